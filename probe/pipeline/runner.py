"""The run pipeline: dataset -> batches -> captured sites -> dual solves -> rows -> part files + manifest.

A run is planned as a fixed list of batches (deterministic given its settings) and every finished batch
is written as its own part file (:mod:`probe.store.storage`), so memory does not grow with the dataset and a
run stopped at any moment, by any signal, keeps every finished batch.  On a CPU with several threads
the forward pass of batch k + 1 runs while the last problems of batch k are solved in the background
(:class:`probe.solve.parallel.Lane`).  SIGINT and SIGTERM drop the batches in flight, mark the manifest
``"interrupted"`` and raise :class:`RunStopped`.  :func:`resume`
continues a stopped run with the settings its manifest recorded, after checking that the model files
and the texts are the ones it started with; the finished run equals an uninterrupted one.  Launched by
torchrun as several processes, the processes share the batches (:mod:`probe.pipeline.distributed`).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import pyarrow as pa
import torch

from probe.batch.rows import Summary, process_batch
from probe.capture.data import DatasetSpec
from probe.capture.loading import LoadedModel
from probe.core import naming
from probe.core.config import RunConfig, config_from_json, config_to_json  # noqa: F401 (probe.pipeline.runner.RunConfig, as before)
from probe.core.environment import check_environment
from probe.core.errors import ProbeError, RunIOError
from probe.pipeline import allocator, distributed, fingerprint
from probe.pipeline.job import Job, prepare
from probe.pipeline.manifest import (
    PartIndex,
    new_manifest,
    now,
    package_versions,
    plan_sha256,
    record_completion,
    record_stop,
    run_name,
    timings_of,
    tokenizer_inputs,
)
from probe.pipeline.stopping import RunStopped, Stops
from probe.pipeline.validate import check_run
from probe.solve import native
from probe.solve.parallel import Lane
from probe.store import integrity, storage

#: while batches finish, rank 0 rewrites the manifest at most this often (seconds; less often when a
#: rewrite would take more than 1% of the time, as the part records make it grow), and at every stop and
#: at the end.  The part files are the record of what is finished (resume reads them); the manifest's
#: running totals and heartbeat (stale after at least 600 s) are for whoever watches the run.
REPORT_EVERY_S = 1.0


# --------------------------------------------------------------------------------------------------
# preparing a run: model, texts, batch plan














# --------------------------------------------------------------------------------------------------
# the manifest


















# --------------------------------------------------------------------------------------------------
# the run


def run(config: RunConfig, *, model: LoadedModel | None = None, checked=None) -> Path:
    """Run probe on a model and dataset; return the run directory.

    ``model``: a model already in memory (:mod:`probe.callbacks`: the model being trained), measured as it is,
    in this process alone, with ``checked`` its up-front checks (:func:`probe.callbacks.check_in_memory`)."""
    # every up-front check (probe.pipeline.validate): before any weights load or file is written
    checked = check_run(config) if checked is None else checked
    config = checked.config  # defaults resolved: the adapter's space, the dtype's fidelity tolerance
    joined = distributed.join(config.device) if model is None else _alone()
    with Stops() as stops, joined as group, ExitStack() as held:
        job = group.agree(lambda: prepare(config, group.device(config.device), texts=checked.texts, loaded=model))
        stops.hold()

        def create() -> str:  # rank 0 creates the run directory and holds it
            run_dir = storage.create_run_directory(Path(config.out), naming.slug(run_name(config)))
            held.enter_context(storage.writer_lock(run_dir))
            if config.intervene:
                (run_dir / storage.INTERVENTIONS).mkdir()
            return str(run_dir.resolve())

        run_dir = Path(group.from_main(create))
        return _execute(run_dir, new_manifest(job, checked.unknown_tokens) if group.main else None, job, stops, group)


def resume(run_dir: Path, *, progress: bool = True) -> Path:
    """Continue a stopped run with its recorded settings, and repair a damaged one: part files that are
    missing or do not match their records (size, footer, rows, SHA-256) are moved to ``RUN_DIR/quarantine``
    and recomputed (:func:`probe.store.integrity.repair_parts`).  A complete, intact run is returned untouched."""
    check_environment()
    run_dir = Path(run_dir)
    manifest = storage.read_manifest(run_dir)
    if manifest.get("status") == "complete" and all(
            integrity.check_parts(run_dir, manifest, checksums=True, table=table).ok
            for table in storage.run_tables(manifest)):
        return run_dir
    if "config" not in manifest or not (run_dir / storage.PARTS).is_dir():
        raise ProbeError(f"{run_dir} was written by an older probe that cannot resume runs. Start a new `probe run`.")
    if manifest.get("status") == "running":
        alive, how = storage.writer_alive(manifest["process"])
        raise ProbeError(f"{run_dir} is still running ({how}). Stop that process first, or wait for it.")
    config = config_from_json(manifest["config"])
    config.progress = progress
    with Stops() as stops, distributed.join(config.device) as group, ExitStack() as held:
        job = group.agree(lambda: prepare_resume(run_dir, manifest, config, group.device(config.device)))
        stops.hold()

        def hold() -> None:  # rank 0 holds the run directory, and sets damaged parts aside to be redone
            held.enter_context(storage.writer_lock(run_dir))
            for table in storage.run_tables(manifest):
                (run_dir / table).mkdir(exist_ok=True)
                check, moved = integrity.repair_parts(run_dir, manifest, table)
                if check.damaged:
                    manifest.setdefault("repairs", []).append({
                        "at": now(), "quarantine": str(moved) if moved else None,
                        **({} if table == storage.PARTS else {"table": table}),
                        "batches": {str(batch): why for batch, why in sorted(check.damaged.items())},
                    })
                    if manifest.get("status") == "complete":
                        manifest.update(status="interrupted", stop_reason=f"damaged: {check.describe()}")
            for segment in manifest["segments"]:  # a segment killed without a chance to say so
                if segment.get("status") == "running":
                    segment.update(status="interrupted", stop_reason=manifest.get("stop_reason"))

        group.from_main(hold)
        return _execute(run_dir, manifest, job, stops, group)


@contextmanager
def _alone():
    """A group of this process only (a model in memory is measured where it is, whatever launched it)."""
    yield distributed.Group(distributed.Ranks())


def prepare_resume(run_dir: Path, manifest: dict, config: RunConfig, device: str) -> Job:
    """Check that the model files are the run's, load model and texts, and check the texts and batches."""
    if manifest["inputs"].get("model_location", "") is None:  # probe.callbacks: no files to load the model from
        raise ProbeError(f"{run_dir} measured a model in memory (during training), whose weights were not kept: it "
                         "cannot be loaded again to resume the run or re-solve its rows. Measure a saved checkpoint "
                         "with `probe run` instead (`probe verify --sample 0` checks the part files).")
    inputs = {key: naming.expand_path(value) if key.endswith("_location") else value  # naming.recorded_path's
              for key, value in manifest["inputs"].items()}
    try:
        directory = fingerprint.model_directory(inputs["model_location"], inputs["model_revision"])
    except OSError as error:  # a hub snapshot that is no longer cached (and no connection)
        raise ProbeError(
            f"The model files of {run_dir} ({inputs['model_location']} at {inputs['model_revision']}) cannot be "
            f"found: {str(error).splitlines()[0].rstrip('.')}. Restore them, or start a new run with `probe run`."
        ) from None
    differences = fingerprint.differences(inputs["model_fingerprint"], fingerprint.model_fingerprint(directory))
    if differences:
        raise ProbeError(
            f"The model files of {run_dir} changed since the run started ({'; '.join(differences[:5])}"
            f"{'; ...' if len(differences) > 5 else ''}), so its rows would mix two models. Restore the "
            f"files in {directory}, or start a new run with `probe run`."
        )
    if "tokenizer_fingerprint" in inputs:
        now = tokenizer_inputs(inputs["tokenizer_location"]).get("tokenizer_fingerprint", {})
        changed = fingerprint.differences(inputs["tokenizer_fingerprint"], now)
        if changed:
            raise ProbeError(
                f"The tokenizer files of {run_dir} ({inputs['tokenizer_location']}) changed since the run started "
                f"({'; '.join(changed[:5])}). Restore them, or start a new run with `probe run`."
            )
    dataset = DatasetSpec(**{**asdict(config.dataset), "name": inputs["dataset_location"]})
    as_recorded = replace(  # a hub model at the run's commit; local files where the run found them
        config, revision=inputs["model_revision"] or config.revision,
        tokenizer=inputs.get("tokenizer_location", config.tokenizer),
    )
    job = prepare(as_recorded, device, model_location=inputs["model_location"], dataset=dataset)
    if job.texts.sha256 != manifest["dataset"]["texts_sha256"]:
        raise ProbeError(
            f"The texts of {config.dataset.describe()} changed since the run started (SHA-256 "
            f"{job.texts.sha256[:12]}... now, {manifest['dataset']['texts_sha256'][:12]}... then). Restore "
            "the data, or start a new run with `probe run`."
        )
    if plan_sha256(job.batches) != inputs["batch_plan_sha256"]:
        raise ProbeError(
            "The batches planned now differ from the run's (the tokenizer files changed?). Restore the "
            "model directory, or start a new run with `probe run`."
        )
    return job


