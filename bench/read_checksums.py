"""What the readers' checksums cost: a run of 10^7 rows, its parts' SHA-256 checked before a reader first
reads them, against the cheap check and against the headline's query.

The run: `probe run` of the demo all-MiniLM-L6-v2 over the embedded corpus, replicated to at least --rows
rows through the real writer (bench/scale.py's replicate: valid parts, each recorded with its SHA-256).
Then, in a fresh process each (so no part is known to the process's cache of checked parts):

* ``cheap``: check_parts without checksums (presence, size, footer, rows), what readers did before;
* ``checksums``: check_parts with checksums, as a reader's first read now makes it (every byte hashed);
* ``cached``: the same again in the same process (each part known unchanged: path, size, mtime, inode);
* ``headline``: ``probe.load(RUN).headline()`` in a fresh process, the checks included (what the final
  lines of a run cost), and the same with the checksums already cached (the query alone).

The parts were just written, so they are in the page cache: the checksums' time is hashing, not the
disk (a cold read is paid by the query as well, which reads the same bytes).

    python bench/read_checksums.py                # 10^7 rows: bench/results_read_checksums.{json,md}
    python bench/read_checksums.py --quick        # 10^6 rows, results in a temporary folder
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MEASURE = r"""
import json, sys, time
from pathlib import Path
from probe.store.integrity import check_parts
run = Path(sys.argv[1])
times = {}
started = time.perf_counter(); check = check_parts(run); times["cheap"] = time.perf_counter() - started
assert check.ok
started = time.perf_counter(); check = check_parts(run, checksums=True, cached=True)
times["checksums"] = time.perf_counter() - started
assert check.ok
started = time.perf_counter(); check_parts(run, checksums=True, cached=True); times["cached"] = time.perf_counter() - started
import probe
started = time.perf_counter(); probe.load(run).headline(); times["headline_after_checks"] = time.perf_counter() - started
print("BENCH " + json.dumps(times))
"""

HEADLINE = r"""
import json, sys, time
from pathlib import Path
started = time.perf_counter()
import probe
probe.load(Path(sys.argv[1])).headline()
print("BENCH " + json.dumps({"headline_fresh": time.perf_counter() - started}))
"""


def child(code: str, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    done = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stdout + done.stderr)
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    return json.loads(line[len("BENCH "):])


def markdown(results: dict) -> str:
    t = results["seconds"]
    return (
        "# The readers' checksums (`bench/read_checksums.py`)\n\n"
        f"A run of {results['rows']:,} rows in {results['parts']:,} part files ({results['bytes'] / 1e6:,.0f} MB), "
        "all-MiniLM-L6-v2's rows replicated; each number the median of "
        f"{results['repeats']} fresh processes.\n\n"
        "| check | seconds |\n|---|---|\n"
        f"| cheap (presence, size, footer, rows) | {t['cheap']:.2f} |\n"
        f"| with every part's SHA-256 (a reader's first read) | {t['checksums']:.2f} |\n"
        f"| again, same process (cached) | {t['cached']:.2f} |\n"
        f"| `probe.load(RUN).headline()`, fresh process, checks included | {t['headline_fresh']:.2f} |\n"
        f"| the headline's query with the checks already done | {t['headline_after_checks']:.2f} |\n\n"
        f"Hashing runs at {results['hash_mb_per_s']:,.0f} MB/s; the checksums add "
        f"{t['checksums'] - t['cheap']:.2f} s to a process's first read, "
        f"{results['share_of_headline']:.0%} of the fresh headline.\n\n"
        + common.header(results) + "\n"
    )


def main() -> None:
    parser = common.parser(__doc__, "results_read_checksums.json", quick="10^6 rows, results in a temporary folder")
    parser.add_argument("--rows", type=int, default=10**7, help="rows of the run, at least [default: 10^7]")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement [default: 3]")
    args = parser.parse_args()
    if common.rendered(args, markdown):
        return
    env = common.environment()
    rows = 10**6 if args.quick else args.rows
    import statistics

    from scale_runs import replicate

    from probe.api import demo_model
    from probe.store import storage

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        done = subprocess.run(
            [sys.executable, "-m", "probe", "run", demo_model(), "--out", str(scratch / "source"), "--no-progress"],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(common.ROOT)})
        if done.returncode != 0:
            raise SystemExit(done.stdout + done.stderr)
        (source,) = (scratch / "source").iterdir()
        source_rows = storage.read_manifest(source)["solver"]["rows"]
        run_dir = replicate(source, -(-rows // source_rows), scratch / "run")
        manifest = storage.read_manifest(run_dir)
        samples = [{**child(MEASURE, run_dir), **child(HEADLINE, run_dir)} for _ in range(args.repeats)]
        parts = manifest["parts"]
    seconds = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
    size = sum(part["bytes"] for part in parts)
    results = {
        "rows": manifest["solver"]["rows"], "parts": len(parts), "bytes": size, "repeats": args.repeats,
        "seconds": {key: round(value, 3) for key, value in seconds.items()},
        "samples": samples,
        "hash_mb_per_s": round(size / 1e6 / max(seconds["checksums"] - seconds["cheap"], 1e-9), 1),
        "share_of_headline": round((seconds["checksums"] - seconds["cheap"]) / seconds["headline_fresh"], 4),
        "environment": env,
    }
    out = Path(tempfile.mkdtemp()) / "results_read_checksums.json" if args.quick else args.out
    common.write_results(out, results, markdown, benchmark="read_checksums")


if __name__ == "__main__":
    main()
