"""``--samples random:N`` (``probe.run(samples="random:N")``): N texts drawn at random by the run's ``--seed``,
recorded in the manifest, and read again by ``probe resume``: a run stopped after its first batch and resumed
has the rows of an uninterrupted run of the same sample."""

from __future__ import annotations

import numpy as np
import pandas as pd
from typer.testing import CliRunner

import probe
from probe.cli import app
from probe.core.schema import ROW_KEY

from ..support.runs import interrupted_run


def sorted_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(list(ROW_KEY)).reset_index(drop=True)


TEXTS = [f"Sentence {i} of a corpus sorted by its source, about {word}." for i, word in
         enumerate(["cats", "dogs", "rivers", "mountains", "cities", "music", "rain", "books", "trains", "salt"])]


def test_a_random_sample_is_seeded_recorded_and_resumed(tiny_bert_dir, tmp_path, monkeypatch):
    data = tmp_path / "sorted.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    options = ["--samples", "random:6", "--seed", "7", "--max-length", "24"]
    run_dir = interrupted_run(tiny_bert_dir, data, tmp_path / "stopped", monkeypatch, *options)
    resumed = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    whole = probe.run(tiny_bert_dir, dataset=data, samples="random:6", seed=7, max_length=24, batch_size=2,
                      out=tmp_path / "whole", progress=False)
    drawn = sorted(np.random.default_rng(7).choice(len(TEXTS), size=6, replace=False))
    for run in (probe.load(run_dir), whole):
        assert run.manifest["config"]["dataset"]["samples"] == 6
        assert run.manifest["config"]["dataset"]["sample_seed"] == 7  # the sample is recorded with its seed
        assert "a random sample of 6 drawn with seed 7" in run.manifest["dataset"]["description"]
        assert sorted(run.rows["example"].unique()) == drawn  # the texts' lines in the file
    pd.testing.assert_frame_equal(sorted_rows(probe.load(run_dir).rows), sorted_rows(whole.rows))
    first = probe.run(tiny_bert_dir, dataset=data, samples=6, seed=7, max_length=24, out=tmp_path / "first",
                      progress=False)
    assert sorted(first.rows["example"].unique()) == [0, 1, 2, 3, 4, 5]  # a count alone: the first texts