def _execute(run_dir: Path, manifest: dict | None, job: Job, stops: Stops, group: distributed.Group) -> Path:
    """Run every batch of the plan that has no part file yet, as a new segment of the run; with several
    processes, rank r takes every world-th of them and rank 0 keeps the manifest.  The C heap keeps
    freed memory for reuse meanwhile (:mod:`probe.pipeline.allocator`)."""
    with allocator.kept_heap():
        try:
            return _execute_batches(run_dir, manifest, job, stops, group)
        except OSError as error:  # the disk, not the input: one paragraph and its own exit status
            if not _is_run_io_error(run_dir, error):
                raise
            raise _io_error(run_dir, error, manifest) from None


_IO_ADVICE = {
    errno.ENOSPC: "Free space on that file system (or move the run directory to a larger one)",
    errno.EDQUOT: "Free space within your quota (or move the run directory elsewhere)",
    errno.EROFS: "The file system became read-only: remount it read-write (or copy the run directory to a "
                 "writable place and resume the copy)",
    errno.EACCES: f"Give yourself write permission on the run directory and its {storage.PARTS} again",
    errno.EPERM: f"Give yourself write permission on the run directory and its {storage.PARTS} again",
    errno.EIO: "The device reported a hardware I/O error: check it (dmesg) before trusting it again",
}


