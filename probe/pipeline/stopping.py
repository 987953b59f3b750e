"""Stopping a run on SIGINT and SIGTERM: drop the batches in flight, keep every finished one.

:class:`Stops` turns the signals into :class:`RunStopped`, raised in the main thread at a moment where
nothing is half-committed; the pipeline then marks the manifest ``"interrupted"`` and the CLI says how
to continue (``probe resume``) and exits with 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path


class RunStopped(BaseException):
    """SIGINT or SIGTERM stopped the run; every finished batch is kept and ``probe resume`` continues it.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int, run_dir: Path | None = None, manifest: dict | None = None, rank: int = 0):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.run_dir = run_dir
        self.manifest = manifest  # as rank 0 left it (None on other ranks)
        self.rank = rank

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class Stops:
    """SIGINT and SIGTERM as :class:`RunStopped`, raised in the main thread.

    Until :meth:`hold` (while the model and data load) a stop is raised at once: there is nothing to
    keep.  After it, a stop is raised at once only inside :meth:`interruptible` (a batch being computed,
    which is then dropped); elsewhere (a part file being written) it waits for the next
    :meth:`interruptible`, so a batch is either in a whole part file or not at all, and the manifest
    written at the stop counts exactly the part files.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.holding = False
        self.pending = None
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False

    def _handle(self, signum, frame):
        if self.holding:
            self.pending = self.pending or signum
        else:
            raise RunStopped(signum)

    def hold(self):
        self.holding = True

    @contextmanager
    def interruptible(self):
        if self.pending is not None:
            raise RunStopped(self.pending)
        self.holding = False
        try:
            yield
        finally:
            self.holding = True
