"""The second-order prediction (probe.solve.second_order) against the dense lambda_2 of the explicit template
space (Sigma_u formed from explicit templates), along every path that solves its systems: classes of rows
sharing a preference, rows uniform over an interval of keys (their own tests: test_intervals.py), CG; its certified
error against the true one, also for damaged solves, error targets and tiles; and its order in alpha."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.solve import second_order as second_order_module
from probe.solve.dual import factor_gram, solve_dual
from probe.solve.reference import cvxpy_primal
from probe.solve.second_order import _preference_classes, second_order_point

from ..support.dense_references import (
    PATHS,
    TOL,
    check_second_order,
    dense_lambda_2,
    derive,
    instance,
    lifted,
    newton_dual,
)
from ..support.solver_problems import reduced

CASES = [  # (n, d, alpha, duplicates, zeros)
    (1, 3, 1.0, 0, 0),
    (2, 4, 0.1, 0, 0),
    (2, 1, 10.0, 0, 0),
    (5, 8, 1.0, 0, 2),
    (5, 3, 3.0, 0, 1),  # d < n: rank-deficient G
    (30, 40, 0.1, 0, 10),
    (30, 10, 1.0, 0, 5),
    (30, 40, 10.0, 6, 3),  # duplicate templates
]


@pytest.mark.parametrize("n,d,alpha,duplicates,zeros", CASES)
def test_second_order_matches_dense_newton_and_cvxpy(n, d, alpha, duplicates, zeros):
    T, Z, log_u = instance(n, d, 3, scale=0.5, duplicates=duplicates, zeros=zeros, seed=n * 100 + d)
    problems = reduced(T, Z, log_u, alpha)
    solution = solve_dual(problems)
    assert bool(solution.converged.all())
    derived = derive(problems, solution)
    lam_2s, (value, bound) = lifted(T, Z, alpha, derived["factor"], derived["point"]), derived["second_order"]
    for j in range(len(Z)):
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        assert np.linalg.norm(lam_2s[j] - lam_2) <= TOL * np.linalg.norm(lam_2)
        # lambda* two ways: dense Newton (certified to ~1e-16 here) and CVXPY, whose own error on these
        # small-||lambda*|| instances (alpha = 0.1) reaches a few 1e-7 relative
        lam_newton, newton_error = newton_dual(T, Z[j], log_u[j], alpha)
        assert newton_error < 1e-13 * np.linalg.norm(lam_newton)
        expected = np.linalg.norm(lam_newton - lam_2) / np.linalg.norm(lam_newton)
        assert value[0, j].item() == pytest.approx(expected, abs=1e-9)
        lam_cvxpy, _ = cvxpy_primal(T, Z[j], log_u[j], alpha)
        expected = np.linalg.norm(lam_cvxpy - lam_2) / np.linalg.norm(lam_cvxpy)
        assert value[0, j].item() == pytest.approx(expected, abs=1e-6)
        assert bound[0, j].item() < 1e-7


#: how second_order_point solves its systems: by its cost model; one factorisation per class of rows sharing u,
#: through the class's maps M and D, or row by row with the factor (as for a selection's few rows); CG only
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n,d,alpha,duplicates,zeros", CASES)
def test_second_order_paths_match_dense(n, d, alpha, duplicates, zeros, path):
    """Every row of a group with its own preference: factorised one by one, or by CG."""
    T, Z, log_u = instance(n, d, 5, scale=0.5, duplicates=duplicates, zeros=zeros, seed=n * 100 + d)
    problems = reduced(T, Z, log_u, alpha)
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(
        factor, problems.logits, problems.log_preference, alpha, **PATHS[path]
    )
    check_second_order(T, Z, log_u, alpha, factor, point, point_error)


def shared_preferences(kind, n=12, heads=3, queries=5, seed=0):
    """One group of heads x queries rows (head-major) whose preferences repeat as in real sites: one for
    the group (BERT), one per query shared by the heads (a causal mask: the first q + 1 keys), or a mix of
    shared, distinct and inactive rows with zeros."""
    rng = np.random.default_rng(seed)
    T, Z, _ = instance(n, 7, heads * queries, scale=0.7, seed=seed)
    m = heads * queries
    active = np.ones(m, dtype=bool)
    if kind == "group":
        log_u = np.tile(np.where(np.arange(n) < n - 2, 0.0, -np.inf), (m, 1))  # two padding keys
    elif kind == "causal":
        per_query = np.array([np.where(np.arange(n) <= q + 3, 0.0, -np.inf) for q in range(queries)])
        log_u = np.tile(per_query, (heads, 1))
    else:
        shared = rng.normal(size=n)
        shared[[2, 5]] = -np.inf
        log_u = np.tile(shared, (m, 1))
        log_u[1::3] = rng.normal(size=(len(log_u[1::3]), n))  # distinct rows among shared ones
        log_u[4] = log_u[1]  # a second class
        active[[2, 7]] = False
    return T, Z, log_u, active


@pytest.mark.parametrize("kind", ["group", "group view", "causal", "mixed"])
@pytest.mark.parametrize("path", PATHS)
def test_second_order_rows_sharing_preferences_match_dense(kind, path):
    """Rows sharing a preference found by comparison, or given as a view of the group's row (stride 0, as
    BERT-like masks are: one class per group without a search), with inactive rows among them."""
    T, Z, log_u, active = shared_preferences(kind.split()[0])
    problems = reduced(T, Z, log_u, 0.7)
    if kind == "group view":
        problems.log_preference = problems.log_preference[:, :1].expand_as(problems.logits)
        active[[3, 8]] = False
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(
        factor, problems.logits, problems.log_preference, 0.7, torch.as_tensor(active)[None],
        **PATHS[path],
    )
    check_second_order(T, Z, log_u, 0.7, factor, point, point_error, rows=np.flatnonzero(active))
    assert bool(point[0, ~torch.as_tensor(active)].isnan().all())


@pytest.mark.parametrize("kind", ["group", "causal", "mixed"])
@pytest.mark.parametrize("min_rows", [1, 2, 4])
def test_preference_classes_are_the_exact_partition(kind, min_rows):
    """The classes found are numpy's unique rows of u among the live rows (those of at least min_rows)."""
    T, Z, log_u, active = shared_preferences(kind)
    u = torch.softmax(torch.as_tensor(np.where(active[:, None], log_u, 0.0)), dim=-1)[None]
    found = _preference_classes(u, torch.as_tensor(active)[None], min_rows)
    live = np.flatnonzero(active)
    _, inverse, counts = np.unique(u[0].numpy()[live], axis=0, return_inverse=True, return_counts=True)
    expected = sorted(tuple(live[inverse.ravel() == c]) for c in range(len(counts)) if counts[c] >= min_rows)
    if not expected:
        assert found is None
        return
    groups, first, table, valid = found
    assert torch.equal(groups, torch.zeros_like(groups))
    if table is None:  # each class is every live row of its group
        classes = [tuple(np.flatnonzero(valid[c].numpy())) for c in range(len(groups))]
    else:
        classes = [tuple(sorted(table[c][valid[c]].tolist())) for c in range(len(groups))]
    assert sorted(classes) == expected
    assert all(row == min(c) for row, c in zip(first.tolist(), classes))


