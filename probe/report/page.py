"""``index.html``: one self-contained page that opens on the finding.

First screen: the model, data, rows, certification and fidelity in one line; the headline numbers
(per attention type, and mean / p95 per layer); the computed findings.  Then the explorer (clickable
heatmaps and filters), the figures (PNG data URIs, click to open at full size), the statistics tables
and the run's facts.  No external script, style sheet, font or URL.
"""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone

import numpy as np
import pandas as pd

from probe.capture.tokens import describe as describe_unknown
from probe.core.version import __version__
from probe.report import explorer
from probe.report.data import ReportRun, lookup, model_of, type_label
from probe.report.findings import RULE
from probe.report.style import Saved
from probe.report.summary import FAR, headline, main_rows, scale_words

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1280px;
       padding: 0.6em 1.2em 2em; color: #222; line-height: 1.35; }
h1 { font-size: 1.35em; margin: 0.2em 0; } h2 { margin-top: 1.4em; border-bottom: 1px solid #ddd; font-size: 1.2em; }
h3 { font-size: 1em; margin: 0.8em 0 0.3em; }
.oneline { margin: 0.2em 0; font-size: 0.95em; } .slice { margin: 0.2em 0; color: #555; font-size: 0.9em; }
.landing { display: grid; grid-template-columns: minmax(300px, 1fr) minmax(360px, 1.3fr); gap: 0.4em 1.6em;
           align-items: start; }
.numbers { display: flex; flex-wrap: wrap; gap: 0.4em 1.2em; margin: 0.3em 0; }
.number { font-size: 0.85em; color: #555; } .number b { display: block; font-size: 1.5em; color: #111; }
.number .control { display: block; font-size: 0.9em; color: #777; }
ul.scale { margin: 0.2em 0 0.6em; padding-left: 1.2em; font-size: 0.9em; }
p.note { font-size: 0.82em; color: #555; margin: 0.2em 0 0.6em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.3em 0; }
th, td { padding: 0.15em 0.55em; border-bottom: 1px solid #e5e5e5; text-align: right; vertical-align: top; }
th { background: #f3f3f3; } table.facts th, table.facts td { text-align: left; }
.wide-table { overflow-x: auto; max-width: 100%; }
ul.findings { margin: 0.2em 0; padding-left: 1.2em; font-size: 0.92em; } ul.findings li { margin: 0.15em 0; }
.notes { background: #fff4e5; border-left: 4px solid #e69500; padding: 0.4em 1em 0.4em 2em; margin: 0.4em 0; }
nav { margin: 0.8em 0; font-size: 0.9em; } nav a { margin-right: 1em; }
.filters { position: sticky; top: 0; background: #fff; padding: 0.4em 0; z-index: 2; font-size: 0.9em; }
.filters span { margin: 0 0.3em 0 0.8em; color: #555; }
button.filter { border: 1px solid #bbb; background: #f7f7f7; border-radius: 3px; margin: 0 0.1em; cursor: pointer; }
button.filter.active { background: #4c72b0; color: #fff; border-color: #4c72b0; }
.explorer { display: grid; grid-template-columns: minmax(0, min-content) minmax(320px, 1fr); gap: 1em;
            align-items: start; }
.explorer:has(#head-panel[hidden]) { grid-template-columns: minmax(0, 1fr); }
.explorer > div:first-child { overflow-x: auto; }
@media (max-width: 1000px) { .explorer { grid-template-columns: minmax(0, 1fr); } }
@media (max-width: 720px) { .landing { grid-template-columns: minmax(0, 1fr); } }
table.heat td.cell { cursor: pointer; min-width: 2.6em; height: 1.5em; text-align: center; font-size: 0.85em;
                     border: 1px solid #fff; }
table.heat th, table.heat td { padding: 0.15em 0.25em; } table.heat th { white-space: nowrap; }
table.heat.dense th, table.heat.dense td { padding: 0.15em 0.1em; } table.heat.dense td.cell { min-width: 1.4em; }
table.heat td.cell.selected { outline: 3px solid #d62728; outline-offset: -3px; }
.legend .ramp { display: inline-block; width: 160px; height: 0.8em; vertical-align: middle; }
#head-panel { border: 1px solid #ddd; padding: 0.5em 0.8em; position: sticky; top: 2.6em; min-width: 0;
              overflow-x: auto; }
#head-panel svg.hist { max-width: 100%; height: auto; }
#head-worst td.ctx { text-align: left; max-width: 420px; } #head-worst mark { background: #ffd54f; }
#head-worst .text { color: #666; font-size: 0.9em; margin-top: 0.2em; }
.hint { color: #666; font-size: 0.85em; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; cursor: zoom-in; }
figure.wide img { width: 100%; } figcaption { font-size: 0.88em; color: #555; }
#lightbox { position: fixed; inset: 0; background: rgba(0,0,0,0.85); overflow: auto; z-index: 10; cursor: zoom-out; }
#lightbox img { display: block; margin: 1em auto; max-width: none; background: #fff; }
footer { margin-top: 3em; color: #888; font-size: 0.8em; }
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


def _model(run: ReportRun) -> str:
    """The model's own name, which a run named with ``--name`` shows beside its name."""
    model = model_of(run.manifest)
    return run.name if model == "unknown model" else model


def one_line(run: ReportRun) -> str:
    """Model · data · rows · certification · fidelity, from the data and the manifest."""
    main = run.counts()
    trivial = main["trivial"]
    non_converged = run.counts(main=False)["non_converged"]
    certified = "every solve certified" if non_converged == 0 else f"{non_converged:,} solves not certified"
    bound = lookup(run.manifest, "solver", "max_relative_error_bound")
    if isinstance(bound, (int, float)) and not isinstance(bound, bool):
        certified += f" (relative error bound ≤ {bound:.1e})"
    fidelity = lookup(run.manifest, "fidelity")
    if isinstance(fidelity, dict) and "passed" in fidelity:
        error, tolerance = fidelity.get("max_abs_error"), fidelity.get("tolerance")
        detail = f" ({error:.1e} ≤ {tolerance:.0e})" if isinstance(error, float) and isinstance(tolerance, float) else ""
        fidelity_text = f"fidelity {'passed' if fidelity['passed'] else 'FAILED'}{detail}"
    else:
        fidelity_text = "fidelity unknown"
    revision = lookup(run.manifest, "model", "revision")
    model = _model(run)
    model = (f"{run.name} ({model})" if model != run.name else model) + (
        f" @ {str(revision)[:12]}" if isinstance(revision, str) and revision else "")
    return (
        f"<b>{html.escape(model)}</b> · {html.escape(run.dataset)} · {main['rows']:,} rows "
        f"({trivial:,} trivial left out) · {html.escape(certified)} · {html.escape(fidelity_text)}"
    )


def slice_line(run: ReportRun) -> str:
    """Which slice the page shows, and which others the run holds."""
    others = []
    if len(run.alphas) > 1:
        others.append("α ∈ {" + ", ".join(f"{a:g}" for a in run.alphas) + "}")
    if len(run.spaces) > 1:
        others.append("spaces: " + ", ".join(run.spaces))
    text = f"Main figures and numbers: {run.slice_text}"
    if others:
        text += f" (the run also has {'; '.join(others)}: see the α and space figures and summary.csv)"
    if run.measured:
        text += f". Measured: {run.measured} (the run's selection; other rows were not measured)"
    return html.escape(text + ". Trivial rows (one key, λ* = αz exactly) are left out of every statistic.")


def headline_html(run: ReportRun, control: dict | None = None) -> str:
    """The page's headline, as HTML: the numbers per attention type (with the control run's beside them),
    then what they mean in words (:func:`probe.report.summary.scale_words`)."""
    by_type = (control or {}).get("by_type", {})
    parts, words = [], []
    for item in headline(run):
        label = html.escape(type_label(item["attention_type"]))
        other = by_type.get(item["attention_type"])
        for name, key, fmt in (("mean", "mean", ".3f"), ("p95", "p95", ".3f"), ("max", "max", ".3f"),
                               (f"rows above {FAR:g}", f"share_above_{FAR:g}", ".1%")):
            text = _number(item[key], fmt)
            beside = f'<span class="control">control {_number(other[key], fmt)}</span>' if other else ""
            parts.append(f'<div class="number">{label} {name}<b>{text}</b>{beside}</div>')
        words.append(f"<li>{html.escape(scale_words(item, other))}</li>")
    meaning = ("0 means attention is exactly the closed form of the posterior: the exact solution λ* of the dual "
               "is αz, the λ that gives softmax attention.")
    if control:
        meaning += (f" Control: {control['model']} ({control['run_dir']}), the same numbers over its rows."
                    + (f" {control['note']}" if control.get("note") else ""))
    return (f'<div class="numbers">{"".join(parts)}</div>'
            f'<p class="note scale">{html.escape(meaning)}</p><ul class="scale">{"".join(words)}</ul>')


def _number(value, fmt: str) -> str:
    return "–" if value is None or not np.isfinite(value) else format(value, fmt)


def layer_table(run: ReportRun, summary: pd.DataFrame) -> str:
    """Mean and p95 per layer (over every row) for each attention type, side by side."""
    layers = main_rows(summary, run, "layer")
    if layers.empty:
        return "<p>No data.</p>"
    header_top = "".join(f'<th colspan="2">{html.escape(type_label(t))}</th>' for t in run.types)
    header = "".join("<th>mean</th><th>p95</th>" for _ in run.types)
    body = []
    for layer in sorted(layers["layer"].unique()):
        cells = []
        for attention_type in run.types:
            row = layers[(layers["attention_type"] == attention_type) & (layers["layer"] == layer)]
            if row.empty or not np.isfinite(row["mean"].iloc[0]):
                cells.append("<td></td><td></td>")
            else:
                cells.append(f"<td>{row['mean'].iloc[0]:.3f}</td><td>{row['p95'].iloc[0]:.3f}</td>")
        body.append(f"<tr><th>{layer}</th>{''.join(cells)}</tr>")
    return (
        f'<table class="by-layer"><tr><th rowspan="2">layer</th>{header_top}</tr><tr>{header}</tr>'
        f"{''.join(body)}</table>"
        '<p class="note">Per layer, over every row (one value per example, query token and head). The layer '
        "histograms below show head-averaged values (one per example and query token), so their p95 and "
        "maximum are lower.</p>"
    )


def _facts(run: ReportRun) -> list[tuple[str, str]]:
    manifest = run.manifest
    every = run.counts(main=False)
    facts = [
        *([("run", run.name)] if run.name != _model(run) else []),  # --name, or the report's own
        ("model", _model(run)),
        ("model type", lookup(manifest, "model", "model_type")),
        ("revision", lookup(manifest, "model", "revision")),
        ("dataset", run.dataset),
        ("dataset spec", {k: v for k, v in (lookup(manifest, "dataset") or {}).items() if k != "texts_sha256"}),
        ("unknown tokens", describe_unknown(lookup(manifest, "unknown_tokens"))),  # probe.capture.tokens; None: a version-1 run
        ("alpha", run.alphas or lookup(manifest, "alpha")),
        ("spaces", run.spaces or None),
        ("attention types", ", ".join(type_label(t) for t in run.types) or "none"),
        ("measured", run.measured or "every layer, head and query position"),
        ("rows (every slice)", f"{every['rows']:,} ({every['non_converged']:,} not converged, "
                               f"{every['trivial']:,} trivial)"),
        ("attention implementation", lookup(manifest, "attention_implementation")),
        ("device", lookup(manifest, "device")),
        ("dtype", lookup(manifest, "dtype")),
        ("fidelity", lookup(manifest, "fidelity")),
        ("solver", lookup(manifest, "solver")),
        ("status", lookup(manifest, "status")),
        ("probe version (run)", lookup(manifest, "probe_version")),
        ("run directory", run.run_dir.name),
    ]
    return [(label, _format_value(value)) for label, value in facts]


def _table(frame: pd.DataFrame) -> str:
    """A statistics table as HTML (escaped by pandas), numbers to 4 significant digits."""
    return ('<div class="wide-table">' + frame.to_html(index=False, border=0, na_rep="", float_format=lambda v: f"{v:.4g}",
                                                       classes="stats") + "</div>")


def figure_html(figure: Saved) -> str:
    esc = html.escape
    data_type = f' data-type="{esc(figure.attention_type)}"' if figure.attention_type else ""
    png = base64.b64encode(figure.png).decode("ascii")
    return (
        f'<figure id="{esc(figure.stem)}" class="{"wide" if figure.wide else ""}"{data_type}>'
        f'<img class="zoom" alt="{esc(figure.caption)}" width="{figure.size_px[0]}" height="{figure.size_px[1]}" '
        f'src="data:image/png;base64,{png}">'
        f"<figcaption>{esc(figure.caption)} Files: {esc(', '.join(p.name for p in figure.files))}.</figcaption></figure>"
    )



def _kept_text(run: ReportRun) -> str:
    """What a run that kept aggregates (``--keep``) read its numbers from, for the tables' paragraph."""
    if run.aggregates is None:
        return ""
    sample = (f" The figures that need rows (2-D densities, the drivers' correlations) are drawn from its uniform "
              f"sample of {run.sample_rows:,} rows." if run.sample_rows else
              " The figures that need rows (2-D densities, the drivers' correlations) are left out: it kept none.")
    return (f" The run kept mergeable statistics instead of its rows ({run.kept}): counts, means, maxima and shares "
            "are exact; histograms are on fixed bins of width 1/1024 (exact to one such bin on other edges); the "
            "findings' shares above the 95th percentile are not kept." + sample)


def page(run: ReportRun, summary: pd.DataFrame, findings: list[dict], figures: list[Saved], explorer_html: str,
         explorer_data: dict | None, quantities: pd.DataFrame, interventions_html: str = "",
         control: dict | None = None, worst_text_html: str = "") -> str:
    """The whole page (``interventions_html``: the section of a run with ``--intervene``,
    :func:`probe.report.interventions.section_html`; ``control``: the control run's headline numbers,
    :func:`probe.report.summary.control_headline`; ``worst_text_html``: the section on the worst row's text,
    :func:`probe.report.text_view.section_html`)."""
    esc = html.escape
    notes = "".join(f"<li>{esc(note)}</li>" for note in run.notes)
    if findings:
        finding_items = "".join(f"<li>{esc(f['text'])}</li>" for f in findings)
    elif run.counts()["measured"]:
        finding_items = "<li>No group of rows deviates more than the rest beyond the noise.</li>"
    else:
        finding_items = "<li>No findings: no data.</li>"
    facts = "\n".join(f"<tr><th>{esc(label)}</th><td>{esc(text)}</td></tr>" for label, text in _facts(run))
    tables = []
    for level, title in (("layer", "per layer, over every row (tokens × heads)"),
                         ("layer_head_averaged", "per layer, over the head-averaged (example, query) values "
                                                 "the layer histograms show"),
                         ("head", "per head")):
        rows = main_rows(summary, run, level).drop(columns=["level", "space", "alpha"])
        if level != "head":
            rows = rows.drop(columns=["head"])
        table = _table(rows)
        tables.append(f"<details{' open' if level == 'layer' else ''}><summary>Relative deviation {esc(title)} "
                      f"({len(rows)} rows)</summary>{table}</details>")
    if len(quantities):
        tables.append(f"<details><summary>Other measured quantities per layer ({len(quantities)} rows)</summary>"
                      f"{_table(quantities)}</details>")
    images = "\n".join(figure_html(f) for f in figures)
    script = ""
    if explorer_data is not None:
        script = explorer.data_script(explorer_data) + f"<script>{explorer.SCRIPT}</script>"
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>probe report: {esc(run.title)}</title>
<style>{CSS}</style>
</head>
<body>
<header id="summary">
<h1>{esc(run.name)}: attention against the exact solution of its Fenchel dual</h1>
<p class="oneline">{one_line(run)}</p>
<p class="slice">{slice_line(run)}</p>
{f'<ul class="notes">{notes}</ul>' if notes else ""}
<div class="landing">
<div id="headline"><h2>Relative deviation ‖λ* − αz‖ / ‖λ*‖ over every row (example × query token × head)</h2>{headline_html(run, control)}{layer_table(run, summary)}</div>
<div id="findings"><h2>Findings (computed from the rows)</h2><ul class="findings">{finding_items}</ul>
<p class="note rule">{esc(RULE)}</p></div>
</div>
</header>
<nav><a href="#explorer">Explorer</a>{'<a href="#worst-text">Worst text</a>' if worst_text_html else ''}<a href="#figures">Figures</a>{'<a href="#interventions">Interventions</a>' if interventions_html else ''}<a href="#tables">Tables</a><a href="#run">Run</a></nav>
<section id="explorer"><h2>Explorer</h2>
{explorer_html}
</section>
{worst_text_html}
<section id="figures"><h2>Figures</h2>
{images or "<p>No data, no figures.</p>"}
</section>
{interventions_html}
<section id="tables"><h2>Tables</h2>
<p>The same numbers are in summary.csv (column <code>level</code>: layer, layer_head_averaged, head; every
slice) and summary.json. p95: 95th percentile; trivial: rows left out (one key); non_converged: rows whose
solve did not meet the certificate (included). Quantiles (median, p95, the box plots' quartiles and
whiskers) are {esc(run.quantile_method)}.{esc(_kept_text(run))}</p>
{"".join(tables) if run.counts()["rows"] else "<p>No data.</p>"}
</section>
<section id="run"><h2>Run</h2>
<div class="wide-table"><table class="facts">
{facts}
</table></div>
</section>
<div id="lightbox" hidden><img alt="figure at full size"></div>
<footer>Generated by probe {esc(__version__)} on {generated}.</footer>
{script}
</body>
</html>
"""
