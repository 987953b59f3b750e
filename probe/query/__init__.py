"""The one query layer over a run's tables (:mod:`probe.query.runs`, :mod:`probe.query.table`, :mod:`probe.query.sql`;
its DuckDB connections and memory budget: :mod:`probe.store.engine`): every reader (report, compare, the API, status, verify,
export) asks its questions here, through DuckDB over the run's checked part files, in memory that does not
grow with the number of rows.

What a reader gets.  :class:`RunTable` is a run's deviations table (its checked part files, or one
exported Parquet file) as the DuckDB view ``rows``: every column of :data:`probe.core.schema.DEVIATION_SCHEMA`,
absent ones as typed nulls, ``trivial`` filled in from ``n_keys`` where a run did not record it, and NaN
read as null (as pandas skips it).  On it:

* :meth:`RunTable.sql` and :attr:`RunTable.relation`: any SQL, lazily (a DuckDB relation);
* :meth:`Table.aggregate`: counts, sums, means, maxima of several groupings in one pass (grouping sets);
* :meth:`Table.stats`: count, mean, min, max, shares above thresholds and **exact** quantiles and order
  statistics of several groupings in two passes (see below);
* :meth:`Table.histogram`, :meth:`Table.histogram2d`: bin counts on given edges, exactly as
  ``numpy.histogram`` / ``numpy.histogram2d`` count them;
* :meth:`Table.top_rows`: the rows of largest value per group (the explorer's worst rows);
* :meth:`RunTable.select`: a filtered pandas slice, refused with a :class:`~probe.core.errors.ProbeError` before it would
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
those values are more than :func:`probe.query.sql.read_limit` (a share of the budget), the largest bins are first split
into :data:`probe.query.sql.SPLIT_BINS` equal sub-bins, all in one more pass, until they fit.  Every quantile is then
exactly numpy's and pandas' (the "linear" method: ``x[k] + (x[k+1] - x[k]) * f`` at ``k + f = q (n - 1)``),
and every order statistic the rank-th smallest value: no sketch, no rank error.

The memory budget.  :func:`memory_budget` is what one reader may hold: ``PROBE_MEMORY_BUDGET`` (bytes, or
with a unit: ``600MB``, ``1.5GiB``) or :data:`probe.store.engine.DEFAULT_MEMORY_BUDGET`.  DuckDB gets a share of it as its
``memory_limit``; readers that would materialise rows in pandas (``Run.rows``, :meth:`RunTable.select`)
compare their estimate with it and refuse, naming the lazy way, instead of being killed for memory.
"""

from probe.query.runs import RunTable
from probe.query.sql import both, where
from probe.query.table import Rank, Table
from probe.store.engine import memory_budget

#: what a reader calls; probe's own modules import the rest (columns, SQL helpers, the engine's settings)
#: from the modules that define them
__all__ = ["RunTable", "Table", "Rank", "where", "both", "memory_budget"]
