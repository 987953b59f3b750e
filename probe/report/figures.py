"""The deviation figures of one run (the paper's Figs 4 to 8 in form), on shared scales:

* ``overview``: box plots per layer for every attention type side by side (quartiles, 5th-95th
  percentile whiskers, the mean and the maximum marked; y axis from 0, shared);
* ``layers_<type>``: one histogram per layer of the head-averaged deviation of each (example, query),
  then every layer on a log y axis and every layer's ECDF;
* ``heads_<type>``: a layers x heads grid of per-head histograms on a shared log y axis, the figure
  growing with the grid;
* ``heatmap_mean_<type>`` / ``heatmap_p95_<type>``: layer x head heatmaps on one colour scale shared
  by every heatmap of the report.

Trivial rows (one key) are left out of every panel and counted in the titles.
"""

from __future__ import annotations

import math

import matplotlib as mpl
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FixedLocator, LogLocator, MaxNLocator, NullFormatter

from probe.report.breakdowns import position_grid
from probe.report.data import ReportRun, in_slice, type_label
from probe.report.style import (
    CMAP,
    DEVIATION_LABEL,
    ECDF_BINS,
    Drawn,
    Scale,
    caption_sentence,
    counts_on,
    draw_counts,
    ecdf,
    file_stem,
    layer_boxes,
    layer_colors,
    mark_mean_max,
    new_figure,
    shared_edges,
    stats_line,
    suptitle,
    wrap,
)

#: Heatmaps get a number in every cell up to this many heads and cells.
ANNOTATE_MAX_HEADS = 16
ANNOTATE_MAX_CELLS = 400


def report_scale(run: ReportRun, head_stats: pd.DataFrame) -> Scale:
    """The report's shared x range, bins and colour range, from the main slice's non-trivial rows.

    ``head_stats`` is the summary's head level in the main slice (its means and p95s are heatmap cells).
    The bins come from exact quantiles (:attr:`ReportRun.deviation`, :attr:`ReportRun.averaged`), never from the rows.
    """
    pooled = run.main_deviation("slice")
    finite_max = pooled["max"].to_numpy(dtype=float)
    finite_max = finite_max[np.isfinite(finite_max)]
    x_max = float(finite_max.max()) if finite_max.size else 1.0
    x_max = x_max if x_max > 0 else 1.0
    averaged = in_slice(run.averaged["layer"], run.space, run.alpha)
    averaged = averaged[averaged["attention_type"].isin(run.types)]
    heads = run.main_deviation("head")
    pooled_averaged = in_slice(run.averaged["slice"], run.space, run.alpha)
    first = lambda frame: frame.iloc[0].to_dict() if len(frame) else {"count": 0}  # noqa: E731
    averaged_panels = averaged.to_dict("records")
    head_panels = heads.to_dict("records")
    edges = shared_edges(first(pooled_averaged) if averaged_panels else first(pooled), averaged_panels, x_max,
                         n=int(np.median([p["count"] for p in averaged_panels] or [1])))
    head_edges = shared_edges(first(pooled), head_panels, x_max,
                              n=int(np.median([p["count"] for p in head_panels] or [1])))
    notes = []
    if run.aggregates is not None:  # the aggregates' fixed bins, joined: every bin a whole number of them
        edges, head_edges = fixed_edges(edges, x_max), fixed_edges(head_edges, x_max)
        notes.append(FIXED_BINS_NOTE)
    color_values = [head_stats["mean"], head_stats["p95"]]
    for attention_type in run.types:
        color_values.append(position_grid(run, attention_type).stack())
    colors = pd.concat([pd.Series(v, dtype=float) for v in color_values]).dropna()
    color_max = float(colors.max()) if len(colors) and colors.max() > 0 else x_max
    return Scale(x_max=x_max, edges=edges, head_edges=head_edges, color_max=color_max, notes=notes)


#: what the figures of a run that kept aggregates say of their bins
FIXED_BINS_NOTE = ("bins: the aggregates' fixed bins of width 1/1024, joined in powers of two to about the "
                   "Freedman–Diaconis width of the run's quartiles (the run kept no rows to bin afresh)")


