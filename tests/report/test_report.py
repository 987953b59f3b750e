"""The report: statistics against independent pandas computations, the figures' scales, bins, labels and
fonts, provenance, findings on runs with planted effects, and the errors users see for bad run directories.

Run directories are synthetic (:mod:`tests.support.synthetic_runs`).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.collections import PathCollection, QuadMesh
from matplotlib.patches import StepPatch

from probe.core.errors import ProbeError
from probe.core.schema import DEVIATION_SCHEMA
from probe.report import build_report, draw_figures, read_run
from probe.report.data import dataset_text, run_title
from probe.report.figures import heads_figure, layers_figure, report_scale
from probe.report.findings import analyse
from probe.report.quantities import alpha_figure, spaces_figure
from probe.report.style import MIN_BINS_PER_PANEL, style
from probe.report.summary import main_rows, summarize

from ..support.synthetic_runs import deviation_rows, manifest_for, write_run

SUMMARY_HEADER = [
    "level", "space", "alpha", "attention_type", "layer", "head", "count", "trivial", "mean", "median", "p95", "max",
    "share_above_0.1", "non_converged",
]
NEW_COLUMNS = ("second_order_deviation", "attention_tv", "output_deviation", "evidence_norm", "attention_entropy")


def figure_files(report: Path) -> set[str]:
    return {p.name for p in report.iterdir() if p.suffix in (".png", ".pdf")}


def core_figures(types, formats=("png",)) -> set[str]:
    kinds = ("layers", "heads", "heatmap_mean", "heatmap_p95")
    return {f"overview.{f}" for f in formats} | {f"{k}_{t}.{f}" for k in kinds for t in types for f in formats}


T5_SHAPES = {"cross": (2, 2), "decoder_self": (2, 2), "encoder_self": (3, 4)}


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory):
    """A T5-like run (written cross first), with trivial decoder rows and a planted [CLS] effect."""
    rows = deviation_rows(T5_SHAPES, examples=10, cls_factor=3.0)
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "t5-run", rows, manifest_for())
    report = build_report(run_dir, run_dir / "out", formats=["png"])
    return rows, run_dir, report


@pytest.fixture(scope="module")
def t5_figures(t5_run):
    """The drawn figures of the T5-like run, by file stem (not saved)."""
    _, run_dir, _ = t5_run
    run = read_run(run_dir)
    summary = summarize(run)
    scale = report_scale(run, main_rows(summary, run, "head"))
    with style():
        drawn = list(draw_figures(run, summary, scale))
        yield {d.stem: d.figure for d in drawn}, scale, {d.stem: d.caption for d in drawn}


# --------------------------------------------------------------------------------------------------
# files and statistics


def test_every_figure_is_written(t5_run):
    _, _, report = t5_run
    types = ["encoder_self", "decoder_self", "cross"]
    expected = core_figures(types) | {
        f"{stem}.png" for stem in ["roles", "second_order", "attention_tv", "output_deviation"]
        + [f"drivers_{t}" for t in types] + [f"positions_{t}" for t in types]
    }
    assert figure_files(report) == expected
    for name in figure_files(report):
        assert (report / name).read_bytes().startswith(b"\x89PNG"), name


@pytest.fixture(scope="module")
def pdf_report(tmp_path_factory):
    rows = deviation_rows({"decoder_self": (2, 2)}, examples=3)
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "pdf-run", rows, manifest_for())
    return build_report(run_dir, formats=["png", "pdf"])


def test_every_format_is_written(pdf_report):
    files = figure_files(pdf_report)
    assert {name[:-4] for name in files if name.endswith(".pdf")} == {name[:-4] for name in files if name.endswith(".png")}
    assert "overview.pdf" in files
    for name in files:
        assert (pdf_report / name).read_bytes().startswith(b"\x89PNG" if name.endswith(".png") else b"%PDF"), name


def independent_stats(values: pd.Series, keys) -> pd.DataFrame:
    grouped = values.groupby(keys)
    return pd.DataFrame({
        "count": grouped.count(), "mean": grouped.mean(), "median": grouped.median(),
        "p95": grouped.quantile(0.95), "max": grouped.max(), "share_above_0.1": grouped.apply(lambda v: (v > 0.1).mean()),
    })


@pytest.mark.parametrize("level", ["layer", "layer_head_averaged", "head"])
def test_summary_matches_an_independent_computation(t5_run, level):
    rows, _, report = t5_run
    keys = ["space", "alpha", "attention_type", "layer"] + (["head"] if level == "head" else [])
    measured = rows[rows["n_keys"] > 1]
    if level == "layer_head_averaged":
        values = measured.groupby(keys + ["example", "query"])["rel_deviation"].mean()
        want = independent_stats(values, keys)
        trivial = rows[rows["n_keys"] == 1].groupby(keys)[["example", "query"]].apply(lambda f: len(f.drop_duplicates()))
    else:
        want = independent_stats(measured.set_index(keys)["rel_deviation"], keys)
        trivial = rows[rows["n_keys"] == 1].groupby(keys).size()
    summary = pd.read_csv(report / "summary.csv")
    assert list(summary.columns) == SUMMARY_HEADER
    got = summary[summary["level"] == level].set_index(keys)
    assert sorted(got.index) == sorted(want.index)
    got = got.loc[want.index]
    assert got["count"].tolist() == want["count"].tolist()
    for column in ("mean", "median", "p95", "max", "share_above_0.1"):
        np.testing.assert_allclose(got[column], want[column], rtol=1e-12, err_msg=column)
    assert got["trivial"].tolist() == trivial.reindex(want.index, fill_value=0).tolist()
    non_converged = (~rows["converged"]).groupby([rows[k] for k in keys]).sum()
    assert got["non_converged"].tolist() == non_converged.loc[want.index].tolist()


def test_summary_json_holds_the_same_numbers(t5_run):
    _, _, report = t5_run
    csv = pd.read_csv(report / "summary.csv")
    data = json.loads((report / "summary.json").read_text())
    from_json = pd.DataFrame(data["rows"], columns=data["columns"])
    assert list(from_json.columns) == SUMMARY_HEADER
    assert len(from_json) == len(csv)
    for column in SUMMARY_HEADER:
        if csv[column].dtype.kind in "fi":
            np.testing.assert_allclose(from_json[column].astype(float), csv[column].astype(float), rtol=1e-12)
        else:
            assert from_json[column].fillna("").tolist() == csv[column].fillna("").tolist(), column
    assert data["main_slice"] == {"space": "hidden", "alpha": 1.0}


def test_trivial_rows_are_left_out_and_counted(t5_run):
    """Defect 1: decoder self-attention's one-key rows (lambda* = alpha z exactly) pulled means down."""
    rows, _, report = t5_run
    summary = pd.read_csv(report / "summary.csv")
    layer0 = summary[(summary["level"] == "layer") & (summary["attention_type"] == "decoder_self")
                     & (summary["layer"] == 0)].iloc[0]
    decoder0 = rows[(rows["attention_type"] == "decoder_self") & (rows["layer"] == 0)]
    assert layer0["trivial"] == (decoder0["n_keys"] == 1).sum() > 0
    assert layer0["mean"] == pytest.approx(decoder0.loc[decoder0["n_keys"] > 1, "rel_deviation"].mean(), rel=1e-12)
    assert layer0["mean"] > decoder0["rel_deviation"].mean()  # what the old report showed
    page = (report / "index.html").read_text(encoding="utf-8")
    assert f"{int((rows['n_keys'] == 1).sum()):,} trivial left out" in page


