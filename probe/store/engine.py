"""DuckDB under probe's memory budget, and Python values and names spelled as SQL.

Every reader (:mod:`probe.query`) and the export's sort (:mod:`probe.store.keyorder`) open their DuckDB
connections here: :func:`memory_budget` is what one reader may hold (``PROBE_MEMORY_BUDGET``), :func:`connect`
gives DuckDB its share of it, and :func:`literal`, :func:`name` and :func:`equals` write values exactly.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np

from probe.core.environment import MEMORY_BUDGET_ENV, memory_budget_bytes, parse_size  # noqa: F401 (re-exported)
from probe.core.errors import ProbeError

#: the memory budget when ``PROBE_MEMORY_BUDGET`` is not set (bytes)
DEFAULT_MEMORY_BUDGET = 1 << 30
#: the share of the budget DuckDB may use for its own buffers (the rest: Python, pandas slices, figures)
DUCKDB_SHARE = 0.5


def memory_budget() -> int:
    """The memory one reader may use, in bytes (``PROBE_MEMORY_BUDGET``, default 1 GiB)."""
    return memory_budget_bytes(DEFAULT_MEMORY_BUDGET)


#: DuckDB's memory limit is never set below this (it needs a few buffers per thread to run at all)
MIN_DUCKDB_MEMORY = 128 << 20
#: DuckDB runs at most one thread per this much of its memory limit (each thread's scans hold buffers)
MEMORY_PER_THREAD = 48 << 20


def connect(*, memory_limit: int | None = None, threads: int | None = None, temp_directory: str | Path | None = None):
    """A fresh in-memory DuckDB connection set up for probe's readers: ``memory_limit`` (default: a share of
    :func:`memory_budget`), ``threads`` (default: the machine's cores, at most one per
    :data:`MEMORY_PER_THREAD` of the limit), and a temporary directory to spill to (default: a new one
    under the system's temporary directory)."""
    import duckdb

    limit = max(memory_limit if memory_limit is not None else int(memory_budget() * DUCKDB_SHARE), MIN_DUCKDB_MEMORY)
    if threads is None:
        threads = max(1, min(os.cpu_count() or 1, limit // MEMORY_PER_THREAD))
    connection = duckdb.connect(":memory:")
    connection.execute(f"SET memory_limit = '{limit}B'")
    connection.execute(f"SET threads = {int(threads)}")
    spill = Path(temp_directory) if temp_directory is not None else Path(tempfile.gettempdir()) / "probe-duckdb"
    connection.execute(f"SET temp_directory = '{sql_string(str(spill))}'")
    connection.execute("SET preserve_insertion_order = false")
    connection.execute("SET parquet_metadata_cache = true")  # readers ask many questions of the same parts
    connection.execute("SET enable_progress_bar = false")  # DuckDB's own bar would print into a command's output
    return connection


def sql_string(text: str) -> str:
    """``text`` inside single quotes in SQL."""
    return text.replace("'", "''")


def same_columns(files) -> bool:
    """Whether every one of the part ``files`` has the first one's columns, read from each footer (a run's
    parts normally do; a run resumed by another version of probe may not).  Where they do, DuckDB can read
    them by position (:func:`parquet_source` with ``union_by_name=False``), which binds faster and, over
    thousands of files, takes hundreds of MB less."""
    import pyarrow.parquet as pq

    names = pq.read_schema(files[0]).names if files else None
    return all(pq.read_schema(f).names == names for f in files[1:])


def parquet_source(files, *, union_by_name: bool = True) -> str:
    """The SQL table expression reading ``files`` (part files) as one table: ``read_parquet([...])``.
    ``union_by_name``: columns matched by name across files that differ (DuckDB then reads every file's
    schema when the query is bound); False when every file has the same columns, which binds faster."""
    files = sorted(str(Path(f)) for f in files)
    if not files:
        raise ValueError("parquet_source needs at least one file")
    return ("read_parquet([" + ", ".join(f"'{sql_string(f)}'" for f in files)
            + f"], union_by_name = {'true' if union_by_name else 'false'})")


def literal(value) -> str:
    """A Python value as an exact SQL literal: strings quoted, floats by their shortest round-trip text
    (parsed back to the same double), None as NULL."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "NULL"
    if isinstance(value, (bool, np.bool_)):
        return "TRUE" if value else "FALSE"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return f"CAST('{float(value)!r}' AS DOUBLE)"
    return f"'{sql_string(str(value))}'"


def name(column: str) -> str:
    """A column name as a quoted SQL identifier."""
    return '"' + column.replace('"', '""') + '"'


def equals(column: str, value) -> str:
    """SQL: ``column`` holds exactly ``value``; ``None`` is ``IS NULL`` (which ``=`` never matches)."""
    return f"{name(column)} IS NULL" if value is None else f"{name(column)} = {literal(value)}"


def over_budget(error, what: str, then: str) -> ProbeError:
    """The :class:`ProbeError` for DuckDB's out-of-memory ``error`` in ``what`` (a query, the export's
    summary of its slices): how to raise :data:`MEMORY_BUDGET_ENV`, ``then`` what else to do."""
    return ProbeError(f"{what} ran out of the memory budget ({str(error).splitlines()[0]}). Raise it with "
                      f"{MEMORY_BUDGET_ENV}=4GB (or more), {then}.")


