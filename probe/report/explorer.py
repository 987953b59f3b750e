"""The page's interactive explorer: clickable layer x head heatmaps (HTML tables coloured on the report's
shared scale) that open a head's histogram and its worst rows, and filters by attention type and layer.

Everything it needs travels inside the page as JSON (per head: statistics, histogram counts on the
report's shared bins, the rows that deviate most with their query token in context) read by a small
inline script; no external script, style sheet or URL.  The context of a query is spelled out by the
query tokens of its example (every real token is a query), so it needs no text files; when the run's
texts can be recovered and checked against the manifest's hash, the text is shown too.
"""

from __future__ import annotations

import html
import json

import matplotlib as mpl
import numpy as np
import pandas as pd

from probe.report.data import (
    TARGET_QUERY_TYPES,
    WORST_ROWS,
    ReportRun,
    lookup,
    token_sequences,
    type_label,
)
from probe.report.style import CMAP, Scale, counts_on

#: Heatmap cells show their value up to this many heads.
VALUE_MAX_HEADS = 16


def _round(value: float) -> float | None:
    return None if value is None or not np.isfinite(value) else float(f"{value:.6g}")


def recover_texts(manifest: dict) -> dict[int, str]:
    """The run's texts by example index when they can be read again and match the manifest's hash:
    the embedded corpus, or a local file that still exists.  Empty otherwise (hub datasets are not
    downloaded by the report)."""
    spec = lookup(manifest, "dataset")
    if not isinstance(spec, dict) or not isinstance(spec.get("texts_sha256"), str):
        return {}
    from probe.capture.data import DatasetSpec, load_texts

    name = spec.get("name")
    if name is not None:
        from pathlib import Path

        if not Path(str(name)).is_file():
            return {}
    try:
        fields = {key: spec.get(key) for key in ("name", "config", "split", "column", "target_column", "samples",
                                                 "sample_seed")}
        fields["split"] = fields["split"] or "train"
        fields["column"] = fields["column"] or "text"
        texts = load_texts(DatasetSpec(**fields))
    except Exception:  # noqa: BLE001 -- any failure only means the page shows token contexts alone
        return {}
    if texts.sha256 != spec["texts_sha256"]:
        return {}
    return dict(zip(texts.indices, texts.texts))


def worst_rows(run: ReportRun) -> pd.DataFrame:
    """The :data:`WORST_ROWS` rows of largest deviation of each head in the main slice (ties: the earlier
    example and query first), with their token, role and number of keys: one pass, given each head's
    threshold (:attr:`ReportRun.deviation`'s ``top``)."""
    if run.aggregates is not None:  # kept exactly, per head, by the aggregates
        return run.aggregates.worst_rows({"space": run.space, "alpha": run.alpha})
    thresholds = run.main_deviation("head").rename(columns={"top": "threshold"})
    return run.table.top_rows("rel_deviation", WORST_ROWS, ("attention_type", "layer", "head"), run.measured_where,
                              columns=("example", "query", "token", "token_role", "n_keys"),
                              order=("example", "query"), thresholds=thresholds)


def payload(run: ReportRun, head_stats: pd.DataFrame, scale: Scale, texts: dict[int, str] | None = None) -> dict:
    """The explorer's data: per attention type and head, statistics, histogram counts and worst rows."""
    from probe.report.figures import head_histograms

    edges = scale.head_edges
    worst = worst_rows(run)
    needed = {(str(t), int(e)) for t, e in zip(worst["attention_type"], worst["example"])}
    contexts = token_sequences(run, needed)
    texts = texts or {}
    counted = head_histograms(run, edges)
    trivial = run.main_census.groupby(["attention_type", "layer", "head"])["trivial"].sum()
    types = {}
    for attention_type in run.types:
        stats = head_stats[head_stats["attention_type"] == attention_type].set_index(["layer", "head"])
        type_worst = worst[worst["attention_type"] == attention_type]
        cells = {}
        for (layer, head), stat in stats.iterrows():
            head_worst = type_worst[(type_worst["layer"] == layer) & (type_worst["head"] == head)]
            cells[f"{layer}/{head}"] = {
                "count": int(stat["count"]),
                "trivial": int(trivial.get((attention_type, layer, head), 0)),
                "mean": _round(stat["mean"]),
                "p95": _round(stat["p95"]),
                "max": _round(stat["max"]),
                "counts": counts_on(edges, counted, attention_type, layer, head).tolist(),
                "worst": [
                    [int(r.example), int(r.query), None if pd.isna(r.token) else str(r.token),
                     None if pd.isna(r.token_role) else str(r.token_role),
                     None if pd.isna(r.n_keys) else int(r.n_keys), _round(r.rel_deviation)]
                    for r in head_worst.itertuples()
                ],
            }
        types[attention_type] = {
            "label": type_label(attention_type),
            "layers": [int(v) for v in sorted(stats.index.get_level_values("layer").unique())],
            "heads": [int(v) for v in sorted(stats.index.get_level_values("head").unique())],
            "cells": cells,
            "source_texts": attention_type not in TARGET_QUERY_TYPES,
        }
    examples = {int(e) for _, e in needed}
    return {
        "edges": [_round(e) for e in edges],
        "types": types,
        "contexts": {f"{t}/{e}": tokens for (t, e), tokens in contexts.items()},
        "texts": {str(e): texts[e] for e in sorted(examples) if e in texts},
    }


