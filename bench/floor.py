"""How far the CPU solve is from half the baseline's time, and what that target leaves for each stage: the
run on one thread, with the Newton kernel's seconds told apart and its counted products priced at this
machine's own BLAS rate for the kernel's shapes.

For each text length (``--tokens``, default 128 and 512; the texts of ``bench/speedup.py``), the real
all-MiniLM-L6-v2 is analysed on one thread with the baseline's probe (a git worktree of ``--baseline``, default
66d896f) and with this checkout's, alternating, each run a child process of its own (on one thread nothing runs
beside the model: no lane of ``probe.solve.parallel``, so every second of the kernel is on the run's path).  The
current child also
times every call of the compiled Newton kernel (``probe.solve.native.newton_tile``), takes the kernel's own
count of its float32 and float64 products (``probe.solve.native.FLOPS``), times the plain eager forward over
the same batches, and measures ``torch.mm``'s rate on one thread for the kernel's products (a block of 256 rows
against the ``n x r`` factor, both ways round, ``r = min(n, 384)``; the faster of the two in each precision).

From these, per length (medians over the repeats):

* *kernel at the BLAS rate*: the counted products at that rate, nothing else (no exponentials, no line
  searches, no reductions): a lower bound on any kernel that makes the method's products;
* *floor*: this checkout's processing time with the kernel replaced by that bound;
* *rest*: the processing time less the kernel and the plain forward (capture, building and factoring the
  problems, the derived quantities, the rows and their files);
* *what the target leaves for the rest*: half the baseline's time, less the forward and the kernel at the
  BLAS rate, as a fraction of the rest today.

    python bench/floor.py                 # bench/results_floor.{json,md}
    python bench/floor.py --quick         # 128 tokens, 8 texts, one repeat
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runs  # noqa: E402

if runs.child_setup(sys.argv) is None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402
import speedup  # noqa: E402

WAYS = speedup.WAYS
TEXTS = {128: 64, 512: 8}
WIDTH = 384  # MiniLM's hidden size: the factor's width r = min(n, 384)


def blas_rates(n: int, r: int, rows: int = 256) -> dict:
    """``torch.mm``'s flops per second on this thread for the kernel's two products of a block of ``rows``
    with the ``n x r`` factor, per precision: the faster of the two shapes."""
    import torch

    rates = {}
    for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        best = 0.0
        for left, right in (((rows, r), (r, n)), ((rows, n), (n, r))):
            a, b = torch.randn(*left, dtype=dtype), torch.randn(*right, dtype=dtype)
            out = torch.empty(left[0], right[1], dtype=dtype)
            for _ in range(3):
                torch.mm(a, b, out=out)
            repeats = max(5, int(1e9 / (2 * left[0] * left[1] * right[1])))
            started = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, b, out=out)
            best = max(best, 2 * left[0] * left[1] * right[1] * repeats / (time.perf_counter() - started))
        rates[name] = best
    return rates


def child_main(spec: dict) -> None:
    """One run on one thread; this checkout's also times the kernel and the forward, and the BLAS rates."""
    import json

    import torch

    torch.set_num_threads(1)
    texts = json.loads(Path(spec["texts_file"]).read_text())
    workdir = Path(spec["workdir"])
    config = runs.run_config(spec["model"], texts, spec["tokens"], 8, workdir, threads=1)
    result = {}
    kernel = [0.0]
    if spec["way"] == WAYS[1]:
        from probe.capture.loading import load_model
        from probe.solve import native

        loaded = load_model(spec["model"], device="cpu")
        batches = runs.forward_batches(loaded, config, texts)
        runs.forward_seconds(loaded.model, batches[:1])  # warm-up
        result["forward_s"] = runs.forward_seconds(loaded.model, batches)
        result["n"] = int(batches[0]["input_ids"].shape[1])
        del loaded
        solve = native.newton_tile
        counted = {"float32": 0.0, "float64": 0.0}  # the Newton kernel's own (FLOPS also counts other compiled code)

        def timed_tile(*args, **kwargs):
            before, started = dict(native.FLOPS), time.perf_counter()
            try:
                return solve(*args, **kwargs)
            finally:
                kernel[0] += time.perf_counter() - started
                for precision in counted:
                    counted[precision] += native.FLOPS[precision] - before[precision]

        native.newton_tile = timed_tile
    result.update(runs.analysis(config))
    if spec["way"] == WAYS[1]:
        result["kernel_s"] = kernel[0]
        result["kernel_flops"] = counted
        result["rates"] = blas_rates(result["n"], min(result["n"], WIDTH))
    runs.child_result(result)


