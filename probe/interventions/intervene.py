r"""Interventions: put a substitute for the model's attention weights into the forward pass and measure
what the model outputs then.

The question (issue 24): the exact posterior :math:`p^*` of an attention site's inference problem moves
the head's output by a lot (``output_deviation``); does it change what the *model* computes, once
residual connections, layer norms and later layers have had their say?

What is substituted
-------------------
An *attention site* is one attention module call of a forward pass (attention type, layer; the same
``(attention type, layer)`` as the rows).  At a substituted site every head's attention weights
:math:`p_{att}` (``(b, h, q, k)``) are replaced by substitute weights :math:`p_{sub}` and the model goes
on with :math:`p_{sub} V` through its own code: a function registered under ``"eager"`` in transformers'
attention interface (as :mod:`probe.capture.adapters.interface` does for the capture) runs the family's own
``eager_attention_forward`` (for the site's problems and the check below), then returns
``(p_sub @ V).transpose(1, 2)`` with the key/value heads repeated for grouped-query attention
(``repeat_kv``), exactly the form every family's eager function returns its output in.  That this is the
form is checked on the first substituted call of each attention class (the eager output must equal
``probs @ V`` so transposed); the output projection, residuals, norms and everything after are the
model's.  Families whose adapter does not go through the attention interface (MPNet, DeBERTa-v2, BLOOM:
hooks on their own attention code) cannot substitute: :func:`can_intervene` says so before a run.

Substitutes (per row: example, head, query; from the site's problems in one space and alpha)
------------------------------------------------------------------------------------------
* ``exact``: :math:`p^* = p(\lambda^*)`, the solver's certified optimum (:func:`probe.solve.dual.solve_dual`
  on :func:`probe.batch.rows.site_problems`: the rows' :math:`p^*`);
* ``second-order``: :math:`p(\lambda_2)`, :math:`\lambda_2 = \alpha(I + \alpha\Sigma_u)^{-1}z` (the paper's
  second-order prediction; :func:`probe.solve.derived.second_order_point` gives :math:`\lambda_2 = \alpha z +
  Vy_2`, so :math:`\log p(\lambda_2) = \log u + \alpha s + Ay_2` up to normalisation);
* ``null``: the control: a seeded random perturbation :math:`q` of the model's own attention with
  exactly the total variation :math:`\tau = TV(p^*, p_{att})` (:func:`null_attention`);
* ``model``: :math:`p_{att} = \mathrm{softmax}(\log u + \alpha s)` itself, rebuilt from the problems (the
  identity control: it reproduces the model's outputs to the fidelity tolerance).

Rows of padding queries keep the model's own weights.

Modes
-----
* *per site* (:func:`per_site_records`): one forward captures every site (and the reference outputs,
  and each layer's output: :class:`Trace`); then, per site and substitute, one forward *from the site
  on*: the layers (``ModuleList`` entries) called before the site's layer return what they returned in
  the capture, which is what they would compute again, and the model runs from the site's layer on.
  No family-specific layer call is needed: the layers' own modules are called by the model as usual,
  and the earlier ones answer from the trace; so do the linear projections of the site's layer called
  before its first attention call (query, key, value).  (``from_site=False``: a full forward per site.)
* *whole model* (:func:`whole_model_records`, "the inference transformer"): every site is substituted,
  its problems built and solved inside the attention call from the hidden states the earlier
  substitutions produced (new solves, certified: their convergence is recorded per example).  The
  first site's problems are the captured ones: it takes p* from the rows' solves, and with the per-site
  mode the forward starts after it, from that site's per-site forward (:class:`_HeadStart`).

Effects (per example; :func:`effects`)
--------------------------------------
With :math:`h, h'` the final hidden states of the original and the substituted model (the output of the
base model; the decoder's for encoder-decoders) over the example's real positions:

* ``hidden_change`` :math:`= \mathrm{mean}_j \|h'_j - h_j\| / \|h_j\|`;
* ``embedding_cosine``: cosine of the pooled embeddings; the pooling is the model's own where its files
  say so (sentence-transformers' ``modules.json`` + ``1_Pooling/config.json``: mean, cls, max,
  mean_sqrt_len, lasttoken), else the first token for encoders and the last real token for decoders
  and encoder-decoders (under causal attention the first position sees only itself); column
  ``pooling`` records which;
* with a language-model head (:func:`with_lm_head`): ``lm_loss_original`` and ``lm_loss`` (mean
  cross-entropy in nats over the scored positions) and ``top1_agreement`` (fraction of scored positions
  where the two models' most likely tokens agree).  Masked LM: 15% of each example's non-special
  tokens (at least one), drawn from the seed and the example id, replaced 80% by the mask token, 10% by
  a random token and 10% left (:func:`masked_lm_inputs`); every forward of the example, the reference
  included, then runs on these masked inputs.  Causal LM: every real position with a real next token,
  scored on that token; seq2seq: the same within the decoder input (teacher forcing).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import weakref
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from probe.solve import derived
from probe.capture.adapters.base import SiteCapture
from probe.capture.adapters.generic import DECODER, ENCODER, ENCODER_DECODER, InterfaceAdapter
from probe.capture.adapters.interface import eager_call, eager_registered
from probe.core.errors import ProbeError
from probe.batch.rows import site_problems
from probe.core.schema import INTERVENTION_COLUMNS, INTERVENTION_SCHEMA
from probe.solve.dual import DualProblems, DualSolution, factor_gram, solve_dual

__all__ = [
    "SUBSTITUTES", "WHOLE", "InterventionConfig", "Outputs", "can_intervene", "require_intervention", "with_lm_head",
    "lm_kind", "pooling_of", "masked_lm_inputs", "run_forward", "site_substitutes", "null_attention", "effects",
    "per_site_records", "whole_model_records", "intervention_records", "records_table", "COLUMNS", "Trace", "pool",
    "lm_labels", "site_name", "Substitute", "run_config", "batch_records",
]

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
    implementation = getattr(loaded.model.config, "_attn_implementation", None)
    if implementation != "eager":
        return f"the model runs {implementation} attention; interventions need eager attention"
    return None


def require_intervention(loaded) -> None:
    """:func:`can_intervene` as a :class:`ProbeError` (to refuse before a run)."""
    reason = can_intervene(loaded)
    if reason is not None:
        raise ProbeError(f"Cannot intervene on this model: {reason}. Run without --intervene.")


def _inputs_kind(loaded) -> str:
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
    kind = _HEAD_OF_INPUTS[_inputs_kind(loaded)]
    model = loaded.model
    names = {type(model).__name__}
    if kind == "masked":
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

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

    if lm_kind(loaded) is not None or _inputs_kind(loaded) == ENCODER_DECODER:
        info = dict(loaded.info, lm_head=lm_kind(loaded))
        return LoadedModel(adapter=loaded.adapter, model=loaded.model, tokenizer=loaded.tokenizer, info=info)
    config = copy.deepcopy(loaded.model.config)
    architectures = set(getattr(config, "architectures", None) or [])
    kind = _HEAD_OF_INPUTS[_inputs_kind(loaded)]
    named = architectures & _head_classes(config.model_type)[kind]
    if not named:
        return LoadedModel(adapter=loaded.adapter, model=loaded.model, tokenizer=loaded.tokenizer,
                           info=dict(loaded.info, lm_head=None))
    loader = AutoModelForMaskedLM if kind == "masked" else AutoModelForCausalLM
    dtype = next(loaded.model.parameters()).dtype
    device = next(loaded.model.parameters()).device
    if loaded.info.get("init") == "random":
        torch.manual_seed(loaded.info.get("init_seed") or 0)
        model = loader.from_config(config, attn_implementation="eager", dtype=dtype)
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
                    attn_implementation="eager", output_loading_info=True,
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
    return "first" if _inputs_kind(loaded) == ENCODER else "last"


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


def _example_generator(seed: int, *parts) -> torch.Generator:
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
        generator = _example_generator(seed, example, "mask")
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


# --------------------------------------------------------------------------------------------------
# the forward pass with substitution


@dataclass
class Outputs:
    """What a forward pass gave.

    Attributes:
        hidden: final hidden states ``(b, n, D)`` (the base model's output; the decoder's for
            encoder-decoders).
        mask: the real positions of ``hidden``, ``(b, n)`` bool.
        logits: the LM head's logits ``(b, n, V)``, or ``None`` without a head.
    """

    hidden: torch.Tensor
    mask: torch.Tensor
    logits: torch.Tensor | None = None


#: ``at_site(name, site)``: the substitute weights ``(b, h, q, k)`` for this site, or ``None`` to keep the model's
SiteFunction = Callable[[str, SiteCapture], "torch.Tensor | None"]


def site_name(attention_type: str, layer: int) -> str:
    """The ``site`` value of an attention site: ``"<attention type>:<layer>"`` (e.g. ``self:3``)."""
    return f"{attention_type}:{layer}"


def _repeat_kv(value: torch.Tensor, heads: int) -> torch.Tensor:
    """``(b, g, k, d)`` -> ``(b, heads, k, d)``: query head ``j`` uses value head ``j // (heads / g)``
    (transformers' ``repeat_kv``)."""
    groups = value.shape[1]
    return value if groups == heads else value.repeat_interleave(heads // groups, dim=1)


@dataclass
class Trace:
    """What the block calls of a forward gave, so that a later forward on the same inputs that changes
    nothing before a given block call can start there (:func:`run_forward`'s ``trace`` and ``start_at``).

    A *block* is the outermost module around an attention site that is an entry of a ``ModuleList`` (a
    transformer layer: ``encoder.layer.3``, ``decoder.block.1``, ``layers.0``, ALBERT's shared layer
    group, called once per layer).  Every block call before the one that contains the first substituted
    site gets exactly the inputs it got in the traced forward (the forward is the same function of the
    same inputs up to there), so the rerun returns its recorded output instead of computing it.

    The same holds within the block call a rerun starts at, up to its first attention call: the
    projections of that site's module computed before it (its query, key and value: a quarter of a BERT
    layer's products) return their recorded outputs too (``projections``).

    Attributes:
        outputs: each block call's output, in call order.
        sites: the site names called within each block call.
        block_of: site name -> the index of the block call it was called in.
        modules: site name -> its attention module.
        projections: site name -> {projection module: its output}: the linear layers of the site's module
            called (once each) in the site's block call before its attention call.
    """

    outputs: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    block_of: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)
    projections: dict = field(default_factory=dict)


def _blocks(model, site_modules) -> list | None:
    """The blocks of the model's sites (:class:`Trace`), or ``None`` if some site is in no ``ModuleList``."""
    named = dict(model.named_modules())
    names = {module: name for name, module in named.items()}
    blocks = []
    for module in site_modules:
        parts = names[module].split(".")
        found = None
        for end in range(1, len(parts) + 1):  # the outermost ancestor (or itself) that is a ModuleList entry
            parent = named.get(".".join(parts[:end - 1]) if end > 1 else "")
            if isinstance(parent, torch.nn.ModuleList):
                found = named[".".join(parts[:end])]
                break
        if found is None:
            return None
        if found not in blocks:
            blocks.append(found)
    return blocks


@dataclass
class _Layout:
    """What every substituting forward of a model needs to know of it, found once per model (:func:`_layout`).

    Attributes:
        sites: site module -> its attention type.
        names: module -> its name in the model.
        blocks: the sites' blocks (:class:`Trace`), ``None`` if some site is in no ``ModuleList``.
        extra: keyword arguments of every forward (``use_cache=False`` where the model takes it).
        projections: site module -> its linear layers (``nn.Linear``, transformers' ``Conv1D``).
        checked: the attention classes whose eager output was checked to be ``probs @ V``.
    """

    sites: dict
    names: dict
    blocks: list | None
    extra: dict
    projections: dict
    checked: set = field(default_factory=set)


_LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, _Layout]]" = weakref.WeakKeyDictionary()


