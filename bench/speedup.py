"""The whole analysis against a baseline commit's: processing time, counted flops per row and the analysis /
forward ratio, the two alternating in one run, and the answers compared.

For each text length (``--tokens``, default 16, 128 and 512), the real all-MiniLM-L6-v2 analyses the same
texts of exactly that many tokens with the baseline's probe (a git worktree of ``--baseline``, default
66d896f) and with this checkout's.  Each run is a child process of its own: it times the plain eager forward
over the run's batches, then runs ``probe.pipeline.runner.run`` (batch size 8, 2 threads, the default
settings) and reports the manifest's processing time, ``total_s - load_model_s - load_data_s``.  The two
ways alternate, ``--repeats`` times; the table shows medians and the median of the per-repeat ratios.

Once per way and length, **counted flops**: the matrix products of a one-thread run over the first batch
(``torch.utils.flop_counter``), plus the compiled kernel's own count of its products
(``probe.solve.native.FLOPS``: its BLAS calls are invisible to the counter), less the forward's, per row, in
units of one product with the row's ``n x r`` factor (``2 n r`` flops, ``r = min(n, 384)``), as
``bench/results_e2e.md`` counts them.  The baseline's kernel counts nothing, so its method is counted on
its torch replica (``PROBE_NATIVE=0 PROBE_SCHEDULE=0``: the adaptive iterations its kernel runs in C).

**Answers**: every row of the last two runs (baseline, this checkout) joined by its key; ``rel_deviation``
must agree within what the two certificates allow, ``2 (error_bound / lambda_norm)`` of each.

``--model causal`` measures a causal decoder instead: the Llama-shaped model with 12 query heads on 4 key-value
heads of ``bench/long_context.py``'s share table (built from its config, random weights), on 16 texts of 128
tokens and 2 of 1,024 (the key space: products in units of ``2 n r`` with ``r = min(n, 64)``, its head width).

    python bench/speedup.py                      # bench/results_speedup.{json,md}
    python bench/speedup.py --quick              # 16 tokens, 4 texts, one repeat: a smoke run
    python bench/speedup.py --model causal --baseline ba806bd   # bench/results_speedup_causal.{json,md}
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runs  # noqa: E402

if runs.child_setup(sys.argv) is None:  # a child runs with the environment its parent chose for it
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402

BASELINE = "66d896f"
#: the models measured: what the tables call them, texts per length, the default lengths, the width r of a
#: problem's factor (min(n, width)) and the results file.  MiniLM: 64 texts where a run takes seconds to a
#: minute; 8 at 512 tokens, where one of the baseline's runs of 16 texts took over five minutes on 2 cores
#: shared with other work.  The causal decoder: the same 98,304 rows at 128 and at 1,024 tokens.
MODELS = {
    "minilm": {"label": "the real all-MiniLM-L6-v2", "texts": {16: 64, 128: 64, 512: 8}, "tokens": "16,128,512",
               "width": 384, "out": "results_speedup.json"},
    "causal": {"label": "a Llama-shaped causal decoder (random weights; hidden_size 768, 4 layers, 12 query heads "
                        "on 4 key-value heads, head_dim 64)", "texts": {128: 16, 1024: 2}, "tokens": "128,1024",
               "width": 64, "out": "results_speedup_causal.json"},
}
WAYS = ("baseline", "this checkout")
ROW_KEY = ["space", "alpha", "attention_type", "layer", "head", "example", "query"]


def child_main(spec: dict) -> None:
    """One run in this process: the forward's seconds, then the analysis (or its counted flops)."""
    import json

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from probe.capture.loading import load_model

    texts = json.loads(Path(spec["texts_file"]).read_text())
    workdir = Path(spec["workdir"])
    config = runs.run_config(spec["model"], texts, spec["tokens"], spec["batch_size"], workdir, threads=spec["threads"])
    torch.set_num_threads(spec["threads"])
    loaded = load_model(spec["model"], device="cpu")
    batches = runs.forward_batches(loaded, config, texts)
    if spec["mode"] == "flops":
        from probe.solve import native

        with FlopCounterMode(display=False) as counter:
            runs.forward_seconds(loaded.model, batches)
        forward = counter.get_total_flops()
        with FlopCounterMode(display=False) as counter:
            measured = runs.analysis(config)
        kernel = getattr(native, "FLOPS", {"float32": 0.0, "float64": 0.0})
        runs.child_result({"forward_flops": forward, "torch_flops": counter.get_total_flops(), "kernel_flops": kernel,
                           "rows": measured["rows"], "n": int(batches[0]["input_ids"].shape[1])})
        return
    runs.forward_seconds(loaded.model, batches[:1])  # warm-up
    forward_s = runs.forward_seconds(loaded.model, batches)
    del loaded
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    measured = runs.analysis(config)
    cpu_end = resource.getrusage(resource.RUSAGE_SELF)
    measured["cpu_s"] = cpu_end.ru_utime - cpu_start.ru_utime + cpu_end.ru_stime - cpu_start.ru_stime
    run_dir = max((workdir / "runs").iterdir(), key=lambda path: path.stat().st_mtime)
    runs.child_result({**measured, "forward_s": forward_s, "run_dir": str(run_dir)})


