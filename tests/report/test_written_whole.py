"""A report and a comparison are written whole or not at all: stopped at any moment (SIGINT sent to a real
``probe report`` at several stages of its build, an error half-way), their folder holds the previous report or
none, never a part of one; Ctrl-C exits 130 with one line, and a reader that closes the pipe (``| head``) is
no error.

The folder is written into a hidden folder beside its destination and moved into place when complete
(:func:`probe.core.destination.written_whole`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from probe.core.destination import check_replaceable, written_whole
from probe.core.errors import ProbeError
from probe.report import build_report

from ..support.synthetic_runs import deviation_rows, manifest_for, write_run

ROOT = Path(__file__).resolve().parents[2]


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by its relative path, with its SHA-256 (empty when there is no folder)."""
    if not folder.exists():
        return {}
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def leftovers(parent: Path) -> list[str]:
    """Hidden folders a stopped write would leave beside its destination."""
    return sorted(path.name for path in parent.iterdir() if path.name.startswith("."))


# --------------------------------------------------------------------------------------------------
# the folder, without a process


def test_an_error_half_way_leaves_the_previous_folder(tmp_path):
    destination = tmp_path / "report"
    with written_whole(destination) as folder:
        (folder / "summary.json").write_text("first")
    before = contents(destination)
    with pytest.raises(RuntimeError, match="half-way"), written_whole(destination) as folder:
        (folder / "summary.json").write_text("second")
        (folder / "figure.png").write_bytes(b"half")
        raise RuntimeError("stopped half-way")
    assert contents(destination) == before and leftovers(tmp_path) == []
    with written_whole(destination) as folder:
        (folder / "index.html").write_text("third")
    assert contents(destination).keys() == {"index.html"}  # replaced whole: no file of the previous one stays
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("at", ["writing", "previous"])
def test_a_signal_as_a_hidden_folder_is_made_leaves_nothing(tmp_path, monkeypatch, at):
    """SIGTERM the instant a hidden folder exists, before the code that made it has its name (the moment
    ``probe compare`` was signalled at when it left its folder behind): the signal is delivered once the name
    is held, and the folder is removed."""
    destination = tmp_path / "report"
    with written_whole(destination) as folder:
        (folder / "summary.json").write_text("first")

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    mkdir = Path.mkdir

    def mkdir_then_signal(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if f".{at}-" in self.name:
            signal.raise_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        monkeypatch.setattr(Path, "mkdir", mkdir_then_signal)
        with pytest.raises(Stopped), written_whole(destination) as folder:
            (folder / "summary.json").write_text("second")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert leftovers(tmp_path) == []
    # stopped before the write: the previous folder; during the swap: the swap finishes first
    assert (destination / "summary.json").read_text() == ("first" if at == "writing" else "second")
    assert contents(destination).keys() == {"summary.json"}


def test_the_folder_gets_the_permissions_any_new_folder_gets(tmp_path):
    previous = os.umask(0o022)
    try:
        with written_whole(tmp_path / "a" / "report") as folder:
            (folder / "index.html").write_text("page")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a" / "report").stat().st_mode) == 0o755  # not a temporary folder's 0700


def test_only_an_earlier_output_is_replaced(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "draft.md").write_text("mine")
    with pytest.raises(ProbeError, match="holds files that are not a report"):
        check_replaceable(notes, "out", "report", "summary.json")
    (notes / "summary.json").write_text("{}")  # an earlier report (even one cut short by an older probe)
    check_replaceable(notes, "out", "report", "summary.json")
    check_replaceable(tmp_path / "new", "out", "report", "summary.json")


# --------------------------------------------------------------------------------------------------
# a real `probe report`, signalled


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    rows = deviation_rows({"self": (3, 2)}, examples=6, alphas=(1.0, 0.5))
    return write_run(tmp_path_factory.mktemp("signalled") / "run", rows, manifest_for(), parts=3)


def _environment() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1"}


def stop_at(argv: list[str], stage: str, signum=signal.SIGINT) -> tuple[int, list[str]]:
    """``probe ARGV`` in a new process, sent ``signum`` once its stderr says ``stage`` (a progress line of the
    report); its exit status and its stderr lines that are not progress lines."""
    process = subprocess.Popen([sys.executable, "-m", "probe", *argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=_environment())
    said = []
    for line in process.stderr:
        said.append(line.rstrip("\n"))
        if stage in line:
            process.send_signal(signum)
            break
    else:
        process.wait(timeout=60)
        pytest.fail(f"the report never said {stage!r}: {said}")
    said += process.stderr.read().splitlines()
    return process.wait(timeout=120), [line for line in said if not line.startswith("probe report: ")]


#: stages of the report's build, as its progress lines name them (the first read, the statistics, a figure,
#: the explorer: the last stage before the page is written and the folder moved into place)
STAGES = ["read", "statistics:", "figure 1:", "figure 6:", "explorer:"]
#: the two the everyday tests signal at (the others: pytest -m slow)
EVERYDAY = {("figure 1:", False), ("explorer:", True)}


@pytest.mark.slow
@pytest.mark.parametrize("stage, previous", [
    pytest.param(stage, previous, id=f"{stage.rstrip(':')}, {'a previous report' if previous else 'none before'}",
                 marks=() if (stage, previous) in EVERYDAY else pytest.mark.slow)
    for stage in STAGES for previous in (False, True)])
def test_ctrl_c_leaves_the_previous_report_or_none(run_dir, tmp_path, stage, previous):
    out = tmp_path / "report"
    if previous:
        build_report(run_dir, out)
    before = contents(out)
    code, lines = stop_at(["report", str(run_dir), "--out", str(out)], stage)
    assert code == 130, lines
    assert len(lines) == 1 and lines[0].startswith("probe: stopped by SIGINT;"), lines  # one line, no traceback
    assert f"{out} holds a whole report or none, never part of one" in lines[0]
    assert contents(out) == before  # the previous report, byte for byte, or none: never a partial one
    assert (out / "index.html").exists() == previous
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_sigterm_during_a_comparison_leaves_none(run_dir, tmp_path):
    other = write_run(tmp_path / "other", deviation_rows({"self": (2, 2)}, examples=6, seed=1), manifest_for(), parts=2)
    out = tmp_path / "compare"
    process = subprocess.Popen([sys.executable, "-m", "probe", "compare", str(run_dir), str(other), "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_environment())
    deadline = time.monotonic() + 120
    while not (list(tmp_path.glob(".compare.*")) or out.exists()) and process.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)  # until the comparison is being written (into a hidden folder beside it, or in place)
    process.send_signal(signal.SIGTERM)
    lines = process.stderr.read().splitlines()
    assert process.wait(timeout=120) == 143, lines
    assert len(lines) == 1 and lines[0].startswith("probe: stopped by SIGTERM;"), lines
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_reader_that_closes_the_pipe_is_no_error(run_dir, tmp_path):
    """``probe status RUN | head -0``: the reader is gone before the command prints, and the command ends as it
    would have (exit 0, no word about a broken pipe)."""
    process = subprocess.Popen([sys.executable, "-m", "probe", "status", str(run_dir)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_environment())
    process.stdout.close()
    errors = process.stderr.read()
    assert process.wait(timeout=300) == 0, errors
    assert "Broken" not in errors and "Exception" not in errors, errors


@pytest.mark.slow
def test_a_report_piped_into_a_reader_that_leaves_is_written(run_dir, tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "probe", "report", str(run_dir), "--out", str(tmp_path / "r")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_environment())
    process.stdout.close()
    errors = process.stderr.read()
    assert process.wait(timeout=300) == 0, errors
    assert "Broken" not in errors and "Exception" not in errors, errors
    assert (tmp_path / "r" / "index.html").exists()
