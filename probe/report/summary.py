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

from probe.report.data import (
    FAR,
    LEVEL_KEYS,
    ReportRun,
    in_slice,
    lookup,
    ordered_types,
    type_label,
)

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


def summarize(run: ReportRun) -> pd.DataFrame:
    """The summary table over every slice of the run (see the module docstring for the levels)."""
    census = run.census
    if not len(census) or not census["rows"].sum():
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    levels = []
    for level in LEVELS:
        keys = list(LEVEL_KEYS["head" if level == "head" else "layer"])
        if level == "layer_head_averaged":
            stats = run.averaged["layer"]
            trivial = run.averaged_trivial(keys)
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


def main_rows(summary: pd.DataFrame, run: ReportRun, level: str) -> pd.DataFrame:
    """The summary rows of one level in the run's main slice."""
    return in_slice(summary[summary["level"] == level], run.space, run.alpha)


def quantity_stats(run: ReportRun) -> pd.DataFrame:
    """Mean, p95 and max per (type, layer) of the other measured quantities in the main slice."""
    columns = ["quantity", "attention_type", "layer", "count", "mean", "p95", "max"]
    from probe.report.data import QUANTITIES

    table = run.quantities["layer"]
    table = table[table["quantity"].isin(QUANTITIES)]
    if table.empty:
        return pd.DataFrame(columns=columns)

    order = {q: i for i, q in enumerate(QUANTITIES)}
    return table.sort_values(["quantity", "attention_type", "layer"], key=lambda c: c.map(order) if c.name == "quantity"
                             else c)[columns].reset_index(drop=True)


def headline(run: ReportRun) -> list[dict]:
    """Per attention type in the main slice: rows, trivial rows, mean, p95, max and the share above FAR."""
    out = []
    stats = run.main_deviation("type").set_index("attention_type")
    for attention_type in run.types:
        counts = run.counts(attention_type)
        known = attention_type in stats.index and stats.loc[attention_type, "count"] > 0
        value = (lambda column, row=stats.loc[attention_type]: float(row[column])) if known else (lambda column: math.nan)
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


def scale_words(item: dict, control: dict | None = None) -> str:
    """What one attention type's numbers mean, in words (``item``: one entry of :func:`headline`; ``control``:
    the control run's entry for the same type).  The relative deviation ``||lambda* - alpha z|| / ||lambda*||``
    is 0 exactly when attention is the closed form of the posterior (``lambda* = alpha z``); a value ``r`` says
    that the exact ``lambda*`` lies ``100 r`` percent of its own length away from ``alpha z``."""
    mean, p95 = item["mean"], item["p95"]
    if not (np.isfinite(mean) and np.isfinite(p95)):
        return f"{type_label(item['attention_type'])}: no non-trivial rows."
    text = (f"{type_label(item['attention_type'])}: on average the exact λ* lies {mean:.1%} of its length away "
            f"from αz (mean {mean:.3f}); one row in twenty lies more than {p95:.1%} away (p95 {p95:.3f})")
    if control is not None and np.isfinite(control.get("mean", math.nan)):
        text += f"; in the control run {control['mean']:.1%} on average (mean {control['mean']:.3f})"
        if control["mean"] > 0:
            text += f", so this run's mean is {mean / control['mean']:.2f}x the control's"
    return text + "."


def control_headline(run: ReportRun, control_dir) -> dict:
    """The control run's headline numbers (a random-initialisation run of the same model, say) in ``run``'s
    main slice: ``run_dir``, ``model``, ``by_type`` (attention type -> :func:`headline` entry) and ``note``
    (why some numbers are missing, or None).  ``control_dir``: the control's run directory."""
    from dataclasses import replace

    from probe.report.data import read_run

    control = read_run(control_dir)
    try:
        note = None
        slices = control.census[["space", "alpha"]].drop_duplicates()
        if len(in_slice(slices, run.space, run.alpha)):
            control = replace(control, space=run.space, alpha=run.alpha, memo={})
        else:
            note = (f"The control run has no rows in this run's slice ({run.slice_text}); its numbers are from its "
                    f"own main slice ({control.slice_text}).")
        by_type = {item["attention_type"]: item for item in headline(control) if item["attention_type"] in run.types}
        missing = [type_label(t) for t in run.types if t not in by_type]
        if missing:
            note = (note + " " if note else "") + f"The control run has no {', '.join(missing)} rows."
        return {"run_dir": control.run_dir.name, "model": control.name, "by_type": by_type, "note": note}
    finally:
        control.table.close()


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


def _json_ready(value):
    """Findings as JSON: NaN and infinities become null, numpy scalars Python numbers, at any depth."""
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(item) for item in value]
    return _json_value(value)


def summary_json(run: ReportRun, summary: pd.DataFrame, findings: list[dict], below_noise: list[dict] = (),
                 control: dict | None = None) -> dict:
    """What ``summary.json`` holds: the same rows as ``summary.csv``, plus headline numbers with their meaning
    in words (and the control run's, :func:`control_headline`), the findings, the rule that decides which are
    shown and the candidates that did not clear it."""
    from probe.report.findings import RULE

    return {
        "model": run.name,
        "dataset": run.dataset,
        "main_slice": {"space": run.space, "alpha": run.alpha},
        "spaces": run.spaces,
        "alphas": run.alphas,
        "fidelity_passed": lookup(run.manifest, "fidelity", "passed"),
        "columns": list(SUMMARY_COLUMNS),
        "rows": records(summary),
        "headline": [{**{k: _json_value(v) for k, v in item.items()},
                      "in_words": scale_words(item, (control or {}).get("by_type", {}).get(item["attention_type"]))}
                     for item in headline(run)],
        "control": _json_ready(control),
        "quantiles": {"method": run.quantile_method, "rank_error": run.rank_error},
        "kept": run.kept,
        "findings": _json_ready(findings),
        "findings_rule": RULE,
        "findings_below_noise": _json_ready(list(below_noise)),
        "quantities": records(quantity_stats(run)),
    }
