"""Experiment (evidence for a solver choice; not used by probe): the CG loop of the Newton directions, run
four ways, on one thread and on two threads side by side.

``probe.solve.newton_cg.conjugate_gradient_python`` runs a fixed number of CG steps (``forcing`` 0, so no row stops
early) on random problems of the solver's tile shapes, in float32 like the Newton directions:

* **python**: the function as written, each operation dispatched from Python;
* **torchscript**: ``probe.solve.newton_cg.conjugate_gradient``, the same function compiled by TorchScript
  (what the solver runs; its interpreter releases the GIL);
* **inductor**: ``torch.compile`` of one CG step (Inductor fuses the elementwise kernels into C++ loops;
  the loop's data-dependent stop stays in Python);
* **2 bmm**: the two products of each step alone, the floor of any fusion.

"2 threads" runs two copies at once, each in a thread with one intra-op thread, as the solver's workers
do; its column is the throughput against one copy on one thread (2.0x: the two threads never wait for
each other).

    python bench/fusion_experiment.py > bench/results_fusion.md     # Inductor needs a C++ compiler
    python bench/fusion_experiment.py --quick    # the smallest tile, without Inductor (the tests run this)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the probe command sets it (cli.py), before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from probe.solve import newton_cg

STEPS = 10
SHAPES = [(48, 192, 16, 16), (1, 768, 128, 128), (1, 192, 512, 384)]  # (groups, m, n, r): corpus, 128, 512 tokens


def problem(g, m, n, r):
    generator = torch.Generator().manual_seed(0)
    factor = torch.randn(g, n, r, generator=generator) / r**0.5
    p = torch.softmax(2 * torch.randn(g, m, n, generator=generator), -1)
    rhs = torch.randn(g, m, r, generator=generator)
    return factor, p, rhs


def cg_step(factor, p, x, r, d, rz):
    """One step of ``_conjugate_gradient_steps`` (no preconditioner, every row running)."""
    Hd = newton_cg.hessian_times(factor, 1.0, p, d)
    step = (rz / torch.linalg.vecdot(d, Hd)).unsqueeze(-1)
    x = x + step * d
    r = r - step * Hd
    rz_new = torch.linalg.vecdot(r, r)
    d = r + (rz_new / rz).unsqueeze(-1) * d
    return x, r, d, rz_new


def ways(factor, p, rhs, inductor=True):
    g, m, _ = p.shape
    zero, live = torch.zeros(g, m), torch.ones(g, m, dtype=torch.bool)
    compiled_step = torch.compile(cg_step, dynamic=False) if inductor else None

    def python():
        newton_cg.conjugate_gradient_python(factor, 1.0, p, rhs.clone(), zero, STEPS, live)

    def torchscript():
        newton_cg.conjugate_gradient(factor, 1.0, p, rhs.clone(), zero, STEPS, live)

    def inductor():
        x, r, d = torch.zeros_like(rhs), rhs.clone(), rhs.clone()
        rz = torch.linalg.vecdot(r, r)
        for _ in range(STEPS):
            x, r, d, rz = compiled_step(factor, p, x, r, d, rz)

    def products():
        for _ in range(STEPS):
            torch.bmm(torch.bmm(rhs, factor.transpose(1, 2)), factor)

    out = {"python": python, "torchscript": torchscript, "inductor": inductor, "2 bmm": products}
    return out if compiled_step is not None else {name: way for name, way in out.items() if name != "inductor"}


def repeated(function, calls):
    def many():
        for _ in range(calls):
            function()

    return many


def best(function, repeats=5):
    function()
    out = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        out = min(out, time.perf_counter() - start)
    return out


def side_by_side(function, repeats=5):
    """Best time of two copies of ``function`` at once, each in a thread with one intra-op thread."""

    def worker(barrier):
        torch.set_num_threads(1)
        barrier.wait()
        function()

    out = float("inf")
    for _ in range(repeats):
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=worker, args=(barrier,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        out = min(out, time.perf_counter() - start)
    return out


def main(argv=None):
    parser = common.parser(__doc__, quick="the smallest tile, without Inductor")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("# The CG loop four ways, on one thread and on two side by side (`bench/fusion_experiment.py`)")
    print()
    print(common.header({"benchmark": "fusion_experiment", "environment": common.environment()}))
    print()
    timing = "one call each" if args.quick else "best of 5 runs of about 50 ms"
    print(f"{STEPS} CG steps, float32, torch {torch.__version__}; ms per call ({timing}), and the throughput of two "
          "threads side by side against one")
    print()
    print("| tile (groups, m, n, r) | way | 1 thread (ms) | 2 threads side by side (ms) | throughput on 2 threads |")
    print("|---|---|---|---|---|")
    for shape in SHAPES[:1] if args.quick else SHAPES:
        for name, function in ways(*problem(*shape), inductor=not args.quick).items():
            calls = 1 if args.quick else max(1, round(0.05 / best(function, 1)))  # about 50 ms: starting threads is noise
            one = best(repeated(function, calls)) / calls
            two = side_by_side(repeated(function, calls)) / calls
            print(f"| {shape} | {name} | {1e3 * one:.2f} | {1e3 * two:.2f} | {2 * one / two:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
