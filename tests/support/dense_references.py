"""Independent dense references for the solver's derived quantities, in the explicit template space (numpy):
the second-order prediction from Sigma_u formed from explicit templates, lambda* by a dense Newton solver, the
reduced form's lambda_2 lifted back and checked against them; random instances, and the second-order solve's
paths (``PATHS``: the keyword arguments that force each one); and every derived quantity of a batch as the
pipeline computes them (``derive``), to compare with the references."""

from __future__ import annotations

import numpy as np
import torch

from probe.solve.derived import (
    attention_deviations,
    attention_entropy,
    attention_tv,
    model_log_attention,
    output_deviation,
)
from probe.solve.dual import factor_gram
from probe.solve.second_order import second_order_deviation, second_order_point

#: relative agreement of lambda_2 with its dense reference
TOL = 1e-7

#: the second-order solve's paths, as keyword arguments of probe.solve.second_order.second_order_point
PATHS = {"auto": {}, "direct": {"direct_min_rows": 1, "direct_rows": False},
         "direct rows": {"direct_min_rows": 1, "direct_rows": True},
         "intervals": {"direct_min_rows": 10**9, "intervals": True},
         "cg": {"direct_min_rows": 10**9, "intervals": False}}


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
