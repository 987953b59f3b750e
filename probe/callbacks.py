"""Measuring a model while it trains: :class:`ProbeCallback`, a ``transformers.TrainerCallback``.

Every ``every_n_steps`` optimizer steps the callback measures a fixed probe set on the model being trained,
in memory, through probe's own pipeline (:func:`probe.pipeline.runner.run` with ``model=``): each measurement is an
ordinary run directory under ``out_dir`` (``probe.load`` reads it, ``probe compare`` draws the runs against
their step) whose manifest records the step (``config.step``) and the epoch (``training``).  Its headline
numbers go through the Trainer's own logging: they are added to the ``logs`` of the Trainer's next log (which
the callback asks for at that step), so ``on_log`` callbacks, ``report_to`` (TensorBoard, W&B, ...) and
``trainer.state.log_history`` receive them under ``probe/...`` names.

What a measurement does to the training: none of its numbers, weights or random streams change.  For the
measurement the model is put in eval mode (no dropout) and runs probe's attention function (its family's eager
attention, selected for this model alone); afterwards each of its modules is given back the mode it had, and
the model its attention implementation; the random number generators are saved and restored (the pipeline
seeds its own); no gradient is computed and the optimizer is never touched.  It costs the
training the measurement's time, on the model's own device, which the run's manifest records (``timings_s``)
and the logs state (``probe/seconds``).

Before training starts (``on_train_begin``) the callback checks that probe can measure the model: a family it
captures, a tokenizer (``tokenizer=``, or the Trainer's ``processing_class``), the probe set within the model's
length limits, and one forward pass of the first text captured without error.  A problem raises a
:class:`ProbeError` there, before the first step, and nothing is written.

:func:`measure` measures a model in memory once, outside any Trainer.
"""

from __future__ import annotations

import inspect
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
from transformers import TrainerCallback

from probe.core.errors import ProbeError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

#: a row deviates "far" above this relative deviation (the report's headline share)
FAR = 0.1
#: the prefix of the numbers the callback logs
PREFIX = "probe/"


def _model_dtype(model) -> str:
    from probe.capture.loading import DTYPES

    dtype = next(model.parameters()).dtype
    names = {value: key for key, value in DTYPES.items()}
    if dtype not in names:
        raise ProbeError(f"The model's weights are {dtype}; probe measures models in {', '.join(DTYPES)} only.")
    return names[dtype]


def in_memory(model, tokenizer, *, name: str | None = None):
    """A model in memory and its tokenizer as probe's :class:`~probe.capture.loading.LoadedModel` (the model is not copied:
    the run measures it as it is); a family probe cannot capture is refused with a :class:`ProbeError`."""
    from probe.capture.adapters import adapter_for
    from probe.capture.loading import LoadedModel

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "parameters") or getattr(config, "model_type", None) is None:
        raise ProbeError(f"probe measures transformers models (with a config naming their model_type); a "
                         f"{type(model).__name__} has none.")
    adapter = adapter_for(config.model_type)
    adapter.model_class(config)  # the adapter may refuse a configuration it cannot capture
    if tokenizer is None:
        raise ProbeError("probe needs the model's tokenizer to measure it: pass tokenizer= to the callback, or give "
                         "the Trainer its processing_class.")
    adapter.prepare(model)
    name = name or getattr(config, "_name_or_path", None) or type(model).__name__
    info = {
        "id": str(name), "path": None, "revision": None, "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None), "class": type(model).__name__,
        "saved_attention_implementation": getattr(config, "_attn_implementation", None), "tokenizer": None,
        "init": "pretrained", "init_seed": None, "device_map": None, "in_memory": True,
    }
    return LoadedModel(adapter=adapter, model=model, tokenizer=tokenizer, info=info)


