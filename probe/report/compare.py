"""``probe compare RUN_DIR... --out DIR``: several runs on shared axes.

Each run contributes the non-trivial rows of one common slice (alpha = 1 and the hidden space when
every run has them, else the first (space, alpha) all runs share).  Figures:

* ``depth``: per-layer mean (solid) and 95th percentile (dashed) against relative depth
  ``(layer + 1) / number of layers``, so that models of different depth line up; one panel per
  attention type the runs share;
* ``ecdf``: the ECDF of every run, one panel per shared attention type, on one x axis;

and ``compare.csv`` (one row per run and attention type) with ``index.html``.  Its main uses: a
pretrained model against its random-initialisation control, and one model against another.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from probe.core.destination import check_destination, check_replaceable, writing, written_whole
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.spelling import option
from probe.report.data import FAR, ReportRun, lookup, model_of, read_run, require_run_dir, type_label
from probe.report.series import is_series, write_series
from probe.report.style import (
    DEVIATION_LABEL,
    ECDF_BINS,
    Drawn,
    check_formats,
    ecdf,
    new_figure,
    save,
    style,
    suptitle,
)
from probe.store.engine import connect

COMPARE_COLUMNS = ("run", "model", "run_dir", "space", "alpha", "attention_type", "layers", "rows", "trivial", "count", "mean", "median",
                   "p95", "max", f"share_above_{FAR:g}")
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def _slices(run: ReportRun) -> set:
    keys = run.census[["space", "alpha"]].astype({"space": object}).drop_duplicates()
    return {(None if pd.isna(s) else str(s), None if pd.isna(a) else round(float(a), 12))
            for s, a in keys.itertuples(index=False)}


def common_slice(runs: list[ReportRun]) -> tuple[str | None, float | None]:
    """The (space, alpha) every run has: alpha 1 / hidden space preferred; ProbeError when there is none."""
    shared = set.intersection(*(_slices(run) for run in runs))
    if not shared:
        listing = "; ".join(f"{run.name}: " + ", ".join(f"{s or '?'} space α = {a}" for s, a in sorted(
            _slices(run), key=str)) for run in runs)
        raise ProbeError(f"The runs share no (space, alpha) slice, so there is nothing to compare ({listing}). "
                         f"Compare runs made with a common {option('alpha')}.")

    def preference(key):
        space, alpha = key
        return (space != "hidden", alpha is None or not math.isclose(alpha, 1.0), str(space), alpha or 0.0)

    return min(shared, key=preference)


def _labels(runs: list[ReportRun], names: Sequence[str] | None) -> list[str]:
    """One label per run: given names, else model names made unique with the run directory's name."""
    if names:
        if len(names) != len(runs):
            raise ProbeError(f"Give one label per run ({option('names')}): {len(names)} names for {len(runs)} runs.")
        return list(names)
    labels = [run.name for run in runs]
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = f"{label} ({runs[i].run_dir.name})"
    return labels


def comparison_table(runs: list[ReportRun], labels: list[str], types: list[str]) -> pd.DataFrame:
    """Per run and attention type: the slice compared (space, alpha), layers, rows, trivial rows, and statistics
    of the non-trivial rows."""
    records = []
    for run, label in zip(runs, labels):
        stats = run.main_deviation("type").set_index("attention_type")
        for attention_type in types:
            counts = run.counts(attention_type)
            known = attention_type in stats.index and stats.loc[attention_type, "count"] > 0
            value = (lambda c, row=stats.loc[attention_type]: float(row[c])) if known else (lambda c: math.nan)
            records.append({
                "run": label, "model": model_of(run.manifest), "run_dir": run.run_dir.name, "space": run.space,
                "alpha": run.alpha, "attention_type": attention_type,
                "layers": len(run.layers(attention_type)), "rows": counts["rows"], "trivial": counts["trivial"],
                "count": int(stats.loc[attention_type, "count"]) if known else 0, "mean": value("mean"),
                "median": value("median"), "p95": value("p95"), "max": value("max"),
                f"share_above_{FAR:g}": value(f"share_above_{FAR:g}"),
            })
    return pd.DataFrame.from_records(records, columns=list(COMPARE_COLUMNS))


#: the compare page's numbers: this many significant figures, every column
SIGNIFICANT = 3
#: the statistics the compare page shows per run and attention type
NUMBERS = ("layers", "rows", "trivial", "count", "mean", "median", "p95", "max", f"share_above_{FAR:g}")


def rounded(value) -> str:
    """One rounding rule for the compare page: counts in full (with thousands separators), every other number
    to :data:`SIGNIFICANT` significant figures."""
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    if isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1):
        return f"{int(value):,}"
    return f"{float(value):.{SIGNIFICANT}g}"