def test_headline_numbers_on_the_page(t5_run):
    rows, _, report = t5_run
    page = (report / "index.html").read_text(encoding="utf-8")
    landing = page[: page.index('id="explorer"')]
    for attention_type in ("encoder_self", "decoder_self", "cross"):
        values = rows.loc[(rows["attention_type"] == attention_type) & (rows["n_keys"] > 1), "rel_deviation"]
        for value in (values.mean(), values.quantile(0.95), values.max()):
            assert f"<b>{value:.3f}</b>" in landing
        assert f"<b>{(values > 0.1).mean():.1%}</b>" in landing


# --------------------------------------------------------------------------------------------------
# figures: scales, tails, bins, labels, fonts


def test_overview_shows_the_maximum_from_a_zero_y_axis(t5_figures, t5_run):
    """Defect 2: no fliers or maxima, and a y axis that did not start at 0."""
    rows, _, _ = t5_run
    figures, scale, captions = t5_figures
    axes = [ax for ax in figures["overview"].axes if ax.get_xlabel() == "layer"]
    assert len(axes) == 3
    for ax, attention_type in zip(axes, ["encoder_self", "decoder_self", "cross"]):
        assert ax.get_ylim()[0] == 0
        assert ax.get_ylim()[1] >= scale.x_max
        (markers,) = [c for c in ax.collections if isinstance(c, PathCollection)]
        want = rows[(rows["attention_type"] == attention_type) & (rows["n_keys"] > 1)].groupby("layer")["rel_deviation"].max()
        np.testing.assert_allclose(markers.get_offsets()[:, 1], want.to_numpy(), rtol=1e-12)


