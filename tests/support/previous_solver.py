# probe's solver as it was at commit 5315dce, before the speed work, frozen: the reference that
# tests/solve/test_solver.py::test_answers_agree_with_the_previous_solver compares the current solver with.
# Not used by probe.
r"""Batched, certified solver for the Fenchel dual of attention.

Pure tensor math: nothing here knows about models.  Notation follows the documentation's math page (docs/math.md).

Templates :math:`t_1..t_n \in R^d` (rows of :math:`T`), preference :math:`u` over them with mean
:math:`\mu = T^\top u`, evidence :math:`z`, strength :math:`\alpha`.

* primal  (P):  :math:`\min_p\ \tfrac{\alpha}{2}\|\mu + z - T^\top p\|^2 + KL(p\|u)`
* dual    (D):  :math:`\max_\lambda\ \langle\lambda, \mu+z\rangle - \|\lambda\|^2/(2\alpha)
  - \log\sum_i u_i e^{\langle t_i,\lambda\rangle}`
* optimum:      :math:`p_i(\lambda^*) \propto u_i e^{\langle t_i,\lambda^*\rangle}`,
  :math:`\lambda^* = \alpha(\mu + z - T^\top p^*) = \alpha z + T^\top c^*` with :math:`c^* = \alpha(u - p^*)`.

Reduced form
------------
Every problem is given by n-dimensional data only: the logits :math:`s = Tz`, the Gram matrix
:math:`G = TT^\top` (shared by all problems of a *group*, e.g. all heads and queries of one example and
layer), :math:`\|z\|^2`, :math:`\log u` (``-inf`` for excluded keys) and :math:`\alpha`.

Write :math:`G = A A^\top` with :math:`A = Q\Gamma^{1/2}` from the eigendecomposition of :math:`G`.
Then :math:`T = A V^\top` for an orthonormal :math:`V` and every :math:`\lambda` in the affine set
:math:`\alpha z + \mathrm{row}(T)`, which contains :math:`\lambda^*`, is :math:`\lambda = \alpha z + V y`
with :math:`y \in R^r`.  Substituting into (D):

.. math::  D(y) = \alpha s^\top u + \tfrac{\alpha}{2}\|z\|^2 + y^\top m - \tfrac{1}{2\alpha}\|y\|^2
           - \mathrm{LSE}(\log u + \alpha s + A y), \qquad m = A^\top u,

a smooth, :math:`1/\alpha`-strongly concave function of :math:`y` (eq. R-D below).  Its gradient and
Hessian are

.. math::  g = m - A^\top p - y/\alpha, \qquad H = -(I/\alpha + A^\top(\mathrm{diag}\,p - pp^\top)A).

We run Newton's method on (R-D) with Armijo backtracking on the dual objective; each Newton system is
solved by preconditioned conjugate gradients whose matrix-vector products, for all problems of a group
at once, are matrix-matrix products with the shared :math:`A` (so the per-query cost is
:math:`O(n^2)` per CG step, not :math:`O(n^3)`).

Certificate
-----------
At any :math:`y`, with :math:`p = p(y)`, the duality gap of the pair (primal point :math:`p`, dual point
:math:`\lambda(y)`) has the closed form (derived in :func:`duality_gap_reduced`)

.. math::  P(p) - D(y) = \tfrac{\alpha}{2}\,\|g\|^2 ,

and strong concavity gives :math:`\|\lambda(y) - \lambda^*\| \le \alpha\|g\| = \sqrt{2\alpha\,\mathrm{gap}}`.
The returned :math:`\hat\lambda = \alpha(\mu + z - T^\top p)` is within ``error_bound``
:math:`= 2\sqrt{2\alpha\,\mathrm{gap}}` of :math:`\lambda^*`.  A problem is ``converged`` only when
``error_bound <= rtol * ||lambda_hat|| + atol``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DualProblems", "DualSolution", "solve_dual", "duality_gap_reduced", "factor_gram"]


@dataclass
class DualProblems:
    r"""A batch of reduced dual problems, laid out by group.

    Shapes: ``n_groups`` groups that each share one Gram matrix, ``m`` problems per group, ``n`` keys.

    Attributes:
        gram: :math:`G = TT^\top`, ``(n_groups, n, n)``.
        logits: :math:`s = Tz` (without :math:`\alpha`), ``(n_groups, m, n)``.
        log_preference: :math:`\log u` up to an additive constant per problem, ``-inf`` for keys that
            are not part of the problem, ``(n_groups, m, n)``.
        evidence_sqnorm: :math:`\|z\|^2`, ``(n_groups, m)``.
        alpha: strength :math:`\alpha > 0`.
        active: which problems to solve, ``(n_groups, m)`` bool; inactive ones (e.g. padding queries)
            are skipped and their outputs are NaN.  ``None`` means all.
    """

    gram: torch.Tensor
    logits: torch.Tensor
    log_preference: torch.Tensor
    evidence_sqnorm: torch.Tensor
    alpha: float = 1.0
    active: torch.Tensor | None = None


@dataclass
class DualSolution:
    r"""Per-problem results, each ``(n_groups, m)`` unless stated.

    Attributes:
        coefficients: :math:`c` with :math:`\hat\lambda = \alpha z + T^\top c`, ``(n_groups, m, n)``
            (:math:`c = \alpha(u - p)`); the reduced form of :math:`\lambda^*`.
        attention: :math:`p(\lambda)`, the optimal primal distribution, ``(n_groups, m, n)``.
        rel_deviation: :math:`\|\hat\lambda - \alpha z\| / \|\hat\lambda\|`.
        lambda_norm: :math:`\|\hat\lambda\|`.
        duality_gap: :math:`P(p) - D(\lambda)` at the final iterate (>= 0).
        error_bound: certified bound on :math:`\|\hat\lambda - \lambda^*\|`.
        iterations: Newton iterations taken.
        converged: ``error_bound <= rtol * lambda_norm + atol``.
    """

    coefficients: torch.Tensor
    attention: torch.Tensor
    rel_deviation: torch.Tensor
    lambda_norm: torch.Tensor
    duality_gap: torch.Tensor
    error_bound: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor


def factor_gram(gram: torch.Tensor) -> torch.Tensor:
    r"""Return :math:`A = Q\Gamma^{1/2}` with :math:`AA^\top = G` for each Gram matrix in ``(g, n, n)``.

    Eigenvalues below ``n * eps * max_eigenvalue`` (rounding noise of a rank-deficient :math:`G`, e.g.
    duplicate templates) are treated as exact zeros; the corresponding columns of :math:`A` are zero.
    """
    gram = 0.5 * (gram + gram.transpose(-1, -2))
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    n = gram.shape[-1]
    top = eigenvalues.abs().amax(dim=-1, keepdim=True)
    floor = n * torch.finfo(gram.dtype).eps * top
    kept = torch.where(eigenvalues > floor, eigenvalues, torch.zeros_like(eigenvalues))
    return eigenvectors * kept.sqrt().unsqueeze(-2)


def _log_softmax_normalised(log_preference: torch.Tensor) -> torch.Tensor:
    """Normalise log u over the last axis so that sum_i u_i = 1 (``-inf`` entries stay ``-inf``)."""
    return log_preference - torch.logsumexp(log_preference, dim=-1, keepdim=True)


def duality_gap_reduced(gradient: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""Duality gap :math:`P(p(y)) - D(y) = \tfrac{\alpha}{2}\|g(y)\|^2` (closed form).

    Derivation: with :math:`\theta = \log u + \alpha s + Ay`, :math:`p = \mathrm{softmax}(\theta)` and
    :math:`KL(p\|u) = p^\top(\alpha s + Ay) - \mathrm{LSE}(\theta)`, the primal at :math:`p` is
    :math:`\tfrac{\alpha}{2}(\|z\|^2 + 2s^\top(u-p) + \|A^\top(u-p)\|^2) + KL(p\|u)`.  Subtracting
    (R-D), the :math:`\|z\|^2`, :math:`s^\top p` and LSE terms cancel and what is left is
    :math:`\tfrac{\alpha}{2}\|A^\top(u-p)\|^2 - y^\top A^\top(u-p) + \|y\|^2/(2\alpha)
    = \tfrac{1}{2\alpha}\|\alpha A^\top(u-p) - y\|^2 = \tfrac{\alpha}{2}\|g\|^2`.
    Computed as a squared norm it is non-negative and free of cancellation.
    """
    return 0.5 * alpha * (gradient * gradient).sum(-1)


