"""Statistics of the relative deviation: ``summary.csv`` / ``summary.json`` and the headline numbers.

Three levels, named in the ``level`` column, for every (space, alpha) slice of the run:

* ``layer``: over every row of the layer (every example, query token and head);
* ``layer_head_averaged``: over the (example, query token) values averaged over the layer's heads, the
  values the per-layer histograms show;
* ``head``: over every row of one head.

Trivial rows (``n_keys == 1``, where ``lambda* = alpha z`` holds by construction) are left out of
every statistic and counted in ``trivial``; ``count`` is the number of values a statistic is over.
Non-converged rows are included and counted in ``non_converged``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .data import FAR, LEVEL_KEYS, QUANTILE_METHOD, Run, in_slice, lookup, ordered_types

SUMMARY_COLUMNS = (
    "level", "space", "alpha", "attention_type", "layer", "head", "count", "trivial", "mean", "median", "p95",
    "max", f"share_above_{FAR:g}", "non_converged",
)
LEVELS = ("layer", "layer_head_averaged", "head")
STATISTICS = ["count", "mean", "median", "p95", "max", f"share_above_{FAR:g}"]


def _level(census: pd.DataFrame, stats: pd.DataFrame, keys: list[str], trivial: pd.Series) -> pd.DataFrame:
    """One level of the summary: every group of the census (rows of any kind), its statistics where it
    has non-trivial values (count 0 otherwise), its trivial count and its non-converged rows."""
    groups = census.groupby(keys, dropna=False, sort=False)[["non_converged"]].sum().reset_index()
    table = groups.merge(stats[keys + STATISTICS], on=keys, how="left")
    table = table.merge(trivial.rename("trivial").reset_index(), on=keys, how="left")
    table["count"] = table["count"].fillna(0).astype(int)
    table["trivial"] = table["trivial"].fillna(0).astype(int)
    table["non_converged"] = table["non_converged"].astype(int)
    return table


def summarize(run: Run) -> pd.DataFrame:
    """The summary table over every slice of the run (see the module docstring for the levels)."""
    census = run.census
    if not len(census) or not census["rows"].sum():
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    levels = []
    for level in LEVELS:
        keys = list(LEVEL_KEYS["head" if level == "head" else "layer"])
        if level == "layer_head_averaged":
            stats = run.averaged["layer"]
            (trivial,) = run.averaged_table.aggregate({"trivial": "CAST(count_if(trivial) AS BIGINT)"}, [tuple(keys)])
            trivial = trivial.set_index(keys)["trivial"]
        else:
            stats = run.deviation[level]
            trivial = census.groupby(keys, dropna=False)["trivial"].sum()
        levels.append(_level(census, stats, keys, trivial).assign(level=level))
    summary = pd.concat(levels, ignore_index=True)
    summary["space"] = summary["space"].astype(object).where(summary["space"].notna(), None)
    if "head" not in summary.columns:
        summary["head"] = np.nan
    summary["head"] = summary["head"].astype("Int64")
    type_rank = {t: i for i, t in enumerate(ordered_types(summary["attention_type"]))}
    order = summary.assign(
        _space=summary["space"].fillna(""), _alpha=summary["alpha"].fillna(-1.0),
        _level=summary["level"].map({level: i for i, level in enumerate(LEVELS)}),
        _type=summary["attention_type"].map(type_rank), _head=summary["head"].fillna(-1),
    ).sort_values(["_space", "_alpha", "_level", "_type", "layer", "_head"])
    return summary.loc[order.index, list(SUMMARY_COLUMNS)].reset_index(drop=True)


def main_rows(summary: pd.DataFrame, run: Run, level: str) -> pd.DataFrame:
    """The summary rows of one level in the run's main slice."""
    return in_slice(summary[summary["level"] == level], run.space, run.alpha)


def quantity_stats(run: Run) -> pd.DataFrame:
    """Mean, p95 and max per (type, layer) of the other measured quantities in the main slice."""
    columns = ["quantity", "attention_type", "layer", "count", "mean", "p95", "max"]
    from .data import QUANTITIES

    table = run.quantities["layer"]
    table = table[table["quantity"].isin(QUANTITIES)]
    if table.empty:
        return pd.DataFrame(columns=columns)

    order = {q: i for i, q in enumerate(QUANTITIES)}
    return table.sort_values(["quantity", "attention_type", "layer"], key=lambda c: c.map(order) if c.name == "quantity"
                             else c)[columns].reset_index(drop=True)


def headline(run: Run) -> list[dict]:
    """Per attention type in the main slice: rows, trivial rows, mean, p95, max and the share above FAR."""
    out = []
    stats = run.main_deviation("type").set_index("attention_type")
    for attention_type in run.types:
        counts = run.counts(attention_type)
        known = attention_type in stats.index and stats.loc[attention_type, "count"] > 0
        value = (lambda column: float(stats.loc[attention_type, column])) if known else (lambda column: math.nan)
        out.append(
            {
                "attention_type": attention_type,
                "rows": counts["rows"],
                "trivial": counts["trivial"],
                "non_converged": counts["non_converged"],
                "mean": value("mean"),
                "p95": value("p95"),
                "max": value("max"),
                f"share_above_{FAR:g}": value(f"share_above_{FAR:g}"),
            }
        )
    return out


def _json_value(value):
    if value is None or value is pd.NA:
        return None
    if isinstance(value, (float, np.floating)):
        return None if not np.isfinite(value) else float(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.bool_,)):
        return bool(value)
    return value


def records(frame: pd.DataFrame) -> list[dict]:
    """A frame as JSON-ready dicts (NaN and NA become null)."""
    return [{key: _json_value(value) for key, value in row.items()} for row in frame.to_dict("records")]


def summary_json(run: Run, summary: pd.DataFrame, findings: list[dict]) -> dict:
    """What ``summary.json`` holds: the same rows as ``summary.csv``, plus headline numbers and findings."""
    return {
        "model": run.name,
        "dataset": run.dataset,
        "main_slice": {"space": run.space, "alpha": run.alpha},
        "spaces": run.spaces,
        "alphas": run.alphas,
        "fidelity_passed": lookup(run.manifest, "fidelity", "passed"),
        "columns": list(SUMMARY_COLUMNS),
        "rows": records(summary),
        "headline": [{k: _json_value(v) for k, v in item.items()} for item in headline(run)],
        "quantiles": {"method": QUANTILE_METHOD, "rank_error": 0},
        "findings": findings,
        "quantities": records(quantity_stats(run)),
    }
