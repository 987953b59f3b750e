"""The report: ``deviations.parquet`` + ``manifest.json`` -> figures, ``summary.csv`` and ``index.html``.

For every attention type present in the run (ordered self, encoder_self, decoder_self, cross) the report
draws

* ``layers_<type>``: one histogram per layer of the relative deviation, each (example, query token)
  value first averaged over the layer's heads, with the mean as a red line;
* ``heads_<type>``: a layers x heads grid of histograms, one per head, each with its mean in red;
* ``heatmap_mean_<type>`` and ``heatmap_p95_<type>``: layer x head heatmaps of the mean and the 95th
  percentile;

plus ``overview``, which compares the attention types side by side (box plots per layer over every
token and head).  Each figure is written in every requested format; bins and axes are shared within a
figure.  ``summary.csv`` holds per-head and per-layer statistics (the layer level over all rows of the
layer, not head-averaged), and ``index.html`` is a single self-contained page (figures embedded as PNG
data URIs) with the run's key facts, the tables and the figures.

Figures are drawn on :class:`matplotlib.figure.Figure` objects with the Agg canvas, never through
pyplot, so building a report neither needs a display nor changes the caller's matplotlib state.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import textwrap
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from . import __version__
from .errors import ProbeError
from .schema import DEVIATION_SCHEMA
from .storage import deviations_dataset, with_liveness

#: The parquet columns the report reads (the others are never loaded).
NEEDED_COLUMNS = ("attention_type", "layer", "head", "example", "query", "rel_deviation", "converged")
#: Figure formats the report can write.
FORMATS = ("png", "pdf")
#: Known attention types, in the order figures and tables show them; unknown ones follow, sorted.
TYPE_ORDER = ("self", "encoder_self", "decoder_self", "cross")
TYPE_LABELS = {
    "self": "self-attention",
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention",
    "cross": "cross-attention",
}
SUMMARY_COLUMNS = (
    "level", "attention_type", "layer", "head", "count", "mean", "median", "p95", "max", "non_converged",
)
DEVIATION_LABEL = "relative deviation ‖λ* − αz‖ / ‖λ*‖"
PNG_DPI = 150
N_BINS = 40
HIST_COLOR = "#4c72b0"
MEAN_COLOR = "red"
#: Heatmaps get a number in every cell up to this many heads and cells.
ANNOTATE_MAX_HEADS = 16
ANNOTATE_MAX_CELLS = 400


@dataclass
class _Run:
    """What titles and the page say about the run, taken from the manifest (with fallbacks)."""

    run_dir: Path
    manifest: dict
    model: str
    dataset: str
    alpha: float | None
    notes: list[str] = field(default_factory=list)  # problems to show prominently on the page

    @property
    def title(self) -> str:
        alpha = "α = ?" if self.alpha is None else f"α = {self.alpha:g}"
        return f"{_shorten(self.model)} · {_shorten(self.dataset)} · {alpha}"


@dataclass
class _Figure:
    """One saved figure: its file stem, a caption, PNG bytes for the page and the files written."""

    stem: str
    caption: str
    png: bytes
    files: list[Path]


def build_report(run_dir: str | Path, out_dir: str | Path | None = None, formats: Sequence[str] = ("png",)) -> Path:
    """Build figures, ``summary.csv`` and ``index.html`` for a run directory; return the report directory.

    ``out_dir`` defaults to ``<run_dir>/report``.  ``formats`` are figure formats (``png``, ``pdf``); the
    page always embeds PNG renderings whatever is written to disk.  Raises :class:`ProbeError` for a
    missing run directory, a missing, unreadable or incomplete ``deviations.parquet`` and unknown
    formats.  A missing or invalid ``manifest.json`` only produces a warning (on the page and through
    :mod:`warnings`); a parquet without rows gives a report that says there is no data.
    """
    formats = _check_formats(formats)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(
            f"Run directory {run_dir} does not exist (or is not a directory). "
            "Pass the run directory printed by `probe run`."
        )
    parquet_path = run_dir / "deviations.parquet"  # a directory of part files (or one exported file)
    if not parquet_path.exists():
        raise ProbeError(
            f"{parquet_path} does not exist: {run_dir} is not a probe run directory. "
            "Pass the run directory printed by `probe run` (it holds deviations.parquet and manifest.json)."
        )
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    if out_dir.exists() and not out_dir.is_dir():
        raise ProbeError(f"Report directory {out_dir} exists and is not a directory. Choose another --out.")

    data = _read_deviations(parquet_path)
    run = _describe_run(run_dir, parquet_path)
    summary = _summarize(data)
    types = _ordered_types(data["attention_type"].unique())
    _note_data_problems(run, data)

    out_dir.mkdir(parents=True, exist_ok=True)
    summary.to_csv(out_dir / "summary.csv", index=False)
    figures = _draw_figures(data, summary, types, run, out_dir, formats) if len(data) else []
    (out_dir / "index.html").write_text(_page(run, data, summary, types, figures), encoding="utf-8")
    return out_dir


# --------------------------------------------------------------------------------------------------
# input


def _check_formats(formats: Sequence[str]) -> list[str]:
    """Normalise figure formats (lower case, no leading dot, no duplicates) and reject unknown ones."""
    if isinstance(formats, str):
        formats = [formats]
    cleaned = list(dict.fromkeys(f.strip().lower().lstrip(".") for f in formats if f.strip()))
    if not cleaned:
        raise ProbeError(f"No figure format given. Use one or more of: {', '.join(FORMATS)}.")
    unknown = [f for f in cleaned if f not in FORMATS]
    if unknown:
        raise ProbeError(f"Unknown figure format(s) {', '.join(unknown)}. Use one or more of: {', '.join(FORMATS)}.")
    return cleaned


def _type_kind(arrow_type: pa.DataType) -> str:
    """Coarse kind of an Arrow type (dictionary-encoded columns count as their values)."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    for kind, test in (
        ("boolean", pa.types.is_boolean),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
    ):
        if test(arrow_type):
            return kind
    return str(arrow_type)