def causal_model(directory: Path) -> str:
    """The causal decoder of ``bench/long_context.py``'s share table, built from its config in ``directory``."""
    import long_context

    return str(long_context.make_llama(directory, long_context.LLAMA_SHARE, 4096))


@contextmanager
def against_baseline(commit: str, prefix: str):
    """A scratch folder and the two ways' checkouts, ``{baseline: a git worktree of commit, this checkout: the
    repository}``; the worktree and the folder are removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield scratch, {WAYS[0]: baseline_checkout(commit, scratch / "baseline"), WAYS[1]: common.ROOT}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "baseline")], cwd=common.ROOT,
                       capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def current_commit() -> str:
    """This checkout's commit, short."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=common.ROOT, capture_output=True,
                          text=True).stdout.strip()


def baseline_checkout(commit: str, directory: Path) -> Path:
    """A detached git worktree of ``commit`` in ``directory`` (made once)."""
    if not (directory / "probe").exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(directory), commit], cwd=common.ROOT,
                       check=True, capture_output=True)
    return directory


def compare_answers(baseline_dir: str, current_dir: str) -> dict:
    """Every row of the two runs joined by its key: the largest difference of ``rel_deviation`` and whether
    each is within the two certificates, and the same for the second-order deviation's value."""
    import pyarrow.parquet as pq

    columns = ROW_KEY + ["rel_deviation", "error_bound", "lambda_norm", "converged", "second_order_deviation"]
    a, b = (pq.read_table(Path(d) / "deviations.parquet", columns=columns).to_pandas() for d in (baseline_dir, current_dir))
    joined = a.merge(b, on=ROW_KEY, suffixes=("_old", "_new"))
    allowed = 2 * (joined.error_bound_old / joined.lambda_norm_old + joined.error_bound_new / joined.lambda_norm_new)
    difference = (joined.rel_deviation_old - joined.rel_deviation_new).abs()
    second = (joined.second_order_deviation_old - joined.second_order_deviation_new).abs()
    return {
        "rows": len(joined), "rows_baseline": len(a), "rows_current": len(b),
        "all_certified": bool(joined.converged_old.all() and joined.converged_new.all()),
        "max_rel_deviation_difference": float(difference.max()),
        "within_certificates": bool((difference <= allowed + 1e-15).all()),
        "max_second_order_difference": float(second.max()),
        "max_relative_error_bound": float((joined.error_bound_new / joined.lambda_norm_new).max()),
    }


