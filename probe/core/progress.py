"""How a run shows its progress: a bar on a terminal, plain lines anywhere else.

A progress bar redraws itself with carriage returns, which a log file keeps: ``probe run > log 2>&1``
would hold one line of hundreds of redraws.  So the bar (tqdm) is drawn only where stderr is a terminal,
or in a notebook (tqdm's widget).  Elsewhere (a file, a pipe, a CI log) :class:`Lines` prints one plain
line each time another tenth of the work is done, at most every :data:`EVERY_S` seconds otherwise, and
at the end: ``probe: solving: 12/38 batches (32%), 0:01:05, rows=45,120``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

#: with plain lines, a line at least this often while work finishes (seconds), besides every tenth of it
EVERY_S = 60.0


def on_terminal() -> bool:
    """Whether a bar can be drawn: stderr is a terminal, or this is a notebook's kernel."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def progress(total: int, initial: int, enabled: bool, *, desc: str, unit: str = "batch", units: str = "batches"):
    """A tqdm bar on a terminal, else :class:`Lines`; both take ``update``, ``set_postfix`` and ``close``
    and count in ``n``.  Nothing is shown unless ``enabled``."""
    if enabled and on_terminal():
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True)
    return Lines(total, initial, enabled, desc=desc, units=units)


class Lines:
    """Progress as plain lines on stderr (the part of tqdm's interface the pipeline uses)."""

    def __init__(self, total: int, initial: int, enabled: bool, *, desc: str, units: str):
        self.total, self.n, self.enabled, self.desc, self.units = total, initial, enabled, desc, units
        self.postfix: dict = {}
        self.started = self.shown_at = time.perf_counter()
        self.shown: tuple | None = None  # (n, postfix) of the last line

    def update(self, done: int = 1) -> None:
        self.n += done
        if done and self._due():
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
        return self.n // tenth > self.shown[0] // tenth or time.perf_counter() - self.shown_at >= EVERY_S

    def _show(self) -> None:
        if not self.enabled:
            return
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        elapsed = timedelta(seconds=round(time.perf_counter() - self.started))
        extra = "".join(f", {key}={value}" for key, value in self.postfix.items())
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.units}{share}, {elapsed}{extra}", file=sys.stderr,
              flush=True)
        self.shown, self.shown_at = (self.n, dict(self.postfix)), time.perf_counter()
