r"""The paper's second-order prediction :math:`\lambda_2` (:func:`second_order_point`) and its distance from the
exact optimum (:func:`second_order_deviation`), each with a certified bound on its numerical error.

Pure tensor math, with the conventions of :mod:`probe.solve.derived`: batched reduced quantities of
:class:`probe.solve.problems.DualProblems` and :class:`probe.solve.problems.DualSolution`, ``(g, m, ...)``,
float64 results ``(g, m)``, NaN on inactive rows; :math:`\varepsilon` is the solver's ``error_bound`` and
``lambda_norm`` :math:`= \|\hat\lambda\|`.

Second-order prediction (:func:`second_order_point`, :func:`second_order_deviation`)
---------------------------------------------------------------------------------------
Linearising the optimality condition :math:`\lambda = \alpha(\mu + z - T^\top p(\lambda))` at
:math:`\lambda = 0`, where :math:`p(\lambda) \approx u + W T\lambda` with :math:`W = \mathrm{diag}\,u -
uu^\top` (:math:`u` the normalised preference), gives the paper's second-order prediction

.. math::  \lambda_2 = \alpha (I + \alpha\Sigma_u)^{-1} z, \qquad
           \Sigma_u = \textstyle\sum_i u_i t_i t_i^\top - \mu\mu^\top = T^\top W T .

For fixed :math:`z`, :math:`\lambda^* - \alpha z = O(\alpha^2)` and :math:`\lambda^* - \lambda_2 = O(\alpha^3)`.
In the pipeline's convention (the model's logits :math:`\alpha s` fixed, :math:`z \propto 1/\alpha`) the
expansion is in the size of the logits instead: as :math:`\alpha \to 0`, :math:`\lambda^* - \lambda_2 =
\alpha(\mu - T^\top p_{att} + \Sigma_u \alpha z) + O(\alpha^2)` is of the same order as
:math:`\lambda^* - \alpha z` unless the model's logits are small (the tests check both).

*Reduced form.*  With :math:`T^\top = VA^\top` (:math:`V` orthonormal, :math:`G = AA^\top`, the solver's
factor), :math:`\Sigma_u = VKV^\top` with :math:`K = A^\top W A`, and :math:`\Sigma_u z = VA^\top W s`
(:math:`s = Tz = AV^\top z`, the solver's logits).  Since :math:`(I + \alpha VKV^\top)^{-1}V = V(I +
\alpha K)^{-1}`,

.. math::  \lambda_2 - \alpha z = -\alpha^2 (I + \alpha\Sigma_u)^{-1}\Sigma_u z = -\alpha\,V x, \qquad
           H x = b, \quad H = I/\alpha + A^\top W A, \quad b = A^\top W s ,

an :math:`r \times r` SPD system per row (:math:`r = \mathrm{rank}\,G`) whose matrix is the solver's
Newton matrix at :math:`p = u`.  :func:`second_order_point` returns :math:`y_2 = -\alpha\hat x`, the
prediction's correction to :math:`\alpha z` in the basis :math:`V`: :math:`\hat\lambda_2 = \alpha z +
Vy_2`, in the coordinates of the solver's :math:`\hat\lambda - \alpha z = VA^\top\hat c`.

*Solving the systems.*  :math:`H = H_u` depends on the row only through :math:`u`.  Rows of a group with
bitwise equal :math:`u` form a class that shares one :math:`H_u`: every row of an example when the
preference is uniform over its real keys (BERT-like models, and T5's cross-attention), every head of a
query under a causal mask without position bias.  A class of at least
:func:`_direct_min_rows` rows (the size above which it is cheaper) is solved directly: :math:`H_u` is
formed (:math:`nr^2`), Cholesky-factored and inverted (:math:`r^3`) once, with an :math:`n \times r` map
:math:`M` of the logits and the rounding :math:`D = B - MH_u` of it (:func:`_solve_direct`); then each row
costs one product of its logits with :math:`M`, which gives :math:`\hat x`, and one pass over them, which
bounds its residual :math:`b - H_u\hat x = D^\top s` by :math:`\sum_i |s_i|\,\|D_i\|` (the triangle
inequality over the rows :math:`D_i` of :math:`D`), instead of a CG run of :math:`\sim 2 \cdot` 5 to 12
products with :math:`A` (:math:`nr` each) and the two products with :math:`A` of a residual.  A class of
few rows (a selection's few queries of a head) skips :math:`M` and :math:`D` (:math:`2nr^2`): each row's
:math:`b = B^\top s` (:math:`nr`) is solved with the Cholesky factor and its residual :math:`b - H_u\hat x`
formed with :math:`H_u` (:math:`3r^2`; :func:`_direct_by_rows` chooses by these counts).  Rows whose
:math:`u` is uniform over an interval of keys of their own (a causal mask's prefix, a sliding window) get
their own :math:`H_u`, factored once per interval for the heads that share it, where :func:`_intervals_pay`
finds that cheaper than CG (:func:`_solve_intervals`): on a CPU by compiled code that moves a window of keys
along each group (``probe/solve/intervals.c``, one rank-one update per key that enters or leaves it),
elsewhere from prefix sums over the keys at the intervals' bounds.  Their residual is recomputed with
:math:`A`.  Other rows with their own :math:`u` (T5's position bias) and the
rest go to the batched CG of :func:`probe.solve.dual.solve_spd_reduced`, whose residual is recomputed from
:math:`\hat x` with :math:`A`.  Columns of :math:`A` that are zero in every group (null eigenvalues of :math:`G`, e.g.
beyond the :math:`d'` dimensions of the key space) are dropped first: they contribute
:math:`x_k/\alpha` to :math:`Hx` and nothing to :math:`b`, so :math:`x_k = 0` exactly.  Whichever way
:math:`\hat x` was found, the bound below uses its residual (or the bound on it), so no path needs to be
trusted: a row whose residual is above its tolerance after the direct solve (or whose factorisation fails)
is handed to CG.

*Tolerance.*  A row is done at :math:`\|\rho\| \le` ``rtol`` :math:`\|b\|`, or earlier at
``error_target`` :math:`/\alpha^2` when given.  The pipeline (:func:`probe.batch.rows.derive`) passes a tenth
of the solver's tolerance, :math:`\varepsilon_2 \le 0.1\,\mathrm{rtol}\,\|\hat\lambda\|` (:math:`10^{-10}`
by default): the second-order deviation is then resolved like rel_deviation, its bound below being
dominated by the solver's own :math:`\varepsilon \le \mathrm{rtol}\,\|\hat\lambda\|`.  Two second-order solutions, to any tolerances, differ by
at most the sum of their :math:`\varepsilon_2`.

*Error of* :math:`\lambda_2`.  For the residual :math:`\rho = b - H\hat x`, :math:`\hat x - x =
-H^{-1}\rho`, and :math:`H \succeq I/\alpha` bounds :math:`\|H^{-1}\| \le \alpha`, so

.. math::  \|\hat\lambda_2 - \lambda_2\| = \alpha\|\hat x - x\| \le \alpha^2\|\rho\| =: \varepsilon_2 .

(The direct solve's residual comes from the formed :math:`H_u` and :math:`b`, whose rounding is that of
the final products.)

*Deviation.*  :math:`\hat\lambda - \hat\lambda_2 = V(A^\top\hat c - y_2)` (the solver returns
:math:`A^\top\hat c`, formed with its certificate), so the computed value is :math:`\hat v = \|A^\top\hat c - y_2\| / \|\hat\lambda\|`.  Its numerator is within
:math:`\delta = \varepsilon + \varepsilon_2` of :math:`\|\lambda^* - \lambda_2\|` and its denominator
within :math:`\varepsilon` of :math:`\|\lambda^*\|`; the worst case over both intervals is

.. math::  |\hat v - v| \le \frac{\varepsilon + \varepsilon_2 + \hat v\,\varepsilon}{\|\hat\lambda\| - \varepsilon}
           \quad (\infty \text{ if } \|\hat\lambda\| \le \varepsilon) .
"""