def _read_deviations(path: Path) -> pd.DataFrame:
    """Read only the columns the report needs, after checking that they exist with the right types."""
    hint = "Re-run `probe run`, or export the run again."
    try:
        parquet = deviations_dataset(path)
        schema = parquet.schema
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read {path} as parquet ({error}). {hint}") from None
    missing = [name for name in NEEDED_COLUMNS if name not in schema.names]
    if missing:
        raise ProbeError(
            f"{path} lacks the column(s) {', '.join(missing)} (it has: {', '.join(schema.names) or 'none'}). "
            "The report needs the deviations table written by `probe run`; re-run it with this version of probe."
        )
    wrong = [
        f"{name} is {schema.field(name).type}, expected {DEVIATION_SCHEMA.field(name).type}"
        for name in NEEDED_COLUMNS
        if _type_kind(schema.field(name).type) != _type_kind(DEVIATION_SCHEMA.field(name).type)
    ]
    if wrong:
        raise ProbeError(f"{path} has columns of the wrong type: {'; '.join(wrong)}. Re-run `probe run`.")
    try:
        table = parquet.to_table(columns=list(NEEDED_COLUMNS))
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read the data in {path} ({error}). {hint}") from None
    index = table.schema.get_field_index("attention_type")
    table = table.set_column(index, "attention_type", table["attention_type"].dictionary_encode())
    return table.to_pandas()  # attention_type becomes a categorical: small, however many rows


def _load_manifest(path: Path) -> tuple[dict, str | None]:
    """The manifest as a dict, and a note saying what is wrong with it (None when it is fine)."""
    if not path.is_file():
        return {}, f"{path} is missing: the facts below are incomplete."
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return {}, f"{path} could not be read ({error}): the facts below are incomplete."
    if not isinstance(manifest, dict):
        return {}, f"{path} does not hold a JSON object: the facts below are incomplete."
    return manifest, None


