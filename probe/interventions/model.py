"""What can intervene, and the model made ready for it: its language-model head, how its outputs are
pooled, and the masked-LM inputs every forward of an example runs on."""

from __future__ import annotations

import copy
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from probe.capture.adapters.generic import (
    DECODER,
    ENCODER,
    ENCODER_DECODER,
    InterfaceAdapter,
)
from probe.capture.adapters.interface import register as register_attention
from probe.core.errors import ProbeError

_F64 = torch.float64


#: the substitutes, in display order
SUBSTITUTES = ("exact", "second-order", "null", "model")
#: the ``site`` value of the whole-model substitution
WHOLE = "whole"
#: fraction of each example's (non-special) tokens scored by a masked-LM head
MASK_FRACTION = 0.15


@dataclass
class InterventionConfig:
    """What to substitute and measure.

    Attributes:
        substitutes: among :data:`SUBSTITUTES`.
        alphas: strengths; the substitutes of each alpha are built from the site's problems at that alpha.
        spaces: parameterisations (``hidden``, ``key``); ``None``: the adapter's first (default) space.
        rtol: the solver's tolerance (as for the rows).
        seed: seeds the null's draws and the masked-LM mask (with the example id and site).
        per_site: run the per-site mode.
        from_site: per site, rerun the model from the site's layer on (the earlier layers' outputs replayed
            from the unmodified forward, :class:`Trace`); ``False``: a full forward per site.
        whole_model: run the whole-model mode.
    """

    substitutes: tuple[str, ...] = SUBSTITUTES
    alphas: tuple[float, ...] = (1.0,)
    spaces: tuple[str, ...] | None = None
    rtol: float = 1e-9
    seed: int = 0
    per_site: bool = True
    whole_model: bool = True
    from_site: bool = True

    def __post_init__(self):
        unknown = [s for s in self.substitutes if s not in SUBSTITUTES]
        if unknown or not self.substitutes:
            raise ProbeError(
                f"Unknown substitute(s) {', '.join(map(repr, unknown)) or '(none given)'}: choose among "
                f"{', '.join(SUBSTITUTES)} (comma-separated)."
            )
        if any(not (a > 0 and math.isfinite(a)) for a in self.alphas):
            raise ProbeError(f"alpha must be positive and finite, got {list(self.alphas)}.")


# --------------------------------------------------------------------------------------------------
# what can intervene, and the model with its language-model head


def can_intervene(loaded) -> str | None:
    """Why this loaded model cannot have its attention substituted (a sentence), or ``None`` if it can."""
    adapter = loaded.adapter
    if not isinstance(adapter, InterfaceAdapter):
        return (
            f"probe captures {loaded.info.get('model_type', type(loaded.model).__name__)} attention with hooks on the "
            "family's own attention code, which offers no point to substitute its weights; interventions work for "
            "the families that compute attention through transformers' attention interface (BERT, T5, BART, GPT-2, "
            "Llama, ...)"
        )
    return None


def require_intervention(loaded) -> None:
    """:func:`can_intervene` as a :class:`ProbeError` (to refuse before a run)."""
    reason = can_intervene(loaded)
    if reason is not None:
        raise ProbeError(f"Cannot intervene on this model: {reason}. Run without --intervene.")


def inputs_kind(loaded) -> str:
    return loaded.adapter.family.inputs


def _head_classes(model_type: str):
    from transformers.models.auto import modeling_auto as auto

    return {
        "masked": {auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model_type),
                   auto.MODEL_FOR_PRETRAINING_MAPPING_NAMES.get(model_type)} - {None},
        "causal": {auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)} - {None},
        "seq2seq": {auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(model_type)} - {None},
    }


#: the language-model head each input kind can have
_HEAD_OF_INPUTS = {ENCODER: "masked", DECODER: "causal", ENCODER_DECODER: "seq2seq"}


def lm_kind(loaded) -> str | None:
    """``"masked"``, ``"causal"`` or ``"seq2seq"`` when the loaded model carries that language-model head
    (its class is the family's LM class), else ``None``."""
    kind = _HEAD_OF_INPUTS[inputs_kind(loaded)]
    model = loaded.model
    names = {type(model).__name__}
    if kind == "masked":
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )

        names &= {MODEL_FOR_MASKED_LM_MAPPING_NAMES.get(model.config.model_type)}
    else:
        names &= _head_classes(model.config.model_type)[kind]
    return kind if names else None


