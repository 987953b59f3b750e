"""A run's settings (:class:`RunConfig`) and the names of their choices, importable without torch.

The command line and the Python API check options against these before anything heavy loads, so a
mistyped option is refused at once (:func:`probe.pipeline.validate.check_options`).  The pipeline records the
settings in the manifest (``config``) and :func:`probe.pipeline.runner.resume` reads them back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from probe.core.errors import ProbeError
from probe.core.naming import expand_path, recorded_path
from probe.core.version import __version__

#: the parameterisations, in display order: "hidden" (t = x/sqrt(d'), z = c W_k^T q), "key" (t = k/sqrt(d'), z = c q)
SPACES = ("hidden", "key")
#: the model dtypes ``--dtype`` takes (probe.capture.loading maps them to torch dtypes)
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
#: where the model's weights come from: the checkpoint, or a random initialisation (a control)
INITS = ("pretrained", "random")
#: what ``--intervene`` substitutes for the model's attention weights (probe.interventions.SUBSTITUTES, without torch)
INTERVENTION_SUBSTITUTES = ("exact", "second-order", "null", "model")
#: the intervention modes ``--intervene-modes`` takes: every site on its own, and all sites at once
INTERVENTION_MODES = ("per-site", "whole")


@dataclass
class DatasetSpec:
    """Where texts come from.  ``name=None`` means the embedded corpus.

    ``split`` and ``column`` are ``None`` when not given (then ``"train"`` and ``"text"``), so that an
    option that does not apply to the chosen input (``--split`` on a local file, ``--column`` with the
    embedded corpus) can be told from its default and rejected.
    """

    name: str | None = None
    config: str | None = None
    split: str | None = None
    column: str | None = None
    target_column: str | None = None
    samples: int | None = None  # --samples N: the first N non-empty texts (None: every text)
    # --samples random:N: N texts drawn at random by this seed (the run's --seed) instead of the first N
    sample_seed: int | None = None

    @property
    def split_name(self) -> str:
        return self.split or "train"

    @property
    def text_column(self) -> str:
        return self.column or "text"

    @property
    def local_path(self) -> Path | None:
        """The local file or folder behind ``name``, or None (embedded corpus, hub dataset)."""
        if self.name is None:
            return None
        path = Path(self.name).expanduser()
        return path if path.exists() else None

    def describe(self) -> str:
        drawn = f", a random sample of {self.samples} drawn with seed {self.sample_seed}" if self.drawn else ""
        return self.source() + drawn

    @property
    def drawn(self) -> bool:
        """Whether the texts are a random sample (``--samples random:N``) rather than the first N."""
        return self.samples is not None and self.sample_seed is not None

    def source(self) -> str:
        """Where the texts come from, in words."""
        if self.name is None:
            return "embedded probe corpus"
        if self.local_path is not None:  # without this machine's layout where possible (~/data.txt)
            return f"{recorded_path(self.name)} [{self.text_column}]"
        parts = [self.name] + ([self.config] if self.config else []) + [self.split_name]
        return "/".join(parts) + f" [{self.text_column}]"


@dataclass
class RunConfig:
    """Everything that defines a run; recorded in the manifest (``config``) and used again by resume."""

    model: str
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    out: Path = Path("runs")
    revision: str | None = None
    batch_size: int = 8
    max_length: int = 128
    alphas: tuple[float, ...] = (1.0,)  # strengths solved for (one capture, one solve each)
    spaces: tuple[str, ...] | None = None  # "hidden" and/or "key"; None: the adapter's default (rotary: key)
    init: str = "pretrained"  # or "random": the same architecture with fresh weights (seeded by ``seed``)
    tokenizer: str | None = None  # where the tokenizer is when it is not beside the model (--tokenizer)
    max_memory_bytes: int | None = None  # --max-memory: bounds the problems held at once (probe.batch.rows)
    threads: int | None = None  # --threads: torch's intra-op threads (None: torch's default, all cores)
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    rtol: float = 1e-9
    fidelity_tolerance: float | None = None  # None: by the model's dtype (probe.batch.rows.FIDELITY_TOLERANCE)
    progress: bool = True
    name: str | None = None  # --name: the run's name (directory and report title); None: from the model's files
    # --intervene: substitutes put into the forward pass (probe.interventions), () = off; their records go to
    # the run's second table, interventions.parquet/
    intervene: tuple[str, ...] = ()
    intervene_modes: tuple[str, ...] = INTERVENTION_MODES  # --intervene-modes: per-site and/or whole
    # --allow-unknown-tokens: run although the tokenizer turns more than probe.capture.tokens.UNKNOWN_LIMIT of the
    # tokens into its unknown token (refused otherwise, before the model loads)
    allow_unknown_tokens: bool = False
    # the training step of the weights measured (a checkpoint of a series, probe.training.series; the model being trained,
    # probe.callbacks); None: the run is not a step of training
    step: int | None = None


#: the settings that hold local paths, which the manifest records without this machine's layout
#: (probe.core.naming.recorded_path: ``<site-packages>/...``, ``~/...``) and resume expands again
PATH_SETTINGS = ("model", "tokenizer", "out")


def config_to_json(config: RunConfig) -> dict:
    data = json.loads(json.dumps(asdict(config), default=str))
    for name in PATH_SETTINGS:
        data[name] = recorded_path(data[name]) if data[name] is not None else None
    if data["dataset"]["name"] is not None:
        data["dataset"]["name"] = recorded_path(data["dataset"]["name"])
    return data


def config_from_json(data: dict) -> RunConfig:
    """The :class:`RunConfig` a manifest recorded (lists become tuples, as the dataclass declares them)."""
    known = {f.name: f for f in fields(RunConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ProbeError(
            f"The run was written by another version of probe (settings {', '.join(unknown)} are unknown to "
            f"probe {__version__}); resume it with that version."
        )
    values = {}
    for name, value in data.items():
        if name == "dataset":
            value = DatasetSpec(**{**value, "name": expand_path(value.get("name"))})
        elif name == "out":
            value = Path(expand_path(value))
        elif name in PATH_SETTINGS:
            value = expand_path(value)
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    return RunConfig(**values)
