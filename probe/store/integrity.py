"""A run's part files checked against their records in the manifest, before any reader trusts them.

:func:`check_parts` (presence, size, footer row count; SHA-256 on request) is what every reader calls;
:func:`require_intact` refuses a damaged run (:class:`DamagedRunError`) unless told to read what is left.
Readers check every recorded part's SHA-256 before they first read it in a process: a byte changed inside
a value, which leaves the size, footer and row count as they were, is caught before any number is trusted.
A part whose checksum matched is not hashed again while its file stays the same (path, size, modification
time, inode), so a process that asks many questions of one run hashes each part once;
:func:`quarantine` and :func:`repair_parts` are ``probe resume``'s repair.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from probe.core.errors import ProbeError
from probe.store.storage import (
    MANIFEST,
    PART_METADATA_KEY,
    PARTS,
    QUARANTINE,
    TABLE_RECORDS,
    describe_part,
    file_sha256,
    fsync_directory,
    part_files,
    part_records,
    read_manifest,
)

#: parts whose SHA-256 matched their record in this process: (path, size, mtime_ns, inode, recorded sha256)
_VERIFIED: set[tuple] = set()


def checksum_matches(path: Path, recorded: str, *, cached: bool) -> bool:
    """Whether ``path``'s SHA-256 is ``recorded``; with ``cached``, a file verified before in this process and
    unchanged since (same size, modification time and inode) is not read again."""
    stat = path.stat()
    key = (str(path.absolute()), stat.st_size, stat.st_mtime_ns, stat.st_ino, recorded)
    if cached and key in _VERIFIED:
        return True
    if file_sha256(path) != recorded:
        _VERIFIED.discard(key)
        return False
    _VERIFIED.add(key)
    return True


class DamagedRunWarning(UserWarning):
    """A reader read a damaged run anyway (``allow_damaged``): its text is the banner naming what was left
    out.  The CLI prints that banner itself and does not repeat it as a warning."""


class DamagedRunError(ProbeError):
    """A reader refused a run whose part files do not match their records (missing, resized, unreadable,
    wrong rows or checksum)."""

    def __init__(self, message: str, check: "PartsCheck"):
        super().__init__(message)
        self.check = check


@dataclass
class PartsCheck:
    """What :func:`check_parts` found in a run directory.

    ``readable``: batch -> part file, for every part that passed (the ones a reader reads);
    ``damaged``: batch -> what is wrong with it (its file is missing, has another size, an unreadable
    footer, other rows or another checksum than recorded); ``unrecorded``: batches whose part is present
    and sound but not (yet) in the manifest's records, as a kill right after a part's rename leaves it.
    """

    run_dir: Path
    status: str | None
    batches_total: int | None
    readable: dict[int, Path] = field(default_factory=dict)
    damaged: dict[int, str] = field(default_factory=dict)
    unrecorded: list[int] = field(default_factory=list)
    checksums: bool = False

    @property
    def ok(self) -> bool:
        return not self.damaged

    def describe(self, limit: int = 8) -> str:
        """``batches 3 (missing), 7 (12,345 bytes, recorded 23,456)``, the first ``limit`` of them."""
        items = [f"{batch} ({why})" for batch, why in sorted(self.damaged.items())]
        more = f" and {len(items) - limit} more" if len(items) > limit else ""
        return f"batch{'es' if len(items) > 1 else ''} {', '.join(items[:limit])}{more}"

    def banner(self) -> str:
        """What a reader told to read a damaged run anyway prints, and puts on what it writes."""
        return (
            f"DAMAGED RUN, read anyway (--allow-damaged): {len(self.damaged)} damaged part(s) left out, "
            f"{self.describe()}; what follows covers {len(self.readable)} of "
            f"{self.batches_total if self.batches_total is not None else '?'} batches. "
            f"Repair with: probe resume {self.run_dir}"
        )


def _footer_problem(path: Path, expected_rows: int | None, batch: int) -> tuple[str | None, int | None]:
    """What is wrong with a part's footer (None if nothing), and its row count."""
    try:
        metadata = pq.read_metadata(path)
    except (OSError, pa.ArrowException) as error:
        return f"unreadable footer: {str(error).splitlines()[0][:120]}", None
    rows = metadata.num_rows
    if expected_rows is not None and rows != expected_rows:
        return f"{rows:,} rows, recorded {expected_rows:,}", rows
    raw = (metadata.metadata or {}).get(PART_METADATA_KEY)
    if expected_rows is None and raw is not None:  # unrecorded: its own batch record must agree with it
        try:
            record = json.loads(raw)
            own_batch = int(record["batch"])
            # the rows the file holds: its own count where the file keeps fewer than it measured (--keep)
            own_rows = record["rows"] if "rows" in record else record.get("summary", {}).get("rows")
        except (KeyError, TypeError, ValueError, AttributeError):
            return "its probe.batch record does not read", rows
        if own_batch != batch:
            return f"holds batch {own_batch}, not {batch}", rows
        if own_rows is not None and own_rows != rows:
            return f"{rows:,} rows, its own record says {own_rows:,}", rows
    return None, rows