def is_control(run: ReportRun) -> bool:
    """Whether a run is a control: its weights are a random initialisation (``probe run --init random``)."""
    init = lookup(run.manifest, "model", "init") or lookup(run.manifest, "init")
    return isinstance(init, str) and init not in ("", "pretrained")


def numbers_html(table: pd.DataFrame, labels: list[str], controls: list[bool]) -> str:
    """The compare page's numbers: per attention type one row per run (named once, by its label), and, where
    one of the runs is a control, the control's mean beside each run's."""
    control = labels[controls.index(True)] if any(controls) and not all(controls) else None
    names = {"count": "rows measured", f"share_above_{FAR:g}": f"share above {FAR:g}"}
    header = ["attention type", "run", *(names.get(c, c) for c in NUMBERS)] + (
        ["control's mean", "mean / control's"] if control else [])
    rows = []
    for record in table.to_dict("records"):
        cells = [type_label(record["attention_type"]), record["run"], *(rounded(record[c]) for c in NUMBERS)]
        if control and record["run"] == control:
            cells += ["", ""]
        elif control:
            reference = table[(table["run"] == control) & (table["attention_type"] == record["attention_type"])]
            mean = float(reference["mean"].iloc[0]) if len(reference) else math.nan
            cells += [rounded(mean), rounded(record["mean"] / mean) if mean > 0 else ""]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in cells) + "</tr>")
    return ('<table class="numbers"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"
            + "".join(rows) + "</table>")


def headline_lines(table: pd.DataFrame) -> list[str]:
    """The headline comparison in words, for a terminal: the slice the runs share, then per run (and attention
    type) its non-trivial rows, their mean, p95 and share above 0.1 (``table``: :func:`comparison_table`, as
    ``compare.csv`` holds it)."""
    first = table.iloc[0]
    where = ", ".join(part for part in (
        f"{first['space']} space" if isinstance(first["space"], str) else "",
        f"alpha {first['alpha']:g}" if pd.notna(first["alpha"]) else "") if part)
    width = max(len(str(run)) for run in table["run"])
    several = table["attention_type"].nunique() > 1
    return [f"rel_deviation{', ' + where if where else ''}, over the non-trivial rows:"] + [
        f"  {str(row['run']).ljust(width)}  " + (f"{type_label(row['attention_type'])}: " if several else "")
        + f"{int(row['count']):,} rows: mean {rounded(row['mean'])}, p95 {rounded(row['p95'])}, "
        f"{row[f'share_above_{FAR:g}']:.1%} above {FAR:g}"
        for row in table.to_dict("records")
    ]


def difference_sentences(table: pd.DataFrame, labels: list[str], controls: list[bool]) -> list[str]:
    """Per attention type, the difference between the runs in one sentence: each run's mean relative deviation
    as a multiple of the reference run's (the control, when one run is; else the first run)."""
    reference = controls.index(True) if any(controls) and not all(controls) else 0
    out = []
    for attention_type in dict.fromkeys(table["attention_type"]):
        part = table[table["attention_type"] == attention_type].set_index("run")
        base = float(part.loc[labels[reference], "mean"])
        others = []
        for label in labels:
            if label == labels[reference]:
                continue
            mean = float(part.loc[label, "mean"])
            if np.isfinite(mean) and np.isfinite(base) and base > 0:
                others.append(f"{label}'s mean relative deviation is {rounded(mean / base)}x "
                              f"{labels[reference]}'s ({rounded(mean)} vs {rounded(base)})")
        if others:
            out.append(f"{type_label(attention_type)}: " + "; ".join(others) + ".")
    return out


def relative_depth(layers: pd.Series | np.ndarray, n_layers: int) -> np.ndarray:
    """``(layer + 1) / n_layers``: 1 is the last layer whatever the model's depth."""
    return (np.asarray(layers, dtype=float) + 1) / n_layers


def depth_figure(runs: list[ReportRun], labels: list[str], types: list[str], x_max: float, title: str) -> Drawn:
    figure = new_figure(max(6.5, 4.4 * len(types) + 1.0), 4.6)
    axes = figure.subplots(1, len(types), squeeze=False, sharey=True)[0]
    for ax, attention_type in zip(axes, types):
        for (run, label), color in zip(zip(runs, labels), RUN_COLORS * 4):
            by_layer = run.main_deviation("layer", attention_type).set_index("layer").sort_index()
            n_layers = max(run.layers(attention_type)) + 1
            ax.plot(relative_depth(by_layer.index, n_layers), by_layer["mean"].to_numpy(), color=color, marker="o",
                    label=f"{label}: mean")
            ax.plot(relative_depth(by_layer.index, n_layers), by_layer["p95"].to_numpy(), color=color, marker="o",
                    linestyle="--", label=f"{label}: p95")
        ax.set_title(type_label(attention_type))
        ax.set_xlabel("relative depth (layer + 1) / layers")
        ax.set_xlim(0, 1.05)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(0, -0.2), ncol=2, frameon=False)
    axes[0].set_ylim(0, x_max * 1.05)
    axes[0].set_ylabel(DEVIATION_LABEL)
    details = suptitle(figure, title, "trivial rows left out", "y axis from 0, shared by every panel and run")
    caption = ("Per-layer mean (solid) and 95th percentile (dashed) against relative depth, every run on the "
               f"same axes. {details}")
    return Drawn("depth", caption, figure)


