"""Long contexts with the model's fast attention: ``probe run --attn-implementation sdpa``.

The Llama-shaped model of bench/long_context.py (hidden 512, 4 layers, 8 query heads on 2 key-value heads, head
width 64; random weights, seed 0; a byte-level BPE tokenizer trained on the embedded corpus) on one text of n
tokens, n = 4,096 ... 32,768, with ``--queries sample:32`` (every layer and head; 32 sampled positions), each
measurement a child process of its own (peak memory is a process's):

* a plain forward of the text (the model loaded by transformers with ``attn_implementation="sdpa"``, then
  ``"eager"``; ``model(**inputs)`` under ``torch.no_grad``): its peak resident set size (``VmHWM``) and seconds;
* ``probe run`` of the same text with ``--attn-implementation sdpa``, then ``eager``: its peak, its seconds, its
  rows, whether every row is certified and whether the fidelity check passed (under SDPA the check compares the
  output rebuilt from probe's logits with the model's own).

The eager measurements stop at ``--eager-up-to`` tokens (8,192): an eager forward holds the (heads, n, n)
probabilities of a layer and its softmax's temporaries, 8 x n^2 x 4 bytes each, which at 16,384 tokens is 8.6 GB
a tensor, beyond what a 24 GB shared machine should be asked for.

    python bench/fast_attention.py            # the full run (about 6 min on 2 shared cores)
    python bench/fast_attention.py --quick    # a smoke run: a small model, texts of 256 and 512 tokens

The machine may be shared: ratios measured in one run are what to compare.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import long_context  # noqa: E402
import runs  # noqa: E402
from long_context import LLAMA, LLAMA_QUICK, child, make_llama, write_texts  # noqa: E402


def forward(model_dir: Path, data: Path, length: int, implementation: str) -> dict:
    """A plain forward of the text by transformers with ``implementation``, in a child process."""
    peak, output = child(long_context.FORWARD, model_dir, data, length, implementation)
    return {"peak_mib": peak / 1024, "seconds": long_context.seconds_of(output)}


def probe_run(model_dir: Path, data: Path, length: int, out: Path, queries: str, implementation: str) -> dict:
    """``probe run`` of the text, batches of one text, with ``implementation``, in a child process."""
    run = long_context.probe_run(model_dir, data, length, out, queries=queries, batch=1,
                                 attn_implementation=implementation)
    return {"peak_mib": run.pop("peak_kib") / 1024, **run}


def measure(model_dir: Path, length: int, work: Path, queries: str, eager: bool) -> dict:
    from transformers import AutoTokenizer

    texts = runs.corpus_texts(AutoTokenizer.from_pretrained(model_dir), length, 1, seed=length)
    data = write_texts(work / f"text-{length}.jsonl", texts)
    found = {"tokens": length, "queries": queries}
    for implementation in ("sdpa", "eager") if eager else ("sdpa",):
        found[implementation] = {
            "forward": forward(model_dir, data, length, implementation),
            "probe": probe_run(model_dir, data, length, work / f"runs-{implementation}", queries, implementation),
        }
        print(f"{length} tokens, {implementation}: {json.dumps(found[implementation])}", file=sys.stderr)
    return found


# --------------------------------------------------------------------------------------------------


def table(results: dict) -> str:
    """Peak memory and seconds per context length (docs/long-contexts.md quotes it)."""
    lines = [
        "| tokens | forward, SDPA: MiB / s | probe run, SDPA: MiB / s | probe / forward (SDPA) | forward, eager: MiB / s "
        "| probe run, eager: MiB / s | probe SDPA / forward eager | rows | certified | fidelity (SDPA) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for each in results["lengths"]:
        fast = each["sdpa"]
        eager = each.get("eager")
        cells = [f"{each['tokens']:,}", f"{fast['forward']['peak_mib']:,.0f} / {fast['forward']['seconds']:.1f}",
                 f"{fast['probe']['peak_mib']:,.0f} / {fast['probe']['seconds']:.1f}",
                 f"**{fast['probe']['peak_mib'] / fast['forward']['peak_mib']:.2f}x**"]
        if eager is None:
            cells += ["not run", "not run", "-"]
        else:
            cells += [f"{eager['forward']['peak_mib']:,.0f} / {eager['forward']['seconds']:.1f}",
                      f"{eager['probe']['peak_mib']:,.0f} / {eager['probe']['seconds']:.1f}",
                      f"**{fast['probe']['peak_mib'] / eager['forward']['peak_mib']:.2f}x**"]
        run = fast["probe"]
        cells += [f"{run['rows']:,}", "all" if run["not_converged"] == 0 else f"{run['not_converged']} not",
                  f"{'passed' if run['fidelity_passed'] else 'FAILED'} ({run['fidelity_max_abs_error']:.1e})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    return "\n".join([
        "# Long contexts with the model's fast attention", "",
        common.header(results), "",
        f"Llama-shaped model ({results['llama']}), one text of n tokens, `--queries {results['queries']}` (every layer "
        "and head), batches of one text. *forward*: a plain forward of the text by transformers with that attention; "
        "*probe run*: `probe run --attn-implementation` that attention, the whole process (loading, capture, solve, "
        "writing). Peak resident set (`VmHWM`) in MiB and wall seconds; *rows*, *certified* and *fidelity*: the SDPA "
        f"run's (fidelity: {results['lengths'][0]['sdpa']['probe']['fidelity_check']}, largest error). The eager "
        f"measurements stop at {results['eager_up_to']:,} tokens (the module docstring says why).", "",
        table(results),
    ]) + "\n"


def main(argv=None) -> int:
    arguments = common.parser(__doc__, "results_fast_attention.json", quick="a small model, 256 and 512 tokens")
    arguments.add_argument("--eager-up-to", type=int, default=8192,
                           help="the longest text measured with eager attention too [default: 8192]")
    options = arguments.parse_args(argv)
    if common.rendered(options, markdown):
        return 0
    if options.quick and options.out == arguments.get_default("out"):
        options.out = options.out.with_name("results_fast_attention_quick.json")
    shape, lengths = (LLAMA_QUICK, [256, 512]) if options.quick else (LLAMA, [4096, 8192, 16384, 32768])
    queries = "sample:8" if options.quick else "sample:32"
    with tempfile.TemporaryDirectory(prefix="probe-fast-attention-") as scratch:
        work = Path(scratch)
        model_dir = make_llama(work / "llama", shape, max(lengths))
        results = {
            "environment": common.environment(), "quick": options.quick, "queries": queries,
            "llama": ", ".join(f"{key} {value}" for key, value in shape.items()), "eager_up_to": options.eager_up_to,
            "lengths": [measure(model_dir, length, work, queries, length <= options.eager_up_to) for length in lengths],
        }
    common.write_results(options.out, results, markdown, benchmark="fast_attention")
    return 0


if __name__ == "__main__":
    sys.exit(main())
