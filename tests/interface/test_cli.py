"""`probe run` end to end through the typer app, and the errors users see for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from transformers import AutoConfig, AutoTokenizer
from typer.testing import CliRunner

from probe.cli import app
from probe.core.schema import REQUIRED_COLUMNS

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def only_run_dir(out: Path) -> Path:
    (run_dir,) = list(out.iterdir())
    return run_dir


def expected_rows(model_dir, texts, max_length=128):
    """Rows = sum over examples of tokens x heads x layers, counted here from the tokenizer alone."""
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = sum(len(tokenizer(t, truncation=True, max_length=max_length)["input_ids"]) for t in texts)
    return tokens * config.num_attention_heads * config.num_hidden_layers


def test_run_tiny_bert_end_to_end(tiny_bert_dir, texts_file, tmp_path):
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--batch-size", 2, "--out", out, "--no-progress")
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    assert run_dir.name.startswith(Path(tiny_bert_dir).name + "-")
    table = pq.read_table(run_dir / "deviations.parquet")
    frame = table.to_pandas()
    texts = [line for line in texts_file.read_text().splitlines() if line.strip()]
    assert list(frame.columns) == list(REQUIRED_COLUMNS)
    assert len(frame) == expected_rows(tiny_bert_dir, texts)
    assert frame["converged"].all()
    assert (frame["duality_gap"] >= 0).all() and frame["rel_deviation"].between(0, 10).all()
    parts = sorted(p.name for p in (run_dir / "deviations.parquet").iterdir())
    assert parts == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]  # one per batch
    # rows are unique per (example, layer, head, query) and examples keep their dataset index (line 2 is empty)
    assert not frame.duplicated(["example", "layer", "head", "query"]).any()
    assert sorted(frame["example"].unique()) == [0, 1, 3, 4, 5]
    # n_keys is the example's token count, the same for every query of the example
    assert (frame.groupby("example")["n_keys"].nunique() == 1).all()
    assert (frame.groupby("example")["query"].max() + 1 == frame.groupby("example")["n_keys"].first()).all()

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["attention_implementation"] == "eager"
    assert manifest["fidelity"]["passed"] and manifest["fidelity"]["max_abs_error"] <= 1e-5
    assert manifest["solver"]["rows"] == len(frame) and manifest["solver"]["not_converged"] == 0
    assert manifest["dataset"]["n_examples"] == 5 and manifest["dataset"]["skipped_empty"] == 1
    assert len(manifest["dataset"]["texts_sha256"]) == 64
    for key in ("model", "dtype", "device", "alpha", "parameterisation", "seed", "versions", "timings_s"):
        assert key in manifest
    assert {"load_model_s", "load_data_s", "capture_s", "solve_s", "write_s", "total_s"} <= set(manifest["timings_s"])


def test_alpha_changes_the_problem_but_not_the_model_attention(tiny_bert_dir, texts_file, tmp_path):
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--alpha", 0.25, "--out", out, "--no-progress")
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    assert (frame["alpha"] == 0.25).all() and frame["converged"].all()
    assert json.loads((run_dir / "manifest.json").read_text())["fidelity"]["passed"]


def test_run_real_minilm_embedded_corpus(minilm_dir, tmp_path):
    """The real pretrained model on the embedded default corpus (no --dataset)."""
    out = tmp_path / "runs"
    result = invoke("run", minilm_dir, "--samples", 12, "--max-length", 48, "--out", out, "--no-progress")
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["fidelity"]["max_abs_error"] <= 1e-5
    assert frame["converged"].all()
    assert sorted(frame["layer"].unique()) == list(range(6)) and sorted(frame["head"].unique()) == list(range(12))
    assert frame["example"].nunique() == 12
    assert manifest["dataset"]["description"] == "embedded probe corpus"


def test_interrupted_run_keeps_finished_batches(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    """Ctrl-C in the second batch: exit 130, the first batch's part file, the way to continue."""
    import probe.batch.problems as problems  # where the solver is called

    calls = {"n": 0}
    real = problems.solve_dual

    def failing_solve(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:  # one call per batch (its two layers stacked): fail in the second batch
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(problems, "solve_dual", failing_solve)
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--batch-size", 2, "--out", out, "--no-progress")
    assert result.exit_code == 130, result.output
    run_dir = only_run_dir(out)
    assert f"probe resume {run_dir}" in result.output and "after 1 of 3 batches" in result.output
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and manifest["batches_done"] == 1
    assert manifest["stop_reason"] == "stopped by SIGINT (Ctrl-C)"
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    assert len(frame) == manifest["solver"]["rows"] > 0
    assert frame["example"].nunique() == 2


# ---------------------------------------------------------------------------------------------- errors
# The catalogue of bad inputs to `probe run` is tests/interface/test_bad_inputs.py.


def assert_clean_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def test_column_option_chooses_the_text_column(tiny_bert_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"sentence": "hello there"}\n{"sentence": "general kenobi"}\n')
    ok = invoke("run", tiny_bert_dir, "--dataset", data, "--column", "sentence", "--out", tmp_path / "ok", "--no-progress")
    assert ok.exit_code == 0, ok.output
    frame = pd.read_parquet(only_run_dir(tmp_path / "ok") / "deviations.parquet")
    assert sorted(frame["example"].unique()) == [0, 1]


@pytest.mark.slow
def test_run_with_report_and_report_command(tiny_bert_dir, texts_file, tmp_path):
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--out", out, "--no-progress", "--report")
    assert result.exit_code == 0, result.output
    run_dir = only_run_dir(out)
    for name in ("index.html", "summary.csv", "layers_self.png", "heads_self.png", "overview.png"):
        assert (run_dir / "report" / name).exists(), name
    again = invoke("report", run_dir, "--out", tmp_path / "pdf", "--format", "png,pdf")
    assert again.exit_code == 0, again.output
    assert (tmp_path / "pdf" / "layers_self.pdf").exists()
    assert_clean_error(invoke("report", tmp_path / "nowhere"), "nowhere")


@pytest.mark.slow
def test_threads_option_and_passive_wait_policy(tiny_bert_dir, texts_file, tmp_path):
    """--threads sets torch's threads for the run, and the probe command lets idle OpenMP threads sleep
    (OMP_WAIT_POLICY=PASSIVE unless the environment says otherwise); the manifest records both.  In a
    subprocess: the policy only takes effect before torch starts, and threads are process-wide."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, str(root / "cli.py"), "run", str(tiny_bert_dir), "--dataset", str(texts_file),
         "--threads", "1", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=environment, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((only_run_dir(out) / "manifest.json").read_text())
    (rank,) = manifest["segments"][0]["ranks"]
    assert rank["threads"] == 1
    assert rank["omp_wait_policy"] == "PASSIVE"
    assert manifest["config"]["threads"] == 1
    from probe.solve import native  # the manifest says which code ran the Newton iterations

    assert rank["newton_iterations"] == native.describe("cpu")


def _options_named_by_their_metavar(path: Path):
    """(function, parameter) of every ``typer.Option`` in ``path`` whose metavar is the parameter's name in
    capitals and that does not spell its flag out."""
    import ast

    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef):
            continue
        arguments = function.args.args + function.args.kwonlyargs
        defaults = [None] * (len(function.args.args) - len(function.args.defaults)) + function.args.defaults
        defaults += function.args.kw_defaults
        for argument, default in zip(arguments, defaults):
            if not (isinstance(default, ast.Call) and getattr(default.func, "attr", None) == "Option"):
                continue
            metavar = next((k.value.value for k in default.keywords if k.arg == "metavar"), None)
            flags = [a.value for a in default.args[1:] if isinstance(a, ast.Constant)]
            if metavar == argument.arg.upper() and not flags:
                found.append((function.name, argument.arg))
    return found


def test_an_option_whose_metavar_is_its_name_spells_its_flag_out():
    """With typer 0.27 and click 8.5 (the GPU machine's image), an option declared without its flag and with
    its own name in capitals as the metavar became ``--DEVICE`` (``probe run --device cuda``: "No such option";
    seen on the lent H100).  Every such option names its flag."""
    import probe

    root = Path(probe.__file__).parent
    assert _options_named_by_their_metavar(root / "cli.py") == []
    assert _options_named_by_their_metavar(root / "vit" / "cli.py") == []


def test_every_option_answers_to_its_lowercase_flag():
    """The commands as click sees them (with whatever typer and click are installed): each option of ``probe
    run`` and ``probe vit train`` answers to ``--`` and its name with dashes."""
    import click
    import typer

    from probe.cli import app

    group = typer.main.get_command(app)
    commands = [group.get_command(click.Context(group), "run")]
    vit = group.get_command(click.Context(group), "vit")
    commands.append(vit.get_command(click.Context(vit), "train"))
    for command in commands:
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                flag = "--" + param.name.replace("_", "-")
                assert flag in param.opts or any(flag in o for o in param.secondary_opts + param.opts), \
                    (command.name, param.name, param.opts)
