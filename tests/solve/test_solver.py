"""The dual solver against independent references (CVXPY on the primal, SciPy L-BFGS on the dual) and
closed forms, on random, hard and real-model instances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probe.solve.dual import DualProblems, DualSolution, factor_gram, solve_dual, solve_spd_reduced
from probe.solve.reference import cvxpy_primal, gradient_ascent_dual, lbfgs_dual, relative_deviation

from ..support.solver_problems import agree, as_previous, certified_difference, random_groups, reduced

TOL = 1e-7


def full_lambda(T, Z, solution, alpha):
    """lambda_hat = alpha z + T^T c from the solver's reduced output, in the full space."""
    c = solution.coefficients[0].numpy()
    return alpha * np.asarray(Z) + c @ np.asarray(T)


def check_against_cvxpy(T, Z, log_u, alpha=1.0):
    solution = solve_dual(reduced(T, Z, log_u, alpha))
    assert bool(solution.converged.all())
    lam_ours = full_lambda(T, Z, solution, alpha)
    for j in range(len(Z)):
        lam_ref, _ = cvxpy_primal(T, Z[j], log_u[j], alpha)
        expected = relative_deviation(lam_ref, Z[j], alpha)
        assert solution.rel_deviation[0, j].item() == pytest.approx(expected, abs=TOL)
        # the reduced-form deviation is the deviation of the full-space lambda it describes
        assert relative_deviation(lam_ours[j], Z[j], alpha) == pytest.approx(expected, abs=TOL)
        assert solution.lambda_norm[0, j].item() == pytest.approx(np.linalg.norm(lam_ref), rel=1e-7)
    return solution


RNG = np.random.default_rng(1234)


@pytest.mark.parametrize("n,d,alpha", [(5, 8, 1.0), (16, 32, 1.0), (24, 12, 0.3), (12, 40, 3.0)])
def test_random_instances_match_cvxpy(n, d, alpha):
    T = RNG.normal(size=(n, d)) * 0.6
    Z = RNG.normal(size=(3, d))
    log_u = RNG.normal(size=(3, n))
    check_against_cvxpy(T, Z, log_u, alpha)


def test_huge_logits_match_cvxpy():
    T = RNG.normal(size=(10, 6)) * 30
    Z = RNG.normal(size=(3, 6)) * 30
    assert np.abs(Z @ T.T).max() > 1e3
    check_against_cvxpy(T, Z, np.zeros((3, 10)))


def test_duplicate_templates_and_rank_deficient_gram_match_cvxpy():
    base = RNG.normal(size=(4, 10))
    T = np.vstack([base, base[:2], base[0] + base[1]])  # duplicates and a linear combination: rank 4 of 7
    Z = RNG.normal(size=(3, 10))
    assert np.linalg.matrix_rank(T @ T.T) == 4
    check_against_cvxpy(T, Z, RNG.normal(size=(3, 7)))


def test_more_templates_than_dimensions_match_cvxpy():
    T = RNG.normal(size=(30, 3))  # G has rank 3
    check_against_cvxpy(T, RNG.normal(size=(2, 3)), np.zeros((2, 30)))


def test_preference_with_zeros_matches_cvxpy():
    T = RNG.normal(size=(9, 7))
    log_u = RNG.normal(size=(3, 9))
    log_u[0, [1, 4]] = -np.inf
    log_u[1, 5:] = -np.inf  # causal-style prefix
    log_u[2, :8] = -np.inf  # a single allowed key
    solution = check_against_cvxpy(T, RNG.normal(size=(3, 7)), log_u)
    p = solution.attention[0].numpy()
    assert np.all(p[np.isinf(log_u)] == 0)
    assert solution.rel_deviation[0, 2].item() == pytest.approx(0.0, abs=1e-12)


def test_single_key_closed_form():
    """n = 1: p = (1), so lambda* = alpha z exactly and the deviation is 0."""
    T = RNG.normal(size=(1, 5))
    Z = RNG.normal(size=(4, 5))
    solution = solve_dual(reduced(T, Z, np.zeros((4, 1)), alpha=2.0))
    assert torch.equal(solution.rel_deviation[0], torch.zeros(4, dtype=torch.float64))
    np.testing.assert_allclose(solution.lambda_norm[0].numpy(), 2.0 * np.linalg.norm(Z, axis=1), rtol=1e-14)


def test_two_keys_match_cvxpy():
    T = RNG.normal(size=(2, 4)) * 2
    check_against_cvxpy(T, RNG.normal(size=(3, 4)), RNG.normal(size=(3, 2)))


