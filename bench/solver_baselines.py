"""The baselines of bench/solver.py: CVXPY and L-BFGS one problem at a time, the paper's gradient ascent, and
gradient ascent on probe's reduced form with the best safe constant step (module docstring of bench/solver.py)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from solver_problems import RTOL, _active, _sync, explicit

from probe.solve.dual import DualProblems, factor_gram
from probe.solve.reference import cvxpy_primal, gradient_ascent_dual, lbfgs_dual, relative_deviation


def time_one_at_a_time(name, family, picks, probe_rel, probe_lam, form, repeats):
    """Per-problem best-of-``repeats`` time of CVXPY or L-BFGS, single-threaded BLAS."""
    from threadpoolctl import threadpool_limits

    systems = [explicit(family, key, form) for key in picks]

    def solve(T, z, log_u, lam_norm):
        if name == "cvxpy":
            return cvxpy_primal(T, z, log_u, polish=False)[0]  # Clarabel's own answer and time
        # same certified accuracy as probe: alpha ||g||_2 <= alpha sqrt(d) ||g||_inf <= rtol ||lambda*||
        return lbfgs_dual(T, z, log_u, gtol=RTOL * lam_norm / math.sqrt(T.shape[1]))[0]

    times, worst, failures = [], 0.0, 0
    with threadpool_limits(1, user_api="blas"):
        solve(*systems[0], probe_lam[0])  # warm-up (imports, CVXPY's first compilation)
        for (T, z, log_u), rel, lam_norm in zip(systems, probe_rel, probe_lam):
            best, lam = math.inf, None
            for _ in range(repeats):
                start = time.perf_counter()
                try:
                    lam = solve(T, z, log_u, lam_norm)
                except Exception:  # noqa: BLE001 -- a failed solve is reported, not fatal
                    lam = None
                best = min(best, time.perf_counter() - start)
            times.append(best)
            if lam is None:
                failures += 1
                worst = math.inf
            else:
                worst = max(worst, abs(relative_deviation(lam, z, 1.0) - rel))
    return {
        "form": form,
        "subset": len(picks),
        "d": int(max(T.shape[1] for T, _, _ in systems)),
        "seconds_per_problem": float(np.mean(times)),
        "problems_per_s": 1.0 / float(np.mean(times)),
        "max_abs_diff_rel_deviation": worst,
        "failures": failures,
    }



def _padded_batch(systems):
    n = max(len(lu) for _, _, lu in systems)
    d = max(T.shape[1] for T, _, _ in systems)
    B = len(systems)
    T = torch.zeros(B, n, d, dtype=torch.float64)
    z = torch.zeros(B, d, dtype=torch.float64)
    log_u = torch.full((B, n), float("-inf"), dtype=torch.float64)  # padding keys are off the support
    for b, (t_b, z_b, lu_b) in enumerate(systems):
        T[b, : t_b.shape[0], : t_b.shape[1]] = torch.from_numpy(t_b)
        z[b, : z_b.shape[0]] = torch.from_numpy(z_b)
        log_u[b, : len(lu_b)] = torch.from_numpy(lu_b)
    return T, z, log_u



def time_reference_ascent(family, picks, probe_rel, form, max_iter, repeats):
    """``gradient_ascent_dual`` on the picked problems (CPU tensors: it keeps its counters there).

    Problems from calls with the same padded length form one batch (so that short problems are not
    padded to the longest); the time is the sum over batches of the best of ``repeats`` runs.
    """
    systems = [explicit(family, key, form) for key in picks]
    buckets = {}
    for b, (c, _, _) in enumerate(picks):
        buckets.setdefault(int(family.calls[c].logits.shape[-1]), []).append(b)
    T, z, log_u = _padded_batch(systems[:2])
    gradient_ascent_dual(T, z, log_u, 1.0, tol=RTOL, max_iter=10)  # warm-up
    elapsed = 0.0
    lam = np.zeros((len(picks), max(T.shape[1] for T, _, _ in systems)))
    iterations = np.zeros(len(picks), dtype=np.int64)
    for members in buckets.values():
        T, z, log_u = _padded_batch([systems[b] for b in members])
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            lam_b, its_b = gradient_ascent_dual(T, z, log_u, 1.0, tol=RTOL, max_iter=max_iter)
            best = min(best, time.perf_counter() - start)
        elapsed += best
        iterations[members] = its_b.numpy()
        for row, b in enumerate(members):
            lam[b, : systems[b][1].shape[0]] = lam_b[row, : systems[b][1].shape[0]].numpy()
    diffs = [
        abs(relative_deviation(lam[b, : z_b.shape[0]], z_b, 1.0) - probe_rel[b]) for b, (_, z_b, _) in enumerate(systems)
    ]
    return {
        "form": form,
        "subset": len(picks),
        "batches": len(buckets),
        "d": int(max(T_b.shape[1] for T_b, _, _ in systems)),
        "seconds": elapsed,
        "problems_per_s": len(picks) / elapsed,
        "mean_iterations": float(iterations.mean()),
        "max_iterations": int(iterations.max()),
        "iteration_cap": max_iter,
        "reached_tolerance": bool((iterations < max_iter).all()),
        "max_abs_diff_rel_deviation": float(max(diffs)),
    }, iterations



def _factor(gram):
    """A with A A^T = G from the eigendecomposition (``probe.solve.dual.factor_gram``, ``method="eigh"``) and its
    pseudo-inverse's transpose: the columns of A are q_j sqrt(w_j) (zero for dropped eigenvalues), orthogonal,
    so those of the latter are a_j / ||a_j||^2."""
    A = factor_gram(gram, method="eigh")
    sq = (A * A).sum(-2, keepdim=True)
    return A, torch.where(sq > 0, A / torch.where(sq > 0, sq, torch.ones_like(sq)), torch.zeros_like(A))



def _smoothness(gram, support, rule):
    """Per-problem global smoothness constant of LSE over the support (without the 1/alpha)."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)  # (g, n)
    if rule == "paper":  # max_i ||t_i||^2, as probe.solve.reference.gradient_ascent_dual
        return diag.unsqueeze(1).masked_fill(~support, 0.0).amax(-1)
    # exact: sup_p lambda_max(Cov_p(t)) = diam^2 / 4 over the support; supports are shared per group
    sq_dist = (diag.unsqueeze(-1) + diag.unsqueeze(-2) - 2 * gram).clamp_min(0)  # (g, n, n)
    out = torch.empty(support.shape[:2], dtype=gram.dtype, device=gram.device)
    for g in range(support.shape[0]):
        masks, inverse = torch.unique(support[g], dim=0, return_inverse=True)
        values = torch.stack([sq_dist[g][mask][:, mask].amax() if mask.any() else sq_dist.new_zeros(()) for mask in masks])
        out[g] = values[inverse] / 4
    return out



