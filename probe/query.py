"""The one query layer over a run's tables: every reader (report, compare, the API, status, verify,
export) asks its questions here, through DuckDB over the run's checked part files, in memory that does not
grow with the number of rows.

What a reader gets.  :class:`RunTable` is a run's deviations table (its checked part files, or one
exported Parquet file) as the DuckDB view ``rows``: every column of :data:`probe.schema.DEVIATION_SCHEMA`,
absent ones as typed nulls, ``trivial`` filled in from ``n_keys`` where a run did not record it, and NaN
read as null (as pandas skips it).  On it:

* :meth:`RunTable.sql` and :attr:`RunTable.relation`: any SQL, lazily (a DuckDB relation);
* :meth:`Table.aggregate`: counts, sums, means, maxima of several groupings in one pass (grouping sets);
* :meth:`Table.stats`: count, mean, min, max, shares above thresholds and **exact** quantiles and order
  statistics of several groupings in two passes (see below);
* :meth:`Table.histogram`, :meth:`Table.histogram2d`: bin counts on given edges, exactly as
  ``numpy.histogram`` / ``numpy.histogram2d`` count them;
* :meth:`Table.top_rows`: the rows of largest value per group (the explorer's worst rows);
* :meth:`RunTable.select`: a filtered pandas slice, refused with a :class:`ProbeError` before it would
  exceed the memory budget.

The main slice and trivial rows are asked for in one place, :func:`where`.

Why DuckDB.  It reads the part files in place (no copy, no load), runs grouped aggregates, hash
aggregations with millions of groups, joins and sorts out of core (spilling to a temporary directory under
its memory limit), and gives readers SQL they can reuse outside probe (``duckdb``, and the same Parquet
files read by polars or Spark: docs/large-runs.md).  pyarrow's compute functions have no grouped quantiles
and no out-of-core sort or aggregation; polars' streaming engine is capable too, but would add a second
engine and a second API next to the pyarrow that writes the parts, and DuckDB's SQL is what readers of a
run already know.

Exact quantiles in bounded memory.  DuckDB's own ``quantile_cont`` keeps every value of a group in memory
and cannot spill (8 bytes a value: 0.8 GB for one 10^8-row slice), so :meth:`Table.stats` selects order
statistics in two passes instead.  Pass 1 counts each group's values in fine logarithmic bins (128 per
octave) together with each bin's minimum, maximum, sum and counts above thresholds, which also give the
count, mean, min, max and shares; the cumulative counts name the one bin that holds each wanted rank.  Pass
2 reads only the values of those bins (about 0.5% of a group each), sorts them and picks the ranks.  When
those values are more than :func:`read_limit` (a share of the budget), the largest bins are first split
into :data:`SPLIT_BINS` equal sub-bins, all in one more pass, until they fit.  Every quantile is then
exactly numpy's and pandas' (the "linear" method: ``x[k] + (x[k+1] - x[k]) * f`` at ``k + f = q (n - 1)``),
and every order statistic the rank-th smallest value: no sketch, no rank error.

The memory budget.  :func:`memory_budget` is what one reader may hold: ``PROBE_MEMORY_BUDGET`` (bytes, or
with a unit: ``600MB``, ``1.5GiB``) or :data:`DEFAULT_MEMORY_BUDGET`.  DuckDB gets a share of it as its
``memory_limit``; readers that would materialise rows in pandas (``Run.rows``, :meth:`RunTable.select`)
compare their estimate with it and refuse, naming the lazy way, instead of being killed for memory.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

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
    connection.execute(f"SET temp_directory = '{_sql_string(str(spill))}'")
    connection.execute("SET preserve_insertion_order = false")
    connection.execute("SET parquet_metadata_cache = true")  # readers ask many questions of the same parts
    connection.execute("SET enable_progress_bar = false")  # DuckDB's own bar would print into a command's output
    return connection


def _sql_string(text: str) -> str:
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
    return ("read_parquet([" + ", ".join(f"'{_sql_string(f)}'" for f in files)
            + f"], union_by_name = {'true' if union_by_name else 'false'})")


# --------------------------------------------------------------------------------------------------
# SQL pieces


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
    return f"'{_sql_string(str(value))}'"


def name(column: str) -> str:
    """A column name as a quoted SQL identifier."""
    return '"' + column.replace('"', '""') + '"'


def where(*, space=..., alpha=..., trivial: bool | None = None, **equal) -> str:
    """A SQL predicate over the ``rows`` view: the one place that says what a slice and trivial rows are.

    ``space`` and ``alpha`` select one (space, alpha) slice; ``None`` (an old run without the column)
    matches every row, as the report always has; alpha matches within a relative 1e-12, like
    ``numpy.isclose(alpha, value, rtol=1e-12, atol=0)``.  ``trivial=False`` leaves out the rows with one key
    (``lambda* = alpha z`` by construction), ``True`` keeps only them.  Other keywords are equalities
    (``attention_type="self"``, ``layer=3``; a list or tuple means any of its values).
    """
    parts = []
    if space is not ... and space is not None:
        parts.append(f"space = {literal(str(space))}")
    if alpha is not ... and alpha is not None:
        parts.append(f"abs(alpha - {literal(float(alpha))}) <= 1e-12 * abs({literal(float(alpha))})")
    if trivial is not None:
        parts.append("trivial" if trivial else "NOT trivial")
    for column, value in equal.items():
        if isinstance(value, (list, tuple, set, frozenset)):
            parts.append(f"{name(column)} IN ({', '.join(literal(v) for v in value)})" if value else "FALSE")
        else:
            parts.append(equals(column, value))
    return " AND ".join(f"({p})" for p in parts) or "TRUE"


def equals(column: str, value) -> str:
    """SQL: ``column`` holds exactly ``value``; ``None`` is ``IS NULL`` (which ``=`` never matches)."""
    return f"{name(column)} IS NULL" if value is None else f"{name(column)} = {literal(value)}"


def over_budget(error, what: str, then: str) -> ProbeError:
    """The :class:`ProbeError` for DuckDB's out-of-memory ``error`` in ``what`` (a query, the export's
    summary of its slices): how to raise :data:`MEMORY_BUDGET_ENV`, ``then`` what else to do."""
    return ProbeError(f"{what} ran out of the memory budget ({str(error).splitlines()[0]}). Raise it with "
                      f"{MEMORY_BUDGET_ENV}=4GB (or more), {then}.")


def both(*predicates: str) -> str:
    """The conjunction of SQL predicates."""
    kept = [p for p in predicates if p and p != "TRUE"]
    return " AND ".join(f"({p})" for p in kept) or "TRUE"


#: pass 1 of the exact quantiles: logarithmic bins, this many per factor of two (a bin spans 0.54%)
BINS_PER_OCTAVE = 128
#: a split divides an interval's range into this many equal sub-bins
SPLIT_BINS = 256


def read_limit() -> int:
    """The most values pass 2 of :meth:`Table.stats` reads at once (16 bytes each, with their sorting about
    64): a 256th of :func:`memory_budget`; beyond it, intervals are split first."""
    return max(memory_budget() // 256, 1024)


def _log_bin(value: str) -> str:
    """The pass-1 bin of a value: 0 for zero, else sign * (C + floor(log2 |v| * BINS_PER_OCTAVE)), a
    non-decreasing function of the value (C keeps every positive value's bin above 0)."""
    offset = 1100 * BINS_PER_OCTAVE
    return (f"CASE WHEN {value} > 0 THEN {offset} + floor(log2({value}) * {BINS_PER_OCTAVE}) "
            f"WHEN {value} < 0 THEN -({offset} + floor(log2(-({value})) * {BINS_PER_OCTAVE})) ELSE 0 END")


def _uniform(edges: np.ndarray) -> tuple[float, float] | None:
    """``(start, step)`` when ``edges[i] == i * step + start`` exactly for every edge but the last (the
    edges of ``numpy.linspace`` and of ``numpy.arange(n + 1) * step``), else None."""
    n = len(edges) - 1
    for step in (edges[1] - edges[0], (edges[-1] - edges[0]) / n):
        if step > 0 and np.array_equal(np.arange(n) * step + edges[0], edges[:-1]):
            return float(edges[0]), float(step)
    return None


def edges_guess(value: str, edges: np.ndarray) -> str:
    """The bin of ``value`` among equal-width ``edges`` from the bin width alone (clamped to the bins); it
    can be one off at an edge, which :func:`edges_bin` corrects."""
    edges = np.asarray(edges, dtype=float)
    n = len(edges) - 1
    uniform = _uniform(edges) if n >= 1 else None
    if uniform is None:
        raise ValueError("edges_bin needs two or more equal-width edges (numpy.linspace or numpy.arange(n + 1) * step)")
    start, step = (literal(x) for x in uniform)
    return f"CAST(least(greatest(floor(({value} - {start}) / {step}), 0), {n - 1}) AS BIGINT)"


def edges_bin(value: str, edges: np.ndarray, guess: str | None = None) -> str:
    """The 0-based bin of ``value`` among increasing equal-width ``edges`` as ``numpy.histogram`` counts it
    (the bin ``i`` with ``edges[i] <= v < edges[i + 1]``, the last bin closed on the right), NULL outside
    them.  The guess from the bin width (:func:`edges_guess`; ``guess``: a column that holds it, computed
    once) is corrected by comparing with the exact edges (``i * step + start``, as numpy computes them), so
    float rounding cannot put a value in its neighbour's bin."""
    edges = np.asarray(edges, dtype=float)
    guess = guess or edges_guess(value, edges)
    n = len(edges) - 1
    start, step = (literal(x) for x in _uniform(edges))
    return (
        f"CASE WHEN {value} >= {literal(edges[0])} AND {value} <= {literal(edges[-1])} THEN "
        f"CASE WHEN {value} < {guess} * {step} + {start} THEN {guess} - 1 "
        f"WHEN {guess} < {n - 1} AND {value} >= ({guess} + 1) * {step} + {start} THEN {guess} + 1 ELSE {guess} END END"
    )


def cut_bin(value: str, edges: Sequence[float]) -> str:
    """The 0-based interval of ``value`` among increasing ``edges`` closed on the right, the first closed on
    both sides (``pandas.cut(..., include_lowest=True)``); NULL outside them."""
    edges = [float(e) for e in edges]
    cases = " ".join(f"WHEN {value} <= {literal(e)} THEN {i}" for i, e in enumerate(edges[1:]))
    return f"CASE WHEN {value} < {literal(edges[0])} THEN NULL {cases} END"


# --------------------------------------------------------------------------------------------------
# order statistics


def quantile_ranks(count: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks (0-based) and weight of the linear quantile ``q`` of ``count`` values, as numpy's
    ``percentile(values, 100 q)`` places it: ``k = floor(h)``, ``k + 1`` (at most ``count - 1``) and
    ``f = h - k`` at ``h = q (count - 1)``."""
    q = float(np.true_divide(q * 100.0, 100))  # the q numpy sees after pandas passes 100 q to percentile
    count = np.asarray(count, dtype=np.int64)
    virtual = q * (count - 1).astype(float)
    below = np.floor(virtual).astype(np.int64)
    above = np.minimum(below + 1, count - 1)
    return below, above, virtual - below


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between neighbouring order statistics (``numpy.lib._function_base_impl._lerp``)."""
    a, b, t = (np.asarray(x, dtype=float) for x in (a, b, t))
    diff = b - a
    with np.errstate(invalid="ignore"):
        out = np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
    return np.where(a == b, a, out)


@dataclass(frozen=True)
class Rank:
    """An order statistic to select per group: ``kind`` "below"/"above" (the neighbours of the linear
    quantile ``q``; "below" is the largest value <= the quantile, "above" the smallest value >= it) or
    "top" (the ``k``-th largest value)."""

    kind: str
    q: float = 0.0
    k: int = 0

    def of(self, count: np.ndarray) -> np.ndarray:
        count = np.asarray(count, dtype=np.int64)
        if self.kind == "top":
            return np.maximum(count - self.k, 0)
        below, above, weight = quantile_ranks(count, self.q)
        if self.kind == "below":
            return below
        return np.where(weight > 0, above, below)


class Table:
    """A table DuckDB reads on one connection (the run's ``rows`` view, or a table derived from it), and the
    questions readers ask of it.  ``where`` arguments are SQL predicates (see :func:`where`); ``by`` is a
    list of groupings, each a tuple of column names; ``columns`` defines further columns by SQL expression
    (``{"bin": "floor(query / 8)"}``) that groupings and values may use."""

    def __init__(self, connection, relation: str, path: Path | None = None):
        self.connection = connection
        #: the SQL name (or parenthesised query) this table is read from
        self.relation_name = relation
        #: where the data lives, for error messages
        self.path = path

    # ---- running SQL

    def execute(self, query: str, parameters=None):
        """Run ``query``; DuckDB's errors from unreadable data or a full memory become :class:`ProbeError`."""
        with self._guard():
            if parameters is None:
                return self.connection.execute(query)
            return self.connection.execute(query, parameters)

    @contextmanager
    def _guard(self):
        import duckdb

        try:
            yield
        except duckdb.OutOfMemoryException as error:
            raise over_budget(error, "The query", "or ask for fewer groups") from None
        except (duckdb.IOException, duckdb.InvalidInputException) as error:
            where_text = f" in {self.path}" if self.path is not None else ""
            raise ProbeError(
                f"Cannot read the data{where_text} ({str(error).splitlines()[0]}). Re-run `probe run`; a run "
                "killed before it finished can leave a parquet file without its footer (`probe verify RUN` "
                "names it, `probe resume RUN` repairs it)."
            ) from None

    def frame(self, query: str) -> pd.DataFrame:
        """The result of ``query`` as a pandas DataFrame (through Arrow, as ``pyarrow.Table.to_pandas`` types it)."""
        with self._guard():
            return self.connection.sql(query).to_arrow_table().to_pandas()

    def _from(self, where_sql: str = "TRUE", columns: Mapping[str, str] | None = None) -> str:
        extra = "".join(f", {expression} AS {name(column)}" for column, expression in (columns or {}).items())
        return f"(SELECT *{extra} FROM {self.relation_name} WHERE {where_sql})"

    # ---- plain aggregates

    def aggregate(self, aggregates: Mapping[str, str], by: Sequence[Sequence[str]], where: str = "TRUE", *,
                  columns: Mapping[str, str] | None = None) -> list[pd.DataFrame]:
        """SQL ``aggregates`` (name -> expression, e.g. ``{"rows": "count(*)"}``) for each grouping in ``by``,
        in one pass (grouping sets); one DataFrame per grouping: its keys, then the aggregates."""
        groupings = [tuple(keys) for keys in by]
        union = list(dict.fromkeys(k for keys in groupings for k in keys))
        keys_sql = ", ".join(name(k) for k in union)
        sets = ", ".join("(" + ", ".join(["_all", *(name(k) for k in keys)]) + ")" for keys in groupings)
        selected = ", ".join(f"{expression} AS {name(column)}" for column, expression in aggregates.items())
        query = (
            f"SELECT GROUPING(_all{''.join(', ' + name(k) for k in union)}) AS _gid"
            f"{', ' + keys_sql if union else ''}, {selected} "
            f"FROM (SELECT *, 0 AS _all FROM {self._from(where, columns)}) GROUP BY GROUPING SETS ({sets})"
        )
        result = self.frame(query)
        out = []
        for keys in groupings:
            part = result[result["_gid"] == _grouping_id(union, keys)]
            out.append(part[list(keys) + list(aggregates)].sort_values(list(keys)).reset_index(drop=True)
                       if keys else part[list(aggregates)].reset_index(drop=True))
        return out

    # ---- exact statistics

    def stats(self, value: str, by: Sequence[Sequence[str]], where: str = "TRUE", *,
              quantiles: Mapping[str, float] | None = None, ranks: Mapping[str, Rank] | None = None,
              above: Mapping[str, float] | None = None, columns: Mapping[str, str] | None = None,
              distinct: bool = False, needed=None) -> list[pd.DataFrame]:
        """Statistics of the non-null values of ``value`` (a column or SQL expression) for each grouping in
        ``by``: ``count``, ``mean``, ``min``, ``max``, the share above each threshold of ``above`` (name ->
        threshold), each linear quantile of ``quantiles`` (name -> q, exactly pandas' ``quantile(q)``) and
        each order statistic of ``ranks`` (name -> :class:`Rank`); with ``distinct``, ``intervals`` (pass 1's
        value intervals: at most the number of distinct values) and ``distinct`` (the number of distinct
        values where every interval holds one, else NaN).  ``needed(name, grouping, table)``, if given, says
        which groups (a boolean mask over ``table``, the grouping's counts) need the quantile or rank
        ``name``: the others get NaN, and pass 2 reads less.  Two passes over the table whatever the
        groupings (module docstring); groups without a value are absent.  One DataFrame per grouping, in key
        order."""
        groupings = [tuple(keys) for keys in by]
        union = list(dict.fromkeys(k for keys in groupings for k in keys))
        thresholds = dict(above or {})
        source = f"(SELECT *, ({value}) AS _v FROM {self._from(where, columns)} WHERE ({value}) IS NOT NULL)"
        finest = self._histogram_pass(source, union, thresholds)
        wanted = {**{n: (Rank("below", q), Rank("above", q)) for n, q in (quantiles or {}).items()},
                  **{n: (r,) for n, r in (ranks or {}).items()}}
        every_rank = list(dict.fromkeys(r for rs in wanted.values() for r in rs))
        cells = finest.to_pandas()
        parts = [_Grouping(_roll_up(cells, keys, thresholds), keys, thresholds, distinct) for keys in groupings]
        for j, part in enumerate(parts):
            masks = np.ones((len(part.table), len(every_rank)), dtype=bool)
            if needed is not None:
                masks[:] = False
                for statistic, rs in wanted.items():
                    mask = np.asarray(needed(statistic, j, part.table), dtype=bool)
                    for r in rs:
                        masks[:, every_rank.index(r)] |= mask
            part.locate(every_rank, masks)
        self._read_ranks(source, union, finest, parts)
        out = []
        for part in parts:
            table = part.table
            for column, rs in wanted.items():
                if len(rs) == 2:  # a linear quantile: its two neighbours, weighted
                    _, _, weight = quantile_ranks(table["count"].to_numpy(), quantiles[column])
                    below, above_ = (part.values[:, every_rank.index(r)] for r in rs)
                    table[column] = lerp(below, above_, weight)
                else:
                    table[column] = part.values[:, every_rank.index(rs[0])]
            out.append(table)
        return out

    def _histogram_pass(self, source: str, union: list[str], thresholds):
        """Pass 1: per group of the finest grouping (every key) and bin, count, sum, min, max and counts
        above thresholds, as an Arrow table (coarser groupings add these up: :func:`_roll_up`)."""
        keys_sql = "".join(name(k) + ", " for k in union)
        above = "".join(f", CAST(count_if(_v > {literal(t)}) AS BIGINT) AS {name('_above_' + n)}"
                        for n, t in thresholds.items())
        with self._guard():
            return self.connection.sql(
                f"SELECT {keys_sql}_b, CAST(count(*) AS BIGINT) AS _n, fsum(_v) AS _s, min(_v) AS _lo, max(_v) AS _hi"
                f"{above} FROM (SELECT {keys_sql}_v, {_log_bin('_v')} AS _b FROM {source}) GROUP BY ALL"
            ).to_arrow_table()

    def _read_ranks(self, source, union, finest, parts) -> None:
        """Pass 2: the order statistics pass 1 could not place, read from the values of the intervals that
        hold them (one scan for every grouping), sorted, the ranks picked.  While those values are more than
        :func:`read_limit`, the largest intervals are first split into :data:`SPLIT_BINS` equal sub-bins,
        all in one more scan, and the sub-bins that hold the ranks replace them."""
        import pyarrow as pa

        if not any(len(part.pending) for part in parts):
            return
        cells = finest.select(union + ["_b"]).to_pandas()
        nodes, members, targets = [], [], []  # intervals to read; their finest cells; the ranks wanted in them
        for j, part in enumerate(parts):
            if not len(part.pending):
                continue
            wanted = np.unique(part.pending[:, 0])
            keys = list(part.keys) + ["_b"]
            mine = part.cells[np.isin(part.interval_of_cell, wanted)][keys].assign(
                _interval=part.interval_of_cell[np.isin(part.interval_of_cell, wanted)])
            cell_of = cells[keys].reset_index(names="_cell").merge(mine, on=keys)
            first = sum(len(n) for n in nodes)
            node = {int(i): first + k for k, i in enumerate(wanted)}
            nodes.append(pd.DataFrame({"_n": part.n[wanted], "_lo": part.lo[wanted], "_hi": part.hi[wanted]}))
            members.append(pd.DataFrame({"_node": cell_of["_interval"].map(node).to_numpy(),
                                         "_cell": cell_of["_cell"].to_numpy()}))
            targets.append(pd.DataFrame({"_node": [node[int(i)] for i in part.pending[:, 0]],
                                         "_inner": part.pending[:, 3], "_part": j, "_group": part.pending[:, 1],
                                         "_rank": part.pending[:, 2]}))
        nodes = pd.concat(nodes, ignore_index=True)
        members = pd.concat(members, ignore_index=True)
        targets = pd.concat(targets, ignore_index=True)
        limit = read_limit()
        for _ in range(64):
            targets = self._place(parts, nodes, targets)
            active = nodes.loc[np.unique(targets["_node"])]
            if active.empty or active["_n"].sum() <= limit:
                break
            big = active[(active["_n"] > max(limit // len(active), 1)) & (active["_lo"] < active["_hi"])]
            if big.empty:
                break
            nodes, members, targets = self._split(source, union, finest, nodes, members, targets, big)
        if targets.empty:
            return
        values = self._node_values(source, union, finest, nodes, members, np.unique(targets["_node"]),
                                   "SELECT m._node, s._v", "")
        node, value = np.asarray(values["_node"], dtype=np.int64), np.asarray(values["_v"], dtype=float)
        order = np.lexsort((value, node))
        node, value = node[order], value[order]
        start = np.searchsorted(node, targets["_node"].to_numpy(), side="left")
        counted = np.searchsorted(node, targets["_node"].to_numpy(), side="right") - start
        if (counted != nodes["_n"].to_numpy()[targets["_node"].to_numpy()]).any():
            raise RuntimeError("pass 2 read other values than pass 1 counted")
        self._fill(parts, targets, value[start + targets["_inner"].to_numpy()])

    @staticmethod
    def _fill(parts, targets: pd.DataFrame, values: np.ndarray) -> None:
        for j, rows in targets.assign(_value=values).groupby("_part"):
            parts[j].values[rows["_group"].to_numpy(), rows["_rank"].to_numpy()] = rows["_value"].to_numpy()

    def _place(self, parts, nodes: pd.DataFrame, targets: pd.DataFrame) -> pd.DataFrame:
        """Fill in the targets whose value is known without reading (the node's first or last value, or a
        node of one value); return the others."""
        n = nodes["_n"].to_numpy()[targets["_node"].to_numpy()]
        low = nodes["_lo"].to_numpy()[targets["_node"].to_numpy()]
        high = nodes["_hi"].to_numpy()[targets["_node"].to_numpy()]
        inner = targets["_inner"].to_numpy()
        last = inner == n - 1
        known = (low == high) | (inner == 0) | last
        self._fill(parts, targets[known], np.where(last, high, low)[known])
        return targets[~known].reset_index(drop=True)

    def _node_values(self, source, union, finest, nodes, members, wanted, select: str, group: str):
        """``select`` over the values of the nodes ``wanted``: the rows of their finest cells whose value lies
        in the node's range, each row once per node it belongs to (``m._node``, ``m._lo``, ``m._hi``)."""
        import pyarrow as pa

        chosen = members[members["_node"].isin(wanted)]
        table = finest.select(union + ["_b"]).take(pa.array(chosen["_cell"].to_numpy()))
        table = table.append_column("_node", pa.array(chosen["_node"].to_numpy(), pa.int64()))
        table = table.append_column("_lo", pa.array(nodes["_lo"].to_numpy()[chosen["_node"].to_numpy()]))
        table = table.append_column("_hi", pa.array(nodes["_hi"].to_numpy()[chosen["_node"].to_numpy()]))
        nullable = {k for k in union if table.column(k).null_count}
        view = f"_nodes_{next(_views)}"
        self.connection.register(view, table)
        try:
            on = " AND ".join([f"s.{name(k)} IS NOT DISTINCT FROM m.{name(k)}" if k in nullable
                               else f"s.{name(k)} = m.{name(k)}" for k in union] + ["s._b = m._b"])
            bins = ", ".join(sorted({repr(float(b)) for b in table.column("_b").to_pylist()}))
            with self._guard():
                return self.connection.sql(
                    f"{select} FROM (SELECT * FROM (SELECT {''.join(name(k) + ', ' for k in union)}_v, "
                    f"{_log_bin('_v')} AS _b FROM {source}) WHERE _b IN ({bins})) s JOIN {view} m ON {on} "
                    f"WHERE s._v BETWEEN m._lo AND m._hi {group}"
                ).fetchnumpy()
        finally:
            self.connection.unregister(view)

    def _split(self, source, union, finest, nodes, members, targets, big):
        """One scan: each node of ``big`` counted in :data:`SPLIT_BINS` equal sub-bins of its range (a
        non-decreasing function of the value, so the counts below a sub-bin are exact); the sub-bin that
        holds each target becomes its node."""
        sub = (f"CAST(least(floor((s._v - m._lo) / (m._hi - m._lo) * {SPLIT_BINS}), {SPLIT_BINS - 1}) AS BIGINT)")
        counted = pd.DataFrame(self._node_values(
            source, union, finest, nodes, members, big.index.to_numpy(),
            f"SELECT m._node, {sub} AS _sub, count(*) AS _n, min(s._v) AS _lo, max(s._v) AS _hi", "GROUP BY ALL"))
        counted = counted.sort_values(["_node", "_sub"], ignore_index=True)
        counted["_new"] = len(nodes) + np.arange(len(counted))
        ends = counted.groupby("_node")["_n"].cumsum().to_numpy()
        moving = targets["_node"].isin(big.index).to_numpy()
        moved = targets[moving]
        first = np.searchsorted(counted["_node"].to_numpy(), moved["_node"].to_numpy(), side="left")
        last = np.searchsorted(counted["_node"].to_numpy(), moved["_node"].to_numpy(), side="right")
        # within each node's sub-bins, the one whose cumulative count passes the target's rank
        at = np.array([f + int(np.searchsorted(ends[f:l], inner, side="right"))
                       for f, l, inner in zip(first, last, moved["_inner"].to_numpy())], dtype=np.int64)
        below = ends[at] - counted["_n"].to_numpy()[at]
        targets = pd.concat([targets[~moving], moved.assign(_node=counted["_new"].to_numpy()[at],
                                                             _inner=moved["_inner"].to_numpy() - below)],
                            ignore_index=True)
        new_nodes = counted[["_n", "_lo", "_hi"]]
        nodes = pd.concat([nodes, new_nodes], ignore_index=True)
        inherited = members.merge(counted[["_node", "_new"]], on="_node")[["_new", "_cell"]].rename(
            columns={"_new": "_node"})
        return nodes, pd.concat([members, inherited], ignore_index=True), targets

    # ---- bins and rows

    def histogram(self, value: str, edges, by: Sequence[str] = (), where: str = "TRUE", *,
                  columns: Mapping[str, str] | None = None) -> pd.DataFrame:
        """Counts of ``value`` in the equal-width bins ``edges`` per group of ``by``, exactly as
        ``numpy.histogram(values, bins=edges)`` counts them: columns ``by``, ``bin`` (0-based), ``count``
        (empty bins absent)."""
        keys = "".join(name(k) + ", " for k in by)
        return self.frame(
            f"SELECT {keys}_bin AS bin, count(*) AS count FROM (SELECT {keys}{edges_bin('_x', edges, '_g')} AS _bin "
            f"FROM (SELECT {keys}_x, {edges_guess('_x', edges)} AS _g FROM (SELECT {keys}({value}) AS _x FROM "
            f"{self._from(where, columns)}))) WHERE _bin IS NOT NULL GROUP BY ALL ORDER BY ALL"
        )

    def histogram2d(self, x: str, y: str, x_edges, y_edges, where: str = "TRUE") -> np.ndarray:
        """The counts of ``numpy.histogram2d(x, y, bins=[x_edges, y_edges])`` (equal-width edges), rows x."""
        counts = np.zeros((len(x_edges) - 1, len(y_edges) - 1), dtype=np.int64)
        cells = self.frame(
            f"SELECT _bx, _by, count(*) AS n FROM (SELECT {edges_bin('_x', x_edges, '_gx')} AS _bx, "
            f"{edges_bin('_y', y_edges, '_gy')} AS _by FROM (SELECT _x, _y, {edges_guess('_x', x_edges)} AS _gx, "
            f"{edges_guess('_y', y_edges)} AS _gy FROM (SELECT ({x}) AS _x, ({y}) AS _y FROM {self._from(where)}))) "
            "WHERE _bx IS NOT NULL AND _by IS NOT NULL GROUP BY ALL"
        )
        counts[cells["_bx"].to_numpy(dtype=np.int64), cells["_by"].to_numpy(dtype=np.int64)] = cells["n"].to_numpy()
        return counts

    def top_rows(self, value: str, k: int, by: Sequence[str], where: str = "TRUE", *, columns: Sequence[str] = (),
                 order: Sequence[str] = (), thresholds: pd.DataFrame | None = None) -> pd.DataFrame:
        """The ``k`` rows of largest ``value`` per group of ``by`` (ties: smallest ``order`` first), with
        ``by``, ``value`` and ``columns``.  ``thresholds``: per group the ``k``-th largest value (the
        ``Rank("top", k=k)`` of :meth:`stats`), if known; computed otherwise.  One more pass."""
        if thresholds is None:
            (thresholds,) = self.stats(value, [tuple(by)], where, ranks={"threshold": Rank("top", k=k)})
        thresholds = thresholds[list(by) + ["threshold"]]
        if thresholds.empty:
            return pd.DataFrame(columns=list(dict.fromkeys([*by, value, *columns])))
        import pyarrow as pa

        view = f"_thresholds_{id(thresholds)}"
        self.connection.register(view, pa.Table.from_pandas(thresholds, preserve_index=False))
        try:
            on = " AND ".join(f"r.{name(b)} IS NOT DISTINCT FROM t.{name(b)}" for b in by)
            wanted = list(dict.fromkeys([*by, value, *columns, *order]))
            rows = self.frame(
                f"SELECT {', '.join('r.' + name(c) for c in wanted)} FROM {self._from(where)} r JOIN {view} t "
                f"ON {on or 'TRUE'} WHERE r.{name(value)} >= t.threshold"
            )
        finally:
            self.connection.unregister(view)
        rows = rows.sort_values([value, *order], ascending=[False] + [True] * len(order), kind="stable")
        return rows.groupby(list(by), sort=False, dropna=False).head(k).reset_index(drop=True)


def _grouping_id(union: Sequence[str], keys: Sequence[str]) -> int:
    """DuckDB's ``GROUPING(_all, union...)`` of the grouping set ``keys``: a bit per key left out."""
    bits = [0] + [0 if k in keys else 1 for k in union]
    return int("".join(map(str, bits)), 2)


_views = itertools.count()


def _roll_up(cells: pd.DataFrame, keys: Sequence[str], thresholds: Mapping[str, float]) -> pd.DataFrame:
    """Pass 1's cells of the finest grouping added up to the grouping ``keys`` (per group and bin)."""
    keys = list(keys) + ["_b"]
    measures = ["_n", "_s", "_lo", "_hi"] + [f"_above_{n}" for n in thresholds]
    if set(keys) == set(cells.columns) - set(measures):  # the finest grouping itself
        return cells
    sums = {c: (c, "sum") for c in ["_n", "_s"] + [f"_above_{n}" for n in thresholds]}
    return cells.groupby(keys, sort=False, dropna=False, observed=True).agg(
        **sums, _lo=("_lo", "min"), _hi=("_hi", "max")).reset_index()


class _Grouping:
    """Pass 1's bins of one grouping, as each group's disjoint value intervals in value order.

    Bins whose value ranges overlap (a rounding of log2 at a bin's edge) are merged into one interval, so
    the counts below an interval are exact whatever the binning.  ``table``: the groups' keys, ``count``,
    ``mean``, ``min``, ``max`` and shares above thresholds.  After :meth:`locate`, ``values`` (groups x
    ranks) holds every order statistic pass 1 already knows and ``pending`` the rest: rows of (interval,
    group, rank, rank within the interval) for pass 2.
    """

    def __init__(self, cells: pd.DataFrame, keys: Sequence[str], thresholds: Mapping[str, float],
                 distinct: bool = False):
        self.keys = tuple(keys)
        cells = cells.sort_values(list(self.keys) + ["_lo"], kind="stable", na_position="last").reset_index(drop=True)
        self.cells = cells
        group = (cells.groupby(list(self.keys), sort=False, dropna=False).ngroup().to_numpy() if self.keys
                 else np.zeros(len(cells), dtype=np.int64))
        lo, hi = cells["_lo"].to_numpy(dtype=float), cells["_hi"].to_numpy(dtype=float)
        new_group = np.r_[True, group[1:] != group[:-1]] if len(cells) else np.array([], dtype=bool)
        if len(cells) < 2 or (new_group[1:] | (lo[1:] > hi[:-1])).all():
            self.interval_of_cell = np.arange(len(cells))  # the usual case: the bins are disjoint intervals
        else:
            previous = pd.Series(hi).groupby(group).cummax().groupby(group).shift().to_numpy()
            self.interval_of_cell = np.cumsum(new_group | ~(lo <= previous)) - 1
        starts = np.flatnonzero(np.r_[True, self.interval_of_cell[1:] != self.interval_of_cell[:-1]]) \
            if len(cells) else np.array([], dtype=np.int64)
        n = cells["_n"].to_numpy(dtype=np.int64)
        reduce = lambda f, x, at: f.reduceat(x, at) if len(at) else x[:0]  # noqa: E731
        self.n, self.lo = reduce(np.add, n, starts), reduce(np.minimum, lo, starts)
        self.hi = reduce(np.maximum, hi, starts)
        self.group = group[starts] if len(starts) else group[:0]
        firsts = np.flatnonzero(new_group)
        table = cells.iloc[firsts][list(self.keys)].reset_index(drop=True)
        table["count"] = reduce(np.add, n, firsts)
        table["mean"] = reduce(np.add, cells["_s"].to_numpy(dtype=float), firsts) / np.maximum(table["count"], 1)
        table["min"], table["max"] = reduce(np.minimum, lo, firsts), reduce(np.maximum, hi, firsts)
        for label in thresholds:
            table[label] = reduce(np.add, cells[f"_above_{label}"].to_numpy(dtype=np.int64), firsts) / table["count"]
        if distinct:  # each interval of one value is one distinct value
            first_interval = np.searchsorted(self.group, np.arange(len(table)))
            table["intervals"] = np.diff(np.r_[first_interval, len(self.group)])
            several = reduce(np.add, (self.lo < self.hi).astype(np.int64), first_interval)
            table["distinct"] = np.where(several == 0, table["intervals"], np.nan)
        self.table = table
        self.values = np.full((len(table), 0), np.nan)
        self.pending = np.zeros((0, 4), dtype=np.int64)

    def locate(self, ranks: Sequence["Rank"], masks: np.ndarray | None = None) -> None:
        """Place every group's order statistic of each rank (where ``masks``, groups x ranks, asks for it):
        its value where pass 1 knows it (an interval of one value, or the interval's first or last value),
        else a ``pending`` row for pass 2."""
        n_groups = len(self.table)
        self.values = np.full((n_groups, len(ranks)), np.nan)
        if not n_groups or not ranks:
            return
        ends = np.cumsum(self.n)
        first = np.searchsorted(self.group, np.arange(n_groups), side="left")
        start = ends[first] - self.n[first]
        wanted = np.stack([rank.of(self.table["count"].to_numpy()) for rank in ranks], axis=1)  # groups x ranks
        index = np.searchsorted(ends, start[:, None] + wanted, side="right")
        inner = start[:, None] + wanted - (ends[index] - self.n[index])
        low, high, size = self.lo[index], self.hi[index], self.n[index]
        last = inner == size - 1
        known = (low == high) | (inner == 0) | last
        self.values[known] = np.where(last, high, low)[known]
        if masks is not None:
            self.values[~masks] = np.nan
            known |= ~masks
        group, rank = np.nonzero(~known)
        self.pending = np.stack([index[group, rank], group, rank, inner[group, rank]], axis=1).astype(np.int64)


# --------------------------------------------------------------------------------------------------
# a run's deviations table


#: columns the report cannot do without
NEEDED_COLUMNS = ("attention_type", "layer", "head", "example", "query", "rel_deviation", "converged")
#: columns runs written by older versions lack (read as nulls; ``trivial`` then comes from ``n_keys``)
OPTIONAL_COLUMNS = (
    "alpha", "space", "n_keys", "trivial", "token", "token_role", "second_order_deviation",
    "attention_tv", "output_deviation", "evidence_norm", "attention_entropy",
)
#: columns of runs written by older versions, read when present: ``model`` (the model on every row; runs
#: now name it once, in the manifest)
LEGACY_COLUMNS = ("model",)
#: the view's name for readers' SQL
ROWS = "rows"
RUN_HINT = "Re-run `probe run`; a run killed before it finished can leave a parquet file without its footer."
#: bytes a row takes as a pandas DataFrame of every column (measured: 550 at 3.65M rows, sort included)
ROW_BYTES = 600
#: bytes per value of one column of a pandas slice, by kind (strings: a Python object each)
VALUE_BYTES = {"string": 64, "boolean": 1}


def _kind(arrow_type) -> str:
    """Coarse kind of an Arrow type (dictionary-encoded columns count as their values)."""
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    for kind, test in (
        ("boolean", pa.types.is_boolean),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("null", pa.types.is_null),
    ):
        if test(arrow_type):
            return kind
    return str(arrow_type)


_SQL_TYPES = {"string": "VARCHAR", "integer": None, "floating": "DOUBLE", "boolean": "BOOLEAN"}


def _sql_type(arrow_type) -> str:
    import pyarrow as pa

    if pa.types.is_int64(arrow_type):
        return "BIGINT"
    if pa.types.is_integer(arrow_type):
        return "INTEGER"
    return _SQL_TYPES[_kind(arrow_type)]


class RunTable(Table):
    """A run's deviations table as the DuckDB view ``rows`` (module docstring): lazy, read in place.

    >>> table = RunTable.open("runs/all-MiniLM-L6-v2-20261125-101500")
    >>> table.sql("SELECT layer, head, avg(rel_deviation) FROM rows WHERE NOT trivial GROUP BY ALL").df()
    >>> table.stats("rel_deviation", [("layer", "head")], where(alpha=1.0, trivial=False),
    ...             quantiles={"median": 0.5, "p95": 0.95})[0]
    """

    def __init__(self, path: str | Path, files: Iterable[str | Path] | None = None, *, connection=None,
                 view: str = ROWS, check=None):
        path = Path(path)
        self.files = sorted(str(f) for f in files) if files is not None else (
            sorted(str(p) for p in path.iterdir() if re.match(r"^part-\d+\.parquet$", p.name)) if path.is_dir()
            else [str(path)])
        #: the check of the run's parts (:class:`probe.storage.PartsCheck`), when the table was opened from a run
        self.check = check
        self.schema, self._same_columns = _checked_schema(path, self.files)
        super().__init__(connection if connection is not None else connect(), name(view), path)
        self._owns_connection = connection is None
        self.view = view
        self._scratch: Path | None = None
        self.execute(f"CREATE OR REPLACE TEMP VIEW {name(view)} AS {self._view_sql()}")

    @classmethod
    def open(cls, run_dir: str | Path, *, allow_damaged: bool = False, manifest: dict | None = None,
             connection=None, view: str = ROWS) -> "RunTable":
        """A run directory's table after :func:`probe.storage.require_intact`: a damaged run is refused
        unless ``allow_damaged`` (then its intact parts are read and :attr:`check` says what is left out).
        A single ``deviations.parquet`` file (runs of older versions, exports) is read as it is."""
        from .storage import PARTS, require_intact

        run_dir = Path(run_dir)
        path = run_dir / PARTS
        if path.is_dir():
            check = require_intact(run_dir, manifest, allow_damaged=allow_damaged)
            return cls(path, check.readable.values(), connection=connection, view=view, check=check)
        return cls(path, connection=connection, view=view)

    def _view_sql(self) -> str:
        from .schema import DEVIATION_SCHEMA

        present = set(self.schema.names) if self.schema is not None else set()
        columns = []
        for field in DEVIATION_SCHEMA:
            sql_type = _sql_type(field.type)
            if field.name not in present:
                expression = f"CAST(NULL AS {sql_type})"
            elif sql_type == "DOUBLE":
                column = name(field.name)
                expression = f"CASE WHEN isnan({column}) THEN NULL ELSE CAST({column} AS DOUBLE) END"
            else:
                expression = f"CAST({name(field.name)} AS {sql_type})"
            columns.append((field.name, expression))
        columns = dict(columns)
        columns["trivial"] = f"coalesce({columns['trivial']}, {columns['n_keys']} = 1, FALSE)"
        columns["converged"] = f"coalesce({columns['converged']}, FALSE)"
        for legacy in LEGACY_COLUMNS:
            if legacy in present:
                columns[legacy] = f"CAST({name(legacy)} AS VARCHAR)"
        selected = ", ".join(f"{expression} AS {name(column)}" for column, expression in columns.items())
        if not self.files:
            return f"SELECT {selected} FROM (SELECT 1) WHERE FALSE"
        return f"SELECT {selected} FROM {parquet_source(self.files, union_by_name=not self._same_columns)}"

    # ---- the lazy handle

    def sql(self, query: str):
        """``query`` as a lazy DuckDB relation (``.df()``, ``.arrow()``, ``.fetchall()``, or more SQL on it);
        the run's rows are the view ``rows``."""
        return self.connection.sql(query)

    @property
    def relation(self):
        """The rows as a lazy DuckDB relation (``.filter(...)``, ``.aggregate(...)``, ``.df()``)."""
        return self.connection.view(self.view)

    @property
    def stored_columns(self) -> list[str]:
        """The columns the part files hold, in their order (the ``model`` column of old runs left out)."""
        return [c for c in (self.schema.names if self.schema is not None else []) if c not in LEGACY_COLUMNS]

    def count(self, where_sql: str = "TRUE") -> int:
        """The number of rows satisfying ``where_sql``."""
        return int(self.execute(f"SELECT count(*) FROM {self.relation_name} WHERE {where_sql}").fetchall()[0][0])

    def row_count(self) -> int:
        """Every row of the run, from the part files' footers (reads no rows)."""
        if not self.files:
            return 0
        source = parquet_source(self.files, union_by_name=not self._same_columns)
        return int(self.execute(f"SELECT count(*) FROM {source}").fetchall()[0][0])

    def estimated_bytes(self, rows: int, columns: Sequence[str] | None = None) -> int:
        """What ``rows`` rows of ``columns`` (default: every stored column) take as a pandas DataFrame."""
        if columns is None:
            return rows * ROW_BYTES
        kinds = {f.name: _kind(f.type) for f in self.schema} if self.schema is not None else {}
        per_row = sum(VALUE_BYTES.get(kinds.get(c, "floating"), 8) for c in columns)
        return rows * 2 * per_row  # the Arrow result and the DataFrame, side by side

    def select(self, where_sql: str = "TRUE", columns: Sequence[str] | None = None, *,
               order: Sequence[str] | None = None, what: str = "this slice") -> pd.DataFrame:
        """The rows satisfying ``where_sql`` as a pandas DataFrame (``columns``: default every stored column),
        sorted by ``order`` (default the row key), with a fresh index; refused with a :class:`ProbeError`
        naming the lazy way when its estimated size exceeds :func:`memory_budget`."""
        from .schema import ROW_KEY

        columns = list(columns) if columns is not None else self.stored_columns
        order = list(ROW_KEY if order is None else order)
        rows = self.count(where_sql)
        self.require_fits(rows, columns, what)
        ordering = ", ".join(name(c) for c in order)
        return self.frame(
            f"SELECT {', '.join(name(c) for c in columns)} FROM {self.relation_name} WHERE {where_sql}"
            + (f" ORDER BY {ordering}" if ordering else "")
        )

    def require_fits(self, rows: int, columns: Sequence[str] | None, what: str) -> None:
        """Refuse (:class:`ProbeError`) to load ``rows`` rows of ``columns`` when that exceeds the budget."""
        needed, budget = self.estimated_bytes(rows, columns), memory_budget()
        if needed > budget:
            raise ProbeError(
                f"Loading {what} ({rows:,} rows) as a pandas DataFrame would take about {_size(needed)}, more "
                f"than the memory budget of {_size(budget)} ({MEMORY_BUDGET_ENV}). Ask lazily instead: "
                "`run.sql(\"SELECT layer, head, avg(rel_deviation) FROM rows GROUP BY ALL\").df()` (DuckDB over "
                "the part files), `run.query.stats(...)` for exact quantiles, or a smaller slice with "
                "`run.select(space=..., alpha=..., layer=..., head=..., columns=[...])`; or raise the budget, "
                f"e.g. {MEMORY_BUDGET_ENV}=8GB."
            )

    def sample(self, columns: Sequence[str], where_sql: str, rows: int, key: Sequence[str], *,
               total: int | None = None) -> tuple[pd.DataFrame, int]:
        """Every row satisfying ``where_sql`` when at most ``rows`` do, else a deterministic sample of about
        ``rows`` of them (each row kept by the hash of its ``key``); returns the frame and the number of rows
        sampled from (``total``, if known, saves counting them)."""
        total = self.count(where_sql) if total is None else total
        selected = ", ".join(name(c) for c in columns)
        if total <= rows:
            return self.frame(f"SELECT {selected} FROM {self.relation_name} WHERE {where_sql}"), total
        keep = max(1, math.ceil(rows / total * 1_000_000))
        hashed = f"hash({', '.join(name(k) for k in key)}) % 1000000 < {keep}"
        return self.frame(f"SELECT {selected} FROM {self.relation_name} WHERE {both(where_sql, hashed)}"), total

    # ---- derived tables

    def derive(self, table: str, query: str) -> Table:
        """The result of ``query`` written once as a Parquet file in this table's scratch directory (on disk,
        so that it does not hold memory) and read back as a :class:`Table`."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="probe-query-"))
        path = self._scratch / f"{table}.parquet"
        self.execute(f"COPY ({query}) TO '{_sql_string(str(path))}' (FORMAT parquet, ROW_GROUP_SIZE 1000000)")
        return Table(self.connection, f"read_parquet('{_sql_string(str(path))}')", path)

    def close(self) -> None:
        """Close the connection (when this table opened it) and remove derived tables."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._owns_connection:
            self.connection.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # a derived table's files do not outlive the table
        scratch = getattr(self, "_scratch", None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _size(n: int) -> str:
    for unit, factor in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} bytes"


def _checked_schema(path: Path, files: list[str]):
    """The Arrow schema of the part files (the first file's, as pyarrow's dataset reads it), checked: the
    needed columns exist and every column has the schema's kind; a clear :class:`ProbeError` otherwise.
    And whether every file has the same columns (read from each footer: a run's parts normally do, but a
    run resumed by another version of probe may not).  ``(None, True)`` for a table without files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .schema import DEVIATION_SCHEMA

    if not files:
        return None, True
    try:
        schema = pq.read_schema(files[0])
        same = same_columns(files)
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read {path} as parquet ({error}). {RUN_HINT}") from None
    missing = [c for c in NEEDED_COLUMNS if c not in schema.names]
    if missing:
        raise ProbeError(
            f"{path} lacks the column(s) {', '.join(missing)} (it has: {', '.join(schema.names) or 'none'}). "
            "The report needs the deviations table written by `probe run`; re-run it with this version of probe."
        )
    wrong = [
        f"{c} is {schema.field(c).type}, expected {DEVIATION_SCHEMA.field(c).type}"
        for c in schema.names
        if c in DEVIATION_SCHEMA.names
        and _kind(schema.field(c).type) not in (_kind(DEVIATION_SCHEMA.field(c).type), "null")
    ]
    if wrong:
        raise ProbeError(f"{path} has columns of the wrong type: {'; '.join(wrong)}. Re-run `probe run`.")
    return schema, same
