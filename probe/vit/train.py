"""Training the ViT / OT-ViT / Sinkhorn-ViT / exact-ViT: one run = one directory, resumable, with a results file.

A run directory holds ``checkpoint.pt`` (rewritten atomically after every epoch: model, optimizer, the torch
RNG state, the learning curve so far), and at the end ``model.pt`` (weights and config only; what
:func:`probe.vit.load_checkpoint` reads) and ``results.json``.  A killed run started again with the same
settings continues from its last finished epoch and ends exactly where an uninterrupted run would (the data
order and the trick's draws come from generators seeded by (seed, epoch); the dropout RNG is restored).
The steps themselves run in :mod:`probe.vit.loop` (the data resident on the device, no host sync per step,
``precision`` and ``compile`` as options).

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

from probe.core.destination import check_destination
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.version import __version__
from probe.solve.exact import merge_summaries
from probe.vit.attention import MultiHeadAttention
from probe.vit.data import DATASETS, ImageData, load_data
from probe.vit.gap import GAP_IMAGES, final_layer_gap, gap_line
from probe.vit.loop import PRECISIONS, TRICK_PROBABILITY, Partners, Resident, evaluate_resident, plan_epoch, train_epoch
from probe.vit.model import ViT, ViTConfig, parameter_count

__all__ = ["TrainSettings", "Training", "train", "validate_settings", "read_checkpoint", "CHECKPOINT", "RESULTS", "MODEL"]

CHECKPOINT, RESULTS, MODEL = "checkpoint.pt", "results.json", "model.pt"
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
    # how the steps run (probe.vit.loop): "bf16" changes the arithmetic, so it is part of the fingerprint
    precision: str = "fp32"
    compile: bool = False

    def run_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / f"vit-{self.data}-{self.attention}-seed{self.seed}"

    # what must match for a run directory to be resumed (epochs may grow, device/threads/progress/compile may
    # change); the precision counts only when it is not the default (a checkpoint that records none is fp32)
    def fingerprint(self) -> dict:
        skip = {"epochs", "device", "out", "threads", "progress", "data_dir", "compile"}
        if self.precision == "fp32":
            skip.add("precision")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def validate_settings(s: TrainSettings) -> None:
    """Every check on the options that needs no data (and on probe's environment variables): raises
    :class:`ProbeError`."""
    check_environment()
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
    if s.precision not in PRECISIONS:
        raise ProbeError(f"unknown precision {s.precision!r}: --precision must be one of {', '.join(PRECISIONS)}.")
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


def evaluate(model: ViT, resident: Resident, precision: str = "fp32") -> dict:
    """Test accuracy and loss over the run's test images (:func:`probe.vit.loop.evaluate_resident`), and the exact
    layer's certificates merged (``exact_test``)."""
    exact = _exact_layer(model)
    metrics, certificates = evaluate_resident(model, resident, precision=precision, exact=exact)
    if exact is not None:
        metrics["exact_test"] = merge_summaries(certificates)
    return metrics


@dataclass
class Prepared:
    """What the checks before training found (:func:`prepare`)."""

    data: ImageData
    train_index: torch.Tensor  #: the training subset's indices into the data's training images
    test_index: torch.Tensor  #: the test subset's, into its test images
    run_dir: Path
    checkpoint: dict | None  #: the run directory's checkpoint, when it holds one of these settings

    @property
    def train_images(self) -> int:
        return int(self.train_index.shape[0])


def prepare(s: TrainSettings) -> Prepared:
    """All checks before training (options, data, run directory)."""
    validate_settings(s)
    check_destination(s.run_dir(), "out")  # before the data loads: writable, with room
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
    return Prepared(data, train_index, test_index, run_dir, checkpoint)


class Training:
    """One run's model, optimizer and learning curve: started afresh from the seed, or resumed from the run
    directory's checkpoint (:meth:`resume`); :meth:`run_epochs` trains the epochs left, writing a checkpoint
    after each (:meth:`save_checkpoint`), and :meth:`save_results` writes ``model.pt`` and ``results.json``."""

    def __init__(self, s: TrainSettings, prepared: Prepared):
        self.s, self.prepared, self.run_dir = s, prepared, prepared.run_dir
        self.device = torch.device(s.device)
        self.config = model_config(s, prepared.data)
        torch.manual_seed(s.seed)
        self.model = ViT(self.config).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=s.lr)
        self.history: list[dict] = []  # one entry per finished epoch (the checkpoint's "epoch" is its length)
        self.wall_before = 0.0  # the seconds the run's earlier processes trained
        self.started = time.perf_counter()
        if prepared.checkpoint is not None:
            self.resume(prepared.checkpoint)

    @property
    def epochs_done(self) -> int:
        return len(self.history)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.prepared.train_images / self.s.batch_size)

    def wall_s(self) -> float:
        """The seconds spent training, over every process of the run."""
        return self.wall_before + time.perf_counter() - self.started

    # -- resuming

    def resume(self, checkpoint: dict) -> None:
        """Continue from a checkpoint: model, optimizer, RNG state, learning curve and wall time."""
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        torch.set_rng_state(checkpoint["rng"])
        if self.device.type == "cuda" and checkpoint.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(checkpoint["cuda_rng"], self.device)
        self.history, self.wall_before = checkpoint["history"], checkpoint["wall_s"]
        if self.epochs_done > self.s.epochs:
            raise ProbeError(
                f"{self.run_dir} already holds {self.epochs_done} epochs, more than --epochs {self.s.epochs}: give "
                f"--epochs {self.epochs_done} or more to use it, or another --out."
            )

    def finished_results(self) -> dict | None:
        """The results of a run that already trained every epoch asked for, if it wrote them."""
        if self.epochs_done < self.s.epochs or not (self.run_dir / RESULTS).exists():
            return None
        results = json.loads((self.run_dir / RESULTS).read_text())
        return results if results.get("epochs_done") == self.s.epochs else None

    # -- the loop

    def run_epochs(self, log=None) -> None:
        """Train the epochs left, each followed by its evaluation and a checkpoint."""
        s, prepared = self.s, self.prepared
        labels = prepared.data.train_labels[prepared.train_index]
        partners = Partners(labels, prepared.data.num_classes) if s.attention == "ot" else None
        # probe.vit.loop: the data, once, on the device
        resident = Resident(prepared.data, prepared.train_index, prepared.test_index, self.device)
        forward = torch.compile(self.model, dynamic=True) if s.compile else self.model
        self.started = time.perf_counter()
        for epoch in range(self.epochs_done, s.epochs):
            self.history.append(self.run_epoch(epoch, forward, resident, partners))
            self.save_checkpoint()
            if log is not None:
                entry = self.history[-1]
                log(f"epoch {epoch + 1}/{s.epochs}: train loss {entry['train_loss']:.4f}, "
                    f"test accuracy {entry['test_accuracy']:.4f}, {gap_line(entry['final_layer_gap'])} "
                    f"({entry['epoch_s']:.0f} s)")

    def run_epoch(self, epoch: int, forward, resident: Resident, partners: Partners | None) -> dict:
        """Train one epoch (0-based ``epoch``) and evaluate it; returns its entry of the learning curve."""
        from tqdm.auto import tqdm

        s = self.s
        exact = _exact_layer(self.model)
        epoch_start = time.perf_counter()
        plan = plan_epoch(s.seed, epoch, self.prepared.train_images, s.batch_size, partners, self.device)
        with tqdm(total=self.steps_per_epoch, desc=f"{s.attention} seed {s.seed} epoch {epoch + 1}/{s.epochs}",
                  disable=not s.progress, leave=False, mininterval=1.0, file=sys.stderr) as bar:
            done = train_epoch(self.model, forward, self.optimizer, resident, plan, precision=s.precision, exact=exact,
                               on_step=None if bar.disable else lambda: bar.update())
        train_s = time.perf_counter() - epoch_start
        metrics = evaluate(self.model, resident, s.precision)
        metrics["final_layer_gap"] = final_layer_gap(self.model, resident.test_x[:GAP_IMAGES])  # probe.vit.gap
        return {
            "epoch": epoch + 1, "train_loss": done["train_loss"], "train_accuracy": done["train_accuracy"], **metrics,
            "train_s": train_s, "epoch_s": time.perf_counter() - epoch_start,
            **({"exact_train": merge_summaries(done["certificates"])} if exact is not None else {}),
        }

    # -- what it writes

    def save_checkpoint(self) -> None:
        """``checkpoint.pt``, atomically: everything :meth:`resume` needs to continue after the last epoch."""
        cuda = self.device.type == "cuda"
        _atomic_save({
            "format": "probe-vit-checkpoint", "fingerprint": self.s.fingerprint(), "settings": asdict(self.s),
            "config": self.config.to_dict(), "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if cuda else None,
            "epoch": self.epochs_done, "history": self.history, "wall_s": self.wall_s(),
        }, self.run_dir / CHECKPOINT)

    def save_results(self) -> dict:
        """``model.pt`` (what :func:`probe.vit.load_checkpoint` reads) and ``results.json``; returns the results."""
        s, model, config, prepared = self.s, self.model, self.config, self.prepared
        wall = self.wall_s()
        _atomic_save({"format": "probe-vit-model", "config": config.to_dict(), "model": model.state_dict(),
                      "settings": asdict(s)}, self.run_dir / MODEL)
        results = {
            "test_accuracy": self.history[-1]["test_accuracy"],
            "test_loss": self.history[-1]["test_loss"],
            "learning_curve": self.history,
            "epochs_done": self.epochs_done,
            "wall_time_s": wall,
            "parameters": sum(p.numel() for p in model.parameters()),
            "parameters_formula": parameter_count(config),
            "steps": self.steps_per_epoch * self.epochs_done,
            "train_images": prepared.train_images,
            "test_images": int(prepared.test_index.shape[0]),
            "settings": asdict(s),
            "model_config": config.to_dict(),
            "gamma": float(model.blocks[-1].attn.gamma),
            "alpha": float(model.blocks[-1].attn.alpha),
            "trick_probability": TRICK_PROBABILITY if s.attention == "ot" else None,
            "data_source": prepared.data.source,
            "threads": torch.get_num_threads(),
            "versions": _versions(),
        }
        _atomic_json(results, self.run_dir / RESULTS)
        return results


def train(s: TrainSettings, *, log=None) -> dict:
    """Train (or resume, or find finished) the run of ``s``; returns the results dictionary."""
    prepared = prepare(s)
    if s.threads:
        torch.set_num_threads(s.threads)
    training = Training(s, prepared)
    finished = training.finished_results()
    if finished is not None:
        return finished
    training.run_epochs(log)
    return training.save_results()
