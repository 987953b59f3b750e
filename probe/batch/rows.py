"""One batch: captured sites -> problems (:mod:`probe.batch.problems`) -> solves -> rows (or, with ``--keep``,
statistics: :mod:`probe.batch.aggregates`), and the manifest's totals (:mod:`probe.batch.summary`).

The adapter emits each attention site while the model runs (:meth:`probe.capture.adapters.base.Adapter.capture`).
Sites are split by examples into pieces of at most ``budget`` bytes of float64 logits, consecutive pieces
of one shape are stacked (so the solver's per-call cost is paid once and its batched products run on
larger batches) and solved as soon as the stack is full: memory holds one stack of problems at a time,
whatever the batch size (two on a CPU with several threads and no memory budget, where a batch's last
stack is solved in the background while the model runs on the next batch: :meth:`BatchSolver.finish`).  For every stack,
each requested space (parameterisation) is built once and solved for every requested alpha.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import pyarrow as pa
import torch

from probe.batch.columns import RowContext, SiteColumns, columns_table, with_layer
from probe.batch.problems import (
    STACK_BYTES,
    dual_problems,
    fidelity_error,
    fidelity_errors,
    group_factor,
    mergeable,
    merged,
    merged_problems,
    pieces,
    site_bytes,
    site_stacks,
    solve_stacked,
    stacked_problems,
)
from probe.batch.summary import Summary
from probe.capture.adapters import SiteCapture
from probe.capture.adapters.base import SITE_WEIGHT_SPACES, SpaceProblems, real_values, space_problems
from probe.solve import derived, second_order
from probe.solve.dual import DualProblems, DualSolution
from probe.solve.parallel import cpu_workers, run_all

# --------------------------------------------------------------------------------------------------
# solutions -> rows


@dataclass
class Derived:
    """The derived quantities of one site's solution, each ``(groups, m)`` like the solution."""

    second_order_deviation: torch.Tensor
    attention_tv: torch.Tensor
    output_deviation: torch.Tensor
    attention_entropy: torch.Tensor
    #: the largest certified bound of each quantity over the site's rows (probe.solve.second_order, .derived)
    bounds: dict


#: the derived quantities' tile budgets, for the second order's systems and the attention quantities, where a
#: run sets no memory budget (``--max-memory``); with one, each takes at most a quarter of it
SECOND_ORDER_BYTES, ATTENTION_BYTES = 1 << 29, 1 << 24


