"""A run's rows read whole (:func:`read_deviations`, :func:`read_interventions`) and exported into one
Parquet or CSV file in key order (:func:`export`), streamed in memory that does not grow with the rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from probe.core.destination import MIN_FREE_BYTES, check_destination, writing
from probe.core.environment import check_environment
from probe.core.errors import ProbeError
from probe.core.schema import (
    DEVIATION_SCHEMA,
    INTERVENTION_KEY,
    INTERVENTION_SCHEMA,
    ROW_KEY,
)
from probe.store.integrity import DamagedRunWarning, require_intact
from probe.store.keyorder import batches_in_key_order
from probe.store.storage import (
    INTERVENTIONS,
    PART_NAME,
    PARTS,
    parquet_options,
    read_manifest,
    replace_atomically,
    run_tables,
)


def deviations_dataset(path: Path, files=None) -> ds.Dataset:
    """The deviations table at ``path`` (a run's parts directory, or a single exported parquet file);
    ``files``: the part files to read (default: every one in the directory)."""
    path = Path(path)
    if path.is_dir() or files is not None:
        if files is None:
            files = [p for p in path.iterdir() if PART_NAME.match(p.name)]
        files = sorted(str(p) for p in files)
        return ds.dataset(files, format="parquet", schema=None if files else DEVIATION_SCHEMA)
    return ds.dataset(str(path), format="parquet")


def read_deviations(run_dir: Path, columns=None, *, allow_damaged: bool = False) -> pa.Table:
    """Every finished batch's rows of a run, in batch order (``columns``: a subset to read), after
    :func:`require_intact`; a damaged run is refused unless ``allow_damaged`` (then with a warning)."""
    check = require_intact(run_dir, allow_damaged=allow_damaged)
    if check.damaged:
        import warnings

        warnings.warn(check.banner(), DamagedRunWarning, stacklevel=2)
    return deviations_dataset(Path(run_dir) / PARTS, files=check.readable.values()).to_table(columns=columns)


#: what ``export`` writes, by the extension of its target
EXPORT_FORMATS = {".parquet": "Parquet", ".csv": "CSV"}


def read_interventions(run_dir: Path, columns=None, *, allow_damaged: bool = False) -> pa.Table:
    """The intervention records of a run with ``--intervene`` (:data:`INTERVENTIONS`), in batch order, after
    :func:`require_intact` on that table; a run without them is refused with what to do."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if INTERVENTIONS not in run_tables(manifest):
        raise ProbeError(
            f"{run_dir} has no interventions: it was run without --intervene. Run the model again with "
            "`probe run ... --intervene exact,second-order,null`."
        )
    check = require_intact(run_dir, manifest, allow_damaged=allow_damaged, table=INTERVENTIONS)
    if check.damaged:
        import warnings

        warnings.warn(check.banner(), DamagedRunWarning, stacklevel=2)
    files = sorted(str(p) for p in check.readable.values())
    if not files:
        return INTERVENTION_SCHEMA.empty_table() if columns is None else INTERVENTION_SCHEMA.empty_table().select(columns)
    return ds.dataset(files, format="parquet").to_table(columns=columns)


#: rows per row group of an exported Parquet file
EXPORT_ROW_GROUP_ROWS = 1 << 17


def export(run_dir: Path, to: Path, *, allow_damaged: bool = False, manifest: dict | None = None,
           table: str = PARTS) -> int:
    """Write a run's rows into one file, in the format its extension names (:data:`EXPORT_FORMATS`):
    Parquet (row groups of :data:`EXPORT_ROW_GROUP_ROWS` rows) or CSV (with a header line); return the row count.

    The rows are in their key's order, as ``Run.rows`` has them (:data:`probe.core.schema.ROW_KEY`; the
    interventions' :data:`probe.core.schema.INTERVENTION_KEY`), sorted out of core by a bucket sort
    (:mod:`probe.store.keyorder`) whose memory does not grow with the rows, and they stream into the file batch by
    batch.

    The parts are checked first (:func:`require_intact`): a damaged run is refused unless
    ``allow_damaged``, and then a Parquet file's metadata carries the banner under ``probe.damaged``."""
    check_environment()
    run_dir, to = Path(run_dir), Path(to)
    if to.suffix.lower() not in EXPORT_FORMATS:
        raise ProbeError(
            f"--to {to}: probe writes {' or '.join(f'{kind} ({suffix})' for suffix, kind in EXPORT_FORMATS.items())}, "
            f"chosen by the file's extension, and '{to.suffix or '(none)'}' is neither. Name the file *.parquet or *.csv."
        )
    parts = run_dir / table
    if table != PARTS and (run_dir / PARTS).is_dir() and not parts.is_dir():
        raise ProbeError(f"{run_dir} has no {table}: it was run without --intervene. Export --table deviations, "
                         "or run the model again with --intervene.")
    if not parts.is_dir():
        raise ProbeError(f"{parts} is not a directory of part files: {run_dir} is not a probe run directory.")
    if to.exists():
        raise ProbeError(f"{to} exists already. Choose another --to, or delete it first.")
    if not to.parent.is_dir():
        raise ProbeError(f"The directory of --to ({to.parent}) does not exist. Create it first.")
    if to.resolve().is_relative_to(parts.resolve()):
        raise ProbeError(f"--to {to} is inside the run's parts directory; choose a file outside {parts}.")
    # writable, with room for about the parts' bytes, before the parts are read
    check_destination(to, "to", kind="file", room=max(MIN_FREE_BYTES, sum(p.stat().st_size for p in parts.iterdir())))
    check = require_intact(run_dir, manifest, allow_damaged=allow_damaged, table=table)
    files = sorted(check.readable.values())
    if files:
        schema = pq.read_schema(files[0]).remove_metadata()
    elif table == PARTS:
        schema = DEVIATION_SCHEMA
    else:
        schema = INTERVENTION_SCHEMA
    key = ROW_KEY if table == PARTS else INTERVENTION_KEY
    rows = 0

    def write(handle):
        nonlocal rows
        if to.suffix.lower() == ".csv":
            from pyarrow import csv

            with csv.CSVWriter(handle, schema) as writer:
                for batch in batches_in_key_order(files, schema, key):
                    writer.write_batch(batch)
                    rows += batch.num_rows
            return
        damaged = {b"probe.damaged": check.banner().encode()} if check.damaged else None
        with pq.ParquetWriter(handle, schema.with_metadata(damaged) if damaged else schema,
                              **parquet_options(schema)) as writer:
            group: list[pa.RecordBatch] = []  # the batches of the row group being filled, and their rows
            filled = 0
            for batch in batches_in_key_order(files, schema, key):
                group.append(batch)
                rows, filled = rows + batch.num_rows, filled + batch.num_rows
                if filled >= EXPORT_ROW_GROUP_ROWS:
                    writer.write_table(pa.Table.from_batches(group), row_group_size=EXPORT_ROW_GROUP_ROWS)
                    group, filled = [], 0
            if group:
                writer.write_table(pa.Table.from_batches(group), row_group_size=EXPORT_ROW_GROUP_ROWS)

    with writing("the export", to):
        replace_atomically(to, write)
    return rows


def export_table(table: pa.Table, to: Path, what: str = "the export") -> int:
    """Write one small table (a run's aggregates as a table) into ``to``: Parquet or CSV by its extension, checked
    as :func:`export` checks its target; returns the row count."""
    to = Path(to)
    if to.suffix.lower() not in EXPORT_FORMATS:
        raise ProbeError(
            f"--to {to}: probe writes {' or '.join(f'{kind} ({suffix})' for suffix, kind in EXPORT_FORMATS.items())}, "
            f"chosen by the file's extension, and '{to.suffix or '(none)'}' is neither. Name the file *.parquet or *.csv."
        )
    if to.exists():
        raise ProbeError(f"{to} exists already. Choose another --to, or delete it first.")
    if not to.parent.is_dir():
        raise ProbeError(f"The directory of --to ({to.parent}) does not exist. Create it first.")
    check_destination(to, "to", kind="file", room=MIN_FREE_BYTES)

    def write(handle):
        if to.suffix.lower() == ".csv":
            from pyarrow import csv

            csv.write_csv(table, handle)
        else:
            pq.write_table(table, handle, compression="zstd")

    with writing(what, to):
        replace_atomically(to, write)
    return table.num_rows
