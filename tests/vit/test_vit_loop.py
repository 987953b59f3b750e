"""probe.vit.loop: the device-resident training loop computes what the step-by-step loop computed (the previous
loop, frozen in tests/support/previous_vit_train.py), to the bit on the CPU, without a host sync per step; the
full protocol's plateau rule against hand-made learning curves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from probe.vit import load_checkpoint
from probe.vit.loop import plateau_epoch
from probe.vit.train import TrainSettings, train

from ..support import previous_vit_train as previous
from ..support.vit_data import TINY, write_mnist

#: the ops through which a host reads a device tensor, each one a sync on a GPU: every ``.item()``, ``float()``,
#: ``int()`` or ``bool()`` of a tensor ends in ``_local_scalar_dense``; ``nonzero`` reads its count back
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


def _both(data_dir, tmp_path, **kw):
    base = dict(data="fashion-mnist", data_dir=str(data_dir), seed=5, epochs=2, batch_size=16, threads=1,
                progress=False, dropout=0.2, train_subset=60, **TINY)  # 60 images: a last batch of 12
    base.update(kw)
    now = train(TrainSettings(**base, out=str(tmp_path / "now")))
    before = previous.train(previous.TrainSettings(**base, out=str(tmp_path / "before")))
    return now, before


@pytest.mark.parametrize("attention", ["softmax", "ot", "sinkhorn", "exact"])
def test_the_resident_loop_computes_what_the_previous_loop_computed(tmp_path, attention):
    data_dir = write_mnist(tmp_path / "data")
    now, before = _both(data_dir, tmp_path, attention=attention)
    assert len(now["learning_curve"]) == len(before["learning_curve"]) == 2
    for a, b in zip(now["learning_curve"], before["learning_curve"]):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "exact_train", "exact_test",
                    "final_layer_gap"):
            assert a.get(key) == b.get(key), key
    m1, _ = load_checkpoint(tmp_path / "now")
    m2, _ = load_checkpoint(tmp_path / "before")
    for (name, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_on_fashion_mnist_the_ot_vit_trains_as_before(tmp_path):
    """The installed data set (skipped where it is missing), the OT-ViT with its trick: 3 steps of 128."""
    from probe.vit.data import FASHION_MNIST_DIR

    if not FASHION_MNIST_DIR.is_dir():
        pytest.skip("Fashion-MNIST is not installed")
    now, before = _both(FASHION_MNIST_DIR, tmp_path, attention="ot", epochs=1, batch_size=128, train_subset=300,
                        test_subset=200)
    a, b = now["learning_curve"][0], before["learning_curve"][0]
    assert (a["train_loss"], a["test_loss"], a["test_accuracy"]) == (b["train_loss"], b["test_loss"], b["test_accuracy"])


def _syncs(profile, outside=("Optimizer.step",)) -> int:
    """Host reads of tensors in ``profile``, those inside Adam's step left out: its step counter lives on the host
    (as torch keeps it for a CUDA Adam too), so reading it is no device sync."""
    count = 0
    for event in profile.events():
        if event.name not in SYNC_OPS:
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            inside = inside or any(parent.name.startswith(o) for o in outside)
            parent = parent.cpu_parent
        count += not inside
    return count


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["softmax", "ot", "sinkhorn"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, attention):
    """An epoch of 4 steps and one of 8 read the device the same number of times: once for the loss and once
    for the correct predictions, at the epoch's end."""
    from probe.vit.data import load_data
    from probe.vit.loop import Partners, Resident, plan_epoch, train_epoch
    from probe.vit.model import ViT, ViTConfig

    data = load_data("fashion-mnist", write_mnist(tmp_path / "data", n_train=128))
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, num_classes=10, attention=attention, **TINY))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    counts = {}
    for n in (64, 128):
        index = torch.arange(n)
        resident = Resident(data, index, torch.arange(32), "cpu")
        partners = Partners(data.train_labels[index], 10) if attention == "ot" else None
        plan = plan_epoch(0, 0, n, 16, partners, torch.device("cpu"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            train_epoch(model, model, optimizer, resident, plan)
        counts[plan.steps] = _syncs(profile)
    assert counts == {4: 2, 8: 2}


@pytest.mark.slow
def test_the_previous_loop_read_the_device_every_step(tmp_path):
    """The same count on the previous loop (a whole run of 4 and of 8 steps, the evaluation the same in both):
    3 reads more per step for the ViT (the loss twice, the correct predictions)."""
    data_dir = write_mnist(tmp_path / "data", n_train=128)
    counts = {}
    for n in (64, 128):
        settings = previous.TrainSettings(data_dir=str(data_dir), attention="softmax", epochs=1, batch_size=16,
                                          train_subset=n, threads=1, progress=False, out=str(tmp_path / f"r{n}"),
                                          **TINY)
        original = previous.final_layer_gap
        previous.final_layer_gap = lambda model, images: {"kl": {"tv_median": float("nan")}}
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                previous.train(settings)
        finally:
            previous.final_layer_gap = original
        counts[n // 16] = _syncs(profile)
    assert (counts[8] - counts[4]) / 4 == 3


@pytest.mark.parametrize("attention", ["softmax", "ot", "sinkhorn", "exact"])
def test_bf16_trains_every_arm_with_float32_transport(tmp_path, attention):
    """--precision bf16: every arm trains to a finite loss (the exact layer's solves all certified), the
    fingerprint differs from fp32's, and the OT layer's weights stay float32 under autocast."""
    from probe.vit.attention import MultiHeadAttention

    data_dir = write_mnist(tmp_path / "data")
    s = TrainSettings(data_dir=str(data_dir), attention=attention, epochs=1, batch_size=16, threads=1,
                      progress=False, out=str(tmp_path / "bf16"), precision="bf16", **TINY)
    epoch = train(s)["learning_curve"][0]
    assert torch.isfinite(torch.tensor(epoch["train_loss"])) and 0 <= epoch["test_accuracy"] <= 1
    assert epoch.get("exact_train", {"not_converged": 0})["not_converged"] == 0
    assert s.fingerprint()["precision"] == "bf16"
    assert "precision" not in dataclasses.replace(s, precision="fp32").fingerprint()
    seen = {}
    layer = MultiHeadAttention(16, 2, 8, "ot")
    original = layer.weights

    def recording(*args, **kwargs):
        w, v = original(*args, **kwargs)
        seen["dtypes"] = (w.dtype, v.dtype)
        return w, v

    layer.weights = recording
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 5, 16))
    assert seen["dtypes"] == (torch.float32, torch.float32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("curve, patience, expected", [
    ([0.5, 0.6, 0.7, 0.8], 2, None),               # still improving
    ([0.5, 0.7, 0.6, 0.65], 2, 4),                 # best at epoch 2, two epochs without a better one
    ([0.5, 0.7, 0.7, 0.7], 2, 4),                  # a tie is no improvement
    ([0.5, 0.7, 0.6, 0.71, 0.7, 0.69], 2, 6),      # the best moves to epoch 4
    ([0.9, 0.1, 0.1, 0.1, 0.1, 0.1], 5, 6),
    ([0.9], 1, None),
])
def test_the_plateau_rule_against_hand_made_curves(curve, patience, expected):
    assert plateau_epoch(curve, patience) == expected


@pytest.mark.slow
def test_compile_trains_the_vit_as_eager_does(tmp_path, monkeypatch):
    """--compile (torch.compile of the forward, about a minute to compile here): the same epoch as eager, to
    float32 rounding (the compiled kernels may order sums differently), once the compiled dropout draws its
    masks from torch's generator as eager does (Inductor's own random numbers differ)."""
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    data_dir = write_mnist(tmp_path / "data")
    runs = {}
    for compiled in (False, True):
        runs[compiled] = train(TrainSettings(data_dir=str(data_dir), attention="softmax", epochs=1, batch_size=16,
                                             threads=1, progress=False, out=str(tmp_path / f"c{compiled}"),
                                             compile=compiled, **TINY))["learning_curve"][0]
    assert runs[True]["train_loss"] == pytest.approx(runs[False]["train_loss"], rel=1e-4)
    assert runs[True]["test_loss"] == pytest.approx(runs[False]["test_loss"], rel=1e-4)
