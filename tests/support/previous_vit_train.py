# probe vit train's training loop as it was before the device-resident loop (probe/vit/loop.py), frozen: the
# reference that tests/vit/test_vit_loop.py compares the current loop with, and the "before" of
# bench/vit_steps.py.  One host sync or more per step (float(loss), int(correct), the trick's mask), every batch
# normalised and copied to the device per step.  Not used by probe.
"""Training the ViT / OT-ViT / Sinkhorn-ViT / exact-ViT: one run = one directory, resumable, with a results file.

A run directory holds ``checkpoint.pt`` (rewritten atomically after every epoch: model, optimizer, the torch
RNG state, the learning curve so far), and at the end ``model.pt`` (weights and config only; what
:func:`probe.vit.load_checkpoint` reads) and ``results.json``.  A killed run started again with the same
settings continues from its last finished epoch and ends exactly where an uninterrupted run would (the data
order and the trick's draws come from generators seeded by (seed, epoch); the dropout RNG is restored).

The same settings give every attention the same initial weights (the parameters are the same), the same
training subset, the same data order, batch size, epochs and learning rate: only the final layer's
attention differs.  Optimiser: Adam, constant learning rate (the paper gives only the rate, 3e-4).
Training trick (OT only, the paper's): each training sample, with probability 1/2, has the final-layer
templates of another training image of the same class (drawn uniformly among the training subset, not
itself) added to its candidate set; at test time only the input's own.

Checkpoints are read with ``torch.load(weights_only=True)`` (:func:`read_checkpoint`): they hold tensors and
plain data only, and a file that names any other Python object is refused, so a crafted checkpoint runs no
code.  Every epoch's entry of the history records how far the final layer is from exact inference on the first
test images (``final_layer_gap``: :mod:`probe.vit.gap`).  The exact-ViT's history also records, per epoch, its
final layer's Newton iterations and certificates over the training steps (``exact_train``) and the evaluation
(``exact_test``): the summaries of :class:`probe.solve.exact.ExactCertificate`, merged by
:func:`probe.solve.exact.merge_summaries`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import platform
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from probe.core.errors import ProbeError
from probe.core.version import __version__
from probe.solve.exact import merge_summaries
from probe.vit.attention import MultiHeadAttention
from probe.vit.data import DATASETS, ImageData, load_data
from probe.vit.gap import GAP_IMAGES, final_layer_gap, gap_line
from probe.vit.model import ViT, ViTConfig, parameter_count

__all__ = ["TrainSettings", "train", "validate_settings", "read_checkpoint", "CHECKPOINT", "RESULTS", "MODEL"]

CHECKPOINT, RESULTS, MODEL = "checkpoint.pt", "results.json", "model.pt"
TRICK_PROBABILITY = 0.5
_SUBSET_SEED = 20240527  # the training/test subsets: fixed, the same for every seed and attention


@dataclass
class TrainSettings:
    data: str = "fashion-mnist"
    data_dir: Optional[str] = None
    attention: str = "softmax"
    seed: int = 0
    epochs: int = 10
    lr: float = 3e-4
    batch_size: int = 128
    train_subset: Optional[int] = None
    test_subset: Optional[int] = None
    device: str = "cpu"
    out: Optional[str] = None
    threads: Optional[int] = None
    progress: bool = True
    # the model's sizes (MODEL_FIELDS), defaults from ViTConfig: the paper's, in one place
    dim: int = ViTConfig.dim
    depth: int = ViTConfig.depth
    heads: int = ViTConfig.heads
    head_dim: int = ViTConfig.head_dim
    mlp_dim: int = ViTConfig.mlp_dim
    patch: int = ViTConfig.patch
    dropout: float = ViTConfig.dropout
    sinkhorn_iterations: int = ViTConfig.sinkhorn_iterations

    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / f"vit-{self.data}-{self.attention}-seed{self.seed}"

    # what must match for a run directory to be resumed (epochs may grow, device/threads/progress may change)
    def fingerprint(self) -> dict:
        skip = {"epochs", "device", "out", "threads", "progress", "data_dir"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def validate_settings(s: TrainSettings) -> None:
    """Every check on the options that needs no data: raises :class:`ProbeError`."""
    if s.data not in DATASETS:
        raise ProbeError(f"unknown data set {s.data!r}: --data must be one of {', '.join(DATASETS)}.")
    if s.attention not in MultiHeadAttention.KINDS:
        raise ProbeError(
            f"unknown attention {s.attention!r}: --attention must be one of {', '.join(MultiHeadAttention.KINDS)}."
        )
    for name, value in (("--epochs", s.epochs), ("--batch-size", s.batch_size), ("--depth", s.depth),
                        ("--heads", s.heads), ("--head-dim", s.head_dim), ("--dim", s.dim), ("--mlp-dim", s.mlp_dim),
                        ("--sinkhorn-iterations", s.sinkhorn_iterations), ("--patch", s.patch)):
        if value < 1:
            raise ProbeError(f"{name} must be a positive integer, got {value}.")
    for name, value in (("--train-subset", s.train_subset), ("--test-subset", s.test_subset), ("--threads", s.threads)):
        if value is not None and value < 1:
            raise ProbeError(f"{name} must be a positive integer (or left out), got {value}.")
    if not (math.isfinite(s.lr) and s.lr > 0):
        raise ProbeError(f"--lr must be a positive number, got {s.lr} (the paper's is 3e-4).")
    if not 0 <= s.dropout < 1:
        raise ProbeError(f"--dropout must be in [0, 1), got {s.dropout}.")
    if s.device not in ("cpu", "cuda") and not s.device.startswith("cuda:"):
        raise ProbeError(f"unknown device {s.device!r}: --device must be cpu, cuda or cuda:N.")
    if s.device.startswith("cuda") and not torch.cuda.is_available():
        raise ProbeError(f"--device {s.device} asked for, but torch sees no CUDA device here: use --device cpu.")


def _subset(n: int, size: Optional[int], what: str, option: str) -> torch.Tensor:
    if size is None:
        return torch.arange(n)
    if size > n:
        raise ProbeError(f"{option} {size} is larger than the {n} {what} images: give at most {n} or leave it out.")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(_SUBSET_SEED))
    return order[:size].sort().values


def _generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 7 + stream) % (2**63))


class _Partners:
    """Draws, for each sample, another training image of the same class (the OT training trick)."""

    def __init__(self, labels: torch.Tensor, num_classes: int):
        n = labels.shape[0]
        counts = torch.bincount(labels, minlength=num_classes)
        order = torch.argsort(labels, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty(n, dtype=torch.long)
        position[order] = torch.arange(n) - starts[labels[order]]
        self.labels, self.counts, self.order, self.starts, self.position = labels, counts, order, starts, position

    def draw(self, index: torch.Tensor, generator: torch.Generator):
        """``index (B,)`` positions in the training subset -> (partner positions, use mask)."""
        c = self.labels[index]
        others = self.counts[c] - 1
        coin = torch.rand(index.shape[0], generator=generator) < TRICK_PROBABILITY
        r = (torch.rand(index.shape[0], generator=generator) * others.clamp_min(1)).long()
        r = r + (r >= self.position[index]).long()  # skip the image itself
        partner = self.order[self.starts[c] + r.clamp_max(self.counts[c] - 1)]
        return partner, coin & (others > 0)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def read_checkpoint(path: Path, remedy: str, map_location="cpu") -> dict:
    """A checkpoint or model file of this module, read with ``torch.load(weights_only=True)``: tensors and plain
    data only.  A file that names another Python object (which unpickling could run) is refused, and so is a
    damaged one, each with a :class:`ProbeError` that ends with ``remedy``."""
    try:
        saved = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        detail = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line), None)
        if detail is None:
            raise ProbeError(f"cannot read {path} (UnpicklingError: {error}): it is damaged. {remedy}") from None
        raise ProbeError(
            f"refusing to read {path}: it holds a Python object that is neither a tensor nor plain data ({detail}), "
            f"and loading it could run code; `probe vit train` writes no such file. {remedy}"
        ) from None
    except Exception as error:  # noqa: BLE001
        raise ProbeError(f"cannot read {path} ({type(error).__name__}: {error}): it is damaged. {remedy}") from None
    if not isinstance(saved, dict):
        raise ProbeError(f"{path} holds a {type(saved).__name__}, not a `probe vit train` checkpoint. {remedy}")
    return saved


def _atomic_json(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


#: the settings that size the model, passed to :class:`ViTConfig` as they are
MODEL_FIELDS = ("patch", "dim", "depth", "heads", "head_dim", "mlp_dim", "dropout", "sinkhorn_iterations")


def model_config(s: TrainSettings, data: ImageData) -> ViTConfig:
    return ViTConfig(
        image_size=data.image_size, channels=data.channels, num_classes=data.num_classes, attention=s.attention,
        **{name: getattr(s, name) for name in MODEL_FIELDS},
    )


def _versions() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "probe": __version__, "platform": platform.platform()}


def _exact_layer(model: ViT):
    """The final layer's attention if it is exact (its ``last_certificate`` is read after each forward), else None."""
    attention = model.blocks[-1].attn
    return attention if attention.kind == "exact" else None


