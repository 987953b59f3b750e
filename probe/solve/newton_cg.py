r"""The adaptive Newton-CG iterations on the reduced dual (R-D), tile by tile: Newton steps with truncated
conjugate gradients and Armijo backtracking, until each problem's certificate holds (eq. (D) and its gap,
:mod:`probe.solve.dual`).

On a CPU the compiled kernel (:mod:`probe.solve.native`) runs this method and these iterations take only the
problems it leaves; elsewhere the fixed schedule (:mod:`probe.solve.fixed`) runs first and these iterations
take the problems it leaves.  The quantities a tile keeps fixed are a :class:`WorkingSet`; the point the
iterations are at, with everything the certificate needs, is a :class:`State`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from probe.solve.parallel import call_compiled, without_gil
from probe.solve.problems import duality_gap_reduced, row_dot, shares_rows

__all__ = [
    "COMPILED_LOOPS", "Progress", "State", "WorkingSet", "adaptive", "certified", "conjugate_gradient",
    "continue_rows", "finish", "forcing_floor", "hessian_times", "softmax_and_lse",
]


class WorkingSet:
    r"""Quantities of a set of problems that stay fixed during the Newton iterations.

    Groups share the factor :math:`A` ``(g, n, r)``; their problems are rows ``(g, m, n)``: the logits
    :math:`s`, ``base`` :math:`= \log u + \alpha s` (``-inf`` off the support), the normalised preference
    :math:`u`, :math:`\|z\|^2`, and :math:`m = A^\top u` (formed here, once per group where the rows share
    :math:`u`).  ``factor_low`` is :math:`A` in the Newton direction's precision.
    """

    def __init__(self, factor, factor_low, logits, base, u, evidence_sqnorm, alpha):
        self.A = factor
        self.A_low = factor_low
        self.alpha = alpha
        self.logits = logits
        self.evidence_sqnorm = evidence_sqnorm
        self.base = base
        self.u = u
        if shares_rows(u):  # rows that share u share m
            self.m = torch.bmm(u[:, :1], factor).expand(*u.shape[:2], factor.shape[-1])
        else:
            self.m = torch.bmm(u, factor)  # m = A^T u, as rows (g, m, r)

    def subset(self, groups, pick):
        """The working set of rows ``pick = (group index, row index)`` of the groups ``groups``."""
        out = WorkingSet.__new__(WorkingSet)
        out.A, out.A_low, out.alpha = self.A[groups], self.A_low[groups], self.alpha
        out.logits, out.evidence_sqnorm = self.logits[pick], self.evidence_sqnorm[pick]
        out.base, out.u, out.m = self.base[pick], self.u[pick], self.m[pick]
        return out

    def initial_state(self) -> "State":
        r"""The state at :math:`y = 0` (:math:`\lambda = \alpha z`, where :math:`p` is the model's attention)."""
        y = self.m.new_zeros(self.m.shape)
        p, lse = softmax_and_lse(self.base)
        return self.state_from(y, self.base, p, lse)

    def state(self, y) -> "State":
        """The :class:`State` at ``y``, with :math:`\\theta` formed afresh."""
        theta = torch.baddbmm(self.base, y, self.A.transpose(1, 2))  # log u + alpha s + A y
        p, lse = softmax_and_lse(theta)
        return self.state_from(y, theta, p, lse)

    def state_from(self, y, theta, p, lse) -> "State":
        r"""The state at ``y`` given :math:`\theta = \log u + \alpha s + Ay` and its softmax and log-sum-exp.

        :math:`A^\top(u-p)` is formed from the difference :math:`u - p`, not as :math:`m - A^\top p`:
        near the optimum the two terms nearly cancel, and the subtraction would cost digits of the
        gradient (and so of the certificate) for problems whose :math:`\lambda^*` is small.
        """
        terms = call_compiled(_state_terms, self.A, self.m, self.u, self.logits, self.evidence_sqnorm,
                              float(self.alpha), y, p, lse)
        return State(y, theta, p, *terms)


class StateTerms(NamedTuple):
    """The fields of :class:`State` that follow from its point (:func:`_state_terms_python`)."""

    gradient: torch.Tensor
    gradient_sq: torch.Tensor
    objective: torch.Tensor
    y_dot_m: torch.Tensor
    y_sq: torch.Tensor
    lambda_norm: torch.Tensor
    deviation: torch.Tensor


def _state_terms_python(
    A: torch.Tensor, m: torch.Tensor, u: torch.Tensor, logits: torch.Tensor, evidence_sqnorm: torch.Tensor,
    alpha: float, y: torch.Tensor, p: torch.Tensor, lse: torch.Tensor,
) -> StateTerms:
    r"""The fields of :class:`State` after ``(y, theta, p)`` at ``y`` (:meth:`WorkingSet.state_from`).
    Written in the TorchScript subset: :data:`_state_terms` is this function compiled."""
    u_minus_p = u - p
    spread = torch.bmm(u_minus_p, A)  # A^T (u - p)
    gradient = spread - y / alpha
    y_dot_m = row_dot(y, m)
    y_sq = row_dot(y, y)
    # ||lambda_hat|| = alpha ||z + T^T (u - p)||, expanded in reduced quantities
    spread_sq = row_dot(spread, spread)
    lambda_sq = evidence_sqnorm + 2 * row_dot(logits, u_minus_p) + spread_sq
    return StateTerms(
        gradient, row_dot(gradient, gradient), y_dot_m - y_sq / (2 * alpha) - lse, y_dot_m, y_sq,
        alpha * lambda_sq.clamp_min(0).sqrt(), alpha * spread_sq.sqrt(),
    )


def softmax_and_lse(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(theta), logsumexp(theta))`` over the last axis."""
    top = theta.amax(dim=-1, keepdim=True)
    p = torch.sub(theta, top).exp_()
    total = p.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)
    return p.div_(total), lse


@dataclass
class State:
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


def certified(gradient_sq: torch.Tensor, lambda_norm: torch.Tensor, alpha: float, rtol: float, atol: float):
    r"""Where the certificate holds: ``error_bound`` :math:`= 2\alpha\|g\| \le` ``rtol`` :math:`\|\hat\lambda\|
    +` ``atol`` (false for NaN), the test of ``converged``."""
    return gradient_sq.sqrt() * (2 * alpha) <= rtol * lambda_norm + atol


def hessian_times(factor, alpha, p, v):
    r"""Rows of :math:`Hv = v/\alpha + A^\top \Sigma_p A v`, the negated Hessian of (R-D) at :math:`p`,
    with :math:`\Sigma_p = \mathrm{diag}\,p - pp^\top` (two products with the group's :math:`A`)."""
    return _hessian_times_into(factor, alpha, p, v, torch.empty_like(v), torch.empty_like(p))


def _hessian_times_into(
    factor: torch.Tensor, alpha: float, p: torch.Tensor, v: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor
) -> torch.Tensor:
    """:func:`hessian_times` into ``out``, with ``buffer`` (shaped like ``p``) for :math:`Av`."""
    Av = torch.bmm(v, factor.transpose(1, 2), out=buffer)
    Av.sub_(row_dot(p, Av).unsqueeze(-1)).mul_(p)  # Sigma_p A v
    return torch.baddbmm(v, Av, factor, beta=1.0 / alpha, out=out)


def conjugate_gradient_python(
    factor: torch.Tensor, alpha: float, p: torch.Tensor, rhs: torch.Tensor, forcing: torch.Tensor, max_iter: int,
    live: torch.Tensor, precond: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    r"""Batched CG on :math:`H x = b` (:func:`hessian_times`), each row stopping when its residual's norm
    reaches ``forcing`` times its right-hand side's; rows not ``live`` return 0.

    For the Newton directions there is no preconditioner: a Jacobi one did not reduce the step count on
    MiniLM's problems (their Hessians have condition numbers of 3 to 5) and costs a pass per step.
    ``p``, ``rhs`` (overwritten) and ``precond`` (the diagonal, or None) are in ``factor``'s precision,
    which is that of the result.  Written in the TorchScript subset: :data:`conjugate_gradient` is
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


def forcing_floor(direction_dtype: torch.dtype) -> float:
    """The smallest relative CG residual asked of a Newton direction in ``direction_dtype``."""
    return max(1e-12, 8 * torch.finfo(direction_dtype).eps)


class NewtonStep(NamedTuple):
    r"""A Newton step's outcome (:func:`_newton_step_python`): the new point with :math:`\theta` and its
    softmax and log-sum-exp, the rows for which no acceptable step was found (they stay where they were)
    and those whose full step was below the objective's rounding (taken)."""

    y: torch.Tensor
    theta: torch.Tensor
    p: torch.Tensor
    lse: torch.Tensor
    searching: torch.Tensor
    at_floor: torch.Tensor


def _newton_step_python(
    A: torch.Tensor, A_low: torch.Tensor, m: torch.Tensor, alpha: float, y: torch.Tensor, theta: torch.Tensor,
    p_low: torch.Tensor, gradient: torch.Tensor, gradient_low: torch.Tensor, objective: torch.Tensor,
    y_dot_m: torch.Tensor, y_sq: torch.Tensor, forcing: torch.Tensor, cg_cap: int, live: torch.Tensor, eps: float,
) -> NewtonStep:
    r"""One inexact Newton step on (R-D) for the ``live`` rows, with Armijo backtracking on the objective.

    The direction solves :math:`H\,dy = g` by CG in ``A_low``'s precision (``p_low``, ``gradient_low``:
    :math:`p` and :math:`g` in it, the latter overwritten) to relative residual ``forcing``; everything
    else is in the solver's dtype, whose machine epsilon is ``eps``.  A full step whose predicted increase
    is below the objective's rounding is taken (see :func:`_newton`).  Written in the TorchScript subset:
    :data:`_newton_step` is this function compiled (:func:`probe.solve.parallel.without_gil`).
    """
    direction = conjugate_gradient(A_low, alpha, p_low, gradient_low, forcing, cg_cap, live, None).to(y.dtype)
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
    full_p, full_lse = softmax_and_lse(full_theta)
    trial_lse = full_lse
    for trial in range(60):  # Armijo backtracking on the dual objective
        if trial > 0:
            trial_lse = softmax_and_lse(torch.addcmul(theta, step.unsqueeze(-1), a_direction))[1]
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
        return NewtonStep(y, full_theta, full_p, full_lse, searching, at_floor)
    theta = torch.addcmul(theta, taken.unsqueeze(-1), a_direction)
    p, lse = softmax_and_lse(theta)
    return NewtonStep(y, theta, p, lse, searching, at_floor)


#: the solver's compiled loops by name, with the names of the Python functions they are compiled from
#: (to compare the two)
COMPILED_LOOPS = {
    "conjugate_gradient": "conjugate_gradient_python",
    "_newton_step": "_newton_step_python",
    "_state_terms": "_state_terms_python",
}


@dataclass
class Progress:
    """Where the adaptive iterations of a working set stand: the :class:`State`, the Newton iterations
    each row took, the rows still iterating, and :math:`\\|g\\|` at the rows' start (the forcing term's
    reference; ``None``: the current gradient)."""

    state: State
    iterations: torch.Tensor
    live: torch.Tensor
    initial_norm: Optional[torch.Tensor] = None


def _newton(work: WorkingSet, progress: Progress, rtol, atol, max_iter) -> int:
    """Newton iterations with Armijo backtracking on (R-D), for the problems of one working set, advancing
    ``progress``.

    Returns the iterations left: it stops when no problem is live, after ``max_iter`` iterations (0
    left), or when the live problems would fit in a working set below ``_COMPACT_BELOW`` of this one
    (the caller compacts and calls again, with the same ``progress.initial_norm`` for the forcing term).
    A problem stops as soon as its certificate holds (:func:`certified`).
    """
    alpha = work.alpha
    state = progress.state
    dtype = state.y.dtype
    low = work.A_low.dtype
    g_count, m, _ = state.p.shape
    gradient_norm = state.gradient_sq.sqrt()
    if progress.initial_norm is None:
        progress.initial_norm = gradient_norm.clamp_min(torch.finfo(dtype).tiny)
    cg_cap = max(10, 2 * work.A.shape[-1])
    floor = forcing_floor(low)
    for done in range(max_iter):
        goal = (rtol * state.lambda_norm + atol) / (2 * alpha)  # on ||g||: the certificate
        progress.live = live = progress.live & ~certified(state.gradient_sq, state.lambda_norm, alpha, rtol, atol)
        per_group = live.sum(-1)
        if int((per_group > 0).sum()) * int(per_group.max()) <= _COMPACT_BELOW * g_count * m:
            return max_iter - done  # no live problem, or compact
        # Inexact Newton; the gradient, the line search and the certificate stay in the solver's dtype.
        forcing = _forcing(gradient_norm, progress.initial_norm, goal, floor)
        step = call_compiled(
            _newton_step, work.A, work.A_low, work.m, float(alpha), state.y, state.theta, state.p.to(low),
            state.gradient, state.gradient.to(low, copy=True), state.objective, state.y_dot_m, state.y_sq,
            forcing, cg_cap, live, torch.finfo(dtype).eps,
        )
        progress.iterations = progress.iterations + live.to(torch.int32)
        previous_norm = gradient_norm
        progress.state = state = work.state_from(step.y, step.theta, step.p, step.lse)
        gradient_norm = state.gradient_sq.sqrt()
        # Near the optimum the objective cannot resolve the gain of a Newton step (it is below its
        # rounding), but the gradient still can: such steps are taken in full while they shrink the
        # gradient.  A problem stops when they no longer do, or when no acceptable step exists; whether
        # it converged is then decided by the certificate alone.
        stalled = step.at_floor & (gradient_norm > 0.5 * previous_norm)
        progress.live = live & ~step.searching & ~stalled
    progress.live = progress.live & ~certified(state.gradient_sq, state.lambda_norm, alpha, rtol, atol)
    return 0


def adaptive(work: WorkingSet, progress: Progress, active, rtol, atol, max_iter, out):
    """:func:`_newton` on the live problems of a tile from ``progress``, compacting the working set as
    problems finish; the tile's :class:`probe.solve.problems.DualSolution`, written into ``out``."""
    g_count, m, _ = work.base.shape
    device = work.base.device
    remaining = _newton(work, progress, rtol, atol, max_iter)
    if remaining == 0 or not bool(progress.live.any()):
        return finish(work, progress.state, active, rtol, atol, progress.iterations, out)
    final, iterations = progress.state, progress.iterations
    y = final.y
    groups = torch.arange(g_count, device=device)  # working set: rows[k, j] of group groups[k]
    rows = torch.arange(m, device=device).expand(g_count, m)
    live, initial_norm = progress.live, progress.initial_norm
    while remaining > 0 and bool(live.any()):
        # gather the live problems: groups that have one, live rows first
        per_group = live.sum(-1)
        keep = per_group.nonzero().squeeze(-1)
        width = int(per_group.max())
        order = torch.argsort((~live[keep]).to(torch.int8), dim=-1, stable=True)[:, :width]
        groups, rows = groups[keep], rows[keep].gather(1, order)
        pick = (groups.unsqueeze(-1), rows)
        subset = work.subset(groups, pick)
        part = Progress(subset.state(y[pick]), iterations[pick], live[keep].gather(1, order),
                        initial_norm[keep].gather(1, order))
        remaining = _newton(subset, part, rtol, atol, remaining)
        live, initial_norm = part.live, part.initial_norm
        y[pick] = part.state.y  # rows that were not live come back unchanged
        iterations[pick] = part.iterations
        for name in ("p", "gradient", "gradient_sq", "lambda_norm", "deviation"):  # what finish reads
            getattr(final, name)[pick] = getattr(part.state, name)
    return finish(work, final, active, rtol, atol, iterations, out)


def continue_rows(work: WorkingSet, y, rows, iterations, active, rtol, atol, max_iter, out):
    r"""The adaptive iterations for the ``rows`` ``(g, m)`` of a tile from the iterates ``y`` (the compiled
    kernel's, for the rows it left above their goal; a non-finite iterate restarts at 0), gathered into a
    working set of their own; their results and iterations (added to ``iterations``) are written into the
    tile's ``out``."""
    per_group = rows.sum(-1)
    groups = per_group.nonzero().squeeze(-1)
    order = torch.argsort((~rows[groups]).to(torch.int8), dim=-1, stable=True)[:, : int(per_group.max())]
    valid = rows[groups].gather(1, order)
    pick = (groups.unsqueeze(-1), order)
    subset = work.subset(groups, pick)
    start = y[pick]
    start = torch.where(torch.isfinite(start.sum(-1, keepdim=True)), start, 0.0)
    part = _empty_like(out, valid.shape)
    progress = Progress(subset.state(start), iterations[pick], valid.clone())
    adaptive(subset, progress, valid, rtol, atol, max_iter, part)
    where = (groups.unsqueeze(-1).expand_as(order)[valid], order[valid])
    for name, target in vars(out).items():
        target[where] = getattr(part, name)[valid]
    return out


def _empty_like(out, shape):
    """A solution of the leading ``shape`` (groups, rows) with ``out``'s other axes, dtypes and device."""
    return type(out)(**{name: value.new_empty(*shape, *value.shape[2:]) for name, value in vars(out).items()})


def finish(work: WorkingSet, state: State, active, rtol, atol, iterations, out):
    """The tile's :class:`probe.solve.problems.DualSolution` from the final state (its certificate: the
    module docstring of :mod:`probe.solve.dual`), written into ``out`` (a solution of the tile's shape)."""
    alpha = work.alpha
    torch.mul(state.gradient_sq.sqrt(), 2 * alpha, out=out.error_bound)
    error_bound = out.error_bound
    torch.logical_and(active & torch.isfinite(error_bound), error_bound <= rtol * state.lambda_norm + atol,
                      out=out.converged)
    torch.sub(work.u, state.p, out=out.coefficients).mul_(alpha)
    out.attention.copy_(state.p)
    torch.add(state.y, state.gradient, alpha=alpha, out=out.correction)  # alpha A^T(u - p) = y + alpha g
    torch.div(state.deviation, state.lambda_norm, out=out.rel_deviation)
    # lambda = alpha z exactly: no deviation, also where both are 0 (zero templates and evidence: 0 / 0)
    out.rel_deviation.masked_fill_(state.deviation == 0, 0.0)
    out.lambda_norm.copy_(state.lambda_norm)
    out.duality_gap.copy_(duality_gap_reduced(state.gradient, alpha))
    out.iterations.copy_(iterations)
    return out


#: :func:`_state_terms_python`, compiled so that it runs without the GIL (identical results)
_state_terms = without_gil(_state_terms_python)


#: :func:`conjugate_gradient_python`, compiled so that its loop runs without the GIL (the same operations
#: in the same order: identical results)
conjugate_gradient = without_gil(conjugate_gradient_python)


#: :func:`_newton_step_python`, compiled so that it runs without the GIL (identical results)
_newton_step = without_gil(_newton_step_python)
