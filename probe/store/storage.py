"""A run directory on disk: part files, the manifest, liveness, readers and export.

Layout of ``RUN_DIR``::

    manifest.json                      the run's settings, progress and totals (always valid JSON)
    .lock                              held (flock) by the process writing the run
    deviations.parquet/                a directory of part files, one per finished batch
        part-000000.parquet            batch 0 (batches are numbered in the run's batch plan)
        part-000001.parquet
        .part-000002.parquet.tmp-4711  a batch being written (ignored by every reader)

Crash safety.  A part file is written under a temporary name that starts with "." and does not end in
``.parquet`` (pyarrow, pandas, DuckDB's and polars' ``*.parquet`` globs all skip it), flushed to disk
with ``fsync``, then renamed to its final name (an atomic step), and the directory entry is synced.
So at every moment, after any kill (SIGKILL and power loss included), the directory holds exactly the
batches that were finished, each whole: ``pandas.read_parquet(RUN_DIR / "deviations.parquet")`` reads
them.  A part file's name identifies its batch, and batches are deterministic given the run's settings,
so redoing a batch rewrites the same file: nothing is ever duplicated.  The manifest is replaced the
same way (temporary file, fsync, rename).

Inside a part file the rows are in the row key's order (:data:`probe.core.schema.ROW_KEY`), with a row group per
(space, alpha, attention type, layer) slice, so that a reader filtering on a slice skips the others; zstd
(:func:`parquet_options`).  A part of a version-1 run (:data:`FORMAT_VERSION`) may hold one row group, its rows
in the order they were solved; every reader takes both.

Format versions.  The manifest records the format of the run directory as ``format_version``
(:data:`FORMAT_VERSION`); a manifest without it is version 1, and :func:`read_manifest` refuses a version
newer than this probe's.  Resume keeps a run's version: its parts are all read as that version's.

Each part carries, in its parquet metadata under ``probe.batch``, the batch's number, example indices,
solver/fidelity summary and timing; totals over a run are folded from these, so they are right however
many processes (segments, ranks) wrote the parts.

Part records.  The manifest's ``parts`` list records, for every finished part, what the file must be:
its name, size in bytes, row count and SHA-256.  A part is renamed into place first and recorded at the
manifest's next write (within a second, and at every stop and at the end), so after a kill (SIGKILL,
power loss) between the two a part can be present but *unrecorded*: it is whole by construction (it was
fsynced before its rename), so readers take it after the cheap checks that need no record (its footer
reads, its row count equals its own ``probe.batch`` summary's, its batch number is its name's), and
``probe resume`` reads it in full and records it (or, if that fails, quarantines and recomputes it).
Every reader calls :func:`~probe.store.integrity.check_parts` (cheap: presence, size, footer row count; checksums on request)
and refuses a damaged run (:class:`~probe.store.integrity.DamagedRunError`) unless told to read what is left, never a silent
subset; ``probe resume`` moves damaged parts into ``RUN_DIR/quarantine/`` and recomputes them.

Liveness.  A running run's manifest records the writer's pid, host, process start time and a heartbeat
(updated after every batch).  :func:`read_manifest` reports a ``"running"`` manifest whose process is
gone (same host and that process no longer exists, or another host and the heartbeat is stale) as
``"interrupted"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from probe.core.errors import ProbeError
from probe.core.schema import ROW_KEY
from probe.core.version import __version__
from probe.store.keyorder import stretch_starts

MANIFEST = "manifest.json"
LOCK = ".lock"
PARTS = "deviations.parquet"
#: the second table of a run with ``--intervene`` (probe.interventions): the same part-file layout, one part per batch
INTERVENTIONS = "interventions.parquet"
#: where ``probe resume`` moves damaged part files (outside PARTS, so no reader of PARTS sees them)
QUARANTINE = "quarantine"
#: the manifest's key for the list of part records (file, bytes, rows, sha256 per finished batch)
PART_RECORDS = "parts"
#: The run directory's format, which a new run records in its manifest as ``format_version``.
#:
#: * 3: a run may keep mergeable statistics instead of (or beside) its rows (``--keep``): a third table of parts,
#:   ``aggregates.parquet/`` (:mod:`probe.store.aggregates`), merged into one file when the run completes; its
#:   manifest records what it measured (``selection``: layers, heads, attention types, query positions).
#: * 2: everything this module's docstring describes: part records in the manifest, parts in key order
#:   with a row group per slice, every column of :data:`probe.core.schema.DEVIATION_SCHEMA` (the model named
#:   once, in the manifest's ``model.name``), the settings (``config``) and inputs resume and verify need,
#:   the count of unknown tokens (``unknown_tokens``).
#: * 1: a manifest without ``format_version``.  Such a run may lack any of those: part records (its parts
#:   then pass the checks that need none), key order (one row group in the order solved), the columns
#:   of :data:`probe.query.runs.OPTIONAL_COLUMNS` (read as nulls; ``trivial`` from ``n_keys``), the model's
#:   name (then its id or directory, or a ``model`` column on every row), ``config`` (then it cannot be
#:   resumed), ``inputs`` (then it cannot be re-solved by ``probe verify``) and ``unknown_tokens``.
#:   Every reader takes all three.
FORMAT_VERSION = 3
#: the statistics of a run with ``--keep aggregates`` or ``--keep sample:N`` (probe.store.aggregates): one part per batch
AGGREGATES = "aggregates.parquet"
#: the manifest's list of part records of each table (the deviations' under ``parts``)
TABLE_RECORDS = {PARTS: PART_RECORDS, INTERVENTIONS: "intervention_parts", AGGREGATES: "aggregate_parts"}
#: The key, in each part file's parquet metadata, of the batch's record (JSON).
PART_METADATA_KEY = b"probe.batch"
PART_NAME = re.compile(r"^part-(\d+)\.parquet$")


#: How part files (and exports) are compressed: zstd at this level (higher ones save almost nothing on these
#: columns and write slower).
COMPRESSION, COMPRESSION_LEVEL = "zstd", 1
#: Within a part file, rows are in the row key's order (:data:`probe.core.schema.ROW_KEY`; a version-1 run's
#: may be in the order its sites were solved, which every reader accepts), and a new row group starts where
#: one of these columns changes, so that a reader filtering on a slice (DuckDB, pyarrow, polars and Spark read
#: the row groups' statistics) skips the row groups of the others.
ROW_GROUP_COLUMNS = ("space", "alpha", "attention_type", "layer")
#: ... unless the row group would hold fewer rows than this: small slices share one (their statistics still
#: bound them), since each row group costs its own metadata in the file's footer.
MIN_ROW_GROUP_ROWS = 4096
#: no row group holds more rows than this (pyarrow's own default)
MAX_ROW_GROUP_ROWS = 1 << 20


def parquet_options(schema: pa.Schema) -> dict:
    """How tables are written, losslessly: zstd; dictionaries for the columns whose
    values repeat (names, indices, flags), none for the float measurements (float64, as certified: they rarely
    repeat, and trying a dictionary before falling back made writing 2.7x slower).  The floats are not
    byte-stream-split: that would save a few percent more, but Spark's default Parquet reader cannot decode
    it, and the run directory is meant to be read anywhere."""
    return {
        "compression": COMPRESSION,
        "compression_level": COMPRESSION_LEVEL,
        "use_dictionary": [field.name for field in schema
                           if not (pa.types.is_floating(field.type) or pa.types.is_binary(field.type))],
    }


def _in_key_order(table: pa.Table) -> pa.Table:
    """The rows of a deviations table in the row key's order (other tables as they are)."""
    if not set(ROW_KEY) <= set(table.column_names):
        return table
    return table.sort_by([(name, "ascending") for name in ROW_KEY])