@torch.no_grad()
def evaluate(model: ViT, data: ImageData, index: torch.Tensor, device, batch_size: int = 500) -> dict:
    model.eval()
    correct, loss = 0, 0.0
    exact, certificates = _exact_layer(model), []
    for start in range(0, index.shape[0], batch_size):
        i = index[start : start + batch_size]
        x = data.normalise(data.test_images[i]).to(device)
        y = data.test_labels[i].to(device)
        logits = model(x)
        loss += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        if exact is not None:
            certificates.append(exact.last_certificate.summary())
    metrics = {"test_accuracy": correct / index.shape[0], "test_loss": loss / index.shape[0]}
    if exact is not None:
        metrics["exact_test"] = merge_summaries(certificates)
    return metrics


def prepare(s: TrainSettings):
    """All checks before training (options, data, run directory): returns what :func:`train` needs."""
    validate_settings(s)
    if s.data != "fashion-mnist" and s.data_dir is None:
        raise ProbeError(f"--data {s.data} needs --data-dir: the directory holding its python batches.")
    data = load_data(s.data, s.data_dir)
    if data.image_size % s.patch:
        raise ProbeError(f"--patch {s.patch} does not divide the image size {data.image_size}.")
    train_index = _subset(data.train_labels.shape[0], s.train_subset, "training", "--train-subset")
    test_index = _subset(data.test_labels.shape[0], s.test_subset, "test", "--test-subset")
    run_dir = s.run_dir()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe_file = run_dir / ".write-test"
        probe_file.write_text("")
        probe_file.unlink()
    except OSError as error:
        raise ProbeError(f"cannot write the run directory {run_dir} ({error}): give a writable --out.") from None
    checkpoint = None
    if (run_dir / CHECKPOINT).exists():
        checkpoint = read_checkpoint(run_dir / CHECKPOINT, "Delete it to start the run afresh, or give another --out.")
        if checkpoint.get("fingerprint") != s.fingerprint():
            theirs, ours = checkpoint.get("fingerprint", {}), s.fingerprint()
            diff = ", ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} now" for k in ours if theirs.get(k) != ours.get(k))
            raise ProbeError(
                f"{run_dir} holds a run with other settings ({diff}). Give the same settings to resume it, "
                "or another --out for a new run."
            )
    return data, train_index, test_index, run_dir, checkpoint


