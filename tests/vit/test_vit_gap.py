"""`probe vit train` records, per epoch, how far the final layer is from exact inference (probe.vit.gap): the
recorded numbers are recomputed here from the saved model with numpy, and the exact posterior is checked by its
optimality condition, p* = softmax(<t, lambda*>) with lambda* = z + T^T (u - p*), not by the solver that found it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.vit import load_checkpoint
from probe.vit.data import load_data
from probe.vit.gap import GAP_IMAGES, final_layer_posteriors
from probe.vit.train import TrainSettings, train

from ..support.vit_data import TINY, write_mnist


def _train(tmp_path, attention, epochs=2):
    data_dir = write_mnist(tmp_path / "data")
    settings = TrainSettings(data="fashion-mnist", data_dir=str(data_dir), attention=attention, seed=1, epochs=epochs,
                             batch_size=16, out=str(tmp_path / attention), threads=1, progress=False, **TINY)
    lines = []
    return train(settings, log=lines.append), lines, data_dir


def test_every_epoch_records_the_softmax_layers_distance_from_exact_inference(tmp_path):
    results, lines, data_dir = _train(tmp_path, "softmax")
    curve = results["learning_curve"]
    assert len(curve) == 2 and all("final_layer_gap" in entry for entry in curve)
    assert len(lines) == 2 and all("final layer vs exact: TV median" in line for line in lines)
    recorded = curve[-1]["final_layer_gap"]
    assert "ot" not in recorded and recorded["kl"]["not_converged"] == 0

    model, _ = load_checkpoint(tmp_path / "softmax")  # the weights after the last epoch
    data = load_data("fashion-mnist", data_dir)
    images = data.normalise(data.test_images[:GAP_IMAGES])
    assert recorded["images"] == images.shape[0] and recorded["problems"] == images.shape[0] * TINY["heads"]
    solved = final_layer_posteriors(model, images)
    p, lam = solved["exact"].numpy(), solved["lam"].numpy()
    templates, z = solved["templates"].numpy(), solved["evidence"].numpy()
    # the optimality condition of the exact posterior, and lambda* as its definition
    logits = np.einsum("bhnd,bhd->bhn", templates, lam)
    fixed = np.exp(logits - logits.max(-1, keepdims=True))
    fixed /= fixed.sum(-1, keepdims=True)
    assert np.abs(fixed - p).max() < 1e-9
    u = np.full_like(p, 1.0 / p.shape[-1])
    assert np.allclose(lam, z + np.einsum("bhnd,bhn->bhd", templates, u - p), atol=1e-12)
    # softmax attention as the model computes it: q.k / sqrt(d')
    q, k = solved["problems"]["evidence"].double().numpy(), solved["problems"]["candidates"].double().numpy()
    scores = np.einsum("bhnd,bhd->bhn", k, q) / np.sqrt(TINY["head_dim"])
    softmax = np.exp(scores - scores.max(-1, keepdims=True))
    softmax /= softmax.sum(-1, keepdims=True)
    tv = 0.5 * np.abs(p - softmax).sum(-1).ravel()
    rel = (np.linalg.norm(lam - z, axis=-1) / np.linalg.norm(lam, axis=-1)).ravel()
    for name, values in (("tv", tv), ("rel_deviation", rel)):
        assert recorded["kl"][f"{name}_median"] == pytest.approx(np.median(values), abs=1e-12)
        assert recorded["kl"][f"{name}_p90"] == pytest.approx(np.quantile(values, 0.9), abs=1e-12)
        assert recorded["kl"][f"{name}_max"] == pytest.approx(values.max(), abs=1e-12)
    assert recorded["kl"]["tv_max"] > 0  # softmax is not the exact posterior
    assert curve[0]["final_layer_gap"] != curve[1]["final_layer_gap"]  # measured afresh after each epoch


@pytest.mark.parametrize("attention, own", [("ot", True), ("sinkhorn", False), ("exact", False)])
def test_each_arm_records_the_gap_where_it_is_defined(tmp_path, attention, own):
    results, _, _ = _train(tmp_path, attention, epochs=1)
    gap = results["learning_curve"][0]["final_layer_gap"]
    assert np.isfinite(gap["kl"]["tv_median"]) and np.isfinite(gap["kl"]["rel_deviation_median"])
    assert ("ot" in gap) == own
    if own:
        assert gap["ot"]["certified"] == 1.0 and 0 <= gap["ot"]["tv_median"] <= 1
        assert torch.isfinite(torch.tensor(gap["ot"]["rel_deviation_max"]))


def test_the_training_page_quotes_the_committed_epoch_series():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    kept = json.loads((root / "reports" / "vit" / "epochs-softmax.json").read_text())
    curve = kept["learning_curve"]
    page = " ".join((root / "docs" / "training.md").read_text().split())
    first, last = curve[0], curve[-1]
    for number in (f"{first['final_layer_gap']['kl']['tv_median']:.4f}",
                   f"{first['final_layer_gap']['kl']['rel_deviation_median']:.4f}",
                   f"{last['final_layer_gap']['kl']['tv_median']:.4f}",
                   f"{last['final_layer_gap']['kl']['rel_deviation_median']:.4f}",
                   f"{first['test_accuracy']:.3f}", f"{last['test_accuracy']:.3f}"):
        assert number in page, number
    assert kept["committed_curve_matches"] is True and "changed nothing of the training" in page
