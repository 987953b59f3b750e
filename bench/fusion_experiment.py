"""Experiment (evidence for a solver change; not used by probe): fuse the elementwise work of a CG step.

One step of ``probe.solver._conjugate_gradient`` (``probe.solver._cg_step``, with ``_Group.hessian_times``)
is two batched products plus about twenty elementwise/reduction kernels over ``(groups, m, n)`` tensors,
each a separate pass through memory.  This times the solver's own step eagerly and under
``torch.compile`` (Inductor fuses the elementwise kernels), next to the two ``bmm`` alone (the floor).
The Newton direction is float64 here, as in the measurements quoted in ``NOTES.md`` (the solver's
default is float32; the ratios are similar).

    python bench/fusion_experiment.py        # needs a C++ compiler for Inductor on CPU
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from probe.solver import _cg_step, _Group  # noqa: E402


def best(f, repeats=20):
    f()
    f()
    out = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - start)
    return out


def main():
    torch.manual_seed(0)
    compiled = torch.compile(_cg_step, dynamic=False)
    print("| tile (groups, m, n) | eager step (ms) | compiled step (ms) | speedup | 2 bmm alone (ms) |")
    print("|---|---|---|---|---|")
    for g, m, n in [(48, 192, 16), (8, 300, 25), (12, 768, 64), (6, 1536, 128), (2, 1536, 512)]:
        r_dim = min(n, 384)
        f64 = torch.float64
        A = torch.randn(g, n, r_dim, dtype=f64) / 4
        logits = torch.randn(g, m, n, dtype=f64)
        log_pref = torch.full((g, m, n), -torch.log(torch.tensor(float(n), dtype=f64)).item(), dtype=f64)
        group = _Group(A, logits, log_pref, 1.0, f64)
        p = torch.softmax(logits, -1)
        d = torch.randn(g, m, r_dim, dtype=f64)
        args = (group, p, torch.full_like(d, 2.0), torch.zeros(g, m, dtype=f64),
                torch.zeros_like(d), d.clone(), d, (d * d).sum(-1), torch.ones(g, m, dtype=torch.bool))
        eager = best(lambda: _cg_step(*args))
        fused = best(lambda: compiled(*args))
        floor = best(lambda: torch.bmm(torch.bmm(d, A.transpose(1, 2)), A))
        print(f"| ({g}, {m}, {n}) | {1e3 * eager:.2f} | {1e3 * fused:.2f} | {eager / fused:.2f}x | {1e3 * floor:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
