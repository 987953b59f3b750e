r"""BLOOM decoders (``model_type`` ``bloom``): causal self-attention with ALiBi, one site per layer.

How transformers v5 runs it (``transformers/models/bloom/modeling_bloom.py``):

* ``BloomModel.forward`` builds ``alibi = build_alibi_tensor(attention_mask, n_head, dtype)``: per head
  ``h`` and key ``i``, ``m_h * pos_i`` with ``m_h`` the head's slope (``_get_alibi_slopes``) and
  ``pos_i = cumsum(attention_mask) - 1`` the key's position *within its own sequence* (left padding
  included), shape ``(b * h, 1, k)``.  Since softmax ignores a constant per query, ``m_h * pos_i``
  equals the linear distance penalty ``-m_h (j - i)`` of the ALiBi paper.  The causal mask comes from
  ``create_causal_mask`` (eager: additive, ``finfo.min`` for future and padding keys, ``(b, 1, q, k)``).
* ``BloomAttention.forward(hidden_states, residual, alibi, attention_mask, ...)`` (called with keywords
  by ``BloomBlock``) computes the fused ``query_key_value(x)`` from its input ``x`` (the output of
  ``input_layernorm``), splits it per head as ``(n_head, 3, d')`` -- query, key, value interleaved
  *per head* -- and computes ``alibi.baddbmm(q, k^T, beta=1, alpha=inv_norm_factor) + attention_mask``,
  ``inv_norm_factor = 1/sqrt(d')``, then softmax (in float32).  It always returns ``(output, probs)``.

So :math:`\text{logit}_{ji} = q_j\cdot k_i/\sqrt{d'} + \log u_{ji}` with

.. math::  \log u_{ji} = m_h\,\text{pos}_i + \text{mask}_{ji}

(``-inf`` for future and padding keys): ALiBi is the preference, the content dot product the evidence.
BLOOM has no rotary encoding, so the hidden space exists: :math:`t_i = x_i/\sqrt{d'}`,
:math:`z = W_k^\top q` with :math:`W_k` the key rows of the fused weight (the key bias cancels in the
softmax); key space :math:`t_i = k_i/\sqrt{d'}`, :math:`z = q`.

Queries are the real tokens; ``query`` is the token's position within its own sequence, also under
left padding (``query_positions``).  The first token's row has one key (kept, with deviation 0).
"""

from __future__ import annotations

import torch

from probe.capture.adapters.base import Adapter, SiteCapture, head_split, padded_batch
from probe.capture.adapters.hooks import recording
from probe.capture.adapters.interface import mask_to_log
from probe.capture.selection import selected
from probe.core.errors import ProbeError

#: further BloomAttention inputs to record, as (keyword, positional index)
RECORDED_INPUTS = (("alibi", 2), ("attention_mask", 3))


def fused_part(module, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight ``(h * d', D)`` and bias ``(h * d',)`` of the query (0), key (1) or value (2) rows of
    ``query_key_value``, whose output is laid out ``(n_head, 3, d')``."""
    fused = module.query_key_value
    heads, d_head = module.num_heads, module.head_dim
    weight = fused.weight.detach().view(heads, 3, d_head, -1)[:, part].reshape(heads * d_head, -1)
    bias = fused.bias.detach().view(heads, 3, d_head)[:, part].reshape(heads * d_head)
    return weight, bias


def fused_project(x: torch.Tensor, module, part: int) -> torch.Tensor:
    """Per-head ``W x + b`` of one part of the fused projection, in float64, ``(b, h, n, d')``."""
    weight, bias = fused_part(module, part)
    f64 = torch.float64
    return head_split(x.detach().to(f64) @ weight.to(f64).T + bias.to(f64), module.num_heads)


class BloomAdapter(Adapter):
    model_types = ("bloom",)
    attention_types = ("causal_self",)

    def encode(self, tokenizer, texts, targets, max_length):
        """Texts padded on the tokenizer's side (BLOOM's own tokenizer pads left); no pad token: eos."""
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ProbeError("The tokenizer has neither a pad nor an eos token to pad batches with.")
            tokenizer.pad_token = tokenizer.eos_token
        return padded_batch(tokenizer, texts, max_length)

    def describe(self):
        return {
            "templates": "hidden: t_i = x_i / sqrt(d'), x_i = output of the block's input_layernorm (the state "
            "entering attention); key: t_i = k_i / sqrt(d'), k_i = W_k x_i + b_k (key rows of the fused "
            "query_key_value)",
            "evidence": "hidden: z = W_k^T q; key: z = q; q = W_q x + b_q (per head); the key bias cancels in "
            "the softmax",
            "preference": "log u_ji = ALiBi slope_h * (position of key i within its sequence) + causal mask "
            "(-inf for future and padding keys); equal, per query, to ALiBi's -slope_h * (j - i)",
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i / sqrt(d') + alibi + mask (alpha = 1)",
            "queries": "real tokens; query = position within the token's own sequence (also under left padding)",
        }

    def capture(self, model, inputs, emit, selection=None):
        emit = selected(emit, selection)  # the sites and rows a run measures (probe.capture.selection)
        modules = [block.self_attention for block in model.h]
        mask = inputs.get("attention_mask")
        key_mask = (torch.ones_like(inputs["input_ids"]) if mask is None else mask).bool()
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)

        def on_record(index, record):
            module = modules[index]
            x = record.hidden_states
            b, n = x.shape[:2]
            alibi = record.inputs["alibi"]
            log_u = alibi.to(torch.float64).view(b, module.num_heads, 1, alibi.shape[-1])
            causal = mask_to_log(record.inputs["attention_mask"])
            if causal is None:
                raise ProbeError("BLOOM attention ran without a causal mask; probe needs the eager causal mask.")
            emit(SiteCapture(
                attention_type="causal_self",
                layer=index,
                queries=fused_project(x, module, 0),
                keys=fused_project(x, module, 1),
                values=fused_project(x, module, 2),
                logit_scale=float(module.inv_norm_factor),
                log_preference=log_u + causal,
                query_mask=key_mask,
                key_mask=key_mask,
                query_ids=inputs["input_ids"],
                model_probs=record.probs,
                key_hidden=x,
                key_weight=fused_part(module, 1)[0],
                query_positions=positions,
            ))

        with recording(modules, on_record, inputs=RECORDED_INPUTS):
            model(**inputs, use_cache=False)
