r"""T5 encoder-decoders: encoder self-attention, decoder (causal) self-attention and cross-attention.

Every attention module of T5 is a ``T5Attention``.  Its input ``hidden_states`` is the output of the
``T5LayerNorm`` in front of it, i.e. the state ``x`` entering attention; for cross-attention the keys
come from the keyword input ``key_value_states``, the encoder's final output.  T5 logits are

.. math::  q\cdot k_i + b_{h}(i - j) + m_{ji}, \qquad q = W_q x_j,\ k_i = W_k x_i,

with **no** :math:`1/\sqrt{d'}` (``T5Attention.scaling == 1``), no q/k biases, the relative position
bias :math:`b` (computed by the first layer of each stack and shared by all its layers; zero for
cross-attention) and the additive mask :math:`m` (padding keys, and future keys in the decoder).
With :math:`t_i = x_i/\sqrt{d'}` and :math:`z = \sqrt{d'}\,W_k^\top q` we get
:math:`\langle t_i, z\rangle = q\cdot k_i`, so :math:`\log u_i = b_h(i - j) + m_{ji}` (``-inf`` where the
mask excludes the key) reproduces the logits exactly.

How transformers v5 runs it (``transformers/models/t5/modeling_t5.py``): ``T5Attention.forward`` returns
``(output, position_bias, attn_weights)`` -- the probabilities are the *third* output, the second is the
position bias (without the mask; v5 passes the mask separately as ``mask=``).  Layer 0 of a stack gets
``position_bias=None`` and computes it with ``compute_bias``; later layers receive layer 0's tensor as
the ``position_bias`` keyword.  Either way the second output is the bias the module actually added, so
it is recorded from there.

Decoder input: teacher forcing.  The target is the dataset's target column when given, else the text
itself (the decoder reconstructs the encoder input).  ``decoder_input_ids`` is the model's shift-right
of the tokenised target (``decoder_start_token_id`` -- the pad id 0 for T5 -- prepended, last token
dropped); ``decoder_attention_mask`` marks the real positions: the start token and the target tokens
but the last, so a target of ``n`` tokens including ``</s>`` gives ``n`` decoder positions (the
target's own attention mask), each predicting one target token.
"""

from __future__ import annotations

import torch

from ..errors import ProbeError
from .base import Adapter, SiteCapture, project
from .hooks import Record, recording


def mask_to_log(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's attention mask as float64 log-preference terms: ``-inf`` where a key is excluded.

    Additive float masks exclude with a very negative value (``finfo(dtype).min``); those become ``-inf``
    and any other value is kept as is (normally 0).  Boolean masks are ``True`` where attention is allowed.
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float64, device=mask.device).masked_fill(~mask, float("-inf"))
    excluded = mask <= torch.finfo(mask.dtype).min / 2
    return mask.to(torch.float64).masked_fill(excluded, float("-inf"))


#: T5Attention returns (output, position_bias, attention probabilities).
POSITION_BIAS_OUTPUT, PROBS_OUTPUT = 1, 2
#: further T5Attention inputs to record, as (keyword, positional index)
RECORDED_INPUTS = (("mask", 1), ("key_value_states", 2))


def log_preference(record: Record, heads: int) -> torch.Tensor:
    """``log u = position_bias + mask`` (float64, ``-inf`` for masked keys), shape ``(b, h, q, k)``."""
    b, q = record.hidden_states.shape[:2]
    k = record.probs.shape[-1]
    log_u = torch.zeros((b, heads, q, k), dtype=torch.float64, device=record.probs.device)
    position_bias = record.outputs[POSITION_BIAS_OUTPUT]
    if position_bias is not None:
        log_u = log_u + position_bias.to(torch.float64)
    mask = record.inputs["mask"]
    mask = mask_to_log(mask if isinstance(mask, torch.Tensor) else None)
    if mask is not None:
        log_u = log_u + mask
    return log_u


