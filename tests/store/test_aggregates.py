"""The aggregates' building blocks against independent references: the stated rank error is DataSketches' own
for the k used; the fixed bins count values as ``numpy.histogram`` does on their edges; the sample's hash is the
same on the device (torch) as on the host (numpy) and keeps a uniform sample; merging states is exact for every
statistic but the sketches, which stay within their bound."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from probe.batch import aggregates as device
from probe.batch.columns import SiteColumns
from probe.store import aggregates as stored


def test_the_stated_rank_error_is_datasketches_and_at_most_one_percent():
    from datasketches import kll_doubles_sketch

    assert stored.RANK_ERROR == kll_doubles_sketch.get_normalized_rank_error(stored.KLL_K, False) <= 0.01
    assert kll_doubles_sketch.get_normalized_rank_error(260, False) > 0.01  # k = 270 would be the smallest
    assert stored.rank_error() == stored.RANK_ERROR


def _values(rng, n=200_000):
    """Values over every part of the bins: the linear range, its top, the octaves, the overflow, and edges."""
    return np.concatenate([
        rng.uniform(0, 4, n), rng.exponential(0.1, n), 4 * np.exp2(rng.uniform(0, 18, n // 10)),
        rng.uniform(2.0**20, 2.0**22, 100), stored.FINE_EDGES[:-1], np.nextafter(stored.FINE_EDGES[1:-1], 0), [0.0],
    ])


def test_fine_bins_count_as_numpy_histogram_on_their_edges():
    values = _values(np.random.default_rng(0))
    reference = np.searchsorted(stored.FINE_EDGES, values, side="right") - 1  # numpy.histogram's bins
    assert (stored.fine_bins(values) == reference).all()
    assert (device.fine_bins(torch.from_numpy(values)).numpy() == reference).all()
    counts = np.bincount(stored.fine_bins(values), minlength=stored.FINE_BINS)
    finite = np.r_[stored.FINE_EDGES[:-1], 2.0**30]
    assert (counts == np.histogram(values, finite)[0]).all()
    assert len(stored.FINE_EDGES) == stored.FINE_BINS + 1 and (np.diff(stored.FINE_EDGES) > 0).all()
    assert stored.FINE_EDGES[1] == 1 / 1024 and stored.FINE_EDGES[stored.LINEAR_BINS] == 4.0
    coarse = stored.COARSE_OF_FINE[stored.fine_bins(values)]
    assert (coarse == np.searchsorted(stored.COARSE_EDGES, values, side="right") - 1).all()


def _columns(n, rng, layer=2, space="hidden", alpha=0.5, attention_type="self"):
    head = torch.from_numpy(rng.integers(0, 12, n))
    return SiteColumns(attention_type, layer, space, alpha, torch.from_numpy(rng.integers(0, 10**9, n)), head,
                       torch.from_numpy(rng.integers(0, 512, n)), torch.zeros(n, dtype=torch.int64),
                       torch.full((n,), 5), torch.zeros(n, dtype=torch.int64), {})


def test_the_sample_hash_is_the_same_on_the_device_and_the_host_and_uniform():
    rng = np.random.default_rng(1)
    columns = _columns(100_000, rng)
    on_device = device.row_hash(7, columns).numpy()
    on_host = stored.row_hash(7, "hidden", 0.5, "self", np.full(100_000, 2), columns.head.numpy(),
                              columns.example.numpy(), columns.query.numpy())
    assert (on_device == on_host).all()
    assert len(np.unique(on_host)) == len(on_host)  # distinct keys, distinct hashes
    assert not (device.row_hash(8, columns).numpy() == on_host).any()  # the seed changes every hash
    # uniform: the smallest 10% by hash hold each head's share of the rows (chi-square, 11 degrees of freedom)
    chosen = columns.head.numpy()[np.argsort(on_host)[:10_000]]
    observed = np.bincount(chosen, minlength=12)
    expected = np.bincount(columns.head.numpy(), minlength=12) / 10
    assert ((observed - expected) ** 2 / expected).sum() < 31.3  # the 99.9% quantile of chi2(11)


def _state(values: np.ndarray, head: np.ndarray, example: np.ndarray, query: np.ndarray) -> stored.AggregateState:
    """A state of one site's values per head, built directly (the reference for merging)."""
    records = []
    for h in np.unique(head):
        x = np.sort(values[head == h])
        bins, counts = np.unique(stored.fine_bins(x), return_counts=True)
        records.append({"column": "rel_deviation", "space": "hidden", "alpha": 1.0, "attention_type": "self",
                        "layer": 0, "head": int(h), "token_role": "word", "count": len(x), "trivial": 0,
                        "sum": float(x.sum()), "sumsq": float((x * x).sum()), "above": int((x > stored.FAR).sum()),
                        "min": float(x[0]), "max": float(x[-1]), "bins": bins.astype(np.int32), "counts": counts,
                        "sketch": stored.sketch_bytes(x)})
    worst = pd.DataFrame({"space": "hidden", "alpha": 1.0, "attention_type": "self", "layer": 0, "head": head,
                          "rel_deviation": values, "example": example, "query": query,
                          "token_id": 0, "token_role": "word", "n_keys": 3})
    return stored.AggregateState({"values": pd.DataFrame.from_records(records),
                                  "worst": stored.worst_rows(worst)})


def test_merging_states_is_exact_but_for_the_sketches_which_stay_within_their_bound():
    rng = np.random.default_rng(2)
    n = 60_000
    values, head, example = rng.gamma(2.0, 0.03, n), rng.integers(0, 4, n), rng.integers(0, 500, n)
    query = np.arange(n) % 7
    pieces = np.array_split(np.arange(n), 9)
    merged = stored.merge(
        stored.AggregateState.from_arrow(_state(values[p], head[p], example[p], query[p]).to_arrow())
        for p in pieces)
    whole = _state(values, head, example, query)
    a, b = merged["values"].set_index("head"), whole["values"].set_index("head")
    for column in ("count", "above", "min", "max"):
        assert (a[column] == b[column]).all(), column
    assert np.allclose(a["sum"], b["sum"], rtol=1e-12) and np.allclose(a["sumsq"], b["sumsq"], rtol=1e-12)
    for h in b.index:
        assert (stored.dense(a.loc[h, "bins"], a.loc[h, "counts"]) == stored.dense(b.loc[h, "bins"],
                                                                                   b.loc[h, "counts"])).all()
        x = np.sort(values[head == h])
        sketch = stored.merged_sketch([a.loc[h, "sketch"]])
        assert sketch.n == len(x)
        for q in (0.01, 0.25, 0.5, 0.95, 0.99):
            rank = np.searchsorted(x, sketch.get_quantile(q), side="right") / len(x)
            assert abs(rank - q) <= stored.RANK_ERROR, (h, q, rank)
    pd.testing.assert_frame_equal(merged["worst"].reset_index(drop=True), whole["worst"].reset_index(drop=True),
                                  check_dtype=False)
    expected = (pd.DataFrame({"head": head, "v": values, "e": example, "q": np.arange(n) % 7})
                .sort_values(["head", "v", "e", "q"], ascending=[True, False, True, True]).groupby("head").head(8))
    assert np.array_equal(np.sort(merged["worst"]["rel_deviation"].to_numpy()), np.sort(expected["v"].to_numpy()))
