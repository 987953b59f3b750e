"""One batch: captured sites -> problems -> solves -> rows.

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
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from probe.capture.adapters import SiteCapture
from probe.capture.adapters.base import SpaceProblems, space_problems
from probe.core.schema import DEVIATION_SCHEMA
from probe.solve import derived
from probe.solve.dual import DualProblems, DualSolution, factor_gram, solve_dual
from probe.solve.parallel import cpu_workers, run_all
from probe.solve.problems import shares_rows

#: default bound on the float64 logits held at once (one stack of pieces)
STACK_BYTES = 1 << 28


# --------------------------------------------------------------------------------------------------
# sites -> problems


def select(site: SiteCapture, examples: slice) -> SiteCapture:
    """The site restricted to some of its examples (views, no copies)."""

    def pick(x):
        return x if x is None or x.shape[0] == 1 else x[examples]

    fields = {name: getattr(site, name) for name in SiteCapture.__dataclass_fields__}
    for name in ("queries", "keys", "values", "log_preference", "query_mask", "key_mask", "query_ids",
                 "model_probs", "key_hidden", "query_positions"):
        fields[name] = pick(fields[name])
    return SiteCapture(**fields)


def dual_problems(site: SiteCapture, problems: SpaceProblems, alpha: float) -> DualProblems:
    r"""The site's problems for strength ``alpha``, grouped by shared Gram matrix.

    Hidden space: one group per example, its ``h * q`` problems head-major.  Key space: one group per
    (example, key head), its ``(h / g) * q`` problems head-major.  Adapters give :math:`\alpha = 1`
    quantities; for other :math:`\alpha` the evidence is rescaled to :math:`z/\alpha` so that
    :math:`\alpha\langle t_i, z\rangle + \log u_i` still equals the model's logits.
    """
    b, h, q, k = site.shape
    groups = problems.gram.reshape(-1, k, k)
    per_group = h * q * b // groups.shape[0]
    log_pref = site.log_preference.expand(b, h, q, k).reshape(-1, per_group, k)
    active = site.query_mask[:, None, :].expand(b, h, q).reshape(-1, per_group)
    logits = problems.logits.reshape(-1, per_group, k)
    return DualProblems(
        gram=groups,
        logits=logits if alpha == 1 else logits / alpha,  # x / 1 == x: no copy of the largest input for alpha 1
        log_preference=log_pref,
        evidence_sqnorm=problems.evidence_sqnorm.reshape(-1, per_group) / alpha**2,
        alpha=alpha,
        active=active,
    )


def site_problems(site: SiteCapture, alpha: float, space: str = "hidden") -> DualProblems:
    """:func:`dual_problems` of the whole site in ``space``."""
    return dual_problems(site, space_problems(site, space), alpha)


#: default fidelity tolerance per model dtype (max abs difference of attention probabilities).  The
#: reconstruction is exact in float64 from the queries and keys the model multiplies; what remains is the
#: model's own rounding of its logits and probabilities.  A logit error d moves a probability p by at most
#: about p(1 - p) * 2d, and rounding to a p-bit mantissa gives d ~ |logit| * 2^-p: float16 (p = 11) stays
#: within 1e-2 and bfloat16 (p = 8) within 5e-2 for logits up to about 50.  float64 models are held to 1e-6,
#: not tighter, because several families (Llama, Mistral, Qwen2, Gemma) take their softmax in float32.
FIDELITY_TOLERANCE = {"float64": 1e-6, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}


def fidelity_error(site: SiteCapture, problems: SpaceProblems | None = None) -> float:
    """Max |softmax(log u + s) - model probabilities| over the site's real queries (alpha = 1)."""
    problems = space_problems(site, site.spaces[0]) if problems is None else problems
    reconstructed = torch.softmax(site.log_preference + problems.logits, dim=-1)
    difference = (reconstructed - site.model_probs.to(torch.float64)).abs().amax(dim=-1)  # (b, h, q)
    difference = difference.masked_fill(~site.query_mask[:, None, :], 0.0)
    return float(difference.max()) if difference.numel() else 0.0