def measure_length(tokens: int, count: int, roots: dict, repeats: int, workdir: Path, model: str, width: int
                   ) -> dict:
    """The two ways at one length: times (alternating), counted flops, answers."""
    import json

    from transformers import AutoTokenizer

    texts = runs.texts_of_length(AutoTokenizer.from_pretrained(model), tokens, count)
    texts_file = workdir / f"texts-{tokens}.json"
    texts_file.write_text(json.dumps(texts))
    spec = {"model": model, "tokens": tokens, "batch_size": 8, "texts_file": str(texts_file), "threads": 2}
    last = {}

    def run(way):
        folder = workdir / f"{tokens}-{way.replace(' ', '-')}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        result = runs.run_child("speedup", {**spec, "mode": "time", "workdir": str(folder)}, root=roots[way])
        last[way] = result["run_dir"]
        return result

    measured = common.alternate({way: (lambda way=way: run(way)) for way in WAYS}, repeats, measure=lambda f: f())
    row = {"tokens": tokens, "texts": count, "repeats": repeats, "runs": measured}
    for way in WAYS:
        seconds = [r["seconds"] for r in measured[way]]
        ratios = [r["seconds"] / r["forward_s"] for r in measured[way]]
        row[way] = {"processing_s": seconds, "processing_s_median": statistics.median(seconds),
                    "analysis_over_forward": ratios, "analysis_over_forward_median": statistics.median(ratios),
                    "rows": measured[way][0]["rows"], "not_converged": max(r["not_converged"] for r in measured[way]),
                    "max_relative_error_bound": max(r["max_relative_error_bound"] for r in measured[way])}
    row["speedup_ratios"] = [new["seconds"] / old["seconds"] for old, new in zip(measured[WAYS[0]], measured[WAYS[1]])]
    row["time_ratio_median"] = statistics.median(row["speedup_ratios"])
    row["cpu_ratios"] = [new["cpu_s"] / old["cpu_s"] for old, new in zip(measured[WAYS[0]], measured[WAYS[1]])]
    row["cpu_ratio_median"] = statistics.median(row["cpu_ratios"])
    row["answers"] = compare_answers(last[WAYS[0]], last[WAYS[1]])
    first = {**spec, "threads": 1, "texts_file": str(texts_file)}
    subset = workdir / f"texts-{tokens}-first-batch.json"
    subset.write_text(json.dumps(texts[:8]))
    row["flops"] = {}
    for way in WAYS:
        folder = workdir / f"{tokens}-flops-{way.replace(' ', '-')}"
        folder.mkdir(exist_ok=True)
        environment = dict(os.environ)
        if way == WAYS[0]:
            environment.update(PROBE_NATIVE="0", PROBE_SCHEDULE="0")
        counted = runs.run_child("speedup", {**first, "texts_file": str(subset), "mode": "flops", "workdir": str(folder)},
                                 environment, root=roots[way])
        r = min(counted["n"], width)
        beyond = counted["torch_flops"] + sum(counted["kernel_flops"].values()) - counted["forward_flops"]
        row["flops"][way] = {**counted, "products_per_row": beyond / counted["rows"] / (2 * counted["n"] * r),
                             "kernel_products_per_row": {k: v / counted["rows"] / (2 * counted["n"] * r)
                                                          for k, v in counted["kernel_flops"].items()}}
    return row


def markdown(results: dict) -> str:
    return "\n".join([
        "# The analysis against the baseline's: time, counted flops and answers",
        "",
        common.header(results),
        "",
        f"Baseline: commit `{results['baseline']}`, run from a git worktree; *this checkout*: "
        f"`{results.get('current_commit', '?')}`. {model_label(results)}, texts of exactly L tokens, batches of 8, "
        "2 threads, each run a child process of its own, the two alternating. *processing s*: the manifest's "
        "`total_s - load_model_s - load_data_s`; *time ratio*: the median of the per-repeat ratios this checkout / "
        f"baseline{' (the target is at most 0.5)' if results.get('model', 'minilm') == 'minilm' else ''}; "
        "*CPU time ratio*: the same for the run's CPU seconds (user and system, "
        "every thread), which a shared machine's load moves less. *analysis / forward*: processing time over the "
        "plain forward of the same batches, timed in the same child. *products per row*: matrix-product flops beyond "
        f"the forward per problem in units of `2 n r` (r = min(n, {results.get('width', 384)})), counted over the "
        "first batch; the baseline's "
        "on its torch replica of its kernel's method, this checkout's as torch ops plus the compiled code's own count "
        "(float32 + float64 in brackets: the Newton kernel's products, and the second order's factorisations per "
        "interval of keys where a causal model's rows have them).",
        "",
        table(results),
    ]) + "\n"