class _Group:
    """Quantities of one tile of problems that stay fixed during the Newton iterations."""

    def __init__(self, factor, logits, log_pref, alpha, direction_dtype):
        self.A = factor  # (g, n, r), shared by the m problems of each group
        self.A_sq = factor * factor  # for the Jacobi preconditioner
        self.A_low = factor.to(direction_dtype)  # the Newton direction's precision (CG only)
        self.alpha = alpha
        self.base = log_pref + alpha * logits  # log u + alpha s   (-inf off the support)
        self.u = log_pref.exp()  # log_pref is normalised
        self.m = torch.bmm(self.u, factor)  # m = A^T u, as rows: (g, m, r)

    def times_A_T(self, y):
        """Rows of A y: (g, m, r) -> (g, m, n)."""
        return torch.bmm(y, self.A.transpose(1, 2))

    def times_A(self, w):
        """Rows of A^T w: (g, m, n) -> (g, m, r)."""
        return torch.bmm(w, self.A)

    def state(self, y):
        r"""Return (p, objective without constant, :math:`A^\top(u - p)`) at y.

        :math:`A^\top(u-p)` is formed from the difference :math:`u - p`, not as :math:`m - A^\top p`:
        near the optimum the two terms nearly cancel, and the subtraction would cost digits of the
        gradient (and so of the certificate) for problems whose :math:`\lambda^*` is small.
        """
        theta = self.base + self.times_A_T(y)
        lse = torch.logsumexp(theta, dim=-1)
        p = torch.exp(theta - lse.unsqueeze(-1))
        return p, self._objective(y, lse), self.times_A(self.u - p)

    def objective(self, y):
        r"""(R-D) at y, without its constant :math:`\alpha s^\top u + \tfrac{\alpha}{2}\|z\|^2`."""
        return self._objective(y, torch.logsumexp(self.base + self.times_A_T(y), dim=-1))

    def _objective(self, y, lse):
        return (y * self.m).sum(-1) - (y * y).sum(-1) / (2 * self.alpha) - lse

    def hessian_times(self, p, v):
        r"""Rows of :math:`(I/\alpha + A^\top(\mathrm{diag}\,p - pp^\top)A)\,v` (the negated Hessian),
        in the Newton direction's precision (``p`` and ``v`` must be in it)."""
        w = torch.bmm(v, self.A_low.transpose(1, 2))
        sigma_w = p * (w - (p * w).sum(-1, keepdim=True))
        return torch.baddbmm(v, sigma_w, self.A_low, beta=1.0 / self.alpha)

    def hessian_diagonal(self, p, spread):
        """Diagonal of the negated Hessian, used as the CG preconditioner (``spread`` = A^T(u - p))."""
        a_p = self.m - spread  # A^T p
        return 1.0 / self.alpha + torch.bmm(p, self.A_sq) - a_p * a_p


