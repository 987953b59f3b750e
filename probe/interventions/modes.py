"""The modes: each site substituted on its own (``per-site``) and every site at once, solved in order on
the states the substitutions produce (``whole``); the records they give and their table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from probe.capture.adapters.base import SiteCapture
from probe.core.errors import ProbeError
from probe.core.schema import INTERVENTION_COLUMNS, INTERVENTION_SCHEMA
from probe.interventions.effects import effects, lm_labels
from probe.interventions.forward import Outputs, Trace, layout_of, run_forward
from probe.interventions.model import (
    WHOLE,
    InterventionConfig,
    lm_kind,
    masked_lm_inputs,
    pooling_of,
    require_intervention,
)
from probe.interventions.substitutes import Substitute, site_substitutes

_F64 = torch.float64

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

    trace = Trace() if config.from_site and layout_of(loaded).blocks is not None else None
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
