"""A batch's rows folded into mergeable statistics where they were computed (``--keep aggregates`` and
``--keep sample:N``): :class:`Aggregates` takes the per-site tensors of :func:`probe.batch.rows.site_columns` and
never builds a row table.

Everything is reduced on the run's device with torch (``index_add_``, sorts, ``unique_consecutive``) into the
groups the report reads (:data:`probe.store.aggregates.KINDS`): per (space, alpha, attention type, layer, head,
token role) the count, sums, extremes, the share above 0.1, a sparse histogram on the fixed bins
(:data:`probe.store.aggregates.FINE_EDGES`) and the worst rows; per (example, query) the head-averaged
deviation; per example, per query position and per token what the findings and the bootstrap over examples
need.  Only the quantile sketches' updates cross to the host: one sorted float64 array per column and group,
given to Apache DataSketches' KLL (:mod:`probe.store.aggregates`) in one call.

With ``sample`` (``--keep sample:N``) the batch also keeps its N rows of smallest :func:`row_hash` (the row key
and the run's seed through splitmix64), chosen on the device; only those rows become a table.  The N rows of
smallest hash over the run are among the union of every batch's, so the run's sample is the same whatever the
batches, resumes or ranks (the pipeline keeps those N when the run completes).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from probe.batch.rows import SiteColumns, columns_table
from probe.store import aggregates as stored
from probe.store.aggregates import (
    AVERAGED,
    BINS_PER_OCTAVE,
    COARSE_OF_FINE,
    FAR,
    FINE_BINS,
    FIRST_EXPONENT,
    LINEAR_BINS,
    LINEAR_SCALE,
    LINEAR_TOP,
    MIX_1,
    MIX_2,
    MIX_ADD,
    PRESENT_COLUMNS,
    QUANTITY_COLUMNS,
    ROLES,
    WORST_ROWS,
    AggregateState,
    alpha_code,
    kll_sketch,
    string_code,
)


def fine_bins(values: torch.Tensor) -> torch.Tensor:
    """The fine bin of each (finite) value, exactly as :func:`probe.store.aggregates.fine_bins` computes it."""
    x = values.to(torch.float64).clamp_min(0.0)
    linear = torch.floor(x.clamp_max(LINEAR_TOP) * LINEAR_SCALE).to(torch.int64)
    mantissa, exponent = torch.frexp(x.clamp_min(LINEAR_TOP))
    log = LINEAR_BINS + (exponent.to(torch.int64) - FIRST_EXPONENT) * BINS_PER_OCTAVE + torch.floor(
        (mantissa * 2 - 1) * BINS_PER_OCTAVE).to(torch.int64)
    return torch.where(x < LINEAR_TOP, linear, log.clamp_max(FINE_BINS - 1))


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64, wrapping (:func:`probe.store.aggregates._mix` on uint64)."""
    x = x + MIX_ADD
    x = (x ^ _shift(x, 30)) * MIX_1
    x = (x ^ _shift(x, 27)) * MIX_2
    return x ^ _shift(x, 31)


def row_hash(seed: int, columns: SiteColumns) -> torch.Tensor:
    """The sample's key of each row (:func:`probe.store.aggregates.row_hash`, bit for bit), on the rows' device."""
    state = torch.full_like(columns.head, seed, dtype=torch.int64)
    for code in (string_code(columns.space), alpha_code(columns.alpha), string_code(columns.attention_type)):
        state = _mix(state ^ code)
    for field in (torch.full_like(state, columns.layer), columns.head, columns.example, columns.query):
        state = _mix(state ^ field.to(torch.int64))
    return state


def _sums(index: torch.Tensor, weights: torch.Tensor, size: int) -> torch.Tensor:
    """``weights`` added per ``index`` (float64; counts are exact up to 2^53)."""
    return torch.zeros(size, dtype=torch.float64, device=index.device).index_add_(0, index, weights.to(torch.float64))


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


