r"""The fixed-iteration Newton method: Newton-CG on (R-D) with every decision taken in advance, so that a GPU
runs it with no host synchronisation.

The adaptive iterations (:mod:`probe.solve.newton_cg`) decide, after every conjugate-gradient step and
every line-search trial, whether any problem still needs the next one.  Each decision reads a tensor on
the host: on a GPU the host waits for the device there, and the device then waits for the host's next
launch.  :func:`fixed_newton` runs the same method with

* a fixed number of Newton iterations (:data:`CG_STEPS`, one entry each), each solving the Newton
  system :math:`H\,dy = g` (:math:`H = I/\alpha + A^\top\Sigma_p A`, eq. R-D's negated Hessian) by
  exactly that many CG steps in the direction's precision;
* a line search whose Armijo trial steps :math:`1, \tfrac12, \dots, 2^{1-S}` (:data:`TRIAL_STEPS` of
  them) are evaluated together, each problem taking the longest that is accepted (none: it stays);
* the certificate at the end.

Problems whose certificate already holds take no further steps (their direction is zero).  The method
contains no ``.item()``, boolean indexing or data-dependent branch, so ``torch.compile(fullgraph=True)``
captures it whole.  After it, one read of the host (:func:`solve_by_schedule`) says whether any problem
of the tile is not yet certified; only those go on through the adaptive iterations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.core import environment
from probe.solve import native, newton_cg
from probe.solve.newton_cg import Progress, State, WorkingSet, softmax_and_lse

__all__ = ["ARMIJO", "CG_STEPS", "TRIAL_STEPS", "Constants", "applies", "constants", "fixed_newton", "runs",
           "solve_by_schedule"]

#: CG steps of each Newton iteration: of the schedules of about as many CG steps, the one that brings the
#: most rows of the pretrained MiniLM within their tolerance
CG_STEPS = (1, 2, 3, 5)
#: Armijo trial steps evaluated together: 1, 1/2, ..., 2^(1 - TRIAL_STEPS)
TRIAL_STEPS = 4
#: Armijo's sufficient-increase constant, as in the adaptive iterations' line search
ARMIJO = 1e-4


def enabled() -> bool:
    """Whether the torch path runs the fixed schedule first (``PROBE_SCHEDULE=0``: the adaptive
    iterations alone, for comparisons)."""
    return environment.fixed_schedule_allowed()


def applies(max_iter: int) -> bool:
    """Whether :func:`solve_by_schedule` solves a tile allowed ``max_iter`` Newton iterations."""
    return enabled() and max_iter >= len(CG_STEPS)


def runs(device: torch.device, dtype: torch.dtype, direction_dtype: torch.dtype, max_iter: int) -> bool:
    """Whether a :func:`probe.solve.dual.solve_dual` call with these settings solves its tiles by
    :func:`solve_by_schedule`: where the compiled kernel (:mod:`probe.solve.native`: a CPU, float64 with
    float32 directions) does not run them."""
    if not applies(max_iter):
        return False
    kernel = device.type == "cpu" and dtype == torch.float64 and direction_dtype == torch.float32
    return not (kernel and native.available())


@dataclass
class Constants:
    r"""The fixed schedule's constant tensors: 0, the trial steps :math:`t`, :math:`(t, t^2)`, the
    coefficients of :math:`(g^\top dy, dy^\top m, y^\top dy, \|dy\|^2)` in the increase's :math:`t` and
    :math:`t^2` terms less Armijo's, and the smallest normal number of the direction's precision."""

    zero: torch.Tensor
    steps: torch.Tensor
    powers: torch.Tensor
    weights: torch.Tensor
    tiny: torch.Tensor


def make_constants(alpha: float, trials: int, dtype: torch.dtype, low: torch.dtype, device) -> Constants:
    """:class:`Constants` for strength ``alpha``, ``trials`` trial steps, the solver's ``dtype`` and the
    direction's ``low``, made from one tensor on ``device``."""
    steps_t = [0.5**k for k in range(trials)]
    coefficients = [-ARMIJO, 0.0, 1.0, 0.0, -1.0 / alpha, 0.0, 0.0, -0.5 / alpha]
    values = torch.tensor([0.0] + steps_t + [t * t for t in steps_t] + coefficients, dtype=dtype, device=device)
    tiny = torch.full((), torch.finfo(low).tiny, dtype=low, device=device)
    return Constants(values[0], values[1:1 + trials], values[1:1 + 2 * trials].view(2, trials),
                     values[1 + 2 * trials:].view(4, 2), tiny)


_CONSTANTS: dict = {}


