"""The report's interventions section (runs with ``--intervene``; :mod:`probe.intervene`): what each
substitute does to the model's outputs, per attention site and for the whole model, the null beside it.

Every number is a mean over the examples of the run's ``interventions.parquet/`` records of one
``(space, alpha, substitute, site)`` (:func:`effects_table`); the figure draws that table, and
``probe compare`` puts the tables of several runs side by side (:func:`compare_table`).
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pandas as pd

from ..schema import INTERVENTION_KEY
from .style import Drawn

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


def read_interventions(run_dir: Path, manifest: dict, *, allow_damaged: bool = False) -> pd.DataFrame | None:
    """The run's intervention records (None for a run without ``--intervene``), checked like every table."""
    from ..storage import INTERVENTIONS, read_interventions as read, run_tables

    if INTERVENTIONS not in run_tables(manifest):
        return None
    return read(run_dir, allow_damaged=allow_damaged).to_pandas()


def _site_order(frame: pd.DataFrame) -> list[str]:
    """Sites in forward order (attention type as the model meets it, then layer), the whole model last."""
    per_site = frame[frame["site"] != "whole"].drop_duplicates("site")
    per_site = per_site.sort_values(["attention_type", "layer"], kind="stable")
    return list(per_site["site"]) + (["whole"] if (frame["site"] == "whole").any() else [])


def effects_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean effect per ``(space, alpha, site, substitute)`` over the examples: ``examples`` and the mean of
    each effect (LM columns only where the model has an LM head); sites in forward order, whole last."""
    columns = [c for c in EFFECTS if frame[c].notna().any()]
    grouped = frame.groupby(["space", "alpha", "site", "substitute"], sort=False)
    table = grouped[columns].mean().reset_index()
    table.insert(4, "examples", grouped.size().to_numpy())
    sites = {site: i for i, site in enumerate(_site_order(frame))}
    substitutes = {s: i for i, s in enumerate(ORDER)}
    table = table.sort_values(
        ["space", "alpha", "site", "substitute"], kind="stable",
        key=lambda c: c.map(sites) if c.name == "site" else c.map(substitutes) if c.name == "substitute" else c,
    )
    return table.reset_index(drop=True)


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


def section_html(table: pd.DataFrame, frame: pd.DataFrame, figure_html: str) -> str:
    """The page's section: what was substituted, the figure, the side-by-side tables."""
    esc = html.escape
    pooling = ", ".join(sorted(frame["pooling"].dropna().unique()))
    lm = frame["lm_head"].dropna().unique()
    effects = [e for e in ("hidden_change", "embedding_cosine", "lm_loss", "top1_agreement") if e in table.columns]
    tables = "".join(
        f"<details{' open' if i == 0 else ''}><summary>{esc(effect)}: mean per site, substitutes side by side"
        f"</summary>{side_by_side(table, effect).to_html(index=False, border=0, na_rep='', float_format=lambda v: f'{v:.4g}', classes='stats')}</details>"
        for i, effect in enumerate(effects)
    )
    return (
        '<section id="interventions"><h2>Interventions</h2>'
        f"<p>Each attention site's weights replaced by a substitute (exact: the exact posterior p*; second-order: "
        f"p(λ₂); null: a seeded random change with p*'s total variation; model: the model's own weights) and the "
        f"model run on; <code>whole</code>: every site substituted at once, solved in order. Effects on the final "
        f"hidden states (hidden_change), the pooled embedding ({esc(pooling)} pooling; embedding_cosine)"
        f"{', and the ' + esc(lm[0]) + ' LM head (lm_loss, top1_agreement)' if len(lm) else ''}; means over "
        f"{frame['example'].nunique()} examples, {len(frame):,} records in interventions.parquet (interventions.csv "
        f"holds this table).</p>{figure_html}{tables}</section>"
    )


def compare_table(frames: list[pd.DataFrame], labels: list[str]) -> pd.DataFrame:
    """The runs' :func:`effects_table` side by side: one row per (space, alpha, site, substitute) they share,
    each effect's mean per run (columns ``effect [label]``)."""
    tables = [effects_table(frame) for frame in frames]
    key = ["space", "alpha", "site", "substitute"]
    merged = None
    for table, label in zip(tables, labels):
        effects = [c for c in EFFECTS if c in table.columns]
        renamed = table[key + effects].rename(columns={e: f"{e} [{label}]" for e in effects})
        merged = renamed if merged is None else merged.merge(renamed, on=key, how="inner", sort=False)
    return merged


__all__ = ["INTERVENTION_KEY", "effects_table", "side_by_side", "figure", "section_html", "compare_table",
           "read_interventions"]
