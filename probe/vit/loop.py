"""The training loop of ``probe vit train``, written to keep a device busy: the data resident on the device, no
host sync in a training step, mixed precision and ``torch.compile`` as options.

* **Resident data** (:class:`Resident`): the run's training and test images are normalised once and copied to
  the device once, as one tensor each; a step indexes them.  Normalising is elementwise, so every batch holds
  exactly the numbers that normalising it alone gives.
* **An epoch's plan on the host, once** (:func:`plan_epoch`): the data order and, for the OT-ViT, the training
  trick's partners come from the same seeded generators, drawn in the same sequence as a step-by-step loop
  draws them, and go to the device in one copy per epoch.  Which samples get a partner is known on the host
  beforehand, so the model never reads the mask back (``ViT.forward(..., extra_index=...)``).
* **No host sync per step**: the loss and the correct predictions are summed on the device (the loss in
  float64, as a Python float would sum it) and read once per epoch.  The exact-ViT's solver is the exception:
  its Newton iterations decide on the host when to stop, and its certificates are read per step.
* **Mixed precision** (``precision="bf16"``): the steps run under ``torch.autocast`` in bfloat16; the OT,
  Sinkhorn and exact layers keep their weights in float32 (:class:`probe.vit.attention.MultiHeadAttention`),
  the exact solve in float64.  bfloat16 needs no loss scaling (a loss scaler reads its overflow flag back every
  step).  The default, ``"fp32"``, computes what the step-by-step loop computed, to the bit on the CPU.
* **torch.compile** (``compile=True``): the model's forward compiled (dynamic shapes: the OT-ViT's batch
  of partners changes size from step to step).  Off by default.  Compiled dropout draws its own random
  numbers (Inductor's), so a compiled run is the eager run only up to its dropout masks.

:func:`plateau_epoch` is the stopping rule of the full protocol (no improvement for ``patience`` epochs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Resident", "EpochPlan", "plan_epoch", "train_epoch", "evaluate_resident", "plateau_epoch",
           "Partners", "generator", "TRICK_PROBABILITY", "PRECISIONS"]

TRICK_PROBABILITY = 0.5
#: the precisions of the training steps (``--precision``)
PRECISIONS = ("fp32", "bf16")


def generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    """The seeded CPU generator of one epoch's ``stream`` (0: the data order, 1: the training trick)."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 7 + stream) % (2**63))


class Partners:
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


class Resident:
    """A run's images, normalised once (:meth:`probe.vit.data.ImageData.normalise`) and held on ``device``."""

    def __init__(self, data, train_index: torch.Tensor, test_index: torch.Tensor, device):
        self.train_x = data.normalise(data.train_images[train_index]).to(device)
        self.train_y = data.train_labels[train_index].to(device)
        self.test_x = data.normalise(data.test_images[test_index]).to(device)
        self.test_y = data.test_labels[test_index].to(device)


@dataclass
class EpochPlan:
    """One epoch's draws, on the device: ``order (n,)`` the data order; for the OT-ViT ``use (n,)`` the trick's
    mask in that order, ``partner (m,)`` the partners of the samples that use one (step by step) and
    ``within (m,)`` each one's row in its batch; ``bounds[step]`` the host's slice of ``partner`` for a step."""

    order: torch.Tensor
    steps: int
    batch_size: int
    use: Optional[torch.Tensor] = None
    partner: Optional[torch.Tensor] = None
    within: Optional[torch.Tensor] = None
    bounds: Optional[list] = None


