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

from .data import Run, lookup, ordered_types

#: A row deviates "far" above this relative deviation (the share is a headline number).
FAR = 0.1
SUMMARY_COLUMNS = (
    "level", "space", "alpha", "attention_type", "layer", "head", "count", "trivial", "mean", "median", "p95",
    "max", f"share_above_{FAR:g}", "non_converged",
)
LEVELS = ("layer", "layer_head_averaged", "head")
SLICE_KEYS = ["space", "alpha"]


def _keyed(rows: pd.DataFrame) -> pd.DataFrame:
    """The columns statistics group by, with null space/alpha made groupable."""
    return rows.assign(
        space=rows["space"].astype(object).fillna("").astype(str),
        alpha=rows["alpha"].astype(float).fillna(-1.0),
        attention_type=rows["attention_type"].astype(str),
        non_converged=~rows["converged"],
    )


def _stats(values) -> pd.DataFrame:
    """count, mean, median, p95, max and the share above FAR of a grouped series."""
    return pd.DataFrame(
        {
            "count": values.count(),
            "mean": values.mean(),
            "median": values.median(),
            "p95": values.quantile(0.95),
            "max": values.max(),
            f"share_above_{FAR:g}": values.apply(lambda v: float((v.dropna() > FAR).mean()) if v.count() else math.nan),
        }
    )


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """The summary table over every slice of ``rows`` (see the module docstring for the levels)."""
    if rows.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    rows = _keyed(rows)
    measured = rows[~rows["trivial"]]
    levels = []
    for level in LEVELS:
        keys = SLICE_KEYS + ["attention_type", "layer"] + (["head"] if level == "head" else [])
        if level == "layer_head_averaged":
            averaged = measured.groupby(keys + ["example", "query"], sort=False)["rel_deviation"].mean()
            stats = _stats(averaged.groupby(level=keys))
            trivial = rows[rows["trivial"]].drop_duplicates(keys + ["example", "query"]).groupby(keys).size()
        else:
            stats = _stats(measured.groupby(keys)["rel_deviation"])
            trivial = rows[rows["trivial"]].groupby(keys).size()
        everything = rows.groupby(keys)
        stats = stats.reindex(everything.size().index)
        stats["count"] = stats["count"].fillna(0).astype(int)
        stats["trivial"] = trivial.reindex(stats.index, fill_value=0).astype(int)
        stats["non_converged"] = everything["non_converged"].sum().astype(int)
        levels.append(stats.reset_index().assign(level=level))
    summary = pd.concat(levels, ignore_index=True)
    summary["space"] = summary["space"].replace("", None)
    summary["alpha"] = summary["alpha"].where(summary["alpha"] >= 0)
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
    keep = summary["level"] == level
    if run.space is not None:
        keep &= summary["space"] == run.space
    if run.alpha is not None:
        keep &= np.isclose(summary["alpha"].astype(float), run.alpha)
    return summary[keep]


def quantity_stats(run: Run, columns=("second_order_deviation", "attention_tv", "output_deviation")) -> pd.DataFrame:
    """Mean, p95 and max per (type, layer) of the other measured quantities in the main slice."""
    frames = []
    measured = run.measured.assign(attention_type=run.measured["attention_type"].astype(str))
    for column in columns:
        if not run.has(column, measured):
            continue
        values = measured.groupby(["attention_type", "layer"])[column]
        frames.append(
            pd.DataFrame({"count": values.count(), "mean": values.mean(), "p95": values.quantile(0.95),
                          "max": values.max()}).reset_index().assign(quantity=column)
        )
    if not frames:
        return pd.DataFrame(columns=["quantity", "attention_type", "layer", "count", "mean", "p95", "max"])
    return pd.concat(frames, ignore_index=True)[["quantity", "attention_type", "layer", "count", "mean", "p95", "max"]]


def headline(run: Run) -> list[dict]:
    """Per attention type in the main slice: rows, trivial rows, mean, p95, max and the share above FAR."""
    out = []
    main = run.main
    for attention_type in run.types:
        subset = main[main["attention_type"] == attention_type]
        values = subset.loc[~subset["trivial"], "rel_deviation"].dropna()
        out.append(
            {
                "attention_type": attention_type,
                "rows": int(len(subset)),
                "trivial": int(subset["trivial"].sum()),
                "non_converged": int((~subset["converged"]).sum()),
                "mean": float(values.mean()) if len(values) else math.nan,
                "p95": float(values.quantile(0.95)) if len(values) else math.nan,
                "max": float(values.max()) if len(values) else math.nan,
                f"share_above_{FAR:g}": float((values > FAR).mean()) if len(values) else math.nan,
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
        "findings": findings,
        "quantities": records(quantity_stats(run)),
    }
