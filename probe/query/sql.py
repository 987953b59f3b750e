"""The SQL pieces readers build questions from: the slice predicate :func:`where`, and bins that count
exactly as numpy and pandas do (the report's histograms, the exact quantiles' pass 1)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from probe.store.engine import equals, literal, memory_budget, name


def where(*, space=..., alpha=..., trivial: bool | None = None, **equal) -> str:
    """A SQL predicate over the ``rows`` view: the one place that says what a slice and trivial rows are.

    ``space`` and ``alpha`` select one (space, alpha) slice; ``None`` (a version-1 run without the column)
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


def log_bin(value: str) -> str:
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