def _is_run_io_error(run_dir: Path, error: OSError) -> bool:
    """An error of the disk under the run (its kind, a file in the run directory, or the directory gone),
    not an OSError of something else (a library's, a model file's) that happens to share the type."""
    inside = bool(error.filename) and str(Path(error.filename).absolute()).startswith(str(Path(run_dir).absolute()))
    return error.errno in _IO_ADVICE or inside or not Path(run_dir).is_dir()


def _io_error(run_dir: Path, error: OSError, manifest: dict | None) -> RunIOError:
    """The one paragraph for an I/O error during a run: what happened, what is safe, what to do."""
    import shlex

    what = f"{error.strerror or error} ({errno.errorcode.get(error.errno, error.errno)})"
    where = f" at {error.filename}" if error.filename else ""
    if not Path(run_dir).is_dir():
        return RunIOError(
            f"Writing the run failed: {what}{where}. The run directory {run_dir} no longer exists (deleted or "
            "unmounted while the run was going on), so its finished batches went with it; nothing else was "
            "written. Restore it from a backup and `probe resume` it, or start again with `probe run`."
        )
    done = storage.part_files(run_dir)
    if not (Path(run_dir) / storage.MANIFEST).is_file():  # the first manifest write failed: nothing to resume
        return RunIOError(
            f"Writing the run failed: {what}{where}, before its first batch: nothing was finished, and "
            f"{run_dir} holds no manifest to resume from (delete it). {_IO_ADVICE.get(error.errno, 'Fix the cause')}, "
            "then start again with `probe run`."
        )
    manifest_note = (
        "the manifest records the stop" if getattr(error, "probe_manifest_written", False)
        else "the manifest could not be updated, which resume does not need: it reads and checks the part files"
    )
    advice = _IO_ADVICE.get(error.errno, "Fix the cause")
    return RunIOError(
        f"Writing the run failed: {what}{where}. Safe: the {len(done)} batch(es) finished before it are whole "
        f"part files in {Path(run_dir) / storage.PARTS} ({manifest_note}); the half-written file was removed "
        f"and nothing finished was lost. {advice}, then continue with: probe resume {shlex.quote(str(run_dir))}"
    )