def constants(alpha: float, trials: int, dtype: torch.dtype, low: torch.dtype, device) -> Constants:
    """:func:`make_constants`, made once per process and settings: on a GPU each is a copy from the host,
    which would wait for the device."""
    key = (alpha, trials, dtype, low, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = make_constants(alpha, trials, dtype, low, device)
    return _CONSTANTS[key]


def _dot(a: torch.Tensor, b: torch.Tensor, plus: torch.Tensor) -> torch.Tensor:
    """Row-wise inner products of contiguous ``(..., k)`` rows plus the 0-d ``plus``, in one operator."""
    rows, k = math.prod(a.shape[:-1]), a.shape[-1]
    return torch.baddbmm(plus, a.reshape(rows, 1, k), b.reshape(rows, k, 1)).view(a.shape[:-1])


def _conjugate_gradient(A_low, At_low, alpha: float, p, rhs, steps: int, tiny):
    r"""``steps`` CG steps on :math:`H x = b` (:math:`H = I/\alpha + A^\top\Sigma_p A`) from :math:`x = 0`
    for every row, with no stopping test.  Every inner product carries ``tiny`` (the smallest normal
    number of the direction's precision, 0-d): a row whose residual vanished takes steps of
    :math:`\mathrm{tiny}/\mathrm{tiny}` along a zero direction, which leave it where it is, instead of
    :math:`0/0`."""
    r = d = rhs
    rz = _dot(r, r, tiny)
    x = None
    for step_index in range(steps):
        Ad = torch.bmm(d, At_low)
        w = Ad * p
        w.addcmul_(p, w.sum(-1, keepdim=True), value=-1.0)  # Sigma_p A d
        Hd = torch.baddbmm(d, w, A_low, beta=1.0 / alpha)
        step = (rz / _dot(d, Hd, tiny)).unsqueeze(-1)
        x = step * d if x is None else x.addcmul_(step, d)
        if step_index == steps - 1:
            break
        r = torch.addcmul(r, step, Hd, value=-1.0) if step_index == 0 else r.addcmul_(step, Hd, value=-1.0)
        rz_new = _dot(r, r, tiny)
        d = torch.addcmul(r, (rz_new / rz).unsqueeze(-1), d)
        rz = rz_new
    return x


def fixed_newton(
    A, A_low, base, u, m, logits, evidence_sqnorm, live, alpha: float, rtol: float, atol: float,
    cg_steps: tuple = CG_STEPS, trials: int = TRIAL_STEPS, constants: Constants | None = None,
) -> Progress:
    r"""The fixed schedule (module docstring) on the rows of one working set, from :math:`y = 0`.

    Arguments as the fields of :class:`probe.solve.newton_cg.WorkingSet` (``A_low``: :math:`A` in the Newton
    direction's precision); ``live``: the active rows; ``constants``: :func:`make_constants`'s (made here
    if not given).  Returns the :class:`probe.solve.newton_cg.Progress` the adaptive iterations continue
    from: the state at the final point, the Newton iterations each row took, the rows whose certificate
    does not hold yet, and :math:`\|g\|` at :math:`y = 0` (the forcing term's reference).  No host
    synchronisation and no data-dependent branch.

    Between iterations a row stops where its certificate holds with the lower bound
    :math:`\|\hat\lambda\| \ge \alpha(\|z\| - \|A^\top(u-p)\|)` (the triangle inequality) in place of
    :math:`\|\hat\lambda\|`, which is formed at the end only.

    The line search compares the increase of (R-D) along the direction :math:`dy`,
    :math:`t\,(dy^\top m - y^\top dy/\alpha) - t^2\|dy\|^2/(2\alpha) - (\mathrm{LSE}_t - \mathrm{LSE}_0)`,
    with Armijo's :math:`10^{-4}\,t\,g^\top dy`, for all trial steps :math:`t` at once: the polynomial
    part as two small products (the inner products by their coefficients, then by :math:`(t, t^2)`),
    :math:`\mathrm{LSE}_t - \mathrm{LSE}_0` as the log-sum-exp of :math:`\log p + t\,A\,dy`.  A full
    step whose predicted increase :math:`g^\top dy` is below that difference's rounding,
    :math:`64\epsilon(|\mathrm{LSE}| + 1)` with the log-sum-exp at :math:`y = 0`, is taken in full (as in
    the adaptive iterations, which handle the rows that stall there).
    """
    dtype, low = base.dtype, A_low.dtype
    eps, smallest = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    At, At_low = A.transpose(1, 2), A_low.transpose(1, 2)
    c = make_constants(alpha, trials, dtype, low, base.device) if constants is None else constants
    goal_scale = 1.0 / (2 * alpha)  # the certificate: ||g|| <= goal_scale (rtol ||lambda_hat|| + atol)
    alpha_z = evidence_sqnorm.sqrt().mul_(alpha)  # ||alpha z||

    def certified_below(gradient_norm, spread_sq):  # certified with ||lambda_hat|| >= its lower bound
        lower = torch.sub(alpha_z, spread_sq.sqrt(), alpha=alpha)
        return torch.sub(gradient_norm, lower, alpha=rtol * goal_scale) <= atol * goal_scale

    # y = 0: lambda = alpha z, p the model's attention, g = A^T (u - p)
    theta, (p, lse) = base, softmax_and_lse(base)
    y = torch.zeros_like(m)
    u_minus_p = u - p
    gradient = torch.bmm(u_minus_p, A)
    gradient_sq = spread_sq = _dot(gradient, gradient, c.zero)
    gradient_norm = gradient_sq.sqrt()
    initial_norm = gradient_norm.clamp_min(smallest)
    floor = lse.abs().add_(1).mul_(64 * eps)  # the rounding of LSE_t - LSE_0, at y = 0
    iterations = torch.zeros(live.shape, dtype=torch.int32, device=live.device)
    for steps in cg_steps:
        live = live & ~certified_below(gradient_norm, spread_sq)
        iterations.add_(live)
        rhs = torch.where(live.unsqueeze(-1), gradient, 0.0).to(low)  # certified rows: no step
        direction = _conjugate_gradient(A_low, At_low, alpha, p.to(low), rhs, steps, c.tiny).to(dtype)
        a_direction = torch.bmm(direction, At)  # A dy
        dots = torch.matmul(torch.stack((gradient, m, y, direction), dim=-2), direction.unsqueeze(-1))
        increase = torch.matmul(torch.matmul(dots.squeeze(-1), c.weights), c.powers).permute(2, 0, 1)
        trial = torch.addcmul(theta, c.steps.view(-1, 1, 1, 1), a_direction)  # every trial step at once
        lse_change = trial.sub_(lse.unsqueeze(-1)).exp_().sum(-1).clamp_min_(smallest).log_()
        gain = increase - lse_change  # the increase of (R-D) less Armijo's, per trial step
        gain[0].masked_fill_(dots[..., 0, 0] <= floor, 0.0)  # g^T dy below the rounding: the full step
        taken = ((gain >= 0) * c.steps.view(-1, 1, 1)).amax(0).unsqueeze(-1)  # the longest accepted; 0 if none
        y = torch.addcmul(y, taken, direction)
        theta = torch.addcmul(theta, taken, a_direction)
        p, lse = softmax_and_lse(theta)
        u_minus_p = u - p
        spread = torch.bmm(u_minus_p, A)  # A^T (u - p)
        gradient = torch.sub(spread, y, alpha=1.0 / alpha)
        gradient_sq, spread_sq = _dot(gradient, gradient, c.zero), _dot(spread, spread, c.zero)
        gradient_norm = gradient_sq.sqrt()
    # ||lambda_hat|| = alpha ||z + T^T (u - p)||, the objective (R-D) and the rows not yet certified
    lambda_sq = torch.add(evidence_sqnorm, _dot(logits, u_minus_p, c.zero), alpha=2).add_(spread_sq)
    lambda_norm = lambda_sq.clamp_min_(0).sqrt_().mul_(alpha)
    live = live & (torch.sub(gradient_norm, lambda_norm, alpha=rtol * goal_scale) > atol * goal_scale)
    y_dot_m, y_sq = _dot(y, m, c.zero), _dot(y, y, c.zero)
    objective = torch.sub(y_dot_m, y_sq, alpha=0.5 / alpha).sub_(lse)
    deviation = spread_sq.sqrt().mul_(alpha)
    state = State(y, theta, p, gradient, gradient_sq, objective, y_dot_m, y_sq, lambda_norm, deviation)
    return Progress(state, iterations, live, initial_norm)


def solve_by_schedule(work: WorkingSet, active, rtol, atol, max_iter, out):
    """A tile by the fixed schedule, then the adaptive iterations for the problems whose certificate does
    not hold yet, if any (one read of the host); its :class:`probe.solve.problems.DualSolution`, written
    into ``out``."""
    made = constants(float(work.alpha), TRIAL_STEPS, work.A.dtype, work.A_low.dtype, work.A.device)
    progress = fixed_newton(
        work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm, active,
        float(work.alpha), float(rtol), float(atol), constants=made)
    if not bool(progress.live.any()):
        return newton_cg.finish(work, progress.state, active, rtol, atol, progress.iterations, out)
    return newton_cg.adaptive(work, progress, active, rtol, atol, max_iter - len(CG_STEPS), out)
