"""Runs of the model's fast attention (``attn_implementation="sdpa"``): the model computes each attention call with
transformers' own SDPA, which never forms the ``(b, h, q, k)`` probabilities, and probe builds the selected rows'
problems from the queries, keys and mask it handed over.

What shows it right, against computations that are not probe's:
- the rows equal the same rows of an eager run of the same texts (a rotary grouped-query decoder with left
  padding, an encoder with padding, a T5 with its position bias), to the rounding of the models' float64 forward;
- the fidelity check there compares the output rebuilt from probe's logits with the model's own SDPA output, and it
  catches a wrong preference: its error is bounded by, and large with, the probabilities' error against the
  model's eager attention of the same inputs;
- a run of the model's fast attention forms no probabilities at all (each site's ``model_probs`` is None) and
  ``probe show`` recomputes its rows within their certificates.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from probe.batch.problems import FIDELITY_TOLERANCE, fidelity_errors, output_errors
from probe.capture.adapters.base import space_problems
from probe.capture.adapters.interface import runs_probe_attention
from probe.capture.data import DatasetSpec
from probe.capture.loading import load_model
from probe.core.schema import ROW_KEY
from probe.pipeline.runner import RunConfig, run

from ..support.families import CORPUS, save_tiny, spec


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, minilm_dir):
    return save_tiny(spec("llama"), tmp_path_factory.mktemp("sdpa-llama"), minilm_dir, padding_side="left")


def run_frame(model_dir, out, dtype="float64", batch_size=3, **settings):
    data = out / "texts.txt"
    out.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(CORPUS[:5]) + "\n")
    run_dir = run(RunConfig(model=str(model_dir), dataset=DatasetSpec(name=str(data)), out=out / "runs",
                            batch_size=batch_size, device="cpu", progress=False, dtype=dtype, **settings))
    frame = pd.read_parquet(run_dir / "deviations.parquet").sort_values(list(ROW_KEY)).reset_index(drop=True)
    return frame, json.loads((run_dir / "manifest.json").read_text()), run_dir


def assert_same_rows(eager: pd.DataFrame, fast: pd.DataFrame, rtol: float) -> None:
    key = list(ROW_KEY)
    assert len(eager) and eager[key].equals(fast[key])
    for column in eager.columns:
        if eager[column].dtype.kind == "f":
            np.testing.assert_allclose(fast[column], eager[column], rtol=rtol, atol=rtol, err_msg=column)


def compare_runs(model_dir, tmp_path, rtol, **selection):
    eager, eager_manifest, _ = run_frame(model_dir, tmp_path / "eager", **selection)
    fast, manifest, run_dir = run_frame(model_dir, tmp_path / "sdpa", attn_implementation="sdpa", **selection)
    assert_same_rows(eager, fast, rtol)
    fidelity = manifest["fidelity"]
    assert fidelity["passed"] and "SDPA attention output" in fidelity["check"]
    assert "eager attention probabilities" in eager_manifest["fidelity"]["check"]
    assert manifest["config"]["attn_implementation"] == "sdpa" and manifest["solver"]["not_converged"] == 0
    assert manifest["attention_implementation"] == "sdpa" and eager_manifest["attention_implementation"] == "eager"
    return fidelity, run_dir


@pytest.mark.parametrize("batch_size", [3, 1])
def test_sdpa_rows_equal_eager_rows_rotary_grouped_query(tiny_llama, tmp_path, batch_size):
    """Batches of 3 texts pad them (left), and SDPA gets a boolean mask; one text per batch gets none, SDPA runs
    each call with is_causal, and probe builds the selected rows' causal preference from that flag.  float32 (a
    float64 Llama's eager attention is NaN with left padding: the last test); the two forwards round differently
    from the first layer's output on, by about 1e-7."""
    fidelity, _ = compare_runs(tiny_llama, tmp_path, 1e-5, queries="sample:4", heads="0,2", dtype="float32",
                               batch_size=batch_size)
    assert fidelity["max_abs_error"] < FIDELITY_TOLERANCE["float32"]