def _execute_batches(run_dir: Path, manifest: dict | None, job: Job, stops: Stops, group: distributed.Group) -> Path:
    config, ranks = job.config, group.ranks
    rank_info = group.gather({
        "rank": ranks.rank, **storage.process_identity(), "device": str(job.device),
        "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "newton_iterations": native.describe(job.device), **job.timings,
    })

    def start() -> tuple[list[int], int]:  # rank 0: the batches left, and a new segment in the manifest
        storage.remove_temporaries(run_dir)
        done = set(storage.part_files(run_dir))
        if config.intervene:  # a batch is done when both of its parts are (the interventions' is written first)
            done &= set(storage.part_files(run_dir, storage.INTERVENTIONS))
        manifest["segments"].append({
            "segment": len(manifest["segments"]),
            **storage.process_identity(),
            "status": "running",
            "started_at": now(),
            "device": str(job.device),
            "versions": package_versions(),
            "processes": ranks.world,
            "ranks": rank_info,
            "batches": 0,
            "timings_s": {**job.timings, "capture_s": 0.0, "solve_s": 0.0, "write_s": 0.0, "total_s": 0.0},
        })
        for stale in ("stop_reason", "note", "finished_at"):
            manifest.pop(stale, None)
        manifest.update(status="running", process=storage.heartbeat(storage.process_identity(), 3600.0),
                        batches_done=len(done))
        storage.write_manifest(run_dir, manifest)
        return [batch for batch in range(len(job.batches)) if batch not in done], len(manifest["segments"]) - 1

    todo, segment_number = group.from_main(start)
    index = PartIndex(run_dir, config.fidelity_tolerance, storage.part_records(manifest)) if group.main else None
    if group.main and config.intervene:
        index.with_interventions(storage.part_records(manifest, storage.INTERVENTIONS))
    if group.main:
        index.refresh()  # the parts of earlier segments (resume); later, this process's own as it writes them
    segment = manifest["segments"][-1] if group.main else None
    longest_batch_s, reported_at, report_every_s = 0.0, time.perf_counter(), REPORT_EVERY_S
    progress = _progress(len(job.batches), len(job.batches) - len(todo), config.progress and group.main)
    if group.main:  # a resumed run's bar counts the rows of its earlier segments too
        index.refresh()
        progress.set_postfix(rows=f"{index.summary.rows:,}", refresh=False)

    def report() -> None:  # rank 0: progress, totals and heartbeat into the manifest
        nonlocal reported_at, report_every_s
        if ranks.world > 1:
            index.refresh()  # the other ranks' parts
        index.fold_into(segment)
        segment["timings_s"]["total_s"] = time.perf_counter() - job.started
        manifest.update(
            batches_done=len(index.records),
            **index.tables(manifest),
            process=storage.heartbeat(storage.process_identity(), max(600.0, 10 * longest_batch_s)),
            solver=index.summary.solver(),
            deviations=index.summary.settings(),
            fidelity=index.summary.fidelity_summary(),
            timings_s=timings_of(manifest),
        )
        written = time.perf_counter()
        storage.write_manifest(run_dir, manifest)
        progress.update(len(index.records) - progress.n)
        progress.set_postfix(rows=f"{index.summary.rows:,}", refresh=False)
        reported_at = time.perf_counter()
        # the manifest grows by a part record per batch: at most 1% of the time goes into rewriting it
        report_every_s = max(REPORT_EVERY_S, 100 * (reported_at - written))

    def commit(batch, finish, batch_started) -> None:  # wait for the batch's solves and write its part file
        nonlocal longest_batch_s
        with stops.interruptible():  # a stop while the batch is computed drops it
            table, batch_summary, seconds, interventions = finish()
        written = time.perf_counter()
        if interventions is not None:  # first: a batch whose deviations part exists has its interventions too
            storage.write_part(run_dir, batch, interventions, {
                "examples": [job.texts.indices[i] for i in job.batches[batch]], "segment": segment_number,
                "rank": ranks.rank, "summary": {"rows": interventions.num_rows}, "seconds": seconds,
            }, storage.INTERVENTIONS)
        path = storage.write_part(run_dir, batch, table, {
            "examples": [job.texts.indices[i] for i in job.batches[batch]],
            "segment": segment_number,
            "rank": ranks.rank,
            "summary": batch_summary.state(),
            "seconds": seconds,
        })
        longest_batch_s = max(longest_batch_s, time.perf_counter() - batch_started)
        if group.main:
            segment["timings_s"]["write_s"] += time.perf_counter() - written
            index.add(batch, path, written=True)
            progress.set_postfix(rows=f"{index.summary.rows:,}", refresh=False)  # every row written so far
            progress.update(len(index.records) - progress.n)
            if time.perf_counter() - reported_at >= report_every_s:
                report()

    # Batch k + 1 is captured while batch k's last stack is solved in the lane (a CPU run on several
    # threads without a memory budget; on one thread, as with one process per core, the two would only
    # take turns); its part file is written once both are done, in the plan's order.
    threads = torch.get_num_threads()
    lane = Lane(threads) if job.device.type == "cpu" and threads > 1 and config.max_memory_bytes is None else None
    try:
        in_flight = None  # (batch, finish, started) of the batch whose solves may still be running
        for batch in todo[ranks.rank :: ranks.world]:
            batch_started = time.perf_counter()
            with stops.interruptible():
                finish = _start_batch(job, batch, lane)
            if in_flight is not None:
                commit(*in_flight)
            in_flight = (batch, finish, batch_started)
        if in_flight is not None:
            commit(*in_flight)
        if group.main:  # follow the other ranks until every batch has its part file
            while (finished := index.refresh()) < len(job.batches):
                if finished > progress.n or time.perf_counter() - reported_at > 10:
                    report()
                with stops.interruptible():
                    time.sleep(0.1)
        with stops.interruptible():  # a stop that arrived while the last batch was written
            pass
    except BaseException as error:
        progress.close()
        if lane is not None:
            lane.close()
        if group.main:
            record_stop(run_dir, manifest, segment, index, error, job.started)
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C before our handler, or raised by a library
            raise RunStopped(signal.SIGINT, run_dir, manifest, ranks.rank) from error
        if isinstance(error, RunStopped):
            error.run_dir, error.manifest, error.rank = run_dir, manifest, ranks.rank
        raise
    progress.close()
    if lane is not None:
        lane.close()
    if group.main:
        record_completion(run_dir, manifest, segment, index, config, job.started)
    return run_dir


