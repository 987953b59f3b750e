"""A batch's rows folded into mergeable statistics where they were computed (``--keep aggregates`` and
``--keep sample:N``): :class:`Aggregates` takes the per-site tensors of :func:`probe.batch.rows.site_columns` and
never builds a row table.

Everything is reduced on the run's device with torch (``index_add_``, sorts, ``unique_consecutive``) into the
groups the report reads (:data:`probe.store.aggregates.KINDS`): per (space, alpha, attention type, layer, head,
token role) the count, sums, extremes, the share above 0.1, a sparse histogram on the fixed bins
(:data:`probe.store.aggregates.FINE_EDGES`) and the worst rows; per (example, query) the head-averaged
deviation; per example, per query position and per token what the findings and the bootstrap over examples
need.  Only the quantile sketches' updates cross to the host: one sorted float64 array per group of the relative
deviation (and one of its head-averaged values), given to Apache DataSketches' KLL (:mod:`probe.store.aggregates`)
in one call; the other quantities are reduced to their numbers and histograms on the device.

With ``sample`` (``--keep sample:N``) the batch also keeps its N rows of smallest :func:`row_hash` (the row key
and the run's seed through splitmix64), chosen on the device; only those rows become a table.  The N rows of
smallest hash over the run are among the union of every batch's, so the run's sample is the same whatever the
batches, resumes or ranks (the pipeline keeps those N when the run completes).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from probe.batch.columns import SiteColumns, columns_table
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
    """splitmix64's finaliser on int64, wrapping (as :mod:`probe.store.aggregates` computes it on uint64)."""
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


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def _added(index: torch.Tensor, weights: torch.Tensor, size: int) -> np.ndarray:
    """The rows of ``weights`` (n, c) added per ``index``, as a (size, c) float64 array on the host (counts exact
    up to 2^53)."""
    out = torch.zeros((size, weights.shape[1]), dtype=torch.float64, device=index.device)
    return _host(out.index_add_(0, index, weights.to(torch.float64)))


def _grown(array: np.ndarray, shape: tuple) -> np.ndarray:
    """``array`` padded with zeros to at least ``shape``."""
    pad = [(0, max(0, want - have)) for have, want in zip(array.shape, shape)]
    return np.pad(array, pad) if any(after for _, after in pad) else array


def _sparse_rows(dense: np.ndarray) -> tuple[list, list]:
    """Each row of a dense count matrix as (bins, counts) of its non-zero bins."""
    rows, bins = np.nonzero(dense)
    cut = np.searchsorted(rows, np.arange(dense.shape[0] + 1))
    return ([bins[a:b].astype(np.int32) for a, b in zip(cut[:-1], cut[1:])],
            [dense[rows[a:b], bins[a:b]].astype(np.int64) for a, b in zip(cut[:-1], cut[1:])])


#: the census' counts, in the order _Site.census holds them
CENSUS = ("rows", "trivial", "non_converged", "measured", *(f"present_{c}" for c in PRESENT_COLUMNS), "pairs",
          "pairs_better")
#: a statistics entry's running numbers: count, trivial, sum, sum of squares, above FAR, minimum, maximum
NUMBERS = 7


