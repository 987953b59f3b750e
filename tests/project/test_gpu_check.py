"""The prepared GPU check (bench/gpu.py) works before a GPU is lent: its CPU dry run writes every
result file, and its row-by-row comparison of two runs flags a difference larger than the certificates."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

#: every test here runs a benchmark's quick mode or its dry run: minutes, so `pytest -m slow`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
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
    assert results["speed"]["ratio"][0]["aggregates_ratio"] > 0  # the analysis with --keep aggregates too
    profile = results["speed"]["profile"]  # one batch under torch.profiler
    assert profile["wall_s"] > 0 and profile["top_host_ops"]
    large = results["large"]  # the large model's part, on a model of its proportions
    assert large["rows"] == 2 * 2 * 8 * 8 and large["not_converged"] == 0 and large["fidelity_passed"]
    assert large["ratio"] > 0 and large["queries"] == "sample:8"
    long = large["long"]  # one longer text under the model's fast attention
    assert long["tokens"] == 256 and long["rows"] == 2 * 8 * 8 and long["not_converged"] == 0
    assert long["fidelity_passed"] and "SDPA attention output" in long["fidelity_check"]
    per_tokens = results["speed"]["solver"]["per_tokens"]  # rows/s per length, the same problems on both
    assert set(per_tokens) == {"16"} and all(per_tokens["16"][k] > 0 for k in ("gpu_rows_per_s", "cpu_rows_per_s"))
    vit = results["vit"]
    assert not vit["failed"] and vit["report_exit_code"] == 0
    assert vit["precision"] == vit["calibration"]["faster"] in ("fp32", "bf16")
    # the quick protocol: toward 4 epochs, patience 1; the stop is the plateau rule's epoch or the cap
    curve, stop = vit["softmax_mean_curve"], vit["stop_epoch"]
    assert vit["stopped_by"] in ("plateau", "max_epochs") and len(curve) >= stop
    if vit["stopped_by"] == "plateau":
        assert max(curve[: stop - 1]) >= curve[stop - 1]  # epoch `stop` did not improve on the best before it
    else:
        assert stop == 4 and all(b > a for a, b in zip(curve, curve[1:4]))
    assert vit["epochs_compared"] == min(vit["results_epochs"].values()) >= stop
    report = json.loads((out / "vit" / "results.json").read_text())
    assert set(report["summary"]) == set(vit["compared"]) >= {"softmax", "ot"}
    assert len(report["summary"]["softmax"]["mean_test_accuracy_per_epoch"]) == vit["epochs_compared"]
    assert report["protocol"]["stopped_by"].startswith("the plateau rule" if vit["stopped_by"] == "plateau"
                                                       else "the cap")
    assert report["paper_distance"]["softmax"]["paper"] == 0.928
    text = (out / "results_gpu.md").read_text()
    assert "A dry run" in text and "bert-base-shape" in text


@pytest.mark.slow
def test_the_comparison_flags_a_row_beyond_its_certificates(dry_run):
    """The same run copied, one row's rel_deviation moved by 1e-6 (far beyond its certified ~1e-9): the
    comparison finds exactly that row over its bound."""
    import gpu_agreement

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
    assert gpu_agreement.compare_runs(run_dir, run_dir)["rows_over_bound"] == 0
    result = gpu_agreement.compare_runs(copy, run_dir)
    assert result["rows_over_bound"] == 1 and result["max_difference_over_bound"] > 1
    assert abs(result["max_difference"] - 1e-6) < 1e-9


@pytest.mark.parametrize("mean, half, verdict", [
    (0.012, 0.004, "confirmed at this budget"),     # the interval lies above 0: OT-ViT better, as the paper reports
    (0.003, 0.010, "not confirmed at this budget"),  # the interval contains 0
    (-0.02, 0.005, "reversed at this budget"),  # the interval lies below 0
    (0.010, None, None),             # one seed: no interval, no verdict
])
def test_the_full_protocol_report_says_whether_the_papers_gap_is_confirmed(mean, half, verdict):
    sys.path.insert(0, str(ROOT / "scripts"))
    import vit_experiment

    said = vit_experiment.paper_gap_verdict({"ot-softmax": {"mean": mean, "ci95_half_width": half}})
    assert (said is None) if verdict is None else said.startswith(verdict + ":")


def test_a_later_call_replaces_the_parts_it_ran():
    """Two calls of the machine (the second reran the OT-ViT part that the first could not run): the merged
    results hold the first call's other parts, the second's vit, and say which call ran what."""
    import gpu

    environment = {"date": "d1", "device_name": "NVIDIA H100 80GB HBM3"}
    first = {"environment": environment, "budget_s": 510, "seconds": 155.0, "tests": {"summary": "5 passed"},
             "agreement": {"runs": []}, "speed": {"ratio": []}, "vit": {"epochs_compared": 0}}
    second = {"environment": dict(environment, date="d2"), "budget_s": 525, "seconds": 437.0,
              "vit": {"epochs_compared": 5}}
    merged = gpu.merge_calls([first, second])
    assert merged["tests"] == first["tests"] and merged["agreement"] == first["agreement"]
    assert merged["vit"] == {"epochs_compared": 5}
    assert [c["parts"] for c in merged["calls"]] == [["tests", "agreement", "speed", "vit"], ["vit"]]
    assert merged["seconds"] == 592.0 and merged["environment"]["date"] == "d1"


def test_a_much_slower_arm_cannot_hold_up_the_papers_comparison(tmp_path, monkeypatch):
    """_launch_all's gate: once every run of the paper's two arms has finished, the others get at most as long
    again and are stopped after that; the fast arms' runs are not stopped."""
    import time
    import types

    import gpu_vit

    seconds = {"softmax": 0.5, "ot": 1.0, "exact": 60.0}
    monkeypatch.setattr(gpu_vit, "_train_command", lambda args, a, s, e, runs: ["sleep", str(seconds[a])])
    start = time.monotonic()
    codes, took = gpu_vit._launch_all(types.SimpleNamespace(), tmp_path, 1, [0], tuple(seconds), lambda line: None,
                                      time.monotonic() + 120, gate=gpu_vit.MAIN_ARMS)
    assert time.monotonic() - start < 30
    assert codes[("softmax", 0)] == 0 and codes[("ot", 0)] == 0 and codes[("exact", 0)] != 0
    assert took[("ot", 0)] < took[("exact", 0)] < 30