def _conjugate_gradient(group, p, rhs, precond, rtol, max_iter, live):
    """Batched preconditioned CG for (negated Hessian) x = rhs, stopping each problem at its rtol.

    Runs in the group's direction precision and returns x in the precision of ``rhs``.
    """
    out_dtype = rhs.dtype
    low = group.A_low.dtype
    p, rhs, precond, rtol = p.to(low), rhs.to(low), precond.to(low), rtol.to(low)
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = r / precond
    d = z.clone()
    rz = (r * z).sum(-1)
    target = (rtol * rhs.norm(dim=-1)) ** 2
    running = live & ((r * r).sum(-1) > target)
    for _ in range(max_iter):
        if not bool(running.any()):
            break
        x, r, d, rz, running = _cg_step(group, p, precond, target, x, r, d, rz, running)
    return x.to(out_dtype)


def _cg_step(group, p, precond, target, x, r, d, rz, running):
    """One preconditioned CG step for the rows still ``running``: returns the new (x, r, d, rz, running);
    a row whose squared residual reaches ``target`` stops."""
    hd = group.hessian_times(p, d)
    curvature = (d * hd).sum(-1)
    step = torch.where(running, rz / torch.where(curvature > 0, curvature, 1.0), 0.0)
    x = x + step.unsqueeze(-1) * d
    r = r - step.unsqueeze(-1) * hd
    z = r / precond
    rz_new = (r * z).sum(-1)
    beta = torch.where(running, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)
    d = torch.where(running.unsqueeze(-1), z + beta.unsqueeze(-1) * d, d)
    rz = torch.where(running, rz_new, rz)
    running = running & ((r * r).sum(-1) > target)
    return x, r, d, rz, running


