"""How a run shows its progress: a bar on a terminal, plain lines anywhere else.

A progress bar redraws itself with carriage returns, which a log file keeps: ``probe run > log 2>&1``
would hold one line of hundreds of redraws.  So the bar (tqdm) is drawn only where stderr is a terminal,
or in a notebook (tqdm's widget).  Elsewhere (a file, a pipe, a CI log) :class:`Lines` prints one plain
line each time another tenth of the work is done, and at the end, with the time spent and the time left
at the rate so far: ``probe: solving: 12/38 batches (32%), 0:01:05, ETA 0:02:21, rows=45,120``.

Work that moves within a unit (the rows solved within a batch, in its postfix) is shown with
:meth:`Bar.tick` / :meth:`Lines.tick`: the bar redraws (so its timer moves too), and the lines print when
a line is due by time: every :data:`FIRST_EVERY_S` seconds at first, less often as the run goes on, at
least every :data:`EVERY_S`.  A run of one long batch then shows it moving in a log as on a terminal.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

#: with plain lines, a line at least this often while work moves (seconds), besides every tenth of it
EVERY_S = 60.0
#: ... and at first this often: the interval grows with the time spent (a fifth of it), up to EVERY_S
FIRST_EVERY_S = 5.0
#: a bar redraws for work within a unit at most this often (seconds; tqdm's own interval)
REDRAW_S = 0.1


def on_terminal() -> bool:
    """Whether a bar can be drawn: stderr is a terminal, or this is a notebook's kernel."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress(total: int, initial: int, enabled: bool, *, desc: str, unit: str = "batch", units: str = "batches"):
    """A :class:`Bar` on a terminal, else :class:`Lines`; both take ``update``, ``set_postfix``, ``tick`` and
    ``close`` and count in ``n``.  Nothing is shown unless ``enabled``."""
    if enabled and on_terminal():
        return Bar(total, initial, unit=unit, desc=desc)
    return Lines(total, initial, enabled, desc=desc, units=units)


def clock(seconds: float) -> timedelta:
    """Seconds as ``h:mm:ss``."""
    return timedelta(seconds=round(seconds))


class Bar:
    """tqdm's bar (a widget in a notebook), with :meth:`tick` for work that moves within a unit."""

    def __init__(self, total: int, initial: int, *, unit: str, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True)
        self.drawn_at = time.perf_counter()

    @property
    def n(self) -> int:
        return self.bar.n

    def update(self, done: int = 1) -> None:
        self.bar.update(done)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        self.bar.set_postfix(ordered_dict, refresh=refresh, **values)

    def tick(self) -> None:
        """Redraw (the postfix and the timer), at most every :data:`REDRAW_S` seconds."""
        now = time.perf_counter()
        if now - self.drawn_at >= REDRAW_S:
            self.bar.refresh()
            self.drawn_at = now

    def close(self) -> None:
        self.bar.close()


class Lines:
    """Progress as plain lines on stderr (the part of tqdm's interface the pipeline uses, and :meth:`tick`)."""

    def __init__(self, total: int, initial: int, enabled: bool, *, desc: str, units: str):
        self.total, self.n, self.enabled, self.desc, self.units = total, initial, enabled, desc, units
        self.initial = initial  # what earlier work did (a resumed run's): not counted in the rate
        self.postfix: dict = {}
        self.started = self.shown_at = time.perf_counter()
        self.shown: tuple | None = None  # (n, postfix) of the last line

    def update(self, done: int = 1) -> None:
        self.n += done
        if done and self._due():
            self._show()

    def tick(self) -> None:
        """A line for work that moved within a unit (its postfix), when one is due by time."""
        if self.shown is None or self._due_by_time():
            self._show()

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **values) -> None:
        self.postfix = {**(ordered_dict or {}), **values}

    def close(self) -> None:
        if self.shown != (self.n, self.postfix):  # the last state, unless the last line said it
            self._show()
        self.enabled = False

    def _due(self) -> bool:
        if self.shown is None:
            return True
        tenth = max(1, self.total // 10)
        return self.n // tenth > self.shown[0] // tenth or self._due_by_time()

    def _due_by_time(self) -> bool:
        now = time.perf_counter()
        every = min(EVERY_S, max(FIRST_EVERY_S, (now - self.started) / 5))
        return now - self.shown_at >= every

    def eta(self) -> float | None:
        """The seconds left at this process's rate so far; ``None`` before its first unit, and once done."""
        done = self.n - self.initial
        if done <= 0 or self.n >= self.total:
            return None
        return (time.perf_counter() - self.started) / done * (self.total - self.n)

    def _show(self) -> None:
        if not self.enabled:
            return
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        eta = self.eta()
        times = f"{clock(time.perf_counter() - self.started)}" + ("" if eta is None else f", ETA {clock(eta)}")
        extra = "".join(f", {key}={value}" for key, value in self.postfix.items())
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.units}{share}, {times}{extra}", file=sys.stderr,
              flush=True)
        self.shown, self.shown_at = (self.n, dict(self.postfix)), time.perf_counter()
