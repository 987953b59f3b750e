"""A series of runs over training: one ordinary run per checkpoint of one model, on the same texts, ordered by step.

The checkpoints are hub revisions of one model (``revisions=["step1000", "step2000"]``, as Pythia publishes
them), local checkpoint folders, or a Trainer's output folder, whose ``checkpoint-*`` folders are taken in
turn.  Each checkpoint's step is read, in this order, from the steps given (``steps=``), from the
``global_step`` of its ``trainer_state.json`` (what the Trainer writes beside each checkpoint), or from the last
number in its revision's or folder's name (``step1000``, ``checkpoint-500``).  ``random_init=True`` adds the
first checkpoint's architecture with random weights as step 0 (``init="random"``: the weights training starts
from, seeded).

Everything is checked before the first run: every checkpoint found with its files, a step for each and no step
twice, and one architecture for all (the model type and sizes of their configs).  A problem raises a
:class:`ProbeError` and nothing is written.  Each run is an ordinary run (``probe.load``, ``probe resume``, ``probe
verify`` take it) whose manifest records its step (``config.step``); ``probe compare`` draws runs that have
steps against their step (:mod:`probe.report.series`), which :func:`run_series` does at the end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from probe.core.errors import ProbeError

#: the config entries that must agree between the checkpoints of one series (those a config has)
ARCHITECTURE_KEYS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
    "n_layer", "n_head", "n_embd", "d_model", "num_layers", "num_heads", "num_decoder_layers", "vocab_size",
)
#: the file beside a Trainer checkpoint that holds its step (``global_step``)
TRAINER_STATE = "trainer_state.json"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of a series: where its weights are, its step and where that step was read."""

    model: str  # a hub id or a local model directory
    revision: str | None
    step: int
    source: str  # "given", "trainer_state.json", "revision name", "folder name" or "random init"
    init: str = "pretrained"

    @property
    def label(self) -> str:
        where = f"{self.model}@{self.revision}" if self.revision else self.model
        return f"{where} ({'random init' if self.init == 'random' else f'step {self.step}'})"


def _number_in(name: str) -> int | None:
    """The last number in ``name`` (``step1000`` -> 1000, ``checkpoint-500`` -> 500); None without one."""
    found = re.findall(r"\d+", name)
    return int(found[-1]) if found else None


def _trainer_step(directory: Path) -> int | None:
    state = directory / TRAINER_STATE
    if not state.is_file():
        return None
    try:
        step = json.loads(state.read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ProbeError(f"{state} does not say the checkpoint's step ({type(error).__name__}: {error}). Give the "
                         "steps with --steps.") from None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ProbeError(f"{state} gives the step {step!r}, not a whole number >= 0. Give the steps with --steps.")
    return step


def _expand(model: str) -> list[Path] | None:
    """A Trainer's output folder (no config.json of its own, ``checkpoint-*`` folders in it) as those folders;
    None for anything else."""
    path = Path(model).expanduser()
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = [p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1])) if found else None


def _numbers(value, name: str) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [str(item).strip() for item in items]
    if not items or any(not item for item in items):
        raise ProbeError(f"--{name} has an empty entry; separate its values by single commas.")
    return items


