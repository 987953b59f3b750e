"""How the solver should use a CPU's cores: each operation on all threads, or tiles side by side.

The problems of real MiniLM batches (the embedded corpus's texts joined to exactly ``--tokens``
tokens, hidden space, alpha 1), captured once, are solved in one process, alternating, by
``probe.solve.dual.solve_dual`` in three ways:

* **intra-op, W threads**: tiles one after another, each operation spread over torch's W intra-op
  threads (``workers=0``; how the solver ran before ``probe.solve.parallel``);
* **1 thread**: the same on one thread;
* **side by side, W workers**: W tiles at a time, each in a worker thread whose operations use one
  intra-op thread (``probe.solve.parallel``; the default since), with the solver's loops compiled by
  TorchScript, which runs them without the GIL (``probe.solve.parallel.without_gil``; the default);
* **side by side, Python loops**: the same with those loops run as the Python functions they are
  compiled from (how the solver ran before), so the workers take turns for the GIL between operations.

All four run the solver's torch loops: the compiled C kernel that replaces them where it can be built
(``probe.solve.native``) is turned off here, and compared with them by ``bench/native.py``.

``OMP_WAIT_POLICY`` is what the ``probe`` command sets (PASSIVE) unless the environment says otherwise;
``--wait-policy active`` measures OpenMP's spinning default instead (a separate run: the policy is read
when torch starts).  Side by side and on one thread, every operation runs on one thread, and the answers
are bitwise identical (checked here); spread over intra-op threads, a product may be split differently
and round differently, within the certificates (checked here).  The Python loops give bitwise the
answers of the compiled ones (checked here).

    python bench/parallel.py                     # bench/results_parallel.{json,md}
    python bench/parallel.py --wait-policy active --out bench/results_parallel_active.json
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
    parser = common.parser(__doc__, "results_parallel.json", repeats=3)
    parser.add_argument("--tokens", default="16,128,512", help="comma-separated text lengths")
    parser.add_argument("--texts", type=int, default=8, help="texts per batch (at 512 tokens: a quarter)")
    parser.add_argument("--wait-policy", choices=("passive", "active"), default="passive")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    if args.wait_policy == "passive":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)
    import runs
    import torch

    from probe.capture.loading import load_model
    from probe.solve import native, newton_cg
    from probe.solve.dual import solve_dual

    env = common.environment()
    # the loops are called from probe.solve.newton_cg: there the Python ones stand in for the compiled ones
    compiled = {name: getattr(newton_cg, name) for name in newton_cg.COMPILED_LOOPS}
    python = {name: getattr(newton_cg, source) for name, source in newton_cg.COMPILED_LOOPS.items()}

    native._state.update(kernel=None, reason="bench/parallel.py measures the torch loops")
    cores = torch.get_num_threads()
    loaded = load_model(runs.minilm_path(), device="cpu")
    results = []
    for tokens in (int(x) for x in args.tokens.split(",")):
        count = max(2, args.texts // 4) if tokens >= 512 else args.texts
        problems = captured_problems(loaded, tokens, count)
        ways = {
            f"intra-op, {cores} threads": (cores, 0, compiled),
            "1 thread": (1, 1, compiled),
            f"side by side, {cores} workers": (cores, cores, compiled),
            "side by side, Python loops": (cores, cores, python),
        }
        seconds = {name: [] for name in ways}
        answers = {}
        solve_dual(problems, workers=0)  # warm-up
        for _ in range(args.repeats):
            for name, (threads, workers, loops) in ways.items():
                torch.set_num_threads(threads)
                for loop, function in loops.items():
                    setattr(newton_cg, loop, function)
                started = time.perf_counter()
                answers[name] = solve_dual(problems, workers=workers)
                seconds[name].append(time.perf_counter() - started)
        torch.set_num_threads(cores)
        for loop, function in compiled.items():
            setattr(newton_cg, loop, function)
        def same(a, b):
            return all(torch.equal(torch.nan_to_num(getattr(a, k), nan=-1.0), torch.nan_to_num(getattr(b, k), nan=-1.0))
                       for k in vars(a))

        intra, single, side, side_python = (answers[name] for name in ways)
        identical = same(single, side) and same(side, side_python)  # one thread per operation: bitwise the same
        intra_identical = same(intra, single)  # several intra-op threads may split a product differently
        certified = bool((((intra.rel_deviation - single.rel_deviation).abs()
                           <= 2 * (intra.error_bound / intra.lambda_norm + single.error_bound / single.lambda_norm) + 1e-15)
                          | ~problems.active).all())
        row = {
            "tokens": tokens, "texts": count, "problems": int(problems.active.sum()),
            "seconds": seconds, "median_s": {name: statistics.median(s) for name, s in seconds.items()},
            "side_by_side_bitwise_identical_to_1_thread": identical,
            "intra_op_bitwise_identical_to_1_thread": intra_identical,
            "intra_op_within_certificates_of_1_thread": certified,
        }
        results.append(row)
        print(tokens, {name: round(s, 2) for name, s in row["median_s"].items()}, identical, intra_identical, certified,
              flush=True)
    common.write_results(args.out, {"environment": env, "repeats": args.repeats, "results": results}, markdown,
                         benchmark="parallel")


def captured_problems(loaded, tokens: int, count: int):
    """The dual problems (hidden space, alpha 1) of one batch of ``count`` MiniLM texts of ``tokens``
    tokens, every layer stacked as ``probe run`` stacks them, with their Gram factors."""
    import runs
    import torch

    from probe.batch.problems import dual_problems, stacked_problems
    from probe.capture.adapters.base import space_problems
    from probe.solve.dual import factor_gram

    texts = runs.texts_of_length(loaded.tokenizer, tokens, count)
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, None, tokens)
    sites = []
    with torch.no_grad():
        loaded.adapter.capture(loaded.model, inputs, sites.append)
    duals = []
    for site in sites:
        built = space_problems(site, "hidden")
        dual = dual_problems(site, built, 1.0)
        dual.factor = factor_gram(built.gram.reshape(-1, *built.gram.shape[-2:]))
        duals.append(dual)
    return stacked_problems(duals)


def markdown(out: dict) -> str:
    results = out["results"]
    repeats = out.get("repeats", 3)
    names = list(results[0]["median_s"])
    lines = [
        "# The solver on a CPU's cores: each operation on every thread, or tiles side by side",
        "",
        common.header(out) + " `solve_dual` on the captured problems of real MiniLM batches (hidden space, alpha 1); "
        f"seconds, median of {repeats}, the ways alternating in one process.",
        "",
        "| tokens per text | texts | problems | " + " | ".join(names)
        + " | intra-op time / side by side time | Python loops time / compiled time | side by side = 1 thread "
        "| intra-op = 1 thread |",
        "|---|---|---|" + "---|" * len(names) + "---|---|---|---|",
    ]
    for row in results:
        median = row["median_s"]
        lines.append(
            f"| {row['tokens']} | {row['texts']} | {row['problems']:,} | "
            + " | ".join(f"{median[name]:.2f}" for name in names)
            + f" | {median[names[0]] / median[names[2]]:.1f}x | "
            + (f"{median[names[3]] / median[names[2]]:.2f}x | " if len(names) > 3 else "– | ")
            + ("bitwise" if row["side_by_side_bitwise_identical_to_1_thread"] else "**differ**") + " | "
            + ("bitwise" if row["intra_op_bitwise_identical_to_1_thread"] else
               "within the certificates" if row["intra_op_within_certificates_of_1_thread"] else "**differ**") + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
