"""Runs of one model over training, drawn against their step: the part of ``probe compare`` for runs that record
a training step (``config.step``: :mod:`probe.training.series`, :class:`probe.callbacks.ProbeCallback`).

Per attention type, for the whole model and per layer, in the common slice of the comparison and over its
non-trivial rows: the mean relative deviation, its 95th percentile and the share of rows above 0.1, each with
a 95% bootstrap interval over the examples (the rows of one example are not independent).  The bootstrap:
``numpy.random.default_rng(SEED)`` draws :data:`REPLICATES` samples of the run's examples with replacement
(``rng.integers(0, E, size=(REPLICATES, E))`` over the examples sorted by id, one draw per run and attention
type, shared by its layers); a replicate's mean and share are its examples' rows pooled, its p95 is read from
the pooled histogram of :data:`P95_BINS` equal bins from 0 to the type's maximum (linear within a bin, so its
interval is exact to one bin width); the interval is the 2.5th to 97.5th percentile of the replicates.  A run of
more than :data:`MAX_UNITS` examples resamples blocks of consecutive examples instead, at most that many, so that
memory stays bounded (``E`` is then the number of blocks).  A run that kept aggregates (``--keep``) gives the
per-example sums and per-example histograms it kept (:mod:`probe.store.aggregates`: coarse bins of 1/128 below 4),
so its p95 intervals are exact to one such bin.

Written: ``series.csv`` (one row per run, attention type and layer, ``layer`` empty for the whole model),
``series_findings.csv`` (the report's findings, :mod:`probe.report.findings`, that appear or vanish from one step
to the next), and the figures ``series`` (whole model) and ``series_layers`` (one line per layer).
"""

from __future__ import annotations

import html
import json
import math

import numpy as np
import pandas as pd

from probe.report.data import FAR, ReportRun, lookup, type_label
from probe.report.style import DEVIATION_LABEL, Drawn, layer_colors, new_figure, suptitle

#: bootstrap replicates
REPLICATES = 1000
#: the seed of their draws
SEED = 0
#: the interval's level
LEVEL = 0.95
#: at most this many resampled units: a run of more examples resamples blocks of consecutive examples (by id)
MAX_UNITS = 5000
#: the equal bins, from 0 to the type's maximum, a replicate's p95 is read from
P95_BINS = 1024
SHARE = f"share_above_{FAR:g}"
#: the statistics drawn against the step, each with ``_low`` and ``_high`` columns in ``series.csv``
STATISTICS = ("mean", "p95", SHARE)
SERIES_COLUMNS = ("step", "run", "run_dir", "checkpoint", "attention_type", "layer", "examples", "count",
                  *(f"{s}{end}" for s in STATISTICS for end in ("", "_low", "_high")))
FINDING_COLUMNS = ("step", "event", "attention_type", "finding", "ratio", "text")


def steps(runs: list[ReportRun]) -> list[int | None]:
    """Each run's training step as its manifest records it (``config.step``), None where it has none."""
    found = [lookup(run.manifest, "config", "step") for run in runs]
    return [int(step) if isinstance(step, int) and not isinstance(step, bool) else None for step in found]


def is_series(runs: list[ReportRun]) -> bool:
    """Whether the runs are one series: every run records a step, each a different one."""
    found = steps(runs)
    return all(step is not None for step in found) and len(set(found)) == len(found)


def draws(examples: int, replicates: int = REPLICATES, seed: int = SEED) -> np.ndarray:
    """How often each example is drawn in each replicate, ``(replicates, examples)`` (the module's docstring)."""
    picks = np.random.default_rng(seed).integers(0, examples, size=(replicates, examples))
    counts = np.zeros((replicates, examples), dtype=np.float64)
    np.add.at(counts, (np.arange(replicates)[:, None], picks), 1.0)
    return counts