def ecdf_figure(runs: list[ReportRun], labels: list[str], types: list[str], x_max: float, title: str) -> Drawn:
    figure = new_figure(max(6.5, 4.4 * len(types) + 1.0), 4.4)
    axes = figure.subplots(1, len(types), squeeze=False, sharex=True, sharey=True)[0]
    edges = np.linspace(0.0, x_max * 1.02, ECDF_BINS + 1)
    counted = [run.table.histogram("rel_deviation", edges, ("attention_type",), run.measured_where)
               if run.aggregates is None else run.aggregates.histogram(
                   "rel_deviation", edges, ("attention_type",), {"space": run.space, "alpha": run.alpha})
               for run in runs]
    for ax, attention_type in zip(axes, types):
        for (counts, label), color in zip(zip(counted, labels), RUN_COLORS * 4):
            part = counts[counts["attention_type"] == attention_type]
            binned = np.zeros(ECDF_BINS, dtype=np.int64)
            binned[part["bin"].to_numpy(dtype=np.int64)] = part["count"].to_numpy()
            ecdf(ax, binned, edges, color=color, label=label, linewidth=1.3)
        ax.set_title(type_label(attention_type))
        ax.set_xlabel(DEVIATION_LABEL)
        ax.legend(fontsize="x-small", loc="lower right")
    axes[0].set_xlim(0, x_max * 1.02)
    axes[0].set_ylim(0, 1)
    axes[0].set_ylabel("fraction of rows ≤ x")
    details = suptitle(figure, title, "over every non-trivial row", "x axis shared by every panel and run")
    caption = f"ECDF of the relative deviation of every run, per attention type, on one x axis. {details}"
    return Drawn("ecdf", caption, figure)


def _interventions_html(runs: list[ReportRun], labels: list[str], out_dir: Path, allow_damaged: bool) -> str:
    """Runs with ``--intervene``: their mean effects per (site, substitute) side by side, written to
    ``compare_interventions.csv`` too; "" unless at least two of the runs have interventions."""
    from probe.report.interventions import compare_effects, effects, open_interventions

    tables = []
    for run, label in zip(runs, labels):
        records = open_interventions(run.run_dir, run.manifest, allow_damaged=allow_damaged,
                                     connection=run.table.connection)
        table = effects(records)[0] if records is not None else None
        if table is not None and not table.empty:
            tables.append((table, label))
    if len(tables) < 2:
        return ""
    table = compare_effects([t for t, _ in tables], [label for _, label in tables])
    table.to_csv(out_dir / "compare_interventions.csv", index=False)
    return ("<h2>Interventions</h2><p>Mean effect of each substitute per attention site and for the whole model "
            "(whole), run by run (compare_interventions.csv).</p>"
            + table.to_html(index=False, border=0, na_rep="", float_format=lambda v: f"{v:.4g}"))


def compare_runs(
    run_dirs: Sequence[str | Path], out_dir: str | Path = "compare", formats: Sequence[str] = ("png",),
    *, names: Sequence[str] | None = None, allow_damaged: bool = False,
) -> Path:
    """Compare runs on shared axes; write ``depth`` and ``ecdf`` figures, ``compare.csv`` and ``index.html``.

    The comparison is written whole or not at all (:func:`probe.core.destination.written_whole`): ``out_dir``
    holds the previous comparison until the new one is complete; a folder holding other files is refused.
    Raises :class:`ProbeError` for fewer than two runs, a run given twice, runs that share no attention
    type or no (space, alpha) slice, and for everything :func:`probe.report.data.read_run` rejects.
    """
    check_environment()
    formats = check_formats(formats)
    paths = [Path(p) for p in run_dirs]
    if len(paths) < 2:
        raise ProbeError("Give at least two run directories to compare (e.g. a model and its "
                         f"{option('init', 'random')} control).")
    resolved = [p.resolve() for p in paths]
    if len(set(resolved)) < len(resolved):
        raise ProbeError("A run directory is given twice; give each run once.")
    for path in paths:
        require_run_dir(path)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ProbeError(f"{out_dir} exists and is not a directory. Choose another {option('out')}.")
    check_replaceable(out_dir, "out", "comparison", COMPARE_MARKER)
    check_destination(out_dir, "out")  # before any run is read: writable, with room
    connection = connect()  # one DuckDB, one memory budget, for every run
    try:
        with writing("the comparison", out_dir), written_whole(out_dir) as staging:
            _compare(paths, staging, formats, names, allow_damaged, connection)
    finally:
        connection.close()
    return out_dir


