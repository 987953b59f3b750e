r"""What every architecture adapter produces: one :class:`SiteCapture` per attention site.

An *attention site* is one attention module of the model (an attention type and a layer).  For every
example, head and query token of a site the adapter gives the reduced dual problem of DEVELOPERS.md
for :math:`\alpha = 1`:

* templates :math:`t_i = x_i/\sqrt{d'}` (``x_i`` the hidden state entering attention), through their
  Gram matrix :math:`G = TT^\top`;
* evidence :math:`z` such that :math:`\langle t_i, z\rangle + \log u_i` equals the model's attention
  logit up to a constant per query, through the logits :math:`s_i = \langle t_i, z\rangle` and
  :math:`\|z\|^2`;
* preference :math:`\log u` (unnormalised, ``-inf`` for keys that are not part of the problem).

The pipeline rescales for other :math:`\alpha` and hands the problems to :mod:`probe.solver`; adapters
know nothing about solving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class SiteCapture:
    """Reduced problems of one attention site for one batch of examples (alpha = 1).

    Shapes use ``b`` examples, ``h`` heads, ``q`` query positions, ``k`` key positions.

    Attributes:
        attention_type: e.g. ``"self"``, ``"encoder_self"``, ``"decoder_self"``, ``"cross"``.
        layer: layer index within its stack, from 0.
        gram: ``G = T T^T``, ``(b, k, k)``, float64.
        logits: ``s = T z`` per head and query, ``(b, h, q, k)``, float64.
        log_preference: ``log u``, broadcastable to ``(b, h, q, k)``, ``-inf`` where excluded.
        evidence_sqnorm: ``||z||^2``, ``(b, h, q)``, float64.
        query_mask: which query positions are real tokens (rows to write), ``(b, q)`` bool.
        model_probs: the model's own attention probabilities (eager), ``(b, h, q, k)``, for the
            fidelity check.
    """

    attention_type: str
    layer: int
    gram: torch.Tensor
    logits: torch.Tensor
    log_preference: torch.Tensor
    evidence_sqnorm: torch.Tensor
    query_mask: torch.Tensor
    model_probs: torch.Tensor


class Adapter(ABC):
    """Per-architecture capture.  Subclasses are declared in :data:`probe.adapters.REGISTRY`."""

    #: ``config.model_type`` values this adapter handles.
    model_types: tuple[str, ...] = ()
    #: attention types it produces, in display order.
    attention_types: tuple[str, ...] = ()

    @abstractmethod
    def load_model(self, name_or_path: str, *, config, revision: str | None, dtype: torch.dtype):
        """Load the model with eager attention (so that attention probabilities are observable).

        ``config`` is the checkpoint's config with its attention implementation already set to eager
        (a value saved in config.json would otherwise win over the ``attn_implementation`` argument).
        """

    @abstractmethod
    def encode(self, tokenizer, texts: list[str], targets: list[str] | None, max_length: int) -> dict:
        """Tokenise a batch into the model's keyword inputs (padded)."""

    @abstractmethod
    def capture(self, model, inputs: dict) -> Iterator[SiteCapture]:
        """Run the model on ``inputs`` with forward hooks and yield one capture per attention site."""

    def describe(self) -> dict:
        """Conventions recorded in the manifest (parameterisation, decoder input, ...)."""
        return {}


def head_split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, n, heads * d) -> (b, heads, n, d)."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def self_attention_problems(hidden, w_query, b_query, w_key, heads, logit_scale):
    r"""Reduced problems for dot-product attention with logits ``logit_scale * q.k``.

    ``hidden`` is ``(b, n, D)`` (the states entering attention; used for keys and, when the same,
    queries), ``w_query``/``w_key`` are ``(heads*d', D)``, ``b_query`` is ``(heads*d',)`` or None.
    Returns ``(gram, logits, evidence_sqnorm)`` in float64 with :math:`t_i = x_i/\sqrt{d'}` and
    :math:`z = \text{logit\_scale}\sqrt{d'}\,W_k^\top q`, so that :math:`\langle t_i, z\rangle` is the
    model's logit minus the key-bias term (constant over keys).
    """
    return cross_attention_problems(hidden, hidden, w_query, b_query, w_key, heads, logit_scale)


def cross_attention_problems(query_hidden, key_hidden, w_query, b_query, w_key, heads, logit_scale):
    r"""Like :func:`self_attention_problems` with queries from ``query_hidden`` ``(b, q, D_q)`` and
    templates (keys) from ``key_hidden`` ``(b, k, D)``."""
    f64 = torch.float64
    x_q = query_hidden.detach().to(f64)
    x_k = key_hidden.detach().to(f64)
    w_query = w_query.detach().to(f64)
    w_key = w_key.detach().to(f64)
    d_head = w_key.shape[0] // heads
    query = x_q @ w_query.T
    if b_query is not None:
        query = query + b_query.detach().to(f64)
    query = head_split(query, heads)  # (b, h, q, d')
    key_nobias = head_split(x_k @ w_key.T, heads)  # (b, h, k, d') = W_k x_i
    # z = c W_k^T q with c = logit_scale * sqrt(d'), so <t_i, z> = logit_scale * q . W_k x_i
    scale = logit_scale * d_head**0.5
    logits = (query @ key_nobias.transpose(-1, -2)) * logit_scale
    w_key_heads = w_key.view(heads, d_head, -1)
    key_gram = w_key_heads @ w_key_heads.transpose(-1, -2)  # (h, d', d') = W_k,h W_k,h^T
    evidence_sqnorm = scale**2 * torch.einsum("bhqd,hde,bhqe->bhq", query, key_gram, query)
    gram = (x_k @ x_k.transpose(-1, -2)) / d_head
    return gram, logits, evidence_sqnorm