def test_one_text_runs_sdpa_causally_without_a_mask(tiny_llama):
    """The path the batch-of-one rows above take: no mask reaches the attention function, the call is recorded as
    causal, and the kept rows' preference excludes exactly the keys after each query."""
    from probe.capture.adapters.interface import sdpa_attention_calls

    loaded = load_model(str(tiny_llama), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, CORPUS[:1], None, 64)
    calls = []
    with runs_probe_attention(loaded.model, "sdpa"), sdpa_attention_calls(calls.append), torch.no_grad():
        loaded.model(**inputs, use_cache=False)
    assert calls and all(call.attention_mask is None and call.causal for call in calls)
    (site, *_) = captured(tiny_llama, "sdpa", CORPUS[:1])
    n = site.shape[3]
    expected = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), diagonal=1)
    assert torch.equal(site.log_preference.expand(1, site.shape[1], n, n)[0, 0], expected)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_sdpa_rows_equal_eager_rows_encoder_and_t5(family, tmp_path_factory, minilm_dir, tmp_path):
    model_dir = save_tiny(spec(family), tmp_path_factory.mktemp(f"sdpa-{family}"), minilm_dir)
    fidelity, _ = compare_runs(model_dir, tmp_path, 1e-9, queries="every:3")
    assert fidelity["max_abs_error"] < 1e-12


def captured(model_dir, implementation, texts=CORPUS[:3]):
    loaded = load_model(str(model_dir), device="cpu")  # float32: a float64 Llama's eager forward is NaN (below)
    inputs = loaded.adapter.encode(loaded.tokenizer, list(texts), None, 64)
    with runs_probe_attention(loaded.model, implementation):
        return loaded.adapter.sites(loaded.model, inputs)


def test_output_check_catches_a_wrong_preference(tiny_llama):
    """A preference without its causal mask rebuilds other attention: the output check fails, by at most the
    probabilities' error summed over the keys (the bound output_errors states), which the eager capture of the
    same inputs measures independently."""
    fast, eager = captured(tiny_llama, "sdpa"), captured(tiny_llama, "eager")
    assert all(site.model_probs is None and site.model_output is not None for site in fast)
    for site, reference in zip(fast, eager):
        assert float(fidelity_errors(site).max()) < FIDELITY_TOLERANCE["float32"]
        wrong = torch.zeros_like(site.log_preference).masked_fill(~site.key_mask[:, None, None, :], float("-inf"))
        rebuilt = torch.softmax(wrong + space_problems(site, "key").logits, dim=-1)
        error = output_errors(site, rebuilt).masked_fill(~site.query_mask[:, None, :], 0.0)
        bound = (rebuilt - reference.model_probs).abs().sum(-1).masked_fill(~site.query_mask[:, None, :], 0.0)
        assert float(error.max()) > 1e-2  # seen: the future keys carry weight now
        assert bool((error <= bound + FIDELITY_TOLERANCE["float32"]).all())


def test_a_nan_in_the_models_attention_fails_the_fidelity_check(tiny_llama, tmp_path):
    """A float64 Llama's eager attention with left padding: its softmax, taken in float32, turns the padding rows'
    masked logits to -inf and their outputs to NaN, which the next layer's keys carry into every real row.  The model
    computed NaN attention there; the check must say so (a NaN compares false with the tolerance), and the same model
    under SDPA, which keeps those rows finite, passes."""
    with pytest.warns(UserWarning, match="Fidelity check failed"):
        _, manifest, _ = run_frame(tiny_llama, tmp_path / "eager", queries="last")
    assert not manifest["fidelity"]["passed"] and manifest["fidelity"]["max_abs_error"] == float("inf")
    _, manifest, _ = run_frame(tiny_llama, tmp_path / "sdpa", queries="last", attn_implementation="sdpa")
    assert manifest["fidelity"]["passed"]


def test_show_recomputes_an_sdpa_run_within_its_certificates(tiny_llama, tmp_path):
    from probe.pipeline.recompute import text_view

    _, _, run_dir = run_frame(tiny_llama, tmp_path, attn_implementation="sdpa", queries="every:2", layers="-1")
    view = text_view(run_dir, 1, -1, 3)
    assert view.largest_ratio <= 1.0
    # recomputed with the run's selection: its rows alone (every second position), each against its stored row
    assert view.query_positions and all(position % 2 == 0 for position in view.query_positions)
    assert np.isfinite(view.stored_rel_deviation).all()
    # the attention drawn is the one rebuilt from the logits: rows of a distribution over the causal keys
    np.testing.assert_allclose(view.attention.sum(axis=1), 1.0, atol=1e-12)


def test_probe_run_says_the_output_was_checked(tiny_llama, tmp_path):
    from typer.testing import CliRunner

    from probe.cli import app

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(CORPUS[:2]) + "\n")
    result = CliRunner().invoke(app, ["run", str(tiny_llama), "--dataset", str(data), "--out", str(tmp_path / "runs"),
                                      "--queries", "last", "--attn-implementation", "sdpa", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "passed, tolerance 1e-05; SDPA: the attention output checked" in result.output
