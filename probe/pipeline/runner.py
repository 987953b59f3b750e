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
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import pyarrow as pa
import torch

from probe.batch.rows import process_batch
from probe.batch.summary import Summary
from probe.capture.data import DatasetSpec
from probe.capture.loading import LoadedModel
from probe.core import naming
from probe.core.arguments import parse_keep
from probe.core.config import RunConfig, config_from_json
from probe.core.environment import check_environment
from probe.core.errors import ProbeError, RunIOError
from probe.core.schema import DEVIATION_SCHEMA
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
from probe.store import aggregates, integrity, storage

#: while batches finish, rank 0 rewrites the manifest at most this often (seconds; less often when a
#: rewrite would take more than 1% of the time, as the part records make it grow), and at every stop and
#: at the end.  The part files are the record of what is finished (resume reads them); the manifest's
#: running totals and heartbeat (stale after at least 600 s) are for whoever watches the run.
REPORT_EVERY_S = 1.0


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
            if config.keep != "rows":
                (run_dir / storage.AGGREGATES).mkdir()
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
            for table in storage.run_tables(manifest)) and aggregates.merged_problem(run_dir, manifest) is None:
        return run_dir
    if "config" not in manifest or not (run_dir / storage.PARTS).is_dir():
        raise ProbeError(f"{run_dir} does not record the settings a resume needs (a version-1 run without them). "
                         "Start a new `probe run`.")
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
            problem = aggregates.merged_problem(run_dir, manifest)
            if problem is not None:  # the merged aggregates: every batch is computed again
                moved = aggregates.quarantine_merged(run_dir, manifest)
                manifest.setdefault("repairs", []).append({
                    "at": now(), "quarantine": str(moved) if moved else None, "table": storage.AGGREGATES,
                    "merged": problem})
                manifest.update(status="interrupted", stop_reason=f"damaged: {storage.AGGREGATES}/"
                                                                  f"{aggregates.MERGED} ({problem})")
                (run_dir / storage.AGGREGATES).mkdir(exist_ok=True)
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
            return BatchLoop(run_dir, manifest, job, stops, group).run()
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


@dataclass
class BatchOutputs:
    """What one batch of the plan gives: its rows (with ``--keep sample:N`` the sampled ones, with ``--keep
    aggregates`` none), their summary, the seconds spent capturing and solving, with ``--intervene`` its
    interventions table, and with ``--keep aggregates`` or ``sample:N`` its statistics
    (:class:`probe.batch.aggregates.Aggregates`)."""

    rows: pa.Table
    summary: Summary
    seconds: dict
    interventions: pa.Table | None = None
    aggregates: object = None


@dataclass
class BatchInFlight:
    """A batch whose capture is done and whose last solves may still be running (in the lane)."""

    number: int
    started: float  #: ``time.perf_counter()`` when its capture started
    finish: Callable[[], BatchOutputs]  #: waits for its solves


