"""The ViT / OT-ViT / Sinkhorn-ViT / exact-ViT comparison on Fashion-MNIST, reduced to fit a shared 2-core CPU.

Runs ``probe vit train`` (as ``python3 -m probe.vit.cli train``) for every (seed, attention), at most
``--jobs`` at once, one torch thread each, then writes ``reports/vit/results.json`` and
``reports/vit/results.md`` from the runs' ``results.json`` files.  Finished runs are skipped; killed runs
resume from their last epoch (start the script again).  ``--report-only`` rewrites the reports from the
runs that exist.

``--reuse-runs-from reports/vit/results.json`` takes the arms of a report this script wrote before (its
``runs`` entries are the runs' results files), so that a new arm can join the committed ones without training
them again.  Runs of a reused arm that are also in ``--runs-dir`` are *reruns* on this machine: the report
compares them with the reused runs, bit for bit and as paired differences, and pairs the new arms with the
softmax reruns (the same machine and period of load).  ``--rerun-check LABEL=DIR`` names a further run (the
same settings, made with other code, fewer epochs allowed), compared bit for bit with the rerun of the same
name, or the report's run: with the reused runs' code and with the code the change started from, it shows
whether the change left their code path computing the same numbers.

The protocol is fair by construction: every run gets the same training subset, test subset, epochs, batch
size and learning rate; for a given seed, every attention gets the same initial weights (the parameters are
the same) and the same data order (see ``probe.vit.train``).

    PYTHONPATH=. python3 scripts/vit_experiment.py            # run (or finish) the protocol, then report
    PYTHONPATH=. python3 scripts/vit_experiment.py --report-only
    PYTHONPATH=. python3 scripts/vit_experiment.py --epochs 4 --attentions exact softmax   # a new arm and reruns
    PYTHONPATH=. python3 scripts/vit_experiment.py --report-only --epochs 4 \
        --reuse-runs-from reports/vit/results.json --reuse-arms softmax ot sinkhorn \
        --rerun-check "main's code=runs/main/softmax-seed0"
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
    p.add_argument("--machine", default="a 2-core CPU shared with other work",
                   help="the machine, as the report's protocol names it (bench/gpu.py: the GPU's name)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--stopped-by", default=None, metavar="TEXT",
                   help="why the runs stopped where they did (the GPU call's plateau rule or its budget), as the "
                        "report should say it")
    p.add_argument("--render-from", type=Path, default=None, metavar="RESULTS_JSON",
                   help="Write results.md (and results.json, its verdict recomputed) into --report-dir again from "
                        "this results.json alone: after a change of the report's words, when the runs are gone "
                        "(a GPU call's runs stay on that machine).")
    p.add_argument("--keep-checkpoint", default="ot-seed0",
                   help="RUN whose model.pt is copied to the report directory (empty: none).")
    p.add_argument("--reuse-runs-from", type=Path, default=None, metavar="RESULTS_JSON",
                   help="Take the arms of this earlier report of the script (their runs there, as they were).")
    p.add_argument("--reuse-arms", nargs="+", default=None, choices=ATTENTIONS, metavar="ATTENTION",
                   help="Which arms to take from --reuse-runs-from [default: all it holds].")
    p.add_argument("--rerun-check", nargs="*", default=[], metavar="LABEL=DIR",
                   help="Further runs (LABEL: the code that made them), compared bit for bit with the runs used here.")
    return p.parse_args()


def run_name(attention: str, seed: int) -> str:
    return f"{attention}-seed{seed}"


def finished(run_dir: Path, epochs: int) -> bool:
    results = run_dir / "results.json"
    return results.exists() and json.loads(results.read_text()).get("epochs_done", 0) >= epochs


def at_epoch(r: dict, epochs: int) -> dict:
    """A run's results as they were after ``epochs`` epochs (from its learning curve).

    A run continued to more epochs passed through exactly the state of a run of ``epochs`` epochs (the number
    of epochs changes nothing in the training; tests/vit/test_vit.py checks that a resumed run equals an
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


def compare_runs(fresh: dict, reference: dict) -> dict:
    """``fresh``'s learning curve against ``reference``'s, epoch by epoch: bit for bit the same in
    ``CHECKED_FIELDS``?  And the largest absolute difference of each field (over the epochs both have)."""
    pairs = list(zip(fresh["learning_curve"], reference["learning_curve"]))
    return {"epochs": len(pairs), "identical": all(a[f] == b[f] for a, b in pairs for f in CHECKED_FIELDS),
            "max_abs_difference": {f: max(abs(a[f] - b[f]) for a, b in pairs) for f in CHECKED_FIELDS}}


def _labelled(item: str) -> tuple[str, Path]:
    """``LABEL=DIR`` or ``DIR`` (labelled by its parent folder's name)."""
    label, _, directory = item.rpartition("=")
    return (label or Path(directory).parent.name), Path(directory)


def exact_certificates(run: dict) -> dict:
    """The exact-ViT run's Newton iterations and certificates over its epochs (``exact_train``, ``exact_test``)."""
    from probe.solve.exact import merge_summaries

    curve = run["learning_curve"]
    return {
        "train": merge_summaries([e["exact_train"] for e in curve]),
        "test": merge_summaries([e["exact_test"] for e in curve]),
        "train_mean_iterations_per_epoch": [e["exact_train"]["mean_iterations"] for e in curve],
    }


#: test images on which a trained model's final-layer exact posterior is compared with its softmax
GAP_IMAGES = 256


def posterior_gap(run_dir: Path, settings: dict, data_dir: Path | None) -> dict | None:
    """How far the exact posterior is from softmax attention in a trained model's final layer: for the class-token
    query of each head on the first ``GAP_IMAGES`` test images of the run's data (``settings``), p* of templates
    k / sqrt(d'), evidence q and u uniform against softmax(<q, k> / sqrt(d')), the approximation lambda = alpha z of
    the same problem (the model's ``model.pt``; None where the run has none)."""
    if not (run_dir / "model.pt").exists():
        return None
    import torch

    from probe.solve.exact import exact_attention
    from probe.vit import final_layer_problems, load_checkpoint
    from probe.vit.data import load_data

    data = load_data(settings["data"], settings["data_dir"] or data_dir)
    model, _ = load_checkpoint(run_dir)
    images = data.test_images[:GAP_IMAGES]
    problems = final_layer_problems(model, data.normalise(images))
    k, q = problems["candidates"].double(), problems["evidence"].double()  # (B, H, N, d'), (B, H, d')
    T = k / math.sqrt(k.shape[-1])
    p = exact_attention(T, q, torch.zeros(k.shape[:-1], dtype=torch.float64), 1.0)
    softmax = torch.softmax((T @ q.unsqueeze(-1)).squeeze(-1), dim=-1)
    u = torch.full_like(p, 1.0 / p.shape[-1])
    lam = q + (T.transpose(-1, -2) @ (u - p).unsqueeze(-1)).squeeze(-1)  # lambda* = alpha z + T^T alpha (u - p*)
    tv = 0.5 * (p - softmax).abs().sum(-1).flatten()
    rel = ((lam - q).norm(dim=-1) / lam.norm(dim=-1)).flatten()

    def entropy(w):
        return -(w * w.clamp_min(1e-300).log()).sum(-1).flatten()

    return {"images": images.shape[0], "problems": tv.numel(), "keys": p.shape[-1],
            "tv_median": float(tv.median()), "tv_p90": float(tv.quantile(0.9)), "tv_max": float(tv.max()),
            "rel_deviation_median": float(rel.median()),
            "entropy_exact_median": float(entropy(p).median()), "entropy_softmax_median": float(entropy(softmax).median()),
            "entropy_uniform": math.log(p.shape[-1])}


def _summary(runs: dict, attention: str, seeds: list[int], epochs: int) -> dict | None:
    """Test accuracy (mean, t-interval), learning curve, wall time and training seconds per step of one arm."""
    chosen = [runs[(attention, seed)] for seed in seeds if (attention, seed) in runs]
    if not chosen:
        return None
    accs = [r["test_accuracy"] for r in chosen]
    mean, sd, half = t_interval(accs)
    step_s = [sum(e["train_s"] for e in r["learning_curve"]) / r["steps"] for r in chosen]
    return {
        "mean_train_s_per_step": sum(step_s) / len(step_s),
        "seeds": [seed for seed in seeds if (attention, seed) in runs], "test_accuracy": accs,
        "mean": mean, "sd": sd, "ci95_half_width": half,
        "mean_wall_time_s": sum(r["wall_time_s"] for r in chosen) / len(chosen),
        "mean_test_accuracy_per_epoch": [t_interval([r["learning_curve"][e]["test_accuracy"] for r in chosen])[0]
                                         for e in range(epochs)],
    }


def _paired(runs: dict, baseline: dict, attention: str, seeds: list[int]) -> dict | None:
    """Per-seed differences of test accuracy, ``attention``'s runs minus ``baseline``'s softmax runs."""
    common = [seed for seed in seeds if (attention, seed) in runs and ("softmax", seed) in baseline]
    if not common:
        return None
    diffs = [runs[(attention, seed)]["test_accuracy"] - baseline[("softmax", seed)]["test_accuracy"] for seed in common]
    mean, sd, half = t_interval(diffs)
    return {"seeds": common, "differences": diffs, "mean": mean, "sd": sd, "ci95_half_width": half}


def report(args) -> dict:
    """The report from the runs in ``--runs-dir`` and, with ``--reuse-runs-from``, an earlier report's runs.

    With reuse, an arm's runs come from the earlier report when it holds the arm (its comparison stays as it
    was), else from the runs directory.  Runs directory runs of a reused arm are *reruns*: they are compared
    with the reused runs (bit for bit, and as a paired difference), and a new arm is paired with the reruns of
    the softmax arm where they exist, so that it is compared with a ViT trained on the same machine."""
    here, earlier_runs = {}, {}
    earlier = json.loads(args.reuse_runs_from.read_text()) if args.reuse_runs_from else None
    for attention in args.attentions:
        for seed in args.seeds:
            name = run_name(attention, seed)
            path = args.runs_dir / name / "results.json"
            if path.exists():
                r = json.loads(path.read_text())
                r["settings"]["out"] = _shown(path.parent)  # as the repository names it, not a machine path
                if r.get("epochs_done", 0) >= args.epochs:
                    here[(attention, seed)] = at_epoch(r, args.epochs)
            reusable = earlier is not None and (args.reuse_arms is None or attention in args.reuse_arms)
            if reusable and name in earlier["runs"] and earlier["runs"][name]["epochs_done"] >= args.epochs:
                earlier_runs[(attention, seed)] = at_epoch(earlier["runs"][name], args.epochs)
    reused_arms = {a for a, _ in earlier_runs}
    runs = {key: r for key, r in here.items() if key[0] not in reused_arms} | earlier_runs
    reruns = {key: r for key, r in here.items() if key[0] in reused_arms}
    if not runs:
        raise SystemExit(f"no finished runs in {args.runs_dir}: run the protocol first.")
    any_run = next(iter(runs.values()))
    s = any_run["settings"]
    protocol = {
        "data": "fashion-mnist", "train_images": any_run["train_images"], "test_images": any_run["test_images"],
        "epochs": args.epochs, "steps": any_run["steps"], "batch_size": s["batch_size"], "lr": s["lr"],
        "optimizer": "Adam, constant learning rate", "seeds": args.seeds, "threads_per_run": 1,
        "parallel_runs": args.jobs, "machine": args.machine, "parameters": any_run["parameters"], "model_config": any_run["model_config"],
        "ot_alpha": runs.get(("ot", args.seeds[0]), any_run)["alpha"],
        "ot_gamma": runs.get(("ot", args.seeds[0]), any_run)["gamma"],
        "trick_probability": 0.5,
    }
    summary = {a: _summary(runs, a, args.seeds, args.epochs) for a in args.attentions}
    summary = {a: v for a, v in summary.items() if v is not None}
    paired = {}
    for attention in summary:
        if attention != "softmax":  # a new arm against the softmax reruns where they exist
            baseline = reruns if attention not in reused_arms and ("softmax", args.seeds[0]) in reruns else runs
            d = _paired(runs, baseline, attention, args.seeds)
            if d is not None:
                paired[f"{attention}-softmax"] = dict(d, baseline="rerun" if baseline is reruns else "same source")
    out_runs = {run_name(a, seed): r for (a, seed), r in runs.items()}
    certificates = {name: exact_certificates(r) for name, r in out_runs.items() if name.startswith("exact-")}
    gaps = {name: gap for name in certificates
            if (gap := posterior_gap(args.runs_dir / name, out_runs[name]["settings"], args.data_dir))}
    out = {"protocol": protocol, "summary": summary, "paired_differences": paired,
           "runs": out_runs, "paper": PAPER,
           "generated_by": "scripts/vit_experiment.py", "generated_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "paper_gap": paper_gap_verdict(paired)}
    if args.stopped_by:
        protocol["stopped_by"] = args.stopped_by
    distance = paper_distance(summary)
    if distance:
        out["paper_distance"] = distance
    if certificates:
        out["exact_certificates"] = certificates
    if gaps:
        out["exact_vs_softmax"] = gaps
    if earlier is not None:
        made = earlier.get("reused_runs", {}).get("generated_at", earlier["generated_at"])  # a report made from itself
        out["reused_runs"] = {"from": _shown(args.reuse_runs_from), "generated_at": made,
                              "runs": sorted(run_name(a, seed) for a, seed in earlier_runs)}
    if reruns:
        out["reruns"] = {
            "summary": {a: v for a in sorted({a for a, _ in reruns}) if (v := _summary(reruns, a, args.seeds, args.epochs))},
            "against_reused": {run_name(a, seed): compare_runs(r, earlier_runs[(a, seed)]) for (a, seed), r in reruns.items()},
            "paired_differences": {f"{a}-rerun-{a}": _paired(reruns, earlier_runs, a, args.seeds)
                                   for a in sorted({a for a, _ in reruns}) if a == "softmax"},
            "runs": {run_name(a, seed): r for (a, seed), r in reruns.items()},
        }
    checks = []
    for item in args.rerun_check:
        label, directory = _labelled(item)
        fresh = json.loads((directory / "results.json").read_text())
        key = (fresh["settings"]["attention"], fresh["settings"]["seed"])
        reference, against = (reruns[key], "rerun") if key in reruns else (runs[key], "report")
        checks.append({"label": label, "directory": _shown(directory), "run": run_name(*key), "against": against,
                       **compare_runs(fresh, reference)})
    if checks:
        out["checks"] = checks
    args.report_dir.mkdir(parents=True, exist_ok=True)
    _portable(out)
    (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    kept = None
    if args.keep_checkpoint:
        name = args.keep_checkpoint
        source = args.runs_dir / name / "model.pt"
        if earlier is not None and earlier.get("kept_model", {}).get("run") == name and name in out["reused_runs"]["runs"]:
            kept = args.report_dir / earlier["kept_model"]["file"]  # the reused run's kept model stays
            out["kept_model"] = earlier["kept_model"]
            (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
        elif source.exists():
            kept = args.report_dir / f"{name}.pt"
            shutil.copyfile(source, kept)
            raw = json.loads((args.runs_dir / name / "results.json").read_text())
            out["kept_model"] = {"run": name, "file": kept.name, "epochs": raw["epochs_done"],
                                 "test_accuracy": raw["test_accuracy"]}
            (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    (args.report_dir / "results.md").write_text(markdown(out, args, kept))
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it is inside it (no machine paths in the reports); Debian's
    Fashion-MNIST folder as it is (the same on every machine); any other path by its last two parts under
    ``<elsewhere>/`` (a GPU call's scratch folder, say), which does not name the machine."""
    from probe.vit.data import FASHION_MNIST_DIR

    path = Path(path).resolve()
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if path == Path(FASHION_MNIST_DIR).resolve():
        return str(FASHION_MNIST_DIR)
    return "<elsewhere>/" + "/".join(path.parts[-2:])


def _portable(out: dict) -> dict:
    """``out`` with every run's folders (its output, data folder and data source) as :func:`_shown` gives them."""
    runs = list(out.get("runs", {}).values()) + list(out.get("reruns", {}).get("runs", {}).values())
    for r in runs:
        settings = r.get("settings", {})
        for holder, field in ((settings, "out"), (settings, "data_dir"), (r, "data_source")):
            value = holder.get(field)
            if isinstance(value, str) and (value.startswith("/") or ":\\" in value):
                holder[field] = _shown(Path(value))
    return out


def _paper_gap() -> float:
    return float(PAPER["fashion-mnist"]["ot"].split()[0]) - float(PAPER["fashion-mnist"]["softmax"].split()[0])


def _t_factor(n: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, n - 1)) if n > 1 else float("nan")


def _fmt(mean, half):
    return f"{mean:.3f}" + (f" ± {half:.3f}" if half is not None else "")


#: the training set's size: a run on all of it has the paper's data (its budget may still be smaller)
FULL_TRAIN_IMAGES = 60_000


def _full(p: dict) -> bool:
    return p["train_images"] >= FULL_TRAIN_IMAGES


def paper_distance(summary: dict) -> dict:
    """Each of the paper's two arms here against the paper's Fashion-MNIST accuracy: the mean's difference and its
    95% t-interval (over seeds)."""
    out = {}
    for attention in ("softmax", "ot"):
        s = summary.get(attention)
        if s is None:
            continue
        paper = float(PAPER["fashion-mnist"][attention].split()[0])
        half = s["ci95_half_width"]
        out[attention] = {"paper": paper, "difference": s["mean"] - paper,
                          "ci95": None if half is None else [s["mean"] - half - paper, s["mean"] + half - paper]}
    return out


def paper_gap_verdict(paired: dict) -> str | None:
    """Whether the paper's Fashion-MNIST gap (OT-ViT better than the ViT) shows in the paired differences, at
    the runs' budget (which may be far below the paper's: the verdict says so)."""
    d = paired.get("ot-softmax")
    if not d or d["ci95_half_width"] is None:
        return None
    low, high = d["mean"] - d["ci95_half_width"], d["mean"] + d["ci95_half_width"]
    measured = f"OT-ViT − ViT here {d['mean']:+.4f}, 95% interval [{low:+.4f}, {high:+.4f}]"
    if low > 0:
        return f"confirmed at this budget: {measured} lies above 0 (the paper: {_paper_gap():+.3f})"
    if high < 0:
        return f"reversed at this budget: {measured} lies below 0 (the paper: {_paper_gap():+.3f})"
    return f"not confirmed at this budget: {measured} contains 0 (the paper: {_paper_gap():+.3f})"


def markdown(out, args, kept) -> str:
    p, summary, paired = out["protocol"], out["summary"], out["paired_differences"]
    full = _full(p)
    scope = f"all {p['train_images']:,} training images, {p['epochs']} epochs" if full else "reduced protocol"
    setting = "at this budget" if full else "in this reduced setting"
    lines = [
        "# ViT, OT-ViT, Sinkhorn-ViT and exact-ViT on Fashion-MNIST: "
        + (f"all {p['train_images']:,} training images, a fair comparison" if full else "a reduced, fair comparison"),
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
        f"- Machine: {p.get('machine', 'a 2-core CPU shared with other work')}, {p['parallel_runs']} runs at a time, "
        "1 thread each.",
        *_reuse_lines(out),
        "",
        "## Test accuracy (mean and 95% t-interval over seeds)",
        "",
        f"| model | here: Fashion-MNIST, {scope} | seeds | mean wall time per run: training and evaluation (s per training step) | paper: Fashion-MNIST (full protocol) | paper: CIFAR-10 | paper: CIFAR-100 |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(NAMES[a], a, v) for a, v in summary.items()]
    rows += [(f"{NAMES[a]}, rerun here", a, v) for a, v in out.get("reruns", {}).get("summary", {}).items()]
    for name, attention, s in rows:
        lines.append(
            f"| {name} | {_fmt(s['mean'], s['ci95_half_width'])} | {len(s['seeds'])} | "
            f"{s['mean_wall_time_s'] / 60:.1f} min ({s['mean_train_s_per_step']:.1f} s) | {PAPER['fashion-mnist'][attention]} | "
            f"{PAPER['cifar10'][attention]}; not run here: no copy of CIFAR offline | "
            f"{PAPER['cifar100'][attention]}; not run here: no copy of CIFAR offline |"
        )
    lines += ["", "Per seed:", "", "| model | " + " | ".join(f"seed {s}" for s in p["seeds"]) + " |",
              "|---|" + "---|" * len(p["seeds"])]
    for name, _, s in rows:
        by_seed = dict(zip(s["seeds"], s["test_accuracy"]))
        lines.append(f"| {name} | " + " | ".join(
            f"{by_seed[seed]:.4f}" if seed in by_seed else "missing" for seed in p["seeds"]) + " |")
    lines += ["", "Mean test accuracy after each epoch (the learning curve):", "",
              "| model | " + " | ".join(f"epoch {e + 1}" for e in range(p["epochs"])) + " |",
              "|---|" + "---|" * p["epochs"]]
    for name, _, s in rows:
        lines.append(f"| {name} | " + " | ".join(f"{a:.4f}" for a in s["mean_test_accuracy_per_epoch"]) + " |")
    lines += ["", "## Paired differences (same seed: same initial weights and data order)", "",
              "| difference | mean | 95% t-interval | per seed |", "|---|---|---|---|"]
    verdicts = []
    differences = [(f"{NAMES[key.split('-')[0]]} − ViT" + (" (rerun here)" if d.get("baseline") == "rerun" else ""),
                    key.split("-")[0], d) for key, d in paired.items()]
    differences += [(f"{NAMES[key.split('-')[0]]} rerun here − {NAMES[key.split('-')[0]]}", None, d)
                    for key, d in out.get("reruns", {}).get("paired_differences", {}).items() if d is not None]
    for label, attention, d in differences:
        half = d["ci95_half_width"]
        interval = "n/a (one seed)" if half is None else f"[{d['mean'] - half:+.4f}, {d['mean'] + half:+.4f}]"
        lines.append(f"| {label} | {d['mean']:+.4f} | {interval} | "
                     + ", ".join(f"{x:+.4f}" for x in d["differences"]) + " |")
        if half is not None and attention is not None:
            if d["mean"] - half > 0:
                verdicts.append(f"{NAMES[attention]} is better than the ViT {setting} (interval above 0)")
            elif d["mean"] + half < 0:
                verdicts.append(f"{NAMES[attention]} is worse than the ViT {setting} (interval below 0)")
            else:
                verdicts.append(f"the {NAMES[attention]} − ViT difference is not distinguishable from 0 "
                                f"(its interval contains 0)")
    spread = ", ".join(f"{NAMES[a]} {v['sd']:.3f}" for a, v in summary.items() if v["sd"] is not None) or "n/a"
    gap = out.get("paper_gap")
    if full and p.get("stopped_by"):
        paper_line = (f"- The paper's Fashion-MNIST gap ({PAPER['fashion-mnist']['softmax']} against "
                      f"{PAPER['fashion-mnist']['ot']}) is {gap or 'not tested: too few seeds for an interval'}. "
                      f"These runs have the paper's data and stopped after {p['epochs']} epochs: {p['stopped_by']}. "
                      f"Seed-to-seed standard deviations here: {spread}.")
        for attention, d in out.get("paper_distance", {}).items():
            interval = "" if d["ci95"] is None else f", 95% interval [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
            paper_line += (f" The {NAMES[attention]}'s mean test accuracy is {d['difference']:+.4f} from the paper's "
                           f"{d['paper']:.3f}{interval}.")
    elif full:
        paper_line = (f"- The paper's Fashion-MNIST gap ({PAPER['fashion-mnist']['softmax']} against "
                      f"{PAPER['fashion-mnist']['ot']}) is {gap or 'not tested: too few seeds for an interval'}. "
                      f"These runs have the paper's data but {p['epochs']} epochs, as many as fitted in one call of the "
                      f"machine, and the paper trains far longer: what the ordering is at the paper's budget is not "
                      f"tested here. Seed-to-seed standard deviations here: {spread}.")
    else:
        paper_line = (f"- It cannot confirm or refute the paper's Fashion-MNIST numbers ({PAPER['fashion-mnist']['softmax']} "
                      f"and {PAPER['fashion-mnist']['ot']}, a difference of {_paper_gap():.3f}): "
                      "the paper trains on all 60,000 images with a far larger budget, and a gap of that size is about the "
                      f"seed-to-seed spread of short runs (here: standard deviations {spread}). The accuracies here are "
                      "those of under-trained models, well below the paper's.")
    lines += [
        "",
        "## What this run can and cannot show",
        "",
        "- It shows that the models train from the same command and code path, and how they compare "
        f"**at this {'' if full else 'small '}budget** ({p['steps']} steps on {p['train_images']:,} images), with the same data, "
        f"order and initial weights: " + ("; ".join(verdicts) if verdicts else "too few seeds for an interval") + ".",
        *_exact_caveat(out),
        paper_line,
        f"- {len(p['seeds'])} seeds give a t-interval with {len(p['seeds']) - 1} degrees of freedom (factor "
        f"{_t_factor(len(p['seeds'])):.2f} on the standard error): wide by construction.",
        "- CIFAR-10/100: not run here, no copy of CIFAR exists offline on this machine "
        "(`probe vit train --data cifar10 --data-dir DIR` runs them where the data is).",
        "- Wall times were measured under the machine's varying load (other work ran beside these runs), so they "
        "compare the attentions' costs only roughly.",
        *([] if full else ["- The full protocol (all 60,000 images, a full training budget) needs a GPU: "
                           "`probe vit train --device cuda --epochs E --seed S --attention A` for each run."]),
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


def _differences(check: dict) -> str:
    """How a rerun compares with its reference: bit for bit, or its largest differences."""
    if check["identical"]:
        return f"bit for bit the same ({', '.join(CHECKED_FIELDS)}, {check['epochs']} epoch(s))"
    d = check["max_abs_difference"]
    return (f"not bit for bit the same: over {check['epochs']} epoch(s) the largest differences are "
            f"{d['train_loss']:.1e} in training loss and {d['test_accuracy']:.4f} in test accuracy")


def _reuse_lines(out) -> list[str]:
    """The protocol's lines on runs taken from an earlier report, the reruns of reused arms, and the checks."""
    reused, reruns = out.get("reused_runs"), out.get("reruns")
    if not reused:
        return []
    lines = [f"- Reused: {', '.join(f'`{r}`' for r in reused['runs'])} are the runs of `{reused['from']}` "
             f"({reused['generated_at']}), not trained again."]
    if reruns:
        compared = reruns["against_reused"]
        lines.append(
            f"- Rerun here: {', '.join(f'`{r}`' for r in compared)}, trained again on this machine with this code. "
            "Against the reused runs they are " + "; ".join(f"`{r}`: {_differences(c)}" for r, c in compared.items())
            + ". New arms are paired with these reruns (the same machine, the same period of load).")
    for check in out.get("checks", []):
        lines.append(f"- Check: `{check['directory']}`, a run of `{check['run']}` made with {check['label']}, against "
                     f"the {'rerun here' if check['against'] == 'rerun' else 'run in this report'}: "
                     f"{_differences(check)}.")
    return lines


def _exact_caveat(out) -> list[str]:
    """What the exact-ViT's comparison can show, given how close its final layer's p* is to softmax."""
    gaps = out.get("exact_vs_softmax")
    if not gaps:
        return []
    tv = max(g["tv_median"] for g in gaps.values())
    entropy = min(g["entropy_exact_median"] for g in gaps.values())
    uniform = next(iter(gaps.values()))["entropy_uniform"]
    return [f"- The exact-ViT − ViT comparison is weak evidence either way: in the trained exact-ViTs' final layer the "
            f"exact posterior is close to the softmax of the same queries and keys (median total variation at most "
            f"{tv:.3f}), and both are close to uniform (median entropy at least {entropy:.2f} against {uniform:.2f} "
            "for uniform weights). At this budget the final layer stays where softmax is already close to exact "
            "inference, so the comparison says little about models whose attention is far from it."]


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
    gaps = out.get("exact_vs_softmax")
    if gaps:
        g = next(iter(gaps.values()))
        lines += ["", f"How far exact inference is from softmax in the trained exact-ViTs' final layer (class-token query, "
                  f"{g['images']} test images x {g['problems'] // g['images']} heads; p* against softmax(<q, k> / sqrt(d')), "
                  "the approximation lambda = alpha z of the same problem, computed from the run's model.pt):", "",
                  "| run | TV(p*, softmax): median | 90th percentile | max | median relative deviation of lambda* | "
                  f"median entropy, p* / softmax (uniform over {g['keys']} keys: {g['entropy_uniform']:.3f}) |",
                  "|---|---|---|---|---|---|"]
        for name, g in gaps.items():
            lines.append(f"| {name} | {g['tv_median']:.4f} | {g['tv_p90']:.4f} | {g['tv_max']:.4f} | "
                         f"{g['rel_deviation_median']:.3f} | {g['entropy_exact_median']:.3f} / "
                         f"{g['entropy_softmax_median']:.3f} |")
    baseline = out.get("reruns", {}).get("summary", {}).get("softmax") or summary.get("softmax")
    if baseline and "exact" in summary:
        ratio = summary["exact"]["mean_train_s_per_step"] / baseline["mean_train_s_per_step"]
        lines += ["", f"Training time per step (wall clock): {summary['exact']['mean_train_s_per_step']:.1f} s for the "
                  f"exact-ViT against {baseline['mean_train_s_per_step']:.1f} s for the ViT"
                  f"{' rerun here' if baseline is not summary.get('softmax') else ''} ({ratio:.2f}x), measured in "
                  "separate processes under the shared machine's varying load; `bench/results_exact.md` measures the "
                  "two side by side in CPU time."]
    return lines + [""]


def render_from(args) -> dict:
    """The report again from a results.json: its numbers as they are, its words as this script says them now."""
    out = _portable(json.loads(args.render_from.read_text()))
    out["paper_gap"] = paper_gap_verdict(out["paired_differences"])
    args.report_dir.mkdir(parents=True, exist_ok=True)
    (args.report_dir / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    kept = args.report_dir / out["kept_model"]["file"] if out.get("kept_model") else None
    (args.report_dir / "results.md").write_text(markdown(out, args, kept))
    return out


def main():
    args = parse()
    if args.render_from:
        render_from(args)
        return
    if not args.report_only:
        started = time.time()
        run_all(args)
        print(f"protocol finished in {(time.time() - started) / 60:.1f} min", flush=True)
    out = report(args)
    for attention, s in out["summary"].items():
        print(f"{attention}: {_fmt(s['mean'], s['ci95_half_width'])} over seeds {s['seeds']}")


if __name__ == "__main__":
    main()