def checkpoints(models: str | Sequence[str], *, revisions: str | Sequence[str] | None = None,
                steps: str | Sequence[int] | None = None, random_init: bool = False) -> list[Checkpoint]:
    """The checkpoints of a series, ordered by step (see the module's docstring); a checkpoint whose step cannot
    be found, a step given twice, or steps that do not match the checkpoints raise a :class:`ProbeError`."""
    models = [models] if isinstance(models, (str, Path)) else [str(m) for m in models]
    if not models:
        raise ProbeError("Give the checkpoints of the series: a Trainer's output folder, checkpoint folders, or a "
                         "hub id with --revision.")
    revisions = _numbers(revisions, "revision")
    places: list[tuple[str, str | None, str]] = []  # (model, revision, name the step may be read from)
    if revisions is not None:
        if len(models) != 1:
            raise ProbeError(f"--revision names revisions of one model; {len(models)} models given "
                             f"({', '.join(models)}).")
        if Path(models[0]).expanduser().exists():
            raise ProbeError(f"--revision applies to hub ids, but '{models[0]}' is a local directory (it holds one "
                             "version). Give its checkpoint folders instead.")
        if len(set(revisions)) != len(revisions):
            raise ProbeError(f"--revision lists a revision twice ({', '.join(revisions)}); list each once.")
        places = [(models[0], revision, revision) for revision in revisions]
    else:
        for model in models:
            expanded = _expand(model)
            if expanded is None:
                places.append((model, None, Path(model).name))
            else:
                places += [(str(path), None, path.name) for path in expanded]
    given = _numbers(steps, "steps")
    if given is not None:
        if len(given) != len(places):
            raise ProbeError(f"--steps gives {len(given)} step(s) for {len(places)} checkpoint(s) "
                             f"({', '.join(p[1] or p[0] for p in places)}); give one per checkpoint, in their order.")
        parsed = []
        for item in given:
            if not item.isdigit():
                raise ProbeError(f"--steps takes whole numbers >= 0, comma separated; {item!r} is not one.")
            parsed.append(int(item))
    found = []
    for index, (model, revision, name) in enumerate(places):
        path = Path(model).expanduser()
        if given is not None:
            step, source = parsed[index], "given"
        elif revision is None and path.is_dir() and (step := _trainer_step(path)) is not None:
            source = TRAINER_STATE
        else:
            step, source = _number_in(name), "revision name" if revision is not None else "folder name"
            if step is None:
                what = (f"revision '{revision}' of {model}: its name has no number" if revision is not None else
                        f"'{model}': it has no {TRAINER_STATE} and no number in its name")
                raise ProbeError(f"Cannot find the step of {what}. Give the steps with --steps, one per checkpoint in "
                                 "their order.")
        found.append(Checkpoint(model=model, revision=revision, step=step, source=source))
    if random_init:
        first = found[0]
        found.append(Checkpoint(model=first.model, revision=first.revision, step=0, source="random init",
                                init="random"))
    places_seen: dict[tuple, Checkpoint] = {}
    for each in found:
        place = (str(Path(each.model).expanduser().resolve()) if Path(each.model).expanduser().exists() else each.model,
                 each.revision, each.init)
        if place in places_seen:
            raise ProbeError(f"The checkpoint {each.model}{'@' + each.revision if each.revision else ''} is given twice "
                             f"(as {places_seen[place].label} and {each.label}); give each checkpoint once.")
        places_seen[place] = each
    steps_seen: dict[int, Checkpoint] = {}
    for each in found:
        if each.step in steps_seen:
            raise ProbeError(f"Step {each.step} appears twice in the series: {steps_seen[each.step].label} and "
                             f"{each.label}. Give distinct steps with --steps (step 0 is --random-init's).")
        steps_seen[each.step] = each
    return sorted(found, key=lambda c: c.step)


def architecture(config) -> dict:
    """The entries of a transformers config that one series must share (:data:`ARCHITECTURE_KEYS` it has)."""
    data = config.to_dict()
    return {key: data[key] for key in ARCHITECTURE_KEYS if data.get(key) is not None}


def check_series(series: list[Checkpoint], settings=None) -> None:
    """Every checkpoint's files and config (:func:`probe.pipeline.validate.check_model`, which checks the run
    options ``settings`` against the model: spaces, tokenizer, the selection), and one architecture for all;
    nothing is written.  A revision or folder that cannot be read is named with its step."""
    from dataclasses import replace

    from probe.capture.loading import load_config
    from probe.core.config import RunConfig
    from probe.pipeline.validate import check_model

    if len(series) < 2:
        raise ProbeError(f"A series needs at least two checkpoints (or one and --random-init); got "
                         f"{len(series)}: {', '.join(c.label for c in series)}.")
    shapes = []
    for each in series:
        try:
            check_model(replace(settings or RunConfig(model=each.model), model=each.model, revision=each.revision,
                                init=each.init))
            shapes.append(architecture(load_config(each.model, each.revision)))
        except ProbeError as error:
            raise ProbeError(f"The checkpoint {each.label} cannot be measured: {error}") from None
    for each, shape in zip(series[1:], shapes[1:], strict=True):
        if shape != shapes[0]:
            differ = [f"{key} {shapes[0].get(key)} vs {shape.get(key)}" for key in ARCHITECTURE_KEYS
                      if shapes[0].get(key) != shape.get(key)]
            raise ProbeError(f"The checkpoints of one series must share one architecture, but {series[0].label} and "
                             f"{each.label} differ: {'; '.join(differ)}. Run them as separate series.")


