"""The report's first screen says what the numbers mean: the scale in words and a control run's
numbers beside the run's, findings shown only when they clear the noise (a confidence interval over examples)
and merged when they describe the same rows, captions instead of title boilerplate, a log axis where one
extreme row would squash the boxes, a page that fits 800 px, and a compare page that states the difference.

Every expected number is recomputed here with pandas from the synthetic rows, never read from the report.
"""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app
from probe.core.errors import ProbeError
from probe.report import build_report, compare_runs, read_run
from probe.report.findings import MIN_EXAMPLES, MIN_RATIO, RULE, analyse, z_value
from probe.report.quantities import quantity_figure
from probe.report.style import style

from ..support.browser import load_check_html, needs_chromium
from ..support.synthetic_runs import deviation_rows, manifest_for, write_run


def measured(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[rows["n_keys"] > 1]


def per_example_ci(rows: pd.DataFrame, in_group: pd.Series, groups: int) -> tuple[float, float]:
    """The normal interval of the mean over examples of (the group's mean - the rest's mean), by pandas and
    scipy: 95% for ``groups`` intervals at once (Bonferroni)."""
    from scipy.stats import norm

    means = rows.assign(group=in_group).groupby(["example", "group"])["rel_deviation"].mean().unstack("group")
    difference = (means[True] - means[False]).dropna()
    half = norm.ppf(1 - 0.025 / groups) * difference.std(ddof=1) / math.sqrt(len(difference))
    return difference.mean() - half, difference.mean() + half


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A run with a real [CLS] effect (x3) and its random-init control (no effect), one extreme output deviation."""
    base = tmp_path_factory.mktemp("meaning")
    rows = deviation_rows({"self": (2, 3)}, examples=12, queries=8, cls_factor=3.0)
    rows.loc[rows.index[5], "output_deviation"] = 50.0  # one extreme row, as MiniLM's maximum of about 16
    control = deviation_rows({"self": (2, 3)}, examples=12, queries=8, seed=1)
    control["rel_deviation"] *= 2.0
    control_dir = write_run(base / "untrained-2", control, manifest_for(init="random"))
    run_dir = write_run(base / "trained-1", rows, manifest_for())
    report = build_report(run_dir, base / "report", control=control_dir)
    return rows, control, run_dir, control_dir, report


# --------------------------------------------------------------------------------------------------
# noise rule and merged findings


def test_a_planted_effect_is_shown_and_a_noise_size_effect_is_not(tmp_path):
    real = read_run(write_run(tmp_path / "real", deviation_rows({"self": (2, 3)}, examples=20, queries=8,
                                                                cls_factor=3.0), manifest_for()))
    noise_rows = deviation_rows({"self": (2, 3)}, examples=20, queries=8, cls_factor=1.02, seed=3)
    noise = read_run(write_run(tmp_path / "noise", noise_rows, manifest_for()))
    shown, _ = analyse(real)
    assert [f["value"] for f in shown if f["kind"] != "head"] == [0]  # the [CLS] position, named once
    shown, below = analyse(noise)
    assert not [f for f in shown if f["kind"] != "head"]  # role, position and token: noise-size effects
    assert {f["kind"] for f in below} >= {"token_role", "query_position", "token"}
    for found in shown:  # what is shown clears the rule, recomputed by pandas over examples
        rows = measured(noise_rows)
        group = (rows["layer"] == found["value"][0]) & (rows["head"] == found["value"][1])
        low, high = per_example_ci(rows, group, 6)  # the largest of 6 heads
        assert (found["ci_low"], found["ci_high"]) == pytest.approx((low, high), rel=1e-9)
        assert low > 0 and found["ratio"] >= MIN_RATIO and found["examples"] >= MIN_EXAMPLES
    for found in below:  # and what is not shown fails it
        assert not (found["ci_low"] > 0 and found["ratio"] >= MIN_RATIO)


def test_the_confidence_interval_is_over_examples(tmp_path):
    rows = deviation_rows({"self": (2, 3)}, examples=15, queries=8, cls_factor=1.5, seed=2)
    shown, below = analyse(read_run(write_run(tmp_path / "run", rows, manifest_for())))
    (position,) = [f for f in shown + below if f["kind"] == "query_position"]
    rows = measured(rows)
    low, high = per_example_ci(rows, rows["query"] == position["value"], 8)  # the largest of 8 positions
    assert (position["ci_low"], position["ci_high"]) == pytest.approx((low, high), rel=1e-9)
    assert position["examples"] == 15 and position["compared_groups"] == 8
    assert z_value(1) == pytest.approx(1.959963984540054) and z_value(144) == pytest.approx(3.5772543873)  # docs


def test_findings_that_select_the_same_rows_are_one_finding(planted):
    """Token role 'special', query position 0 and query token [CLS] were three findings of one effect."""
    rows, _, run_dir, _, report = planted
    shown, _ = analyse(read_run(run_dir))
    cls = [f for f in shown if f["kind"] != "head"]
    assert len(cls) == 1
    (found,) = cls
    assert (found["kind"], found["value"]) == ("query_position", 0)
    same = {d["name"]: d for d in found["same_rows"]}
    assert set(same) == {"query token '[CLS]'", "token role 'special'"}
    rows = measured(rows)
    position, special = rows["query"] == 0, rows["token_role"] == "special"
    assert same["query token '[CLS]'"]["of_these"] == 1.0 and same["query token '[CLS]'"]["of_its_own"] == 1.0
    assert same["token role 'special'"]["of_these"] == pytest.approx((position & special).sum() / position.sum())
    assert same["token role 'special'"]["of_its_own"] == pytest.approx((position & special).sum() / special.sum())
    page = (report / "index.html").read_text(encoding="utf-8")
    landing = page[page.index('id="findings"'):page.index('id="explorer"')]
    assert landing.count("deviates most") == len(shown)
    assert "Also described as query token &#x27;[CLS]&#x27; (the same rows)" in landing
    data = json.loads((report / "summary.json").read_text())
    assert data["findings_rule"] == RULE and RULE.split(":")[0] in page
    assert [f["text"] for f in data["findings"]] == [f["text"] for f in shown]


# --------------------------------------------------------------------------------------------------
# scale words and the control


def test_the_first_screen_says_what_the_mean_means_and_shows_the_control(planted):
    rows, control, _, control_dir, report = planted
    mean, p95 = measured(rows)["rel_deviation"].mean(), measured(rows)["rel_deviation"].quantile(0.95)
    control_mean = measured(control)["rel_deviation"].mean()
    page = (report / "index.html").read_text(encoding="utf-8")
    headline = page[page.index('id="headline"'):page.index('id="findings"')]
    assert "0 means attention is exactly the closed form of the posterior" in headline
    assert f"lies {mean:.1%} of its length away from αz (mean {mean:.3f})" in headline
    assert f"more than {p95:.1%} away" in headline
    assert f"control {control_mean:.3f}" in headline  # beside the run's number
    assert f"in the control run {control_mean:.1%} on average (mean {control_mean:.3f}), so this run&#x27;s mean is " \
           f"{mean / control_mean:.2f}x the control&#x27;s" in headline
    data = json.loads((report / "summary.json").read_text())
    assert data["control"]["by_type"]["self"]["mean"] == pytest.approx(control_mean, rel=1e-12)
    assert data["control"]["run_dir"] == control_dir.name
    assert "lies" in data["headline"][0]["in_words"]


@pytest.mark.slow
def test_the_manifest_can_name_the_control(planted, tmp_path):
    rows, control, _, control_dir, _ = planted
    manifest = {**manifest_for(), "control": f"../{control_dir.name}"}
    run_dir = write_run(control_dir.parent / "named", rows, manifest)
    data = json.loads((build_report(run_dir, tmp_path / "r") / "summary.json").read_text())
    assert data["control"]["by_type"]["self"]["mean"] == pytest.approx(measured(control)["rel_deviation"].mean())


def test_a_missing_control_names_the_parameter(planted, tmp_path):
    _, _, run_dir, _, _ = planted
    with pytest.raises(ProbeError, match=r"control=") as caught:
        build_report(run_dir, tmp_path / "r", control=tmp_path / "nowhere")
    assert "--control" not in str(caught.value)


# --------------------------------------------------------------------------------------------------
# figures and the page's width


def test_figure_boilerplate_is_one_caption_and_the_colour_range_is_said_once(planted):
    _, _, _, _, report = planted
    page = (report / "index.html").read_text(encoding="utf-8")
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", page, flags=re.S)
    heatmap = [c for c in captions if c.startswith("self-attention: mean of the relative deviation")]
    assert len(heatmap) == 1 and "colour scale 0 to" in heatmap[0] and "shared by every heatmap" in heatmap[0]
    legend = page[page.index('class="legend"'):]
    legend = legend[: legend.index("</p>")]
    top = re.search(r"olour scale 0 to ([0-9.]+)", legend).group(1)
    assert legend.count(top) == 1  # "0 to 0.169: colour scale 0 to 0.169" said it twice


def test_figures_keep_a_short_title_no_larger_than_their_axis_labels(planted):
    from matplotlib.font_manager import FontProperties

    from probe.report import draw_figures
    from probe.report.figures import report_scale
    from probe.report.summary import main_rows, summarize

    _, _, run_dir, _, _ = planted
    run = read_run(run_dir)
    summary = summarize(run)
    with style():
        for drawn in draw_figures(run, summary, report_scale(run, main_rows(summary, run, "head"))):
            title = drawn.figure._suptitle
            assert title is not None and "\n" not in title.get_text(), drawn.stem
            labels = [ax.yaxis.label for ax in drawn.figure.axes if ax.get_ylabel()]
            size = max(FontProperties(size=label.get_fontsize()).get_size_in_points() for label in labels)
            assert title.get_fontsize() <= size, drawn.stem


def test_one_extreme_row_does_not_squash_the_box_plot(planted):
    rows, _, run_dir, _, _ = planted
    with style():
        drawn = quantity_figure(read_run(run_dir), "output_deviation")
    (ax,) = [ax for ax in drawn.figure.axes if ax.get_xlabel() == "layer"]
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    values = measured(rows)["output_deviation"]
    assert low <= values.quantile(0.05) and high >= values.max()
    assert "log y axis" in drawn.caption.lower()


@needs_chromium
@pytest.mark.slow  # a real browser
def test_the_page_does_not_scroll_sideways_at_800_px(planted):
    _, _, _, _, report = planted
    check_html = load_check_html()
    with check_html.Browser(size=(800, 900)) as browser:
        browser.open(report / "index.html")
        assert browser.evaluate("document.documentElement.scrollWidth") <= 800
    with check_html.Browser() as browser:  # scripts/check_html.py checks it too (make_reports.sh, the tests)
        browser.open(report / "index.html")
        assert check_html.width_problems(browser) == []
        assert browser.evaluate("document.documentElement.scrollWidth") <= 1400


# --------------------------------------------------------------------------------------------------
# the compare page


def test_the_compare_page_states_the_difference_once_per_type(planted, tmp_path):
    rows, control, run_dir, control_dir, _ = planted
    out = compare_runs([run_dir, control_dir], tmp_path / "compare", names=["trained", "random"])
    page = (out / "index.html").read_text(encoding="utf-8")
    mean, control_mean = measured(rows)["rel_deviation"].mean(), measured(control)["rel_deviation"].mean()
    assert (f"self-attention: trained&#x27;s mean relative deviation is {mean / control_mean:.3g}x random&#x27;s "
            f"({mean:.3g} vs {control_mean:.3g}).") in page
    numbers = page[page.index('<table class="numbers">'):]
    numbers = numbers[: numbers.index("</table>")]
    assert "run_dir" not in numbers and "model" not in numbers  # the runs are named once, in their own table
    assert page.count(run_dir.name) == 1 and page.count(control_dir.name) == 1
    cells = re.findall(r"<td>([^<]*)</td>", numbers)
    for cell in cells:
        if re.fullmatch(r"[0-9.e+-]+", cell) and "." in cell:
            assert len(cell.replace("0.", "", 1).lstrip("0").replace(".", "")) <= 3, cell  # 3 significant figures
    assert "control&#x27;s mean" in numbers and f"{control_mean:.3g}" in cells


def test_compare_errors_name_the_parameter_in_python_and_the_flag_on_the_command_line(planted, tmp_path):
    _, _, run_dir, control_dir, _ = planted
    with pytest.raises(ProbeError) as caught:
        compare_runs([run_dir, control_dir], tmp_path / "c", names=["only one"])
    assert "names=" in str(caught.value) and "--name" not in str(caught.value)
    result = CliRunner().invoke(app, ["compare", str(run_dir), str(control_dir), "--out", str(tmp_path / "c"),
                                      "--name", "only one"])
    assert result.exit_code != 0 and "--name" in result.output and "names=" not in result.output
    (tmp_path / "file").write_text("x")
    with pytest.raises(ProbeError) as caught:
        build_report(run_dir, tmp_path / "file")
    assert "out=" in str(caught.value) and "--out" not in str(caught.value)
