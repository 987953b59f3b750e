r"""What a run measures: its attention types, layers, query heads and query positions.

A run measures every (example, site, head, query token) unless told otherwise (``--layers``, ``--heads``,
``--attention-types``, ``--queries``; :mod:`probe.core.arguments` reads them).  :func:`resolve` checks a
selection against the model's stacks (:meth:`probe.capture.adapters.base.Adapter.stacks`, read from its config
before any weight loads) and gives a :class:`Selection`; :meth:`Selection.for_batch` binds it to a batch's
examples, and the adapters build only the selected part of each site (:func:`restrict`), so that the problems
held, solved and written grow with the rows selected, never with the tokens squared of the sites left out.

The query rules, on each text's real (non-padding) tokens, numbered from 0 in its own sequence (the encoder's
for ``self``, ``encoder_self`` and ``causal_self`` sites; the decoder's for ``decoder_self`` and ``cross``):

* ``all``: every position;
* ``last``: the last position;
* ``every:K``: positions :math:`0, K, 2K, \dots`;
* ``sample:N``: :math:`\min(N, n)` of the :math:`n` positions, drawn without replacement by a generator
  seeded with the run's seed, the text's example id and its sequence (:func:`sampled_positions`), so that
  every site and head of one text measures the same positions (its rows join across layers), whatever the
  batch the text falls in, the process that runs it or a resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from probe.core.arguments import QueryRule, describe_indices, indices, queries
from probe.core.errors import ProbeError
from probe.core.spelling import option

#: the attention types a site can have (an adapter's stacks are some of them)
ATTENTION_TYPES = ("self", "causal_self", "encoder_self", "decoder_self", "cross")
#: attention types whose queries are decoder (target) tokens; the others' are the encoder's (source)
TARGET_QUERY_TYPES = ("decoder_self", "cross")


@dataclass(frozen=True)
class Stack:
    """One attention type's stack of sites: its number of layers (sites called in one forward pass) and of
    query heads per site."""

    layers: int
    heads: int


@dataclass(frozen=True)
class Selection:
    """A run's selection, resolved against the model's stacks.

    Attributes:
        layers: attention type -> the layers measured (every selected type has an entry).
        heads: attention type -> the query heads measured, ascending.
        stacks: attention type -> its :class:`Stack` (every type of the model).
        queries: the query rule.
        seed: the run's seed (``sample:N``).
    """

    layers: dict[str, tuple[int, ...]]
    heads: dict[str, tuple[int, ...]]
    stacks: dict[str, Stack]
    queries: QueryRule = field(default_factory=QueryRule)
    seed: int = 0

    @property
    def everything(self) -> bool:
        """Whether every layer, head, attention type and query position is measured."""
        return not self.queries.selects and all(
            kind in self.layers and len(self.layers[kind]) == stack.layers and len(self.heads[kind]) == stack.heads
            for kind, stack in self.stacks.items()
        )

    def wants(self, attention_type: str, layer: int) -> bool:
        """Whether the site ``(attention_type, layer)`` is measured."""
        return layer in self.layers.get(attention_type, ())

    def for_batch(self, example_ids) -> "BatchSelection":
        """The selection bound to a batch's example ids (their sampled positions depend on them)."""
        return BatchSelection(self, tuple(int(i) for i in example_ids))

    def describe(self) -> str:
        """What was measured, in words: ``"layers 0, 5, 11; heads 0-3; 32 sampled query positions per text (all of a
        shorter text), seed 0"``."""
        parts = []
        if tuple(self.layers) != tuple(self.stacks):
            parts.append(f"attention types {', '.join(self.layers)}")
        for label, chosen, size in (("layers", self.layers, "layers"), ("heads", self.heads, "heads")):
            distinct = {values for values in chosen.values()}
            partial = any(len(values) < getattr(self.stacks[kind], size) for kind, values in chosen.items())
            if partial:
                if len(distinct) == 1:
                    parts.append(f"{label} {_spans(next(iter(distinct)))}")
                else:
                    parts.append(f"{label} " + "; ".join(f"{kind} {_spans(values)}" for kind, values in chosen.items()))
        if self.queries.selects:
            parts.append(self.queries.describe() + (f", seed {self.seed}" if self.queries.kind == "sample" else ""))
        return "; ".join(parts) if parts else "every layer, head and query position"

    def record(self) -> dict:
        """The selection as the manifest records it."""
        return {
            "attention_types": list(self.layers),
            "layers": {kind: list(values) for kind, values in self.layers.items()},
            "heads": {kind: list(values) for kind, values in self.heads.items()},
            "queries": str(self.queries),
            "seed": self.seed,
            "description": self.describe(),
            # the model's sizes, so that a reader can count indices from the end as the run did
            "stacks": {kind: {"layers": stack.layers, "heads": stack.heads} for kind, stack in self.stacks.items()},
        }


