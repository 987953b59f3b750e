"""The manifest of a run as the pipeline writes it: its first version, the part files folded into its
totals (:class:`PartIndex`), and what a stop or the end records."""

from __future__ import annotations

import hashlib
import json
import platform
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

from probe.batch.summary import Summary
from probe.core import naming
from probe.core.arguments import parse_keep
from probe.core.config import RunConfig, config_to_json
from probe.core.schema import INTERVENTION_KEY
from probe.core.version import __version__
from probe.pipeline import fingerprint
from probe.pipeline.job import Job
from probe.pipeline.stopping import RunStopped
from probe.store import aggregates, storage


def plan_sha256(batches: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()


def package_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version(), "probe": __version__}
    for package in ("torch", "transformers", "datasets", "pandas", "pyarrow", "numpy"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return versions


def run_name(config: RunConfig) -> str:
    """``--name``, or the model's real name (``-random`` for a random-initialisation control, ``-texts`` for
    texts given in memory: :func:`probe.core.naming.run_name`)."""
    return naming.run_name(config.model, config.init, config.name, texts=naming.is_texts_file(config.dataset.name))


def now() -> str:
    return datetime.now(timezone.utc).isoformat()


def new_manifest(job: Job, unknown_tokens: dict) -> dict:
    config, loaded, texts = job.config, job.loaded, job.texts
    in_memory = bool(loaded.info.get("in_memory"))  # a model measured in memory has no files to record
    local_model = not in_memory and Path(config.model).expanduser().exists()
    local_data = config.dataset.name is not None and Path(config.dataset.name).expanduser().exists()
    model_directory = None if in_memory else fingerprint.model_directory(config.model, config.revision)
    return {
        "format_version": storage.FORMAT_VERSION,
        "probe_version": __version__,
        "name": run_name(config),
        "status": "running",
        "started_at": now(),
        "model": {**loaded.info, "name": naming.model_name(config.model),  # local paths as naming.recorded_path
                  **{key: naming.recorded_path(loaded.info[key]) for key in ("id", "path") if loaded.info[key]}},
        "adapter": type(loaded.adapter).__name__,
        "attention_types": list(loaded.adapter.attention_types),
        # the attention the model ran, through probe's registered functions: the family's eager_attention_forward
        # (eager), or transformers' sdpa_attention_forward (sdpa, --attn-implementation sdpa)
        "attention_implementation": config.attn_implementation,
        "dtype": config.dtype,
        "device": str(job.device),
        "dataset": {
            **config_to_json(config)["dataset"],  # a local file's path as naming.recorded_path
            "description": config.dataset.describe(),
            "n_examples": len(texts.texts),
            "skipped_empty": texts.skipped_empty,
            "texts_sha256": texts.sha256,
            "max_length": config.max_length,
            "truncated_examples": texts.truncated if texts.truncated is not None else
            sum(length >= config.max_length for length in job.lengths),
        },
        "unknown_tokens": unknown_tokens,  # probe.capture.tokens: how much of the texts the tokenizer does not know
        "alpha": list(config.alphas),
        "spaces": list(config.spaces),
        "init": config.init,
        # what the run measures (probe.capture.selection): every type, layer, head and query, or those selected
        "selection": job.selection.record(),
        "parameterisation": {
            "alpha": list(config.alphas),
            "spaces": list(config.spaces),
            "rel_deviation": "||lambda* - alpha z|| / ||lambda*||",
            "alpha_scaling": "adapters give alpha = 1 quantities; for other alpha the evidence is z / alpha",
            **loaded.adapter.describe(),
        },
        "seed": config.seed,
        "batch_size": config.batch_size,
        "solver_settings": {
            "rtol": config.rtol,
            "dtype": "float64",
            "newton_direction_dtype": "float32",
            "sites_stacked_per_call": "consecutive sites of one shape, up to 256 MiB of logits",
        },
        "versions": package_versions(),
        "batches_done": 0,
        "batches_total": len(job.batches),
        "config": config_to_json(config),
        # what resume loads and checks: the same model files, texts and batch plan
        "inputs": {
            **({"model_location": None, "model_revision": None, "model_directory": None, "model_fingerprint": None}
               if in_memory else {
                "model_location": naming.recorded_path(model_directory) if local_model else config.model,
                # a hub model's commit: its cache snapshot's name (the directory is named after it)
                "model_revision": None if local_model else loaded.info.get("revision") or model_directory.name,
                "model_directory": naming.recorded_path(model_directory),
                "model_fingerprint": fingerprint.model_fingerprint(model_directory)}),
            "dataset_location": (naming.recorded_path(Path(config.dataset.name).expanduser().resolve()) if local_data
                                 else config.dataset.name),
            "batch_plan_sha256": plan_sha256(job.batches),
            **tokenizer_inputs(config.tokenizer),
        },
        "segments": [],
        "parts": [],  # one record per finished part file (storage.describe_part), kept by PartIndex
        **({storage.TABLE_RECORDS[storage.INTERVENTIONS]: [], "interventions": intervention_settings(job)}
           if config.intervene else {}),
    }


def intervention_settings(job: Job) -> dict:
    """The manifest's ``interventions`` entry before any batch: what is substituted and measured."""
    from probe.interventions import lm_kind, pooling_of

    return {
        "substitutes": list(job.config.intervene), "modes": list(job.config.intervene_modes),
        "table": storage.INTERVENTIONS, "key": list(INTERVENTION_KEY),
        "pooling": pooling_of(job.loaded), "lm_head": lm_kind(job.loaded), "records": 0,
    }


class PartIndex:
    """The run's part files read so far: their records folded into the run's summary and into the
    batches and seconds of each (segment, rank).  Rank 0 follows every rank's progress through it."""

    def __init__(self, run_dir: Path, tolerance: float, recorded: dict[int, dict] | None = None,
                 attn_implementation: str = "eager"):
        self.run_dir = run_dir
        self.summary = Summary(tolerance, attn_implementation)
        #: the batches folded in so far (their records are folded, not kept: memory stays flat over a run)
        self.records: set[int] = set()
        self.work: dict[tuple[int, int], dict] = {}
        #: batch -> the manifest's record of its part file (name, bytes, rows, SHA-256); the ones the manifest
        #: already holds (checked by resume) are taken as they are, new ones are described when first seen
        self.parts: dict[int, dict] = dict(recorded or {})
        #: the same for the run's other tables, whose part of each batch is written ahead of its deviations'
        #: part: the interventions (--intervene) and the aggregates (--keep aggregates or sample:N)
        self.other_parts: dict[str, dict[int, dict]] = {}

    @property
    def intervention_parts(self) -> dict[int, dict] | None:
        """The interventions table's records (runs with --intervene; ``None`` otherwise)."""
        return self.other_parts.get(storage.INTERVENTIONS)

    def with_interventions(self, recorded: dict[int, dict]) -> "PartIndex":
        return self.with_table(storage.INTERVENTIONS, recorded)

    def with_table(self, table: str, recorded: dict[int, dict]) -> "PartIndex":
        """Follow another table of the run (each batch's part of it is written ahead of its deviations' part)."""
        self.other_parts[table] = dict(recorded)
        return self

    def part_records(self, table: str = storage.PARTS) -> list[dict]:
        parts = self.parts if table == storage.PARTS else self.other_parts[table]
        return [parts[batch] for batch in sorted(parts)]

    def tables(self, manifest: dict | None = None) -> dict:
        """The manifest's part records of every table (and, given the ``manifest``, the interventions'
        running record count into its ``interventions`` entry)."""
        tables = {storage.PART_RECORDS: self.part_records()}
        for table in self.other_parts:
            tables[storage.TABLE_RECORDS[table]] = self.part_records(table)
        if self.intervention_parts is not None and manifest is not None and isinstance(
                manifest.get("interventions"), dict):
            manifest["interventions"]["records"] = sum(r["rows"] for r in self.intervention_parts.values())
        return tables

    def refresh(self) -> int:
        """Read the part files not seen yet (a directory listing: other ranks' parts); return how many
        batches are finished (in every table the run writes)."""
        for batch, path in storage.part_files(self.run_dir).items():
            self.add(batch, path)
        return len(self.records)

    def add(self, batch: int, path: Path, written: bool = False) -> None:
        """Fold in one finished part (this process's own, just written: no directory listing, whose cost
        grows with the run); with interventions, the batch's part of that table too (written first).
        ``written``: the part files were just (re)written, so their records are described afresh (a batch
        redone because its other table's part was damaged replaces a recorded part)."""
        if batch in self.records:
            return
        if written:
            self.parts.pop(batch, None)
            for parts in self.other_parts.values():
                parts.pop(batch, None)
        for table, parts in self.other_parts.items():
            if batch not in parts:
                other = storage.part_path(self.run_dir, batch, table)
                if not other.exists():
                    return  # not finished: resume redoes it (every table)
                parts[batch] = storage.describe_part(other, batch)
        if batch not in self.parts:
            self.parts[batch] = storage.describe_part(path, batch)
        record = storage.part_record(path)
        self.records.add(batch)
        self.summary.merge(Summary.from_state(record["summary"]))
        work = self.work.setdefault((record["segment"], record["rank"]), {"batches": 0, "capture_s": 0.0, "solve_s": 0.0})
        work["batches"] += 1
        work["capture_s"] += record["seconds"]["capture"]
        work["solve_s"] += record["seconds"]["solve"]

    def fold_into(self, segment: dict) -> None:
        """Batches and seconds of the segment's ranks (and their sums) from the part files they wrote."""
        for entry in segment["ranks"]:
            entry.update(self.work.get((segment["segment"], entry["rank"]), {"batches": 0, "capture_s": 0.0, "solve_s": 0.0}))
        segment["batches"] = sum(entry["batches"] for entry in segment["ranks"])
        for key in ("capture_s", "solve_s"):
            segment["timings_s"][key] = sum(entry[key] for entry in segment["ranks"])


def tokenizer_inputs(tokenizer: str | None) -> dict:
    """A separate tokenizer (--tokenizer): where it is (absolute, when local) and its fingerprint."""
    if tokenizer is None:
        return {}
    path = Path(tokenizer).expanduser()
    if not path.is_dir():  # a hub id: the batch plan check covers it
        return {"tokenizer_location": tokenizer}
    path = path.resolve()
    return {"tokenizer_location": naming.recorded_path(path), "tokenizer_fingerprint": fingerprint.model_fingerprint(path)}


def timings_of(manifest: dict) -> dict:
    """Seconds per stage, summed over the run's segments (capture and solve: over all their processes)."""
    timings: dict[str, float] = {}
    for segment in manifest["segments"]:
        for key, value in segment["timings_s"].items():
            timings[key] = timings.get(key, 0.0) + value
    return timings


def record_stop(run_dir: Path, manifest: dict, segment: dict, index: PartIndex, error: BaseException,
                 started: float) -> None:
    if isinstance(error, RunStopped):
        reason = f"stopped by {signal.Signals(error.signum).name}"
    elif isinstance(error, KeyboardInterrupt):
        reason = "stopped by SIGINT (Ctrl-C)"
    else:
        reason = f"failed: {type(error).__name__}: {error}"
    try:
        index.refresh()
    except OSError:  # the directory went away or became unreadable: the totals are those seen so far
        pass
    index.fold_into(segment)
    segment.update(status="interrupted", stop_reason=reason, finished_at=now())
    segment["timings_s"]["total_s"] = time.perf_counter() - started
    manifest.update(
        status="interrupted",
        stop_reason=reason,
        batches_done=len(index.records),
        **index.tables(manifest),
        solver=index.summary.solver(),
        deviations=index.summary.settings(),
        fidelity=index.summary.fidelity_summary(),
        timings_s=timings_of(manifest),
        note=f"{storage.PARTS} holds every batch finished before the stop; `probe resume` continues the run",
    )
    try:
        storage.write_manifest(run_dir, manifest)
    except OSError:  # the disk that stopped the run may refuse this too; the part files are the record
        if not isinstance(error, OSError):
            raise
    else:
        if isinstance(error, OSError):
            error.probe_manifest_written = True


def record_completion(run_dir: Path, manifest: dict, segment: dict, index: PartIndex, config: RunConfig,
                       started: float) -> None:
    """Totals over every part file (whichever segment and rank wrote it) and every segment; with ``--keep``,
    the run's sample cut to its N rows and its aggregates merged into one file (:func:`finish_kept`)."""
    index.refresh()
    merged = finish_kept(run_dir, manifest, index, config)
    for each in manifest["segments"]:  # batches and seconds of every segment, from its part files
        index.fold_into(each)
    segment.update(status="complete", finished_at=now())
    segment["timings_s"]["total_s"] = time.perf_counter() - started
    timings = timings_of(manifest)
    if config.intervene:
        manifest["interventions"] = {**manifest.get("interventions", {}), **intervention_totals(run_dir, manifest)}
    manifest.update(
        status="complete",
        finished_at=now(),
        batches_done=len(index.records),
        **index.tables(manifest),
        solver=index.summary.solver(),
        deviations=index.summary.settings(),
        fidelity=index.summary.fidelity_summary(),
        timings_s=timings,
        problems_per_second=index.summary.rows / timings["solve_s"] if timings["solve_s"] else None,
    )
    storage.write_manifest(run_dir, manifest)
    if merged:  # recorded: the parts it replaces go (a kill before this leaves them, which readers ignore)
        aggregates.remove_parts(run_dir)
    if not manifest["fidelity"]["passed"]:
        import warnings

        warnings.warn(
            f"Fidelity check failed: reconstructed attention differs from the model's by "
            f"{manifest['fidelity']['max_abs_error']:.2e} (> {config.fidelity_tolerance:.0e}); see "
            f"{run_dir / storage.MANIFEST}. A model whose attention adds something probe does not represent "
            "fails this check; so can a low-precision model with very large logits (the default tolerance per "
            "dtype is in docs/large-models.md): --fidelity-tolerance.",
            stacklevel=3,
        )


def finish_kept(run_dir: Path, manifest: dict, index: PartIndex, config: RunConfig) -> bool:
    """A complete run made with ``--keep aggregates`` or ``sample:N``: its sample parts cut to the run's N rows of
    smallest hash (:mod:`probe.store.aggregates`), then its aggregates' parts merged into one recorded file.
    Each step is safe to be killed in: a part rewritten has its record dropped from the manifest first (a reader
    takes it as an unrecorded part, checking its rows against its own record), and the merged file counts only
    once the manifest records it.  Returns whether the aggregates were merged now."""
    mode, count = parse_keep(config.keep)
    if mode == "rows" or manifest.get(aggregates.MERGED_RECORD):
        return False
    if count is not None:
        files = storage.part_files(run_dir)
        threshold = aggregates.sample_threshold(files.values(), count, config.seed)
        if threshold is not None:
            cut = {batch: table for batch, path in files.items()
                   if (table := aggregates.rows_within(path, threshold, config.seed)) is not None}
            if cut:
                for batch in cut:
                    index.parts.pop(batch, None)
                manifest.update(**index.tables(manifest))
                storage.write_manifest(run_dir, manifest)
                for batch, table in cut.items():
                    record = {**storage.part_record(files[batch]), "rows": table.num_rows}
                    record.pop("batch", None)
                    index.parts[batch] = storage.describe_part(storage.write_part(run_dir, batch, table, record), batch)
    from probe.store.integrity import require_intact

    manifest.update(**index.tables(manifest))  # every part this run wrote, recorded: each is checked in full
    check = require_intact(run_dir, manifest, table=storage.AGGREGATES)
    state = aggregates.merge_files(path for _, path in sorted(check.readable.items()))
    path = aggregates.merged_path(run_dir)
    aggregates.write_merged(path, state, {"batches": len(check.readable)}, storage.replace_atomically)
    manifest[aggregates.MERGED_RECORD] = aggregates.describe_merged(path, len(check.readable))
    index.other_parts[storage.AGGREGATES] = {}
    return True


#: the intervention columns whose means the manifest records per (space, alpha, substitute, mode)
INTERVENTION_MEANS = ("hidden_change", "embedding_cosine", "lm_loss_original", "lm_loss", "top1_agreement")


def intervention_totals(run_dir: Path, manifest: dict) -> dict:
    """The interventions' totals, read back from their part files by one streaming aggregate (:mod:`probe.query`;
    no record is held): records, and per (space, alpha, substitute) and mode (per-site: every site's records
    together; whole) the records, solves not converged and mean effects (over the values that are numbers:
    ``None`` where there is none, as for the LM loss without an LM head).  On one thread, so that the sums
    are taken in one order and a resumed run's totals equal an uninterrupted one's."""
    from probe.store.engine import connect, parquet_source

    files = list(storage.part_files(run_dir, storage.INTERVENTIONS).values())
    if not files:
        return {"records": 0, "means": []}
    means = ", ".join(f'avg("{name}") FILTER (WHERE NOT isnan("{name}")) AS "mean_{name}"'
                      for name in INTERVENTION_MEANS)
    sql = (f"SELECT space, alpha, substitute, CASE WHEN site = 'whole' THEN 'whole' ELSE 'per-site' END AS mode, "
           f"count(*) AS records, sum(solver_not_converged) AS solver_not_converged, {means} "
           f"FROM {parquet_source(files)} GROUP BY ALL ORDER BY space, alpha, substitute, mode")
    connection = connect(threads=1)
    try:
        cursor = connection.execute(sql)
        names = [column[0] for column in cursor.description]
        groups = [dict(zip(names, values)) for values in cursor.fetchall()]
    finally:
        connection.close()
    means = []
    for group in groups:
        entry = {"space": group["space"], "alpha": float(group["alpha"]), "substitute": group["substitute"],
                 "mode": group["mode"], "records": int(group["records"]),
                 "solver_not_converged": int(group["solver_not_converged"] or 0)}
        for name in INTERVENTION_MEANS:
            value = group[f"mean_{name}"]
            entry[f"mean_{name}"] = None if value is None or value != value else float(value)
        means.append(entry)
    return {"records": sum(entry["records"] for entry in means), "means": means}

