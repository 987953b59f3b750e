"""Runs that can be checked after the fact: every part file recorded in the manifest (name, bytes, rows,
SHA-256), every reader refusing a damaged run by name (or reading what is left under a banner, never a
silent subset), and `probe resume` moving damaged parts to the quarantine folder and recomputing them
until the run equals an uninterrupted one bitwise."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli import app
from probe.store import export, integrity, storage

from ..support.runs import flip_a_byte, invoke_with_one_thread, part


@pytest.fixture
def run_copy(clean_run, tmp_path) -> Path:
    return Path(shutil.copytree(clean_run, tmp_path / clean_run.name))


def manifest_of(run_dir: Path) -> dict:
    return json.loads((run_dir / storage.MANIFEST).read_text())


def assert_records_match(run_dir: Path, batches: int = 6):
    """Name, size, rows and SHA-256 of each part, computed here independently (hashlib over the bytes,
    pyarrow's full read for the rows)."""
    manifest = manifest_of(run_dir)
    records = manifest["parts"]
    assert [r["batch"] for r in records] == list(range(batches))
    for record in records:
        path = part(run_dir, record["batch"])
        assert record["file"] == path.name
        assert record["bytes"] == len(path.read_bytes())
        assert record["rows"] == pq.read_table(path).num_rows > 0
        assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sum(r["rows"] for r in records) == manifest["solver"]["rows"]


def test_the_manifest_records_every_part(clean_run):
    manifest = manifest_of(clean_run)
    assert manifest["status"] == "complete" and manifest["batches_total"] == 6
    assert_records_match(clean_run)


def delete(path: Path):
    path.unlink()


def truncate(path: Path):
    path.write_bytes(path.read_bytes()[:-100])


def other_batch(path: Path):
    """Another batch's whole part under this name (a mixed-up copy)."""
    shutil.copy(path.with_name("part-000000.parquet"), path)


DAMAGES = [
    (delete, "missing", True),
    (truncate, r"[\d,]+ bytes, recorded [\d,]+", True),
    (other_batch, r"[\d,]+ (bytes|rows), recorded [\d,]+", True),
    (flip_a_byte, "SHA-256", False),  # not seen by status's cheap check; every reader's checksums see it
]


@pytest.mark.slow
@pytest.mark.parametrize("damage,why,cheap", DAMAGES, ids=[d[0].__name__ for d in DAMAGES])
def test_a_damaged_run_is_refused_by_name_then_repaired_bitwise(clean_run, run_copy, tmp_path, damage, why, cheap):
    reference = pd.read_parquet(clean_run / storage.PARTS)
    export.read_deviations(run_copy)  # read once intact in this process: a changed file is still hashed again
    damage(part(run_copy, 3))

    status = CliRunner().invoke(app, ["status", str(run_copy)])
    assert status.exit_code == 0, status.output
    if cheap:
        assert re.search(rf"damaged: batch 3 \({why}", status.output), status.output
        assert f"repair with: probe resume {run_copy}" in status.output
    else:
        assert "damaged:" not in status.output, status.output
    if True:  # every reader refuses it by name
        for command in (["report", str(run_copy), "--out", str(tmp_path / "report")],
                        ["export", str(run_copy), "--to", str(tmp_path / "all.parquet")],
                        ["compare", str(clean_run), str(run_copy), "--out", str(tmp_path / "compare")]):
            refused = CliRunner().invoke(app, command)
            assert refused.exit_code == 2 and "Traceback" not in refused.output, (command, refused.output)
            assert re.search(rf"is damaged: batch 3 \({why}", refused.output) and "probe resume" in refused.output
            assert "--allow-damaged" in refused.output and "probe verify" in refused.output
        import probe

        for read in (lambda: probe.load(run_copy).rows, lambda: probe.Run(run_copy).select(layer=0),
                     lambda: probe.Run(run_copy).sql("SELECT count(*) FROM rows").fetchall(),
                     lambda: probe.Run(run_copy).headline()):
            with pytest.raises(integrity.DamagedRunError, match="is damaged: batch 3"):
                read()
        with pytest.raises(integrity.DamagedRunError, match="batch 3"):
            export.read_deviations(run_copy)
        assert not (tmp_path / "report").exists() and not (tmp_path / "all.parquet").exists()

        # read anyway: the intact parts only, under a banner (said once: not also as a Python warning, which
        # a terminal would show beside it), and the exported file says so too
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            allowed = CliRunner().invoke(app, ["export", str(run_copy), "--to", str(tmp_path / "some.parquet"),
                                               "--allow-damaged"])
            reported = CliRunner().invoke(app, ["report", str(run_copy), "--out", str(tmp_path / "some-report"),
                                                "--allow-damaged"])
        assert allowed.exit_code == 0 and "DAMAGED RUN" in allowed.output and "5 of 6 batches" in allowed.output
        assert reported.exit_code == 0 and reported.output.count("5 of 6 batches") == 1, reported.output
        assert not [w for w in warned if issubclass(w.category, integrity.DamagedRunWarning)]
        with pytest.warns(integrity.DamagedRunWarning, match="5 of 6 batches"):  # the API's readers do warn
            export.read_deviations(run_copy, allow_damaged=True)
        some = pq.read_table(tmp_path / "some.parquet")
        assert b"probe.damaged" in some.schema.metadata
        expected = reference[~reference["example"].isin(pd.read_parquet(part(clean_run, 3))["example"].unique())]
        assert some.num_rows == len(expected) < len(reference)

    repaired = invoke_with_one_thread("resume", run_copy, "--no-progress")
    assert repaired.exit_code == 0, repaired.output
    assert "is damaged: batch 3" in repaired.output, repaired.output
    quarantined = [p.name for p in (run_copy / storage.QUARANTINE).rglob("*.parquet")]
    assert quarantined == ([] if damage is delete else ["part-000003.parquet"])  # nothing is deleted
    final = pd.read_parquet(run_copy / storage.PARTS)
    pd.testing.assert_frame_equal(final, reference, check_exact=True)  # same rows, order and bits
    manifest = manifest_of(run_copy)
    assert manifest["status"] == "complete" and manifest["solver"]["rows"] == len(reference)
    assert_records_match(run_copy)
    assert re.match(why, manifest["repairs"][0]["batches"]["3"])
    assert [s["batches"] for s in manifest["segments"]] == [5, 1]  # batch 3 recomputed by the new segment
    again = CliRunner().invoke(app, ["resume", str(run_copy)])
    assert again.exit_code == 0 and "nothing to resume" in again.output, again.output
    assert "damaged:" not in CliRunner().invoke(app, ["status", str(run_copy)]).output


def unrecord(run_dir: Path, batch: int) -> None:
    """As a kill between a part's rename and the manifest's next write leaves the run."""
    manifest = manifest_of(run_dir)
    manifest["parts"] = [r for r in manifest["parts"] if r["batch"] != batch]
    manifest.update(status="interrupted", stop_reason="killed")
    storage.write_manifest(run_dir, manifest)


def test_a_part_finished_after_the_last_manifest_write_is_read_and_recorded(clean_run, run_copy):
    """Present but unrecorded: whole by construction, so readers take it after its footer checks and
    resume records it without recomputing it."""
    unrecord(run_copy, 5)
    before = part(run_copy, 5).stat()
    check = integrity.check_parts(run_copy)
    assert check.ok and check.unrecorded == [5] and len(check.readable) == 6
    status = CliRunner().invoke(app, ["status", str(run_copy)])
    assert "unrecorded: 1 part(s)" in status.output and "damaged:" not in status.output, status.output
    assert export.read_deviations(run_copy).num_rows == pq.read_table(clean_run / storage.PARTS).num_rows

    result = invoke_with_one_thread("resume", run_copy, "--no-progress")
    assert result.exit_code == 0, result.output
    assert part(run_copy, 5).stat().st_ino == before.st_ino  # kept, not rewritten
    assert manifest_of(run_copy)["parts"] == manifest_of(clean_run)["parts"]  # the same files
    assert not (run_copy / storage.QUARANTINE).exists()


def test_an_unrecorded_part_with_a_bad_footer_is_quarantined_and_redone(clean_run, run_copy):
    unrecord(run_copy, 5)
    truncate(part(run_copy, 5))
    check = integrity.check_parts(run_copy)
    assert list(check.damaged) == [5] and "unreadable footer" in check.damaged[5]
    result = invoke_with_one_thread("resume", run_copy, "--no-progress")
    assert result.exit_code == 0, result.output
    pd.testing.assert_frame_equal(pd.read_parquet(run_copy / storage.PARTS),
                                  pd.read_parquet(clean_run / storage.PARTS), check_exact=True)
    assert_records_match(run_copy)
    assert len(list((run_copy / storage.QUARANTINE).rglob("part-000005.parquet"))) == 1


def test_a_complete_run_missing_a_part_it_never_recorded_is_damaged(run_copy):
    """A run written before part records existed: a complete run must still have every batch."""
    manifest = manifest_of(run_copy)
    storage.write_manifest(run_copy, {key: value for key, value in manifest.items() if key != "parts"})
    part(run_copy, 2).unlink()
    check = integrity.check_parts(run_copy)
    assert check.damaged == {2: "missing, never recorded"} and sorted(check.unrecorded) == [0, 1, 3, 4, 5]


def test_the_docs_soak_table_is_the_results_files():
    """docs/integrity.md shows bench/results_soak.md's table as it is (a rerun not carried over fails)."""
    root = Path(__file__).resolve().parents[2]

    def table(text):
        return [line for line in text.splitlines() if line.startswith("| ") and ("per batch" in line or
                "resident set" in line or "writing the part" in line or line.startswith("| quantity"))]

    in_results = table((root / "bench" / "results_soak.md").read_text())
    assert len(in_results) == 5
    docs = (root / "docs" / "integrity.md").read_text()
    assert table(docs[docs.index("## Long runs stay flat"):]) == in_results


@pytest.mark.slow
def test_the_soak_benchmark_quick_mode(tmp_path):
    """bench/soak.py end to end on 60 texts: its results files, a part record per batch in the manifest."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, str(root / "bench" / "soak.py"), "--repeats", "1", "--texts", "60",
                           "--blocks", "5", "--out", str(out)], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["batches"] == 60 and result["checks"]["parts"] == 60
    assert result["manifest"]["bytes_without_records"] < result["manifest"]["bytes_at_end"]
    assert result["rss_mb"]["slope_mb_per_1000_batches"]["blocks"] == 5
    assert "| resident set (MB) |" in out.with_suffix(".md").read_text()


def test_an_unreadable_part_is_named_not_a_traceback(run_copy, monkeypatch):
    """A part that cannot be opened (permissions, an I/O error) is damaged by name, like any other."""
    real = storage.file_sha256

    def eio(path):
        if Path(path).name == "part-000004.parquet":
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(integrity, "file_sha256", eio)
    check = integrity.check_parts(run_copy, checksums=True)
    assert check.damaged == {4: "unreadable: Input/output error"}
