"""The forward pass with substitution: every attention site's weights replaced through the model's own
eager attention function, and the trace of what each site saw and gave."""

from __future__ import annotations

import inspect
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
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


def site_blocks(model, site_modules) -> list | None:
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
                                  blocks=site_blocks(model, sites), extra={"use_cache": False} if accepts else {},
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


class Substitution:
    """Within ``with Substitution(loaded, inputs, at_site):``, every eager attention call of ``loaded.model``
    runs the family's own eager attention, builds the call's :class:`SiteCapture` (as the adapter's capture
    does) and hands it to ``at_site``; weights it returns replace the call's attention weights (module
    docstring).  A site function with an ``only`` attribute (the name of the one site it substitutes) gets
    ``None`` for the site: it needs no :class:`SiteCapture`, and none is built.

    ``trace`` with ``start_at``: block calls before that index return their recorded outputs (their sites
    count as called), and so do the projections of the first site's module computed before its attention
    call in the block call it starts at.  ``record`` (an empty :class:`Trace`): the block calls of this
    forward are recorded into it, replayed ones included; only those before ``record_until`` when given.

    On exit every hook and wrapper is removed (also after an exception); after a forward that went
    through, a site that never called the eager attention function is an error (its weights could not
    be substituted).
    """

    def __init__(self, loaded, inputs: dict, at_site: SiteFunction, trace: Trace | None = None,
                 start_at: int | None = None, record: Trace | None = None, record_until: int | None = None):
        self.model, self.adapter, self.layout = loaded.model, loaded.adapter, layout_of(loaded)
        self.roles = self.adapter.roles(inputs)
        self.at_site, self.only = at_site, getattr(at_site, "only", None)
        self.trace, self.start_at = trace, start_at
        self.replay = trace is not None and start_at is not None
        self.record, self.record_until = record, record_until
        self.key_inputs: dict = {}  # site module -> the hidden state its key projection took
        self.per_type: dict[str, int] = {}  # attention type -> its sites called so far (the next one's layer)
        self.called: set = set()  # the site modules called (or replayed)
        self.block_calls = 0  # block calls so far
        self.recording: int | None = None  # the index of the recorded block call now running
        self.recent: dict = {}  # recording: projection -> [calls in this block call, its last output]
        self.pending: dict = {}  # replaying: projection -> the output it gave in the traced forward
        self.handles: list = []  # hooks to remove
        self.patched: list = []  # (module, its own ``forward`` attribute or None) to put back
        self.registration = ExitStack()

    def __enter__(self) -> "Substitution":
        if (self.replay or self.record is not None) and self.layout.blocks is None:
            raise ValueError("this model's sites are not in ModuleList blocks: no trace")
        try:
            self.hook_key_inputs()
            if self.record is not None:
                self.hook_projections()
            if self.replay:
                self.answer_projections()
            if self.replay or self.record is not None:
                for block in self.layout.blocks:
                    self.patch(block, self.block_forward(block.forward))
            # the model runs probe's attention function; this thread's calls go to the substitution
            self.registration.enter_context(runs_probe_attention(self.model))
            self.registration.enter_context(attention_handler(partial(Substitution.attention, self),
                                                              "attention substitution and capture blocks"))
        except BaseException:
            self.undo()
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self.undo()
        if exc_type is None:
            self.check_every_site_called()
        return False

    def undo(self) -> None:
        """The model as it was: the registration, hooks and wrapped ``forward`` methods removed."""
        self.registration.close()
        for handle in self.handles:
            handle.remove()
        for module, previous_forward in reversed(self.patched):
            if previous_forward is None:
                del module.forward
            else:
                module.forward = previous_forward
        self.handles, self.patched = [], []

    def patch(self, module: torch.nn.Module, forward: Callable) -> None:
        self.patched.append((module, module.__dict__.get("forward")))
        module.forward = forward

    # -- what the sites take in

    def hook_key_inputs(self) -> None:
        """Keep the hidden state each site's key projection takes (the hidden space's templates)."""
        key = self.adapter.family.key
        if key is None:
            return
        for module in self.layout.sites:
            self.handles.append(getattr(module, key).register_forward_pre_hook(
                lambda _, args, module=module: self.key_inputs.__setitem__(module, args[0].detach())
            ))

    def hook_projections(self) -> None:
        """Recording: each projection's calls within the running block call, and its last output."""

        def projected(module, _args, output):
            if self.recording is not None:
                entry = self.recent.setdefault(module, [0, None])
                entry[0] += 1
                entry[1] = output.detach().clone() if isinstance(output, torch.Tensor) else None

        for projections in self.layout.projections.values():
            for projection in projections:
                self.handles.append(projection.register_forward_hook(projected))

    def answer_projections(self) -> None:
        """Replaying: the projections computed before the first attention call of the block call the
        forward starts at give their recorded outputs (once each)."""
        trace, start_at = self.trace, self.start_at
        if start_at < len(trace.sites) and trace.sites[start_at]:
            self.pending = dict(trace.projections.get(trace.sites[start_at][0], {}))
        for projection in self.pending:
            def answering(*args, projection=projection, original=projection.forward, **kwargs):
                answer = self.pending.pop(projection, None)
                return original(*args, **kwargs) if answer is None else answer.clone()

            self.patch(projection, answering)

    # -- block calls: replayed or recorded

    def block_forward(self, original: Callable) -> Callable:
        """A block's ``forward``: replayed from the trace before ``start_at``, recorded when recording."""

        def forward(*args, **kwargs):
            index = self.block_calls
            self.block_calls += 1
            keep = self.record is not None and (self.record_until is None or index < self.record_until)
            if self.replay and index < self.start_at:
                return self.replayed(index, keep)
            if keep:
                self.record.outputs.append(None)
                self.record.sites.append([])
                self.recent.clear()
            outer, self.recording = self.recording, index if keep else None
            try:
                output = original(*args, **kwargs)
            finally:
                self.recording = outer
            if keep:
                self.record.outputs[index] = _cloned(output)  # later layers may change it in place
            return output

        return forward

    def replayed(self, index: int, keep: bool):
        """The recorded output of block call ``index``, its sites counted as called (and recorded again)."""
        trace = self.trace
        for name in trace.sites[index]:
            kind = name.rsplit(":", 1)[0]
            self.per_type[kind] = self.per_type.get(kind, 0) + 1
            self.called.add(trace.modules[name])
        if keep:
            self.record.outputs.append(_cloned(trace.outputs[index]))
            self.record.sites.append(list(trace.sites[index]))
            for name in trace.sites[index]:
                self.record.block_of[name], self.record.modules[name] = index, trace.modules[name]
        return _cloned(trace.outputs[index])

    def record_site(self, name: str, module: torch.nn.Module) -> None:
        """Recording: the site called in the running block call, with its projections computed once in
        that block call before this attention call."""
        current, record, projections = self.recording, self.record, self.layout.projections[module]
        record.sites[current].append(name)
        record.block_of[name], record.modules[name] = current, module
        record.projections[name] = {
            projection: self.recent[projection][1] for projection in projections
            if self.recent.get(projection, [0])[0] == 1 and self.recent[projection][1] is not None
        }
        for projection in projections:
            self.recent.pop(projection, None)

    # -- the attention calls

    def attention(self, module, query, key, value, attention_mask, *args, **kwargs):
        """The eager attention function while substituting: the family's own, then ``at_site``'s weights
        (if any) times the values."""
        output, probs, call = eager_call(module, query, key, value, attention_mask, *args, **kwargs)
        attention_type = self.layout.sites.get(module)
        if attention_type is None:
            raise ProbeError(
                f"{self.layout.names.get(module, type(module).__name__)} computed attention but is not declared as "
                f"a site of {self.adapter.family.name}: add it to the family's sites."
            )
        layer = self.per_type.get(attention_type, 0)
        self.per_type[attention_type] = layer + 1
        self.called.add(module)
        name = site_name(attention_type, layer)
        if self.recording is not None:
            self.record_site(name, module)
        self.pending.clear()  # an attention call: the projections before it are done
        if self.only is not None:  # a function that substitutes one site: no SiteCapture anywhere
            self.key_inputs.pop(module, None)
            if name != self.only:
                return output, probs
            weights = self.at_site(name, None)
        else:
            site = self.adapter.site(call, attention_type, layer, self.roles[attention_type],
                                      self.key_inputs.pop(module, None))
            weights = self.at_site(name, site)
        if weights is None:
            return output, probs
        values = _repeat_kv(value, query.shape[1])
        self.check_output_form(module, output, probs, values)
        weights = weights.to(device=value.device, dtype=value.dtype)
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights

    def check_output_form(self, module, output: torch.Tensor, probs: torch.Tensor, values: torch.Tensor) -> None:
        """Once per attention class: its eager output is ``probs @ values`` (what substitution replaces)."""
        if type(module) in self.layout.checked:
            return
        expected = torch.matmul(probs, values).transpose(1, 2)
        tolerance = 64 * torch.finfo(output.dtype).eps  # the same product as eager's: rounding at most
        scale = float(output.abs().max()) if output.numel() else 0.0
        close = expected.shape == output.shape and torch.allclose(expected, output, rtol=0, atol=tolerance * (1 + scale))
        if not close:
            raise ProbeError(
                f"{type(module).__name__}'s eager attention does not return (probs @ values) in the form probe "
                "substitutes, so its attention weights cannot be replaced; this family cannot intervene."
            )
        self.layout.checked.add(type(module))

    def check_every_site_called(self) -> None:
        silent = [self.layout.names[module] for module in self.layout.sites if module not in self.called]
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
        with Substitution(loaded, inputs, at_site or (lambda name, site: None), trace, start_at, record,
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