class _Statistics:
    """The running numbers of some groups of one column: counts, sums, extremes, the share above FAR, the fine
    histograms (dense rows, or sparse pieces) and, where the column has them, the KLL sketches."""

    def __init__(self, groups: int, sketches: bool):
        self.numbers = np.zeros((groups, NUMBERS))
        self.numbers[:, 5], self.numbers[:, 6] = np.inf, -np.inf
        self.pieces: list[list] = [[] for _ in range(groups)]
        self.dense: np.ndarray | None = None
        self.sketches = [kll_sketch() for _ in range(groups)] if sketches else None

    def grow(self, groups: int) -> None:
        if groups > len(self.numbers):
            more = groups - len(self.numbers)
            extra = np.zeros((more, NUMBERS))
            extra[:, 5], extra[:, 6] = np.inf, -np.inf
            self.numbers = np.vstack([self.numbers, extra])
            self.pieces += [[] for _ in range(more)]
            if self.sketches is not None:
                self.sketches += [kll_sketch() for _ in range(more)]

    def add_sorted(self, values: torch.Tensor, group: torch.Tensor, groups: int, trivial: np.ndarray) -> None:
        """Values of several groups: sorted by group, then value, on the device; per group their numbers, the
        sparse histogram of its run of bins, and its sketch's update (one sorted array per group, on the host)."""
        self.grow(groups)
        order = torch.argsort(values, stable=True)
        order = order[torch.argsort(group[order], stable=True)]
        values, group = values[order], group[order]
        counts = torch.bincount(group, minlength=groups)
        sums = _added(group, torch.stack([values, values * values, (values > FAR).to(values.dtype)], 1), groups)
        key, runs = torch.unique_consecutive(group * FINE_BINS + fine_bins(values), return_counts=True)
        counts, values, key, runs = _host(counts), _host(values), _host(key), _host(runs)
        ends = np.cumsum(counts)
        starts = ends - counts
        present = counts > 0
        numbers = self.numbers[:groups]
        numbers[:, 0] += counts
        numbers[:, 1] += trivial
        numbers[:, 2:5] += sums
        numbers[present, 5] = np.fmin(numbers[present, 5], values[starts[present]])
        numbers[present, 6] = np.fmax(numbers[present, 6], values[ends[present] - 1])
        cut = np.searchsorted(key // FINE_BINS, np.arange(groups + 1))
        for g in np.flatnonzero(present):
            self.pieces[g].append((key[cut[g]:cut[g + 1]] % FINE_BINS, runs[cut[g]:cut[g + 1]]))
            if self.sketches is not None:
                self.sketches[g].update(values[starts[g]:ends[g]])

    def add_dense(self, values: torch.Tensor, trivial: int) -> None:
        """Values of one group without a sketch: reductions and a dense histogram, no sort."""
        numbers = self.numbers[0]
        if len(values):
            found = _host(torch.stack([values.sum(), (values * values).sum(), (values > FAR).sum().to(values.dtype),
                                       values.min(), values.max()]))
            numbers[2:5] += found[:3]
            numbers[5], numbers[6] = min(numbers[5], found[3]), max(numbers[6], found[4])
        numbers[0] += len(values)
        numbers[1] += trivial
        counted = _host(torch.bincount(fine_bins(values), minlength=FINE_BINS))
        self.dense = counted if self.dense is None else self.dense + counted

    def histograms(self) -> tuple[list, list]:
        if self.dense is not None:
            return _sparse_rows(self.dense[None, :])
        merged = [_sparse(pieces) for pieces in self.pieces]
        return [b for b, _ in merged], [c for _, c in merged]


class _Site:
    """The running statistics of one site (space, alpha, attention type, layer) within a batch."""

    def __init__(self, heads: int):
        self.heads = heads
        self.census = np.zeros((heads, len(CENSUS)))
        self.pairs_max = np.full(heads, -np.inf)
        self.rel = _Statistics(heads * len(ROLES), sketches=True)
        self.averaged = _Statistics(1, sketches=True)
        self.quantities = {column: _Statistics(1, sketches=False) for column in QUANTITY_COLUMNS}
        self.worst: list[dict] = []
        self.examples: np.ndarray | None = None  # (examples, heads, [n, sum, above])
        self.positions = np.zeros((0, 3))  # (query, [rows, n, sum])
        self.example_bins: list = []  # sparse (example * COARSE_BINS + coarse bin, count) of each piece

    def grow(self, heads: int) -> None:
        if heads > self.heads:
            self.census = _grown(self.census, (heads, len(CENSUS)))
            self.pairs_max = np.r_[self.pairs_max, np.full(heads - self.heads, -np.inf)]
            self.heads = heads


class Aggregates:
    """The statistics of one batch's rows (see the module), folded site by site; :meth:`state` gives them as an
    :class:`~probe.store.aggregates.AggregateState`, :meth:`sample_table` the batch's sampled rows.

    ``example_ids``: the batch's example ids; ``seed``: the run's seed (the sample's hash); ``sample``: N of
    ``--keep sample:N``, or None; ``context``: the rows' :class:`~probe.batch.columns.RowContext` (token strings)."""

    def __init__(self, example_ids, context, *, seed: int = 0, sample: int | None = None):
        self.example_ids = sorted(int(e) for e in example_ids)
        self.context, self.seed, self.sample = context, seed, sample
        self.sites: dict[tuple, _Site] = {}
        #: (space, alpha, type) -> per (example, query): [rows, n, sum, present], token id, role
        self.queries: dict[tuple, list] = {}
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
        values, head, role = columns.values, columns.head, columns.role
        device = head.device
        heads, positions = int(head.max()) + 1, int(columns.query.max()) + 1
        key = (columns.space, float(columns.alpha), columns.attention_type, int(columns.layer))
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = _Site(heads)
        site.grow(heads)
        heads = site.heads
        examples = len(self.example_ids)
        local = torch.searchsorted(torch.as_tensor(self.example_ids, dtype=torch.int64, device=device),
                                   columns.example)
        rel = values["rel_deviation"].to(torch.float64)
        second = values["second_order_deviation"].to(torch.float64)
        trivial = columns.n_keys == 1
        nontrivial = ~trivial
        measured = nontrivial & torch.isfinite(rel)
        pairs = measured & torch.isfinite(second)

        # census per head, in one pass
        indicators = [torch.ones_like(trivial), trivial, ~values["converged"], measured]
        indicators += [nontrivial & torch.isfinite(values[c].to(torch.float64)) if c in values else nontrivial
                       for c in PRESENT_COLUMNS]
        indicators += [pairs, pairs & (second < rel)]
        site.census[: int(head.max()) + 1] += _added(head, torch.stack(indicators, 1), int(head.max()) + 1)
        if bool(pairs.any()):
            larger = torch.full((heads,), -np.inf, dtype=torch.float64, device=device).scatter_reduce(
                0, head[pairs], torch.maximum(rel, second)[pairs], reduce="amax")
            site.pairs_max = np.fmax(site.pairs_max, _host(larger))

        # the relative deviation per (head, token role): sorted on the device, sketched on the host
        groups = heads * len(ROLES)
        group = head * len(ROLES) + role
        index = torch.nonzero(measured).flatten()
        trivial_groups = _host(torch.bincount(group[trivial], minlength=groups))
        site.rel.add_sorted(rel[index], group[index], groups, trivial_groups)

        # the worst rows: per (head, role), the largest WORST_ROWS and their ties (chosen exactly on the host)
        if len(index):
            _fold_worst(site, columns, index, group, groups, rel)

        # the other measured quantities, per site: reductions and a histogram (no sort, no sketch)
        for column in QUANTITY_COLUMNS:
            value = values[column].to(torch.float64)
            site.quantities[column].add_dense(value[nontrivial & torch.isfinite(value)], int(trivial.sum()))

        # per (example, query): the deviation averaged over the layer's heads; the query's token and role
        self._fold_queries(site, key, columns, local, positions, measured, nontrivial, trivial, rel)
        rel_measured = torch.where(measured, rel, torch.zeros_like(rel))

        # per (head, example), per query position and per (example, coarse bin): findings and the bootstrap
        found = _added(local * heads + head, torch.stack([measured, rel_measured, measured & (rel > FAR)], 1),
                       examples * heads).reshape(examples, heads, 3)
        site.examples = found if site.examples is None else _grown(site.examples, found.shape) + _grown(
            found, site.examples.shape)
        found = _added(columns.query, torch.stack([nontrivial, measured, rel_measured], 1), positions)
        site.positions = _grown(site.positions, found.shape) + _grown(found, site.positions.shape)
        coarse = torch.as_tensor(COARSE_OF_FINE, device=device)[fine_bins(rel[index])]
        cells, counted = torch.unique(local[index] * stored.COARSE_BINS + coarse, return_counts=True)
        site.example_bins.append((_host(cells), _host(counted)))

    def _fold_queries(self, site, key: tuple, columns: SiteColumns, local: torch.Tensor, positions: int,
                      measured: torch.Tensor, nontrivial: torch.Tensor, trivial: torch.Tensor,
                      rel: torch.Tensor) -> None:
        """Per (example, query): the relative deviation averaged over the site's heads (into the site's sketch of
        it), and the running per-query sums of the layer's type with each query's token and role."""
        device, role, examples = rel.device, columns.role, len(self.example_ids)
        rel_measured = torch.where(measured, rel, torch.zeros_like(rel))
        cell = local * positions + columns.query
        grid = torch.zeros((examples * positions, 5), dtype=torch.float64, device=device).index_add_(
            0, cell, torch.stack([nontrivial, measured, rel_measured, trivial, torch.ones_like(trivial)], 1).to(
                torch.float64))
        averaged_index = torch.nonzero(grid[:, 1] > 0).flatten()
        averaged = grid[averaged_index, 2] / grid[averaged_index, 1]
        cell_trivial = int(((grid[:, 3] > 0) & (grid[:, 4] > 0)).sum())
        site.averaged.add_sorted(averaged, torch.zeros_like(averaged_index), 1, np.array([cell_trivial]))
        token = torch.zeros(examples * positions, dtype=torch.int64, device=device).index_copy_(0, cell,
                                                                                               columns.token_id)
        cell_role = torch.zeros(examples * positions, dtype=torch.int64, device=device).index_copy_(0, cell, role)
        grid = _host(grid).reshape(examples, positions, 5)
        running = self.queries.get(key[:3])
        present = grid[:, :, 4] > 0
        if running is None:
            running = self.queries[key[:3]] = [np.zeros((examples, positions, 4)),
                                               np.zeros((examples, positions), np.int64),
                                               np.zeros((examples, positions), np.int64)]
        width = max(running[0].shape[1], positions)
        running[0] = _grown(running[0], (examples, width, 4))
        running[1], running[2] = _grown(running[1], (examples, width)), _grown(running[2], (examples, width))
        running[0][:, :positions, :3] += grid[:, :, :3]
        running[0][:, :positions, 3] += present
        for slot, found in ((1, token), (2, cell_role)):
            running[slot][:, :positions] = np.where(present, _host(found).reshape(examples, positions),
                                                    running[slot][:, :positions])
        self.tokens.update(_host(torch.unique(columns.token_id)).tolist())

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
        every = torch.cat([hashes.to("cpu") for hashes, _ in self.candidates]) if self.candidates else None
        if every is None or len(every) <= self.sample:
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
        """The batch's statistics as an :class:`~probe.store.aggregates.AggregateState` (Arrow tables, built from
        numpy arrays without a Python object per record)."""
        kinds: dict[str, list[dict]] = {kind: [] for kind in stored.KINDS}
        roles = pa.array(ROLES, pa.string())
        ids = np.asarray(self.example_ids, dtype=np.int64)

        def add(kind: str, size: int, scalars: dict, **columns) -> None:
            """One part of a kind's table: ``scalars`` repeated ``size`` times, and the given columns."""
            part = {name: pa.repeat(pa.scalar(value), size) for name, value in scalars.items()}
            for name, value in columns.items():
                if name in ("bins", "counts"):
                    part[name] = _lists(value, pa.int32() if name == "bins" else pa.int64())
                elif name == "sketch":
                    part[name] = pa.array(value, pa.binary())
                elif name == "token_role":
                    part[name] = roles.take(pa.array(np.asarray(value, dtype=np.int64)))
                else:
                    part[name] = pa.array(np.asarray(value))
            kinds[kind].append(part)

        for site_key, site in self.sites.items():
            keys = dict(zip(stored.SITE_KEYS, site_key))
            heads = site.heads
            census = _grown(site.census, (heads, len(CENSUS))).astype(np.int64)
            add("census", heads, keys, head=np.arange(heads, dtype=np.int32),
                **{name: census[:, i] for i, name in enumerate(CENSUS)}, pairs_max=site.pairs_max)
            groups = len(site.rel.numbers)
            entries = [("rel_deviation", site.rel, np.arange(groups) // len(ROLES), np.arange(groups) % len(ROLES)),
                       (AVERAGED, site.averaged, np.array([-1]), None),
                       *((column, statistics, np.array([-1]), None) for column, statistics in site.quantities.items())]
            for column, statistics, head, role in entries:
                keep = np.flatnonzero((statistics.numbers[:, 0] > 0) | (statistics.numbers[:, 1] > 0))
                numbers = statistics.numbers[keep]
                bins, counts = statistics.histograms()
                sketches = statistics.sketches
                roles_here = {"token_role": role[keep]} if role is not None else {}
                add("values", len(keep), {"column": column, **keys, **({} if role is not None else {"token_role": ""})},
                    head=head[keep].astype(np.int32), **roles_here,
                    count=numbers[:, 0].astype(np.int64), trivial=numbers[:, 1].astype(np.int64),
                    sum=numbers[:, 2], sumsq=numbers[:, 3], above=numbers[:, 4].astype(np.int64),
                    min=np.where(numbers[:, 0] > 0, numbers[:, 5], np.nan),
                    max=np.where(numbers[:, 0] > 0, numbers[:, 6], np.nan),
                    bins=[bins[g] for g in keep], counts=[counts[g] for g in keep],
                    sketch=[sketches[g].serialize() if sketches is not None else b"" for g in keep])
            if site.worst:
                worst = {name: np.concatenate([w[name] for w in site.worst]) for name in site.worst[0]}
                order = np.lexsort((worst["query"], worst["example"], -worst["rel_deviation"], worst["head"]))
                head = worst["head"][order]
                keep = order[np.arange(len(order)) - np.searchsorted(head, head, side="left") < WORST_ROWS]
                add("worst", len(keep), keys, head=worst["head"][keep].astype(np.int32),
                    rel_deviation=worst["rel_deviation"][keep], example=worst["example"][keep],
                    query=worst["query"][keep].astype(np.int32), token_id=worst["token_id"][keep],
                    token_role=worst["role"][keep], n_keys=worst["n_keys"][keep].astype(np.int32))
            example, head = np.nonzero(site.examples[:, :, 0] > 0)
            found = site.examples[example, head]
            add("examples", len(example), keys, head=head.astype(np.int32), example=ids[example],
                n=found[:, 0].astype(np.int32), sum=found[:, 1], above=found[:, 2].astype(np.int32))
            query = np.flatnonzero(site.positions[:, 0] > 0)
            add("positions", len(query), keys, query=query.astype(np.int32),
                rows=site.positions[query, 0].astype(np.int64), n=site.positions[query, 1].astype(np.int64),
                sum=site.positions[query, 2])
            cells, counted = _sparse(site.example_bins)  # sorted by example, then bin
            if len(cells):
                example, first = np.unique(cells // stored.COARSE_BINS, return_index=True)
                add("example_bins", len(example), keys, example=ids[example],
                    bins=np.split((cells % stored.COARSE_BINS).astype(np.int32), first[1:]),
                    counts=np.split(counted, first[1:]))
        for (space, alpha, attention_type), (grid, token, role) in self.queries.items():
            example, query = np.nonzero(grid[:, :, 3] > 0)
            add("queries", len(example), {"space": space, "alpha": alpha, "attention_type": attention_type},
                example=ids[example], query=query.astype(np.int32), rows=grid[example, query, 0].astype(np.int32),
                n=grid[example, query, 1].astype(np.int32), sum=grid[example, query, 2],
                token_id=token[example, query].astype(np.int32), token_role=role[example, query])
        if self.tokens:
            met = np.asarray(sorted(self.tokens), dtype=np.int64)
            kinds["tokens"].append({"token_id": pa.array(met), "token": self.context.tokens(met)})
        tables = {}
        for kind, parts in kinds.items():
            if parts:
                names = [name for group in stored.KINDS[kind][:2] for name in group] + list(stored.KINDS[kind][2])
                tables[kind] = pa.Table.from_arrays([pa.concat_arrays([part[name] for part in parts])
                                                     for name in names], names=names)
        return AggregateState(tables)


def _lists(arrays: list, value_type) -> pa.Array:
    """A list column from numpy arrays, in one copy."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(value_type.to_pandas_dtype())))


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


def _sparse(pieces: list) -> tuple[np.ndarray, np.ndarray]:
    """Sparse histograms (bins, counts) of several pieces added into one."""
    if not pieces:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    if len(pieces) == 1:
        return pieces[0]
    bins = np.concatenate([b for b, _ in pieces]).astype(np.int64)
    counts = np.concatenate([c for _, c in pieces])
    unique, inverse = np.unique(bins, return_inverse=True)
    return unique, np.bincount(inverse, weights=counts).astype(np.int64)


def _fold_worst(site, columns: SiteColumns, index: torch.Tensor, group: torch.Tensor, groups: int,
                rel: torch.Tensor) -> None:
    """Keep, per (head, role) group, the site's largest :data:`WORST_ROWS` relative deviations and their ties
    (chosen exactly on the host later): each group's values in a row of a matrix, -inf beyond them; its top ones."""
    device, head, role = rel.device, columns.head, columns.role
    in_group, values_measured = group[index], rel[index]
    sizes = torch.bincount(in_group, minlength=groups)
    order = torch.argsort(in_group, stable=True)
    rank = torch.empty_like(index)
    rank[order] = torch.arange(len(index), device=device) - (torch.cumsum(sizes, 0) - sizes)[in_group[order]]
    masked = torch.full((groups, int(sizes.max())), -np.inf, dtype=torch.float64, device=device)
    masked[in_group, rank] = values_measured
    threshold = torch.topk(masked, min(WORST_ROWS, masked.shape[1]), dim=1).values[:, -1]
    chosen = index[values_measured >= threshold[in_group]]
    site.worst.append({"head": _host(head[chosen]), "rel_deviation": _host(rel[chosen]),
                       "example": _host(columns.example[chosen]), "query": _host(columns.query[chosen]),
                       "token_id": _host(columns.token_id[chosen]), "role": _host(role[chosen]),
                       "n_keys": _host(columns.n_keys[chosen])})