def train(s: TrainSettings, *, log=None) -> dict:
    """Train (or resume, or find finished) the run of ``s``; returns the results dictionary."""
    data, train_index, test_index, run_dir, checkpoint = prepare(s)
    if s.threads:
        torch.set_num_threads(s.threads)
    device = torch.device(s.device)
    config = model_config(s, data)
    torch.manual_seed(s.seed)
    model = ViT(config).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=s.lr)
    history, start_epoch, wall_before = [], 0, 0.0
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        torch.set_rng_state(checkpoint["rng"])
        if device.type == "cuda" and checkpoint.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(checkpoint["cuda_rng"], device)
        history, start_epoch, wall_before = checkpoint["history"], checkpoint["epoch"], checkpoint["wall_s"]
        if start_epoch > s.epochs:
            raise ProbeError(
                f"{run_dir} already holds {start_epoch} epochs, more than --epochs {s.epochs}: give --epochs "
                f"{start_epoch} or more to use it, or another --out."
            )
    if start_epoch >= s.epochs and (run_dir / RESULTS).exists():
        results = json.loads((run_dir / RESULTS).read_text())
        if results.get("epochs_done") == s.epochs:
            return results

    labels = data.train_labels[train_index]
    partners = _Partners(labels, data.num_classes) if s.attention == "ot" else None
    n, bs = train_index.shape[0], s.batch_size
    steps_per_epoch = math.ceil(n / bs)
    started = time.perf_counter()
    from tqdm.auto import tqdm

    exact = _exact_layer(model)
    for epoch in range(start_epoch, s.epochs):
        epoch_start = time.perf_counter()
        model.train()
        certificates = []
        order = torch.randperm(n, generator=_generator(s.seed, epoch, 0))
        trick = _generator(s.seed, epoch, 1)
        total_loss, correct = 0.0, 0
        bar = tqdm(range(steps_per_epoch), desc=f"{s.attention} seed {s.seed} epoch {epoch + 1}/{s.epochs}",
                   disable=not s.progress, leave=False, mininterval=1.0, file=sys.stderr)
        for step in bar:
            pos = order[step * bs : (step + 1) * bs]
            x = data.normalise(data.train_images[train_index[pos]]).to(device)
            y = labels[pos].to(device)
            if partners is not None:
                partner, use = partners.draw(pos, trick)
                extra = data.normalise(data.train_images[train_index[partner]]).to(device)
                logits = model(x, extra, use.to(device))
            else:
                logits = model(x)
            if exact is not None:
                certificates.append(exact.last_certificate.summary())
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += float(loss.detach()) * pos.shape[0]
            correct += int((logits.argmax(-1) == y).sum())
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", refresh=False)
        bar.close()
        train_s = time.perf_counter() - epoch_start
        metrics = evaluate(model, data, test_index, device)
        gap_images = data.normalise(data.test_images[test_index[:GAP_IMAGES]]).to(device)
        metrics["final_layer_gap"] = final_layer_gap(model, gap_images)  # probe.vit.gap
        history.append({
            "epoch": epoch + 1, "train_loss": total_loss / n, "train_accuracy": correct / n, **metrics,
            "train_s": train_s, "epoch_s": time.perf_counter() - epoch_start,
            **({"exact_train": merge_summaries(certificates)} if exact is not None else {}),
        })
        wall = wall_before + time.perf_counter() - started
        _atomic_save({
            "format": "probe-vit-checkpoint", "fingerprint": s.fingerprint(), "settings": asdict(s),
            "config": config.to_dict(), "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(), "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "epoch": epoch + 1, "history": history, "wall_s": wall,
        }, run_dir / CHECKPOINT)
        if log is not None:
            log(f"epoch {epoch + 1}/{s.epochs}: train loss {history[-1]['train_loss']:.4f}, "
                f"test accuracy {metrics['test_accuracy']:.4f}, {gap_line(metrics['final_layer_gap'])} "
                f"({history[-1]['epoch_s']:.0f} s)")

    wall = wall_before + time.perf_counter() - started
    _atomic_save({"format": "probe-vit-model", "config": config.to_dict(), "model": model.state_dict(),
                  "settings": asdict(s)}, run_dir / MODEL)
    results = {
        "test_accuracy": history[-1]["test_accuracy"],
        "test_loss": history[-1]["test_loss"],
        "learning_curve": history,
        "epochs_done": len(history),
        "wall_time_s": wall,
        "parameters": sum(p.numel() for p in model.parameters()),
        "parameters_formula": parameter_count(config),
        "steps": steps_per_epoch * len(history),
        "train_images": n,
        "test_images": int(test_index.shape[0]),
        "settings": asdict(s),
        "model_config": config.to_dict(),
        "gamma": float(model.blocks[-1].attn.gamma),
        "alpha": float(model.blocks[-1].attn.alpha),
        "trick_probability": TRICK_PROBABILITY if s.attention == "ot" else None,
        "data_source": data.source,
        "threads": torch.get_num_threads(),
        "versions": _versions(),
    }
    _atomic_json(results, run_dir / RESULTS)
    return results