def _series_name(checkpoint: Checkpoint) -> str:
    """The model's name (:func:`probe.core.naming.run_name`); for a Trainer's ``checkpoint-N`` folder, its output
    folder's name."""
    from probe.core.naming import run_name

    name = run_name(checkpoint.model)
    if re.fullmatch(r"checkpoint-\d+", name):
        return Path(checkpoint.model).expanduser().resolve().parent.name or name
    return name


@dataclass
class Series:
    """A finished series: its checkpoints with their runs (:class:`probe.Run`), in step order, and the comparison
    (``None`` when none was asked)."""

    checkpoints: list[Checkpoint]
    runs: list
    compare: Path | None


def run_series(models: str | Sequence[str], *, revisions: str | Sequence[str] | None = None,
               steps: str | Sequence[int] | None = None, random_init: bool = False, out: str | Path = "runs",
               name: str | None = None, compare: str | Path | bool = True, texts: Iterable[str] | None = None,
               dataset: str | Path | None = None, formats: str | Sequence[str] = "png", progress: bool = True,
               **options) -> Series:
    """Run every checkpoint of a series (:func:`checkpoints`) on the same texts, in step order: one run each,
    named ``NAME-step<step>`` (``NAME-random-step0`` for the random init; ``name`` default: the model's name),
    under ``out``; then compare them (``compare``: the folder, default ``OUT/NAME-series``; False: none).
    ``texts``, ``dataset`` and ``options`` are :func:`probe.run`'s (``samples``, ``max_length``, ``alpha``,
    ``space``, ``device``, ``dtype``, ...)."""
    import sys

    from probe import api
    from probe.core.environment import check_environment
    from probe.core.naming import slug

    check_environment()  # probe's environment variables, before any checkpoint is read
    series = checkpoints(models, revisions=revisions, steps=steps, random_init=random_init)
    if options.get("init") is not None or options.get("revision") is not None or options.get("step") is not None:
        raise ProbeError("A series sets each run's init, revision and step itself: use --random-init, --revision "
                         "and --steps.")
    from probe.core.config import RunConfig
    from probe.pipeline.validate import check_options

    # every run's options as probe.run reads them, checked before the first run (the selection against the model
    # in check_series)
    settings = RunConfig.from_options(series[0].model, out=out, dataset=dataset, **options)
    check_options(settings)
    check_series(series, settings)
    base = name or _series_name(next(c for c in series if c.init != "random"))
    compare_dir = None if compare is False else Path(out) / f"{slug(base)}-series" if compare is True else Path(compare)
    if compare_dir is not None and compare_dir.exists() and not compare_dir.is_dir():
        raise ProbeError(f"{compare_dir} exists and is not a directory. Choose another --compare.")
    if compare_dir is not None:
        from probe.pipeline.validate import check_report_formats

        check_report_formats(formats if isinstance(formats, str) else ",".join(formats))
    runs = []
    for each in series:
        label = f"{base}-random-step0" if each.init == "random" else f"{base}-step{each.step}"
        if progress:
            print(f"probe: series: {each.label} as {label} ({len(runs) + 1} of {len(series)})", flush=True,
                  file=sys.stderr)
        runs.append(api.run(each.model, revision=each.revision, init=each.init, step=each.step, name=label, out=out,
                            texts=texts, dataset=dataset, progress=progress, **options))
    where = None
    if compare_dir is not None:
        where = api.compare(runs, compare_dir, formats, names=[f"step {c.step}" + (" (random init)" if c.init ==
                                                                                   "random" else "") for c in series])
    return Series(checkpoints=series, runs=runs, compare=where)
