"""Breakdowns of the relative deviation by what might drive it: the query token's role, the query
position (a layer x position heatmap), and the row's number of keys, attention entropy and ``||alpha z||``.

Every figure here is over the non-trivial rows of the main slice and uses the report's shared scales.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm

from .data import Run, type_label
from .style import (
    CMAP, DEVIATION_LABEL, MEAN_COLOR, P95_COLOR, Drawn, Scale, file_stem, new_figure, suptitle,
)

#: A (layer, position) cell of the position heatmap needs this many rows, or it is left blank.
MIN_POSITION_ROWS = 20
ROLE_COLORS = {"special": "#d62728", "first": "#9467bd", "word": "#1f77b4"}
#: The drivers against which the deviation is drawn: column -> axis label.
DRIVERS = {
    "n_keys": "number of keys n",
    "attention_entropy": "attention entropy −Σ p log p (nats)",
    "evidence_norm": "‖αz‖ (the approximation's λ)",
}


def position_grid(rows: pd.DataFrame) -> pd.DataFrame:
    """Mean deviation per (layer, query position), NaN where a cell has fewer than MIN_POSITION_ROWS rows."""
    grouped = rows.groupby(["layer", "query"])["rel_deviation"]
    means = grouped.mean().where(grouped.count() >= MIN_POSITION_ROWS)
    grid = means.unstack("query").sort_index()
    keep = grid.columns[grid.notna().any(axis=0)]
    return grid.loc[:, keep.min() : keep.max()] if len(keep) else grid.iloc[:, :0]


def roles_figure(run: Run, scale: Scale) -> Drawn | None:
    """Mean and p95 per layer for each token role, one panel per attention type (needs ``token_role``)."""
    measured = run.measured
    if not run.has("token_role", measured):
        return None
    types = [t for t in run.types if (measured["attention_type"] == t).any()]
    figure = new_figure(max(6.5, 3.6 * len(types) + 0.8), 4.3)
    axes = figure.subplots(1, len(types), squeeze=False, sharey=True)[0]
    for ax, attention_type in zip(axes, types):
        rows = measured[measured["attention_type"] == attention_type]
        for role, group in rows.groupby(rows["token_role"].astype(object), sort=True):
            by_layer = group.groupby("layer")["rel_deviation"]
            color = ROLE_COLORS.get(role, "#7f7f7f")
            share = len(group) / len(rows)
            ax.plot(by_layer.mean(), marker="o", color=color, label=f"{role} ({share:.1%} of rows): mean")
            ax.plot(by_layer.quantile(0.95), marker="o", linestyle="--", color=color, alpha=0.7,
                    label=f"{role}: p95")
        ax.set_title(f"{type_label(attention_type)}\n{len(rows):,} rows")
        ax.set_xlabel("layer")
        ax.set_ylim(0, scale.x_max * 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, frameon=False)
    axes[0].set_ylabel(DEVIATION_LABEL)
    suptitle(figure, f"{run.title} · by the query token's role",
             "solid: mean · dashed: 95th percentile · trivial rows left out · y axis from 0, shared")
    caption = (
        "Relative deviation per layer for each query token role (special: the tokenizer's special tokens; first: "
        "the first decoder position; word: every other token); solid lines mean, dashed 95th percentile."
    )
    return Drawn("roles", caption, figure)


def positions_figure(run: Run, attention_type: str, scale: Scale) -> Drawn | None:
    """Layer x query position heatmap of the mean deviation, on the report's shared colour scale."""
    rows = run.measured[run.measured["attention_type"] == attention_type]
    grid = position_grid(rows)
    if grid.empty:
        return None
    n_layers, n_positions = grid.shape
    figure = new_figure(min(24.0, max(6.5, 0.13 * n_positions + 2.6)), max(3.2, 0.38 * n_layers + 2.0))
    ax = figure.subplots()
    image = ax.pcolormesh(
        np.arange(n_positions + 1) - 0.5 + grid.columns[0], np.arange(n_layers + 1) - 0.5 + grid.index[0],
        np.ma.masked_invalid(grid.to_numpy(dtype=float)), cmap=CMAP, vmin=0, vmax=scale.color_max,
    )
    ax.set_facecolor("#e0e0e0")
    ax.grid(False)
    ax.invert_yaxis()
    ax.set_xlabel("query position (0 = first token)")
    ax.set_ylabel("layer")
    ax.yaxis.get_major_locator().set_params(integer=True)
    figure.colorbar(image, ax=ax, label="mean relative deviation", shrink=0.9)
    suptitle(
        figure, f"{run.title} · {type_label(attention_type)} · by query position",
        f"mean per layer and query position · grey: fewer than {MIN_POSITION_ROWS} rows · {scale.color_text}",
    )
    caption = (
        f"{type_label(attention_type)}: mean relative deviation per layer and query position (trivial rows left "
        f"out; cells with fewer than {MIN_POSITION_ROWS} rows blank); colour scale shared with the head heatmaps."
    )
    return Drawn(f"positions_{file_stem(attention_type)}", caption, figure, attention_type, wide=n_positions > 60)