def _row_group_bounds(table: pa.Table) -> list[tuple[int, int]]:
    """``(offset, length)`` of each row group of ``table`` (in the row key's order): a new one where a
    column of :data:`ROW_GROUP_COLUMNS` changes, slices of fewer than :data:`MIN_ROW_GROUP_ROWS` rows merged
    with the next, none longer than :data:`MAX_ROW_GROUP_ROWS`."""
    rows = table.num_rows
    if not set(ROW_KEY) <= set(table.column_names) or rows <= MIN_ROW_GROUP_ROWS:  # not in key order: one
        starts = [0]
    else:
        starts = [0]  # each slice's first row, short slices merged with the next
        for start in stretch_starts(table, ROW_GROUP_COLUMNS)[1:].tolist():
            if start - starts[-1] >= MIN_ROW_GROUP_ROWS:
                starts.append(start)
        if rows - starts[-1] < MIN_ROW_GROUP_ROWS and len(starts) > 1:
            starts.pop()  # a short last slice joins the one before
    bounds = []
    for start, stop in zip(starts, starts[1:] + [rows]):
        for offset in range(start, stop, MAX_ROW_GROUP_ROWS):
            bounds.append((offset, min(MAX_ROW_GROUP_ROWS, stop - offset)))
    return bounds or [(0, 0)]


