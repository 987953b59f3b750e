"""``probe series CHECKPOINT... [--revision R,R...]``: one run per checkpoint of a training, then their comparison
against the step (:mod:`probe.training.series`; mounted in :mod:`probe.cli`).  Nothing heavy is imported until it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from probe.core.errors import exit_with as _fail  # the one error paragraph and exit status 2 of probe's commands
from probe.run_options import PER_RUN, with_run_options


@with_run_options(leave_out=PER_RUN)
def series_command(
    checkpoints: list[str] = typer.Argument(
        ..., metavar="CHECKPOINT", help="A Trainer's output folder (its checkpoint-* folders), checkpoint folders, or "
        "one hub id with --revision.",
    ),
    revision: Optional[str] = typer.Option(
        None, metavar="R[,R...]", help="Hub revisions of the one model given, comma separated (step1000,step2000).",
    ),
    steps: Optional[str] = typer.Option(
        None, metavar="N[,N...]", help="The checkpoints' steps, in their order [default: each checkpoint's "
        "trainer_state.json, else the last number in its revision's or folder's name].",
    ),
    random_init: bool = typer.Option(
        False, "--random-init", help="Add the architecture with random weights (--init random) as step 0.",
    ),
    name: Optional[str] = typer.Option(
        None, "--name", metavar="NAME", help="The series' name: its runs are NAME-step<N> [default: the model's name].",
    ),
    compare: Optional[Path] = typer.Option(
        None, "--compare", metavar="DIR", help="Where the comparison goes [default: OUT/NAME-series].",
    ),
    report_format: str = typer.Option("png", "--format", metavar="FMT[,FMT]", help="Figure formats (png,pdf)."),
    progress: bool = typer.Option(True, help="Say what each run is doing; --no-progress prints the final lines only."),
    **options,
):
    """Measure every checkpoint of a training on the same texts, ordered by step, and draw the series.

    Every checkpoint is checked first (its files, its step, one architecture for all) and so are the run options,
    which each run takes as `probe run` does: a problem exits with status 2 and nothing is written. Each run is an
    ordinary run (probe resume, probe report take it).
    """
    from probe.core.errors import ProbeError
    from probe.training.series import run_series

    try:  # a stop (Ctrl-C) goes up to the command line, which says where the stopped run is
        series = run_series(
            checkpoints, revisions=revision, steps=steps, random_init=random_init, name=name,
            compare=compare if compare is not None else True, formats=report_format, progress=progress, **options,
        )
    except ProbeError as error:
        _fail(error)
    for checkpoint, run in zip(series.checkpoints, series.runs, strict=True):
        typer.echo(f"step {checkpoint.step:>8,}: {run.run_dir}")
    typer.echo(f"comparison: {series.compare / 'index.html'}")