def test_scales_are_shared_across_types_heads_and_statistics(t5_figures):
    """Defect 3: every heatmap scaled its own colours; every type had its own x range."""
    figures, scale, captions = t5_figures
    limits = {stem: mesh.get_clim() for stem, figure in figures.items() if stem.startswith(("heatmap_", "positions_"))
              for ax in figure.axes for mesh in ax.collections if isinstance(mesh, QuadMesh)}
    assert len(limits) == 3 * 3  # mean, p95 and position heatmaps of three types
    assert set(limits.values()) == {(0.0, scale.color_max)}
    x_ranges = {ax.get_xlim() for stem, figure in figures.items() if stem.startswith(("layers_", "heads_"))
                for ax in figure.axes if any(isinstance(p, StepPatch) for p in ax.patches)}
    assert len(x_ranges) == 1 and x_ranges.pop()[0] == 0
    for stem in figures:
        if stem.startswith("heatmap_"):
            assert "shared by every heatmap" in captions[stem]  # in the page's caption, not over the figure


@pytest.mark.parametrize("heads", [4, 12])
def test_head_grids_are_readable_at_any_head_count(tmp_path, heads):
    """Defect 5: no y scale or label, a linear shared y axis, a figure that did not grow with the grid."""
    rows = deviation_rows({"self": (3, heads)}, examples=3, queries=5)
    run = read_run(write_run(tmp_path / "run", rows, manifest_for()))
    summary = summarize(run)
    scale = report_scale(run, main_rows(summary, run, "head"))
    with style():
        figure = heads_figure(run, "self", scale).figure
        assert figure.get_figwidth() >= 1.7 * heads
        panels = [ax for ax in figure.axes if ax.get_subplotspec() is not None]
        assert len(panels) == 3 * heads
        assert {ax.get_yscale() for ax in panels} == {"log"}
        first_column = [ax for ax in panels if ax.get_subplotspec().colspan.start == 0]
        figure.canvas.draw()
        for ax in first_column:
            assert ax.get_ylabel().startswith("layer")
            assert any(label.get_text() for label in ax.get_yticklabels())
        assert "log" in figure.get_supylabel()
        assert overlapping_texts(figure) == []


def visible_texts(figure):
    """Every text matplotlib draws: titles, labels, drawn tick labels, annotations, legends."""
    texts = [figure._suptitle, figure._supxlabel, figure._supylabel, *figure.texts]  # texts may repeat these
    for ax in figure.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis._update_ticks():
                texts += [tick.label1, tick.label2]
        if ax.get_legend() is not None:
            texts += list(ax.get_legend().get_texts())
    unique = {id(t): t for t in texts if t is not None and t.get_visible() and t.get_text().strip()}
    return list(unique.values())


def overlapping_texts(figure) -> list[tuple[str, str]]:
    """Pairs of drawn texts whose boxes overlap by more than a pixel."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in visible_texts(figure)]
    clashes = []
    for i, (text_a, a) in enumerate(boxes):
        for text_b, b in boxes[i + 1:]:
            if min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1:
                clashes.append((text_a, text_b))
    return clashes


def test_no_label_collides_with_another_or_with_bars(t5_figures):
    """Defect 6: the mean's label covered the tallest bar; panel subtitles ran together."""
    figures, _, _ = t5_figures
    for stem, figure in figures.items():
        assert overlapping_texts(figure) == [], stem
        for ax in figure.axes:
            if any(isinstance(p, StepPatch) for p in ax.patches):
                assert not ax.texts, f"{stem}: text inside a histogram panel"


