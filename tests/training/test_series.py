"""probe.training.series and `probe series`: runs over the checkpoints of a training, ordered by step, and the compare
figures drawn against the step (probe.report.series), recomputed here from the runs' rows with pandas and numpy.

The checkpoints are tiny BERTs saved as a Trainer saves them (``checkpoint-N`` folders with a
``trainer_state.json``); bad input is refused by the command with exit status 2, one paragraph, nothing written.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import probe
from probe.cli import app
from probe.core.errors import ProbeError

from ..support.models import save_tiny_bert

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is the closed-form solution of a convex problem, or so the claim goes.",
    "Short one.",
    "Researchers measured the deviation for every layer, head and query token.",
    "Why?",
    "A second sentence about the weather, which was fine.",
]
MAX_LENGTH = 32


def _checkpoint(root, folder, minilm_dir, *, seed, step=None, layers=2):
    directory = save_tiny_bert(root / folder, minilm_dir, layers=layers, heads=2, hidden=32, seed=seed)
    if step is not None:
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 1.0}))
    return directory


@pytest.fixture(scope="module")
def training(tmp_path_factory, minilm_dir):
    """A Trainer's output folder: checkpoint-30's state says step 25 (the state wins over the name)."""
    root = tmp_path_factory.mktemp("train")
    _checkpoint(root, "checkpoint-30", minilm_dir, seed=3, step=25)
    _checkpoint(root, "checkpoint-10", minilm_dir, seed=1, step=10)
    _checkpoint(root, "checkpoint-20", minilm_dir, seed=2, step=20)
    return root


def _weighted_quantile(values_by_example, weights, q):
    values = np.concatenate([np.repeat(v, int(w)) for v, w in zip(values_by_example, weights, strict=True) if w])
    return float(np.quantile(values, q))


@pytest.mark.slow
def test_a_series_orders_by_step_and_its_figures_are_recomputed_from_the_runs(training, tmp_path):
    from probe.report.series import P95_BINS, REPLICATES, SEED
    from probe.training.series import run_series

    series = run_series(str(training), random_init=True, texts=TEXTS, max_length=MAX_LENGTH, out=tmp_path / "runs",
                        progress=False)
    assert [c.step for c in series.checkpoints] == [0, 10, 20, 25]
    assert [c.source for c in series.checkpoints] == ["random init"] + ["trainer_state.json"] * 3
    assert [c.init for c in series.checkpoints] == ["random", "pretrained", "pretrained", "pretrained"]
    for checkpoint, run in zip(series.checkpoints, series.runs, strict=True):
        loaded = probe.load(run.run_dir)  # an ordinary, intact run
        assert loaded.manifest["config"]["step"] == checkpoint.step
        assert loaded.manifest["status"] == "complete"
    assert series.runs[-1].run_dir.name.startswith(f"{training.name}-step25-")
    assert (series.compare / "series.png").is_file() and (series.compare / "series_layers.png").is_file()
    assert "Over training" in (series.compare / "index.html").read_text()

    table = pd.read_csv(series.compare / "series.csv")
    assert list(table.drop_duplicates("step")["step"]) == [0, 10, 20, 25]
    for checkpoint, run in zip(series.checkpoints, series.runs, strict=True):
        rows = probe.load(run.run_dir).rows
        rows = rows[~rows["trivial"]]
        examples = np.sort(rows["example"].unique())
        picks = np.random.default_rng(SEED).integers(0, len(examples), size=(REPLICATES, len(examples)))
        weights = np.stack([np.bincount(p, minlength=len(examples)) for p in picks])
        width = rows["rel_deviation"].max() / P95_BINS
        mine = table[table["step"] == checkpoint.step]
        assert len(mine) == 1 + rows["layer"].nunique()
        for layer in [None, *sorted(rows["layer"].unique())]:
            part = rows if layer is None else rows[rows["layer"] == layer]
            got = mine[mine["layer"].isna()] if layer is None else mine[mine["layer"] == layer]
            got = got.iloc[0]
            values = part["rel_deviation"].to_numpy()
            assert got["count"] == len(values)
            assert got["mean"] == pytest.approx(values.mean(), abs=1e-12)
            assert got["p95"] == pytest.approx(np.quantile(values, 0.95), abs=1e-12)
            assert got["share_above_0.1"] == pytest.approx((values > 0.1).mean(), abs=1e-12)
            by_example = [part.loc[part["example"] == e, "rel_deviation"].to_numpy() for e in examples]
            n = np.array([len(v) for v in by_example], dtype=float)
            sums = np.array([v.sum() for v in by_example])
            above = np.array([(v > 0.1).sum() for v in by_example], dtype=float)
            for name, replicates in (("mean", weights @ sums / (weights @ n)),
                                     ("share_above_0.1", weights @ above / (weights @ n))):
                low, high = np.quantile(replicates, [0.025, 0.975])
                assert got[f"{name}_low"] == pytest.approx(low, abs=1e-12), (checkpoint.step, layer, name)
                assert got[f"{name}_high"] == pytest.approx(high, abs=1e-12), (checkpoint.step, layer, name)
            p95s = [_weighted_quantile(by_example, w, 0.95) for w in weights]
            low, high = np.quantile(p95s, [0.025, 0.975])
            assert abs(got["p95_low"] - low) <= width and abs(got["p95_high"] - high) <= width
            assert got["mean_low"] <= got["mean"] <= got["mean_high"]
    events = pd.read_csv(series.compare / "series_findings.csv")
    assert set(events["event"]) <= {"present", "appears", "vanishes"}
    assert events["step"].is_monotonic_increasing


def test_findings_that_appear_and_vanish(monkeypatch):
    """The appear/vanish rule on findings given by hand: a finding persists while any of its descriptions does."""
    from types import SimpleNamespace

    from probe.report import findings as findings_module
    from probe.report import series as series_module

    def found(kind, value, ratio=2.0, same=()):
        return {"attention_type": "self", "kind": kind, "value": value, "name": f"{kind} {value}", "ratio": ratio,
                "text": f"{kind} {value}", "same_rows": [{"kind": k, "value": v} for k, v in same]}

    by_step = {
        0: [],
        5: [found("head", [0, 1]), found("query_position", 0)],
        9: [found("token", "[CLS]", same=[("query_position", 0)])],  # the position-0 finding, named by its token
        12: [],
    }
    runs = [SimpleNamespace(manifest={"config": {"step": step}}, step=step) for step in (12, 0, 9, 5)]
    monkeypatch.setattr(findings_module, "findings", lambda run: by_step[run.step])
    events = series_module.finding_events(runs, ["a", "b", "c", "d"])
    assert list(zip(events["step"], events["event"], events["finding"], strict=True)) == [
        (5, "appears", "head [0, 1]"), (5, "appears", "query_position 0"),
        (9, "vanishes", "head [0, 1]"),
        (12, "vanishes", "token [CLS]"),
    ]


def test_histogram_quantile_is_within_a_bin_of_the_exact_one():
    from probe.report.series import histogram_quantile

    values = np.random.default_rng(1).gamma(2.0, 0.03, size=997)
    edges = np.linspace(0, values.max(), 257)
    counts, _ = np.histogram(values, edges)
    for q in (0.05, 0.5, 0.95, 1.0):
        assert abs(histogram_quantile(counts, edges, q)[0] - np.quantile(values, q)) <= edges[1] - edges[0]


runner = CliRunner()


def _refused(*args, match):
    result = runner.invoke(app, ["series", *map(str, args), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and match in result.output, result.output
    return result


def test_bad_series_are_refused_before_anything_is_written(training, minilm_dir, tmp_path):
    out = tmp_path / "runs"
    common = ("--out", out, "--max-length", MAX_LENGTH)
    deeper = _checkpoint(tmp_path, "deeper", minilm_dir, seed=4, step=40, layers=3)
    _refused(training / "checkpoint-10", deeper, *common, match="share one architecture")
    unnamed = _checkpoint(tmp_path, "final", minilm_dir, seed=5)
    _refused(training / "checkpoint-10", unnamed, *common, match="Cannot find the step of")
    _refused(training, "--steps", "1,2", *common, match="--steps gives 2 step(s) for 3 checkpoint(s)")
    _refused(training / "checkpoint-10", "--steps", "0", "--random-init", *common, match="Step 0 appears twice")
    _refused(training / "checkpoint-10", "--steps", "x", *common, match="whole numbers")
    _refused(training / "checkpoint-10", *common, match="at least two checkpoints")
    _refused(training, "--revision", "step1,step2", *common, match="--revision applies to hub ids")
    _refused("some-org/some-model", "--revision", "step1,step2", *common,
             match="some-org/some-model@step1 (step 1) cannot be measured")
    _refused("some-org/some-model", "--revision", "main,step2", *common,
             match="Cannot find the step of revision 'main'")
    _refused(training, "--max-length", 1000, "--out", out, match="--max-length 1000 is more than")
    assert not out.exists()


def test_checkpoints_reads_steps_from_names_when_no_state_says_them(tmp_path, minilm_dir):
    from probe.training.series import checkpoints

    _checkpoint(tmp_path, "step200", minilm_dir, seed=1)
    _checkpoint(tmp_path, "step100", minilm_dir, seed=2)
    found = checkpoints([str(tmp_path / "step200"), str(tmp_path / "step100")])
    assert [(c.step, c.source) for c in found] == [(100, "folder name"), (200, "folder name")]
    given = checkpoints([str(tmp_path / "step200"), str(tmp_path / "step100")], steps="7,3")
    assert [(c.step, c.source, c.model.endswith("step100")) for c in given] == [(3, "given", True), (7, "given", False)]
    with pytest.raises(ProbeError, match="revisions of one model"):
        checkpoints(["a/b", "c/d"], revisions="step1")
    assert math.isfinite(found[0].step)


@pytest.mark.parametrize("step, match", [(-1, "whole number >= 0"), (1.5, "takes a whole number"), (True, "whole")])
def test_a_run_refuses_a_step_that_is_not_one(tmp_path, tiny_bert_dir, step, match):
    with pytest.raises(ProbeError, match=match):
        probe.run(tiny_bert_dir, texts=TEXTS, step=step, out=tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_runs_made_one_by_one_with_a_step_are_drawn_as_a_series(training, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "runs"
    for step in (20, 10):
        done = runner.invoke(app, ["run", str(training / f"checkpoint-{step}"), "--dataset", str(texts), "--step",
                                   str(step), "--max-length", str(MAX_LENGTH), "--out", str(out), "--no-progress"])
        assert done.exit_code == 0, done.output
    runs = sorted(out.iterdir())
    assert sorted(probe.load(run).manifest["config"]["step"] for run in runs) == [10, 20]
    compared = runner.invoke(app, ["compare", *map(str, runs), "--out", str(tmp_path / "compare")])
    assert compared.exit_code == 0, compared.output
    table = pd.read_csv(tmp_path / "compare" / "series.csv")
    assert list(table.drop_duplicates("step")["step"]) == [10, 20]
    # without a step on every run, no series
    plain = runner.invoke(app, ["run", str(training / "checkpoint-10"), "--dataset", str(texts), "--max-length",
                                str(MAX_LENGTH), "--out", str(tmp_path / "plain"), "--no-progress"])
    assert plain.exit_code == 0, plain.output
    mixed = runner.invoke(app, ["compare", str(runs[0]), *map(str, (tmp_path / "plain").iterdir()),
                                "--out", str(tmp_path / "mixed")])
    assert mixed.exit_code == 0, mixed.output
    assert not (tmp_path / "mixed" / "series.csv").exists()


def test_a_run_of_many_examples_resamples_blocks_of_them(tiny_bert_dir, tmp_path, monkeypatch):
    from probe.report import series as series_module
    from probe.report.data import read_run

    run = probe.run(tiny_bert_dir, texts=TEXTS, max_length=MAX_LENGTH, out=tmp_path / "runs", progress=False)
    monkeypatch.setattr(series_module, "MAX_UNITS", 4)  # 6 examples: 3 blocks of 2
    (whole, *_layers) = series_module.run_statistics(read_run(run.run_dir), "self", "run", 0)
    rows = run.rows[~run.rows["trivial"]]
    examples = np.sort(rows["example"].unique())
    blocks = [examples[i:i + 2] for i in range(0, len(examples), 2)]
    n = np.array([rows["example"].isin(b).sum() for b in blocks], dtype=float)
    sums = np.array([rows.loc[rows["example"].isin(b), "rel_deviation"].sum() for b in blocks])
    picks = np.random.default_rng(series_module.SEED).integers(0, 3, size=(series_module.REPLICATES, 3))
    weights = np.stack([np.bincount(p, minlength=3) for p in picks])
    low, high = np.quantile(weights @ sums / (weights @ n), [0.025, 0.975])
    assert whole["examples"] == len(examples) == 6
    assert whole["mean_low"] == pytest.approx(low, abs=1e-12) and whole["mean_high"] == pytest.approx(high, abs=1e-12)


def test_the_training_page_quotes_the_committed_study():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    table = pd.read_csv(root / "reports" / "training" / "series.csv")
    page = " ".join((root / "docs" / "training.md").read_text().split())
    first, last = table["step"].min(), table["step"].max()

    def row(step, layer=None):
        part = table[table["step"] == step]
        return (part[part["layer"].isna()] if layer is None else part[part["layer"] == layer]).iloc[0]

    start, end = row(first), row(last)
    quoted = [f"{100 * start[f'share_above_0.1{end_}']:.1f}%" for end_ in ("", "_low", "_high")]
    quoted += [f"{100 * end[f'share_above_0.1{end_}']:.1f}%" for end_ in ("", "_low", "_high")]
    quoted += [f"{start['mean']:.4f}", f"{end['mean']:.4f}", f"{last} steps"]
    for layer in (5, 3):
        quoted += [f"{100 * row(step, layer)['share_above_0.1']:.1f}%" for step in (first, last)]
    for number in quoted:
        assert number in page, number
    assert round(100 * (1 - end["mean"] / start["mean"])) == 5 and "mean falls by 5%" in page
    events = pd.read_csv(root / "reports" / "training" / "series_findings.csv")
    assert set(events["event"]) == {"present"} and "none appears or vanishes" in page
    results = (root / "reports" / "training" / "results.md").read_text()
    assert "took 2494 s, of which the measurements took 62 s (2%)" in results and "62 s of the 2494 s" in page
    assert results.count("within 0.0e+00") == 4 and "exactly" in page


def _unknown_tokenizer_checkpoints(root, minilm_dir):
    """Two checkpoints whose own tokenizer knows a handful of words (most of TEXTS become its unknown token);
    MiniLM's tokenizer, which knows them, is the one to give with --tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "the": 4, "fox": 5}
    model = Tokenizer(WordLevel(words, unk_token="[UNK]"))
    model.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]")
    made = []
    for step, seed in ((10, 1), (20, 2)):
        directory = _checkpoint(root, f"checkpoint-{step}", minilm_dir, seed=seed, step=step)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            (directory / name).unlink(missing_ok=True)
        tokenizer.save_pretrained(directory)
        made.append(directory)
    return made


