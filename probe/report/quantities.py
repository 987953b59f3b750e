"""Views across the run's slices and its other measured quantities:

* ``alpha``: mean and p95 of the relative deviation against alpha (log x), one line per layer, when the
  run has several alphas;
* ``spaces``: mean and p95 per layer in each parameterisation (hidden / key space), when it has both;
* ``second_order``: the paper's second-order correction against the first-order deviation;
* ``attention_tv`` and ``output_deviation``: per layer box plots of the attention's total variation
  distance from the exact solution and of the resulting deviation of the head's output.

A figure is skipped when its column is absent or entirely null (a version-1 run may lack it:
:data:`probe.store.storage.FORMAT_VERSION`).  Trivial rows are left out throughout.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

from probe.query import both, where
from probe.report.breakdowns import DENSITY_BINS, density
from probe.report.data import ReportRun, in_slice, type_label
from probe.report.style import (
    DEVIATION_LABEL,
    HIST_COLOR,
    MAX_COLOR,
    MEAN_COLOR,
    P95_COLOR,
    Drawn,
    Scale,
    layer_boxes,
    layer_colors,
    new_figure,
    suptitle,
)

QUANTITY_LABELS = {
    "attention_tv": "attention total variation ½ Σ|p* − p_att|",
    "output_deviation": "output deviation ‖Σ(p* − p_att) v‖ / ‖Σ p_att v‖",
    "second_order_deviation": "second-order deviation ‖λ* − λ₂‖ / ‖λ*‖",
}


def _present_types(run: ReportRun, stats) -> list[str]:
    return [t for t in run.types if (stats["attention_type"] == t).any()]


def alpha_figure(run: ReportRun) -> Drawn | None:
    """Mean (solid) and p95 (dashed) against alpha, one line per layer; rows: spaces, columns: types."""
    if len(run.alphas) < 2:
        return None
    measured = run.deviation["layer"]
    spaces = run.spaces or [None]
    types = _present_types(run, measured)
    figure = new_figure(max(6.5, 4.2 * len(types) + 1.0), 3.5 * len(spaces) + 1.3)
    axes = figure.subplots(len(spaces), len(types), squeeze=False, sharex=True, sharey=True)
    for i, space in enumerate(spaces):
        in_space = measured if space is None else measured[measured["space"] == space]
        for j, attention_type in enumerate(types):
            ax = axes[i, j]
            rows = in_space[in_space["attention_type"] == attention_type]
            layers = sorted(rows["layer"].unique())
            for layer, color in zip(layers, layer_colors(len(layers))):
                by_alpha = rows[rows["layer"] == layer].set_index("alpha").sort_index()
                ax.plot(by_alpha["mean"], color=color, marker=".", label=f"layer {layer}")
                ax.plot(by_alpha["p95"], color=color, linestyle="--", alpha=0.8)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(run.alphas))
            ax.xaxis.set_major_formatter(FixedFormatter([f"{a:g}" for a in run.alphas]))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_title(f"{type_label(attention_type)}" + (f" · {space} space" if space else ""))
            if i == len(spaces) - 1:
                ax.set_xlabel("α (log scale)")
            if j == 0:
                ax.set_ylabel("relative deviation")
    axes[0, 0].set_ylim(bottom=0)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="outside lower center", fontsize="small", ncol=min(len(labels), 6),
                      frameon=False)
    details = suptitle(figure, f"{run.name} · against α", "trivial rows left out", "y axis from 0, shared")
    caption = ("Mean (solid) and 95th percentile (dashed) of the relative deviation against α, per layer (log x). "
               + details)
    return Drawn("alpha", caption, figure)


def spaces_figure(run: ReportRun, scale: Scale) -> Drawn | None:
    """Mean and p95 per layer in each space (at the main alpha), one panel per attention type."""
    if len(run.spaces) < 2:
        return None
    rows = in_slice(run.deviation["layer"], None, run.alpha)
    types = _present_types(run, rows)
    figure = new_figure(max(6.5, 4.0 * len(types) + 1.0), 4.2)
    axes = figure.subplots(1, len(types), squeeze=False, sharey=True)[0]
    for ax, attention_type in zip(axes, types):
        subset = rows[rows["attention_type"] == attention_type]
        for space, color in zip(run.spaces, ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")):
            by_layer = subset[subset["space"] == space].set_index("layer").sort_index()
            ax.plot(by_layer["mean"], color=color, marker="o", label=f"{space}: mean")
            ax.plot(by_layer["p95"], color=color, marker="o", linestyle="--", label=f"{space}: p95")
        ax.set_title(type_label(attention_type))
        ax.set_xlabel("layer")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, frameon=False)
    axes[0].set_ylim(0, scale.x_max * 1.05)
    axes[0].set_ylabel(DEVIATION_LABEL)
    alpha = "" if run.alpha is None else f" · α = {run.alpha:g}"
    details = suptitle(figure, f"{run.name}{alpha} · hidden space against key space", "y axis from 0, shared")
    caption = ("Mean (solid) and 95th percentile (dashed) per layer in each parameterisation (hidden and key space). "
               + details)
    return Drawn("spaces", caption, figure)


def second_order_figure(run: ReportRun, scale: Scale) -> Drawn | None:
    """Per layer mean/p95 of the first- and second-order deviations, and the rows' joint density."""
    if not run.has("second_order_deviation"):
        return None
    quantities = run.quantities["layer"]
    second = quantities[quantities["quantity"] == "second_order_deviation"]
    first = run.main_deviation("layer")
    types = [t for t in run.types if run.counts(t)["rows"] > run.counts(t)["trivial"]]
    pairs = run.main_census.groupby("attention_type")[["pairs", "pairs_better"]].sum().join(
        run.main_census.groupby("attention_type")[["pairs_max"]].max())
    both_present = both(run.measured_where, "rel_deviation IS NOT NULL AND second_order_deviation IS NOT NULL")
    figure = new_figure(10.0, 3.6 * len(types) + 1.3)
    axes = figure.subplots(len(types), 2, squeeze=False)
    for (left, right), attention_type in zip(axes, types):
        for stats, color, name in ((first, HIST_COLOR, "first order (αz)"),
                                   (second, P95_COLOR, "second order (λ₂)")):
            by_layer = stats[stats["attention_type"] == attention_type].set_index("layer").sort_index()
            left.plot(by_layer["mean"], color=color, marker="o", label=f"{name}: mean")
            left.plot(by_layer["p95"], color=color, marker="o", linestyle="--", label=f"{name}: p95")
        left.set_ylim(0, scale.x_max * 1.05)
        left.set_xlabel("layer")
        left.set_ylabel("relative deviation")
        left.xaxis.get_major_locator().set_params(integer=True)
        left.set_title(type_label(attention_type))
        left.legend(fontsize="x-small", loc="upper left")
        if attention_type in pairs.index and pairs.loc[attention_type, "pairs"] and run.without_rows("") is None:
            n = int(pairs.loc[attention_type, "pairs"])
            top = float(pairs.loc[attention_type, "pairs_max"]) * 1.02 or 1.0
            edges = np.linspace(0, top, DENSITY_BINS + 1)
            counts = run.table.histogram2d("rel_deviation", "second_order_deviation", edges, edges,
                                           both(both_present, where(attention_type=attention_type)))
            density(right, counts, edges, edges)
            right.plot([0, top], [0, top], color=MEAN_COLOR, linewidth=1, label="equal")
            right.legend(fontsize="x-small", loc="upper left")
            better = int(pairs.loc[attention_type, "pairs_better"]) / n
            right.set_title(f"per row: second order smaller in {better:.1%} of {n:,} rows")
        elif attention_type in pairs.index and pairs.loc[attention_type, "pairs"]:
            n = int(pairs.loc[attention_type, "pairs"])
            better = int(pairs.loc[attention_type, "pairs_better"]) / n
            right.set_axis_off()
            right.text(0.5, 0.5, f"second order smaller in {better:.1%} of {n:,} rows\n(the joint density needs the "
                       "rows: --keep aggregates kept none)", ha="center", va="center", transform=right.transAxes,
                       wrap=True)
        right.set_xlabel("first-order deviation ‖λ* − αz‖ / ‖λ*‖")
        right.set_ylabel("second-order deviation")
    details = suptitle(figure, f"{run.name} · second order against first order", "trivial rows left out",
                       (run.without_rows("the joint density (right)") or run.needs_rows("the joint density (right)")
                        or ""))
    caption = ("Second-order deviation ‖λ* − λ₂‖/‖λ*‖ (the paper's second-order correction λ₂) against the "
               "first-order deviation (αz): mean and 95th percentile per layer, and the joint density of the rows "
               f"(log colour) with the diagonal. {details}")
    return Drawn("second_order", caption, figure)