@pytest.mark.slow
def test_a_float32_layer_norm_moves_t5s_rows_beyond_the_certificates(tmp_path):
    """The explanation of the T5 rows over their bound on the H100 (bench/gpu_t5_norm.py), on tiny models: on
    one device, computing T5LayerNorm's variance in float64 instead of float32 changes the T5 problems at
    float32's rounding and moves rows beyond what the certificates allow, and leaves BERT's rows alone."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_t5_norm.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["model"]: r for r in json.loads((tmp_path / "results_gpu_t5_norm.json").read_text())["runs"]}
    t5, bert = runs["t5-small-shape"], runs["bert-base-shape"]
    assert 1e-9 < t5["max_relative_evidence_difference"] < 1e-5  # float32 rounding, not a different model
    assert t5["rows_over_bound"] > 0 and t5["max_difference_over_bound"] > 1
    assert bert["max_difference"] == 0.0 and bert["rows_unmatched"] == 0 == t5["rows_unmatched"]


def test_the_vit_report_is_rendered_again_from_its_results(tmp_path):
    """--render-from: the words of the committed full-protocol report again from its results.json, the numbers
    unchanged and the paper's-gap verdict recomputed from its paired differences."""
    source = ROOT / "reports" / "vit" / "results-full.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "vit_experiment.py"), "--render-from", str(source),
                           "--report-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = json.loads(source.read_text()), json.loads((tmp_path / "results.json").read_text())
    assert {k: v for k, v in before.items() if k != "paper_gap"} == {k: v for k, v in after.items() if k != "paper_gap"}
    d = after["paired_differences"]["ot-softmax"]
    low, high = d["mean"] - d["ci95_half_width"], d["mean"] + d["ci95_half_width"]
    expected = "confirmed" if low > 0 else "reversed" if high < 0 else "not confirmed"
    assert after["paper_gap"].startswith(expected + " at this budget:")
    assert (tmp_path / "results.md").read_text() == (ROOT / "reports" / "vit" / "results-full.md").read_text()


@pytest.mark.parametrize("curves, stop", [
    ({("softmax", 0): [0.5, 0.6, 0.7], ("softmax", 1): [0.7, 0.8]}, (None, None)),  # still improving
    ({("softmax", 0): [0.5, 0.7, 0.6], ("softmax", 1): [0.7, 0.9, 0.6]}, (3, "plateau")),  # mean 0.6, 0.8, 0.6
    ({("softmax", 0): [0.1, 0.2, 0.3, 0.4], ("softmax", 1): [0.1, 0.2, 0.3, 0.4, 0.5]}, (4, "max_epochs")),
])
def test_the_main_arms_stop_where_the_seeds_mean_plateaus_or_at_the_cap(curves, stop):
    """The softmax ViT's mean over the seeds, over the epochs every seed has finished; patience 1, cap 4."""
    import gpu_vit

    curve = gpu_vit.softmax_curve(curves, [0, 1])
    assert len(curve) == min(len(c) for c in curves.values())
    assert gpu_vit.stop_epoch(curve, 1, 4) == stop
