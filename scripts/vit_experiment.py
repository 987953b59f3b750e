"""The ViT / OT-ViT / Sinkhorn-ViT / exact-ViT comparison on Fashion-MNIST, reduced to fit a shared 2-core CPU.

Runs ``probe vit train`` (as ``python3 -m probe.vit.cli train``) for every (seed, attention), at most
``--jobs`` at once, one torch thread each, then writes ``reports/vit/results.json`` and
``reports/vit/results.md`` from the runs' ``results.json`` files.  Finished runs are skipped; killed runs
resume from their last epoch (start the script again).  ``--report-only`` rewrites the reports from the
runs that exist.

``--reuse-runs-from reports/vit/results.json`` takes the runs that are not in ``--runs-dir`` from a report this
script wrote before (its ``runs`` entries are the runs' results files), so that a new arm can join the committed
ones without training them again.  ``--rerun-check DIR`` names a fresh run of one reused arm (the same
settings, fewer epochs); the report compares its learning curve with the reused run's, entry by entry and bit
for bit, which shows that the reused arms' code path still computes what it computed then.

The protocol is fair by construction: every run gets the same training subset, test subset, epochs, batch
size and learning rate; for a given seed, every attention gets the same initial weights (the parameters are
the same) and the same data order (see ``probe.vit.train``).

    PYTHONPATH=. python3 scripts/vit_experiment.py            # run (or finish) the protocol, then report
    PYTHONPATH=. python3 scripts/vit_experiment.py --report-only
    PYTHONPATH=. python3 scripts/vit_experiment.py --epochs 4 --attentions exact     # train one arm
    PYTHONPATH=. python3 scripts/vit_experiment.py --report-only --epochs 4 \
        --reuse-runs-from reports/vit/results.json --rerun-check runs/determinism/softmax-seed0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ATTENTIONS = ("softmax", "ot", "sinkhorn", "exact")
NAMES = {"softmax": "ViT (softmax)", "ot": "OT-ViT", "sinkhorn": "Sinkhorn-ViT", "exact": "exact-ViT"}
# The source paper's reported test accuracies (95% intervals), quoted for comparison; not results of ours.
PAPER = {
    name: {"softmax": softmax, "ot": ot, "sinkhorn": "not reported", "exact": "not reported"}
    for name, softmax, ot in (("fashion-mnist", "0.928 ± 0.01", "0.937 ± 0.01"),
                              ("cifar10", "0.751 ± 0.01", "0.772 ± 0.02"), ("cifar100", "0.463 ± 0.01", "0.491 ± 0.01"))
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "vit-experiment")
    p.add_argument("--report-dir", type=Path, default=ROOT / "reports" / "vit")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--attentions", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-subset", type=int, default=4096)
    p.add_argument("--test-subset", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--keep-checkpoint", default="ot-seed0",
                   help="RUN whose model.pt is copied to the report directory (empty: none).")
    p.add_argument("--reuse-runs-from", type=Path, default=None, metavar="RESULTS_JSON",
                   help="Take the runs missing from --runs-dir from this earlier report of the script.")
    p.add_argument("--rerun-check", type=Path, nargs="*", default=[], metavar="DIR",
                   help="Fresh runs of reused arms, compared bit for bit with the reused runs' learning curves.")
    return p.parse_args()


def run_name(attention: str, seed: int) -> str:
    return f"{attention}-seed{seed}"


def finished(run_dir: Path, epochs: int) -> bool:
    results = run_dir / "results.json"
    return results.exists() and json.loads(results.read_text()).get("epochs_done", 0) >= epochs


def at_epoch(r: dict, epochs: int) -> dict:
    """A run's results as they were after ``epochs`` epochs (from its learning curve).

    A run continued to more epochs passed through exactly the state of a run of ``epochs`` epochs (the number
    of epochs changes nothing in the training; tests/test_vit.py checks that a resumed run equals an
    uninterrupted one), so its learning curve's entry is that run's result.
    """
    curve = r["learning_curve"][:epochs]
    return dict(r, learning_curve=curve, epochs_done=epochs, test_accuracy=curve[-1]["test_accuracy"],
                test_loss=curve[-1]["test_loss"], steps=r["steps"] // r["epochs_done"] * epochs,
                wall_time_s=sum(e["epoch_s"] for e in curve))


def command(args, attention: str, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "probe.vit.cli", "train", "--data", "fashion-mnist", "--attention", attention,
           "--seed", str(seed), "--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
           "--train-subset", str(args.train_subset), "--test-subset", str(args.test_subset), "--threads", "1",
           "--device", "cpu", "--no-progress", "--out", str(args.runs_dir / run_name(attention, seed))]
    if args.data_dir is not None:
        cmd += ["--data-dir", str(args.data_dir)]
    return cmd


def run_all(args) -> None:
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    queue = [(a, s) for s in args.seeds for a in args.attentions]  # seed-major: whole seeds finish first
    queue = [(a, s) for a, s in queue if not finished(args.runs_dir / run_name(a, s), args.epochs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    running: list[tuple[subprocess.Popen, str, float]] = []
    failed = []
    while queue or running:
        while queue and len(running) < args.jobs:
            attention, seed = queue.pop(0)
            name = run_name(attention, seed)
            log = open(args.runs_dir / f"{name}.log", "a")
            print(f"{time.strftime('%H:%M:%S')} start {name}", flush=True)
            running.append((subprocess.Popen(command(args, attention, seed), stdout=log, stderr=log, env=env,
                                             cwd=ROOT), name, time.time()))
        time.sleep(2)
        for proc, name, t0 in list(running):
            if proc.poll() is not None:
                running.remove((proc, name, t0))
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"{time.strftime('%H:%M:%S')} {status} {name} ({time.time() - t0:.0f} s)", flush=True)
                if proc.returncode:
                    failed.append(name)
    if failed:
        print(f"failed runs: {', '.join(failed)} (see their .log files in {args.runs_dir})", file=sys.stderr)


def t_interval(values: list[float]) -> tuple[float, float | None, float | None]:
    """Mean, sample standard deviation and the half-width of the 95% t-interval (None for one value)."""
    from scipy.stats import t

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, sd, float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)


#: what a rerun must reproduce bit for bit, per epoch
CHECKED_FIELDS = ("train_loss", "train_accuracy", "test_accuracy", "test_loss")


def rerun_check(run_dir: Path, reused: dict) -> dict:
    """A fresh run of a reused arm against the reused run: every finished epoch's ``CHECKED_FIELDS`` equal?"""
    fresh = json.loads((run_dir / "results.json").read_text())
    s = fresh["settings"]
    name = run_name(s["attention"], s["seed"])
    if name not in reused:
        raise SystemExit(f"--rerun-check {run_dir}: {name} is not a reused run.")
    pairs = list(zip(fresh["learning_curve"], reused[name]["learning_curve"]))
    return {"run": name, "directory": run_dir.name, "epochs": len(pairs),
            "fields": list(CHECKED_FIELDS),
            "identical": all(a[f] == b[f] for a, b in pairs for f in CHECKED_FIELDS),
            "versions": fresh["versions"]}


