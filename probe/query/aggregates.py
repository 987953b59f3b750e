"""A run's aggregates as the report asks of them (:class:`AggregateTable`): the statistics, histograms and worst
rows that :class:`probe.query.RunTable` answers from the rows, answered from the mergeable statistics of a run made
with ``--keep aggregates`` or ``--keep sample:N`` (:mod:`probe.store.aggregates`).

What is exact and what is not.  Counts, trivial and non-converged counts, sums (hence means), sums of squares,
minima, maxima, shares above 0.1, the worst rows and every per-example, per-position and per-token count and sum
are exact (merged without loss).  Histograms are exact on the fixed bins (:data:`probe.store.aggregates.FINE_EDGES`);
re-binned onto other edges (:meth:`AggregateTable.histogram`) each fine bin counts where its centre falls, so a
count is exact to one fine bin (1/1024 below 4).  Quantiles of the relative deviation (and of its head-averaged
values) come from the merged KLL sketches: the value returned for quantile ``q`` of ``n`` values has a true rank
within ``RANK_ERROR * n`` of ``q n`` (:data:`probe.store.aggregates.RANK_ERROR`, 0.009 for the k of 300 used, with 99%
confidence).  Quantiles of the other quantities come from their fine histograms (exact to one fine bin).
"""

from __future__ import annotations

import warnings
from functools import cached_property
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from probe.core.errors import ProbeError
from probe.store import aggregates as stored
from probe.store.aggregates import (
    AVERAGED,
    FAR,
    FINE_BINS,
    FINE_EDGES,
    MERGED_RECORD,
    RANK_ERROR,
    AggregateState,
)
from probe.store.storage import AGGREGATES, part_files

#: how quantiles of an aggregates run are computed, as the report's page and summary.json say it
QUANTILE_METHOD = (f"Apache DataSketches' KLL sketch (k = {stored.KLL_K}), merged over batches, resumes and ranks: "
                   f"a quantile's true rank is within {RANK_ERROR:.4f} of the one asked for (normalized rank error, "
                   "99% confidence)")
#: the midpoints of the fine bins (the last one, open above, at its lower edge)
FINE_CENTRES = np.r_[(FINE_EDGES[:-2] + FINE_EDGES[1:-1]) / 2, FINE_EDGES[-2]]


def keeps(manifest: dict | None) -> str:
    """What a run kept (``--keep``): ``rows``, ``aggregates`` or ``sample:N``."""
    return str(((manifest or {}).get("config") or {}).get("keep", "rows"))


