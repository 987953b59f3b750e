"""Forward hooks that record what enters an attention module and the probabilities it computes."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from probe.core.errors import ProbeError


@dataclass
class Record:
    """What one attention module saw and returned in the last forward pass."""

    hidden_states: torch.Tensor | None = None  # its first input: the states entering attention
    probs: torch.Tensor | None = None  # the attention probabilities it returned (eager)
    inputs: dict = field(default_factory=dict)  # further inputs asked for by name
    outputs: tuple = ()  # everything it returned


def detached(value):
    """``value`` detached from autograd when it is a tensor; anything else as it is."""
    return value.detach() if isinstance(value, torch.Tensor) else value


@contextmanager
def recording(modules, on_record, *, probs_index: int = 1, inputs: tuple[tuple[str, int], ...] = ()):
    """Record, for each module, its ``hidden_states`` input and its attention probabilities output, and
    hand each record to ``on_record(index, record)`` from the hook, as soon as the module has run.

    ``probs_index`` is where the probabilities sit in the module's output tuple (BERT: 1; T5 returns
    ``(output, position_bias, probs)``: 2).  ``inputs`` names further inputs to keep, as
    ``(keyword, positional index)`` pairs.  Modules must run eager attention: other implementations
    return no probabilities, which is reported as a :class:`ProbeError`.  Nothing is kept after
    ``on_record`` returns.
    """
    handles = []

    def make_hook(index):
        record = Record()
        def hook(module, args, kwargs, output):
            record.hidden_states = (args[0] if args else kwargs["hidden_states"]).detach()
            record.inputs = {
                name: detached(kwargs[name] if name in kwargs else (args[index] if len(args) > index else None))
                for name, index in inputs
            }
            record.outputs = tuple(detached(x) for x in output) if isinstance(output, tuple) else (output,)
            probs = record.outputs[probs_index] if len(record.outputs) > probs_index else None
            if probs is None:
                raise ProbeError(
                    f"{type(module).__name__} returned no attention probabilities: the model is not running "
                    "eager attention. probe loads models with attn_implementation='eager'; load yours that way."
                )
            record.probs = probs
            try:
                on_record(index, record)
            finally:
                record.hidden_states = record.probs = None
                record.inputs, record.outputs = {}, ()

        return hook

    try:
        for index, module in enumerate(modules):
            handles.append(module.register_forward_hook(make_hook(index), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
