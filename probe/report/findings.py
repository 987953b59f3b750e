"""Findings computed from the data, never written by hand: per attention type, the token role, query
position, query token and head whose rows deviate most, each with its ratio to the rest of the type's rows.

A finding compares the mean relative deviation of a group of rows with the mean over all the other
(non-trivial) rows of the same attention type in the main slice, and says which share of the type's
rows above its 95th percentile fall in the group (against the group's share of all rows).  Groups
smaller than :func:`min_rows` are not eligible, so a rare position cannot win by noise.
"""

from __future__ import annotations

import math

import pandas as pd

from ..query import both, where
from .data import Run, type_label

#: the groupings a finding can name, by kind: the :attr:`Run.groups` frame and its keys
KINDS = {"token_role": ("token_role",), "query_position": ("query",), "token": ("token",), "head": ("layer", "head")}
GROUPS = {"token_role": "token_role", "query_position": "query", "token": "token", "head": "head"}


def min_rows(n: int) -> int:
    """The fewest rows a group needs to be named: 0.5% of the type's rows, at least 20."""
    return max(20, math.ceil(0.005 * n))


def _top_group(groups: pd.DataFrame, keys, minimum: int, above_total: int) -> dict | None:
    """The eligible group with the largest mean, compared with the rest; None when fewer than two groups.

    ``groups``: one row per group with a value (``count``, ``sum``, ``above_p95``: its values above the 95th
    percentile of the type's values with a key), in key order; ``above_total``: all such values."""
    groups = groups[groups["count"] > 0]
    means = groups["sum"] / groups["count"]
    eligible = means[groups["count"] >= minimum]
    if len(groups) < 2 or eligible.empty:
        return None
    best = eligible.idxmax()
    total_n, total_sum = int(groups["count"].sum()), float(groups["sum"].sum())
    count, total = int(groups.loc[best, "count"]), float(groups.loc[best, "sum"])
    rest_n = total_n - count
    if rest_n == 0:
        return None
    rest_mean = (total_sum - total) / rest_n
    return {
        "value": tuple(groups.loc[best, list(keys)]) if len(keys) > 1 else groups.loc[best, keys[0]],
        "count": count,
        "mean": float(means[best]),
        "rest_mean": rest_mean,
        "ratio": float(means[best]) / rest_mean if rest_mean > 0 else math.inf,
        "share_of_rows": count / total_n,
        "share_above_p95": int(groups.loc[best, "above_p95"]) / above_total if above_total else math.nan,
    }


def _grouped(run: Run, kind: str, attention_type: str) -> tuple[pd.DataFrame, int]:
    """The groups of one kind within one attention type, in key order (rows without a key left out, as
    pandas groups them), and how many of their values lie above the 95th percentile of those values."""
    keys = list(KINDS[kind])
    frame = run.groups[GROUPS[kind]]
    frame = frame[(frame["attention_type"] == attention_type)].dropna(subset=keys)
    frame = frame.sort_values(keys).reset_index(drop=True)
    measured = run.counts(attention_type)["measured"]
    if int(frame["count"].sum()) != measured:  # some values lack the key: their 95th percentile differs
        with_key = both(run.measured_where, where(attention_type=attention_type),
                        " AND ".join(f"{k} IS NOT NULL" for k in keys))
        (p95,) = run.table.stats("rel_deviation", [()], with_key, quantiles={"p95": 0.95})
        threshold = float(p95["p95"].iloc[0]) if len(p95) else math.nan
        (recounted,) = run.table.aggregate({"above_p95": f"CAST(count_if(rel_deviation > {threshold!r}) AS BIGINT)"},
                                           [tuple(keys)], with_key)
        frame = frame.drop(columns="above_p95").merge(recounted, on=keys, how="left")
        frame["above_p95"] = frame["above_p95"].fillna(0)
    return frame, int(frame["above_p95"].sum())


def _describe(kind: str, attention_type: str, found: dict, extra: str = "") -> str:
    value = found["value"]
    if kind == "head":
        name = f"layer {value[0]} head {value[1]}"
    else:
        name = {"token_role": f"token role '{value}'", "query_position": f"query position {value}{extra}",
                "token": f"query token '{value}'"}[kind]
    return (
        f"{type_label(attention_type)}: {name} deviates most, mean {found['mean']:.3g} against "
        f"{found['rest_mean']:.3g} for the rest ({found['ratio']:.2f}x); {found['share_of_rows']:.1%} of the rows, "
        f"{found['share_above_p95']:.0%} of those above the 95th percentile."
    )


def findings(run: Run) -> list[dict]:
    """The findings of the main slice, per attention type in display order (JSON-ready dicts)."""
    out = []
    for attention_type in run.types:
        n = run.counts(attention_type)["measured"]
        if n < 2:
            continue
        minimum = min_rows(n)
        candidates = []
        if run.has("token_role", attention_type):
            candidates.append(("token_role", minimum))
        candidates.append(("query_position", minimum))
        if run.has("token", attention_type):
            candidates.append(("token", minimum))
        candidates.append(("head", 1))
        for kind, needed in candidates:
            groups, above = _grouped(run, kind, attention_type)
            found = _top_group(groups, KINDS[kind], needed, above)
            if found is None:
                continue
            extra = ""
            if kind == "query_position" and run.has("token", attention_type):
                common = run.table.frame(
                    f"SELECT token, count(*) AS n, sum(count(*)) OVER () AS total FROM {run.table.relation_name} "
                    f"WHERE {both(run.measured_where, where(attention_type=attention_type, query=int(found['value'])))}"
                    " AND rel_deviation IS NOT NULL AND token IS NOT NULL GROUP BY token"
                    " ORDER BY n DESC, min(example), token LIMIT 1"  # ties: the token met first, as value_counts
                )
                if len(common):
                    token, share = str(common["token"].iloc[0]), float(common["n"].iloc[0] / common["total"].iloc[0])
                    found["most_common_token"] = token
                    found["most_common_token_share"] = share
                    extra = f" (token '{token}' in {share:.0%} of its rows)"
            value = found["value"]
            found["value"] = [int(value[0]), int(value[1])] if kind == "head" else (
                int(value) if kind == "query_position" else str(value)
            )
            found.update(kind=kind, attention_type=attention_type, text=_describe(kind, attention_type, found, extra))
            out.append(found)
    return out
