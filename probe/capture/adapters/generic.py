r"""One adapter for every family that computes attention through transformers' attention interface.

A family is declared by a :class:`Family`: how its inputs are encoded (``encoder``, ``encoder_decoder``
with teacher forcing, or ``decoder``-only), which modules are its attention sites and of which attention
type (regular expressions searched in the module names of the loaded model), and where the hidden-space
ingredients come from (the key projection: :math:`x` is what enters it, :math:`W_k` its weight).
Everything else comes from the capture point, :func:`probe.capture.adapters.interface.eager_attention_calls`:
per-head queries and keys exactly as the logits use them, the scale, the mask and any position bias
passed to the attention function, and the model's own eager probabilities.

Per call (one site of one forward pass) the site is (:class:`probe.capture.adapters.base.SiteCapture`):

* ``logit_scale`` = the call's ``scaling``; ``log u`` = ``attention_mask`` (``-inf`` where it excludes a
  key: padding, future keys, keys outside a sliding window) + ``position_bias`` (T5 family);
* ``layer`` = the order of the call among the calls of its attention type (so a module shared by all
  layers, as ALBERT's, gives one site per layer);
* ``query`` rows = each query's position within its own sequence (``cumsum(mask) - 1``: left padding
  keeps positions from 0);
* hidden space: :math:`x` = the input of the key projection (for cross-attention the encoder output),
  :math:`W_k` = its weight (a slice of it for fused projections: GPT-2's ``c_attn`` Conv1D computes
  :math:`[q, k, v] = x W + b` with ``W`` of shape ``(D, 3D)``, so :math:`W_k` = ``W[:, D:2D]^T``).
  Rotary models have none (the rotation of a key depends on its position, so :math:`k_i` is not
  :math:`W_k x_i + b_k`): ``key=None`` and the site supports the key space only.

After the forward pass every declared site module must have called the interface at least once (a model
not running eager attention, or a code path that bypasses the interface -- GPT-2 with
``reorder_and_upcast_attn`` -- is reported, never silently skipped), and every call must come from a
declared module.
"""

from __future__ import annotations

import inspect
import re
from collections import Counter
from dataclasses import dataclass, field

import torch

from probe.capture.adapters.base import SPACES, Adapter, SiteCapture
from probe.capture.adapters.interface import (
    AttentionCall,
    causal_log_preference,
    eager_attention_calls,
    mask_to_log,
    runs_probe_attention,
    runs_sdpa,
    sdpa_attention_calls,
)
from probe.capture.selection import SiteRows, site_rows
from probe.core.errors import ProbeError

#: how inputs are encoded (and which attention types exist)
ENCODER, ENCODER_DECODER, DECODER = "encoder", "encoder_decoder", "decoder"

#: site patterns shared by several families
BART_SITES = {
    "encoder_self": r"(^|\.)encoder\.layers\.\d+\.self_attn$",
    "decoder_self": r"(^|\.)decoder\.layers\.\d+\.self_attn$",
    "cross": r"(^|\.)decoder\.layers\.\d+\.encoder_attn$",
}
ROTARY_DECODER_SITES = {"causal_self": r"(^|\.)layers\.\d+\.self_attn$"}


@dataclass(frozen=True, eq=False)
class Family:
    """A family that fits the generic capture: one registry line, ``"model_type": Family(...)``.

    Attributes:
        name: the family's name (recorded in the manifest).
        inputs: ``ENCODER`` (attention type ``self``), ``ENCODER_DECODER`` (``encoder_self``,
            ``decoder_self``, ``cross``; teacher forcing) or ``DECODER`` (``causal_self``).
        sites: attention type -> regular expression searched in the names of the model's modules
            (``model.named_modules()``); the matching modules are the ones that call the attention
            interface.
        key: attribute name of the site module's key projection, for the hidden space (``None``:
            rotary, key space only).
        key_part: ``(index, count)``: the key is part ``index`` of ``count`` equal parts of the
            projection's output (fused projections); ``(0, 1)`` for a plain key projection.
        notes: entries that add to (or replace) the generic :meth:`InterfaceAdapter.describe`.
    """

    name: str
    inputs: str
    sites: dict
    key: str | None
    key_part: tuple[int, int] = (0, 1)
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        expected = {
            ENCODER: ("self",), DECODER: ("causal_self",), ENCODER_DECODER: ("encoder_self", "decoder_self", "cross"),
        }
        if tuple(self.sites) != expected.get(self.inputs):
            raise ValueError(f"{self.name}: inputs {self.inputs!r} needs sites for {expected.get(self.inputs)}")

    def __call__(self) -> "InterfaceAdapter":
        """A registry entry is called to make the adapter."""
        return InterfaceAdapter(self)


