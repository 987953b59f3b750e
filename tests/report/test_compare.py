"""``probe compare``: runs of different depth on shared axes, its table against pandas, and clear errors
when runs have nothing in common."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app
from probe.core.errors import ProbeError
from probe.report import compare_runs, read_run
from probe.report.compare import depth_figure, ecdf_figure
from probe.report.style import style

from ..support.synthetic_runs import deviation_rows, manifest_for, write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 'pretrained' 4-layer run with a [CLS] effect and a 2-layer 'random init' control, alpha 0.5 and 1."""
    base = tmp_path_factory.mktemp("compare")
    deep = deviation_rows({"self": (4, 2)}, examples=5, cls_factor=3.0, alphas=(1.0, 0.5))
    shallow = deviation_rows({"self": (2, 3)}, examples=5, alphas=(1.0,), seed=1)
    deep_dir = write_run(base / "deep", deep, manifest_for())
    shallow_dir = write_run(base / "shallow", shallow, manifest_for(init="random"))
    return {"deep": (deep, deep_dir), "shallow": (shallow, shallow_dir), "base": base}


def test_compare_writes_figures_and_a_table_matching_pandas(runs):
    (deep, deep_dir), (shallow, shallow_dir) = runs["deep"], runs["shallow"]
    out = compare_runs([deep_dir, shallow_dir], runs["base"] / "out")
    assert {p.name for p in out.iterdir()} == {"compare.csv", "index.html", "depth.png", "ecdf.png"}
    table = pd.read_csv(out / "compare.csv")
    assert table["run"].tolist() == ["org/tiny-model", "org/tiny-model (random init)"]
    for (_, got), rows in zip(table.iterrows(), (deep, shallow)):
        rows = rows[(rows["alpha"] == 1.0) & (rows["n_keys"] > 1)]
        values = rows["rel_deviation"]
        assert got["rows"] == len(rows) and got["layers"] == rows["layer"].nunique()
        for column, want in (("mean", values.mean()), ("median", values.median()), ("p95", values.quantile(0.95)),
                             ("max", values.max()), ("share_above_0.1", (values > 0.1).mean())):
            assert got[column] == pytest.approx(want, rel=1e-12), column
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "org/tiny-model vs org/tiny-model (random init) · α = 1, hidden space" in page
    assert "http" not in page.split("<body>")[1].split("<table")[0]


def test_depth_lines_up_models_of_different_depth_on_shared_axes(runs):
    (_, deep_dir), (shallow, shallow_dir) = runs["deep"], runs["shallow"]
    loaded = [read_run(deep_dir), read_run(shallow_dir)]
    with style():
        depth = depth_figure(loaded, ["deep", "shallow"], ["self"], 0.5, "t").figure
        ecdf = ecdf_figure(loaded, ["deep", "shallow"], ["self"], 0.5, "t").figure
    (ax,) = depth.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    np.testing.assert_allclose(lines["deep: mean"].get_xdata(), [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(lines["shallow: mean"].get_xdata(), [0.5, 1.0])
    want = shallow.groupby("layer")["rel_deviation"].mean()
    np.testing.assert_allclose(lines["shallow: mean"].get_ydata(), want.to_numpy(), rtol=1e-12)
    assert ax.get_ylim()[0] == 0
    (ax,) = ecdf.axes
    assert ax.get_xlim()[0] == 0 and ax.get_ylim() == (0, 1)


@pytest.mark.parametrize(
    "case, message",
    [
        ("one run", "at least two run directories"),
        ("same run twice", "given twice"),
        ("no common type", "share no attention type"),
        ("no common alpha", "share no (space, alpha) slice"),
        ("missing", "does not exist"),
        ("names", "one label per run (names=)"),
    ],
)
def test_runs_with_nothing_in_common_are_refused(runs, tmp_path, case, message):
    deep_dir, shallow_dir = runs["deep"][1], runs["shallow"][1]
    names = None
    if case == "one run":
        dirs = [deep_dir]
    elif case == "same run twice":
        dirs = [deep_dir, deep_dir]
    elif case == "no common type":
        dirs = [deep_dir, write_run(tmp_path / "t5", deviation_rows({"cross": (2, 2)}), manifest_for())]
    elif case == "no common alpha":
        dirs = [shallow_dir, write_run(tmp_path / "a2", deviation_rows({"self": (2, 2)}, alphas=(2.0,)), manifest_for())]
    elif case == "missing":
        dirs = [deep_dir, tmp_path / "nowhere"]
    else:
        dirs, names = [deep_dir, shallow_dir], ["only one"]
    with pytest.raises(ProbeError, match=re.escape(message)):
        compare_runs(dirs, tmp_path / "out", names=names)
    assert not (tmp_path / "out").exists()


def test_compare_command(runs, tmp_path):
    runner = CliRunner()
    deep_dir, shallow_dir = runs["deep"][1], runs["shallow"][1]
    result = runner.invoke(app, ["compare", str(deep_dir), str(shallow_dir), "--out", str(tmp_path / "c"),
                                 "--name", "pretrained", "--name", "random"])
    assert result.exit_code == 0, result.output
    assert pd.read_csv(tmp_path / "c" / "compare.csv")["run"].tolist() == ["pretrained", "random"]
    result = runner.invoke(app, ["compare", str(deep_dir)])
    assert result.exit_code == 2 and "at least two run directories" in result.output
    assert "Traceback" not in result.output



def test_compare_prints_the_headline_comparison(runs, tmp_path):
    """As `probe run` ends with its headline numbers, `probe compare` prints each run's: the non-trivial rows of
    the slice the runs share, their mean, p95 and share above 0.1, computed here with pandas."""
    (deep, deep_dir), (shallow, shallow_dir) = runs["deep"], runs["shallow"]
    result = CliRunner().invoke(app, ["compare", str(deep_dir), str(shallow_dir), "--out", str(tmp_path / "c"),
                                      "--name", "pretrained", "--name", "random init"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "rel_deviation, hidden space, alpha 1, over the non-trivial rows:", lines
    assert lines[-1] == f"comparison: {tmp_path / 'c' / 'index.html'}"
    for label, rows in (("pretrained", deep), ("random init", shallow)):
        values = rows[(rows["alpha"] == 1.0) & (rows["space"] == "hidden") & ~rows["trivial"]]["rel_deviation"]
        (line,) = [line for line in lines if line.strip().startswith(label + " ")]
        found = re.fullmatch(r"\s+" + re.escape(label) + r"\s+([\d,]+) rows: mean ([\d.e-]+), p95 ([\d.e-]+), "
                             r"([\d.]+)% above 0\.1", line)
        assert found, line
        assert int(found.group(1).replace(",", "")) == len(values)
        assert float(found.group(2)) == pytest.approx(values.mean(), rel=5e-3)
        assert float(found.group(3)) == pytest.approx(values.quantile(0.95), rel=5e-3)
        assert float(found.group(4)) == pytest.approx(100 * (values > 0.1).mean(), abs=0.05)