def plan_epoch(seed: int, epoch: int, n: int, batch_size: int, partners: Optional[Partners], device) -> EpochPlan:
    """The draws of epoch ``epoch`` (0-based), in the sequence a step-by-step loop makes them: the order from
    stream 0, then per step the trick's coins and partners from stream 1."""
    order = torch.randperm(n, generator=generator(seed, epoch, 0))
    steps = -(-n // batch_size)
    if partners is None:
        return EpochPlan(order.to(device), steps, batch_size)
    trick = generator(seed, epoch, 1)
    drawn = [partners.draw(order[step * batch_size : (step + 1) * batch_size], trick) for step in range(steps)]
    use = torch.cat([u for _, u in drawn])
    rows = use.nonzero().squeeze(1)  # one pass over the epoch, on the host's tensors
    step_of = rows // batch_size
    bounds = torch.cumsum(torch.bincount(step_of, minlength=steps), 0).tolist()
    bounds = list(zip([0] + bounds[:-1], bounds))
    partner = torch.cat([p for p, _ in drawn])[rows]
    return EpochPlan(order.to(device), steps, batch_size, use.to(device), partner.to(device),
                     (rows - step_of * batch_size).to(device), bounds)


def autocast(device: torch.device, precision: str):
    """The context of a step's forward: bfloat16 autocast for ``"bf16"``, nothing for ``"fp32"``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def train_epoch(model, forward, optimizer, resident: Resident, plan: EpochPlan, *, precision: str = "fp32",
                exact=None, on_step=None) -> dict:
    """One epoch of training steps: returns ``train_loss`` and ``train_accuracy`` (read from the device once)
    and, for an exact final layer (``exact``: its attention module), the certificates' summaries per step.

    ``forward`` is the model's forward (compiled or not); ``on_step`` is called after each step (a progress bar).
    """
    device = plan.order.device
    n = plan.order.shape[0]
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    certificates = []
    model.train()
    for step in range(plan.steps):
        start, stop = step * plan.batch_size, min((step + 1) * plan.batch_size, n)
        pos = plan.order[start:stop]
        x, y = resident.train_x[pos], resident.train_y[pos]
        with autocast(device, precision):
            if plan.partner is not None:
                a, b = plan.bounds[step]
                logits = forward(x, resident.train_x[plan.partner[a:b]], plan.use[start:stop],
                                 extra_index=plan.within[a:b])
            else:
                logits = forward(x)
            loss = F.cross_entropy(logits.float(), y)
        if exact is not None:
            certificates.append(exact.last_certificate.summary())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total_loss += loss.detach().double() * (stop - start)
        correct += (logits.argmax(-1) == y).sum()
        if on_step is not None:
            on_step()
    return {"train_loss": float(total_loss) / n, "train_accuracy": int(correct) / n, "certificates": certificates}


@torch.no_grad()
def evaluate_resident(model, resident: Resident, *, precision: str = "fp32", exact=None, batch_size: int = 500):
    """Test accuracy and loss over the resident test images (summed on the device, read once), and for an exact
    final layer the certificates' summaries per batch."""
    model.eval()
    x_all, y_all = resident.test_x, resident.test_y
    loss = torch.zeros((), dtype=torch.float64, device=x_all.device)
    correct = torch.zeros((), dtype=torch.long, device=x_all.device)
    certificates = []
    for start in range(0, x_all.shape[0], batch_size):
        x, y = x_all[start : start + batch_size], y_all[start : start + batch_size]
        with autocast(x.device, precision):
            logits = model(x).float()
        loss += F.cross_entropy(logits, y, reduction="sum").double()
        correct += (logits.argmax(-1) == y).sum()
        if exact is not None:
            certificates.append(exact.last_certificate.summary())
    n = x_all.shape[0]
    return {"test_accuracy": int(correct) / n, "test_loss": float(loss) / n}, certificates


def plateau_epoch(accuracies: Sequence[float], patience: int) -> Optional[int]:
    """The first epoch (1-based) after which the best accuracy so far is ``patience`` epochs old: the epoch
    ``e`` with ``max(accuracies[:e - patience]) >= max(accuracies[e - patience:e])``.  None if there is none yet.
    Ties count as no improvement."""
    best, best_epoch = float("-inf"), 0
    for epoch, accuracy in enumerate(accuracies, 1):
        if accuracy > best:
            best, best_epoch = accuracy, epoch
        elif epoch - best_epoch >= patience:
            return epoch
    return None
