#!/usr/bin/env bash
# The one command of a lent GPU machine's call: unpack what scripts/gpu_prepare.sh put in .gpu/,
# then run bench/gpu.py on CUDA into $OUT (the folder that comes back). Everything bench/gpu.py measures is
# written as it goes, so a call cut short still brings back what finished.
#   GPU_BUDGET_S   seconds for the whole command (default 530: inside a 560 s call, with the copy back)
#   GPU_DEVICE     the device (default cuda; cpu with GPU_QUICK=1 is the dry run of this script here)
#   GPU_SKIP       parts to leave out (bench/gpu.py --skip: tests,agreement,speed,large,vit), for a second call
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
OUT=${OUT:-${1:-/tmp/probe-gpu-out}}
mkdir -p "$OUT" /tmp/probe-site /tmp/fashion-mnist
tar -xJf .gpu/site.tar.xz -C /tmp/probe-site || exit 3
for f in .gpu/fashion-mnist/*.xz; do xz -dc "$f" > "/tmp/fashion-mnist/$(basename "$f" .xz)" & done
wait
export PYTHONPATH=/tmp/probe-site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch, transformers, datasets, pyarrow, fsspec; print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__, 'fsspec', fsspec.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
  | tee "$OUT/console.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$OUT/console.txt" 2>&1 || true
budget=$(( ${GPU_BUDGET_S:-530} - ($(date +%s) - start) - 20 ))
python3 bench/gpu.py --out "$OUT" --data-dir /tmp/fashion-mnist --budget-s "$budget" --device "${GPU_DEVICE:-cuda}" \
  ${GPU_QUICK:+--quick} ${GPU_SKIP:+--skip "$GPU_SKIP"} 2>&1 | tee -a "$OUT/console.txt"