def check_in_memory(config, loaded):
    """The up-front checks of :func:`probe.pipeline.validate.check_run` that apply to a model in memory (options, output
    folder, texts, spaces, max length, unknown tokens): a :class:`~probe.pipeline.validate.Checked`; nothing is written."""
    from dataclasses import replace

    from probe.batch.problems import FIDELITY_TOLERANCE
    from probe.capture.data import load_texts
    from probe.capture.selection import resolve
    from probe.capture.tokens import check_unknown_tokens, unknown_tokens
    from probe.core.environment import check_environment
    from probe.core.spelling import option
    from probe.pipeline.validate import Checked, check_family_options, check_max_length, check_options, check_output

    check_environment()
    check_options(config)
    check_output(Path(config.out))
    started = time.perf_counter()
    texts = load_texts(config.dataset)
    load_data_s = time.perf_counter() - started
    spaces = tuple(config.spaces or loaded.adapter.spaces[:1])
    unsupported = [space for space in spaces if space not in loaded.adapter.spaces]
    if unsupported:
        raise ProbeError(f"{loaded.info['model_type']} supports the space(s) {', '.join(loaded.adapter.spaces)} only, "
                         f"not {', '.join(unsupported)}. Pass {option('space', ','.join(loaded.adapter.spaces))}.")
    check_family_options(config, loaded.model.config, loaded.adapter)  # attn_implementation="sdpa" needs the interface
    check_max_length(config, loaded.model.config, loaded.tokenizer)
    resolve(config, loaded.adapter.stacks(loaded.model.config))  # the selection against the model
    unknown = unknown_tokens(loaded.tokenizer, texts.texts, config.max_length)
    check_unknown_tokens(unknown, config.model, config.allow_unknown_tokens)
    tolerance = FIDELITY_TOLERANCE[config.dtype] if config.fidelity_tolerance is None else config.fidelity_tolerance
    return Checked(texts=texts, load_data_s=load_data_s, config=replace(config, spaces=spaces,
                                                                         fidelity_tolerance=tolerance),
                   unknown_tokens=unknown)