def test_two_keys_closed_form_root():
    """n = 2 reduces to a scalar equation in p_1 = sigma(log-odds); solve it by bisection."""
    T = np.array([[1.5, -0.5, 2.0], [-1.0, 1.0, 0.5]])
    z = np.array([0.7, -1.2, 0.4])
    u = np.array([0.3, 0.7])
    alpha = 1.7
    delta = T[0] - T[1]
    b = T.T @ u + z

    def residual(p1):  # p = p(lambda(p)) with lambda = alpha (b - T^T p)
        lam = alpha * (b - T.T @ np.array([p1, 1 - p1]))
        logit = np.log(u[0] / u[1]) + delta @ lam
        return p1 - 1 / (1 + np.exp(-logit))

    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if residual(mid) < 0 else (lo, mid)
    lam = alpha * (b - T.T @ np.array([lo, 1 - lo]))
    solution = solve_dual(reduced(T, z[None], np.log(u)[None], alpha), rtol=1e-13)
    assert bool(solution.converged.all())
    assert solution.rel_deviation.item() == pytest.approx(relative_deviation(lam, z, alpha), abs=1e-12)


def test_certificate_bounds_the_true_error_when_stopped_early():
    """error_bound must dominate ||lambda_hat - lambda*|| at every iteration count; early stops are
    reported as not converged."""
    T = RNG.normal(size=(20, 8)) * 2.5
    Z = RNG.normal(size=(6, 8)) * 2
    log_u = np.zeros((6, 20))
    exact = solve_dual(reduced(T, Z, log_u))
    lam_star = full_lambda(T, Z, exact, 1.0)
    for reference_j in range(6):  # the converged solution agrees with an independent solver
        lam_ref, _ = lbfgs_dual(T, Z[reference_j], log_u[reference_j])
        assert np.linalg.norm(lam_star[reference_j] - lam_ref) < 1e-7 * np.linalg.norm(lam_ref)
    saw_unconverged = False
    for iterations in (1, 2, 3):
        early = solve_dual(reduced(T, Z, log_u), max_iter=iterations)
        actual = np.linalg.norm(full_lambda(T, Z, early, 1.0) - lam_star, axis=1)
        assert np.all(early.error_bound[0].numpy() >= actual - 1e-12)
        assert np.all(early.duality_gap[0].numpy() >= 0)
        saw_unconverged |= not bool(early.converged.all())
    assert saw_unconverged


def test_duality_gap_equals_primal_minus_dual_in_full_space():
    """The closed-form gap must equal P(p) - D(lambda) evaluated from the definitions (here at the
    optimum of a converged solve, and at an early iterate, where lambda = alpha z + T^T c_y)."""
    T = RNG.normal(size=(6, 4))
    z = RNG.normal(size=4)
    log_u = np.log(np.array([0.1, 0.2, 0.3, 0.1, 0.2, 0.1]))
    u = np.exp(log_u)
    alpha = 0.8
    solution = solve_dual(reduced(T, z[None], log_u[None], alpha), max_iter=1)
    p = solution.attention[0, 0].numpy()
    mu = T.T @ u
    primal = alpha / 2 * np.sum((mu + z - T.T @ p) ** 2) + np.sum(p * np.log(p / u))
    # the dual point behind p: p = softmax(log u + T lambda) determines T lambda up to a constant, and
    # lambda lies in alpha z + row(T); recover it by least squares
    theta = np.log(p) - log_u
    offset, *_ = np.linalg.lstsq(
        np.hstack([T, np.ones((6, 1))]), theta - alpha * T @ z, rcond=None
    )
    lam = alpha * z + T.T @ np.linalg.lstsq(T @ T.T, T @ offset[:4], rcond=None)[0]
    dual = lam @ (mu + z) - lam @ lam / (2 * alpha) - np.log(np.sum(u * np.exp(T @ lam)))
    assert solution.duality_gap.item() == pytest.approx(primal - dual, rel=1e-6, abs=1e-12)


def test_inactive_and_padded_problems():
    T = RNG.normal(size=(5, 4))
    Z = RNG.normal(size=(3, 4))
    problems = reduced(T, Z, np.zeros((3, 5)))
    problems.active = torch.tensor([[True, False, True]])
    solution = solve_dual(problems)
    assert torch.isnan(solution.rel_deviation[0, 1])
    assert not bool(solution.converged[0, 1])
    full = solve_dual(reduced(T, Z, np.zeros((3, 5))))
    torch.testing.assert_close(solution.rel_deviation[0, [0, 2]], full.rel_deviation[0, [0, 2]], rtol=0, atol=1e-13)


