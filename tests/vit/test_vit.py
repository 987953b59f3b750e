"""probe.vit: the OT attention layer, the Sinkhorn and exact attentions, the four ViTs, offline data, training
and its CLI.

References are independent of the code under test: plain Python loops over eq. (22), the dense softmax,
numpy Sinkhorn iterations, CVXPY for the exact posterior, the parameter formula against the allocated model,
files written here in the standard idx and CIFAR-pickle formats.  Everything uses tiny models and tiny data
(seconds).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from probe.core.errors import ProbeError
from probe.solve.ot import ot_attention
from probe.vit import final_layer_problems, load_checkpoint
from probe.vit.attention import (
    ExactAttention,
    MultiHeadAttention,
    OTAttention,
    SinkhornAttention,
    dot_cost,
    ot_attention_weights,
    sinkhorn_attention_weights,
    softmax_attention_weights,
)
from probe.vit.cli import app
from probe.vit.data import load_data, read_idx
from probe.vit.model import ViT, ViTConfig, parameter_count
from probe.vit.train import TrainSettings, train

from ..support.vit_data import TINY, write_idx, write_mnist


def write_cifar(directory, which="cifar10", n=6, seed=0, protocol=pickle.DEFAULT_PROTOCOL):
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    key, names, classes = (b"labels", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], 10) if which == "cifar10" \
        else (b"fine_labels", ["train", "test"], 100)
    expected = {}
    for name in names:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = list(rng.integers(0, classes, size=n))
        with open(directory / name, "wb") as f:
            pickle.dump({b"data": data, key: labels, b"batch_label": f"batch {name}".encode(),
                         b"filenames": [f"image_{i}.png".encode() for i in range(n)]}, f, protocol=protocol)
        expected[name] = (data, labels)
    return expected


# --------------------------------------------------------------------------- the OT attention layer
def loop_eq22(q, k, key_mask, extra_k, extra_mask, alpha, gamma, cost):
    """Eq. (22) with Python loops: p_i(t) = sum_j u_j softmax_t((alpha<t, q_i> - M(t_j, t)) / gamma)."""
    B, H, Q, _ = q.shape
    n = k.shape[2]
    m = 0 if extra_k is None else extra_k.shape[2]
    out = torch.zeros(B, H, Q, n + m, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            cand = [(t, k[b, h, t]) for t in range(n) if key_mask[b, t]]
            cand += [(n + t, extra_k[b, h, t]) for t in range(m) if extra_mask[b, t]]
            sources = [k[b, h, j] for j in range(n) if key_mask[b, j]]
            for i in range(Q):
                for tj in sources:
                    logits = [(alpha * float(q[b, h, i] @ t) - cost(tj, t)) / gamma for _, t in cand]
                    top = max(logits)
                    e = [math.exp(x - top) for x in logits]
                    for (index, _), ei in zip(cand, e):
                        out[b, h, i, index] += ei / sum(e) / len(sources)
    return out


def _instance(B=2, H=3, n=5, m=4, d=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, n, d, generator=g, dtype=dtype), torch.randn(B, H, n, d, generator=g, dtype=dtype)
    extra = torch.randn(B, H, m, d, generator=g, dtype=dtype)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, 3:] = False  # sample 1: two padding tokens
    extra_mask = torch.zeros(B, m, dtype=torch.bool)
    extra_mask[0] = True  # only sample 0 has extra candidates
    return q, k, extra, mask, extra_mask


@pytest.mark.parametrize("alpha,gamma", [(1.0, math.sqrt(6)), (0.3, 2.0), (2.0, 0.5)])
def test_ot_attention_equals_a_loop_over_eq22(alpha, gamma):
    q, k, extra, mask, extra_mask = _instance()
    w = ot_attention_weights(q, k, mask, extra, extra_mask, alpha=alpha, gamma=gamma)
    ref = loop_eq22(q, k, mask, extra, extra_mask, alpha, gamma, lambda a, b: -float(a @ b))
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-12)
    # padding and absent extra candidates get no mass; every distribution sums to 1
    assert float(w[1, :, :, 3:5].abs().max()) == 0 and float(w[1, :, :, 5:].abs().max()) == 0
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


def test_ot_attention_with_a_custom_cost_callable():
    q, k, extra, mask, extra_mask = _instance(seed=3)
    sq = lambda s, c: ((s.unsqueeze(-2) - c.unsqueeze(-3)) ** 2).sum(-1)  # noqa: E731
    w = ot_attention_weights(q, k, mask, extra, extra_mask, alpha=1.0, gamma=1.5, cost=sq)
    ref = loop_eq22(q, k, mask, extra, extra_mask, 1.0, 1.5, lambda a, b: float(((a - b) ** 2).sum()))
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-12)


def test_dot_cost_is_nonnegative_and_its_constant_cancels():
    _, k, extra, mask, extra_mask = _instance(seed=5)
    cand = torch.cat([k, extra], dim=2)
    M = dot_cost(k, cand)
    assert float(M.min()) >= 0
    inner = torch.einsum("bhjd,bhtd->bhjt", k, cand)
    assert torch.all(M.amin(dim=(-2, -1)) == 0)  # C is the largest inner product: M >= 0 is tight
    torch.testing.assert_close(M, inner.amax(dim=(-2, -1), keepdim=True) - inner)
    q = torch.randn_like(k)
    shifted = lambda s, c: dot_cost(s, c) + 123.0  # noqa: E731  (a different C)
    torch.testing.assert_close(
        ot_attention_weights(q, k, mask, extra, extra_mask, cost=shifted),
        ot_attention_weights(q, k, mask, extra, extra_mask),
    )


def test_constant_cost_is_softmax_attention_at_temperature_gamma():
    q, k, _, mask, _ = _instance(seed=1)
    const = lambda s, c: torch.full(s.shape[:-1] + (c.shape[-2],), 7.0, dtype=s.dtype)  # noqa: E731
    for gamma in (0.7, math.sqrt(6), 4.0):
        w = ot_attention_weights(q, k, mask, gamma=gamma, cost=const)
        logits = (q @ k.transpose(-1, -2)) / gamma
        logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
        torch.testing.assert_close(w, torch.softmax(logits, -1), rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(w, softmax_attention_weights(q, k, mask, gamma), rtol=1e-13, atol=1e-14)


def test_ot_attention_gradcheck_float64():
    q, k, extra, mask, extra_mask = _instance(B=2, H=1, n=3, m=2, d=3, seed=2)
    for t in (q, k, extra):
        t.requires_grad_(True)
    f = lambda q, k, e: ot_attention_weights(q, k, mask, e, extra_mask, alpha=0.8, gamma=1.3)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, extra), eps=1e-6, atol=1e-7)


def test_module_masks_exclude_padding_and_gradcheck():
    torch.manual_seed(0)
    layer = OTAttention(4, 2, 2).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    extra = torch.randn(2, 2, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    extra_mask = torch.tensor([[True] * 2, [False] * 2])
    out = layer(x, mask, extra, extra_mask)
    garbage = x.clone()
    garbage[1, 2:] = 1e3 * torch.randn(1, 4, dtype=torch.float64)  # padding content must not matter
    extra_garbage = extra.clone()
    extra_garbage[1] = 1e3
    out2 = layer(garbage, mask, extra_garbage, extra_mask)
    torch.testing.assert_close(out[0], out2[0])
    torch.testing.assert_close(out[1, :2], out2[1, :2])
    # the class-token-only evaluation is the full evaluation's first row
    torch.testing.assert_close(layer(x, mask, extra, extra_mask, query_index=0), out[:, :1])
    xs = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: layer(x, mask, extra, extra_mask), (xs,), eps=1e-6, atol=1e-7)


def test_sinkhorn_attention_against_numpy_iterations():
    q, k, _, mask, _ = _instance(seed=4)
    for iterations in (1, 2, 3, 7):
        w = sinkhorn_attention_weights(q, k, mask, iterations)
        for b in range(2):
            real = mask[b].numpy()
            for h in range(3):
                K = np.exp(q[b, h].numpy() @ k[b, h].numpy().T / math.sqrt(6))[np.ix_(real, real)]
                for it in range(iterations):
                    if it:
                        K = K / K.sum(0, keepdims=True)
                    K = K / K.sum(1, keepdims=True)
                np.testing.assert_allclose(w[b, h].numpy()[np.ix_(real, real)], K, rtol=1e-10, atol=1e-13)
                assert np.abs(w[b, h].numpy()[np.ix_(real, ~real)]).max(initial=0) == 0
    torch.testing.assert_close(sinkhorn_attention_weights(q, k, mask, 1), softmax_attention_weights(q, k, mask))
    many = sinkhorn_attention_weights(q, k, mask, 200)  # doubly stochastic in the limit
    torch.testing.assert_close(many[0].sum(-2), torch.ones(3, 5, dtype=torch.float64), atol=1e-8, rtol=0)


# --------------------------------------------------------------------------- the models
def test_parameter_count_of_the_paper_config():
    config = ViTConfig()  # 6 layers, width 256, MLP 512, 8 heads of 32, patch 4, 28x28x1, 10 classes
    assert parameter_count(config) == 3_183_114  # "3.2M"
    for attention in ("softmax", "ot", "sinkhorn"):
        model = ViT(ViTConfig(attention=attention))
        assert sum(p.numel() for p in model.parameters()) == parameter_count(config)
    cifar = ViTConfig(image_size=32, channels=3, num_classes=100)
    assert sum(p.numel() for p in ViT(cifar).parameters()) == parameter_count(cifar)
    assert parameter_count(ViTConfig(dim=512, mlp_dim=2048, heads=8, head_dim=64)) > 18_000_000  # the other reading


@pytest.mark.parametrize("attention", ["softmax", "ot", "sinkhorn", "exact"])
def test_forward_shapes_and_identical_initialisation(attention):
    config = ViTConfig(image_size=8, num_classes=4, attention=attention, **TINY)
    torch.manual_seed(0)
    model = ViT(config)
    torch.manual_seed(0)
    reference = ViT(ViTConfig(image_size=8, num_classes=4, attention="softmax", **TINY))
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    model.eval()
    x = torch.randn(3, 1, 8, 8)
    assert model(x).shape == (3, 4)
    if attention == "softmax":  # the class-token-only final block is exact: compare with a full forward
        h = model.blocks[-1]
        full = model.hidden_before_final(x)
        a = h.attn(h.norm1(full))
        y = full + a
        y = y + h.mlp(h.norm2(y))
        torch.testing.assert_close(model(x), model.head(model.norm(y[:, 0])))


def test_ot_vit_trick_changes_only_samples_with_a_partner():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, num_classes=4, attention="ot", **TINY)).eval()
    x, partners = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8)
    use = torch.tensor([True, False, False])
    with torch.no_grad():
        plain, tricked = model(x), model(x, partners, use)
    torch.testing.assert_close(plain[1:], tricked[1:])
    assert not torch.allclose(plain[0], tricked[0])


def test_final_layer_problems_reproduce_the_models_attention_and_logits():
    torch.manual_seed(1)
    model = ViT(ViTConfig(image_size=8, num_classes=4, attention="ot", **TINY)).eval()
    x = torch.randn(3, 1, 8, 8)
    P = final_layer_problems(model, x)
    B, H, N, dh = P["candidates"].shape
    assert (B, H, N, dh) == (3, 2, 5, 8) and P["cost"].shape == (3, 2, 5, 5) and P["evidence"].shape == (3, 2, 8)
    assert P["source_weights"].shape == (3, 2, 5) and P["alpha"] == 1.0 and P["gamma"] == pytest.approx(math.sqrt(8))
    p = ot_attention(P["candidates"], P["source_weights"], P["cost"], P["evidence"], P["alpha"], P["gamma"])
    block = model.blocks[-1]
    with torch.no_grad():
        h = model.hidden_before_final(x)
        w, _ = block.attn.weights(block.norm1(h), query_index=0)
        torch.testing.assert_close(p, w[:, :, 0])
        # and the logits from p, by hand: values mixed, heads joined, projection, residual, MLP, head
        mixed = (p.unsqueeze(-1) * P["values"]).sum(-2).reshape(3, H * dh)
        y = h[:, 0] + block.attn.proj(mixed)
        y = y + block.mlp(block.norm2(y))
        torch.testing.assert_close(model.head(model.norm(y)), model(x))


# --------------------------------------------------------------------------- data
@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_read_back(tmp_path, gz):
    write_mnist(tmp_path, n_train=10, n_test=6, gz=gz)
    data = load_data("fashion-mnist", tmp_path)
    assert data.train_images.shape == (10, 1, 8, 8) and data.test_images.shape == (6, 1, 8, 8)
    assert data.train_images.dtype == torch.uint8 and data.train_labels.tolist() == [i % 4 for i in range(10)]
    name = "train-images-idx3-ubyte" + (".gz" if gz else "")
    assert np.array_equal(read_idx(tmp_path / name), data.train_images[:, 0].numpy())
    x = data.normalise(data.train_images)
    torch.testing.assert_close(x.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("which", ["cifar10", "cifar100"])
@pytest.mark.parametrize("nested", [False, True])
def test_cifar_batches_read_back(tmp_path, which, nested):
    sub = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}[which]
    expected = write_cifar(tmp_path / sub if nested else tmp_path, which)
    data = load_data(which, tmp_path)
    train_names = [f"data_batch_{i}" for i in range(1, 6)] if which == "cifar10" else ["train"]
    test_name = "test_batch" if which == "cifar10" else "test"
    want = np.concatenate([expected[n][0] for n in train_names]).reshape(-1, 3, 32, 32)
    assert np.array_equal(data.train_images.numpy(), want)
    assert data.train_labels.tolist() == sum((list(map(int, expected[n][1])) for n in train_names), [])
    assert data.test_labels.tolist() == list(map(int, expected[test_name][1]))
    assert data.num_classes == (10 if which == "cifar10" else 100)


def _corrupt_gzip(d):
    (d / "train-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b\x08 not really gzip")


def _truncate(d):
    path = d / "train-images-idx3-ubyte.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:-10]))


def _bad_magic(d):
    path = d / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(b"\x12\x34" + gzip.decompress(path.read_bytes())[2:]))


def _label_count(d):
    write_idx(d / "train-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))


def _label_range(d):
    write_idx(d / "t10k-labels-idx1-ubyte", np.full(6, 11, dtype=np.uint8))


def _missing(d):
    (d / "t10k-images-idx3-ubyte.gz").unlink()


@pytest.mark.parametrize("damage,words", [
    (_corrupt_gzip, "cannot read"), (_truncate, "bytes where its header"), (_bad_magic, "wrong magic number"),
    (_label_count, "do not match"), (_label_range, "outside 0..9"), (_missing, "has no t10k-images-idx3-ubyte"),
])
def test_bad_idx_files_give_a_clear_error(tmp_path, damage, words):
    write_mnist(tmp_path, n_train=10, n_test=6)
    damage(tmp_path)
    with pytest.raises(ProbeError, match=words):
        load_data("fashion-mnist", tmp_path)


def test_bad_cifar_directories_give_a_clear_error(tmp_path):
    with pytest.raises(ProbeError, match="not a cifar10 directory: data_batch_1"):
        load_data("cifar10", tmp_path)
    write_cifar(tmp_path, "cifar100")
    (tmp_path / "test").write_bytes(b"garbage, not a pickle")
    with pytest.raises(ProbeError, match="cannot read .* as a CIFAR python batch"):
        load_data("cifar100", tmp_path)
    with open(tmp_path / "test", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 10), np.uint8), b"fine_labels": [0, 1]}, f)
    with pytest.raises(ProbeError, match="N x 3072"):
        load_data("cifar100", tmp_path)
    with pytest.raises(ProbeError, match="does not exist"):
        load_data("cifar10", tmp_path / "nowhere")


# --------------------------------------------------------------------------- training and the CLI
def _settings(data_dir, out, **kw):
    base = dict(data="fashion-mnist", data_dir=str(data_dir), attention="ot", seed=3, epochs=2, batch_size=16,
                out=str(out), threads=1, progress=False, dropout=0.2, **TINY)
    base.update(kw)
    return TrainSettings(**base)


def test_cli_trains_one_tiny_epoch_end_to_end(tmp_path):
    data_dir = write_mnist(tmp_path / "data")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--data-dir", str(data_dir), "--attention", "ot", "--epochs", "1", "--batch-size", "16",
        "--train-subset", "48", "--out", str(out), "--threads", "1", "--no-progress"], catch_exceptions=False)
    # the CLI trains the paper-size model; on 8x8 images it has 5 tokens
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_done"] == 1 and results["steps"] == 3 and results["train_images"] == 48
    assert results["parameters"] == results["parameters_formula"] == parameter_count(ViTConfig(image_size=8, num_classes=10))
    assert results["settings"]["attention"] == "ot" and results["gamma"] == pytest.approx(math.sqrt(32))
    assert 0 <= results["test_accuracy"] <= 1 and len(results["learning_curve"]) == 1
    assert {"torch", "python", "probe"} <= set(results["versions"])
    model, info = load_checkpoint(out)
    assert info["config"]["attention"] == "ot" and model.config.image_size == 8
    # a finished run started again does nothing and returns the same results
    again = CliRunner().invoke(app, [
        "train", "--data-dir", str(data_dir), "--attention", "ot", "--epochs", "1", "--batch-size", "16",
        "--train-subset", "48", "--out", str(out), "--threads", "1", "--no-progress"])
    assert again.exit_code == 0 and json.loads((out / "results.json").read_text()) == results


@pytest.mark.parametrize("attention", ["softmax", "ot", "sinkhorn", "exact"])
def test_a_killed_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch, attention):
    data_dir = write_mnist(tmp_path / "data")
    whole = train(_settings(data_dir, tmp_path / "whole", attention=attention))
    steps_per_epoch = 4  # 64 images / 16

    calls = {"n": 0}
    original = torch.optim.Adam.step

    def dying_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == steps_per_epoch + 2:  # in the middle of the second epoch
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        train(_settings(data_dir, tmp_path / "killed", attention=attention))
    monkeypatch.setattr(torch.optim.Adam, "step", original)
    assert not (tmp_path / "killed" / "results.json").exists()
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)["epoch"] == 1
    resumed = train(_settings(data_dir, tmp_path / "killed", attention=attention))
    for key in ("test_accuracy", "test_loss"):
        assert resumed[key] == whole[key]
    for a, b in zip(resumed["learning_curve"], whole["learning_curve"]):
        assert (a["train_loss"], a["test_accuracy"]) == (b["train_loss"], b["test_accuracy"])
        assert a.get("exact_train") == b.get("exact_train") and a.get("exact_test") == b.get("exact_test")
    m1, _ = load_checkpoint(tmp_path / "whole")
    m2, _ = load_checkpoint(tmp_path / "killed")
    for (name, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), name


def test_same_seed_gives_every_attention_the_same_data_order(tmp_path, monkeypatch):
    """The batches every model is given in training, recorded at its forward: the same images in the same order
    for every attention; the OT-ViT's partners come on top."""
    data_dir = write_mnist(tmp_path / "data")
    seen = {}
    original = ViT.forward

    def recording(self, images, *args, **kwargs):
        if self.training:
            seen.setdefault(current["attention"], []).append(images.clone())
        return original(self, images, *args, **kwargs)

    monkeypatch.setattr(ViT, "forward", recording)
    current = {}
    for attention in ("softmax", "sinkhorn", "exact", "ot"):
        current["attention"] = attention
        train(_settings(data_dir, tmp_path / attention, attention=attention, epochs=1))
    soft = seen["softmax"]
    assert len(soft) == 4 and not all(torch.equal(soft[0], b) for b in soft[1:])
    for other in ("sinkhorn", "exact", "ot"):
        assert len(seen[other]) == len(soft) and all(torch.equal(a, b) for a, b in zip(soft, seen[other])), other