def histogram_quantile(counts: np.ndarray, edges: np.ndarray, q: float, *, equal: bool = True) -> np.ndarray:
    """The linear ``q`` quantile (numpy's and pandas' default) of values known by their histograms (one per row
    of ``counts``), each bin's values taken as evenly spread within it: exact to one bin width.  ``equal``: the
    bins have one width (else each its own, as the aggregates' coarse bins)."""
    counts = np.atleast_2d(counts)
    total = counts.sum(axis=1)
    position = q * (total - 1)  # 0-based order statistic, between two of them
    cumulative = np.cumsum(counts, axis=1)

    def order_statistic(rank):  # the rank-th value (0-based) of each row
        bins = np.array([np.searchsorted(row, r, side="right") for row, r in zip(cumulative, rank, strict=True)])
        bins = np.minimum(bins, counts.shape[1] - 1)
        before = np.where(bins > 0, cumulative[np.arange(len(bins)), bins - 1], 0)
        inside = counts[np.arange(len(bins)), bins]
        width = edges[1] - edges[0] if equal else edges[bins + 1] - edges[bins]
        return edges[bins] + (rank - before + 0.5) / np.maximum(inside, 1) * width

    low, high = np.floor(position), np.ceil(position)
    return order_statistic(low) + (position - low) * (order_statistic(high) - order_statistic(low))


