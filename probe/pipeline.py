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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from . import __version__
from .adapters import SiteCapture, adapter_for
from .data import DatasetSpec, Texts, load_texts
from .errors import ProbeError
from .schema import DEVIATION_SCHEMA
from .solver import DualProblems, DualSolution, solve_dual

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunConfig:
    """Everything that defines a run; recorded in the manifest."""

    model: str
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    out: Path = Path("runs")
    revision: str | None = None
    batch_size: int = 8
    max_length: int = 128
    alpha: float = 1.0
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    rtol: float = 1e-9
    fidelity_tolerance: float = 1e-5
    progress: bool = True


# --------------------------------------------------------------------------------------------------
# model loading


@dataclass
class LoadedModel:
    adapter: object
    model: torch.nn.Module
    tokenizer: object
    info: dict


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ProbeError(f"Unknown device '{device}'. Use auto, cpu, cuda or cuda:N.") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"Device '{device}' asked for, but CUDA is not available here. Use --device cpu.")
    return resolved


def load_model(name: str, *, revision: str | None = None, dtype: str = "float32", device: str = "auto") -> LoadedModel:
    """Load config, adapter, model (eager attention) and tokenizer for a hub id or local directory."""
    from transformers import AutoConfig, AutoTokenizer

    if dtype not in DTYPES:
        raise ProbeError(f"Unknown dtype '{dtype}'. Choose one of: {', '.join(DTYPES)}.")
    resolved = _resolve_device(device)  # before the (slow) load, so that a bad --device fails at once
    path = Path(name).expanduser()
    if path.exists() and not (path / "config.json").exists():
        raise ProbeError(
            f"'{name}' is a local path but has no config.json: it is not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained, or a hub model id."
        )
    try:
        config = AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:
        raise ProbeError(
            f"Could not load model '{name}': {str(error).splitlines()[0]}\n"
            "Pass a local model directory (one written by save_pretrained), or check the model id and your "
            "connection to the Hugging Face Hub (offline? set HF_HUB_OFFLINE=1 and use a cached or local model)."
        ) from None
    adapter = adapter_for(config.model_type)
    saved_implementation = getattr(config, "_attn_implementation", None)
    config._attn_implementation = "eager"
    try:
        model = adapter.load_model(name, config=config, revision=revision, dtype=DTYPES[dtype])
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:
        raise ProbeError(
            f"Could not load the weights or tokenizer of '{name}': {str(error).splitlines()[0]}\n"
            "A model directory needs its weights and tokenizer files; for a hub id, check your connection."
        ) from None
    if model.config._attn_implementation != "eager":
        raise ProbeError(
            f"'{name}' loaded with {model.config._attn_implementation} attention, which hides attention "
            "probabilities; probe needs eager attention. Remove _attn_implementation from its config.json."
        )
    model.eval().to(resolved)
    info = {
        "id": name,
        "path": str(path.resolve()) if path.exists() else None,
        "revision": revision or getattr(config, "_commit_hash", None),
        "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None),
        "class": type(model).__name__,
        "saved_attention_implementation": saved_implementation,
    }
    return LoadedModel(adapter=adapter, model=model, tokenizer=tokenizer, info=info)


# --------------------------------------------------------------------------------------------------
# sites -> problems -> rows


def site_problems(site: SiteCapture, alpha: float) -> DualProblems:
    r"""The site's problems for strength ``alpha``: one group per example, one problem per (head, query).

    Adapters give :math:`\alpha = 1` quantities; for other :math:`\alpha` the evidence is rescaled to
    :math:`z/\alpha` so that :math:`\alpha\langle t_i, z\rangle + \log u_i` still equals the model's logits.
    """
    b, h, q, k = site.logits.shape
    log_pref = site.log_preference.expand(b, h, q, k).reshape(b, h * q, k)
    active = site.query_mask[:, None, :].expand(b, h, q).reshape(b, h * q)
    return DualProblems(
        gram=site.gram,
        logits=site.logits.reshape(b, h * q, k) / alpha,
        log_preference=log_pref,
        evidence_sqnorm=site.evidence_sqnorm.reshape(b, h * q) / alpha**2,
        alpha=alpha,
        active=active,
    )