def _color(value: float, vmax: float) -> tuple[str, str]:
    """Background and text colour of a heatmap cell on the shared colour scale."""
    if value is None or not np.isfinite(value):
        return "#e0e0e0", "#222"
    r, g, b, _ = mpl.colormaps[CMAP](min(max(value / vmax, 0.0), 1.0) if vmax > 0 else 0.0)
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return mpl.colors.to_hex((r, g, b)), "#111" if luminance > 0.5 else "#fff"


def heatmap_tables(run: ReportRun, head_stats: pd.DataFrame, scale: Scale) -> str:
    """One clickable layer x head table per attention type, coloured by the head's mean."""
    esc = html.escape
    parts = []
    for attention_type in run.types:
        stats = head_stats[head_stats["attention_type"] == attention_type].set_index(["layer", "head"])
        layers = sorted(stats.index.get_level_values("layer").unique())
        heads = sorted(stats.index.get_level_values("head").unique())
        show_values = len(heads) <= VALUE_MAX_HEADS
        header = "".join(f"<th>{h}</th>" for h in heads)
        body = []
        for layer in layers:
            cells = []
            for head in heads:
                if (layer, head) not in stats.index:
                    cells.append("<td></td>")
                    continue
                stat = stats.loc[(layer, head)]
                background, ink = _color(float(stat["mean"]), scale.color_max)
                tip = (f"layer {layer} head {head}: mean {stat['mean']:.4g}, p95 {stat['p95']:.4g}, "
                       f"max {stat['max']:.4g}, {int(stat['count']):,} rows")
                text = f"{stat['mean']:.3f}" if show_values and np.isfinite(stat["mean"]) else ""
                cells.append(
                    f'<td class="cell" tabindex="0" role="button" data-type="{esc(attention_type)}" '
                    f'data-layer="{layer}" data-head="{head}" title="{esc(tip)}" '
                    f'style="background:{background};color:{ink}">{text}</td>'
                )
            body.append(f'<tr data-layer="{layer}"><th>{layer}</th>{"".join(cells)}</tr>')
        parts.append(
            f'<div class="heatmap" data-type="{esc(attention_type)}"><h3>{esc(type_label(attention_type))}: mean '
            f"per layer (rows) and head (columns)</h3>"
            f'<table class="heat{"" if show_values else " dense"}"><thead><tr><th>layer \\ head</th>{header}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>"
        )
    legend = _legend(scale)
    return legend + "".join(parts)


def _legend(scale: Scale) -> str:
    stops = ", ".join(_color(scale.color_max * i / 8, scale.color_max)[0] + f" {100 * i / 8:.0f}%" for i in range(9))
    return (
        f'<p class="legend"><span class="ramp" style="background:linear-gradient(to right, {stops})"></span> '
        f"{html.escape(scale.color_text[0].upper() + scale.color_text[1:])} (and with the figures' heatmaps). "
        "Click a cell for the head's histogram and worst rows.</p>"
    )


def filters(run: ReportRun) -> str:
    """Buttons that filter the page by attention type and by layer."""
    layers = sorted({int(v) for v in run.main_census["layer"].unique()})
    type_buttons = "".join(
        f'<button type="button" class="filter" data-filter="type" data-value="{html.escape(t)}">'
        f"{html.escape(type_label(t))}</button>"
        for t in run.types
    )
    layer_buttons = "".join(
        f'<button type="button" class="filter" data-filter="layer" data-value="{layer}">{layer}</button>'
        for layer in layers
    )
    return (
        '<div class="filters"><span>attention type:</span>'
        '<button type="button" class="filter active" data-filter="type" data-value="all">all</button>'
        f"{type_buttons}<span>layer:</span>"
        '<button type="button" class="filter active" data-filter="layer" data-value="all">all</button>'
        f"{layer_buttons}</div>"
    )