def fixed_edges(edges: np.ndarray, x_max: float) -> np.ndarray:
    """Edges like ``edges`` (0 to at least ``x_max``), whose width is the aggregates' fine width (1/1024) times the
    power of two nearest the width of ``edges``: each bin joins whole fine bins, so the counts are exact (below 4)."""
    from probe.store.aggregates import LINEAR_SCALE

    width = float(edges[1] - edges[0]) if len(edges) > 1 else 1.0 / LINEAR_SCALE
    width = 2.0 ** round(math.log2(max(width * LINEAR_SCALE, 1.0))) / LINEAR_SCALE
    return np.arange(max(1, math.ceil(x_max / width * (1 + 1e-12))) + 1) * width


def _counts_line(counts: dict) -> str:
    """``N rows, T trivial left out, C not converged`` for one attention type."""
    return (
        f"{counts['rows']:,} rows, {counts['trivial']:,} trivial (one key) left out, "
        f"{counts['non_converged']:,} not converged"
    )


def layer_histograms(run: ReportRun, edges: np.ndarray) -> pd.DataFrame:
    """Counts of the head-averaged values of the main slice per (attention type, layer) on ``edges``."""
    key = ("layer_histograms", edges.tobytes())
    if key not in run.memo and run.aggregates is not None:
        run.memo[key] = run.aggregates.histogram("layer_head_averaged", edges, ("attention_type", "layer"),
                                                 {"space": run.space, "alpha": run.alpha})
    if key not in run.memo:
        run.memo[key] = run.averaged_table.histogram(
            "value", edges, ("attention_type", "layer"), f"({run.main_where}) AND value IS NOT NULL")
    return run.memo[key]


def head_histograms(run: ReportRun, edges: np.ndarray) -> pd.DataFrame:
    """Counts of the main slice's non-trivial deviations per (attention type, layer, head) on ``edges``."""
    key = ("head_histograms", edges.tobytes())
    if key not in run.memo and run.aggregates is not None:
        run.memo[key] = run.aggregates.histogram("rel_deviation", edges, ("attention_type", "layer", "head"),
                                                 {"space": run.space, "alpha": run.alpha})
    if key not in run.memo:
        run.memo[key] = run.table.histogram("rel_deviation", edges, ("attention_type", "layer", "head"),
                                            run.measured_where)
    return run.memo[key]


def ecdf_edges(x_end: float) -> np.ndarray:
    """The fine bins an ECDF over 0 to ``x_end`` is drawn from."""
    return np.linspace(0.0, x_end if x_end > 0 else 1.0, ECDF_BINS + 1)


def overview_figure(run: ReportRun, scale: Scale) -> Drawn:
    """Box plots per layer over every non-trivial row, one panel per attention type, y axis from 0 shared."""
    types = run.types
    layers = {t: run.layers(t) for t in types}
    widths = [max(len(layers[t]), 4) for t in types]
    figure = new_figure(min(24.0, max(6.5, 0.55 * sum(widths) + 1.0 * len(types) + 1.0)), 5.0)
    axes = figure.subplots(1, len(types), sharey=True, squeeze=False, width_ratios=widths)[0]
    notes = []
    for ax, attention_type in zip(axes, types, strict=True):
        layer_boxes(ax, run.main_deviation("layer", attention_type), layers[attention_type])
        counts = run.counts(attention_type)
        ax.set_title(f"{type_label(attention_type)}\n{counts['rows'] - counts['trivial']:,} rows", fontsize="medium")
        notes.append(f"{type_label(attention_type)}: {_counts_line(counts)}")
        ax.set_xlabel("layer")
    axes[0].set_ylim(0, scale.x_max * 1.06)
    axes[0].set_ylabel(DEVIATION_LABEL)
    details = suptitle(figure, run.name, "y axis from 0, shared by every panel", *notes)
    caption = (
        "All attention types side by side: the relative deviation per layer over every non-trivial query token "
        "and head (box: quartiles; whiskers: 5th–95th percentile; red diamond: mean; dark red triangle: maximum). "
        + details
    )
    return Drawn("overview", caption, figure)