def with_lm_head(loaded):
    """The loaded model with its language-model head, when its checkpoint has one (its config's
    ``architectures`` name the family's masked-LM / pretraining class for encoders, its causal-LM class for
    decoders; encoder-decoders are loaded with their seq2seq head by the adapter already); else ``loaded``
    itself.  Pretrained weights come from the same checkpoint (every head weight must be in it:
    ``ProbeError`` otherwise); ``init="random"`` builds the head model from the config with the run's seed.
    Returns a new :class:`~probe.capture.loading.LoadedModel` (``info["class"]`` and ``info["lm_head"]`` updated)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from probe.capture.loading import LoadedModel

    if lm_kind(loaded) is not None or inputs_kind(loaded) == ENCODER_DECODER:
        info = dict(loaded.info, lm_head=lm_kind(loaded))
        return LoadedModel(adapter=loaded.adapter, model=loaded.model, tokenizer=loaded.tokenizer, info=info)
    config = copy.deepcopy(loaded.model.config)
    architectures = set(getattr(config, "architectures", None) or [])
    kind = _HEAD_OF_INPUTS[inputs_kind(loaded)]
    named = architectures & _head_classes(config.model_type)[kind]
    if not named:
        return LoadedModel(adapter=loaded.adapter, model=loaded.model, tokenizer=loaded.tokenizer,
                           info=dict(loaded.info, lm_head=None))
    loader = AutoModelForMaskedLM if kind == "masked" else AutoModelForCausalLM
    dtype = next(loaded.model.parameters()).dtype
    device = next(loaded.model.parameters()).device
    if loaded.info.get("init") == "random":
        torch.manual_seed(loaded.info.get("init_seed") or 0)
        model = loader.from_config(config, attn_implementation=register_attention(), dtype=dtype)
    else:
        from transformers.utils import logging as hf_logging

        source = loaded.info.get("path") or loaded.info["id"]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the load report is read below, not printed
        from probe.capture.loading import quiet_transformers

        try:
            with quiet_transformers():  # no "Loading weights" bar in probe's lines
                model, report = loader.from_pretrained(
                    source, config=config, revision=loaded.info.get("revision"), dtype=dtype,
                    attn_implementation=register_attention(), output_loading_info=True,
                )
        except (OSError, ValueError, RuntimeError) as error:
            raise ProbeError(f"Could not load the language-model head of '{source}': {error}.") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        missing = sorted(report.get("missing_keys") or [])
        if missing and type(model).__name__ not in named:
            # a pretraining class with another head (ELECTRA's discriminator): no masked-LM head to measure
            return LoadedModel(adapter=loaded.adapter, model=loaded.model, tokenizer=loaded.tokenizer,
                               info=dict(loaded.info, lm_head=None))
        if missing:
            raise ProbeError(
                f"The checkpoint of '{source}' names {type(model).__name__} in its architectures but lacks "
                f"{len(missing)} of its weights (e.g. {missing[0]!r}): its language-model head would be random. "
                "Measure without the LM effects (load the base model), or use the complete checkpoint."
            )
    model.eval().to(device)
    loaded.adapter.prepare(model)
    info = dict(loaded.info, **{"class": type(model).__name__, "lm_head": kind})
    return LoadedModel(adapter=loaded.adapter, model=model, tokenizer=loaded.tokenizer, info=info)


# --------------------------------------------------------------------------------------------------
# pooling


#: sentence-transformers' pooling flags, in the order it reads them, and probe's names for them
_POOLING_FLAGS = (
    ("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"), ("pooling_mode_lasttoken", "lasttoken"),
)


def pooling_of(loaded) -> str:
    """How embeddings are pooled: the model's own pooling where its files say so (sentence-transformers'
    ``modules.json`` naming a ``Pooling`` module whose ``config.json`` sets one mode), else ``"first"``
    (first token) for encoders and ``"last"`` (last real token) for decoders and encoder-decoders."""
    path = loaded.info.get("path")
    modules = Path(path) / "modules.json" if path else None
    if modules is not None and modules.is_file():
        try:
            entries = json.loads(modules.read_text())
            pooling_dirs = [e["path"] for e in entries if str(e.get("type", "")).endswith("Pooling")]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ProbeError(f"Could not read {modules}: {error}. Fix or remove the file.") from None
        if pooling_dirs:
            config_file = Path(path) / pooling_dirs[0] / "config.json"
            try:
                settings = json.loads(config_file.read_text())
            except (OSError, ValueError) as error:
                raise ProbeError(f"Could not read the pooling config {config_file}: {error}.") from None
            modes = [name for flag, name in _POOLING_FLAGS if settings.get(flag)]
            if len(modes) != 1:
                raise ProbeError(
                    f"{config_file} sets {len(modes)} pooling modes ({', '.join(modes) or 'none'} of "
                    f"{', '.join(name for _, name in _POOLING_FLAGS)}); probe compares one embedding per example: "
                    "keep exactly one mode in that file."
                )
            return modes[0]
    return "first" if inputs_kind(loaded) == ENCODER else "last"


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pooled embeddings ``(b, D)`` of final hidden states ``(b, n, D)`` over the real positions ``mask``
    ``(b, n)``, as sentence-transformers' ``Pooling`` computes them (float64)."""
    hidden = hidden.to(_F64)
    weights = mask.to(_F64).unsqueeze(-1)
    count = weights.sum(1).clamp_min(1)
    if pooling in ("cls", "first", "last", "lasttoken"):  # the first or last real position (either padding side)
        positions = torch.arange(mask.shape[1], device=mask.device)
        if pooling in ("cls", "first"):
            index = torch.where(mask.bool(), -positions, -mask.shape[1]).argmax(1)
        else:
            index = torch.where(mask.bool(), positions, -1).argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]
    if pooling == "mean":
        return (hidden * weights).sum(1) / count
    if pooling == "mean_sqrt_len":
        return (hidden * weights).sum(1) / count.sqrt()
    if pooling == "max":
        return hidden.masked_fill(~mask.bool().unsqueeze(-1), -1e9).amax(1)
    raise ValueError(f"unknown pooling {pooling!r}")


