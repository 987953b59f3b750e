"""The prepared GPU check (bench/gpu.py, issue 32) works before a GPU is lent: its CPU dry run writes every
result file, and its row-by-row comparison of two runs flags a difference larger than the certificates."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-out")
    work = tmp_path_factory.mktemp("gpu-work")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--quick", "--out", str(out),
         "--workdir", str(work), "--skip", "tests"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, work


@pytest.mark.slow
def test_the_cpu_dry_run_writes_every_result(dry_run):
    out, _ = dry_run
    results = json.loads((out / "results_gpu.json").read_text())
    assert results["quick"] and results["environment"]["device"] == "cpu"
    runs = results["agreement"]["runs"]
    assert {r["model"] for r in runs} == {"bert-base-shape", "t5-small-shape"}
    for r in runs:  # two CPU runs of the same settings: the same rows, bitwise
        assert r["rows"] > 0 and r["rows_unmatched"] == 0 and r["max_difference"] == 0.0
    assert results["agreement"]["same_problems"]["rows_over_bound"] == 0
    assert results["speed"]["ratio"][0]["rows"] > 0 and results["speed"]["solver"]["rows"] > 0
    vit = results["vit"]
    assert not vit["failed"] and vit["epochs_compared"] == 1 and vit["report_exit_code"] == 0
    report = json.loads((out / "vit" / "results.json").read_text())
    assert set(report["summary"]) == set(vit["attentions"]) and "softmax" in vit["attentions"]
    text = (out / "results_gpu.md").read_text()
    assert "A dry run" in text and "bert-base-shape" in text


@pytest.mark.slow
def test_the_comparison_flags_a_row_beyond_its_certificates(dry_run):
    """The same run copied, one row's rel_deviation moved by 1e-6 (far beyond its certified ~1e-9): the
    comparison finds exactly that row over its bound."""
    import gpu

    _, work = dry_run
    run_dir = next(p.parent for p in (work / "agreement").glob("*/manifest.json"))
    copy = work / "tampered"
    shutil.copytree(run_dir, copy)
    part = sorted((copy / "deviations.parquet").glob("part-*.parquet"))[0]
    table = pq.read_table(part)
    values = table.column("rel_deviation").to_pylist()
    index = next(i for i, v in enumerate(values) if v and v > 0)
    values[index] += 1e-6
    table = table.set_column(table.schema.get_field_index("rel_deviation"), "rel_deviation",
                             __import__("pyarrow").array(values, type=table.schema.field("rel_deviation").type))
    pq.write_table(table, part)
    assert gpu.compare_runs(run_dir, run_dir)["rows_over_bound"] == 0
    result = gpu.compare_runs(copy, run_dir)
    assert result["rows_over_bound"] == 1 and result["max_difference_over_bound"] > 1
    assert abs(result["max_difference"] - 1e-6) < 1e-9


@pytest.mark.parametrize("mean, half, verdict", [
    (0.012, 0.004, "confirmed"),     # the interval lies above 0: OT-ViT better, as the paper reports
    (0.003, 0.010, "not confirmed"),  # the interval contains 0
    (-0.02, 0.005, "contradicted"),  # the interval lies below 0
    (0.010, None, None),             # one seed: no interval, no verdict
])
def test_the_full_protocol_report_says_whether_the_papers_gap_is_confirmed(mean, half, verdict):
    sys.path.insert(0, str(ROOT / "scripts"))
    import vit_experiment

    said = vit_experiment.paper_gap_verdict({"ot-softmax": {"mean": mean, "ci95_half_width": half}})
    assert (said is None) if verdict is None else said.startswith(verdict + ":")