def stacked_problems(problems: list[DualProblems]) -> DualProblems:
    """Problems of one shape as one batch: their groups stacked along the group axis."""
    if len(problems) == 1:
        return problems[0]
    return DualProblems(
        gram=torch.cat([p.gram for p in problems]),
        logits=torch.cat([p.logits for p in problems]),
        log_preference=_stacked_rows([p.log_preference for p in problems]),
        evidence_sqnorm=torch.cat([p.evidence_sqnorm for p in problems]),
        alpha=problems[0].alpha,
        active=torch.cat([p.active for p in problems]),
        factor=None if any(p.factor is None for p in problems) else torch.cat([p.factor for p in problems]),
    )


def _stacked_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along the group axis, keeping rows that share their group's values by construction
    (:func:`probe.solve.problems.shares_rows`, as an expanded preference) shared, so that the solver computes
    with them once per group."""
    if all(shares_rows(t) for t in tensors):
        first = torch.cat([t[:, :1] for t in tensors])
        return first.expand(first.shape[0], tensors[0].shape[1], first.shape[2])
    return torch.cat(tensors)


def solve_stacked(problems: list[DualProblems], rtol: float, memory_bytes: int | None = None) -> list[DualSolution]:
    """Solve problems of one shape with one :func:`solve_dual` call, one solution per entry.

    Per-call overhead is paid once and the solver's batched products run on larger batches; the
    problems stay independent of one another.
    """
    budget = {} if memory_bytes is None else {"memory_budget_bytes": memory_bytes}
    solution = solve_dual(stacked_problems(problems), rtol=rtol, **budget)
    solutions, start = [], 0
    for part in problems:
        stop = start + part.gram.shape[0]
        solutions.append(DualSolution(**{name: value[start:stop] for name, value in vars(solution).items()}))
        start = stop
    return solutions


def solve_sites(sites: list[SiteCapture], alpha: float, rtol: float, space: str = "hidden") -> list[DualSolution]:
    """Solve the problems of sites of one shape in ``space`` with one solver call, one solution per site."""
    return solve_stacked([site_problems(site, alpha, space) for site in sites], rtol)


def site_bytes(site: SiteCapture) -> int:
    """Bytes of the site's float64 logits, the measure of its problems' size."""
    b, h, q, k = site.shape
    return b * h * q * k * 8


def pieces(site: SiteCapture, limit_bytes: int) -> list[SiteCapture]:
    """The site split by examples into pieces of at most ``limit_bytes`` of logits (at least one example)."""
    b = site.shape[0]
    per_example = max(1, site_bytes(site) // max(b, 1))
    step = max(1, limit_bytes // per_example)
    if step >= b:
        return [site]
    return [select(site, slice(start, start + step)) for start in range(0, b, step)]


def site_stacks(sites, limit_bytes: int = STACK_BYTES, site_of=lambda item: item):
    """Sites (or items holding one, ``site_of(item)``) grouped by problem shape, in order of first
    appearance, in lists of at most ``limit_bytes`` of logits: each list is one solver call."""
    stacks: dict[tuple, list] = {}
    sizes: dict[tuple, int] = {}
    for item in sites:
        site = site_of(item)
        key, nbytes = _stack_key(site), site_bytes(site)
        if key in stacks and sizes[key] + nbytes > limit_bytes:
            yield stacks.pop(key)
            del sizes[key]
        stacks.setdefault(key, []).append(item)
        sizes[key] = sizes.get(key, 0) + nbytes
    yield from stacks.values()


def _stack_key(site: SiteCapture):
    """Sites with equal keys have problems of one shape in every space."""
    _, h, q, k = site.shape
    return h, q, k, site.keys.shape[1]


# --------------------------------------------------------------------------------------------------
# solutions -> rows


@dataclass
class RowContext:
    """What rows need beyond a site and its solution."""

    example_ids: list[int]
    special_ids: frozenset
    token_text: dict  # token id -> token string, filled as ids are met
    tokenizer: object = None

    def tokens(self, ids: np.ndarray) -> pa.Array:
        """The token strings of ``ids`` as a string column (each distinct id looked up once)."""
        distinct, position = np.unique(ids, return_inverse=True)
        missing = [int(i) for i in distinct if int(i) not in self.token_text]
        if missing:
            texts = self.tokenizer.convert_ids_to_tokens(missing) if self.tokenizer is not None else None
            for i, text in zip(missing, texts or [None] * len(missing)):
                self.token_text[i] = text if text is not None else str(i)
        strings = pa.array([self.token_text[int(i)] for i in distinct], pa.string())
        return strings.take(pa.array(position.reshape(-1), pa.int64()))


@dataclass
class Derived:
    """The derived quantities of one site's solution, each ``(groups, m)`` like the solution."""

    second_order_deviation: torch.Tensor
    attention_tv: torch.Tensor
    output_deviation: torch.Tensor
    attention_entropy: torch.Tensor
    #: the largest certified bound of each quantity over the site's rows (probe.solve.derived)
    bounds: dict


