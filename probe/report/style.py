"""Drawing primitives shared by every figure: the style (TrueType fonts in PDFs), figures on the Agg
canvas, data-driven shared bins, histograms with their mean and maximum marked, ECDFs, saving.

Figures are drawn on :class:`matplotlib.figure.Figure` objects with the Agg canvas, never through
pyplot, so building a report neither needs a display nor changes the caller's matplotlib state.
"""

from __future__ import annotations

import io
import math
import re
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib as mpl
import numpy as np
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from probe.core.errors import ProbeError

#: Figure formats the report can write.
FORMATS = ("png", "pdf")
DEVIATION_LABEL = "relative deviation ‖λ* − αz‖ / ‖λ*‖"
PNG_DPI = 130
HIST_COLOR = "#4c72b0"
MEAN_COLOR = "#d62728"
MAX_COLOR = "#7f0000"
P95_COLOR = "#ff7f0e"
CMAP = "viridis"
#: Every panel's central 98% of values spans at least this many bins (the floor on Freedman-Diaconis).
MIN_BINS_PER_PANEL = 15
#: The most bins over the whole shared x range.
MAX_BINS = 400


@contextmanager
def style():
    """Seaborn's paper style; TrueType (Type 42) fonts in PDF and PS so that no Type 3 font is embedded.

    Saving must happen inside the block: matplotlib reads ``pdf.fonttype`` when it writes the file.
    """
    with sns.axes_style("whitegrid"), sns.plotting_context("paper", font_scale=1.1), mpl.rc_context(
        {"pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none", "axes.titlesize": "medium"}
    ):
        yield


def new_figure(width: float, height: float, *, constrained: bool = True) -> Figure:
    """A figure on the Agg canvas (no pyplot, no display), with constrained layout unless told not to."""
    figure = Figure(figsize=(width, height), layout="constrained" if constrained else None)
    FigureCanvasAgg(figure)
    return figure


def wrap(text: str, width_inches: float) -> str:
    """Wrap a title to a figure's width (about 11 characters per inch at title size)."""
    return "\n".join(textwrap.wrap(text, width=max(30, int(width_inches * 11)), break_on_hyphens=False))


def suptitle(figure: Figure, short: str, *details: str) -> str:
    """A figure's own title, ``short`` (wrapped to the figure's width, no larger than its axis labels); the
    ``details`` (counts, legend, shared scales) go into one sentence for the figure's caption on the page,
    which is returned."""
    figure.suptitle(wrap(short, figure.get_figwidth()), fontsize=mpl.rcParams["axes.labelsize"])
    return caption_sentence(*details)


def caption_sentence(*details: str) -> str:
    """Caption parts as one sentence: ``a; b; c.`` (empty parts left out, the first letter capitalised)."""
    text = "; ".join(part.strip().rstrip(".") for part in details if part and part.strip())
    return (text[0].upper() + text[1:] + ".") if text else ""


# --------------------------------------------------------------------------------------------------
# shared bins and scales


def freedman_diaconis_width(q1: float, q3: float, n: int) -> float:
    """Freedman-Diaconis bin width ``2 IQR / n^(1/3)`` from the quartiles ``q1``, ``q3`` of ``n`` values."""
    if not n or n < 2 or not np.isfinite(q1) or not np.isfinite(q3):
        return math.nan
    return 2.0 * float(q3 - q1) / n ** (1 / 3)


def shared_edges(pooled: dict, panels, x_max: float, *, n: int | None = None) -> np.ndarray:
    """Bin edges from 0 to ``x_max`` for histograms that share one x axis.

    The width is Freedman-Diaconis on the pooled values (``pooled``: their ``count`` and quartiles ``q1``,
    ``q3``; with ``n`` the typical panel size), narrowed so that every panel's central 98% (``panels``:
    each with ``count``, 1st and 99th percentiles ``p1``, ``p99``) spans at least
    :data:`MIN_BINS_PER_PANEL` bins, and never so narrow that the range holds more than :data:`MAX_BINS` bins.
    """
    x_max = float(x_max) if np.isfinite(x_max) and x_max > 0 else 1.0
    count = int(pooled.get("count", 0) or 0)
    width = freedman_diaconis_width(pooled.get("q1", math.nan), pooled.get("q3", math.nan), n or count) \
        if count >= 2 else math.nan
    if not np.isfinite(width) or width <= 0:
        width = x_max / 40
    for panel in panels:
        if panel["count"] >= 2 and panel["p99"] > panel["p1"]:
            width = min(width, (panel["p99"] - panel["p1"]) / MIN_BINS_PER_PANEL)
    width = max(width, x_max / MAX_BINS)
    n_bins = max(1, math.ceil(x_max / width * (1 + 1e-12)))
    return np.arange(n_bins + 1) * width


