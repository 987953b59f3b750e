"""Peak memory of a run: the peak resident set size (``VmHWM`` of ``/proc/self/status``: unlike ``ru_maxrss``,
which Linux carries over from the parent through ``exec``, it is the child's own) of runs on the real
all-MiniLM-L6-v2 at 512 tokens with batch sizes 1 and 16 over the same texts, of the largest batch under
``--max-memory 1GiB``, and of a process that only imports and loads the model; each a child process.

    python bench/e2e_memory.py            # bench/results_e2e_memory.{json,md} (minutes)
    python bench/e2e_memory.py --quick    # 16 tokens, batches of 1 and 2 (seconds)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runs  # noqa: E402

if runs.child_setup(sys.argv) is None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the probe command sets it, before torch loads
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common  # noqa: E402

child_main = runs.configuration_child


def memory(model_path: str, length: int, count: int, batch_sizes, workdir: Path, budgets=()) -> dict:
    """Peak RSS of runs at ``batch_sizes`` (and of the largest batch under each ``--max-memory`` in
    ``budgets``, bytes), and of a process that only loads the model."""
    from transformers import AutoTokenizer

    texts = runs.texts_of_length(AutoTokenizer.from_pretrained(model_path), length, count)
    texts_file = workdir / "memory-texts.json"
    texts_file.write_text(json.dumps(texts))
    base = {"model": model_path, "length": length, "texts_file": str(texts_file), "workdir": str(workdir)}
    loaded = runs.run_child("e2e_memory", {**base, "mode": "load"})
    result = {"tokens": length, "texts": count, "load_only_peak_rss_mb": loaded["peak_rss_mb"], "runs": {}}
    for batch_size in batch_sizes:
        # every batch has the same shape (texts of exactly ``length`` tokens) and a run holds one batch at
        # a time, so a run over 4 texts peaks like one over all of them; the largest batch gets them all
        subset = texts[: max(batch_size, 4)]
        subset_file = workdir / f"memory-texts-{batch_size}.json"
        subset_file.write_text(json.dumps(subset))
        child = runs.run_child("e2e_memory", {**base, "texts_file": str(subset_file), "mode": "run", "batch_size": batch_size})
        result["runs"][str(batch_size)] = {
            "texts": len(subset), "peak_rss_mb": child["peak_rss_mb"], "analysis_s": child["seconds"], "rows": child["rows"],
            "not_converged": child["not_converged"],
        }
        print(f"memory: batch {batch_size}: peak RSS {child['peak_rss_mb']:,.0f} MB", flush=True)
    for budget in budgets:
        largest = batch_sizes[-1]
        child = runs.run_child("e2e_memory", {**base, "mode": "run", "batch_size": largest, "max_memory_bytes": budget})
        result["runs"][f"{largest}, --max-memory {budget / 2**30:g}GiB"] = {
            "texts": count, "peak_rss_mb": child["peak_rss_mb"], "analysis_s": child["seconds"], "rows": child["rows"],
            "not_converged": child["not_converged"], "max_memory_bytes": budget,
        }
        print(f"memory: batch {largest}, --max-memory {budget}: peak RSS {child['peak_rss_mb']:,.0f} MB", flush=True)
    small, large = (result["runs"][str(b)]["peak_rss_mb"] for b in (batch_sizes[0], batch_sizes[-1]))
    result["ratio"] = large / small
    result["ratio_above_load"] = (large - loaded["peak_rss_mb"]) / max(1.0, small - loaded["peak_rss_mb"])
    return result


def markdown(results: dict) -> str:
    lines = ["# Peak memory of a run", "", common.header(results)]
    mem = results.get("memory")
    if mem:
        by_batch = mem["runs"]
        lines += [
            "",
            f"## Peak memory (MiniLM, {mem['tokens']} tokens, {mem['texts']} texts; one child process each)",
            "",
            "| batch size | texts | peak RSS (MB) | analysis s |",
            "|---|---|---|---|",
            *[f"| {b} | {v.get('texts', mem['texts'])} | {v['peak_rss_mb']:,.0f} | {v['analysis_s']:.1f} |"
              for b, v in by_batch.items()],
            f"| (import and load the model only) | | {mem['load_only_peak_rss_mb']:,.0f} | |",
            "",
            f"Largest over smallest batch (both without `--max-memory`): **{mem['ratio']:.2f}x** in peak RSS, "
            f"{mem['ratio_above_load']:.2f}x above what loading the model takes.",
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_e2e_memory.json", quick="16 tokens, batches of 1 and 2")
    parser.add_argument("--child", default=None, help="(internal) one run in this process")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    env = common.environment()
    with tempfile.TemporaryDirectory(prefix="probe-memory-") as tmp:
        mem = memory(runs.minilm_path(), 16 if args.quick else 512, 2 if args.quick else 16,
                     (1, 2) if args.quick else (1, 16), Path(tmp), budgets=(2**28,) if args.quick else (2**30,))
    common.write_results(args.out, {"environment": env, "memory": mem}, markdown, benchmark="e2e_memory")
    return 0


if __name__ == "__main__":
    runs.entry(main, child_main)
