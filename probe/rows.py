"""Sites -> problems -> solves -> rows: what the pipeline does with one batch's attention sites."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from .adapters import SiteCapture
from .schema import DEVIATION_SCHEMA
from .solver import DualProblems, DualSolution, solve_dual


def site_problems(site: SiteCapture, alpha: float) -> DualProblems:
    r"""The site's problems for strength ``alpha``: one group per example, one problem per (head, query).

    Adapters give :math:`\alpha = 1` quantities; for other :math:`\alpha` the evidence is rescaled to
    :math:`z/\alpha` so that :math:`\alpha\langle t_i, z\rangle + \log u_i` still equals the model's logits.
    """
    b, h, q, k = site.logits.shape
    log_pref = site.log_preference.expand(b, h, q, k).reshape(b, h * q, k)
    active = site.query_mask[:, None, :].expand(b, h, q).reshape(b, h * q)
    return DualProblems(
        gram=site.gram,
        logits=site.logits.reshape(b, h * q, k) / alpha,
        log_preference=log_pref,
        evidence_sqnorm=site.evidence_sqnorm.reshape(b, h * q) / alpha**2,
        alpha=alpha,
        active=active,
    )


def fidelity_error(site: SiteCapture) -> float:
    """Max |softmax(log u + alpha s) - model probabilities| over the site's real queries (alpha = 1)."""
    reconstructed = torch.softmax(site.log_preference + site.logits, dim=-1)
    difference = (reconstructed - site.model_probs.to(torch.float64)).abs().amax(dim=-1)  # (b, h, q)
    difference = difference.masked_fill(~site.query_mask[:, None, :], 0.0)
    return float(difference.max()) if difference.numel() else 0.0


def site_rows(site: SiteCapture, solution: DualSolution, example_ids: list[int], model_name: str, alpha: float) -> pa.Table:
    """One row per (example, head, real query) of the site, in the parquet schema."""
    b, h, q, k = site.logits.shape
    active = site.query_mask[:, None, :].expand(b, h, q)
    n_keys = torch.isfinite(site.log_preference.expand(b, h, q, k)).sum(-1)
    ex, head, query = active.nonzero(as_tuple=True)

    def pick(x):
        return x.reshape(b, h, q)[ex, head, query].cpu().numpy()

    count = len(ex)
    examples = np.asarray(example_ids, dtype=np.int64)[ex.cpu().numpy()]
    columns = {
        "model": pa.array([model_name] * count, pa.string()),
        "attention_type": pa.array([site.attention_type] * count, pa.string()),
        "layer": np.full(count, site.layer, np.int32),
        "head": head.cpu().numpy().astype(np.int32),
        "example": examples,
        "query": query.cpu().numpy().astype(np.int32),
        "n_keys": n_keys[ex, head, query].cpu().numpy().astype(np.int32),
        "alpha": np.full(count, alpha, np.float64),
        "rel_deviation": pick(solution.rel_deviation),
        "lambda_norm": pick(solution.lambda_norm),
        "duality_gap": pick(solution.duality_gap),
        "error_bound": pick(solution.error_bound),
        "iterations": pick(solution.iterations).astype(np.int32),
        "converged": pick(solution.converged),
    }
    for name in DEVIATION_SCHEMA.names:  # analysis columns not computed yet (being built): null
        columns.setdefault(name, pa.nulls(count, DEVIATION_SCHEMA.field(name).type))
    columns["space"] = pa.array(["hidden"] * count, pa.string())
    return pa.table(columns, schema=DEVIATION_SCHEMA)


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
        self.tolerance = tolerance

    def add(self, table: pa.Table, site: SiteCapture, fidelity: float):
        if table.num_rows:
            converged = table["converged"].to_numpy(zero_copy_only=False)
            iterations = table["iterations"].to_numpy()
            bound = table["error_bound"].to_numpy() / table["lambda_norm"].to_numpy()
            self.rows += table.num_rows
            self.not_converged += int((~converged).sum())
            self.max_duality_gap = max(self.max_duality_gap, float(np.nanmax(table["duality_gap"].to_numpy())))
            self.max_relative_error_bound = max(self.max_relative_error_bound, float(np.nanmax(bound)))
            self.iterations_total += int(iterations.sum())
            self.iterations_max = max(self.iterations_max, int(iterations.max()))
        key = site.attention_type
        self.fidelity[key] = max(self.fidelity.get(key, 0.0), fidelity)

    def solver(self) -> dict:
        return {
            "method": "Newton-CG on the reduced dual with Armijo backtracking (probe.solver)",
            "dtype": "float64",
            "newton_direction_dtype": "float32",
            "rows": self.rows,
            "converged": self.rows - self.not_converged,
            "not_converged": self.not_converged,
            "max_duality_gap": self.max_duality_gap,
            "max_relative_error_bound": self.max_relative_error_bound,
            "mean_iterations": self.iterations_total / self.rows if self.rows else None,
            "max_iterations": self.iterations_max,
        }

    def state(self) -> dict:
        """The running totals as JSON values (each part file stores its batch's; see :meth:`merge`)."""
        return {**vars(self), "fidelity": dict(self.fidelity)}

    @classmethod
    def from_state(cls, state: dict) -> "Summary":
        summary = cls(state["tolerance"])
        vars(summary).update({**state, "fidelity": dict(state["fidelity"])})
        return summary

    def merge(self, other: "Summary") -> "Summary":
        """Fold another summary (another batch, segment or rank) into this one; return self."""
        self.rows += other.rows
        self.not_converged += other.not_converged
        self.max_duality_gap = max(self.max_duality_gap, other.max_duality_gap)
        self.max_relative_error_bound = max(self.max_relative_error_bound, other.max_relative_error_bound)
        self.iterations_total += other.iterations_total
        self.iterations_max = max(self.iterations_max, other.iterations_max)
        for key, value in other.fidelity.items():
            self.fidelity[key] = max(self.fidelity.get(key, 0.0), value)
        return self

    def fidelity_summary(self) -> dict:
        worst = max(self.fidelity.values(), default=0.0)
        return {
            "check": "max |softmax(log u + alpha s) - eager attention probabilities| over real queries",
            "max_abs_error": worst,
            "by_attention_type": dict(self.fidelity),
            "tolerance": self.tolerance,
            "passed": worst <= self.tolerance,
        }