def derive(site: SiteCapture, problems: DualProblems, solution: DualSolution, rtol: float = 1e-9) -> Derived:
    r"""The second-order deviation, attention TV, output deviation and attention entropy of every row
    (:mod:`probe.solve.derived`, with their certified bounds).  ``problems.factor`` must be set.

    ``rtol`` is the solver's tolerance: the second-order systems are solved until their certified error
    is at most ``rtol / 10`` of :math:`\|\hat\lambda\|`, so that ``second_order_deviation`` is resolved
    like ``rel_deviation``."""
    factor, alpha = problems.factor, problems.alpha
    point, point_error = derived.second_order_point(
        factor, problems.logits, problems.log_preference, alpha, active=problems.active,
        error_target=0.1 * rtol * solution.lambda_norm,
    )
    second, second_bound = derived.second_order_deviation(
        solution.correction, point, solution.lambda_norm, solution.error_bound, point_error
    )
    log_p_att = derived.model_log_attention(problems.logits, problems.log_preference, alpha, active=problems.active)
    p_att = log_p_att.exp()
    # value heads: row j of a group uses value head j // (m / H); key space: one key head per group
    b, _, _, k = site.shape
    values = site.values.to(torch.float64).reshape(problems.gram.shape[0], -1, k, site.values.shape[-1])
    (tv, tv_bound), (output, output_bound) = derived.attention_deviations(
        solution.attention, p_att, values, problems.gram, solution.error_bound
    )

    def worst(bound):
        finite = bound[problems.active]
        return float(finite.max()) if finite.numel() else 0.0

    return Derived(
        second_order_deviation=second, attention_tv=tv, output_deviation=output,
        attention_entropy=derived.attention_entropy(p_att, log_p_att),
        bounds={"second_order_deviation": worst(second_bound), "attention_tv": worst(tv_bound),
                "output_deviation": worst(output_bound)},
    )