class _Sorted:
    """Values sorted by group, then by value, and what each group's segment gives: counts, sums, extremes, the
    share above FAR, the sparse histogram (bins of sorted values arrive in order) and the sketch's input."""

    def __init__(self, values: torch.Tensor, group: torch.Tensor, groups: int):
        order = torch.argsort(values, stable=True)
        order = order[torch.argsort(group[order], stable=True)]
        self.values, self.group = values[order], group[order]
        self.order = order
        self.counts = torch.bincount(self.group, minlength=groups)
        self.sum = _sums(self.group, self.values, groups)
        self.sumsq = _sums(self.group, self.values * self.values, groups)
        self.above = torch.bincount(self.group[self.values > FAR], minlength=groups)
        key = self.group * FINE_BINS + fine_bins(self.values)
        self.hist_key, self.hist_count = torch.unique_consecutive(key, return_counts=True)

    def host(self, groups: int) -> dict:
        """The per-group numbers on the host: count, sum, sumsq, above, min, max, the values split per group
        (for the sketches) and the sparse histograms."""
        counts = _host(self.counts)
        values = _host(self.values)
        ends = np.cumsum(counts)
        starts = ends - counts
        keys, hist = _host(self.hist_key), _host(self.hist_count)
        owner = keys // FINE_BINS
        cut = np.searchsorted(owner, np.arange(groups + 1))
        return {
            "count": counts, "sum": _host(self.sum), "sumsq": _host(self.sumsq), "above": _host(self.above),
            "min": np.where(counts > 0, values[np.minimum(starts, max(len(values) - 1, 0))] if len(values) else 0.0,
                            np.inf),
            "max": np.where(counts > 0, values[np.maximum(ends - 1, 0)] if len(values) else 0.0, -np.inf),
            "split": [values[a:b] for a, b in zip(starts, ends)],
            "bins": [(keys[cut[g]:cut[g + 1]] % FINE_BINS).astype(np.int32) for g in range(groups)],
            "counts": [hist[cut[g]:cut[g + 1]].astype(np.int64) for g in range(groups)],
        }


class _Site:
    """The running statistics of one site (space, alpha, attention type, layer) within a batch."""

    def __init__(self, key: tuple, heads: int):
        self.key, self.heads = key, heads
        self.census: dict[str, np.ndarray] = {}
        self.values: dict[tuple, dict] = {}  # (column, head, role) -> running numbers and sketch
        self.worst: list[pd.DataFrame] = []
        self.examples: dict[str, np.ndarray] = {}
        self.positions: dict[str, np.ndarray] = {}
        self.example_bins: np.ndarray | None = None

    def fold(self, name: str, into: dict, values: np.ndarray) -> None:
        """``values`` added into ``into[name]`` (grown as needed)."""
        have = into.get(name)
        if have is None:
            into[name] = values.copy()
            return
        if len(have) < len(values):
            have = np.concatenate([have, np.zeros(len(values) - len(have), dtype=have.dtype)])
        have[: len(values)] += values
        into[name] = have

    def add_group(self, column: str, head: int, role: str, numbers: dict, g: int, trivial: int = 0) -> None:
        """One group's numbers of a piece (from :meth:`_Sorted.host`), its sketch updated on the host."""
        entry = self.values.get((column, head, role))
        if entry is None:
            entry = self.values[(column, head, role)] = {
                "count": 0, "trivial": 0, "sum": 0.0, "sumsq": 0.0, "above": 0, "min": np.inf, "max": -np.inf,
                "hist": [], "sketch": kll_sketch()}
        entry["count"] += int(numbers["count"][g])
        entry["trivial"] += trivial
        entry["sum"] += float(numbers["sum"][g])
        entry["sumsq"] += float(numbers["sumsq"][g])
        entry["above"] += int(numbers["above"][g])
        entry["min"] = min(entry["min"], float(numbers["min"][g]))
        entry["max"] = max(entry["max"], float(numbers["max"][g]))
        if len(numbers["bins"][g]):
            entry["hist"].append((numbers["bins"][g], numbers["counts"][g]))
        if len(numbers["split"][g]):
            entry["sketch"].update(numbers["split"][g])


