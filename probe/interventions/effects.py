"""What a substitution changes in the model's outputs: hidden states, pooled embeddings and, with a
language-model head, the loss and the top-1 agreement."""

from __future__ import annotations

import math

import torch

from probe.interventions.forward import Outputs
from probe.interventions.model import lm_kind, pool

_F64 = torch.float64

# --------------------------------------------------------------------------------------------------
# effects


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (nats) of ``labels`` ``(b, n)`` under ``logits`` ``(b, n, V)``; 0 where labels are -100."""
    scored = labels != -100
    losses = torch.nn.functional.cross_entropy(
        logits.to(_F64).transpose(1, 2), labels.masked_fill(~scored, 0), reduction="none")
    return losses.masked_fill(~scored, 0.0)


def lm_labels(loaded, inputs: dict, labels: torch.Tensor | None) -> torch.Tensor | None:
    """The scored tokens of each position (``-100``: not scored), aligned with the logits: the masked-LM
    ``labels`` as given; causal and seq2seq LM: the next real token of each real position."""
    kind = lm_kind(loaded)
    if kind is None:
        return None
    if kind == "masked":
        return labels
    ids = inputs["decoder_input_ids" if kind == "seq2seq" else "input_ids"]
    mask = inputs.get("decoder_attention_mask" if kind == "seq2seq" else "attention_mask", torch.ones_like(ids)).bool()
    following = torch.full_like(ids, -100)
    following[:, :-1] = torch.where(mask[:, :-1] & mask[:, 1:], ids[:, 1:], -100)
    return following


def effects(reference: Outputs, changed: Outputs, pooling: str, labels: torch.Tensor | None = None) -> dict:
    """Per-example effects of a substitution (module docstring), each a ``(b,)`` float64 tensor (and
    ``scored_tokens``): ``hidden_change``, ``embedding_cosine``, and with ``labels`` (scored tokens, -100
    elsewhere, aligned with the logits) ``lm_loss_original``, ``lm_loss``, ``top1_agreement``."""
    mask = reference.mask
    h, h2 = reference.hidden.to(_F64), changed.hidden.to(_F64)
    per_token = (h2 - h).norm(dim=-1) / h.norm(dim=-1)
    real = mask.to(_F64)
    result = {
        "hidden_change": (per_token.nan_to_num(0.0) * real).sum(-1) / real.sum(-1),
        "embedding_cosine": torch.nn.functional.cosine_similarity(
            pool(h, mask, pooling), pool(h2, mask, pooling), dim=-1),
    }
    b = h.shape[0]
    nan = torch.full((b,), float("nan"), dtype=_F64)
    result.update(lm_loss_original=nan, lm_loss=nan, top1_agreement=nan, scored_tokens=torch.zeros(b, dtype=torch.long))
    if labels is not None and reference.logits is not None and changed.logits is not None:
        scored = labels != -100
        count = scored.sum(-1)
        denominator = count.clamp_min(1).to(_F64)
        agree = (reference.logits.argmax(-1) == changed.logits.argmax(-1)) & scored
        empty = count == 0
        def mean(per_position):
            return (per_position.sum(-1) / denominator).masked_fill(empty, math.nan)

        result.update(
            lm_loss_original=mean(_token_losses(reference.logits, labels)),
            lm_loss=mean(_token_losses(changed.logits, labels)),
            top1_agreement=mean(agree.to(_F64)),
            scored_tokens=count,
        )
    return result