class BatchLoop:
    """One segment of a run: every batch of the plan that has no part file yet, computed and written.

    With several processes, rank r takes every world-th of those batches.  Batch k + 1 is captured while
    batch k's last stack is solved in the lane (a CPU run on several threads without a memory budget; on
    one thread, as with one process per core, the two would only take turns); each batch's outputs are
    written once both are done, in the plan's order (:meth:`commit`).  Rank 0 keeps the manifest: it
    opens the segment (:meth:`start_segment`), folds every part written into the run's totals and
    rewrites the manifest at most every :data:`REPORT_EVERY_S` (:meth:`report`), follows the other ranks
    until every batch has its part, and records the stop or the completion.
    """

    def __init__(self, run_dir: Path, manifest: dict | None, job: Job, stops: Stops, group: distributed.Group):
        self.run_dir, self.manifest, self.job, self.stops, self.group = run_dir, manifest, job, stops, group
        self.config, self.ranks = job.config, group.ranks
        self.segment: dict | None = None  # rank 0: this segment's entry in the manifest
        self.segment_number = 0
        self.index: PartIndex | None = None  # rank 0: every part file of the run read so far
        self.progress = None
        self.lane: Lane | None = None
        self.longest_batch_s = 0.0
        self.reported_at, self.report_every_s = time.perf_counter(), REPORT_EVERY_S
        self.rows_in_flight = 0  # rank 0: rows solved in batches not written yet
        self.showing = threading.Lock()  # the progress is told from the lane's thread too

    def run(self) -> Path:
        """Compute and write the batches left; record the segment's stop or the run's completion."""
        rank_info = self.group.gather(self.rank_info())
        todo, self.segment_number = self.group.from_main(lambda: self.start_segment(rank_info))
        if self.group.main:
            self.segment = self.manifest["segments"][-1]
            self.index = PartIndex(self.run_dir, self.config.fidelity_tolerance, storage.part_records(self.manifest),
                                   self.config.attn_implementation)
            if self.config.intervene:
                self.index.with_interventions(storage.part_records(self.manifest, storage.INTERVENTIONS))
            if self.config.keep != "rows":
                self.index.with_table(storage.AGGREGATES, storage.part_records(self.manifest, storage.AGGREGATES))
            self.index.refresh()  # the parts of earlier segments (resume); later, this process's own
        total = len(self.job.batches)
        self.progress = _progress(total, total - len(todo), self.config.progress and self.group.main)
        if self.group.main:  # a resumed run's bar counts the rows of its earlier segments too
            self.progress.set_postfix(rows=f"{self.index.summary.rows:,}", refresh=False)
        self.lane = self.new_lane()
        sample = parse_keep(self.config.keep)[1]
        if sample is not None:  # --keep sample:N: the N smallest row hashes this process has seen
            from probe.batch.aggregates import SampleBound

            self.job.sample_bound = SampleBound(sample)
        try:
            self.compute(todo[self.ranks.rank :: self.ranks.world])
            if self.group.main:
                self.follow_other_ranks()
            with self.stops.interruptible():  # a stop that arrived while the last batch was written
                pass
        except BaseException as error:
            self.close()
            if self.group.main:
                record_stop(self.run_dir, self.manifest, self.segment, self.index, error, self.job.started)
            if isinstance(error, KeyboardInterrupt):  # Ctrl-C before our handler, or raised by a library
                raise RunStopped(signal.SIGINT, self.run_dir, self.manifest, self.ranks.rank) from error
            if isinstance(error, RunStopped):
                error.run_dir, error.manifest, error.rank = self.run_dir, self.manifest, self.ranks.rank
            raise
        self.close()
        if self.group.main:
            record_completion(self.run_dir, self.manifest, self.segment, self.index, self.config, self.job.started)
        return self.run_dir

    def rank_info(self) -> dict:
        """This process, as the segment's ``ranks`` entry records it."""
        return {
            "rank": self.ranks.rank, **storage.process_identity(), "device": str(self.job.device),
            "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "newton_iterations": native.describe(self.job.device), **self.job.timings,
        }

    def start_segment(self, rank_info: list[dict]) -> tuple[list[int], int]:
        """Rank 0: the batches left, and the number of the new segment it adds to the manifest."""
        run_dir, manifest, job = self.run_dir, self.manifest, self.job
        storage.remove_temporaries(run_dir)
        done = set(storage.part_files(run_dir))
        for table in storage.run_tables(manifest):  # a batch is done when each of its parts is (write_outputs)
            done &= aggregated_batches(run_dir, manifest) if table == storage.AGGREGATES else set(
                storage.part_files(run_dir, table))
        manifest["segments"].append({
            "segment": len(manifest["segments"]),
            **storage.process_identity(),
            "status": "running",
            "started_at": now(),
            "device": str(job.device),
            "versions": package_versions(),
            "processes": self.ranks.world,
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

    def new_lane(self) -> Lane | None:
        """The lane that solves a batch's last stack while the next batch is captured, where it pays."""
        threads = torch.get_num_threads()
        on_cpu = self.job.device.type == "cpu"
        return Lane(threads) if on_cpu and threads > 1 and self.config.max_memory_bytes is None else None

    def compute(self, batches: list[int]) -> None:
        """Capture each batch (its solves start), then commit the one before it."""
        in_flight = None
        for number in batches:
            started = time.perf_counter()
            with self.stops.interruptible():
                finish = _start_batch(self.job, number, self.lane, self.solved if self.group.main else None)
            if in_flight is not None:
                self.commit(in_flight)
            in_flight = BatchInFlight(number, started, finish)
        if in_flight is not None:
            self.commit(in_flight)

    def commit(self, batch: BatchInFlight) -> None:
        """Wait for the batch's solves and write its outputs; rank 0 counts it and reports when due."""
        with self.stops.interruptible():  # a stop while the batch is computed drops it
            outputs = batch.finish()
        written = time.perf_counter()
        path = self.write_outputs(batch.number, outputs)
        self.longest_batch_s = max(self.longest_batch_s, time.perf_counter() - batch.started)
        if self.group.main:
            self.segment["timings_s"]["write_s"] += time.perf_counter() - written
            self.index.add(batch.number, path, written=True)
            with self.showing:
                self.rows_in_flight -= outputs.summary.rows  # the rows measured (with --keep, not all written)
            self.show_progress()
            if time.perf_counter() - self.reported_at >= self.report_every_s:
                self.report()

    def write_outputs(self, number: int, outputs: BatchOutputs) -> Path:
        """Write the batch's part files, one per table; returns the deviations' part, written last: a batch
        whose deviations part exists has all of its parts (what resume counts as done)."""
        if outputs.aggregates is not None:  # the batch's statistics (probe.store.aggregates)
            state = outputs.aggregates.state().to_arrow()
            storage.write_part(self.run_dir, number, state, {
                "segment": self.segment_number, "rank": self.ranks.rank, "rows": state.num_rows,
                "measured_rows": outputs.summary.rows}, storage.AGGREGATES)
        if outputs.interventions is not None:
            self.write_part(number, outputs.interventions, {"rows": outputs.interventions.num_rows}, outputs.seconds,
                            storage.INTERVENTIONS)
        # with --keep, the part holds the sampled rows (or none) of the rows its summary counts as measured
        sampled = {} if outputs.aggregates is None else {"rows": outputs.rows.num_rows}
        return self.write_part(number, outputs.rows, outputs.summary.state(), outputs.seconds, extra=sampled)

    def write_part(self, number: int, table: pa.Table, summary: dict, seconds: dict, name: str = storage.PARTS,
                   extra: dict | None = None) -> Path:
        """One part file of table ``name`` (atomically), with the record resume and the readers check."""
        record = {
            "examples": [self.job.texts.indices[i] for i in self.job.batches[number]],
            "segment": self.segment_number,
            "rank": self.ranks.rank,
            "summary": summary,
            "seconds": seconds,
            **(extra or {}),
        }
        if name == storage.PARTS:  # write_part's own default: the call that wrappers of it (samplers) take
            return storage.write_part(self.run_dir, number, table, record)
        return storage.write_part(self.run_dir, number, table, record, name)

    def show_progress(self) -> None:
        """Rank 0: the batches finished, and every row written or solved so far."""
        with self.showing:
            self.progress.set_postfix(rows=f"{self.index.summary.rows + self.rows_in_flight:,}", refresh=False)
            self.progress.update(len(self.index.records) - self.progress.n)

    def solved(self, rows: int) -> None:
        """Rank 0: ``rows`` more rows solved within a batch (a long batch's progress moves with them)."""
        with self.showing:
            self.rows_in_flight += rows
            self.progress.set_postfix(rows=f"{self.index.summary.rows + self.rows_in_flight:,}", refresh=False)
            self.progress.tick()

    def report(self) -> None:
        """Rank 0: progress, totals and heartbeat into the manifest."""
        index, manifest = self.index, self.manifest
        if self.ranks.world > 1:
            index.refresh()  # the other ranks' parts
        index.fold_into(self.segment)
        self.segment["timings_s"]["total_s"] = time.perf_counter() - self.job.started
        manifest.update(
            batches_done=len(index.records),
            **index.tables(manifest),
            process=storage.heartbeat(storage.process_identity(), max(600.0, 10 * self.longest_batch_s)),
            solver=index.summary.solver(),
            deviations=index.summary.settings(),
            fidelity=index.summary.fidelity_summary(),
            timings_s=timings_of(manifest),
        )
        written = time.perf_counter()
        storage.write_manifest(self.run_dir, manifest)
        self.show_progress()
        self.reported_at = time.perf_counter()
        # the manifest grows by a part record per batch: at most 1% of the time goes into rewriting it
        self.report_every_s = max(REPORT_EVERY_S, 100 * (self.reported_at - written))

    def follow_other_ranks(self) -> None:
        """Rank 0: wait until every batch of the plan has its part file, reporting as the others write."""
        while (finished := self.index.refresh()) < len(self.job.batches):
            if finished > self.progress.n or time.perf_counter() - self.reported_at > 10:
                self.report()
            with self.stops.interruptible():
                time.sleep(0.1)

    def close(self) -> None:
        self.progress.close()
        if self.lane is not None:
            self.lane.close()


def aggregated_batches(run_dir: Path, manifest: dict) -> set[int]:
    """The batches whose aggregates are on disk: their parts, or every batch once merged into one file."""
    if manifest.get(aggregates.MERGED_RECORD):
        return set(range(manifest["batches_total"]))
    return set(storage.part_files(run_dir, storage.AGGREGATES))


def _start_batch(job: Job, batch: int, lane=None, on_rows: Callable[[int], None] | None = None,
                 ) -> Callable[[], BatchOutputs]:
    """Capture one batch of the plan and start its solves (in ``lane``, if any); returns a function that
    waits for them and returns the batch's outputs.  ``on_rows``: told the rows of each site as they are solved."""
    positions = job.batches[batch]
    texts = [job.texts.texts[i] for i in positions]
    targets = [job.texts.targets[i] for i in positions] if job.texts.targets is not None else None
    example_ids = [job.texts.indices[i] for i in positions]
    inputs = job.loaded.adapter.encode(job.loaded.tokenizer, texts, targets, job.config.max_length)
    inputs = {key: value.to(job.device) for key, value in inputs.items()}
    summary = Summary(job.config.fidelity_tolerance, job.config.attn_implementation)
    capture, records = None, None
    made = []  # the batch's Aggregates (--keep aggregates, sample:N), made by process_batch with its context
    mode, sample = parse_keep(job.config.keep)

    def aggregates(context):
        from probe.batch.aggregates import Aggregates

        made.append(Aggregates(example_ids, context, seed=job.config.seed, sample=sample))
        return made[-1]

    if job.config.intervene:  # the rows come from the intervention's unmodified forward (its emit)
        from probe.interventions import batch_records, run_config

        records, intervention_config = [], run_config(job.config)

        def capture(emit):
            started = time.perf_counter()
            records.extend(batch_records(job.loaded, inputs, example_ids, intervention_config, emit))
            records.append(time.perf_counter() - started)

    wait = process_batch(job.loaded, inputs, example_ids, job.config, summary, job.context, lane, capture, on_rows,
                         selection=job.selection, aggregates=None if mode == "rows" else aggregates)

    def finish() -> BatchOutputs:
        """The batch's rows (its sample, or none, with --keep), summary, seconds, interventions and aggregates."""
        tables, seconds = wait()
        kept = made[0] if made else None
        if kept is not None:
            sampled = kept.sample_table(job.sample_bound)
            tables = [sampled if sampled is not None else DEVIATION_SCHEMA.empty_table()]
        if records is None:
            return BatchOutputs(pa.concat_tables(tables), summary, seconds, aggregates=kept)
        from probe.interventions import records_table

        seconds = dict(seconds, intervene=records[-1])  # the whole forward work, row capture included
        return BatchOutputs(pa.concat_tables(tables), summary, seconds, records_table(records[:-1]), kept)

    return finish


def _progress(total: int, initial: int, enabled: bool):
    """A bar on a terminal; plain lines where stderr is a file or a pipe (:mod:`probe.core.progress`)."""
    from probe.core.progress import progress

    return progress(total, initial, enabled, unit="batch", desc="probe: solving")