def _write_table(table: pa.Table, handle) -> None:
    """``table`` as one Parquet file with :func:`parquet_options`, one row group per :func:`_row_group_bounds`."""
    with pq.ParquetWriter(handle, table.schema, **parquet_options(table.schema)) as writer:
        for offset, length in _row_group_bounds(table):
            writer.write_table(table.slice(offset, length), row_group_size=max(length, 1))


# --------------------------------------------------------------------------------------------------
# atomic files


def fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform (Windows): the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    """A hidden sibling name that no reader (nor a ``*.parquet`` / ``*.json`` glob) picks up."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def replace_atomically(path: Path, write) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file, fsync it and rename it into place."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:  # the directory may be gone or read-only by now: the original error is the one to report
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_directory(path.parent)


def write_manifest(run_dir: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, default=str).encode()
    replace_atomically(Path(run_dir) / MANIFEST, lambda handle: handle.write(text))


def read_manifest(run_dir: Path, *, check_liveness: bool = True) -> dict:
    """The run's manifest; a ``"running"`` one whose process is gone is reported as ``"interrupted"``.

    Raises :class:`ProbeError` when the directory or its manifest is missing or unreadable.
    """
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        what = "is a file, not a run directory" if run_dir.exists() else "does not exist"
        raise ProbeError(f"{run_dir} {what}. Pass the run directory printed by `probe run` (it holds manifest.json "
                         "and deviations.parquet), or DIR/NAME for the newest run named NAME.")
    if not path.is_file():
        raise ProbeError(f"{path} does not exist: {run_dir} is not a probe run directory (or its run never started).")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProbeError(f"{path} is not readable JSON ({error}).") from None
    if not isinstance(manifest, dict):
        raise ProbeError(f"{path} does not hold a JSON object.")
    check_format(manifest, path)
    return with_liveness(manifest) if check_liveness else manifest


def format_version(manifest: dict) -> int:
    """The run directory's format (:data:`FORMAT_VERSION`): its manifest's ``format_version``, 1 when it has none."""
    version = manifest.get("format_version", 1)
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def check_format(manifest: dict, path: Path) -> None:
    """Refuse (:class:`ProbeError`) a manifest of a format this probe does not read."""
    version = format_version(manifest)
    if version > FORMAT_VERSION:
        raise ProbeError(
            f"{path} records run format {version}, newer than this probe ({__version__}) reads (up to "
            f"{FORMAT_VERSION}): the run was written by a newer probe. Upgrade probe to read it."
        )
    if version < 1:
        raise ProbeError(f"{path} records format_version {manifest.get('format_version')!r}, which is not a run "
                         "format (a positive integer): the manifest is damaged.")


# --------------------------------------------------------------------------------------------------
# liveness: pid, host, process start time and heartbeat


def _process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), which tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    if fields[0] == "Z":  # a zombie: killed, not yet reaped by its parent
        return -1
    return int(fields[19])


def process_identity() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _process_start_ticks(os.getpid())}


def heartbeat(process: dict, stale_after_s: float) -> dict:
    """``process`` (from :func:`process_identity`) with the current time as its heartbeat."""
    now = time.time()
    return {
        **process,
        "heartbeat_at": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        "heartbeat_unix": now,
        "stale_after_s": stale_after_s,
    }


def writer_alive(process: dict) -> tuple[bool, str]:
    """Whether the process described by a manifest's ``process`` entry still runs, and how we know."""
    pid, host = process.get("pid"), process.get("host")
    if host == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:  # exists, owned by someone else
            alive = True
        ticks = _process_start_ticks(pid)
        if ticks == -1 or (alive and None not in (ticks, process.get("start_ticks")) and ticks != process["start_ticks"]):
            alive = False  # a zombie, or the pid now belongs to another process
        return alive, f"process {pid} on this host ({host}) {'is running' if alive else 'no longer exists'}"
    age = time.time() - float(process.get("heartbeat_unix") or 0)
    stale = float(process.get("stale_after_s") or 3600)
    return age <= stale, f"last heartbeat from pid {pid} on host {host} {age:,.0f} s ago (stale after {stale:,.0f} s)"


def with_liveness(manifest: dict) -> dict:
    """The manifest, with a ``"running"`` status turned into ``"interrupted"`` if its writer is gone."""
    if manifest.get("status") != "running" or not isinstance(manifest.get("process"), dict):
        return manifest
    alive, how = writer_alive(manifest["process"])
    if alive:
        return manifest
    return {**manifest, "status": "interrupted", "stop_reason": f"killed without a chance to say so: {how}"}