BAD_OPTIONS = [
    (["--attention", "bogus"], "--attention must be one of softmax, ot, sinkhorn, exact."),
    (["--data", "mnist2"], "--data must be one of fashion-mnist, cifar10, cifar100"),
    (["--epochs", "0"], "--epochs must be a positive integer"),
    (["--batch-size", "-3"], "--batch-size must be a positive integer"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--train-subset", "0"], "--train-subset must be a positive integer"),
    (["--train-subset", "1000"], "--train-subset 1000 is larger than the 64 training images"),
    (["--test-subset", "33"], "--test-subset 33 is larger than the 32 test images"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--precision", "fp16"], "--precision must be one of fp32, bf16"),
    (["--data", "cifar10"], "--data cifar10 needs --data-dir"),
    (["--data-dir", "/nonexistent/fmnist"], "does not exist"),
    (["--data", "cifar100", "--data-dir", "DATA"], "is not a cifar100 directory"),
]


@pytest.mark.parametrize("options,words", BAD_OPTIONS)
def test_bad_options_fail_fast_with_one_paragraph(tmp_path, options, words):
    data_dir = write_mnist(tmp_path / "data")
    options = [str(data_dir) if o == "DATA" else o for o in options]
    if "--data-dir" not in options and "--data" not in options:
        options = options + ["--data-dir", str(data_dir)]
    elif "--data-dir" not in options and "fashion-mnist" in options:
        options = options + ["--data-dir", str(data_dir)]
    result = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "run"), "--no-progress", *options])
    assert result.exit_code == 2, result.output
    assert words in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_resume_with_other_settings_is_refused(tmp_path):
    data_dir = write_mnist(tmp_path / "data")
    train(_settings(data_dir, tmp_path / "run", epochs=2))
    with pytest.raises(ProbeError, match="other settings .*attention: 'ot' there, 'softmax' now"):
        train(_settings(data_dir, tmp_path / "run", epochs=2, attention="softmax"))
    with pytest.raises(ProbeError, match="already holds 2 epochs, more than --epochs 1"):
        train(_settings(data_dir, tmp_path / "run", epochs=1))
    longer = train(_settings(data_dir, tmp_path / "run", epochs=3))  # a larger --epochs continues
    assert longer["epochs_done"] == 3 and [e["epoch"] for e in longer["learning_curve"]] == [1, 2, 3]


