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

The quantities derived from a solution and their certificates, which follow from this one, are in
:mod:`probe.solve.second_order` (the second-order prediction) and :mod:`probe.solve.derived` (attention and
output deviations).
"""

from __future__ import annotations

import torch

from probe.solve import fixed, native, newton_cg, tiles
from probe.solve.gram import factor_gram, used_columns
from probe.solve.newton_cg import Progress, WorkingSet, conjugate_gradient, forcing_floor, hessian_times
from probe.solve.parallel import call_compiled, cpu_workers, run_all
from probe.solve.problems import DualProblems, DualSolution, duality_gap_reduced

__all__ = ["DualProblems", "DualSolution", "solve_dual", "duality_gap_reduced", "factor_gram", "solve_spd_reduced"]


def _solve_tile(work: WorkingSet, active, rtol, atol, max_iter, out) -> bool:
    """Newton-CG on every active problem of a tile, written into ``out`` (views of the tile in the call's
    output, which then needs no copy); returns whether the inactive problems are written too.

    On a CPU the compiled kernel (:mod:`probe.solve.native`) solves and certifies the tile; the adaptive
    iterations of :mod:`probe.solve.newton_cg` continue from its iterates the problems it left above their
    goal (one read of the host).  Elsewhere (or without it) the fixed schedule of :mod:`probe.solve.fixed`
    runs first, with no host synchronisation, and the adaptive iterations only for the problems it leaves.

    All operations are row-wise, so a problem's iterates do not depend on the rest of the batch, up to
    the rounding of the batched products (which may group their sums differently for other shapes).
    With a float64 direction that rounding stays at 1e-16; with a float32 direction it perturbs the
    Newton steps, and the final iterates of the same problem in two batches agree within their
    certificates (not bit for bit).
    """
    y = native.newton_tile(work, active, rtol, atol, max_iter, forcing_floor(work.A_low.dtype), out)
    if y is not None:
        left = active & ~out.converged
        remaining = max_iter - int(out.iterations.max())
        if remaining > 0 and bool(left.any()):
            newton_cg.continue_rows(work, y, left, out.iterations, active, rtol, atol, remaining, out)
        return True
    if fixed.applies(max_iter):  # the fixed schedule, then what remains
        fixed.solve_by_schedule(work, active, rtol, atol, max_iter, out)
        return False
    iterations = torch.zeros(active.shape, dtype=torch.int32, device=active.device)
    newton_cg.adaptive(work, Progress(work.initial_state(), iterations, active.clone()), active, rtol, atol,
                       max_iter, out)
    return False


def _check(problems: DualProblems, dtype: torch.dtype, direction_dtype: torch.dtype) -> None:
    """A one-line ``ValueError`` for arguments :func:`solve_dual` cannot solve."""
    if problems.alpha <= 0:
        raise ValueError(f"alpha must be positive, got {problems.alpha}")
    if not (dtype.is_floating_point and direction_dtype.is_floating_point):
        raise ValueError(f"dtype and direction_dtype must be floating point, got {dtype} and {direction_dtype}")
    if problems.gram is None and problems.factor is None:
        raise ValueError("DualProblems needs its templates: gram, factor, or both")
    n_groups, m, n = problems.logits.shape
    gram_ok = problems.gram is None or problems.gram.shape == (n_groups, n, n)
    factor_ok = problems.factor is None or (problems.factor.dim() == 3 and problems.factor.shape[:2] == (n_groups, n))
    if (
        not (gram_ok and factor_ok)
        or problems.log_preference.shape != problems.logits.shape
        or problems.evidence_sqnorm.shape != (n_groups, m)
    ):
        shape = lambda tensor: None if tensor is None else tuple(tensor.shape)  # noqa: E731
        raise ValueError(
            f"inconsistent shapes: gram {shape(problems.gram)}, factor {shape(problems.factor)}, "
            f"logits {tuple(problems.logits.shape)}, log_preference {tuple(problems.log_preference.shape)}, "
            f"evidence_sqnorm {tuple(problems.evidence_sqnorm.shape)}"
        )


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
    r"""Solve every dual problem in ``problems`` (eq. (D) of the module docstring, reduced to (R-D)) and
    certify each answer.

    Runs on the device of the templates (``problems.gram``, else ``problems.factor``).  Problems are
    processed in tiles of whole groups (or slices of a group) whose working set stays within
    :func:`probe.solve.tiles.tile_bytes` (on a CPU, about its cache; on a GPU, a share of its free memory)
    and within ``memory_budget_bytes``.  Beyond its inputs, the solver holds one tile's working set and its
    outputs.  On a CPU the compiled kernel (:mod:`probe.solve.native`) solves each tile; elsewhere the fixed
    schedule of :mod:`probe.solve.fixed` runs first, with no host synchronisation; the adaptive iterations
    of :mod:`probe.solve.newton_cg` take the problems either leaves.  A problem stops as soon as its
    certificate holds.

    Args:
        problems: the problems, with their templates as ``gram``, ``factor`` or both (:class:`DualProblems`).
        rtol: relative tolerance: a problem is ``converged`` where its certified ``error_bound`` on
            :math:`\hat\lambda` is at most ``rtol * lambda_norm + atol``.
        atol: absolute tolerance, for problems whose :math:`\hat\lambda` is near 0.
        max_iter: Newton iterations allowed per problem; those not certified by then come back with
            ``converged`` false and their honest certificate.
        dtype: the precision of the gradient, the line search and the certificate (float64).
        direction_dtype: the precision of the Newton directions (the conjugate-gradient solves, most of the
            work).  float32 (the default, the faster) changes how a problem gets to its answer, not what is
            certified about it; float64 gives answers that do not depend on the rest of the batch beyond
            1e-16 rounding.  The compiled kernel runs for float64 with float32 directions.
        memory_budget_bytes: a bound on the tiles' working sets together; ``None``: the device's tile size.
            With a budget, fewer workers run where their tiles would not fit in it together.
        workers: on a CPU, how many tiles are solved at a time, each by a thread of its own with one intra-op
            thread (:mod:`probe.solve.parallel`); default the intra-op thread count; 0: one after another in
            this thread.  The tiles, and so the answers, do not depend on it.

    Returns:
        A :class:`DualSolution`: per problem the certified answer, its certificate and ``correction``
        (:math:`A^\top\hat c`, in the coordinates of the factor).  Inactive problems are NaN.
    """
    _check(problems, dtype, direction_dtype)
    device = problems.device
    n_groups, m, n = problems.logits.shape
    if m == 0 or n_groups == 0 or n == 0:
        width = 0 if problems.factor is None else problems.factor.shape[-1]
        return tiles.empty_solution(n_groups, m, n, width, dtype, device)
    if problems.factor is None:
        factor = factor_gram(problems.gram.to(dtype))
    else:
        factor = problems.factor.to(device=device, dtype=dtype)
    width = factor.shape[-1]
    kept = used_columns(factor)  # zero columns (a rank-deficient G in every group) do nothing
    dropped = not bool(kept.all())
    if dropped:
        factor = factor[..., kept]
    out = tiles.empty_solution(n_groups, m, n, factor.shape[-1], dtype, device)
    factor_low = factor if direction_dtype == dtype else factor.to(direction_dtype)

    # The tiles depend on the shapes and the budget only, not on ``workers``: a problem's answer is the
    # same whichever number of threads solves the batch.
    planned, workers = tiles.plan_tiles(
        n_groups, m, n, device, dtype, fixed.runs(device, dtype, direction_dtype, max_iter), memory_budget_bytes,
        cpu_workers(device) if workers is None else max(0, workers))

    def solve(g0, g1, j0, j1):  # one tile, written into its own slice of ``out``
        inputs = tiles.tile_inputs(problems, g0, g1, j0, j1, dtype, device)
        active = inputs.active
        work = WorkingSet(factor[g0:g1], factor_low[g0:g1], inputs.logits, inputs.base, inputs.u,
                          inputs.evidence_sqnorm, problems.alpha)
        tile = DualSolution(**{name: value[g0:g1, j0:j1] for name, value in vars(out).items()})
        if _solve_tile(work, active, rtol, atol, max_iter, tile):
            return
        inactive = ~active
        for name, target in vars(tile).items():  # inactive problems: NaN (iterations 0), with no host read
            if name != "converged":
                mask = inactive.unsqueeze(-1) if target.dim() == 3 else inactive
                target.masked_fill_(mask, 0 if name == "iterations" else float("nan"))

    run_all([lambda tile=tile: solve(*tile) for tile in planned], workers)
    if dropped:  # the correction in every column of the given factor (0 in the dropped ones; NaN if inactive)
        full = out.correction.new_zeros(n_groups, m, width)
        full[..., kept] = out.correction
        out.correction = full.masked_fill_(out.lambda_norm.isnan().unsqueeze(-1), float("nan"))
    return out


def solve_spd_reduced(
    factor: torch.Tensor, weights: torch.Tensor, rhs: torch.Tensor, alpha: float, rtol: float | torch.Tensor = 1e-12,
    max_iter: int | None = None, residual: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Solve :math:`(I/\alpha + A^\top(\mathrm{diag}\,w - ww^\top)A)\,x = b` for every row, in float64.

    The negated Hessian of (R-D) with :math:`p` replaced by the distribution ``weights`` :math:`w`
    (``(g, m, n)``, rows summing to 1, zeros allowed), for right-hand sides ``rhs`` ``(g, m, r)`` and the
    shared factor :math:`A` ``(g, n, r)`` of :func:`factor_gram`.  Solved by the Newton systems'
    batched CG (:func:`probe.solve.newton_cg.conjugate_gradient`, the same operator) with a Jacobi preconditioner, to relative
    residual ``rtol`` (a number, or one per row ``(g, m)``), at most ``max_iter`` steps (default
    ``4 r + 20``).  Rows with ``rhs = 0`` return 0.  (Unlike the Newton directions these systems are
    solved to near float64 precision, and the preconditioner saves steps where :math:`w` is spread out.)

    Returns ``(x, residual_norm)`` with :math:`\|b - Hx\|` recomputed from ``x`` (not CG's recursive
    residual), so that callers can certify their error: :math:`H \succeq I/\alpha` gives
    :math:`\|x - H^{-1}b\| \le \alpha\,\|b - Hx\|`.  ``residual=False``: ``(x, None)``, for callers
    that need none (:mod:`probe.solve.exact`'s backward pass).
    """
    f64 = torch.float64
    factor, weights, rhs = factor.to(f64), weights.to(f64), rhs.to(f64)
    mean = torch.bmm(weights, factor)  # A^T w, as rows
    diagonal = (torch.bmm(weights, factor * factor) - mean * mean).add_(1.0 / alpha).clamp_min_(1.0 / alpha)
    forcing = torch.as_tensor(rtol, dtype=f64, device=rhs.device).expand(rhs.shape[:-1])
    live = torch.ones(rhs.shape[:-1], dtype=torch.bool, device=rhs.device)
    steps = 4 * factor.shape[-1] + 20 if max_iter is None else max_iter
    x = call_compiled(conjugate_gradient, factor, float(alpha), weights, rhs.clone(), forcing, int(steps), live,
                      diagonal)
    if not residual:
        return x, None
    return x, (rhs - hessian_times(factor, alpha, weights, x)).norm(dim=-1)