@contextmanager
def measuring(model):
    """The model as probe measures it, meanwhile: eval mode, probe's attention function (its family's eager
    attention, observable: :func:`probe.capture.adapters.interface.runs_probe_attention`), no gradients, and the
    random number generators (CPU and the model's GPU) as they were; afterwards each module's mode, the attention
    implementation and the generators are given back."""
    import torch

    from probe.capture.adapters.interface import runs_probe_attention

    modes = [(module, module.training) for module in model.modules()]
    device = next(model.parameters()).device
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    devices = [index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            model.eval()
            with runs_probe_attention(model):
                yield model
        finally:
            for module, training in modes:
                module.training = training


def _config(loaded, texts_name: str, out: Path, *, step, name, options: dict):
    """The run's settings for the model in memory (its device and dtype) and ``options``, read as
    :func:`probe.run` reads them (:meth:`probe.core.config.RunConfig.from_options`)."""
    from probe.core.config import RunConfig

    return RunConfig.from_options(
        loaded.info["id"], dataset=texts_name, out=out, device=str(next(loaded.model.parameters()).device),
        dtype=_model_dtype(loaded.model), name=name, step=step, **options,
    )


def _dry_capture(loaded, config) -> None:
    """One forward pass of the first text through the adapter's capture, nothing solved or kept: what probe cannot
    capture fails here, as a :class:`ProbeError`."""
    from probe.capture.data import load_texts

    first = load_texts(config.dataset).texts[:1]
    device = next(loaded.model.parameters()).device
    try:
        inputs = loaded.adapter.encode(loaded.tokenizer, first, None, config.max_length)
        inputs = {key: value.to(device) for key, value in inputs.items()}
        with measuring(loaded.model):
            loaded.adapter.capture(loaded.model, inputs, lambda site: None)
    except ProbeError as error:
        raise ProbeError(f"probe cannot measure this {type(loaded.model).__name__}: {error}") from None
    except Exception as error:  # noqa: BLE001 - the model's own failure, said in one line
        raise ProbeError(f"probe cannot measure this {type(loaded.model).__name__}: its forward pass on the first "
                         f"probe text failed ({type(error).__name__}: {str(error).splitlines()[0]}).") from None


def headline_numbers(run) -> dict[str, float]:
    """The numbers a measurement logs, over the non-trivial rows of each (space, alpha) slice of ``run`` (a
    :class:`probe.Run`): ``rows``, ``mean``, ``p95`` and ``share_above_0.1`` of the relative deviation, named
    ``probe/<number>`` for a run of one slice and ``probe/<space>/alpha=<alpha>/<number>`` otherwise."""
    from probe.query import where

    if run.aggregates is not None:  # keep="aggregates" / "sample:N": the statistics the run kept
        (stats,) = run.aggregates.stats("rel_deviation", [("space", "alpha")], quantiles={"p95": 0.95},
                                        above={"share": FAR})
        stats["above"] = np.rint(stats["share"] * stats["count"]).astype(np.int64)
    else:
        with run.open_table() as table:
            (stats,) = table.stats("rel_deviation", [("space", "alpha")], where(trivial=False),
                                   quantiles={"p95": 0.95})
            (above,) = table.aggregate({"above": f"CAST(count_if(rel_deviation > {FAR!r}) AS BIGINT)"},
                                       [("space", "alpha")], where(trivial=False))
        stats = stats.merge(above, on=["space", "alpha"], how="left")
    stats = stats.dropna(subset=["space", "alpha"])
    numbers = {}
    for record in stats.sort_values(["space", "alpha"]).to_dict("records"):
        prefix = PREFIX if len(stats) == 1 else f"{PREFIX}{record['space']}/alpha={float(record['alpha']):g}/"
        count = int(record["count"])
        numbers.update({
            f"{prefix}rows": count, f"{prefix}mean": float(record["mean"]), f"{prefix}p95": float(record["p95"]),
            f"{prefix}share_above_{FAR:g}": int(record["above"]) / count if count else math.nan,
        })
    return numbers


#: the options of :func:`probe.run` that a measurement of a model in memory takes (:func:`measure`,
#: :class:`ProbeCallback`); the others name the model, its files or its texts, which the model in memory and the
#: probe set give
IN_MEMORY_OPTIONS = (
    "alpha", "space", "max_length", "batch_size", "seed", "max_memory", "fidelity_tolerance", "allow_unknown_tokens",
    "layers", "heads", "attention_types", "queries", "keep", "attn_implementation",
)


def check_in_memory_options(options: dict) -> dict:
    """``options`` if each is one of :data:`IN_MEMORY_OPTIONS`; otherwise a :class:`ProbeError` naming it."""
    unknown = sorted(set(options) - set(IN_MEMORY_OPTIONS))
    if unknown:
        raise ProbeError(f"A measurement of a model in memory takes {', '.join(IN_MEMORY_OPTIONS)} of probe.run's "
                         f"options, not {', '.join(unknown)}.")
    return options


def measure(model, tokenizer, texts: Iterable[str], out: str | Path, *, step: int | None = None,
            name: str | None = None, progress: bool = False, training: dict | None = None, **options):
    """Measure ``model`` (in memory, on its device, in its dtype) on ``texts`` once: a new run directory under ``out``
    (``name``, default the model's name) whose manifest records ``step``; returns it as a :class:`probe.Run`.
    ``options``: :func:`probe.run`'s options that apply to a model in memory (:data:`IN_MEMORY_OPTIONS`: ``alpha``,
    ``space``, ``max_length``, ``batch_size``, ``seed``, the selection ``layers``, ``heads``, ``attention_types``,
    ``queries``, ...).  The model's modes, attention implementation and the random generators are as they were
    afterwards (:func:`measuring`)."""
    from probe.api import Run
    from probe.capture.given import GivenTexts
    from probe.pipeline.runner import run as run_pipeline
    from probe.pipeline.validate import check_options

    given = GivenTexts.of(texts)
    loaded = in_memory(model, tokenizer, name=name)
    config = _config(loaded, str(given.path), Path(out), step=step, name=name,
                     options=dict(check_in_memory_options(options), progress=progress))
    check_options(config)
    given.keep()
    checked = check_in_memory(config, loaded)
    with measuring(model):
        run_dir = run_pipeline(checked.config, model=loaded, checked=checked)
    if training:
        from probe.store import storage

        manifest = storage.read_manifest(run_dir)
        manifest["training"] = training
        storage.write_manifest(run_dir, manifest)
    return Run(run_dir)


class ProbeCallback(TrainerCallback):
    """Measure a fixed probe set on the model being trained every ``every_n_steps`` optimizer steps.

    Only the main process measures.  After training, :attr:`runs` lists the run directories and :attr:`logged`
    the numbers of each step.

    Args:
        texts: the probe set (a few hundred texts; empty strings are skipped, and a set without text is refused).
        every_n_steps: measure after every this many optimizer steps.
        out_dir: where the runs go, one directory per measurement named ``<name>-step<step>-<time>``.
        name: the runs' name (default: the model's ``name_or_path``).
        tokenizer: the model's tokenizer (default: the Trainer's ``processing_class``).
        at_start: also measure the weights training starts from, as step ``state.global_step`` before the
            first step; no Trainer log follows then, so its numbers are an entry of ``state.log_history`` of
            their own and in :attr:`logged`.
        progress: probe's progress lines on stderr.
        **options: :func:`probe.run`'s options that apply to a model in memory (:data:`IN_MEMORY_OPTIONS`):
            ``alpha``, ``space``, ``max_length``, ``batch_size``, ``seed``, what to measure (``layers``,
            ``heads``, ``attention_types``, ``queries``) and what to keep (``keep``: ``"rows"``,
            ``"aggregates"`` or ``"sample:N"``: a measurement that keeps aggregates writes a few MB whatever the
            probe set).
    """

    def __init__(self, texts: Iterable[str], every_n_steps: int, out_dir: str | Path, *, name: str | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, at_start: bool = False, progress: bool = False,
                 **options: Any):
        from probe.capture.given import GivenTexts
        from probe.core.arguments import whole_numbers
        from probe.core.config import RunConfig
        from probe.core.spelling import option

        whole_numbers(every_n_steps=every_n_steps)
        if every_n_steps < 1:
            raise ProbeError(f"{option('every_n_steps')} must be at least 1, got {every_n_steps}.")
        self.options = check_in_memory_options(options)
        RunConfig.from_options("model", **options)  # each option of the right kind, before training starts
        self.given = GivenTexts.of(texts)  # a probe set without text is refused here
        self.texts = self.given.texts
        self.every_n_steps = every_n_steps
        self.out_dir = Path(out_dir)
        self.name, self.tokenizer, self.at_start, self.progress = name, tokenizer, at_start, progress
        self.runs: list[Path] = []
        self.logged: dict[int, dict[str, float]] = {}
        self._pending: dict[str, float] = {}

    # ---- before training

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._ahead_of_loggers()
        tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
        if model is None:
            raise ProbeError("The Trainer gave the callback no model to measure.")
        loaded = in_memory(model, tokenizer, name=self.name)
        config = self._run_config(loaded, state.global_step)
        self.given.keep()  # the probe set as the runs record it, in probe's cache
        check_in_memory(config, loaded)
        _dry_capture(loaded, config)
        self._tokenizer = tokenizer
        if self.at_start:  # no log follows before the first step: the numbers get their own history entry
            self._measure(model, state)
            state.log_history.append({**self._pending, "step": state.global_step})
            self._pending = {}

    def _ahead_of_loggers(self) -> None:
        """Move this callback before the Trainer's ``report_to`` loggers, which the Trainer puts ahead of the
        callbacks it is given, so that they receive the numbers it adds to the logs.  The Trainer's list of
        callbacks is the one whose event called this (its ``CallbackHandler``); where none is found the numbers
        still reach the callbacks after this one and ``state.log_history``."""
        from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

        frame = inspect.currentframe()
        try:
            for _ in range(4):
                frame = frame.f_back if frame is not None else None
                handler = frame.f_locals.get("self") if frame is not None else None
                if isinstance(handler, CallbackHandler):
                    callbacks = handler.callbacks
                    if self in callbacks:
                        callbacks.remove(self)
                        flow = [i for i, each in enumerate(callbacks) if isinstance(each, DefaultFlowCallback)]
                        callbacks.insert(flow[0] + 1 if flow else 0, self)
                    return
        finally:
            del frame

    def _run_config(self, loaded, step: int):
        config = _config(loaded, str(self.given.path), self.out_dir, step=step, name=self._run_name(loaded, step),
                         options=dict(self.options, progress=self.progress))
        from probe.pipeline.validate import check_options

        check_options(config)
        return config

    def _run_name(self, loaded, step: int) -> str:
        from probe.core.naming import run_name

        return f"{run_name(self.name or loaded.info['id'])}-step{step}"

    # ---- during training

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and state.global_step % self.every_n_steps == 0 and model is not None:
            self._measure(model, state)
            control.should_log = True  # the numbers go out with the Trainer's log of this step
        return control

    def _measure(self, model, state) -> None:
        started = time.perf_counter()
        step = state.global_step
        run = measure(model, self._tokenizer, self.texts, self.out_dir, step=step,
                      name=self._run_name(in_memory(model, self._tokenizer, name=self.name), step),
                      progress=self.progress, training={"step": step, "epoch": state.epoch,
                                                        "max_steps": state.max_steps}, **self.options)
        numbers = headline_numbers(run)
        numbers[f"{PREFIX}seconds"] = time.perf_counter() - started
        self.runs.append(run.run_dir)
        self.logged[step] = dict(numbers)
        self._pending.update(numbers)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None:
            logs.update(self._pending)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(self._pending)
            self._pending = {}