def test_cli_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, probe.vit.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def run_experiment_script(*argv):
    """``scripts/vit_experiment.py ARGV`` in this process."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "vit_experiment.py"
    spec = importlib.util.spec_from_file_location("vit_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = sys.argv
    try:
        sys.argv = ["vit_experiment.py", *argv]
        module.main()
    finally:
        sys.argv = saved


def test_experiment_report_is_computed_from_the_runs(tmp_path):
    """scripts/vit_experiment.py --report-only: means and t-intervals from the runs' results files."""
    from scipy import stats

    data_dir = write_mnist(tmp_path / "data")
    runs = tmp_path / "runs"
    for attention in ("softmax", "ot"):
        for seed in (0, 1, 2):
            train(_settings(data_dir, runs / f"{attention}-seed{seed}", attention=attention, seed=seed, epochs=1))
            # tiny runs sit at chance; give them distinct accuracies so that the interval is not degenerate
            results_file = runs / f"{attention}-seed{seed}" / "results.json"
            r = json.loads(results_file.read_text())
            r["test_accuracy"] = r["learning_curve"][-1]["test_accuracy"] = 0.5 + 0.1 * seed + (attention == "ot") * 0.03 * seed**2
            results_file.write_text(json.dumps(r))
    run_experiment_script("--report-only", "--runs-dir", str(runs), "--report-dir", str(tmp_path / "report"),
                          "--epochs", "1", "--attentions", "softmax", "ot")
    out = json.loads((tmp_path / "report" / "results.json").read_text())
    for attention in ("softmax", "ot"):
        accs = [json.loads((runs / f"{attention}-seed{s}" / "results.json").read_text())["test_accuracy"] for s in range(3)]
        low, high = stats.t.interval(0.95, 2, loc=np.mean(accs), scale=stats.sem(accs))
        s = out["summary"][attention]
        assert s["mean"] == pytest.approx(np.mean(accs)) and s["ci95_half_width"] == pytest.approx((high - low) / 2)
    diffs = [0.03 * s**2 for s in range(3)]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=stats.sem(diffs))
    assert out["paired_differences"]["ot-softmax"]["ci95_half_width"] == pytest.approx((high - low) / 2)
    md = (tmp_path / "report" / "results.md").read_text()
    assert f"{out['summary']['ot']['mean']:.3f}" in md and "not run here: no copy of CIFAR offline" in md
    assert (tmp_path / "report" / "ot-seed0.pt").exists()