class Aggregates:
    """The statistics of one batch's rows (see the module), folded site by site; :meth:`state` gives them as an
    :class:`~probe.store.aggregates.AggregateState`, :meth:`sample_table` the batch's sampled rows.

    ``example_ids``: the batch's example ids; ``seed``: the run's seed (the sample's hash); ``sample``: N of
    ``--keep sample:N``, or None; ``context``: the rows' :class:`~probe.batch.rows.RowContext` (token strings)."""

    def __init__(self, example_ids, context, *, seed: int = 0, sample: int | None = None):
        self.example_ids = sorted(int(e) for e in example_ids)
        self.context, self.seed, self.sample = context, seed, sample
        self.sites: dict[tuple, _Site] = {}
        self.queries: dict[tuple, dict] = {}  # (space, alpha, type) -> per (example, query) running arrays
        self.tokens: set[int] = set()
        self.candidates: list[tuple[torch.Tensor, SiteColumns]] = []  # the sample: (hashes, rows)
        self.candidate_count = 0

    # ---- folding

    def add(self, columns: SiteColumns) -> None:
        """Fold one piece of a site (its rows in one space and alpha) into the batch's statistics."""
        if not columns.count:
            return
        if self.sample is not None:
            self._sample(columns)
        values = columns.values
        heads = int(columns.head.max()) + 1
        key = (columns.space, float(columns.alpha), columns.attention_type, int(columns.layer))
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = _Site(key, heads)
        site.heads = max(site.heads, heads)
        device = columns.head.device
        ids = torch.as_tensor(self.example_ids, dtype=torch.int64, device=device)
        local = torch.searchsorted(ids, columns.example)
        examples = len(self.example_ids)
        positions = int(columns.query.max()) + 1
        rel = values["rel_deviation"].to(torch.float64)
        trivial = columns.n_keys == 1
        finite = torch.isfinite(rel)
        measured = ~trivial & finite
        nontrivial = ~trivial
        head, role = columns.head, columns.role

        # census per head
        census = {"rows": torch.bincount(head, minlength=heads),
                  "trivial": torch.bincount(head[trivial], minlength=heads),
                  "non_converged": torch.bincount(head[~values["converged"]], minlength=heads),
                  "measured": torch.bincount(head[measured], minlength=heads)}
        for column in PRESENT_COLUMNS:
            present = nontrivial & torch.isfinite(values[column].to(torch.float64)) if column in values else nontrivial
            census[f"present_{column}"] = torch.bincount(head[present], minlength=heads)
        second = values["second_order_deviation"].to(torch.float64)
        pairs = measured & torch.isfinite(second)
        census["pairs"] = torch.bincount(head[pairs], minlength=heads)
        census["pairs_better"] = torch.bincount(head[pairs & (second < rel)], minlength=heads)
        larger = torch.maximum(rel, second)
        pairs_max = torch.full((heads,), -np.inf, dtype=torch.float64, device=device).scatter_reduce(
            0, head[pairs], larger[pairs], reduce="amax")
        for name, counted in census.items():
            site.fold(name, site.census, _host(counted).astype(np.int64))
        have = site.census.get("pairs_max")
        found = _host(pairs_max)
        site.census["pairs_max"] = found if have is None else np.fmax(
            np.r_[have, np.full(max(0, len(found) - len(have)), -np.inf)][: max(len(have), len(found))],
            np.r_[found, np.full(max(0, len(have) - len(found)), -np.inf)])

        # the relative deviation per (head, token role)
        groups = heads * len(ROLES)
        index = torch.nonzero(measured).flatten()
        sorted_rel = _Sorted(rel[index], head[index] * len(ROLES) + role[index], groups)
        numbers = sorted_rel.host(groups)
        trivial_groups = _host(torch.bincount(head[trivial] * len(ROLES) + role[trivial], minlength=groups))
        for g in range(groups):
            if numbers["count"][g] or trivial_groups[g]:
                site.add_group("rel_deviation", g // len(ROLES), ROLES[g % len(ROLES)], numbers, g,
                               int(trivial_groups[g]))

        # the worst rows: the tail of each (head, role) segment, and its ties
        ends = torch.cumsum(sorted_rel.counts, 0)
        starts = ends - sorted_rel.counts
        position = torch.arange(len(sorted_rel.values), device=device)
        tail_start = torch.maximum(ends - WORST_ROWS, starts)[sorted_rel.group]
        threshold = sorted_rel.values[torch.clamp(tail_start, max=max(len(sorted_rel.values) - 1, 0))] if len(
            sorted_rel.values) else sorted_rel.values
        keep = (position >= tail_start) | (sorted_rel.values >= threshold)
        chosen = index[sorted_rel.order[keep]]
        if len(chosen):
            site.worst.append(pd.DataFrame({
                "head": _host(head[chosen]), "rel_deviation": _host(rel[chosen]),
                "example": _host(columns.example[chosen]), "query": _host(columns.query[chosen]),
                "token_id": _host(columns.token_id[chosen]),
                "token_role": np.asarray(ROLES, dtype=object)[_host(role[chosen])],
                "n_keys": _host(columns.n_keys[chosen])}))

        # the other measured quantities, per site
        for column in QUANTITY_COLUMNS:
            value = values[column].to(torch.float64)
            index = torch.nonzero(nontrivial & torch.isfinite(value)).flatten()
            numbers = _Sorted(value[index], torch.zeros_like(index), 1).host(1)
            site.add_group(column, -1, "", numbers, 0, int(trivial.sum()))

        # per (example, query): the deviation averaged over the layer's heads; the query's token and role
        cell = local * positions + columns.query
        cells = examples * positions
        rel_measured = torch.where(measured, rel, torch.zeros_like(rel))
        cell_sum = _sums(cell, rel_measured, cells)
        cell_n = _sums(cell, measured, cells)
        cell_rows = _sums(cell, nontrivial, cells)
        cell_trivial = _sums(cell, trivial, cells) > 0
        cell_present = _sums(cell, torch.ones_like(rel), cells) > 0
        averaged_index = torch.nonzero(cell_n > 0).flatten()
        averaged = cell_sum[averaged_index] / cell_n[averaged_index]
        numbers = _Sorted(averaged, torch.zeros_like(averaged_index), 1).host(1)
        site.add_group(AVERAGED, -1, "", numbers, 0, int((cell_trivial & cell_present).sum()))
        token = torch.zeros(cells, dtype=torch.int64, device=device).index_copy_(0, cell, columns.token_id)
        cell_role = torch.zeros(cells, dtype=torch.int64, device=device).index_copy_(0, cell, role)
        queries = self.queries.setdefault(key[:3], {})
        present = _host(cell_present).reshape(examples, positions)
        for name, counted in (("rows", cell_rows), ("n", cell_n), ("sum", cell_sum)):
            _fold_grid(queries, name, _host(counted).reshape(examples, positions))
        _fold_grid(queries, "present", present.astype(np.int64))
        _fold_grid(queries, "token_id", _host(token).reshape(examples, positions), replace=True, where=present)
        _fold_grid(queries, "token_role", _host(cell_role).reshape(examples, positions), replace=True,
                   where=present)
        self.tokens.update(np.unique(_host(columns.token_id)).tolist())

        # per (head, example) and per (example, coarse bin): findings and the bootstrap over examples
        slot = local * heads + head
        for name, counted in (("n", _sums(slot, measured, examples * heads)),
                              ("sum", _sums(slot, rel_measured, examples * heads)),
                              ("above", _sums(slot, measured & (rel > FAR), examples * heads))):
            grid = _host(counted).reshape(examples, heads)
            site.fold(name, site.examples, grid.T.reshape(-1))  # head-major, so that more heads only append
        coarse = torch.as_tensor(COARSE_OF_FINE, device=device)[fine_bins(rel[measured])]
        bins = torch.bincount(local[measured] * stored.COARSE_BINS + coarse, minlength=examples * stored.COARSE_BINS)
        counted = _host(bins).reshape(examples, stored.COARSE_BINS)
        site.example_bins = counted if site.example_bins is None else site.example_bins + counted

        # per query position
        for name, counted in (("rows", _sums(columns.query, nontrivial, positions)),
                              ("n", _sums(columns.query, measured, positions)),
                              ("sum", _sums(columns.query, rel_measured, positions))):
            site.fold(name, site.positions, _host(counted))

    def _sample(self, columns: SiteColumns) -> None:
        """Keep the piece's rows of smallest hash, at most N over the batch."""
        hashes = row_hash(self.seed, columns)
        if len(hashes) > self.sample:
            hashes, index = torch.topk(hashes, self.sample, largest=False, sorted=False)
            columns = columns.take(index)
        self.candidates.append((hashes, columns))
        self.candidate_count += len(hashes)
        if self.candidate_count > 2 * self.sample:
            self._prune()

    def _prune(self) -> None:
        """The candidates cut to the N of smallest hash."""
        every = torch.cat([hashes.to("cpu") for hashes, _ in self.candidates])
        if len(every) <= self.sample:
            return
        threshold = torch.kthvalue(every, self.sample).values
        kept = []
        for hashes, columns in self.candidates:
            index = torch.nonzero(hashes <= threshold.to(hashes.device)).flatten()
            if len(index):
                kept.append((hashes[index], columns.take(index)))
        self.candidates = kept
        self.candidate_count = sum(len(hashes) for hashes, _ in kept)

    # ---- results

    def sample_table(self, bound: "SampleBound | None" = None) -> pa.Table | None:
        """The batch's sampled rows (its N rows of smallest hash, and of those only the ones among the N smallest
        this process has seen: ``bound``) in the parquet schema; None without a sample."""
        if self.sample is None:
            return None
        self._prune()
        if bound is not None and self.candidates:
            threshold = bound.update(torch.cat([hashes.to("cpu") for hashes, _ in self.candidates]))
            self.candidates = [(hashes[keep], columns.take(keep)) for hashes, columns in self.candidates
                               if len(keep := torch.nonzero(hashes <= threshold.to(hashes.device)).flatten())]
        from probe.core.schema import DEVIATION_SCHEMA

        tables = [columns_table(columns, self.context) for _, columns in self.candidates]
        return pa.concat_tables(tables) if tables else DEVIATION_SCHEMA.empty_table()

    def state(self) -> AggregateState:
        """The batch's statistics as an :class:`~probe.store.aggregates.AggregateState`."""
        frames: dict[str, list] = {kind: [] for kind in stored.KINDS}
        for key, site in self.sites.items():
            keys = dict(zip(stored.SITE_KEYS, key))
            heads = len(site.census["rows"])
            census = {name: (values if len(values) == heads else np.r_[values, np.zeros(heads - len(values))])
                      for name, values in site.census.items()}
            frames["census"].append(pd.DataFrame({**keys, "head": np.arange(heads), **census}))
            records = []
            for (column, head, role), entry in site.values.items():
                bins, counts = _sparse(entry["hist"])
                records.append({"column": column, **keys, "head": head, "token_role": role,
                                **{k: entry[k] for k in ("count", "trivial", "sum", "sumsq", "above")},
                                "min": entry["min"] if entry["count"] else np.nan,
                                "max": entry["max"] if entry["count"] else np.nan,
                                "bins": bins, "counts": counts, "sketch": entry["sketch"].serialize()})
            frames["values"].append(pd.DataFrame.from_records(records))
            if site.worst:
                worst = pd.concat(site.worst, ignore_index=True).assign(**keys)
                frames["worst"].append(stored.worst_rows(worst))
            examples = len(self.example_ids)
            n = site.examples["n"]
            heads_here = len(n) // examples
            grid = {name: value.reshape(heads_here, examples).T.reshape(-1) for name, value in site.examples.items()}
            example_frame = pd.DataFrame({**keys, "head": np.tile(np.arange(heads_here), examples),
                                          "example": np.repeat(self.example_ids, heads_here),
                                          "n": grid["n"].astype(np.int64), "sum": grid["sum"],
                                          "above": grid["above"].astype(np.int64)})
            frames["examples"].append(example_frame[example_frame["n"] > 0])
            positions = site.positions
            position_frame = pd.DataFrame({**keys, "query": np.arange(len(positions["rows"])),
                                           "rows": positions["rows"].astype(np.int64),
                                           "n": positions["n"].astype(np.int64), "sum": positions["sum"]})
            frames["positions"].append(position_frame[position_frame["rows"] > 0])
            where_bins = [np.flatnonzero(row) for row in site.example_bins]
            frame = pd.DataFrame({**keys, "example": self.example_ids,
                                  "bins": [b.astype(np.int32) for b in where_bins],
                                  "counts": [row[b].astype(np.int64) for row, b in zip(site.example_bins, where_bins)]})
            frames["example_bins"].append(frame[[len(b) > 0 for b in where_bins]])
        for key, grid in self.queries.items():
            present = grid["present"] > 0
            example_index, query = np.nonzero(present)
            frames["queries"].append(pd.DataFrame({
                "space": key[0], "alpha": key[1], "attention_type": key[2],
                "example": np.asarray(self.example_ids, dtype=np.int64)[example_index], "query": query,
                "rows": grid["rows"][present].astype(np.int64), "n": grid["n"][present].astype(np.int64),
                "sum": grid["sum"][present], "token_id": grid["token_id"][present].astype(np.int64),
                "token_role": np.asarray(ROLES, dtype=object)[grid["token_role"][present]]}))
        ids = sorted(self.tokens)
        if ids:
            strings = self.context.tokens(np.asarray(ids, dtype=np.int64)).to_pylist()
            frames["tokens"].append(pd.DataFrame({"token_id": ids, "token": strings}))
        tables = {}
        for kind, parts in frames.items():
            parts = [part for part in parts if len(part)]
            if parts:
                keys, sums, others = stored.KINDS[kind]
                frame = pd.concat(parts, ignore_index=True)[[*keys, *sums, *others]]
                tables[kind] = _typed(frame)
        return AggregateState(tables)