# --------------------------------------------------------------------------------------------------
# masked-LM inputs


def example_generator(seed: int, *parts) -> torch.Generator:
    """A generator seeded from ``seed`` and ``parts`` (example id, site, ...): the same draws for an
    example whatever batch it is in."""
    key = ":".join(str(p) for p in (seed, *parts)).encode()
    return torch.Generator().manual_seed(zlib.crc32(key))


def masked_lm_inputs(inputs: dict, tokenizer, seed: int, example_ids) -> tuple[dict, torch.Tensor]:
    """The inputs with 15% of each example's non-special real tokens (at least one) chosen from
    ``(seed, example id)``; of the chosen, 80% become the mask token, 10% a random token, 10% stay
    (BERT's recipe).  Returns ``(masked inputs, labels)``, labels ``-100`` except at the chosen positions,
    where they hold the original token."""
    if tokenizer.mask_token_id is None:
        raise ProbeError("The tokenizer has no mask token, so masked-LM effects cannot be measured.")
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids)).bool()
    special = set(tokenizer.all_special_ids)
    masked_ids = ids.clone()
    labels = torch.full_like(ids, -100)
    for row, example in enumerate(example_ids):
        generator = example_generator(seed, example, "mask")
        candidates = [j for j in range(ids.shape[1]) if mask[row, j] and int(ids[row, j]) not in special]
        if not candidates:
            continue
        count = max(1, round(MASK_FRACTION * len(candidates)))
        order = torch.randperm(len(candidates), generator=generator)[:count].sort().values
        chosen = torch.tensor(candidates)[order]
        draw = torch.rand(count, generator=generator)
        random_tokens = torch.randint(len(tokenizer), (count,), generator=generator)
        labels[row, chosen] = ids[row, chosen]
        replaced = torch.where(draw < 0.8, torch.full_like(random_tokens, tokenizer.mask_token_id),
                               torch.where(draw < 0.9, random_tokens, ids[row, chosen].cpu()))
        masked_ids[row, chosen] = replaced.to(ids.device)
    return dict(inputs, input_ids=masked_ids), labels


