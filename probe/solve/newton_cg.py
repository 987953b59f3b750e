"""The adaptive Newton-CG iterations on the reduced dual, tile by tile: Newton steps with truncated conjugate
gradients and Armijo backtracking, until each problem is certified within its tolerance (eq. (D) and its
gap, :mod:`probe.solve.dual`).  On a CPU the compiled kernel (:mod:`probe.solve.native`) runs the same
method; elsewhere the fixed schedule (:mod:`probe.solve.schedule`) runs first and these iterations take the
problems it leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from probe.solve.parallel import without_gil
from probe.solve.problems import duality_gap_reduced, row_dot, shares_rows


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


def _adaptive(work, state, iterations, live, initial_norm, active, rtol, atol, max_iter, out):
    """:func:`_newton` on the ``live`` problems of a tile from ``state``, compacting the working set as
    problems finish (:func:`probe.solve.dual._solve_tile`); the tile's :class:`probe.solve.problems.DualSolution`, written into ``out``."""
    g_count, m, _ = work.base.shape
    device = work.base.device
    state, iterations, live, initial_norm, remaining = _newton(
        work, state, iterations, live, initial_norm, rtol, atol, max_iter
    )
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
    """The tile's :class:`probe.solve.problems.DualSolution` from the final state (its certificate: module docstring), written
    into ``out`` (a :class:`probe.solve.problems.DualSolution` of the tile's shape)."""
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


#: tile size of :func:`probe.solve.dual.solve_dual` per device type: on a CPU, small enough for a tile's working set to
#: stay in cache (bench/NOTES.md); on a GPU, the least (:func:`probe.solve.schedule.tile_bytes`)
TILE_BYTES = {"cpu": 1 << 24, "cuda": 1 << 29}


#: a call of at least twice this many problems is cut into an even number (at least 2) of equal tiles, so
#: that two workers share it evenly (three tiles on two workers left one idle for a third of the call)
_MIN_TILE_ROWS = 1024


#: :func:`_state_terms_python`, compiled so that it runs without the GIL (identical results)
_state_terms = without_gil(_state_terms_python)


#: :func:`_conjugate_gradient_steps`, compiled so that its loop runs without the GIL (the same operations
#: in the same order: identical results)
_conjugate_gradient = without_gil(_conjugate_gradient_steps)


#: :func:`_newton_step_python`, compiled so that it runs without the GIL (identical results)
_newton_step = without_gil(_newton_step_python)

