"""Where a command writes, checked before it does any work: every writer of probe (a run's ``--out``, the
report, ``probe compare --out``, ``probe export --to``, ``probe vit train --out``) calls
:func:`check_destination` first, so that a destination it cannot write to is refused in one paragraph
(exit status 2) before anything is computed or created.

The test is the one a write would meet: a temporary file is created and removed in the destination, or
in its nearest existing parent when it does not exist yet.  Permission bits alone would not do: root
passes them everywhere, while a read-only mount refuses root too.  The file system must also have room:
at least :data:`MIN_FREE_BYTES`, or what the caller says the output needs.

An :class:`OSError` while writing, after the check (a disk that fills up meanwhile), is turned into a
:class:`probe.core.errors.RunIOError` by :func:`writing` (exit status 74).

A folder of output (a report, a comparison) is written whole or not at all (:func:`written_whole`): into a
hidden folder beside its destination, moved into place when complete, so that a command stopped half-way
(Ctrl-C, a full disk) leaves the previous folder as it was, or none.  :func:`check_replaceable` refuses,
before any work, a destination that holds anything else, which the move would delete.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from probe.core.errors import ProbeError, RunIOError
from probe.core.spelling import option

#: the room a destination must have at the least (a report's figures and page, a comparison)
MIN_FREE_BYTES = 16 << 20


def _size(n: int) -> str:
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_destination(path: str | Path, name: str, *, kind: str = "folder", room: int = MIN_FREE_BYTES) -> None:
    """Refuse (:class:`ProbeError`) a destination probe cannot write: ``path`` is a ``kind`` (``"folder"``
    or ``"file"``) to be written, given as the option ``name`` (``"out"``, ``"to"``), which the message
    names as the caller spells it.  Nothing is left behind: ``path`` is not created."""
    path = Path(path).expanduser()
    given = option(name, str(path))
    if kind == "folder" and path.exists() and not path.is_dir():
        raise ProbeError(f"{given} is a file, not a folder. Pass a folder to write into.")
    if kind == "file" and path.is_dir():
        raise ProbeError(f"{given} is a folder; pass the file to write.")
    existing = path if kind == "folder" else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ProbeError(f"{given} cannot be created: '{existing}' is a file. Pass another folder.")
    try:
        handle, temporary = tempfile.mkstemp(prefix=".probe-write-test-", dir=existing)
        os.close(handle)
        os.remove(temporary)
    except OSError as error:
        raise ProbeError(
            f"{given} is not writable: probe cannot create files in '{existing}' "
            f"({error.strerror or error}). Pass a folder you can write to."
        ) from None
    free = shutil.disk_usage(existing).free
    if free < room:
        raise ProbeError(
            f"{given} has no room: the file system of '{existing}' has {_size(free)} free, and this needs about "
            f"{_size(room)}. Free some space, or pass a folder on another file system."
        )


#: errno values that mean the destination failed, not the input
IO_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT}


@contextmanager
def writing(what: str, where: str | Path):
    """Turn an :class:`OSError` of the file system while ``what`` is written into ``where`` into one
    paragraph with exit status 74 (:class:`probe.core.errors.RunIOError`); other errors pass unchanged."""
    try:
        yield
    except OSError as error:
        if error.errno not in IO_ERRNOS:
            raise
        code = errno.errorcode.get(error.errno, str(error.errno))
        raise RunIOError(
            f"Writing {what} to {where} failed: {error.strerror or error} ({code}). What was written there may be "
            "incomplete. Fix the cause (free space, permissions, a read-only file system), then run the command "
            "again."
        ) from None


# --------------------------------------------------------------------------------------------------
# a folder written whole


def check_replaceable(path: str | Path, name: str, what: str, marker: str) -> None:
    """Refuse (:class:`ProbeError`) a destination folder that :func:`written_whole` would replace while it holds
    something other than an earlier ``what`` (``"report"``; a folder that holds the file ``marker``): the
    move deletes what the folder held.  A folder that does not exist yet, or is empty, is fine."""
    path = Path(path).expanduser()
    if not path.is_dir() or not any(path.iterdir()) or (path / marker).is_file():
        return
    raise ProbeError(
        f"{option(name, str(path))} holds files that are not a {what} (it has no {marker}): probe writes the "
        f"{what} into a new folder and moves it into place whole, replacing the folder and everything in it. "
        f"Pass a new folder, or the folder of an earlier {what}."
    )


@contextmanager
def signals_deferred():
    """SIGINT and SIGTERM held back while the block runs (in the main thread; elsewhere nothing changes),
    then delivered to the handlers that were in place: a step that must not be cut in two (a folder being
    swapped) finishes first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: pending.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


def _hidden_folder(destination: Path, role: str) -> Path:
    """A new folder ``.NAME.ROLE-PID-RANDOM`` beside ``destination``, made with the permissions any folder gets
    (the umask's; a temporary folder's 0700 would follow the report into place)."""
    while True:
        folder = destination.parent / f".{destination.name}.{role}-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


@contextmanager
def written_whole(destination: str | Path):
    """A hidden folder beside ``destination`` to write into (yielded), moved into place as ``destination``
    when the block ends without an error; the folder ``destination`` was is deleted then.  On any error or
    signal the hidden folder is removed and ``destination`` stays as it was: whoever reads it sees the
    previous folder, or none, never a half-written one.  The swap itself runs with SIGINT and SIGTERM
    held back (:func:`signals_deferred`).  The destination's parent folders are created."""
    destination = Path(destination).expanduser()
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = None
    try:
        with signals_deferred():  # a signal between the folder's creation and its name would leave it behind
            staging = _hidden_folder(destination, "writing")
        yield staging
        with signals_deferred():
            previous = None
            if destination.exists():
                previous = _hidden_folder(destination, "previous")
                os.replace(destination, previous / destination.name)
            try:
                os.replace(staging, destination)
            except BaseException:
                if previous is not None:  # the previous folder back in place
                    os.replace(previous / destination.name, destination)
                raise
            finally:
                if previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
