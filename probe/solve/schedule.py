r"""The solver's fixed schedule: Newton-CG on (R-D) with no host synchronisation.

:func:`probe.solve.newton_cg._newton` decides, after every conjugate-gradient step and every line-search trial,
whether any problem still needs the next one.  Each decision reads a tensor on the host: on a GPU the
host waits for the device there, and the device then waits for the host's next launch
(bench/results_gpu_ready.md counts them).

:func:`fixed_newton` runs the same method with every decision taken in advance:

* a fixed number of Newton iterations (:data:`CG_STEPS`, one entry each), each solving the Newton
  system :math:`H\,dy = g` (:math:`H = I/\alpha + A^\top\Sigma_p A`, eq. R-D's negated Hessian) by
  exactly that many CG steps in the direction's precision;
* a line search whose Armijo trial steps :math:`1, \tfrac12, \dots, 2^{1-S}` (:data:`TRIAL_STEPS` of
  them) are evaluated together, each problem taking the longest that is accepted (none: it stays);
* the certificate at the end.

Problems whose gradient is already within the goal take no further steps (their direction is zero), as
in :func:`probe.solve.newton_cg._newton`.  The schedule contains no ``.item()``, boolean indexing or
data-dependent branch, so ``torch.compile(fullgraph=True)`` captures it whole.  After it, one read of
the host (:func:`solve_tile`) says whether any problem of the tile is not yet within its goal; only
those go on through the adaptive iterations of :mod:`probe.solver`, which certify them as before.
Certificates, tolerances and the answers' accuracy do not change.

This module also holds the tile inputs (:func:`tile_inputs`), free of host synchronisation, the tile
size (:func:`tile_bytes`: on a GPU, from its free memory) and the batched factorisation of the Gram
matrices (:func:`probe.solve.gram.factor_cholesky`).
"""

from __future__ import annotations

import math
import os

import torch

from probe.solve import native, newton_cg
from probe.solve.problems import DualSolution, shares_rows

__all__ = [
    "CG_STEPS", "TRIAL_STEPS", "applies", "fixed_newton", "runs", "solve_tile", "tile_bytes",
    "tile_inputs",
]

#: CG steps of each Newton iteration of the fixed schedule: of the schedules of about as many CG steps,
#: the one that brings the most rows of the pretrained MiniLM within their goal (bench/results_gpu_ready.md
#: compares them)
CG_STEPS = (1, 2, 3, 5)
#: Armijo trial steps evaluated together: 1, 1/2, ..., 2^(1 - TRIAL_STEPS)
TRIAL_STEPS = 4
#: Armijo's sufficient-increase constant, as in :func:`probe.solve.newton_cg._newton_step_python`
ARMIJO = 1e-4


def enabled() -> bool:
    """Whether the torch path runs the fixed schedule first (``PROBE_SCHEDULE=0``: the adaptive
    iterations alone, as before it existed; for comparisons)."""
    return os.environ.get("PROBE_SCHEDULE", "1") != "0"


def applies(work, max_iter: int) -> bool:
    """Whether :func:`solve_tile` solves the tile ``work`` (a :class:`probe.solve.newton_cg._WorkingSet`)."""
    return enabled() and max_iter >= len(CG_STEPS)


def runs(device: torch.device, dtype: torch.dtype, direction_dtype: torch.dtype, max_iter: int) -> bool:
    """Whether a :func:`probe.solve.dual.solve_dual` call with these settings solves its tiles by
    :func:`solve_tile`: where the compiled kernel (:mod:`probe.solve.native`: a CPU, float64 with float32
    directions) does not run them."""
    if not enabled() or max_iter < len(CG_STEPS):
        return False
    kernel = device.type == "cpu" and dtype == torch.float64 and direction_dtype == torch.float32
    return not (kernel and native.available())


