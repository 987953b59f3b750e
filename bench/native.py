"""The solver's Newton iterations in compiled C (``probe.solve.native``) against its torch loops.

The problems of real MiniLM batches (the embedded corpus's texts joined to exactly ``--tokens`` tokens,
hidden space, alpha 1, every layer stacked as ``probe run`` stacks them), captured once, are solved in
one process by ``probe.solve.dual.solve_dual`` four ways, alternating:

* **torch loops** and **compiled**, each on 1 thread and side by side on all workers (the default).

Both ways compute the state and the certificate of the final iterates in torch, and both must certify
every problem; the answers must agree within their certificates (checked here, with the largest
difference in ``rel_deviation``), and the Newton iteration counts show that it is the same method.

    python bench/native.py        # bench/results_native.{json,md}
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402


def main(argv=None):
    parser = common.parser(__doc__, "results_native.json", repeats=3)
    parser.add_argument("--tokens", default="16,128,512", help="comma-separated text lengths")
    parser.add_argument("--texts", type=int, default=8, help="texts per batch (at 512 tokens: a quarter)")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the probe command sets it
    import runs
    import torch
    from parallel import captured_problems

    from probe.capture.loading import load_model
    from probe.solve import native
    from probe.solve.dual import solve_dual

    if not native.available():
        raise SystemExit(f"the compiled kernel is not available here: {native.unavailable_reason()}")
    env = common.environment()
    kernel = native._state["kernel"]
    cores = torch.get_num_threads()
    loaded = load_model(runs.minilm_path(), device="cpu")
    results = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        count = max(2, args.texts // 4) if tokens >= 512 else args.texts
        problems = captured_problems(loaded, tokens, count)
        ways = {  # name: (intra-op threads, workers, compiled)
            "torch loops, 1 thread": (1, 1, False),
            "compiled, 1 thread": (1, 1, True),
            f"torch loops, {cores} workers": (cores, cores, False),
            f"compiled, {cores} workers": (cores, cores, True),
        }
        seconds = {name: [] for name in ways}
        answers = {}
        solve_dual(problems)  # warm-up (and the kernel's build, if it was not cached)
        for _ in range(args.repeats):
            for name, (threads, workers, compiled) in ways.items():
                torch.set_num_threads(threads)
                native._state["kernel"] = kernel if compiled else None
                started = time.perf_counter()
                answers[name] = solve_dual(problems, workers=workers)
                seconds[name].append(time.perf_counter() - started)
        torch.set_num_threads(cores)
        native._state["kernel"] = kernel
        active = problems.active
        loops, compiled = answers[f"torch loops, {cores} workers"], answers[f"compiled, {cores} workers"]
        difference = (loops.rel_deviation - compiled.rel_deviation).abs()
        allowed = 2 * (loops.error_bound / loops.lambda_norm + compiled.error_bound / compiled.lambda_norm) + 1e-15
        row = {
            "tokens": tokens, "texts": count, "problems": int(active.sum()),
            "seconds": seconds, "median_s": {name: statistics.median(s) for name, s in seconds.items()},
            "all_certified": {name: bool(a.converged[active].all()) for name, a in answers.items()},
            "within_certificates": bool((difference <= allowed)[active].all()),
            "max_rel_deviation_difference": float(difference[active].max()),
            "mean_iterations": {
                "torch loops": float(loops.iterations[active].float().mean()),
                "compiled": float(compiled.iterations[active].float().mean()),
            },
        }
        results.append(row)
        print(tokens, {name: round(s, 3) for name, s in row["median_s"].items()}, row["within_certificates"], flush=True)
    common.write_results(args.out, {"environment": env, "repeats": args.repeats, "results": results}, markdown,
                         benchmark="native")


def markdown(out: dict) -> str:
    results = out["results"]
    repeats = out.get("repeats", 3)
    names = list(results[0]["median_s"])
    lines = [
        "# The solver's Newton iterations: compiled C against the torch loops",
        "",
        common.header(out) + " `solve_dual` on the captured problems of real MiniLM batches (hidden space, alpha 1, "
        f"every layer); seconds, median of {repeats}, the ways alternating in one process. "
        "*speed-up*: torch loops' time / compiled time.",
        "",
        "| tokens per text | texts | problems | " + " | ".join(names)
        + " | speed-up, 1 thread | speed-up, side by side | every problem certified | answers | "
        "Newton iterations (torch loops / compiled) |",
        "|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|",
    ]
    for row in results:
        median = row["median_s"]
        iterations = row["mean_iterations"]
        lines.append(
            f"| {row['tokens']} | {row['texts']} | {row['problems']:,} | "
            + " | ".join(f"{median[name]:.2f}" for name in names)
            + f" | {median[names[0]] / median[names[1]]:.2f}x | {median[names[2]] / median[names[3]]:.2f}x | "
            + ("yes" if all(row["all_certified"].values()) else "**no**") + " | "
            + (f"within the certificates (largest difference {row['max_rel_deviation_difference']:.1e})"
               if row["within_certificates"] else "**differ**")
            + f" | {iterations['torch loops']:.3f} / {iterations['compiled']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
