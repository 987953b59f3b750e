r"""Quantities derived from a dual solution, each with a certified bound on its numerical error.

Pure tensor math, like :mod:`probe.solver` (notation and the reduced form are in its docstring): every
function takes the batched reduced quantities of :class:`probe.solver.DualProblems` and
:class:`probe.solver.DualSolution`, ``(g, m, ...)`` with ``g`` groups sharing one Gram matrix and ``m``
rows (problems) per group, and returns float64 tensors ``(g, m)`` on the inputs' device.  Rows that are
inactive (NaN in a solution, all-``-inf`` preference, or masked by ``active``) come out NaN.  Within a
group the rows are head-major: with ``H`` heads and ``Q = m / H`` rows per head, row ``j`` belongs to
head ``j // Q`` ("hidden" parameterisation: one group per example; "key": one group per (example,
head), ``H = 1``).

Throughout, :math:`\varepsilon` is the solver's ``error_bound``: :math:`\|\hat\lambda - \lambda^*\|
\le \varepsilon` for :math:`\hat\lambda = \alpha z + T^\top \hat c` (``coefficients``), and
``lambda_norm`` :math:`= \|\hat\lambda\|`, so :math:`|\|\hat\lambda\| - \|\lambda^*\|| \le \varepsilon`.
The solver's ``attention`` :math:`\hat p = p(\lambda(y))` is the distribution at its dual iterate
:math:`\lambda(y) = \alpha z + Vy`, which is within :math:`\alpha\|g\| = \varepsilon/2` of
:math:`\lambda^*` (see the certificate section of :mod:`probe.solver`).  Bounds are on the
difference between the computed value and the value at the exact optimum of the problem the reduced
data define; like the solver's certificate they do not count the float64 rounding of the final
products (relative ~1e-16 n).

Second-order prediction (:func:`second_order_coefficients`, :func:`second_order_deviation`)
---------------------------------------------------------------------------------------------
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

By the push-through identity :math:`(I + \alpha T^\top W T)^{-1} = I - \alpha T^\top (I + \alpha W
G)^{-1} W T`, :math:`\lambda_2 = \alpha z + T^\top c_2` with
:math:`c_2 = -\alpha^2 (I + \alpha W G)^{-1} W s` (:math:`s = Tz`, the solver's logits).  With
:math:`G = AA^\top` Woodbury gives :math:`(I + \alpha W A A^\top)^{-1} w = w - WAx`,
:math:`(I/\alpha + A^\top W A)\,x = A^\top w`, so

.. math::  c_2 = -\alpha^2 W (s - A x), \qquad H x = b, \quad H = I/\alpha + A^\top W A, \quad
           b = A^\top W s ,

an :math:`r \times r` SPD system per row (:math:`r = \mathrm{rank}\,G`) whose matrix is the solver's
Newton matrix at :math:`p = u`; it is solved by the solver's batched CG
(:func:`probe.solver.solve_spd_reduced`), never as an :math:`n \times n` system.

*Error of* :math:`\lambda_2`.  CG returns :math:`\hat x` with residual :math:`\rho = b - H\hat x`
(recomputed from :math:`\hat x`).  Exactly, :math:`A^\top c_2 = -\alpha^2(b - (H - I/\alpha)x) =
-\alpha x`; for :math:`\hat c_2 = -\alpha^2 W(s - A\hat x)`, :math:`A^\top \hat c_2 = -\alpha^2\rho
- \alpha\hat x`.  With :math:`\hat x - x = -H^{-1}\rho` and :math:`T^\top = VA^\top` (:math:`V`
orthonormal),

.. math::  \hat\lambda_2 - \lambda_2 = V A^\top(\hat c_2 - c_2) = -\alpha(\alpha I - H^{-1})\rho,
           \qquad \|\hat\lambda_2 - \lambda_2\| \le \alpha^2\|\rho\| =: \varepsilon_2 ,

because :math:`H \succeq I/\alpha` puts the eigenvalues of :math:`\alpha I - H^{-1}` in
:math:`[0, \alpha)`.  ``c2_error`` is :math:`\varepsilon_2`.

*Deviation.*  :math:`\hat\lambda - \hat\lambda_2 = VA^\top(\hat c - \hat c_2)`, so the computed value
is :math:`\hat v = \|A^\top(\hat c - \hat c_2)\| / \|\hat\lambda\|`.  Its numerator is within
:math:`\delta = \varepsilon + \varepsilon_2` of :math:`\|\lambda^* - \lambda_2\|` and its denominator
within :math:`\varepsilon` of :math:`\|\lambda^*\|`; the worst case over both intervals is

.. math::  |\hat v - v| \le \frac{\varepsilon + \varepsilon_2 + \hat v\,\varepsilon}{\|\hat\lambda\| - \varepsilon}
           \quad (\infty \text{ if } \|\hat\lambda\| \le \varepsilon) .

Attention (:func:`model_attention`, :func:`attention_tv`, :func:`attention_entropy`)
-----------------------------------------------------------------------------------
The model's attention is :math:`p_{att} = \mathrm{softmax}(\log u + \alpha s)` (the attention
approximation :math:`\lambda = \alpha z`; in the pipeline :math:`\alpha s` is the model's logits for
every :math:`\alpha`).

*Softmax lemma.*  For logits :math:`a, b` with :math:`d = a - b` of oscillation
:math:`\omega = \max_i d_i - \min_i d_i`, :math:`TV(\mathrm{softmax}\,a, \mathrm{softmax}\,b) \le
\tanh(\omega/4)`.  Proof: :math:`TV = \max_S\,(p(S) - q(S))` with :math:`p = \mathrm{softmax}\,a`,
:math:`q = \mathrm{softmax}\,b`, and :math:`p(S) = \sum_S q_i e^{d_i} / \sum_i q_i e^{d_i}` increases
with :math:`d_i` on :math:`S` and decreases with it off :math:`S`; shifting :math:`d` (which changes
nothing) into :math:`[-\omega/2, \omega/2]`, the worst case is :math:`d = \pm\omega/2` on/off
:math:`S`, where with :math:`\sigma = q(S)`, :math:`p(S) - q(S) = \sigma(1-\sigma)(e^{\omega/2} -
e^{-\omega/2}) / (\sigma e^{\omega/2} + (1-\sigma)e^{-\omega/2})`, maximal at
:math:`\sigma = e^{-\omega/4}/(e^{\omega/4} + e^{-\omega/4})` with value :math:`\tanh(\omega/4)`.

*TV bound.*  :math:`\hat p` and :math:`p^*` have logits :math:`\langle t_i, \lambda(y)\rangle` and
:math:`\langle t_i, \lambda^*\rangle` (plus :math:`\log u_i`), so :math:`d_i - d_j = \langle t_i -
t_j, \lambda(y) - \lambda^*\rangle` and :math:`\omega \le D\,\varepsilon/2` with the template diameter
:math:`D = \max_{i,j} \|t_i - t_j\|`, :math:`\|t_i - t_j\|^2 = G_{ii} + G_{jj} - 2G_{ij}`, over the keys
of the group that carry probability in some row.  By the triangle inequality

.. math::  |TV(\hat p, p_{att}) - TV(p^*, p_{att})| \le TV(\hat p, p^*) \le \tanh(D\varepsilon/8) =: \tau
           \ (\le D\varepsilon/8 \le \max_i\|t_i\|\,\varepsilon/4).

(Keys whose probability underflows to 0 in every row of the group are left out of :math:`D`; they
carry less than 1e-300 of mass in :math:`\hat p` and :math:`p_{att}`.)

Output (:func:`output_deviation`)
--------------------------------
With values :math:`v_i` of the row's head, :math:`\hat o = \|\sum_i(\hat p_i - p_{att,i})v_i\| /
\|\sum_i p_{att,i} v_i\|`.  Since :math:`\sum_i(\hat p_i - p^*_i) = 0`, for any centre :math:`c`

.. math::  |\hat o - o| \le \frac{\|\sum_i(\hat p_i - p^*_i)(v_i - c)\|}{\|\sum_i p_{att,i}v_i\|}
           \le \frac{\|\hat p - p^*\|_1\, R}{\|\sum_i p_{att,i}v_i\|} \le \frac{2\tau R}{\|\sum_i p_{att,i}v_i\|},
           \qquad R = \min_{c \in \{0, \bar v\}} \max_i\|v_i - c\|,

with :math:`\bar v` the mean of the values, both over the keys of :math:`D`, per head (:math:`c = 0`
is the plain :math:`\|\hat p - p^*\|_1\max_i\|v_i\|`; the mean removes the values' common part).
"""

