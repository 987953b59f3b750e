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

from .data import Run, type_label


HEAD_KEY = 1_000_000  # (layer, head) as one integer: layer * HEAD_KEY + head


def min_rows(n: int) -> int:
    """The fewest rows a group needs to be named: 0.5% of the type's rows, at least 20."""
    return max(20, math.ceil(0.005 * n))


def _top_group(values: pd.Series, keys: pd.Series, minimum: int) -> dict | None:
    """The eligible group with the largest mean, compared with the rest; None when fewer than two groups."""
    frame = pd.DataFrame({"value": values.to_numpy(), "key": keys.to_numpy()}).dropna()
    grouped = frame.groupby("key", observed=True)["value"]
    sizes, sums, means = grouped.size(), grouped.sum(), grouped.mean()
    eligible = means[sizes >= minimum]
    if len(sizes) < 2 or eligible.empty:
        return None
    key = eligible.idxmax()
    total_n, total_sum = int(sizes.sum()), float(sums.sum())
    rest_n = total_n - int(sizes[key])
    if rest_n == 0:
        return None
    rest_mean = (total_sum - float(sums[key])) / rest_n
    p95 = frame["value"].quantile(0.95)
    above = frame[frame["value"] > p95]
    return {
        "value": key,
        "count": int(sizes[key]),
        "mean": float(means[key]),
        "rest_mean": rest_mean,
        "ratio": float(means[key]) / rest_mean if rest_mean > 0 else math.inf,
        "share_of_rows": int(sizes[key]) / total_n,
        "share_above_p95": float((above["key"] == key).mean()) if len(above) else math.nan,
    }


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
    measured = run.measured
    for attention_type in run.types:
        rows = measured[measured["attention_type"] == attention_type]
        rows = rows[rows["rel_deviation"].notna()]
        if len(rows) < 2:
            continue
        minimum = min_rows(len(rows))
        values = rows["rel_deviation"]
        candidates = []
        if run.has("token_role", rows):
            candidates.append(("token_role", _top_group(values, rows["token_role"].astype(object), minimum)))
        candidates.append(("query_position", _top_group(values, rows["query"], minimum)))
        if run.has("token", rows):
            candidates.append(("token", _top_group(values, rows["token"].astype(object), minimum)))
        heads = rows["layer"].astype("int64") * HEAD_KEY + rows["head"].astype("int64")
        candidates.append(("head", _top_group(values, heads, 1)))
        for kind, found in candidates:
            if found is None:
                continue
            extra = ""
            if kind == "query_position" and run.has("token", rows):
                tokens = rows.loc[rows["query"] == found["value"], "token"].astype(object).dropna()
                if len(tokens):
                    common = tokens.value_counts()
                    found["most_common_token"] = str(common.index[0])
                    found["most_common_token_share"] = float(common.iloc[0] / len(tokens))
                    extra = f" (token '{common.index[0]}' in {common.iloc[0] / len(tokens):.0%} of its rows)"
            value = found["value"]
            found["value"] = [int(value) // HEAD_KEY, int(value) % HEAD_KEY] if kind == "head" else (
                int(value) if kind == "query_position" else str(value)
            )
            found.update(kind=kind, attention_type=attention_type, text=_describe(kind, attention_type, found, extra))
            out.append(found)
    return out
