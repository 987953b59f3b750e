"""The report's page: self-contained, the landing summary first, and interactive in a real browser
(headless Chromium driven by scripts/check_html.py over the DevTools protocol: real mouse clicks).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from probe.report import build_report

from ..support.browser import load_check_html, needs_chromium
from ..support.synthetic_runs import deviation_rows, manifest_for, write_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """An encoder-decoder run with a planted [CLS] effect; the manifest names a URL-like dataset."""
    rows = deviation_rows({"encoder_self": (3, 4), "cross": (2, 2)}, examples=6, cls_factor=3.0)
    manifest = manifest_for(description="https://example.org/<script>alert(1)</script>")
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "run", rows, manifest)
    return rows, build_report(run_dir)


def test_page_is_self_contained_and_escaped(report):
    _, out = report
    page = (out / "index.html").read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == len(list(out.glob("*.png")))
    for value in re.findall(r'(?:src|href)="([^"]*)"', page):
        assert value.startswith(("data:", "#")), value
    assert "<link" not in page and not re.search(r"<script[^>]*\bsrc=", page)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert not re.search(r"\b(fetch|XMLHttpRequest|import)\s*\(", page)


def test_the_landing_summary_comes_before_everything_else(report):
    """Defect 11: the page opened with a 14-row facts table; the first figure was 1,150 px down."""
    _, out = report
    page = (out / "index.html").read_text(encoding="utf-8")
    order = [page.index(marker) for marker in ('id="headline"', 'id="findings"', 'id="explorer"', "<figure",
                                               'class="facts"')]
    assert order == sorted(order)
    assert "org/tiny-model" in page[: order[0]] and "fidelity passed" in page[: order[0]]


@needs_chromium
@pytest.mark.slow  # a real browser
def test_check_html_passes_in_headless_chromium(report, tmp_path):
    _, out = report
    shot = tmp_path / "page.png"
    command = [sys.executable, str(REPO / "scripts" / "check_html.py"), str(out / "index.html"), "--screenshot", str(shot)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert shot.stat().st_size > 20_000


@needs_chromium
@pytest.mark.slow  # a real browser
def test_clicking_a_heatmap_cell_shows_that_heads_histogram_and_worst_rows(report):
    rows, out = report
    check_html = load_check_html()
    head = rows[(rows["attention_type"] == "encoder_self") & (rows["layer"] == 1) & (rows["head"] == 2)]
    worst = head.sort_values("rel_deviation", ascending=False).head(8)
    with check_html.Browser() as browser:
        browser.open(out / "index.html")
        assert browser.evaluate("document.getElementById('head-panel').hidden") is True
        browser.click('td.cell[data-type="encoder_self"][data-layer="1"][data-head="2"]')
        panel = browser.evaluate(
            "(() => { const p = document.getElementById('head-panel'); return {hidden: p.hidden,"
            " title: document.getElementById('head-title').textContent,"
            " stats: document.getElementById('head-stats').textContent,"
            " bars: p.querySelectorAll('svg rect.bar').length,"
            " worst: Array.from(p.querySelectorAll('tr.worst')).map(r => Array.from(r.cells).map(c => c.textContent)),"
            " marked: Array.from(p.querySelectorAll('tr.worst mark')).map(m => m.textContent)}; })()"
        )
        assert panel["hidden"] is False
        assert panel["title"] == "encoder self-attention · layer 1 · head 2"
        assert f"max {head['rel_deviation'].max():.3g}" in panel["stats"]
        assert f"mean {head['rel_deviation'].mean():.3g}" in panel["stats"]
        assert panel["bars"] > 0
        assert [float(r[0]) for r in panel["worst"]] == pytest.approx(worst["rel_deviation"].tolist(), rel=5e-3)
        assert [(int(r[1]), int(r[2]), r[3]) for r in panel["worst"]] == list(
            zip(worst["example"], worst["query"], worst["token"]))
        assert panel["marked"] == [t.lstrip("#") for t in worst["token"]]  # the query token highlighted in context

        browser.click('button.filter[data-filter="type"][data-value="cross"]')
        hidden = browser.evaluate(
            "Object.fromEntries(Array.from(document.querySelectorAll('div.heatmap')).map(d => [d.dataset.type, d.hidden]))"
        )
        assert hidden == {"encoder_self": True, "cross": False}
        assert browser.evaluate("document.getElementById('layers_encoder_self').hidden") is True
        assert browser.evaluate("document.getElementById('overview').hidden") is False
        assert browser.evaluate("document.getElementById('head-panel').hidden") is True  # another type's head

        browser.click("#overview img")
        assert browser.evaluate("document.getElementById('lightbox').hidden") is False
        assert browser.external_requests() == []


#: what the heatmaps' fit is checked in: each heatmap wholly in view (no part scrolled away sideways), the
#: page not wider than the window, and the heatmap's last column inside the window
FIT = """(() => {
  const maps = Array.from(document.querySelectorAll('div.heatmap')).filter(d => !d.hidden);
  const boxes = maps.map(d => {
    const scroller = d.closest('.explorer > div');
    const table = d.querySelector('table.heat').getBoundingClientRect();
    return {cut: scroller.scrollWidth - scroller.clientWidth, right: table.right};
  });
  return {cut: Math.max(...boxes.map(b => b.cut)), right: Math.max(...boxes.map(b => b.right)),
          page: document.documentElement.scrollWidth, window: window.innerWidth, maps: maps.length};
})()"""


@pytest.fixture(scope="module")
def reports_by_heads(tmp_path_factory):
    """Reports of models with 12, 16 and 32 heads (6 layers, one attention type)."""
    made = {}
    for heads in (12, 16, 32):
        rows = deviation_rows({"self": (6, heads)}, examples=2, queries=4, non_converged=0)
        run_dir = write_run(tmp_path_factory.mktemp("runs") / f"heads-{heads}", rows, manifest_for())
        made[heads] = build_report(run_dir)
    return made


@needs_chromium
@pytest.mark.slow
@pytest.mark.parametrize("width", [1280, 1920])
def test_the_head_heatmap_fits_the_window_with_12_16_and_32_heads(reports_by_heads, width):
    """At 1280 px (and wider) no heatmap of 12, 16 or 32 heads is cut off behind a sideways scrollbar, before
    and after a click opens the head panel beside it."""
    check_html = load_check_html()
    for heads, out in reports_by_heads.items():
        with check_html.Browser(size=(width, 900)) as browser:
            browser.open(out / "index.html")
            for state in ("closed", "open"):
                if state == "open":
                    browser.click(f'td.cell[data-layer="5"][data-head="{heads - 1}"]')
                    assert browser.evaluate("document.getElementById('head-panel').hidden") is False
                fit = browser.evaluate(FIT)
                assert fit["maps"] == 1
                assert fit["cut"] <= 0 and fit["right"] <= fit["window"] and fit["page"] <= fit["window"], \
                    (heads, width, state, fit)


@pytest.mark.slow
def test_a_named_run_shows_its_name_and_its_model(tmp_path):
    """A run named with ``--name`` keeps the model's own name on its page: both are shown."""
    manifest = {**manifest_for(name="all-MiniLM-L6-v2"), "config": {"name": "ablation A"}}
    run_dir = write_run(tmp_path / "run", deviation_rows({"self": (2, 2)}, examples=3), manifest)
    page = (build_report(run_dir) / "index.html").read_text(encoding="utf-8")
    assert '<p class="oneline"><b>ablation A (all-MiniLM-L6-v2)</b>' in page
    assert "<tr><th>run</th><td>ablation A</td></tr>" in page
    assert "<tr><th>model</th><td>all-MiniLM-L6-v2</td></tr>" in page
    unnamed = write_run(tmp_path / "unnamed", deviation_rows({"self": (2, 2)}, examples=3),
                        manifest_for(name="all-MiniLM-L6-v2"))
    page = (build_report(unnamed) / "index.html").read_text(encoding="utf-8")
    assert '<p class="oneline"><b>all-MiniLM-L6-v2</b>' in page and "<tr><th>run</th>" not in page