def test_layer_figure_titles_match_the_head_averaged_level(t5_figures, t5_run):
    """Defect 8: summary.csv's layer p95 was over all rows while the layer figure was head-averaged."""
    figures, _, _ = t5_figures
    _, _, report = t5_run
    summary = pd.read_csv(report / "summary.csv")
    averaged = summary[(summary["level"] == "layer_head_averaged") & (summary["attention_type"] == "encoder_self")]
    titles = [ax.get_title() for ax in figures["layers_encoder_self"].axes if ax.get_title().startswith("layer")]
    assert len(titles) == 3
    for title, (_, row) in zip(titles, averaged.sort_values("layer").iterrows()):
        assert f"mean {row['mean']:.3g} · p95 {row['p95']:.3g} · max {row['max']:.3g}" in title


def test_pdfs_embed_no_type3_fonts(pdf_report):
    """Defect 9: matplotlib's default pdf.fonttype 3 embeds Type 3 fonts, which venues reject."""
    pdfs = sorted(pdf_report.glob("*.pdf"))
    assert pdfs
    for pdf in pdfs:
        content = pdf.read_bytes()
        fonts = re.findall(rb"/Subtype\s*/(\w+)", content)
        assert b"Type3" not in fonts, pdf.name
        assert b"TrueType" in fonts or b"CIDFontType2" in fonts, pdf.name


def test_bins_resolve_a_narrow_layer(tmp_path):
    """Defect 10: 40 bins from 0 to the maximum put a narrow layer into about 5 bins."""
    rows = deviation_rows({"self": (2, 3)}, examples=40, queries=20)
    narrow = rows["layer"] == 0
    rows.loc[narrow, "rel_deviation"] = np.random.default_rng(1).normal(0.04, 0.008, narrow.sum()).clip(0.02, 0.06)
    rows.loc[~narrow & (rows["query"] == 0), "rel_deviation"] = 0.25
    run = read_run(write_run(tmp_path / "run", rows, manifest_for()))
    summary = summarize(run)
    scale = report_scale(run, main_rows(summary, run, "head"))
    averaged = rows[rows["layer"] == 0].groupby(["example", "query"])["rel_deviation"].mean()
    low, high = np.percentile(averaged, [1, 99])
    with style():
        figure = layers_figure(run, "self", scale).figure
    (panel,) = [ax for ax in figure.axes if ax.get_title().startswith("layer 0")]
    (stairs,) = [p for p in panel.patches if isinstance(p, StepPatch)]
    edges = stairs.get_data().edges
    assert ((edges >= low) & (edges <= high)).sum() >= MIN_BINS_PER_PANEL
    assert edges[0] == 0 and edges[-1] >= 0.25
    assert len(edges) - 1 <= 400


# --------------------------------------------------------------------------------------------------
# findings and provenance


def test_findings_name_the_planted_outlier_role_and_position(tmp_path):
    """Defect 4: the [CLS] finding appeared nowhere in the report."""
    rows = deviation_rows({"self": (3, 4)}, examples=12, queries=10, cls_factor=3.0)
    run = read_run(write_run(tmp_path / "run", rows, manifest_for()))
    shown, below = analyse(run)
    found = {f["kind"]: f for f in shown + below}
    assert found["query_position"]["value"] == 0 and found["query_position"] in shown
    # the role and the token select the same rows: named in the position's finding
    assert {d["kind"]: d["value"] for d in found["query_position"]["same_rows"]} == {
        "token_role": "special", "token": "[CLS]"}
    assert found["query_position"]["most_common_token"] == "[CLS]"
    measured = rows[rows["n_keys"] > 1]
    cls = measured["query"] == 0
    ratio = measured.loc[cls, "rel_deviation"].mean() / measured.loc[~cls, "rel_deviation"].mean()
    assert found["query_position"]["ratio"] == pytest.approx(ratio, rel=1e-12)
    p95 = measured["rel_deviation"].quantile(0.95)
    above = measured[measured["rel_deviation"] > p95]
    assert found["query_position"]["share_above_p95"] == pytest.approx((above["query"] == 0).mean())
    heads = measured.groupby(["layer", "head"])["rel_deviation"].mean()
    assert found["head"]["value"] == list(heads.idxmax())


