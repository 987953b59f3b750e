"""The report: figures in every format, summary.csv against an independent pandas computation, the page,
and the errors users see for bad run directories.

Run directories are synthetic: a parquet with the exact schema of ``probe.schema`` filled with
reproducible random deviations, plus a manifest.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from probe.errors import ProbeError
from probe.report import build_report
from probe.schema import DEVIATION_SCHEMA

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
SUMMARY_HEADER = ["level", "attention_type", "layer", "head", "count", "mean", "median", "p95", "max", "non_converged"]
FIGURE_KINDS = ("layers", "heads", "heatmap_mean", "heatmap_p95")


def deviation_rows(shapes: dict[str, tuple[int, int]], *, examples=3, queries=5, non_converged=4, alpha=1.0, seed=0):
    """Rows for every (type, layer, head, example, query); ``shapes`` maps type -> (layers, heads)."""
    rng = np.random.default_rng(seed)
    index = pd.MultiIndex.from_tuples(
        [
            (kind, layer, head, example, query)
            for kind, (layers, heads) in shapes.items()
            for layer in range(layers)
            for head in range(heads)
            for example in range(examples)
            for query in range(queries)
        ],
        names=["attention_type", "layer", "head", "example", "query"],
    )
    rows = index.to_frame(index=False)
    n = len(rows)
    rows.insert(0, "model", "org/tiny-model")
    rows["n_keys"] = queries
    rows["alpha"] = alpha
    rows["rel_deviation"] = rng.gamma(2.0, 0.03, n) * (1 + 0.2 * rows["layer"])
    rows["lambda_norm"] = rng.uniform(1, 5, n)
    rows["duality_gap"] = rng.uniform(0, 1e-12, n)
    rows["error_bound"] = rng.uniform(0, 1e-10, n)
    rows["iterations"] = rng.integers(1, 8, n)
    rows["converged"] = True
    rows.loc[rng.choice(n, size=non_converged, replace=False), "converged"] = False
    rows["space"] = "hidden"
    rows["token_id"] = 1000 + rows["query"]
    rows["token"] = "tok" + rows["query"].astype(str)
    rows["token_role"] = "word"
    rows["trivial"] = rows["n_keys"] == 1
    for name in ("second_order_deviation", "attention_tv", "output_deviation"):
        rows[name] = rows["rel_deviation"] * rng.uniform(0.1, 0.5, n)
    rows["evidence_norm"] = rows["lambda_norm"] * rng.uniform(0.9, 1.1, n)
    rows["attention_entropy"] = rng.uniform(0.5, 2.5, n)
    return rows


def write_run(run_dir: Path, rows: pd.DataFrame, manifest: dict | str | None) -> Path:
    """A run directory: rows as deviations.parquet (exact schema) and the manifest (dict, raw text or none)."""
    run_dir.mkdir(parents=True)
    table = pa.Table.from_pandas(rows[list(DEVIATION_SCHEMA.names)], schema=DEVIATION_SCHEMA, preserve_index=False)
    pq.write_table(table, run_dir / "deviations.parquet", row_group_size=100)  # several row groups
    if isinstance(manifest, dict):
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    elif isinstance(manifest, str):
        (run_dir / "manifest.json").write_text(manifest)
    return run_dir


def manifest_for(description="tiny <b>corpus</b> & co", alpha=1.0):
    return {
        "probe_version": "0.1.0",
        "status": "complete",
        "model": {"id": "org/tiny-model", "model_type": "t5"},
        "dataset": {"description": description, "n_examples": 3},
        "alpha": alpha,
        "attention_implementation": "eager",
        "device": "cpu",
        "dtype": "float32",
        "fidelity": {"max_abs_error": 3.2e-7, "tolerance": 1e-5, "passed": True},
        "solver": {"rows": 123, "not_converged": 4, "max_duality_gap": 1e-12},
    }


def expected_figures(types, formats):
    return {f"overview.{fmt}" for fmt in formats} | {
        f"{kind}_{t}.{fmt}" for kind in FIGURE_KINDS for t in types for fmt in formats
    }


def figure_files(report: Path):
    return {p.name for p in report.iterdir() if p.suffix in (".png", ".pdf")}


@pytest.fixture(scope="module")
def two_types(tmp_path_factory):
    """A T5-like run with two attention types of different shapes, written cross first, reported as png+pdf."""
    rows = deviation_rows({"cross": (2, 2), "encoder_self": (3, 4)})
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "t5-run", rows, manifest_for())
    report = build_report(run_dir, run_dir / "out", formats=["png", "pdf"])
    return rows, report


# --------------------------------------------------------------------------------------------------
# figures and tables


def test_every_figure_is_written_in_every_format(two_types):
    _, report = two_types
    assert report.name == "out"
    assert figure_files(report) == expected_figures(["encoder_self", "cross"], ["png", "pdf"])
    for name in figure_files(report):
        content = (report / name).read_bytes()
        assert content.startswith(b"\x89PNG" if name.endswith(".png") else b"%PDF"), name


def independent_stats(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    grouped = rows.groupby(keys)
    return pd.DataFrame(
        {
            "count": grouped["rel_deviation"].count(),
            "mean": grouped["rel_deviation"].mean(),
            "median": grouped["rel_deviation"].median(),
            "p95": grouped["rel_deviation"].quantile(0.95),
            "max": grouped["rel_deviation"].max(),
            "non_converged": grouped["converged"].apply(lambda c: int((~c).sum())),
        }
    )


def read_summary(report: Path, level: str, keys: list[str]) -> pd.DataFrame:
    summary = pd.read_csv(report / "summary.csv")
    assert list(summary.columns) == SUMMARY_HEADER
    return summary[summary["level"] == level].set_index(keys)


@pytest.mark.parametrize(
    "level, keys", [("head", ["attention_type", "layer", "head"]), ("layer", ["attention_type", "layer"])]
)
def test_summary_matches_an_independent_computation(two_types, level, keys):
    rows, report = two_types
    got = read_summary(report, level, keys)
    want = independent_stats(rows, keys)
    assert sorted(got.index) == sorted(want.index)
    got = got.loc[want.index]
    for column in ("count", "non_converged"):
        assert got[column].tolist() == want[column].tolist(), column
    for column in ("mean", "median", "p95", "max"):
        np.testing.assert_allclose(got[column], want[column], rtol=1e-12, err_msg=column)
    if level == "layer":  # over all rows of the layer, and no head
        assert got["head"].isna().all()
        assert (got["count"] == rows.groupby(keys).size().loc[want.index]).all()


def test_summary_orders_levels_and_attention_types(two_types):
    _, report = two_types
    summary = pd.read_csv(report / "summary.csv")
    assert summary["level"].tolist() == ["layer"] * 5 + ["head"] * 16
    for level in ("layer", "head"):
        types = summary.loc[summary["level"] == level, "attention_type"]
        assert list(dict.fromkeys(types)) == ["encoder_self", "cross"]  # encoder first, though cross came first
    assert summary["non_converged"].sum() == 2 * 4  # each row counted once per level


def test_page_is_self_contained_and_escaped(two_types):
    _, report = two_types
    page = (report / "index.html").read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == len(expected_figures(["encoder_self", "cross"], ["png"]))
    assert not re.search(r"https?://", page)
    assert all(value.startswith("data:") for value in re.findall(r'(?:src|href)="([^"]*)"', page))
    assert "<link" not in page and "<script" not in page
    assert "tiny &lt;b&gt;corpus&lt;/b&gt; &amp; co" in page and "<b>corpus" not in page
    assert "org/tiny-model" in page and "α = 1" in page
    assert "4 of 240 rows did not meet" in page  # non-converged rows are reported
    assert "<details>" in page and "3.2e-07" in page  # head table collapsed; fidelity from the manifest


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_page_renders_in_headless_chromium(two_types, tmp_path):
    _, report = two_types
    shot = tmp_path / "page.png"
    command = [sys.executable, str(REPO / "scripts" / "check_html.py"), str(report / "index.html")]
    result = subprocess.run([*command, "--screenshot", str(shot)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert shot.stat().st_size > 20_000


# --------------------------------------------------------------------------------------------------
# degraded input that still gives a report


@pytest.mark.parametrize("manifest, problem", [(None, "is missing"), ("{not json", "could not be read")])
def test_missing_or_invalid_manifest_only_warns(tmp_path, manifest, problem):
    rows = deviation_rows({"self": (2, 2)}, examples=2, queries=3, non_converged=0, alpha=0.5)
    run_dir = write_run(tmp_path / "run", rows, manifest)
    with pytest.warns(UserWarning, match="manifest.json"):
        report = build_report(run_dir)
    assert report == run_dir / "report"
    assert figure_files(report) == expected_figures(["self"], ["png"])
    page = (report / "index.html").read_text(encoding="utf-8")
    assert problem in page
    assert "org/tiny-model" in page and "α = 0.5" in page  # taken from the parquet instead


def test_empty_run_gives_a_no_data_report(tmp_path):
    rows = deviation_rows({"self": (1, 1)}, non_converged=0).iloc[:0]
    run_dir = write_run(tmp_path / "run", rows, manifest_for())
    report = build_report(run_dir, formats=("png", "pdf"))
    assert figure_files(report) == set()
    assert pd.read_csv(report / "summary.csv").columns.tolist() == SUMMARY_HEADER
    assert len(pd.read_csv(report / "summary.csv")) == 0
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


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_parquet(tmp_path, damage):
    run_dir = write_run(tmp_path / "run", deviation_rows({"self": (1, 2)}), manifest_for())
    parquet = run_dir / "deviations.parquet"
    content = parquet.read_bytes()
    parquet.write_bytes(b"this is not parquet" if damage == "garbage" else content[: len(content) // 2])
    with pytest.raises(ProbeError, match="Cannot read") as error:
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
