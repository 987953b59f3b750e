"""The run directory's format: a new run records ``format_version``; a manifest without it is version 1,
which every reader takes and resume keeps; a newer or nonsensical one is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import probe
from probe.cli import app
from probe.core.errors import ProbeError
from probe.store import storage


@pytest.fixture(scope="module")
def finished_run(tiny_bert_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("format") / "runs"
    result = CliRunner().invoke(app, ["run", str(tiny_bert_dir), "--samples", "4", "--batch-size", "2",
                                      "--max-length", "16", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def edited_copy(run_dir: Path, where: Path, edit) -> Path:
    """A copy of ``run_dir`` whose manifest is ``edit(manifest)``."""
    copy = Path(shutil.copytree(run_dir, where / run_dir.name))
    manifest = json.loads((copy / storage.MANIFEST).read_text())
    (copy / storage.MANIFEST).write_text(json.dumps(edit(manifest)))
    return copy


def without_version(manifest: dict) -> dict:
    return {key: value for key, value in manifest.items() if key != "format_version"}


def test_a_new_run_records_the_format_it_is_written_in(finished_run):
    manifest = json.loads((finished_run / storage.MANIFEST).read_text())
    assert manifest["format_version"] == storage.FORMAT_VERSION == 3
    assert storage.format_version(storage.read_manifest(finished_run)) == 3


def test_a_run_without_a_version_is_version_1_and_reads_the_same(finished_run, tmp_path):
    old = edited_copy(finished_run, tmp_path, without_version)
    assert storage.format_version(storage.read_manifest(old)) == 1
    pd.testing.assert_frame_equal(probe.load(old).rows, probe.load(finished_run).rows, check_exact=True)


def test_resume_keeps_a_runs_version(finished_run, tmp_path):
    """A version-1 run missing a batch is finished as version 1 (its other parts are version 1's)."""

    def stopped_version_1(manifest):
        return {**without_version(manifest), "status": "interrupted"}

    old = edited_copy(finished_run, tmp_path, stopped_version_1)
    (old / storage.PARTS / "part-000001.parquet").unlink()
    result = CliRunner().invoke(app, ["resume", str(old), "--no-progress"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((old / storage.MANIFEST).read_text())
    assert manifest["status"] == "complete" and "format_version" not in manifest
    pd.testing.assert_frame_equal(probe.load(old).rows, probe.load(finished_run).rows, check_exact=True)


@pytest.mark.parametrize("version, message", [
    (4, "records run format 4, newer than this probe"),
    ("2", "is not a run format"),
    (0, "is not a run format"),
    (True, "is not a run format"),
])
def test_a_format_this_probe_does_not_read_is_refused(finished_run, tmp_path, version, message):
    run_dir = edited_copy(finished_run, tmp_path, lambda manifest: {**manifest, "format_version": version})
    for read in (lambda: probe.load(run_dir).rows, lambda: storage.read_manifest(run_dir)):
        with pytest.raises(ProbeError, match=message):
            read()
