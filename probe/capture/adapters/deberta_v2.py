r"""DeBERTa-v2/v3 encoders (``model_type`` ``deberta-v2``): disentangled self-attention, one site per layer.

How transformers v5 runs it (``transformers/models/deberta_v2/modeling_deberta_v2.py``,
``DisentangledSelfAttention.forward``): from the layer input ``x`` (post-LN: the previous layer's
output) it computes ``q = W_q x + b_q``, ``k = W_k x + b_k`` (``query_proj``, ``key_proj``) and

.. math::  \text{logit}_{ji} = \underbrace{\frac{q_j\cdot k_i}{\sqrt{s\,d'}}}_{\text{content-to-content}}
           + \underbrace{\frac{q_j\cdot k^{r}_{\delta(j,i)}}{\sqrt{s\,d'}}}_{\text{c2p}}
           + \underbrace{\frac{k_i\cdot q^{r}_{\delta(j,i)}}{\sqrt{s\,d'}}}_{\text{p2c}}

with :math:`s = 1 + [\text{c2p}] + [\text{p2c}]` (``scale_factor``; the scale is ``sqrt(d' * s)``),
:math:`\delta(j, i)` the (log-bucketed, clamped) relative position ``j - i`` and :math:`k^r, q^r` the
projections of the shared relative position embeddings (``pos_key_proj`` / ``pos_query_proj``, or
``key_proj`` / ``query_proj`` when ``share_att_key``), computed by
``DisentangledSelfAttention.disentangled_attention_bias``.  Masked keys are then set to
``finfo.min`` (``masked_fill`` with the boolean mask ``get_attention_mask`` builds: real query and real
key) and the result goes through ``softmax``.  The module returns ``(context, probs)``, with ``probs``
``None`` unless ``output_attentions``: the forward is run with ``output_attentions=True``.

**The split.** Only the content-to-content term is evidence: :math:`c_\text{scale} = 1/\sqrt{s\,d'}` and
hidden space :math:`t_i = x_i/\sqrt{d'}`, :math:`z = c\,W_k^\top q` (key space :math:`t_i = k_i/\sqrt{d'}`,
:math:`z = c\,q`) with :math:`c = c_\text{scale}\sqrt{d'} = 1/\sqrt{s}`.  Both position terms go into the
preference, per query: :math:`\log u_{ji} = \text{c2p}_{ji} + \text{p2c}_{ji} + m_{ji}` (``-inf`` for
masked keys).  Note that p2c depends on the key's content :math:`k_i` and c2p on the query's
:math:`q_j`, so this preference is not content-free as T5's or MPNet's bias is; it is what the model
adds to :math:`q\cdot k`, which is the split the issue asks for.

The hook records the module's input ``x``, its ``attention_mask`` (positional 1), ``relative_pos`` and
``rel_embeddings`` (keywords), and the position terms are recomputed with the module's own
``disentangled_attention_bias`` on the same inputs (eval mode: its dropout is the identity), so they
are the model's values, in the model's dtype.  ``query_states`` (passed only by the extra passes of
``DebertaV2Model`` when ``z_steps > 1``; transformers sets ``z_steps = 0``) is not supported.
"""

from __future__ import annotations

import torch

from probe.capture.adapters.base import Adapter, SiteCapture, padded_batch, project
from probe.capture.adapters.hooks import recording
from probe.capture.adapters.interface import mask_to_log
from probe.capture.selection import selected
from probe.core.errors import ProbeError

#: further DisentangledSelfAttention inputs to record, as (keyword, positional index)
RECORDED_INPUTS = (("attention_mask", 1), ("query_states", 3), ("relative_pos", 4), ("rel_embeddings", 5))


def scale_factor(module) -> int:
    """``s`` of ``DisentangledSelfAttention.forward``: 1 + one per position term (c2p, p2c)."""
    return 1 + ("c2p" in module.pos_att_type) + ("p2c" in module.pos_att_type)


def position_terms(module, x: torch.Tensor, relative_pos, rel_embeddings) -> torch.Tensor | None:
    """c2p + p2c, ``(b, h, q, k)``, as the module computed them from its input ``x``; ``None`` without
    relative attention."""
    if not module.relative_attention:
        return None
    heads = module.num_attention_heads
    query_layer = module.transpose_for_scores(module.query_proj(x), heads)  # (b * h, n, d'), as forward does
    key_layer = module.transpose_for_scores(module.key_proj(x), heads)
    terms = module.disentangled_attention_bias(
        query_layer, key_layer, relative_pos, module.pos_dropout(rel_embeddings), scale_factor(module)
    )
    if not isinstance(terms, torch.Tensor):  # pos_att_type empty: score stays 0
        return None
    b, n = x.shape[:2]
    return terms.view(b, heads, n, terms.shape[-1])


class DebertaV2Adapter(Adapter):
    model_types = ("deberta-v2",)
    attention_types = ("self",)

    def encode(self, tokenizer, texts, targets, max_length):
        return padded_batch(tokenizer, texts, max_length)

    def describe(self):
        return {
            "templates": "hidden: t_i = x_i / sqrt(d'), x_i = hidden state entering the layer's self-attention "
            "(the layer input); key: t_i = k_i / sqrt(d'), k_i = W_k x_i + b_k",
            "evidence": "the content-to-content term only: hidden: z = W_k^T q / sqrt(s); key: z = q / sqrt(s); "
            "q = W_q x + b_q (per head), s = 1 + [c2p] + [p2c] (the model scales logits by 1/sqrt(s d')); the "
            "key bias cancels in the softmax",
            "preference": "log u_ji = c2p_ji + p2c_ji (the disentangled position terms, per query, as the model "
            "computed them: q_j . k^r_delta(j,i) / sqrt(s d') + k_i . q^r_delta(j,i) / sqrt(s d')) + attention "
            "mask (-inf for padding keys)",
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i / sqrt(s d') + c2p + p2c + mask (alpha = 1)",
        }

    def capture(self, model, inputs, emit, selection=None):
        emit = selected(emit, selection)  # the sites and rows a run measures (probe.capture.selection)
        modules = [layer.attention.self for layer in model.encoder.layer]
        key_mask = inputs["attention_mask"].bool()

        def on_record(index, record):
            module = modules[index]
            heads, x = module.num_attention_heads, record.hidden_states
            if record.inputs["query_states"] is not None:
                raise ProbeError("DeBERTa-v2 attention with separate query_states (DebertaV2Model.z_steps > 1) is "
                                 "not supported: probe captures the encoder's self-attention.")
            # the module's mask: nonzero = allowed (it calls .bool())
            log_u = mask_to_log(record.inputs["attention_mask"].bool())
            terms = position_terms(module, x, record.inputs["relative_pos"], record.inputs["rel_embeddings"])
            if terms is not None:
                log_u = log_u + terms.to(torch.float64)
            emit(SiteCapture(
                attention_type="self",
                layer=index,
                queries=project(x, module.query_proj, heads),
                keys=project(x, module.key_proj, heads),
                values=project(x, module.value_proj, heads),
                logit_scale=(module.attention_head_size * scale_factor(module)) ** -0.5,
                log_preference=log_u,
                query_mask=key_mask,
                key_mask=key_mask,
                query_ids=inputs["input_ids"],
                model_probs=record.probs,
                key_hidden=x,
                key_weight=module.key_proj.weight.detach(),
            ))

        with recording(modules, on_record, inputs=RECORDED_INPUTS):
            model(**inputs, output_attentions=True)