class T5Adapter(Adapter):
    model_types = ("t5",)
    attention_types = ("encoder_self", "decoder_self", "cross")

    def __init__(self):
        #: set by :meth:`prepare` from the model's config; T5 convention (the pad id) otherwise.
        self.decoder_start_token_id: int | None = None

    def model_class(self, config):
        from transformers import AutoModel, AutoModelForSeq2SeqLM

        architectures = list(getattr(config, "architectures", None) or [])
        if architectures and all(name.endswith("EncoderModel") for name in architectures):
            raise ProbeError(
                f"This is an encoder-only {config.model_type} checkpoint ({architectures[0]}): it has no decoder, "
                "so probe's encoder-decoder adapter (encoder self-, decoder self- and cross-attention) cannot run on it."
            )
        # The user's path for seq2seq checkpoints; T5Model-only (or other head) checkpoints load as T5Model.
        seq2seq = not architectures or any(name.endswith("ForConditionalGeneration") for name in architectures)
        return AutoModelForSeq2SeqLM if seq2seq else AutoModel

    def prepare(self, model):
        start = getattr(model.config, "decoder_start_token_id", None)
        self.decoder_start_token_id = start if start is not None else getattr(model.config, "pad_token_id", None)

    def encode(self, tokenizer, texts, targets, max_length):
        """Encoder input = ``texts``; decoder input = shift-right of ``targets`` (default: ``texts``)."""
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        labels = tokenizer(
            list(targets) if targets is not None else list(texts),
            padding=True, truncation=True, max_length=max_length, return_tensors="pt",
        )
        start = self.decoder_start_token_id
        if start is None:
            start = tokenizer.pad_token_id  # T5: decoder_start_token_id = pad_token_id = 0
        if start is None:
            raise ProbeError("The tokenizer has no pad token and the model no decoder_start_token_id.")
        label_ids, label_mask = labels["input_ids"], labels["attention_mask"]
        decoder_input_ids = torch.full_like(label_ids, start)
        decoder_input_ids[:, 1:] = label_ids[:, :-1]
        # Position j holds the start token (j = 0) or target token j - 1 and predicts target token j: the
        # real positions are those of the real target tokens, i.e. the target's own attention mask (the
        # final </s> enters only at a padding position, or is dropped by the shift).
        decoder_attention_mask = label_mask.clone()
        return {
            "input_ids": encoded["input_ids"],
            "attention_mask": encoded["attention_mask"],
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_attention_mask,
        }

    def describe(self):
        return {
            "templates": (
                "hidden: t_i = x_i / sqrt(d'), d' = d_kv; x_i = hidden state entering the T5Attention (output of the "
                "T5LayerNorm before it); for cross-attention x_i = the encoder's final output (key_value_states); "
                "key: t_i = k_i / sqrt(d'), k_i = W_k x_i"
            ),
            "evidence": (
                "hidden: z = sqrt(d') W_k^T q; key: z = sqrt(d') q; q = W_q x (per head; T5 has no q/k biases and "
                "no 1/sqrt(d') scaling)"
            ),
            "preference": (
                "log u_i = relative position bias[head, query, i] (as the model computed it: layer 0 of each stack, "
                "shared by later layers) + attention mask, -inf for padding keys and, in the decoder, future keys "
                "(causal); cross-attention has no position bias: u uniform over the real source tokens"
            ),
            "logit_identity": "alpha <t_i, z> + log u_i = q.k_i + position_bias + mask (alpha = 1)",
            "decoder_input": (
                "teacher forcing: decoder_input_ids = shift-right of the tokenised target (decoder_start_token_id "
                "prepended, last token dropped); target = the dataset's target column when given, else the text "
                "itself; real decoder positions = the start token and the target tokens but the last (a target of "
                "n tokens including </s> gives n positions)"
            ),
            "queries": "encoder_self: real encoder tokens; decoder_self and cross: real decoder positions",
        }

    def capture(self, model, inputs, emit):
        encoder_modules = [block.layer[0].SelfAttention for block in model.encoder.block]
        decoder_modules = [block.layer[0].SelfAttention for block in model.decoder.block]
        cross_modules = [block.layer[1].EncDecAttention for block in model.decoder.block]
        modules = encoder_modules + decoder_modules + cross_modules
        n_enc, n_dec = len(encoder_modules), len(decoder_modules)

        input_ids = inputs["input_ids"]
        encoder_mask = inputs.get("attention_mask")
        encoder_mask = (torch.ones_like(input_ids) if encoder_mask is None else encoder_mask).bool()
        decoder_ids = inputs["decoder_input_ids"]
        decoder_mask = inputs.get("decoder_attention_mask")
        decoder_mask = (torch.ones_like(decoder_ids) if decoder_mask is None else decoder_mask).bool()

        def on_record(index, record):
            if index < n_enc:
                site = ("encoder_self", index, encoder_mask, encoder_mask, input_ids)
            elif index < n_enc + n_dec:
                site = ("decoder_self", index - n_enc, decoder_mask, decoder_mask, decoder_ids)
            else:
                site = ("cross", index - n_enc - n_dec, decoder_mask, encoder_mask, decoder_ids)
            emit(self._site(modules[index], record, *site))

        with recording(modules, on_record, probs_index=PROBS_OUTPUT, inputs=RECORDED_INPUTS), torch.no_grad():
            model(**inputs, use_cache=False)

    @staticmethod
    def _site(module, record, attention_type, index, query_mask, key_mask, query_ids):
        heads = module.n_heads
        key_hidden = record.hidden_states
        if attention_type == "cross":
            key_hidden = record.inputs["key_value_states"]
            if key_hidden is None:
                raise ProbeError("T5 cross-attention ran without key_value_states (the encoder output).")
        return SiteCapture(
            attention_type=attention_type,
            layer=index,
            queries=project(record.hidden_states, module.q, heads),
            keys=project(key_hidden, module.k, heads),
            values=project(key_hidden, module.v, heads),
            logit_scale=float(getattr(module, "scaling", 1.0)),  # 1.0: T5 does not scale q.k
            log_preference=log_preference(record, heads),
            query_mask=query_mask,
            key_mask=key_mask,
            query_ids=query_ids,
            model_probs=record.probs,
            key_hidden=key_hidden,
            key_weight=module.k.weight.detach(),
        )