def _layout(loaded) -> _Layout:
    """The :class:`_Layout` of ``loaded.model`` (with ``loaded.adapter``'s sites), cached with the model."""
    model, adapter = loaded.model, loaded.adapter
    cached = _LAYOUTS.get(model)
    if cached is None or cached[0] is not adapter:
        from transformers.pytorch_utils import Conv1D

        sites = adapter.site_modules(model)
        accepts = "use_cache" in inspect.signature(model.forward).parameters
        projections = {
            site: [m for m in site.modules() if m is not site and isinstance(m, (torch.nn.Linear, Conv1D))]
            for site in sites
        }
        cached = adapter, _Layout(sites=sites, names={module: name for name, module in model.named_modules()},
                                  blocks=_blocks(model, sites), extra={"use_cache": False} if accepts else {},
                                  projections=projections)
        _LAYOUTS[model] = cached
    return cached[1]


def _cloned(value):
    """A copy of a block's output (tensors cloned, so that the rerun cannot change the recorded ones)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)) and not hasattr(value, "keys"):
        return type(value)(_cloned(v) for v in value)
    return value


@contextmanager
def _substituting(loaded, inputs: dict, at_site: SiteFunction, trace: Trace | None = None,
                  start_at: int | None = None, record: Trace | None = None, record_until: int | None = None):
    """Within the block, every eager attention call of ``loaded.model`` runs the family's own eager
    attention, builds the call's :class:`SiteCapture` (as the adapter's capture does) and hands it to
    ``at_site``; weights it returns replace the call's attention weights (module docstring).  A site
    function with an ``only`` attribute (the name of the one site it substitutes) gets ``None`` for the
    site: it needs no :class:`SiteCapture`, and none is built.

    ``trace`` with ``start_at``: block calls before that index return their recorded outputs (their sites
    count as called).  ``record`` (an empty :class:`Trace`): the block calls of this forward are recorded
    into it, replayed ones included; only those before ``record_until`` when given."""
    adapter, model = loaded.adapter, loaded.model
    layout = _layout(loaded)
    sites, names = layout.sites, layout.names
    roles = adapter._roles(inputs)
    key_inputs: dict = {}
    handles = []
    if adapter.family.key is not None:
        for module in sites:
            handles.append(getattr(module, adapter.family.key).register_forward_pre_hook(
                lambda _, args, module=module: key_inputs.__setitem__(module, args[0].detach())
            ))
    per_type: dict[str, int] = {}
    called: set = set()
    block_calls = {"count": 0, "current": None}  # block calls so far; the recorded one now running
    replay = trace is not None and start_at is not None
    patched: list = []
    recent: dict = {}  # recording: projection -> [calls in this block call, its last output]
    only = getattr(at_site, "only", None)
    pending: dict = {}  # replaying: projection -> the output it gave in the traced forward
    if replay and start_at < len(trace.sites) and trace.sites[start_at]:  # up to the block's first attention call
        pending = dict(trace.projections.get(trace.sites[start_at][0], {}))
    if replay or record is not None:
        if layout.blocks is None:
            raise ValueError("this model's sites are not in ModuleList blocks: no trace")
        if record is not None:
            def projected(module, _args, output):
                if block_calls["current"] is not None:
                    entry = recent.setdefault(module, [0, None])
                    entry[0] += 1
                    entry[1] = output.detach().clone() if isinstance(output, torch.Tensor) else None

            for projections in layout.projections.values():
                for projection in projections:
                    handles.append(projection.register_forward_hook(projected))
        for projection in pending:
            def answering(*args, projection=projection, original=projection.forward, **kwargs):
                answer = pending.pop(projection, None)
                return original(*args, **kwargs) if answer is None else answer.clone()

            patched.append((projection, projection.__dict__.get("forward")))
            projection.forward = answering

        def through(original):
            def forward(*args, **kwargs):
                index = block_calls["count"]
                block_calls["count"] += 1
                keep = record is not None and (record_until is None or index < record_until)
                if replay and index < start_at:
                    for name in trace.sites[index]:
                        kind = name.rsplit(":", 1)[0]
                        per_type[kind] = per_type.get(kind, 0) + 1
                        called.add(trace.modules[name])
                    if keep:
                        record.outputs.append(_cloned(trace.outputs[index]))
                        record.sites.append(list(trace.sites[index]))
                        for name in trace.sites[index]:
                            record.block_of[name], record.modules[name] = index, trace.modules[name]
                    return _cloned(trace.outputs[index])
                if keep:
                    record.outputs.append(None)
                    record.sites.append([])
                    recent.clear()
                outer, block_calls["current"] = block_calls["current"], index if keep else None
                try:
                    output = original(*args, **kwargs)
                finally:
                    block_calls["current"] = outer
                if keep:
                    record.outputs[index] = _cloned(output)  # later layers may change it in place
                return output
            return forward

        for block in layout.blocks:
            patched.append((block, block.__dict__.get("forward")))
            block.forward = through(block.forward)

    def substituting_attention(module, query, key, value, attention_mask, *args, **kwargs):
        output, probs, call = eager_call(module, query, key, value, attention_mask, *args, **kwargs)
        attention_type = sites.get(module)
        if attention_type is None:
            raise ProbeError(
                f"{names.get(module, type(module).__name__)} computed attention but is not declared as a site of "
                f"{adapter.family.name}: add it to the family's sites."
            )
        layer = per_type.get(attention_type, 0)
        per_type[attention_type] = layer + 1
        called.add(module)
        name = site_name(attention_type, layer)
        current = block_calls["current"]
        if current is not None:
            record.sites[current].append(name)
            record.block_of[name], record.modules[name] = current, module
            record.projections[name] = {  # computed once in this block call, before this attention call
                projection: recent[projection][1] for projection in layout.projections[module]
                if recent.get(projection, [0])[0] == 1 and recent[projection][1] is not None
            }
            for projection in layout.projections[module]:
                recent.pop(projection, None)
        pending.clear()  # an attention call: the projections before it are done
        if only is not None:  # a function that substitutes one site: no SiteCapture anywhere
            key_inputs.pop(module, None)
            if name != only:
                return output, probs
            weights = at_site(name, None)
        else:
            site = adapter._site(call, attention_type, layer, roles[attention_type], key_inputs.pop(module, None))
            weights = at_site(name, site)
        if weights is None:
            return output, probs
        values = _repeat_kv(value, query.shape[1])
        if type(module) not in layout.checked:
            expected = torch.matmul(probs, values).transpose(1, 2)
            tolerance = 64 * torch.finfo(output.dtype).eps  # the same product as eager's: rounding at most
            scale = float(output.abs().max()) if output.numel() else 0.0
            close = expected.shape == output.shape and torch.allclose(
                expected, output, rtol=0, atol=tolerance * (1 + scale))
            if not close:
                raise ProbeError(
                    f"{type(module).__name__}'s eager attention does not return (probs @ values) in the form probe "
                    "substitutes, so its attention weights cannot be replaced; this family cannot intervene."
                )
            layout.checked.add(type(module))
        weights = weights.to(device=value.device, dtype=value.dtype)
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights

    try:
        with eager_registered(substituting_attention, "attention substitution and capture blocks"):
            yield
    finally:
        for handle in handles:
            handle.remove()
        for block, previous_forward in patched:
            if previous_forward is None:
                del block.forward
            else:
                block.forward = previous_forward
    silent = [names[module] for module in sites if module not in called]
    if silent:
        raise ProbeError(
            f"{', '.join(silent[:3])} computed attention without transformers' eager attention function, so "
            "probe could not substitute its weights; load the model with attn_implementation='eager'."
        )


@torch.no_grad()
def run_forward(loaded, inputs: dict, at_site: SiteFunction | None = None, *, trace: Trace | None = None,
                start_at: int | None = None, record: Trace | None = None, record_until: int | None = None) -> Outputs:
    """One forward pass of ``loaded.model`` on ``inputs``; at each attention site ``at_site(name, site)``
    may return weights that replace the site's attention weights (``None`` everywhere: the model's own
    forward).  Returns the final hidden states (and the LM logits, with a head).

    ``trace`` (an empty :class:`Trace`) without ``start_at`` records the block calls of this forward; a
    later forward on the same inputs that substitutes nothing before the site ``name`` can pass that trace
    with ``start_at = trace.block_of[name]`` to start at the site's block (the forward from the site on).
    ``record`` (an empty :class:`Trace`) records this forward's block calls also while it replays a trace
    (those before ``record_until`` when given)."""
    if trace is not None and start_at is None:
        trace, record = None, trace
    model = loaded.model
    encoder_decoder = _inputs_kind(loaded) == ENCODER_DECODER
    target = model.get_decoder() if encoder_decoder else model.base_model
    grabbed = {}
    handle = target.register_forward_hook(lambda _m, _a, output: grabbed.__setitem__("hidden", output[0]))
    try:
        with _substituting(loaded, inputs, at_site or (lambda name, site: None), trace, start_at, record,
                           record_until):
            output = model(**inputs, **_layout(loaded).extra)
    finally:
        handle.remove()
    mask_name = "decoder_attention_mask" if encoder_decoder else "attention_mask"
    ids = inputs["decoder_input_ids" if encoder_decoder else "input_ids"]
    mask = inputs.get(mask_name)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    logits = getattr(output, "logits", None) if lm_kind(loaded) is not None else None
    return Outputs(hidden=grabbed["hidden"], mask=mask, logits=logits)


# --------------------------------------------------------------------------------------------------
# substitutes


@dataclass
class Substitute:
    """One substitute of a site: its weights and what its solve certified (per example).

    Attributes:
        weights: ``(b, h, q, k)`` float64 (padding queries: the model's own weights).
        solver_rows: rows solved per example ``(b,)`` (0 where no solve was needed).
        not_converged: rows whose certificate missed the tolerance, per example ``(b,)``.
        max_relative_error_bound: max ``error_bound / lambda_norm`` per example ``(b,)`` (NaN: no solve).
    """

    weights: torch.Tensor
    solver_rows: torch.Tensor
    not_converged: torch.Tensor
    max_relative_error_bound: torch.Tensor


def _solve(site: SiteCapture, alpha: float, space: str, rtol: float) -> tuple[DualProblems, DualSolution]:
    problems = site_problems(site, alpha, space)
    problems.factor = factor_gram(problems.gram)
    return problems, solve_dual(problems, rtol=rtol)


def null_attention(p_att: torch.Tensor, tau: torch.Tensor, allowed: torch.Tensor,
                   generator: torch.Generator) -> torch.Tensor:
    r"""A random distribution :math:`q` with :math:`TV(q, p_{att}) = \tau` exactly, per row.

    Rows ``(r, n)``: ``p_att`` distributions over the ``allowed`` keys, ``tau`` ``(r,)`` in
    :math:`[0, 1 - \min_{allowed} p_{att}]` (which holds for :math:`\tau = TV(p^*, p_{att})` with :math:`p^*`
    on the allowed keys: :math:`\tau = p^*(S) - p_{att}(S) \le 1 - p_{att}(S)` for :math:`S = \{p^* >
    p_{att}\}`).  Keys are split at random into acceptors :math:`A` (a random-length prefix of a random
    order of the keys with :math:`p_i \le 1 - \tau`, as long as :math:`p(A) \le 1 - \tau`; at least one)
    and donors :math:`D` (the other allowed keys, so :math:`p(D) \ge \tau`).  With random weights
    :math:`a` on :math:`A` (a flat Dirichlet draw) and :math:`d = p|_D / p(D)`,

    .. math::  q = p + \tau(a - d) \ge 0, \qquad \textstyle\sum q = 1, \qquad
               TV(q, p) = \tfrac{\tau}{2}(\sum_A a + \sum_D d) = \tau,

    since :math:`A` and :math:`D` are disjoint and :math:`\tau d_i = \tau p_i/p(D) \le p_i`.
    """
    device = p_att.device
    p, tau, allowed = p_att.to("cpu", _F64), tau.to("cpu", _F64).clamp(min=0), allowed.to("cpu")
    rows, n = p.shape
    draws = torch.rand(rows, n, generator=generator, dtype=_F64)
    slack = 4 * torch.finfo(_F64).eps  # tau = 1 - min p (the edge) must keep the least likely key feasible
    feasible = allowed & (p <= 1 - tau.unsqueeze(-1) + slack)
    least = torch.where(allowed, p, torch.inf).argmin(-1, keepdim=True)
    feasible.scatter_(-1, least, feasible.gather(-1, least) | allowed.gather(-1, least))
    order = torch.where(feasible, draws, 2.0).argsort(-1)  # feasible keys first, in random order
    cumulative = p.gather(-1, order).cumsum(-1)
    position = torch.arange(n).expand(rows, n)
    n_allowed = allowed.sum(-1, keepdim=True)
    length = 1 + (torch.rand(rows, 1, generator=generator, dtype=_F64) * (n_allowed - 1).clamp(min=0)).long()
    prefix = (position < length) & (position < feasible.sum(-1, keepdim=True))
    prefix &= cumulative <= 1 - tau.unsqueeze(-1) + slack  # a prefix, as the cumulative sum grows
    prefix[:, 0] |= feasible.gather(-1, order[:, :1]).squeeze(-1)  # at least one acceptor, whatever the rounding
    acceptors = torch.zeros_like(allowed).scatter(-1, order, prefix)
    donors = allowed & ~acceptors
    weights = torch.where(acceptors, -torch.log1p(-torch.rand(rows, n, generator=generator, dtype=_F64)), 0.0)
    a = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    donor_mass = torch.where(donors, p, 0.0).sum(-1, keepdim=True)
    d = torch.where(donors, p, 0.0) / donor_mass.clamp_min(1e-300)
    moved = (tau > 0) & acceptors.any(-1) & (donor_mass.squeeze(-1) > 0)
    q = p + tau.unsqueeze(-1) * (a - d)
    return torch.where(moved.unsqueeze(-1), q.clamp_min(0), p).to(device)


def site_substitutes(site: SiteCapture, kinds, alpha: float, space: str, rtol: float, seed: int,
                     example_ids, solved: tuple[DualProblems, DualSolution] | None = None) -> dict[str, Substitute]:
    """The substitute weights of ``site`` for each of ``kinds`` (module docstring), from its problems in
    ``space`` at ``alpha`` (one solve shared by ``exact`` and ``null``).  ``solved``: the site's problems and
    their solution as the rows' solver computed them (:meth:`probe.batch.rows.BatchSolver.solved`), which
    ``exact`` and ``null`` then take instead of solving again."""
    b, h, q, k = site.shape
    kinds = tuple(kinds)
    own = site.model_probs.to(_F64)
    real = site.query_mask[:, None, :, None].expand(b, h, q, 1)

    def shaped(rows):  # (g, m, n) -> (b, h, q, k); padding queries keep the model's weights
        return torch.where(real, rows.reshape(b, h, q, k).nan_to_num(0.0), own)

    none = torch.zeros(b, dtype=torch.long)
    no_bound = torch.full((b,), float("nan"), dtype=_F64)
    if any(kind in ("exact", "null") for kind in kinds):
        problems, solution = _solve(site, alpha, space, rtol) if solved is None else solved
        per_example = lambda x: x.reshape(b, -1)  # noqa: E731  (groups are example-major in both spaces)
        active = per_example(problems.active)
        stats = dict(  # on the CPU, like the records they go to
            solver_rows=active.sum(-1).cpu(),
            not_converged=(active & ~per_example(solution.converged)).sum(-1).cpu(),
            max_relative_error_bound=torch.where(
                active, per_example(solution.error_bound / solution.lambda_norm), -torch.inf).amax(-1).cpu(),
        )
    else:
        problems = site_problems(site, alpha, space)
        problems.factor = factor_gram(problems.gram)
        solution, stats = None, None
    log_pref = problems.log_preference.expand_as(problems.logits)
    p_att = None
    if any(kind in ("model", "null") for kind in kinds):
        p_att = derived.model_attention(problems.logits, log_pref, alpha, active=problems.active)
    out = {}
    for kind in kinds:
        entry = dict(solver_rows=none, not_converged=none, max_relative_error_bound=no_bound)
        if kind == "model":
            weights = shaped(p_att)
        elif kind == "exact":
            weights, entry = shaped(solution.attention), stats
        elif kind == "second-order":
            point, _ = derived.second_order_point(problems.factor, problems.logits, log_pref, alpha,
                                                  active=problems.active)
            # log p(lambda_2) = log u + alpha s + A y_2 (+ const): <t_i, alpha z + V y_2> = alpha s_i + (A y_2)_i
            theta = torch.add(log_pref, problems.logits, alpha=alpha)
            theta += torch.bmm(point, problems.factor.transpose(1, 2))
            weights = shaped(torch.softmax(theta.masked_fill(~(log_pref > -torch.inf), -torch.inf), dim=-1))
        elif kind == "null":
            tau = 0.5 * (solution.attention - p_att).abs().sum(-1)  # attention_tv of the rows
            allowed = (log_pref > -torch.inf).reshape(b, h * q, k)
            rows_p, rows_tau = p_att.reshape(b, h * q, k), tau.reshape(b, h * q)
            drawn = [
                null_attention(rows_p[i].nan_to_num(0.0), rows_tau[i].nan_to_num(0.0), allowed[i],
                               _example_generator(seed, example, site_name(site.attention_type, site.layer), "null"))
                for i, example in enumerate(example_ids)
            ]
            weights, entry = shaped(torch.stack(drawn)), stats
        else:
            raise ValueError(f"unknown substitute {kind!r}")
        out[kind] = Substitute(weights=weights, **entry)
    return out


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


# --------------------------------------------------------------------------------------------------
# the modes


def _prepared(loaded, inputs, example_ids, config):
    """(inputs, labels): masked-LM inputs when the model has a masked-LM head, with the scored tokens."""
    labels = None
    if lm_kind(loaded) == "masked":
        inputs, labels = masked_lm_inputs(inputs, loaded.tokenizer, config.seed, example_ids)
    return inputs, lm_labels(loaded, inputs, labels)


def _spaces(loaded, config) -> tuple[str, ...]:
    spaces = config.spaces or (loaded.adapter.spaces[0],)
    unsupported = [s for s in spaces if s not in loaded.adapter.spaces]
    if unsupported:
        raise ProbeError(
            f"This model supports the space(s) {', '.join(loaded.adapter.spaces)} only, not {', '.join(unsupported)}."
        )
    return tuple(spaces)


def _records(common: dict, example_ids, effect: dict, substitute: Substitute | dict) -> list[dict]:
    stats = substitute if isinstance(substitute, dict) else vars(substitute)
    rows = []
    for i, example in enumerate(example_ids):
        row = dict(common, example=int(example))
        for name in ("hidden_change", "embedding_cosine", "lm_loss_original", "lm_loss", "top1_agreement"):
            row[name] = float(effect[name][i])
        row["scored_tokens"] = int(effect["scored_tokens"][i])
        row["solver_rows"] = int(stats["solver_rows"][i])
        row["solver_not_converged"] = int(stats["not_converged"][i])
        row["max_relative_error_bound"] = float(stats["max_relative_error_bound"][i])
        rows.append(row)
    return rows


def per_site_records(loaded, inputs: dict, example_ids, config: InterventionConfig,
                     emit: Callable[[SiteCapture], None] | None = None) -> list[dict]:
    """Per-site mode: capture every site once, then for each site, space, alpha and substitute one forward
    with that site substituted; one record per example (:data:`COLUMNS`).

    ``emit``, if given, receives each captured site as the capture forward computes it (the pipeline's
    row solver can take the rows from this forward; with a masked-LM head these are the masked inputs)."""
    return _per_site(loaded, inputs, example_ids, config, emit)[0]


@dataclass
class _AtOneSite:
    """The site function of a per-site forward: ``weights`` at the site ``only``, the model's own elsewhere
    (declared by ``only``, so that no site's call builds a :class:`SiteCapture`: none is needed)."""

    only: str
    weights: torch.Tensor

    def __call__(self, name, _site):
        return self.weights if name == self.only else None


def _keeps_solutions(emit) -> bool:
    """Whether ``emit`` is a row solver that can keep its solutions for the substitutes
    (:meth:`probe.batch.rows.BatchSolver.keep`, :meth:`~probe.batch.rows.BatchSolver.solved` and
    :meth:`~probe.batch.rows.BatchSolver.forget`)."""
    return all(callable(getattr(emit, method, None)) for method in ("keep", "solved", "forget"))


def _per_site(loaded, inputs, example_ids, config, emit=None) -> tuple[list[dict], Outputs, dict]:
    require_intervention(loaded)
    inputs, labels = _prepared(loaded, inputs, example_ids, config)
    spaces, pooling = _spaces(loaded, config), pooling_of(loaded)
    substitutes: dict[tuple, dict[str, Substitute]] = {}
    order: list[tuple[str, tuple[str, int]]] = []
    # The rows' solver (the pipeline's emit) keeps its solutions: exact and null take p* from them after
    # the capture forward instead of solving every site a second time.
    reuse = _keeps_solutions(emit)
    later = tuple(kind for kind in config.substitutes if reuse and kind in ("exact", "null"))
    now = tuple(kind for kind in config.substitutes if kind not in later)
    deferred: list[tuple[str, SiteCapture]] = []
    if reuse and later:
        emit.keep()

    def build(name, site, kinds, solver=None):
        for space in spaces:
            for alpha in config.alphas:
                solved = solver.solved(site, space, alpha) if solver is not None else None
                built = site_substitutes(site, kinds, alpha, space, config.rtol, config.seed, example_ids, solved)
                for substitute in built.values():  # held until its forward: in the model's dtype
                    substitute.weights = substitute.weights.to(site.values.dtype)
                merged = {**substitutes.get((name, space, alpha), {}), **built}
                substitutes[name, space, alpha] = {kind: merged[kind] for kind in config.substitutes if kind in merged}

    def capture(name, site):  # the substitutes are built as each site is captured; the capture is let go
        order.append((name, (site.attention_type, site.layer)))
        if emit is not None:
            emit(site)
        if now:
            build(name, site, now)
        if later:  # held until the rows' solver has solved it
            deferred.append((name, site))
        return None

    trace = Trace() if config.from_site and _layout(loaded).blocks is not None else None
    reference = run_forward(loaded, inputs, capture, trace=trace)
    if deferred:
        emit.flush()  # every site's rows solved now (the lane, if any, gets nothing left to do)
        for name, site in deferred:  # the site's solutions let go as its substitutes are built
            build(name, site, later, emit)
            emit.forget(site)
        deferred.clear()
    # The whole-model forward substitutes the first site just as its per-site forward does, on the same
    # inputs: where that site is alone in the first block, the whole-model forward starts after it, from
    # the per-site forward's output of that block (heads[space, alpha, kind]: that output, and the
    # substitute with its certificates).
    first = order[0][0] if order else None
    head_start = trace is not None and first is not None and trace.sites[:1] == [[first]]
    heads: dict[tuple, _HeadStart] = {}
    records = []
    for name, (attention_type, layer) in order:
        start = {} if trace is None else {"trace": trace, "start_at": trace.block_of[name]}
        for space in spaces:
            for alpha in config.alphas:
                for kind, substitute in substitutes.pop((name, space, alpha)).items():
                    head = Trace() if head_start and name == first else None
                    changed = run_forward(loaded, inputs, _AtOneSite(name, substitute.weights), **start,
                                          record=head, record_until=2)  # block 1: its projections
                    if head is not None:
                        heads[space, alpha, kind] = _HeadStart(head, substitute)
                    common = dict(space=space, alpha=float(alpha), substitute=kind, site=name,
                                  attention_type=attention_type, layer=layer, pooling=pooling,
                                  lm_head=lm_kind(loaded))
                    records += _records(common, example_ids, effects(reference, changed, pooling, labels), substitute)
    return records, reference, heads


@dataclass
class _HeadStart:
    """The first block of a whole-model forward, done by a per-site forward (:func:`_per_site`).

    Attributes:
        trace: that forward's first two block calls (the first's output, and the second's projections).
        substitute: the site's substitute, with its certificates (the whole-model record sums them).
    """

    trace: Trace
    substitute: Substitute


def whole_model_records(loaded, inputs: dict, example_ids, config: InterventionConfig,
                        reference: Outputs | None = None, heads: dict | None = None,
                        solved: Callable | None = None) -> list[dict]:
    """Whole-model mode ("the inference transformer"): for each space, alpha and substitute one forward in
    which every site is substituted, its problems built and solved inside the attention call from the
    hidden states the earlier substitutions produced; the solver's certificates are summed over the
    sites per example.  One record per example, ``site`` = :data:`WHOLE`.  ``reference``: the unmodified
    model's outputs on these inputs when the caller has them (the per-site mode's capture); ``heads``: the
    first blocks the per-site mode has done (:class:`_HeadStart`, per space, alpha and substitute);
    ``solved``: the rows' solver's :meth:`~probe.batch.rows.BatchSolver.solved`, whose solution of the first
    site (nothing is substituted before it: its problems are the captured ones) the first site takes
    instead of solving again."""
    require_intervention(loaded)
    inputs, labels = _prepared(loaded, inputs, example_ids, config)
    spaces, pooling = _spaces(loaded, config), pooling_of(loaded)
    reference = run_forward(loaded, inputs) if reference is None else reference
    records = []
    b = len(example_ids)
    for space in spaces:
        for alpha in config.alphas:
            for kind in config.substitutes:
                totals = dict(solver_rows=torch.zeros(b, dtype=torch.long),
                              not_converged=torch.zeros(b, dtype=torch.long),
                              max_relative_error_bound=torch.full((b,), -torch.inf, dtype=_F64))

                def add(chosen, totals=totals):
                    totals["solver_rows"] += chosen.solver_rows
                    totals["not_converged"] += chosen.not_converged
                    totals["max_relative_error_bound"] = torch.fmax(
                        totals["max_relative_error_bound"], chosen.max_relative_error_bound)

                head = (heads or {}).get((space, alpha, kind))
                first = [head is None and solved is not None]  # the next site is the forward's first

                def substitute(name, site, kind=kind, space=space, alpha=alpha, add=add, first=first):
                    rows = solved(site, space, alpha) if first[0] else None
                    first[0] = False
                    chosen = site_substitutes(site, (kind,), alpha, space, config.rtol, config.seed, example_ids,
                                              rows)[kind]
                    add(chosen)
                    return chosen.weights

                start = {}
                if head is not None:  # the first block as the per-site forward of its one site did it
                    add(head.substitute)
                    start = {"trace": head.trace, "start_at": 1}
                changed = run_forward(loaded, inputs, substitute, **start)
                totals["max_relative_error_bound"] = torch.where(
                    totals["solver_rows"] > 0, totals["max_relative_error_bound"], math.nan)
                common = dict(space=space, alpha=float(alpha), substitute=kind, site=WHOLE, attention_type=None,
                              layer=None, pooling=pooling, lm_head=lm_kind(loaded))
                records += _records(common, example_ids, effects(reference, changed, pooling, labels), totals)
    return records


def intervention_records(loaded, inputs: dict, example_ids, config: InterventionConfig,
                         emit: Callable[[SiteCapture], None] | None = None) -> list[dict]:
    """Both modes as ``config`` asks (per site, then whole model, sharing the unmodified forward): the
    records of one batch.  ``emit``: as in :func:`per_site_records` (per-site mode only)."""
    records, reference, heads = [], None, None
    if config.per_site:
        records, reference, heads = _per_site(loaded, inputs, example_ids, config, emit)
    if config.whole_model:
        records += whole_model_records(loaded, inputs, example_ids, config, reference, heads)
    return records


def run_config(config) -> InterventionConfig:
    """The :class:`InterventionConfig` of a run's settings (:class:`probe.core.config.RunConfig`: ``--intervene``,
    ``--intervene-modes`` and the run's alphas, spaces, rtol and seed)."""
    modes = tuple(config.intervene_modes)
    return InterventionConfig(
        substitutes=tuple(config.intervene), alphas=tuple(config.alphas),
        spaces=tuple(config.spaces) if config.spaces else None, rtol=config.rtol, seed=config.seed,
        per_site="per-site" in modes, whole_model="whole" in modes,
    )


def batch_records(loaded, inputs: dict, example_ids, config: InterventionConfig,
                  emit: Callable[[SiteCapture], None]) -> list[dict]:
    """A run's batch: the records of :func:`intervention_records`, while ``emit`` (the run's row solver)
    receives every site of the unmodified forward they start from, so that the rows come from the same
    forward (on the masked inputs when the model has a masked-LM head).  Without the per-site mode that
    forward is the whole-model mode's reference."""
    if config.per_site:
        return intervention_records(loaded, inputs, example_ids, config, emit)
    require_intervention(loaded)
    prepared, _ = _prepared(loaded, inputs, example_ids, config)
    reuse, seen = _keeps_solutions(emit), []

    def capture(_name, site):
        if reuse and not seen:  # the first site: the whole model takes its p* from the rows' solve
            emit.keep(sites=[(site.attention_type, site.layer)])
        seen.append(site.layer)
        emit(site)

    reference = run_forward(loaded, prepared, capture)
    if reuse:
        emit.flush()  # the rows solved now: the first site takes its solution from them
    return whole_model_records(loaded, inputs, example_ids, config, reference, solved=emit.solved if reuse else None)


#: the columns of a record, with their arrow types (the key is (space, alpha, substitute, site, example)):
#: the interventions table's, defined in :mod:`probe.core.schema`
COLUMNS = INTERVENTION_COLUMNS


def records_table(records: list[dict]):
    """The records as a :class:`pyarrow.Table` with :data:`COLUMNS`' types."""
    import pyarrow as pa

    return pa.Table.from_pylist(records, schema=INTERVENTION_SCHEMA)
