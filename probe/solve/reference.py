r"""Independent reference solvers, for tests and the benchmark only (runs never use them).

They work on the *full* problem (templates :math:`T \in R^{n\times d}`, evidence :math:`z \in R^d`,
preference :math:`u`, :math:`\alpha`), one problem at a time, with general-purpose optimisers, and share
no code with :mod:`probe.solve.dual`:

* :func:`cvxpy_primal` -- the primal (P) as a conic program (CVXPY + Clarabel), its answer polished by
  Newton's method on (P) itself (:func:`polish_primal`);
* :func:`lbfgs_dual` -- the dual (D) by SciPy's L-BFGS;
* :func:`gradient_ascent_dual` -- batched gradient ascent on (D) with step :math:`1/L`, the method the
  paper describes, on many problems at once (torch).

``cvxpy`` and ``scipy`` are test-only dependencies and are imported lazily.
"""

from __future__ import annotations

import warnings

import numpy as np


def relative_deviation(lam: np.ndarray, z: np.ndarray, alpha: float) -> float:
    r""":math:`\|\lambda - \alpha z\| / \|\lambda\|`."""
    return float(np.linalg.norm(lam - alpha * z) / np.linalg.norm(lam))


def _support(log_u: np.ndarray):
    log_u = np.asarray(log_u, dtype=float)
    keep = np.isfinite(log_u)
    w = np.exp(log_u[keep] - log_u[keep].max())
    return keep, w / w.sum()


def cvxpy_primal(T, z, log_u, alpha=1.0, *, eps=1e-12, polish=True):
    r"""Solve (P): :math:`\min_p \tfrac{\alpha}{2}\|\mu + z - T^\top p\|^2 + KL(p\|u)` over the simplex.

    Clarabel's tolerances are tightened to ``eps`` (1e-12): at its defaults (1e-8) the recovered
    :math:`\lambda` is only good to about 1e-6 relative.  Even so it can end "almost solved" on a
    well-posed problem, about 1e-5 off (a 3-key BLOOM problem on an AMD Zen 3, with Clarabel 0.11), so
    its :math:`p` is then polished by Newton's method on (P) (:func:`polish_primal`; ``polish=False``:
    Clarabel's answer as it is).  Keys with :math:`u_i = 0` (``log_u = -inf``) are excluded (:math:`p_i = 0`).  Returns
    ``(lambda, p)`` with :math:`\lambda = \alpha(\mu + z - T^\top p)` recovered from the primal optimum.
    """
    import cvxpy as cp

    T = np.asarray(T, dtype=float)
    z = np.asarray(z, dtype=float)
    keep, u = _support(log_u)
    T_s = T[keep]
    b = T_s.T @ u + z
    p = cp.Variable(len(u), nonneg=True)
    residual = cp.Variable(len(b))  # the residual mu + z - T^T p as its own variable conditions better
    objective = 0.5 * alpha * cp.sum_squares(residual) + cp.sum(cp.rel_entr(p, u))
    problem = cp.Problem(cp.Minimize(objective), [cp.sum(p) == 1, residual == b - T_s.T @ p])
    with warnings.catch_warnings():  # "optimal_inaccurate" at these tolerances is still ~1e-9 accurate
        warnings.simplefilter("ignore", UserWarning)
        problem.solve(
            solver=cp.CLARABEL, tol_gap_abs=eps, tol_gap_rel=eps, tol_feas=eps, tol_ktratio=eps, max_iter=1000,
            static_regularization_constant=eps, iterative_refinement_reltol=1e-16,
            iterative_refinement_abstol=1e-16, iterative_refinement_max_iter=50,
        )
    if p.value is None:
        raise RuntimeError(f"CVXPY failed: {problem.status}")
    p_full = np.zeros(len(keep))
    p_full[keep] = polish_primal(T_s, b, u, p.value, alpha) if polish else np.clip(p.value, 0, None)
    lam = alpha * (b - T_s.T @ p_full[keep])
    return lam, p_full