def layers_figure(run: ReportRun, attention_type: str, scale: Scale) -> Drawn:
    """Per-layer histograms of the head-averaged deviation, then all layers on log y, then their ECDFs."""
    stats = in_slice(run.averaged["layer"], run.space, run.alpha)
    stats = stats[stats["attention_type"] == attention_type].set_index("layer")
    layers = sorted(int(layer) for layer in stats.index)
    edges = scale.edges
    counted = layer_histograms(run, edges)
    counts = {layer: counts_on(edges, counted, attention_type, layer) for layer in layers}
    fine = ecdf_edges(scale.x_end)
    fine_counts = layer_histograms(run, fine)
    ncols = 3 if len(layers) + 2 <= 12 else 4
    nrows = math.ceil((len(layers) + 2) / ncols)
    figure = new_figure(3.1 * ncols + 0.9, 2.45 * nrows + 1.4)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(layers) + 2 :]:
        ax.remove()
    top = max([c.max() for c in counts.values()] or [1]) * 1.05
    colors = dict(zip(layers, layer_colors(len(layers))))
    for ax, layer in zip(axes, layers):
        row = stats.loc[layer]
        draw_counts(ax, counts[layer], edges)
        mark_mean_max(ax, row["mean"], row["max"])
        ax.set_xlim(0, scale.x_end)
        ax.set_ylim(0, top)
        ax.set_title(f"layer {layer} · {int(row['count']):,} head-averaged values\n"
                     f"{stats_line(int(row['count']), row['mean'], row['p95'], row['max'])}", fontsize="small")
    if layers:
        log_ax, ecdf_ax = axes[len(layers)], axes[len(layers) + 1]
        for layer in layers:
            log_ax.stairs(np.where(counts[layer] > 0, counts[layer], np.nan), edges, color=colors[layer], linewidth=1.1)
            ecdf(ecdf_ax, counts_on(fine, fine_counts, attention_type, layer), fine, color=colors[layer],
                 linewidth=1.1, label=f"layer {layer}")
        log_ax.set_yscale("log")
        log_ax.set_xlim(0, scale.x_end)
        log_ax.set_title("every layer, log y (tails)", fontsize="small")
        ecdf_ax.set_xlim(0, scale.x_end)
        ecdf_ax.set_ylim(0, 1.0)
        ecdf_ax.set_title("every layer, ECDF", fontsize="small")
        ecdf_ax.set_ylabel("fraction ≤ x")
        ecdf_ax.legend(fontsize="x-small", loc="lower right", ncol=2 if len(layers) > 6 else 1)
    for ax in axes[: len(layers) + 2]:
        ax.xaxis.set_major_locator(MaxNLocator(4))
    figure.supxlabel(f"{DEVIATION_LABEL}, per query token averaged over the layer's heads")
    figure.supylabel("(example, query) values per bin")
    binned = f"{len(edges) - 1} bins (Freedman–Diaconis)" if not scale.notes else f"{len(edges) - 1} {scale.notes[0]}"
    details = suptitle(figure, f"{run.name} · {type_label(attention_type)}", _counts_line(run.counts(attention_type)),
                       binned, scale.x_text)
    caption = (
        f"{type_label(attention_type)}: histogram per layer of the deviation of each (example, query token), "
        "averaged over the layer's heads (shared bins and axes; red line: mean; triangle: maximum), every layer "
        "again on a log y axis, and every layer's ECDF. " + details
    )
    return Drawn(f"layers_{file_stem(attention_type)}", caption, figure, attention_type)


