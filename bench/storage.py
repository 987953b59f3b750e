"""Storage benchmark: bytes per row on disk, and the time to write and read the part files, for the writer
before issue 34 and the settings it chose between.

The rows: a real run's part files (``--run RUN_DIR``; default: ``probe run`` of all-MiniLM-L6-v2 over
``--texts`` texts of two sentences, made as ``bench/scale.py`` makes its real run).  Each writer rewrites every
part into a fresh run directory through ``probe.store.storage.write_part`` as a run calls it (sort, encode,
compress, fsync, rename); the writers take turns, ``--repeats`` rounds, and each one's time is its median
over the rounds.

* **before**: the writer before issue 34: snappy, dictionaries for every column but the floats, one row
  group, the rows in the order they were given;
* **zstd L**: zstd at level L, the rows in the row key's order and a row group per (space, alpha,
  attention type, layer) slice (:mod:`probe.store.storage`'s writer, whose level is
  ``probe.store.storage.COMPRESSION_LEVEL``);
* **zstd 1, floats byte-stream-split**: the same with the float columns' bytes split into streams
  (``BYTE_STREAM_SPLIT``: what that encoding would buy; probe does not use it, as Spark's default reader
  cannot decode it).

Measured: bytes per row (the files' sizes, footers included); write and read seconds per million rows (read:
pyarrow reading every part whole); the row groups that pyarrow's statistics keep for a filter on one layer
(of all the run's row groups); and every value read back bit for bit (floats compared as their bits).

    python bench/storage.py                     # bench/results_storage.{json,md}
    python bench/storage.py --run RUN_DIR --repeats 1 --out /tmp/storage.json
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "bench"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

#: (name, zstd level or None for the writer before, byte-stream-split floats)
WRITERS = [("before", None, False), ("zstd 1", 1, False), ("zstd 3", 3, False), ("zstd 6", 6, False),
           ("zstd 9", 9, False), ("zstd 1, floats byte-stream-split", 1, True)]


@contextmanager
def writer(level: int | None, split: bool):
    """``probe.store.storage.write_part`` writing as the named writer does, for the duration."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from probe.store import storage

    saved = storage.COMPRESSION_LEVEL, storage.parquet_options, storage._write_table, storage._in_key_order
    if level is None:  # the writer before issue 34
        def options(schema):
            return {"use_dictionary": [f.name for f in schema if not pa.types.is_floating(f.type)]}

        storage._write_table = lambda table, handle: pq.write_table(table, handle, **options(table.schema))
        storage._in_key_order = lambda table: table
    else:
        storage.COMPRESSION_LEVEL = level
        if split:
            storage.parquet_options = lambda schema: {**saved[1](schema), "column_encoding": dict.fromkeys(
                [field.name for field in schema if pa.types.is_floating(field.type)], "BYTE_STREAM_SPLIT")}
    try:
        yield
    finally:
        storage.COMPRESSION_LEVEL, storage.parquet_options, storage._write_table, storage._in_key_order = saved


def bits_equal(a, b) -> bool:
    """Two tables equal column by column, floats bit for bit."""
    import numpy as np
    import pyarrow as pa

    if a.column_names != b.column_names or a.num_rows != b.num_rows:
        return False
    for name in a.column_names:
        if pa.types.is_floating(a.schema.field(name).type):
            if not np.array_equal(a[name].to_numpy(zero_copy_only=False).view(np.int64),
                                  b[name].to_numpy(zero_copy_only=False).view(np.int64)):
                return False
        elif not a[name].equals(b[name]):
            return False
    return True


