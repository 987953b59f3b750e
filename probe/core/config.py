"""A run's settings (:class:`RunConfig`) and the names of their choices, importable without torch.

The command line and the Python API check options against these before anything heavy loads, so a
mistyped option is refused at once (:func:`probe.pipeline.validate.check_options`).  The pipeline records the
settings in the manifest (``config``) and :func:`probe.pipeline.runner.resume` reads them back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from probe.core import arguments
from probe.core.errors import ProbeError
from probe.core.naming import expand_path, recorded_path
from probe.core.spelling import option
from probe.core.version import __version__

#: the parameterisations, in display order: "hidden" (t = x/sqrt(d'), z = c W_k^T q), "key" (t = k/sqrt(d'), z = c q)
SPACES = ("hidden", "key")
#: the model dtypes ``--dtype`` takes (probe.capture.loading maps them to torch dtypes)
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
#: where the model's weights come from: the checkpoint, or a random initialisation (a control)
INITS = ("pretrained", "random")
#: the attention the model runs while it is measured (``--attn-implementation``): its eager attention, whose
#: probabilities the fidelity check compares; or its fast attention (SDPA), which never forms the (h, k, k)
#: probabilities, and whose output the fidelity check compares (probe.capture.adapters.interface)
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
#: what ``--intervene`` substitutes for the model's attention weights (probe.interventions.SUBSTITUTES, without torch)
INTERVENTION_SUBSTITUTES = ("exact", "second-order", "null", "model")
#: the intervention modes ``--intervene-modes`` takes: every site on its own, and all sites at once
INTERVENTION_MODES = ("per-site", "whole")
#: what a run keeps of its rows (``--keep``): every row; mergeable statistics only (probe.batch.aggregates);
#: those statistics and a seeded uniform sample of N rows (``sample:N``)
KEEP_MODES = ("rows", "aggregates", "sample")


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
    fidelity_tolerance: float | None = None  # None: by the model's dtype (probe.batch.problems.FIDELITY_TOLERANCE)
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
    # what the run measures (probe.capture.selection): layers and query heads as comma-separated indices and ranges,
    # negative from the end (None: all; probe.core.arguments.indices), attention types (None: all), and which
    # query positions of each text (probe.core.arguments.queries: all, last, every:K, sample:N)
    layers: str | None = None
    heads: str | None = None
    attention_types: tuple[str, ...] | None = None
    queries: str = "all"
    # --keep: "rows" (every row, as parquet parts), "aggregates" (mergeable statistics computed where the rows
    # are, no row table) or "sample:N" (the aggregates, and a seeded uniform sample of N rows as parts)
    keep: str = "rows"
    # --attn-implementation: the attention the model runs while it is measured (ATTN_IMPLEMENTATIONS)
    attn_implementation: str = "eager"

    @classmethod
    def from_options(
        cls, model: str, *, dataset: str | None = None, config: str | None = None, split: str | None = None,
        column: str | None = None, target_column: str | None = None, samples: int | str | None = None,
        max_length: int = 128,
        batch_size: int = 8, alpha=1.0, space=None, init: str = "pretrained", tokenizer=None, max_memory=None,
        threads: int | None = None, out="runs", device: str = "auto", dtype: str = "float32",
        revision: str | None = None, seed: int = 0, fidelity_tolerance=None, name: str | None = None,
        progress: bool = True, intervene=None, intervene_modes=None, allow_unknown_tokens: bool = False,
        step: int | None = None, layers=None, heads=None, attention_types=None, queries="all", keep="rows",
        attn_implementation: str | None = "eager",
    ) -> "RunConfig":
        """The settings of a run from the options as the command line, the Python API and the Trainer callback
        give them (:mod:`probe.core.arguments`: one value, a sequence or a comma-separated string; a size for
        ``max_memory``), each read one way for all three.  A value of the wrong kind is refused by name
        (:class:`ProbeError`); the values' ranges and their fit to the model are checked later
        (:func:`probe.pipeline.validate.check_options`, :func:`probe.pipeline.validate.check_run`).
        ``samples``: N (the first N texts) or ``"random:N"`` (N drawn by ``seed``); ``intervene_modes``: only with
        ``intervene`` (None: both modes)."""
        samples, drawn = arguments.samples(samples)
        if intervene_modes is not None and not intervene:
            raise ProbeError(
                f"{option('intervene_modes')} applies to interventions: add {option('intervene', 'exact')} (the "
                f"substitutes to put into the forward pass), or remove {option('intervene_modes')}."
            )
        arguments.whole_numbers(("samples", "threads", "step"), samples=samples, max_length=max_length,
                                batch_size=batch_size, threads=threads, step=step)
        arguments.seed(seed)
        if step is not None and step < 0:
            raise ProbeError(f"{option('step')} is a training step, a whole number >= 0; got {step}.")
        if fidelity_tolerance is not None and not arguments.is_number(fidelity_tolerance):
            raise ProbeError(f"{option('fidelity_tolerance')} takes a number, got {fidelity_tolerance!r}.")
        if isinstance(max_memory, str):
            max_memory = arguments.parse_size(max_memory, "max_memory")
        elif max_memory is not None:
            arguments.whole_numbers(max_memory=max_memory)
        layer_ranges, head_ranges = arguments.indices(layers, "layers"), arguments.indices(heads, "heads")
        return cls(
            model=str(model),
            dataset=DatasetSpec(name=None if dataset is None else str(dataset), config=config, split=split,
                                column=column, target_column=target_column, samples=samples,
                                sample_seed=seed if drawn else None),
            out=Path(out), revision=revision, batch_size=batch_size, max_length=max_length,
            alphas=arguments.numbers(alpha, "alpha"), spaces=arguments.names(space, "space"), init=init,
            tokenizer=None if tokenizer is None else str(tokenizer), max_memory_bytes=max_memory, threads=threads,
            device=device, dtype=dtype, seed=seed, fidelity_tolerance=fidelity_tolerance, progress=progress,
            name=name, intervene=arguments.names(intervene, "intervene") or (),
            intervene_modes=arguments.names(INTERVENTION_MODES if intervene_modes is None else intervene_modes,
                                            "intervene_modes"),
            allow_unknown_tokens=bool(allow_unknown_tokens), step=step,
            layers=None if layer_ranges is None else arguments.describe_indices(layer_ranges),
            heads=None if head_ranges is None else arguments.describe_indices(head_ranges),
            attention_types=arguments.names(attention_types, "attention_types"),
            queries=str(arguments.queries(queries)), keep=arguments.describe_keep(arguments.parse_keep(keep)),
            attn_implementation="eager" if attn_implementation is None else str(attn_implementation),
        )

    @property
    def selects(self) -> bool:
        """Whether the run measures less than every layer, head, attention type and query position."""
        return (self.layers is not None or self.heads is not None or self.attention_types is not None
                or arguments.queries(self.queries).selects)


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