def fidelity_error(site: SiteCapture) -> float:
    """Max |softmax(log u + alpha s) - model probabilities| over the site's real queries (alpha = 1)."""
    reconstructed = torch.softmax(site.log_preference + site.logits, dim=-1)
    difference = (reconstructed - site.model_probs.to(torch.float64)).abs().amax(dim=-1)  # (b, h, q)
    difference = difference.masked_fill(~site.query_mask[:, None, :], 0.0)
    return float(difference.max()) if difference.numel() else 0.0


def site_rows(site: SiteCapture, solution: DualSolution, example_ids: list[int], model_name: str, alpha: float) -> pa.Table:
    """One row per (example, head, real query) of the site, in the parquet schema."""
    b, h, q, k = site.logits.shape
    active = site.query_mask[:, None, :].expand(b, h, q)
    n_keys = torch.isfinite(site.log_preference.expand(b, h, q, k)).sum(-1)
    ex, head, query = active.nonzero(as_tuple=True)

    def pick(x):
        return x.reshape(b, h, q)[ex, head, query].cpu().numpy()

    count = len(ex)
    examples = np.asarray(example_ids, dtype=np.int64)[ex.cpu().numpy()]
    columns = {
        "model": pa.array([model_name] * count, pa.string()),
        "attention_type": pa.array([site.attention_type] * count, pa.string()),
        "layer": np.full(count, site.layer, np.int32),
        "head": head.cpu().numpy().astype(np.int32),
        "example": examples,
        "query": query.cpu().numpy().astype(np.int32),
        "n_keys": n_keys[ex, head, query].cpu().numpy().astype(np.int32),
        "alpha": np.full(count, alpha, np.float64),
        "rel_deviation": pick(solution.rel_deviation),
        "lambda_norm": pick(solution.lambda_norm),
        "duality_gap": pick(solution.duality_gap),
        "error_bound": pick(solution.error_bound),
        "iterations": pick(solution.iterations).astype(np.int32),
        "converged": pick(solution.converged),
    }
    return pa.table(columns, schema=DEVIATION_SCHEMA)


# --------------------------------------------------------------------------------------------------
# bookkeeping


