r"""The attention quantities derived from a dual solution, each with a certified bound on its numerical error; the
second-order prediction and its deviation are in :mod:`probe.solve.second_order`.

Pure tensor math, like :mod:`probe.solve.dual` (notation and the reduced form are in its docstring): every
function takes the batched reduced quantities of :class:`probe.solve.problems.DualProblems` and
:class:`probe.solve.problems.DualSolution`, ``(g, m, ...)`` with ``g`` groups sharing one Gram matrix and ``m``
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
:math:`\lambda^*` (see the certificate section of :mod:`probe.solve.dual`).  Bounds are on the
difference between the computed value and the value at the exact optimum of the problem the reduced
data define; like the solver's certificate they do not count the float64 rounding of the final
products (relative ~1e-16 n).

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
:math:`\langle t_i, \lambda^*\rangle` (plus :math:`\log u_i`), so with :math:`\delta = \lambda(y) -
\lambda^*`, :math:`\|\delta\| \le \varepsilon/2`, and any centre :math:`c`, :math:`d_i - d_j = \langle t_i
- c, \delta\rangle - \langle t_j - c, \delta\rangle \le (\|t_i - c\| + \|t_j - c\|)\,\varepsilon/2`.  With
:math:`c = \bar t` the mean of the templates in use, :math:`\omega \le D\,\varepsilon/2` for the *spread*
:math:`D = d_{(1)} + d_{(2)}`, the two largest of :math:`d_i = \|t_i - \bar t\|`, over the keys of the group
that carry probability in some row.  The spread lies between the templates' diameter
:math:`\max_{i,j}\|t_i - t_j\|` and twice it, and costs :math:`O(nr)` per group, not the diameter's
:math:`O(n^2 r)`: :math:`d_i = \|a_i - \bar a\|` for the rows of any factor :math:`AA^\top = G`, or
:math:`d_i^2 = G_{ii} - 2(Gw)_i + w^\top G w` with :math:`w` uniform over the keys in use.  By the triangle
inequality

.. math::  |TV(\hat p, p_{att}) - TV(p^*, p_{att})| \le TV(\hat p, p^*) \le \tanh(D\varepsilon/8) =: \tau
           \ (\le D\varepsilon/8 \le \max_i\|t_i\|\,\varepsilon/2).

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

from probe.solve.problems import row_dot

__all__ = [
    "model_attention",
    "model_log_attention",
    "attention_tv",
    "output_deviation",
    "attention_deviations",
    "attention_quantities",
    "attention_entropy",
]

_F64 = torch.float64
_NAN = float("nan")


def model_log_attention(
    logits: torch.Tensor, log_preference: torch.Tensor, alpha: float, active: torch.Tensor | None = None
) -> torch.Tensor:
    r"""The log of the model's attention, :math:`\log p_{att} = \mathrm{log\,softmax}(\log u + \alpha s)`,
    ``(g, m, n)``: :func:`model_attention` is its exponential, and :func:`attention_entropy` takes both.

    ``logits`` are the solver's :math:`s` ``(g, m, n)`` (so :math:`\alpha s` is the model's logits),
    ``log_preference`` :math:`\log u` broadcastable to it (``-inf`` for excluded keys, which stay
    ``-inf``).  Rows with no allowed key, or not ``active`` ``(g, m)``, are NaN.
    """
    logits = logits.to(_F64)
    log_pref = log_preference.to(device=logits.device, dtype=_F64)
    theta = torch.add(log_pref, logits, alpha=alpha)  # -inf + a finite logit stays -inf
    if not bool(torch.isfinite(logits.sum())):  # excluded keys stay excluded whatever their logits hold
        theta.masked_fill_(~(log_pref > -torch.inf), -torch.inf)
    log_p = torch.log_softmax(theta, dim=-1)  # an all -inf row gives NaN
    if active is not None:
        log_p = log_p.masked_fill_(~active.to(log_p.device).unsqueeze(-1), _NAN)
    return log_p


def model_attention(
    logits: torch.Tensor, log_preference: torch.Tensor, alpha: float, active: torch.Tensor | None = None
) -> torch.Tensor:
    r"""The model's attention :math:`p_{att} = \mathrm{softmax}(\log u + \alpha s)`, ``(g, m, n)``: the
    exponential of :func:`model_log_attention` (same arguments; excluded keys get 0, rows with no allowed
    key or not ``active`` are NaN)."""
    return model_log_attention(logits, log_preference, alpha, active).exp_()


def attention_tv(
    attention: torch.Tensor, p_att: torch.Tensor, gram: torch.Tensor | None, error_bound: torch.Tensor,
    *, factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Total variation :math:`\tfrac12\sum_i|p^*_i - p_{att,i}|` between the optimal attention and the
    model's.

    Args:
        attention: the solver's :math:`\hat p` ``(g, m, n)`` (at its dual iterate, within
            :math:`\varepsilon/2` of :math:`\lambda^*`).
        p_att: :func:`model_attention`, ``(g, m, n)``.
        gram: :math:`G` ``(g, n, n)``, or ``None`` with ``factor``.
        error_bound: the solver's :math:`\varepsilon` ``(g, m)``.
        factor: any :math:`A` with :math:`AA^\top = G`, ``(g, n, r)``, used instead of ``gram`` when given
            (memory :math:`O(nr)`, no :math:`n \times n` matrix).

    Returns:
        ``(value, bound)`` ``(g, m)``: :math:`|value - \text{true}| \le bound = \tanh(D\varepsilon/8)`,
        :math:`D` the spread of the group's templates (module docstring).
    """
    common = _AttentionDifference(attention, p_att, gram, error_bound, factor)
    return common.tv(), common.tau