@pytest.mark.parametrize("direction_dtype", [torch.float64, torch.float32])
def test_tiling_gives_the_same_answers(direction_dtype):
    """With a float64 Newton direction the answers do not depend on the tiling or on the other groups
    (to rounding); with a float32 direction they agree within the certificates."""
    groups = []
    for _ in range(3):
        T = RNG.normal(size=(12, 6))
        groups.append((T, RNG.normal(size=(7, 6)), RNG.normal(size=(7, 12))))
    problems = DualProblems(
        gram=torch.stack([torch.tensor(T @ T.T) for T, _, _ in groups]),
        logits=torch.stack([torch.tensor(Z @ T.T) for T, Z, _ in groups]),
        log_preference=torch.stack([torch.tensor(lu) for _, _, lu in groups]),
        evidence_sqnorm=torch.stack([torch.tensor((Z * Z).sum(-1)) for _, Z, _ in groups]),
    )
    whole = solve_dual(problems, direction_dtype=direction_dtype)
    tiled = solve_dual(problems, direction_dtype=direction_dtype, memory_budget_bytes=16 * 12 * 8 * 3)  # 3 rows a tile
    assert bool(whole.converged.all()) and bool(tiled.converged.all())

    def check(x, y):
        if direction_dtype == torch.float64:
            torch.testing.assert_close(x.rel_deviation, y.rel_deviation, rtol=0, atol=1e-12)
        else:
            assert bool(((x.rel_deviation - y.rel_deviation).abs() <= certified_difference(x, y)).all())

    check(tiled, whole)
    for g, (T, Z, lu) in enumerate(groups):  # and each group is its own independent problem set
        alone = solve_dual(reduced(T, Z, lu), direction_dtype=direction_dtype)
        check(alone, DualSolution(**{k: v[g : g + 1] for k, v in vars(whole).items()}))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_ascent_reference_and_solver_on_device(device):
    """The batched references (gradient ascent, the paper's method) and the solver run on the device
    of their inputs and agree there."""
    rng = np.random.default_rng(7)
    T = rng.normal(size=(10, 6)) / 2
    Z = rng.normal(size=(4, 6))
    log_u = np.log(rng.dirichlet(np.ones(10), size=4))
    problems = reduced(T, Z, log_u, alpha=0.7)
    for name in ("gram", "logits", "log_preference", "evidence_sqnorm"):
        setattr(problems, name, getattr(problems, name).to(device))
    solution = solve_dual(problems)
    assert solution.rel_deviation.device.type == device and bool(solution.converged.all())
    tensors = [torch.as_tensor(x, device=device) for x in (np.repeat(T[None], 4, 0), Z, log_u)]
    lam, iterations = gradient_ascent_dual(*tensors, alpha=0.7, tol=1e-10)
    assert lam.device.type == device and int(iterations.min()) > 0
    expected = [relative_deviation(row, z, 0.7) for row, z in zip(lam.cpu().numpy(), Z)]
    np.testing.assert_allclose(solution.rel_deviation[0].cpu().numpy(), expected, rtol=0, atol=1e-8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        solve_dual(reduced(np.eye(2), np.ones((1, 2)), np.zeros((1, 2)), alpha=0.0))
    with pytest.raises(ValueError, match="floating point"):
        solve_dual(reduced(np.eye(2), np.ones((1, 2)), np.zeros((1, 2))), direction_dtype=torch.int32)
    bad = reduced(np.eye(2), np.ones((1, 2)), np.zeros((1, 2)))
    bad.logits = bad.logits[..., :1]
    with pytest.raises(ValueError, match="inconsistent shapes"):
        solve_dual(bad)


def random_instance(n, d, scale, alpha, duplicates, zeros, seed):
    rng = np.random.default_rng(seed)
    T = rng.normal(size=(n, d)) * scale
    if duplicates and n > 1:
        T[rng.integers(0, n, duplicates)] = T[0]
    z = rng.normal(size=d) * scale
    log_u = rng.normal(size=n)
    log_u[rng.permutation(n)[: min(zeros, n - 1)]] = -np.inf
    return T, z, log_u


def dual_gradient(T, z, log_u, alpha, lam):
    """grad D(lambda) = mu + z - lambda/alpha - T^T p(lambda), from the definitions."""
    u = np.exp(log_u - np.logaddexp.reduce(log_u))
    theta = log_u + T @ lam
    p = np.exp(theta - np.logaddexp.reduce(theta))
    return T.T @ u + z - lam / alpha - T.T @ p


instances = dict(
    n=st.integers(1, 12),
    d=st.integers(1, 10),
    alpha=st.sampled_from([0.05, 1.0, 10.0]),
    duplicates=st.integers(0, 3),
    zeros=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scale=st.sampled_from([0.1, 1.0, 3.0, 6.0]), **instances)
def test_property_converges_to_the_optimum(n, d, scale, alpha, duplicates, zeros, seed):
    """Arbitrary (also degenerate: duplicates, zero preferences, n = 1) instances with logits up to
    ~1e3 converge, satisfy the optimality condition lambda = alpha (mu + z - T^T p(lambda)) in the full
    space, and match L-BFGS on the dual."""
    T, z, log_u = random_instance(n, d, scale, alpha, duplicates, zeros, seed)
    solution = solve_dual(reduced(T, z[None], log_u[None], alpha))
    lam = full_lambda(T, z[None], solution, alpha)[0]
    if not bool(solution.converged.all()):
        # float64 cannot certify 1e-9 relative accuracy when lambda* nearly cancels alpha z: the
        # logits' own rounding moves lambda* by more than that.  Only such instances may fail.
        assert np.linalg.norm(lam) < 1e-3 * alpha * np.linalg.norm(z)
        return
    # the fixed-point map amplifies the distance to lambda* by up to its Lipschitz constant
    lipschitz = 1 + alpha * np.max(np.sum(T * T, axis=1))
    residual = alpha * dual_gradient(T, z, log_u, alpha, lam)
    assert np.linalg.norm(residual) <= 1e-8 * max(1.0, np.linalg.norm(lam)) * lipschitz
    # L-BFGS's own error is at most alpha ||grad D(lambda_ref)|| (1/alpha-strong concavity): when
    # ||lambda*|| is small that can exceed 1e-6 relative, so compare within both certified bounds
    lam_ref, _ = lbfgs_dual(T, z, log_u, alpha)
    reference_error = alpha * np.linalg.norm(dual_gradient(T, z, log_u, alpha, lam_ref))
    distance = np.linalg.norm(lam - lam_ref)
    assert distance <= reference_error + solution.error_bound.item() + 1e-12 * max(1.0, np.linalg.norm(lam_ref))
    if reference_error <= 1e-9 * np.linalg.norm(lam_ref):
        expected = relative_deviation(lam_ref, z, alpha)
        assert solution.rel_deviation.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scale=st.sampled_from([10.0, 15.0, 40.0]), **instances)
