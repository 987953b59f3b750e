"""Progress a user can read: plain lines in a log say the time left, and a batch that takes long shows its
rows moving, in a log as on a terminal."""

from __future__ import annotations

import json
import re

import pytest

import probe.core.progress as progress_module
from probe.core.config import RunConfig
from probe.core.progress import Lines


class Clock:
    """``time.perf_counter`` moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    return clock


def lines_of(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_log_lines_say_the_time_left_at_the_rate_so_far(clock, capsys):
    lines = Lines(10, 0, True, desc="probe: solving", units="batches")
    clock.now += 20
    lines.update(2)  # 2 of 10 in 20 s: 8 more at 10 s each
    clock.now += 10
    lines.update(1)  # a tenth more: 3 in 30 s, 7 left
    clock.now += 70
    lines.update(7)
    assert lines_of(capsys) == [
        "probe: solving: 2/10 batches (20%), 0:00:20, ETA 0:01:20",
        "probe: solving: 3/10 batches (30%), 0:00:30, ETA 0:01:10",
        "probe: solving: 10/10 batches (100%), 0:01:40",  # done: no time left to say
    ]


def test_a_resumed_runs_time_left_counts_only_what_this_process_did(clock, capsys):
    lines = Lines(10, 4, True, desc="probe: solving", units="batches")  # 4 batches written before
    clock.now += 30
    lines.update(2)  # 2 in 30 s here: 4 left, 60 s
    assert lines_of(capsys) == ["probe: solving: 6/10 batches (60%), 0:00:30, ETA 0:01:00"]


def test_work_within_a_unit_prints_lines_by_time_more_rarely_as_the_run_goes_on(clock, capsys):
    lines = Lines(1, 0, True, desc="probe: solving", units="batches")
    shown = []
    for second in range(1, 301):
        clock.now += 1
        lines.set_postfix(rows=f"{second:,}")
        lines.tick()
        shown += [(second, line) for line in lines_of(capsys)]
    seconds = [second for second, _ in shown]
    assert seconds[:5] == [1, 6, 11, 16, 21]  # the first line, then every FIRST_EVERY_S
    gaps = [b - a for a, b in zip(seconds, seconds[1:])]
    assert gaps == sorted(gaps) and max(gaps) <= progress_module.EVERY_S  # less often, at least every minute
    assert all(line.startswith("probe: solving: 0/1 batches (0%), ") and line.endswith(f"rows={second:,}")
               for second, line in shown)


def one_long_batch(tiny_bert_dir, texts_file, tmp_path, monkeypatch) -> RunConfig:
    """A run of a single batch whose problems are solved in many stacks (one example's site each)."""
    import probe.batch.rows as rows

    monkeypatch.setattr(rows, "STACK_BYTES", 1)
    from probe.capture.data import DatasetSpec

    return RunConfig(model=str(tiny_bert_dir), dataset=DatasetSpec(name=str(texts_file)), out=tmp_path / "runs",
                     batch_size=16, max_length=32, device="cpu", progress=True)


def manifest_rows(run_dir) -> int:
    return json.loads((run_dir / "manifest.json").read_text())["solver"]["rows"]


def test_a_long_batch_moves_in_a_log(tiny_bert_dir, texts_file, tmp_path, monkeypatch, capsys):
    from probe.pipeline.runner import run

    monkeypatch.setattr(progress_module, "EVERY_S", 0.0)  # a line for every site solved
    run_dir = run(one_long_batch(tiny_bert_dir, texts_file, tmp_path, monkeypatch))
    solving = [line for line in lines_of(capsys) if line.startswith("probe: solving: ")]
    within = [int(re.search(r"rows=([\d,]+)", line).group(1).replace(",", ""))
              for line in solving if line.startswith("probe: solving: 0/1 batches")]
    assert len(within) > 3 and within == sorted(within) and within[-1] > within[1] > 0, solving
    assert solving[-1].startswith("probe: solving: 1/1 batches (100%), ")
    assert solving[-1].endswith(f"rows={manifest_rows(run_dir):,}") and within[-1] <= manifest_rows(run_dir)


def test_a_long_batch_moves_on_a_terminal(tiny_bert_dir, texts_file, tmp_path, monkeypatch, capsys):
    from probe.pipeline.runner import run

    monkeypatch.setattr(progress_module, "on_terminal", lambda: True)
    monkeypatch.setattr(progress_module, "REDRAW_S", 0.0)  # a redraw for every site solved
    run_dir = run(one_long_batch(tiny_bert_dir, texts_file, tmp_path, monkeypatch))
    drawn = [part for part in re.split(r"[\r\n]", capsys.readouterr().err) if part.startswith("probe: solving")]
    within = [int(re.search(r"rows=([\d,]+)", part).group(1).replace(",", ""))
              for part in drawn if " 0/1 " in part and "rows=" in part]
    assert len(set(within)) > 3 and within == sorted(within) and within[-1] > 0, drawn
    assert " 1/1 " in drawn[-1] and drawn[-1].rstrip().endswith(f"rows={manifest_rows(run_dir):,}]"), drawn[-1]
