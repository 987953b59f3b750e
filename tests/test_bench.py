"""The benchmark script runs (in its --quick mode) and every baseline reaches probe's answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_quick_mode(tmp_path):
    out = tmp_path / "results.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "solver.py"), "--quick", "--device", "cpu", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, timeout=300,
    )
    results = json.loads(out.read_text())
    assert [f["family"] for f in results["families"]] == ["minilm", "random-16", "random-64", "illcond-64"]
    for family in results["families"]:
        assert family["probe_converged_fraction"] == 1.0
        for method in ("cvxpy", "lbfgs", "ascent", "ascent_reduced"):
            assert family[f"{method}_max_abs_diff_rel_deviation"] < 1e-6, (family["family"], method)
    assert out.with_suffix(".md").exists()