@dataclass
class Scale:
    """Axes and colours shared by every figure of a report (or of a comparison)."""

    x_max: float  # the shared x range of deviation histograms: 0 to x_max
    edges: np.ndarray  # bins of histograms over (example, query) values
    head_edges: np.ndarray  # bins of per-head histograms (fewer values per panel)
    color_max: float  # heatmaps of deviation statistics share the colour range 0 to color_max
    notes: list[str] = field(default_factory=list)

    @property
    def x_end(self) -> float:
        """The right end of every deviation histogram's x axis (the last bin edge of either binning)."""
        return float(max(self.edges[-1], self.head_edges[-1]))

    @property
    def x_text(self) -> str:
        return f"x axis 0 to {self.x_end:.3g}, shared by every deviation histogram"

    @property
    def color_text(self) -> str:
        return f"colour scale 0 to {self.color_max:.3g}, shared by every heatmap"


# --------------------------------------------------------------------------------------------------
# panels


def draw_counts(ax, counts: np.ndarray, edges: np.ndarray, *, log: bool = False, color: str = HIST_COLOR) -> None:
    """A filled histogram of bin ``counts`` on ``edges`` (log y: empty bins stay empty)."""
    if log:
        ax.stairs(np.where(counts > 0, counts, np.nan), edges, fill=True, color=color, alpha=0.85, baseline=0.7)
        ax.set_yscale("log")
    else:
        ax.stairs(counts, edges, fill=True, color=color, alpha=0.85)


def counts_on(edges: np.ndarray, histogram, *keys) -> np.ndarray:
    """The counts of one group from a :meth:`probe.query.Table.histogram` frame (its ``by`` columns first,
    then ``bin`` and ``count``), as an array over ``edges``' bins (zeros where the group has none)."""
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    part = histogram
    for column, key in zip(histogram.columns, keys):
        part = part[part[column] == key]
    counts[part["bin"].to_numpy(dtype=np.int64)] = part["count"].to_numpy()
    return counts


def layer_boxes(ax, stats, layers) -> list[float]:
    """One box per layer from its statistics (``stats``: a frame with ``layer``, ``q1``, ``median``, ``q3``,
    ``whislo``, ``whishi``, ``mean``, ``max``, as :class:`probe.report.data.ReportRun` computes them exactly): the
    box the quartiles, whiskers at the smallest value at or above the 5th percentile and the largest at or
    below the 95th (``boxplot(whis=(5, 95))``), the mean as a diamond, and each layer's maximum as a
    triangle; a layer without values gets an empty box.  Returns the maxima (NaN for an empty layer)."""
    by_layer = stats.set_index("layer") if len(stats) else stats
    boxes, maxima = [], []
    for layer in layers:
        if layer in getattr(by_layer, "index", ()) and by_layer.loc[layer, "count"] > 0:
            row = by_layer.loc[layer]
            boxes.append({"label": str(layer), "med": row["median"], "q1": row["q1"], "q3": row["q3"],
                          "whislo": row["whislo"], "whishi": row["whishi"], "mean": row["mean"], "fliers": []})
            maxima.append(float(row["max"]))
        else:
            boxes.append({"label": str(layer), "med": np.nan, "q1": np.nan, "q3": np.nan, "whislo": np.nan,
                          "whishi": np.nan, "mean": np.nan, "fliers": []})
            maxima.append(np.nan)
    positions = np.arange(1, len(boxes) + 1)
    ax.bxp(
        boxes, positions=positions, showfliers=False, showmeans=True, patch_artist=True,
        boxprops={"facecolor": HIST_COLOR, "alpha": 0.6}, medianprops={"color": "black"},
        meanprops={"marker": "D", "markersize": 4, "markerfacecolor": MEAN_COLOR, "markeredgecolor": MEAN_COLOR},
    )
    ax.scatter(positions, maxima, marker="^", color=MAX_COLOR, s=22, zorder=5)
    return maxima


