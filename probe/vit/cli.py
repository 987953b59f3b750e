"""``probe vit``: the typer sub-app that trains the ViT, OT-ViT, Sinkhorn-ViT and exact-ViT (mounted in cli.py).

Importing this module does not import torch: option errors are instant.  Every error a user can cause is
printed as one paragraph and exits with status 2, before any training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from probe.core.errors import (
    exit_with as _fail,  # the one error paragraph and prefix of probe's commands
)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="ViT / OT-ViT / Sinkhorn-ViT / exact-ViT: train and compare (the OT attention, eq. 22).")


@app.callback()
def _callback():
    """ViT / OT-ViT / Sinkhorn-ViT / exact-ViT: train and compare (the OT attention, eq. 22)."""


@app.command()
def train(
    data: str = typer.Option("fashion-mnist", metavar="NAME", help="fashion-mnist, cifar10 or cifar100."),
    data_dir: Optional[Path] = typer.Option(
        None, metavar="DIR", help="Directory of the data set's files [default for fashion-mnist: /usr/share/datasets/fashion-mnist, "
                   "from `apt install dataset-fashion-mnist`]."),
    attention: str = typer.Option("softmax", metavar="KIND", help="The final layer's attention: softmax, ot, sinkhorn or exact."),
    seed: int = typer.Option(0, metavar="S", help="Seed of the initial weights, data order, dropout and training trick."),
    epochs: int = typer.Option(10, metavar="E", help="Epochs over the (subset of the) training set."),
    lr: float = typer.Option(3e-4, "--lr", metavar="LR", help="Adam learning rate (the paper's 3e-4)."),
    batch_size: int = typer.Option(128, metavar="N", help="Images per step."),
    train_subset: Optional[int] = typer.Option(None, metavar="N", help="Train on a fixed subset of N training images."),
    test_subset: Optional[int] = typer.Option(None, metavar="N", help="Evaluate on a fixed subset of N test images."),
    device: str = typer.Option("cpu", "--device", metavar="DEVICE", help="cpu, cuda or cuda:N."),
    out: Optional[Path] = typer.Option(
        None, metavar="DIR", help="Run directory (checkpoints, model.pt, results.json) [default: runs/vit-DATA-ATTENTION-seedS]."),
    threads: Optional[int] = typer.Option(None, metavar="N", help="torch CPU threads [default: torch's]."),
    sinkhorn_iterations: int = typer.Option(3, metavar="K", help="Row normalisations of the Sinkhorn attention."),
    precision: str = typer.Option("fp32", "--precision", metavar="P", help="fp32, or bf16: the steps under bfloat16 autocast (the "
                                  "OT, Sinkhorn and exact weights stay float32, the exact solve float64)."),
    compile: bool = typer.Option(False, "--compile", help="Compile the model's forward with torch.compile."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
):
    """Train one model (or resume a killed run with the same settings) and write results.json."""
    from probe.core.errors import ProbeError

    try:
        from probe.vit.train import TrainSettings
        from probe.vit.train import train as run_training

        settings = TrainSettings(
            data=data, data_dir=None if data_dir is None else str(data_dir), attention=attention, seed=seed,
            epochs=epochs, lr=lr, batch_size=batch_size, train_subset=train_subset, test_subset=test_subset,
            device=device, out=None if out is None else str(out), threads=threads, progress=progress,
            sinkhorn_iterations=sinkhorn_iterations, precision=precision, compile=compile,
        )
        from probe.core.destination import writing

        with writing("the training run", settings.run_dir()):  # a disk that fills up while training: exit 74
            results = run_training(settings, log=lambda line: typer.echo(line, err=True))
    except ProbeError as error:
        _fail(error)
    typer.echo(
        f"{attention}: test accuracy {results['test_accuracy']:.4f} after {results['epochs_done']} epochs "
        f"({results['wall_time_s']:.0f} s, {results['parameters']:,} parameters); results in {settings.run_dir()}"
    )


if __name__ == "__main__":
    app()