def _start_batch(job: Job, batch: int, lane=None):
    """Capture one batch of the plan and start its solves (in ``lane``, if any); returns a function that
    waits for them and returns the batch's rows, its summary and the seconds spent capturing and solving."""
    positions = job.batches[batch]
    texts = [job.texts.texts[i] for i in positions]
    targets = [job.texts.targets[i] for i in positions] if job.texts.targets is not None else None
    example_ids = [job.texts.indices[i] for i in positions]
    inputs = job.loaded.adapter.encode(job.loaded.tokenizer, texts, targets, job.config.max_length)
    inputs = {key: value.to(job.device) for key, value in inputs.items()}
    summary = Summary(job.config.fidelity_tolerance)
    capture, records = None, None
    if job.config.intervene:  # the rows come from the intervention's unmodified forward (its emit)
        from probe.interventions import batch_records, run_config

        records, intervention_config = [], run_config(job.config)

        def capture(emit):
            started = time.perf_counter()
            records.extend(batch_records(job.loaded, inputs, example_ids, intervention_config, emit))
            records.append(time.perf_counter() - started)

    wait = process_batch(job.loaded, inputs, example_ids, job.config, summary, job.context, lane, capture,
                         selection=job.selection)

    def finish() -> tuple[pa.Table, Summary, dict, pa.Table | None]:
        tables, seconds = wait()
        if records is None:
            return pa.concat_tables(tables), summary, seconds, None
        from probe.interventions import records_table

        seconds = dict(seconds, intervene=records[-1])  # the whole forward work, row capture included
        return pa.concat_tables(tables), summary, seconds, records_table(records[:-1])

    return finish










def _progress(total: int, initial: int, enabled: bool):
    """A bar on a terminal; plain lines where stderr is a file or a pipe (:mod:`probe.core.progress`)."""
    from probe.core.progress import progress

    return progress(total, initial, enabled, unit="batch", desc="probe: solving")