def data_script(data: dict) -> str:
    """The payload as an inline JSON script element (``<`` escaped so no text can close the element)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    return f'<script type="application/json" id="explorer-data">{text}</script>'


HEAD_PANEL = """
<div id="head-panel" hidden>
  <h3 id="head-title"></h3>
  <p id="head-stats"></p>
  <p><button type="button" id="head-log">log y</button> <span class="hint">bars: rows per bin on the report's
  shared bins; red line: mean; triangle: maximum</span></p>
  <div id="head-hist"></div>
  <h4>Rows that deviate most</h4>
  <table id="head-worst" class="stats"></table>
</div>
"""

SCRIPT = r"""
(function () {
  const data = JSON.parse(document.getElementById('explorer-data').textContent);
  const state = {type: 'all', layer: 'all', log: false, shown: null};
  const svgNS = 'http://www.w3.org/2000/svg';
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  function fmt(v) { return v === null || v === undefined ? '–' : Number(v).toPrecision(3); }
  function applyFilters() {
    document.querySelectorAll('[data-type]').forEach(function (node) {
      if (node.classList.contains('cell') || node.classList.contains('filter')) return;
      node.hidden = state.type !== 'all' && node.dataset.type !== state.type;
    });
    document.querySelectorAll('tr[data-layer]').forEach(function (row) {
      row.hidden = state.layer !== 'all' && row.dataset.layer !== state.layer;
    });
    document.querySelectorAll('button.filter').forEach(function (b) {
      b.classList.toggle('active', state[b.dataset.filter] === b.dataset.value);
    });
    const panel = document.getElementById('head-panel');
    if (state.shown && ((state.type !== 'all' && state.shown.type !== state.type) ||
        (state.layer !== 'all' && String(state.shown.layer) !== state.layer))) panel.hidden = true;
  }
  function context(type, example, query) {
    const tokens = data.contexts[type + '/' + example];
    const box = el('span', {'class': 'context'});
    if (!tokens) return box;
    const lo = Math.max(0, query - 20), hi = Math.min(tokens.length, query + 21);
    if (lo > 0) box.appendChild(document.createTextNode('… '));
    for (let i = lo; i < hi; i++) {
      let t = tokens[i] || '';
      let sep = i === lo ? '' : ' ';
      if (t.startsWith('##')) { t = t.slice(2); sep = ''; }
      else if (t.startsWith('\u2581') || t.startsWith('\u0120')) { t = t.slice(1); }
      if (sep) box.appendChild(document.createTextNode(sep));
      if (i === query) box.appendChild(el('mark', {}, t)); else box.appendChild(document.createTextNode(t));
    }
    if (hi < tokens.length) box.appendChild(document.createTextNode(' …'));
    return box;
  }
  function drawHistogram(cell) {
    const host = document.getElementById('head-hist');
    host.textContent = '';
    const W = 640, H = 230, L = 56, R = 12, T = 10, B = 38;
    const edges = data.edges, counts = cell.counts;
    const xmax = edges[edges.length - 1];
    const top = Math.max(1, ...counts);
    const x = v => L + (W - L - R) * v / xmax;
    const y = c => state.log
      ? (c <= 0 ? H - B : H - B - (H - B - T) * Math.log10(c + 1) / Math.log10(top + 1))
      : H - B - (H - B - T) * c / top;
    const root = svg('svg', {width: W, height: H, viewBox: '0 0 ' + W + ' ' + H, 'class': 'hist'});
    for (let i = 0; i < counts.length; i++) {
      if (counts[i] <= 0) continue;
      root.appendChild(svg('rect', {x: x(edges[i]), y: y(counts[i]), width: Math.max(0.5, x(edges[i + 1]) - x(edges[i])),
        height: H - B - y(counts[i]), fill: '#4c72b0', 'class': 'bar'}));
    }
    root.appendChild(svg('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: '#333'}));
    root.appendChild(svg('line', {x1: L, x2: L, y1: T, y2: H - B, stroke: '#333'}));
    for (let k = 0; k <= 4; k++) {
      const v = xmax * k / 4;
      const t = svg('text', {x: x(v), y: H - B + 14, 'text-anchor': 'middle', 'font-size': 11});
      t.textContent = v.toPrecision(2); root.appendChild(t);
    }
    const ticks = state.log ? [1, 10, 100, 1000, 10000, 100000].filter(c => c <= top) : [0, top / 2, top];
    for (const c of ticks) {
      const t = svg('text', {x: L - 5, y: y(c) + 4, 'text-anchor': 'end', 'font-size': 11});
      t.textContent = Math.round(c).toLocaleString(); root.appendChild(t);
    }
    const xl = svg('text', {x: (L + W - R) / 2, y: H - 4, 'text-anchor': 'middle', 'font-size': 12});
    xl.textContent = 'relative deviation (x axis shared by every head)'; root.appendChild(xl);
    const yl = svg('text', {x: 12, y: (T + H - B) / 2, 'text-anchor': 'middle', 'font-size': 12,
      transform: 'rotate(-90 12 ' + (T + H - B) / 2 + ')'});
    yl.textContent = state.log ? 'rows (log)' : 'rows'; root.appendChild(yl);
    if (cell.mean !== null) root.appendChild(svg('line', {x1: x(cell.mean), x2: x(cell.mean), y1: T, y2: H - B,
      stroke: '#d62728', 'stroke-width': 1.5, 'class': 'mean'}));
    if (cell.max !== null) root.appendChild(svg('path', {d: 'M' + x(cell.max) + ' ' + (H - B) + ' l-5 8 l10 0 z',
      fill: '#7f0000', 'class': 'max'}));
    host.appendChild(root);
  }
  function showHead(type, layer, head) {
    const info = data.types[type];
    const cell = info && info.cells[layer + '/' + head];
    if (!cell) return;
    state.shown = {type: type, layer: layer, head: head, cell: cell};
    const panel = document.getElementById('head-panel');
    panel.dataset.shown = type + '/' + layer + '/' + head;
    document.getElementById('head-title').textContent = info.label + ' · layer ' + layer + ' · head ' + head;
    document.getElementById('head-stats').textContent = cell.count.toLocaleString() + ' rows (' +
      cell.trivial.toLocaleString() + ' trivial left out) · mean ' + fmt(cell.mean) + ' · p95 ' + fmt(cell.p95) +
      ' · max ' + fmt(cell.max);
    drawHistogram(cell);
    const table = document.getElementById('head-worst');
    table.textContent = '';
    const head_row = el('tr');
    for (const name of ['relative deviation', 'example', 'query', 'token', 'role', 'keys', 'context'])
      head_row.appendChild(el('th', {}, name));
    table.appendChild(head_row);
    for (const r of cell.worst) {
      const [example, query, token, role, keys, dev] = r;
      const row = el('tr', {'class': 'worst'});
      row.appendChild(el('td', {'class': 'dev'}, fmt(dev)));
      row.appendChild(el('td', {}, String(example)));
      row.appendChild(el('td', {}, String(query)));
      row.appendChild(el('td', {}, token === null ? '–' : token));
      row.appendChild(el('td', {}, role === null ? '–' : role));
      row.appendChild(el('td', {}, keys === null ? '–' : String(keys)));
      const ctx = el('td', {'class': 'ctx'});
      ctx.appendChild(context(type, example, query));
      const text = info.source_texts ? data.texts[String(example)] : undefined;
      if (text) ctx.appendChild(el('div', {'class': 'text'}, text));
      row.appendChild(ctx);
      table.appendChild(row);
    }
    document.querySelectorAll('td.cell.selected').forEach(n => n.classList.remove('selected'));
    const selected = document.querySelector('td.cell[data-type="' + CSS.escape(type) + '"][data-layer="' + layer +
      '"][data-head="' + head + '"]');
    if (selected) selected.classList.add('selected');
    panel.hidden = false;
  }
  document.querySelectorAll('td.cell').forEach(function (cell) {
    const open = () => showHead(cell.dataset.type, cell.dataset.layer, cell.dataset.head);
    cell.addEventListener('click', open);
    cell.addEventListener('keydown', e => { if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); open(); } });
  });
  document.querySelectorAll('button.filter').forEach(function (b) {
    b.addEventListener('click', function () { state[b.dataset.filter] = b.dataset.value; applyFilters(); });
  });
  document.getElementById('head-log').addEventListener('click', function () {
    state.log = !state.log;
    this.textContent = state.log ? 'linear y' : 'log y';
    if (state.shown) drawHistogram(state.shown.cell);
  });
  const box = document.getElementById('lightbox');
  document.querySelectorAll('img.zoom').forEach(function (img) {
    img.addEventListener('click', function () {
      box.querySelector('img').src = img.src; box.hidden = false;
    });
  });
  box.addEventListener('click', function () { box.hidden = true; });
})();
"""
