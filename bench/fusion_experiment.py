"""Experiment (evidence for a solver change; not used by probe): fuse the elementwise work of a CG step.

One step of ``probe.solver._conjugate_gradient`` (with ``_Group.hessian_times``) is two ``bmm`` plus about
twenty elementwise/reduction kernels over ``(groups, m, n)`` tensors, each a separate pass through memory.
This times that step eagerly and under ``torch.compile`` (Inductor fuses the elementwise kernels), next to
the two ``bmm`` alone (the floor).  The step below is the solver's CG step as it was in float64 (the
solver now runs it in float32, with ``baddbmm`` for the second product; the ratios are similar).

    python bench/fusion_experiment.py        # needs a C++ compiler for Inductor on CPU
"""

from __future__ import annotations

import time

import torch


def cg_step(A, p, alpha, d, x, r, rz, precond, running, target):
    w = torch.bmm(d, A.transpose(1, 2))  # hessian_times
    sigma_w = p * (w - (p * w).sum(-1, keepdim=True))
    hd = d / alpha + torch.bmm(sigma_w, A)
    curvature = (d * hd).sum(-1)  # the CG update
    step = torch.where(running, rz / torch.where(curvature > 0, curvature, 1.0), 0.0)
    x = x + step.unsqueeze(-1) * d
    r = r - step.unsqueeze(-1) * hd
    z = r / precond
    rz_new = (r * z).sum(-1)
    beta = torch.where(running, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)
    d = torch.where(running.unsqueeze(-1), z + beta.unsqueeze(-1) * d, d)
    rz = torch.where(running, rz_new, rz)
    running = running & ((r * r).sum(-1) > target)
    return d, x, r, rz, running


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
    compiled = torch.compile(cg_step, dynamic=False)
    print("| tile (groups, m, n) | eager step (ms) | compiled step (ms) | speedup | 2 bmm alone (ms) |")
    print("|---|---|---|---|---|")
    for g, m, n in [(48, 192, 16), (8, 300, 25), (12, 768, 64), (6, 1536, 128), (2, 1536, 512)]:
        r_dim = min(n, 384)
        f64 = torch.float64
        A = torch.randn(g, n, r_dim, dtype=f64) / 4
        p = torch.softmax(torch.randn(g, m, n, dtype=f64), -1)
        d = torch.randn(g, m, r_dim, dtype=f64)
        args = (A, p, 1.0, d, torch.zeros_like(d), d.clone(), (d * d).sum(-1), torch.full_like(d, 2.0),
                torch.ones(g, m, dtype=torch.bool), torch.zeros(g, m, dtype=f64))
        eager = best(lambda: cg_step(*args))
        fused = best(lambda: compiled(*args))
        floor = best(lambda: torch.bmm(torch.bmm(d, A.transpose(1, 2)), A))
        print(f"| ({g}, {m}, {n}) | {1e3 * eager:.2f} | {1e3 * fused:.2f} | {eager / fused:.2f}x | {1e3 * floor:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