class Summary:
    """Running solver and fidelity summaries for the manifest."""

    def __init__(self, tolerance: float):
        self.rows = 0
        self.not_converged = 0
        self.max_duality_gap = 0.0
        self.max_relative_error_bound = 0.0
        self.iterations_total = 0
        self.iterations_max = 0
        self.fidelity: dict[str, float] = {}
        self.tolerance = tolerance

    def add(self, table: pa.Table, site: SiteCapture, fidelity: float):
        if table.num_rows:
            converged = table["converged"].to_numpy(zero_copy_only=False)
            iterations = table["iterations"].to_numpy()
            bound = table["error_bound"].to_numpy() / table["lambda_norm"].to_numpy()
            self.rows += table.num_rows
            self.not_converged += int((~converged).sum())
            self.max_duality_gap = max(self.max_duality_gap, float(np.nanmax(table["duality_gap"].to_numpy())))
            self.max_relative_error_bound = max(self.max_relative_error_bound, float(np.nanmax(bound)))
            self.iterations_total += int(iterations.sum())
            self.iterations_max = max(self.iterations_max, int(iterations.max()))
        key = site.attention_type
        self.fidelity[key] = max(self.fidelity.get(key, 0.0), fidelity)

    def solver(self) -> dict:
        return {
            "method": "Newton-CG on the reduced dual with Armijo backtracking (probe.solver)",
            "dtype": "float64",
            "newton_direction_dtype": "float32",
            "rows": self.rows,
            "converged": self.rows - self.not_converged,
            "not_converged": self.not_converged,
            "max_duality_gap": self.max_duality_gap,
            "max_relative_error_bound": self.max_relative_error_bound,
            "mean_iterations": self.iterations_total / self.rows if self.rows else None,
            "max_iterations": self.iterations_max,
        }

    def fidelity_summary(self) -> dict:
        worst = max(self.fidelity.values(), default=0.0)
        return {
            "check": "max |softmax(log u + alpha s) - eager attention probabilities| over real queries",
            "max_abs_error": worst,
            "by_attention_type": dict(self.fidelity),
            "tolerance": self.tolerance,
            "passed": worst <= self.tolerance,
        }


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
    if config.alpha <= 0:
        raise ProbeError(f"--alpha must be positive, got {config.alpha}.")
    if config.batch_size < 1 or config.max_length < 1:
        raise ProbeError("--batch-size and --max-length must be at least 1.")
    torch.manual_seed(config.seed)
    timings = {}
    started = time.perf_counter()
    loaded = load_model(config.model, revision=config.revision, dtype=config.dtype, device=config.device)
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
        "alpha": config.alpha,
        "parameterisation": {
            "alpha": config.alpha,
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
            tables, seconds = _process_batch(loaded, inputs, example_ids, config, summary)
            capture_s += seconds["capture"]
            solve_s += seconds["solve"]
            problems_done += sum(table.num_rows for table in tables)
            t1 = time.perf_counter()
            writer.write_table(pa.concat_tables(tables))
            write_s += time.perf_counter() - t1
            manifest.update(
                batches_done=batch_number + 1,
                solver=summary.solver(),
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


@torch.no_grad()
def _process_batch(loaded: LoadedModel, inputs: dict, example_ids: list[int], config: RunConfig, summary: Summary):
    """Capture every attention site of one batch, solve its problems and return the rows per site."""
    tables = []
    seconds = {"capture": 0.0, "solve": 0.0}
    t0 = time.perf_counter()
    for chunk in site_stacks(loaded.adapter.capture(loaded.model, inputs)):
        fidelities = [fidelity_error(site) for site in chunk]
        t1 = time.perf_counter()
        seconds["capture"] += t1 - t0
        solutions = solve_sites(chunk, config.alpha, config.rtol)
        for site, solution, fidelity in zip(chunk, solutions, fidelities):
            table = site_rows(site, solution, example_ids, config.model, config.alpha)
            summary.add(table, site, fidelity)
            tables.append(table)
        t0 = time.perf_counter()
        seconds["solve"] += t0 - t1
    return tables, seconds


#: at most this many bytes of float64 logits in one stack of sites (bounds the extra memory of stacking)
STACK_BYTES = 1 << 28


def site_stacks(sites, limit_bytes: int = STACK_BYTES):
    """Consecutive sites whose problems have one shape, in lists of at most ``limit_bytes`` of logits."""
    chunk, shape, size = [], None, 0
    for site in sites:
        b, h, q, k = site.logits.shape
        nbytes = site.logits.numel() * 8
        if chunk and ((h * q, k) != shape or size + nbytes > limit_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(site)
        shape, size = (h * q, k), size + nbytes
    if chunk:
        yield chunk


def stacked_problems(sites: list[SiteCapture], alpha: float) -> DualProblems:
    """The problems of sites of one shape as one batch: their groups stacked along the group axis."""
    problems = [site_problems(site, alpha) for site in sites]
    if len(problems) == 1:
        return problems[0]
    return DualProblems(
        gram=torch.cat([p.gram for p in problems]),
        logits=torch.cat([p.logits for p in problems]),
        log_preference=torch.cat([p.log_preference for p in problems]),
        evidence_sqnorm=torch.cat([p.evidence_sqnorm for p in problems]),
        alpha=alpha,
        active=torch.cat([p.active for p in problems]),
    )


def solve_sites(sites: list[SiteCapture], alpha: float, rtol: float) -> list[DualSolution]:
    """Solve the problems of sites of one shape with one :func:`solve_dual` call, one solution per site.

    Per-call overhead is paid once and the solver's batched products run on larger batches; the
    problems stay independent of one another.
    """
    solution = solve_dual(stacked_problems(sites, alpha), rtol=rtol)
    solutions, start = [], 0
    for site in sites:
        stop = start + site.logits.shape[0]
        solutions.append(DualSolution(**{name: value[start:stop] for name, value in vars(solution).items()}))
        start = stop
    return solutions


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="batch", desc="probe", disable=not enabled, dynamic_ncols=True)