def test_attention_classes_differ_only_in_their_weights():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    layers = {kind: MultiHeadAttention(8, 2, 4, kind=kind) for kind in ("softmax", "ot", "sinkhorn")}
    torch.manual_seed(0)
    ot = OTAttention(8, 2, 4)
    torch.manual_seed(0)
    sink = SinkhornAttention(8, 2, 4, iterations=1)
    ot.load_state_dict(layers["ot"].state_dict())
    sink.load_state_dict(layers["softmax"].state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ot(x), layers["ot"](x))
        torch.testing.assert_close(sink(x), layers["softmax"](x))  # one row normalisation = softmax
        # OT with a constant cost: the softmax layer
        const = OTAttention(8, 2, 4, cost=lambda s, c: torch.zeros(s.shape[:-1] + (c.shape[-2],)))
        const.load_state_dict(layers["softmax"].state_dict())
        torch.testing.assert_close(const(x), layers["softmax"](x))


# --------------------------------------------------------------------------- the exact attention
def test_exact_layer_weights_are_the_exact_posterior_of_its_keys_and_queries():
    """ExactAttention's weights, against CVXPY on each head's and query's problem: templates k / sqrt(dh),
    evidence q, u uniform over the real tokens, alpha = 1 (padding keys get 0); softmax is its approximation."""
    from probe.solve.reference import cvxpy_primal

    torch.manual_seed(0)
    layer = ExactAttention(8, 2, 4).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    w, _ = layer.weights(x, mask)
    q, k, _ = layer.split(x)
    with torch.no_grad():
        for b in range(2):
            real = mask[b].numpy()
            for h in range(2):
                T = (k[b, h] / 2.0).numpy()  # sqrt(head_dim) = 2
                log_u = np.where(real, 0.0, -np.inf)
                for i in range(5):
                    _, p_ref = cvxpy_primal(T, q[b, h, i].numpy(), log_u, 1.0)
                    np.testing.assert_allclose(w[b, h, i].detach().numpy(), p_ref, rtol=0, atol=1e-8)
    certificate = layer.last_certificate
    assert certificate.error_bound.shape == (2, 2, 5) and certificate.not_converged == 0
    softmax = MultiHeadAttention(8, 2, 4, kind="softmax").double()
    softmax.load_state_dict(layer.state_dict())
    approximation, _ = softmax.weights(x, mask)
    assert float((approximation - w).abs().max().detach()) > 1e-3  # exact inference is not the softmax
    # the class-token-only evaluation is the full evaluation's first row
    torch.testing.assert_close(layer(x, mask, query_index=0), layer(x, mask)[:, :1])