class AggregateTable:
    """A run's merged statistics (see the module): :meth:`census`, :meth:`stats`, :meth:`histogram`,
    :meth:`worst_rows` and the per-example, per-position and per-token tables, as frames shaped like the answers
    of :class:`probe.query.RunTable`.  ``check``: the check of its parts (None once merged into one file)."""

    def __init__(self, state: AggregateState, path: Path | None = None, *, check=None):
        self.state, self.path, self.check = state, path, check
        self._sketches: dict = {}

    @classmethod
    def open(cls, run_dir: str | Path, manifest: dict | None = None, *,
             allow_damaged: bool = False) -> "AggregateTable | None":
        """The aggregates of a run directory, checked like its parts (a damaged file refused by name, unless
        ``allow_damaged``: then its intact parts are read, with a warning); None for a run that kept its rows."""
        from probe.store.integrity import DamagedRunWarning, require_intact
        from probe.store.storage import read_manifest

        run_dir = Path(run_dir)
        manifest = read_manifest(run_dir) if manifest is None else manifest
        if keeps(manifest) == "rows":
            return None
        if manifest.get(MERGED_RECORD):
            problem = stored.merged_problem(run_dir, manifest)
            if problem is not None:
                raise ProbeError(
                    f"{run_dir} is damaged (its {AGGREGATES}): {AGGREGATES}/{stored.MERGED} ({problem}). Repair it "
                    f"with `probe resume {run_dir}` (it moves the damaged file to {run_dir / 'quarantine'} and "
                    f"recomputes the run's batches; `probe verify {run_dir}` checks every file).")
            path = stored.merged_path(run_dir)
            return cls(AggregateState.read(path), path)
        check = require_intact(run_dir, manifest, allow_damaged=allow_damaged, table=AGGREGATES)
        if check.damaged:
            warnings.warn(check.banner(), DamagedRunWarning, stacklevel=2)
        # the finished batches': a batch whose rows' part is not written yet is not finished (resume redoes it)
        finished = set(part_files(run_dir))
        state = stored.merge_files(path for batch, path in sorted(check.readable.items()) if batch in finished)
        return cls(state, run_dir / AGGREGATES, check=check)

    # ---- the tables

    @property
    def values(self) -> pd.DataFrame:
        return self.state["values"]

    def census(self) -> pd.DataFrame:
        """Rows of every kind per (space, alpha, attention type, layer, head), as :func:`probe.report.data.census`."""
        frame = self.state["census"].copy()
        for column in frame.columns:
            if column not in stored.SITE_KEYS + ("pairs_max", "space", "attention_type"):
                frame[column] = frame[column].astype(np.int64)
        frame["pairs_max"] = frame["pairs_max"].astype(float).where(np.isfinite(frame["pairs_max"].astype(float)))
        return frame.sort_values(list(stored.SITE_KEYS) + ["head"]).reset_index(drop=True)

    def _rows(self, column: str, where: Mapping | None) -> pd.DataFrame:
        frame = self.values
        frame = frame[frame["column"] == column]
        return _filtered(frame, where)

    # ---- statistics

    def stats(self, column: str, by: Sequence[Sequence[str]], where: Mapping | None = None, *,
              quantiles: Mapping[str, float] | None = None, ranks: Mapping | None = None,
              above: Mapping[str, float] | None = None, trivial: bool = False) -> list[pd.DataFrame]:
        """For each grouping of ``by``, the statistics of ``column`` (``rel_deviation``, ``layer_head_averaged`` or a
        quantity): ``count``, ``mean``, ``min``, ``max``, ``std``, the share above 0.1 (``above``: its names; 0.1 is
        the one threshold kept), the ``quantiles`` (name -> q) from the merged sketch, and ``ranks`` (name ->
        :class:`probe.query.Rank`: "below"/"above" read as the quantile ``q``, "top" the k-th largest, exact at the
        head level from the worst rows); ``trivial``: the trivial values' count too.  ``where``: equalities
        (``{"space": "hidden", "alpha": 1.0}``; alpha within 1e-12).  Groups without a value are absent."""
        for threshold in (above or {}).values():
            if not np.isclose(threshold, FAR):
                raise ProbeError(f"The aggregates keep the share above {FAR:g} only, not above {threshold!r}.")
        frame = self._rows(column, where)
        out = []
        for keys in by:
            keys = list(keys)
            if not len(frame):
                out.append(pd.DataFrame(columns=[*keys, "count", "mean", "min", "max", *(quantiles or {}),
                                                 *(ranks or {}), *(above or {})]))
                continue
            grouped = frame.groupby(keys, sort=True, dropna=False) if keys else [((), frame)]
            records = []
            for key, part in grouped:
                key = key if isinstance(key, tuple) else (key,)
                count = int(part["count"].sum())
                if not count and not trivial:
                    continue
                total, squares = float(part["sum"].sum()), float(part["sumsq"].sum())
                record = dict(zip(keys, key))
                record.update(count=count, mean=total / count if count else np.nan,
                              min=float(np.nanmin(part["min"].astype(float))) if count else np.nan,
                              max=float(np.nanmax(part["max"].astype(float))) if count else np.nan,
                              std=float(np.sqrt(max(squares - total * total / count, 0.0) / (count - 1)))
                              if count > 1 else np.nan)
                if trivial:
                    record["trivial"] = int(part["trivial"].sum())
                for name in above or {}:
                    record[name] = int(part["above"].sum()) / count if count else np.nan
                quantile = self._quantile(column, part, record) if (quantiles or ranks) and count else None
                for name, q in (quantiles or {}).items():
                    record[name] = quantile(q) if quantile is not None else np.nan
                for name, rank in (ranks or {}).items():
                    if rank.kind == "top":
                        record[name] = self._top(key, keys, rank.k, where) if count else np.nan
                    else:
                        record[name] = quantile(rank.q) if quantile is not None else np.nan
                records.append(record)
            columns = [*keys, "count", "mean", "min", "max", "std", *(["trivial"] if trivial else []),
                       *(above or {}), *(quantiles or {}), *(ranks or {})]
            result = pd.DataFrame.from_records(records, columns=columns)
            out.append(_integers(result, keys))
        return out

    def _quantile(self, column: str, part: pd.DataFrame, record: dict):
        """The function ``q -> quantile`` of the groups in ``part``: from their merged KLL sketch (the relative
        deviation and its head-averaged values), else from their fine histogram (the other quantities: exact to
        one fine bin, clipped to the group's exact extremes)."""
        key = (column, tuple(part.index))
        if key not in self._sketches:
            sketch = stored.merged_sketch(part["sketch"].to_numpy())
            if not sketch.is_empty():
                self._sketches[key] = lambda q: float(sketch.get_quantile(q))
            else:
                counts = np.zeros(FINE_BINS, dtype=np.int64)
                for bins, found in zip(part["bins"], part["counts"]):
                    np.add.at(counts, np.asarray(bins, dtype=np.int64), np.asarray(found, dtype=np.int64))
                low, high = record["min"], record["max"]
                self._sketches[key] = lambda q: histogram_quantile(counts, q, low, high)
        return self._sketches[key]

    def _top(self, key: tuple, keys: list[str], k: int, where) -> float:
        """The k-th largest deviation of a group (exact where the group is within one head)."""
        worst = _filtered(self.state["worst"], {**(where or {}), **dict(zip(keys, key))})
        if len(worst) < k:
            return float(worst["rel_deviation"].min()) if len(worst) else np.nan
        return float(np.sort(worst["rel_deviation"].to_numpy(dtype=float))[::-1][k - 1])

    # ---- histograms and rows

    def fine_counts(self, column: str, by: Sequence[str], where: Mapping | None = None) -> dict[tuple, np.ndarray]:
        """The dense fine-bin counts of ``column`` per group of ``by``."""
        frame = self._rows(column, where)
        out: dict[tuple, np.ndarray] = {}
        for row in frame.itertuples(index=False):
            key = tuple(getattr(row, k) for k in by)
            counts = out.setdefault(key, np.zeros(FINE_BINS, dtype=np.int64))
            np.add.at(counts, np.asarray(row.bins, dtype=np.int64), np.asarray(row.counts, dtype=np.int64))
        return out

    def histogram(self, column: str, edges, by: Sequence[str] = (), where: Mapping | None = None) -> pd.DataFrame:
        """Counts of ``column`` in the bins ``edges`` per group of ``by``, shaped as
        :meth:`probe.query.Table.histogram` gives them (``by``, ``bin``, ``count``; empty bins absent): each fine bin
        counted in the bin its centre falls in (exact to one fine bin)."""
        edges = np.asarray(edges, dtype=float)
        records = []
        for key, counts in self.fine_counts(column, by, where).items():
            binned = rebin(counts, edges)
            for index in np.flatnonzero(binned):
                records.append((*key, int(index), int(binned[index])))
        return pd.DataFrame.from_records(records, columns=[*by, "bin", "count"])

    def worst_rows(self, where: Mapping | None = None) -> pd.DataFrame:
        """The worst rows of every head (``rel_deviation``, ``example``, ``query``, ``token_id``, ``token_role``,
        ``n_keys``) with their token strings."""
        worst = _filtered(self.state["worst"], where)
        return worst.merge(self.tokens, on="token_id", how="left")

    @cached_property
    def tokens(self) -> pd.DataFrame:
        """token id -> token string, for every token met."""
        return self.state["tokens"].drop_duplicates("token_id")

    def table(self, kind: str, where: Mapping | None = None) -> pd.DataFrame:
        """One of the state's tables (:data:`probe.store.aggregates.KINDS`), filtered."""
        return _filtered(self.state[kind], where)

    # ---- what findings, breakdowns and the series ask

    def groups(self, where: Mapping | None = None) -> dict[str, pd.DataFrame]:
        """Per attention type, the non-trivial rows grouped as :attr:`probe.report.data.ReportRun.groups` groups them
        (``token_role``, ``token``, ``head``, ``position``, ``query``): ``rows``, ``count`` (rows with a deviation),
        ``sum``; ``above_p95`` is NaN (counting the values above a percentile needs the rows)."""
        queries = self.table("queries", where)
        tokens = queries.merge(self.tokens, on="token_id", how="left")
        frames = {
            "token_role": queries.groupby(["attention_type", "token_role"], as_index=False)[["rows", "n", "sum"]].sum(),
            "token": tokens.groupby(["attention_type", "token"], as_index=False)[["rows", "n", "sum"]].sum(),
        }
        census = self.table("census", where)
        heads = census.assign(rows=census["rows"] - census["trivial"])[["attention_type", "layer", "head", "rows"]]
        sums = self._rows("rel_deviation", where).groupby(["attention_type", "layer", "head"], as_index=False)[
            ["count", "sum"]].sum().rename(columns={"count": "n"})
        frames["head"] = heads.groupby(["attention_type", "layer", "head"], as_index=False)["rows"].sum().merge(
            sums, on=["attention_type", "layer", "head"], how="left").fillna({"n": 0, "sum": 0.0})
        frames["position"] = self.table("positions", where).groupby(["attention_type", "layer", "query"],
                                                                   as_index=False)[["rows", "n", "sum"]].sum()
        frames["query"] = frames["position"].groupby(["attention_type", "query"], as_index=False)[
            ["rows", "n", "sum"]].sum()
        out = {}
        for kind, frame in frames.items():
            frame = frame.rename(columns={"n": "count"})
            frame = frame[frame["rows"] > 0].copy()
            frame["count"] = frame["count"].astype(np.int64)
            frame["rows"] = frame["rows"].astype(np.int64)
            frame["above_p95"] = np.nan
            out[kind] = _integers(frame.reset_index(drop=True), ["layer", "head", "query"])
        return out

    def query_cells(self, where: Mapping | None = None) -> pd.DataFrame:
        """Per (attention type, example, query): its token (string and id), role, non-trivial ``rows`` and
        measured ``n`` over every layer and head, and their ``sum``."""
        return self.table("queries", where).merge(self.tokens, on="token_id", how="left")

    def token_sequences(self, keys, where: Mapping | None = None) -> dict[tuple[str, int], list[str]]:
        """The query tokens of each wanted (attention type, example), in query order (as
        :func:`probe.report.data.token_sequences` reads them from the rows)."""
        cells = self.query_cells(where)
        out = {}
        for (attention_type, example), group in cells.groupby(["attention_type", "example"], sort=True):
            if (attention_type, int(example)) not in keys:
                continue
            tokens = [""] * (int(group["query"].max()) + 1)
            for query, token in zip(group["query"], group["token"]):
                tokens[int(query)] = "" if pd.isna(token) else str(token)
            out[(attention_type, int(example))] = tokens
        return out

    def example_sums(self, where: Mapping | None = None, by=("layer", "example")) -> pd.DataFrame:
        """Per group of ``by`` (with ``example``): the measured rows ``n``, their ``sum`` and the rows ``above``
        0.1 (the bootstrap over examples, the findings' intervals)."""
        frame = self.table("examples", where)
        return _integers(frame.groupby(list(by), as_index=False)[["n", "sum", "above"]].sum(), by)

    def example_histograms(self, where: Mapping | None = None) -> pd.DataFrame:
        """Per (layer, example), the counts of the deviations in the coarse bins
        (:data:`probe.store.aggregates.COARSE_EDGES`): ``layer``, ``example``, ``bin``, ``count``."""
        records = []
        for row in self.table("example_bins", where).itertuples(index=False):
            for b, c in zip(row.bins, row.counts):
                records.append((int(row.layer), int(row.example), int(b), int(c)))
        return pd.DataFrame.from_records(records, columns=["layer", "example", "bin", "count"])

    def per_example(self, attention_type: str, groups: Sequence[tuple[str, object]],
                    where: Mapping | None = None) -> tuple[pd.DataFrame, np.ndarray]:
        """What :func:`probe.report.findings.per_example` asks of the rows, from the per-(example, query) and
        per-(head, example) sums: per example of the type, ``n`` and ``sum`` of every measured row and ``n_i``,
        ``sum_i`` of each group ``(kind, value)`` (kinds ``token_role``, ``query_position``, ``token``, ``head`` with
        value ``(layer, head)``); and the rows every two groups share, summed over the examples.  Two groups of
        query tokens share the rows of the query tokens in both; a head shares with such a group the rows of its
        query tokens measured at that head, counted as each query token's measured rows over the type's
        (layer, head) pairs: exact when a query token is measured at every head of the type or at none (its
        trivial rows are those of one key, the same at every head of an encoder)."""
        scope = {**(where or {}), "attention_type": attention_type}
        cells = self.query_cells(scope)
        heads = self.example_sums(scope, by=("layer", "head", "example"))
        pairs = max(1, len(self.table("census", scope)[["layer", "head"]].drop_duplicates()))
        examples = np.sort(cells.loc[cells["n"] > 0, "example"].unique())
        frame = pd.DataFrame({"example": examples})
        per = cells.groupby("example")[["n", "sum"]].sum()
        frame["n"] = per["n"].reindex(examples, fill_value=0).to_numpy().astype(np.int64)
        frame["sum"] = per["sum"].reindex(examples, fill_value=0.0).to_numpy()
        cell_masks = {}
        for i, (kind, value) in enumerate(groups):
            if kind == "head":
                part = heads[(heads["layer"] == value[0]) & (heads["head"] == value[1])].set_index("example")
                n_i, sum_i = part["n"], part["sum"]
            else:
                column = {"token_role": "token_role", "query_position": "query", "token": "token"}[kind]
                mask = (cells[column] == value).to_numpy()
                cell_masks[i] = mask
                part = cells[mask].groupby("example")[["n", "sum"]].sum()
                n_i, sum_i = part["n"], part["sum"]
            frame[f"n_{i}"] = n_i.reindex(examples, fill_value=0).to_numpy().astype(np.int64)
            frame[f"sum_{i}"] = sum_i.reindex(examples, fill_value=0.0).to_numpy()
        shared = np.zeros((len(groups), len(groups)))
        n = cells["n"].to_numpy(dtype=float)
        for i in range(len(groups)):
            shared[i, i] = frame[f"n_{i}"].sum()
            for j in range(i + 1, len(groups)):
                if i in cell_masks and j in cell_masks:
                    both = float(n[cell_masks[i] & cell_masks[j]].sum())
                elif i in cell_masks or j in cell_masks:  # a head and a group of query tokens
                    both = float(n[cell_masks[i if i in cell_masks else j]].sum()) / pairs
                else:
                    both = shared[i, i] if groups[i] == groups[j] else 0.0
                shared[i, j] = shared[j, i] = both
        return frame, np.rint(shared).astype(np.int64)

    def export_table(self) -> pd.DataFrame:
        """The aggregates as one flat table: a row per (column, space, alpha, attention type, layer, head, token
        role) with its count, trivial count, sum, sum of squares, minimum, maximum, count above 0.1, median and
        p95 (from its sketch) and the stated rank error."""
        frame = self.values.drop(columns=["bins", "counts", "sketch"]).copy()
        quantiles = [self._quantile(row.column, self.values.loc[[index]], {"min": row.min, "max": row.max})
                     if row.count else None for index, row in zip(self.values.index, frame.itertuples())]
        for name, q in (("median", 0.5), ("p95", 0.95)):
            frame[name] = [quantile(q) if quantile is not None else np.nan for quantile in quantiles]
        frame["quantiles"] = ["KLL sketch" if not stored.merged_sketch([blob]).is_empty() else "fine histogram"
                              for blob in self.values["sketch"]]
        frame["rank_error"] = np.where(frame["quantiles"] == "KLL sketch", RANK_ERROR, np.nan)
        return frame


