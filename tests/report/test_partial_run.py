"""The report of a run that is still being written, or was stopped: the command line says so and what it
covers, and the page's subtitle counts the texts its rows hold, not the run's planned total."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app
from probe.store import storage

from ..support.runs import finished_run

#: 12 texts of the embedded corpus in 6 batches of 2
RUN_ARGS = ["--samples", "12", "--batch-size", "2", "--max-length", "16", "--no-progress"]


@pytest.fixture(scope="module")
def complete_run(tiny_bert_dir, tmp_path_factory) -> Path:
    return finished_run(tiny_bert_dir, tmp_path_factory.mktemp("partial"), *RUN_ARGS)


def cut_short(run_dir: Path, keep: int, status: str, process: dict | None = None) -> None:
    """As a run stopped (or still going) after its first ``keep`` batches leaves it."""
    manifest = json.loads((run_dir / storage.MANIFEST).read_text())
    for batch, path in storage.part_files(run_dir).items():
        if batch >= keep:
            path.unlink()
    manifest["parts"] = [r for r in manifest["parts"] if r["batch"] < keep]
    manifest.update(status=status, batches_done=keep)
    if process is not None:
        manifest["process"] = process
    storage.write_manifest(run_dir, manifest)


@pytest.mark.parametrize("status", ["interrupted", "running"])
def test_the_report_of_an_unfinished_run_says_what_it_covers(complete_run, tmp_path, status):
    run_dir = Path(shutil.copytree(complete_run, tmp_path / complete_run.name))
    process = storage.heartbeat(storage.process_identity(), 3600) if status == "running" else None  # alive: us
    cut_short(run_dir, 2, status, process)
    covered = pd.read_parquet(run_dir / storage.PARTS)["example"].nunique()  # the texts the kept parts hold
    assert 0 < covered < 12

    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    said = "is still being written" if status == "running" else "is interrupted"
    assert f"the run {said}: the report covers the 2 of 6 batches" in result.output, result.output
    assert ("probe resume" in result.output) == (status == "interrupted")
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["dataset"].endswith(f", {covered:,} of 12 texts"), summary["dataset"]
    page = (tmp_path / "report" / "index.html").read_text()
    assert f"{covered:,} of 12 texts" in page and ", 12 texts" not in page


def test_the_report_of_a_complete_run_counts_every_text(complete_run, tmp_path):
    result = CliRunner().invoke(app, ["report", str(complete_run), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0 and "the report covers" not in result.output, result.output
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["dataset"].endswith(", 12 texts")
