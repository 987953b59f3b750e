"""I/O errors during a run (a full disk, a read-only or vanished run directory, lost permissions): one
paragraph that says what happened, what is safe and how to continue, exit status 74, no temporary file
left, every finished batch kept, and `probe resume` (once the cause is fixed) finishing the run equal to
an uninterrupted one bitwise.  Simulated by an OSError injected into the write path, and for real on a
small tmpfs where this machine lets us mount one."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cli import app
from probe.core.errors import EXIT_IO_ERROR
from probe.store import integrity, storage

from ..support.runs import SMALL_RUN_ARGS, finish, invoke_with_one_thread, probe_process


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp-" in p.name]


def failing_writes(monkeypatch, *, after: int, error: OSError | None = None, vanish: bool = False,
                   manifest_too: bool = False):
    """From the ``after``-th part file on, writes fail half-way through (the temporary file exists, holds
    some bytes, then the OSError comes); ``manifest_too``: manifest writes fail from then on as well (a
    disk that stays full); ``vanish``: the run directory is deleted instead, so the write finds no
    directory."""
    real = storage.replace_atomically
    state = {"parts": 0, "failing": after < 0}  # after < 0: from the first write on (the manifest)

    def replace(path: Path, write):
        is_part = path.parent.name == storage.PARTS
        if is_part:
            state["parts"] += 1
            state["failing"] = state["failing"] or state["parts"] > after
        if state["failing"] and vanish and is_part:
            shutil.rmtree(path.parents[1])
            return real(path, write)
        if state["failing"] and (is_part or manifest_too):
            def half_then_fail(handle):
                handle.write(b"PAR1" + b"\0" * 1000)
                raise error
            return real(path, half_then_fail)
        return real(path, write)

    monkeypatch.setattr(storage, "replace_atomically", replace)


def assert_one_paragraph(result, *fragments):
    assert result.exit_code == EXIT_IO_ERROR == 74, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    (message,) = [line for line in result.output.splitlines() if line.startswith("Error:")]  # one paragraph
    assert message.startswith("Error: Writing the run failed"), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


ERRORS = [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    OSError(errno.EROFS, os.strerror(errno.EROFS)),
    PermissionError(errno.EACCES, os.strerror(errno.EACCES)),
]


@pytest.mark.parametrize("error", ERRORS, ids=["ENOSPC", "EROFS", "EACCES"])
def test_an_io_error_in_a_part_write_is_one_paragraph_and_resumes_bitwise(clean_run, tiny_bert_dir, tmp_path,
                                                                          monkeypatch, error):
    out = tmp_path / "runs"
    with monkeypatch.context() as patch:
        failing_writes(patch, after=2, error=error)
        result = invoke_with_one_thread("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", out)
    (run_dir,) = out.iterdir()
    assert_one_paragraph(result, error.strerror, errno.errorcode[error.errno], "the 2 batch(es) finished before it",
                         "the manifest records the stop", f"then continue with: probe resume {run_dir}")
    assert not temporaries(out)  # the half-written part was removed
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "interrupted" and errno.errorcode[error.errno] in manifest["stop_reason"] or \
        error.strerror in manifest["stop_reason"]
    check = integrity.check_parts(run_dir)
    assert check.ok and sorted(check.readable) == [0, 1] and not check.unrecorded

    resumed = invoke_with_one_thread("resume", run_dir, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / storage.PARTS),
                                  pd.read_parquet(clean_run / storage.PARTS), check_exact=True)


def test_a_disk_that_stays_full_loses_the_manifest_write_but_no_batch(clean_run, tiny_bert_dir, tmp_path, monkeypatch):
    out = tmp_path / "runs"
    with monkeypatch.context() as patch:
        failing_writes(patch, after=3, error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), manifest_too=True)
        result = invoke_with_one_thread("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", out)
    (run_dir,) = out.iterdir()
    assert_one_paragraph(result, "No space left on device", "the 3 batch(es) finished before it",
                         "the manifest could not be updated", "probe resume")
    assert not temporaries(out)
    check = integrity.check_parts(run_dir)  # the manifest lags: its records miss the last parts, which read fine
    assert check.ok and sorted(check.readable) == [0, 1, 2]
    # this test's process wrote the run and is alive: say it stopped, as a reader would once it exits
    manifest = json.loads((run_dir / storage.MANIFEST).read_text())
    storage.write_manifest(run_dir, {**manifest, "status": "interrupted"})
    resumed = invoke_with_one_thread("resume", run_dir, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / storage.PARTS),
                                  pd.read_parquet(clean_run / storage.PARTS), check_exact=True)


def test_a_vanished_run_directory_is_said_plainly(tiny_bert_dir, tmp_path, monkeypatch):
    out = tmp_path / "runs"
    with monkeypatch.context() as patch:
        failing_writes(patch, after=2, vanish=True)
        result = invoke_with_one_thread("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", out)
    assert_one_paragraph(result, "No such file or directory", "no longer exists", "probe run")
    assert list(out.iterdir()) == []


def test_resume_in_a_read_only_directory_is_refused_before_loading(clean_run, tmp_path, monkeypatch):
    run_dir = Path(shutil.copytree(clean_run, tmp_path / "run"))
    manifest = json.loads((run_dir / storage.MANIFEST).read_text())
    storage.write_manifest(run_dir, {**manifest, "status": "interrupted"})
    real_open = open

    def read_only_open(file, mode="r", *args, **kwargs):
        if str(file).endswith(storage.LOCK) and "a" in mode:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", read_only_open)
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 74 and "Read-only file system" in result.output and "not writable" in result.output, \
        result.output


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 96 KiB tmpfs (room for the manifest and two or three of the tiny model's parts), where the
    machine lets this process mount one (root in a container that allows it); skipped elsewhere."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and a container that allows mounts)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_real_full_disk(clean_run, tiny_bert_dir, small_tmpfs):
    """A real `probe run` process on a 96 KiB tmpfs fills it: exit 74 with the paragraph, no temporary
    file; after the file system grows, `probe resume` completes the run, bitwise equal to a clean one."""
    out = small_tmpfs / "runs"
    code, output = finish(probe_process("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", out))
    assert code == 74, output
    assert "No space left on device (ENOSPC)" in output and "Traceback" not in output, output
    (run_dir,) = out.iterdir()
    assert f"continue with: probe resume {run_dir}" in output, output
    assert not temporaries(out)
    assert integrity.check_parts(run_dir).ok
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_tmpfs)], check=True)
    resumed = invoke_with_one_thread("resume", run_dir, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / storage.PARTS),
                                  pd.read_parquet(clean_run / storage.PARTS), check_exact=True)


def test_an_oserror_that_is_not_the_run_directory_is_not_called_a_disk_error(tiny_bert_dir, tmp_path, monkeypatch):
    """An OSError from elsewhere (here a library's 'too many open files' while solving) is not reported as
    a failed write of the run: it propagates as it is."""
    import probe.batch.problems as problems  # where the solver is called

    def no_more_files(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "/some/library/file")

    monkeypatch.setattr(problems, "solve_dual", no_more_files)
    result = invoke_with_one_thread("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", tmp_path / "runs")
    assert result.exit_code != 74 and isinstance(result.exception, OSError), result.output
    assert result.exception.errno == errno.EMFILE


def test_a_disk_full_before_the_first_manifest_says_start_again(tiny_bert_dir, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        failing_writes(patch, after=-1, error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), manifest_too=True)
        result = invoke_with_one_thread("run", tiny_bert_dir, *SMALL_RUN_ARGS, "--out", tmp_path / "runs")
    assert_one_paragraph(result, "before its first batch", "start again with `probe run`")
    assert "probe resume" not in result.output
    assert not temporaries(tmp_path)