def exact_certificates(run: dict) -> dict:
    """The exact-ViT run's Newton iterations and certificates over its epochs (``exact_train``, ``exact_test``)."""
    from probe.exact import merge_summaries

    curve = run["learning_curve"]
    return {
        "train": merge_summaries([e["exact_train"] for e in curve]),
        "test": merge_summaries([e["exact_test"] for e in curve]),
        "train_mean_iterations_per_epoch": [e["exact_train"]["mean_iterations"] for e in curve],
    }


def report(args) -> dict:
    runs, reused = {}, {}
    earlier = json.loads(args.reuse_runs_from.read_text()) if args.reuse_runs_from else None
    for attention in args.attentions:
        for seed in args.seeds:
            path = args.runs_dir / run_name(attention, seed) / "results.json"
            r = json.loads(path.read_text()) if path.exists() else None
            if r is not None:  # the run directory as the repository names it, not a machine path
                r["settings"]["out"] = _shown(path.parent)
            if r is None and earlier is not None and run_name(attention, seed) in earlier["runs"]:
                r = reused[run_name(attention, seed)] = earlier["runs"][run_name(attention, seed)]
            if r is not None and r.get("epochs_done", 0) >= args.epochs:
                runs[(attention, seed)] = at_epoch(r, args.epochs)
    if not runs:
        raise SystemExit(f"no finished runs in {args.runs_dir}: run the protocol first.")
    any_run = next(iter(runs.values()))
    s = any_run["settings"]
    protocol = {
        "data": "fashion-mnist", "train_images": any_run["train_images"], "test_images": any_run["test_images"],
        "epochs": args.epochs, "steps": any_run["steps"], "batch_size": s["batch_size"], "lr": s["lr"],
        "optimizer": "Adam, constant learning rate", "seeds": args.seeds, "threads_per_run": 1,
        "parallel_runs": args.jobs, "parameters": any_run["parameters"], "model_config": any_run["model_config"],
        "ot_alpha": runs.get(("ot", args.seeds[0]), any_run)["alpha"],
        "ot_gamma": runs.get(("ot", args.seeds[0]), any_run)["gamma"],
        "trick_probability": 0.5,
    }
    summary = {}
    for attention in args.attentions:
        accs = [runs[(attention, seed)]["test_accuracy"] for seed in args.seeds if (attention, seed) in runs]
        if not accs:
            continue
        mean, sd, half = t_interval(accs)
        walls = [runs[(attention, seed)]["wall_time_s"] for seed in args.seeds if (attention, seed) in runs]
        curve = [t_interval([runs[(attention, seed)]["learning_curve"][e]["test_accuracy"]
                             for seed in args.seeds if (attention, seed) in runs])[0] for e in range(args.epochs)]
        step_s = [sum(e["train_s"] for e in runs[(attention, seed)]["learning_curve"]) / runs[(attention, seed)]["steps"]
                  for seed in args.seeds if (attention, seed) in runs]
        summary[attention] = {
            "mean_train_s_per_step": sum(step_s) / len(step_s),
            "seeds": [seed for seed in args.seeds if (attention, seed) in runs], "test_accuracy": accs,
            "mean": mean, "sd": sd, "ci95_half_width": half, "mean_wall_time_s": sum(walls) / len(walls),
            "mean_test_accuracy_per_epoch": curve,
        }
    paired = {}
    for attention in args.attentions:
        if attention == "softmax":
            continue
        common = [seed for seed in args.seeds if (attention, seed) in runs and ("softmax", seed) in runs]
        if common:
            diffs = [runs[(attention, seed)]["test_accuracy"] - runs[("softmax", seed)]["test_accuracy"] for seed in common]
            mean, sd, half = t_interval(diffs)
            paired[f"{attention}-softmax"] = {"seeds": common, "differences": diffs, "mean": mean, "sd": sd,
                                              "ci95_half_width": half}
    certificates = {run_name(a, seed): exact_certificates(r) for (a, seed), r in runs.items() if a == "exact"}
    out = {"protocol": protocol, "summary": summary, "paired_differences": paired,
           "runs": {run_name(a, s): r for (a, s), r in runs.items()}, "paper": PAPER,
           "generated_by": "scripts/vit_experiment.py", "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if certificates:
        out["exact_certificates"] = certificates
    if reused:
        out["reused_runs"] = {"from": _shown(args.reuse_runs_from), "generated_at": earlier["generated_at"],
                              "runs": sorted(reused), "checks": [rerun_check(d, reused) for d in args.rerun_check]}
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    kept = None
    if args.keep_checkpoint:
        source = args.runs_dir / args.keep_checkpoint / "model.pt"
        if not source.exists() and args.keep_checkpoint in reused and "kept_model" in earlier:
            kept = args.report_dir / earlier["kept_model"]["file"]  # the reused run's kept model stays
            out["kept_model"] = earlier["kept_model"]
            (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
        elif source.exists():
            kept = args.report_dir / f"{args.keep_checkpoint}.pt"
            shutil.copyfile(source, kept)
            raw = json.loads((args.runs_dir / args.keep_checkpoint / "results.json").read_text())
            out["kept_model"] = {"run": args.keep_checkpoint, "file": kept.name, "epochs": raw["epochs_done"],
                                 "test_accuracy": raw["test_accuracy"]}
            (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.report_dir / "results.md").write_text(markdown(out, args, kept))
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it (no machine paths in the reports)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _paper_gap() -> float:
    return float(PAPER["fashion-mnist"]["ot"].split()[0]) - float(PAPER["fashion-mnist"]["softmax"].split()[0])


def _t_factor(n: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) if n > 1 else float("nan")


def _fmt(mean, half):
    return f"{mean:.3f}" + (f" ± {half:.3f}" if half is not None else "")


def markdown(out, args, kept) -> str:
    p, summary, paired = out["protocol"], out["summary"], out["paired_differences"]
    lines = [
        "# ViT, OT-ViT, Sinkhorn-ViT and exact-ViT on Fashion-MNIST: a reduced, fair comparison",
        "",
        f"Generated by `scripts/vit_experiment.py` from the runs' results files ({out['generated_at']}); "
        "nothing here is typed by hand.",
        "",
        "## Protocol",
        "",
        f"- Data: Fashion-MNIST (Debian's `dataset-fashion-mnist`), a fixed random subset of "
        f"**{p['train_images']:,} training images** (the same for every run) and a fixed subset of "
        f"**{p['test_images']:,} test images**.",
        f"- Budget: **{p['epochs']} epochs = {p['steps']} steps** of batch {p['batch_size']}, Adam at a constant "
        f"learning rate {p['lr']:g}; seeds {', '.join(map(str, p['seeds']))}.",
        "- Fairness: for a seed, all the models start from the same weights (identical parameters), see the same "
        "images in the same order and differ only in the final layer's attention. The OT-ViT's training trick "
        f"(probability {p['trick_probability']}: the final-layer templates of another training image of the same "
        "class join the candidate set) costs it an extra forward of those images (and draws more dropout masks "
        "from the same seeded generator); the budget is counted in steps.",
        f"- Model: the paper's sizes, {p['model_config']['depth']} layers, width {p['model_config']['dim']}, MLP "
        f"{p['model_config']['mlp_dim']}, {p['model_config']['heads']} heads of {p['model_config']['head_dim']}, "
        f"patch {p['model_config']['patch']}, dropout {p['model_config']['dropout']}: **{p['parameters']:,} "
        f"parameters**. OT layer: alpha = {p['ot_alpha']:g}, gamma = sqrt(head dim) = {p['ot_gamma']:.3f}; Sinkhorn "
        f"layer: {p['model_config']['sinkhorn_iterations']} row normalisations; exact layer: the KL problem's exact "
        "posterior p* (`probe.exact`) with templates k / sqrt(head dim), evidence q, u uniform and alpha = 1, whose "
        "closed-form approximation lambda = alpha z is the ViT's softmax layer.",
        f"- Machine: a 2-core CPU shared with other work, {p['parallel_runs']} runs at a time, 1 thread each.",
        *_reuse_lines(out),
        "",
        "## Test accuracy (mean and 95% t-interval over seeds)",
        "",
        "| model | here: Fashion-MNIST, reduced protocol | seeds | mean wall time per run: training and evaluation (s per training step) | paper: Fashion-MNIST (full protocol) | paper: CIFAR-10 | paper: CIFAR-100 |",
        "|---|---|---|---|---|---|---|",
    ]
    for attention, s in summary.items():
        lines.append(
            f"| {NAMES[attention]} | {_fmt(s['mean'], s['ci95_half_width'])} | {len(s['seeds'])} | "
            f"{s['mean_wall_time_s'] / 60:.1f} min ({s['mean_train_s_per_step']:.1f} s) | {PAPER['fashion-mnist'][attention]} | "
            f"{PAPER['cifar10'][attention]}; not run here: no copy of CIFAR offline | "
            f"{PAPER['cifar100'][attention]}; not run here: no copy of CIFAR offline |"
        )
    lines += ["", "Per seed:", "", "| model | " + " | ".join(f"seed {s}" for s in p["seeds"]) + " |",
              "|---|" + "---|" * len(p["seeds"])]
    for attention, s in summary.items():
        by_seed = dict(zip(s["seeds"], s["test_accuracy"]))
        lines.append(f"| {NAMES[attention]} | " + " | ".join(
            f"{by_seed[seed]:.4f}" if seed in by_seed else "missing" for seed in p["seeds"]) + " |")
    lines += ["", "Mean test accuracy after each epoch (the learning curve):", "",
              "| model | " + " | ".join(f"epoch {e + 1}" for e in range(p["epochs"])) + " |",
              "|---|" + "---|" * p["epochs"]]
    for attention, s in summary.items():
        lines.append(f"| {NAMES[attention]} | " + " | ".join(f"{a:.4f}" for a in s["mean_test_accuracy_per_epoch"]) + " |")
    lines += ["", "## Paired differences (same seed: same initial weights and data order)", "",
              "| difference | mean | 95% t-interval | per seed |", "|---|---|---|---|"]
    verdicts = []
    for key, d in paired.items():
        attention = key.split("-")[0]
        half = d["ci95_half_width"]
        interval = "n/a (one seed)" if half is None else f"[{d['mean'] - half:+.4f}, {d['mean'] + half:+.4f}]"
        lines.append(f"| {NAMES[attention]} − ViT | {d['mean']:+.4f} | {interval} | "
                     + ", ".join(f"{x:+.4f}" for x in d["differences"]) + " |")
        if half is not None:
            if d["mean"] - half > 0:
                verdicts.append(f"{NAMES[attention]} is better than the ViT in this reduced setting (interval above 0)")
            elif d["mean"] + half < 0:
                verdicts.append(f"{NAMES[attention]} is worse than the ViT in this reduced setting (interval below 0)")
            else:
                verdicts.append(f"the {NAMES[attention]} − ViT difference is not distinguishable from 0 "
                                f"(its interval contains 0)")
    spread = ", ".join(f"{NAMES[a]} {v['sd']:.3f}" for a, v in summary.items() if v["sd"] is not None) or "n/a"
    lines += [
        "",
        "## What this run can and cannot show",
        "",
        "- It shows that the models train from the same command and code path, and how they compare "
        f"**at this small budget** ({p['steps']} steps on {p['train_images']:,} images), with the same data, "
        f"order and initial weights: " + ("; ".join(verdicts) if verdicts else "too few seeds for an interval") + ".",
        f"- It cannot confirm or refute the paper's Fashion-MNIST numbers ({PAPER['fashion-mnist']['softmax']} and "
        f"{PAPER['fashion-mnist']['ot']}, a difference of {_paper_gap():.3f}): "
        "the paper trains on all 60,000 images with a far larger budget, and a gap of that size is about the seed-to-seed "
        f"spread of short runs (here: standard deviations {spread}). The accuracies here are those of "
        "under-trained models, well below the paper's.",
        f"- {len(p['seeds'])} seeds give a t-interval with {len(p['seeds']) - 1} degrees of freedom (factor "
        f"{_t_factor(len(p['seeds'])):.2f} on the standard error): wide by construction.",
        "- CIFAR-10/100: not run here, no copy of CIFAR exists offline on this machine "
        "(`probe vit train --data cifar10 --data-dir DIR` runs them where the data is).",
        "- Wall times were measured under the machine's varying load (other work ran beside these runs), so they "
        "compare the attentions' costs only roughly.",
        "- The full protocol (all 60,000 images, a full training budget) needs a GPU: "
        "`probe vit train --device cuda --epochs E --seed S --attention A` for each run.",
        "",
    ]
    lines += _exact_lines(out)
    if kept is not None:
        k = out["kept_model"]
        lines += [f"The model of run `{k['run']}` after {k['epochs']} epochs (test accuracy {k['test_accuracy']:.4f}) is "
                  f"kept as `{kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept}` "
                  "(`probe.vit.load_checkpoint`); the other runs' checkpoints are in "
                  f"`{args.runs_dir.relative_to(ROOT) if args.runs_dir.is_relative_to(ROOT) else args.runs_dir}` "
                  "(not in git).", ""]
    return "\n".join(lines)


def _reuse_lines(out) -> list[str]:
    """The protocol's line on runs taken from an earlier report, and the bitwise check of a fresh rerun."""
    reused = out.get("reused_runs")
    if not reused:
        return []
    line = (f"- Reused: {', '.join(f'`{r}`' for r in reused['runs'])} are the runs of `{reused['from']}` "
            f"({reused['generated_at']}), not trained again.")
    for check in reused["checks"]:
        verdict = ("bit for bit the same" if check["identical"] else
                   "NOT the same: the reused runs' code path has changed, and they should be trained again")
        line += (f" A fresh run of `{check['run']}` with the current code gave {check['epochs']} epoch(s) whose "
                 f"{', '.join(check['fields'])} are {verdict} as the reused run's.")
    return [line]


def _exact_lines(out) -> list[str]:
    """The exact-ViT's Newton iterations, certificates and cost per step against the ViT."""
    certificates, summary = out.get("exact_certificates"), out["summary"]
    if not certificates:
        return []
    lines = ["## The exact-ViT's solver during training", "",
             "Every training step solves one problem per image and head (the class-token query); the evaluation "
             "solves one per test image and head. Certified: the solver's bound on the error of lambda* is at most "
             "1e-9 of its norm.", "",
             "| run | problems in training | Newton iterations, mean (per epoch) | max | max bound / norm lambda | "
             "not certified | test problems | not certified |", "|---|---|---|---|---|---|---|---|"]
    for name, c in certificates.items():
        t, e = c["train"], c["test"]
        lines.append(
            f"| {name} | {t['problems']:,} | {t['mean_iterations']:.2f} ("
            + ", ".join(f"{x:.2f}" for x in c["train_mean_iterations_per_epoch"])
            + f") | {t['max_iterations']} | {max(t['max_relative_error_bound'], e['max_relative_error_bound']):.1e} | "
            f"{t['not_converged']} | {e['problems']:,} | {e['not_converged']} |"
        )
    if "softmax" in summary and "exact" in summary:
        ratio = summary["exact"]["mean_train_s_per_step"] / summary["softmax"]["mean_train_s_per_step"]
        lines += ["", f"Training time per step: {summary['exact']['mean_train_s_per_step']:.1f} s for the exact-ViT "
                  f"against {summary['softmax']['mean_train_s_per_step']:.1f} s for the ViT ({ratio:.2f}x), measured "
                  "in different runs under the shared machine's varying load; `bench/results_exact.md` measures the "
                  "two side by side."]
    return lines + [""]


def main():
    args = parse()
    if not args.report_only:
        started = time.time()
        run_all(args)
        print(f"protocol finished in {(time.time() - started) / 60:.1f} min", flush=True)
    out = report(args)
    for attention, s in out["summary"].items():
        print(f"{attention}: {_fmt(s['mean'], s['ci95_half_width'])} over seeds {s['seeds']}")


if __name__ == "__main__":
    main()
