"""The run directory on disk: part files that readers see only when whole, the documented one-liners
(pandas, pyarrow, DuckDB, polars), export, and recognising a run whose process is gone."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from probe.core.errors import ProbeError
from probe.core.schema import DEVIATION_SCHEMA, ROW_KEY
from probe.store import export, storage


def batch_table(batch: int, examples=(0, 1), queries=3) -> pa.Table:
    """Rows of a fake batch in the deviations schema (only the key columns vary)."""
    n = len(examples) * queries
    columns = {
        "model": ["m"] * n,
        "attention_type": ["self"] * n,
        "layer": np.zeros(n, np.int32),
        "head": np.zeros(n, np.int32),
        "example": np.repeat(np.asarray(examples, np.int64) + 10 * batch, queries),
        "query": np.tile(np.arange(queries, dtype=np.int32), len(examples)),
        "rel_deviation": np.linspace(0, 1, n) + batch,
        "space": ["hidden"] * n,
    }
    for name in DEVIATION_SCHEMA.names:
        columns.setdefault(name, pa.nulls(n, DEVIATION_SCHEMA.field(name).type))
    return pa.table(columns, schema=DEVIATION_SCHEMA)


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with two finished batches, a half-written third one and a half-written manifest,
    as a kill during the third batch's write leaves them."""
    run_dir = storage.create_run_directory(tmp_path, "model")
    for batch in (0, 1):
        storage.write_part(run_dir, batch, batch_table(batch), {"examples": [10 * batch, 10 * batch + 1]})
    storage.write_manifest(run_dir, {"status": "complete"})
    parts = run_dir / storage.PARTS
    (parts / ".part-000002.parquet.tmp-12345").write_bytes(pq_bytes(batch_table(2))[:100])  # no footer
    (run_dir / ".manifest.json.tmp-12345").write_text('{"status": "runn')
    return run_dir


def pq_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def expected_frame() -> pd.DataFrame:
    return pa.concat_tables([batch_table(0), batch_table(1)]).to_pandas()


def test_readers_see_finished_batches_only(run_dir):
    """The one-liners of docs/runs.md read exactly the two whole batches; the temporaries are invisible."""
    duckdb = pytest.importorskip("duckdb")
    polars = pytest.importorskip("polars")
    import pyarrow.dataset as ds

    expected = expected_frame()
    path = run_dir / "deviations.parquet"
    readers = {
        "pandas": lambda: pd.read_parquet(path),
        "pyarrow": lambda: pq.read_table(path).to_pandas(),
        "pyarrow.dataset": lambda: ds.dataset(path).to_table().to_pandas(),
        "duckdb": lambda: duckdb.sql(f"SELECT * FROM '{path}'").df(),
        "polars": lambda: polars.read_parquet(f"{path}/*.parquet").to_pandas(),
        "probe": lambda: export.read_deviations(run_dir).to_pandas(),
    }
    for name, read in readers.items():
        frame = read().sort_values(["example", "query"]).reset_index(drop=True)
        assert len(frame) == len(expected), name
        assert frame["example"].tolist() == expected["example"].tolist(), name
        np.testing.assert_array_equal(frame["rel_deviation"], expected["rel_deviation"], err_msg=name)
    assert json.loads((run_dir / "manifest.json").read_text()) == {"status": "complete"}


