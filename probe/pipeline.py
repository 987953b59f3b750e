"""The run pipeline: dataset -> batches -> captured sites -> dual solves -> rows -> part files + manifest.

A run is planned as a fixed list of batches (deterministic given its settings) and every finished batch
is written as its own part file (:mod:`probe.storage`), so memory does not grow with the dataset and a
run stopped at any moment, by any signal, keeps every finished batch.  On a CPU with several threads
the forward pass of batch k + 1 runs while the last problems of batch k are solved in the background
(:class:`probe.parallel.Lane`).  SIGINT and SIGTERM drop the batches in flight, mark the manifest
``"interrupted"`` and raise :class:`RunStopped`.  :func:`resume`
continues a stopped run with the settings its manifest recorded, after checking that the model files
and the texts are the ones it started with; the finished run equals an uninterrupted one.  Launched by
torchrun as several processes, the processes share the batches (:mod:`probe.distributed`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import signal
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import torch

from . import __version__, allocator, distributed, fingerprint, naming, native, storage
from .config import RunConfig, config_from_json, config_to_json  # noqa: F401 (probe.pipeline.RunConfig, as before)
from .data import DatasetSpec, Texts, load_texts
from .errors import ProbeError, RunIOError
from .loading import LoadedModel, device_name, load_model
from .parallel import Lane
from .rows import RowContext, Summary, process_batch
from .schema import INTERVENTION_KEY
from .stopping import RunStopped, Stops
from .validate import check_run


#: while batches finish, rank 0 rewrites the manifest at most this often (seconds; less often when a
#: rewrite would take more than 1% of the time, as the part records make it grow), and at every stop and
#: at the end.  The part files are the record of what is finished (resume reads them); the manifest's
#: running totals and heartbeat (stale after at least 600 s) are for whoever watches the run.
REPORT_EVERY_S = 1.0


# --------------------------------------------------------------------------------------------------
# preparing a run: model, texts, batch plan


@dataclass
class _Job:
    """What a run segment works on: its settings, the loaded model, the texts and the batch plan."""

    config: RunConfig
    loaded: LoadedModel
    texts: Texts
    batches: list[list[int]]  # dataset positions of each batch, in the run's batch order
    lengths: list[int]  # token count of each text
    device: torch.device
    context: RowContext  # what rows need beyond sites and solutions (token texts, cached over the run)
    timings: dict
    started: float  # time.perf_counter() when the segment started loading


#: texts tokenized at once while the batches are planned (their lengths are kept, not their tokens, so
#: that planning holds a few thousand texts' tokens whatever the number of texts)
PLAN_CHUNK = 4096


def _plan_batches(loaded: LoadedModel, texts: Texts, batch_size: int, max_length: int):
    """Batches of dataset positions, longest first (less padding; memory problems show at once)."""
    lengths = []
    for start in range(0, len(texts.texts), PLAN_CHUNK):
        chunk = texts.texts[start : start + PLAN_CHUNK]
        lengths += [len(ids) for ids in loaded.tokenizer(chunk, truncation=True, max_length=max_length)["input_ids"]]
    if max(lengths) > max_length:
        raise ProbeError(
            f"--max-length {max_length} is too small for this tokenizer: it produced {max(lengths)} tokens "
            "(special tokens are never truncated). Use a larger --max-length."
        )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)], lengths


def _prepare(
    config: RunConfig, device: str, model_location: str | None = None, dataset: DatasetSpec | None = None,
    texts: Texts | None = None, loaded: LoadedModel | None = None,
) -> _Job:
    """Load the model (from ``model_location``, default ``config.model``; ``loaded``: one already in memory,
    taken as it is) onto ``device`` and the texts (``texts`` when already read, else from ``dataset``, default
    ``config.dataset``); plan the batches."""
    torch.manual_seed(config.seed)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    if loaded is None:
        _say(config, f"loading {naming.model_name(config.model)} ({config.init} weights, {config.dtype}) onto "
                     f"{device_name(device)}")
        loaded = load_model(
            model_location or config.model, revision=config.revision, dtype=config.dtype, device=device,
            init=config.init, seed=config.seed, tokenizer=config.tokenizer,
        )
    unsupported = [space for space in config.spaces if space not in loaded.adapter.spaces]
    if unsupported:
        raise ProbeError(
            f"{loaded.info['model_type']} supports the space(s) {', '.join(loaded.adapter.spaces)} only, not "
            f"{', '.join(unsupported)} (rotary models have no hidden-space parameterisation). Pass "
            f"--space {','.join(loaded.adapter.spaces)}."
        )
    if config.intervene:  # the model with its LM head (rows and interventions alike), refused before the run
        from .intervene import require_intervention, with_lm_head

        loaded = with_lm_head(loaded)
        require_intervention(loaded)
    loaded_at = time.perf_counter()
    texts = texts if texts is not None else load_texts(dataset or config.dataset)
    timings = {"load_model_s": loaded_at - started, "load_data_s": time.perf_counter() - loaded_at}
    _say(config, f"planning the batches of {len(texts.texts):,} texts (tokenizing them)")
    batches, lengths = _plan_batches(loaded, texts, config.batch_size, config.max_length)
    device = next(loaded.model.parameters()).device
    context = RowContext(
        example_ids=[], special_ids=frozenset(loaded.tokenizer.all_special_ids),
        token_text={}, tokenizer=loaded.tokenizer,
    )
    return _Job(config, loaded, texts, batches, lengths, device, context, timings, started)


def _say(config: RunConfig, message: str) -> None:
    """What the run is doing, on stderr, before the progress bar starts (not with --no-progress; rank 0
    speaks for the run)."""
    if config.progress and distributed.Ranks.from_environment().main:
        import sys

        print(f"probe: {message}", file=sys.stderr, flush=True)


def _plan_sha256(batches: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# the manifest


def _package_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version(), "probe": __version__}
    for package in ("torch", "transformers", "datasets", "pandas", "pyarrow", "numpy"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return versions


def _run_name(config: RunConfig) -> str:
    """``--name``, or the model's real name (``-random`` for a random-initialisation control)."""
    return naming.run_name(config.model, config.init, config.name)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _new_manifest(job: _Job, unknown_tokens: dict) -> dict:
    config, loaded, texts = job.config, job.loaded, job.texts
    in_memory = bool(loaded.info.get("in_memory"))  # a model measured in memory has no files to record
    local_model = not in_memory and Path(config.model).expanduser().exists()
    local_data = config.dataset.name is not None and Path(config.dataset.name).expanduser().exists()
    model_directory = None if in_memory else fingerprint.model_directory(config.model, config.revision)
    return {
        "probe_version": __version__,
        "name": _run_name(config),
        "status": "running",
        "started_at": _now(),
        "model": {**loaded.info, "name": naming.model_name(config.model),  # local paths as naming.recorded_path
                  **{key: naming.recorded_path(loaded.info[key]) for key in ("id", "path") if loaded.info[key]}},
        "adapter": type(loaded.adapter).__name__,
        "attention_types": list(loaded.adapter.attention_types),
        "attention_implementation": "eager",
        "dtype": config.dtype,
        "device": str(job.device),
        "dataset": {
            **config_to_json(config)["dataset"],  # a local file's path as naming.recorded_path
            "description": config.dataset.describe(),
            "n_examples": len(texts.texts),
            "skipped_empty": texts.skipped_empty,
            "texts_sha256": texts.sha256,
            "max_length": config.max_length,
            "truncated_examples": sum(length >= config.max_length for length in job.lengths),
        },
        "unknown_tokens": unknown_tokens,  # probe.tokens: how much of the texts the tokenizer does not know
        "alpha": list(config.alphas),
        "spaces": list(config.spaces),
        "init": config.init,
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
        "versions": _package_versions(),
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
            "batch_plan_sha256": _plan_sha256(job.batches),
            **_tokenizer_inputs(config.tokenizer),
        },
        "segments": [],
        "parts": [],  # one record per finished part file (storage.describe_part), kept by _PartIndex
        **({storage.TABLE_RECORDS[storage.INTERVENTIONS]: [], "interventions": _intervention_settings(job)}
           if config.intervene else {}),
    }