def _solve_tile(factor, logits, log_pref, evidence_sqnorm, active, alpha, rtol, atol, max_iter, direction_dtype):
    """Newton-CG on every active problem of a tile; returns its :class:`DualSolution`.

    Problems finish after different numbers of Newton iterations.  Once the live problems fit in a
    working set below ``_COMPACT_BELOW`` of the current one, they are gathered into it (the groups
    that still have one, each with its live rows packed to the front; the Gram factor stays shared per
    group) and iterated there, so stragglers do not pay for the finished.

    All operations are row-wise, so a problem's iterates do not depend on the rest of the batch, up to
    the rounding of the batched products (which may group their sums differently for other shapes).
    With a float64 direction that rounding stays at 1e-16; with a float32 direction it perturbs the
    Newton steps, and the final iterates of the same problem in two batches agree within their
    certificates (not bit for bit).
    """
    g_count, m, _ = logits.shape
    r = factor.shape[-1]
    device = factor.device
    y = torch.zeros(g_count, m, r, dtype=factor.dtype, device=device)
    iterations = torch.zeros(g_count, m, dtype=torch.int32, device=device)
    groups = torch.arange(g_count, device=device)  # working set: rows[k, j] of group groups[k]
    rows = torch.arange(m, device=device).expand(g_count, m)
    live = active.clone()
    initial_norm = None
    remaining = max_iter
    while True:
        pick = (groups.unsqueeze(-1), rows)
        work = _Group(factor[groups], logits[pick], log_pref[pick], alpha, direction_dtype)
        y_work, iterations_work, live, initial_norm, remaining = _newton(
            work, logits[pick], evidence_sqnorm[pick], y[pick], iterations[pick], live, initial_norm, alpha,
            rtol, atol, remaining,
        )
        y[pick] = y_work  # rows that were not live come back unchanged
        iterations[pick] = iterations_work
        if remaining == 0 or not bool(live.any()):
            break
        # gather the live problems: groups that have one, live rows first
        per_group = live.sum(-1)
        keep = per_group.nonzero().squeeze(-1)
        width = int(per_group.max())
        order = torch.argsort((~live[keep]).to(torch.int8), dim=-1, stable=True)[:, :width]
        groups, rows = groups[keep], rows[keep].gather(1, order)
        live, initial_norm = live[keep].gather(1, order), initial_norm[keep].gather(1, order)

    group = _Group(factor, logits, log_pref, alpha, direction_dtype)
    p, _, spread = group.state(y)
    return _finish(group, logits, evidence_sqnorm, active, alpha, rtol, atol, y, p, spread, iterations)