def test_findings_are_on_the_landing_page(t5_run):
    _, _, report = t5_run
    page = (report / "index.html").read_text(encoding="utf-8")
    landing = page[: page.index('id="explorer"')]
    assert "encoder self-attention: query position 0 deviates most" in landing
    assert "Also described as query token &#x27;[CLS]&#x27; (the same rows) and token role &#x27;special&#x27;" in landing
    data = json.loads((report / "summary.json").read_text())
    assert [f["text"] for f in data["findings"]] == [
        html.unescape(text) for text in re.findall(r"<li>(.*?)</li>", landing.split('id="findings"')[1])
    ]


def test_findings_without_an_effect_have_ratios_near_one(tmp_path):
    rows = deviation_rows({"self": (2, 4)}, examples=30, queries=10, cls_factor=1.0)
    run = read_run(write_run(tmp_path / "run", rows, manifest_for()))
    shown, below = analyse(run)
    found = {f["kind"]: f for f in shown + below}
    assert found["query_position"]["ratio"] < 1.5
    assert found["query_position"] in below  # not shown: it does not clear the noise


@pytest.mark.parametrize(
    "model, rows_model, want",
    [
        ({"id": "org/tiny-model", "path": None}, None, "org/tiny-model"),
        ({"id": "bert-base-uncased", "path": None}, None, "bert-base-uncased"),
        ({"id": "/tmp/tmp.zatc7Rr9l2/all-MiniLM-L6-v2", "path": "/site-packages/x/model"}, None, "all-MiniLM-L6-v2"),
        ({"id": "./models/my-model/", "path": "/abs/models/my-model"}, None, "my-model"),
        ({"id": "org/tiny-model", "path": None, "init": "random"}, None, "org/tiny-model (random init)"),
        ({}, "/tmp/tmpabc/local-bert", "local-bert"),
        ({}, None, "unknown model"),
    ],
)
def test_model_names_never_show_a_temporary_path(model, rows_model, want):
    """Defect 7: the committed report named the model by a deleted temp path."""
    rows = pd.DataFrame({"model": [rows_model] if rows_model else []})
    assert run_title({"model": model} if model else {}, rows) == want


@pytest.mark.parametrize(
    "spec, want",
    [
        ({"name": None, "description": "embedded probe corpus", "n_examples": 300}, "embedded probe corpus, 300 texts"),
        ({"name": "/tmp/x/pairs.jsonl", "split": "train", "column": "source", "target_column": "target",
          "n_examples": 12}, "pairs.jsonl [source → target], 12 texts"),
        ({"name": "wikitext", "config": "wikitext-2-raw-v1", "split": "test", "column": "text"},
         "wikitext/wikitext-2-raw-v1/test [text]"),
        ({"name": "data/texts.txt", "split": "train", "column": "text"}, "texts.txt [text]"),
    ],
)
def test_dataset_descriptions_name_file_and_columns(spec, want):
    assert dataset_text({"dataset": spec}) == want


def test_name_option_and_local_model_directory(tmp_path):
    rows = deviation_rows({"self": (1, 2)}, non_converged=0)
    manifest = manifest_for(id="/tmp/tmp.zatc7Rr9l2/all-MiniLM-L6-v2", path="/somewhere/model")
    run_dir = write_run(tmp_path / "run", rows, manifest)
    assert read_run(run_dir).name == "all-MiniLM-L6-v2"
    page = (build_report(run_dir, name="MiniLM (pretrained)") / "index.html").read_text(encoding="utf-8")
    assert "<title>probe report: MiniLM (pretrained)" in page and "/tmp/tmp.zatc7Rr9l2" not in page


# --------------------------------------------------------------------------------------------------
# slices, storage layouts and old runs


