"""BERT-family encoders: one self-attention site per layer, preference uniform over real keys.

Hooks sit on each layer's ``attention.self`` module (``BertSelfAttention``): its input is the hidden
state ``x`` entering attention, and with eager attention its second output is the model's attention
probabilities.  Logits are ``q.k / sqrt(d')`` with ``q = W_q x + b_q``; the key bias adds
``q.b_k / sqrt(d')`` to every key alike and cancels in the softmax.
"""

from __future__ import annotations

import torch

from .base import Adapter, SiteCapture, self_attention_problems
from .hooks import recording


class BertAdapter(Adapter):
    model_types = ("bert",)
    attention_types = ("self",)

    def load_model(self, name_or_path, *, config, revision, dtype):
        from transformers import AutoModel

        from ..loading import from_pretrained_checked

        return from_pretrained_checked(
            AutoModel, name_or_path, config=config, revision=revision, dtype=dtype, attn_implementation="eager"
        )

    def encode(self, tokenizer, texts, targets, max_length):
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"))

    def describe(self):
        return {
            "templates": "t_i = x_i / sqrt(d'), x_i = hidden state entering the layer's self-attention",
            "evidence": "z = W_k^T q with q = W_q x + b_q (per head); key bias cancels in softmax",
            "preference": "u uniform over the example's real (non-padding) tokens",
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i / sqrt(d') + const (alpha = 1)",
        }

    def capture(self, model, inputs):
        layers = model.encoder.layer
        modules = [layer.attention.self for layer in layers]
        with recording(modules) as records:
            model(**inputs)
        key_mask = inputs["attention_mask"].bool()
        log_preference = torch.zeros(key_mask.shape, dtype=torch.float64, device=key_mask.device)
        log_preference = log_preference.masked_fill(~key_mask, float("-inf"))[:, None, None, :]
        for index, (module, record) in enumerate(zip(modules, records)):
            hidden = record.hidden_states * key_mask.unsqueeze(-1)  # padding templates carry no weight
            heads = module.num_attention_heads
            gram, logits, evidence_sqnorm = self_attention_problems(
                hidden, module.query.weight, module.query.bias, module.key.weight, heads,
                logit_scale=module.attention_head_size**-0.5,
            )
            yield SiteCapture(
                attention_type="self",
                layer=index,
                gram=gram,
                logits=logits,
                log_preference=log_preference,
                evidence_sqnorm=evidence_sqnorm,
                query_mask=key_mask,
                model_probs=record.probs,
            )
