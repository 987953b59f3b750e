"""BERT-like encoders (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA): one self-attention site per layer.

The site is each layer's ``attention.self`` module (``BertSelfAttention`` and its copies), which calls
the attention interface with ``q = W_q x + b_q`` and ``k = W_k x + b_k`` per head, ``scaling =
1/sqrt(d')`` (``BertSelfAttention.scaling``) and the additive padding mask; ``x``, the hidden state
entering attention, is the input of its ``key`` projection.  The preference is uniform over the
example's real tokens; in the hidden space the key bias adds ``q.b_k / sqrt(d')`` to every key alike
and cancels in the softmax.  Captured through :mod:`probe.capture.adapters.generic`.
"""

from __future__ import annotations

from probe.capture.adapters.generic import ENCODER, Family, InterfaceAdapter

BERT = Family(
    name="bert",
    inputs=ENCODER,
    sites={"self": r"(^|\.)attention\.self$"},
    key="key",
    notes={"preference": "u uniform over the example's real (non-padding) tokens (log u = the padding mask)"},
)


class BertAdapter(InterfaceAdapter):
    model_types = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
    attention_types = ("self",)
    family = BERT
