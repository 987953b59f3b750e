"""The ``probe`` command line (a typer app): ``probe run MODEL`` and ``probe report RUN_DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Test 'attention as inference via Fenchel duality' on pretrained Hugging Face models.",
)


def _fail(error: Exception) -> None:
    typer.secho(f"error: {error}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=2)


@app.command()
def run(
    model: str = typer.Argument(..., help="Hugging Face hub id (e.g. bert-base-uncased) or a local model directory."),
    dataset: Optional[str] = typer.Option(
        None, help="Hub dataset name or a local .txt/.jsonl/.csv/.parquet file; default: the embedded corpus."
    ),
    config: Optional[str] = typer.Option(None, help="Dataset configuration (e.g. wikitext-2-raw-v1)."),
    split: str = typer.Option("train", help="Dataset split."),
    column: str = typer.Option("text", help="Column holding the texts."),
    target_column: Optional[str] = typer.Option(
        None, help="Column holding decoder targets (encoder-decoder models); default: the text itself."
    ),
    samples: Optional[int] = typer.Option(None, help="Use the first N non-empty texts."),
    max_length: int = typer.Option(128, help="Truncate texts to this many tokens."),
    batch_size: int = typer.Option(8, help="Examples per forward pass."),
    alpha: str = typer.Option(
        "1", help="Strength alpha of the inference problem; a comma-separated list (0.25,0.5,1,2,4) solves each "
        "from one capture."
    ),
    space: Optional[str] = typer.Option(
        None, help="Parameterisation(s), comma separated: hidden (t = x/sqrt(d'), z = c W_k^T q) and/or key "
        "(t = k/sqrt(d'), z = c q). Default: hidden, or key for rotary models (which have no hidden space)."
    ),
    init: str = typer.Option(
        "pretrained", help="pretrained, or random: the same architecture with fresh weights (seeded by --seed), "
        "the control for what training did."
    ),
    out: Path = typer.Option(Path("runs"), help="Parent directory of the run directory."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or cuda:N."),
    dtype: str = typer.Option(
        "float32", help="Model dtype: float32, bfloat16, float16 or float64 (the solver always works in float64)."
    ),
    revision: Optional[str] = typer.Option(None, help="Model revision (hub branch, tag or commit)."),
    seed: int = typer.Option(0, help="Random seed (recorded in the manifest)."),
    fidelity_tolerance: Optional[float] = typer.Option(
        None, help="Max abs error allowed between reconstructed and eager attention; default by --dtype "
        "(float64 1e-6, float32 1e-5, float16 1e-2, bfloat16 5e-2)."
    ),
    report: bool = typer.Option(False, "--report", help="Build the figure report when the run finishes."),
    report_format: str = typer.Option("png", "--format", help="Report figure formats, comma separated (png,pdf)."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
):
    """Solve the dual for every example, layer, head and query token; write deviations.parquet."""
    from probe.data import DatasetSpec
    from probe.errors import ProbeError
    from probe.pipeline import RunConfig, run as run_pipeline

    spec = DatasetSpec(
        name=dataset, config=config, split=split, column=column, target_column=target_column, samples=samples
    )
    settings = RunConfig(
        model=model, dataset=spec, out=out, revision=revision, batch_size=batch_size, max_length=max_length,
        alphas=_alphas(alpha), spaces=_spaces(space) if space is not None else None, init=init, device=device,
        dtype=dtype, seed=seed, fidelity_tolerance=fidelity_tolerance, progress=progress,
    )
    try:
        run_dir = run_pipeline(settings)
    except ProbeError as error:
        _fail(error)
    _print_summary(run_dir)
    if report:
        _build_report(run_dir, None, report_format)


def _alphas(text: str) -> tuple[float, ...]:
    """``--alpha 0.25,1,4`` -> (0.25, 1.0, 4.0); a bad value is a clear error."""
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            _fail(ValueError(f"--alpha takes numbers, comma separated (e.g. 0.25,1,4); got '{part}'."))
        if not (0 < value < float("inf")):
            _fail(ValueError(f"--alpha values must be finite and positive; got '{part}'."))
        values.append(value)
    if len(set(values)) != len(values):
        _fail(ValueError(f"--alpha lists a value twice: {text}."))
    return tuple(values)


def _spaces(text: str) -> tuple[str, ...]:
    """``--space hidden,key`` -> ("hidden", "key")."""
    from probe.adapters.base import SPACES

    values = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [v for v in values if v not in SPACES]
    if unknown or not values or len(set(values)) != len(values):
        _fail(ValueError(f"--space takes {' and/or '.join(SPACES)}, comma separated, each once; got '{text}'."))
    return values


def _print_summary(run_dir: Path) -> None:
    import json

    manifest = json.loads((run_dir / "manifest.json").read_text())
    solver, fidelity = manifest["solver"], manifest["fidelity"]
    typer.echo(
        f"{solver['rows']:,} rows, {solver['not_converged']:,} not converged "
        f"(max relative error bound {solver['max_relative_error_bound']:.1e}); "
        f"fidelity max abs error {fidelity['max_abs_error']:.1e} "
        f"({'passed' if fidelity['passed'] else 'FAILED'}, tolerance {fidelity['tolerance']:.0e})"
    )
    typer.echo(f"run directory: {run_dir}")


@app.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="A run directory written by `probe run`."),
    out: Optional[Path] = typer.Option(None, help="Where to write the report (default: RUN_DIR/report)."),
    report_format: str = typer.Option("png", "--format", help="Figure formats, comma separated (png,pdf)."),
):
    """Figures per layer, head and attention type, summary tables and an HTML page."""
    _build_report(run_dir, out, report_format)


def _build_report(run_dir: Path, out: Optional[Path], formats: str) -> None:
    from probe.errors import ProbeError
    from probe.report import build_report

    try:
        where = build_report(run_dir, out, [f.strip() for f in formats.split(",") if f.strip()])
    except ProbeError as error:
        _fail(error)
    typer.echo(f"report: {where / 'index.html'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
