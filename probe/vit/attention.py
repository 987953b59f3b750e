r"""Attention layers for the ViT experiment: softmax, the OT attention (eq. 22), Sinkhorn attention and
exact attention (the KL problem's exact posterior, :mod:`probe.solve.exact`).

Which vectors play which role in the OT attention (one head; the paper's symbols, see :mod:`probe.solve.ot`):

* **templates** ``t``: the keys.  The input's templates ``t_1..t_n`` are the keys of the input's real tokens
  (the class token included); the candidate set ``A`` is those keys, plus, in training with the paper's
  trick, the keys of another image's tokens (computed by the same layer from that image's hidden states);
* **evidence** ``z``: a query (one OT problem per query token);
* **source weights** ``u`` (the preference): uniform over the input's real tokens unless given;
* **what is mixed**: the values.  The output for query ``z`` is ``sum_{t in A} p(t) v_t`` with ``p`` of
  eq. (22): ``p(t) = sum_j u_j softmax_{t in A}((alpha <t, z> - M(t, t_j)) / gamma)``;
* **cost** ``M(t_j, t) = -<t_j, t> + C`` by default.  ``C`` is any constant making ``M >= 0`` (the paper's
  upper bound of the inner products); it cancels in every softmax over ``t`` (it is the same for every
  candidate in row ``j``), so it changes nothing but the numbers' range.  We take ``C`` = the largest inner
  product of the problem (detached), which makes ``M >= 0`` exactly and keeps every logit ``<= alpha<t,z>/gamma``.
  Any callable ``cost(sources (..., n, dh), candidates (..., N, dh)) -> (..., n, N)`` may replace it;
* **alpha = 1, gamma = sqrt(head dim)** by default.  The paper says ``gamma = sqrt(hidden dim)``.  With a
  constant cost the OT attention is exactly ``softmax(alpha <q, k> / gamma)`` over ``A`` (tested), so
  ``gamma`` plays the role of the temperature ``sqrt(d_k)`` of scaled dot-product attention, whose ``d_k`` is
  the dimension of the vectors in the inner product: the head dimension.  ``gamma = sqrt(head dim)`` makes the
  OT layer differ from the other layers only by its transport term, at the same scale; ``gamma`` is an
  option of :class:`OTAttention` for the other reading.

Cost against softmax attention, per head, for ``Q`` queries, ``n`` sources and ``N >= n`` candidates:
softmax attention needs ``O(Q N dh)`` time and an ``O(Q N)`` weight matrix; the OT attention needs the
``(n, N)`` cost (``O(n N dh)``) and a softmax over ``N`` for every (query, source) pair: ``O(Q n N)`` time and
memory (here through :func:`probe.solve.ot.ot_attention`, which materialises the ``(Q, n, N)`` logits).  In the
OT-ViT only the final layer uses it, and only the class token's output of the final layer feeds the
classifier, so the model evaluates the final layer for the class-token query alone (``Q = 1``): exact for the
logits, and ``O(n N)`` per head, about the cost of one full softmax attention layer.

The exact attention (:class:`ExactAttention`) solves, per head and query, the KL problem whose closed-form
approximation :math:`\lambda \approx \alpha z` is the softmax layer, in probe's key space: templates
:math:`t_i = k_i / \gamma` (:math:`\gamma = \sqrt{d'}`, the softmax layer's temperature), evidence
:math:`z = q`, preference :math:`u` uniform over the real tokens, :math:`\alpha = 1`.  Then
:math:`\mathrm{softmax}(\log u + \alpha T z) = \mathrm{softmax}(\langle q, k\rangle / \gamma)` is the
softmax layer's weights, and the exact layer returns :math:`p^*` instead (:func:`probe.solve.exact.exact_attention`,
certified, with implicit gradients).  The parameters are the softmax layer's.  The paper's other reading,
templates :math:`x_i / \sqrt{d'}` from the hidden states and evidence :math:`W_k^\top q`, is the rows'
hidden space; the key space keeps each head's problem in its own :math:`d' = 32` dimensions, fewer than
the 50 tokens, so the solver works on :math:`\lambda` itself.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from probe.solve.exact import ExactCertificate, exact_attention
from probe.solve.ot import ot_attention

__all__ = [
    "dot_cost",
    "ot_attention_weights",
    "softmax_attention_weights",
    "sinkhorn_attention_weights",
    "exact_attention_weights",
    "MultiHeadAttention",
    "OTAttention",
    "SinkhornAttention",
    "ExactAttention",
]

Cost = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def dot_cost(sources: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    r"""The paper's cost ``M(t_j, t) = -<t_j, t> + C``: ``sources (..., n, d)``, ``candidates (..., N, d)`` ->
    ``(..., n, N)``, with ``C`` the largest inner product of each problem (detached), so ``M >= 0``."""
    inner = sources @ candidates.transpose(-1, -2)
    shift = inner.detach().amax(dim=(-2, -1), keepdim=True)
    return shift - inner


def _neg_inf(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), float("-inf"), dtype=like.dtype, device=like.device)


def softmax_attention_weights(q, k, key_mask=None, gamma=None):
    """Scaled dot-product attention weights ``softmax(<q, k> / gamma)``, ``gamma = sqrt(dh)`` by default.

    ``q (B, H, Q, dh)``, ``k (B, H, N, dh)``, ``key_mask (B, N)`` bool (True = real token) -> ``(B, H, Q, N)``.
    """
    gamma = math.sqrt(q.shape[-1]) if gamma is None else gamma
    logits = (q @ k.transpose(-1, -2)) / gamma
    if key_mask is not None:
        logits = torch.where(key_mask[:, None, None, :], logits, _neg_inf(logits))
    return torch.softmax(logits, dim=-1)


def sinkhorn_attention_weights(q, k, mask=None, iterations: int = 3):
    r"""Sinkhorn attention (Sinkformers, Sander et al. 2022): the softmax's row normalisation of
    ``K = exp(<q, k> / sqrt(dh))`` replaced by Sinkhorn's alternating normalisations, which drive ``K``
    towards a doubly stochastic matrix.

    ``iterations`` counts the row normalisations; each after the first is preceded by a column
    normalisation (columns: sums over the real queries), so the result is always row-stochastic (the output
    is a convex combination of values), ``iterations = 1`` is exactly softmax attention, and as
    ``iterations`` grows the column sums tend to 1.  Computed in the log domain (log-sum-exp), so it does not
    overflow.  Queries and keys are the same tokens: ``q, k (B, H, n, dh)``, ``mask (B, n)`` bool.
    Returns ``(B, H, n, n)``; rows of padding queries are meaningless.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = torch.where(mask[:, None, None, :], logits, _neg_inf(logits))
    for iteration in range(iterations):
        if iteration > 0:
            columns = logits if mask is None else torch.where(mask[:, None, :, None], logits, _neg_inf(logits))
            log_col = torch.logsumexp(columns, dim=-2, keepdim=True)
            if mask is not None:  # padding keys' columns are -inf everywhere: leave them
                log_col = torch.where(mask[:, None, None, :], log_col, torch.zeros_like(log_col))
            logits = logits - log_col
        logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits.exp()