def test_several_alphas_and_spaces(tmp_path):
    rows = deviation_rows({"self": (2, 2)}, alphas=(0.5, 1.0, 4.0), spaces=("hidden", "key"), non_converged=0)
    run_dir = write_run(tmp_path / "run", rows, manifest_for(), parts=4)  # a directory of part files
    report = build_report(run_dir)
    assert {"alpha.png", "spaces.png"} <= figure_files(report)
    summary = pd.read_csv(report / "summary.csv")
    assert set(zip(summary["space"], summary["alpha"])) == {(s, a) for s in ("hidden", "key") for a in (0.5, 1.0, 4.0)}
    run = read_run(run_dir)
    assert (run.space, run.alpha) == ("hidden", 1.0)
    main = rows[(rows["space"] == "hidden") & (rows["alpha"] == 1.0)]
    assert run.counts()["rows"] == len(main)
    page = (report / "index.html").read_text(encoding="utf-8")
    assert "Main figures and numbers: α = 1, hidden space" in page and "α ∈ {0.5, 1, 4}" in page
    headline = json.loads((report / "summary.json").read_text())["headline"][0]
    assert headline["mean"] == pytest.approx(main["rel_deviation"].mean(), rel=1e-12)


def test_alpha_and_space_figures(tmp_path):
    rows = deviation_rows({"self": (2, 2)}, alphas=(0.25, 1.0, 4.0), spaces=("hidden", "key"), non_converged=0)
    run = read_run(write_run(tmp_path / "run", rows, manifest_for()))
    summary = summarize(run)
    scale = report_scale(run, main_rows(summary, run, "head"))
    with style():
        figure = alpha_figure(run).figure
        spaces = spaces_figure(run, scale).figure
        assert overlapping_texts(figure) == [] and overlapping_texts(spaces) == []
    hidden_ax, key_ax = figure.axes
    assert hidden_ax.get_xscale() == "log" and "hidden space" in hidden_ax.get_title()
    hidden = rows[rows["space"] == "hidden"]
    want = hidden[hidden["layer"] == 1].groupby("alpha")["rel_deviation"]
    lines = [line for line in hidden_ax.get_lines() if line.get_label() == "layer 1"]
    np.testing.assert_allclose(lines[0].get_xdata(), [0.25, 1.0, 4.0])
    np.testing.assert_allclose(lines[0].get_ydata(), want.mean().to_numpy(), rtol=1e-12)
    dashed = [line for line in hidden_ax.get_lines() if line.get_linestyle() == "--"]
    assert any(np.allclose(line.get_ydata(), want.quantile(0.95).to_numpy()) for line in dashed)
    (ax,) = spaces.axes
    key = rows[(rows["space"] == "key") & (rows["alpha"] == 1.0)].groupby("layer")["rel_deviation"]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "key: p95"]
    np.testing.assert_allclose(line.get_ydata(), key.quantile(0.95).to_numpy(), rtol=1e-12)


def test_a_directory_of_part_files_reads_like_one_file(tmp_path):
    rows = deviation_rows({"self": (2, 3), "cross": (1, 2)}, non_converged=2)
    single = read_run(write_run(tmp_path / "file", rows, manifest_for()))
    parts = read_run(write_run(tmp_path / "parts", rows, manifest_for(), parts=3))
    assert single.counts(main=False)["rows"] == len(rows)
    pd.testing.assert_frame_equal(summarize(single), summarize(parts))


def test_old_runs_and_null_columns_skip_their_figures(tmp_path):
    rows = deviation_rows({"self": (2, 2)}, non_converged=0)
    old = write_run(tmp_path / "old", rows, manifest_for(), columns=DEVIATION_SCHEMA.names[:14])
    assert figure_files(build_report(old)) == core_figures(["self"])  # n_keys is constant: no drivers figure
    nulls = write_run(tmp_path / "nulls", deviation_rows({"self": (2, 2)}, null_columns=NEW_COLUMNS + (
        "token", "token_role", "space", "trivial")), manifest_for())
    report = build_report(nulls)
    assert figure_files(report) == core_figures(["self"])
    assert pd.read_csv(report / "summary.csv")["count"].sum() > 0