def test_property_certificate_is_never_wrong(n, d, scale, alpha, duplicates, zeros, seed):
    """On extreme instances (logits up to ~1e5) the solver may stop unconverged, but its certificate
    must hold: error_bound >= ||lambda_hat - lambda*||.  lambda* is bracketed with L-BFGS, whose own
    error is at most alpha ||grad D(lambda_ref)|| by 1/alpha-strong concavity."""
    T, z, log_u = random_instance(n, d, scale, alpha, duplicates, zeros, seed)
    solution = solve_dual(reduced(T, z[None], log_u[None], alpha), max_iter=30)
    lam = full_lambda(T, z[None], solution, alpha)[0]
    lam_ref, _ = lbfgs_dual(T, z, log_u, alpha)
    reference_error = alpha * np.linalg.norm(dual_gradient(T, z, log_u, alpha, lam_ref))
    distance = np.linalg.norm(lam - lam_ref)
    assert solution.error_bound.item() >= distance - reference_error - 1e-9 * np.linalg.norm(lam_ref)
    if bool(solution.converged.all()) and reference_error <= 1e-9 * np.linalg.norm(lam_ref):
        assert distance <= 1e-7 * np.linalg.norm(lam_ref)


# --------------------------------------------------------------------------------------------------
# the speed work changed how the solver gets to its answers, not the answers


@pytest.mark.parametrize("n,d,template_scale,logit_std", [(16, 384, 1 / 8, 2.0), (48, 32, 1 / 2, 8.0), (40, 24, 1.0, 3.0)])
def test_answers_agree_with_the_previous_solver(n, d, template_scale, logit_std):
    """The same problems solved today's way (the previous solver, tests/support/previous_solver.py, with a
    float64 direction) and by the current solver (float32 and float64 directions): the same certified
    answers.  Families: MiniLM-like, ill-conditioned (condition number bound ~ 64), more templates than
    dimensions (rank-deficient Gram matrices)."""
    from ..support import previous_solver

    problems = random_groups(4, 40, n, d, template_scale, logit_std, seed=n)
    old = previous_solver.solve_dual(as_previous(problems), direction_dtype=torch.float64)
    for direction_dtype in (torch.float32, torch.float64):
        agree(solve_dual(problems, direction_dtype=direction_dtype), old, problems.active)