#: the file every comparison holds (its first): a folder with it is an earlier comparison, which a new one replaces whole
COMPARE_MARKER = "compare.csv"


def _compare(paths: list[Path], out_dir: Path, formats, names, allow_damaged: bool, connection) -> None:
    """The comparison's files, written into ``out_dir`` (the hidden folder :func:`compare_runs` moves into place)."""
    runs = [read_run(path, allow_damaged=allow_damaged, connection=connection, view=f"rows_{i}")
            for i, path in enumerate(paths)]
    empty = [str(run.run_dir) for run in runs if not run.counts(main=False)["rows"]]
    if empty:
        raise ProbeError(f"These runs have no rows, so there is nothing to compare: {', '.join(empty)}.")
    shared_types = [t for t in runs[0].types if all(t in run.types for run in runs[1:])]
    if not shared_types:
        listing = "; ".join(f"{run.name}: {', '.join(run.types)}" for run in runs)
        raise ProbeError(f"The runs share no attention type, so there is nothing to compare ({listing}).")
    space, alpha = common_slice(runs)
    runs = [replace(run, space=space, alpha=alpha, memo={}) for run in runs]
    labels = _labels(runs, names)
    table = comparison_table(runs, labels, shared_types)
    x_max = float(np.nanmax(table["max"].to_numpy(dtype=float))) if table["max"].notna().any() else 1.0
    x_max = x_max if x_max > 0 else 1.0
    title = f"{' vs '.join(labels)} · {runs[0].slice_text}"

    table.to_csv(out_dir / "compare.csv", index=False)
    series_part = ""
    with style():
        drawn = [depth_figure(runs, labels, shared_types, x_max, title),
                 ecdf_figure(runs, labels, shared_types, x_max, title)]
        if is_series(runs):  # runs that record their training step: drawn against it (probe.report.series)
            series_part, more = write_series(runs, labels, shared_types, out_dir, title)
            drawn = more + drawn
        saved = [save(each, out_dir, formats) for each in drawn]
    esc = html.escape
    images = "".join(
        f'<figure><img alt="{esc(s.caption)}" width="{s.size_px[0]}" height="{s.size_px[1]}" '
        f'src="data:image/png;base64,{base64.b64encode(s.png).decode("ascii")}"><figcaption>{esc(s.caption)}'
        f"</figcaption></figure>" for s in saved
    )
    controls = [is_control(run) for run in runs]
    run_rows = "".join(
        f"<tr><th>{esc(label)}</th><td>{esc(model_of(run.manifest))}</td><td>{esc(run.dataset)}</td>"
        f"<td>{esc(run.run_dir.name)}</td><td>{'control (random initialisation)' if control else 'pretrained'}</td>"
        f"<td>{esc(run.measured or 'every layer, head and query position')}</td></tr>"
        for run, label, control in zip(runs, labels, controls))
    runs_html = ("<table class=\"runs\"><tr><th>run</th><th>model</th><th>data</th><th>run directory</th><th>weights</th>"
                 f"<th>measured</th></tr>{run_rows}</table>")
    differences = "".join(f"<li>{esc(sentence)}</li>" for sentence in difference_sentences(table, labels, controls))
    table_html = numbers_html(table, labels, controls)
    table_html += _interventions_html(runs, labels, out_dir, allow_damaged) + series_part
    (out_dir / "index.html").write_text(
        f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>probe compare: {esc(title)}</title>
<style>body {{ font-family: system-ui, sans-serif; max-width: 1280px; margin: 0 auto; padding: 0.6em 1.2em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }} th, td {{ padding: 0.15em 0.6em;
border-bottom: 1px solid #e5e5e5; text-align: right; }} table.runs td, table.runs th {{ text-align: left; }}
.wide {{ overflow-x: auto; max-width: 100%; margin: 0.5em 0; }} .note {{ font-size: 0.85em; color: #555; }}
figure {{ margin: 1em 0; }} figure img {{ max-width: 100%; height: auto; }}</style></head>
<body><h1>probe compare</h1><p>{esc(title)}. Trivial rows (one key) are left out of every statistic.</p>
<ul class="differences">{differences}</ul>
<div class="wide">{runs_html}</div><div class="wide">{table_html}</div>
<p class="note">Numbers to {SIGNIFICANT} significant figures (compare.csv: in full); counts in full.</p>{images}</body></html>
""",
        encoding="utf-8",
    )
