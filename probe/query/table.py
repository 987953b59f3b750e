"""A table of rows as DuckDB sees it (:class:`Table`): grouped aggregates, exact quantiles in two passes,
histograms and top rows, in memory bounded by the budget."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from probe.core.errors import ProbeError
from probe.query.sql import (
    SPLIT_BINS,
    edges_bin,
    edges_guess,
    log_bin,
    read_limit,
)
from probe.store.engine import literal, name, over_budget


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
        with self._guard():
            arrow = self.connection.sql(query).to_arrow_table()
        result = arrow.to_pandas()
        import pyarrow as pa

        # a key is null in the other groupings' rows, so pandas reads an integer key as float: back to integers
        integers = {key for key in union if pa.types.is_integer(arrow.schema.field(key).type)}
        out = []
        for keys in groupings:
            part = result[result["_gid"] == _grouping_id(union, keys)]
            part = part[list(keys) + list(aggregates)].copy()
            for key in keys:
                if key in integers and not part[key].isna().any():
                    part[key] = part[key].astype("int64")
            out.append(part.sort_values(list(keys)).reset_index(drop=True) if keys else part.reset_index(drop=True))
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
                f"{above} FROM (SELECT {keys_sql}_v, {log_bin('_v')} AS _b FROM {source}) GROUP BY ALL"
            ).to_arrow_table()

    def _read_ranks(self, source, union, finest, parts) -> None:
        """Pass 2: the order statistics pass 1 could not place, read from the values of the intervals that
        hold them (one scan for every grouping), sorted, the ranks picked.  While those values are more than
        :func:`read_limit`, the largest intervals are first split into :data:`SPLIT_BINS` equal sub-bins,
        all in one more scan, and the sub-bins that hold the ranks replace them."""

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
                    f"{log_bin('_v')} AS _b FROM {source}) WHERE _b IN ({bins})) s JOIN {view} m ON {on} "
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