@pytest.mark.slow
def test_series_takes_the_run_options_and_each_run_equals_probe_run(tmp_path, minilm_dir):
    """`probe series` takes every run option that means the same for each checkpoint, from the one declaration
    `probe run` uses: a series refused for its unknown tokens runs with --allow-unknown-tokens, and with
    --tokenizer; each of its runs has the rows of `probe run` of that checkpoint with the same options."""
    root = tmp_path / "train"
    checkpoints = _unknown_tokenizer_checkpoints(root, minilm_dir)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    common = ["--dataset", data, "--max-length", MAX_LENGTH, "--no-progress"]
    _refused(root, *common, "--out", tmp_path / "refused", match="--allow-unknown-tokens")
    assert not (tmp_path / "refused").exists()
    variants = {
        "allowed": ["--allow-unknown-tokens"],
        "tokenizer": ["--tokenizer", str(minilm_dir), "--layers", "-1", "--queries", "last", "--seed", "3"],
    }
    for variant, options in variants.items():
        out = tmp_path / variant
        result = runner.invoke(app, ["series", str(root), *map(str, common), "--out", str(out), *options])
        assert result.exit_code == 0, result.output
        series_runs = sorted(path for path in out.iterdir() if (path / "manifest.json").is_file())
        assert len(series_runs) == 2
        for checkpoint, run_dir in zip(checkpoints, series_runs, strict=True):
            alone = probe.run(checkpoint, dataset=data, max_length=MAX_LENGTH, out=tmp_path / f"alone-{variant}",
                              progress=False, allow_unknown_tokens=variant == "allowed",
                              **({"tokenizer": minilm_dir, "layers": "-1", "queries": "last", "seed": 3}
                                 if variant == "tokenizer" else {}))
            ours, theirs = probe.load(run_dir).rows, alone.rows
            assert len(ours) == len(theirs) > 0
            columns = ["attention_type", "layer", "head", "example", "query", "token", "rel_deviation"]
            pd.testing.assert_frame_equal(ours[columns], theirs[columns])
        if variant == "tokenizer":
            last = probe.load(series_runs[0]).rows
            assert set(last["layer"]) == {1} and last.groupby("example")["query"].nunique().eq(1).all()
            assert "layers 1; the last token of each text" in (out / "train-series" / "index.html").read_text()


