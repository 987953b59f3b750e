"""Running independent pieces of tensor work side by side on the CPU's cores.

torch parallelises each operation over its intra-op threads.  The solver's operations are many and
small (a tile's elementwise updates take tens of microseconds), and handing each one to a team of
threads costs more than it saves, most of all under ``OMP_WAIT_POLICY=PASSIVE`` (which ``probe``
sets so that idle threads sleep instead of taking cores from other work): waking the sleeping team
for every operation made the solver twice as slow on 2 threads as on 1 at 128 tokens.

So independent pieces (the solver's tiles, the sites of a stack) run side by side instead, each in a
worker thread whose own operations use one intra-op thread; torch releases the GIL inside its
kernels, so the workers' kernels run in parallel.  Each piece computes exactly what it would alone,
in the same order, so the results do not depend on the number of workers or on their scheduling.

The workers still take turns for the GIL between operations, and for small operations that turn-taking
costs more than the operations: a loop of them runs slower on two threads than on one.  The solver's
hottest loops are therefore compiled with TorchScript (:func:`without_gil`), whose interpreter runs
them without the GIL.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_pools: dict[int, ThreadPoolExecutor] = {}


def set_thread_count(count: int) -> None:
    """This thread's intra-op thread count, for good.

    torch settles a new thread's count lazily, at the thread's first operation, from the count last set
    in *any* thread: a worker that only called ``torch.set_num_threads(1)`` would take the main thread's
    count if that were set before the worker's first operation.  Asking for the count first settles it."""
    torch.get_num_threads()
    torch.set_num_threads(count)


def _one_intra_op_thread() -> None:
    set_thread_count(1)


def cpu_workers(device: torch.device | str | None = None) -> int:
    """How many pieces to run side by side: the process's intra-op thread count (``--threads``,
    default one per core) on a CPU; 0 elsewhere (a GPU parallelises each operation itself, so the
    pieces run in the caller's thread: :func:`run_all`)."""
    if device is not None and torch.device(device).type != "cpu":
        return 0
    return max(1, torch.get_num_threads())


def without_gil(function: Callable) -> Callable:
    """``function`` compiled by TorchScript, whose interpreter releases the GIL while it runs, so that the
    workers of :func:`run_all` run its loop truly side by side; ``function`` itself where TorchScript
    cannot compile it (it is deprecated in torch, and may go).

    The compiled function runs the same operations in the same order, so its results are identical
    (``tests/solve/test_parallel.py`` checks it).  ``function`` must be written in the TorchScript subset
    (annotated arguments, no closures) and is still an ordinary Python function.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation notice: the fallback below covers removal
            return torch.jit.script(function)
    except Exception:  # noqa: BLE001 - any failure to compile leaves the (identical) Python function
        return function


def call_compiled(function: Callable[..., T], *args) -> T:
    """``function(*args)`` for a function of :func:`without_gil`; on CPU tensors (the device of the first tensor
    argument) with the graph executor's optimisation off, in this thread, for the call.

    The optimising executor runs a compiled function's first calls with profiling, then builds a graph
    specialised to what it saw.  That pays where it fuses operations (CUDA).  On a CPU, where TorchScript fuses
    nothing by default, the same operations run in the same order either way, and those first calls cost some
    40 ms of each process: on a causal model, most of the solve of a selection of a few rows."""
    device = next((value.device for value in args if isinstance(value, torch.Tensor)), None)
    unoptimised = getattr(torch.jit, "optimized_execution", None)  # a torch without TorchScript has none
    if device is None or device.type != "cpu" or unoptimised is None:
        return function(*args)
    with unoptimised(False):
        return function(*args)


def run_all(jobs: list[Callable[[], T]], workers: int) -> list[T]:
    """``[job() for job in jobs]``, computed by ``workers`` threads of one intra-op thread each.

    With ``workers == 0``, or 1 when this thread already has one intra-op thread, the jobs run here, in
    order.  One worker for a caller with several intra-op threads (a memory budget that lets one piece
    run at a time) still runs the pieces in a worker, so that their operations use one thread each,
    like those of the other workers.  The workers compute with the caller's grad mode
    (``torch.no_grad`` is per thread).  An exception in a job, or in the waiting thread
    (a stop signal), cancels the jobs not yet started and propagates; a job already running finishes
    in its worker.
    """
    if workers <= 0 or (workers == 1 and torch.get_num_threads() == 1):
        return [job() for job in jobs]
    pool = _pools.get(workers)
    if pool is None:
        pool = _pools[workers] = ThreadPoolExecutor(
            workers, thread_name_prefix="probe-worker", initializer=_one_intra_op_thread
        )
    grad = torch.is_grad_enabled()  # thread-local in torch: the workers compute in the caller's mode

    def in_callers_mode(job):
        with torch.set_grad_enabled(grad):
            return job()

    futures = [pool.submit(in_callers_mode, job) for job in jobs]
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()


class Lane:
    """One background thread that runs jobs in the order they come, at most one at a time.

    The pipeline solves a batch's stacks here while the main thread runs the model on the next batch
    (the forward leaves the cores partly idle, most of all on short texts).  :meth:`submit` first waits
    for the job before it, so at most one job runs while the caller prepares the next: memory holds
    two stacks of problems, not more.  The lane's thread uses ``threads`` intra-op threads, like its
    caller.
    """

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="probe-lane", initializer=set_thread_count,
                                       initargs=(max(1, threads),))
        self.last = None

    def submit(self, job: Callable[[], T]) -> "Future[T]":
        if self.last is not None:
            self.last.result()  # the job before: done, or its error raised here
        grad = torch.is_grad_enabled()

        def in_callers_mode():
            with torch.set_grad_enabled(grad):
                return job()

        self.last = self.pool.submit(in_callers_mode)
        return self.last

    def close(self) -> None:
        """Cancel what has not started; a job already running finishes in its thread."""
        self.pool.shutdown(wait=False, cancel_futures=True)