def output_deviation(
    attention: torch.Tensor, p_att: torch.Tensor, values: torch.Tensor, gram: torch.Tensor | None,
    error_bound: torch.Tensor, *, factor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r""":math:`\|\sum_i(p^*_i - p_{att,i})v_i\| / \|\sum_i p_{att,i}v_i\|`, the relative change of the
    attention output.

    Args:
        attention: the solver's :math:`\hat p` ``(g, m, n)``, rows head-major.
        p_att: :func:`model_attention`, ``(g, m, n)``.
        values: :math:`v_i` per value head, ``(g, H, n, d_v)``; row ``j`` uses head ``j // (m / H)``.  With
            grouped-query attention pass the key/value heads: the consecutive query heads that share one
            are consecutive blocks of rows.
        gram: :math:`G` ``(g, n, n)``, or ``None`` with ``factor``.
        error_bound: the solver's :math:`\varepsilon` ``(g, m)``.
        factor: any :math:`A` with :math:`AA^\top = G`, ``(g, n, r)``, used instead of ``gram`` when given.

    Returns:
        ``(value, bound)`` ``(g, m)``: :math:`|value - \text{true}| \le bound = 2\tanh(D\varepsilon/8)\,R /
        \|\sum_i p_{att,i}v_i\|`, :math:`R` the radius of the head's values (module docstring).
    """
    return _AttentionDifference(attention, p_att, gram, error_bound, factor).output(values)


def attention_deviations(
    attention: torch.Tensor, p_att: torch.Tensor, values: torch.Tensor, gram: torch.Tensor | None,
    error_bound: torch.Tensor, *, factor: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`attention_tv` and :func:`output_deviation` of the same rows at once, ``((tv, tv_bound),
    (output, output_bound))``: they share :math:`\\hat p - p_{att}`, the keys in use and the TV bound.
    ``gram`` or ``factor`` as in :func:`attention_tv`."""
    common = _AttentionDifference(attention, p_att, gram, error_bound, factor)
    return (common.tv(), common.tau), common.output(values)


def attention_quantities(
    attention: torch.Tensor, logits: torch.Tensor, log_preference: torch.Tensor, alpha: float, values: torch.Tensor,
    error_bound: torch.Tensor, *, gram: torch.Tensor | None = None, factor: torch.Tensor | None = None,
    active: torch.Tensor | None = None, memory_budget_bytes: int = 1 << 24,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    r""":func:`attention_deviations` and :func:`attention_entropy` of every row from the model's logits
    (:func:`model_log_attention`), ``((tv, tv_bound), (output, output_bound), entropy)``, each ``(g, m)``:
    the same values and bounds, computed for tiles of rows of one value head at a time, of about
    ``memory_budget_bytes`` (a site of long contexts is gigabytes for each ``(g, m, n)`` tensor; tiles that stay
    in the cache also run faster: 16 MB took 0.6 to 0.85 of the time of 256 MB on a CPU).

    Each tile gives its rows' values, their :math:`\|\sum_i p_{att,i}v_i\|` and the keys its rows use; the
    bounds follow once every tile has: the spread and the values' radius are over the keys in use in any row
    of the group (module docstring).  Arguments as in :func:`model_log_attention` and
    :func:`attention_deviations` (``logits`` the solver's :math:`s`, ``values`` ``(g, H, n, d_v)``).
    """
    _check_templates(gram, factor)
    g_count, m, n = logits.shape
    per_head = _rows_per_head(values, (g_count, m, n))
    heads = values.shape[1]
    device = attention.device
    log_preference = log_preference.expand(g_count, m, n)
    tv, output, scale, entropy = (torch.empty(g_count, m, dtype=_F64, device=device) for _ in range(4))
    keys = torch.zeros(g_count, n, dtype=torch.bool, device=device)
    step = max(1, memory_budget_bytes // (8 * 6 * g_count * n))  # rows at a time: about six (g, rows, n) tensors
    for head in range(heads):
        head_values = values[:, head].to(device=device, dtype=_F64)  # (g, n, d_v)
        for q0 in range(0, per_head, step):
            rows = slice(head * per_head + q0, head * per_head + min(q0 + step, per_head))
            log_p = model_log_attention(logits[:, rows], log_preference[:, rows], alpha,
                                        None if active is None else active[:, rows])
            p_att = log_p.exp()
            solved = attention[:, rows].to(_F64)
            difference = solved - p_att
            keys |= _keys_in_use(solved, p_att)
            tv[:, rows] = 0.5 * torch.linalg.vector_norm(difference, ord=1, dim=-1)
            scale[:, rows] = (p_att @ head_values).norm(dim=-1)  # ||sum_i p_att,i v_i||
            output[:, rows] = (difference @ head_values).norm(dim=-1) / scale[:, rows]
            entropy[:, rows] = attention_entropy(p_att, log_p)
    tau = _certified_tv(keys, gram, factor, error_bound)
    return (tv, tau), (output, _output_bound(tau, _in_use(values, keys), keys, scale)), entropy


class _AttentionDifference:
    r"""What the attention quantities of a batch share: :math:`\hat p - p_{att}`, the keys in use and
    the certified :math:`\tau = \tanh(D\varepsilon/8) \ge TV(\hat p, p^*)`."""

    def __init__(self, attention, p_att, gram, error_bound, factor=None):
        _check_templates(gram, factor)
        self.attention = attention.to(_F64)
        self.p_att = p_att.to(device=self.attention.device, dtype=_F64)
        self.difference = self.attention - self.p_att
        self.keys = _keys_in_use(self.attention, self.p_att)
        self.tau = _certified_tv(self.keys, gram, factor, error_bound)

    def tv(self):
        return 0.5 * torch.linalg.vector_norm(self.difference, ord=1, dim=-1)

    def output(self, values):
        g_count, m, n = self.difference.shape
        per_head = _rows_per_head(values, self.difference.shape)
        heads = values.shape[1]
        keys = self.keys
        masked = _in_use(values, keys)

        def by_head(p):  # (g, m, n) -> (g, H, Q, n)
            return p.reshape(g_count, heads, per_head, n)

        scale = (by_head(self.p_att) @ masked).norm(dim=-1).reshape(g_count, m)  # ||sum_i p_att,i v_i||
        value = (by_head(self.difference) @ masked).norm(dim=-1).reshape(g_count, m) / scale
        return value, _output_bound(self.tau, masked, keys, scale)


def _check_templates(gram, factor) -> None:
    if gram is None and factor is None:
        raise ValueError("the attention deviations need the templates: gram or factor")


def _rows_per_head(values: torch.Tensor, shape) -> int:
    """The rows of each value head, for ``values`` ``(g, H, n, d_v)`` and attention of ``shape`` ``(g, m, n)``."""
    g_count, m, n = shape
    heads = values.shape[1]
    if values.shape[0] != g_count or values.shape[2] != n or m % heads:
        raise ValueError(f"values {tuple(values.shape)} do not fit attention {tuple(shape)}")
    return m // heads


def _certified_tv(keys, gram, factor, error_bound):
    r""":math:`\tau = \tanh(D\varepsilon/8) \ge TV(\hat p, p^*)` ``(g, m)`` for the spread :math:`D` of the
    templates of the ``keys`` in use, from ``factor`` where given, else from ``gram``."""
    spread = _spread_from_factor(keys, factor) if factor is not None else _spread_from_gram(keys, gram)
    return _tv_to_optimum(spread, error_bound)


def _in_use(values, keys):
    """``values`` ``(g, H, n, d_v)`` in float64, zero at the keys not in use ``(g, n)``."""
    return torch.where(keys[:, None, :, None], values.to(device=keys.device, dtype=_F64), 0.0)


def _output_bound(tau, values, keys, scale):
    r"""The output deviation's bound :math:`2\tau R / \|\sum_i p_{att,i}v_i\|` ``(g, m)`` (module docstring),
    :math:`R` the radius of each head's ``values`` ``(g, H, n, d_v)`` (of :func:`_in_use`) over the ``keys`` in
    use, ``scale`` the rows' :math:`\|\sum_i p_{att,i}v_i\|`."""
    radius = _value_radius(values, keys).repeat_interleave(scale.shape[1] // values.shape[1], dim=1)
    return 2 * tau * radius / scale


def _spread_from_gram(keys: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    r"""The spread :math:`D = d_{(1)} + d_{(2)}` over the ``keys`` ``(g, n)`` of each group (module
    docstring): the two largest distances :math:`d_i = \|t_i - \bar t\|` of the templates in use from their
    mean, from :math:`d_i^2 = G_{ii} - 2(Gw)_i + w^\top G w` with :math:`w` uniform over the keys in use,
    ``(g,)``."""
    gram = gram.to(device=keys.device, dtype=_F64)
    weights = keys.to(_F64) / keys.sum(-1, keepdim=True).clamp_min(1)
    pulled = (gram @ weights.unsqueeze(-1)).squeeze(-1)  # (G w)_i
    squared = torch.diagonal(gram, dim1=-2, dim2=-1) - 2 * pulled + row_dot(weights, pulled).unsqueeze(-1)
    return _two_largest(torch.where(keys, squared, 0.0).clamp_min(0).sqrt())


def _spread_from_factor(keys: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    r""":func:`_spread_from_gram` from any :math:`A` with :math:`AA^\top = G` ``(g, n, r)``: the rows
    :math:`a_i` of :math:`A` have the templates' distances, so :math:`d_i = \|a_i - \bar a\|`.  Time and
    memory :math:`O(nr)` per group: no pair of keys is formed."""
    factor = factor.to(device=keys.device, dtype=_F64)
    weights = keys.to(_F64) / keys.sum(-1, keepdim=True).clamp_min(1)
    mean = weights.unsqueeze(-2) @ factor  # (g, 1, r): the mean of the rows in use
    distances = torch.linalg.vector_norm(factor - mean, dim=-1)
    return _two_largest(torch.where(keys, distances, 0.0))


def _two_largest(distances: torch.Tensor) -> torch.Tensor:
    """The sum of the two largest entries of each row of ``distances`` ``(g, n)`` (the largest alone where
    ``n == 1``), ``(g,)``."""
    if distances.shape[-1] == 0:
        return distances.new_zeros(distances.shape[:-1])
    return distances.topk(min(2, distances.shape[-1]), dim=-1).values.sum(-1)


def _tv_to_optimum(spread, error_bound):
    r"""The certified :math:`\tau = \tanh(D\varepsilon/8) \ge TV(\hat p, p^*)`, ``(g, m)``, for the spreads
    :math:`D` ``(g,)`` of the groups' templates (:func:`_spread_from_factor`)."""
    eps = error_bound.to(device=spread.device, dtype=_F64)
    tau = torch.tanh(spread.unsqueeze(-1) * eps / 8)
    return torch.where((spread.unsqueeze(-1) == 0) & ~torch.isnan(eps), 0.0, tau)  # D = 0 even if eps = inf


def _keys_in_use(attention, p_att):
    """Keys that carry probability in some row of the group, ``(g, n)`` bool (NaN rows count for none)."""
    return (attention.nansum(dim=1) > 0) | (p_att.nansum(dim=1) > 0)  # sums of non-negative terms


def _value_radius(values, keys):
    r""":math:`R = \min_{c \in \{0, \bar v\}} \max_i \|v_i - c\|` over the keys in use, per (group, head),
    ``(g, H)`` (:math:`\bar v` their mean)."""
    in_use = keys[:, None, :]  # values are already zero elsewhere
    count = in_use.sum(dim=-1).clamp_min(1)[..., None, None]
    mean = values.sum(dim=-2, keepdim=True) / count
    around_mean = torch.where(in_use, (values - mean).norm(dim=-1), 0.0).amax(dim=-1)  # masked as (g, H, n) norms
    return torch.minimum(around_mean, values.norm(dim=-1).amax(dim=-1))


def attention_entropy(p_att: torch.Tensor, log_p_att: torch.Tensor | None = None) -> torch.Tensor:
    r"""Entropy :math:`-\sum_i p_i\log p_i` in nats (:math:`0\log 0 = 0`) of each row ``(g, m, n)`` -> ``(g, m)``.

    With ``log_p_att`` (:func:`model_log_attention`) the logs are taken from it, which saves computing
    them (and is exact where :math:`p_i` underflows: its term is 0 either way)."""
    p_att = p_att.to(_F64)
    if log_p_att is None:
        return -torch.special.xlogy(p_att, p_att).sum(-1)
    finite_logs = log_p_att.to(_F64).clamp(min=torch.finfo(_F64).min)  # -inf at p = 0: 0 * finite = 0
    return -row_dot(p_att, finite_logs)