@torch.no_grad()
def process_batch(loaded, inputs: dict, example_ids: list[int], config, summary: Summary):
    """Capture every attention site of one batch, solve its problems and return the rows per site."""
    tables = []
    seconds = {"capture": 0.0, "solve": 0.0}
    t0 = time.perf_counter()
    for chunk in site_stacks(loaded.adapter.capture(loaded.model, inputs)):
        fidelities = [fidelity_error(site) for site in chunk]
        t1 = time.perf_counter()
        seconds["capture"] += t1 - t0
        solutions = solve_sites(chunk, config.alpha, config.rtol)
        for site, solution, fidelity in zip(chunk, solutions, fidelities):
            table = site_rows(site, solution, example_ids, config.model, config.alpha)
            summary.add(table, site, fidelity)
            tables.append(table)
        t0 = time.perf_counter()
        seconds["solve"] += t0 - t1
    return tables, seconds


#: at most this many bytes of float64 logits in one stack of sites (bounds the extra memory of stacking)
STACK_BYTES = 1 << 28


def site_stacks(sites, limit_bytes: int = STACK_BYTES):
    """Consecutive sites whose problems have one shape, in lists of at most ``limit_bytes`` of logits."""
    chunk, shape, size = [], None, 0
    for site in sites:
        b, h, q, k = site.logits.shape
        nbytes = site.logits.numel() * 8
        if chunk and ((h * q, k) != shape or size + nbytes > limit_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(site)
        shape, size = (h * q, k), size + nbytes
    if chunk:
        yield chunk


def stacked_problems(sites: list[SiteCapture], alpha: float) -> DualProblems:
    """The problems of sites of one shape as one batch: their groups stacked along the group axis."""
    problems = [site_problems(site, alpha) for site in sites]
    if len(problems) == 1:
        return problems[0]
    return DualProblems(
        gram=torch.cat([p.gram for p in problems]),
        logits=torch.cat([p.logits for p in problems]),
        log_preference=torch.cat([p.log_preference for p in problems]),
        evidence_sqnorm=torch.cat([p.evidence_sqnorm for p in problems]),
        alpha=alpha,
        active=torch.cat([p.active for p in problems]),
    )


def solve_sites(sites: list[SiteCapture], alpha: float, rtol: float) -> list[DualSolution]:
    """Solve the problems of sites of one shape with one :func:`solve_dual` call, one solution per site.

    Per-call overhead is paid once and the solver's batched products run on larger batches; the
    problems stay independent of one another.
    """
    solution = solve_dual(stacked_problems(sites, alpha), rtol=rtol)
    solutions, start = [], 0
    for site in sites:
        stop = start + site.logits.shape[0]
        solutions.append(DualSolution(**{name: value[start:stop] for name, value in vars(solution).items()}))
        start = stop
    return solutions
