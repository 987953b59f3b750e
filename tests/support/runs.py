"""Real tiny runs for the tests: `probe` in this process on one thread, or as a real process (torchrun
included); a finished or a Ctrl-C-interrupted run; and the part files of a run, to damage on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
from typer.testing import CliRunner

from probe.cli import app
from probe.store import storage

ROOT = Path(__file__).resolve().parents[2]
#: 12 texts of the embedded corpus in 6 batches of 2 (the ``clean_run`` fixture's)
SMALL_RUN_ARGS = ["--samples", "12", "--batch-size", "2", "--max-length", "32", "--no-progress"]


def probe_process(*args, processes: int = 1, threads: int = 1) -> subprocess.Popen:
    """`probe ARGS` as a real process (this checkout's cli.py), as a user starts it; with ``processes``
    > 1, `torchrun --standalone --nproc-per-node N -m probe ARGS`.  One thread per process unless
    ``threads`` says otherwise (torchrun's default; the rows do not depend on it)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(threads),
    }
    if processes == 1:
        command = [sys.executable, str(ROOT / "cli.py")]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   "-m", "probe"]
    return subprocess.Popen(
        [*command, *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(process: subprocess.Popen, timeout=300) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out + err


@contextmanager
def one_thread():
    """This process computes with one thread, like the processes above."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def invoke_with_one_thread(*args):
    with one_thread():
        return CliRunner().invoke(app, [str(a) for a in args])


def finished_run(model_dir, out: Path, *args) -> Path:
    """``probe run MODEL ARGS --out OUT`` in this process on one thread, finished: its run directory."""
    result = invoke_with_one_thread("run", model_dir, *args, "--out", out)
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def interrupted_run(model_dir, data, out, monkeypatch, *args) -> Path:
    """A run stopped by Ctrl-C (in this process) as it starts a batch after its first part file is written:
    batch 0 finished and batch 1 dropped, whatever the thread count (batch k + 1 is captured, and on one
    thread solved, before batch k is written; on several, batch k's last solves run meanwhile)."""
    import probe.pipeline.runner as pipeline

    real_start, real_write, written = pipeline._start_batch, storage.write_part, {"parts": 0}

    def write(*args, **kwargs):
        path = real_write(*args, **kwargs)
        written["parts"] += 1
        return path

    def start_or_interrupt(*args, **kwargs):
        if written["parts"]:
            raise KeyboardInterrupt
        return real_start(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "_start_batch", start_or_interrupt)
        patch.setattr(storage, "write_part", write)
        result = CliRunner().invoke(app, ["run", str(model_dir), "--dataset", str(data), "--batch-size", "2",
                                          "--out", str(out), "--no-progress", *map(str, args)])
    assert result.exit_code == 130, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def part(run_dir: Path, batch: int) -> Path:
    return run_dir / storage.PARTS / f"part-{batch:06d}.parquet"


def flip_a_byte(path: Path):
    """Same size, footer intact: only the checksum can tell.  The byte is one of the first data page's
    values (its offset from the column chunk's metadata, past the page header), not the footer."""
    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    offset = column.data_page_offset + column.total_compressed_size // 2
    assert offset < path.stat().st_size - pq.ParquetFile(path).metadata.serialized_size - 8
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