def test_exact_vit_trains_with_finite_gradients_and_a_falling_loss():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=8, num_classes=4, attention="exact", **dict(TINY, dropout=0.0)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 8, 8, generator=g)
    y = torch.arange(16) % 4
    x[y == 1, :, :4, :4] += 2.0  # a learnable signal
    x[y == 2, :, 4:, 4:] += 2.0
    x[y == 3, :, :4, 4:] += 2.0
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        final = model.blocks[-1].attn.qkv.weight.grad
        assert float(final.abs().sum()) > 0  # the gradient reaches the final layer's queries and keys
        optimizer.step()
        losses.append(float(loss.detach()))
        assert model.blocks[-1].attn.last_certificate.not_converged == 0
    assert losses[-1] < 0.8 * losses[0]


def test_exact_run_records_newton_iterations_and_certificates(tmp_path):
    data_dir = write_mnist(tmp_path / "data")
    results = train(_settings(data_dir, tmp_path / "run", attention="exact", epochs=1))
    entry = results["learning_curve"][0]
    heads = TINY["heads"]
    assert entry["exact_train"]["problems"] == 64 * heads and entry["exact_test"]["problems"] == 32 * heads
    for record in (entry["exact_train"], entry["exact_test"]):
        assert record["not_converged"] == 0 and 0 < record["max_relative_error_bound"] <= 1e-9
        assert 1 <= record["mean_iterations"] <= record["max_iterations"] <= 100