def histogram_quantile(counts: np.ndarray, q: float, low: float, high: float) -> float:
    """The linear ``q`` quantile of values known by their fine-bin ``counts`` and exact extremes: the order
    statistics around ``q (n - 1)`` taken as evenly spread within their bins (exact to one fine bin)."""
    total = int(counts.sum())
    if not total:
        return np.nan
    cumulative = np.cumsum(counts)

    def order_statistic(rank: int) -> float:
        index = int(np.searchsorted(cumulative, rank, side="right"))
        before = cumulative[index - 1] if index else 0
        lower, upper = FINE_EDGES[index], min(FINE_EDGES[index + 1], high)
        return float(min(max(lower + (rank - before + 0.5) / counts[index] * (upper - lower), low), high))

    position = q * (total - 1)
    below, above = int(np.floor(position)), int(np.ceil(position))
    return order_statistic(below) + (position - below) * (order_statistic(above) - order_statistic(below))


def rebin(counts: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Fine-bin counts on other edges (each fine bin where its centre falls; outside the edges: left out, the
    last edge included as numpy's histogram includes it)."""
    index = np.searchsorted(edges, FINE_CENTRES, side="right") - 1
    index[FINE_CENTRES == edges[-1]] = len(edges) - 2
    inside = (index >= 0) & (index < len(edges) - 1)
    return np.bincount(index[inside], weights=counts[inside], minlength=len(edges) - 1).astype(np.int64)


def _filtered(frame: pd.DataFrame, where: Mapping | None) -> pd.DataFrame:
    keep = np.ones(len(frame), dtype=bool)
    for key, value in (where or {}).items():
        if value is None:
            continue
        column = frame[key]
        if key == "alpha":
            keep &= np.isclose(column.to_numpy(dtype=float), float(value), rtol=1e-12, atol=0)
        elif isinstance(value, (list, tuple, set)):
            keep &= column.isin(list(value)).to_numpy()
        else:
            keep &= (column == value).to_numpy()
    return frame[keep]


def _integers(frame: pd.DataFrame, keys) -> pd.DataFrame:
    for key in keys:
        if key in ("layer", "head", "query", "example") and key in frame.columns and len(frame):
            frame[key] = frame[key].astype(np.int64)
    return frame


__all__ = ["AggregateTable", "QUANTILE_METHOD", "keeps", "rebin", "AVERAGED"]
