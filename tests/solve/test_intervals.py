"""Rows whose preference is uniform over an interval of keys (causal masks, sliding windows): their second-order
systems solved by one factorisation per interval (probe.solve.second_order._solve_intervals), by the compiled code
(probe/solve/intervals.c, which moves a window of keys along each group) and by the torch code (prefix sums at the
bounds), each against the dense lambda_2 of the explicit template space; the compiled code's answers against
numpy's solves of each interval's matrix; damaged solves caught by their residuals; the cost model's choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.solve import native
from probe.solve import second_order as second_order_module
from probe.solve.dual import factor_gram
from probe.solve.newton_cg import hessian_times
from probe.solve.second_order import second_order_point

from ..support.dense_references import PATHS, check_second_order, dense_lambda_2, instance, lifted
from ..support.solver_problems import reduced

COMPILED = native.intervals_available(torch.zeros(1, 1, 1, dtype=torch.float64))


@pytest.fixture(params=["compiled", "torch"])
def interval_code(request, monkeypatch):
    """The interval path by the compiled code, or by the torch code (the compiled code made unavailable)."""
    if request.param == "compiled" and not COMPILED:
        pytest.skip(f"the compiled code is not available here: {native.unavailable_reason()}")
    if request.param == "torch":
        monkeypatch.setattr(native, "intervals_available", lambda a: False)
    return request.param


def interval_preferences(kind, n=16, heads=2, queries=6, seed=3, offset=0.0):
    """One group of heads x queries rows (head-major) whose preference is uniform over an interval of keys (a
    causal mask after three padding keys, a sliding window of four, a window per head) or is not (a hole in the
    support, a position bias): the interval path takes the first kinds only.  ``offset`` shifts every
    template."""
    T, Z, _ = instance(n, 7, heads * queries, scale=0.7, seed=seed)
    T = T + offset
    keys, rows = np.arange(n), []
    for head in range(heads):
        for q in range(queries):
            position = 3 + 2 * q
            if kind == "causal":
                allowed = (keys >= 3) & (keys <= position)
            elif kind == "window":
                allowed = (keys <= position) & (keys > position - 4)
            elif kind == "windows":
                allowed = (keys <= position) & (keys > position - 2 - 3 * head)
            else:  # not intervals: a hole (head 0), a position bias (head 1)
                allowed = (keys <= position) & ((keys != position - 1) | (head == 1))
            row = np.where(allowed, 0.0, -np.inf)
            if kind == "other" and head == 1:
                row = np.where(allowed, -0.3 * (position - keys), -np.inf)
            rows.append(row)
    return T, Z, np.array(rows)


@pytest.mark.parametrize("kind,offset", [("causal", 0.0), ("window", 0.0), ("windows", 0.0), ("causal", 30.0),
                                         ("window", 30.0), ("other", 0.0)])
def test_rows_uniform_over_an_interval_are_solved_by_their_own_factors(monkeypatch, interval_code, kind, offset):
    """Rows uniform over an interval of keys (causal masks, sliding windows; templates far from the origin, where
    the prefix sums' subtraction would cancel, as far as the reduced form itself stays within its certificate):
    lambda_2 of every row against the dense one, within the certified error; CG is left only the rows that are
    not intervals (``other``)."""
    T, Z, log_u = interval_preferences(kind, offset=offset)
    problems = reduced(T, Z, log_u, 0.6)
    factor = factor_gram(problems.gram)
    given_to_cg = []
    solve_cg = second_order_module._solve_cg

    def recorded(a, u, rhs, rhs_norm, tolerance, pending, *rest):
        given_to_cg.append(pending.clone())
        return solve_cg(a, u, rhs, rhs_norm, tolerance, pending, *rest)

    monkeypatch.setattr(second_order_module, "_solve_cg", recorded)
    point, point_error = second_order_point(factor, problems.logits, problems.log_preference, 0.6,
                                            **PATHS["intervals"])
    check_second_order(T, Z, log_u, 0.6, factor, point, point_error)
    to_cg = sorted(torch.cat(given_to_cg).nonzero()[:, -1].tolist()) if given_to_cg else []
    assert to_cg == ([] if kind != "other" else list(range(len(Z))))


@pytest.mark.parametrize("piece", [1, 3, 32])
def test_interval_sums_are_the_sums_over_each_interval(piece):
    """The prefix sums at the bounds against numpy's sums over each interval: several groups, intervals that
    start after the first key, repeat, nest and touch the last key, pieces of any length."""
    rng = np.random.default_rng(piece)
    a = rng.normal(size=(3, 23, 4)) + 2.0
    intervals = [(0, 0, 5), (0, 2, 5), (0, 0, 23), (0, 22, 23), (1, 7, 19), (1, 7, 19), (1, 3, 4), (2, 0, 1),
                 (2, 10, 23), (2, 4, 12)]
    group, start, stop = (torch.tensor(column) for column in zip(*intervals))
    total, outer = second_order_module._interval_sums(torch.as_tensor(a), group, start, stop, piece=piece)
    for c, (g, lo, hi) in enumerate(intervals):
        np.testing.assert_allclose(total[c].numpy(), a[g, lo:hi].sum(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(outer[c].numpy(), a[g, lo:hi].T @ a[g, lo:hi], rtol=1e-12, atol=1e-11)


def test_rows_left_to_cg_where_their_own_factors_cost_more(interval_code):
    """By default a few rows of short intervals go to CG (the cost model of _intervals_pay), and many rows of
    long intervals shared by several heads do not; both certified against the dense lambda_2."""
    pay = second_order_module._intervals_pay
    for compiled in (False, True):
        assert not pay(128, 64, sharing=1, rows_per_group=8, compiled=compiled)
        assert pay(1024, 64, sharing=3, rows_per_group=3072, compiled=compiled)
    # the compiled code's factorisations pay from shorter contexts: a full causal run of 3 heads a mask at 128 keys
    assert pay(128, 64, sharing=3, rows_per_group=384, compiled=True)
    assert not pay(128, 64, sharing=3, rows_per_group=384, compiled=False)
    T, Z, log_u = interval_preferences("causal")
    problems = reduced(T, Z, log_u, 0.6)
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(factor, problems.logits, problems.log_preference, 0.6)
    check_second_order(T, Z, log_u, 0.6, factor, point, point_error)


@pytest.mark.parametrize("budget_rows", [1, 3])
def test_intervals_in_chunks_give_the_same_answers(monkeypatch, budget_rows):
    """A memory budget of a few intervals' matrices splits the torch code's intervals into chunks (each with its
    own prefix sums)."""
    monkeypatch.setattr(native, "intervals_available", lambda a: False)
    T, Z, log_u = interval_preferences("windows", n=20, queries=8)
    problems = reduced(T, Z, log_u, 0.6)
    factor = factor_gram(problems.gram)
    r = factor.shape[-1]
    point, point_error = second_order_point(factor, problems.logits, problems.log_preference, 0.6,
                                            memory_budget_bytes=budget_rows * 8 * 4 * r * r, **PATHS["intervals"])
    check_second_order(T, Z, log_u, 0.6, factor, point, point_error)


@pytest.mark.parametrize("loose", [False, True])
def test_a_damaged_interval_solve_is_caught_by_its_residual(monkeypatch, interval_code, loose):
    """The interval path's solves spoiled by 1e-4 (the torch code's triangular solves, the compiled code's
    answers): at the default tolerance its rows go to CG and come out right; at a loose error target they are
    kept, with a certified error that covers the damage."""
    T, Z, log_u = interval_preferences("causal")
    problems = reduced(T, Z, log_u, 1.3)
    factor = factor_gram(problems.gram)
    if interval_code == "torch":
        exact = torch.cholesky_solve
        monkeypatch.setattr(torch, "cholesky_solve", lambda *args: exact(*args) * (1 + 1e-4))
    else:
        compiled = native.interval_solve

        def spoiled(*args):
            x, solved = compiled(*args)
            return x * (1 + 1e-4), solved

        monkeypatch.setattr(native, "interval_solve", spoiled)
    target = torch.full(problems.logits.shape[:2], 1e-2) if loose else None
    point, point_error = second_order_point(factor, problems.logits, problems.log_preference, 1.3,
                                            error_target=target, **PATHS["intervals"])
    lam_2s = lifted(T, Z, 1.3, factor, point)
    errors = torch.tensor([np.linalg.norm(lam_2s[j] - dense_lambda_2(T, Z[j], log_u[j], 1.3)) for j in range(len(Z))])
    if loose:  # the damage was kept where there was any (a row of one key has x = 0), and certified
        several = torch.as_tensor(np.isfinite(log_u).sum(-1) > 1)
        assert bool((errors[several] > 1e-9).all()) and bool((point_error[0] >= errors).all())
    else:
        check_second_order(T, Z, log_u, 1.3, factor, point, point_error)




def _dense_interval_solution(a, lo, hi, alpha, b):
    """x = H^{-1} b for H = I/alpha + S/k - abar abar^T over the keys lo..hi-1 of a (numpy)."""
    keys = a[lo:hi]
    mean = keys.mean(0)
    H = np.eye(a.shape[1]) / alpha + keys.T @ keys / len(keys) - np.outer(mean, mean)
    return np.linalg.solve(H, b.T).T


@pytest.mark.skipif(not COMPILED, reason="the compiled code is not available here")
@pytest.mark.parametrize("offset", [0.0, 5.0])
def test_compiled_windows_solve_every_interval(offset):
    """The compiled code's window moved every way a sequence of intervals can move it (grown, shrunk from either
    end, jumped past, moved back, across groups, kept after many keys came and went) and its answers against
    numpy's solve of each interval's own matrix; intervals that are no interval are reported unsolved."""
    rng = np.random.default_rng(7)
    g, n, r, alpha = 3, 40, 6, 0.7
    a = rng.normal(size=(g, n, r)) + offset
    intervals = [(0, 0, 1), (0, 0, 2), (0, 0, 9), (0, 3, 9), (0, 3, 7), (0, 1, 7), (0, 20, 30), (0, 21, 31),
                 (0, 2, 40), (1, 5, 6), (1, 5, 6), (0, 0, 40), (2, 0, 40), (2, 7, 5), (2, 0, 41)]
    slide = [(1, lo, lo + 8) for lo in range(0, 33)] + [(1, lo, lo + 3) for lo in range(30, 0, -1)]
    intervals += slide
    counts = rng.integers(0, 4, size=len(intervals))
    offset_rows = np.concatenate([[0], np.cumsum(counts)])
    rhs = rng.normal(size=(int(offset_rows[-1]), r))
    group, start, stop = (torch.tensor(column) for column in zip(*intervals))
    flops_before = native.FLOPS["float64"]
    x, solved = native.interval_solve(torch.as_tensor(a), group, start, stop, torch.as_tensor(offset_rows),
                                      torch.as_tensor(rhs), alpha)
    valid = [0 <= lo < hi <= n for _, lo, hi in intervals]
    assert solved.tolist() == valid
    # the flops it counts: at least each factorisation's r^3/3, each row's two triangular solves and each key's update
    least = sum(r**3 / 3 + 2 * r * r * counts[c] + (hi - lo) * r * (r + 1) * (c == 0)
                for c, (_, lo, hi) in enumerate(intervals) if valid[c])
    assert native.FLOPS["float64"] - flops_before >= least
    for c, (k, lo, hi) in enumerate(intervals):
        if valid[c] and counts[c]:
            rows = slice(offset_rows[c], offset_rows[c + 1])
            expected = _dense_interval_solution(a[k], lo, hi, alpha, rhs[rows])
            scale = 1.0 + offset**2  # the sums' rounding grows with the templates' distance from the origin
            np.testing.assert_allclose(x[rows].numpy(), expected, rtol=0, atol=1e-11 * scale * np.abs(rhs).max())


@pytest.mark.parametrize("kind", ["causal", "windows", "other"])
@pytest.mark.parametrize("cache_bytes", [1, 4 << 20])
def test_the_residual_over_the_keys_in_use_is_the_whole_residual(kind, cache_bytes):
    """The interval path's residual, formed over the keys from the first to the last that a piece of rows uses,
    against the residual over every key, for answers that are not the solution (so that every term counts)."""
    T, Z, log_u = interval_preferences(kind)
    problems = reduced(T, Z, log_u, 0.6)
    a = factor_gram(problems.gram).to(torch.float64)
    u = torch.softmax(problems.log_preference.to(torch.float64).expand(problems.logits.shape), dim=-1)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(*u.shape[:2], a.shape[-1], generator=generator, dtype=torch.float64)
    rhs = torch.randn(*u.shape[:2], a.shape[-1], generator=generator, dtype=torch.float64)
    support = u > 0
    first = support.to(torch.int8).argmax(-1)
    last = u.shape[-1] - 1 - support.flip(-1).to(torch.int8).argmax(-1)
    whole = (rhs - hessian_times(a, 0.6, u, x)).norm(dim=-1)
    pieces = second_order_module._misfit(a, 0.6, u, rhs, x, first, last, cache_bytes=cache_bytes)
    torch.testing.assert_close(pieces, whole, rtol=1e-12, atol=0)