def heads_figure(run: ReportRun, attention_type: str, scale: Scale) -> Drawn:
    """A layers x heads grid of histograms on one log y axis; the figure grows with the grid.

    The panels get the same limits set by hand rather than shared axes, and a fixed grid rather than
    constrained layout: both cost time quadratic in the number of panels (144 for a 12 x 12 model).
    """
    layers, head_ids = run.layers(attention_type), run.heads(attention_type)
    edges = scale.head_edges
    stats = run.main_deviation("head", attention_type).set_index(["layer", "head"])
    counted = head_histograms(run, edges)
    counted = counted[counted["attention_type"] == attention_type]
    counts = {key: counts_on(edges, counted, attention_type, *key) for key in stats.index}
    top = max([int(c.max()) for c in counts.values()] or [1])
    panel_w, panel_h = 1.75, 1.3
    width = max(7.0, panel_w * len(head_ids) + 1.6)
    title = wrap(f"{run.name} · {type_label(attention_type)}", width)
    title_h = 0.24 * (title.count("\n") + 1) + 0.55  # the title, then the "head k" panel titles
    left, bottom, right = 1.25, 0.95, 0.25
    height = panel_h * len(layers) + title_h + bottom
    figure = new_figure(width, height, constrained=False)
    figure.subplots_adjust(
        left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - title_h / height,
        wspace=0.12, hspace=0.22,
    )
    axes = figure.subplots(len(layers), len(head_ids), squeeze=False)
    # no tick label near a panel's right edge, where it would meet the next panel's "0"
    x_ticks = FixedLocator([t for t in MaxNLocator(3).tick_values(0, scale.x_end) if 0 <= t <= 0.85 * scale.x_end])
    for row, layer in enumerate(layers):
        for col, head in enumerate(head_ids):
            ax = axes[row, col]
            if (layer, head) in counts:
                draw_counts(ax, counts[(layer, head)], edges, log=True)
                mark_mean_max(ax, stats.loc[(layer, head), "mean"], stats.loc[(layer, head), "max"])
            ax.set_yscale("log")
            ax.set_xlim(0, scale.x_end)
            ax.set_ylim(0.7, top * 1.8)
            ax.xaxis.set_major_locator(x_ticks)
            ax.yaxis.set_major_locator(LogLocator(numticks=4))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelleft=col == 0, labelbottom=row == len(layers) - 1, labelsize="small")
            if row == 0:
                ax.set_title(f"head {head}", fontsize="medium")
            if col == 0:
                ax.set_ylabel(f"layer {layer}", fontsize="medium")
    figure.supxlabel(f"{DEVIATION_LABEL} (every non-trivial query token)", y=0.12 / height, va="bottom")
    figure.supylabel("rows per bin (log)", x=0.08 / width, ha="left")
    figure.suptitle(title, y=1 - 0.08 / height, va="top", fontsize=mpl.rcParams["axes.labelsize"])
    caption = (
        f"{type_label(attention_type)}: histogram per head (rows: layers, columns: heads) over every non-trivial "
        "query token, on one log y axis with shared bins; red line: the head's mean; triangle: its maximum. "
        + caption_sentence(_counts_line(run.counts(attention_type)), scale.x_text, *scale.notes)
        + " Click the image to open it at full size."
    )
    return Drawn(f"heads_{file_stem(attention_type)}", caption, figure, attention_type, wide=len(head_ids) > 4)


def heatmap_figure(run: ReportRun, head_stats: pd.DataFrame, statistic: str, attention_type: str, scale: Scale) -> Drawn:
    """Layer x head heatmap of one statistic (``mean`` or ``p95``) on the report's shared colour scale."""
    stats = head_stats[head_stats["attention_type"] == attention_type]
    grid = stats.pivot(index="layer", columns="head", values=statistic).sort_index().sort_index(axis=1)
    n_layers, n_heads = grid.shape
    name = {"mean": "mean", "p95": "95th percentile"}[statistic]
    figure = new_figure(max(6.5, 0.62 * n_heads + 2.6), max(3.4, 0.42 * n_layers + 2.2))
    ax = figure.subplots()
    sns.heatmap(
        grid.astype(float), ax=ax, cmap=CMAP, vmin=0, vmax=scale.color_max, linewidths=0.5,
        cbar_kws={"label": f"{statistic} rel. deviation"},
        annot=n_heads <= ANNOTATE_MAX_HEADS and grid.size <= ANNOTATE_MAX_CELLS, fmt=".3g",
        annot_kws={"fontsize": "x-small"},
    )
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(axis="y", rotation=0)
    details = suptitle(figure, f"{run.name} · {type_label(attention_type)}",
                       f"over {int(stats['count'].sum()):,} non-trivial rows", scale.color_text)
    caption = f"{type_label(attention_type)}: {name} of the relative deviation per layer and head. {details}"
    return Drawn(f"heatmap_{statistic}_{file_stem(attention_type)}", caption, figure, attention_type)
