"""Derived quantities (probe.solve.derived) against independent dense computations in the explicit template
space: the second-order prediction from Sigma_u formed from explicit templates, lambda* from CVXPY or
a dense Newton solver written here, softmaxes, outputs and entropies in numpy/scipy; and their certified
bounds against the true errors, also for solves stopped early and hard instances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from probe.solve.derived import (
    attention_deviations,
    attention_entropy,
    attention_tv,
    model_attention,
    model_log_attention,
    output_deviation,
)
from probe.solve.dual import factor_gram, solve_dual
from probe.solve.reference import cvxpy_primal
from probe.solve.second_order import _preference_classes, second_order_deviation, second_order_point

from ..support.solver_problems import reduced

TOL = 1e-7


# ---------------------------------------------------------------- independent dense references


def normalised(log_u):
    keep = np.isfinite(log_u)
    u = np.zeros(len(log_u))
    u[keep] = np.exp(log_u[keep] - log_u[keep].max())
    return u / u.sum()


def softmax(theta):
    theta = np.asarray(theta, dtype=float)
    out = np.zeros_like(theta)
    keep = np.isfinite(theta)
    out[keep] = np.exp(theta[keep] - theta[keep].max())
    return out / out.sum()


def dense_lambda_2(T, z, log_u, alpha):
    """lambda_2 = alpha (I + alpha Sigma_u)^{-1} z with Sigma_u = sum_i u_i t_i t_i^T - mu mu^T (d x d)."""
    u = normalised(log_u)
    mu = T.T @ u
    sigma = T.T @ (u[:, None] * T) - np.outer(mu, mu)
    return alpha * np.linalg.solve(np.eye(T.shape[1]) + alpha * sigma, z)


def newton_dual(T, z, log_u, alpha, max_iter=500):
    """Maximise (D) in the explicit d-dimensional space by damped Newton with a dense Hessian.

    Returns (lambda, its certified error alpha ||grad D(lambda)||, by 1/alpha-strong concavity)."""
    keep = np.isfinite(log_u)
    T_s, u = T[keep], normalised(log_u)[keep]
    log_u_s = np.log(u)
    b = T_s.T @ u + z

    def dual(lam):
        theta = log_u_s + T_s @ lam
        top = theta.max()
        return lam @ b - lam @ lam / (2 * alpha) - top - np.log(np.exp(theta - top).sum())

    def gradient(lam):
        p = softmax(log_u_s + T_s @ lam)
        return b - lam / alpha - T_s.T @ p, p

    lam = alpha * z
    for _ in range(max_iter):
        grad, p = gradient(lam)
        norm = np.linalg.norm(grad)
        hessian = np.eye(len(z)) / alpha + T_s.T @ ((np.diag(p) - np.outer(p, p)) @ T_s)
        direction = np.linalg.solve(hessian, grad)
        # Armijo on (D); near the optimum (D) cannot resolve the gain, so a step that shrinks the
        # gradient is taken too.  Stop when neither makes progress.
        step, value = 1.0, dual(lam)
        while step > 1e-12:
            trial = lam + step * direction
            if dual(trial) >= value + 1e-4 * step * (grad @ direction) or np.linalg.norm(gradient(trial)[0]) < 0.5 * norm:
                break
            step /= 2
        if step <= 1e-12:
            break
        lam = trial
    grad, _ = gradient(lam)
    return lam, alpha * np.linalg.norm(grad)


def derive(problems, solution, values=None, cg_rtol=1e-12, path="auto"):
    """Every derived quantity of one batch, as the pipeline computes them: name -> (g, m) tensor(s)."""
    alpha, active = problems.alpha, problems.active
    factor = factor_gram(problems.gram)
    point, point_error = second_order_point(
        factor, problems.logits, problems.log_preference, alpha, active, rtol=cg_rtol, **PATHS[path]
    )
    log_p_att = model_log_attention(problems.logits, problems.log_preference, alpha, active)
    p_att = log_p_att.exp()
    eps = solution.error_bound
    out = {
        "factor": factor,
        "point": point,
        "point_error": point_error,
        "p_att": p_att,
        "second_order": second_order_deviation(solution.correction, point, solution.lambda_norm, eps, point_error),
        "tv": attention_tv(solution.attention, p_att, problems.gram, eps),
        "entropy": attention_entropy(p_att, log_p_att),
        "entropy from p": attention_entropy(p_att),
    }
    if values is not None:
        values = torch.as_tensor(values, dtype=torch.float64)
        out["output"] = output_deviation(solution.attention, p_att, values, problems.gram, eps)
        out["together"] = attention_deviations(solution.attention, p_att, values, problems.gram, eps)
    return out


def instance(n, d, m, *, scale=1.0, duplicates=0, zeros=0, seed=0):
    rng = np.random.default_rng(seed)
    T = rng.normal(size=(n, d)) * scale
    if duplicates and n > 1:
        T[rng.integers(1, n, duplicates)] = T[0]
    Z = rng.normal(size=(m, d)) * scale
    log_u = rng.normal(size=(m, n))
    for row in log_u:
        row[rng.permutation(n)[: min(zeros, n - 1)]] = -np.inf
    return T, Z, log_u


# ---------------------------------------------------------------- second order


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
PATHS = {"auto": {}, "direct": {"direct_min_rows": 1, "direct_rows": False},
         "direct rows": {"direct_min_rows": 1, "direct_rows": True}, "cg": {"direct_min_rows": 10**9}}


def lifted(T, Z, alpha, factor, point, group=0):
    """lambda_2_hat = alpha z + V y_2 in the full space, one row per row of Z: V = T^T A (A^T A)^+ is the
    orthonormal basis in which the reduced form's coordinates live (T^T = V A^T)."""
    A = factor[group].numpy()
    basis = np.asarray(T).T @ A @ np.linalg.pinv(A.T @ A)
    return alpha * np.asarray(Z) + point[group].numpy() @ basis.T