def exact_attention_weights(
    q, k, key_mask=None, alpha: float = 1.0, gamma=None
) -> tuple[torch.Tensor, ExactCertificate]:
    r"""The exact posterior of every query over the keys (module docstring): templates ``k / gamma``, evidence
    ``q``, ``u`` uniform over the real keys, ``gamma = sqrt(dh)`` by default.

    ``q (B, H, Q, dh)``, ``k (B, H, N, dh)``, ``key_mask (B, N)`` bool (True = real token) ->
    ``(p (B, H, Q, N), certificate)`` (:class:`probe.solve.exact.ExactCertificate`, shaped ``(B, H, Q)``).
    """
    gamma = math.sqrt(q.shape[-1]) if gamma is None else gamma
    B, _, _, N = *q.shape[:3], k.shape[2]
    log_preference = torch.zeros(B, 1, 1, N, dtype=q.dtype, device=q.device)
    if key_mask is not None:
        log_preference = log_preference.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return exact_attention((k / gamma).unsqueeze(2), q, log_preference, alpha, return_certificate=True)


def ot_attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: Optional[torch.Tensor] = None,
    extra_k: Optional[torch.Tensor] = None,
    extra_mask: Optional[torch.Tensor] = None,
    source_weights: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    gamma: Optional[float] = None,
    cost: Cost = dot_cost,
) -> torch.Tensor:
    r"""The OT attention weights (eq. 22) of every query over the candidate set, for every head.

    ``q (B, H, Q, dh)`` the evidence, ``k (B, H, n, dh)`` the input's templates (also candidates),
    ``key_mask (B, n)`` bool (True = real token; padding is neither a source nor a candidate),
    ``extra_k (B, H, m, dh)`` / ``extra_mask (B, m)`` optional extra candidates (the training trick; a sample
    without extra candidates has an all-False row), ``source_weights (B, n)`` (default: uniform over the real
    tokens).  Returns ``p (B, H, Q, n + m)``: candidates ordered input first, then extra.
    The formula itself is :func:`probe.solve.ot.ot_attention` (one place for the math).
    """
    B, H, n, dh = k.shape
    gamma = math.sqrt(dh) if gamma is None else gamma
    if key_mask is None:
        key_mask = torch.ones(B, n, dtype=torch.bool, device=k.device)
    candidates, candidate_mask = k, key_mask
    if extra_k is not None:
        if extra_mask is None:
            extra_mask = torch.ones(extra_k.shape[0], extra_k.shape[2], dtype=torch.bool, device=k.device)
        candidates = torch.cat([k, extra_k], dim=-2)
        candidate_mask = torch.cat([key_mask, extra_mask], dim=-1)
    if source_weights is None:
        source_weights = key_mask.to(k.dtype) / key_mask.sum(-1, keepdim=True).to(k.dtype)
    else:
        source_weights = torch.where(key_mask, source_weights, torch.zeros((), dtype=source_weights.dtype))
    M = cost(k, candidates)  # (B, H, n, N): M[j, t] = M(t_j, t)
    M = torch.where(candidate_mask[:, None, None, :], M, torch.full((), float("inf"), dtype=M.dtype))
    # one OT problem per (batch, head, query): batch dims (B, H, Q)
    return ot_attention(
        candidates.unsqueeze(2),  # (B, H, 1, N, dh)
        source_weights[:, None, None, :],  # (B, 1, 1, n)
        M.unsqueeze(2),  # (B, H, 1, n, N)
        q,  # (B, H, Q, dh)
        alpha,
        gamma,
    )


