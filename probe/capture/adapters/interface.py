r"""The capture point: every attention call a model makes through transformers' attention interface.

In transformers 5 an attention module computes its per-head queries, keys and values (projections, biases
and rotary position encoding included), then hands them to an *attention function* looked up by
implementation name::

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    output, probs = attention_interface(self, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)

transformers' attention interface lets a library add an attention function under a name of its own
(``AttentionInterface.register(name, function)``, with the masks it takes: ``AttentionMaskInterface.register``)
and a model select it (``model.set_attn_implementation(name)``); every other model keeps its implementation.
probe registers :func:`probe_attention` as :data:`ATTENTION` (``"probe"``, with eager attention's masks,
:func:`register`) and a model it measures runs it: probe loads its models that way, and a model given in
memory runs it while it is measured (:func:`runs_probe_attention`).  Outside a measurement the function is the
calling family's own ``eager_attention_forward`` (looked up in the module that defines the attention module's
class, ``sys.modules[type(module).__module__]``).  Within an :func:`eager_attention_calls` block the calls of
the thread that entered it also hand an :class:`AttentionCall`, with everything that entered the
logits, to a callback as soon as the call returns (a context variable holds the block's handler, so that a
model run meanwhile by another thread is not measured, and two measurements in two threads stay apart).  The
probabilities are the model's own: the family's eager function computes them.  The eager functions of the
families probe declares compute

.. math::  \mathrm{softmax}\big(\text{scaling}\; q\cdot k_i + \text{position\_bias} + \text{attention\_mask}\big)

(``models/bert/modeling_bert.py``, ``models/llama/modeling_llama.py`` with ``repeat_kv`` for grouped-query
attention, ``models/t5/modeling_t5.py`` with ``position_bias``; ``scaling=None`` means
:math:`1/\sqrt{d'}`), which is probe's logit :math:`c_\text{scale}\,q\cdot k_i + \log u_i` with
:math:`\log u` = position bias + mask.  What this form cannot represent is refused with a
:class:`~probe.core.errors.ProbeError` (:func:`unrepresentable`): logit soft-capping (``softcap``, Gemma 2:
:math:`c\tanh(\ell/c)` is not affine in :math:`q\cdot k`), attention sinks (``s_aux``/``sinks``: an extra
softmax-denominator term, so the weights over the keys do not sum to one), and any other parameter an
eager function takes that probe does not know.  Sliding windows need nothing: transformers builds them
into ``attention_mask`` (``masking_utils.sliding_window_overlay``); the ``sliding_window`` keyword is only
read by flash attention.

A run may also ask for the model's fast attention (``attn_implementation="sdpa"``,
``--attn-implementation sdpa``): probe then registers :func:`probe_sdpa_attention` as :data:`ATTENTION_SDPA`
(``"probe_sdpa"``), which computes each call's output with transformers' own ``sdpa_attention_forward``, as a
model loaded with ``attn_implementation="sdpa"`` does, and never forms the ``(b, h, q, k)`` probabilities.
Its masks are SDPA's own: boolean, or none at all where SDPA runs the call with ``is_causal`` (a causal
mask without padding), which keeps the :math:`k \times k` mask out of memory too; the call then records that
flag as SDPA's own rule sets it (:func:`sdpa_causal`), and probe builds the causal preference of the selected
rows alone.  The call hands its :class:`AttentionCall` with the model's output instead of its probabilities;
the fidelity check then compares the output rebuilt from probe's logits, :math:`\sum_i p_i v_i`, with the
model's own (:func:`probe.batch.problems.fidelity_errors`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from probe.capture.adapters.hooks import detached
from probe.core.config import ATTN_IMPLEMENTATIONS
from probe.core.errors import ProbeError

#: parameters (or keyword arguments) that change the softmax in ways probe's logit form cannot represent
#: when they are set (``None`` leaves eager attention in the form above)
UNREPRESENTABLE = {
    "softcap": "logit soft-capping (softcap * tanh(logit / softcap)) is not of the form scale * q.k + log u",
    "s_aux": "attention sinks add a term to the softmax denominator, so the weights over the keys do not sum to 1",
    "sinks": "attention sinks add a term to the softmax denominator, so the weights over the keys do not sum to 1",
}
#: parameters of a family's eager attention function that probe represents (or refuses when set)
KNOWN_PARAMETERS = {
    "module", "query", "key", "value", "attention_mask", "scaling", "dropout", "position_bias", *UNREPRESENTABLE,
}


@dataclass
class AttentionCall:
    r"""One call of an attention function: what the module passed in and what eager attention returned.

    Attributes:
        module: the attention module that made the call.
        query: ``(b, h, q, d')``, as the logits use it (bias and rotary included).
        key: ``(b, g, k, d')`` (``g`` key heads; eager repeats them for grouped-query attention).
        value: ``(b, g, k, d_v)``.
        attention_mask: the additive (or boolean) mask as passed, or ``None``.
        scaling: the logit scale (``None`` in the call means ``1/sqrt(d')``, resolved here).
        position_bias: an additive bias passed as the ``position_bias`` keyword (T5 family), or ``None``.
        probs: the eager attention probabilities, ``(b, h, q, k)``; ``None`` for a call of
            :func:`probe_sdpa_attention`, which never forms them.
        kwargs: the other keyword arguments of the call.
        output: the attention output per head, ``(b, h, q, d_v)``, of a call of :func:`probe_sdpa_attention`
            (the model's own SDPA); ``None`` for eager calls, whose probabilities are checked instead.
        causal: whether the call ran with SDPA's ``is_causal`` and no mask (key :math:`i` attended by query
            :math:`j` iff :math:`i \le j`), :func:`sdpa_causal`.
    """

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    position_bias: torch.Tensor | None
    probs: torch.Tensor | None
    kwargs: dict = field(default_factory=dict)
    output: torch.Tensor | None = None
    causal: bool = False


def family_eager_function(module: torch.nn.Module) -> Callable:
    """The ``eager_attention_forward`` of the file that defines ``module``'s class (the function the model
    would call without probe)."""
    source = sys.modules.get(type(module).__module__)
    eager = getattr(source, "eager_attention_forward", None)
    if eager is None:
        raise ProbeError(
            f"{type(module).__name__} ({type(module).__module__}) calls the attention interface but its module defines "
            "no eager_attention_forward; probe cannot delegate to the model's own eager attention. Write a dedicated "
            "adapter for this family (see docs/models.md, 'Adding an architecture')."
        )
    return eager


@functools.lru_cache(maxsize=None)
def _signature(function: Callable) -> inspect.Signature:
    """``inspect.signature`` of a family's eager function, read once (it is read at every attention call)."""
    return inspect.signature(function)


def unrepresentable(module: torch.nn.Module, eager: Callable, arguments: dict) -> str | None:
    """Why this call cannot be written as ``scale * q.k + log u`` (a sentence), or ``None`` if it can."""
    for name, reason in UNREPRESENTABLE.items():
        if arguments.get(name) is not None or arguments.get("kwargs", {}).get(name) is not None:
            return reason
    if getattr(module, "sinks", None) is not None:
        return UNREPRESENTABLE["sinks"]
    if getattr(module, "reorder_and_upcast_attn", False):
        return ("its reorder_and_upcast_attn option computes attention outside the attention interface (upcast to "
                "float32, scaled before the product); set it to False to measure its eager attention")
    unknown = [
        name for name, parameter in _signature(eager).parameters.items()
        if name not in KNOWN_PARAMETERS and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    if unknown:
        return f"its eager attention takes {', '.join(unknown)}, which probe does not know how to represent"
    if module.training and arguments.get("dropout"):
        return "the module is in training mode and drops attention weights at random (call model.eval())"
    return None


def representable_arguments(module, query, key, value, attention_mask, *args, **kwargs) -> dict:
    """The call's arguments as the calling family's ``eager_attention_forward`` names them (its defaults filled
    in); a :class:`ProbeError` when probe's logit form cannot represent the call (:func:`unrepresentable`)."""
    eager = family_eager_function(module)
    bound = _signature(eager).bind(module, query, key, value, attention_mask, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    reason = unrepresentable(module, eager, arguments)
    if reason is not None:
        raise ProbeError(f"probe cannot represent the attention of {type(module).__name__}: {reason}.")
    return arguments


def recorded_call(arguments: dict, probs: torch.Tensor | None, output: torch.Tensor | None = None,
                  causal: bool = False) -> AttentionCall:
    """The :class:`AttentionCall` of a call's ``arguments`` (:func:`representable_arguments`), detached."""
    query, mask, scaling = arguments["query"], arguments["attention_mask"], arguments.get("scaling")
    return AttentionCall(
        module=arguments["module"],
        query=query.detach(),
        key=arguments["key"].detach(),
        value=arguments["value"].detach(),
        attention_mask=None if mask is None else mask.detach(),
        scaling=float(query.shape[-1] ** -0.5 if scaling is None else scaling),
        position_bias=detached(arguments.get("position_bias")),
        probs=detached(probs),
        kwargs=dict(arguments.get("kwargs", {})),
        output=detached(output),
        causal=causal,
    )


def eager_call(module, query, key, value, attention_mask, *args, **kwargs):
    """Run the calling family's own ``eager_attention_forward`` on an attention interface call, refusing (a
    :class:`ProbeError`) what probe's logit form cannot represent; return its ``(output, probs)`` and the
    :class:`AttentionCall` of everything that entered the logits (detached)."""
    arguments = representable_arguments(module, query, key, value, attention_mask, *args, **kwargs)
    output, probs = family_eager_function(module)(module, query, key, value, attention_mask, *args, **kwargs)
    if probs is None:
        raise ProbeError(f"{type(module).__name__}'s eager attention returned no probabilities.")
    return output, probs, recorded_call(arguments, probs)


def sdpa_function() -> Callable:
    """transformers' ``sdpa_attention_forward``: the attention a model loaded with ``attn_implementation="sdpa"``
    runs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def sdpa_call(module, query, key, value, attention_mask, *args, **kwargs):
    """Run transformers' SDPA attention on an attention interface call (what probe's logit form cannot represent
    refused first, as for eager calls); return its output and the :class:`AttentionCall` with the output per head,
    ``(b, h, q, d_v)``, in place of the probabilities, which SDPA never forms."""
    arguments = representable_arguments(module, query, key, value, attention_mask, *args, **kwargs)
    known = {name: arguments[name] for name in ("dropout", "scaling", "position_bias") if name in arguments}
    causal = sdpa_causal(module, query, key, attention_mask, arguments.get("kwargs", {}))
    output, _ = sdpa_function()(module, query, key, value, attention_mask, **known, **arguments.get("kwargs", {}))
    return output, recorded_call(arguments, None, output.transpose(1, 2), causal)


def sdpa_causal(module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> bool:
    r"""Whether transformers' ``sdpa_attention_forward`` runs this call with ``is_causal``, by its own rule: more
    than one query, no mask, and the call's ``is_causal`` (else the module's, else True).  With as many keys as
    queries (probe's forward passes keep no cache), key :math:`i` is then attended by query :math:`j` iff
    :math:`i \le j`; more keys than queries would be cropped by SDPA, which probe does not follow: refused."""
    flag = kwargs.get("is_causal")
    flag = getattr(module, "is_causal", True) if flag is None else flag
    causal = bool(query.shape[2] > 1 and attention_mask is None and flag)
    if causal and key.shape[2] != query.shape[2]:
        raise ProbeError(f"{type(module).__name__} ran SDPA causally with {key.shape[2]} keys for {query.shape[2]} "
                         "queries (a cache), which probe does not follow: measure it with its eager attention.")
    return causal


#: the name under which probe's attention function is registered with transformers (``AttentionInterface`` and
#: ``AttentionMaskInterface``); a model measured by probe runs it (``config._attn_implementation``)
ATTENTION = "probe"
#: the name of probe's fast attention function (:func:`probe_sdpa_attention`), for runs that ask for SDPA
ATTENTION_SDPA = "probe_sdpa"
#: the attention a run can ask for (``attn_implementation``: eager, sdpa) and the name of probe's function for each
IMPLEMENTATIONS = dict(zip(ATTN_IMPLEMENTATIONS, (ATTENTION, ATTENTION_SDPA)))
#: this thread's handler of probe's attention calls (None: the family's own eager attention answers them)
_HANDLER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("probe_attention_handler", default=None)


def probe_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """probe's attention function, registered as :data:`ATTENTION`: the handler of the calling thread's block
    (:func:`attention_handler`), or outside any block the calling family's own ``eager_attention_forward``, so
    that a model set to run it computes exactly its eager attention whenever probe is not measuring it."""
    handler = _HANDLER.get()
    if handler is None:
        return family_eager_function(module)(module, query, key, value, attention_mask, *args, **kwargs)
    return handler(module, query, key, value, attention_mask, *args, **kwargs)


def probe_sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """probe's fast attention function, registered as :data:`ATTENTION_SDPA`: the handler of the calling thread's
    block, or outside any block transformers' own ``sdpa_attention_forward``."""
    handler = _HANDLER.get()
    if handler is None:
        return sdpa_function()(module, query, key, value, attention_mask, *args, **kwargs)
    return handler(module, query, key, value, attention_mask, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def register() -> str:
    """Register :func:`probe_attention` with transformers under :data:`ATTENTION` (once per process), with eager
    attention's masks (``AttentionMaskInterface``: the additive masks the families' eager functions take), and
    :func:`probe_sdpa_attention` under :data:`ATTENTION_SDPA` with SDPA's masks (boolean, or none for
    ``is_causal``); return :data:`ATTENTION`.  Registering adds names and changes no other: models that do not
    select them are untouched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION, probe_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    AttentionInterface.register(ATTENTION_SDPA, probe_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_SDPA, sdpa_mask)
    return ATTENTION


def set_attention(model, implementation: str) -> None:
    """Make ``model`` (and its sub-models) run the attention ``implementation``."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:
        model.config._attn_implementation = implementation


def runs_sdpa(model) -> bool:
    """Whether ``model`` runs probe's fast attention (:data:`ATTENTION_SDPA`)."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_SDPA


@contextmanager
def runs_probe_attention(model, implementation: str | None = None):
    """Within the block ``model`` runs probe's attention function for ``implementation`` (``"eager"``:
    :func:`probe_attention`, ``"sdpa"``: :func:`probe_sdpa_attention`; selected for this model alone, as
    transformers' attention interface documents: every other model keeps its own implementation); afterwards it
    runs the implementation it had.  ``None`` leaves a model that already runs one of probe's functions as it is
    (as probe loads models, or within an outer block that chose), and gives any other :func:`probe_attention`."""
    register()
    previous = getattr(model.config, "_attn_implementation", None)
    wanted = IMPLEMENTATIONS[implementation or "eager"]
    if previous == wanted or (implementation is None and previous in IMPLEMENTATIONS.values()):
        yield model
        return
    set_attention(model, wanted)
    try:
        yield model
    finally:
        set_attention(model, previous)


@contextmanager
def attention_handler(function: Callable, what: str = "probe's attention blocks"):
    """Within the block, the calls that this thread's models make to :func:`probe_attention` go to ``function``
    (with the attention function's arguments); other threads, and models that do not run probe's attention, are
    not affected.  Blocks do not nest within a thread: a second one inside the block is refused."""
    register()
    if _HANDLER.get() is not None:
        raise RuntimeError(f"{what} do not nest")
    token = _HANDLER.set(function)
    try:
        yield
    finally:
        _HANDLER.reset(token)


@contextmanager
def eager_attention_calls(on_call: Callable[[AttentionCall], None]):
    """Within the block, every call of this thread's models to :func:`probe_attention` runs the calling family's own
    ``eager_attention_forward`` and is then handed to ``on_call`` (before the model goes on).  Blocks do not nest."""

    def calls(module, query, key, value, attention_mask, *args, **kwargs):
        output, probs, call = eager_call(module, query, key, value, attention_mask, *args, **kwargs)
        on_call(call)
        return output, probs

    with attention_handler(calls, "eager_attention_calls blocks"):
        yield


@contextmanager
def sdpa_attention_calls(on_call: Callable[[AttentionCall], None]):
    """As :func:`eager_attention_calls`, for a model that runs :func:`probe_sdpa_attention`: every call runs
    transformers' SDPA attention (:func:`sdpa_call`) and its :class:`AttentionCall`, with the output and no
    probabilities, is handed to ``on_call``."""

    def calls(module, query, key, value, attention_mask, *args, **kwargs):
        output, call = sdpa_call(module, query, key, value, attention_mask, *args, **kwargs)
        on_call(call)
        return output, None

    with attention_handler(calls, "sdpa_attention_calls blocks"):
        yield


def causal_log_preference(columns: torch.Tensor | None, queries: int, keys: int, device) -> torch.Tensor:
    """The causal preference as float64 log terms, ``-inf`` where key :math:`i` lies after query :math:`j`
    (:math:`i > j`): ``(b, 1, q', keys)`` for the query ``columns`` ``(b, q')`` kept of each example, or
    ``(1, 1, queries, keys)`` for all of them (``columns`` None).  What a call run with SDPA's ``is_causal``
    attended (:func:`sdpa_causal`), built for the kept rows only: a few sampled queries of a long context never
    need the ``k x k`` pattern."""
    rows = torch.arange(queries, device=device)[None] if columns is None else columns.to(device)
    after = torch.arange(keys, device=device)[None, None, :] > rows[:, :, None]  # (b, q', k)
    log_u = torch.zeros(after.shape, dtype=torch.float64, device=device).masked_fill_(after, float("-inf"))
    return log_u[:, None]


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