def test_a_checkpoint_given_twice_is_refused(training, tmp_path):
    _refused(training / "checkpoint-10", training / "checkpoint-20", training / "checkpoint-10",
             "--out", tmp_path / "runs", match="is given twice")
    _refused(training, "--layers", "5", "--out", tmp_path / "runs",
             match="5 is out of range for this model (self: 2 layers")
    assert not (tmp_path / "runs").exists()
@pytest.mark.slow
def test_a_series_of_runs_that_kept_aggregates_has_the_intervals_of_their_rows(training, tmp_path):
    """``--keep aggregates``: the bootstrap over examples from the per-example sums the runs kept gives the mean's
    and share's intervals of the same runs keeping their rows (to 1e-9); the p95 and its interval within a coarse
    bin (1/128) or the sketch's rank error."""
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    tables = {}
    for keep in ("rows", "aggregates"):
        out = tmp_path / keep
        for step in (20, 10):
            done = runner.invoke(app, ["run", str(training / f"checkpoint-{step}"), "--dataset", str(texts), "--step",
                                       str(step), "--max-length", str(MAX_LENGTH), "--out", str(out), "--no-progress",
                                       "--keep", keep])
            assert done.exit_code == 0, done.output
        compared = runner.invoke(app, ["compare", *map(str, sorted(out.iterdir())), "--out", str(tmp_path / f"c-{keep}")])
        assert compared.exit_code == 0, compared.output
        tables[keep] = pd.read_csv(tmp_path / f"c-{keep}" / "series.csv")
    rows, kept = tables["rows"], tables["aggregates"]
    assert list(kept["step"]) == list(rows["step"]) and (kept["count"] == rows["count"]).all()
    for column in ("mean", "mean_low", "mean_high", "share_above_0.1", "share_above_0.1_low", "share_above_0.1_high"):
        assert np.allclose(kept[column], rows[column], rtol=1e-9, atol=1e-12), column
    for column in ("p95_low", "p95_high"):
        assert (np.abs(kept[column] - rows[column]) <= 1 / 128 + 1e-12).all(), column