def site_rows(
    site: SiteCapture, space: str, problems: SpaceProblems, solution: DualSolution, quantities: Derived,
    alpha: float, context: RowContext, example_offset: int = 0,
) -> pa.Table:
    """One row per (example, head, real query) of the site in one space and alpha, in the parquet schema."""
    b, h, q, k = site.shape
    active = site.query_mask[:, None, :].expand(b, h, q)
    n_keys = torch.isfinite(site.log_preference.expand(b, h, q, k)).sum(-1)
    ex, head, query = active.nonzero(as_tuple=True)

    def pick(x):
        return x.reshape(b, h, q)[ex, head, query].cpu().numpy()

    count = len(ex)
    ex_np, query_np = ex.cpu().numpy(), query.cpu().numpy()
    examples = np.asarray(context.example_ids, dtype=np.int64)[ex_np + example_offset]
    positions = query_np if site.query_positions is None else site.query_positions[ex, query].cpu().numpy()
    token_ids = site.query_ids[ex, query].cpu().numpy().astype(np.int64)
    keys = n_keys[ex, head, query].cpu().numpy().astype(np.int32)
    role_codes = np.isin(token_ids, list(context.special_ids)).astype(np.int64)  # index into _ROLES
    if site.attention_type in ("decoder_self", "cross"):
        role_codes[positions == 0] = 2
    columns = {
        "attention_type": _repeated(site.attention_type, count),
        "layer": np.full(count, site.layer, np.int32),
        "head": head.cpu().numpy().astype(np.int32),
        "example": examples,
        "query": positions.astype(np.int32),
        "n_keys": keys,
        "alpha": np.full(count, alpha, np.float64),
        "rel_deviation": pick(solution.rel_deviation),
        "lambda_norm": pick(solution.lambda_norm),
        "duality_gap": pick(solution.duality_gap),
        "error_bound": pick(solution.error_bound),
        "iterations": pick(solution.iterations).astype(np.int32),
        "converged": pick(solution.converged),
        "space": _repeated(space, count),
        "token_id": token_ids.astype(np.int32),
        "token": context.tokens(token_ids),
        "token_role": _ROLES.take(pa.array(role_codes)),
        "trivial": keys == 1,
        "second_order_deviation": pick(quantities.second_order_deviation),
        "attention_tv": pick(quantities.attention_tv),
        "output_deviation": pick(quantities.output_deviation),
        # ||alpha z|| = ||z|| at alpha = 1 (the evidence is z / alpha for other alpha)
        "evidence_norm": problems.evidence_sqnorm[ex, head, query].sqrt().cpu().numpy(),
        "attention_entropy": pick(quantities.attention_entropy),
    }
    return pa.table(columns, schema=DEVIATION_SCHEMA)


#: the ``token_role`` values, by code
_ROLES = pa.array(["word", "special", "first"], pa.string())


def _repeated(value: str, count: int) -> pa.Array:
    """A string column of ``count`` copies of ``value``."""
    return pa.repeat(pa.scalar(value, pa.string()), count)


# --------------------------------------------------------------------------------------------------
# bookkeeping


#: the columns whose means the manifest summarises per (space, alpha)
MEANS = ("rel_deviation", "second_order_deviation", "attention_tv", "output_deviation")


