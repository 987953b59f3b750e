"""Architecture adapters, declared in one registry keyed by ``config.model_type``.

A registry entry is called with no arguments to make the adapter: an :class:`Adapter` subclass, or a
:class:`~probe.capture.adapters.generic.Family` (a family that computes attention through transformers' attention
interface: one line here).  Families with their own attention code get an adapter file beside these.
"""

from __future__ import annotations

from typing import Callable

from probe.capture.adapters.base import (
    SPACES,
    Adapter,
    SiteCapture,
    SpaceProblems,
    space_problems,
)
from probe.capture.adapters.bert import BertAdapter
from probe.capture.adapters.bloom import BloomAdapter
from probe.capture.adapters.deberta_v2 import DebertaV2Adapter
from probe.capture.adapters.gemma import UncappedFamily
from probe.capture.adapters.generic import (
    BART_SITES,
    DECODER,
    ENCODER,
    ENCODER_DECODER,
    ROTARY_DECODER_SITES,
    Family,
    InterfaceAdapter,
)
from probe.capture.adapters.mpnet import MPNetAdapter
from probe.capture.adapters.t5 import T5Adapter
from probe.core.errors import ProbeError

REGISTRY: dict[str, Callable[[], Adapter]] = {
    # encoders: self
    "bert": BertAdapter,
    "roberta": BertAdapter,
    "xlm-roberta": BertAdapter,
    "camembert": BertAdapter,
    "electra": BertAdapter,
    "albert": Family("albert", ENCODER, {"self": r"albert_layers\.\d+\.attention$"}, key="key"),  # shared layers
    "distilbert": Family("distilbert", ENCODER, {"self": r"transformer\.layer\.\d+\.attention$"}, key="k_lin"),
    # encoder-decoders: encoder_self, decoder_self, cross
    "t5": T5Adapter,
    "mt5": T5Adapter,
    "umt5": T5Adapter,
    "bart": Family("bart", ENCODER_DECODER, BART_SITES, key="k_proj"),
    "mbart": Family("mbart", ENCODER_DECODER, BART_SITES, key="k_proj"),
    "marian": Family("marian", ENCODER_DECODER, BART_SITES, key="k_proj"),
    # decoder-only: causal_self (rotary ones: key space only)
    "gpt2": Family("gpt2", DECODER, {"causal_self": r"(^|\.)h\.\d+\.attn$"}, key="c_attn", key_part=(1, 3)),
    "llama": Family("llama", DECODER, ROTARY_DECODER_SITES, key=None),
    "mistral": Family("mistral", DECODER, ROTARY_DECODER_SITES, key=None),
    "qwen2": Family("qwen2", DECODER, ROTARY_DECODER_SITES, key=None),
    "gemma": Family("gemma", DECODER, ROTARY_DECODER_SITES, key=None),
    "qwen3": Family("qwen3", DECODER, ROTARY_DECODER_SITES, key=None),  # q/k norms: inside q and k
    "phi3": Family("phi3", DECODER, ROTARY_DECODER_SITES, key=None),  # fused qkv_proj, partial rotary
    "olmo2": Family("olmo2", DECODER, ROTARY_DECODER_SITES, key=None),  # q/k norms: inside q and k
    # Gemma 2 and 3: refused where the config soft-caps attention logits (gemma.py)
    "gemma2": UncappedFamily("gemma2", DECODER, ROTARY_DECODER_SITES, key=None),
    "gemma3_text": UncappedFamily("gemma3_text", DECODER, ROTARY_DECODER_SITES, key=None),
    "gemma3": UncappedFamily("gemma3", DECODER, {"causal_self": r"(^|\.)language_model\.layers\.\d+\.self_attn$"},
                             key=None),  # the multimodal model's language model (text inputs only)
    "mpnet": MPNetAdapter,
    "deberta-v2": DebertaV2Adapter,
    "bloom": BloomAdapter,
}


def adapter_for(model_type: str) -> Adapter:
    """Return the adapter for a ``config.model_type``, or a :class:`ProbeError` listing what is supported."""
    try:
        return REGISTRY[model_type]()
    except KeyError:
        supported = ", ".join(sorted(REGISTRY))
        raise ProbeError(
            f"probe has no adapter for model type '{model_type}'. Supported model types: {supported}. "
            "To add one, declare it in probe.capture.adapters.REGISTRY (see docs/models.md, 'Adding an architecture')."
        ) from None


__all__ = [
    "Adapter", "SiteCapture", "SpaceProblems", "SPACES", "space_problems", "REGISTRY", "adapter_for", "Family",
    "InterfaceAdapter",
]