_COMPACT_BELOW = 0.5  # gather the live problems once they fit in this fraction of the working set


def _newton(group, logits, evidence_sqnorm, y, iterations, live, initial_norm, alpha, rtol, atol, max_iter):
    """Newton iterations with Armijo backtracking on (R-D), for the problems of one working set.

    Returns ``(y, iterations, live, initial_norm, remaining)``: it stops when no problem is live, after
    ``max_iter`` iterations (``remaining`` = 0), or when the live problems would fit in a working set
    below ``_COMPACT_BELOW`` of this one (the caller compacts and calls again, carrying
    ``initial_norm`` for the forcing term).
    """
    dtype = y.dtype
    g_count, m, r = y.shape
    p, objective, spread = group.state(y)
    gradient = spread - y / alpha
    if initial_norm is None:
        initial_norm = gradient.norm(dim=-1).clamp_min(torch.finfo(dtype).tiny)
    cg_cap = max(10, 2 * r)
    # a float32 direction cannot resolve CG residuals much below its precision
    forcing_floor = max(1e-12, 8 * torch.finfo(group.A_low.dtype).eps)
    for done in range(max_iter):
        error = alpha * gradient.norm(dim=-1)  # >= ||lambda(y) - lambda*||
        lam = _lambda_norm(logits, evidence_sqnorm, group.u - p, spread, alpha)
        live = live & (2 * error > 0.25 * (rtol * lam + atol))  # stop well inside the tolerance
        per_group = live.sum(-1)
        if int((per_group > 0).sum()) * int(per_group.max()) <= _COMPACT_BELOW * g_count * m:
            return y, iterations, live, initial_norm, max_iter - done  # no live problem, or compact
        # Inexact Newton: CG to relative residual min(0.1, ||g||/||g0||), floored at the direction's
        # precision (superlinear convergence, then linear at rate ~1e-6 for a float32 direction; a
        # looser forcing term stalls on near-hard-max instances with logits ~1e4).  The gradient, the
        # line search and the certificate stay in the solver's dtype.
        forcing = torch.clamp(gradient.norm(dim=-1) / initial_norm, max=0.1).clamp_min(forcing_floor)
        precond = group.hessian_diagonal(p, spread)
        direction = _conjugate_gradient(group, p, gradient, precond, forcing, cg_cap, live)
        slope = (gradient * direction).sum(-1)  # > 0: CG from 0 on an SPD system gives ascent
        step = torch.ones(g_count, m, dtype=dtype, device=y.device)
        # Below this predicted increase the objective cannot resolve progress: the rounding floor.
        floor = 64 * torch.finfo(dtype).eps * (objective.abs() + 1)
        searching = live.clone()
        at_floor = torch.zeros_like(live)
        candidate = y
        for _ in range(60):  # Armijo backtracking on the dual objective
            trial = y + step.unsqueeze(-1) * direction
            value = group.objective(trial)
            tiny = (step == 1) & (slope <= floor)  # a full Newton step too small to measure
            accepted = ((value >= objective + 1e-4 * step * slope) | tiny) & torch.isfinite(value)
            take = searching & accepted
            candidate = torch.where(take.unsqueeze(-1), trial, candidate)
            at_floor = at_floor | (take & tiny)
            searching = searching & ~accepted
            if not bool(searching.any()):
                break
            step = torch.where(searching, 0.5 * step, step)
        y = torch.where((live & ~searching).unsqueeze(-1), candidate, y)
        iterations = iterations + live.to(torch.int32)
        previous_norm = gradient.norm(dim=-1)
        p, objective, spread = group.state(y)
        gradient = spread - y / alpha
        # Near the optimum the objective cannot resolve the gain of a Newton step (it is below its
        # rounding), but the gradient still can: such steps are taken in full while they shrink the
        # gradient.  A problem stops when they no longer do, or when no acceptable step exists; whether
        # it converged is then decided by the certificate alone.
        stalled = at_floor & (gradient.norm(dim=-1) > 0.5 * previous_norm)
        live = live & ~searching & ~stalled
    return y, iterations, live, initial_norm, 0