def measure_length(tokens: int, count: int, roots: dict, repeats: int, workdir: Path, model: str) -> dict:
    import json

    from transformers import AutoTokenizer

    texts_file = workdir / f"texts-{tokens}.json"
    texts_file.write_text(json.dumps(runs.texts_of_length(AutoTokenizer.from_pretrained(model), tokens, count)))

    def run(way):
        folder = workdir / f"{tokens}-{way.replace(' ', '-')}"
        folder.mkdir(exist_ok=True)
        spec = {"model": model, "tokens": tokens, "texts_file": str(texts_file), "workdir": str(folder), "way": way}
        return runs.run_child("floor", spec, root=roots[way])

    measured = common.alternate({way: (lambda way=way: run(way)) for way in WAYS}, repeats, measure=lambda f: f())
    old, new = measured[WAYS[0]], measured[WAYS[1]]
    kernel_at_rate = [sum(r["kernel_flops"][p] / r["rates"][p] for p in ("float32", "float64")) for r in new]
    med = statistics.median
    row = {
        "tokens": tokens, "texts": count, "repeats": repeats, "runs": measured, "rows": new[0]["rows"],
        "baseline_s": med([r["seconds"] for r in old]), "current_s": med([r["seconds"] for r in new]),
        "ratios": [b["seconds"] / a["seconds"] for a, b in zip(old, new)],
        "forward_s": med([r["forward_s"] for r in new]), "kernel_s": med([r["kernel_s"] for r in new]),
        "kernel_at_rate_s": med(kernel_at_rate),
        "floor_s": med([r["seconds"] - r["kernel_s"] + k for r, k in zip(new, kernel_at_rate)]),
        "rest_s": med([r["seconds"] - r["kernel_s"] - r["forward_s"] for r in new]),
        "kernel_flops": new[-1]["kernel_flops"], "rates": new[-1]["rates"],
        "all_certified": all(r["not_converged"] == 0 for r in old + new),
    }
    row["ratio"] = med(row["ratios"])
    row["floor_ratio"] = row["floor_s"] / row["baseline_s"]
    row["left_for_rest_s"] = 0.5 * row["baseline_s"] - row["forward_s"] - row["kernel_at_rate_s"]
    return row


def markdown(results: dict) -> str:
    return "\n".join([
        "# Half the baseline's time on a CPU: what it leaves for each stage",
        "",
        common.header(results),
        "",
        f"Baseline: commit `{results['baseline']}`; *this checkout*: `{results.get('current_commit', '?')}`. The real "
        "all-MiniLM-L6-v2, texts of exactly L tokens, batches of 8, **one thread**, each run a child process, the two "
        "alternating; medians over the repeats. *processing*: the manifest's `total_s - load_model_s - "
        "load_data_s`. *kernel*: the seconds inside the compiled Newton kernel; *at the BLAS rate*: its own count of "
        "its products (float32 + float64) priced at `torch.mm`'s rate on this thread for the same shapes (rates in "
        "GFLOP/s), with nothing else, and the kernel's seconds over that. *floor*: the processing time with the kernel at that bound. *rest*: the "
        "processing time less the kernel and the plain forward. *left for the rest*: half the baseline's time less "
        "the forward and the kernel at the BLAS rate (the target: 0.5 of the baseline).",
        "",
        table(results),
    ] + busy_warning(results)) + "\n"


def busy_warning(results: dict) -> list:
    """A line under the table when the products at the BLAS rate took longer than the kernel that made them and
    more: the rate was measured on a busy machine, and that length's floor says nothing."""
    slow = [str(row["tokens"]) for row in results["lengths"] if row["kernel_at_rate_s"] >= row["kernel_s"]]
    if not slow:
        return []
    return ["", f"**Not a floor at {', '.join(slow)} tokens:** the kernel's products priced at the BLAS rate took "
                "longer than the kernel itself, so the rate was measured while something else ran. Rerun on an idle "
                "machine."]


def table(results: dict) -> str:
    """The measurement per length (docs/speed.md quotes it)."""
    lines = [
        "| tokens | texts | rows | baseline s | this checkout s | ratio (repeats) | forward s | kernel s | kernel "
        "GFLOP f32 + f64 | BLAS rate f32 / f64 | kernel at the BLAS rate s | kernel / that | floor s | floor / baseline | rest s | "
        "left for the rest s | left / rest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["lengths"]:
        flops, rates = row["kernel_flops"], row["rates"]
        lines.append(
            f"| {row['tokens']} | {row['texts']} | {row['rows']:,} | {row['baseline_s']:.2f} | {row['current_s']:.2f} | "
            f"{row['ratio']:.2f} ({', '.join(f'{r:.2f}' for r in row['ratios'])}) | {row['forward_s']:.2f} | "
            f"{row['kernel_s']:.2f} | {flops['float32'] / 1e9:.0f} + {flops['float64'] / 1e9:.0f} | "
            f"{rates['float32'] / 1e9:.0f} / {rates['float64'] / 1e9:.0f} | {row['kernel_at_rate_s']:.2f} | "
            f"{row['kernel_s'] / row['kernel_at_rate_s']:.2f}x | "
            f"{row['floor_s']:.2f} | **{row['floor_ratio']:.2f}** | {row['rest_s']:.2f} | "
            f"{row['left_for_rest_s']:.2f} | **{row['left_for_rest_s'] / row['rest_s']:.2f}** |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_floor.json", quick="128 tokens, 8 texts, one repeat", repeats=2)
    parser.add_argument("--baseline", default=speedup.BASELINE, help=f"[default: {speedup.BASELINE}]")
    parser.add_argument("--tokens", default="128,512", help="comma-separated text lengths [default: 128,512]")
    parser.add_argument("--child", default=None, help="(internal) run one measurement in this process")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    from probe.solve import native

    if not native.available():
        print(f"bench/floor.py prices the compiled Newton kernel's products, and it is not in use here: "
              f"{native.unavailable_reason()}", file=sys.stderr)
        return 2
    lengths = [128] if args.quick else [int(x) for x in args.tokens.split(",")]
    with speedup.against_baseline(args.baseline, "probe-floor-") as (scratch, roots):
        results = {"environment": common.environment(threads=1), "baseline": args.baseline, "lengths": [],
                   "current_commit": speedup.current_commit()}
        for tokens in lengths:
            count = 8 if args.quick else TEXTS.get(tokens, 16)
            results["lengths"].append(measure_length(tokens, count, roots, 1 if args.quick else args.repeats,
                                                     scratch, runs.minilm_path()))
        common.write_results(args.out, results, markdown, benchmark="floor")
    return 0


if __name__ == "__main__":
    runs.entry(main, child_main)
