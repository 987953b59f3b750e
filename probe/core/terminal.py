"""How a command meets its terminal: a reader that stops reading (``probe report RUN | head``) is no error,
and a stop signal while a folder is written whole (:func:`probe.core.destination.written_whole`) ends the
command with one line and the shell's status for the signal.  Nothing heavy is imported."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path


class ReaderMayLeave:
    """Standard output for a reader that may stop reading: once the pipe is closed, what is written goes
    nowhere (the file descriptor then points at ``/dev/null``), and the command ends as it would have, its exit
    status unchanged."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def reader_may_leave():
    """``sys.stdout`` as a :class:`ReaderMayLeave` while the block runs (a command line's whole life)."""
    stdout = sys.stdout
    sys.stdout = ReaderMayLeave(stdout)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


@contextmanager
def stops_exit(what: str, where: str | Path):
    """SIGINT or SIGTERM while ``what`` (``"the report"``) is written whole into ``where``: one line on stderr, then
    exit 130 or 143.  The first signal stops the work wherever it is; a DuckDB query it interrupts reports it as
    its own error, so the signal, not the error, decides.  (In the main thread only; elsewhere nothing
    changes.)"""
    received: list[int] = []

    def stop(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)} if main_thread \
        else {}
    try:
        yield
    except BaseException as error:
        if not received and not isinstance(error, KeyboardInterrupt):
            raise
        signum = received[0] if received else signal.SIGINT
        print(f"probe: stopped by {signal.Signals(signum).name}; {where} holds a whole {what.removeprefix('the ')} or "
              f"none, never part of one: {what} is moved into place only when complete (the previous one stays "
              "until then).", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