def _interval(values: np.ndarray) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan, math.nan
    low, high = np.quantile(values, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return float(low), float(high)


def checkpoint(run: ReportRun) -> str:
    """Where the run's weights came from, as its manifest records them: the model's path or hub id, with its
    revision (``MODEL@REV``) and ``(random init)`` for a random initialisation."""
    config = run.manifest.get("config") or {}
    where = str(config.get("model") or "")
    if config.get("revision"):
        where += f"@{config['revision']}"
    return where + (" (random init)" if config.get("init") == "random" else "")


def run_statistics(run: ReportRun, attention_type: str, label: str, step: int) -> list[dict]:
    """The rows of ``series.csv`` for one run and attention type: the whole model, then each layer."""
    measured = f"{run.measured_where} AND attention_type = '{attention_type}'"
    kept = {"space": run.space, "alpha": run.alpha, "attention_type": attention_type}
    if run.aggregates is not None:  # the per-example sums and coarse histograms the aggregates keep
        sums = run.aggregates.example_sums(kept)
    else:
        (sums,) = run.table.aggregate(
            {"n": "CAST(count(rel_deviation) AS BIGINT)", "sum": "fsum(rel_deviation)",
             "above": f"CAST(count_if(rel_deviation > {FAR!r}) AS BIGINT)"}, [("layer", "example")], measured)
    sums = sums[sums["n"] > 0]
    if sums.empty:
        return []
    examples = np.sort(sums["example"].unique())
    block = math.ceil(len(examples) / MAX_UNITS)  # examples per resampled unit: 1 up to MAX_UNITS examples
    units = math.ceil(len(examples) / block)
    weights = draws(units)
    column = np.searchsorted(examples, sums["example"].to_numpy()) // block
    layer_stats = run.main_deviation("layer", attention_type).set_index("layer")
    whole = run.main_deviation("type", attention_type).iloc[0]
    x_max = float(whole["max"]) if float(whole["max"]) > 0 else 1.0
    if run.aggregates is not None:
        from probe.store.aggregates import COARSE_EDGES

        edges = np.r_[COARSE_EDGES[:-1], max(x_max, COARSE_EDGES[-2] * 2)]
        counted = run.aggregates.example_histograms(kept)
    else:
        edges = np.linspace(0.0, x_max, P95_BINS + 1)
        counted = run.table.histogram("rel_deviation", edges, ("layer", "example"), measured)
    bins = len(edges) - 1
    layers = sorted(int(layer) for layer in sums["layer"].unique())
    records = []
    for layer in [None, *layers]:
        pick = np.ones(len(sums), dtype=bool) if layer is None else (sums["layer"] == layer).to_numpy()
        per_example = {key: np.bincount(column[pick], sums[key].to_numpy(dtype=float)[pick], units)
                       for key in ("n", "sum", "above")}
        n = weights @ per_example["n"]
        with np.errstate(invalid="ignore", divide="ignore"):
            means, shares = (weights @ per_example["sum"]) / n, (weights @ per_example["above"]) / n
        part = counted if layer is None else counted[counted["layer"] == layer]
        histogram = np.zeros((units, bins))
        np.add.at(histogram, (np.searchsorted(examples, part["example"].to_numpy()) // block,
                              part["bin"].to_numpy(dtype=int)),
                  part["count"].to_numpy(dtype=float))
        pooled = weights @ histogram
        p95s = np.where(pooled.sum(axis=1) > 0, histogram_quantile(pooled, edges, 0.95,
                                                                   equal=run.aggregates is None), np.nan)
        point = whole if layer is None else layer_stats.loc[layer]
        record = {"step": step, "run": label, "run_dir": run.run_dir.name, "checkpoint": checkpoint(run),
                  "attention_type": attention_type,
                  "layer": layer, "examples": int(sums.loc[pick, "example"].nunique()), "count": int(point["count"])}
        for statistic, replicates in (("mean", means), ("p95", p95s), (SHARE, shares)):
            record[statistic] = float(point[statistic])
            record[f"{statistic}_low"], record[f"{statistic}_high"] = _interval(replicates)
        records.append(record)
    return records


def series_table(runs: list[ReportRun], labels: list[str], types: list[str]) -> pd.DataFrame:
    """``series.csv``: every run (in step order), attention type and layer (the whole model first)."""
    records = []
    for run, label, step in sorted(zip(runs, labels, steps(runs), strict=True), key=lambda item: item[2]):
        for attention_type in types:
            records += run_statistics(run, attention_type, label, step)
    table = pd.DataFrame.from_records(records, columns=list(SERIES_COLUMNS))
    table["layer"] = table["layer"].astype("Int64")
    return table


def _descriptions(found: dict) -> set:
    """A finding's descriptions (its own and those of the same rows), as comparable keys."""
    return {(found["attention_type"], d["kind"], json.dumps(d["value"])) for d in [found, *found["same_rows"]]}


def finding_events(runs: list[ReportRun], labels: list[str]) -> pd.DataFrame:
    """``series_findings.csv``: in step order, the findings of the first run (``present``), and from one step to
    the next those that appear (none of their descriptions found at the step before) or vanish (none found at
    this step)."""
    from probe.report.findings import findings

    events, before = [], None
    for run, _label, step in sorted(zip(runs, labels, steps(runs), strict=True), key=lambda item: item[2]):
        now = findings(run)
        now_keys = set().union(*(_descriptions(f) for f in now)) if now else set()
        before_keys = set().union(*(_descriptions(f) for f in before)) if before else set()
        for found in now:
            if before is None or not (_descriptions(found) & before_keys):
                events.append({"step": step, "event": "present" if before is None else "appears",
                               "attention_type": found["attention_type"], "finding": found["name"],
                               "ratio": found["ratio"], "text": found["text"]})
        for found in before or []:
            if not (_descriptions(found) & now_keys):
                events.append({"step": step, "event": "vanishes", "attention_type": found["attention_type"],
                               "finding": found["name"], "ratio": found["ratio"], "text": found["text"]})
        before = now
    return pd.DataFrame.from_records(events, columns=list(FINDING_COLUMNS))


#: at most this many steps get a tick each; more get whole-number ticks where matplotlib puts them
STEP_TICKS = 10


def _x_axis(ax, values) -> None:
    """The training step: whole numbers only (a tick at each step when there are few), on a symmetric log
    scale when the steps span more than a factor of 100."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    steps = sorted({int(v) for v in values})
    positive = [v for v in steps if v > 0]
    logarithmic = bool(positive) and max(positive) / min(positive) > 100
    if logarithmic:
        ax.set_xscale("symlog", linthresh=min(positive))
    if len(steps) <= STEP_TICKS:
        ax.set_xticks(steps)
        ax.minorticks_off()
    elif not logarithmic:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.set_xlabel("training step")


NAMES = {"mean": "mean", "p95": "95th percentile", SHARE: f"share of rows above {FAR:g}"}


def series_figure(table: pd.DataFrame, types: list[str], title: str, *, by_layer: bool) -> Drawn:
    """The statistics against the step, one row of panels per attention type: the whole model with its
    intervals, or (``by_layer``) one line per layer with its intervals as a band."""
    figure = new_figure(13.0, 3.6 * len(types) + 0.8)
    axes = figure.subplots(len(types), len(STATISTICS), squeeze=False)
    for row, attention_type in zip(axes, types, strict=True):
        part = table[table["attention_type"] == attention_type]
        whole = part[part["layer"].isna()]
        layers = sorted(int(layer) for layer in part["layer"].dropna().unique())
        for ax, statistic in zip(row, STATISTICS, strict=True):
            if by_layer:
                for layer, color in zip(layers, layer_colors(len(layers)), strict=True):
                    line = part[part["layer"] == layer]
                    ax.plot(line["step"], line[statistic], color=color, marker="o", markersize=3,
                            label=f"layer {layer}")
                    ax.fill_between(line["step"], line[f"{statistic}_low"], line[f"{statistic}_high"], color=color,
                                    alpha=0.12, linewidth=0)
            else:
                ax.errorbar(whole["step"], whole[statistic],
                            yerr=[whole[statistic] - whole[f"{statistic}_low"],
                                  whole[f"{statistic}_high"] - whole[statistic]],
                            color="#1f77b4", marker="o", capsize=3, label="whole model")
            ax.set_title(f"{type_label(attention_type)}: {NAMES[statistic]}", fontsize="medium")
            ax.set_ylabel(DEVIATION_LABEL if statistic != SHARE else f"share above {FAR:g}")
            ax.set_ylim(bottom=0)
            _x_axis(ax, part["step"])
        if by_layer:  # beside the panels, never over the lines
            row[-1].legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                           ncol=1 + len(layers) // 13)
    details = suptitle(figure, title, "trivial rows left out",
                       f"{LEVEL:.0%} bootstrap intervals over the examples ({REPLICATES} replicates)"
                       + ("; bands: per layer" if by_layer else "; bars: whole model"))
    what = "each layer's" if by_layer else "the whole model's"
    caption = (f"Over training: {what} mean, 95th percentile and share of rows above {FAR:g} of the relative "
               f"deviation against the training step. {details}")
    return Drawn("series_layers" if by_layer else "series", caption, figure, wide=True)


def _cell(value, low, high) -> str:
    if value is None or not np.isfinite(value):
        return ""
    return f"{value:.3g} [{low:.3g}, {high:.3g}]" if np.isfinite(low) else f"{value:.3g}"


def series_html(table: pd.DataFrame, events: pd.DataFrame, measured: str | None = None) -> str:
    """The page's part: the whole model's numbers per step, and the findings that appear or vanish;
    ``measured``: what the runs measured, when they selected part of the model."""
    esc = html.escape
    measured = f". Each run measured {esc(measured)}" if measured else ""
    whole = table[table["layer"].isna()]
    header = "".join(f"<th>{esc(h)}</th>" for h in ("attention type", "step", "run", "checkpoint", "rows measured",
                                                     *(NAMES[s] + f" [{LEVEL:.0%} interval]" for s in STATISTICS)))
    rows = "".join(
        "<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in (
            type_label(r["attention_type"]), f"{r['step']:,}", r["run"], r["checkpoint"], f"{r['count']:,}",
            *(_cell(r[s], r[f"{s}_low"], r[f"{s}_high"]) for s in STATISTICS))) + "</tr>"
        for r in whole.to_dict("records"))
    said = {"present": "found at the first step", "appears": "appears", "vanishes": "vanishes"}
    items = "".join(f"<li>step {r['step']:,}: {esc(said[r['event']])}: {esc(r['text'])}</li>"
                    for r in events.to_dict("records"))
    return (f"<h2>Over training</h2><p>The runs in step order (series.csv, per layer too; {LEVEL:.0%} bootstrap "
            f"intervals over the examples){measured}.</p><div class=\"wide\"><table class=\"numbers\"><tr>{header}</tr>{rows}"
            f"</table></div><h3>Findings along the way</h3><p>The report's findings that appear or vanish from one "
            f"step to the next (series_findings.csv).</p><ul class=\"findings\">{items or '<li>none</li>'}</ul>")


def write_series(runs: list[ReportRun], labels: list[str], types: list[str], out_dir, title: str):
    """``series.csv``, ``series_findings.csv``, the page's part and the two figures (to be saved by the caller,
    inside :func:`probe.report.style.style`)."""
    table = series_table(runs, labels, types)
    events = finding_events(runs, labels)
    table.to_csv(out_dir / "series.csv", index=False)
    events.to_csv(out_dir / "series_findings.csv", index=False)
    figures = [series_figure(table, types, title, by_layer=False), series_figure(table, types, title, by_layer=True)]
    return series_html(table, events, runs[0].measured), figures