def test_direct_solves_left_above_tolerance_go_to_cg():
    """rtol = 0 is beyond any solve: the direct solutions fail their check and CG takes the rows over (to
    its step limit); the values and their bounds stay right."""
    T, Z, log_u, active = shared_preferences("group")
    problems = reduced(T, Z, log_u, 1.3)
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(factor, problems.logits, problems.log_preference, 1.3, rtol=0.0)
    check_second_order(T, Z, log_u, 1.3, factor, point, point_error)


@pytest.mark.parametrize("path,spoiled", [("direct", "cholesky_inverse"), ("direct rows", "cholesky_solve")])
@pytest.mark.parametrize("loose", [False, True])
def test_a_damaged_direct_solve_is_caught_by_its_residual(monkeypatch, loose, path, spoiled):
    """The direct solve's inverse (or, row by row, its triangular solves) spoiled by 1e-4 (as rounding
    could): at the default tolerance its rows go to CG and come out right; at a loose error target they are
    kept, and their certified error still covers the damage (so the residual is an honest one, not the
    inverse's own estimate)."""
    T, Z, log_u, _ = shared_preferences("group")
    problems = reduced(T, Z, log_u, 1.3)
    factor = factor_gram(problems.gram)
    exact = getattr(torch, spoiled)
    monkeypatch.setattr(torch, spoiled, lambda *args: exact(*args) * (1 + 1e-4))
    target = torch.full(problems.logits.shape[:2], 1e-2) if loose else None
    point, point_error = second_order_point(
        factor, problems.logits, problems.log_preference, 1.3, error_target=target, **PATHS[path]
    )
    lam_2s = lifted(T, Z, 1.3, factor, point)
    errors = torch.tensor([np.linalg.norm(lam_2s[j] - dense_lambda_2(T, Z[j], log_u[j], 1.3)) for j in range(len(Z))])
    if loose:  # the damage was kept, and certified
        assert bool((errors > 1e-9).all()) and bool((point_error[0] >= errors).all())
    else:  # CG repaired it
        check_second_order(T, Z, log_u, 1.3, factor, point, point_error)


