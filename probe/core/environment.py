"""probe's environment variables, read and checked before any command does its work.

:func:`check_environment` is called first by every command (``probe run``, ``resume``, ``report``,
``compare``, ``export``, ``verify``, ``vit train``, and the same functions from Python), so that a bad value
is refused in one paragraph (exit status 2) before a model loads or a row is read, not met at the end of a
run.  The variables:

- ``PROBE_MEMORY_BUDGET``: the memory one reader may hold, bytes or a size with a unit (:func:`parse_size`);
- ``PROBE_NATIVE``: ``0`` runs the solver's torch loops instead of its compiled kernel, ``1`` (default) not;
- ``PROBE_SCHEDULE``: ``0`` runs the solver's adaptive iterations without its fixed schedule first, ``1``
  (default) not;
- ``PROBE_CACHE_DIR``: probe's cache folder (default ``~/.cache/probe``);
- ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: whole numbers, as torchrun sets them.
"""

from __future__ import annotations

import os
from pathlib import Path

from probe.core import arguments
from probe.core.errors import ProbeError

#: the environment variable that sets the memory budget of one reader
MEMORY_BUDGET_ENV = "PROBE_MEMORY_BUDGET"
#: the variables torchrun sets, each a whole number (0 or more)
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def parse_size(text: str, *, what: str = MEMORY_BUDGET_ENV) -> int:
    """Bytes from a size in an environment variable ``what`` (the grammar of
    :func:`probe.core.arguments.parse_size`, which ``--max-memory`` shares)."""
    return arguments.parse_size(text, what, variable=True)


def memory_budget_bytes(default: int) -> int:
    """``PROBE_MEMORY_BUDGET`` in bytes, or ``default`` where it is not set."""
    text = os.environ.get(MEMORY_BUDGET_ENV)
    return default if text in (None, "") else parse_size(text)


def cache_dir() -> Path:
    """probe's cache folder: ``PROBE_CACHE_DIR``, else ``~/.cache/probe`` (texts given in Python, the compiled
    Newton kernel)."""
    return Path(os.environ.get("PROBE_CACHE_DIR") or Path.home() / ".cache" / "probe")


def native_kernel_allowed() -> bool:
    """``PROBE_NATIVE``: ``0`` runs the solver's torch loops instead of its compiled kernel; ``1`` (default) not."""
    return os.environ.get("PROBE_NATIVE", "1") != "0"


def fixed_schedule_allowed() -> bool:
    """``PROBE_SCHEDULE``: ``0`` runs the solver's adaptive iterations alone, without the fixed schedule first
    (for comparisons); ``1`` (default) not."""
    return os.environ.get("PROBE_SCHEDULE", "1") != "0"


def check_environment() -> None:
    """Refuse (:class:`ProbeError`, naming the variable) any of probe's environment variables whose value it
    cannot use (module docstring)."""
    budget = os.environ.get(MEMORY_BUDGET_ENV)
    if budget not in (None, ""):
        parse_size(budget)
    for name, zero, one in (("PROBE_NATIVE", "the solver's torch loops", "its compiled kernel"),
                            ("PROBE_SCHEDULE", "the adaptive iterations alone", "the fixed schedule first")):
        value = os.environ.get(name)
        if value not in (None, "", "0", "1"):
            raise ProbeError(f"{name}={value!r}: give 0 ({zero}) or 1 ({one}, the default), or unset it.")
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value not in (None, "") and not value.strip().isdigit():
            raise ProbeError(f"{name}={value!r} is not a whole number. torchrun sets it; unset it to run in one "
                             "process.")