class InterfaceAdapter(Adapter):
    """The adapter of a :class:`Family` (``InterfaceAdapter(family)``, or a subclass binding ``family``)."""

    family: Family | None = None

    def __init__(self, family: Family | None = None):
        self.family = family or type(self).family
        self.attention_types = tuple(self.family.sites)
        self.spaces = SPACES if self.family.key is not None else ("key",)
        self.decoder_start_token_id: int | None = None
        self.forward_parameters: set[str] | None = None  # the model's forward arguments, from prepare()

    # ----------------------------------------------------------------------------------------------
    # loading

    def model_class(self, config):
        from transformers import AutoModel, AutoModelForSeq2SeqLM
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        )

        if self.family.inputs != ENCODER_DECODER:
            return AutoModel  # the base model: attention is all probe needs (no LM head in memory)
        architectures = list(getattr(config, "architectures", None) or [])
        halves = (("EncoderModel", "an encoder-only", "decoder"), ("ForCausalLM", "a decoder-only", "encoder"))
        for suffix, half, missing in halves:
            if architectures and all(name.endswith(suffix) for name in architectures):
                raise ProbeError(
                    f"This is {half} {config.model_type} checkpoint ({architectures[0]}), only one half of the "
                    f"encoder-decoder: it has no {missing}, so probe's encoder-decoder adapter (encoder self-, decoder "
                    "self- and cross-attention) cannot run on it."
                )
        # the user's path for seq2seq checkpoints; others (T5Model, heads) load as the base model
        seq2seq = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        return AutoModelForSeq2SeqLM if not architectures or seq2seq in architectures else AutoModel

    def prepare(self, model):
        self.forward_parameters = set(inspect.signature(model.forward).parameters)
        start = getattr(model.config, "decoder_start_token_id", None)
        self.decoder_start_token_id = start if start is not None else getattr(model.config, "pad_token_id", None)

    # ----------------------------------------------------------------------------------------------
    # encoding

    def encode(self, tokenizer, texts, targets, max_length):
        if self.family.inputs == ENCODER_DECODER:
            return self._encode_teacher_forcing(tokenizer, texts, targets, max_length)
        if self.family.inputs == DECODER:
            return self._encode_decoder(tokenizer, texts, max_length)
        encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        return {name: value for name, value in encoded.items() if self._accepts(name)}

    def _accepts(self, name: str) -> bool:
        return self.forward_parameters is None or name in self.forward_parameters

    def _encode_teacher_forcing(self, tokenizer, texts, targets, max_length):
        """Encoder input = ``texts``; decoder input = shift-right of ``targets`` (default: ``texts``):
        the decoder start token followed by the target without its last token."""
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
        if tokenizer.padding_side == "left":
            raise ProbeError(
                "Encoder-decoder targets must be padded on the right; set tokenizer.padding_side = 'right'."
            )
        decoder_input_ids = torch.full_like(label_ids, start)
        decoder_input_ids[:, 1:] = label_ids[:, :-1]
        # Position j holds the start token (j = 0) or target token j - 1 and predicts target token j: the
        # real positions are those of the real target tokens, i.e. the target's own attention mask.
        return {
            "input_ids": encoded["input_ids"],
            "attention_mask": encoded["attention_mask"],
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": label_mask.clone(),
        }

    def _encode_decoder(self, tokenizer, texts, max_length):
        """Token ids padded on the tokenizer's side (a tokenizer without a pad token pads with its end
        token; padding is masked), and ``position_ids`` counting each text's tokens from 0 (as
        ``generate`` does), so that left padding leaves positions unchanged."""
        ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
        candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
        pad = next((token for token in candidates if token is not None), 0)
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, tokens in enumerate(ids):
            columns = slice(width - len(tokens), width) if tokenizer.padding_side == "left" else slice(0, len(tokens))
            input_ids[row, columns] = torch.tensor(tokens, dtype=torch.long)
            attention_mask[row, columns] = 1
        encoded = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self._accepts("position_ids"):
            encoded["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return encoded

    # ----------------------------------------------------------------------------------------------
    # capture

    def site_modules(self, model) -> dict[torch.nn.Module, str]:
        """The model's attention site modules, each with its attention type, from the family's patterns."""
        found: dict[torch.nn.Module, str] = {}
        for name, module in model.named_modules():
            types = [kind for kind, pattern in self.family.sites.items() if re.search(pattern, name)]
            if len(types) > 1:
                raise ProbeError(f"{self.family.name}: module {name} matches the patterns of {', '.join(types)}.")
            if types:
                found[module] = types[0]
        if not found:
            raise ProbeError(
                f"No module of this {type(model).__name__} matches the attention sites declared for {self.family.name} "
                f"({self.family.sites}); the family declaration does not fit this model."
            )
        return found

    def capture(self, model, inputs, emit, selection=None):
        sites = self.site_modules(model)
        names = {module: name for name, module in model.named_modules()}
        roles = self.roles(inputs)
        key_inputs: dict[torch.nn.Module, torch.Tensor] = {}  # site module -> what entered its key projection
        handles = []
        if self.family.key is not None:
            for module in sites:
                projection = getattr(module, self.family.key)
                handles.append(projection.register_forward_pre_hook(
                    lambda _, args, module=module: key_inputs.__setitem__(module, args[0].detach())
                ))
        per_type, called = Counter(), set()

        def on_call(call: AttentionCall):
            attention_type = sites.get(call.module)
            if attention_type is None:
                raise ProbeError(
                    f"{names.get(call.module, type(call.module).__name__)} computed attention but is not declared as a "
                    f"site of {self.family.name}: add it to the family's sites."
                )
            layer = per_type[attention_type]
            per_type[attention_type] += 1
            called.add(call.module)
            key_input = key_inputs.pop(call.module, None)
            if selection is not None and not selection.wants(attention_type, layer):
                return  # a site left out: nothing of it is kept
            emit(self.site(call, attention_type, layer, roles[attention_type], key_input, selection))

        extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        try:
            with runs_probe_attention(model), torch.no_grad():
                calls = sdpa_attention_calls if runs_sdpa(model) else eager_attention_calls
                with calls(on_call):
                    model(**inputs, **extra)
        finally:
            for handle in handles:
                handle.remove()
        silent = [names[module] for module in sites if module not in called]
        if silent:
            raise ProbeError(
                f"{', '.join(silent[:3])}{' ...' if len(silent) > 3 else ''} computed attention without "
                "transformers' attention interface, so probe saw neither its logits nor its probabilities: its family "
                "computes attention in code of its own, which needs an adapter of its own (docs/models.md, 'Adding an "
                "architecture')."
            )

    def roles(self, inputs) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Attention type -> (query token ids, query mask, key mask)."""
        def ids_and_mask(ids_name, mask_name):
            ids = inputs[ids_name]
            mask = inputs.get(mask_name)
            return ids, (torch.ones_like(ids) if mask is None else mask).bool()

        source_ids, source_mask = ids_and_mask("input_ids", "attention_mask")
        if self.family.inputs != ENCODER_DECODER:
            return {kind: (source_ids, source_mask, source_mask) for kind in self.family.sites}
        target_ids, target_mask = ids_and_mask("decoder_input_ids", "decoder_attention_mask")
        return {
            "encoder_self": (source_ids, source_mask, source_mask),
            "decoder_self": (target_ids, target_mask, target_mask),
            "cross": (target_ids, target_mask, source_mask),
        }

    def site(self, call: AttentionCall, attention_type, layer, role, key_input, selection=None) -> SiteCapture:
        """The site of one attention call; with a ``selection``, only its selected heads and queries, cut from
        the call's tensors before anything is converted to float64 (:class:`probe.capture.selection.SiteRows`)."""
        device = call.query.device
        keys = call.key.shape[2]
        query_ids, query_mask, key_mask = (x.to(device) for x in role)
        b, h, _, d_head = call.query.shape
        rows = None if selection is None else site_rows(selection, attention_type, h, call.key.shape[1], query_mask)
        rows = rows or SiteRows(batch=b)
        log_u = torch.zeros((1, 1, 1, keys), dtype=torch.float64, device=device)
        if call.attention_mask is not None:
            log_u = log_u + mask_to_log(rows.per_head_and_query(call.attention_mask[..., :keys])).to(device)
        elif call.causal:  # SDPA's is_causal, no mask: the causal preference of the kept queries alone
            log_u = log_u + causal_log_preference(rows.columns, call.query.shape[2], keys, device)
        if call.position_bias is not None:
            bias = rows.per_head_and_query(call.position_bias[..., :keys])
            log_u = log_u + bias.to(device=device, dtype=torch.float64)
        key_hidden = key_weight = None
        if self.family.key is not None:
            if key_input is None:
                raise ProbeError(
                    f"{self.family.name}: the key projection '{self.family.key}' did not run before attention."
                )
            key_hidden = key_input.to(device)
            key_weight = rows.key_weight(self._key_weight(getattr(call.module, self.family.key)).to(device), d_head)
        return SiteCapture(
            attention_type=attention_type,
            layer=layer,
            queries=rows.per_head_and_query(call.query),
            keys=rows.per_key_head(call.key),
            values=rows.per_key_head(call.value),
            logit_scale=call.scaling,
            log_preference=log_u,
            query_mask=rows.query_mask(query_mask),
            key_mask=key_mask,
            query_ids=rows.per_query(query_ids),
            model_probs=rows.per_head_and_query(call.probs),
            model_output=rows.per_head_and_query(call.output),
            key_hidden=key_hidden,
            key_weight=key_weight,
            query_positions=rows.per_query(query_mask.long().cumsum(-1) - 1),
            head_ids=rows.head_ids(None),
        )

    def _key_weight(self, projection) -> torch.Tensor:
        """:math:`W_k` as ``(g * d', D)``: the projection's weight, or its key part for fused projections."""
        from transformers.pytorch_utils import Conv1D

        index, count = self.family.key_part
        weight = projection.weight.detach()
        if isinstance(projection, Conv1D):  # y = x W + b, W of shape (D, out)
            weight = weight.T
        size = weight.shape[0] // count
        return weight[index * size : (index + 1) * size]

    # ----------------------------------------------------------------------------------------------

    def describe(self):
        family = self.family
        key = f"the input of the key projection '{family.key}'" if family.key else None
        described = {
            "family": family.name,
            "capture": "transformers' attention interface: the family's own eager_attention_forward, called through "
            "ALL_ATTENTION_FUNCTIONS['eager'] (probe.capture.adapters.interface)",
            "templates": (
                f"hidden: t_i = x_i / sqrt(d'), x_i = {key} (cross-attention: the encoder output); " if key else
                "hidden: not available (rotary position encoding: a key is not W_k x_i + b_k); "
            ) + "key: t_i = k_i / sqrt(d'), k_i = the key as the attention function receives it",
            "evidence": "hidden: z = c W_k^T q; key: z = c q; q = the query as the attention function receives it, "
            "c = scaling * sqrt(d') (c = 1 for the usual scaling 1/sqrt(d'))",
            "preference": "log u_i = the attention mask passed to the attention function (-inf for padding keys, "
            "future keys in causal attention, keys outside a sliding window) + position_bias where the family "
            "passes one",
            "logit_identity": "alpha <t_i, z> + log u_i = scaling * q.k_i + mask + position_bias (alpha = 1)",
            "layer": "order of the site's calls among its attention type's calls (a module shared by several "
            "layers counts once per call)",
            "query": "the query's position within its own sequence (padding excluded)",
            "spaces_supported": list(self.spaces),
        }
        if family.inputs == ENCODER_DECODER:
            described["decoder_input"] = (
                "teacher forcing: decoder_input_ids = decoder_start_token_id followed by the tokenised target "
                "without its last token; target = the dataset's target column when given, else the text itself; "
                "real decoder positions = the target's tokens (a target of n tokens gives n positions)"
            )
            described["queries"] = "encoder_self: real encoder tokens; decoder_self and cross: real decoder positions"
        if family.inputs == DECODER:
            described["decoder_input"] = (
                "the text, padded on the tokenizer's side (pad token, else end token; masked), position_ids "
                "counting each text's tokens from 0"
            )
        described.update(family.notes)
        return described