def test_answers_agree_with_the_previous_solver_on_minilm(minilm_dir):
    """Captured MiniLM problems (a padded batch, every layer): the same certified answers as before."""
    from probe.batch.problems import site_problems

    from ..support import previous_solver
    from ..support.bert_sites import captured

    _, _, sites, _ = captured(minilm_dir)
    for site in sites[::2]:
        problems = site_problems(site, 1.0)
        old = previous_solver.solve_dual(as_previous(problems), direction_dtype=torch.float64)
        agree(solve_dual(problems), old, problems.active)


@pytest.mark.parametrize("shared", [True, False])
def test_solve_spd_reduced_matches_dense_solves(shared):
    """solve_spd_reduced (groups sharing their weights: one Cholesky per group; otherwise CG) against
    numpy's dense solve of (I/alpha + A^T (diag w - w w^T) A) x = b, and its reported residual against
    the residual recomputed in numpy."""
    from probe.solve.dual import factor_gram, solve_spd_reduced

    rng = np.random.default_rng(5)
    g, m, n, d, alpha = 3, 7, 9, 6, 1.7
    T = rng.normal(size=(g, n, d))
    factor = factor_gram(torch.tensor(T @ T.transpose(0, 2, 1)))
    weights = rng.dirichlet(np.ones(n), size=(g, 1 if shared else m))
    weights[..., 0] = 0.0  # a key outside the support
    weights /= weights.sum(-1, keepdims=True)
    weights = np.broadcast_to(weights, (g, m, n)).copy()
    rhs = rng.normal(size=(g, m, factor.shape[-1]))
    rhs[0, 2] = 0.0
    x, residual = solve_spd_reduced(factor, torch.tensor(weights), torch.tensor(rhs), alpha)
    A = factor.numpy()
    for group in range(g):
        for row in range(m):
            w = weights[group, row]
            H = np.eye(A.shape[-1]) / alpha + A[group].T @ (np.diag(w) - np.outer(w, w)) @ A[group]
            expected = np.linalg.solve(H, rhs[group, row])
            np.testing.assert_allclose(x[group, row].numpy(), expected, rtol=1e-9, atol=1e-12)
            true_residual = np.linalg.norm(rhs[group, row] - H @ x[group, row].numpy())
            assert residual[group, row].item() == pytest.approx(true_residual, abs=1e-12)
    assert torch.equal(x[0, 2], torch.zeros_like(x[0, 2]))


def test_solve_spd_reduced_matches_dense_solves_at_each_rows_tolerance():
    """(I/alpha + A^T (diag w - w w^T) A) x = b against numpy's dense solve, row by row, with a tolerance
    per row (zero weights and a zero right-hand side included); the residual it reports is the true one."""
    rng = np.random.default_rng(3)
    g, m, n, d, alpha = 2, 5, 9, 6, 1.7
    T = rng.normal(size=(g, n, d))
    factor = factor_gram(torch.as_tensor(T @ T.transpose(0, 2, 1)))
    weights = rng.dirichlet(np.ones(n), size=(g, m))
    weights[0, 1, :3] = 0.0
    weights /= weights.sum(-1, keepdims=True)
    rhs = rng.normal(size=(g, m, factor.shape[-1]))
    rhs[1, 2] = 0.0
    rtol = np.array([[1e-2, 1e-6, 1e-12, 1e-12, 1e-9]] * g)
    x, residual = solve_spd_reduced(factor, torch.as_tensor(weights), torch.as_tensor(rhs), alpha, torch.as_tensor(rtol))
    A = factor.numpy()
    for i in range(g):
        for j in range(m):
            w = weights[i, j]
            H = np.eye(A.shape[-1]) / alpha + A[i].T @ (np.diag(w) - np.outer(w, w)) @ A[i]
            exact = np.linalg.solve(H, rhs[i, j])
            true_residual = np.linalg.norm(rhs[i, j] - H @ x[i, j].numpy())
            assert residual[i, j].item() == pytest.approx(true_residual, rel=1e-6, abs=1e-14)
            assert true_residual <= 2 * rtol[i, j] * np.linalg.norm(rhs[i, j]) + 1e-14
            # H >= I/alpha: the error is at most alpha times the residual
            assert np.linalg.norm(x[i, j].numpy() - exact) <= alpha * true_residual + 1e-13
    assert torch.equal(x[1, 2], torch.zeros_like(x[1, 2]))
    assert solve_spd_reduced(factor, torch.as_tensor(weights), torch.as_tensor(rhs), alpha, residual=False)[1] is None


