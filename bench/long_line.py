"""Peak memory of `probe run` on a dataset of one very long line, against a dataset of one sentence.

A run keeps the first --max-length tokens of each text (probe.capture.truncation cuts a long text before
anything tokenizes it), so a 50 MB line should cost about what one sentence costs. Each dataset is run in
a fresh `probe run` process (the demo all-MiniLM-L6-v2, --max-length 128, one batch, --no-progress);
its peak resident set is the process's ru_maxrss, read by the parent (resource.RUSAGE_CHILDREN after
each child, which holds the largest child so far: the runs go smallest first). Wall time is measured too.

    python bench/long_line.py                 # a 50 MB line; writes bench/results_long_line.{json,md}
    python bench/long_line.py --quick         # a 5 MB line, into a temporary results file
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: the ratio of the long line's peak memory to the sentence's that the run must stay within
TARGET = 1.2


def long_line(path: Path, size: int, seed: int = 0) -> None:
    """``size`` bytes of English-like words on one line (the embedded corpus's words, shuffled)."""
    from probe.capture.data import embedded_corpus

    words = " ".join(embedded_corpus()).split()
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        written = 0
        while written < size:
            chunk = " ".join(rng.choice(words) for _ in range(10_000)) + " "
            handle.write(chunk)
            written += len(chunk.encode())
        handle.write("\n")


def peak_of_run(model: str, dataset: Path, out: Path) -> dict:
    """One `probe run` in a fresh process: its peak resident set (MB), wall time and exit status."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "probe", "run", model, "--dataset", str(dataset), "--max-length", "128",
         "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(common.ROOT)},
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"probe run failed on {dataset.name}:\n{done.stdout}{done.stderr}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux: the largest child so far
    texts_line = next(line for line in done.stdout.splitlines() if line.startswith("texts:"))
    texts_line = texts_line.replace(str(dataset.parent), "<scratch>")  # no path of this machine
    return {"peak_rss_mb": round(peak / 1024, 1), "raised_peak": peak > before, "wall_s": round(wall, 1),
            "bytes": dataset.stat().st_size, "texts_line": texts_line}


def markdown(results: dict) -> str:
    sentence, line = results["sentence"], results["long_line"]
    return (
        "# One long line against one sentence (`bench/long_line.py`)\n\n"
        f"`probe run` of {results['model']} at --max-length 128, each in a fresh process; peak resident set "
        "(ru_maxrss).\n\n"
        "| dataset | bytes | peak memory (MB) | wall (s) | final line |\n|---|---|---|---|---|\n"
        f"| one sentence | {sentence['bytes']:,} | {sentence['peak_rss_mb']} | {sentence['wall_s']} | "
        f"{sentence['texts_line']} |\n"
        f"| one line | {line['bytes']:,} | {line['peak_rss_mb']} | {line['wall_s']} | {line['texts_line']} |\n\n"
        f"Ratio of peak memory: **{results['ratio']:.3f}** (target: within {results['target']}x); "
        f"{'met' if results['met'] else 'NOT met'}.\n\n"
        + common.header(results) + "\n"
    )


def main() -> None:
    parser = common.parser(__doc__, "results_long_line.json", quick="a 5 MB line, results in a temporary folder")
    parser.add_argument("--megabytes", type=float, default=50.0, help="size of the long line [default: 50]")
    args = parser.parse_args()
    if common.rendered(args, markdown):
        return
    env = common.environment()
    size_mb = 5.0 if args.quick else args.megabytes
    from probe.api import demo_model

    model = demo_model()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        sentence = scratch / "sentence.txt"
        sentence.write_text("The quick brown fox jumps over the lazy dog.\n")
        line = scratch / "line.txt"
        long_line(line, int(size_mb * 1e6))
        first = peak_of_run(model, sentence, scratch / "runs-sentence")
        second = peak_of_run(model, line, scratch / "runs-line")
    ratio = second["peak_rss_mb"] / first["peak_rss_mb"]
    results = {
        "model": "all-MiniLM-L6-v2", "megabytes": size_mb, "sentence": first, "long_line": second,
        "ratio": round(ratio, 4), "target": TARGET, "met": ratio <= TARGET, "environment": env,
    }
    out = Path(tempfile.mkdtemp()) / "results_long_line.json" if args.quick else args.out
    common.write_results(out, results, markdown, benchmark="long_line")


if __name__ == "__main__":
    main()
