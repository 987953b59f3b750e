"""The report's interventions section (runs with ``--intervene``; :mod:`probe.interventions`): what each
substitute does to the model's outputs, per attention site and for the whole model, the null beside it.

Every number is a mean over the examples of the run's ``interventions.parquet/`` records of one
``(space, alpha, substitute, site)`` (:func:`effects_table`); the figure draws that table, and
``probe compare`` puts the tables of several runs side by side (:func:`compare_table`).
"""

from __future__ import annotations

import html
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from probe.core.schema import INTERVENTION_KEY, INTERVENTION_SCHEMA
from probe.query import Table
from probe.report.style import Drawn
from probe.store.engine import connect, name, parquet_source

#: the effects shown, with how the table names their means
EFFECTS = {
    "hidden_change": "hidden_change",
    "embedding_cosine": "embedding_cosine",
    "lm_loss_original": "lm_loss_original",
    "lm_loss": "lm_loss",
    "top1_agreement": "top1_agreement",
}
#: display order of the substitutes (the null beside what it controls; the identity last)
ORDER = ("exact", "second-order", "null", "model")


def _records(source: str) -> str:
    """The intervention records of ``source`` with NaN read as null (as pandas skips it)."""
    columns = []
    for field in INTERVENTION_SCHEMA:
        column = name(field.name)
        columns.append(f"CASE WHEN isnan({column}) THEN NULL ELSE {column} END AS {column}"
                       if str(field.type) == "double" else column)
    return f"(SELECT {', '.join(columns)} FROM {source})"


def open_interventions(run_dir: Path, manifest: dict, *, allow_damaged: bool = False, connection=None) -> Table | None:
    """The run's intervention records as a query (None for a run without ``--intervene`` or without records
    yet), checked like every table (:func:`probe.store.integrity.require_intact`)."""
    from probe.store.integrity import DamagedRunWarning, require_intact
    from probe.store.storage import INTERVENTIONS, run_tables

    if INTERVENTIONS not in run_tables(manifest):
        return None
    check = require_intact(run_dir, manifest, allow_damaged=allow_damaged, table=INTERVENTIONS)
    if check.damaged:
        warnings.warn(check.banner(), DamagedRunWarning, stacklevel=2)
    files = sorted(check.readable.values())
    if not files:
        return None
    return Table(connection if connection is not None else connect(), _records(parquet_source(files)),
                 Path(run_dir) / INTERVENTIONS)


def effects(records: Table) -> tuple[pd.DataFrame, dict]:
    """Mean effect per ``(space, alpha, site, substitute)`` over the examples of the intervention
    ``records``: ``examples`` and the mean of each effect (LM columns only where the model has an LM head);
    sites in forward order (attention type as the model meets it, then layer), the whole model last.  And
    the facts the section states: ``pooling`` and ``lm_heads`` (the distinct values), ``examples``,
    ``records``."""
    source = records.relation_name
    present = records.frame(f"SELECT {', '.join(f'count({name(c)}) AS {name(c)}' for c in EFFECTS)} FROM {source}")
    columns = [c for c in EFFECTS if int(present[c].iloc[0]) > 0]
    means = "".join(f", avg({name(c)}) AS {name(c)}" for c in columns)
    table = records.frame(
        f"SELECT space, alpha, site, substitute, CAST(count(*) AS BIGINT) AS examples{means} FROM {source} GROUP BY ALL"
    )
    sites = records.frame(
        f"SELECT site FROM {source} WHERE site <> 'whole' GROUP BY site ORDER BY min(attention_type), min(layer), site"
    )["site"].tolist() + ["whole"]
    order = {site: i for i, site in enumerate(sites)}
    substitutes = {s: i for i, s in enumerate(ORDER)}
    table = table.sort_values(
        ["space", "alpha", "site", "substitute"], kind="stable",
        key=lambda c: c.map(order) if c.name == "site" else c.map(substitutes) if c.name == "substitute" else c,
    ).reset_index(drop=True)
    facts = records.frame(
        f"SELECT list(DISTINCT pooling ORDER BY pooling) FILTER (WHERE pooling IS NOT NULL) AS pooling, "
        f"list(DISTINCT lm_head ORDER BY lm_head) FILTER (WHERE lm_head IS NOT NULL) AS lm_heads, "
        f"CAST(count(DISTINCT example) AS BIGINT) AS examples, CAST(count(*) AS BIGINT) AS records FROM {source}"
    ).iloc[0].to_dict()
    facts = {"pooling": list(facts["pooling"] if facts["pooling"] is not None else []),
             "lm_heads": list(facts["lm_heads"] if facts["lm_heads"] is not None else []),
             "examples": int(facts["examples"]), "records": int(facts["records"])}
    return table, facts


