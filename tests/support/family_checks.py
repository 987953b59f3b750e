"""Checks shared by the per-family tests (MPNet, DeBERTa-v2, BLOOM, the real checkpoints).

* :func:`cli_run`: ``probe run`` through the typer app on a local text file; returns the rows and manifest.
* :func:`assert_complete_run`: rows per attention type as counted here from the tokenizer alone, fidelity
  passed, every row converged.
* :func:`assert_reproduces_output_attentions`: each captured site, rebuilt as ``softmax(log u + s)``,
  equals the attentions the model returns with ``output_attentions=True`` (independent of the hooks).
* :func:`real_model_dir`: a real checkpoint from the models cache, or a skip that says how to get it.
* :func:`cvxpy_spot_check`: for rows drawn from a run, the test's own templates, evidence and preference
  (built by the caller from the weights and the model's hidden states, not by the adapter) solved by
  CVXPY give the run's ``rel_deviation``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from probe.batch.problems import fidelity_error
from probe.capture.adapters import space_problems
from probe.solve.reference import cvxpy_primal, relative_deviation

#: texts of varied length: padding in every batch of two, and relative distances beyond the exact
#: buckets of MPNet (8) and of the tiny DeBERTa (4)
TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
    "Short one.",
    "Attention is the closed-form solution of a convex problem, or so the claim goes.",
    "Why?",
    "Researchers measured the deviation for every layer, head and query token of the model, then they "
    "plotted the histograms per layer and wrote the paper.",
]


def models_dir() -> Path:
    """Where real checkpoints rebuilt by ``scripts/fetch_models.sh`` live: ``$PROBE_MODELS_DIR``, default
    ``~/.cache/probe-models`` (the cache ``.ci/run`` fills)."""
    return Path(os.environ.get("PROBE_MODELS_DIR") or Path.home() / ".cache" / "probe-models").expanduser()


def real_model_dir(name: str, marker: str = "config.json") -> Path:
    """The checkpoint ``name`` in :func:`models_dir`, or skip the test saying how to get it."""
    directory = models_dir() / name
    if not (directory / marker).exists():
        pytest.skip(
            f"the real {name} is not in {directory}: rebuild it with `bash scripts/fetch_models.sh "
            f"{models_dir()}` (or set PROBE_MODELS_DIR); .ci/run does this"
        )
    return directory


def write_texts(directory: Path, texts=TEXTS) -> Path:
    """A .txt dataset without empty lines, so that ``example`` is the index in ``texts``."""
    path = Path(directory) / "texts.txt"
    path.write_text("\n".join(texts) + "\n")
    return path


def cli_run(model_dir, data_file, out, *options):
    """``probe run MODEL --dataset FILE --out OUT [options]`` through the typer app: (rows, manifest)."""
    from probe.cli import app

    out = Path(out)
    args = ["run", str(model_dir), "--dataset", str(data_file), "--out", str(out), "--no-progress", *map(str, options)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (run_dir,) = list(out.iterdir())
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return frame, manifest


def token_counts(tokenizer, texts, max_length=128) -> list[int]:
    return [len(ids) for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]]


def assert_complete_run(frame, manifest, expected: dict[str, int], tolerance=1e-5):
    """Rows per attention type, fidelity passed (to ``tolerance``), every row converged."""
    assert frame.groupby("attention_type").size().to_dict() == expected
    assert manifest["status"] == "complete"
    assert manifest["fidelity"]["passed"] and manifest["fidelity"]["max_abs_error"] <= tolerance
    assert manifest["solver"]["not_converged"] == 0 and bool(frame["converged"].all())
    assert set(manifest["attention_types"]) == set(expected)
    assert not frame.duplicated(["attention_type", "layer", "head", "example", "query"]).any()


def assert_reproduces_output_attentions(sites, attentions, tolerance=1e-5):
    """Every site passes the fidelity check in both spaces and its ``softmax(log u + s)`` equals the
    model's ``output_attentions`` for that layer on the real queries."""
    assert [site.layer for site in sites] == list(range(len(attentions)))
    for site, attention in zip(sites, attentions):
        for space in site.spaces:
            problems = space_problems(site, space)
            assert fidelity_error(site, problems) <= tolerance, (site.layer, space)
            rebuilt = torch.softmax(site.log_preference + problems.logits, dim=-1)
            real = site.query_mask[:, None, :, None].expand_as(rebuilt)
            difference = (rebuilt - attention.double()).abs()[real]
            assert difference.numel() and float(difference.max()) <= tolerance, (site.layer, space)


def assert_preference_matters(site, attention, kept_log, threshold=0.05):
    """The preference the adapter captured is not decoration: with ``kept_log`` (the masks) in its place,
    ``softmax(kept_log + s)`` is off from the model's attention by more than ``threshold`` on some real
    query, so the fidelity check on the site could fail."""
    without = torch.softmax(kept_log + space_problems(site, "hidden").logits, dim=-1)
    real = site.query_mask[:, None, :, None].expand_as(without)
    assert float((without - attention.double()).abs()[real].max()) > threshold


def sample_rows(frame: pd.DataFrame, count=20, seed=0) -> pd.DataFrame:
    """``count`` rows drawn at random, always including a first query and a last one."""
    rng = np.random.default_rng(seed)
    first = frame.index[frame["query"] == 0][:1]
    last = frame.index[frame["query"] == frame["n_keys"] - 1][:1] if "n_keys" in frame else frame.index[:0]
    rest = rng.choice(frame.index.difference(first.union(last)), size=count - len(first) - len(last), replace=False)
    return frame.loc[first.union(last).union(pd.Index(rest))]


def cvxpy_spot_check(frame: pd.DataFrame, explicit_problem, count=20, seed=0, rtol=1e-5, atol=1e-7):
    """For ``count`` rows of the run, ``explicit_problem(row) -> (T, z, log_u)`` solved by CVXPY gives the
    row's ``rel_deviation`` (float32 noise between the run's padded batch and the caller's forward pass
    is the only expected difference).  Returns the rows checked."""
    rows = sample_rows(frame, count, seed)
    assert len(rows) == count
    for _, row in rows.iterrows():
        assert row["alpha"] == 1.0  # the caller's evidence is the alpha = 1 one
        T, z, log_u = explicit_problem(row)
        assert np.isfinite(log_u).sum() == row["n_keys"], row.to_dict()
        lam, _ = cvxpy_primal(T, z, log_u)
        expected = relative_deviation(lam, z, 1.0)
        assert abs(row["rel_deviation"] - expected) <= atol + rtol * expected, (row.to_dict(), expected)
    return rows
