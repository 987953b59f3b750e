#!/usr/bin/env bash
# Prepare, here, what one call of a lent GPU machine needs and that machine lacks (bench/gpu.py).
#
# The lent machine has no network, torch and most of probe's dependencies, but a transformers older than
# probe's floor, no `datasets` (probe reads every text file through it) and no Fashion-MNIST. A call carries
# at most 64 MiB: the working tree (tracked and untracked-not-ignored files) plus the carried folder. So this
# writes, into .gpu/ (git-ignored):
#   site.tar.xz               the contents of the wheels of transformers (probe's floor or later), of datasets
#                             with the two packages it needs that the image lacks (dill, multiprocess), and of
#                             datasketches (the quantile sketches of --keep aggregates), at the versions installed
#                             here: ~5 MB as xz
#   fashion-mnist/*.xz        the four idx files, xz-compressed (26 MB; the .gz originals are 31 MB)
# and checks that the tree and .gpu/ together fit. Then one device call:
#   carry [".gpu"], command "bash scripts/gpu_check.sh", timeout_s 560.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DATA=${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
# the image's packages, as the device README lists them, lack these; each at the version installed here
WHEELS=$($PYTHON -c "from importlib.metadata import version as v; print(' '.join(f'{p}=={v(p)}' for p in ('transformers', 'datasets', 'dill', 'multiprocess', 'datasketches')))")
mkdir -p .gpu/fashion-mnist
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f .gpu/site.tar.xz ] || [ "$(cat .gpu/site.version 2>/dev/null)" != "$WHEELS" ]; then
  $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$work/wheels" $WHEELS
  mkdir -p "$work/site"
  for wheel in "$work"/wheels/*.whl; do (cd "$work/site" && $PYTHON -m zipfile -e "$wheel" .); done
  tar -C "$work/site" -cf - . | xz -9 -T2 > .gpu/site.tar.xz
  echo "$WHEELS" > .gpu/site.version
fi
for name in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  if [ ! -f ".gpu/fashion-mnist/$name.xz" ]; then
    [ -f "$DATA/$name.gz" ] || { echo "Error: $DATA/$name.gz is missing: apt install dataset-fashion-mnist, or set FASHION_MNIST_DIR." >&2; exit 2; }
    gzip -dc "$DATA/$name.gz" | xz -9 -T2 > ".gpu/fashion-mnist/$name.xz"
  fi
done
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
carried=$(du -sb .gpu | cut -f1)
total=$((tree + carried))
printf 'working tree %.1f MiB + .gpu %.1f MiB = %.1f MiB of the 64 MiB a call carries\n' \
  "$(echo "$tree / 1048576" | bc -l)" "$(echo "$carried / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt $((64 * 1048576)) ]; then
  echo "Error: too large for one call: leave some untracked files out of the tree, or carry less." >&2
  exit 1
fi