class MultiHeadAttention(nn.Module):
    """Multi-head attention whose weights are softmax, OT (eq. 22), Sinkhorn or exact: the same parameters
    (one ``qkv`` projection to ``heads * head_dim`` and an output projection) for all four kinds.

    ``forward(x, mask=None, extra=None, extra_mask=None, query_index=None)``: ``x (B, n, dim)``,
    ``mask (B, n)`` bool, ``extra (B, m, dim)`` the extra candidates' hidden states (OT only: their keys
    and values are added to the candidate set), ``query_index`` an int to evaluate only that query's output
    (``(B, 1, dim)``; exact, since a query's output does not depend on the other queries for softmax, OT and
    exact; for Sinkhorn all queries are coupled by the column normalisation, so all are computed and one is
    kept).  The exact kind keeps the certificate of its last forward in ``last_certificate``
    (:class:`probe.solve.exact.ExactCertificate`, ``(B, H, Q)``; None before the first).
    """

    KINDS = ("softmax", "ot", "sinkhorn", "exact")

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        kind: str = "softmax",
        dropout: float = 0.0,
        alpha: float = 1.0,
        gamma: Optional[float] = None,
        cost: Cost = dot_cost,
        sinkhorn_iterations: int = 3,
    ):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.kind, self.heads, self.head_dim = kind, heads, head_dim
        self.alpha = float(alpha)
        self.gamma = float(math.sqrt(head_dim) if gamma is None else gamma)
        self.cost = cost
        self.sinkhorn_iterations = sinkhorn_iterations
        self.qkv = nn.Linear(dim, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.last_certificate: Optional[ExactCertificate] = None

    def split(self, x: torch.Tensor):
        """``(B, n, dim)`` -> queries, keys, values, each ``(B, H, n, dh)``."""
        B, n, _ = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def weights(self, x, mask=None, extra=None, extra_mask=None, query_index=None):
        """The attention weights ``(B, H, Q, N)`` and the values ``(B, H, N, dh)`` they mix."""
        q, k, v = self.split(x)
        if self.kind != "ot" and extra is not None:
            raise ValueError("extra candidates exist only for the OT attention")
        if self.kind == "sinkhorn":
            w = sinkhorn_attention_weights(q, k, mask, self.sinkhorn_iterations)
            if query_index is not None:
                w = w[:, :, query_index : query_index + 1]
            return w, v
        if query_index is not None:
            q = q[:, :, query_index : query_index + 1]
        if self.kind == "softmax":
            return softmax_attention_weights(q, k, mask, self.gamma), v
        if self.kind == "exact":
            w, self.last_certificate = exact_attention_weights(q, k, mask, self.alpha, self.gamma)
            return w, v
        extra_k = None
        if extra is not None:
            _, extra_k, extra_v = self.split(extra)
            v = torch.cat([v, extra_v], dim=-2)
        w = ot_attention_weights(q, k, mask, extra_k, extra_mask, None, self.alpha, self.gamma, self.cost)
        return w, v

    def forward(self, x, mask=None, extra=None, extra_mask=None, query_index=None):
        if self.kind != "softmax" and torch.is_autocast_enabled(x.device.type):
            # under mixed precision the OT, Sinkhorn and exact layers compute their queries, keys, values and
            # weights in float32 (the exact solve itself in float64, as without autocast); only their output
            # projection runs in the lower precision
            with torch.autocast(x.device.type, enabled=False):
                w, v = self.weights(x.float(), mask, None if extra is None else extra.float(), extra_mask,
                                    query_index)
                out = (w @ v).transpose(1, 2).flatten(2)
            return self.dropout(self.proj(out))
        w, v = self.weights(x, mask, extra, extra_mask, query_index)
        out = (w @ v).transpose(1, 2).flatten(2)  # (B, Q, H * dh)
        return self.dropout(self.proj(out))


class OTAttention(MultiHeadAttention):
    """Multi-head OT attention (eq. 22): :class:`MultiHeadAttention` with ``kind="ot"``.

    Keys are the templates, queries the evidence, values what is mixed; ``u`` uniform over the real tokens;
    ``alpha = 1``, ``gamma = sqrt(head_dim)`` and the cost :func:`dot_cost` by default (see the module's
    docstring).  ``forward(x, mask=None, extra=None, extra_mask=None, query_index=None)``: ``extra`` holds
    the hidden states of an extra candidate set (the training trick).
    """

    def __init__(self, dim, heads, head_dim, dropout=0.0, alpha=1.0, gamma=None, cost: Cost = dot_cost):
        super().__init__(dim, heads, head_dim, "ot", dropout, alpha, gamma, cost)


class SinkhornAttention(MultiHeadAttention):
    """Multi-head Sinkhorn attention (Sinkformers): :class:`MultiHeadAttention` with ``kind="sinkhorn"``."""

    def __init__(self, dim, heads, head_dim, dropout=0.0, iterations: int = 3):
        super().__init__(dim, heads, head_dim, "sinkhorn", dropout, sinkhorn_iterations=iterations)


class ExactAttention(MultiHeadAttention):
    """Multi-head exact attention: :class:`MultiHeadAttention` with ``kind="exact"`` (module docstring).

    Each head and query solves the KL problem with templates ``k / gamma``, evidence ``q`` and ``u`` uniform over
    the real tokens, and mixes the values with its exact posterior; ``alpha = 1`` and ``gamma = sqrt(head_dim)``
    by default.  ``last_certificate`` holds the certificate of the last forward.
    """

    def __init__(self, dim, heads, head_dim, dropout=0.0, alpha=1.0, gamma=None):
        super().__init__(dim, heads, head_dim, "exact", dropout, alpha, gamma)
