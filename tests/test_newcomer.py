"""What a new user meets first (issue 25): each defect found by trying probe as a newcomer, as a test
that failed before its fix.  Export by extension; options that do not apply to the model's family;
the progress bar and the final lines; silence under --no-progress; fast option errors; help text; one
error prefix; no top-level module but probe; figures that keep their aspect ratio in a browser; the
landing table and the histograms saying which statistic each shows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app

from .families import save_tiny, spec

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def finished_run(tiny_bert_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    texts = out / "texts.txt"
    texts.write_text("The quick brown fox jumps over the lazy dog.\nShort one.\nWhy?\n")
    result = invoke("run", tiny_bert_dir, "--dataset", texts, "--batch-size", 2, "--out", out / "r", "--no-progress")
    assert result.exit_code == 0, result.output
    (run_dir,) = (out / "r").iterdir()
    return run_dir, result


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


# --------------------------------------------------------------------------------------------------
# export


def test_export_to_csv_writes_csv(finished_run, tmp_path):
    run_dir, _ = finished_run
    to = tmp_path / "rows.csv"
    result = invoke("export", run_dir, "--to", to)
    assert result.exit_code == 0, result.output
    assert not to.read_bytes().startswith(b"PAR1")
    written = pd.read_csv(to)
    rows = pd.read_parquet(run_dir / "deviations.parquet")
    assert len(written) == len(rows) and list(written.columns) == list(rows.columns)
    assert written["rel_deviation"].to_numpy() == pytest.approx(rows["rel_deviation"].to_numpy(), rel=1e-12)
    assert (written["token"].astype(str) == rows["token"].astype(str)).all()


def test_export_to_parquet_writes_parquet(finished_run, tmp_path):
    run_dir, _ = finished_run
    to = tmp_path / "rows.PARQUET"
    assert invoke("export", run_dir, "--to", to).exit_code == 0
    assert to.read_bytes()[:4] == b"PAR1"
    pd.testing.assert_frame_equal(pd.read_parquet(to), pd.read_parquet(run_dir / "deviations.parquet"))


@pytest.mark.parametrize("name", ["rows.xlsx", "rows", "rows.json"])
def test_export_refuses_an_unknown_extension(finished_run, tmp_path, name):
    run_dir, _ = finished_run
    result = invoke("export", run_dir, "--to", tmp_path / name)
    assert result.exit_code == 2 and "*.parquet or *.csv" in result.output, result.output
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------
# options that do not apply to the model's family


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory, minilm_dir):
    return save_tiny(spec("gpt2"), tmp_path_factory.mktemp("tiny-gpt2"), minilm_dir)


@pytest.mark.parametrize("family, kind", [("bert", "encoder-only"), ("gpt2", "decoder-only")])
def test_target_column_is_refused_for_models_without_a_decoder_input(
    family, kind, tiny_bert_dir, tiny_gpt2_dir, tmp_path, monkeypatch
):
    import probe.loading

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the options were checked")

    monkeypatch.setattr(probe.loading, "load_model", no_weights)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"text": f"source {i}", "target": f"target {i}"}) + "\n" for i in range(3)))
    model = tiny_bert_dir if family == "bert" else tiny_gpt2_dir
    out = tmp_path / "runs"
    result = invoke("run", model, "--dataset", data, "--target-column", "target", "--out", out, "--no-progress")
    assert result.exit_code == 2, result.output
    assert "--target-column applies to encoder-decoder models" in result.output and kind in result.output
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# what a run prints


def test_progress_says_what_it_does_and_counts_the_rows_it_writes(tiny_bert_dir, texts_file, tmp_path):
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--batch-size", 2, "--out", out, "--progress")
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    rows = json.loads((run_dir / "manifest.json").read_text())["solver"]["rows"]
    text = result.output.replace("\r", "\n")
    loading, planning = text.index("probe: loading"), text.index("probe: planning")
    first_bar = text.index("probe: solving")
    assert text.index("probe: checking") < loading < planning < first_bar
    shown = re.findall(r"rows=([\d,]+)", text)
    assert shown and int(shown[-1].replace(",", "")) == rows


def test_a_resumed_runs_bar_counts_every_row_of_the_run(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    from .test_resume import interrupted_run

    run_dir = interrupted_run(tiny_bert_dir, texts_file, tmp_path / "runs", monkeypatch)
    result = invoke("resume", run_dir, "--progress")
    assert result.exit_code == 0, result.output
    rows = json.loads((run_dir / "manifest.json").read_text())["solver"]["rows"]
    shown = re.findall(r"rows=([\d,]+)", result.output.replace("\r", "\n"))
    assert shown and int(shown[-1].replace(",", "")) == rows
    assert "probe: loading" in result.output


def test_final_lines_give_headline_numbers_and_the_next_command(finished_run):
    run_dir, result = finished_run
    rows = pd.read_parquet(run_dir / "deviations.parquet")
    measured = rows[~rows["trivial"]]["rel_deviation"]
    lines = result.output.strip().splitlines()
    assert f"mean {measured.mean():.3g}, p95 {measured.quantile(0.95):.3g}, max {measured.max():.3g}" in lines[1]
    assert f"over {len(measured):,} non-trivial rows" in lines[1]
    assert lines[-1].startswith(f"next: probe report {run_dir}")


def test_no_progress_prints_only_the_final_lines(tiny_bert_dir, texts_file, tmp_path):
    """A real process (transformers' own bars write to the real stderr): nothing on stderr, and stdout
    holds the final lines only."""
    out = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "run", str(tiny_bert_dir), "--dataset", str(texts_file), "--out",
         str(out), "--threads", "1", "--no-progress"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert lines[0].startswith(f"{Path(tiny_bert_dir).name}: ") and lines[1].startswith("rel_deviation, hidden space")
    assert lines[2].startswith("run directory: ") and lines[3].startswith("next: probe report ")


# --------------------------------------------------------------------------------------------------
# option errors: fast, one prefix


def _timed(*args) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    return time.perf_counter() - started, done


def test_option_errors_come_before_anything_heavy_is_imported():
    """A bad option is refused without importing torch or transformers, so within half a second on an
    idle machine; measured here against importing torch itself on the same (shared) machine."""
    probe_torch = ("import sys, runpy; sys.argv = ['probe', 'run', 'some-model', '--alpha', 'x']\n"
                   "try:\n    runpy.run_path('cli.py', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                   "print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))")
    _, done = _timed("-c", probe_torch)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    torch_s = min(_timed("-c", "import torch")[0] for _ in range(2))
    error_s = min(_timed("cli.py", "run", "some-model", "--batch-size", "0")[0] for _ in range(3))
    assert error_s < max(0.5, torch_s / 2), (error_s, torch_s)


@pytest.mark.parametrize("args, message", [
    (["run", "some-model", "--batch-size", "0"], "--batch-size must be at least 1"),  # probe's own check
    (["run", "--batch-size", "x"], "Invalid value for '--batch-size'"),  # click's
    (["export", "nowhere", "--to", "x.csv"], "nowhere"),
])
def test_every_error_has_one_prefix(args, message):
    _, done = _timed("cli.py", *args)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "rror" in line]
    assert errors and all(line.startswith("Error: ") for line in errors), done.stderr
    assert message in done.stderr
    assert "╭" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["run", "resume", "status", "export", "report", "compare", "verify", "vit train"])
def test_help_has_no_glitches(command):
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=100, env={"COLUMNS": "100"})
    assert result.exit_code == 0
    text = result.output
    assert "<bool>" not in text and "<str>" not in text and "<path>" not in text and "{" not in text
    assert not re.search(r"\w \.(\s|$)", text), text  # no space before a full stop
    assert " ," not in text
    lines = text.splitlines()
    for line, following in zip(lines, lines[1:]):  # a wrap never splits a formula or a bracket's first word
        assert not re.search(r"(\(\w|=|\[\w+:)$", line.rstrip()), (line, following)


# --------------------------------------------------------------------------------------------------
# packaging


def test_the_package_installs_no_top_level_module_but_probe():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project.get("tool", {}).get("setuptools", {})
    assert "py-modules" not in setuptools
    assert setuptools["packages"]["find"]["include"] == ["probe*"]
    assert project["project"]["scripts"] == {"probe": "probe.cli:main"}
    assert (ROOT / "probe" / "cli.py").exists()
    shim = (ROOT / "cli.py").read_text()
    assert "from probe.cli import" in shim and len(shim.splitlines()) < 15  # the repository's cli.py is a shim


# --------------------------------------------------------------------------------------------------
# the report in a browser; which statistic each place shows


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_figures_keep_their_aspect_ratio_in_chromium(finished_run, tiny_bert_dir, texts_file, tmp_path):
    from probe.report import build_report, compare_runs

    from .test_report_page import load_check_html

    run_dir, _ = finished_run
    report = build_report(run_dir, tmp_path / "report")
    out = tmp_path / "runs"
    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--init", "random", "--out", out, "--no-progress")
    assert result.exit_code == 0, result.output
    (other,) = out.iterdir()
    compared = compare_runs([run_dir, other], tmp_path / "compare")
    check_html = load_check_html()
    with check_html.Browser() as browser:
        for page in (report / "index.html", compared / "index.html"):
            browser.open(page)
            shapes = browser.evaluate(
                "Array.from(document.querySelectorAll('figure img')).map(i => { const r = i.getBoundingClientRect();"
                " return [i.naturalWidth, i.naturalHeight, r.width, r.height]; })"
            )
            assert shapes, page
            for natural_w, natural_h, width, height in shapes:
                assert natural_w > 0 and width > 0
                assert (height / width) == pytest.approx(natural_h / natural_w, rel=0.02), (page, natural_w, natural_h, width, height)
            assert any(natural_w > 1280 for natural_w, *_ in shapes) or page == compared / "index.html"


def test_each_statistic_is_labelled_where_it_is_shown(finished_run, tmp_path):
    from probe.report import build_report
    from probe.report.data import read_run
    from probe.report.figures import layers_figure, report_scale
    from probe.report.summary import main_rows, summarize

    run_dir, _ = finished_run
    page = (build_report(run_dir, tmp_path / "report") / "index.html").read_text()
    landing = page[page.index('<div id="headline">'):page.index('<div id="findings">')]
    assert "over every row" in landing and "head-averaged" in landing
    run = read_run(run_dir)
    drawn = layers_figure(run, "self", report_scale(run, main_rows(summarize(run), run, "head")))
    titles = [ax.get_title() for ax in drawn.figure.axes if ax.get_title().startswith("layer ")]
    assert titles and all("head-averaged values" in title for title in titles)