def _driver_bins(values: pd.Series) -> pd.Series:
    """Bin labels for a driver: its own values when few and integral, else up to 20 quantile bins."""
    unique = values.dropna().unique()
    if len(unique) <= 40 and np.allclose(unique, np.round(unique)):
        return values
    return pd.qcut(values, 20, duplicates="drop").map(lambda interval: interval.mid).astype(float)


def drivers_figure(run: Run, attention_type: str, scale: Scale) -> Drawn | None:
    """Deviation against n_keys, attention entropy and ||alpha z||: a 2-D histogram of the rows with the
    binned mean and 95th percentile, and Spearman's rank correlation in the panel title."""
    rows = run.measured[run.measured["attention_type"] == attention_type]
    drivers = [column for column in DRIVERS if run.has(column, rows) and rows[column].nunique() > 1]
    if not drivers or len(rows) < 2:
        return None
    figure = new_figure(max(6.5, 4.0 * len(drivers) + 0.6), 4.2)
    axes = figure.subplots(1, len(drivers), squeeze=False, sharey=True)[0]
    deviation = rows["rel_deviation"].astype(float)
    for ax, column in zip(axes, drivers):
        driver = rows[column].astype(float)
        ok = driver.notna() & deviation.notna()
        x, y = driver[ok].to_numpy(), deviation[ok].to_numpy()
        if x.size and np.ptp(x) > 0:
            ax.hist2d(x, y, bins=[60, 60], range=[[x.min(), x.max()], [0, scale.x_max * 1.05]],
                      cmap="Greys", norm=LogNorm(), rasterized=True)
        binned = pd.DataFrame({"bin": _driver_bins(driver[ok]), "y": y}).groupby("bin")["y"]
        ax.plot(binned.mean(), color=MEAN_COLOR, marker=".", label="mean")
        ax.plot(binned.quantile(0.95), color=P95_COLOR, marker=".", label="95th percentile")
        rho = pd.Series(x).corr(pd.Series(y), method="spearman") if x.size > 2 and np.ptp(y) > 0 else math.nan
        ax.set_title(f"against {column}\nSpearman ρ = {rho:.2f} over {x.size:,} rows")
        ax.set_xlabel(DRIVERS[column])
        ax.set_ylim(0, scale.x_max * 1.05)
        ax.legend(fontsize="x-small", loc="upper right")
    axes[0].set_ylabel(DEVIATION_LABEL)
    suptitle(figure, f"{run.title} · {type_label(attention_type)} · against likely drivers",
             "grey: rows (log density) · red: binned mean · orange: binned p95 · y axis from 0, shared")
    caption = (
        f"{type_label(attention_type)}: relative deviation against the number of keys, the attention entropy of "
        "the row and ‖αz‖ (where present): density of rows, binned mean and 95th percentile, Spearman's ρ."
    )
    return Drawn(f"drivers_{file_stem(attention_type)}", caption, figure, attention_type)