def check_parts(run_dir: Path, manifest: dict | None = None, *, checksums: bool = False,
                table: str = PARTS, cached: bool = False) -> PartsCheck:
    """Check a run's part files against the manifest's records: the one check every reader makes.

    Cheap (a directory listing, one ``stat`` and one footer read per part): each recorded part must be
    present with its recorded size and row count; a part present but unrecorded must have a sound footer
    whose row count and batch number agree with its own ``probe.batch`` record; a complete run must have
    a part for every batch of its plan.  ``checksums=True`` also compares every recorded part's SHA-256
    (reads every byte: ``probe resume`` and ``probe verify`` always do); with ``cached`` a part verified
    before in this process and unchanged since is not read again (what readers do).  ``table``: which of
    the run's tables (:data:`~probe.store.storage.PARTS`, :data:`~probe.store.storage.INTERVENTIONS`).
    """
    run_dir = Path(run_dir)
    if manifest is None:  # a run directory whose first manifest is not written yet has no records
        manifest = read_manifest(run_dir) if (run_dir / MANIFEST).exists() else {}
    records = part_records(manifest, table)
    try:
        present = part_files(run_dir, table)
    except OSError as error:
        raise ProbeError(f"Cannot list {run_dir / table} ({error.strerror or error}): check its permissions.") from None
    total = manifest.get("batches_total")
    check = PartsCheck(run_dir, manifest.get("status"), total if isinstance(total, int) else None,
                       checksums=checksums)
    expected = set(records)
    if check.status == "complete" and check.batches_total is not None:
        expected |= set(range(check.batches_total))  # a complete run has every batch (records or not: a version-1 run)
    for batch in sorted(expected | set(present)):
        path, record = present.get(batch), records.get(batch)
        if path is None:
            check.damaged[batch] = "missing" + ("" if record else ", never recorded")
            continue
        try:
            if record is not None:
                size = path.stat().st_size
                if size != record["bytes"]:
                    check.damaged[batch] = f"{size:,} bytes, recorded {record['bytes']:,}"
                    continue
            problem, _ = _footer_problem(path, record["rows"] if record else None, batch)
            if problem is None and record is not None and checksums and record.get("sha256") and \
                    not checksum_matches(path, record["sha256"], cached=cached):
                problem = "SHA-256 differs from the recorded one"
        except OSError as error:  # unreadable (permissions, an I/O error) or gone since the listing
            problem = f"unreadable: {error.strerror or error}"
        if problem is not None:
            check.damaged[batch] = problem
            continue
        if record is None:
            check.unrecorded.append(batch)
        check.readable[batch] = path
    return check


def require_intact(run_dir: Path, manifest: dict | None = None, *, allow_damaged: bool = False,
                   checksums: bool = True, table: str = PARTS) -> PartsCheck:
    """:func:`check_parts` with the checksums (each part hashed once per process while it stays the same),
    refusing a damaged run with a message that names the batches and what is wrong
    (:class:`DamagedRunError`), unless ``allow_damaged``: then the caller reads ``check.readable`` and
    shows ``check.banner()``."""
    check = check_parts(run_dir, manifest, checksums=checksums, table=table, cached=True)
    if check.damaged and not allow_damaged:
        what = "" if table == PARTS else f" (its {table})"
        raise DamagedRunError(
            f"{run_dir} is damaged{what}: {check.describe()}. Its other parts are intact, but reading it now would "
            f"silently leave these batches out. Repair it with `probe resume {run_dir}` (it moves the damaged "
            f"parts to {Path(run_dir) / QUARANTINE} and recomputes them; `probe verify {run_dir}` checks every "
            "part and a sample of rows), or pass --allow-damaged to read what is left, marked as such.",
            check,
        )
    return check


def quarantine(run_dir: Path, batches, table: str = PARTS) -> Path | None:
    """Move the part files of ``batches`` (those present) into ``RUN_DIR/quarantine/<time>/``
    (``.../<time>/<table>/`` for a table other than the deviations); return it."""
    run_dir = Path(run_dir)
    present = part_files(run_dir, table)
    moving = [present[b] for b in sorted(batches) if b in present]
    if not moving:
        return None
    target = run_dir / QUARANTINE / datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    if table != PARTS:
        target = target / table
    target.mkdir(parents=True)
    for path in moving:
        shutil.move(str(path), target / path.name)
    fsync_directory(run_dir / table)
    return target


def repair_parts(run_dir: Path, manifest: dict, table: str = PARTS) -> tuple[PartsCheck, Path | None]:
    """Before a resume: check every part in full (checksums; an unrecorded part is read whole), move the
    damaged ones to the quarantine folder and drop their records; record the sound unrecorded ones.
    Returns the check and the quarantine folder (None when nothing moved).  ``manifest`` is updated."""
    key = TABLE_RECORDS[table]
    check = check_parts(run_dir, manifest, checksums=True, table=table)
    for batch in list(check.unrecorded):
        path = check.readable[batch]
        try:
            rows = pq.read_table(path).num_rows  # every page decoded, not only the footer
            record = describe_part(path, batch)
            if rows != record["rows"]:
                raise ValueError(f"{rows} rows decoded, footer says {record['rows']}")
        except (OSError, ValueError, pa.ArrowException) as error:
            check.damaged[batch] = f"unreadable: {str(error).splitlines()[0][:120]}"
            del check.readable[batch]
            check.unrecorded.remove(batch)
            continue
        manifest.setdefault(key, []).append(record)
    moved = quarantine(run_dir, check.damaged, table)
    if check.damaged:
        manifest[key] = [r for r in manifest.get(key, []) if int(r["batch"]) not in check.damaged]
    manifest[key] = sorted(manifest.get(key, []), key=lambda r: int(r["batch"]))
    return check, moved