from __future__ import annotations

import torch

from .solver import solve_spd_reduced

__all__ = [
    "second_order_coefficients",
    "second_order_deviation",
    "model_attention",
    "attention_tv",
    "output_deviation",
    "attention_entropy",
]

_F64 = torch.float64
_NAN = float("nan")


def second_order_coefficients(
    factor: torch.Tensor,
    logits: torch.Tensor,
    log_preference: torch.Tensor,
    alpha: float,
    active: torch.Tensor | None = None,
    *,
    rtol: float = 1e-12,
    memory_budget_bytes: int = 1 << 29,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The paper's second-order prediction :math:`\lambda_2 = \alpha(I + \alpha\Sigma_u)^{-1}z` in reduced
    form, :math:`\lambda_2 = \alpha z + T^\top c_2` (module docstring, "Second-order prediction").

    Args:
        factor: :math:`A` with :math:`AA^\top = G`, ``(g, n, r)``, from :func:`probe.solver.factor_gram`.
        logits: the solver's logits :math:`s = Tz`, ``(g, m, n)`` (the pipeline's :math:`s/\alpha`).
        log_preference: :math:`\log u` up to a constant per row, ``-inf`` for excluded keys, ``(g, m, n)``.
        alpha: strength :math:`\alpha > 0`.
        active: rows to compute, ``(g, m)`` bool, ``None`` for all.
        rtol: relative residual at which CG stops (the bound is certified whatever it reaches).
        memory_budget_bytes: rows are processed in tiles of about this working-set size.

    Returns:
        ``(c2, c2_error)``: :math:`c_2` ``(g, m, n)`` (zero on excluded keys) and the certified bound
        :math:`\varepsilon_2 = \alpha^2\|b - H\hat x\| \ge \|\hat\lambda_2 - \lambda_2\|` ``(g, m)``; NaN
        on inactive rows.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    factor = factor.to(_F64)
    device = factor.device
    logits = logits.to(device=device, dtype=_F64)
    log_pref = log_preference.to(device=device, dtype=_F64).expand_as(logits)
    g_count, m, n = logits.shape
    support = log_pref > -torch.inf
    logits = torch.where(support, logits, 0.0)  # whatever is stored at excluded keys plays no part
    ok = support.any(-1) & torch.isfinite(torch.where(support, log_pref, 0.0) + logits).all(-1)
    active = ok if active is None else ok & active.to(device)
    # inactive rows become a harmless uniform problem, so that no NaN enters the batched products
    log_pref = torch.where(active.unsqueeze(-1), log_pref, 0.0)
    logits = torch.where(active.unsqueeze(-1), logits, 0.0)
    u = torch.softmax(log_pref, dim=-1)

    c2 = torch.empty_like(logits)
    c2_error = torch.empty(g_count, m, dtype=_F64, device=device)
    bytes_per_row = 16 * n * 8  # about 16 live (m, n)-sized float64 tensors in the CG
    for g0, g1, j0, j1 in _tiles(g_count, m, max(1, memory_budget_bytes // bytes_per_row)):
        a, s, w = factor[g0:g1], logits[g0:g1, j0:j1], u[g0:g1, j0:j1]
        rhs = torch.bmm(_centred(w, s), a)  # b = A^T W s
        x, residual = solve_spd_reduced(a, w, rhs, alpha, rtol)
        c2[g0:g1, j0:j1] = -(alpha**2) * _centred(w, s - torch.bmm(x, a.transpose(1, 2)))
        c2_error[g0:g1, j0:j1] = alpha**2 * residual
    inactive = ~active
    return c2.masked_fill(inactive.unsqueeze(-1), _NAN), c2_error.masked_fill(inactive, _NAN)


def _centred(u, v):
    r""":math:`W v = u \odot (v - u^\top v)` for :math:`W = \mathrm{diag}\,u - uu^\top`, row-wise."""
    return u * (v - (u * v).sum(-1, keepdim=True))


def _tiles(g_count, m, rows_per_tile):
    """(g0, g1, j0, j1) slices of whole groups, or of one group's rows, of about ``rows_per_tile`` rows."""
    if rows_per_tile >= m:
        per = max(1, rows_per_tile // max(m, 1))
        return [(g, min(g + per, g_count), 0, m) for g in range(0, g_count, per)]
    return [(g, g + 1, j, min(j + rows_per_tile, m)) for g in range(g_count) for j in range(0, m, rows_per_tile)]


def second_order_deviation(
    factor: torch.Tensor,
    coefficients: torch.Tensor,
    c2: torch.Tensor,
    lambda_norm: torch.Tensor,
    error_bound: torch.Tensor,
    c2_error: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\|\lambda^* - \lambda_2\| / \|\lambda^*\|`, computed as :math:`\|A^\top(\hat c - \hat c_2)\| /
    \|\hat\lambda\|` (:math:`= \sqrt{(\hat c - \hat c_2)^\top G (\hat c - \hat c_2)} / \|\hat\lambda\|`).

    Args:
        factor: :math:`A`, ``(g, n, r)``.
        coefficients: the solver's :math:`\hat c`, ``(g, m, n)``.
        c2: :math:`\hat c_2` from :func:`second_order_coefficients`, ``(g, m, n)``.
        lambda_norm: the solver's :math:`\|\hat\lambda\|`, ``(g, m)``.
        error_bound: the solver's :math:`\varepsilon \ge \|\hat\lambda - \lambda^*\|`, ``(g, m)``.
        c2_error: :math:`\varepsilon_2 \ge \|\hat\lambda_2 - \lambda_2\|`, ``(g, m)``.

    Returns:
        ``(value, bound)``, each ``(g, m)``, with
        :math:`|value - \text{true}| \le bound = (\varepsilon + \varepsilon_2 + value\cdot\varepsilon) /
        (\|\hat\lambda\| - \varepsilon)` (:math:`\infty` when :math:`\|\hat\lambda\| \le \varepsilon`).
    """
    factor = factor.to(_F64)
    difference = coefficients.to(_F64) - c2.to(_F64)
    lambda_norm, eps, eps2 = (x.to(_F64) for x in (lambda_norm, error_bound, c2_error))
    value = torch.bmm(difference, factor).norm(dim=-1) / lambda_norm
    bound = (eps + eps2 + value * eps) / (lambda_norm - eps)
    bound = torch.where(lambda_norm > eps, bound, torch.inf)
    return value, torch.where(torch.isnan(value + eps + eps2), _NAN, bound)


def model_attention(
    logits: torch.Tensor, log_preference: torch.Tensor, alpha: float, active: torch.Tensor | None = None
) -> torch.Tensor:
    r"""The model's attention :math:`p_{att} = \mathrm{softmax}(\log u + \alpha s)`, ``(g, m, n)``.

    ``logits`` are the solver's :math:`s` ``(g, m, n)`` (so :math:`\alpha s` is the model's logits),
    ``log_preference`` :math:`\log u` broadcastable to it (``-inf`` for excluded keys, which get 0).
    Rows with no allowed key, or not ``active`` ``(g, m)``, are NaN.
    """
    logits = logits.to(_F64)
    log_pref = log_preference.to(device=logits.device, dtype=_F64)
    theta = torch.where(log_pref > -torch.inf, log_pref + alpha * logits, -torch.inf)
    p = torch.softmax(theta, dim=-1)  # an all -inf row gives NaN
    if active is not None:
        p = p.masked_fill(~active.to(p.device).unsqueeze(-1), _NAN)
    return p


def attention_tv(
    attention: torch.Tensor, p_att: torch.Tensor, gram: torch.Tensor, error_bound: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Total variation :math:`\tfrac12\sum_i|p^*_i - p_{att,i}|` between the optimal attention and the
    model's.

    Args:
        attention: the solver's :math:`\hat p` ``(g, m, n)`` (at its dual iterate, within
            :math:`\varepsilon/2` of :math:`\lambda^*`).
        p_att: :func:`model_attention`, ``(g, m, n)``.
        gram: :math:`G` ``(g, n, n)``.
        error_bound: the solver's :math:`\varepsilon` ``(g, m)``.

    Returns:
        ``(value, bound)`` ``(g, m)``: :math:`|value - \text{true}| \le bound = \tanh(D\varepsilon/8)`,
        :math:`D` the diameter of the group's templates (module docstring).
    """
    attention, p_att = attention.to(_F64), p_att.to(device=attention.device, dtype=_F64)
    value = 0.5 * (attention - p_att).abs().sum(-1)
    return value, _tv_to_optimum(attention, p_att, gram, error_bound)


def _tv_to_optimum(attention, p_att, gram, error_bound):
    r"""The certified :math:`\tau = \tanh(D\varepsilon/8) \ge TV(\hat p, p^*)`, ``(g, m)``."""
    gram = gram.to(device=attention.device, dtype=_F64)
    keys = _keys_in_use(attention, p_att)
    diagonal = torch.diagonal(gram, dim1=-2, dim2=-1)
    squared = diagonal.unsqueeze(-1) + diagonal.unsqueeze(-2) - 2 * gram  # ||t_i - t_j||^2
    pairs = keys.unsqueeze(-1) & keys.unsqueeze(-2)
    diameter = torch.where(pairs, squared, 0.0).amax(dim=(-2, -1)).clamp_min(0).sqrt()  # (g,)
    eps = error_bound.to(device=attention.device, dtype=_F64)
    tau = torch.tanh(diameter.unsqueeze(-1) * eps / 8)
    return torch.where((diameter.unsqueeze(-1) == 0) & ~torch.isnan(eps), 0.0, tau)  # D = 0 even if eps = inf


def _keys_in_use(attention, p_att):
    """Keys that carry probability in some row of the group, ``(g, n)`` bool (NaN rows count for none)."""
    return ((attention > 0) | (p_att > 0)).any(dim=1)


def output_deviation(
    attention: torch.Tensor, p_att: torch.Tensor, values: torch.Tensor, gram: torch.Tensor, error_bound: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\|\sum_i(p^*_i - p_{att,i})v_i\| / \|\sum_i p_{att,i}v_i\|`, the relative change of the
    attention output.

    Args:
        attention: the solver's :math:`\hat p` ``(g, m, n)``, rows head-major.
        p_att: :func:`model_attention`, ``(g, m, n)``.
        values: :math:`v_i` per value head, ``(g, H, n, d_v)``; row ``j`` uses head ``j // (m / H)``.  With
            grouped-query attention pass the key/value heads: the consecutive query heads that share one
            are consecutive blocks of rows.
        gram: :math:`G` ``(g, n, n)``.
        error_bound: the solver's :math:`\varepsilon` ``(g, m)``.

    Returns:
        ``(value, bound)`` ``(g, m)``: :math:`|value - \text{true}| \le bound = 2\tanh(D\varepsilon/8)\,R /
        \|\sum_i p_{att,i}v_i\|`, :math:`R` the radius of the head's values (module docstring).
    """
    attention, p_att = attention.to(_F64), p_att.to(device=attention.device, dtype=_F64)
    g_count, m, n = attention.shape
    heads = values.shape[1]
    if values.shape[0] != g_count or values.shape[2] != n or m % heads:
        raise ValueError(f"values {tuple(values.shape)} do not fit attention {tuple(attention.shape)}")
    keys = _keys_in_use(attention, p_att)
    values = torch.where(keys[:, None, :, None], values.to(device=attention.device, dtype=_F64), 0.0)

    def per_head(p):  # (g, m, n) -> (g, H, Q, n)
        return p.reshape(g_count, heads, m // heads, n)

    output = per_head(p_att) @ values  # (g, H, Q, d_v)
    change = per_head(attention - p_att) @ values
    scale = output.norm(dim=-1).reshape(g_count, m)
    value = change.norm(dim=-1).reshape(g_count, m) / scale
    radius = _value_radius(values, keys)
    tau = _tv_to_optimum(attention, p_att, gram, error_bound)
    bound = 2 * tau * radius.repeat_interleave(m // heads, dim=1) / scale
    return value, bound


def _value_radius(values, keys):
    r""":math:`R = \min_{c \in \{0, \bar v\}} \max_i \|v_i - c\|` over the keys in use, per (group, head),
    ``(g, H)`` (:math:`\bar v` their mean)."""
    in_use = keys[:, None, :, None]  # values are already zero elsewhere
    count = in_use.sum(dim=-2, keepdim=True).clamp_min(1)
    mean = values.sum(dim=-2, keepdim=True) / count
    around_mean = torch.where(in_use, values - mean, 0.0).norm(dim=-1).amax(dim=-1)
    return torch.minimum(around_mean, values.norm(dim=-1).amax(dim=-1))


def attention_entropy(p_att: torch.Tensor) -> torch.Tensor:
    r"""Entropy :math:`-\sum_i p_i\log p_i` in nats (:math:`0\log 0 = 0`) of each row ``(g, m, n)`` -> ``(g, m)``."""
    p_att = p_att.to(_F64)
    return -torch.special.xlogy(p_att, p_att).sum(-1)