@pytest.mark.parametrize("path", ["direct", "direct rows", "cg"])
def test_error_target_stops_rows_there_and_stays_certified(path):
    """A row may stop once its certified error reaches error_target: its error is then at most about the
    target, and still below the reported bound."""
    T, Z, log_u = instance(30, 40, 6, scale=0.5, zeros=4, seed=7)
    if path.startswith("direct"):
        log_u[:] = log_u[0]
    problems = reduced(T, Z, log_u, 2.0)
    target = torch.full((1, 6), 1e-5)
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(
        factor, problems.logits, problems.log_preference, 2.0, error_target=target, **PATHS[path],
    )
    assert bool((point_error <= 1.5 * target).all())
    if path == "cg":
        assert bool((point_error > 1e-9).any())  # it did stop early
    lam_2s = lifted(T, Z, 2.0, factor, point)
    for j in range(len(Z)):
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], 2.0)
        assert np.linalg.norm(lam_2s[j] - lam_2) <= point_error[0, j].item() + 1e-12


@pytest.mark.parametrize("path", PATHS)
def test_second_order_tiles_give_the_same_answers(path):
    """A memory budget of a few rows splits the groups into tiles (and classes across tiles)."""
    T, Z, log_u, active = shared_preferences("causal")
    groups = [reduced(T, Z, log_u, 0.5), reduced(T[::-1].copy(), Z, log_u, 0.5)]
    factor = factor_gram(torch.cat([g.gram for g in groups]))
    logits = torch.cat([g.logits for g in groups])
    log_pref = torch.cat([g.log_preference for g in groups])
    whole = second_order_point(factor, logits, log_pref, 0.5, **PATHS[path])
    tiled = second_order_point(
        factor, logits, log_pref, 0.5, **PATHS[path], memory_budget_bytes=4 * 16 * T.shape[0] * 8
    )
    bound = whole[1] + tiled[1] + 1e-13
    difference = (whole[0] - tiled[0]).norm(dim=-1)  # ||lambda_2 - lambda_2'|| (V orthonormal)
    assert bool((difference <= bound).all())
    for g, T_g in enumerate([T, T[::-1].copy()]):
        check_second_order(T_g, Z, log_u, 0.5, factor, tiled[0], tiled[1], group=g)