def docs_values(summary: dict) -> dict:
    """The numbers docs/large-runs.md quotes, by marker."""
    chosen = summary["writers"][summary["chosen"]]["bytes_per_row"]
    return {"storage:bytes": f"{chosen:.1f}", "storage:before": f"{summary['writers']['before']['bytes_per_row']:.1f}",
            "storage:gb": f"{chosen * 1e8 / 1e9:.1f}"}


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_storage.json")
    parser.add_argument("--run", type=Path, default=None, help="a run directory whose parts to rewrite")
    parser.add_argument("--texts", type=int, default=300, help="texts of the run made when --run is not given")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0

    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from scale_report import DOCS
    from scale_runs import child_env, corpus_texts, run_probe

    from probe.core.schema import ROW_KEY
    from probe.store import storage

    environment = common.environment()
    scratch = Path(tempfile.mkdtemp(prefix="probe-storage-"))
    try:
        source = args.run
        if source is None:
            source = Path(run_probe(corpus_texts(args.texts), scratch, "storage", None, 128, child_env())["run_dir"])
        parts = {batch: pq.read_table(path) for batch, path in storage.part_files(source).items()}
        records = {batch: storage.part_record(path) for batch, path in storage.part_files(source).items()}
        rows = sum(table.num_rows for table in parts.values())
        key = [(name, "ascending") for name in ROW_KEY]
        expected = {batch: table.replace_schema_metadata(None).sort_by(key) for batch, table in parts.items()}
        seconds = {name: [] for name, *_ in WRITERS}
        cpu_seconds = {name: [] for name, *_ in WRITERS}
        results = {}
        for round_number in range(args.repeats):
            for name, level, split in WRITERS:
                target = scratch / f"{name.replace(' ', '-').replace(',', '')}-{round_number}"
                (target / storage.PARTS).mkdir(parents=True)
                with writer(level, split):
                    started, cpu_started = time.perf_counter(), time.process_time()
                    for batch, table in parts.items():
                        storage.write_part(target, batch, table.replace_schema_metadata(None),
                                           {k: v for k, v in records[batch].items() if k != "batch"})
                    seconds[name].append(time.perf_counter() - started)
                    cpu_seconds[name].append(time.process_time() - cpu_started)
                if round_number == args.repeats - 1:  # sizes, reading and the check, once
                    files = storage.part_files(target)
                    started = time.perf_counter()
                    read = {batch: pq.read_table(path) for batch, path in files.items()}
                    read_s = time.perf_counter() - started
                    exact = all(bits_equal(read[batch].replace_schema_metadata(None).sort_by(key), expected[batch])
                                for batch in files)
                    dataset = ds.dataset([str(path) for path in files.values()], format="parquet")
                    fragments = list(dataset.get_fragments())
                    groups = sum(fragment.metadata.num_row_groups for fragment in fragments)
                    kept = sum(len(fragment.split_by_row_group(ds.field("layer") == 1)) for fragment in fragments)
                    floats = {}  # the float columns' compressed bytes, from the files' metadata
                    for fragment in fragments:
                        for group in range(fragment.metadata.num_row_groups):
                            for column in range(fragment.metadata.num_columns):
                                chunk = fragment.metadata.row_group(group).column(column)
                                if chunk.physical_type == "DOUBLE":
                                    floats[chunk.path_in_schema] = (floats.get(chunk.path_in_schema, 0)
                                                                    + chunk.total_compressed_size)
                    results[name] = {
                        "float_columns_bytes_per_row": {k: round(v / rows, 2) for k, v in floats.items()},
                        "bytes_per_row": round(sum(path.stat().st_size for path in files.values()) / rows, 2),
                        "read_s_per_million_rows": round(read_s / rows * 1e6, 3),
                        "row_groups": groups, "row_groups_kept_for_layer_1": kept, "bit_exact": exact,
                    }
                shutil.rmtree(target)
        for name, times in seconds.items():
            results[name]["write_s_per_million_rows"] = round(statistics.median(times) / rows * 1e6, 3)
            results[name]["write_s_rounds"] = [round(t, 3) for t in times]
            results[name]["write_cpu_s_per_million_rows"] = round(statistics.median(cpu_seconds[name]) / rows * 1e6, 3)
        before = results["before"]
        for name in results:
            results[name]["bytes_ratio_to_before"] = round(results[name]["bytes_per_row"] / before["bytes_per_row"], 3)
            for kind in ("write_s", "write_cpu_s"):
                results[name][f"{kind}_ratio_to_before"] = round(
                    results[name][f"{kind}_per_million_rows"] / before[f"{kind}_per_million_rows"], 3)
        manifest = json.loads((source / storage.MANIFEST).read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    chosen = f"zstd {storage.COMPRESSION_LEVEL}"
    summary = {
        "environment": environment,
        "source": {"model": manifest["model"].get("name"), "texts": manifest["dataset"]["n_examples"], "rows": rows,
                   "parts": len(parts), "layers": manifest["model"].get("num_hidden_layers")},
        "repeats": args.repeats, "chosen": chosen, "writers": results,
        # the source run's own time per million rows (its manifest), to set the writer's against
        "run_s_per_million_rows": round(manifest["timings_s"]["total_s"] / rows * 1e6, 2),
    }
    common.write_results(args.out, summary, markdown, benchmark="storage")
    if args.out.resolve() == (HERE / "results_storage.json").resolve():  # the committed results: the docs follow
        common.fill_markers(DOCS, docs_values(summary))
    return 0


def markdown(summary: dict) -> str:
    results, chosen = summary["writers"], summary["chosen"]
    before = results["before"]
    rows, parts = summary["source"]["rows"], summary["source"]["parts"]
    lines = [
        "# Storage: bytes per row and the writer's time",
        "",
        common.header(summary),
        "",
        f"The {rows:,} rows of {parts} part files of a real run ({summary['source']['model']}, "
        f"{summary['source']['texts']:,} texts) rewritten by each writer through `probe.store.storage.write_part`, "
        f"{summary['repeats']} rounds taking turns; write time: the median round.",
        "",
        "| writer | bytes per row | vs before | write, wall (s per 10^6 rows) | vs before | write, CPU (s per 10^6 "
        "rows) | vs before | read (s per 10^6 rows) | row groups kept by `layer == 1` | bit for bit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, got in results.items():
        mark = " (probe's)" if name == chosen else ""
        lines.append(
            f"| {name}{mark} | {got['bytes_per_row']:.1f} | {got['bytes_ratio_to_before']:.3f} | "
            f"{got['write_s_per_million_rows']:.2f} | {got['write_s_ratio_to_before']:.2f} | "
            f"{got['write_cpu_s_per_million_rows']:.2f} | {got['write_cpu_s_ratio_to_before']:.2f} | "
            f"{got['read_s_per_million_rows']:.2f} | {got['row_groups_kept_for_layer_1']} of {got['row_groups']} | "
            f"{'yes' if got['bit_exact'] else '**no**'} |")
    floats = results[chosen]["float_columns_bytes_per_row"]
    split = results["zstd 1, floats byte-stream-split"]
    measured = {k: v for k, v in floats.items() if k != "alpha"}  # alpha: one value per slice
    lines += [
        "",
        f"probe writes {chosen}: {results[chosen]['bytes_per_row']:.1f} bytes per row against "
        f"{before['bytes_per_row']:.1f} before ({results[chosen]['bytes_ratio_to_before']:.2f}x), written in "
        f"{results[chosen]['write_s_ratio_to_before']:.2f}x the wall time and "
        f"{results[chosen]['write_cpu_s_ratio_to_before']:.2f}x the CPU time "
        f"({results[chosen]['write_cpu_s_per_million_rows'] - before['write_cpu_s_per_million_rows']:+.2f} "
        f"CPU seconds per million rows: sorting the rows, and zstd), where the run itself took "
        f"{summary['run_s_per_million_rows']:.0f} s per million rows. The {len(measured)} float64 columns of "
        f"measurements take {sum(measured.values()):.1f} of those bytes ({min(measured.values()):.2f} to "
        f"{max(measured.values()):.2f} each, of 8): their mantissas are as good as random, and no lossless codec "
        f"shrinks those. Splitting the floats' bytes into streams would bring the row to {split['bytes_per_row']:.1f} "
        "bytes (the exponents' bytes repeat), but Spark's default Parquet reader cannot decode that encoding, so "
        "probe leaves it out.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
