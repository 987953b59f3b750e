"""Large-model support: a bfloat16 model with the solver in float64 and a fidelity tolerance chosen by
the model's dtype; device_map="auto" when several GPUs are visible (decided here with the GPU count
simulated: no machine these tests run on has two GPUs)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from probe.batch.problems import FIDELITY_TOLERANCE
from probe.capture import loading
from probe.capture.data import DatasetSpec
from probe.core.errors import ProbeError
from probe.core.schema import ROW_KEY
from probe.pipeline.runner import RunConfig, run

from ..support.families import CORPUS, save_tiny, spec


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, minilm_dir):
    return save_tiny(spec("llama"), tmp_path_factory.mktemp("tiny-llama"), minilm_dir, padding_side="left")


def run_frame(model_dir, out, texts, **settings):
    data = out / "texts.txt"
    out.mkdir(parents=True, exist_ok=True)
    data.write_text("\n".join(texts) + "\n")
    run_dir = run(RunConfig(model=str(model_dir), dataset=DatasetSpec(name=str(data)), out=out / "runs",
                            batch_size=3, device="cpu", progress=False, **settings))
    frame = pd.read_parquet(run_dir / "deviations.parquet").sort_values(list(ROW_KEY)).reset_index(drop=True)
    return frame, json.loads((run_dir / "manifest.json").read_text())


def test_bfloat16_model_float64_solver_dtype_tolerance(tiny_llama, tmp_path):
    low, manifest = run_frame(tiny_llama, tmp_path / "bf16", CORPUS, dtype="bfloat16")
    full, full_manifest = run_frame(tiny_llama, tmp_path / "f32", CORPUS)
    assert manifest["dtype"] == "bfloat16" and manifest["solver"]["dtype"] == "float64"
    assert manifest["spaces"] == ["key"]  # rotary: the key space by default
    fidelity = manifest["fidelity"]
    assert fidelity["tolerance"] == FIDELITY_TOLERANCE["bfloat16"] and fidelity["passed"]
    assert fidelity["max_abs_error"] > 1e-4  # really rounded to bfloat16 ...
    assert full_manifest["fidelity"]["tolerance"] == FIDELITY_TOLERANCE["float32"]
    assert full_manifest["fidelity"]["max_abs_error"] <= 1e-5  # ... where float32 is exact to 1e-5
    assert low["converged"].all() and manifest["solver"]["not_converged"] == 0
    # the same rows, with deviations that differ by the model's rounding only
    key = list(ROW_KEY)
    assert low[key].equals(full[key])
    nontrivial = ~full["trivial"]
    difference = np.abs(low["rel_deviation"] - full["rel_deviation"])[nontrivial]
    assert float(np.median(difference / full["rel_deviation"][nontrivial])) < 0.05


def test_an_explicit_fidelity_tolerance_wins(tiny_llama, tmp_path):
    with pytest.warns(UserWarning, match="Fidelity check failed"):
        _, manifest = run_frame(tiny_llama, tmp_path, CORPUS[:2], dtype="bfloat16", fidelity_tolerance=1e-9)
    assert manifest["fidelity"]["tolerance"] == 1e-9 and not manifest["fidelity"]["passed"]


@pytest.mark.parametrize(
    "device, gpus, init, accelerate, expected",
    [
        ("auto", 2, "pretrained", True, "auto"),
        ("auto", 8, "pretrained", True, "auto"),
        ("auto", 1, "pretrained", True, None),  # one GPU: the model goes there whole
        ("auto", 0, "pretrained", True, None),
        ("cuda:0", 2, "pretrained", True, None),  # an explicit device is obeyed
        ("cpu", 2, "pretrained", True, None),
        ("auto", 2, "pretrained", False, ProbeError("accelerate")),
        ("auto", 2, "random", True, ProbeError("device='cuda:0'")),  # the Python API's spelling (probe.core.spelling)
    ],
)
def test_device_map_when_several_gpus_are_visible(monkeypatch, device, gpus, init, accelerate, expected):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    real_find_spec = importlib.util.find_spec
    def find_spec(name, *args):
        if name == "accelerate":
            return object() if accelerate else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if isinstance(expected, ProbeError):
        with pytest.raises(ProbeError, match=str(expected)):
            loading._device_map(device, init)
    else:
        assert loading._device_map(device, init) == expected