@contextmanager
def writer_lock(run_dir: Path):
    """Hold an exclusive lock on the run directory while writing it (released by the OS even when the
    process is killed), so that two processes never continue the same run at once."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; the liveness check still guards resume
        yield
        return
    try:
        handle = open(Path(run_dir) / LOCK, "a")
    except OSError as error:
        from probe.core.errors import RunIOError

        raise RunIOError(
            f"Cannot open {Path(run_dir) / LOCK} for writing ({error.strerror or error}): the run directory is not "
            "writable (a read-only or full file system, or its permissions). Make it writable, then try again; "
            "nothing was changed."
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ProbeError(
                f"Another probe process is writing {run_dir} (it holds {LOCK}). Wait for it, or stop it first."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# part files


def create_run_directory(out: Path, slug: str) -> Path:
    """A new ``<out>/<slug>-<timestamp>[-k]`` directory with its (empty) parts directory."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for suffix in range(1, 10_000):
            candidate = out / (f"{slug}-{stamp}" + (f"-{suffix}" if suffix > 1 else ""))
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            (candidate / PARTS).mkdir()
            return candidate
    except OSError as error:
        raise ProbeError(f"Cannot create a run directory in {out} ({error}). Choose another --out.") from None
    raise ProbeError(f"Could not create a run directory in {out}: too many runs started this second.")


def part_path(run_dir: Path, batch: int, table: str = PARTS) -> Path:
    return Path(run_dir) / table / f"part-{batch:06d}.parquet"


def run_tables(manifest: dict | None) -> tuple[str, ...]:
    """The tables a run writes: the deviations, the interventions when it was run with ``--intervene``, and the
    aggregates' parts of a run with ``--keep aggregates`` or ``sample:N`` until they are merged into one file
    (:mod:`probe.store.aggregates`: ``aggregates_merged``)."""
    config = (manifest or {}).get("config") or {}
    tables = (PARTS, INTERVENTIONS) if config.get("intervene") else (PARTS,)
    if config.get("keep", "rows") != "rows" and not (manifest or {}).get("aggregates_merged"):
        tables += (AGGREGATES,)
    return tables


def write_part(run_dir: Path, batch: int, table: pa.Table, record: dict, name: str = PARTS) -> Path:
    """Write one batch's rows of table ``name`` atomically; ``record`` (JSON) goes into the file's metadata."""
    path = part_path(run_dir, batch, name)
    metadata = {**(table.schema.metadata or {}), PART_METADATA_KEY: json.dumps({"batch": batch, **record}).encode()}
    table = _in_key_order(table).replace_schema_metadata(metadata)
    replace_atomically(path, lambda handle: _write_table(table, handle))
    return path


def part_record(path: Path) -> dict:
    """The ``probe.batch`` record stored in a part file (read from its footer only)."""
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[PART_METADATA_KEY])


def part_files(run_dir: Path, table: str = PARTS) -> dict[int, Path]:
    """Batch number -> its part file, for every finished batch of the run (a directory listing only)."""
    parts = Path(run_dir) / table
    files = {}
    if parts.is_dir():
        for name in sorted(os.listdir(parts)):
            match = PART_NAME.match(name)
            if match:
                files[int(match.group(1))] = parts / name
    return files


def finished_batches(run_dir: Path) -> dict[int, dict]:
    """Batch number -> its part file's record, for every finished batch of the run."""
    return {batch: part_record(path) for batch, path in part_files(run_dir).items()}


def remove_temporaries(run_dir: Path) -> int:
    """Delete part and manifest files left half-written by a killed process; return how many."""
    removed = 0
    for directory in (Path(run_dir), *(Path(run_dir) / table for table in TABLE_RECORDS)):
        if directory.is_dir():
            for path in directory.iterdir():
                if path.name.startswith(".") and ".tmp-" in path.name:
                    path.unlink(missing_ok=True)
                    removed += 1
    return removed


# --------------------------------------------------------------------------------------------------
# part records and their checks


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def describe_part(path: Path, batch: int | None = None) -> dict:
    """The record of a part file as the manifest keeps it: batch, file name, bytes, rows (from the footer),
    SHA-256 of the whole file."""
    path = Path(path)
    if batch is None:
        batch = int(PART_NAME.match(path.name).group(1))
    return {"batch": batch, "file": path.name, "bytes": path.stat().st_size,
            "rows": pq.read_metadata(path).num_rows, "sha256": file_sha256(path)}


def part_records(manifest: dict, table: str = PARTS) -> dict[int, dict]:
    """Batch number -> its record in the manifest (none in a version-1 run without records: :data:`FORMAT_VERSION`)."""
    records = manifest.get(TABLE_RECORDS[table]) if isinstance(manifest, dict) else None
    return {int(r["batch"]): r for r in records or () if isinstance(r, dict) and "batch" in r}
