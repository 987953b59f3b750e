"""bench/ as one harness: every results file in the one format and its markdown what its benchmark renders
from it, every benchmark a module of at most 400 lines, and every table the documentation quotes from a
results file what that file renders (bench/quotes.py)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

RESULTS = sorted(BENCH.glob("results_*.json")) + [BENCH / "determinism.json"]


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda path: path.name)
def test_every_benchmark_module_is_short(path):
    assert len(path.read_text().splitlines()) <= 400, path.name


@pytest.mark.parametrize("path", RESULTS, ids=lambda path: path.name)
def test_every_results_file_is_in_the_one_format(path):
    results = json.loads(path.read_text())
    assert isinstance(results, dict) and {"benchmark", "environment"} <= set(results), path.name
    assert (BENCH / f"{results['benchmark']}.py").exists(), results["benchmark"]
    assert path.with_suffix(".md").exists()


#: results files whose markdown takes more than the results (the GPU figures beside them)
RENDERED_WITH_MORE = {"results_gpu_t5_norm.json"}


@pytest.mark.parametrize("path", [p for p in RESULTS if p.name not in RENDERED_WITH_MORE], ids=lambda path: path.name)
def test_every_results_markdown_is_what_its_benchmark_renders(path):
    results = json.loads(path.read_text())
    module = importlib.import_module(results["benchmark"])
    assert module.markdown(results) == path.with_suffix(".md").read_text(), (
        f"run `python bench/{results['benchmark']}.py --render {path.relative_to(ROOT)}`")


def test_every_quote_in_the_docs_is_its_results_files():
    import quotes

    for name, (page, _) in quotes.QUOTES.items():
        assert importlib.import_module("common").marked(page, name) is not None, f"{page.name} lacks {name}"
    assert quotes.stale() == [], "run `python bench/quotes.py`"
