"""The run pipeline: dataset -> batches -> captured sites -> dual solves -> rows -> parquet + manifest.

Rows are appended to ``deviations.parquet`` one row group per batch, so memory does not grow with the
dataset, and the manifest is rewritten after every batch: an interrupted run keeps every finished batch
and says where it stopped.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from . import __version__
from .data import DatasetSpec, Texts, load_texts
from .errors import ProbeError
from .loading import LoadedModel, load_model
from .rows import RowContext, Summary, process_batch
from .schema import DEVIATION_SCHEMA


@dataclass
class RunConfig:
    """Everything that defines a run; recorded in the manifest."""

    model: str
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    out: Path = Path("runs")
    revision: str | None = None
    batch_size: int = 8
    max_length: int = 128
    alphas: tuple[float, ...] = (1.0,)  # strengths solved for (one capture, one solve each)
    spaces: tuple[str, ...] = ("hidden",)  # parameterisations: "hidden" and/or "key"
    init: str = "pretrained"  # or "random": the same architecture with fresh weights (seeded by ``seed``)
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    rtol: float = 1e-9
    fidelity_tolerance: float = 1e-5
    progress: bool = True


# --------------------------------------------------------------------------------------------------
# bookkeeping


def _package_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version(), "probe": __version__}
    for package in ("torch", "transformers", "datasets", "pandas", "pyarrow", "numpy"):
        try:
            versions[package] = md.version(package)
        except md.PackageNotFoundError:
            versions[package] = None
    return versions


def _run_directory(out: Path, model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(model_name.rstrip("/")).name or model_name).strip("-") or "model"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate = out / f"{slug}-{stamp}"
    suffix = 1
    while candidate.exists():
        suffix += 1
        candidate = out / f"{slug}-{stamp}-{suffix}"
    candidate.mkdir(parents=True)
    return candidate


def _write_json(path: Path, payload: dict):
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


def _batches(loaded: LoadedModel, texts: Texts, batch_size: int, max_length: int):
    """Batches of dataset positions, longest first (less padding; memory problems show at once)."""
    lengths = [
        len(ids) for ids in loaded.tokenizer(texts.texts, truncation=True, max_length=max_length)["input_ids"]
    ]
    if max(lengths) > max_length:
        raise ProbeError(
            f"--max-length {max_length} is too small for this tokenizer: it produced {max(lengths)} tokens "
            "(special tokens are never truncated). Use a larger --max-length."
        )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)], lengths


# --------------------------------------------------------------------------------------------------
# the run


def run(config: RunConfig) -> Path:
    """Run probe on a model and dataset; return the run directory."""
    if not config.alphas or any(not (alpha > 0 and alpha < float("inf")) for alpha in config.alphas):
        raise ProbeError(f"--alpha must be finite and positive, got {', '.join(map(str, config.alphas))}.")
    if config.init not in ("pretrained", "random"):
        raise ProbeError(f"--init must be pretrained or random, got '{config.init}'.")
    if config.batch_size < 1 or config.max_length < 1:
        raise ProbeError("--batch-size and --max-length must be at least 1.")
    torch.manual_seed(config.seed)
    timings = {}
    started = time.perf_counter()
    loaded = load_model(
        config.model, revision=config.revision, dtype=config.dtype, device=config.device, init=config.init,
        seed=config.seed,
    )
    unsupported = [space for space in config.spaces if space not in loaded.adapter.spaces]
    if unsupported:
        raise ProbeError(
            f"{loaded.info['model_type']} supports the space(s) {', '.join(loaded.adapter.spaces)} only, not "
            f"{', '.join(unsupported)} (rotary models have no hidden-space parameterisation). Pass "
            f"--space {','.join(loaded.adapter.spaces)}."
        )
    timings["load_model_s"] = time.perf_counter() - started
    t0 = time.perf_counter()
    texts = load_texts(config.dataset)
    timings["load_data_s"] = time.perf_counter() - t0
    device = next(loaded.model.parameters()).device

    batches, lengths = _batches(loaded, texts, config.batch_size, config.max_length)
    run_dir = _run_directory(Path(config.out), config.model)
    parquet_path = run_dir / "deviations.parquet"
    manifest_path = run_dir / "manifest.json"
    summary = Summary(config.fidelity_tolerance)
    context = RowContext(
        model_name=config.model, example_ids=[], special_ids=frozenset(loaded.tokenizer.all_special_ids),
        token_text={}, tokenizer=loaded.tokenizer,
    )
    manifest = {
        "probe_version": __version__,
        "status": "running",
        "started_at": datetime.now(timezone.utc).isoformat(),
        "model": loaded.info,
        "adapter": type(loaded.adapter).__name__,
        "attention_types": list(loaded.adapter.attention_types),
        "attention_implementation": "eager",
        "dtype": config.dtype,
        "device": str(device),
        "dataset": {
            **asdict(config.dataset),
            "description": config.dataset.describe(),
            "n_examples": len(texts.texts),
            "skipped_empty": texts.skipped_empty,
            "texts_sha256": texts.sha256,
            "max_length": config.max_length,
            "truncated_examples": sum(length >= config.max_length for length in lengths),
        },
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
        "timings_s": timings,
        "batches_done": 0,
        "batches_total": len(batches),
    }
    _write_json(manifest_path, manifest)

    capture_s = solve_s = write_s = 0.0
    problems_done = 0
    writer = pq.ParquetWriter(parquet_path, DEVIATION_SCHEMA)
    progress = _progress(len(batches), config.progress)
    try:
        for batch_number, positions in enumerate(batches):
            batch_texts = [texts.texts[i] for i in positions]
            batch_targets = [texts.targets[i] for i in positions] if texts.targets is not None else None
            example_ids = [texts.indices[i] for i in positions]
            inputs = loaded.adapter.encode(loaded.tokenizer, batch_texts, batch_targets, config.max_length)
            inputs = {key: value.to(device) for key, value in inputs.items()}
            tables, seconds = process_batch(loaded, inputs, example_ids, config, summary, context)
            capture_s += seconds["capture"]
            solve_s += seconds["solve"]
            problems_done += sum(table.num_rows for table in tables)
            t1 = time.perf_counter()
            writer.write_table(pa.concat_tables(tables))
            write_s += time.perf_counter() - t1
            manifest.update(
                batches_done=batch_number + 1,
                solver=summary.solver(),
                deviations=summary.settings(),
                fidelity=summary.fidelity_summary(),
                timings_s={**timings, "capture_s": capture_s, "solve_s": solve_s, "write_s": write_s},
            )
            _write_json(manifest_path, manifest)
            progress.update(1)
            elapsed = progress.format_dict.get("elapsed") or 1e-9
            progress.set_postfix(problems_per_s=f"{problems_done / max(elapsed, 1e-9):,.0f}", refresh=False)
    except BaseException as error:
        writer.close()
        progress.close()
        manifest.update(
            solver=summary.solver(),
            deviations=summary.settings(),
            fidelity=summary.fidelity_summary(),
            status="interrupted",
            error=f"{type(error).__name__}: {error}",
            note="deviations.parquet holds every batch finished before the interruption",
            finished_at=datetime.now(timezone.utc).isoformat(),
        )
        _write_json(manifest_path, manifest)
        raise
    writer.close()
    progress.close()
    timings.update(capture_s=capture_s, solve_s=solve_s, write_s=write_s, total_s=time.perf_counter() - started)
    manifest.update(
        status="complete",
        finished_at=datetime.now(timezone.utc).isoformat(),
        timings_s=timings,
        solver=summary.solver(),
        deviations=summary.settings(),
        fidelity=summary.fidelity_summary(),
        problems_per_second=problems_done / solve_s if solve_s else None,
    )
    _write_json(manifest_path, manifest)
    if not manifest["fidelity"]["passed"]:
        import warnings

        warnings.warn(
            f"Fidelity check failed: reconstructed attention differs from the model's by "
            f"{manifest['fidelity']['max_abs_error']:.2e} (> {config.fidelity_tolerance:.0e}); see {manifest_path}. "
            "Low-precision dtypes (bfloat16, float16) round attention by ~1e-3: pass --fidelity-tolerance.",
            stacklevel=2,
        )
    return run_dir


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="batch", desc="probe", disable=not enabled, dynamic_ncols=True)