def polish_primal(T, b, u, p, alpha=1.0, *, max_iter=50):
    r"""Newton's method on (P) in the relative interior of the simplex, from a near-optimal ``p``.

    Minimises :math:`F(p) = \tfrac{\alpha}{2}\|b - T^\top p\|^2 + \sum_i p_i\log(p_i/u_i)` subject to
    :math:`\mathbf{1}^\top p = 1` (``T`` the templates on the support of ``u``, :math:`b = \mu + z`): each
    step solves the KKT system of :math:`\nabla^2 F = \alpha TT^\top + \mathrm{diag}(1/p)` with the
    constraint, and is shortened to keep :math:`p > 0` and, away from the optimum, to decrease
    :math:`F`.  (The optimum is interior: the entropy's slope is infinite at :math:`p_i = 0`.)  Stops
    when the Newton decrement reaches rounding.
    """
    T, b, u = (np.asarray(x, dtype=float) for x in (T, b, u))
    n = len(u)
    p = np.clip(np.asarray(p, dtype=float), 1e-300, None)
    p /= p.sum()

    def objective(q):
        residual = b - T.T @ q
        return 0.5 * alpha * residual @ residual + float(np.sum(q * (np.log(q) - np.log(u))))

    return _interior_newton(
        p, objective,
        gradient=lambda q: -alpha * (T @ (b - T.T @ q)) + np.log(q) - np.log(u) + 1.0,
        hessian=lambda q: alpha * (T @ T.T) + np.diag(1.0 / q),
        constraints=np.ones((1, n)), max_iter=max_iter,
        project=lambda q: q / q.sum(),  # back onto the simplex: the step keeps the sum up to rounding
    )


def _interior_newton(x, objective, gradient, hessian, constraints, max_iter, project=None):
    r"""Newton's method for :math:`\min F(x)` subject to :math:`Cx = Cx_0` in the interior :math:`x > 0`,
    from a feasible :math:`x_0`: each step solves the KKT system of the Hessian with the constraints
    ``constraints`` :math:`C`, and is shortened to keep :math:`x > 0` and, away from the optimum, to
    decrease :math:`F`.  Stops when the Newton decrement reaches rounding.  ``project``: applied to every
    new iterate (to undo the constraints' rounding drift)."""
    k, m = len(x), constraints.shape[0]
    kkt = np.zeros((k + m, k + m))
    kkt[:k, k:] = constraints.T
    kkt[k:, :k] = constraints
    for _ in range(max_iter):
        g = gradient(x)
        kkt[:k, :k] = hessian(x)
        step = np.linalg.solve(kkt, np.concatenate([-g, np.zeros(m)]))[:k]
        # the squared Newton decrement, as step^T H step: -g^T step is the same number in exact arithmetic,
        # but g's component normal to the constraints (large, e.g. a constant for the simplex) cancels in it
        # only up to rounding, which can make it <= 0 and stop the polish at Clarabel's 1e-9 answer; where
        # H holds an infinite curvature (an entry of x near 1e-300), -g^T step instead
        with np.errstate(invalid="ignore", over="ignore"):
            decrement = float(step @ kkt[:k, :k] @ step)
        if not np.isfinite(decrement):
            decrement = -(g @ step)
        if not decrement > 1e-28 * max(1.0, abs(objective(x))):
            break
        shrinking = step < 0
        length = min(1.0, 0.99 * float(np.min(-x[shrinking] / step[shrinking]))) if shrinking.any() else 1.0
        start = objective(x)
        # far from the optimum, backtrack on F; near it (F's decrease below what its rounding resolves),
        # Newton converges quadratically and takes its steps whole
        while decrement > 1e-8 * max(1.0, abs(start)) and length > 1e-12 and (
            objective(x + length * step) > start - 1e-4 * length * decrement
        ):
            length *= 0.5
        if length <= 1e-12:
            break
        x = x + length * step
        if project is not None:
            x = project(x)
    return x