def effects_table(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`effects` of intervention records given as a DataFrame (``probe.Run.interventions``)."""
    import pyarrow as pa

    connection = connect()
    try:
        records = pa.Table.from_pandas(frame[list(INTERVENTION_SCHEMA.names)], schema=INTERVENTION_SCHEMA,
                                       preserve_index=False)
        connection.register("_interventions", records)
        return effects(Table(connection, _records("_interventions")))[0]
    finally:
        connection.close()


def side_by_side(table: pd.DataFrame, effect: str) -> pd.DataFrame:
    """One effect of :func:`effects_table` with a column per substitute (rows: space, alpha, site)."""
    wide = table.pivot_table(index=["space", "alpha", "site"], columns="substitute", values=effect, sort=False)
    wide = wide[[s for s in ORDER if s in wide.columns]]
    wide.columns = [f"{effect} [{s}]" for s in wide.columns]
    return wide.reset_index()


def figure(table: pd.DataFrame, title: str) -> Drawn:
    """Mean hidden change (log scale) and 1 - embedding cosine (or the LM loss increase, with an LM head)
    per site and for the whole model, one marker series per substitute, for the table's first slice."""
    import matplotlib.pyplot as plt

    space, alpha = table.iloc[0]["space"], table.iloc[0]["alpha"]
    table = table[(table["space"] == space) & (table["alpha"] == alpha)]
    sites = list(dict.fromkeys(table["site"]))
    lm = "lm_loss" in table.columns and table["lm_loss"].notna().any()
    panels = [("hidden_change", "mean ‖h′ − h‖ / ‖h‖")]
    panels.append(("lm_loss_increase", "mean LM loss increase (nats)") if lm
                  else ("cosine_gap", "mean 1 − embedding cosine"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), constrained_layout=True)
    x = np.arange(len(sites))
    substitutes = [s for s in ORDER if s in set(table["substitute"])]
    for ax, (column, label) in zip(axes, panels):
        for i, substitute in enumerate(substitutes):
            part = table[table["substitute"] == substitute].set_index("site").reindex(sites)
            if column == "cosine_gap":
                values = 1 - part["embedding_cosine"]
            elif column == "lm_loss_increase":
                values = part["lm_loss"] - part["lm_loss_original"]
            else:
                values = part[column]
            values = values.to_numpy(dtype=float)
            offset = (i - (len(substitutes) - 1) / 2) * 0.12
            ax.plot(x + offset, values, "o", label=substitute, markersize=5)
        if column != "lm_loss_increase":
            ax.set_yscale("log")
        ax.set_xticks(x, sites, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.axvline(len(sites) - 1.5, color="#999", lw=0.6, ls=":") if "whole" in sites else None
    axes[0].legend(fontsize=8, frameon=False)
    fig.suptitle(f"{title} · {space} space, alpha {alpha:g}: each site substituted alone, and all at once (whole)",
                 fontsize=10)
    return Drawn("interventions", "Interventions: the effect of each substitute on the model's outputs per "
                 "attention site and for the whole model (means over the examples; null: a random change of the "
                 "exact posterior's total variation).", fig, wide=True)


def section_html(table: pd.DataFrame, facts: dict, figure_html: str) -> str:
    """The page's section: what was substituted, the figure, the side-by-side tables (``facts``: as
    :func:`effects` returns them)."""
    esc = html.escape
    pooling = ", ".join(facts["pooling"])
    lm = facts["lm_heads"]
    shown = [e for e in ("hidden_change", "embedding_cosine", "lm_loss", "top1_agreement") if e in table.columns]
    tables = "".join(
        f"<details{' open' if i == 0 else ''}><summary>{esc(effect)}: mean per site, substitutes side by side"
        f"</summary>{side_by_side(table, effect).to_html(index=False, border=0, na_rep='', float_format=lambda v: f'{v:.4g}', classes='stats')}</details>"
        for i, effect in enumerate(shown)
    )
    return (
        '<section id="interventions"><h2>Interventions</h2>'
        f"<p>Each attention site's weights replaced by a substitute (exact: the exact posterior p*; second-order: "
        f"p(λ₂); null: a seeded random change with p*'s total variation; model: the model's own weights) and the "
        f"model run on; <code>whole</code>: every site substituted at once, solved in order. Effects on the final "
        f"hidden states (hidden_change), the pooled embedding ({esc(pooling)} pooling; embedding_cosine)"
        f"{', and the ' + esc(lm[0]) + ' LM head (lm_loss, top1_agreement)' if len(lm) else ''}; means over "
        f"{facts['examples']} examples, {facts['records']:,} records in interventions.parquet (interventions.csv "
        f"holds this table).</p>{figure_html}{tables}</section>"
    )


def compare_effects(tables: list[pd.DataFrame], labels: list[str]) -> pd.DataFrame:
    """Effects tables (:func:`effects`) side by side: one row per (space, alpha, site, substitute) they share,
    each effect's mean per run (columns ``effect [label]``)."""
    key = ["space", "alpha", "site", "substitute"]
    merged = None
    for table, label in zip(tables, labels):
        shown = [c for c in EFFECTS if c in table.columns]
        renamed = table[key + shown].rename(columns={e: f"{e} [{label}]" for e in shown})
        merged = renamed if merged is None else merged.merge(renamed, on=key, how="inner", sort=False)
    return merged


def compare_table(frames: list[pd.DataFrame], labels: list[str]) -> pd.DataFrame:
    """The runs' :func:`effects_table` side by side (records given as DataFrames; :func:`compare_effects`)."""
    return compare_effects([effects_table(frame) for frame in frames], labels)


__all__ = ["INTERVENTION_KEY", "effects", "effects_table", "side_by_side", "figure", "section_html",
           "compare_effects", "compare_table", "open_interventions"]