@pytest.mark.parametrize("seed", range(4))
def test_the_polished_reference_is_optimal_from_a_loose_clarabel_answer(seed):
    """probe.solve.reference.polish_primal (Newton on the primal) from Clarabel's answer at a loose tolerance
    (about 1e-4 off) reaches the optimum: the gradient of the dual (D) at the lambda it gives,
    b - lambda / alpha - T^T softmax(log u + T lambda), vanishes to rounding.  Clarabel's answer alone
    is measurably off, so the check can fail."""
    rng = np.random.default_rng(seed)
    n, d, alpha = 3 + 4 * seed, 24, 0.7
    T = rng.normal(size=(n, d)) * 0.7
    z = rng.normal(size=d) * 3.0
    log_u = rng.normal(size=n)
    log_u[0] = -np.inf  # an excluded key stays excluded
    keep = np.isfinite(log_u)
    u = np.exp(log_u[keep] - log_u[keep].max())
    u /= u.sum()
    b = T[keep].T @ u + z

    def dual_gradient(lam):
        theta = np.log(u) + T[keep] @ lam
        p = np.exp(theta - theta.max())
        return b - lam / alpha - T[keep].T @ (p / p.sum())

    rough, _ = cvxpy_primal(T, z, log_u, alpha, eps=1e-4, polish=False)
    polished, p = cvxpy_primal(T, z, log_u, alpha, eps=1e-4)
    scale = np.linalg.norm(b)
    assert np.linalg.norm(dual_gradient(rough)) > 1e-7 * scale
    assert np.linalg.norm(dual_gradient(polished)) <= 1e-11 * scale
    assert p[0] == 0.0 and p.sum() == pytest.approx(1.0, abs=1e-15) and (p[1:] > 0).all()


@pytest.mark.parametrize("workers", [0, 2])
def test_rows_sharing_their_preference_by_construction(workers):
    """A preference given as a view whose rows repeat the group's (stride 0, as BERT-like masks are) is
    normalised once per group; its answers are CVXPY's, with an inactive row and a group without keys
    (all -inf: NaN rows, not converged) beside it, also through stacking."""
    from probe.batch.problems import stacked_problems
    from probe.solve.problems import shares_rows

    T = RNG.normal(size=(7, 5))
    Z = RNG.normal(size=(4, 5))
    row = np.array([0.3, -np.inf, 0.0, 1.2, -0.4, -np.inf, 0.7])
    log_u = np.tile(row, (4, 1))
    one = reduced(T, Z, log_u, 0.8)
    one.log_preference = torch.as_tensor(row)[None, None].expand(1, 4, 7)
    one.active = torch.tensor([[True, True, False, True]])
    keyless = reduced(T, Z, log_u, 0.8)
    keyless.log_preference = torch.full((1, 1, 7), -np.inf, dtype=torch.float64).expand(1, 4, 7)
    keyless.active = torch.ones(1, 4, dtype=torch.bool)
    both = stacked_problems([one, keyless])
    assert shares_rows(one.log_preference) and shares_rows(both.log_preference)
    solution = solve_dual(both, workers=workers)
    assert bool(solution.rel_deviation[1].isnan().all()) and not bool(solution.converged[1].any())
    assert bool(solution.rel_deviation[0, 2].isnan()) and bool(solution.converged[0, [0, 1, 3]].all())
    lam_ours = full_lambda(T, Z, solution, 0.8)
    for j in (0, 1, 3):
        lam_ref, _ = cvxpy_primal(T, Z[j], row, 0.8)
        expected = relative_deviation(lam_ref, Z[j], 0.8)
        assert solution.rel_deviation[0, j].item() == pytest.approx(expected, abs=TOL)
        assert relative_deviation(lam_ours[j], Z[j], 0.8) == pytest.approx(expected, abs=TOL)
        assert solution.lambda_norm[0, j].item() == pytest.approx(np.linalg.norm(lam_ref), rel=1e-7)
    assert bool((solution.attention[0, [0, 1, 3]][:, np.isinf(row)] == 0).all())