def check_second_order(T, Z, log_u, alpha, factor, point, point_error, rows=None, group=0):
    """lambda_2 from the reduced form against the dense one of every (active) row, and its certified
    error against the true one."""
    lam_2s = lifted(T, Z, alpha, factor, point, group)
    for j in range(len(Z)) if rows is None else rows:
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        error = np.linalg.norm(lam_2s[j] - lam_2)
        assert error <= TOL * np.linalg.norm(lam_2), j
        assert error <= point_error[group, j].item() + 1e-12 * max(1.0, np.linalg.norm(lam_2)), j


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


# ---------------------------------------------------------------- attention, output, entropy


def attention_case(heads=2, per_head=3, n=9, d=7, d_v=5, alpha=0.8, seed=5):
    """One group with `heads` heads of `per_head` rows each (head-major), values per head."""
    T, Z, log_u = instance(n, d, heads * per_head, scale=0.8, zeros=2, seed=seed)
    values = np.random.default_rng(seed + 1).normal(size=(heads, n, d_v)) + 2.0  # a common offset
    return T, Z, log_u, values, alpha


def test_attention_tv_output_and_entropy_match_numpy_on_cvxpy_solutions():
    T, Z, log_u, values, alpha = attention_case()
    problems = reduced(T, Z, log_u, alpha)
    derived = derive(problems, solve_dual(problems), values[None])
    p_att, entropy = derived["p_att"], derived["entropy"]
    (tv, tv_bound), (out, out_bound) = derived["tv"], derived["output"]
    per_head = len(Z) // len(values)
    for j in range(len(Z)):
        lam_star, _ = cvxpy_primal(T, Z[j], log_u[j], alpha)
        p_star = softmax(log_u[j] + T @ lam_star)
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        np.testing.assert_allclose(p_att[0, j].numpy(), p_model, rtol=0, atol=1e-14)
        assert tv[0, j].item() == pytest.approx(0.5 * np.abs(p_star - p_model).sum(), abs=TOL)
        v = values[j // per_head]
        expected = np.linalg.norm((p_star - p_model) @ v) / np.linalg.norm(p_model @ v)
        assert out[0, j].item() == pytest.approx(expected, abs=TOL)
        assert entropy[0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        assert derived["entropy from p"][0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        assert tv_bound[0, j].item() < 1e-7 and out_bound[0, j].item() < 1e-7
    # the pipeline's call computes both at once, with the same values and bounds
    for ours, theirs in zip(derived["together"], (derived["tv"], derived["output"])):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-15, atol=0)


def test_inactive_rows_are_nan_and_active_rows_unchanged():
    T, Z, log_u, values, alpha = attention_case(heads=1, per_head=4)
    log_u[2] = -np.inf  # a row with no key
    problems = reduced(T, Z, log_u, alpha)
    problems.active = torch.tensor([[True, False, True, True]])
    problems.logits[0, 1] = float("nan")  # whatever an inactive row holds
    derived = derive(problems, solve_dual(problems), values[None])
    outputs = {
        "point": derived["point"].isnan().all(-1),
        "point_error": derived["point_error"].isnan(),
        "p_att": derived["p_att"].isnan().all(-1),
        "entropy": derived["entropy"].isnan(),
    }
    for name in ("second_order", "tv", "output"):
        value, bound = derived[name]
        outputs[name], outputs[name + " bound"] = value.isnan(), bound.isnan()
    expected = torch.tensor([[False, True, True, False]])
    for name, nan in outputs.items():
        assert torch.equal(nan, expected), name
    alone = reduced(T, Z[[0, 3]], log_u[[0, 3]], alpha)
    point_alone, _ = second_order_point(factor_gram(alone.gram), alone.logits, alone.log_preference, alpha)
    torch.testing.assert_close(derived["point"][0, [0, 3]], point_alone[0], rtol=0, atol=1e-13)


# ---------------------------------------------------------------- certified bounds


def hard_instances():
    """(T, Z, log_u, values, alpha): random, huge logits (~1e3), duplicate templates, zero preferences."""
    out = []
    for seed in range(12):
        rng = np.random.default_rng(1000 + seed)
        n = int(rng.integers(2, 16))
        d = int(rng.integers(1, 12))
        scale = [0.5, 2.0, 8.0, 30.0][seed % 4]
        alpha = [0.1, 1.0, 10.0][seed % 3]
        T, Z, log_u = instance(n, d, 4, scale=scale, duplicates=seed % 3, zeros=seed % 4, seed=seed)
        values = rng.normal(size=(2, n, 3)) * scale + rng.normal(size=3)
        out.append((T, Z, log_u, values, alpha))
    return out


def test_hard_instances_have_huge_logits_and_duplicates():
    logits = [np.abs(Z @ T.T).max() for T, Z, *_ in hard_instances()]
    assert max(logits) > 1e3
    assert any(len(np.unique(T, axis=0)) < len(T) for T, *_ in hard_instances())
    # a single Newton step leaves errors for the bounds to cover on most of them
    left = [(solve_dual(reduced(T, Z, lu, a), max_iter=1).error_bound[0].numpy() / np.linalg.norm(a * Z, axis=1)).max()
            for T, Z, lu, _, a in hard_instances()]
    assert sum(e > 1e-6 for e in left) >= 9


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("newton_steps,cg_rtol,path", [(1, 1e-2, "cg"), (3, 1e-6, "cg"), (100, 1e-12, "cg"),
                                                        (1, 1e-2, "direct"), (100, 1e-12, "direct"),
                                                        (100, 1e-12, "direct rows")])
def test_bounds_hold_against_exact_values(case, newton_steps, cg_rtol, path):
    """Every reported bound dominates the actual error against dense references, for solves stopped
    after 1 or 3 Newton steps and second-order solves stopped at a loose CG tolerance too (or solved by
    factorisation).  The references carry their own certified error (dense Newton: alpha ||grad D||),
    added to the slack."""
    T, Z, log_u, values, alpha = hard_instances()[case]
    problems = reduced(T, Z, log_u, alpha)
    derived = derive(problems, solve_dual(problems, max_iter=newton_steps), values[None], cg_rtol, path)
    lam_2s, point_error = lifted(T, Z, alpha, derived["factor"], derived["point"]), derived["point_error"]
    (second, second_bound), (tv, tv_bound), (out, out_bound) = (derived[k] for k in ("second_order", "tv", "output"))
    per_head = len(Z) // len(values)
    norms = np.linalg.norm(T, axis=1)
    for j in range(len(Z)):
        lam_ref, ref_error = newton_dual(T, Z[j], log_u[j], alpha)
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        rounding = 1e-12 * max(1.0, np.linalg.norm(lam_ref), np.linalg.norm(lam_2), alpha * np.linalg.norm(Z[j]))
        # lambda_2
        assert np.linalg.norm(lam_2s[j] - lam_2) <= point_error[0, j].item() + rounding
        # second-order deviation: the reference's own uncertainty is (1 + v) ref_error / (||lam|| - ref_error)
        lam_norm = np.linalg.norm(lam_ref)
        exact = np.linalg.norm(lam_ref - lam_2) / lam_norm
        slack = (2 * ref_error + 2 * rounding) * (1 + exact) / max(lam_norm - ref_error, 1e-300)
        assert abs(second[0, j].item() - exact) <= second_bound[0, j].item() + slack
        # attention: p* from the reference, p_att from the model's logits, both in numpy
        p_ref = softmax(log_u[j] + T @ lam_ref)
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        ref_tv = np.tanh(2 * norms.max() * (ref_error + rounding) / 4)  # TV(p_ref, p*) by the same lemma
        assert abs(tv[0, j].item() - 0.5 * np.abs(p_ref - p_model).sum()) <= tv_bound[0, j].item() + ref_tv + 1e-13
        v = values[j // per_head]
        scale = np.linalg.norm(p_model @ v)
        exact_out = np.linalg.norm((p_ref - p_model) @ v) / scale
        ref_out = 2 * ref_tv * np.abs(v).sum(1).max() / scale
        assert abs(out[0, j].item() - exact_out) <= out_bound[0, j].item() + ref_out + 1e-12


def test_bounds_are_attained_by_their_worst_cases():
    """Each bound is the exact worst case of its derivation, so none can be lowered: inputs built at
    that worst case (certified errors used in full, in the worst direction) make |value - true| equal
    the bound."""
    # second order, T = I (lambda = alpha z + c): lambda_hat overshoots ||lambda*|| by eps along e1,
    # lambda_2_hat undershoots lambda_2 by eps2, so the numerator shrinks by eps + eps2
    a, gap, eps, eps2, alpha = 2.0, 0.7, 0.05, 0.03, 1.0
    e1 = np.array([1.0, 0.0, 0.0])
    z = np.array([0.3, -0.2, 0.5])
    lam_star, lam_2 = a * e1, (a + gap) * e1
    lam_hat, lam_2_hat = lam_star + eps * e1, lam_2 - eps2 * e1

    def row(x):
        return torch.tensor(x, dtype=torch.float64)[None, None]

    value, bound = second_order_deviation(  # T = I: the factor's coordinates are the space's
        row(lam_hat - alpha * z), row(lam_2_hat - alpha * z), row(np.linalg.norm(lam_hat)),
        row(eps), row(eps2),
    )
    true = np.linalg.norm(lam_star - lam_2) / np.linalg.norm(lam_star)
    assert value.item() == pytest.approx((gap - eps - eps2) / (a + eps), rel=1e-14)
    assert abs(true - value.item()) == pytest.approx(bound.item(), rel=1e-12)

    # attention: two templates at +-D/2, the iterate eps/2 from lambda* along them, and p* placed where
    # the softmax lemma is tight (p*_1 = e^{-w/4} / (e^{w/4} + e^{-w/4}), w = D eps / 2); p_att = p*
    D, eps = 3.0, 0.4
    templates = np.array([[D / 2], [-D / 2]])
    w = D * eps / 2
    p_star = np.array([np.exp(-w / 4), np.exp(w / 4)]) / (np.exp(w / 4) + np.exp(-w / 4))
    p_hat = softmax(np.log(p_star) + templates[:, 0] * eps / 2)
    gram = torch.tensor(templates @ templates.T)[None]
    tv, tv_bound = attention_tv(row(p_hat), row(p_star), gram, row(eps))
    assert tv.item() == pytest.approx(tv_bound.item(), rel=1e-12)
    assert tv_bound.item() == pytest.approx(np.tanh(D * eps / 8), rel=1e-14)
    # output: values at c +- R e, so that sum_i (p_hat - p*)_i v_i = 2 TV R e
    centre, R = np.array([1.0, -2.0, 0.5]), 0.8
    values = np.stack([centre + R * np.array([0, 1.0, 0]), centre - R * np.array([0, 1.0, 0])])
    out, out_bound = output_deviation(row(p_hat), row(p_star), torch.tensor(values)[None, None], gram, row(eps))
    assert out.item() == pytest.approx(out_bound.item(), rel=1e-12)


def test_tv_bound_is_not_vacuous_on_early_stops():
    """On a solve stopped after two Newton steps the TV bound is well below 1 and above the error."""
    T, Z, log_u, _, alpha = attention_case(heads=1, per_head=4, alpha=1.0)
    problems = reduced(T, Z, log_u, alpha)
    solution = solve_dual(problems, max_iter=2)
    derived = derive(problems, solution)
    p_att, (tv, bound) = derived["p_att"], derived["tv"]
    errors = []
    for j in range(len(Z)):
        lam_ref, _ = newton_dual(T, Z[j], log_u[j], alpha)
        errors.append(abs(tv[0, j].item() - 0.5 * np.abs(softmax(log_u[j] + T @ lam_ref) - p_att[0, j].numpy()).sum()))
    assert np.all(np.array(errors) <= bound[0].numpy()) and float(bound.max()) < 0.1
    assert max(errors) > 1e-6  # really stopped early


# ---------------------------------------------------------------- the real MiniLM


#: the capture holds the queries the model multiplied (float32); the dense problems here compute z in
#: float64 from the hidden states, so the two agree to float32 rounding, not to the solver's accuracy
CAPTURED = {"rel": 1e-6, "abs": 1e-7}


def test_minilm_derived_quantities_match_dense_computation(minilm_dir):
    from probe.batch.problems import site_problems

    from ..support.bert_sites import captured, explicit_problem

    texts = ["The cat sat on the mat.", "Attention weights are the solution of a convex problem."]
    loaded, inputs, sites, reference = captured(minilm_dir, texts)
    mask = inputs["attention_mask"]
    chosen = [(0, 3, 0, 1), (2, 7, 1, 4), (5, 11, 1, 0)]  # (layer, head, example, query)
    alpha = 1.0
    for layer in sorted({c[0] for c in chosen}):
        site = sites[layer]
        problems = site_problems(site, alpha)
        solution = solve_dual(problems)
        module = loaded.model.encoder.layer[layer].attention.self
        hidden = reference.hidden_states[layer].double()
        heads, d_head = module.num_attention_heads, module.attention_head_size
        values = (hidden @ module.value.weight.double().T + module.value.bias.double()).detach()
        values = values.view(hidden.shape[0], hidden.shape[1], heads, d_head).transpose(1, 2)  # (b, H, n, d_v)
        derived = derive(problems, solution, values)
        (second, _), (tv, _), (out, _) = derived["second_order"], derived["tv"], derived["output"]
        entropy = derived["entropy"]
        q_len = site.shape[2]
        for layer_, head, example, query in chosen:
            if layer_ != layer:
                continue
            row = head * q_len + query
            assert bool(solution.converged[example, row])
            T, z, log_u = explicit_problem(loaded.model, reference.hidden_states, layer, head, example, query, mask)
            lam_star, _ = cvxpy_primal(T, z, log_u, alpha)
            lam_2 = dense_lambda_2(T, z, log_u, alpha)
            assert second[example, row].item() == pytest.approx(
                np.linalg.norm(lam_star - lam_2) / np.linalg.norm(lam_star), **CAPTURED
            )
            p_star = softmax(log_u + T @ lam_star)
            p_model = softmax(log_u + alpha * T @ z)
            keys = mask[example].numpy().astype(bool)
            assert tv[example, row].item() == pytest.approx(0.5 * np.abs(p_star - p_model).sum(), **CAPTURED)
            v = values[example, head].numpy()[keys]
            expected = np.linalg.norm((p_star - p_model) @ v) / np.linalg.norm(p_model @ v)
            assert out[example, row].item() == pytest.approx(expected, **CAPTURED)
            assert entropy[example, row].item() == pytest.approx(scipy_entropy(p_model), **CAPTURED)


@pytest.mark.parametrize("garbage", [np.inf, -np.inf, np.nan, 1e300])
def test_logits_at_excluded_keys_play_no_part(garbage):
    """Whatever a logit holds at a key the preference excludes (-inf in log u), the model's attention,
    its entropy and the second-order point are those of the dense computation."""
    T, Z, log_u, values, alpha = attention_case(heads=1, per_head=4)
    excluded = np.isinf(log_u)
    assert excluded.any()
    problems = reduced(T, Z, log_u, alpha)
    problems.logits[torch.as_tensor(excluded)[None]] = garbage
    derived = derive(problems, solve_dual(reduced(T, Z, log_u, alpha)), values[None])
    lam_2s = lifted(T, Z, alpha, derived["factor"], derived["point"])
    p_att = model_attention(problems.logits, problems.log_preference, alpha)  # the public helper alike
    for j in range(len(Z)):
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        np.testing.assert_allclose(derived["p_att"][0, j].numpy(), p_model, rtol=0, atol=1e-14)
        np.testing.assert_allclose(p_att[0, j].numpy(), p_model, rtol=0, atol=1e-14)
        assert derived["entropy"][0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        assert np.linalg.norm(lam_2s[j] - lam_2) <= TOL * np.linalg.norm(lam_2)