def _lambda_norm(logits, evidence_sqnorm, u_minus_p, spread, alpha):
    r""":math:`\|\hat\lambda\| = \alpha\|z + T^\top(u-p)\|`, expanded in reduced quantities
    (:math:`\|z\|^2 + 2 s^\top(u-p) + \|A^\top(u-p)\|^2`)."""
    sq = evidence_sqnorm + 2 * (logits * u_minus_p).sum(-1) + (spread * spread).sum(-1)
    return alpha * sq.clamp_min(0).sqrt()


def _finish(group, logits, evidence_sqnorm, active, alpha, rtol, atol, y, p, spread, iterations):
    gradient = spread - y / alpha
    gap = duality_gap_reduced(gradient, alpha)
    error_bound = 2 * alpha * gradient.norm(dim=-1)
    deviation = alpha * spread.norm(dim=-1)  # ||lambda_hat - alpha z|| = alpha ||A^T (u - p)||
    lambda_norm = _lambda_norm(logits, evidence_sqnorm, group.u - p, spread, alpha)
    rel_deviation = deviation / lambda_norm
    converged = active & torch.isfinite(error_bound) & (error_bound <= rtol * lambda_norm + atol)
    nan = torch.tensor(float("nan"), dtype=y.dtype, device=y.device)
    inactive = ~active

    def mask(x):
        return torch.where(inactive if x.dim() == 2 else inactive.unsqueeze(-1), nan, x)

    return DualSolution(
        coefficients=mask(alpha * (group.u - p)),
        attention=mask(p),
        rel_deviation=mask(rel_deviation),
        lambda_norm=mask(lambda_norm),
        duality_gap=mask(gap),
        error_bound=mask(error_bound),
        iterations=torch.where(inactive, torch.zeros_like(iterations), iterations),
        converged=converged,
    )