def model_label(results: dict) -> str:
    """The measured model, as the table's paragraph names it (results before ``--model``: MiniLM)."""
    label = results.get("model_label", MODELS["minilm"]["label"])
    return label[0].upper() + label[1:]


def table(results: dict) -> str:
    """The comparison per length: times, ratios, counted products, answers (docs/speed.md quotes it)."""
    lines = [
        "| tokens | texts | rows | baseline processing s | this checkout processing s | time ratio (repeats) | "
        "CPU time ratio (repeats) | analysis / forward, baseline | analysis / forward, this checkout | "
        "products per row, baseline | products per row, this checkout (kernel f32 + f64) | answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["lengths"]:
        old, new = row[WAYS[0]], row[WAYS[1]]
        flops = row["flops"]
        kernel = flops[WAYS[1]]["kernel_products_per_row"]
        answers = row["answers"]
        verdict = ("within the certificates" if answers["within_certificates"] and answers["all_certified"]
                   else "**differ**") + (f" (largest difference {answers['max_rel_deviation_difference']:.1e}; "
                                         f"second order {answers['max_second_order_difference']:.1e})")
        cpu = (f"{row['cpu_ratio_median']:.2f} ({', '.join(f'{r:.2f}' for r in row['cpu_ratios'])})"
               if "cpu_ratios" in row else "–")
        lines.append(
            f"| {row['tokens']} | {row['texts']} | {new['rows']:,} | {old['processing_s_median']:.2f} | "
            f"{new['processing_s_median']:.2f} | **{row['time_ratio_median']:.2f}** "
            f"({', '.join(f'{r:.2f}' for r in row['speedup_ratios'])}) | {cpu} | "
            f"{old['analysis_over_forward_median']:.1f}x | {new['analysis_over_forward_median']:.1f}x | "
            f"{flops[WAYS[0]]['products_per_row']:.1f} | {flops[WAYS[1]]['products_per_row']:.1f} "
            f"({kernel['float32']:.1f} + {kernel['float64']:.1f}) | {verdict} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_speedup.json", quick="16 tokens, 4 texts, one repeat", repeats=3)
    parser.add_argument("--baseline", default=BASELINE, help=f"the commit to compare with [default: {BASELINE}]")
    parser.add_argument("--tokens", default=None, help="comma-separated text lengths [default: the model's]")
    parser.add_argument("--model", choices=sorted(MODELS), default="minilm",
                        help="minilm (the real all-MiniLM-L6-v2) or causal (a Llama-shaped decoder) [default: minilm]")
    parser.add_argument("--child", default=None, help="(internal) run one measurement in this process")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    env = common.environment()
    quick = bool(args.quick)
    chosen = MODELS[args.model]
    if args.out == common.HERE / MODELS["minilm"]["out"]:
        args.out = common.HERE / chosen["out"]
    lengths = [min(map(int, chosen["tokens"].split(",")))] if quick else [
        int(x) for x in (args.tokens or chosen["tokens"]).split(",")]
    with against_baseline(args.baseline, "probe-speedup-") as (scratch, roots):
        results = {"environment": env, "baseline": args.baseline, "lengths": [], "model": args.model,
                   "model_label": chosen["label"], "width": chosen["width"], "current_commit": current_commit()}
        model = runs.minilm_path() if args.model == "minilm" else causal_model(scratch / "causal")
        for tokens in lengths:
            count = 4 if quick else chosen["texts"].get(tokens, 16)
            results["lengths"].append(measure_length(tokens, count, roots, 1 if quick else args.repeats, scratch,
                                                     model, chosen["width"]))
        common.write_results(args.out, results, markdown, benchmark="speedup")
    return 0


if __name__ == "__main__":
    runs.entry(main, child_main)