@pytest.mark.parametrize("some_rows", [False, True])
def test_cg_in_pieces_of_one_row_gives_the_same_answers(monkeypatch, some_rows):
    """CG a row of every group at a time (its working set made to fill the cache alone), on every row or on the
    rows the direct solve leaves (gathered first): the same answers as in one piece, within their certificates,
    and each against the dense lambda_2."""
    T, Z, log_u, _ = shared_preferences("mixed" if some_rows else "causal")
    groups = [reduced(T, Z, log_u, 0.5), reduced(T[::-1].copy(), Z, log_u, 0.5)]
    factor = factor_gram(torch.cat([g.gram for g in groups]))
    logits = torch.cat([g.logits for g in groups])
    log_pref = torch.cat([g.log_preference for g in groups])
    path = {"direct_min_rows": 2, "intervals": False} if some_rows else PATHS["cg"]
    whole = second_order_point(factor, logits, log_pref, 0.5, **path)
    pieces = []
    solve = second_order_module.solve_spd_reduced

    def counted(a, u, *args):
        pieces.append(u.shape[1])
        return solve(a, u, *args)

    monkeypatch.setattr(second_order_module, "solve_spd_reduced", counted)
    monkeypatch.setattr(second_order_module, "_CG_ROW_BYTES", 1 << 40)
    one_by_one = second_order_point(factor, logits, log_pref, 0.5, **path)
    assert len(pieces) > 1 and set(pieces) == {1}
    difference = (whole[0] - one_by_one[0]).norm(dim=-1)
    assert bool((difference <= whole[1] + one_by_one[1] + 1e-13).all())
    for g, T_g in enumerate([T, T[::-1].copy()]):
        check_second_order(T_g, Z, log_u, 0.5, factor, one_by_one[0], one_by_one[1], group=g)


def test_second_order_is_exact_for_a_single_key():
    """n = 1: Sigma_u = 0, so lambda_2 = alpha z = lambda* and both deviations vanish."""
    T, Z, log_u = instance(1, 4, 2, seed=3)
    problems = reduced(T, Z, log_u, 2.0)
    point, point_error = second_order_point(factor_gram(problems.gram), problems.logits, problems.log_preference, 2.0)
    assert torch.equal(point, torch.zeros_like(point)) and torch.equal(point_error, torch.zeros_like(point_error))


def deviations_at(T, Z, log_u, alpha):
    problems = reduced(T, Z, log_u, alpha)
    solution = solve_dual(problems, rtol=1e-12)
    value, _ = derive(problems, solution)["second_order"]
    return value[0].numpy(), solution.rel_deviation[0].numpy()


@pytest.mark.parametrize("seed", range(4))
def test_second_order_is_higher_order_in_alpha_for_fixed_evidence(seed):
    """For fixed z, lambda* - alpha z = O(alpha^2) but lambda* - lambda_2 = O(alpha^3): the second-order
    deviation is O(alpha^2) while rel_deviation is O(alpha), so their ratio falls like alpha."""
    T, Z, log_u = instance(12, 8, 4, seed=seed)
    second, first = deviations_at(T, Z, log_u, 1e-2)
    assert np.all(second < 0.05 * first)
    second_small, first_small = deviations_at(T, Z, log_u, 1e-3)
    assert np.all(second_small / first_small < 0.2 * second / first)


def test_second_order_in_the_pipeline_convention():
    """The pipeline keeps the model's logits alpha s fixed (evidence z_model / alpha).  There lambda* ->
    z_model as alpha -> 0 and lambda* - lambda_2 = alpha (mu - T^T p_att + Sigma_u z_model) + O(alpha^2):
    the linearisation error of the softmax at the model's logits does not vanish with alpha, so the
    ratio to rel_deviation tends to a non-zero constant.  What makes the second order exact to higher
    order is small model logits: scaling them by e gives a ratio of O(e)."""
    T, Z, log_u = instance(12, 8, 4, seed=11)
    ratios = [np.divide(*deviations_at(T, Z / alpha, log_u, alpha)) for alpha in (1e-2, 1e-3)]
    np.testing.assert_allclose(ratios[0], ratios[1], rtol=0.05)
    assert np.all(ratios[1] > 0.1)
    by_scale = [np.divide(*deviations_at(T, scale * Z, log_u, 0.5)) for scale in (1e-1, 1e-2)]
    assert np.all(by_scale[1] < 0.2 * by_scale[0]) and np.all(by_scale[1] < 0.05)