def lbfgs_dual(T, z, log_u, alpha=1.0, *, gtol=1e-12, x0=None):
    r"""Maximise (D) with SciPy L-BFGS from :math:`\lambda_0 = \alpha z`.  Returns (lambda, iterations)."""
    from scipy.optimize import minimize

    T = np.asarray(T, dtype=float)
    z = np.asarray(z, dtype=float)
    keep, u = _support(log_u)
    T_s = T[keep]
    log_u_s = np.log(u)
    b = T_s.T @ u + z

    def negative_dual(lam):
        theta = log_u_s + T_s @ lam
        top = theta.max()
        weights = np.exp(theta - top)
        total = weights.sum()
        p = weights / total
        value = lam @ b - lam @ lam / (2 * alpha) - (top + np.log(total))
        gradient = b - lam / alpha - T_s.T @ p
        return -value, -gradient

    result = minimize(
        negative_dual, alpha * z if x0 is None else x0, jac=True, method="L-BFGS-B",
        options={"gtol": gtol, "ftol": 0.0, "maxiter": 100000, "maxcor": 30},
    )
    return result.x, int(result.nit)


def gradient_ascent_dual(T, z, log_u, alpha=1.0, *, tol=1e-9, max_iter=1_000_000):
    r"""Batched gradient ascent on (D): :math:`\lambda \leftarrow \lambda + \nabla D(\lambda)/L`.

    ``T`` is ``(B, n, d)``, ``z`` ``(B, d)``, ``log_u`` ``(B, n)`` (torch tensors on one device, where it
    runs).  The step uses the
    smoothness constant :math:`L = 1/\alpha + \max_i\|t_i\|^2` (the log-sum-exp Hessian is at most
    :math:`\max_i\|t_i\|^2`).  Stops each problem when :math:`\alpha\|\nabla D\|`, a bound on
    :math:`\|\lambda - \lambda^*\|` by strong concavity, is at most ``tol * ||lambda||``.
    Returns (lambda ``(B, d)``, iterations ``(B,)``).
    """
    import torch

    log_u = log_u - torch.logsumexp(log_u, dim=-1, keepdim=True)
    u = log_u.exp()
    b = torch.einsum("bn,bnd->bd", u, T) + z
    support = torch.isfinite(log_u)
    sq = (T * T).sum(-1).masked_fill(~support, 0.0)
    step = 1.0 / (1.0 / alpha + sq.amax(-1, keepdim=True))
    lam = alpha * z.clone()
    iterations = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)
    live = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
    for _ in range(max_iter):
        p = torch.softmax(log_u + torch.einsum("bnd,bd->bn", T, lam), dim=-1)
        gradient = b - lam / alpha - torch.einsum("bn,bnd->bd", p, T)
        live = live & (alpha * gradient.norm(dim=-1) > tol * lam.norm(dim=-1))
        if not bool(live.any()):
            break
        lam = torch.where(live[:, None], lam + step * gradient, lam)
        iterations += live
    return lam, iterations


def templates_from_reduced(gram, logits, evidence_sqnorm):
    r"""An explicit :math:`(T, z)` with :math:`TT^\top = G`, :math:`Tz = s`, :math:`\|z\|^2` as given.

    Lets full-space solvers run on problems captured in reduced form: the dual depends on :math:`(T, z)`
    only through these quantities (:math:`\lambda^* - \alpha z \in \mathrm{row}(T)`).  ``T = Q
    \Gamma^{1/2}`` plus one extra coordinate that carries the part of :math:`z` orthogonal to row(T).
    """
    gram = np.asarray(gram, dtype=float)
    eigenvalues, Q = np.linalg.eigh(0.5 * (gram + gram.T))
    keep = eigenvalues > len(gram) * np.finfo(float).eps * max(eigenvalues.max(), 0)
    A = Q[:, keep] * np.sqrt(eigenvalues[keep])
    z_row, *_ = np.linalg.lstsq(A, np.asarray(logits, dtype=float), rcond=None)
    rest = max(float(evidence_sqnorm) - float(z_row @ z_row), 0.0) ** 0.5
    T = np.hstack([A, np.zeros((len(gram), 1))])
    return T, np.append(z_row, rest)