def _intervention_settings(job: _Job) -> dict:
    """The manifest's ``interventions`` entry before any batch: what is substituted and measured."""
    from .intervene import lm_kind, pooling_of

    return {
        "substitutes": list(job.config.intervene), "modes": list(job.config.intervene_modes),
        "table": storage.INTERVENTIONS, "key": list(INTERVENTION_KEY),
        "pooling": pooling_of(job.loaded), "lm_head": lm_kind(job.loaded), "records": 0,
    }


class _PartIndex:
    """The run's part files read so far: their records folded into the run's summary and into the
    batches and seconds of each (segment, rank).  Rank 0 follows every rank's progress through it."""

    def __init__(self, run_dir: Path, tolerance: float, recorded: dict[int, dict] | None = None):
        self.run_dir = run_dir
        self.summary = Summary(tolerance)
        #: the batches folded in so far (their records are folded, not kept: memory stays flat over a run)
        self.records: set[int] = set()
        self.work: dict[tuple[int, int], dict] = {}
        #: batch -> the manifest's record of its part file (name, bytes, rows, SHA-256); the ones the manifest
        #: already holds (checked by resume) are taken as they are, new ones are described when first seen
        self.parts: dict[int, dict] = dict(recorded or {})
        #: the same for the interventions table (runs with --intervene; ``None`` otherwise)
        self.intervention_parts: dict[int, dict] | None = None

    def with_interventions(self, recorded: dict[int, dict]) -> "_PartIndex":
        self.intervention_parts = dict(recorded)
        return self

    def part_records(self, table: str = storage.PARTS) -> list[dict]:
        parts = self.parts if table == storage.PARTS else self.intervention_parts
        return [parts[batch] for batch in sorted(parts)]

    def tables(self, manifest: dict | None = None) -> dict:
        """The manifest's part records of every table (and, given the ``manifest``, the interventions'
        running record count into its ``interventions`` entry)."""
        tables = {storage.PART_RECORDS: self.part_records()}
        if self.intervention_parts is not None:
            tables[storage.TABLE_RECORDS[storage.INTERVENTIONS]] = self.part_records(storage.INTERVENTIONS)
            if manifest is not None and isinstance(manifest.get("interventions"), dict):
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
            if self.intervention_parts is not None:
                self.intervention_parts.pop(batch, None)
        if self.intervention_parts is not None:
            if batch not in self.intervention_parts:
                other = storage.part_path(self.run_dir, batch, storage.INTERVENTIONS)
                if not other.exists():
                    return  # not finished: resume redoes it (both tables)
                self.intervention_parts[batch] = storage.describe_part(other, batch)
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


