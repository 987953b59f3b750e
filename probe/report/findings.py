"""Findings computed from the data, never written by hand: per attention type, the token role, query
position, query token and head whose rows deviate most, each with its ratio to the rest of the type's rows,
shown only when the effect clears the noise, and merged when several describe the same rows.

A candidate compares the mean relative deviation of a group of rows with the mean over all the other
(non-trivial) rows of the same attention type in the main slice, and says which share of the type's
rows above its 95th percentile fall in the group (against the group's share of all rows).  Groups
smaller than :func:`min_rows` are not eligible, so a rare position cannot win by noise.

The noise rule (:data:`RULE`) works over examples, because the rows of one example (its heads, layers and
query tokens) are not independent: per example, the group's mean minus the rest's mean; the candidate is
shown when the normal confidence interval of the mean of those differences excludes 0 and the group's
mean is at least :data:`MIN_RATIO` times the rest's.  The candidate is the largest of ``k`` groups, so the
interval is Bonferroni's: :data:`CONFIDENCE` for all ``k`` at once (each at ``1 - 0.05 / k``).

Candidates whose groups share most of their rows (:data:`SAME_ROWS` of the smaller group's, counted over the
rows' keys) are one finding that names each description: ``token role 'special'``, ``query position 0`` and
``query token '[CLS]'`` select nearly the same rows.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pandas as pd

from probe.query import both, where
from probe.report.data import ReportRun, type_label
from probe.store.engine import literal, name

#: the groupings a finding can name, by kind: the :attr:`ReportRun.groups` frame and its keys
KINDS = {"token_role": ("token_role",), "query_position": ("query",), "token": ("token",), "head": ("layer", "head")}
GROUPS = {"token_role": "token_role", "query_position": "query", "token": "token", "head": "head"}
#: the confidence level of a finding's interval, over all the groups it was chosen from
CONFIDENCE = 0.95
#: a finding's group mean is at least this many times the rest's
MIN_RATIO = 1.1
#: the fewest examples (with rows in the group and in the rest) a confidence interval is computed over
MIN_EXAMPLES = 10
#: two candidates describe the same rows when this share of the smaller group's rows is in the other group
SAME_ROWS = 0.9
RULE = (
    "A finding is shown only when its effect clears the noise: over the examples (the rows of one example are "
    "not independent), the normal confidence interval of the mean per-example difference between the group's "
    f"mean and the rest's excludes 0 (at least {MIN_EXAMPLES} examples; {CONFIDENCE:.0%} over all the groups the "
    f"finding was chosen from, Bonferroni), and the group's mean is at least {MIN_RATIO:g}x the rest's. "
    f"Descriptions whose groups share at least {SAME_ROWS:.0%} of the smaller group's rows are one finding."
)


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
        "share_above_p95": (float(groups.loc[best, "above_p95"]) / above_total if above_total
                            and np.isfinite(groups.loc[best, "above_p95"]) else math.nan),
        "compared_groups": int(len(eligible)),
    }


def _grouped(run: ReportRun, kind: str, attention_type: str) -> tuple[pd.DataFrame, int]:
    """The groups of one kind within one attention type, in key order (rows without a key left out, as
    pandas groups them), and how many of their values lie above the 95th percentile of those values."""
    keys = list(KINDS[kind])
    frame = run.groups[GROUPS[kind]]
    frame = frame[(frame["attention_type"] == attention_type)].dropna(subset=keys)
    frame = frame.sort_values(keys).reset_index(drop=True)
    measured = run.counts(attention_type)["measured"]
    if run.aggregates is not None:  # every kept group has its key; the shares above the p95 are not kept
        return frame, 0
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


def describe(kind: str, value) -> str:
    """A group in words: ``token role 'special'``, ``query position 0``, ``query token '[CLS]'``, ``layer 2 head 1``."""
    if kind == "head":
        return f"layer {value[0]} head {value[1]}"
    return {"token_role": f"token role '{value}'", "query_position": f"query position {value}",
            "token": f"query token '{value}'"}[kind]


def _predicate(kind: str, value) -> str:
    """SQL: the rows of one group."""
    return " AND ".join(f"{name(k)} = {literal(v)}" for k, v in zip(KINDS[kind], value if kind == "head" else (value,)))


def per_example(run: ReportRun, attention_type: str, candidates: list[dict]) -> tuple[pd.DataFrame, np.ndarray]:
    """Per example of one attention type (main slice, rows with a deviation): ``n`` and ``sum`` of every row
    and ``n_i``, ``sum_i`` of candidate ``i``'s group; and the rows every two groups share (a matrix, summed
    over the examples).  One pass over the rows (a run that kept aggregates: their per-example sums,
    :meth:`probe.query.aggregates.AggregateTable.per_example`)."""
    if run.aggregates is not None:
        return run.aggregates.per_example(attention_type, [(c["kind"], tuple(c["value"]) if c["kind"] == "head"
                                                            else c["value"]) for c in candidates],
                                          {"space": run.space, "alpha": run.alpha})
    aggregates = {"n": "CAST(count(rel_deviation) AS BIGINT)", "sum": "fsum(rel_deviation)"}
    predicates = [_predicate(c["kind"], c["value"]) for c in candidates]
    for i, predicate in enumerate(predicates):
        aggregates[f"n_{i}"] = f"CAST(count(rel_deviation) FILTER (WHERE {predicate}) AS BIGINT)"
        aggregates[f"sum_{i}"] = f"coalesce(fsum(rel_deviation) FILTER (WHERE {predicate}), 0)"
        for j in range(i + 1, len(predicates)):
            aggregates[f"n_{i}_{j}"] = (f"CAST(count(rel_deviation) FILTER (WHERE ({predicate}) AND ({predicates[j]})) "
                                        "AS BIGINT)")
    (frame,) = run.table.aggregate(aggregates, [("example",)], both(run.measured_where,
                                                                    where(attention_type=attention_type)))
    shared = np.zeros((len(candidates), len(candidates)), dtype=np.int64)
    for i in range(len(candidates)):
        shared[i, i] = int(frame[f"n_{i}"].sum())
        for j in range(i + 1, len(candidates)):
            shared[i, j] = shared[j, i] = int(frame[f"n_{i}_{j}"].sum())
    return frame, shared


def z_value(groups: int) -> float:
    """The normal quantile of a two-sided interval at :data:`CONFIDENCE` for ``groups`` intervals at once
    (Bonferroni): 1.96 for one group, 2.87 for the largest of 12."""
    return NormalDist().inv_cdf(1 - (1 - CONFIDENCE) / (2 * max(1, groups)))


def noise_test(n: np.ndarray, total: np.ndarray, n_group: np.ndarray, group_sum: np.ndarray,
               groups: int = 1) -> dict:
    """The noise rule's numbers for one group, from per-example counts and sums (of every row: ``n``,
    ``total``; of the group's rows: ``n_group``, ``group_sum``): over the examples with rows in the group and
    in the rest, the mean difference of the group's mean and the rest's, its normal confidence interval at
    :data:`CONFIDENCE` for the largest of ``groups`` groups (``ci_low``, ``ci_high``; NaN with fewer than two
    such examples; ``z``: the quantile used) and how many examples it is over."""
    n, total = np.asarray(n, dtype=float), np.asarray(total, dtype=float)
    n_group, group_sum = np.asarray(n_group, dtype=float), np.asarray(group_sum, dtype=float)
    both_sides = (n_group > 0) & (n - n_group > 0)
    difference = (group_sum[both_sides] / n_group[both_sides]
                  - (total - group_sum)[both_sides] / (n - n_group)[both_sides])
    examples = int(both_sides.sum())
    z = z_value(groups)
    if examples < 2:
        return {"examples": examples, "difference": math.nan, "ci_low": math.nan, "ci_high": math.nan, "z": z}
    mean = float(difference.mean())
    half = z * float(difference.std(ddof=1)) / math.sqrt(examples)
    return {"examples": examples, "difference": mean, "ci_low": mean - half, "ci_high": mean + half, "z": z}


def clears_noise(found: dict) -> bool:
    """:data:`RULE`: the confidence interval excludes 0, enough examples, and the ratio is large enough."""
    return (found["examples"] >= MIN_EXAMPLES and np.isfinite(found["ci_low"]) and found["ci_low"] > 0
            and found["ratio"] >= MIN_RATIO)


def _candidates(run: ReportRun, attention_type: str) -> list[dict]:
    """The top group of each kind within one attention type (JSON-ready values, no noise test yet)."""
    n = run.counts(attention_type)["measured"]
    if n < 2:
        return []
    minimum = min_rows(n)
    kinds = [("token_role", minimum)] if run.has("token_role", attention_type) else []
    kinds.append(("query_position", minimum))
    if run.has("token", attention_type):
        kinds.append(("token", minimum))
    kinds.append(("head", 1))
    out = []
    for kind, needed in kinds:
        groups, above = _grouped(run, kind, attention_type)
        found = _top_group(groups, KINDS[kind], needed, above)
        if found is None:
            continue
        value = found["value"]
        found["value"] = [int(value[0]), int(value[1])] if kind == "head" else (
            int(value) if kind == "query_position" else str(value))
        found.update(kind=kind, attention_type=attention_type, name=describe(kind, found["value"]))
        if kind == "query_position" and run.has("token", attention_type) and run.aggregates is not None:
            cells = run.aggregates.query_cells({"space": run.space, "alpha": run.alpha,
                                                "attention_type": attention_type, "query": found["value"]})
            cells = cells[(cells["n"] > 0) & cells["token"].notna()]
            if len(cells):
                counted = cells.groupby("token").agg(n=("n", "sum"), first=("example", "min")).reset_index()
                counted = counted.sort_values(["n", "first", "token"], ascending=[False, True, True])
                found["most_common_token"] = str(counted["token"].iloc[0])
                found["most_common_token_share"] = float(counted["n"].iloc[0] / counted["n"].sum())
        elif kind == "query_position" and run.has("token", attention_type):
            common = run.table.frame(
                f"SELECT token, count(*) AS n, sum(count(*)) OVER () AS total FROM {run.table.relation_name} "
                f"WHERE {both(run.measured_where, where(attention_type=attention_type, query=found['value']))}"
                " AND rel_deviation IS NOT NULL AND token IS NOT NULL GROUP BY token"
                " ORDER BY n DESC, min(example), token LIMIT 1"  # ties: the token met first, as value_counts
            )
            if len(common):
                found["most_common_token"] = str(common["token"].iloc[0])
                found["most_common_token_share"] = float(common["n"].iloc[0] / common["total"].iloc[0])
        out.append(found)
    return out


def _text(found: dict) -> str:
    """A finding in one or two sentences: the group, its effect and its noise test, then its other names."""
    name = found["name"]
    same = found["same_rows"]
    token = found.get("most_common_token")
    if token is not None and not any(d["kind"] == "token" and d["value"] == token for d in same):
        name += f" (token '{token}' in {found['most_common_token_share']:.0%} of its rows)"
    if np.isfinite(found["ci_low"]):
        noise = (f"per-example difference {found['difference']:.3g}, {CONFIDENCE:.0%} CI {found['ci_low']:.3g} to "
                 f"{found['ci_high']:.3g} over {found['examples']:,} examples and {found['compared_groups']} groups")
    else:
        noise = f"{found['examples']:,} example(s) with rows in it and in the rest: too few for a confidence interval"
    above = (f", {found['share_above_p95']:.0%} of those above the 95th percentile" if np.isfinite(
        found["share_above_p95"]) else "")
    text = (
        f"{type_label(found['attention_type'])}: {name} deviates most, mean {found['mean']:.3g} against "
        f"{found['rest_mean']:.3g} for the rest ({found['ratio']:.2f}x; {noise}); "
        f"{found['share_of_rows']:.1%} of the rows{above}."
    )
    if same:
        names = [d["name"] + (" (the same rows)" if d["of_these"] >= 0.995 and d["of_its_own"] >= 0.995 else
                              f" ({d['of_these']:.0%} of these rows, {d['of_its_own']:.0%} of its own; "
                              f"{d['ratio']:.2f}x)") for d in same]
        text += " Also described as " + (names[0] if len(names) == 1 else
                                          ", ".join(names[:-1]) + " and " + names[-1]) + "."
    return text


def _merge(candidates: list[dict], shared: np.ndarray) -> list[dict]:
    """Candidates that clear the noise, merged where their groups share :data:`SAME_ROWS` of the smaller
    group's rows: the candidate with the largest ratio (ties: the first kind) names the finding, the others
    are its ``same_rows`` (each with the shares of rows in common; the most alike first).  Each candidate
    joins the first finding whose lead it overlaps."""
    # equal ratios (the same rows summed in another order differ in the last bits): the kinds' order decides
    order = sorted(range(len(candidates)), key=lambda i: (-float(f"{candidates[i]['ratio']:.12g}"), i))
    leads: list[int] = []
    members: dict[int, list[int]] = {}
    for i in order:
        for lead in leads:
            smaller = min(shared[i, i], shared[lead, lead])
            if smaller and shared[i, lead] >= SAME_ROWS * smaller:
                members[lead].append(i)
                break
        else:
            leads.append(i)
            members[i] = []
    out = []
    for lead in sorted(leads):  # the kinds' order: role, position, token, head
        found = dict(candidates[lead])
        found["same_rows"] = [
            {"kind": candidates[i]["kind"], "value": candidates[i]["value"], "name": candidates[i]["name"],
             "count": candidates[i]["count"], "mean": candidates[i]["mean"], "ratio": candidates[i]["ratio"],
             "of_these": float(shared[i, lead] / shared[lead, lead]),
             "of_its_own": float(shared[i, lead] / shared[i, i])}
            for i in sorted(members[lead], key=lambda i: (-shared[i, lead] / (shared[i, i] + shared[lead, lead]), i))]
        found["text"] = _text(found)
        out.append(found)
    return out


def analyse(run: ReportRun) -> tuple[list[dict], list[dict]]:
    """The findings of the main slice, per attention type in display order (JSON-ready dicts, merged where
    they describe the same rows), and the candidates that did not clear the noise (:data:`RULE`)."""
    shown, below = [], []
    for attention_type in run.types:
        candidates = _candidates(run, attention_type)
        if not candidates:
            continue
        frame, shared = per_example(run, attention_type, candidates)
        for i, found in enumerate(candidates):
            found.update(noise_test(frame["n"], frame["sum"], frame[f"n_{i}"], frame[f"sum_{i}"],
                                    found["compared_groups"]))
            found["clears_noise"] = clears_noise(found)
        keep = [i for i, c in enumerate(candidates) if c["clears_noise"]]
        shown += _merge([candidates[i] for i in keep], shared[np.ix_(keep, keep)])
        for found in candidates:
            if not found["clears_noise"]:
                below.append({**found, "same_rows": [], "text": _text({**found, "same_rows": []})})
    return shown, below


def findings(run: ReportRun) -> list[dict]:
    """The findings the report shows (:func:`analyse`'s first part)."""
    return analyse(run)[0]