class SampleBound:
    """The N smallest row hashes one process has seen so far: a row above the N-th of them is not among the N
    smallest of the run, so a batch need not keep it (the parts of a run then hold about N (1 + ln batches)
    rows, not N per batch, before the run's end cuts them to N)."""

    def __init__(self, count: int):
        self.count = count
        self.hashes = torch.zeros(0, dtype=torch.int64)

    def update(self, hashes: torch.Tensor) -> torch.Tensor:
        """Fold in a batch's candidates' hashes; return the largest hash still among the N smallest."""
        merged = torch.cat([self.hashes, hashes.to(torch.int64)])
        if len(merged) > self.count:
            merged = torch.topk(merged, self.count, largest=False).values
        self.hashes = merged
        return merged.max() if len(merged) >= self.count else torch.tensor(torch.iinfo(torch.int64).max)


def _fold_grid(into: dict, name: str, grid: np.ndarray, *, replace: bool = False, where=None) -> None:
    """A (examples, positions) grid added into ``into[name]`` (or, with ``replace``, written where ``where``),
    the positions grown as needed."""
    have = into.get(name)
    if have is None:
        into[name] = grid.copy() if not replace else np.where(where, grid, 0)
        return
    if have.shape[1] < grid.shape[1]:
        have = np.pad(have, ((0, 0), (0, grid.shape[1] - have.shape[1])))
    elif grid.shape[1] < have.shape[1]:
        grid = np.pad(grid, ((0, 0), (0, have.shape[1] - grid.shape[1])))
        if where is not None:
            where = np.pad(where, ((0, 0), (0, have.shape[1] - where.shape[1])))
    if replace:
        have = np.where(where, grid, have)
    else:
        have = have + grid
    into[name] = have


def _sparse(pieces: list) -> tuple[np.ndarray, np.ndarray]:
    """Sparse histograms (bins, counts) of several pieces added into one."""
    if not pieces:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    if len(pieces) == 1:
        return pieces[0]
    bins = np.concatenate([b for b, _ in pieces]).astype(np.int64)
    counts = np.concatenate([c for _, c in pieces])
    unique, inverse = np.unique(bins, return_inverse=True)
    return unique.astype(np.int32), np.bincount(inverse, weights=counts).astype(np.int64)


#: the Arrow types of the state's columns (the rest as pandas gives them)
_TYPES = {"layer": np.int32, "head": np.int32, "example": np.int64, "query": np.int32, "token_id": np.int64,
          "n_keys": np.int32}


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    for column, dtype in _TYPES.items():
        if column in frame.columns:
            frame[column] = frame[column].astype(dtype)
    return frame