def _lookup(mapping: dict, *keys):
    """``mapping[k1][k2]...``, or None where a level is missing or not a dict."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _first_row(parquet_path: Path, column: str):
    """The value of ``column`` in the parquet's first row, or None (used when the manifest lacks it)."""
    parquet = deviations_dataset(parquet_path)
    if column not in parquet.schema.names:
        return None
    values = parquet.head(1, columns=[column]).column(0)
    return values[0].as_py() if len(values) else None


def _describe_run(run_dir: Path, parquet_path: Path) -> _Run:
    """Model, dataset and alpha from the manifest, falling back to the parquet's model/alpha columns."""
    manifest, problem = _load_manifest(run_dir / "manifest.json")
    manifest = with_liveness(manifest)  # a "running" run whose process is gone was interrupted
    notes = []
    if problem:
        warnings.warn(problem, stacklevel=3)
        notes.append(problem)
    model = _lookup(manifest, "model", "id")
    if not isinstance(model, str):
        model = _first_row(parquet_path, "model")
    alpha = _lookup(manifest, "alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        alpha = _first_row(parquet_path, "alpha")
    dataset = _lookup(manifest, "dataset", "description")
    return _Run(
        run_dir=run_dir,
        manifest=manifest,
        model=model if isinstance(model, str) else "unknown model",
        dataset=dataset if isinstance(dataset, str) else "unknown dataset",
        alpha=float(alpha) if isinstance(alpha, (int, float)) else None,
        notes=notes,
    )


def _note_data_problems(run: _Run, data: pd.DataFrame) -> None:
    """Add page warnings for an empty or interrupted run, non-converged solves and a failed fidelity check."""
    if data.empty:
        run.notes.append("No data: deviations.parquet has no rows, so there are no figures or statistics.")
    status = _lookup(run.manifest, "status")
    if isinstance(status, str) and status != "complete":
        run.notes.append(f"The run's status is '{status}': the statistics cover only the batches it finished.")
    non_converged = int((~data["converged"]).sum())
    if non_converged:
        run.notes.append(
            f"{non_converged:,} of {len(data):,} rows did not meet the solver's certificate; "
            "they are included in every figure and statistic."
        )
    if _lookup(run.manifest, "fidelity", "passed") is False:
        run.notes.append("The fidelity check failed: reconstructed attention differs from the model's.")


def _ordered_types(types) -> list[str]:
    """Attention types in display order: the known ones first, then any others sorted."""
    types = set(types)
    return [t for t in TYPE_ORDER if t in types] + sorted(types - set(TYPE_ORDER))


def _shorten(text: str, limit: int = 32) -> str:
    """Text short enough for a figure title: long paths keep their last components after an ellipsis."""
    if len(text) <= limit:
        return text
    parts = text.split("/")
    for start in range(1, len(parts)):
        tail = "/".join(parts[start:])
        if len(tail) <= limit - 2:
            return "…/" + tail
    return "…" + text[-(limit - 1) :]


def _file_stem(attention_type: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", attention_type)


# --------------------------------------------------------------------------------------------------
# statistics


def _summarize(data: pd.DataFrame) -> pd.DataFrame:
    """Statistics of rel_deviation per (type, layer) over all the layer's rows, and per (type, layer, head).

    ``count`` is the number of (non-NaN) values the statistics are over; ``non_converged`` counts rows.
    """
    data = data.assign(non_converged=~data["converged"])
    levels = []
    for level, keys in (("layer", ["attention_type", "layer"]), ("head", ["attention_type", "layer", "head"])):
        grouped = data.groupby(keys, sort=True, observed=True)
        deviation = grouped["rel_deviation"]
        stats = pd.DataFrame(
            {
                "count": deviation.count(),
                "mean": deviation.mean(),
                "median": deviation.median(),
                "p95": deviation.quantile(0.95),
                "max": deviation.max(),
                "non_converged": grouped["non_converged"].sum(),
            }
        ).reset_index()
        levels.append(stats.assign(level=level, attention_type=stats["attention_type"].astype(str)))
    summary = pd.concat(levels, ignore_index=True)
    summary["head"] = summary["head"].astype("Int64")
    rank = {t: i for i, t in enumerate(_ordered_types(summary["attention_type"]))}
    order = summary.assign(
        level_rank=(summary["level"] == "head").astype(int), type_rank=summary["attention_type"].map(rank)
    ).sort_values(["level_rank", "type_rank", "layer", "head"])
    return summary.loc[order.index, list(SUMMARY_COLUMNS)].reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# figures


@contextmanager
def _style():
    """Seaborn's paper style and font sizes, applied to the figures drawn and saved inside the block."""
    with sns.axes_style("whitegrid"), sns.plotting_context("paper", font_scale=1.1):
        yield


def _new_figure(width: float, height: float, *, constrained: bool = True) -> Figure:
    """A figure on the Agg canvas (no pyplot, no display), with constrained layout unless told not to."""
    figure = Figure(figsize=(width, height), layout="constrained" if constrained else None)
    FigureCanvasAgg(figure)
    return figure


def _type_label(attention_type: str) -> str:
    return TYPE_LABELS.get(attention_type, attention_type)


def _suptitle(figure: Figure, first: str, second: str) -> None:
    """A two-part figure title; the first part is wrapped to the figure's width."""
    first = "\n".join(textwrap.wrap(first, width=max(30, int(figure.get_figwidth() * 10)), break_on_hyphens=False))
    figure.suptitle(f"{first}\n{second}")


def _type_title(figure: Figure, run: _Run, attention_type: str, rows: int, non_converged: int) -> None:
    """Title naming the run and attention type, with the row and non-converged counts."""
    _suptitle(
        figure, f"{run.title} · {_type_label(attention_type)}", f"{rows:,} rows, {non_converged:,} not converged"
    )


def _bins(values: np.ndarray) -> np.ndarray:
    """Shared histogram edges from 0 (or the minimum, if negative) to the largest finite value."""
    finite = values[np.isfinite(values)]
    low = min(0.0, float(finite.min())) if finite.size else 0.0
    high = float(finite.max()) if finite.size else 1.0
    if high <= low:
        high = low + 1.0
    return np.linspace(low, high, N_BINS + 1)


def _histogram(ax, values: np.ndarray, edges: np.ndarray) -> None:
    counts, _ = np.histogram(values, bins=edges)
    ax.stairs(counts, edges, fill=True, color=HIST_COLOR, alpha=0.85)


def _mean_line(ax, mean: float, *, label: bool) -> None:
    """A red vertical line at the mean, with its value written beside it when ``label``."""
    if not np.isfinite(mean):
        return
    ax.axvline(mean, color=MEAN_COLOR, linewidth=1.2)
    if label:
        left, right = ax.get_xlim()
        on_right = mean > (left + right) / 2  # write the value on the side with room
        ax.text(
            mean, 0.96, f"mean {mean:.3g} " if on_right else f" mean {mean:.3g}",
            transform=ax.get_xaxis_transform(), color=MEAN_COLOR, va="top", ha="right" if on_right else "left",
            bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1},
        )


def _panel_grid(figure: Figure, n: int, ncols: int) -> list:
    """``n`` panels in rows of ``ncols`` with shared axes; the lowest panel of each column keeps x ticks."""
    axes = figure.subplots(math.ceil(n / ncols), ncols, sharex=True, sharey=True, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.remove()
    for ax in axes[max(0, n - ncols) : n]:
        ax.tick_params(labelbottom=True)
    return list(axes[:n])


def _layers_figure(data: pd.DataFrame, attention_type: str, run: _Run) -> tuple[str, str, Figure]:
    """Per-layer histograms of the head-averaged deviation of each (example, query token)."""
    averaged = data.groupby(["layer", "example", "query"])["rel_deviation"].mean()
    layers = sorted(averaged.index.get_level_values("layer").unique())
    edges = _bins(averaged.to_numpy())
    ncols = min(len(layers), 4 if len(layers) > 9 else 3)
    figure = _new_figure(max(6.0, 2.6 * ncols + 0.6), 1.9 * math.ceil(len(layers) / ncols) + 1.2)
    for ax, layer in zip(_panel_grid(figure, len(layers), ncols), layers, strict=True):
        values = averaged.xs(layer, level="layer").to_numpy()
        _histogram(ax, values, edges)
        _mean_line(ax, float(np.nanmean(values)), label=True)
        ax.set_title(f"layer {layer}")
        ax.xaxis.set_major_locator(MaxNLocator(4))
    figure.supxlabel(f"{DEVIATION_LABEL}\n(per query token, averaged over the layer's heads)")
    figure.supylabel("query tokens")
    _type_title(figure, run, attention_type, len(data), int((~data["converged"]).sum()))
    caption = (
        f"{_type_label(attention_type)}: histogram per layer of the deviation of each (example, query token), "
        "averaged over the layer's heads; shared bins and axes; red line: mean."
    )
    return f"layers_{_file_stem(attention_type)}", caption, figure


def _heads_figure(data: pd.DataFrame, heads: pd.DataFrame, attention_type: str, run: _Run) -> tuple[str, str, Figure]:
    """A layers x heads grid of histograms, each with the head's mean (from ``heads``) in red.

    The panels get the same limits set by hand rather than shared axes, and a fixed grid rather than
    constrained layout: both cost time quadratic in the number of panels (144 for a 12 x 12 model).
    """
    layers = sorted(data["layer"].unique())
    head_ids = sorted(data["head"].unique())
    edges = _bins(data["rel_deviation"].to_numpy())
    counts = {
        key: np.histogram(group.to_numpy(), bins=edges)[0]
        for key, group in data.groupby(["layer", "head"])["rel_deviation"]
    }
    top = 1.05 * max(int(c.max()) for c in counts.values())
    means = heads.set_index(["layer", "head"])["mean"]
    width, height = max(6.0, 1.15 * len(head_ids) + 1.2), max(3.0, 0.85 * len(layers) + 1.5)
    figure = _new_figure(width, height, constrained=False)
    figure.subplots_adjust(left=1.0 / width, right=1 - 0.15 / width, bottom=0.75 / height, top=1 - 0.85 / height,
                           wspace=0.08, hspace=0.12)
    axes = figure.subplots(len(layers), len(head_ids), squeeze=False)
    for row, layer in enumerate(layers):
        for col, head in enumerate(head_ids):
            ax = axes[row, col]
            if (layer, head) in counts:
                ax.stairs(counts[(layer, head)], edges, fill=True, color=HIST_COLOR, alpha=0.85)
                _mean_line(ax, float(means[(layer, head)]), label=False)
            ax.set_xlim(edges[0], edges[-1])
            ax.set_ylim(0, top)
            ax.xaxis.set_major_locator(MaxNLocator(3))
            ax.tick_params(left=False, labelleft=False, labelbottom=row == len(layers) - 1, labelsize="small")
            if row == 0:
                ax.set_title(f"head {head}")
            if col == 0:
                ax.set_ylabel(f"layer {layer}", rotation=0, ha="right", va="center")
    figure.supxlabel(f"{DEVIATION_LABEL} (every query token; same axes in every panel)", y=0.05 / height,
                     va="bottom")
    _type_title(figure, run, attention_type, len(data), int((~data["converged"]).sum()))
    caption = (
        f"{_type_label(attention_type)}: histogram per head (rows: layers, columns: heads) over every query "
        "token; shared bins and axes; red line: the head's mean."
    )
    return f"heads_{_file_stem(attention_type)}", caption, figure


def _heatmap_figure(heads: pd.DataFrame, statistic: str, attention_type: str, run: _Run) -> tuple[str, str, Figure]:
    """Layer x head heatmap of one statistic of ``heads`` (``mean`` or ``p95``), annotated when small."""
    grid = heads.pivot(index="layer", columns="head", values=statistic).sort_index().sort_index(axis=1)
    n_layers, n_heads = grid.shape
    name = {"mean": "mean", "p95": "95th percentile"}[statistic]
    figure = _new_figure(max(6.0, 0.62 * n_heads + 2.2), max(3.0, 0.42 * n_layers + 1.7))
    ax = figure.subplots()
    sns.heatmap(
        grid, ax=ax, cmap="viridis", linewidths=0.5, cbar_kws={"label": f"{name} relative deviation"},
        annot=n_heads <= ANNOTATE_MAX_HEADS and grid.size <= ANNOTATE_MAX_CELLS, fmt=".3g",
        annot_kws={"fontsize": "small"},
    )
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(axis="y", rotation=0)
    _type_title(figure, run, attention_type, int(heads["count"].sum()), int(heads["non_converged"].sum()))
    caption = f"{_type_label(attention_type)}: {name} of the relative deviation per layer and head."
    return f"heatmap_{statistic}_{_file_stem(attention_type)}", caption, figure


def _overview_figure(data: pd.DataFrame, types: list[str], run: _Run) -> tuple[str, str, Figure]:
    """Box plots per layer over every token and head, one panel per attention type, shared y axis."""
    per_type = {t: data[data["attention_type"] == t] for t in types}
    layers = {t: sorted(subset["layer"].unique()) for t, subset in per_type.items()}
    widths = [max(len(layers[t]), 2) for t in types]
    figure = _new_figure(min(16.0, max(6.0, 0.5 * sum(widths) + 1.5 * len(types))), 4.4)
    axes = figure.subplots(1, len(types), sharey=True, squeeze=False, width_ratios=widths)[0]
    for ax, attention_type in zip(axes, types, strict=True):
        subset = per_type[attention_type]
        groups = subset.groupby("layer")["rel_deviation"]
        ax.boxplot(
            [groups.get_group(layer).dropna().to_numpy() for layer in layers[attention_type]],
            tick_labels=[str(layer) for layer in layers[attention_type]],
            whis=(5, 95), showfliers=False, showmeans=True, patch_artist=True,
            boxprops={"facecolor": HIST_COLOR, "alpha": 0.6}, medianprops={"color": "black"},
            meanprops={"marker": "D", "markersize": 4, "markerfacecolor": MEAN_COLOR, "markeredgecolor": MEAN_COLOR},
        )
        non_converged = int((~subset["converged"]).sum())
        ax.set_title(f"{_type_label(attention_type)}\n{len(subset):,} rows, {non_converged:,} not converged")
        ax.set_xlabel("layer")
    axes[0].set_ylabel(DEVIATION_LABEL)
    _suptitle(figure, run.title, "box: quartiles · whiskers: 5th–95th percentile · red diamond: mean")
    caption = (
        "All attention types side by side: the relative deviation per layer over every query token and head "
        "(box: quartiles, whiskers: 5th–95th percentile, red diamond: mean)."
    )
    return "overview", caption, figure


def _save(drawn: tuple[str, str, Figure], out_dir: Path, formats: list[str]) -> _Figure:
    """Write a drawn figure in every format; keep its PNG bytes for the page."""
    stem, caption, figure = drawn
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=PNG_DPI)
    files = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        if fmt == "png":
            path.write_bytes(buffer.getvalue())
        else:
            figure.savefig(path, format=fmt)
        files.append(path)
    return _Figure(stem, caption, buffer.getvalue(), files)


def _draw_figures(
    data: pd.DataFrame, summary: pd.DataFrame, types: list[str], run: _Run, out_dir: Path, formats: list[str]
) -> list[_Figure]:
    """Draw and save every figure, in page order: the overview, then per type layers, heatmaps, heads."""
    heads = summary[summary["level"] == "head"]
    with _style():
        figures = [_save(_overview_figure(data, types, run), out_dir, formats)]
        for attention_type in types:
            subset = data[data["attention_type"] == attention_type]
            type_heads = heads[heads["attention_type"] == attention_type]
            for drawn in (
                _layers_figure(subset, attention_type, run),
                _heatmap_figure(type_heads, "mean", attention_type, run),
                _heatmap_figure(type_heads, "p95", attention_type, run),
                _heads_figure(subset, type_heads, attention_type, run),
            ):
                figures.append(_save(drawn, out_dir, formats))
    return figures


# --------------------------------------------------------------------------------------------------
# the page

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #e5e5e5; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } table.facts th, table.facts td { text-align: left; }
.notes { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.6em 1em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; } footer { margin-top: 3em; color: #888; font-size: 0.8em; }
"""


def _format_value(value) -> str:
    """A manifest value as short text: numbers to 4 significant digits, dicts as ``key: value; ...``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return "; ".join(f"{key}: {_format_value(item)}" for key, item in value.items())
    if isinstance(value, list):
        return ", ".join(_format_value(item) for item in value)
    return str(value)


def _facts(run: _Run, data: pd.DataFrame, types: list[str]) -> list[tuple[str, str]]:
    """The run's key facts as (label, text) rows, from the manifest and the data."""
    manifest = run.manifest
    model_type = _lookup(manifest, "model", "model_type")
    facts = [
        ("model", run.model + (f" ({model_type})" if model_type else "")),
        ("dataset", run.dataset),
        ("examples", _lookup(manifest, "dataset", "n_examples")),
        ("alpha", run.alpha),
        ("attention types", ", ".join(_type_label(t) for t in types) or "none"),
        ("rows", f"{len(data):,} ({int((~data['converged']).sum()):,} not converged)"),
        ("attention implementation", _lookup(manifest, "attention_implementation")),
        ("device", _lookup(manifest, "device")),
        ("dtype", _lookup(manifest, "dtype")),
        ("fidelity", _lookup(manifest, "fidelity")),
        ("solver", _lookup(manifest, "solver")),
        ("status", _lookup(manifest, "status")),
        ("probe version (run)", _lookup(manifest, "probe_version")),
        ("run directory", str(run.run_dir.resolve())),
    ]
    return [(label, _format_value(value)) for label, value in facts]


def _table(frame: pd.DataFrame) -> str:
    """A statistics table as HTML (escaped by pandas), numbers to 4 significant digits."""
    return frame.to_html(index=False, border=0, na_rep="", float_format=lambda v: f"{v:.4g}", classes="stats")


def _page(run: _Run, data: pd.DataFrame, summary: pd.DataFrame, types: list[str], figures: list[_Figure]) -> str:
    """The self-contained index.html: facts, warnings, tables and the figures as PNG data URIs."""
    esc = html.escape
    facts = "\n".join(f"<tr><th>{esc(label)}</th><td>{esc(text)}</td></tr>" for label, text in _facts(run, data, types))
    notes = "".join(f"<li>{esc(note)}</li>" for note in run.notes)
    layer_table = _table(summary[summary["level"] == "layer"].drop(columns=["level", "head"]))
    head_rows = summary[summary["level"] == "head"]
    head_table = _table(head_rows.drop(columns=["level"]))
    images = "\n".join(
        f'<figure id="{esc(f.stem)}"><img alt="{esc(f.caption)}" '
        f'src="data:image/png;base64,{base64.b64encode(f.png).decode("ascii")}">'
        f"<figcaption>{esc(f.caption)} Files: {esc(', '.join(p.name for p in f.files))}.</figcaption></figure>"
        for f in figures
    )
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>probe report: {esc(run.title)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>probe report</h1>
<p>{esc(run.title)}</p>
{f'<ul class="notes">{notes}</ul>' if notes else ""}
<h2>Run</h2>
<table class="facts">
{facts}
</table>
<h2>Relative deviation per layer</h2>
<p>Statistics of ‖λ* − αz‖ / ‖λ*‖ over every example, head and query token of each layer
(p95: 95th percentile; non_converged: rows whose solve did not meet the certificate).</p>
{layer_table if len(data) else "<p>No data.</p>"}
{f"<details><summary>Per head ({len(head_rows)} rows)</summary>{head_table}</details>" if len(data) else ""}
<h2>Figures</h2>
{images or "<p>No data, no figures.</p>"}
<footer>Generated by probe {esc(__version__)} on {generated}; the same numbers are in summary.csv.</footer>
</body>
</html>
"""
