"""Throughput of the certified OT solver (probe.solve.ot.ot_posterior) on OT-ViT-sized problems.

Problems shaped like the OT-ViT's final layer (class-token query of one head against one image):
``n = 50`` sources (49 patches of a 28x28 image at patch 4x4, and the class token), ``N = 50``
candidates (test time: the input's own templates) or ``N = 100`` (training: also another image's),
``d = 32`` or ``64`` per head.  Sources and candidates have i.i.d. N(0, 1) coordinates (the first 50
candidates *are* the sources), the evidence ``z ~ N(0, I_d)``, the cost ``M(a, b) = -<a, b> + C`` with
``C`` the batch's largest inner product (the OT-ViT's cost; ``M >= 0``), uniform source weights,
``alpha = 1`` and ``gamma = 16 = sqrt(256)`` (the model's setting) and the harder ``gamma = 1``.
Each configuration is one batch of ``--batch`` problems (default 2048), solved once (float64, rtol
1e-9) after a small warm-up, with ``--threads`` torch threads (default 1: the machine is shared).
Reported: problems/s, the fraction certified, Newton iterations, and the ratio of the solve's time to
the closed form eq. (22) (``ot_attention`` on the same batch in float64) measured in the same run.

    python bench/ot.py            # about 2 minutes on one core: bench/results_ot.json and .md
    python bench/ot.py --quick    # smoke run (a few seconds)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

from probe.solve.ot import ot_attention, ot_posterior  # noqa: E402


def problems(batch: int, N: int, n: int, d: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    sources = torch.randn(batch, n, d, generator=generator, dtype=torch.float64)
    extra = torch.randn(batch, N - n, d, generator=generator, dtype=torch.float64) if N > n else sources[:, :0]
    candidates = torch.cat([sources, extra], dim=1)[:, :N]
    inner = sources @ candidates.transpose(1, 2)  # (batch, n, N)
    cost = inner.amax() - inner  # M(a, b) = -<a, b> + C >= 0
    weights = torch.full((batch, n), 1.0 / n, dtype=torch.float64)
    evidence = torch.randn(batch, d, generator=generator, dtype=torch.float64)
    return candidates, weights, cost, evidence


def run(config, threads: int):
    torch.set_num_threads(threads)
    args = problems(config["batch"], config["N"], config["n"], config["d"], seed=config["N"] * 1000 + config["d"])
    alpha, gamma = config["alpha"], config["gamma"]
    warm = [a[:16] for a in args]
    ot_posterior(*warm, alpha, gamma)
    ot_attention(*warm, alpha, gamma)
    start = time.perf_counter()
    closed = ot_attention(*args, alpha, gamma)
    closed_s = time.perf_counter() - start
    start = time.perf_counter()
    sol = ot_posterior(*args, alpha, gamma)
    solve_s = time.perf_counter() - start
    tv = 0.5 * (sol.p - closed).abs().sum(-1)
    return {
        **config,
        "threads": threads,
        "solve_s": round(solve_s, 4),
        "problems_per_s": round(config["batch"] / solve_s, 1),
        "closed_form_s": round(closed_s, 5),
        "ratio_solve_to_closed_form": round(solve_s / closed_s, 1),
        "converged_fraction": float(sol.converged.double().mean()),
        "iterations_mean": round(float(sol.iterations.double().mean()), 2),
        "iterations_max": int(sol.iterations.max()),
        "max_error_bound_over_lambda_norm": float((sol.error_bound / sol.lambda_norm).max()),
        "rel_deviation_median": float(sol.rel_deviation.median()),
        "tv_to_eq22_median": float(tv.median()),
    }


def markdown(results) -> str:
    lines = [
        "# OT solver throughput (bench/ot.py)",
        "",
        common.header(results) + f" One run; batch of {results['rows'][0]['batch']} problems per row, float64, rtol "
        "1e-9, alpha = 1.",
        "",
        "| N | n | d | gamma | problems/s | certified | Newton its (mean / max) | solve / eq. 22 time | "
        "max bound / norm lambda | median rel. deviation | median TV(p*, eq. 22) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['N']} | {r['n']} | {r['d']} | {r['gamma']:g} | {r['problems_per_s']:,.0f} | "
            f"{r['converged_fraction']:.3f} | {r['iterations_mean']:.1f} / {r['iterations_max']} | "
            f"{r['ratio_solve_to_closed_form']:.0f}x | {r['max_error_bound_over_lambda_norm']:.1e} | "
            f"{r['rel_deviation_median']:.3g} | {r['tv_to_eq22_median']:.3g} |"
        )
    lines += ["", __doc__.split("\n\n")[1].replace("\n", " ")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = common.parser(__doc__, "results_ot.json", quick="64 problems per row, one row per size")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    torch.set_num_threads(args.threads)
    env = common.environment()
    batch = 64 if args.quick else args.batch
    gammas = (16.0,) if args.quick else (16.0, 1.0)
    configs = [dict(batch=batch, N=N, n=50, d=d, alpha=1.0, gamma=g) for g in gammas for N in (50, 100) for d in (32, 64)]
    results = {"environment": env, "rows": []}
    for config in configs:
        row = run(config, args.threads)
        print(json.dumps(row), flush=True)
        results["rows"].append(row)
    common.write_results(args.out, results, markdown, indent=1, echo=False, benchmark="ot")


if __name__ == "__main__":
    main()