def _tokenizer_inputs(tokenizer: str | None) -> dict:
    """A separate tokenizer (--tokenizer): where it is (absolute, when local) and its fingerprint."""
    if tokenizer is None:
        return {}
    path = Path(tokenizer).expanduser()
    if not path.is_dir():  # a hub id: the batch plan check covers it
        return {"tokenizer_location": tokenizer}
    path = path.resolve()
    return {"tokenizer_location": naming.recorded_path(path), "tokenizer_fingerprint": fingerprint.model_fingerprint(path)}


def _timings(manifest: dict) -> dict:
    """Seconds per stage, summed over the run's segments (capture and solve: over all their processes)."""
    timings: dict[str, float] = {}
    for segment in manifest["segments"]:
        for key, value in segment["timings_s"].items():
            timings[key] = timings.get(key, 0.0) + value
    return timings


# --------------------------------------------------------------------------------------------------
# the run


def run(config: RunConfig, *, model: LoadedModel | None = None, checked=None) -> Path:
    """Run probe on a model and dataset; return the run directory.

    ``model``: a model already in memory (:mod:`probe.callbacks`: the model being trained), measured as it is,
    in this process alone, with ``checked`` its up-front checks (:func:`probe.callbacks.check_in_memory`)."""
    # every up-front check (probe.validate): before any weights load or file is written
    checked = check_run(config) if checked is None else checked
    config = checked.config  # defaults resolved: the adapter's space, the dtype's fidelity tolerance
    joined = distributed.join(config.device) if model is None else _alone()
    with Stops() as stops, joined as group, ExitStack() as held:
        job = group.agree(lambda: _prepare(config, group.device(config.device), texts=checked.texts, loaded=model))
        stops.hold()

        def create() -> str:  # rank 0 creates the run directory and holds it
            run_dir = storage.create_run_directory(Path(config.out), naming.slug(_run_name(config)))
            held.enter_context(storage.writer_lock(run_dir))
            if config.intervene:
                (run_dir / storage.INTERVENTIONS).mkdir()
            return str(run_dir.resolve())

        run_dir = Path(group.from_main(create))
        return _execute(run_dir, _new_manifest(job, checked.unknown_tokens) if group.main else None, job, stops, group)


