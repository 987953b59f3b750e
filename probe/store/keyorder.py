"""A run's rows in their key's order, out of core, in memory that does not grow with the rows (the export's sort).

``probe export`` writes the rows in the order of their key (:data:`probe.core.schema.ROW_KEY`: space, alpha,
attention type, layer, head, example, query; the interventions' :data:`probe.core.schema.INTERVENTION_KEY`).  A
general out-of-core sort (DuckDB's) needs memory that grows with what it sorts: its merge holds a block of
every sorted run, and on 10^8 rows a (space, alpha, type, layer) slice needs more than 128 MB.  The key's layout makes a simpler sort possible, a bucket sort in two passes:

1. A summary (DuckDB, key columns only): for every *group* (the key's first :data:`GROUP_COLUMNS` columns) and
   every value of the *lead* columns between the group and ``example`` (the head; none for interventions),
   the rows and the smallest and largest ``example``.
2. The key order is cut into *cells*: each lead's examples in equal ranges, so many that a cell holds about
   a bucket's rows (:func:`bucket_rows`: a share of the readers' memory budget).  Consecutive cells are
   packed into *buckets* of at most about that many rows (small slices share a bucket), so a bucket is a
   contiguous stretch of the key order.  Every part file is read once, batch by batch, and each row is
   appended to its bucket's spill file (Arrow IPC, LZ4) with its cell's number.  Then each bucket in turn
   is read back, sorted in memory by (cell, the rest of the key), and handed on.

Memory: the batch being read, the rows buffered before a flush (:func:`flush_rows`), and one bucket with its
sorted copy: about six buckets' rows, :data:`SORT_SHARE` of the budget, whatever the run's size.  A cell holds
about a bucket's rows when a run's examples are of similar lengths; ranges of equal width hold more rows
where the examples are longer, at most by the ratio of the longest to the mean.  A bucket is a spill file
open until every part is read: at most :data:`MAX_BUCKETS` of them, or half the files the process may open,
so a run too large for that many buckets gets larger ones.  The spill files hold the whole run at once,
about 90 bytes a row, in the system's temporary directory; each is deleted once it is sorted.
"""
from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from probe.core.errors import ProbeError

#: the key's leading columns whose every value is sorted separately: a (space, alpha, attention type, layer)
#: slice of the rows (each part file has a row group per slice), or the interventions' (space, alpha,
#: substitute, site)
GROUP_COLUMNS = 4
#: the key column that cells are ranges of
RANGE_COLUMN = "example"
#: the share of the readers' memory budget (``PROBE_MEMORY_BUDGET``) the sort's rows may take: a bucket, its
#: sorted copy, the rows buffered for the spill files and the batch being read, six buckets' rows in all
SORT_SHARE = 1 / 8
#: a bucket's rows at least, whatever the budget
MIN_BUCKET_ROWS = 1024
#: rows a bucket holds, about (what is sorted in memory at once); None: from the budget (:func:`bucket_rows`)
BUCKET_ROWS: int | None = None
#: buckets (spill files) open at once at most (a run too large for them gets larger buckets)
MAX_BUCKETS = 1024
#: rows buffered (over every bucket) before they go to the spill files, and rows per batch read from a part;
#: None: two buckets' rows
FLUSH_ROWS: int | None = None
#: rows per batch handed on
OUT_BATCH_ROWS = 1 << 14
#: DuckDB's memory limit for the summary of the groups (or the readers' share of the budget, if less)
SUMMARY_MEMORY = 128 << 20


@dataclass(frozen=True)
class Lead:
    """One value of the lead columns within a group: its rows, examples and cells."""

    value: tuple
    rows: int
    first: int  # smallest example
    last: int  # largest example
    cells: int = 1
    offset: int = 0  # the number of its first cell, counted over every group and lead in key order

    def cell(self, examples: np.ndarray) -> np.ndarray:
        """The cell of each of ``examples`` (of this lead): equal ranges of examples."""
        return self.offset + ((examples - self.first) * self.cells) // (self.last - self.first + 1)


#: the spill files' column that holds a row's cell
CELL = "__cell"


