"""The reduced ViT's final layer epoch by epoch: how far it is from exact inference beside its learning curve.

Reads the ``results.json`` of one ``probe vit train`` run, whose learning curve records ``final_layer_gap`` after
every epoch (:mod:`probe.vit.gap`), and writes ``REPORT/epochs-<attention>.md``, ``.json`` and ``.png``.  Where the
committed reduced comparison (``reports/vit/results.json``) holds the run of the same settings and seed, its
learning curve is set beside, as a check that measuring the gap changed nothing of the training.

    PYTHONPATH=. python3 -m probe vit train --attention softmax --seed 0 --epochs 4 --train-subset 4096 \\
        --test-subset 5000 --threads 1 --out runs/vit-epochs/softmax-seed0
    PYTHONPATH=. python3 scripts/vit_epochs.py runs/vit-epochs/softmax-seed0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a `probe vit train` run directory")
    p.add_argument("--report", type=Path, default=ROOT / "reports" / "vit")
    p.add_argument("--committed", type=Path, default=ROOT / "reports" / "vit" / "results.json")
    return p.parse_args()


def committed_curve(path: Path, settings: dict) -> list[dict] | None:
    """The learning curve of the committed run with the same attention, seed, subsets and epochs, if any."""
    if not path.is_file():
        return None
    runs = json.loads(path.read_text()).get("runs", {})
    found = runs.get(f"{settings['attention']}-seed{settings['seed']}")
    if not found:
        return None
    theirs = found.get("settings", {})
    same = all(theirs.get(key) == settings.get(key) for key in ("train_subset", "test_subset", "batch_size", "lr"))
    return found["learning_curve"] if same else None


def figure(curve: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [entry["epoch"] for entry in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    left.plot(epochs, [e["test_accuracy"] for e in curve], marker="o", label="test accuracy")
    left.plot(epochs, [e["train_accuracy"] for e in curve], marker="o", linestyle="--", label="training accuracy")
    left.set_xlabel("epoch")
    left.set_ylabel("accuracy")
    left.set_ylim(0, 1)
    left.legend()
    left.set_title("learning curve")
    for key, label, color in (("tv", "total variation p* vs softmax", "#1f77b4"),
                              ("rel_deviation", "rel_deviation ‖λ* − αz‖/‖λ*‖", "#d62728")):
        median = [e["final_layer_gap"]["kl"][f"{key}_median"] for e in curve]
        p90 = [e["final_layer_gap"]["kl"][f"{key}_p90"] for e in curve]
        right.plot(epochs, median, marker="o", color=color, label=f"{label}: median")
        right.plot(epochs, p90, marker="o", color=color, linestyle="--", label=f"{label}: 90th percentile")
    right.set_xlabel("epoch")
    for ax in (left, right):
        ax.set_xticks(epochs)
    right.set_ylim(bottom=0)
    right.set_title("final layer's class-token queries vs exact inference")
    right.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main():
    args = parse()
    results = json.loads((args.run / "results.json").read_text())
    settings, curve = results["settings"], results["learning_curve"]
    name = settings["attention"]
    committed = committed_curve(args.committed, settings)
    gap = curve[0]["final_layer_gap"]
    title = (f"{name} ViT, Fashion-MNIST, {results['train_images']:,} training images, seed {settings['seed']}: "
             f"{gap['images']} test images x {results['model_config']['heads']} heads = {gap['problems']} problems")
    lines = [
        f"# The {name} ViT's final layer epoch by epoch",
        "",
        f"Written by `scripts/vit_epochs.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from a "
        f"`probe vit train --attention {name}` run ({results['train_images']:,} training images, "
        f"{results['test_images']:,} test images, {results['epochs_done']} epochs, batch {settings['batch_size']}, "
        f"seed {settings['seed']}, {results['threads']} thread). After every epoch, the final layer's class-token "
        f"queries on the first {gap['images']} test images ({gap['problems']} problems, `probe.vit.gap`): the "
        "exact posterior p* of the KL problem (templates k/sqrt(d'), evidence q, u uniform, alpha = 1) against "
        "softmax attention of the same queries and keys, its closed-form approximation.",
        "",
        "| epoch | test accuracy | training loss | TV median | TV p90 | TV max | rel_deviation median | "
        "rel_deviation p90 | not certified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in curve:
        kl = entry["final_layer_gap"]["kl"]
        lines.append(f"| {entry['epoch']} | {entry['test_accuracy']:.4f} | {entry['train_loss']:.4f} | "
                     f"{kl['tv_median']:.4f} | {kl['tv_p90']:.4f} | {kl['tv_max']:.4f} | "
                     f"{kl['rel_deviation_median']:.4f} | {kl['rel_deviation_p90']:.4f} | {kl['not_converged']} |")
    if committed is not None:
        same = [a["test_accuracy"] == b["test_accuracy"] and a["train_loss"] == b["train_loss"]
                for a, b in zip(curve, committed, strict=False)]
        lines += ["", f"The committed reduced comparison (`reports/vit/results.json`) holds the run of the same "
                  f"settings and seed: its test accuracy and training loss equal this run's in "
                  f"{sum(same)} of {len(same)} epochs"
                  + (" (measuring the gap after each epoch changed nothing of the training)." if all(same) else
                     ": " + "; ".join(f"epoch {a['epoch']}: {a['test_accuracy']:.4f} there, {b['test_accuracy']:.4f}"
                                      " here" for a, b, s in zip(committed, curve, same, strict=False) if not s)
                     + ".")]
    lines += ["", f"![The learning curve beside the distance from exact inference](epochs-{name}.png)"]
    args.report.mkdir(parents=True, exist_ok=True)
    (args.report / f"epochs-{name}.md").write_text("\n".join(lines) + "\n")
    kept = {"settings": settings, "learning_curve": curve, "generated_by": "scripts/vit_epochs.py",
            "committed_curve_matches": None if committed is None else all(same)}
    (args.report / f"epochs-{name}.json").write_text(json.dumps(kept, indent=1) + "\n")
    figure(curve, args.report / f"epochs-{name}.png", title)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