@contextmanager
def _alone():
    """A group of this process only (a model in memory is measured where it is, whatever launched it)."""
    yield distributed.Group(distributed.Ranks())


def resume(run_dir: Path, *, progress: bool = True) -> Path:
    """Continue a stopped run with its recorded settings, and repair a damaged one: part files that are
    missing or do not match their records (size, footer, rows, SHA-256) are moved to ``RUN_DIR/quarantine``
    and recomputed (:func:`probe.storage.repair_parts`).  A complete, intact run is returned untouched."""
    run_dir = Path(run_dir)
    manifest = storage.read_manifest(run_dir)
    if manifest.get("status") == "complete" and all(
            storage.check_parts(run_dir, manifest, checksums=True, table=table).ok
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
        job = group.agree(lambda: _prepare_resume(run_dir, manifest, config, group.device(config.device)))
        stops.hold()

        def hold() -> None:  # rank 0 holds the run directory, and sets damaged parts aside to be redone
            held.enter_context(storage.writer_lock(run_dir))
            for table in storage.run_tables(manifest):
                (run_dir / table).mkdir(exist_ok=True)
                check, moved = storage.repair_parts(run_dir, manifest, table)
                if check.damaged:
                    manifest.setdefault("repairs", []).append({
                        "at": _now(), "quarantine": str(moved) if moved else None,
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


def _prepare_resume(run_dir: Path, manifest: dict, config: RunConfig, device: str) -> _Job:
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
        now = _tokenizer_inputs(inputs["tokenizer_location"]).get("tokenizer_fingerprint", {})
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
    job = _prepare(as_recorded, device, model_location=inputs["model_location"], dataset=dataset)
    if job.texts.sha256 != manifest["dataset"]["texts_sha256"]:
        raise ProbeError(
            f"The texts of {config.dataset.describe()} changed since the run started (SHA-256 "
            f"{job.texts.sha256[:12]}... now, {manifest['dataset']['texts_sha256'][:12]}... then). Restore "
            "the data, or start a new run with `probe run`."
        )
    if _plan_sha256(job.batches) != inputs["batch_plan_sha256"]:
        raise ProbeError(
            "The batches planned now differ from the run's (the tokenizer files changed?). Restore the "
            "model directory, or start a new run with `probe run`."
        )
    return job


def _execute(run_dir: Path, manifest: dict | None, job: _Job, stops: Stops, group: distributed.Group) -> Path:
    """Run every batch of the plan that has no part file yet, as a new segment of the run; with several
    processes, rank r takes every world-th of them and rank 0 keeps the manifest.  The C heap keeps
    freed memory for reuse meanwhile (:mod:`probe.allocator`)."""
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


def _execute_batches(run_dir: Path, manifest: dict | None, job: _Job, stops: Stops, group: distributed.Group) -> Path:
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
            "started_at": _now(),
            "device": str(job.device),
            "versions": _package_versions(),
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
    index = _PartIndex(run_dir, config.fidelity_tolerance, storage.part_records(manifest)) if group.main else None
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
            timings_s=_timings(manifest),
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
            _record_stop(run_dir, manifest, segment, index, error, job.started)
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C before our handler, or raised by a library
            raise RunStopped(signal.SIGINT, run_dir, manifest, ranks.rank) from error
        if isinstance(error, RunStopped):
            error.run_dir, error.manifest, error.rank = run_dir, manifest, ranks.rank
        raise
    progress.close()
    if lane is not None:
        lane.close()
    if group.main:
        _record_completion(run_dir, manifest, segment, index, config, job.started)
    return run_dir


def _start_batch(job: _Job, batch: int, lane=None):
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
        from .intervene import batch_records, run_config

        records, intervention_config = [], run_config(job.config)

        def capture(emit):
            started = time.perf_counter()
            records.extend(batch_records(job.loaded, inputs, example_ids, intervention_config, emit))
            records.append(time.perf_counter() - started)

    wait = process_batch(job.loaded, inputs, example_ids, job.config, summary, job.context, lane, capture)

    def finish() -> tuple[pa.Table, Summary, dict, pa.Table | None]:
        tables, seconds = wait()
        if records is None:
            return pa.concat_tables(tables), summary, seconds, None
        from .intervene import records_table

        seconds = dict(seconds, intervene=records[-1])  # the whole forward work, row capture included
        return pa.concat_tables(tables), summary, seconds, records_table(records[:-1])

    return finish


def _record_stop(run_dir: Path, manifest: dict, segment: dict, index: _PartIndex, error: BaseException,
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
    segment.update(status="interrupted", stop_reason=reason, finished_at=_now())
    segment["timings_s"]["total_s"] = time.perf_counter() - started
    manifest.update(
        status="interrupted",
        stop_reason=reason,
        batches_done=len(index.records),
        **index.tables(manifest),
        solver=index.summary.solver(),
        deviations=index.summary.settings(),
        fidelity=index.summary.fidelity_summary(),
        timings_s=_timings(manifest),
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


def _record_completion(run_dir: Path, manifest: dict, segment: dict, index: _PartIndex, config: RunConfig,
                       started: float) -> None:
    """Totals over every part file (whichever segment and rank wrote it) and every segment."""
    index.refresh()
    for each in manifest["segments"]:  # batches and seconds of every segment, from its part files
        index.fold_into(each)
    segment.update(status="complete", finished_at=_now())
    segment["timings_s"]["total_s"] = time.perf_counter() - started
    timings = _timings(manifest)
    if config.intervene:
        manifest["interventions"] = {**manifest.get("interventions", {}), **_intervention_totals(run_dir, manifest)}
    manifest.update(
        status="complete",
        finished_at=_now(),
        batches_done=len(index.records),
        **index.tables(manifest),
        solver=index.summary.solver(),
        deviations=index.summary.settings(),
        fidelity=index.summary.fidelity_summary(),
        timings_s=timings,
        problems_per_second=index.summary.rows / timings["solve_s"] if timings["solve_s"] else None,
    )
    storage.write_manifest(run_dir, manifest)
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


#: the intervention columns whose means the manifest records per (space, alpha, substitute, mode)
INTERVENTION_MEANS = ("hidden_change", "embedding_cosine", "lm_loss_original", "lm_loss", "top1_agreement")


def _intervention_totals(run_dir: Path, manifest: dict) -> dict:
    """The interventions' totals, read back from their part files by one streaming aggregate (:mod:`probe.query`;
    no record is held): records, and per (space, alpha, substitute) and mode (per-site: every site's records
    together; whole) the records, solves not converged and mean effects (over the values that are numbers:
    ``None`` where there is none, as for the LM loss without an LM head).  On one thread, so that the sums
    are taken in one order and a resumed run's totals equal an uninterrupted one's."""
    from .query import connect, parquet_source

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


def _progress(total: int, initial: int, enabled: bool):
    """A bar on a terminal; plain lines where stderr is a file or a pipe (:mod:`probe.progress`)."""
    from .progress import progress

    return progress(total, initial, enabled, unit="batch", desc="probe: solving")
