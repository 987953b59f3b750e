"""The forward pass with substitution: every attention site's weights replaced through the model's own
eager attention function, and the trace of what each site saw and gave."""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from probe.capture.adapters.base import SiteCapture
from probe.capture.adapters.generic import ENCODER_DECODER
from probe.capture.adapters.interface import attention_handler, eager_call, runs_probe_attention
from probe.core.errors import ProbeError
from probe.interventions.model import inputs_kind, lm_kind

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
class Layout:
    """What every substituting forward of a model needs to know of it, found once per model (:func:`layout_of`).

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


LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[object, Layout]]" = weakref.WeakKeyDictionary()


def layout_of(loaded) -> Layout:
    """The :class:`Layout` of ``loaded.model`` (with ``loaded.adapter``'s sites), cached with the model."""
    model, adapter = loaded.model, loaded.adapter
    cached = LAYOUTS.get(model)
    if cached is None or cached[0] is not adapter:
        from transformers.pytorch_utils import Conv1D

        sites = adapter.site_modules(model)
        accepts = "use_cache" in inspect.signature(model.forward).parameters
        projections = {
            site: [m for m in site.modules() if m is not site and isinstance(m, (torch.nn.Linear, Conv1D))]
            for site in sites
        }
        cached = adapter, Layout(sites=sites, names={module: name for name, module in model.named_modules()},
                                  blocks=_blocks(model, sites), extra={"use_cache": False} if accepts else {},
                                  projections=projections)
        LAYOUTS[model] = cached
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
    adapter = loaded.adapter
    layout = layout_of(loaded)
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
        with runs_probe_attention(loaded.model), attention_handler(substituting_attention,
                                                              "attention substitution and capture blocks"):
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
            "probe could not substitute its weights: its family computes attention in code of its own."
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
    encoder_decoder = inputs_kind(loaded) == ENCODER_DECODER
    target = model.get_decoder() if encoder_decoder else model.base_model
    grabbed = {}
    handle = target.register_forward_hook(lambda _m, _a, output: grabbed.__setitem__("hidden", output[0]))
    try:
        with _substituting(loaded, inputs, at_site or (lambda name, site: None), trace, start_at, record,
                           record_until):
            output = model(**inputs, **layout_of(loaded).extra)
    finally:
        handle.remove()
    mask_name = "decoder_attention_mask" if encoder_decoder else "attention_mask"
    ids = inputs["decoder_input_ids" if encoder_decoder else "input_ids"]
    mask = inputs.get(mask_name)
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    logits = getattr(output, "logits", None) if lm_kind(loaded) is not None else None
    return Outputs(hidden=grabbed["hidden"], mask=mask, logits=logits)