def _spans(values: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    spans, start = [], None
    for index, value in enumerate(values):
        if start is None:
            start = value
        if index + 1 == len(values) or values[index + 1] != value + 1:
            spans.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(spans)


def resolve(config, stacks: dict[str, Stack]) -> Selection:
    """The run's selection (``config.layers``, ``heads``, ``attention_types``, ``queries``, ``seed``) against the
    model's ``stacks``; a layer or head out of a stack's range, or an attention type the model lacks, is refused
    with the model's range (:class:`ProbeError`)."""
    rule = queries(config.queries)
    types = tuple(stacks)
    if config.attention_types is not None:
        unknown = [kind for kind in config.attention_types if kind not in ATTENTION_TYPES]
        if unknown:
            raise ProbeError(
                f"{option('attention_types', ','.join(unknown))}: not an attention type. The types are "
                f"{', '.join(ATTENTION_TYPES)}; this model has {', '.join(stacks)}."
            )
        absent = [kind for kind in config.attention_types if kind not in stacks]
        if absent:
            raise ProbeError(
                f"{option('attention_types', ','.join(absent))}: the model has no such attention type; its types are "
                f"{', '.join(stacks)}."
            )
        if len(set(config.attention_types)) != len(config.attention_types):
            raise ProbeError(f"{option('attention_types')} lists a type twice ({', '.join(config.attention_types)}); "
                             "list each once.")
        types = tuple(kind for kind in stacks if kind in config.attention_types)
    chosen = {}
    for name, spec, size in (("layers", config.layers, "layers"), ("heads", config.heads, "heads")):
        ranges = indices(spec, name)
        per_type = {}
        for kind in types:
            count = getattr(stacks[kind], size)
            if ranges is None:
                per_type[kind] = tuple(range(count))
                continue
            picked = set()
            for each in ranges:
                resolved = each.resolve(count)
                if resolved is None and each.resolve_end(count, each.first) is not None \
                        and each.resolve_end(count, each.last) is not None:
                    raise ProbeError(
                        f"{option(name, spec)}: {each} runs backwards in this model's {kind} stack (from "
                        f"{each.resolve_end(count, each.first)} down to {each.resolve_end(count, each.last)}): a range a-b "
                        f"goes from a up to b."
                    )
                if resolved is None:
                    raise ProbeError(_out_of_range(name, spec, each, stacks, types, size))
                picked.update(resolved)
            per_type[kind] = tuple(sorted(picked))
        chosen[name] = per_type
    return Selection(layers=chosen["layers"], heads=chosen["heads"], stacks=dict(stacks), queries=rule,
                     seed=int(config.seed))


def _out_of_range(name: str, spec: str, entry, stacks: dict[str, Stack], types, size: str) -> str:
    """Why ``entry`` of ``--layers``/``--heads`` is refused, with the model's range for each attention type."""
    ranges = "; ".join(f"{kind}: {getattr(stacks[kind], size)} {size}, {_range(getattr(stacks[kind], size))}"
                       for kind in types)
    several = len(types) > 1
    return (
        f"{option(name, spec)}: {entry} is out of range for this model ({ranges}). Indices count from 0; negative "
        f"ones from the end (-1 is the last)"
        + (f"; each index applies within every selected attention type's stack, so choose types with "
           f"{option('attention_types')}" if several else "")
        + "."
    )


def _range(count: int) -> str:
    return "none" if count == 0 else f"0 to {count - 1} (or -{count} to -1)"


@dataclass(frozen=True)
class BatchSelection:
    """A :class:`Selection` bound to one batch's example ids (in the batch's order)."""

    selection: Selection
    example_ids: tuple[int, ...]

    def wants(self, attention_type: str, layer: int) -> bool:
        return self.selection.wants(attention_type, layer)

    def query_columns(self, attention_type: str, query_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The selected query columns of each example (``query_mask``: ``(b, q)``, which columns are real tokens):
        ``(columns, selected)``, both ``(b, q')``, where ``selected`` says which entries are real selections
        (examples with fewer selected positions are padded); None when every real query is selected."""
        rule = self.selection.queries
        if not rule.selects:
            return None
        mask = query_mask.bool().cpu()
        sequence = 1 if attention_type in TARGET_QUERY_TYPES else 0
        chosen = []
        for row, example in zip(mask, self.example_ids):
            real = row.nonzero().squeeze(-1).numpy()
            positions = query_positions(rule, len(real), self.selection.seed, example, sequence)
            chosen.append(real[positions])
        width = max((len(each) for each in chosen), default=0)
        columns = torch.zeros((len(chosen), max(width, 1)), dtype=torch.long)
        selected = torch.zeros((len(chosen), max(width, 1)), dtype=torch.bool)
        for row, each in enumerate(chosen):
            columns[row, : len(each)] = torch.as_tensor(each, dtype=torch.long)
            selected[row, : len(each)] = True
        return columns.to(query_mask.device), selected.to(query_mask.device)

    def heads(self, attention_type: str, count: int) -> tuple[int, ...] | None:
        """The selected query heads of a site with ``count`` heads; None when all are."""
        heads = self.selection.heads.get(attention_type, ())
        return None if heads == tuple(range(count)) else heads


def sampled_positions(count: int, size: int, seed: int, example: int, sequence: int) -> np.ndarray:
    """``min(count, size)`` positions of ``range(size)``, ascending, drawn without replacement by a generator
    seeded with ``(seed, example, sequence)``: the same for a text wherever and whenever it is measured."""
    if size <= count:
        return np.arange(size)
    generator = np.random.default_rng([seed, example, sequence])
    return np.sort(generator.choice(size, size=count, replace=False))


def query_positions(rule: QueryRule, size: int, seed: int, example: int, sequence: int) -> np.ndarray:
    """The positions of a sequence of ``size`` real tokens that ``rule`` measures (module docstring)."""
    if size == 0:
        return np.arange(0)
    if rule.kind == "last":
        return np.array([size - 1])
    if rule.kind == "every":
        return np.arange(0, size, rule.count)
    if rule.kind == "sample":
        return sampled_positions(rule.count, size, seed, example, sequence)
    return np.arange(size)


# --------------------------------------------------------------------------------------------------
# restricting a site


def take_queries(x: torch.Tensor | None, columns: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """``x`` (``(B, ..., Q, ...)`` with the query axis at 2 for 4-d tensors, at 1 for 2-d ones; ``B`` 1 or
    ``batch``; ``Q`` 1 or the number of queries) at the query ``columns`` ``(batch, q')`` of each example; an
    axis of size 1 (a value shared by every query) stays shared."""
    if x is None or columns is None:
        return x
    axis = 2 if x.dim() == 4 else 1
    if x.shape[axis] == 1:
        return x
    x = x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 else x
    index = columns.to(x.device)
    if x.dim() == 4:
        index = index[:, None, :, None].expand(batch, x.shape[1], index.shape[1], x.shape[3])
    return x.gather(axis, index)


def take_heads(x: torch.Tensor | None, heads: tuple[int, ...] | None) -> torch.Tensor | None:
    """``x`` (``(B, H, ...)``) at the query ``heads``; a head axis of size 1 stays shared."""
    if x is None or heads is None or x.shape[1] == 1:
        return x
    return x[:, list(heads)]


def key_heads(heads: tuple[int, ...], query_heads: int, key_value_heads: int) -> list[int]:
    r"""The key/value heads that the selected query ``heads`` read, in the layout the solver's groups need: query
    head :math:`j` uses key head :math:`j \div (h/g)`.  Where every key head used is used by the same number of
    selected query heads, one entry per key head (the selected query heads still read their key heads in equal
    blocks); otherwise one entry per selected query head, a key head repeated for each query head that uses it."""
    ratio = query_heads // key_value_heads
    used = [head // ratio for head in heads]
    distinct = sorted(set(used))
    return distinct if len({used.count(kv) for kv in distinct}) == 1 else used


@dataclass(frozen=True)
class SiteRows:
    """The rows of one site a run measures: its query heads and, per example, its query columns.

    Attributes:
        batch: the number of examples ``b``.
        heads: the query heads kept, ascending (None: all).
        key_heads: the key/value heads they read (:func:`key_heads`; None: all).
        columns: ``(b, q')`` the query columns kept per example (None: all).
        selected: ``(b, q')`` which entries of ``columns`` are selections (an example with fewer selected
            positions than the batch's widest is padded).
    """

    batch: int
    heads: tuple[int, ...] | None = None
    key_heads: list[int] | None = None
    columns: torch.Tensor | None = None
    selected: torch.Tensor | None = None

    def per_head_and_query(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A ``(B, H, Q, ...)`` tensor (queries, probabilities, preference) at the kept heads and queries."""
        return take_queries(take_heads(x, self.heads), self.columns, self.batch)

    def per_query(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A ``(b, q)`` tensor (query ids, positions) at the kept queries."""
        return take_queries(x, self.columns, self.batch)

    def query_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """Which kept queries are real: the real tokens among the kept columns, and no padding entry."""
        kept = self.per_query(mask)
        return kept if self.selected is None else kept & self.selected.to(kept.device)

    def per_key_head(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """A ``(b, g, ...)`` tensor (keys, values) at the key heads the kept query heads read."""
        return x if x is None or self.key_heads is None else x[:, self.key_heads]

    def key_weight(self, weight: torch.Tensor | None, d_head: int) -> torch.Tensor | None:
        """:math:`W_k` ``(g d', D)`` at the key heads the kept query heads read."""
        if weight is None or self.key_heads is None:
            return weight
        return weight.view(-1, d_head, weight.shape[-1])[self.key_heads].reshape(-1, weight.shape[-1])

    def head_ids(self, given: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The model's index of each kept head (``given``: the site's, None for ``0 .. h - 1``)."""
        if self.heads is None:
            return given
        return self.heads if given is None else tuple(given[j] for j in self.heads)


def site_rows(chosen: "BatchSelection", attention_type: str, query_heads: int, key_value_heads: int,
              query_mask: torch.Tensor) -> SiteRows | None:
    """The rows of a site of ``attention_type`` that ``chosen`` measures (None: all of them)."""
    heads = chosen.heads(attention_type, query_heads)
    found = chosen.query_columns(attention_type, query_mask)
    if heads is None and found is None:
        return None
    columns, selected = found if found is not None else (None, None)
    return SiteRows(batch=query_mask.shape[0], heads=heads,
                    key_heads=None if heads is None else key_heads(heads, query_heads, key_value_heads),
                    columns=columns, selected=selected)


def restrict(site, chosen: BatchSelection | None):
    """The part of ``site`` (a :class:`probe.capture.adapters.base.SiteCapture`) that ``chosen`` measures (None when the site is not measured at all): its selected
    query heads (with the key and value heads they read) and, per example, its selected query positions
    (``query_mask`` False where an example has fewer than the batch's widest selection); ``query_positions``
    keep each query's position in its own sequence and ``head_ids`` each head's index in the model."""
    if chosen is None:
        return site
    if not chosen.wants(site.attention_type, site.layer):
        return None
    _, h, _, d_head = site.queries.shape
    rows = site_rows(chosen, site.attention_type, h, site.keys.shape[1], site.query_mask)
    if rows is None:
        return site
    positions = site.query_mask.long().cumsum(-1) - 1 if site.query_positions is None else site.query_positions
    return replace(
        site,
        queries=rows.per_head_and_query(site.queries), model_probs=rows.per_head_and_query(site.model_probs),
        model_output=rows.per_head_and_query(site.model_output),
        log_preference=rows.per_head_and_query(site.log_preference), keys=rows.per_key_head(site.keys),
        values=rows.per_key_head(site.values), key_weight=rows.key_weight(site.key_weight, d_head),
        query_ids=rows.per_query(site.query_ids), query_positions=rows.per_query(positions),
        query_mask=rows.query_mask(site.query_mask), head_ids=rows.head_ids(site.head_ids),
    )


def selected(emit: Callable, chosen: BatchSelection | None) -> Callable:
    """``emit`` of the part of each site that ``chosen`` measures (:func:`restrict`); sites left out are dropped."""
    if chosen is None:
        return emit

    def emit_selected(site) -> None:
        kept = restrict(site, chosen)
        if kept is not None:
            emit(kept)

    return emit_selected


def selection_differences(manifests: dict[str, dict]) -> str | None:
    """How the rows that runs measured differ (``manifests``: each run's manifest by its directory), in one
    sentence; None when every run measured the same attention types, layers, heads and query positions (the same
    seed for ``sample:N``), or all of each.  A type, layer or head list left out (all) matches any other run's
    all, whatever the model's size; a run without a recorded selection is not compared."""
    import json

    def measured(manifest: dict) -> str | None:
        selection, config = manifest.get("selection"), manifest.get("config") or {}
        if not isinstance(selection, dict):
            return None
        rule = str(selection.get("queries", "all"))
        key = {"queries": rule, "seed": selection.get("seed") if rule.startswith("sample") else None}
        stacks = selection.get("stacks")
        for name in ("attention_types", "layers", "heads"):
            chosen = selection.get(name)
            if stacks is not None and name == "attention_types":
                whole = list(chosen or []) == list(stacks)
            elif stacks is not None:
                whole = all(list(values) == list(range(stacks[kind][name])) for kind, values in (chosen or {}).items())
            else:  # a run from before the manifest recorded the model's sizes: what was given
                whole = config.get(name) is None
            key[name] = "all" if whole else chosen
        return json.dumps(key, sort_keys=True)

    found = {run: measured(manifest) for run, manifest in manifests.items()}
    if len({key for key in found.values() if key is not None}) < 2:
        return None
    described = "; ".join(f"{run}: {(manifests[run].get('selection') or {}).get('description', '?')}"
                          for run, key in found.items() if key is not None)
    return (
        f"The runs did not measure the same rows (their selections differ): {described}. Each run's numbers "
        "summarise its own layers, heads and query positions, so a difference between them is not only the "
        f"models'. Compare runs made with the same {option('attention_types')}, {option('layers')}, "
        f"{option('heads')} and {option('queries')} (and {option('seed')} for sample:N)."
    )


def describe_config(config) -> str:
    """The selection as given, without the model (``"layers 0,5,-1; queries sample:32"``), for messages."""
    parts = [f"{name} {describe_indices(indices(getattr(config, name), name))}" for name in ("layers", "heads")
             if getattr(config, name) is not None]
    if config.attention_types is not None:
        parts.append(f"attention types {','.join(config.attention_types)}")
    if queries(config.queries).selects:
        parts.append(f"queries {config.queries}")
    return "; ".join(parts) or "everything"