def grouped_ascent(problems: DualProblems, *, rule: str, tol: float, max_iter: int, time_cap: float):
    """Batched gradient ascent on (R-D) of probe.solve.dual: y <- y + h grad D(y), lambda = alpha z + V y.

    The iterates are those of gradient ascent on (D) from lambda_0 = alpha z (the reference's), computed
    in R^rank with the Gram factor shared by a group.  Stops a problem when alpha ||grad|| <= tol ||lambda||.
    """
    alpha = problems.alpha
    gram = problems.gram.to(torch.float64)
    logits = problems.logits.to(torch.float64)
    log_pref = problems.log_preference.to(torch.float64)
    zsq = problems.evidence_sqnorm.to(torch.float64)
    active = _active(problems)
    log_pref = torch.where(active.unsqueeze(-1), log_pref, torch.zeros_like(log_pref))
    log_pref = log_pref - torch.logsumexp(log_pref, -1, keepdim=True)
    support = torch.isfinite(log_pref)
    A, A_pinv = _factor(gram)
    u = log_pref.exp()
    base = log_pref + alpha * logits
    z_row = torch.bmm(logits, A_pinv)  # V^T z
    L = 1.0 / alpha + _smoothness(gram, support, rule)
    mu = 1.0 / alpha
    step = (1.0 / L if rule == "paper" else 2.0 / (mu + L)).unsqueeze(-1)
    y = torch.zeros_like(z_row)
    live = active.clone()
    iterations = torch.zeros(active.shape, dtype=torch.long, device=active.device)
    start = time.perf_counter()
    done = 0
    for done in range(1, max_iter + 1):
        p = torch.softmax(base + torch.bmm(y, A.transpose(1, 2)), dim=-1)
        grad = torch.bmm(u - p, A) - y / alpha
        lam_sq = (alpha * alpha * zsq + 2 * alpha * (z_row * y).sum(-1) + (y * y).sum(-1)).clamp_min(0)
        live = live & (alpha * grad.norm(dim=-1) > tol * lam_sq.sqrt())
        if not bool(live.any()):
            break
        y = torch.where(live.unsqueeze(-1), y + step * grad, y)
        iterations += live
        if done % 25 == 0 and time.perf_counter() - start > time_cap:
            break
    lam_sq = (alpha * alpha * zsq + 2 * alpha * (z_row * y).sum(-1) + (y * y).sum(-1)).clamp_min(0)
    rel = y.norm(dim=-1) / lam_sq.sqrt()
    return rel, iterations, live, active



def time_grouped_ascent(family, device, index, probe_rel, rule, max_iter, time_cap, repeats):
    for p in family.calls[:1]:
        grouped_ascent(p, rule=rule, tol=RTOL, max_iter=3, time_cap=time_cap)  # warm-up
    elapsed = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        results = [grouped_ascent(p, rule=rule, tol=RTOL, max_iter=max_iter, time_cap=time_cap) for p in family.calls]
        _sync(device)
        elapsed = min(elapsed, time.perf_counter() - start)
    results = [tuple(x.cpu() for x in r) for r in results]
    rel = np.array([results[c][0][g, j].item() for c, g, j in index])
    its = np.array([int(results[c][1][g, j]) for c, g, j in index])
    unfinished = sum(int((r[2] & r[3]).sum()) for r in results)
    return {
        "form": "reduced, Gram shared per group",
        "step": "1/L, L = 1/alpha + max ||t_i||^2" if rule == "paper" else "2/(mu+L), L = 1/alpha + diam^2/4",
        "subset": len(index),
        "seconds": elapsed,
        "problems_per_s": len(index) / elapsed,
        "mean_iterations": float(its.mean()),
        "max_iterations": int(its.max()),
        "iteration_cap": max_iter,
        "reached_tolerance": unfinished == 0,
        "unfinished": unfinished,
        "max_abs_diff_rel_deviation": float(np.max(np.abs(rel - probe_rel))),
    }, its