def quantity_figure(run: ReportRun, column: str) -> Drawn | None:
    """Box plots per layer of ``column`` (``attention_tv`` or ``output_deviation``), one panel per type."""
    if not run.has(column):
        return None
    stats = run.quantities["layer"]
    stats = stats[stats["quantity"] == column]
    counts = run.quantities["type"]
    counts = counts[counts["quantity"] == column].set_index("attention_type")["count"]
    types = [t for t in run.types if run.counts(t)["rows"] > run.counts(t)["trivial"]]
    layers = {t: run.layers(t, measured=True) for t in types}
    widths = [max(len(layers[t]), 4) for t in types]
    figure = new_figure(min(24.0, max(6.5, 0.55 * sum(widths) + 1.0 * len(types) + 1.0)), 4.6)
    axes = figure.subplots(1, len(types), sharey=True, squeeze=False, width_ratios=widths)[0]
    maxima = {}
    for ax, attention_type in zip(axes, types):
        maxima[ax] = np.asarray(layer_boxes(ax, stats[stats["attention_type"] == attention_type],
                                            layers[attention_type]), dtype=float)
        ax.set_title(f"{type_label(attention_type)}\n{int(counts.get(attention_type, 0)):,} rows", fontsize="medium")
        ax.set_xlabel("layer")
    every = np.concatenate(list(maxima.values())) if maxima else np.zeros(0)
    top = float(np.nanmax(every)) if np.isfinite(every).any() else 0.0
    shown = stats[stats["attention_type"].isin(types)]
    bottom = log_scale(top, shown)
    limit, clipped = (top, 0) if bottom else clipped_scale(top, shown)
    axes[0].set_ylabel(QUANTITY_LABELS.get(column, column))
    scale_text = "y axis from 0, shared"
    if bottom:
        axes[0].set_yscale("log")
        axes[0].set_ylim(bottom / 1.5, top * 1.5)
        scale_text = (f"log y axis, shared: the largest maximum ({top:.3g}) is more than {CLIP_FACTOR:g} times every "
                      "upper quartile")
    else:
        axes[0].set_ylim(0, (limit or 1.0) * 1.06)
    if clipped:
        for ax, values in maxima.items():  # the maxima above the axis: a triangle on its top edge
            above = np.flatnonzero(values > limit * 1.06)
            ax.scatter(above + 1, np.full(len(above), limit * 1.06), marker="^", color=MAX_COLOR, s=22, zorder=5,
                       clip_on=False)
        scale_text = (f"y axis from 0, shared, clipped at {limit * 1.06:.3g}: the maxima of {clipped} layer(s) lie "
                      f"above it (on the top edge; the largest {top:.3g})")
    details = suptitle(figure, f"{run.name} · {QUANTITY_LABELS.get(column, column)}", scale_text,
                       "trivial rows left out")
    caption = (f"{QUANTITY_LABELS.get(column, column)} per layer (box: quartiles; whiskers: 5th–95th percentile; "
               f"diamond: mean; triangle: maximum). {details}")
    return Drawn(column, caption, figure)


