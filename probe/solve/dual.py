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

The quantities derived from a solution (the second-order prediction, attention and output deviations)
and their certificates, which follow from this one, are in :mod:`probe.solve.derived`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from probe.solve import native
from probe.solve.parallel import cpu_workers, run_all, without_gil

__all__ = ["DualProblems", "DualSolution", "solve_dual", "duality_gap_reduced", "factor_gram", "solve_spd_reduced"]


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
        factor: :math:`A` with :math:`AA^\top = G` from :func:`factor_gram`, ``(n_groups, n, r)``, when
            the caller has it (it depends on :math:`G` only, so one factorisation serves every alpha);
            ``None``: computed here.
    """

    gram: torch.Tensor
    logits: torch.Tensor
    log_preference: torch.Tensor
    evidence_sqnorm: torch.Tensor
    alpha: float = 1.0
    active: torch.Tensor | None = None
    factor: torch.Tensor | None = None


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


class _WorkingSet:
    r"""Quantities of a set of problems that stay fixed during the Newton iterations.

    Groups share the factor :math:`A` ``(g, n, r)``; their problems are rows ``(g, m, n)``.
    """

    def __init__(self, factor, factor_low, logits, base, u, evidence_sqnorm, alpha):
        self.A = factor
        self.A_low = factor_low  # in the Newton direction's precision
        self.alpha = alpha
        self.logits = logits
        self.evidence_sqnorm = evidence_sqnorm
        self.base = base  # log u + alpha s   (-inf off the support)
        self.u = u
        if shares_rows(u):  # rows that share u share m
            self.m = torch.bmm(u[:, :1], factor).expand(*u.shape[:2], factor.shape[-1])
        else:
            self.m = torch.bmm(u, factor)  # m = A^T u, as rows (g, m, r)

    def subset(self, groups, pick):
        """The working set of rows ``pick = (group index, row index)`` of the groups ``groups``."""
        out = _WorkingSet.__new__(_WorkingSet)
        out.A, out.A_low, out.alpha = self.A[groups], self.A_low[groups], self.alpha
        out.logits, out.evidence_sqnorm = self.logits[pick], self.evidence_sqnorm[pick]
        out.base, out.u, out.m = self.base[pick], self.u[pick], self.m[pick]
        return out

    def initial_state(self):
        r"""The state at :math:`y = 0` (:math:`\lambda = \alpha z`, where :math:`p` is the model's attention)."""
        y = self.m.new_zeros(self.m.shape)
        p, lse = _softmax_and_lse(self.base)
        return self.state_from(y, self.base, p, lse)

    def state(self, y):
        """The :class:`_State` at ``y``."""
        theta = torch.baddbmm(self.base, y, self.A.transpose(1, 2))  # log u + alpha s + A y
        p, lse = _softmax_and_lse(theta)
        return self.state_from(y, theta, p, lse)

    def state_from(self, y, theta, p, lse):
        r"""The state at ``y`` given :math:`\theta = \log u + \alpha s + Ay` and its softmax and log-sum-exp.

        :math:`A^\top(u-p)` is formed from the difference :math:`u - p`, not as :math:`m - A^\top p`:
        near the optimum the two terms nearly cancel, and the subtraction would cost digits of the
        gradient (and so of the certificate) for problems whose :math:`\lambda^*` is small.
        """
        terms = _state_terms(self.A, self.m, self.u, self.logits, self.evidence_sqnorm, float(self.alpha), y, p, lse)
        return _State(y, theta, p, *terms)


def shares_rows(rows: torch.Tensor) -> bool:
    """Whether every row of each group of ``(g, m, n)`` is the group's first by construction: a view whose
    rows have stride 0, as an expanded preference is (then computed once per group)."""
    return rows.dim() == 3 and rows.shape[1] > 1 and rows.stride(1) == 0


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise inner products ``(..., k), (..., k) -> (...)``, as a batch of ``1 x k`` by ``k x 1`` matrix
    products: on a CPU four to five times faster than ``torch.linalg.vecdot``, which forms the
    elementwise product in a fresh tensor and then sums it (0.13 to 0.15 ms against 0.66 ms for
    768 x 128 float64 rows, measured on the 2-core machine of bench/NOTES.md)."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1).squeeze(-1)


def _state_terms_python(
    A: torch.Tensor, m: torch.Tensor, u: torch.Tensor, logits: torch.Tensor, evidence_sqnorm: torch.Tensor,
    alpha: float, y: torch.Tensor, p: torch.Tensor, lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The fields of :class:`_State` after ``(y, theta, p)`` at ``y`` (:meth:`_WorkingSet.state_from`).
    Written in the TorchScript subset: :data:`_state_terms` is this function compiled."""
    u_minus_p = u - p
    spread = torch.bmm(u_minus_p, A)  # A^T (u - p)
    gradient = spread - y / alpha
    y_dot_m = row_dot(y, m)
    y_sq = row_dot(y, y)
    # ||lambda_hat|| = alpha ||z + T^T (u - p)||, expanded in reduced quantities
    spread_sq = row_dot(spread, spread)
    lambda_sq = evidence_sqnorm + 2 * row_dot(logits, u_minus_p) + spread_sq
    return (
        gradient, row_dot(gradient, gradient), y_dot_m - y_sq / (2 * alpha) - lse, y_dot_m, y_sq,
        alpha * lambda_sq.clamp_min(0).sqrt(), alpha * spread_sq.sqrt(),
    )


#: :func:`_state_terms_python`, compiled so that it runs without the GIL (identical results)
_state_terms = without_gil(_state_terms_python)


def _softmax_and_lse(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(theta), logsumexp(theta))`` over the last axis."""
    top = theta.amax(dim=-1, keepdim=True)
    p = torch.sub(theta, top).exp_()
    total = p.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)
    return p.div_(total), lse


@dataclass
class _State:
    r"""Newton's state at :math:`y`: :math:`\theta = \log u + \alpha s + Ay`, :math:`p = p(y)`, the gradient
    :math:`g` of (R-D), the objective (R-D) without its constant and the inner products the line search
    reuses, :math:`\|\hat\lambda\|` and :math:`\|\hat\lambda - \alpha z\| = \alpha\|A^\top(u-p)\|`."""

    y: torch.Tensor
    theta: torch.Tensor
    p: torch.Tensor
    gradient: torch.Tensor
    gradient_sq: torch.Tensor
    objective: torch.Tensor
    y_dot_m: torch.Tensor
    y_sq: torch.Tensor
    lambda_norm: torch.Tensor
    deviation: torch.Tensor


def _hessian_times(factor, alpha, p, v):
    r"""Rows of :math:`Hv = v/\alpha + A^\top \Sigma_p A v`, the negated Hessian of (R-D) at :math:`p`,
    with :math:`\Sigma_p = \mathrm{diag}\,p - pp^\top` (two products with the group's :math:`A`)."""
    return _hessian_times_into(factor, alpha, p, v, torch.empty_like(v), torch.empty_like(p))


def _hessian_times_into(
    factor: torch.Tensor, alpha: float, p: torch.Tensor, v: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor
) -> torch.Tensor:
    """:func:`_hessian_times` into ``out``, with ``buffer`` (shaped like ``p``) for :math:`Av`."""
    Av = torch.bmm(v, factor.transpose(1, 2), out=buffer)
    Av.sub_(row_dot(p, Av).unsqueeze(-1)).mul_(p)  # Sigma_p A v
    return torch.baddbmm(v, Av, factor, beta=1.0 / alpha, out=out)


def _conjugate_gradient_steps(
    factor: torch.Tensor, alpha: float, p: torch.Tensor, rhs: torch.Tensor, forcing: torch.Tensor, max_iter: int,
    live: torch.Tensor, precond: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Batched CG on :math:`H x = b` (:func:`_hessian_times`), each row stopping when its residual's norm
    reaches ``forcing`` times its right-hand side's; rows not ``live`` return 0.

    For the Newton directions there is no preconditioner: a Jacobi one did not reduce the step count on
    MiniLM's problems (their Hessians have condition numbers of 3 to 5) and costs a pass per step.
    ``p``, ``rhs`` (overwritten) and ``precond`` (the diagonal, or None) are in ``factor``'s precision,
    which is that of the result.  Written in the TorchScript subset: :data:`_conjugate_gradient` is
    this function compiled (:func:`probe.solve.parallel.without_gil`).
    """
    x = torch.zeros_like(rhs)
    r = rhs
    z = r if precond is None else r / precond
    d = z.clone()
    Ad = torch.empty_like(p)
    Hd = torch.empty_like(r)
    rz = row_dot(r, z)
    target = forcing.to(rz.dtype).square() * row_dot(r, r)
    running = live & (row_dot(r, r) > target)
    for _ in range(max_iter):
        if not bool(running.any()):
            break
        _hessian_times_into(factor, alpha, p, d, Hd, Ad)
        curvature = row_dot(d, Hd)
        step = torch.where(running, rz / torch.where(curvature > 0, curvature, 1.0), 0.0).unsqueeze(-1)
        x.addcmul_(step, d)
        r.addcmul_(step, Hd, value=-1.0)
        if precond is None:
            z = r
            rz_new = row_dot(r, r)
            running = running & (rz_new > target)
        else:
            z = torch.div(r, precond, out=z)
            rz_new = row_dot(r, z)
            running = running & (row_dot(r, r) > target)
        beta = torch.where(running, rz_new / torch.where(rz > 0, rz, 1.0), 0.0).unsqueeze(-1)
        torch.addcmul(z, beta, d, out=d)  # a row that stopped gets d = z: bounded, and never used again
        rz = rz_new
    return x


#: :func:`_conjugate_gradient_steps`, compiled so that its loop runs without the GIL (the same operations
#: in the same order: identical results)
_conjugate_gradient = without_gil(_conjugate_gradient_steps)


_COMPACT_BELOW = 0.5  # gather the live problems once they fit in this fraction of the working set


def _forcing(gradient_norm, initial_norm, goal, floor):
    r"""Relative CG residual for the Newton direction: :math:`\min(0.1, (\|g\|/\|g_0\|)^2)`
    (superlinear convergence), loosened near the end to what still reaches the goal
    (:math:`\tfrac12\,\mathrm{goal}/\|g\|`), and floored at the direction's precision (a float32
    direction cannot resolve residuals much below 1e-6; Newton then converges linearly, at that rate)."""
    ratio = gradient_norm / initial_norm
    return torch.maximum(ratio * ratio, 0.5 * goal / gradient_norm).clamp(min=floor, max=0.1)


def _forcing_floor(direction_dtype: torch.dtype) -> float:
    """The smallest relative CG residual asked of a Newton direction in ``direction_dtype``."""
    return max(1e-12, 8 * torch.finfo(direction_dtype).eps)


def _newton_step_python(
    A: torch.Tensor, A_low: torch.Tensor, m: torch.Tensor, alpha: float, y: torch.Tensor, theta: torch.Tensor,
    p_low: torch.Tensor, gradient: torch.Tensor, gradient_low: torch.Tensor, objective: torch.Tensor,
    y_dot_m: torch.Tensor, y_sq: torch.Tensor, forcing: torch.Tensor, cg_cap: int, live: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""One inexact Newton step on (R-D) for the ``live`` rows, with Armijo backtracking on the objective.

    The direction solves :math:`H\,dy = g` by CG in ``A_low``'s precision (``p_low``, ``gradient_low``:
    :math:`p` and :math:`g` in it, the latter overwritten) to relative residual ``forcing``; everything
    else is in the solver's dtype, whose machine epsilon is ``eps``.  Returns ``(y, theta, p, lse,
    searching, at_floor)``: the new point with :math:`\theta = \log u + \alpha s + Ay` and its softmax and
    log-sum-exp, the rows for which no acceptable step was found (they stay where they were) and those
    whose full step was below the objective's rounding (taken; see :func:`_newton`).  Written in the
    TorchScript subset: :data:`_newton_step` is this function compiled (:func:`probe.solve.parallel.without_gil`).
    """
    direction = _conjugate_gradient_steps(A_low, alpha, p_low, gradient_low, forcing, cg_cap, live, None).to(y.dtype)
    a_direction = torch.bmm(direction, A.transpose(1, 2))  # A dy
    slope = row_dot(gradient, direction)  # > 0: CG from 0 on an SPD system ascends
    # (R-D) along the step: y^T m and ||y||^2 are polynomials in t, only the log-sum-exp needs a pass
    dir_dot_m = row_dot(direction, m)
    y_dot_dir = row_dot(y, direction)
    dir_sq = row_dot(direction, direction)
    step = torch.ones_like(objective)
    taken = torch.zeros_like(step)
    # Below this predicted increase the objective cannot resolve progress: the rounding floor.
    floor = 64 * eps * (objective.abs() + 1)
    tiny = slope <= floor  # a full Newton step too small to measure (only ever taken in full)
    searching = live.clone()
    at_floor = torch.zeros_like(live)
    full_theta = torch.addcmul(theta, step.unsqueeze(-1), a_direction)
    full_p, full_lse = _softmax_and_lse(full_theta)
    trial_lse = full_lse
    for trial in range(60):  # Armijo backtracking on the dual objective
        if trial > 0:
            trial_lse = _softmax_and_lse(torch.addcmul(theta, step.unsqueeze(-1), a_direction))[1]
        value = y_dot_m + step * dir_dot_m - (y_sq + step * (2 * y_dot_dir + step * dir_sq)) / (2 * alpha) - trial_lse
        first = tiny & (step == 1)
        accepted = ((value >= objective + 1e-4 * step * slope) | first) & torch.isfinite(value)
        take = searching & accepted
        taken = torch.where(take, step, taken)
        at_floor = at_floor | (take & first)
        searching = searching & ~accepted
        if not bool(searching.any()):
            break
        step = torch.where(searching, 0.5 * step, step)
    moved = live & ~searching
    taken = torch.where(moved, taken, 0.0)
    y = torch.addcmul(y, taken.unsqueeze(-1), direction)
    # every live row took the full step (rows not live have a zero direction): reuse its softmax
    if bool((moved | ~live).all()) and bool((taken[moved] == 1).all()):
        return y, full_theta, full_p, full_lse, searching, at_floor
    theta = torch.addcmul(theta, taken.unsqueeze(-1), a_direction)
    p, lse = _softmax_and_lse(theta)
    return y, theta, p, lse, searching, at_floor


#: :func:`_newton_step_python`, compiled so that it runs without the GIL (identical results)
_newton_step = without_gil(_newton_step_python)

#: the solver's compiled loops by name, with the names of the Python functions they are compiled from
#: (tests and ``bench/parallel.py`` run those instead, to compare)
COMPILED_LOOPS = {
    "_conjugate_gradient": "_conjugate_gradient_steps",
    "_newton_step": "_newton_step_python",
    "_state_terms": "_state_terms_python",
}


def _newton(work, state, iterations, live, initial_norm, rtol, atol, max_iter):
    """Newton iterations with Armijo backtracking on (R-D), for the problems of one working set.

    Returns ``(state, iterations, live, initial_norm, remaining)``: it stops when no problem is live,
    after ``max_iter`` iterations (``remaining`` = 0), or when the live problems would fit in a working
    set below ``_COMPACT_BELOW`` of this one (the caller compacts and calls again, carrying
    ``initial_norm`` for the forcing term).
    """
    alpha = work.alpha
    dtype = state.y.dtype
    low = work.A_low.dtype
    g_count, m, _ = state.p.shape
    gradient_norm = state.gradient_sq.sqrt()
    if initial_norm is None:
        initial_norm = gradient_norm.clamp_min(torch.finfo(dtype).tiny)
    cg_cap = max(10, 2 * work.A.shape[-1])
    forcing_floor = _forcing_floor(low)
    for done in range(max_iter):
        # stop well inside the tolerance: 2 alpha ||g|| <= 0.25 (rtol ||lambda|| + atol)
        goal = 0.25 * (rtol * state.lambda_norm + atol) / (2 * alpha)
        live = live & (gradient_norm > goal)
        per_group = live.sum(-1)
        if int((per_group > 0).sum()) * int(per_group.max()) <= _COMPACT_BELOW * g_count * m:
            return state, iterations, live, initial_norm, max_iter - done  # no live problem, or compact
        # Inexact Newton; the gradient, the line search and the certificate stay in the solver's dtype.
        forcing = _forcing(gradient_norm, initial_norm, goal, forcing_floor)
        y, theta, p, lse, searching, at_floor = _newton_step(
            work.A, work.A_low, work.m, float(alpha), state.y, state.theta, state.p.to(low),
            state.gradient, state.gradient.to(low, copy=True), state.objective, state.y_dot_m, state.y_sq,
            forcing, cg_cap, live, torch.finfo(dtype).eps,
        )
        iterations = iterations + live.to(torch.int32)
        previous_norm = gradient_norm
        state = work.state_from(y, theta, p, lse)
        gradient_norm = state.gradient_sq.sqrt()
        # Near the optimum the objective cannot resolve the gain of a Newton step (it is below its
        # rounding), but the gradient still can: such steps are taken in full while they shrink the
        # gradient.  A problem stops when they no longer do, or when no acceptable step exists; whether
        # it converged is then decided by the certificate alone.
        stalled = at_floor & (gradient_norm > 0.5 * previous_norm)
        live = live & ~searching & ~stalled
    return state, iterations, live, initial_norm, 0


def _solve_tile(work, active, rtol, atol, max_iter, out=None):
    """Newton-CG on every active problem of a tile; returns its :class:`DualSolution`, written into ``out``
    if given (views of the tile in the caller's output, which then needs no copy).

    On a CPU the iterations run in compiled C where it is available (:mod:`probe.solve.native`, the same method
    in blocks of rows that stay in cache); its iterates come back here, where their state and certificate
    are computed afresh and the iterations below go on for any problem not yet within its tolerance.
    Elsewhere (or without it) they all run below.

    Problems finish after different numbers of Newton iterations.  Once the live problems fit in a
    working set below ``_COMPACT_BELOW`` of the current one, they are gathered into it (the groups
    that still have one, each with its live rows packed to the front; the Gram matrix stays shared per
    group) and iterated there, so stragglers do not pay for the finished.

    All operations are row-wise, so a problem's iterates do not depend on the rest of the batch, up to
    the rounding of the batched products (which may group their sums differently for other shapes).
    With a float64 direction that rounding stays at 1e-16; with a float32 direction it perturbs the
    Newton steps, and the final iterates of the same problem in two batches agree within their
    certificates (not bit for bit).
    """
    g_count, m, _ = work.base.shape
    device = work.base.device
    iterations = torch.zeros(g_count, m, dtype=torch.int32, device=device)
    state = None
    compiled = native.newton_tile(work, active, rtol, atol, max_iter, _forcing_floor(work.A_low.dtype))
    if compiled is not None:  # the same method in C (probe.solve.native); state and certificate recomputed here
        y, iterations = compiled
        y = torch.where(torch.isfinite(y.sum(-1, keepdim=True)), y, 0.0)  # a row that went wrong restarts
        iterations = iterations.clamp(0, max_iter)
        state = work.state(y)
        max_iter -= int(iterations.max())
    state, iterations, live, initial_norm, remaining = _newton(
        work, work.initial_state() if state is None else state, iterations, active.clone(), None, rtol, atol,
        max_iter,
    )
    if out is None:
        out = _empty_solution(g_count, m, work.base.shape[-1], work.base.dtype, device)
    if remaining == 0 or not bool(live.any()):
        return _finish(work, state, active, rtol, atol, iterations, out)
    final, y = state, state.y
    groups = torch.arange(g_count, device=device)  # working set: rows[k, j] of group groups[k]
    rows = torch.arange(m, device=device).expand(g_count, m)
    while remaining > 0 and bool(live.any()):
        # gather the live problems: groups that have one, live rows first
        per_group = live.sum(-1)
        keep = per_group.nonzero().squeeze(-1)
        width = int(per_group.max())
        order = torch.argsort((~live[keep]).to(torch.int8), dim=-1, stable=True)[:, :width]
        groups, rows = groups[keep], rows[keep].gather(1, order)
        live, initial_norm = live[keep].gather(1, order), initial_norm[keep].gather(1, order)
        pick = (groups.unsqueeze(-1), rows)
        subset = work.subset(groups, pick)
        state, iterations_work, live, initial_norm, remaining = _newton(
            subset, subset.state(y[pick]), iterations[pick], live, initial_norm, rtol, atol, remaining
        )
        y[pick] = state.y  # rows that were not live come back unchanged
        iterations[pick] = iterations_work
        for name in ("p", "gradient", "gradient_sq", "lambda_norm", "deviation"):  # what _finish reads
            getattr(final, name)[pick] = getattr(state, name)
    return _finish(work, final, active, rtol, atol, iterations, out)


def _finish(work, state, active, rtol, atol, iterations, out):
    """The tile's :class:`DualSolution` from the final state (its certificate: module docstring), written
    into ``out`` (a :class:`DualSolution` of the tile's shape)."""
    alpha = work.alpha
    torch.mul(state.gradient_sq.sqrt(), 2 * alpha, out=out.error_bound)
    error_bound = out.error_bound
    torch.logical_and(active & torch.isfinite(error_bound), error_bound <= rtol * state.lambda_norm + atol,
                      out=out.converged)
    torch.sub(work.u, state.p, out=out.coefficients).mul_(alpha)
    out.attention.copy_(state.p)
    torch.div(state.deviation, state.lambda_norm, out=out.rel_deviation)
    # lambda = alpha z exactly: no deviation, also where both are 0 (zero templates and evidence: 0 / 0);
    # found by tests/capture/test_fuzz.py, where such a row came back certified with a NaN rel_deviation
    out.rel_deviation.masked_fill_(state.deviation == 0, 0.0)
    out.lambda_norm.copy_(state.lambda_norm)
    out.duality_gap.copy_(duality_gap_reduced(state.gradient, alpha))
    out.iterations.copy_(iterations)
    return out


#: tile size of :func:`solve_dual` per device type: on a CPU, small enough for a tile's working set to
#: stay in cache (the elementwise work is bound by memory traffic; bench/NOTES.md); on a GPU, large
#: enough to fill the device
TILE_BYTES = {"cpu": 1 << 24, "cuda": 1 << 29}

#: a call of at least twice this many problems is cut into an even number (at least 2) of equal tiles, so
#: that two workers share it evenly (three tiles on two workers left one idle for a third of the call)
_MIN_TILE_ROWS = 1024


def solve_dual(
    problems: DualProblems,
    *,
    rtol: float = 1e-9,
    atol: float = 1e-12,
    max_iter: int = 100,
    dtype: torch.dtype = torch.float64,
    direction_dtype: torch.dtype = torch.float32,
    memory_budget_bytes: int | None = None,
    workers: int | None = None,
) -> DualSolution:
    r"""Solve every dual problem in ``problems`` (eq. (D) of the module docstring, reduced to (R-D)).

    Runs on the device of ``problems.gram`` in ``dtype`` (float64 by default).  Problems are processed
    in tiles of whole groups (or slices of a group) whose working set stays within the device's
    :data:`TILE_BYTES` (on a CPU, about its cache) and within ``memory_budget_bytes`` when given.
    Beyond its inputs, the solver holds one tile's working set and its outputs.

    The Newton directions (the conjugate-gradient solves, most of the work) are computed in
    ``direction_dtype``; the gradient, the line search and the certificate stay in ``dtype``, so a
    float32 direction (the default, about 1.5x faster) changes how a problem gets to its answer but
    not what is certified about it.  Pass ``direction_dtype=torch.float64`` for answers that do not
    depend on the rest of the batch beyond 1e-16 rounding.

    On a CPU the tiles are solved ``workers`` at a time (default: the intra-op thread count), each by a
    thread of its own with one intra-op thread (:mod:`probe.solve.parallel`; ``workers=0``: one after another
    in this thread, each operation on all of torch's threads); the tiles, and so the answers, do not
    depend on ``workers``.  With a memory budget, fewer workers run when their tiles would not fit in
    it together.

    Returns a :class:`DualSolution`.  ``converged`` is true only where the certified error bound on
    :math:`\hat\lambda` is at most ``rtol * lambda_norm + atol``.
    """
    if problems.alpha <= 0:
        raise ValueError(f"alpha must be positive, got {problems.alpha}")
    if not (dtype.is_floating_point and direction_dtype.is_floating_point):
        raise ValueError(f"dtype and direction_dtype must be floating point, got {dtype} and {direction_dtype}")
    device = problems.gram.device
    n_groups, m, n = problems.logits.shape
    if (
        problems.gram.shape != (n_groups, n, n)
        or problems.log_preference.shape != problems.logits.shape
        or problems.evidence_sqnorm.shape != (n_groups, m)
    ):
        raise ValueError(
            f"inconsistent shapes: gram {tuple(problems.gram.shape)}, logits {tuple(problems.logits.shape)}, "
            f"log_preference {tuple(problems.log_preference.shape)}, "
            f"evidence_sqnorm {tuple(problems.evidence_sqnorm.shape)}"
        )
    out = _empty_solution(n_groups, m, n, dtype, device)
    if m == 0 or n_groups == 0 or n == 0:
        return out
    if problems.factor is None:
        factor = factor_gram(problems.gram.to(dtype))
    else:
        factor = problems.factor.to(device=device, dtype=dtype)
    kept = factor.abs().amax(dim=(0, 1)) > 0  # zero columns (a rank-deficient G in every group) do nothing
    if not bool(kept.all()):
        factor = factor[..., kept]
    factor_low = factor if direction_dtype == dtype else factor.to(direction_dtype)

    # About 16 (m, n)-sized tensors of the solver's dtype per problem slice are live at once.
    # The tiles depend on the shapes and the budget only, not on ``workers``: a problem's answer is the
    # same whichever number of threads solves the batch.
    tile_bytes = TILE_BYTES.get(device.type, TILE_BYTES["cuda"])
    if memory_budget_bytes is not None:
        tile_bytes = min(tile_bytes, memory_budget_bytes)
    bytes_per_row = 16 * n * torch.finfo(dtype).bits // 8
    rows_per_tile = max(1, tile_bytes // bytes_per_row)
    workers = cpu_workers(device) if workers is None else max(0, workers)
    if memory_budget_bytes is not None and workers > 1:  # each tile in flight holds its working set
        workers = max(1, min(workers, memory_budget_bytes // (min(rows_per_tile, m * n_groups) * bytes_per_row)))
    if rows_per_tile >= m:  # whole groups, in tiles of equal size
        count = -(-n_groups // max(1, rows_per_tile // m))
        if n_groups * m >= 2 * _MIN_TILE_ROWS:
            count = min(n_groups, max(2, count + count % 2))
        tiles = [(g0, g1, 0, m) for g0, g1 in _equal_parts(n_groups, count)]
    else:  # slices of one group, of equal size
        tiles = [(g, g + 1, j0, j1) for g in range(n_groups) for j0, j1 in _equal_parts(m, -(-m // rows_per_tile))]

    def solve(g0, g1, j0, j1):  # one tile, written into its own slice of ``out``
        logits, base, u, evidence_sqnorm, active = _tile_inputs(problems, g0, g1, j0, j1, dtype, device)
        work = _WorkingSet(factor[g0:g1], factor_low[g0:g1], logits, base, u, evidence_sqnorm, problems.alpha)
        tile = DualSolution(**{name: value[g0:g1, j0:j1] for name, value in vars(out).items()})
        _solve_tile(work, active, rtol, atol, max_iter, tile)
        inactive = ~active
        if bool(inactive.any()):
            for name, target in vars(tile).items():
                if name != "converged":  # inactive problems: NaN (iterations 0)
                    target[inactive] = 0 if name == "iterations" else float("nan")

    run_all([lambda tile=tile: solve(*tile) for tile in tiles], workers)
    return out


def _equal_parts(length: int, count: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``count`` consecutive parts of ``range(length)`` whose sizes differ by at most 1."""
    bounds = [round(i * length / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _tile_inputs(problems, g0, g1, j0, j1, dtype, device):
    r"""(logits, :math:`\log u + \alpha s`, :math:`u`, :math:`\|z\|^2`, active) of one tile in the
    solver's dtype, with :math:`u` normalised; inactive problems get a harmless uniform problem, so
    that no NaN enters the batched products."""
    alpha = problems.alpha
    logits = problems.logits[g0:g1, j0:j1].to(device=device, dtype=dtype)
    log_pref = problems.log_preference[g0:g1, j0:j1].to(device=device, dtype=dtype)
    evidence_sqnorm = problems.evidence_sqnorm[g0:g1, j0:j1].to(device=device, dtype=dtype)
    active = problems.active
    if active is None:
        active = torch.ones(logits.shape[:2], dtype=torch.bool, device=device)
    else:
        active = active[g0:g1, j0:j1].to(device)
    # rows that share their group's preference by construction (a view: BERT-like models' masks) are
    # normalised once per group, and keep sharing u
    shared = shares_rows(log_pref)
    row_pref = log_pref[:, :1] if shared else log_pref
    has_key = torch.isfinite(row_pref).any(-1)
    active = active & has_key  # a problem needs at least one key
    if shared and not bool(has_key.all()):
        row_pref = torch.where(has_key.unsqueeze(-1), row_pref, 0.0)  # a group without keys: uniform
    log_u = torch.sub(row_pref, torch.logsumexp(row_pref, dim=-1, keepdim=True))  # normalise u
    base = torch.add(log_u, logits, alpha=alpha)  # log u + alpha s
    u = log_u.exp_().expand_as(logits) if shared else log_u.exp_()
    inactive = ~active
    if bool(inactive.any()):
        base[inactive] = 0.0
        if not shared:  # (a shared u is finite: the rows of a group without keys have a uniform one)
            u[inactive] = 1.0 / logits.shape[-1]
        logits = torch.where(active.unsqueeze(-1), logits, 0.0)  # a copy: the caller's logits stay as given
        evidence_sqnorm = torch.where(active, evidence_sqnorm, 1.0)
    return logits, base, u, evidence_sqnorm, active


def _empty_solution(n_groups, m, n, dtype, device):
    """The output of :func:`solve_dual`; the tiles write every entry (:func:`_finish`, then NaN on inactive
    problems), so its two largest tensors are left unfilled."""
    def full(shape, value, kind=dtype):
        return torch.full(shape, value, dtype=kind, device=device)

    return DualSolution(
        coefficients=torch.empty((n_groups, m, n), dtype=dtype, device=device),
        attention=torch.empty((n_groups, m, n), dtype=dtype, device=device),
        rel_deviation=full((n_groups, m), float("nan")),
        lambda_norm=full((n_groups, m), float("nan")),
        duality_gap=full((n_groups, m), float("nan")),
        error_bound=full((n_groups, m), float("nan")),
        iterations=full((n_groups, m), 0, torch.int32),
        converged=full((n_groups, m), False, torch.bool),
    )


def solve_spd_reduced(
    factor: torch.Tensor, weights: torch.Tensor, rhs: torch.Tensor, alpha: float, rtol: float | torch.Tensor = 1e-12,
    max_iter: int | None = None, residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Solve :math:`(I/\alpha + A^\top(\mathrm{diag}\,w - ww^\top)A)\,x = b` for every row, in float64.

    The negated Hessian of (R-D) with :math:`p` replaced by the distribution ``weights`` :math:`w`
    (``(g, m, n)``, rows summing to 1, zeros allowed), for right-hand sides ``rhs`` ``(g, m, r)`` and the
    shared factor :math:`A` ``(g, n, r)`` of :func:`factor_gram`.  Solved by the Newton systems'
    batched CG (:func:`_conjugate_gradient`, the same operator) with a Jacobi preconditioner, to relative
    residual ``rtol`` (a number, or one per row ``(g, m)``), at most ``max_iter`` steps (default
    ``4 r + 20``).  Rows with ``rhs = 0`` return 0.  (Unlike the Newton directions these systems are
    solved to near float64 precision, and the preconditioner saves steps where :math:`w` is spread out.)

    Returns ``(x, residual_norm)`` with :math:`\|b - Hx\|` recomputed from ``x`` (not CG's recursive
    residual), so that callers can certify their error: :math:`H \succeq I/\alpha` gives
    :math:`\|x - H^{-1}b\| \le \alpha\,\|b - Hx\|`.  ``residual=False``: ``(x, None)``, for callers
    that recompute it themselves (:mod:`probe.solve.derived` does, from the product it needs anyway).
    """
    f64 = torch.float64
    factor, weights, rhs = factor.to(f64), weights.to(f64), rhs.to(f64)
    mean = torch.bmm(weights, factor)  # A^T w, as rows
    diagonal = (torch.bmm(weights, factor * factor) - mean * mean).add_(1.0 / alpha).clamp_min_(1.0 / alpha)
    forcing = torch.as_tensor(rtol, dtype=f64, device=rhs.device).expand(rhs.shape[:-1])
    live = torch.ones(rhs.shape[:-1], dtype=torch.bool, device=rhs.device)
    steps = 4 * factor.shape[-1] + 20 if max_iter is None else max_iter
    x = _conjugate_gradient(factor, float(alpha), weights, rhs.clone(), forcing, int(steps), live, diagonal)
    if not residual:
        return x, None
    return x, (rhs - _hessian_times(factor, alpha, weights, x)).norm(dim=-1)