# ------------------------------------------------------------------------------------------- OT problem
# References for :mod:`probe.solve.ot` (numpy / CVXPY / SciPy, one problem at a time; no code shared with it).
# T (N, d) the candidates, u (n,) the source weights, M (n, N) the cost M[j, t] = M(t, t_j), z (d,).


def ot_true_preference(u, M, gamma):
    r""":math:`\tilde u(t) = \sum_j u_j e^{-M(t, t_j)/\gamma} / \sum_{t''} e^{-M(t'', t_j)/\gamma}` (numpy)."""
    u, M = np.asarray(u, dtype=float), np.asarray(M, dtype=float)
    logits = -M / gamma
    logits = logits - logits.max(axis=1, keepdims=True)
    q = np.exp(logits)
    q /= q.sum(axis=1, keepdims=True)
    return u @ q


def cvxpy_ot_primal(T, u, M, z, alpha, gamma, *, eps=1e-12, polish=True):
    r"""Solve the OT primal with the transport plan as the variable (CVXPY + Clarabel):

    .. math::  \min_{X \ge 0,\ X^\top 1 = u}\ \tfrac{\alpha}{2}\|\tilde\mu + z - T^\top X 1\|^2
               + \langle M, X\rangle - \gamma\sum_{tj}\mathrm{entr}(X_{tj}),

    which is (OT-P) with :math:`p = X1` and :math:`W_\gamma` written out.  Sources with :math:`u_j = 0`
    are dropped.  Clarabel's plan is polished by Newton's method on the same problem
    (:func:`polish_ot_plan`; ``polish=False``: as it is).  Returns ``(lambda, p)`` with
    :math:`\lambda = \alpha(\tilde\mu + z - T^\top p)`.
    """
    import cvxpy as cp

    T, u, M, z = (np.asarray(x, dtype=float) for x in (T, u, M, z))
    u_tilde = ot_true_preference(u, M, gamma)
    b = T.T @ u_tilde + z
    keep = u > 0
    u_s, M_s = u[keep], M[keep]
    excluded = ~np.isfinite(M_s.T)  # (N, n): +inf cost, no transport
    X = cp.Variable((T.shape[0], len(u_s)), nonneg=True)
    residual = cp.Variable(len(b))
    p = cp.sum(X, axis=1)
    objective = (0.5 * alpha * cp.sum_squares(residual) + cp.sum(cp.multiply(np.where(excluded, 0.0, M_s.T), X))
                 - gamma * cp.sum(cp.entr(X)))
    constraints = [cp.sum(X, axis=0) == u_s, residual == b - T.T @ p]
    if excluded.any():
        constraints.append(cp.multiply(excluded.astype(float), X) == 0)
    problem = cp.Problem(cp.Minimize(objective), constraints)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        problem.solve(
            solver=cp.CLARABEL, tol_gap_abs=eps, tol_gap_rel=eps, tol_feas=eps, tol_ktratio=eps, max_iter=1000,
            static_regularization_constant=eps, iterative_refinement_reltol=1e-16,
            iterative_refinement_abstol=1e-16, iterative_refinement_max_iter=50,
        )
    if X.value is None:
        raise RuntimeError(f"CVXPY failed: {problem.status}")
    if polish and not excluded.any():
        plan = polish_ot_plan(T, b, u_s, M_s, X.value, alpha, gamma)
    else:  # (the polish works in the plan's interior; with excluded entries Clarabel's plan is used as it is)
        plan = np.where(excluded, 0.0, np.clip(X.value, 0, None))
    p_value = plan.sum(axis=1)
    return alpha * (b - T.T @ p_value), p_value


