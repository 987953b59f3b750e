r"""What every architecture adapter produces: one :class:`SiteCapture` per attention site.

An *attention site* is one attention module of the model (an attention type and a layer).  For a batch
of examples the adapter records what the module's logits are made of:

.. math::  \text{logit}_{ji} = c_\text{scale}\; q_j\cdot k_i + \log u_{ji}

with per-head queries :math:`q_j` and keys :math:`k_i` exactly as the model multiplies them (biases and
rotary position encoding included), the scale :math:`c_\text{scale}` the model applies (``scaling``;
BERT :math:`1/\sqrt{d'}`, T5 1) and the rest, whatever the model adds to the content logit (padding
and causal masks, T5's or MPNet's relative position bias, ALiBi, DeBERTa's position terms), as the
preference :math:`\log u` (``-inf`` for excluded keys).

From a capture, :func:`space_problems` builds the reduced dual problems of docs/math.md (for
:math:`\alpha = 1`) in one of two parameterisations (*spaces*):

* ``hidden`` (the paper's): templates :math:`t_i = x_i/\sqrt{d'}` with :math:`x_i` the hidden state
  entering attention, evidence :math:`z = c\,W_k^\top q` with :math:`c = c_\text{scale}\sqrt{d'}`, so
  :math:`\langle t_i, z\rangle = c_\text{scale}\, q\cdot W_k x_i` (the key bias adds the same
  :math:`c_\text{scale}\, q\cdot b_k` to every key and cancels in the softmax).  Needs :math:`x` and
  :math:`W_k`; rotary models have none (the rotation depends on the position).
* ``key`` (head space): :math:`t_i = k_i/\sqrt{d'}`, :math:`z = c\,q`, so
  :math:`\langle t_i, z\rangle = c_\text{scale}\, q\cdot k_i`, the model's content logit itself.

Both reproduce the model's attention, :math:`\mathrm{softmax}(\log u + \langle t, z\rangle)`, which the
pipeline checks against the model's own probabilities (the fidelity check).

Adapters emit each site *while the model runs* (from a hook, as soon as the module has computed it), so
the pipeline can solve a site's problems and let them go before the next layer: memory holds one
site's problems at a time, never every layer's.  Adapters know nothing about solving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from probe.capture.adapters.interface import register as register_attention
from probe.capture.selection import Stack
from probe.core.config import SPACES  # the parameterisations, in display order
from probe.core.errors import ProbeError


@dataclass
class SiteCapture:
    """What one attention site computed for one batch of examples.

    Shapes use ``b`` examples, ``h`` query heads, ``g`` key/value heads (``h`` is a multiple of ``g``;
    query head ``j`` uses key head ``j // (h // g)``, as transformers' ``repeat_kv``), ``q`` query
    positions, ``k`` key positions, head width ``d'``.

    Attributes:
        attention_type: ``"self"``, ``"encoder_self"``, ``"decoder_self"``, ``"cross"``, ``"causal_self"``.
        layer: layer index within its stack, from 0.
        queries: per-head queries as the logits use them, ``(b, h, q, d')``.
        keys: per-head keys as the logits use them, ``(b, g, k, d')``.
        values: per-head values (bias included), ``(b, g, k, d_v)``.
        logit_scale: the model's logit is ``logit_scale * q.k + log u``.
        log_preference: ``log u``, broadcastable to ``(b, h, q, k)``, ``-inf`` where excluded.
        query_mask: which query positions are real tokens (rows to write), ``(b, q)`` bool.
        key_mask: which key positions are real tokens, ``(b, k)`` bool (padding keys carry no weight).
        query_ids: the token id at each query position, ``(b, q)``.
        model_probs: the model's own attention probabilities (eager), ``(b, h, q, k)``; ``None`` where the
            model ran its fast attention (SDPA), which never forms them.
        key_hidden: the hidden states :math:`x_i` the keys are computed from, ``(b, k, D)``; ``None``
            where the model has no hidden-space parameterisation (rotary).
        key_weight: :math:`W_k`, ``(g * d', D)``, with ``key_hidden``.
        query_positions: each query's position within its own sequence (``(b, q)``; ``None`` means the
            column index, which differs under left padding).
        head_ids: each query head's index in the model, when the site holds some of its heads only
            (:func:`probe.capture.selection.restrict`); ``None`` means heads ``0 .. h - 1``.
        model_output: the model's own attention output per head, ``(b, h, q, d_v)``, where it ran its fast
            attention (SDPA) and ``model_probs`` is ``None``: the fidelity check compares the output rebuilt
            from probe's logits with it (:func:`probe.batch.problems.output_errors`).
    """

    attention_type: str
    layer: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    logit_scale: float
    log_preference: torch.Tensor
    query_mask: torch.Tensor
    key_mask: torch.Tensor
    query_ids: torch.Tensor
    model_probs: torch.Tensor | None
    key_hidden: torch.Tensor | None = None
    key_weight: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    head_ids: tuple[int, ...] | None = None
    model_output: torch.Tensor | None = None

    @property
    def spaces(self) -> tuple[str, ...]:
        """The parameterisations this site supports."""
        return SPACES if self.key_weight is not None else ("key",)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(b, h, q, k)``."""
        b, h, q, _ = self.queries.shape
        return b, h, q, self.keys.shape[2]


#: config.json entries that give the number of layers, and of query heads, of the encoder's (or the only)
#: stack and of the decoder's, in the order they are looked for
LAYER_ENTRIES = {"source": ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers"),
                 "target": ("num_decoder_layers", "decoder_layers", "num_hidden_layers", "num_layers", "n_layer")}
HEAD_ENTRIES = {"source": ("num_attention_heads", "num_heads", "n_head", "n_heads", "encoder_attention_heads"),
                "target": ("decoder_attention_heads", "num_attention_heads", "num_heads", "n_head", "n_heads")}


def config_entry(config, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``config`` sets to a whole number > 0 (None: none does)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class SpaceProblems:
    r"""The reduced problems of a site (or some of its examples) in one space, for alpha = 1.

    Attributes:
        templates: :math:`T`, one row :math:`t_i` per key (padding keys zero): ``(b, k, D)`` shared by all
            heads (hidden space) or ``(b, g, k, d')`` one per key head (key space).
        logits: :math:`s = Tz` per head and query, ``(b, h, q, k)``, float64.
        evidence_sqnorm: :math:`\|z\|^2`, ``(b, h, q)``, float64.
    """

    templates: torch.Tensor
    logits: torch.Tensor
    evidence_sqnorm: torch.Tensor

    @property
    def gram(self) -> torch.Tensor:
        """:math:`G = TT^\top`, ``(b, k, k)`` or ``(b, g, k, k)`` (formed when asked: the solvers take a factor
        of it from the templates, :func:`probe.solve.gram.factor_from_templates`, and never form it)."""
        return self.templates @ self.templates.transpose(-1, -2)


#: the spaces whose problems use the site's own weights (``key_weight``): sites of several layers are built one
#: by one there, and at once elsewhere (the merged stacks of :class:`probe.batch.rows.BatchSolver`)
SITE_WEIGHT_SPACES = ("hidden",)


def real_values(site: SiteCapture) -> torch.Tensor:
    """The site's values with those of padding keys set to zero, ``(b, g, k, d_v)``: they carry no weight, and a
    float64 model's padding positions may hold NaN (its eager softmax, taken in float32, saw a row of keys all
    masked), which a product with a zero weight would carry on.  (A copy, always: asking whether any key is
    padding would wait for the GPU.)"""
    return site.values.masked_fill(~site.key_mask[:, None, :, None].to(site.values.device), 0.0)


def space_problems(site: SiteCapture, space: str, examples: slice = slice(None)) -> SpaceProblems:
    """The site's reduced problems (alpha = 1) in ``space`` for the examples ``examples``, in float64."""
    f64 = torch.float64
    key_mask = site.key_mask[examples]
    b, h, q, d_head = site.queries[examples].shape
    c = site.logit_scale * d_head**0.5  # z = c W_k^T q (hidden) or z = c q (key)

    def by_key_head(g):  # (b, h, q, d') -> (b, g, (h / g) q, d'): query head j uses key head j // (h / g)
        queries = site.queries[examples].to(f64, memory_format=torch.contiguous_format)
        return queries.reshape(b, g, (h // g) * q, d_head)  # one product per key head, no repeated keys

    if space == "key":
        queries = by_key_head(site.keys.shape[1])
        # padding templates carry no weight (set to zero, not multiplied: a float64 model's padding positions may
        # hold NaN, where its eager softmax, taken in float32, saw a row of keys all masked)
        keys = site.keys[examples].to(f64).masked_fill(~key_mask[:, None, :, None], 0.0)
        logits = site.logit_scale * (queries @ keys.transpose(-1, -2))
        templates = keys / d_head**0.5
        evidence_sqnorm = c**2 * (queries * queries).sum(-1)
    elif space == "hidden":
        if site.key_weight is None:
            raise ValueError("this site has no hidden-space parameterisation (no key_hidden / key_weight)")
        x = site.key_hidden[examples].to(f64).masked_fill(~key_mask[..., None], 0.0)
        w_key = site.key_weight.to(f64)
        g = w_key.shape[0] // d_head
        queries = by_key_head(g)
        keys = head_split(x @ w_key.T, g)  # W_k x_i per key head, (b, g, k, d')
        logits = site.logit_scale * (queries @ keys.transpose(-1, -2))
        w_heads = w_key.view(g, d_head, -1)
        key_gram = w_heads @ w_heads.transpose(-1, -2)  # (g, d', d') = W_k,h W_k,h^T
        evidence_sqnorm = c**2 * (queries @ key_gram).mul_(queries).sum(-1)  # q^T W_k,h W_k,h^T q
        templates = x / d_head**0.5
    else:
        raise ValueError(f"unknown space {space!r}; known: {', '.join(SPACES)}")
    return SpaceProblems(templates=templates, logits=logits.view(b, h, q, -1),
                         evidence_sqnorm=evidence_sqnorm.view(b, h, q))


def padded_batch(tokenizer, texts: list[str], max_length: int) -> dict:
    """``input_ids`` and ``attention_mask`` of ``texts``, padded to the longest and truncated to
    ``max_length`` tokens: the inputs of an encoder (or decoder) that takes nothing else."""
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


class Adapter(ABC):
    """Per-architecture capture.  Subclasses are declared in :data:`probe.capture.adapters.REGISTRY`."""

    #: ``config.model_type`` values this adapter handles.
    model_types: tuple[str, ...] = ()
    #: attention types it produces, in display order.
    attention_types: tuple[str, ...] = ()
    #: parameterisations its sites support; the first is the default.
    spaces: tuple[str, ...] = SPACES

    def model_class(self, config):
        """The transformers class to load (``from_pretrained``) or build (``from_config``) the model with."""
        from transformers import AutoModel

        return AutoModel

    def load_model(self, name_or_path: str, *, config, revision: str | None, dtype: torch.dtype, device_map=None):
        """Load pretrained weights running probe's attention function (the family's eager attention, observable:
        :mod:`probe.capture.adapters.interface`).

        ``config`` is the checkpoint's config with its attention implementation already set to probe's
        (a value saved in config.json would otherwise win over the ``attn_implementation`` argument).
        ``device_map="auto"`` shards the model over the visible GPUs (accelerate); ``None`` loads it whole.
        """
        from probe.capture.checkpoint import (
            from_pretrained_checked,  # weight problems as ProbeErrors
        )

        placement = {"device_map": device_map} if device_map is not None else {}
        model = from_pretrained_checked(
            self.model_class(config), name_or_path, config=config, revision=revision, dtype=dtype,
            attn_implementation=register_attention(), **placement,
        )
        self.prepare(model)
        return model

    def init_model(self, config, *, dtype: torch.dtype, seed: int):
        """The same architecture with fresh random weights (the random-init control): exactly
        ``torch.manual_seed(seed)`` then ``model_class.from_config(config)``, running probe's attention function."""
        torch.manual_seed(seed)
        model = self.model_class(config).from_config(config, attn_implementation=register_attention(), dtype=dtype)
        self.prepare(model)
        return model

    def prepare(self, model) -> None:  # noqa: B027 (a hook: most families need nothing here)
        """Read what encoding needs from the loaded model (e.g. the decoder start token)."""

    @abstractmethod
    def encode(self, tokenizer, texts: list[str], targets: list[str] | None, max_length: int) -> dict:
        """Tokenise a batch into the model's keyword inputs (padded)."""

    @abstractmethod
    def capture(self, model, inputs: dict, emit: Callable[[SiteCapture], None], selection=None) -> None:
        """Run the model on ``inputs`` and call ``emit`` with each attention site as soon as it is computed;
        with a ``selection`` (:class:`probe.capture.selection.BatchSelection`), only the selected sites, each cut
        to its selected heads and queries (:func:`probe.capture.selection.restrict`)."""

    def sites(self, model, inputs: dict, selection=None) -> list[SiteCapture]:
        """Every site of one forward pass (or those ``selection`` measures), as a list (for tests and interactive
        use; holds them all)."""
        collected: list[SiteCapture] = []
        with torch.no_grad():
            self.capture(model, inputs, collected.append, selection)
        return collected

    def describe(self) -> dict:
        """Conventions recorded in the manifest (parameterisation, decoder input, ...)."""
        return {}

    def stacks(self, config) -> dict[str, Stack]:
        """Each attention type's number of layers and query heads, read from the model's config before any
        weight loads (:mod:`probe.capture.selection` checks ``--layers`` and ``--heads`` against them).  The
        decoder's attention types (``decoder_self``, ``cross``) read the decoder's entries, the others the
        encoder's (or the only stack's); a family with other entries overrides this."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        found = {}
        for kind in self.attention_types:
            stack = "target" if kind in ("decoder_self", "cross") else "source"
            layers, heads = config_entry(text, LAYER_ENTRIES[stack]), config_entry(text, HEAD_ENTRIES[stack])
            if layers is None or heads is None:
                raise ProbeError(
                    f"probe cannot tell the number of {'layers' if layers is None else 'attention heads'} of this "
                    f"{config.model_type} model's {kind} attention from its config.json (none of "
                    f"{', '.join(LAYER_ENTRIES[stack] if layers is None else HEAD_ENTRIES[stack])}); its adapter must "
                    "say (probe.capture.adapters, Adapter.stacks)."
                )
            found[kind] = Stack(layers, heads)
        return found


def head_split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, n, heads * d) -> (b, heads, n, d)."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def project(x: torch.Tensor, linear: torch.nn.Linear, heads: int) -> torch.Tensor:
    """Per-head projection ``W x + b`` of ``linear`` in float64, ``(b, n, D) -> (b, heads, n, d')``."""
    x = x.detach().to(torch.float64)
    out = x @ linear.weight.detach().to(torch.float64).T
    if linear.bias is not None:
        out = out + linear.bias.detach().to(torch.float64)
    return head_split(out, heads)
