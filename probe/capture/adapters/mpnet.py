r"""MPNet encoders (``model_type`` ``mpnet``, e.g. all-mpnet-base-v2): one self-attention site per layer,
with a relative position bias shared by all layers.

How transformers v5 runs it (``transformers/models/mpnet/modeling_mpnet.py``):

* ``MPNetEncoder.forward`` computes ``position_bias = compute_position_bias(hidden_states)`` once, a
  learned bias per head and bucketed relative distance ``i - j`` (T5-style bidirectional buckets over
  the *column* index, the same for every example), and hands the same tensor to every layer.
* ``MPNetSelfAttention.forward(hidden_states, attention_mask, position_bias, output_attentions)`` computes
  ``q = W_q x + b_q``, ``k = W_k x + b_k`` from its input ``x`` (the layer's input: MPNet is post-LN),
  then ``scores = q.k / sqrt(d') + position_bias + attention_mask`` (the additive padding mask of
  ``create_bidirectional_mask``), ``softmax``; it returns ``(output, probs)`` only when
  ``output_attentions`` is true, so the forward is run with ``output_attentions=True``.

Hooks on each ``MPNetSelfAttention`` record its input ``x``, the ``attention_mask`` and ``position_bias``
it received (positional arguments 1 and 2) and the probabilities it returned.  So

.. math::  \log u_{ji} = b_h(i - j) + m_{i}, \qquad \text{logit}_{ji} = q_j\cdot k_i/\sqrt{d'} + \log u_{ji},

the bias exactly as the model added it (per head and query, ``-inf`` for padding keys).  Templates and
evidence are BERT's: hidden space :math:`t_i = x_i/\sqrt{d'}`, :math:`z = W_k^\top q` (the key bias
cancels in the softmax); key space :math:`t_i = k_i/\sqrt{d'}`, :math:`z = q`.
"""

from __future__ import annotations

import torch

from probe.capture.adapters.base import Adapter, SiteCapture, padded_batch, project
from probe.capture.adapters.hooks import recording
from probe.capture.adapters.interface import mask_to_log
from probe.capture.selection import selected
from probe.core.errors import ProbeError

#: further MPNetSelfAttention inputs to record, as (keyword, positional index)
RECORDED_INPUTS = (("attention_mask", 1), ("position_bias", 2))


class MPNetAdapter(Adapter):
    model_types = ("mpnet",)
    attention_types = ("self",)

    def encode(self, tokenizer, texts, targets, max_length):
        return padded_batch(tokenizer, texts, max_length)

    def describe(self):
        return {
            "templates": "hidden: t_i = x_i / sqrt(d'), x_i = hidden state entering the layer's self-attention "
            "(the layer input); key: t_i = k_i / sqrt(d'), k_i = W_k x_i + b_k",
            "evidence": "hidden: z = W_k^T q; key: z = q; q = W_q x + b_q (per head); the key bias cancels in "
            "the softmax",
            "preference": "log u_i = relative position bias[head, query, i] (computed once by the encoder from "
            "bucketed relative distances and shared by all layers, as the model added it) + attention mask "
            "(-inf for padding keys)",
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i / sqrt(d') + position_bias + mask (alpha = 1)",
        }

    def capture(self, model, inputs, emit, selection=None):
        emit = selected(emit, selection)  # the sites and rows a run measures (probe.capture.selection)
        modules = [layer.attention.attn for layer in model.encoder.layer]
        key_mask = inputs["attention_mask"].bool()

        def on_record(index, record):
            module = modules[index]
            heads, x = module.num_attention_heads, record.hidden_states
            bias = record.inputs["position_bias"]
            if bias is None:
                raise ProbeError("MPNet self-attention ran without its relative position bias (position_bias).")
            log_u = bias.to(torch.float64)
            mask = mask_to_log(record.inputs["attention_mask"])
            if mask is not None:
                log_u = log_u + mask
            emit(SiteCapture(
                attention_type="self",
                layer=index,
                queries=project(x, module.q, heads),
                keys=project(x, module.k, heads),
                values=project(x, module.v, heads),
                logit_scale=module.attention_head_size**-0.5,
                log_preference=log_u,
                query_mask=key_mask,
                key_mask=key_mask,
                query_ids=inputs["input_ids"],
                model_probs=record.probs,
                key_hidden=x,
                key_weight=module.k.weight.detach(),
            ))

        with recording(modules, on_record, inputs=RECORDED_INPUTS):
            model(**inputs, output_attentions=True)
