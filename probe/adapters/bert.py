"""BERT-family encoders: one self-attention site per layer, preference uniform over real keys.

Hooks sit on each layer's ``attention.self`` module (``BertSelfAttention``): its input is the hidden
state ``x`` entering attention, and with eager attention its second output is the model's attention
probabilities.  Logits are ``q.k / sqrt(d')`` with ``q = W_q x + b_q`` and ``k = W_k x + b_k``
(``BertSelfAttention.scaling``); in the hidden space the key bias adds ``q.b_k / sqrt(d')`` to every key
alike and cancels in the softmax.
"""

from __future__ import annotations

import torch

from .base import Adapter, SiteCapture, project
from .hooks import recording


class BertAdapter(Adapter):
    model_types = ("bert",)
    attention_types = ("self",)

    def encode(self, tokenizer, texts, targets, max_length):
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))

    def describe(self):
        return {
            "templates": "hidden: t_i = x_i / sqrt(d'), x_i = hidden state entering the layer's self-attention; "
            "key: t_i = k_i / sqrt(d'), k_i = W_k x_i + b_k",
            "evidence": "hidden: z = W_k^T q; key: z = q; q = W_q x + b_q (per head); the key bias cancels in "
            "the softmax",
            "preference": "u uniform over the example's real (non-padding) tokens",
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i / sqrt(d') + const (alpha = 1)",
        }

    def capture(self, model, inputs, emit):
        modules = [layer.attention.self for layer in model.encoder.layer]
        key_mask = inputs["attention_mask"].bool()
        log_preference = torch.zeros(key_mask.shape, dtype=torch.float64, device=key_mask.device)
        log_preference = log_preference.masked_fill(~key_mask, float("-inf"))[:, None, None, :]

        def on_record(index, record):
            module = modules[index]
            heads, x = module.num_attention_heads, record.hidden_states
            emit(SiteCapture(
                attention_type="self",
                layer=index,
                queries=project(x, module.query, heads),
                keys=project(x, module.key, heads),
                values=project(x, module.value, heads),
                logit_scale=module.attention_head_size**-0.5,
                log_preference=log_preference,
                query_mask=key_mask,
                key_mask=key_mask,
                query_ids=inputs["input_ids"],
                model_probs=record.probs,
                key_hidden=x,
                key_weight=module.key.weight.detach(),
            ))

        with recording(modules, on_record):
            model(**inputs)