class Summary:
    """Running solver and fidelity summaries for the manifest."""

    def __init__(self, tolerance: float):
        self.rows = 0
        self.not_converged = 0
        self.max_duality_gap = 0.0
        self.max_relative_error_bound = 0.0
        self.iterations_total = 0
        self.iterations_max = 0
        self.fidelity: dict[str, float] = {}
        self.fidelity_by_space: dict[str, float] = {}
        self.derived_bounds: dict[str, float] = {}
        self.by_setting: dict[str, dict] = {}  # "space, alpha=..." -> row count and sums of MEANS
        self.tolerance = tolerance

    def add(self, table: pa.Table, bounds: dict | None = None):
        for name, bound in (bounds or {}).items():
            self.derived_bounds[name] = max(self.derived_bounds.get(name, 0.0), bound)
        if table.num_rows:
            key = f"{table['space'][0].as_py()}, alpha={table['alpha'][0].as_py():g}"
            sums = self.by_setting.setdefault(key, dict.fromkeys(("rows",) + MEANS, 0.0))
            sums["rows"] += table.num_rows
            for name in MEANS:
                sums[name] += float(np.nansum(table[name].to_numpy(zero_copy_only=False)))
            converged = table["converged"].to_numpy(zero_copy_only=False)
            iterations = table["iterations"].to_numpy()
            bound = table["error_bound"].to_numpy() / table["lambda_norm"].to_numpy()
            self.rows += table.num_rows
            self.not_converged += int((~converged).sum())
            self.max_duality_gap = max(self.max_duality_gap, float(np.nanmax(table["duality_gap"].to_numpy())))
            self.max_relative_error_bound = max(self.max_relative_error_bound, float(np.nanmax(bound)))
            self.iterations_total += int(iterations.sum())
            self.iterations_max = max(self.iterations_max, int(iterations.max()))

    def add_fidelity(self, attention_type: str, space: str, error: float):
        self.fidelity[attention_type] = max(self.fidelity.get(attention_type, 0.0), error)
        self.fidelity_by_space[space] = max(self.fidelity_by_space.get(space, 0.0), error)

    def solver(self) -> dict:
        return {
            "method": "Newton-CG on the reduced dual with Armijo backtracking (probe.solve.dual)",
            "dtype": "float64",
            "newton_direction_dtype": "float32",
            "rows": self.rows,
            "converged": self.rows - self.not_converged,
            "not_converged": self.not_converged,
            "max_duality_gap": self.max_duality_gap,
            "max_relative_error_bound": self.max_relative_error_bound,
            "mean_iterations": self.iterations_total / self.rows if self.rows else None,
            "max_iterations": self.iterations_max,
            "max_derived_bound": dict(self.derived_bounds),
        }

    def settings(self) -> dict:
        """Per (space, alpha): rows and the mean of each deviation column (all rows, trivial ones included)."""
        return {
            key: {"rows": int(sums["rows"]), **{f"mean_{name}": sums[name] / sums["rows"] for name in MEANS}}
            for key, sums in self.by_setting.items()
        }

    def state(self) -> dict:
        """The running totals as JSON values (each part file stores its batch's; see :meth:`merge`)."""
        return copy.deepcopy(vars(self))

    @classmethod
    def from_state(cls, state: dict) -> "Summary":
        summary = cls(state["tolerance"])
        vars(summary).update(copy.deepcopy(state))
        return summary

    def merge(self, other: "Summary") -> "Summary":
        """Fold another summary (another batch, segment or rank) into this one; return self."""
        self.rows += other.rows
        self.not_converged += other.not_converged
        self.max_duality_gap = max(self.max_duality_gap, other.max_duality_gap)
        self.max_relative_error_bound = max(self.max_relative_error_bound, other.max_relative_error_bound)
        self.iterations_total += other.iterations_total
        self.iterations_max = max(self.iterations_max, other.iterations_max)
        for mine, theirs in (
            (self.fidelity, other.fidelity),
            (self.fidelity_by_space, other.fidelity_by_space),
            (self.derived_bounds, other.derived_bounds),
        ):
            for key, value in theirs.items():
                mine[key] = max(mine.get(key, 0.0), value)
        for key, sums in other.by_setting.items():
            mine = self.by_setting.setdefault(key, dict.fromkeys(sums, 0.0))
            for name, value in sums.items():
                mine[name] = mine.get(name, 0.0) + value
        return self

    def fidelity_summary(self) -> dict:
        worst = max(self.fidelity.values(), default=0.0)
        return {
            "check": "max |softmax(log u + alpha s) - eager attention probabilities| over real queries",
            "max_abs_error": worst,
            "by_attention_type": dict(self.fidelity),
            "by_space": dict(self.fidelity_by_space),
            "tolerance": self.tolerance,
            "passed": worst <= self.tolerance,
        }


# --------------------------------------------------------------------------------------------------
# one batch


