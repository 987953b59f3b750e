"""The running totals a run's manifest shows: rows, certificates, iterations, fidelity and the mean of each
measured quantity per (space, alpha); mergeable across batches, segments and ranks (:meth:`Summary.merge`)."""

from __future__ import annotations

import copy

import numpy as np
import pyarrow as pa
import torch

from probe.batch.columns import SiteColumns

#: the columns whose means the manifest summarises per (space, alpha)
MEANS = ("rel_deviation", "second_order_deviation", "attention_tv", "output_deviation")


#: what the fidelity check compares, by the attention the model ran (probe.batch.problems.fidelity_errors)
FIDELITY_CHECKS = {
    "eager": "max |softmax(log u + alpha s) - eager attention probabilities| over real queries",
    "sdpa": "max |sum_i softmax(log u + alpha s)_i v_i - SDPA attention output| / max |v| over real queries",
}


class Summary:
    """Running solver and fidelity summaries for the manifest."""

    def __init__(self, tolerance: float, attn_implementation: str = "eager"):
        self.attn_implementation = attn_implementation  # what the fidelity check compares (fidelity_summary)
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

    def add_columns(self, columns: SiteColumns, bounds: dict | None = None):
        """:meth:`add` for rows kept as tensors (:class:`SiteColumns`): the same totals, reduced where the rows are."""
        for name, bound in (bounds or {}).items():
            self.derived_bounds[name] = max(self.derived_bounds.get(name, 0.0), bound)
        if not columns.count:
            return
        values = columns.values
        key = f"{columns.space}, alpha={columns.alpha:g}"
        sums = self.by_setting.setdefault(key, dict.fromkeys(("rows",) + MEANS, 0.0))
        sums["rows"] += columns.count
        for name in MEANS:
            sums[name] += float(torch.nansum(values[name]))
        iterations = values["iterations"]
        bound = values["error_bound"] / values["lambda_norm"]
        self.rows += columns.count
        self.not_converged += int((~values["converged"]).sum())
        self.max_duality_gap = max(self.max_duality_gap, _nanmax(values["duality_gap"]))
        self.max_relative_error_bound = max(self.max_relative_error_bound, _nanmax(bound))
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
            "check": FIDELITY_CHECKS[self.attn_implementation],
            "max_abs_error": worst,
            "by_attention_type": dict(self.fidelity),
            "by_space": dict(self.fidelity_by_space),
            "tolerance": self.tolerance,
            "passed": worst <= self.tolerance,
        }


def _nanmax(values: torch.Tensor) -> float:
    """numpy's ``nanmax`` of a tensor: NaN when every value is."""
    finite = values[~torch.isnan(values)]
    return float(finite.max()) if finite.numel() else float("nan")