def solve_dual(
    problems: DualProblems,
    *,
    rtol: float = 1e-9,
    atol: float = 1e-12,
    max_iter: int = 100,
    dtype: torch.dtype = torch.float64,
    direction_dtype: torch.dtype = torch.float32,
    memory_budget_bytes: int = 1 << 29,
) -> DualSolution:
    r"""Solve every dual problem in ``problems`` (eq. (D) of the module docstring, reduced to (R-D)).

    Runs on the device of ``problems.gram`` in ``dtype`` (float64 by default).  Problems are processed
    in tiles of whole groups (or slices of a group) sized so that the working set stays within
    ``memory_budget_bytes``.

    The Newton directions (the conjugate-gradient solves, most of the work) are computed in
    ``direction_dtype``; the gradient, the line search and the certificate stay in ``dtype``, so a
    float32 direction (the default, about 1.5x faster) changes how a problem gets to its answer but
    not what is certified about it.  Pass ``direction_dtype=torch.float64`` for answers that do not
    depend on the rest of the batch beyond 1e-16 rounding.

    Returns a :class:`DualSolution`.  ``converged`` is true only where the certified error bound on
    :math:`\hat\lambda` is at most ``rtol * lambda_norm + atol``.
    """
    if problems.alpha <= 0:
        raise ValueError(f"alpha must be positive, got {problems.alpha}")
    if not (dtype.is_floating_point and direction_dtype.is_floating_point):
        raise ValueError(f"dtype and direction_dtype must be floating point, got {dtype} and {direction_dtype}")
    gram = problems.gram.to(dtype)
    device = gram.device
    logits = problems.logits.to(device=device, dtype=dtype)
    log_pref = problems.log_preference.to(device=device, dtype=dtype)
    evidence_sqnorm = problems.evidence_sqnorm.to(device=device, dtype=dtype)
    n_groups, m, n = logits.shape
    if gram.shape != (n_groups, n, n) or log_pref.shape != logits.shape or evidence_sqnorm.shape != (n_groups, m):
        raise ValueError(
            f"inconsistent shapes: gram {tuple(gram.shape)}, logits {tuple(logits.shape)}, "
            f"log_preference {tuple(log_pref.shape)}, evidence_sqnorm {tuple(evidence_sqnorm.shape)}"
        )
    if m == 0 or n_groups == 0 or n == 0:
        return _empty_solution(n_groups, m, n, dtype, device)
    active = problems.active
    active = torch.ones(n_groups, m, dtype=torch.bool, device=device) if active is None else active.to(device)
    active = active & torch.isfinite(log_pref).any(-1)  # a problem needs at least one key
    # Inactive rows get a harmless uniform problem so that no NaN enters the batched products.
    log_pref = torch.where(active.unsqueeze(-1), log_pref, torch.zeros_like(log_pref))
    logits = torch.where(active.unsqueeze(-1), logits, torch.zeros_like(logits))
    evidence_sqnorm = torch.where(active, evidence_sqnorm, torch.ones_like(evidence_sqnorm))
    log_pref = _log_softmax_normalised(log_pref)

    factor = factor_gram(gram)

    # About 24 live (m, n)-sized tensors per problem slice during CG and line search.
    bytes_per_row = 24 * n * torch.finfo(dtype).bits // 8
    rows_per_tile = max(1, memory_budget_bytes // max(1, bytes_per_row))
    if rows_per_tile >= m:
        groups_per_tile = max(1, rows_per_tile // m)
        tiles = [(g, min(g + groups_per_tile, n_groups), 0, m) for g in range(0, n_groups, groups_per_tile)]
    else:
        tiles = [(g, g + 1, j, min(j + rows_per_tile, m)) for g in range(n_groups) for j in range(0, m, rows_per_tile)]
    parts = []
    for g0, g1, j0, j1 in tiles:
        part = _solve_tile(
            factor[g0:g1], logits[g0:g1, j0:j1], log_pref[g0:g1, j0:j1], evidence_sqnorm[g0:g1, j0:j1],
            active[g0:g1, j0:j1], problems.alpha, rtol, atol, max_iter, direction_dtype,
        )
        parts.append(((g0, g1, j0, j1), part))
    if len(parts) == 1:
        return parts[0][1]
    return _assemble(parts, n_groups, m, n, dtype, device)


def _empty_solution(n_groups, m, n, dtype, device):
    def full(shape, value, kind=dtype):
        return torch.full(shape, value, dtype=kind, device=device)

    return DualSolution(
        coefficients=full((n_groups, m, n), float("nan")),
        attention=full((n_groups, m, n), float("nan")),
        rel_deviation=full((n_groups, m), float("nan")),
        lambda_norm=full((n_groups, m), float("nan")),
        duality_gap=full((n_groups, m), float("nan")),
        error_bound=full((n_groups, m), float("nan")),
        iterations=full((n_groups, m), 0, torch.int32),
        converged=full((n_groups, m), False, torch.bool),
    )


def _assemble(parts, n_groups, m, n, dtype, device):
    fields = {}
    for name in DualSolution.__dataclass_fields__:
        sample = getattr(parts[0][1], name)
        shape = (n_groups, m, n) if sample.dim() == 3 else (n_groups, m)
        fields[name] = torch.empty(shape, dtype=sample.dtype, device=device)
    for (g0, g1, j0, j1), part in parts:
        for name, out in fields.items():
            out[g0:g1, j0:j1] = getattr(part, name)
    return DualSolution(**fields)
