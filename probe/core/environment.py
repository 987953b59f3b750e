"""probe's environment variables, read and checked before any command does its work.

:func:`check_environment` is called first by every command (``probe run``, ``resume``, ``report``,
``compare``, ``export``, ``verify``, ``vit train``, and the same functions from Python), so that a bad value
is refused in one paragraph (exit status 2) before a model loads or a row is read, not met at the end of a
run.  The variables:

- ``PROBE_MEMORY_BUDGET``: the memory one reader may hold, bytes or a size with a unit (:func:`parse_size`);
- ``PROBE_NATIVE``: ``0`` runs the solver's torch loops instead of its compiled kernel, ``1`` (default) not;
- ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: whole numbers, as torchrun sets them.
"""

from __future__ import annotations

import os
import re

from probe.core.errors import ProbeError

#: the environment variable that sets the memory budget of one reader
MEMORY_BUDGET_ENV = "PROBE_MEMORY_BUDGET"

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
#: the variables torchrun sets, each a whole number (0 or more)
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def parse_size(text: str, *, what: str = MEMORY_BUDGET_ENV) -> int:
    """Bytes from ``"600MB"``, ``"1.5GiB"``, ``"2g"`` or a plain number of bytes; a clear error otherwise."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ProbeError(
            f"{what}={text!r} is not a size. Give bytes, or a number with a unit: 600MB, 1.5GiB, 2G "
            f"(or unset {what})."
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ProbeError(f"{what}={text!r} must be positive: give a size such as 600MB, 1.5GiB, 2G (or unset {what}).")
    return size


def check_environment() -> None:
    """Refuse (:class:`ProbeError`, naming the variable) any of probe's environment variables whose value it
    cannot use (module docstring)."""
    budget = os.environ.get(MEMORY_BUDGET_ENV)
    if budget not in (None, ""):
        parse_size(budget)
    native = os.environ.get("PROBE_NATIVE")
    if native not in (None, "", "0", "1"):
        raise ProbeError(f"PROBE_NATIVE={native!r}: give 0 (the solver's torch loops) or 1 (its compiled kernel, the "
                         "default), or unset it.")
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value not in (None, "") and not value.strip().isdigit():
            raise ProbeError(f"{name}={value!r} is not a whole number. torchrun sets it; unset it to run in one "
                             "process.")