def polish_ot_plan(T, b, u, M, X, alpha, gamma, *, max_iter=50):
    r"""Newton's method on the OT primal in the plan, from a near-optimal ``X`` (N, n): minimises
    :math:`F(X) = \tfrac{\alpha}{2}\|b - T^\top X1\|^2 + \langle M^\top, X\rangle + \gamma\sum X\log X`
    subject to :math:`X^\top 1 = u`, each step solving the KKT system of
    :math:`\nabla^2 F = \alpha S^\top TT^\top S + \gamma\,\mathrm{diag}(1/X)` (:math:`S` sums a plan's rows) with
    the constraint, shortened to keep :math:`X > 0` and, away from the optimum, to decrease :math:`F`.
    Clarabel's exponential cones leave about 1e-7 of error at gamma ~ 8 ("optimal_inaccurate"); this
    brings it to rounding, as :func:`polish_primal` does for the KL problem."""
    T, b, u, M = (np.asarray(x, dtype=float) for x in (T, b, u, M))
    N, n = len(T), len(u)
    x = np.clip(np.asarray(X, dtype=float), 1e-300, None).reshape(-1)  # vec(X), row-major: x[t * n + j]
    x = (x.reshape(N, n) * (u / x.reshape(N, n).sum(axis=0))).reshape(-1)
    S = np.kron(np.eye(N), np.ones((1, n)))  # p = S x
    C = np.kron(np.ones((1, N)), np.eye(n))  # column sums: C x = u
    cost = M.T.reshape(-1)
    G = T @ T.T

    def objective(v):
        residual = b - T.T @ (S @ v)
        return 0.5 * alpha * residual @ residual + cost @ v + gamma * float(np.sum(v * np.log(v)))

    x = _interior_newton(
        x, objective,
        gradient=lambda v: -alpha * S.T @ (T @ (b - T.T @ (S @ v))) + cost + gamma * (np.log(v) + 1.0),
        hessian=lambda v: alpha * S.T @ G @ S + gamma * np.diag(1.0 / v),
        constraints=C, max_iter=max_iter,
    )
    return x.reshape(N, n)


def ot_dual_value_and_gradient(lam, T, u, M, z, alpha, gamma):
    r"""(OT-D) written out in numpy: :math:`D(\lambda)`, :math:`\nabla D(\lambda)` and :math:`p(\lambda)`."""
    T, u, M, z = (np.asarray(x, dtype=float) for x in (T, u, M, z))
    u_tilde = ot_true_preference(u, M, gamma)
    b = T.T @ u_tilde + z
    theta = T @ lam
    p = np.zeros(T.shape[0])
    conjugate = 0.0
    for j in range(len(u)):
        if u[j] == 0:
            continue
        a = (theta - M[j]) / gamma
        top = a.max()
        w = np.exp(a - top)
        conjugate += gamma * u[j] * (top + np.log(w.sum()) - np.log(u[j]))  # gamma (u_j LSE_j - u_j log u_j)
        p += u[j] * w / w.sum()
    value = lam @ b - lam @ lam / (2 * alpha) - conjugate
    return value, b - lam / alpha - T.T @ p, p


def lbfgs_ot_dual(T, u, M, z, alpha, gamma, *, gtol=1e-13):
    r"""Maximise (OT-D) with SciPy L-BFGS from :math:`\lambda_0 = \alpha z`.  Returns ``(lambda, p)``."""
    from scipy.optimize import minimize

    def negative(lam):
        value, gradient, _ = ot_dual_value_and_gradient(lam, T, u, M, z, alpha, gamma)
        return -value, -gradient

    result = minimize(negative, alpha * np.asarray(z, dtype=float), jac=True, method="L-BFGS-B",
                      options={"gtol": gtol, "ftol": 0.0, "maxiter": 100000, "maxcor": 30})
    return result.x, ot_dual_value_and_gradient(result.x, T, u, M, z, alpha, gamma)[2]
