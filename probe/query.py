"""The one query layer over a run's tables: every reader (report, compare, the API, status, verify,
export) asks its questions here, through DuckDB over the run's checked part files, in memory that does not
grow with the number of rows.

Why DuckDB.  It reads the part files in place (no copy, no load), runs grouped aggregates, exact quantiles
and sorts out of core (spilling to a temporary directory under a memory limit), and gives readers SQL
they can reuse outside probe.  pyarrow's streaming compute has no grouped quantiles or out-of-core sort;
polars' streaming engine is capable but spills less predictably and would add a second engine next to
pyarrow's writer.

The memory budget.  :func:`memory_budget` is what one reader may hold: ``PROBE_MEMORY_BUDGET`` (bytes, or
with a unit: ``600MB``, ``1.5GiB``) or :data:`DEFAULT_MEMORY_BUDGET`.  DuckDB gets a share of it as its
``memory_limit``; readers that would materialise rows in pandas (``Run.rows``) compare their estimate with it
and refuse, naming the lazy way, instead of being killed for memory.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from .errors import ProbeError

#: the environment variable that sets the memory budget of one reader
MEMORY_BUDGET_ENV = "PROBE_MEMORY_BUDGET"
#: the memory budget when ``PROBE_MEMORY_BUDGET`` is not set (bytes)
DEFAULT_MEMORY_BUDGET = 1 << 30
#: the share of the budget DuckDB may use for its own buffers (the rest: Python, pandas slices, figures)
DUCKDB_SHARE = 0.5

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, what: str = MEMORY_BUDGET_ENV) -> int:
    """Bytes from ``"600MB"``, ``"1.5GiB"``, ``"2g"`` or a plain number of bytes; a clear error otherwise."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ProbeError(
            f"{what}={text!r} is not a size. Give bytes, or a number with a unit: 600MB, 1.5GiB, 2G."
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ProbeError(f"{what}={text!r} must be positive.")
    return size


def memory_budget() -> int:
    """The memory one reader may use, in bytes (``PROBE_MEMORY_BUDGET``, default 1 GiB)."""
    text = os.environ.get(MEMORY_BUDGET_ENV)
    return DEFAULT_MEMORY_BUDGET if text in (None, "") else parse_size(text)


def connect(*, memory_limit: int | None = None, threads: int | None = None, temp_directory: str | Path | None = None):
    """A fresh in-memory DuckDB connection set up for probe's readers: ``memory_limit`` (default: a share of
    :func:`memory_budget`), ``threads`` (default: DuckDB's own, the machine's cores), and a temporary
    directory to spill to (default: a new one under the system's temporary directory)."""
    import duckdb

    limit = memory_limit if memory_limit is not None else int(memory_budget() * DUCKDB_SHARE)
    connection = duckdb.connect(":memory:")
    connection.execute(f"SET memory_limit = '{max(limit, 64 << 20)}B'")
    if threads is not None:
        connection.execute(f"SET threads = {int(threads)}")
    spill = Path(temp_directory) if temp_directory is not None else Path(tempfile.gettempdir()) / "probe-duckdb"
    connection.execute(f"SET temp_directory = '{_sql_string(str(spill))}'")
    connection.execute("SET preserve_insertion_order = false")
    return connection


def _sql_string(text: str) -> str:
    """``text`` inside single quotes in SQL."""
    return text.replace("'", "''")


def parquet_source(files) -> str:
    """The SQL table expression reading ``files`` (part files) as one table: ``read_parquet([...])``."""
    files = sorted(str(Path(f)) for f in files)
    if not files:
        raise ValueError("parquet_source needs at least one file")
    return "read_parquet([" + ", ".join(f"'{_sql_string(f)}'" for f in files) + "], union_by_name = true)"