def derive(site: SiteCapture, problems: DualProblems, solution: DualSolution, rtol: float = 1e-9,
           memory_bytes: int | None = None) -> Derived:
    r"""The second-order deviation, attention TV, output deviation and attention entropy of every row
    (:mod:`probe.solve.second_order`, :mod:`probe.solve.derived`, with their certified bounds).  ``problems.factor`` must be set.

    ``rtol`` is the solver's tolerance: the second-order systems are solved until their certified error
    is at most ``rtol / 10`` of :math:`\|\hat\lambda\|`, so that ``second_order_deviation`` is resolved
    like ``rel_deviation``.  ``memory_bytes``: the run's memory budget, of which each quantity's tiles take at
    most a quarter (``SECOND_ORDER_BYTES`` and ``ATTENTION_BYTES`` of this module without one)."""
    factor, alpha = problems.factor, problems.alpha

    def budget(default):  # a quarter of the run's budget at most
        return default if memory_bytes is None else min(default, max(1, memory_bytes // 4))

    point, point_error = second_order.second_order_point(
        factor, problems.logits, problems.log_preference, alpha, active=problems.active,
        error_target=0.1 * rtol * solution.lambda_norm, memory_budget_bytes=budget(SECOND_ORDER_BYTES),
    )
    second, second_bound = second_order.second_order_deviation(
        solution.correction, point, solution.lambda_norm, solution.error_bound, point_error
    )
    # value heads: row j of a group uses value head j // (m / H); key space: one key head per group
    b, _, _, k = site.shape
    values = real_values(site).reshape(problems.n_groups, -1, k, site.values.shape[-1])
    (tv, tv_bound), (output, output_bound), entropy = derived.attention_quantities(
        solution.attention, problems.logits, problems.log_preference, alpha, values, solution.error_bound,
        gram=problems.gram, factor=factor, active=problems.active,
        memory_budget_bytes=budget(ATTENTION_BYTES),
    )

    def worst(bound):
        finite = bound[problems.active]
        return float(finite.max()) if finite.numel() else 0.0

    return Derived(
        second_order_deviation=second, attention_tv=tv, output_deviation=output,
        attention_entropy=entropy,
        bounds={"second_order_deviation": worst(second_bound), "attention_tv": worst(tv_bound),
                "output_deviation": worst(output_bound)},
    )


def site_columns(
    site: SiteCapture, space: str, problems: SpaceProblems, solution: DualSolution, quantities: Derived,
    alpha: float, context: RowContext, example_offset: int = 0,
) -> SiteColumns:
    """The site's rows in one space and alpha (one per (example, head, real query)) as tensors, where they were
    computed."""
    b, h, q, k = site.shape
    active = site.query_mask[:, None, :].expand(b, h, q)
    n_keys = torch.isfinite(site.log_preference.expand(b, h, q, k)).sum(-1)
    ex, head, query = active.nonzero(as_tuple=True)  # head: the site's own head index (site.head_ids: the model's)

    def pick(x):
        return x.reshape(b, h, q)[ex, head, query]

    device = ex.device
    example_ids = torch.as_tensor(context.example_ids, dtype=torch.int64, device=device)
    positions = query if site.query_positions is None else site.query_positions[ex, query]
    token_ids = site.query_ids[ex, query].to(torch.int64)
    special = torch.as_tensor(sorted(context.special_ids), dtype=torch.int64, device=device)
    role = torch.isin(token_ids, special).to(torch.int64)  # index into ROLES
    if site.attention_type in ("decoder_self", "cross"):
        role = torch.where(positions == 0, torch.full_like(role, 2), role)
    values = {
        "rel_deviation": pick(solution.rel_deviation),
        "lambda_norm": pick(solution.lambda_norm),
        "duality_gap": pick(solution.duality_gap),
        "error_bound": pick(solution.error_bound),
        "iterations": pick(solution.iterations),
        "converged": pick(solution.converged),
        "second_order_deviation": pick(quantities.second_order_deviation),
        "attention_tv": pick(quantities.attention_tv),
        "output_deviation": pick(quantities.output_deviation),
        # ||alpha z|| = ||z|| at alpha = 1 (the evidence is z / alpha for other alpha)
        "evidence_norm": problems.evidence_sqnorm[ex, head, query].sqrt(),
        "attention_entropy": pick(quantities.attention_entropy),
    }
    model_head = head if site.head_ids is None else torch.as_tensor(site.head_ids, device=device)[head]
    return SiteColumns(site.attention_type, site.layer, space, alpha, example_ids[ex + example_offset], model_head,
                       positions.to(torch.int64), token_ids, n_keys[ex, head, query], role, values)


def site_rows(
    site: SiteCapture, space: str, problems: SpaceProblems, solution: DualSolution, quantities: Derived,
    alpha: float, context: RowContext, example_offset: int = 0,
) -> pa.Table:
    """One row per (example, head, real query) of the site in one space and alpha, in the parquet schema."""
    columns = site_columns(site, space, problems, solution, quantities, alpha, context, example_offset)
    return columns_table(columns, context)


# --------------------------------------------------------------------------------------------------
# one batch


#: a stack of a selection's sites with less than this in logits and factors (:func:`probe.batch.problems.site_bytes`)
#: is worked through as one site (:meth:`BatchSolver._solve_merged`): its sites' fixed costs would outweigh their rows
SMALL_STACK_BYTES = 16 << 20


class BatchSolver:
    """Receives sites as the model emits them and solves them in stacks of bounded size.

    ``spaces`` and ``alphas`` are the parameterisations and strengths to solve; ``memory_bytes`` (the
    run's ``--max-memory``) bounds the problems held at once, the solver's working set and the derived
    quantities' tiles (:func:`derive`).

    :meth:`finish` solves what is left once the model is done with the batch; with a ``lane``
    (:class:`probe.solve.parallel.Lane`) it does so in the background, so that the caller can run the model on
    the next batch meanwhile.  (The stacks that fill while the model runs are solved at once: the model
    is still computing, and could reuse the memory of what it gave.)  The rows and their order are
    those of a run without a lane.
    """

    def __init__(self, spaces, alphas, rtol, context: RowContext, summary: Summary, memory_bytes: int | None = None,
                 on_rows: Callable[[int], None] | None = None, aggregates=None):
        self.spaces, self.alphas, self.rtol = tuple(spaces), tuple(alphas), rtol
        self.on_rows = on_rows  # told the number of rows of each table solved (progress within a batch)
        #: work a small stack through as one site (:meth:`_solve_merged`): for the sites of a selection, whose
        #: few rows per site would otherwise cost their sites' fixed costs (a run of every row keeps the
        #: site-by-site path, whose rows do not depend on the stack's size)
        self.merge_small = False
        self.context, self.summary = context, summary
        #: ``--keep aggregates`` / ``sample:N``: a :class:`probe.batch.aggregates.Aggregates` the rows are folded
        #: into (no row table is built); None: every row becomes a table
        self.aggregates = aggregates
        # --max-memory: an eighth for the logits of the stack held at once (the problems built from
        # them take a few times that), half for the solver's working set
        self.limit_bytes = STACK_BYTES if memory_bytes is None else max(1, memory_bytes // 8)
        self.solver_bytes = None if memory_bytes is None else max(1, memory_bytes // 2)
        self.memory_bytes = memory_bytes
        self.pending: list[tuple[SiteCapture, int]] = []  # (piece, offset of its first example in the batch)
        self.pending_bytes = 0
        self.tables: list[pa.Table] = []
        self.solve_s = 0.0
        #: with :meth:`keep`: (attention type, layer, space, alpha) -> [(offset, problems, solution)] of every
        #: piece solved, for a caller that uses the solutions too (the interventions' exact posterior)
        self.kept: dict | None = None
        self.kept_sites: set | None = None  # with keep(sites): the sites kept

    def keep(self, sites=None) -> None:
        """Keep every solved piece's problems and solution (:meth:`solved`) as well as its rows; ``sites``:
        only those of these ``(attention type, layer)`` sites (a batch's solutions of every site take as
        much memory as its problems)."""
        self.kept = {}
        self.kept_sites = None if sites is None else set(sites)

    def solved(self, site: SiteCapture, space: str, alpha: float) -> tuple[DualProblems, DualSolution] | None:
        """The problems and solution of the whole ``site`` in ``space`` at ``alpha``, as this solver solved
        them for the rows (its pieces joined in example order), once :meth:`flush` has run; ``None`` when
        not kept (or not solved)."""
        pieces = sorted((self.kept or {}).get((site.attention_type, site.layer, space, alpha), ()),
                        key=lambda item: item[0])
        b, h, q, _ = site.shape
        if not pieces or sum(piece.logits.shape[0] * piece.logits.shape[1] for _, piece, _ in pieces) != b * h * q:
            return None
        problems = stacked_problems([piece for _, piece, _ in pieces])
        solutions = [solution for _, _, solution in pieces]
        solution = solutions[0] if len(solutions) == 1 else DualSolution(
            **{name: torch.cat([getattr(each, name) for each in solutions]) for name in vars(solutions[0])})
        return problems, solution

    def forget(self, site: SiteCapture) -> None:
        """Let go of what :meth:`keep` kept of ``site`` (every space and alpha), once the caller has taken it."""
        if self.kept:
            for key in [key for key in self.kept if key[:2] == (site.attention_type, site.layer)]:
                del self.kept[key]

    def __call__(self, site: SiteCapture) -> None:
        offset = 0
        for piece in pieces(site, self.limit_bytes):
            nbytes = site_bytes(piece)
            if self.pending_bytes + nbytes > self.limit_bytes:
                self.flush()
            self.pending.append((piece, offset))
            self.pending_bytes += nbytes
            offset += piece.shape[0]

    def flush(self) -> None:
        """Solve everything pending, one stack per problem shape."""
        pending, self.pending, self.pending_bytes = self.pending, [], 0
        started = time.perf_counter()
        for stack in site_stacks(pending, self.limit_bytes, site_of=lambda item: item[0]):
            self._solve(stack)
        self.solve_s += time.perf_counter() - started

    def finish(self, lane=None) -> Callable[[], list[pa.Table]]:
        """Solve what is pending (in ``lane``, if any); returns a function that waits for it and returns
        the rows, site by site."""
        if lane is None:
            self.flush()
            return lambda: self.tables
        solving = lane.submit(self.flush)
        return lambda: (solving.result(), self.tables)[1]

    def _solve(self, stack: list[tuple[SiteCapture, int]]) -> None:
        sites = [piece for piece, _ in stack]
        if self.merge_small and len(sites) > 1 and self.kept is None and mergeable(sites) and \
                sum(site_bytes(site) for site in sites) < SMALL_STACK_BYTES:
            self._solve_merged(stack)
            return
        # the sites' own work runs side by side on a CPU (probe.solve.parallel); with a memory budget, one at a time
        workers = cpu_workers(sites[0].queries.device)  # in the lane too: its thread has the caller's threads
        if self.solver_bytes is not None:
            workers = min(workers, 1)
        for space in self.spaces:

            def build(site, space=space):
                built = space_problems(site, space)
                return built, fidelity_error(site, built), group_factor(built)

            built_sites = run_all([lambda site=site: build(site) for site in sites], workers)
            problems = [built for built, _, _ in built_sites]
            for site, (_, error, _) in zip(sites, built_sites):
                self.summary.add_fidelity(site.attention_type, space, error)
            factors = [factor for _, _, factor in built_sites]
            for alpha in self.alphas:
                # one factor per space, shared by every alpha
                duals = [dual_problems(site, built, alpha, factor) for site, built, factor in zip(sites, problems,
                                                                                                    factors)]
                solutions = solve_stacked(duals, self.rtol, self.solver_bytes)

                def rows_of(site, offset, built, dual, solution, space=space, alpha=alpha):
                    quantities = derive(site, dual, solution, self.rtol, self.memory_bytes)
                    if self.aggregates is not None:  # folded below, in the stack's order
                        return site_columns(site, space, built, solution, quantities, alpha, self.context,
                                            offset), quantities
                    return site_rows(site, space, built, solution, quantities, alpha, self.context, offset), quantities

                finished = run_all(
                    [partial(rows_of, site, offset, built, dual, solution)
                     for (site, offset), built, dual, solution in zip(stack, problems, duals, solutions)],
                    workers,
                )
                for table, quantities in finished:  # in the stack's order, whichever worker finished first
                    self._add(table, quantities)
                if self.kept is not None:
                    for (site, offset), dual, solution in zip(stack, duals, solutions):
                        if self.kept_sites is not None and (site.attention_type, site.layer) not in self.kept_sites:
                            continue
                        self.kept.setdefault((site.attention_type, site.layer, space, alpha), []).append(
                            (offset, dual, solution))


    def _solve_merged(self, stack: list[tuple[SiteCapture, int]]) -> None:
        """A small stack (a selection of a few heads and queries per site, say) as one site of all its examples
        (:func:`probe.batch.problems.merged`): each operation runs once for every site, so that the stack's
        time follows its rows, not its sites; the rows are those of :meth:`_solve`, site by site."""
        sites = [piece for piece, _ in stack]
        whole = merged(sites)
        context = copy.copy(self.context)  # the examples of the merged site, in its order
        context.example_ids = [example for site, offset in stack
                               for example in self.context.example_ids[offset : offset + site.shape[0]]]
        bounds = torch.tensor([0] + [site.shape[0] for site in sites]).cumsum(0).tolist()  # each site's examples
        _, h, _, _ = whole.shape
        rows_before = torch.cat([torch.zeros(1, dtype=torch.int64, device=whole.query_mask.device),
                                 (whole.query_mask.sum(-1) * h).cumsum(0)]).tolist()  # rows are example-major
        for space in self.spaces:
            built = merged_problems([space_problems(site, space) for site in sites]) if space in SITE_WEIGHT_SPACES \
                else space_problems(whole, space)
            errors = fidelity_errors(whole, built)
            for index, site in enumerate(sites):
                self.summary.add_fidelity(site.attention_type, space, float(errors[bounds[index]:bounds[index + 1]].max()))
            factor = group_factor(built)
            for alpha in self.alphas:
                dual = dual_problems(whole, built, alpha, factor)
                (solution,) = solve_stacked([dual], self.rtol, self.solver_bytes)
                quantities = derive(whole, dual, solution, self.rtol, self.memory_bytes)
                columns = site_columns(whole, space, built, solution, quantities, alpha, context)
                if self.aggregates is None:  # one table, whose sites' rows differ in their layer only
                    table = columns_table(columns, context)
                    self.summary.add(table, quantities.bounds)
                for index, site in enumerate(sites):
                    start, stop = rows_before[bounds[index]], rows_before[bounds[index + 1]]
                    if self.aggregates is None:
                        self._add(with_layer(table.slice(start, stop - start), site.layer), quantities, summed=True)
                        continue
                    rows = torch.arange(start, stop, device=columns.head.device)
                    self._add(replace(columns.take(rows), layer=site.layer), quantities)

    def _add(self, rows, quantities: Derived, summed: bool = False) -> None:
        """One site's rows (a table, or with ``--keep`` its columns) into the summary and the batch's output;
        ``summed``: the summary has them already."""
        if self.aggregates is not None:  # the columns of the site's rows, folded into the statistics
            self.summary.add_columns(rows, quantities.bounds)
            self.aggregates.add(rows)
        else:
            if not summed:
                self.summary.add(rows, quantities.bounds)
            self.tables.append(rows)
        if self.on_rows is not None:
            self.on_rows(rows.count if self.aggregates is not None else rows.num_rows)


@torch.no_grad()
def process_batch(loaded, inputs: dict, example_ids: list[int], config, summary: Summary, context: RowContext,
                  lane=None, capture: Callable | None = None, on_rows: Callable[[int], None] | None = None,
                  selection=None, aggregates=None):
    """Capture every attention site of one batch (with a ``selection``, :class:`probe.capture.selection.Selection`,
    the rows it selects) and solve its problems; returns a function that waits for the solves and returns the
    rows, site by site, and the seconds spent capturing and solving.

    Without a ``lane`` every stack is solved before this returns; with one, the last stack may still be
    solving in the lane, so that the caller can capture the next batch meanwhile.  ``on_rows`` is told the
    number of rows of each site's table as it is solved (from the lane's thread too).  ``aggregates``: a factory
    ``aggregates(context)`` of the batch's :class:`probe.batch.aggregates.Aggregates` (``--keep aggregates`` or
    ``sample:N``), which the rows are folded into instead of becoming tables (the function then returns no table,
    the aggregates are read from it)."""
    budget = getattr(config, "max_memory_bytes", None)
    context = copy.copy(context)  # the example ids of this batch, whichever batch the lane solves meanwhile
    context.example_ids = example_ids
    solver = BatchSolver(config.spaces, config.alphas, config.rtol, context, summary, memory_bytes=budget,
                         on_rows=on_rows, aggregates=None if aggregates is None else aggregates(context))
    started = time.perf_counter()
    solver.merge_small = selection is not None and not selection.everything
    if capture is None:
        chosen = None if selection is None or selection.everything else selection.for_batch(example_ids)
        loaded.adapter.capture(loaded.model, inputs, solver, chosen)
    else:
        capture(solver)
    captured = time.perf_counter() - started - solver.solve_s  # less the stacks solved as they filled
    rows = solver.finish(lane)

    def finish():
        tables = rows()
        return tables, {"capture": captured, "solve": solver.solve_s}

    return finish