# --------------------------------------------------------------------------------------------------
# degraded input that still gives a report


@pytest.mark.parametrize("manifest, problem", [(None, "is missing"), ("{not json", "could not be read")])
def test_missing_or_invalid_manifest_only_warns(tmp_path, manifest, problem):
    rows = deviation_rows({"self": (2, 2)}, examples=2, queries=3, non_converged=0, alphas=(0.5,))
    run_dir = write_run(tmp_path / "run", rows, manifest)
    with pytest.warns(UserWarning, match="manifest.json"):
        report = build_report(run_dir)
    assert report == run_dir / "report"
    assert core_figures(["self"]) <= figure_files(report)
    page = (report / "index.html").read_text(encoding="utf-8")
    assert problem in page
    assert "org/tiny-model" in page and "α = 0.5" in page  # taken from the table instead


def test_empty_run_gives_a_no_data_report(tmp_path):
    rows = deviation_rows({"self": (1, 1)}, non_converged=0).iloc[:0]
    run_dir = write_run(tmp_path / "run", rows, manifest_for())
    report = build_report(run_dir, formats=("png", "pdf"))
    assert figure_files(report) == set()
    summary = pd.read_csv(report / "summary.csv")
    assert summary.columns.tolist() == SUMMARY_HEADER and len(summary) == 0
    assert "No data" in (report / "index.html").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# bad input


def test_missing_run_directory(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(ProbeError, match="does not exist") as error:
        build_report(missing)
    assert str(missing) in str(error.value)


def test_directory_without_parquet(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest_for()))
    with pytest.raises(ProbeError) as error:
        build_report(tmp_path)
    assert str(tmp_path / "deviations.parquet") in str(error.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty directory"])
def test_corrupt_parquet(tmp_path, damage):
    run_dir = write_run(tmp_path / "run", deviation_rows({"self": (1, 2)}), manifest_for())
    parquet = run_dir / "deviations.parquet"
    content = parquet.read_bytes()
    if damage == "empty directory":
        parquet.unlink()
        parquet.mkdir()
    else:
        parquet.write_bytes(b"this is not parquet" if damage == "garbage" else content[: len(content) // 2])
    with pytest.raises(ProbeError, match="Cannot read|no parquet part files") as error:
        build_report(run_dir)
    assert str(parquet) in str(error.value)


def test_parquet_missing_columns_names_them(tmp_path):
    rows = deviation_rows({"self": (1, 2)}).drop(columns=["rel_deviation", "converged"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pq.write_table(pa.Table.from_pandas(rows, preserve_index=False), run_dir / "deviations.parquet")
    with pytest.raises(ProbeError, match="rel_deviation, converged") as error:
        build_report(run_dir)
    assert str(run_dir / "deviations.parquet") in str(error.value)


def test_unknown_format_is_rejected(tmp_path):
    run_dir = write_run(tmp_path / "run", deviation_rows({"self": (1, 2)}), manifest_for())
    with pytest.raises(ProbeError, match="svg"):
        build_report(run_dir, formats=["png", "svg"])
    assert not (run_dir / "report").exists()


def test_texts_are_recovered_only_when_their_hash_matches(tmp_path):
    from probe.capture.data import DatasetSpec, load_texts
    from probe.report.explorer import recover_texts

    corpus = load_texts(DatasetSpec())
    spec = {"name": None, "split": "train", "column": "text", "texts_sha256": corpus.sha256}
    assert recover_texts({"dataset": spec}) == dict(zip(corpus.indices, corpus.texts))
    assert recover_texts({"dataset": {**spec, "texts_sha256": "0" * 64}}) == {}
    local = tmp_path / "texts.txt"
    local.write_text("first text\n\nsecond text\n")
    texts = load_texts(DatasetSpec(name=str(local)))
    assert recover_texts({"dataset": {**spec, "name": str(local), "texts_sha256": texts.sha256}}) == {
        0: "first text", 2: "second text"}
    assert recover_texts({"dataset": {**spec, "name": str(tmp_path / "gone.txt")}}) == {}
    assert recover_texts({"dataset": {**spec, "name": "some/hub-dataset"}}) == {}
