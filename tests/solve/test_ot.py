"""The OT solver (probe.solve.ot) against independent references: CVXPY on the primal with the transport plan
as the variable, SciPy L-BFGS on the dual written out in numpy, probe's KL solver on the OT problem that
equals a KL problem, closed forms, a plain loop over eq. (22), and a certificate recomputed in extended
precision from an explicit transport plan."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probe.solve.dual import DualProblems, solve_dual
from probe.solve.ot import OTInputError, ot_attention, ot_posterior, true_preference
from probe.solve.reference import cvxpy_ot_primal, lbfgs_ot_dual, ot_true_preference

RNG = np.random.default_rng(2027)


def instance(N, n, d, rng=RNG, cost_scale=3.0):
    T = rng.normal(size=(N, d))
    u = rng.dirichlet(np.ones(n))
    M = rng.uniform(0, cost_scale, size=(n, N))
    z = rng.normal(size=d)
    return T, u, M, z


def solve(T, u, M, z, alpha, gamma, **kwargs):
    return ot_posterior(*(torch.as_tensor(np.asarray(x, dtype=float)) for x in (T, u, M, z)), alpha, gamma, **kwargs)


# ------------------------------------------------------------------------------------ exact references


@pytest.mark.parametrize(
    "N,n,d,alpha,gamma",
    [(6, 4, 3, 1.0, 1.0), (8, 5, 10, 2.0, 0.5), (5, 3, 4, 0.5, 4.0), (7, 7, 2, 4.0, 0.25), (4, 2, 12, 1.0, 8.0)],
)
def test_matches_cvxpy_with_the_plan_as_variable(N, n, d, alpha, gamma):
    T, u, M, z = instance(N, n, d)
    sol = solve(T, u, M, z, alpha, gamma)
    assert bool(sol.converged)
    lam_ref, p_ref = cvxpy_ot_primal(T, u, M, z, alpha, gamma)
    scale = np.linalg.norm(lam_ref)
    assert np.abs(sol.lam.numpy() - lam_ref).max() <= 1e-7 * max(1.0, scale)
    assert np.abs(sol.p.numpy() - p_ref).max() <= 1e-7
    assert sol.lambda_norm.item() == pytest.approx(scale, rel=1e-7)
    assert sol.error_bound.item() <= 1e-9 * sol.lambda_norm.item() + 1e-12
    # the reduced form: lambda = alpha z + T^T c
    np.testing.assert_allclose(alpha * z + sol.coefficients.numpy() @ T, sol.lam.numpy(), atol=1e-12)


def test_zero_weight_sources_and_excluded_candidates_match_cvxpy():
    T, u, M, z = instance(6, 4, 3)
    u[1] = 0.0
    u /= u.sum()
    M[1] = np.inf  # a source of weight 0 may have any cost row
    sol = solve(T, u, M, z, 1.5, 0.7)
    M_ref = M.copy()
    M_ref[1] = 0.0
    lam_ref, p_ref = cvxpy_ot_primal(T, u, M_ref, z, 1.5, 0.7)
    assert bool(sol.converged)
    np.testing.assert_allclose(sol.lam.numpy(), lam_ref, atol=1e-7)
    np.testing.assert_allclose(sol.p.numpy(), p_ref, atol=1e-7)


def test_infinite_costs_exclude_transport_and_match_cvxpy():
    # +inf: candidate t gets no mass from source j (CVXPY: those plan entries constrained to 0)
    T, u, M, z = instance(6, 3, 3)
    M[0, 2] = np.inf
    M[1, [0, 4]] = np.inf
    M[2, 2] = np.inf
    sol = solve(T, u, M, z, 1.3, 0.6)
    lam_ref, p_ref = cvxpy_ot_primal(T, u, M, z, 1.3, 0.6)
    assert bool(sol.converged)
    np.testing.assert_allclose(sol.lam.numpy(), lam_ref, atol=1e-7)
    np.testing.assert_allclose(sol.p.numpy(), p_ref, atol=1e-7)
    # a candidate excluded by every source gets nothing
    M[:, 5] = np.inf
    sol = solve(T, u, M, z, 1.3, 0.6)
    assert sol.p[5].item() == 0.0 and sol.u_tilde[5].item() == 0.0 and bool(sol.converged)


def test_matches_lbfgs_on_the_dual_in_both_layouts():
    # d <= N (lambda's coordinates used directly) and d > N (thin QR of T^T)
    for N, d in ((12, 5), (5, 12)):
        T, u, M, z = instance(N, 4, d)
        sol = solve(T, u, M, z, 2.0, 0.8)
        lam_ref, p_ref = lbfgs_ot_dual(T, u, M, z, 2.0, 0.8)
        assert bool(sol.converged)
        np.testing.assert_allclose(sol.lam.numpy(), lam_ref, atol=1e-7)
        np.testing.assert_allclose(sol.p.numpy(), p_ref, atol=1e-7)


def test_kl_special_case_equals_probes_kl_solver():
    # M(t, t_j) = -log w_t and gamma = 1: W(p, u) = KL(p || w) - H(u), so u~ = w and the OT problem is
    # probe's KL problem with preference w over the candidates
    N, n, d, alpha = 9, 4, 5, 1.7
    T = RNG.normal(size=(N, d)) * 0.8
    w = RNG.dirichlet(np.ones(N))
    u = RNG.dirichlet(np.ones(n))
    Z = RNG.normal(size=(3, d))
    M = np.broadcast_to(-np.log(w), (n, N))
    sol = ot_posterior(torch.tensor(T), torch.tensor(u), torch.tensor(M), torch.tensor(Z), alpha, 1.0)
    Tt, Zt = torch.tensor(T), torch.tensor(Z)
    kl = solve_dual(DualProblems(gram=(Tt @ Tt.T)[None], logits=(Zt @ Tt.T)[None],
                                 log_preference=torch.tensor(np.log(w)).expand(1, 3, N),
                                 evidence_sqnorm=(Zt * Zt).sum(-1)[None], alpha=alpha),
                    direction_dtype=torch.float64)
    assert bool(sol.converged.all()) and bool(kl.converged.all())
    np.testing.assert_allclose(sol.u_tilde.numpy(), np.broadcast_to(w, (3, N)), atol=1e-14)
    lam_kl = alpha * Z + kl.coefficients[0].numpy() @ T
    np.testing.assert_allclose(sol.lam.numpy(), lam_kl, atol=1e-8)
    np.testing.assert_allclose(sol.p.numpy(), kl.attention[0].numpy(), atol=1e-9)
    np.testing.assert_allclose(sol.rel_deviation.numpy(), kl.rel_deviation[0].numpy(), atol=1e-8)


def test_true_preference_closed_form_and_limit_gamma_to_zero():
    # A = the input's templates, a metric cost (Euclidean distance: 0 on the diagonal, > 0 elsewhere)
    n = 6
    X = RNG.normal(size=(n, 3))
    u = RNG.dirichlet(np.ones(n))
    M = np.linalg.norm(X[:, None] - X[None], axis=-1)
    gap = M[~np.eye(n, dtype=bool)].min()
    errors = []
    for gamma in (4.0, 1.0, 0.25, gap / 10, gap / 40):
        u_tilde = true_preference(torch.tensor(u), torch.tensor(M), gamma).numpy()
        np.testing.assert_allclose(u_tilde, ot_true_preference(u, M, gamma), atol=1e-15)
        errors.append(np.abs(u_tilde - u).sum())
    # each source keeps all but at most (n - 1) e^{-gap/gamma} of its mass at itself
    assert errors[-1] <= 2 * (n - 1) * math.exp(-40)
    assert errors[-2] <= 2 * (n - 1) * math.exp(-10)
    assert all(a >= b for a, b in zip(errors, errors[1:]))
    # and the OT posterior at gamma -> 0 uses it: its u_tilde is the solver's
    sol = solve(X, u, M, RNG.normal(size=3), 1.0, gap / 40)
    np.testing.assert_allclose(sol.u_tilde.numpy(), u, atol=1e-12)


def test_ot_attention_against_a_plain_loop_over_eq_22():
    B, N, n, d, alpha, gamma = 3, 5, 4, 3, 1.3, 0.6
    T = RNG.normal(size=(B, N, d))
    u = RNG.dirichlet(np.ones(n), size=B)
    u[1, 2] = 0.0
    u[1] /= u[1].sum()
    M = RNG.uniform(0, 2, size=(B, n, N))
    M[0, 1, 3] = np.inf
    M[1, 2, :] = np.inf  # a source of weight 0
    z = RNG.normal(size=(B, d))
    got = ot_attention(*(torch.tensor(x) for x in (T, u, M, z)), alpha, gamma).numpy()
    for b in range(B):
        for t in range(N):
            total = 0.0
            for j in range(n):
                if u[b, j] == 0:
                    continue
                scores = [math.exp((alpha * sum(T[b, k, i] * z[b, i] for i in range(d)) - M[b, j, k]) / gamma)
                          for k in range(N)]
                total += u[b, j] * scores[t] / sum(scores)
            assert got[b, t] == pytest.approx(total, abs=1e-14)


def test_starting_point_is_eq_22_and_the_deviation_is_measured_from_it():
    T, u, M, z = instance(7, 3, 4)
    start = solve(T, u, M, z, 0.8, 1.2, max_iter=0)
    p22 = ot_attention(*(torch.tensor(x) for x in (T, u, M, z)), 0.8, 1.2)
    np.testing.assert_allclose(start.p.numpy(), p22.numpy(), atol=1e-15)
    assert not bool(start.converged)


# -------------------------------------------------------------------------------------- the certificate


def explicit_gap(T, u, M, z, alpha, gamma, lam):
    r"""P(p) - D(lam) with p = grad W*(T lam), in extended precision (numpy longdouble), from the explicit
    plan X_tj = u_j q_j(t) (feasible for (p, u), so P(p) <= its objective) -- no Fenchel-Young shortcut."""
    ld = np.longdouble
    T, u, M, z, lam = (np.asarray(x, dtype=ld) for x in (T, u, M, z, lam))
    alpha, gamma = ld(alpha), ld(gamma)
    logits = -M / gamma
    q0 = np.exp(logits - logits.max(axis=1, keepdims=True))
    u_tilde = u @ (q0 / q0.sum(axis=1, keepdims=True))
    b = T.T @ u_tilde + z
    a = (T @ lam)[None, :] / gamma - M / gamma
    a = a - a.max(axis=1, keepdims=True)
    q = np.exp(a)
    q /= q.sum(axis=1, keepdims=True)
    X = u[:, None] * q  # (n, N): X[j, t]
    p = X.sum(axis=0)
    positive = X > 0
    plan_value = (M[positive] * X[positive]).sum() + gamma * (X[positive] * np.log(X[positive])).sum()
    primal = alpha / 2 * ((b - T.T @ p) ** 2).sum() + plan_value
    conjugate_terms = [
        gamma * np.array([u[j] * np.log(np.exp((T @ lam - M[j]) / gamma - ((T @ lam - M[j]) / gamma).max()).sum()),
                          u[j] * ((T @ lam - M[j]) / gamma).max(), -u[j] * np.log(u[j])])
        for j in range(len(u)) if u[j] > 0
    ]
    conjugate = sum(terms.sum() for terms in conjugate_terms)
    dual = lam @ b - lam @ lam / (2 * alpha) - conjugate
    # the size that rounds: the terms' own magnitudes (they cancel: costs of 1e4 / gamma against each other)
    size = (alpha / 2 * ((b - T.T @ p) ** 2).sum() + np.abs(M[positive] * X[positive]).sum()
            + gamma * np.abs(X[positive] * np.log(X[positive])).sum() + abs(lam @ b) + lam @ lam / (2 * alpha)
            + sum(np.abs(terms).sum() for terms in conjugate_terms))
    return float(primal - dual), float(size)


def test_duality_gap_closed_form_equals_primal_minus_dual():
    # the closed form alpha/2 ||grad D||^2 against P(p) - D(lambda) from the explicit plan, before convergence
    T, u, M, z = instance(6, 3, 4)
    for iterations in (0, 1, 2):
        sol = solve(T, u, M, z, 1.5, 0.5, max_iter=iterations)
        if iterations == 0:  # the dual point is lambda = alpha z, where p is eq. (22)
            np.testing.assert_allclose(sol.dual_point.numpy(), 1.5 * z, atol=1e-15)
        gap, size = explicit_gap(T, u, M, z, 1.5, 0.5, sol.dual_point.numpy())
        assert gap > 1e-12  # not yet converged: the test compares something nonzero
        assert sol.duality_gap.item() == pytest.approx(gap, rel=1e-9, abs=1e-15 * size)


def test_error_bound_bounds_the_true_error_when_stopped_early():
    T, u, M, z = instance(10, 5, 6, cost_scale=5.0)
    exact = solve(T, u, M, z, 6.0, 0.3)
    assert bool(exact.converged)
    for iterations in range(0, 6):
        early = solve(T, u, M, z, 6.0, 0.3, max_iter=iterations)
        error = np.linalg.norm(early.lam.numpy() - exact.lam.numpy())
        assert error <= early.error_bound.item() + exact.error_bound.item()
        if not bool(early.converged):
            assert early.error_bound.item() > 1e-9 * early.lambda_norm.item()


# ------------------------------------------------------------------------------------------------ batches


def test_batches_broadcast_and_agree_with_single_problems():
    N, n, d = 6, 3, 4
    T = torch.tensor(RNG.normal(size=(2, 1, N, d)))
    u = torch.tensor(RNG.dirichlet(np.ones(n), size=(1, 3)))
    M = torch.tensor(RNG.uniform(0, 2, size=(n, N)))
    z = torch.tensor(RNG.normal(size=(2, 3, d)))
    sol = ot_posterior(T, u, M, z, 1.0, 0.9)
    assert sol.lam.shape == (2, 3, d) and sol.p.shape == (2, 3, N) and sol.converged.shape == (2, 3)
    assert sol.lam.dtype == torch.float64
    for a in range(2):
        for b in range(3):
            one = ot_posterior(T[a, 0], u[0, b], M, z[a, b], 1.0, 0.9)
            torch.testing.assert_close(sol.lam[a, b], one.lam, atol=1e-12, rtol=0)
            torch.testing.assert_close(sol.p[a, b], one.p, atol=1e-13, rtol=0)


def test_float32_input_gives_float64_answers():
    T, u, M, z = instance(5, 3, 4)
    sol = ot_posterior(*(torch.tensor(x, dtype=torch.float32) for x in (T, u, M, z)), 1.0, 1.0)
    assert sol.lam.dtype == torch.float64 and bool(sol.converged)


# ---------------------------------------------------------------------------------------------- bad input

GOOD = dict(candidates=np.ones((3, 2)), source_weights=np.array([0.5, 0.5]), cost=np.ones((2, 3)),
            evidence=np.ones(2), alpha=1.0, gamma=1.0)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(cost=-np.ones((2, 3))), "nonnegative"),
        (dict(cost=np.array([[1.0, np.nan, 1.0], [1, 1, 1]])), "NaN"),
        (dict(cost=np.array([[1.0, -np.inf, 1.0], [1, 1, 1]])), "-inf"),
        (dict(cost=np.array([[np.inf] * 3, [1.0, 1, 1]])), "every candidate"),
        (dict(source_weights=np.array([0.5, 0.6])), "sum to 1"),
        (dict(source_weights=np.array([1.5, -0.5])), "nonnegative"),
        (dict(source_weights=np.array([np.nan, 0.5])), "NaN"),
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-1.0), "alpha"),
        (dict(gamma=0.0), "gamma"),
        (dict(gamma=float("inf")), "gamma"),
        (dict(alpha="big"), "alpha"),
        (dict(candidates=np.array([[1.0, np.inf], [0, 0], [1, 1]])), "candidates"),
        (dict(evidence=np.array([np.nan, 1.0])), "evidence"),
        (dict(cost=np.ones((3, 2))), "inconsistent shapes"),
        (dict(evidence=np.ones(3)), "inconsistent shapes"),
        (dict(candidates=np.ones(3)), "expected candidates"),
        (dict(candidates=np.ones((4, 3, 2)), evidence=np.ones((5, 2)), cost=np.ones((2, 3))), "broadcast"),
        (dict(candidates=np.ones((0, 2)), cost=np.ones((2, 0))), "at least one candidate"),
    ],
)
def test_bad_inputs_raise_clear_errors(change, message):
    args = {**GOOD, **change}
    with pytest.raises(OTInputError, match=message) as info:
        ot_posterior(**args)
    assert isinstance(info.value, ValueError)


def test_bad_tolerances_and_true_preference_inputs():
    with pytest.raises(ValueError, match="rtol"):
        ot_posterior(**GOOD, rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="gamma"):
        true_preference(np.array([1.0]), np.ones((1, 2)), -1.0)
    with pytest.raises(ValueError, match="nonnegative"):
        true_preference(np.array([1.0]), -np.ones((1, 2)), 1.0)


# --------------------------------------------------------------------------------------- hard instances


@st.composite
def hard_instances(draw):
    N = draw(st.integers(1, 10))
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0, 20.0]))
    T = rng.normal(size=(N, d)) * scale
    if draw(st.booleans()) and N > 1:  # near-duplicate candidates
        T[1:] = T[0] + draw(st.sampled_from([0.0, 1e-12, 1e-6])) * rng.normal(size=(N - 1, d))
    u = rng.dirichlet(np.ones(n) * 0.5)
    if n > 1 and draw(st.booleans()):
        u[0] = 0.0
        u /= u.sum()
    cost_scale = draw(st.sampled_from([1e-3, 1.0, 1e2, 1e4]))
    M = rng.uniform(0, cost_scale, size=(n, N))
    if N > 1 and draw(st.booleans()):  # some candidates excluded from some sources (each keeps one)
        excluded = rng.random(size=(n, N)) < 0.3
        excluded[np.arange(n), rng.integers(0, N, size=n)] = False
        M[excluded] = np.inf
    z = rng.normal(size=d) * scale
    alpha = draw(st.sampled_from([0.01, 1.0, 30.0, 300.0]))
    gamma = draw(st.sampled_from([1e-3, 0.05, 1.0, 64.0]))
    return T, u, M, z, alpha, gamma


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(hard_instances())
def test_property_every_problem_certified_or_flagged_and_certified_ones_check_out(case):
    T, u, M, z, alpha, gamma = case
    sol = solve(T, u, M, z, alpha, gamma, max_iter=60)
    bound, norm = sol.error_bound.item(), sol.lambda_norm.item()
    assert np.isfinite(bound) and bound >= 0
    assert bool(sol.converged) == (bound <= 1e-9 * norm + 1e-12)
    assert np.all(sol.p.numpy() >= 0) and sol.p.sum().item() == pytest.approx(1.0, abs=1e-12)
    # independent check: weak duality with the explicit plan, in extended precision, at the solver's dual
    # point lambda (where p = p(lambda)): ||lambda - lambda*||^2 <= 2 alpha (P(p) - D(lambda)) by strong
    # concavity, so ||lam_hat - lam*|| <= ||lam_hat - lambda|| + sqrt(2 alpha gap)
    gap, size = explicit_gap(T, u, M, z, alpha, gamma, sol.dual_point.numpy())
    resolution = 64 * np.finfo(np.longdouble).eps * size
    assert gap >= -resolution  # weak duality (a check on the explicit computation itself)
    # the solver's gap alpha/2 ||g||^2 is computed in float64: g = T^T (u~ - p) - (lambda - alpha z)/alpha
    # carries the rounding of p (logits of size max|T lambda|/gamma) and of its two terms
    lam_dual = sol.dual_point.numpy()
    radius = np.linalg.norm(T, axis=1).max()
    rounding = 64 * np.finfo(float).eps * (radius * (2 + np.abs(T @ lam_dual).max() / gamma + M[np.isfinite(M)].max() / gamma)
                                           + np.linalg.norm(lam_dual - alpha * z) / alpha)
    assert abs(math.sqrt(sol.duality_gap.item()) - math.sqrt(max(gap, 0.0))) <= (
        math.sqrt(alpha / 2) * rounding + math.sqrt(resolution) + 1e-6 * math.sqrt(max(gap, 0.0)))
    # the explicit gap is known to +-resolution, so sqrt(2 alpha gap) to +-sqrt(2 alpha resolution)
    slack = math.sqrt(2 * alpha * resolution)
    independent = np.linalg.norm(sol.lam.numpy() - sol.dual_point.numpy()) + math.sqrt(2 * alpha * max(gap, 0.0))
    if bool(sol.converged):
        assert independent <= 1e-9 * norm + 1e-12 + slack
    else:  # flagged: its bound is above the tolerance, and what is certifiable independently is no better
        assert bound > 1e-9 * norm
        assert independent >= 0.5 * bound - slack


# ------------------------------------------------------------------------- approximation quality, scripts


def test_approximation_quality_errors_bound_the_distance_to_the_exact_values():
    from probe.solve.ot import approximation_quality

    T, u, M, z = instance(12, 5, 4, cost_scale=4.0)
    args = [torch.tensor(x) for x in (T, u, M, z)]
    exact = approximation_quality(*args, 4.0, 0.4)
    assert bool(exact.solution.converged)
    assert exact.total_variation.item() > 1e-3  # something to compare
    for iterations in (1, 2, 3):
        early = approximation_quality(*args, 4.0, 0.4, max_iter=iterations)
        assert abs(early.rel_deviation - exact.rel_deviation).item() <= (
            early.rel_deviation_error + exact.rel_deviation_error).item()
        assert abs(early.total_variation - exact.total_variation).item() <= (
            early.total_variation_error + exact.total_variation_error).item()


def _load_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_script_model_mode_on_a_stub_vit(tmp_path, monkeypatch):
    # probe.vit's contract (load_checkpoint, final_layer_problems -> (B, H, ...) tensors), stubbed; the
    # script's number at the model's (alpha, gamma) against L-BFGS on each problem, one at a time
    import sys
    import types

    B, H, n, d, alpha, gamma = 2, 2, 6, 3, 1.0, 2.0  # N = n: the candidates are the sources
    rng = np.random.default_rng(7)
    keys = rng.normal(size=(B, H, n, d))
    inner = keys @ np.swapaxes(keys, -1, -2)
    cost = inner.max() - inner - 1e-7  # a float32-computed C can leave costs a rounding below 0
    problems = dict(candidates=torch.tensor(keys), source_weights=torch.full((B, H, n), 1.0 / n),
                    cost=torch.tensor(cost), evidence=torch.tensor(rng.normal(size=(B, H, d))),
                    alpha=alpha, gamma=gamma)
    vit = types.ModuleType("probe.vit")
    vit.load_checkpoint = lambda path: ("model", {"checkpoint": str(path)})
    vit.final_layer_problems = lambda model, images: problems
    data = types.ModuleType("probe.vit.data")
    data.load_data = lambda name: types.SimpleNamespace(test_images=torch.zeros(3, 1, 28, 28, dtype=torch.uint8),
                                                        normalise=lambda images: images.float())
    monkeypatch.setitem(sys.modules, "probe.vit", vit)
    monkeypatch.setitem(sys.modules, "probe.vit.data", data)
    script = _load_script("ot_quality")
    script.main(["model", "--checkpoint", str(tmp_path / "ckpt.pt"), "--images", "3", "--out", str(tmp_path),
                 "--alphas", "0.5", "--gammas", "4"])
    import json

    result = json.loads((tmp_path / "quality_model.json").read_text())
    assert result["meta"]["model_alpha"] == alpha and result["meta"]["problems"] == B * H
    assert {(r["alpha"], r["gamma"]) for r in result["rows"]} == {(a, g) for a in (0.5, 1.0) for g in (2.0, 4.0)}
    row = next(r for r in result["rows"] if r["alpha"] == alpha and r["gamma"] == gamma)
    assert row["certified_fraction"] == 1.0
    reference = []
    for b in range(B):
        for h in range(H):
            T, M, z = keys[b, h], cost[b, h], problems["evidence"][b, h].numpy()
            lam, _ = lbfgs_ot_dual(T, np.full(n, 1.0 / n), M, z, alpha, gamma)
            reference.append(np.linalg.norm(lam - alpha * z) / np.linalg.norm(lam))
    assert row["rel_deviation_median"] == pytest.approx(float(np.median(reference)), abs=1e-7)
    assert (tmp_path / "quality_model.png").exists() and (tmp_path / "quality_model.csv").exists()


def test_benchmark_rows_are_certified_and_written(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "ot.py"
    spec = importlib.util.spec_from_file_location("_bench_ot", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    candidates, weights, cost, evidence = bench.problems(8, 60, 50, 16, seed=1)
    # the OT-ViT's cost M(a, b) = -<a, b> + C >= 0 with the first n candidates as the sources
    shift = cost + candidates[:, :50] @ candidates.transpose(1, 2)
    assert bool((cost >= 0).all()) and torch.allclose(shift, shift.amax().expand_as(shift), rtol=0, atol=1e-12)
    out = tmp_path / "results.json"
    bench.main(["--batch", "8", "--out", str(out)])
    results = json.loads(out.read_text())
    assert len(results["rows"]) == 8 and all(r["converged_fraction"] == 1.0 for r in results["rows"])
    assert "| 100 | 50 | 64 | 16 |" in out.with_suffix(".md").read_text()