from __future__ import annotations

import math

import torch

from probe.solve import native
from probe.solve.dual import solve_spd_reduced
from probe.solve.gram import used_columns
from probe.solve.newton_cg import hessian_times
from probe.solve.problems import row_dot, shares_rows

__all__ = ["second_order_point", "second_order_deviation"]

_F64 = torch.float64
_NAN = float("nan")


def second_order_point(
    factor: torch.Tensor,
    logits: torch.Tensor,
    log_preference: torch.Tensor,
    alpha: float,
    active: torch.Tensor | None = None,
    *,
    rtol: float = 1e-12,
    error_target: torch.Tensor | None = None,
    direct_min_rows: int | None = None,
    direct_rows: bool | None = None,
    intervals: bool | None = None,
    memory_budget_bytes: int = 1 << 29,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The paper's second-order prediction :math:`\lambda_2 = \alpha(I + \alpha\Sigma_u)^{-1}z` in reduced
    form, :math:`\lambda_2 = \alpha z + V y_2` with :math:`y_2 = -\alpha x`, :math:`H_u x = A^\top W s`
    (module docstring, "Second-order prediction").

    The systems are solved directly where rows share their preference (one factorisation of :math:`H_u`
    per class of rows with bitwise equal :math:`u` in a group, then two products per row), by one
    factorisation per interval where rows are uniform over intervals of keys of their own and that is cheaper,
    and by CG elsewhere; either way :math:`\varepsilon_2` comes from the residual recomputed from :math:`\hat x`
    (module docstring, "Solving the systems").

    Args:
        factor: :math:`A` with :math:`AA^\top = G`, ``(g, n, r)``, from :func:`probe.solve.gram.factor_gram`.
        logits: the solver's logits :math:`s = Tz`, ``(g, m, n)`` (the pipeline's :math:`s/\alpha`).
        log_preference: :math:`\log u` up to a constant per row, ``-inf`` for excluded keys, ``(g, m, n)``.
        alpha: strength :math:`\alpha > 0`.
        active: rows to compute, ``(g, m)`` bool, ``None`` for all.
        rtol: relative residual :math:`\|b - H\hat x\| \le` ``rtol`` :math:`\|b\|` that every row reaches
            (CG stops there; the bound is certified whatever it reaches).
        error_target: ``(g, m)``, optional: a row may stop earlier, once :math:`\varepsilon_2 \le`
            ``error_target`` (the pipeline passes a tenth of the solver's tolerance on
            :math:`\|\hat\lambda\|`).
        direct_min_rows: classes of at least this many rows sharing :math:`u` are solved directly, the
            others by CG; ``None``: by the cost model of :func:`_direct_min_rows`.  (1: every row
            directly; more than ``m``: every row by CG.)
        direct_rows: whether a class solved directly solves its rows one by one with the Cholesky factor of
            :math:`H_u` (few rows) or forms :math:`M` and :math:`D` for them (many); ``None``: by the cost
            model of :func:`_direct_by_rows`.
        intervals: whether the rows left by those classes whose :math:`u` is uniform over an interval of keys (a
            causal mask, a sliding window) are solved by factorising their own :math:`H_u`
            (:func:`_solve_intervals`), before CG takes the rest; ``None``: where the cost model of
            :func:`_intervals_pay` says so.
        memory_budget_bytes: rows are processed in tiles of about this working-set size.

    Returns:
        ``(point, error)``: :math:`y_2 = V^\top(\hat\lambda_2 - \alpha z)` ``(g, m, r)``, in the
        coordinates of ``factor``'s columns (0 in its zero columns), and the certified bound
        :math:`\varepsilon_2 = \alpha^2\|b - H\hat x\| \ge \|\hat\lambda_2 - \lambda_2\|` ``(g, m)``; NaN on
        inactive rows.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    factor = factor.to(_F64)
    used = _used_columns(factor)
    a = factor if used is None else factor[..., used]
    device = factor.device
    g_count, m, n = logits.shape
    log_pref = log_preference.to(device=device).expand(g_count, m, n)
    # rows that share their preference by construction (a view: BERT-like models' masks) share u, its
    # support and one class per group, all found from the group's first row
    shared = shares_rows(log_pref)
    if error_target is not None:
        error_target = error_target.to(device=device, dtype=_F64).expand(g_count, m)
    if direct_min_rows is None:
        direct_min_rows = _direct_min_rows(n, a.shape[-1])

    x = torch.zeros(g_count, m, a.shape[-1], dtype=_F64, device=device)
    residual = torch.zeros(g_count, m, dtype=_F64, device=device)
    computed = torch.zeros(g_count, m, dtype=torch.bool, device=device)
    bytes_per_row = 16 * n * 8  # about 16 live (m, n)-sized float64 tensors in the CG
    # each tile's rows are converted and checked as it comes (whole sites of long contexts are gigabytes)
    for g0, g1, j0, j1 in _tiles(g_count, m, max(1, memory_budget_bytes // bytes_per_row)):
        tile_logits, u, live, tile_shared = _tile_inputs(
            logits[g0:g1, j0:j1].to(device=device), log_pref[g0:g1, j0:j1],
            None if active is None else active[g0:g1, j0:j1].to(device), shared,
        )
        computed[g0:g1, j0:j1] = live
        target = None if error_target is None else error_target[g0:g1, j0:j1]
        _second_order_tile(
            a[g0:g1], tile_logits, u, live, tile_shared, alpha, rtol, target, direct_min_rows, direct_rows, intervals,
            memory_budget_bytes, x[g0:g1, j0:j1], residual[g0:g1, j0:j1],
        )
    x.mul_(-alpha)  # y_2 = -alpha x
    if used is not None:
        x = torch.zeros(g_count, m, factor.shape[-1], dtype=_F64, device=device).index_copy_(
            -1, used.nonzero().squeeze(-1), x
        )
    error = residual.mul_(alpha**2)
    inactive = ~computed
    return x.masked_fill_(inactive.unsqueeze(-1), _NAN), error.masked_fill_(inactive, _NAN)


def _tile_inputs(logits, log_pref, active, shared):
    r"""A tile's logits (float64; 0 at excluded keys when any is not finite), :math:`u`, the rows to compute
    (``active`` and with an allowed key and finite inputs) and whether its rows share their preference.  Rows
    with no allowed key or non-finite inputs become a harmless uniform problem, so that no NaN enters the
    batched products (other inactive rows are computed with the rest, and masked at the end)."""
    g_count, m, n = logits.shape
    logits = logits.to(_F64)
    row_pref = (log_pref[:, :1] if shared else log_pref).to(_F64)
    support = row_pref > -torch.inf
    ok = support.any(-1)
    if not bool(torch.isfinite(torch.where(support, row_pref, 0.0).sum())):  # a finite sum has finite terms
        ok = ok & torch.isfinite(torch.where(support, row_pref, 0.0)).all(-1)
    if not bool(torch.isfinite(logits.sum())):
        logits = torch.where(support, logits, 0.0)  # whatever is stored at excluded keys plays no part
        ok = ok & torch.isfinite(logits).all(-1)
    ok = ok.expand(g_count, m)
    live = ok if active is None else ok & active
    if not bool(ok.all()):
        row_pref = row_pref.expand(g_count, m, n).masked_fill(~ok.unsqueeze(-1), 0.0)
        logits = logits.masked_fill(~ok.unsqueeze(-1), 0.0)
        shared = False
    return logits, torch.softmax(row_pref, dim=-1).expand(g_count, m, n), live, shared


#: cost of one CG solve per row in units of the n r multiply-adds of one product with A, fitted to the
#: measured crossovers (classes of k rows, n = r = 32 / 64 / 128 and n = 128, r = 32, CPU float64:
#: direct faster from k = 4 / 8 / 17 and 8); CG converges in a few steps on these well-conditioned systems
_CG_COST = 8


def _direct_min_rows(n: int, r: int) -> int:
    r"""The smallest class of rows sharing :math:`u` for which one factorisation (:math:`nr^2` to form
    :math:`H_u`, :math:`r^3/3` to factor it) costs less than CG on each of its rows."""
    if n == 0 or r == 0:
        return 1
    return max(1, math.ceil((n * r * r + r**3 / 3) / (_CG_COST * n * r)))


def _direct_by_rows(n: int, r: int, width: int) -> bool:
    r"""Whether a direct solve of classes of ``width`` rows costs less row by row (each row's :math:`B^\top s`,
    two triangular solves and :math:`H_u\hat x`: :math:`nr + 3r^2`) than through :math:`M` and :math:`D`
    (:math:`2nr^2` and the inverse's :math:`r^3/3` per class, then :math:`nr + n` a row)."""
    return width * (3 * r * r - n) < 2 * n * r * r + r**3 / 3


def _intervals_pay(n: int, r: int, sharing: float, rows_per_group: float, compiled: bool = False) -> bool:
    r"""Whether rows with their own interval of keys cost less by a factorisation per interval
    (:func:`_solve_intervals`) than by CG (:data:`_CG_COST` products with :math:`A` a row, and the residual's
    two), in multiply-adds: the residual's two products (:math:`2nr` a row) and, per interval of ``sharing``
    rows (the heads that share a query's mask), the factorisation's :math:`r^3/3`.  In torch (``compiled``
    false) the factorisation runs at about a fifth of the products' rate on these small matrices, with some
    :math:`16r^2` of passes over its matrices, and the prefix sums cost :math:`nr^2` per group of
    ``rows_per_group`` rows; the compiled code (:func:`probe.solve.native.interval_solve`) factorises at about
    the products' rate, with a few :math:`r^2` passes, and its window's rank-one updates cost :math:`nr^2/2` per
    group.  Measured on a CPU at :math:`r = 64`: in torch a full causal run pays from about 1,000 keys; compiled,
    from 128 keys where 3 heads share a mask (10 µs a row against CG's 17), and at 1,024 keys with one row an
    interval (69 µs against 109)."""
    cg = (_CG_COST + 2) * n * r
    if compiled:
        return cg > 2 * n * r + (r**3 / 3 + 4 * r * r) / sharing + n * r * r / (2 * rows_per_group)
    return cg > 2 * n * r + (5 * r**3 / 3 + 16 * r * r) / sharing + n * r * r / rows_per_group


def _used_columns(factor):
    r"""The columns of the factor that are nonzero in some group, ``(r,)`` bool, or ``None`` when all are
    (:func:`probe.solve.gram.factor_gram` zeroes those of null eigenvalues): the others add :math:`x_k/\alpha`
    to :math:`Hx` and nothing to :math:`b`, so :math:`x_k = 0` exactly and they can be dropped."""
    used = used_columns(factor)
    return None if bool(used.all()) else used


def _second_order_tile(a, s, u, live, shared, alpha, rtol, target, direct_min_rows, direct_rows, intervals,
                       memory_budget_bytes, x, residual):
    r"""Solve one tile's systems :math:`H_u x = b` into ``x`` ``(g, m, r)``, with :math:`\|b - H_u\hat x\|`
    into ``residual``: the direct solve on classes of rows sharing :math:`u`, then (with ``intervals``) the rows
    whose :math:`u` is uniform over an interval of keys by their own factorisations, then CG on the live rows
    left (and on any row the direct solves leave above its tolerance).  ``shared``: every row of a group
    has the group's :math:`u` (by construction)."""
    if not a.shape[-1]:  # no templates to speak of: x is empty and lambda_2 = alpha z exactly
        return
    if target is None:
        tolerance = torch.zeros_like(residual)
    else:
        tolerance = torch.nan_to_num(target / alpha**2, nan=0.0)  # on ||b - H x||
    solved = _solve_direct(a, u, s, live, shared, alpha, direct_min_rows, direct_rows, x, residual,
                           memory_budget_bytes)
    if not bool((live & ~(solved & (residual <= tolerance))).any()):
        return
    # rows above their error target, or not solved: the right-hand sides, for rtol ||b|| and for CG
    rhs = torch.bmm(_centred(u, s), a)  # b = A^T W s
    rhs_norm = rhs.norm(dim=-1)
    tolerance = torch.maximum(tolerance, rtol * rhs_norm)
    pending = live & ~(solved & (residual <= tolerance))
    if intervals is not False and bool(pending.any()):
        pending = pending & ~_solve_intervals(a, u, rhs, tolerance, pending, alpha, x, residual, memory_budget_bytes,
                                              always=bool(intervals))
    if bool(pending.any()):
        _solve_cg(a, u, rhs, rhs_norm, tolerance, pending, live, alpha, rtol, x, residual)


def _solve_intervals(a, u, rhs, tolerance, pending, alpha, x, residual, memory_budget_bytes, always=False):
    r"""Solve :math:`H_u x = b` for the ``pending`` rows whose :math:`u` is uniform over an interval of keys
    :math:`[l, h]` (causal masks and sliding windows, with or without padding), by factorising :math:`H_u` once
    per interval (for the rows of every head that share it); writes :math:`\hat x` and :math:`\|b - H_u\hat
    x\|` into ``x`` and ``residual`` for the rows it solves to ``tolerance``, and returns them ``(g, m)``.

    With :math:`k = h - l + 1` keys, :math:`H_u = I/\alpha + S/k - \bar a\bar a^\top` for :math:`S =
    \sum_{i=l}^{h} a_i a_i^\top` and :math:`\bar a = \frac1k\sum_{i=l}^{h} a_i`, then one Cholesky
    factorisation (:math:`r^3/3`), against CG's two products with :math:`A` (:math:`2nr`) per step and row.
    On a CPU the compiled code forms the sums over a window of keys moved along each group and factorises there
    (:func:`_intervals_compiled`); elsewhere they are differences of prefix sums over the keys
    (:func:`_interval_sums`: :math:`nr^2` per group, whatever its rows).
    The factor's rows are first shifted by their mean over the group's keys in use (:math:`H_u` and :math:`b`
    do not change; the sums cancel less).  Each row's residual is then recomputed with :math:`A` (two
    products, as CG's is), so the rounding of the sums costs accuracy, never the certificate: a row above
    its tolerance, or whose factorisation fails, is left to CG.  Unless ``always``, the rows are left to CG
    where :func:`_intervals_pay` says they cost less there."""
    n, r = a.shape[1], a.shape[2]
    support = u > 0
    count = support.sum(-1)
    first = support.to(torch.int8).argmax(-1)
    last = n - 1 - support.flip(-1).to(torch.int8).argmax(-1)
    uniform = ((u == u.gather(-1, first.unsqueeze(-1))) | ~support).all(-1)
    chosen = pending & uniform & (count > 0) & (last - first + 1 == count)
    if not bool(chosen.any()):
        return torch.zeros_like(pending)
    in_use = support.any(1).to(a.dtype)  # (g, n): the keys some row of the group uses
    shifted = a - torch.bmm(in_use.unsqueeze(1), a) / in_use.sum(-1).clamp_min(1.0).reshape(-1, 1, 1)
    # the distinct intervals (sorted, so group-major), and the rows of each as a padded table
    group, row = chosen.nonzero(as_tuple=True)
    code = (group * (n + 1) + first[group, row]) * (n + 1) + last[group, row]
    code, inverse, counts = torch.unique(code, return_inverse=True, return_counts=True)
    groups_in = int(torch.unique_consecutive(group).numel())
    compiled = native.intervals_available(a)
    if not always and not _intervals_pay(n, r, len(group) / len(code), len(group) / groups_in, compiled):
        return torch.zeros_like(pending)
    table = _padded_members(inverse, counts)
    valid = table >= 0
    members = table[valid]  # the rows, interval by interval
    estimate = torch.zeros_like(x)
    if not (compiled and _intervals_compiled(shifted, code, (group[members], row[members]), counts, rhs, alpha,
                                             estimate)):
        _intervals_torch(shifted, code, (group, row), table, valid, rhs, alpha, estimate, memory_budget_bytes)
    solved = torch.zeros_like(chosen)
    solved[group[members], row[members]] = True
    misfit = _misfit(a, alpha, u, rhs, estimate, first, last)  # ||b - H_u x||, with A
    solved &= misfit <= tolerance
    x[solved] = estimate[solved]
    residual[solved] = misfit[solved]
    return solved


def _misfit(a, alpha, u, rhs, x, first, last, cache_bytes=4 << 20):
    r""":math:`\|b - H_u\hat x\|` ``(g, m)`` with the factor :math:`A` (:func:`probe.solve.newton_cg.hessian_times`),
    a few rows of every group at a time, so that the products' ``(g, rows, n)`` intermediates stay in cache, and
    over the keys from the first to the last that those rows' :math:`u` gives weight to (``first``, ``last``
    ``(g, m)``): the others add exact zeros (a causal prefix of consecutive queries spans half the keys on
    average)."""
    g_count, m, n = u.shape
    step = max(1, cache_bytes // (8 * n * max(1, g_count)))
    out = rhs.new_empty(g_count, m)
    for j0 in range(0, m, step):
        j1 = min(m, j0 + step)
        lo, hi = int(first[:, j0:j1].min()), int(last[:, j0:j1].max()) + 1
        keys = slice(lo, max(lo + 1, hi))
        out[:, j0:j1] = (rhs[:, j0:j1] - hessian_times(a[:, keys], alpha, u[:, j0:j1, keys], x[:, j0:j1])).norm(dim=-1)
    return out


def _intervals_compiled(a, code, rows, counts, rhs, alpha, estimate):
    r"""The factorisations of :func:`_solve_intervals` by the compiled code (:func:`probe.solve.native.interval_solve`,
    which moves a window of keys along each group instead of forming prefix sums), writing the rows of the
    intervals it factorised into ``estimate``; False where it does not run (the torch code then does).  ``rows``:
    ``(group, row)`` of each interval's rows, interval by interval; ``counts``: how many each has."""
    base = a.shape[1] + 1
    offset = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    result = native.interval_solve(a, code // base**2, code // base % base, code % base + 1, offset, rhs[rows], alpha)
    if result is None:
        return False
    x, factorised = result
    keep = factorised.repeat_interleave(counts)
    estimate[rows[0][keep], rows[1][keep]] = x[keep]
    return True


def _intervals_torch(a, code, rows, table, valid, rhs, alpha, estimate, memory_budget_bytes):
    r"""The factorisations of :func:`_solve_intervals` in torch, a chunk of intervals at a time: their sums from
    prefix sums (:func:`_interval_sums`), :math:`H_u`, its Cholesky factor, and the solves of their rows (``table``
    of indices into ``rows`` = ``(group, row)``, ``valid`` its real entries), written into ``estimate``."""
    n, r = a.shape[1], a.shape[2]
    group, row = rows
    eye = torch.eye(r, dtype=a.dtype, device=a.device) / alpha
    step = max(1, memory_budget_bytes // (8 * 4 * r * r))  # intervals at a time: their sums, H_u and factors
    for c0 in range(0, len(code), step):
        part = code[c0 : c0 + step]
        start, stop = part // (n + 1) % (n + 1), part % (n + 1) + 1
        total, outer = _interval_sums(a, part // (n + 1) ** 2, start, stop)
        k = (stop - start).to(a.dtype).reshape(-1, 1)
        mean = total.div_(k)
        hessian = outer.div_(k.unsqueeze(-1)).sub_(mean.unsqueeze(-1) * mean.unsqueeze(-2)).add_(eye)
        cholesky, info = torch.linalg.cholesky_ex(hessian)
        members, ok = table[c0 : c0 + step], valid[c0 : c0 + step] & (info == 0).unsqueeze(-1)
        picked = members.clamp_min(0)
        rows_in = torch.where(ok.unsqueeze(-1), rhs[group[picked], row[picked]], 0.0)  # (C, width, r)
        solution = torch.cholesky_solve(rows_in.transpose(1, 2), cholesky).transpose(1, 2)
        estimate[group[members[ok]], row[members[ok]]] = solution[ok]


def _interval_sums(a, group, start, stop, piece=32):
    r""":math:`\sum_i a_i` ``(C, r)`` and :math:`\sum_i a_i a_i^\top` ``(C, r, r)`` over the keys
    ``start`` :math:`\le i <` ``stop`` of group ``group`` of ``a`` ``(g, n, r)``, for each of C intervals (sorted
    by group): differences of the group's prefix sums at those bounds.  The prefix sums of the outer products
    are formed at the bounds only: one product :math:`A^\top A` over the keys before a group's first bound, then
    the products :math:`A_k^\top A_k` of the pieces :math:`A_k` of keys between consecutive bounds (cut at
    multiples of ``piece``), added up in order: :math:`nr^2` per group whatever the intervals."""
    present, local = torch.unique_consecutive(group, return_inverse=True)
    a = a[present]
    g_count, n, r = a.shape
    prefix = torch.cat([a.new_zeros(g_count, 1, r), a.cumsum(1)], 1)  # prefix[:, b]: over the keys before b
    total = prefix[local, stop] - prefix[local, start]
    marks = torch.zeros(g_count, n + 1, dtype=torch.bool, device=a.device)
    marks[local, start] = True
    marks[local, stop] = True
    marks[:, 0] = False  # no piece ends before the first key
    position = torch.arange(n + 1, device=a.device)
    first = marks.to(torch.int8).argmax(-1, keepdim=True)  # each group's first bound (stop >= 1: there is one)
    marks |= (position % piece == 0) & (position > first)
    piece_group, end = marks.nonzero(as_tuple=True)  # each piece's group and (exclusive) end, group-major
    counts = torch.bincount(piece_group, minlength=g_count)
    rank = torch.arange(len(end), device=a.device) - (counts.cumsum(0) - counts)[piece_group]  # within its group
    sums = a.new_empty(g_count, int(counts.max()), r, r)
    before = a * (position[:-1] < first).unsqueeze(-1)  # the keys before each group's first bound
    sums[:, 0] = torch.bmm(before.transpose(1, 2), before)
    later = (rank > 0).nonzero().squeeze(-1)
    if len(later):
        begin, finish, which = end[later - 1], end[later], piece_group[later]
        keys = begin.unsqueeze(-1) + torch.arange(int((finish - begin).max()), device=a.device)
        blocks = a[which.unsqueeze(-1), keys.clamp_max(n - 1)] * (keys < finish.unsqueeze(-1)).unsqueeze(-1)
        sums[which, rank[later]] = torch.bmm(blocks.transpose(1, 2), blocks)
    sums[torch.arange(sums.shape[1], device=a.device) >= counts.unsqueeze(-1)] = 0.0  # a shorter group's tail
    for k in range(1, sums.shape[1]):  # sums[:, k]: over the keys before the end of piece k
        sums[:, k].add_(sums[:, k - 1])  # (torch's cumsum along this axis is several times slower)
    at = torch.zeros(g_count, n + 1, dtype=torch.long, device=a.device)
    at[piece_group, end] = rank
    outer = sums[local, at[local, stop]]
    later = (start > 0).nonzero().squeeze(-1)  # intervals that do not start at the first key
    if len(later):
        outer[later] -= sums[local[later], at[local[later], start[later]]]
    return total, outer


#: CG's working set per row and key, in bytes: about 16 float64 tensors shaped like the rows' preferences
_CG_ROW_BYTES = 16 * 8


def _solve_cg(a, u, rhs, rhs_norm, tolerance, pending, live, alpha, rtol, x, residual):
    """CG (:func:`probe.solve.dual.solve_spd_reduced`, its residual recomputed with the factor) on the
    ``pending`` rows, gathered to the front of the groups that have one; writes into ``x`` and
    ``residual``."""
    if bool((pending | ~live).all()):  # every live row: solve in place
        row_rtol = torch.where(rhs_norm > 0, tolerance / rhs_norm, rtol)
        _cg_in_pieces(a, u, rhs, alpha, row_rtol, x, residual)
        return
    count = pending.sum(-1)
    groups = count.nonzero().squeeze(-1)
    rows = torch.argsort((~pending[groups]).to(torch.int8), dim=-1, stable=True)[:, : int(count.max())]
    valid = pending[groups].gather(1, rows)
    pick = (groups.unsqueeze(-1), rows)
    rhs_norm = rhs_norm[pick]
    row_rtol = torch.where(rhs_norm > 0, tolerance[pick] / rhs_norm, rtol)
    rhs_pending = torch.where(valid.unsqueeze(-1), rhs[pick], 0.0)  # padding rows: nothing to solve
    x_cg, residual_cg = torch.empty_like(rhs_pending), rhs_pending.new_empty(rhs_pending.shape[:-1])
    _cg_in_pieces(a[groups], u[pick], rhs_pending, alpha, row_rtol, x_cg, residual_cg)
    index = (groups.unsqueeze(-1).expand_as(rows)[valid], rows[valid])
    x[index] = x_cg[valid]
    residual[index] = residual_cg[valid]


def _cg_in_pieces(a, u, rhs, alpha, row_rtol, x, residual, cache_bytes=16 << 20):
    """:func:`probe.solve.dual.solve_spd_reduced` on a few rows of every group at a time, so that CG's working
    set stays in cache (0.65 to 0.7 of the time of whole tiles on a CPU, at 128 and 1,024 keys); writes
    into ``x`` ``(g, m, r)`` and ``residual`` ``(g, m)``."""
    g_count, m, n = u.shape
    step = max(1, cache_bytes // (_CG_ROW_BYTES * n * max(1, g_count)))
    for j0 in range(0, m, step):
        rows = slice(j0, min(m, j0 + step))
        x[:, rows], residual[:, rows] = solve_spd_reduced(a, u[:, rows], rhs[:, rows], alpha, row_rtol[:, rows])


def _solve_direct(a, u, s, live, shared, alpha, min_rows, by_rows, x, residual, memory_budget_bytes):
    r"""Solve :math:`H_u x = b` by one factorisation per class of at least ``min_rows`` live rows of a group
    with bitwise equal :math:`u`, writing :math:`\hat x` into ``x`` and :math:`\|b - H_u\hat x\|` into
    ``residual``; returns the rows solved ``(g, m)``.

    With the centred factor :math:`A_c = A - \mathbf{1}(A^\top u)^\top` and :math:`B = \mathrm{diag}(u)A_c`
    (so that :math:`b = B^\top s`), :math:`H_u = I/\alpha + A_c^\top B` (:math:`A^\top W A = A_c^\top
    \mathrm{diag}(u) A_c`, formed so to avoid the cancellation of :math:`A^\top\mathrm{diag}(u)A - (A^\top
    u)(A^\top u)^\top` when the templates share a large mean) is Cholesky-factored and inverted once per
    class, and :math:`M = BH_u^{-1}` and :math:`D = B - MH_u` (:math:`n \times r` each) formed.  One
    product per class then gives every row's :math:`\hat x = M^\top s`, and the norms of the rows of
    :math:`D` bound its residual :math:`\|b - H_u\hat x\| = \|D^\top s\| \le \sum_i |s_i|\,\|D_i\|`
    (exact up to the rounding of the products; any error of :math:`M`, the inverse's rounding included,
    shows in :math:`D`), written into ``residual``.  With ``by_rows`` (``None``: :func:`_direct_by_rows`),
    each row's :math:`b = B^\top s` is solved with the Cholesky factor instead and its residual
    :math:`\|b - H_u\hat x\|` formed.  A class whose factorisation fails (not SPD in rounding) is left to CG.
    """
    solved = torch.zeros_like(live)
    if shared:  # every live row of a group is one class
        keep = live.sum(-1) >= min_rows
        groups = keep.nonzero().squeeze(-1)
        classes = (groups, torch.zeros_like(groups), None, live[keep]) if len(groups) else None
    else:
        classes = _preference_classes(u, live, min_rows)
    if classes is None:
        return solved
    class_group, class_row, table, valid = classes
    n, r = a.shape[1], a.shape[2]
    width = live.shape[1] if table is None else table.shape[1]
    by_rows = _direct_by_rows(n, r, width) if by_rows is None else by_rows
    per_class = 6 * n * r + 3 * r * r + width * (2 * n + r)
    step = max(1, memory_budget_bytes // (8 * per_class))  # classes per chunk
    eye = torch.eye(r, dtype=_F64, device=x.device) / alpha
    everything = table is None and len(class_group) == live.shape[0] and step >= len(class_group)
    for c0 in range(0, len(class_group), step):
        groups = class_group[c0 : c0 + step]
        weights = u[groups, class_row[c0 : c0 + step]].unsqueeze(-1)  # (C, n, 1)
        factor = a if everything else a[groups]
        centred = factor - torch.bmm(weights.transpose(1, 2), factor)  # A_c
        scaled = centred * weights  # B = diag(u) A_c
        hessian = torch.baddbmm(eye, scaled.transpose(1, 2), centred)  # H_u
        cholesky, info = torch.linalg.cholesky_ex(hessian)
        factored = (info == 0).unsqueeze(-1)
        if table is None:  # a class is every live row of its group
            members_ok = valid[c0 : c0 + step] & factored
            rows_in = s if everything else s[groups]
        else:
            members, members_ok = table[c0 : c0 + step], valid[c0 : c0 + step] & factored
            rows_in = s[groups.unsqueeze(-1), members]
        if by_rows:
            rhs = torch.bmm(rows_in, scaled)  # each row's b^T = s^T B
            solution = torch.cholesky_solve(rhs.transpose(1, 2), cholesky).transpose(1, 2)  # x^T = (H^{-1} b)^T
            misfit = torch.baddbmm(rhs, solution, hessian, alpha=-1.0).norm(dim=-1)  # ||b - H x|| (H symmetric)
        else:
            solve = torch.bmm(scaled, torch.cholesky_inverse(cholesky))  # M = B H^{-1}
            rounding = torch.baddbmm(scaled, solve, hessian, alpha=-1.0).norm(dim=-1, keepdim=True)  # ||D_i||
            solution = torch.bmm(rows_in, solve)  # each row's x^T = s^T M
            misfit = torch.bmm(rows_in.abs(), rounding).squeeze(-1)  # >= ||D^T s|| = ||b - H x||
        if everything:
            x.copy_(solution)
            residual.copy_(misfit)
            solved |= members_ok
            continue
        rows = members_ok.nonzero(as_tuple=True)
        index = (groups[rows[0]], rows[1] if table is None else members[rows])
        x[index] = solution[rows]
        residual[index] = misfit[rows]
        solved[index] = True
    return solved


def _preference_classes(u, live, min_rows):
    r"""The classes of at least ``min_rows`` live rows of a group with bitwise equal :math:`u`, or ``None``.

    Returns ``(class_group, class_row, table, valid)``: each class's group and first row ``(C,)``, and its
    member rows as a padded table ``(C, width)`` with ``valid`` marking real entries; ``table`` is
    ``None`` when every class is all the live rows of its group (``valid`` is then ``(C, m)``).

    The usual case, one preference per group (no position bias, no causal mask), is checked first.
    Otherwise rows are sorted by a fixed random projection of :math:`u`, and the runs of equal codes long
    enough to matter are compared exactly with their first row; a row that differs (a collision) is
    left out, so the classes are always exact.
    """
    g_count, m, n = u.shape
    index = torch.arange(g_count, device=u.device)
    first = live.to(torch.int8).argmax(-1)  # the first live row (0 where none)
    same = (u == u[index, first].unsqueeze(1)).all(-1)
    if bool((same | ~live).all()):
        keep = live.sum(-1) >= min_rows
        if not bool(keep.any()):
            return None
        return index[keep], first[keep], None, live[keep]
    weights = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=_F64).to(u.device) + 0.5
    code = torch.where(live, torch.linalg.vecdot(u, weights.expand_as(u)), torch.inf)
    code, order = torch.sort(code, dim=-1, stable=True)
    position = torch.arange(m, device=u.device).expand(g_count, m)
    starts = torch.ones_like(live)
    starts[:, 1:] = code[:, 1:] != code[:, :-1]
    start = torch.where(starts, position, 0).cummax(-1).values  # sorted position of each row's run
    run_length = torch.zeros(g_count, m, dtype=torch.long, device=u.device).scatter_add_(
        1, start, torch.isfinite(code).long()
    )
    long_enough = torch.isfinite(code) & (run_length.gather(1, start) >= min_rows)  # upper bound on the class
    if not bool(long_enough.any()):
        return None
    group_of, position_of = long_enough.nonzero(as_tuple=True)
    row_of, first_of = order[group_of, position_of], order[group_of, start[group_of, position_of]]
    exact = (u[group_of, row_of] == u[group_of, first_of]).all(-1)
    group_of, row_of, first_of = group_of[exact], row_of[exact], first_of[exact]
    keys, class_of, counts = torch.unique(group_of * m + first_of, return_inverse=True, return_counts=True)
    big = counts >= min_rows
    if not bool(big.any()):
        return None
    members = _padded_members(class_of, counts)  # as wide as the biggest class: the others have fewer rows
    valid = members >= 0
    table = torch.where(valid, row_of[members.clamp_min(0)], 0)
    return keys[big] // m, keys[big] % m, table[big], valid[big]


def _padded_members(label, counts):
    """The items of each of C classes as a padded table ``(C, max count)`` of their indices, in their order, -1
    where a class has fewer: ``label`` ``(L,)`` is each item's class, ``counts`` ``(C,)`` the items of each."""
    order = torch.argsort(label, stable=True)
    rank = torch.arange(len(order), device=label.device) - (counts.cumsum(0) - counts)[label[order]]
    table = torch.full((len(counts), int(counts.max())), -1, dtype=torch.long, device=label.device)
    table[label[order], rank] = order
    return table


def _centred(u, v):
    r""":math:`W v = u \odot (v - u^\top v)` for :math:`W = \mathrm{diag}\,u - uu^\top`, row-wise."""
    return (v - row_dot(u, v).unsqueeze(-1)).mul_(u)


def _tiles(g_count, m, rows_per_tile):
    """(g0, g1, j0, j1) slices of whole groups, or of one group's rows, of about ``rows_per_tile`` rows."""
    if rows_per_tile >= m:
        per = max(1, rows_per_tile // max(m, 1))
        return [(g, min(g + per, g_count), 0, m) for g in range(0, g_count, per)]
    return [(g, g + 1, j, min(j + rows_per_tile, m)) for g in range(g_count) for j in range(0, m, rows_per_tile)]


def second_order_deviation(
    correction: torch.Tensor,
    point: torch.Tensor,
    lambda_norm: torch.Tensor,
    error_bound: torch.Tensor,
    point_error: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\|\lambda^* - \lambda_2\| / \|\lambda^*\|`, computed as :math:`\|A^\top\hat c - y_2\| /
    \|\hat\lambda\|` (module docstring, "Deviation").

    Args:
        correction: the solver's :math:`A^\top\hat c` (``DualSolution.correction``), ``(g, m, r)``.
        point: :math:`y_2` from :func:`second_order_point` with the factor the solver used, ``(g, m, r)``.
        lambda_norm: the solver's :math:`\|\hat\lambda\|`, ``(g, m)``.
        error_bound: the solver's :math:`\varepsilon \ge \|\hat\lambda - \lambda^*\|`, ``(g, m)``.
        point_error: :math:`\varepsilon_2 \ge \|\hat\lambda_2 - \lambda_2\|`, ``(g, m)``.

    Returns:
        ``(value, bound)``, each ``(g, m)``, with
        :math:`|value - \text{true}| \le bound = (\varepsilon + \varepsilon_2 + value\cdot\varepsilon) /
        (\|\hat\lambda\| - \varepsilon)` (:math:`\infty` when :math:`\|\hat\lambda\| \le \varepsilon`).
    """
    lambda_norm, eps, eps2 = (x.to(_F64) for x in (lambda_norm, error_bound, point_error))
    value = torch.sub(correction.to(_F64), point.to(device=correction.device, dtype=_F64)).norm(dim=-1) / lambda_norm
    bound = (eps + eps2 + value * eps) / (lambda_norm - eps)
    bound = torch.where(lambda_norm > eps, bound, torch.inf)
    return value, torch.where(torch.isnan(value + eps + eps2), _NAN, bound)