class BatchSolver:
    """Receives sites as the model emits them and solves them in stacks of bounded size.

    ``spaces`` and ``alphas`` are the parameterisations and strengths to solve; ``memory_bytes`` (the
    run's ``--max-memory``) bounds the problems held at once and the solver's working set.

    :meth:`finish` solves what is left once the model is done with the batch; with a ``lane``
    (:class:`probe.solve.parallel.Lane`) it does so in the background, so that the caller can run the model on
    the next batch meanwhile.  (The stacks that fill while the model runs are solved at once: the model
    is still computing, and could reuse the memory of what it gave.)  The rows and their order are
    those of a run without a lane.
    """

    def __init__(self, spaces, alphas, rtol, context: RowContext, summary: Summary, memory_bytes: int | None = None):
        self.spaces, self.alphas, self.rtol = tuple(spaces), tuple(alphas), rtol
        self.context, self.summary = context, summary
        # --max-memory: an eighth for the logits of the stack held at once (the problems built from
        # them take a few times that), half for the solver's working set
        self.limit_bytes = STACK_BYTES if memory_bytes is None else max(1, memory_bytes // 8)
        self.solver_bytes = None if memory_bytes is None else max(1, memory_bytes // 2)
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
        # the sites' own work runs side by side on a CPU (probe.solve.parallel); with a memory budget, one at a time
        workers = cpu_workers(sites[0].queries.device)  # in the lane too: its thread has the caller's threads
        if self.solver_bytes is not None:
            workers = min(workers, 1)
        for space in self.spaces:

            def build(site, space=space):
                built = space_problems(site, space)
                factor = factor_gram(built.gram.reshape(-1, *built.gram.shape[-2:]))
                return built, fidelity_error(site, built), factor

            built_sites = run_all([lambda site=site: build(site) for site in sites], workers)
            problems = [built for built, _, _ in built_sites]
            for site, (_, error, _) in zip(sites, built_sites):
                self.summary.add_fidelity(site.attention_type, space, error)
            factors = [factor for _, _, factor in built_sites]
            for alpha in self.alphas:
                duals = [dual_problems(site, built, alpha) for site, built in zip(sites, problems)]
                for dual, factor in zip(duals, factors):
                    dual.factor = factor  # one factorisation per space, shared by every alpha
                solutions = solve_stacked(duals, self.rtol, self.solver_bytes)

                def rows_of(site, offset, built, dual, solution, space=space, alpha=alpha):
                    quantities = derive(site, dual, solution, self.rtol)
                    return site_rows(site, space, built, solution, quantities, alpha, self.context, offset), quantities

                finished = run_all(
                    [partial(rows_of, site, offset, built, dual, solution)
                     for (site, offset), built, dual, solution in zip(stack, problems, duals, solutions)],
                    workers,
                )
                for table, quantities in finished:  # in the stack's order, whichever worker finished first
                    self.summary.add(table, quantities.bounds)
                    self.tables.append(table)
                if self.kept is not None:
                    for (site, offset), dual, solution in zip(stack, duals, solutions):
                        if self.kept_sites is not None and (site.attention_type, site.layer) not in self.kept_sites:
                            continue
                        self.kept.setdefault((site.attention_type, site.layer, space, alpha), []).append(
                            (offset, dual, solution))


@torch.no_grad()
def process_batch(loaded, inputs: dict, example_ids: list[int], config, summary: Summary, context: RowContext,
                  lane=None, capture: Callable | None = None):
    """Capture every attention site of one batch and solve its problems; returns a function that waits
    for the solves and returns the rows, site by site, and the seconds spent capturing and solving.

    Without a ``lane`` every stack is solved before this returns; with one, the last stack may still be
    solving in the lane, so that the caller can capture the next batch meanwhile."""
    budget = getattr(config, "max_memory_bytes", None)
    context = copy.copy(context)  # the example ids of this batch, whichever batch the lane solves meanwhile
    context.example_ids = example_ids
    solver = BatchSolver(config.spaces, config.alphas, config.rtol, context, summary, memory_bytes=budget)
    started = time.perf_counter()
    if capture is None:
        loaded.adapter.capture(loaded.model, inputs, solver)
    else:
        capture(solver)
    captured = time.perf_counter() - started - solver.solve_s  # less the stacks solved as they filled
    rows = solver.finish(lane)

    def finish():
        tables = rows()
        return tables, {"capture": captured, "solve": solver.solve_s}

    return finish