def test_part_records_and_cleanup(run_dir):
    records = storage.finished_batches(run_dir)
    assert sorted(records) == [0, 1]
    assert records[1]["examples"] == [10, 11] and records[1]["batch"] == 1
    assert storage.remove_temporaries(run_dir) == 2
    assert sorted(p.name for p in (run_dir / storage.PARTS).iterdir()) == ["part-000000.parquet", "part-000001.parquet"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["deviations.parquet", "manifest.json"]


def test_rewriting_a_batch_replaces_it(run_dir):
    """A batch redone (after a kill between its rename and the manifest) replaces its file: no duplicates."""
    storage.write_part(run_dir, 1, batch_table(1), {"examples": [10, 11]})
    assert len(pd.read_parquet(run_dir / "deviations.parquet")) == len(expected_frame())


def test_export_writes_one_file(run_dir, tmp_path):
    to = tmp_path / "all.parquet"
    assert export.export(run_dir, to) == len(expected_frame())
    assert pq.ParquetFile(to).schema_arrow == DEVIATION_SCHEMA
    expected = pd.read_parquet(run_dir / "deviations.parquet").sort_values(list(ROW_KEY), ignore_index=True)
    pd.testing.assert_frame_equal(pd.read_parquet(to), expected)
    with pytest.raises(ProbeError, match="exists already"):
        export.export(run_dir, to)
    with pytest.raises(ProbeError, match="does not exist"):
        export.export(run_dir, tmp_path / "nowhere" / "x.parquet")


# ------------------------------------------------------------------------ the writer: order, row groups, bits

#: float64 values whose bits a lossy or canonicalising step would change
SPECIAL_FLOATS = [np.nan, -0.0, 0.0, np.inf, -np.inf, 5e-324, -1e-310, 1.7976931348623157e308, 1 / 3]


def scrambled_rows(examples, seed: int, *, layers=2, heads=2, queries=3) -> pa.Table:
    """Rows of a batch in no particular order (as a run with several spaces and alphas solves them: slice
    by slice, examples interleaved), every column filled; the float columns hold random bit patterns (NaNs
    with payloads among them) and the special values above."""
    rng = np.random.default_rng(seed)
    keys = list(itertools.product(("key", "hidden"), (1.0, 0.5), ("self",), range(layers), range(heads),
                                  examples, range(queries)))
    keys = [keys[i] for i in rng.permutation(len(keys))]
    n = len(keys)
    columns = {name: [key[i] for key in keys] for i, name in enumerate(ROW_KEY)}
    for field in DEVIATION_SCHEMA:
        if field.name in columns:
            continue
        if pa.types.is_floating(field.type):
            values = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64).view(np.float64)
            values[: len(SPECIAL_FLOATS)] = SPECIAL_FLOATS[:n]
            columns[field.name] = values
        elif pa.types.is_integer(field.type):
            columns[field.name] = rng.integers(0, 30_000, n).astype(field.type.to_pandas_dtype())
        elif pa.types.is_boolean(field.type):
            columns[field.name] = rng.random(n) < 0.5
        else:
            columns[field.name] = [f"t{i}" for i in rng.integers(0, 50, n)]
    return pa.table(columns, schema=DEVIATION_SCHEMA)