def batches_in_key_order(files: Sequence[Path], schema: pa.Schema, key: Sequence[str], *,
                         stats: dict | None = None) -> Iterator[pa.RecordBatch]:
    """The rows of part ``files``, with ``schema``'s columns, in the order of the columns ``key``, as record
    batches of at most :data:`OUT_BATCH_ROWS` rows (see the module's docstring).  ``stats``, if given, is
    filled with ``rows``, ``buckets`` and ``largest_bucket`` (the most rows held sorted at once)."""
    if not files:
        return
    key = list(key)
    group, within = key[:GROUP_COLUMNS], key[GROUP_COLUMNS:]
    if RANGE_COLUMN not in within or len(within[:within.index(RANGE_COLUMN)]) > 1:
        raise ValueError(f"key {key} is not (group, [one lead column], {RANGE_COLUMN}, ...)")
    lead_columns = within[:within.index(RANGE_COLUMN)]
    layout, buckets = _summary(files, schema, group, lead_columns)
    stats = stats if stats is not None else {}
    stats.update(rows=0, buckets=int(buckets[-1]) + 1 if len(buckets) else 0, largest_bucket=0)
    sort_keys = [(CELL, "ascending")] + [(column, "ascending") for column in within]
    spill_root = Path(tempfile.mkdtemp(prefix="probe-export-"))
    try:
        for path in _distribute(files, schema, group, lead_columns, layout, buckets, spill_root):
            if path is None:
                continue
            with pa.OSFile(str(path)) as source:
                table = pa.ipc.open_stream(source).read_all().combine_chunks()
            path.unlink()
            stats["largest_bucket"] = max(stats["largest_bucket"], table.num_rows)
            ordered = table.take(pc.sort_indices(table, sort_keys=sort_keys)).drop_columns([CELL])  # nulls last
            del table
            stats["rows"] += ordered.num_rows
            yield from ordered.to_batches(OUT_BATCH_ROWS)
            del ordered
    finally:
        shutil.rmtree(spill_root, ignore_errors=True)
    expected = sum(lead.rows for _, leads in layout for lead in leads)
    if stats["rows"] != expected:  # every row in exactly one bucket: a row no bucket took would be lost
        raise ProbeError(f"The export's sort gave {stats['rows']:,} of the run's {expected:,} rows, so nothing was "
                         "written. This is a bug in probe: please report it with the run's manifest.json.")


def _summary(files, schema: pa.Schema, group: list[str], lead_columns: list[str]):
    """Every group's values in key order (nulls last) with its leads and their cells (one DuckDB query over
    the key columns), and the bucket of every cell."""
    import duckdb

    from probe.store.engine import (
        DUCKDB_SHARE,
        MIN_DUCKDB_MEMORY,
        connect,
        memory_budget,
        name,
        over_budget,
        parquet_source,
        same_columns,
    )

    listed = ", ".join(map(name, group + lead_columns))
    share = max(int(memory_budget() * DUCKDB_SHARE), MIN_DUCKDB_MEMORY)
    # A few hundred groups need little memory.  Measured on 5,600 part files (10^8 rows): DuckDB's footer
    # cache and reading the files by name (when their columns differ) took 200 and 330 MB more.
    connection = connect(memory_limit=min(share, SUMMARY_MEMORY), threads=1)
    try:
        connection.execute("SET parquet_metadata_cache = false")
        found = connection.sql(
            f"SELECT {listed}, count(*), min({name(RANGE_COLUMN)}), max({name(RANGE_COLUMN)}) "
            f"FROM {parquet_source(files, union_by_name=not same_columns(files))} GROUP BY {listed} ORDER BY {listed}"
        ).fetchall()  # nulls last
    except duckdb.OutOfMemoryException as error:
        raise over_budget(error, "Listing the rows' slices", "and export again") from None
    finally:
        connection.close()
    layout: list[tuple[tuple, list[Lead]]] = []
    for record in found:
        values, lead, (rows, first, last) = tuple(record[:len(group)]), tuple(record[len(group):-3]), record[-3:]
        if first is None or any(v is None for v in lead):
            raise ValueError(f"rows without a {RANGE_COLUMN} or {lead_columns} in the group {values}")
        if not layout or _group_key(layout[-1][0]) != _group_key(values):
            layout.append((values, []))
        layout[-1][1].append(Lead(lead, rows, int(first), int(last)))  # its cells: once every row is counted
    total = sum(lead.rows for _, leads in layout for lead in leads)
    # consecutive buckets together hold more than `size` rows, so there are at most 2 total / size + 1 of them
    size = max(bucket_rows(schema), math.ceil(2 * total / max(1, max_open_buckets() - 1)))
    sized, offset, cell_rows = [], 0, []
    for values, leads in layout:
        done = []
        for lead in leads:
            cells = min(max(1, math.ceil(lead.rows / size)), lead.last - lead.first + 1)
            done.append(replace(lead, cells=cells, offset=offset))
            offset += cells
            cell_rows += [lead.rows / cells] * cells
        sized.append((values, done))
    buckets, number, held = np.empty(len(cell_rows), np.int64), 0, 0.0
    for cell, rows in enumerate(cell_rows):  # consecutive cells packed into buckets of at most `size` rows
        if held and held + rows > size:
            number, held = number + 1, 0.0
        buckets[cell], held = number, held + rows
    return sized, buckets