# --------------------------------------------------------------------------- files that could run code
class _RunsCode:
    """Unpickling this runs ``os.system``: it writes the marker file (what a crafted file would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_crafted_cifar_batch_is_refused_and_runs_no_code(tmp_path):
    write_cifar(tmp_path, "cifar10")
    marker = tmp_path / "marker"
    with open(tmp_path / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((6, 3072), np.uint8), b"labels": [0] * 6, b"x": _RunsCode(marker)}, f)
    with pytest.raises(ProbeError, match="refusing to read .*data_batch_3: it names the Python object (posix|os).system"):
        load_data("cifar10", tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_genuine_cifar_batches_read_with_every_pickle_protocol(tmp_path, protocol):
    expected = write_cifar(tmp_path, "cifar10", protocol=protocol)
    data = load_data("cifar10", tmp_path)
    assert np.array_equal(data.test_images.numpy().reshape(-1, 3072), expected["test_batch"][0])
    assert data.test_labels.tolist() == list(map(int, expected["test_batch"][1]))


def test_a_checkpoint_holding_an_arbitrary_object_is_refused_and_runs_no_code(tmp_path):
    data_dir = write_mnist(tmp_path / "data")
    settings = _settings(data_dir, tmp_path / "run", attention="softmax", epochs=1)
    train(settings)
    marker = tmp_path / "marker"
    for name in ("checkpoint.pt", "model.pt"):
        saved = torch.load(tmp_path / "run" / name, weights_only=True)
        saved["note"] = _RunsCode(marker)
        torch.save(saved, tmp_path / "run" / name)
    with pytest.raises(ProbeError, match="refusing to read .*checkpoint.pt: it holds a Python object .*system"):
        train(_settings(data_dir, tmp_path / "run", attention="softmax", epochs=2))
    with pytest.raises(ProbeError, match="refusing to read .*model.pt: it holds a Python object"):
        load_checkpoint(tmp_path / "run")
    assert not marker.exists()
    result = CliRunner().invoke(app, ["train", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"),
                                      "--no-progress", "--epochs", "2"])
    assert result.exit_code == 2 and "refusing to read" in result.output and "Traceback" not in result.output
    assert not marker.exists()


def test_experiment_report_reuses_earlier_runs_checks_a_rerun_and_records_the_exact_arm(tmp_path):
    """A new arm joins the runs of an earlier report: the reused runs are taken as they were, a rerun of one of
    them on this machine is compared bit for bit and becomes the new arm's baseline, a further run is checked,
    and the exact arm's certificates are tabulated from its history."""
    data_dir = write_mnist(tmp_path / "data")
    first, later = tmp_path / "first", tmp_path / "later"
    for seed in (0, 1):
        train(_settings(data_dir, first / f"softmax-seed{seed}", attention="softmax", seed=seed, epochs=2))
        train(_settings(data_dir, later / f"exact-seed{seed}", attention="exact", seed=seed, epochs=2))
    train(_settings(data_dir, later / "softmax-seed0", attention="softmax", seed=0, epochs=2))  # a rerun
    changed = tmp_path / "changed" / "softmax-seed0"  # a "run with other code" that does not reproduce
    train(_settings(data_dir, changed, attention="softmax", seed=0, epochs=1, lr=1e-3))
    common = ["--report-only", "--epochs", "2", "--seeds", "0", "1"]
    run_experiment_script(*common, "--runs-dir", str(first), "--report-dir", str(tmp_path / "r1"),
                          "--attentions", "softmax")
    run_experiment_script(*common, "--runs-dir", str(later), "--report-dir", str(tmp_path / "r2"),
                          "--attentions", "softmax", "exact", "--reuse-runs-from", str(tmp_path / "r1" / "results.json"),
                          "--rerun-check", f"other code={changed}")
    earlier = json.loads((tmp_path / "r1" / "results.json").read_text())
    out = json.loads((tmp_path / "r2" / "results.json").read_text())
    assert out["runs"]["softmax-seed0"] == earlier["runs"]["softmax-seed0"]  # the reused arm, as it was
    assert out["reused_runs"]["runs"] == ["softmax-seed0", "softmax-seed1"]
    rerun = out["reruns"]["against_reused"]["softmax-seed0"]
    assert rerun["identical"] and rerun["epochs"] == 2 and rerun["max_abs_difference"]["train_loss"] == 0
    (check,) = out["checks"]
    assert check["label"] == "other code" and check["against"] == "rerun" and not check["identical"]
    # the exact arm is paired with the rerun (seed 0: the only seed rerun)
    exact_acc = json.loads((later / "exact-seed0" / "results.json").read_text())["test_accuracy"]
    rerun_acc = json.loads((later / "softmax-seed0" / "results.json").read_text())["test_accuracy"]
    paired = out["paired_differences"]["exact-softmax"]
    assert paired["baseline"] == "rerun" and paired["seeds"] == [0] and paired["differences"] == [exact_acc - rerun_acc]
    certificates = out["exact_certificates"]["exact-seed1"]
    history = json.loads((later / "exact-seed1" / "results.json").read_text())["learning_curve"]
    assert certificates["train"]["problems"] == sum(e["exact_train"]["problems"] for e in history) == 2 * 64 * 2
    assert certificates["train"]["max_iterations"] == max(e["exact_train"]["max_iterations"] for e in history)
    gap = out["exact_vs_softmax"]["exact-seed0"]  # the trained layer's p* against its softmax, on the test images
    assert gap["problems"] == 32 * TINY["heads"] and 0 < gap["tv_median"] <= gap["tv_p90"] <= gap["tv_max"] < 1
    md = (tmp_path / "r2" / "results.md").read_text()
    assert "bit for bit the same" in md and "made with other code" in md and "not bit for bit the same" in md
    assert "exact-ViT − ViT (rerun here)" in md and "ViT (softmax), rerun here" in md
    assert "## The exact-ViT's solver during training" in md
    # the report can be made again from itself: the reused arm named, the new arm from the runs directory
    run_experiment_script(*common, "--runs-dir", str(later), "--report-dir", str(tmp_path / "r3"),
                          "--attentions", "softmax", "exact", "--reuse-runs-from", str(tmp_path / "r2" / "results.json"),
                          "--reuse-arms", "softmax", "--rerun-check", f"other code={changed}")
    again = json.loads((tmp_path / "r3" / "results.json").read_text())
    for key in ("summary", "paired_differences", "runs", "reruns", "checks", "exact_certificates", "exact_vs_softmax"):
        assert again[key] == out[key], key

