"""Data-parallel runs on torch.distributed: which process this is, and the few messages processes exchange.

``torchrun --nproc-per-node N -m probe run MODEL ...`` starts N processes (ranks).  Every rank loads
the model and the texts and plans the same batches (the plan is deterministic); rank 0 creates the run
directory, holds its lock, and tells the others which batches are left; rank r then computes every
N-th of them and writes their part files into the one run directory, and rank 0 writes the manifest.
Batches are independent of one another, so the ranks exchange nothing but a few small Python objects,
all at the start: whether every rank is ready (a rank's error stops them all), the run directory, the
batches left, and each rank's device, threads and load times.  After that, rank 0 follows the others
through the part files they write.

Devices: one per local rank on GPU (``cuda:LOCAL_RANK``, NCCL), the CPU otherwise (gloo).  Threads:
torchrun sets ``OMP_NUM_THREADS=1`` for each process unless it is set, which is right when the
process count equals the cores; a launcher that sets neither gets ``cores // processes per node``.

A single process (no ``WORLD_SIZE`` in the environment, or 1) is the same code with a group of one.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from probe.core.errors import ProbeError


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its rank among ``world`` and on its node among ``local_world``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> "Ranks":
        """From the variables torchrun (or any torch.distributed launcher) sets for each process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")), local_world)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Group:
    """The ranks of a run and the messages they exchange (all of them gathered or broadcast objects)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    @property
    def main(self) -> bool:
        return self.ranks.main

    def device(self, requested: str) -> str:
        """The device of this rank: ``auto`` and ``cuda`` mean this local rank's GPU when there are several
        processes (``cuda:N`` and ``cpu`` are taken as given)."""
        if self.ranks.world > 1 and requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.ranks.local_rank}"
        return requested

    def gather(self, value) -> list:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.ranks.world == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.ranks.world
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value):
        """Rank 0's ``value`` on every rank."""
        if self.ranks.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, step):
        """Run ``step()`` on every rank; if it fails on any rank, fail on all (a rank's own error, or a
        :class:`ProbeError` that names the rank that failed) instead of leaving the others waiting."""
        result, failure = None, None
        try:
            result = step()
        except Exception as error:  # noqa: BLE001 - re-raised below, after the others know
            failure = error
        messages = self.gather(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        for rank, message in enumerate(messages):
            if message is not None:
                raise ProbeError(f"Process {rank} of {self.ranks.world} failed, so all stop: {message}")
        return result

    def from_main(self, step):
        """Run ``step()`` on rank 0 only and return its result on every rank (its failure stops all)."""
        result, failure = None, None
        if self.main:
            try:
                result = step()
            except Exception as error:  # noqa: BLE001 - re-raised below, after the others know
                failure = error
        result, message = self.broadcast((result, None if failure is None else f"{type(failure).__name__}: {failure}"))
        if failure is not None:
            raise failure
        if message is not None:
            raise ProbeError(f"Process 0 of {self.ranks.world} failed, so all stop: {message}")
        return result


@contextmanager
def join(requested_device: str):
    """The group of this process: joins torch.distributed when launched as several processes."""
    ranks = Ranks.from_environment()
    group = Group(ranks)
    if ranks.world == 1:
        yield group
        return
    import torch.distributed as dist

    device = group.device(requested_device)
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
    elif "OMP_NUM_THREADS" not in os.environ:  # a launcher other than torchrun: share the node's cores
        torch.set_num_threads(max(1, available_cores() // ranks.local_world))
    dist.init_process_group(backend="nccl" if on_gpu else "gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group()