def tile_bytes(device: torch.device, schedule: bool, group_bytes: int) -> int:
    """Bytes of one tile's working set on ``device`` (``group_bytes``: one group's).

    On a CPU, :data:`probe.solve.newton_cg.TILE_BYTES` (a working set near the cache) for the compiled kernel and
    the adaptive loops; for the fixed schedule at least one whole group, whose fixed cost per tile (its
    operators and its one read of the host) would otherwise be paid for every slice of a group (tiles
    of 16 to 64 MiB solved alike fast with the torch loops: bench/NOTES.md).  On a GPU, a quarter of
    the device's free memory, and at least :data:`probe.solve.newton_cg.TILE_BYTES`'s entry for it: one tile
    where the call fits.
    """
    base = newton_cg.TILE_BYTES.get(device.type, newton_cg.TILE_BYTES["cuda"])
    if device.type == "cpu":
        return max(base, group_bytes) if schedule else base
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(base, free // 4)
    return base


def plan_tiles(n_groups, m, n, device, dtype, schedule, memory_budget_bytes, workers):
    """``(tiles, workers)`` of a :func:`probe.solve.dual.solve_dual` call: tiles ``(g0, g1, j0, j1)`` of whole
    groups, or slices of one group, of equal size, each within :func:`tile_bytes` (and the memory budget,
    if any), and the number of workers whose tiles fit in the budget together."""
    per_row = bytes_per_row(n, dtype)
    tile = tile_bytes(device, schedule, m * per_row)
    if memory_budget_bytes is not None:
        tile = min(tile, memory_budget_bytes)
    rows_per_tile = max(1, tile // per_row)
    if memory_budget_bytes is not None and workers > 1:  # each tile in flight holds its working set
        workers = max(1, min(workers, memory_budget_bytes // (min(rows_per_tile, m * n_groups) * per_row)))
    if rows_per_tile >= m:  # whole groups, in tiles of equal size
        count = -(-n_groups // max(1, rows_per_tile // m))
        if n_groups * m >= 2 * newton_cg._MIN_TILE_ROWS:
            count = min(n_groups, max(2, count + count % 2))
        return [(g0, g1, 0, m) for g0, g1 in _equal_parts(n_groups, count)], workers
    return [(g, g + 1, j0, j1) for g in range(n_groups) for j0, j1 in _equal_parts(m, -(-m // rows_per_tile))], workers


def _equal_parts(length: int, count: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``count`` consecutive parts of ``range(length)`` whose sizes differ by at most 1."""
    bounds = [round(i * length / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def bytes_per_row(n: int, dtype: torch.dtype) -> int:
    """Working-set bytes per problem: about 16 (m, n)-sized tensors of the solver's dtype are live at once
    (in the fixed schedule, the line search's trial points are 4 of them)."""
    return 16 * n * torch.finfo(dtype).bits // 8


def empty_solution(n_groups, m, n, dtype, device):
    """The output of :func:`probe.solve.dual.solve_dual`, unfilled: the tiles write every entry
    (:func:`probe.solve.newton_cg._finish`, then NaN on inactive problems)."""
    def empty(*shape, kind=dtype):
        return torch.empty(shape, dtype=kind, device=device)

    return DualSolution(
        coefficients=empty(n_groups, m, n), attention=empty(n_groups, m, n), rel_deviation=empty(n_groups, m),
        lambda_norm=empty(n_groups, m), duality_gap=empty(n_groups, m), error_bound=empty(n_groups, m),
        iterations=empty(n_groups, m, kind=torch.int32), converged=empty(n_groups, m, kind=torch.bool),
    )


def _on(tensor: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``, with no operator where it already is."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device=device, dtype=dtype)


def tile_inputs(problems, g0, g1, j0, j1, dtype, device):
    r"""(logits, :math:`\log u + \alpha s`, :math:`u`, :math:`\|z\|^2`, active) of one tile in the
    solver's dtype, with :math:`u` normalised; inactive problems get a harmless uniform problem, so
    that no NaN enters the batched products.  No host synchronisation: the inactive rows are replaced
    by ``torch.where``, whether there are any or not.

    Rows that share their group's preference by construction (a stride-0 view: BERT-like models'
    masks) are moved to the device as one row per group and normalised once; they keep sharing
    :math:`u`.
    """
    alpha = problems.alpha
    logits = _on(problems.logits[g0:g1, j0:j1], device, dtype)
    evidence_sqnorm = _on(problems.evidence_sqnorm[g0:g1, j0:j1], device, dtype)
    log_pref = problems.log_preference[g0:g1, j0:j1]
    shared = shares_rows(log_pref)
    row_pref = _on(log_pref[:, :1] if shared else log_pref, device, dtype)
    row_has_key = torch.isfinite(row_pref).any(-1)  # a problem needs at least one key
    has_key = row_has_key.expand(logits.shape[:-1])  # every row of the tile, also where they share u
    active = has_key.clone() if problems.active is None else _on(problems.active[g0:g1, j0:j1], device) & has_key
    if shared:  # a group without keys: uniform (its rows are inactive)
        row_pref = torch.where(row_has_key.unsqueeze(-1), row_pref, 0.0)
    log_u = torch.sub(row_pref, torch.logsumexp(row_pref, dim=-1, keepdim=True))  # normalise u
    keep = active.unsqueeze(-1)
    base = torch.where(keep, torch.add(log_u, logits, alpha=alpha), 0.0)  # log u + alpha s
    u = log_u.exp_().expand_as(logits) if shared else torch.where(keep, log_u.exp_(), 1.0 / logits.shape[-1])
    logits = torch.where(keep, logits, 0.0)  # a copy: the caller's logits stay as given
    evidence_sqnorm = torch.where(active, evidence_sqnorm, 1.0)
    return logits, base, u, evidence_sqnorm, active


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


def schedule_constants(alpha: float, trials: int, dtype: torch.dtype, low: torch.dtype, device) -> tuple:
    r"""The fixed schedule's constant tensors: 0, the trial steps :math:`t`, :math:`(t, t^2)`, the
    coefficients of :math:`(g^\top dy, dy^\top m, y^\top dy, \|dy\|^2)` in the increase's :math:`t` and
    :math:`t^2` terms less Armijo's, and the smallest normal number of the direction's precision."""
    steps_t = [0.5**k for k in range(trials)]
    coefficients = [-ARMIJO, 0.0, 1.0, 0.0, -1.0 / alpha, 0.0, 0.0, -0.5 / alpha]
    values = torch.tensor([0.0] + steps_t + [t * t for t in steps_t] + coefficients, dtype=dtype, device=device)
    tiny = torch.full((), torch.finfo(low).tiny, dtype=low, device=device)
    return (values[0], values[1:1 + trials], values[1:1 + 2 * trials].view(2, trials),
            values[1 + 2 * trials:].view(4, 2), tiny)


_CONSTANTS: dict = {}


def _cached_constants(alpha: float, trials: int, dtype: torch.dtype, low: torch.dtype, device) -> tuple:
    """:func:`schedule_constants`, made once per process and settings: on a GPU each is a copy from the
    host, which would wait for the device."""
    key = (alpha, trials, dtype, low, str(device))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = schedule_constants(alpha, trials, dtype, low, device)
    return _CONSTANTS[key]


def fixed_newton(
    A, A_low, base, u, m, logits, evidence_sqnorm, live, alpha: float, rtol: float, atol: float,
    cg_steps: tuple = CG_STEPS, trials: int = TRIAL_STEPS, constants: tuple | None = None,
):
    r"""The fixed schedule (module docstring) on the rows of one working set, from :math:`y = 0`.

    Arguments as the fields of :class:`probe.solve.newton_cg._WorkingSet` (``A_low``: :math:`A` in the Newton
    direction's precision); ``live``: the active rows.  Returns ``(y, theta, p, gradient, gradient_sq,
    objective, y_dot_m, y_sq, lambda_norm, deviation, iterations, live, initial_norm)``: the fields of
    :class:`probe.solve.newton_cg._State` at the final point (as :func:`probe.solve.newton_cg._state_terms_python` forms
    them), the Newton iterations each row took, the rows still above their goal
    :math:`\|g\| > \tfrac14(\mathrm{rtol}\,\|\hat\lambda\| + \mathrm{atol})/(2\alpha)` (those
    :func:`probe.solve.newton_cg._newton` continues) and :math:`\|g\|` at :math:`y = 0` (its forcing term's
    reference).  No host synchronisation and no data-dependent branch.  ``constants``: those of
    :func:`schedule_constants` (made here if not given).

    Between iterations a row stops at its goal judged with the lower bound
    :math:`\|\hat\lambda\| \ge \alpha(\|z\| - \|A^\top(u-p)\|)` (the triangle inequality), so no earlier
    than with :math:`\|\hat\lambda\|` itself, which is formed at the end only.

    The line search compares the increase of (R-D) along the direction :math:`dy`,
    :math:`t\,(dy^\top m - y^\top dy/\alpha) - t^2\|dy\|^2/(2\alpha) - (\mathrm{LSE}_t - \mathrm{LSE}_0)`,
    with Armijo's :math:`10^{-4}\,t\,g^\top dy`, for all trial steps :math:`t` at once: the polynomial
    part as two small products (the inner products by their coefficients, then by :math:`(t, t^2)`),
    :math:`\mathrm{LSE}_t - \mathrm{LSE}_0` as the log-sum-exp of :math:`\log p + t\,A\,dy`.  A full
    step whose predicted increase :math:`g^\top dy` is below that difference's rounding,
    :math:`64\epsilon(|\mathrm{LSE}| + 1)` with the log-sum-exp at :math:`y = 0`, is taken in full (as
    in :func:`probe.solve.newton_cg._newton`, whose rows that stall there the adaptive iterations then handle).
    """
    dtype, low = base.dtype, A_low.dtype
    eps, smallest = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    At, At_low = A.transpose(1, 2), A_low.transpose(1, 2)
    if constants is None:
        constants = schedule_constants(alpha, trials, dtype, low, base.device)
    zero, t, powers, weights, tiny = constants
    goal_scale = 0.25 / (2 * alpha)  # the goal: ||g|| <= goal_scale (rtol ||lambda_hat|| + atol)
    alpha_z = evidence_sqnorm.sqrt().mul_(alpha)  # ||alpha z||

    def within_goal(gradient_norm, spread_sq):  # rows at their goal with ||lambda_hat|| >= its lower bound
        lower = torch.sub(alpha_z, spread_sq.sqrt(), alpha=alpha)
        return torch.sub(gradient_norm, lower, alpha=rtol * goal_scale) <= atol * goal_scale

    # y = 0: lambda = alpha z, p the model's attention, g = A^T (u - p)
    theta, (p, lse) = base, newton_cg._softmax_and_lse(base)
    y = torch.zeros_like(m)
    u_minus_p = u - p
    gradient = torch.bmm(u_minus_p, A)
    gradient_sq = spread_sq = _dot(gradient, gradient, zero)
    gradient_norm = gradient_sq.sqrt()
    initial_norm = gradient_norm.clamp_min(smallest)
    floor = lse.abs().add_(1).mul_(64 * eps)  # the rounding of LSE_t - LSE_0, at y = 0
    iterations = torch.zeros(live.shape, dtype=torch.int32, device=live.device)
    for steps in cg_steps:
        live = live & ~within_goal(gradient_norm, spread_sq)
        iterations.add_(live)
        rhs = torch.where(live.unsqueeze(-1), gradient, 0.0).to(low)  # rows at their goal: no step
        direction = _conjugate_gradient(A_low, At_low, alpha, p.to(low), rhs, steps, tiny).to(dtype)
        a_direction = torch.bmm(direction, At)  # A dy
        dots = torch.matmul(torch.stack((gradient, m, y, direction), dim=-2), direction.unsqueeze(-1))
        increase = torch.matmul(torch.matmul(dots.squeeze(-1), weights), powers).permute(2, 0, 1)
        trial = torch.addcmul(theta, t.view(-1, 1, 1, 1), a_direction)  # every trial step at once
        lse_change = trial.sub_(lse.unsqueeze(-1)).exp_().sum(-1).clamp_min_(smallest).log_()
        gain = increase - lse_change  # the increase of (R-D) less Armijo's, per trial step
        gain[0].masked_fill_(dots[..., 0, 0] <= floor, 0.0)  # g^T dy below the rounding: the full step
        taken = ((gain >= 0) * t.view(-1, 1, 1)).amax(0).unsqueeze(-1)  # the longest accepted step; 0 if none
        y = torch.addcmul(y, taken, direction)
        theta = torch.addcmul(theta, taken, a_direction)
        p, lse = newton_cg._softmax_and_lse(theta)
        u_minus_p = u - p
        spread = torch.bmm(u_minus_p, A)  # A^T (u - p)
        gradient = torch.sub(spread, y, alpha=1.0 / alpha)
        gradient_sq, spread_sq = _dot(gradient, gradient, zero), _dot(spread, spread, zero)
        gradient_norm = gradient_sq.sqrt()
    # ||lambda_hat|| = alpha ||z + T^T (u - p)||, the objective (R-D) and the rows still above their goal
    lambda_sq = torch.add(evidence_sqnorm, _dot(logits, u_minus_p, zero), alpha=2).add_(spread_sq)
    lambda_norm = lambda_sq.clamp_min_(0).sqrt_().mul_(alpha)
    live = live & (torch.sub(gradient_norm, lambda_norm, alpha=rtol * goal_scale) > atol * goal_scale)
    y_dot_m, y_sq = _dot(y, m, zero), _dot(y, y, zero)
    objective = torch.sub(y_dot_m, y_sq, alpha=0.5 / alpha).sub_(lse)
    deviation = spread_sq.sqrt().mul_(alpha)
    return (y, theta, p, gradient, gradient_sq, objective, y_dot_m, y_sq, lambda_norm, deviation, iterations,
            live, initial_norm)


def solve_tile(work, active, rtol, atol, max_iter, out):
    """A tile by the fixed schedule, then the adaptive iterations of :mod:`probe.solver` for the problems
    not yet within their goal, if any (one read of the host); its :class:`probe.solve.problems.DualSolution`,
    written into ``out``."""
    constants = _cached_constants(float(work.alpha), TRIAL_STEPS, work.A.dtype, work.A_low.dtype, work.A.device)
    *fields, iterations, live, initial_norm = fixed_newton(
        work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm, active,
        float(work.alpha), float(rtol), float(atol), constants=constants)
    state = newton_cg._State(*fields)
    if out is None:
        g_count, m, n = work.base.shape
        out = empty_solution(g_count, m, n, work.base.dtype, work.base.device)
    if not bool(live.any()):
        return newton_cg._finish(work, state, active, rtol, atol, iterations, out)
    return newton_cg._adaptive(work, state, iterations, live, initial_norm, active, rtol, atol,
                            max_iter - len(CG_STEPS), out)