#: a box plot's y axis is logarithmic (or clipped) when the largest maximum exceeds the largest upper
#: quartile this many times: a linear axis would squash every box under one extreme row
CLIP_FACTOR = 4.0


def _squashed(top: float, stats: pd.DataFrame) -> bool:
    quartiles = stats["q3"].to_numpy(dtype=float) if len(stats) else np.zeros(0)
    quartiles = quartiles[np.isfinite(quartiles)]
    return bool(quartiles.size and quartiles.max() > 0 and top > CLIP_FACTOR * quartiles.max())


def log_scale(top: float, stats: pd.DataFrame) -> float | None:
    """The bottom of a logarithmic y axis for box plots (``stats``: each box's statistics; ``top``: the largest
    maximum) that a linear axis would squash (:data:`CLIP_FACTOR`): the smallest lower whisker; None when the
    linear axis is fine, or when a lower whisker is 0 (a log axis cannot show it)."""
    if not _squashed(top, stats):
        return None
    low = stats["whislo"].to_numpy(dtype=float)
    low = low[np.isfinite(low)]
    return float(low.min()) if low.size and low.min() > 0 else None


def clipped_scale(top: float, stats: pd.DataFrame) -> tuple[float, int]:
    """The top of a box plot's linear y axis and how many boxes' maxima lie above it: ``top`` (the largest
    maximum), unless a linear axis would squash the boxes (:data:`CLIP_FACTOR`); then twice the largest upper
    whisker (the 95th percentile side)."""
    whiskers = stats["whishi"].to_numpy(dtype=float) if len(stats) else np.zeros(0)
    whiskers = whiskers[np.isfinite(whiskers)]
    if not whiskers.size or whiskers.max() <= 0 or not _squashed(top, stats):
        return top, 0
    limit = 2.0 * float(whiskers.max())
    maxima = stats["max"].to_numpy(dtype=float)
    return limit, int((maxima > limit * 1.06).sum())