def mark_mean_max(ax, mean: float, maximum: float) -> None:
    """The mean as a red vertical line and the maximum as a dark red triangle on the x axis.

    Their values belong in the panel's title (see :func:`stats_line`), never inside the axes, so no
    label covers a bar.
    """
    if not np.isfinite(mean):
        return
    ax.axvline(float(mean), color=MEAN_COLOR, linewidth=1.2)
    ax.plot([float(maximum)], [0], marker="^", color=MAX_COLOR, markersize=6, clip_on=False,
            transform=ax.get_xaxis_transform(), zorder=5)


def stats_line(count: int, mean: float, p95: float, maximum: float) -> str:
    """``mean … · p95 … · max …`` (for panel titles)."""
    if not count:
        return "no values"
    return f"mean {mean:.3g} · p95 {p95:.3g} · max {maximum:.3g}"


#: an ECDF is drawn from the cumulative counts in this many equal bins over its x range
ECDF_BINS = 2048


def ecdf(ax, counts: np.ndarray, edges: np.ndarray, **style) -> None:
    """Empirical CDF as a step line from bin ``counts`` on ``edges`` (the exact fraction of values at or below
    each edge: a fine binning, :data:`ECDF_BINS`, draws it as the sorted values would)."""
    total = counts.sum()
    if total:
        ax.step(edges, np.concatenate([[0.0], np.cumsum(counts) / total]), where="post", **style)


def file_stem(attention_type: str) -> str:
    """An attention type as a safe file-name part."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", attention_type)


def layer_colors(n: int):
    """One colour per layer, shallow to deep."""
    cmap = mpl.colormaps["viridis"]
    return [cmap(0.9 * i / max(1, n - 1)) for i in range(n)]


# --------------------------------------------------------------------------------------------------
# saving


@dataclass
class Drawn:
    """A drawn figure: its file stem, caption, the figure, and the attention type it shows (None: all)."""

    stem: str
    caption: str
    figure: Figure
    attention_type: str | None = None
    wide: bool = False  # shown full width on the page (large grids)


@dataclass
class Saved:
    """A saved figure: stem, caption, PNG bytes for the page, files written, attention type, width."""

    stem: str
    caption: str
    png: bytes
    files: list[Path]
    attention_type: str | None
    wide: bool
    size_px: tuple[int, int]


def save(drawn: Drawn, out_dir: Path, formats: list[str]) -> Saved:
    """Write a drawn figure in every format (call inside :func:`style`); keep its PNG bytes for the page."""
    figure = drawn.figure
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PNG_DPI)
    files = []
    for fmt in formats:
        path = out_dir / f"{drawn.stem}.{fmt}"
        if fmt == "png":
            path.write_bytes(buffer.getvalue())
        else:
            figure.savefig(path, format=fmt)
        files.append(path)
    size = (int(round(figure.get_figwidth() * PNG_DPI)), int(round(figure.get_figheight() * PNG_DPI)))
    return Saved(drawn.stem, drawn.caption, buffer.getvalue(), files, drawn.attention_type, drawn.wide, size)


def check_formats(formats) -> list[str]:
    """Normalise figure formats (lower case, no leading dot, no duplicates) and reject unknown ones."""
    if isinstance(formats, str):
        formats = formats.split(",")
    cleaned = list(dict.fromkeys(f.strip().lower().lstrip(".") for f in formats if f.strip()))
    if not cleaned:
        raise ProbeError(f"No figure format given. Use one or more of: {', '.join(FORMATS)}.")
    unknown = [f for f in cleaned if f not in FORMATS]
    if unknown:
        raise ProbeError(f"Unknown figure format(s) {', '.join(unknown)}. Use one or more of: {', '.join(FORMATS)}.")
    return cleaned