def row_bytes(schema: pa.Schema) -> int:
    """About how many bytes a row of ``schema`` takes in Arrow: fixed-width columns their width, a boolean
    one byte, text 16 (an offset and a short name)."""
    return sum(1 if pa.types.is_boolean(f.type) else f.type.bit_width // 8 if pa.types.is_primitive(f.type) else 16
               for f in schema)


def bucket_rows(schema: pa.Schema) -> int:
    """Rows a bucket holds: :data:`BUCKET_ROWS`, or so many that six buckets of ``schema``'s rows take
    :data:`SORT_SHARE` of the memory budget (125,672 rows of the deviations table under the default 1 GiB)."""
    if BUCKET_ROWS is not None:
        return BUCKET_ROWS
    from probe.store.engine import memory_budget

    return max(MIN_BUCKET_ROWS, int(memory_budget() * SORT_SHARE) // (6 * row_bytes(schema)))


def flush_rows(schema: pa.Schema) -> int:
    """Rows buffered before a flush, and rows per batch read: :data:`FLUSH_ROWS`, or two buckets'."""
    return FLUSH_ROWS if FLUSH_ROWS is not None else 2 * bucket_rows(schema)


def max_open_buckets() -> int:
    """How many buckets may be open at once: :data:`MAX_BUCKETS`, or fewer where the process may open fewer
    files (the soft limit, less a margin for everything else)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_BUCKETS
    return MAX_BUCKETS if soft in (-1, resource.RLIM_INFINITY) else max(16, min(MAX_BUCKETS, soft // 2))


def _group_key(values) -> tuple:
    """Group values as a dictionary key: NaN as one value (NaN != NaN), None as itself."""
    return tuple(("NaN",) if isinstance(v, float) and math.isnan(v) else v for v in values)


def _first_values(table: pa.Table, columns: list[str]) -> tuple:
    """The first row's values of ``columns`` as a group key (a column the table lacks: None, as DuckDB's
    ``union_by_name`` reads it)."""
    return _group_key(table[c][0].as_py() if c in table.column_names else None for c in columns)


def _constant(table: pa.Table, column: str, value) -> bool:
    """Whether every row of ``table`` holds ``value`` (a group key's: None, ``("NaN",)`` or a value) in
    ``column``."""
    if column not in table.column_names:
        return value is None
    data = table[column]
    if value is None:
        return data.null_count == len(data)
    if data.null_count:
        return False
    if value == ("NaN",):
        return pc.all(pc.is_nan(data)).as_py()
    return pc.all(pc.equal(data, pa.scalar(value, data.type))).as_py()


def stretch_starts(table: pa.Table, columns) -> np.ndarray:
    """The rows of ``table`` where a stretch begins: the first, and each that differs from the row before in
    one of ``columns`` (those the table has; nulls equal to nulls).  For a part's rows, in key order, the
    stretches of the slice columns are its slices: the part writer cuts its row groups there too."""
    changed = np.zeros(table.num_rows, bool)
    changed[:1] = True
    for column in (c for c in columns if c in table.column_names):
        codes = table[column].combine_chunks().dictionary_encode().indices
        codes = pc.fill_null(codes, -1).to_numpy(zero_copy_only=False)
        changed[1:] |= codes[1:] != codes[:-1]
    return np.flatnonzero(changed)


def _runs(table: pa.Table, columns: list[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of the stretches of ``table`` over which ``columns`` do not change (a part's rows are
    in key order, so a batch holds few: one per slice)."""
    first = dict(zip(columns, _first_values(table, columns)))
    if all(_constant(table, column, value) for column, value in first.items()):
        return [(0, table.num_rows)]  # the common case (a part's batch inside one slice): no encoding
    starts = stretch_starts(table, columns)
    return list(zip(starts.tolist(), np.r_[starts[1:], table.num_rows].tolist()))


def _conformed(batch: pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """``batch`` with exactly ``schema``'s columns and types (a column a file lacks: nulls)."""
    table = pa.Table.from_batches([batch])
    if table.schema.remove_metadata().equals(schema.remove_metadata()):
        return table
    columns = [table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _distribute(files, schema, group: list[str], lead_columns: list[str], layout, buckets: np.ndarray,
                spill_root: Path):
    """Every row of ``files``, with its cell, into its bucket's spill file, in one pass; the files in the
    buckets' order (None: an empty bucket)."""
    index = {_group_key(values): (leads, np.array([lead.value[0] for lead in leads]) if lead_columns else None)
             for values, leads in layout}  # a group's leads, and their values to look a row's up
    paths: list[Path | None] = [None] * (int(buckets[-1]) + 1 if len(buckets) else 0)
    spilled = schema.append(pa.field(CELL, pa.int64()))
    flush_at = flush_rows(schema)
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    pending: dict[int, list[pa.Table]] = {}
    buffered = 0
    options = pa.ipc.IpcWriteOptions(compression="lz4" if pa.Codec.is_available("lz4") else None)

    def flush():
        nonlocal buffered
        for number, tables in pending.items():
            if number not in writers:
                paths[number] = spill_root / f"bucket-{number}.arrow"
                writers[number] = pa.ipc.new_stream(str(paths[number]), spilled, options=options)
            writers[number].write_table(pa.concat_tables(tables).combine_chunks())
        pending.clear()
        buffered = 0

    def cells_of(table: pa.Table, leads: list[Lead], values: np.ndarray | None) -> np.ndarray:
        examples = table[RANGE_COLUMN].to_numpy(zero_copy_only=False).astype(np.int64)
        if not lead_columns:
            return leads[0].cell(examples)
        which = np.searchsorted(values, table[lead_columns[0]].to_numpy(zero_copy_only=False))
        cells = np.empty(table.num_rows, np.int64)
        for i in np.unique(which).tolist():
            rows = which == i
            cells[rows] = leads[i].cell(examples[rows])
        return cells

    try:
        for file in files:
            reader = pq.ParquetFile(file)
            columns = [c for c in schema.names if c in reader.schema_arrow.names]
            for batch in reader.iter_batches(batch_size=flush_at, columns=columns):
                if not batch.num_rows:
                    continue
                table = _conformed(batch, schema)
                for start, end in _runs(table, group):
                    run = table.slice(start, end - start)
                    cells = cells_of(run, *index[_first_values(run, group)])
                    run = run.append_column(CELL, pa.array(cells))
                    bucket = buckets[cells]
                    if np.any(bucket[1:] < bucket[:-1]):  # a part's rows are in key order, so buckets rise
                        order = np.argsort(bucket, kind="stable")
                        run, bucket = run.take(pa.array(order)), bucket[order]
                    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
                    for a, b in zip(starts.tolist(), np.r_[starts[1:], len(bucket)].tolist()):
                        pending.setdefault(int(bucket[a]), []).append(run.slice(a, b - a))
                buffered += table.num_rows
                if buffered >= flush_at:
                    flush()
        flush()
    finally:
        for writer in writers.values():
            writer.close()
    return paths