def float_bits(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy(zero_copy_only=False).view(np.int64)


def assert_bitwise_equal(table: pa.Table, expected: pa.Table):
    """Every column equal, the floats bit for bit (NaN payloads, signed zeros and subnormals included)."""
    assert table.column_names == expected.column_names and table.num_rows == expected.num_rows
    for name in expected.column_names:
        if pa.types.is_floating(expected.schema.field(name).type):
            np.testing.assert_array_equal(float_bits(table, name), float_bits(expected, name), err_msg=name)
        else:
            assert table[name].to_pylist() == expected[name].to_pylist(), name


def key_sorted(table: pa.Table) -> pa.Table:
    """The rows in the row key's order, as pandas sorts their keys (an independent sort; the key is unique)."""
    order = table.select(list(ROW_KEY)).to_pandas().sort_values(list(ROW_KEY), kind="stable").index
    return table.replace_schema_metadata(None).take(pa.array(order.to_numpy()))


def test_a_part_holds_its_rows_in_key_order_one_row_group_per_slice(tmp_path, monkeypatch):
    """A part file: its rows in the row key's order, bit for bit the rows given (float64 kept: NaN payloads,
    -0.0, subnormals), zstd, and a row group per (space, alpha, attention type, layer) slice whose statistics
    let a filter on the layer skip the other slices."""
    import pyarrow.dataset as ds

    monkeypatch.setattr(storage, "MIN_ROW_GROUP_ROWS", 5)  # slices of 12 rows here
    run_dir = storage.create_run_directory(tmp_path, "model")
    rows = scrambled_rows((3, 1), seed=1)
    path = storage.write_part(run_dir, 0, rows, {"examples": [3, 1]})
    written = pq.read_table(path).replace_schema_metadata(None)
    assert_bitwise_equal(written, key_sorted(rows))
    metadata = pq.read_metadata(path)
    assert metadata.num_row_groups == 2 * 2 * 2  # spaces x alphas x layers
    for group in range(metadata.num_row_groups):
        for column in range(metadata.num_columns):
            chunk = metadata.row_group(group).column(column)
            assert chunk.compression == "ZSTD", chunk.path_in_schema
    fragment = next(ds.dataset(path).get_fragments())
    kept = fragment.split_by_row_group(ds.field("layer") == 1)
    assert len(kept) == 4 and all(f.to_table()["layer"].to_pylist() == [1] * 12 for f in kept)
    small = storage.write_part(run_dir, 1, scrambled_rows((0,), seed=2, layers=1, heads=1, queries=1), {})
    assert pq.read_metadata(small).num_row_groups == 1  # 4 rows: one row group


def test_parts_written_before_this_writer_still_read(tmp_path):
    """A run whose parts were written the old way (snappy, plain floats, one row group, rows in the order
    they were solved) beside parts of this writer: readers and export take both."""
    run_dir = storage.create_run_directory(tmp_path, "model")
    old = scrambled_rows((5, 2), seed=3)
    pq.write_table(old, storage.part_path(run_dir, 0), compression="snappy",
                   use_dictionary=[f.name for f in old.schema if not pa.types.is_floating(f.type)])
    new = scrambled_rows((4, 0), seed=4)
    storage.write_part(run_dir, 1, new, {"examples": [4, 0]})
    both = pa.concat_tables([old, new])
    assert_bitwise_equal(key_sorted(export.read_deviations(run_dir)), key_sorted(both))
    to = tmp_path / "all.parquet"
    assert export.export(run_dir, to) == both.num_rows
    assert_bitwise_equal(pq.read_table(to), key_sorted(both))


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_export_writes_the_rows_in_the_row_keys_order(tmp_path, suffix):
    """Examples interleaved across parts (the plan takes texts longest first): the exported file holds the
    rows sorted by the row key, as Run.rows has them, bit for bit (the CSV: every value read back equal)."""
    from pyarrow import csv

    run_dir = storage.create_run_directory(tmp_path, "model")
    parts = [scrambled_rows(examples, seed=batch) for batch, examples in enumerate([(7, 2), (0, 9), (4,)])]
    for batch, rows in enumerate(parts):
        storage.write_part(run_dir, batch, rows, {})
    to = tmp_path / f"all{suffix}"
    assert export.export(run_dir, to) == sum(rows.num_rows for rows in parts)
    expected = key_sorted(pa.concat_tables(parts))
    if suffix == ".csv":
        read = csv.read_csv(to, convert_options=csv.ConvertOptions(column_types=DEVIATION_SCHEMA))
        assert read.column_names == expected.column_names
        for name in expected.column_names:  # a NaN's payload is not written in text: compare NaN as NaN
            got, want = read[name].to_numpy(zero_copy_only=False), expected[name].to_numpy(zero_copy_only=False)
            if pa.types.is_floating(expected.schema.field(name).type):
                np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
                finite = ~np.isnan(want)
                np.testing.assert_array_equal(got[finite].view(np.int64), want[finite].view(np.int64), err_msg=name)
            else:
                np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        assert_bitwise_equal(pq.read_table(to), expected)


def test_only_repeating_columns_are_dictionary_encoded(run_dir, tmp_path):
    """Part files and exports keep dictionaries for names, indices and flags, none for the float
    measurements (a dictionary tried on them and abandoned costs time and space), and read back exact."""
    to = tmp_path / "all.parquet"
    export.export(run_dir, to)
    for path in (storage.part_path(run_dir, 0), to):
        chunks = pq.ParquetFile(path).metadata.row_group(0)
        for i in range(chunks.num_columns):
            column = chunks.column(i)
            kind = DEVIATION_SCHEMA.field(column.path_in_schema).type
            if pa.types.is_boolean(kind):
                continue  # parquet writes flags bit-packed, never with a dictionary
            dictionary = column.dictionary_page_offset is not None
            assert dictionary != pa.types.is_floating(kind), (path.name, column.path_in_schema, column.encodings)
    assert pq.read_table(storage.part_path(run_dir, 0)).replace_schema_metadata(None).equals(batch_table(0))


def test_empty_run_reads_as_no_rows(tmp_path):
    run_dir = storage.create_run_directory(tmp_path, "model")
    table = export.read_deviations(run_dir)
    assert table.num_rows == 0 and table.schema == DEVIATION_SCHEMA
    assert len(pd.read_parquet(run_dir / "deviations.parquet")) == 0


# ---------------------------------------------------------------------------------------------- liveness


def running_manifest(**process) -> dict:
    identity = storage.process_identity()
    return {"status": "running", "process": storage.heartbeat({**identity, **process}, 600.0)}


def test_a_live_writer_is_running():
    assert storage.with_liveness(running_manifest())["status"] == "running"


def test_a_dead_writer_is_interrupted():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = storage.with_liveness(running_manifest(pid=child.pid, start_ticks=None))
    assert gone["status"] == "interrupted" and f"process {child.pid}" in gone["stop_reason"]


def test_a_killed_unreaped_child_is_interrupted():
    if not sys.platform.startswith("linux"):
        pytest.skip("process states are read from /proc")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        manifest = running_manifest(pid=child.pid, start_ticks=None)
        assert storage.with_liveness(manifest)["status"] == "running"
        os.kill(child.pid, 9)
        deadline = time.time() + 10
        while storage.with_liveness(manifest)["status"] == "running" and time.time() < deadline:
            time.sleep(0.02)
        assert storage.with_liveness(manifest)["status"] == "interrupted"  # a zombie until reaped
    finally:
        child.kill()
        child.wait()


def test_a_reused_pid_is_not_the_writer():
    """Our own pid, but another start time: the run's process is gone and the pid was reused."""
    if storage.process_identity()["start_ticks"] is None:
        pytest.skip("no process start times on this platform")
    manifest = running_manifest(start_ticks=storage.process_identity()["start_ticks"] - 1)
    assert storage.with_liveness(manifest)["status"] == "interrupted"


def test_another_host_is_judged_by_its_heartbeat():
    fresh = running_manifest(host=socket.gethostname() + "-elsewhere")
    assert storage.with_liveness(fresh)["status"] == "running"
    stale = json.loads(json.dumps(fresh))
    stale["process"]["heartbeat_unix"] -= 601
    judged = storage.with_liveness(stale)
    assert judged["status"] == "interrupted" and "heartbeat" in judged["stop_reason"]


def test_finished_runs_are_left_alone():
    assert storage.with_liveness({"status": "complete", "process": {"pid": -5}})["status"] == "complete"


def test_export_sorts_many_parts_in_buckets_far_smaller_than_the_run(tmp_path, monkeypatch):
    """The export's bucket sort (probe.store.keyorder) with buckets of 500 rows on a run of 86,400 rows in 3 parts:
    the file equals an independent sort of every row, bit for bit, and no more than about a bucket's rows
    were ever sorted in memory at once.  Where even the summary of the slices does not fit the budget, the
    error says how to raise it (no DuckDB traceback)."""
    from probe.store import engine as query
    from probe.store import keyorder

    run_dir = storage.create_run_directory(tmp_path, "model")
    parts = [scrambled_rows(range(i, 120, 3), seed=i, layers=2, heads=3, queries=30) for i in range(3)]
    for batch, rows in enumerate(parts):  # each part's examples interleave with the others' (longest first)
        storage.write_part(run_dir, batch, rows, {})
    expected = key_sorted(pa.concat_tables(parts))
    monkeypatch.setattr(keyorder, "BUCKET_ROWS", 500)
    monkeypatch.setattr(keyorder, "FLUSH_ROWS", 700)
    seen = {}
    original = keyorder.batches_in_key_order
    monkeypatch.setattr(export, "batches_in_key_order",
                        lambda *args, **kwargs: original(*args, **{**kwargs, "stats": seen}))
    to = tmp_path / "all.parquet"
    assert export.export(run_dir, to) == expected.num_rows == 86_400
    assert_bitwise_equal(pq.read_table(to), expected)
    assert seen["rows"] == 86_400 and seen["buckets"] >= 86_400 // 500
    assert seen["largest_bucket"] <= 2 * 500, seen  # ranges of equal width: about a bucket's rows each

    monkeypatch.setattr(query, "MIN_DUCKDB_MEMORY", 1 << 10)
    monkeypatch.setenv(query.MEMORY_BUDGET_ENV, "4KB")
    with pytest.raises(ProbeError, match=f"{query.MEMORY_BUDGET_ENV}=4GB") as error:
        export.export(run_dir, tmp_path / "again.parquet")
    assert "Traceback" not in str(error.value)


def test_the_bucket_sort_packs_many_slices_into_the_files_it_may_open(tmp_path, monkeypatch):
    """Where the process may open only a few files, the 48 (space, alpha, layer, head) stretches of a run
    share 4 buckets at most (small slices packed together, larger buckets), and the order is still exact."""
    from probe.store import keyorder

    rows = pa.concat_tables([scrambled_rows(range(i, 60, 2), seed=i, layers=3, heads=4, queries=5) for i in range(2)])
    paths = []
    for i, part in enumerate((rows.slice(0, rows.num_rows // 2), rows.slice(rows.num_rows // 2))):
        paths.append(tmp_path / f"part-{i}.parquet")
        pq.write_table(storage._in_key_order(part), paths[-1])
    monkeypatch.setattr(keyorder, "max_open_buckets", lambda: 5)
    monkeypatch.setattr(keyorder, "BUCKET_ROWS", 10)
    seen = {}
    got = pa.Table.from_batches(list(keyorder.batches_in_key_order(paths, DEVIATION_SCHEMA, ROW_KEY, stats=seen)))
    assert 1 < seen["buckets"] <= 5 and seen["rows"] == rows.num_rows == 14_400
    assert_bitwise_equal(got, key_sorted(rows))


def test_the_bucket_sort_reads_a_part_without_the_space_and_alpha_columns(tmp_path):
    """A part of an old run, written before rows had a space and an alpha, beside a new one: its rows come
    out with nulls there, after the new part's (nulls last), as DuckDB's union by name reads them."""
    from probe.store import keyorder

    new = storage._in_key_order(scrambled_rows(range(0, 6), seed=5, layers=1, heads=2, queries=3))
    old = storage._in_key_order(scrambled_rows(range(6, 12), seed=6, layers=1, heads=2, queries=3))
    old = old.filter(pc.and_(pc.equal(old["space"], "hidden"), pc.equal(old["alpha"], 1.0)))
    pq.write_table(new, tmp_path / "part-0.parquet")
    pq.write_table(old.drop_columns(["space", "alpha"]), tmp_path / "part-1.parquet")
    files = [tmp_path / "part-0.parquet", tmp_path / "part-1.parquet"]
    got = pa.Table.from_batches(list(keyorder.batches_in_key_order(files, DEVIATION_SCHEMA, ROW_KEY)))
    nulled = old.set_column(old.schema.get_field_index("space"), "space", pa.nulls(old.num_rows, pa.string()))
    nulled = nulled.set_column(nulled.schema.get_field_index("alpha"), "alpha", pa.nulls(old.num_rows, pa.float64()))
    want = pa.concat_tables([new, nulled.cast(new.schema)]).to_pandas()
    want = want.sort_values(list(ROW_KEY), na_position="last", kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(got.to_pandas()[list(ROW_KEY)], want[list(ROW_KEY)])
    assert got.num_rows == new.num_rows + old.num_rows


def test_the_bucket_sort_orders_rows_that_arrive_out_of_key_order(tmp_path):
    """A part file written by other code, its rows in no order and a NaN alpha among the slices: the rows
    come out in the key's order all the same (pandas' sort, NaN and nulls last), each exactly once."""
    from probe.store import keyorder

    rows = scrambled_rows(range(0, 50), seed=4, layers=2, heads=2, queries=4).to_pandas()
    rows.loc[rows.index[::7], "alpha"] = float("nan")
    table = pa.Table.from_pandas(rows, schema=DEVIATION_SCHEMA, preserve_index=False)
    path = tmp_path / "part-x.parquet"
    pq.write_table(table, path, row_group_size=333)  # not in key order, row groups across slices
    got = pa.Table.from_batches(list(keyorder.batches_in_key_order([path], DEVIATION_SCHEMA, ROW_KEY))).to_pandas()
    want = rows.sort_values(list(ROW_KEY), na_position="last", kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[list(ROW_KEY)], want[list(ROW_KEY)])
    assert len(got) == len(rows)


def test_export_keeps_rows_whose_slice_key_is_null(tmp_path):
    """The sort runs per (space, alpha, type, layer) slice, selected by equality, which SQL's NULL never
    satisfies: rows without a space or an alpha (old runs) are exported all the same, in the order one
    sort of every row gives them (pandas' sort, nulls last)."""
    run_dir = storage.create_run_directory(tmp_path, "model")
    rows = scrambled_rows((3, 1), seed=9).to_pandas()
    rows.loc[rows.index[::3], "space"] = None
    rows.loc[rows.index[1::3], "alpha"] = None
    table = pa.Table.from_pandas(rows, schema=DEVIATION_SCHEMA, preserve_index=False)
    assert table["space"].null_count > 0 and table["alpha"].null_count > 0
    storage.write_part(run_dir, 0, table, {})
    to = tmp_path / "all.parquet"
    assert export.export(run_dir, to) == len(rows)
    got = pq.read_table(to).to_pandas()
    want = rows.sort_values(list(ROW_KEY), na_position="last", kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[list(ROW_KEY)], want[list(ROW_KEY)])
