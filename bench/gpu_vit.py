"""Part 4 of the GPU check (bench/gpu.py): the OT-ViT comparison at the paper's full protocol, its runs trained
side by side until the softmax ViT's mean test accuracy plateaus (module docstring of bench/gpu.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpu_runs import ROOT, SEEDS, Log, _sync

# --------------------------------------------------------------------------------------------------
# 4. the OT-ViT at the full protocol


def vit_attentions() -> tuple[str, ...]:
    from probe.vit.attention import MultiHeadAttention

    return tuple(MultiHeadAttention.KINDS)


def _train_command(args, attention: str, seed: int, epochs: int, runs: Path) -> list[str]:
    command = [sys.executable, "-m", "probe", "vit", "train", "--attention", attention, "--seed", str(seed),
               "--epochs", str(epochs), "--device", args.device, "--out", str(runs / f"{attention}-seed{seed}"),
               "--threads", "1", "--no-progress"]
    if getattr(args, "vit_precision", "fp32") != "fp32":
        command += ["--precision", args.vit_precision]
    if args.data_dir:
        command += ["--data-dir", str(args.data_dir)]
    if args.quick:
        command += ["--train-subset", "64", "--test-subset", "64", "--batch-size", "32"]
    return command


#: the arms of the paper's comparison: the others (sinkhorn, exact) may not hold them up (_launch_all's gate)
MAIN_ARMS = ("softmax", "ot")


def _launch_all(args, runs: Path, epochs: int, seeds, attentions, log: Log, deadline: float,
                gate: tuple[str, ...] = ()) -> dict:
    """Every (attention, seed) as a concurrent process, trained (or resumed) to ``epochs``; processes still
    running at ``deadline`` are stopped (their finished epochs are kept in their checkpoints).  With a
    ``gate``: once every run of those arms has finished, the others get at most as long again, so that a much
    slower arm cannot take the paper's comparison's time.  Returns each run's exit code and its seconds."""
    processes, start, seconds = {}, time.monotonic(), {}
    for attention in attentions:
        for seed in seeds:
            log_file = open(runs / f"{attention}-seed{seed}.log", "a", encoding="utf-8")
            processes[(attention, seed)] = (subprocess.Popen(
                _train_command(args, attention, seed, epochs, runs), cwd=ROOT, stdout=log_file, stderr=log_file,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
                start_new_session=True), log_file)
    codes = {}
    while processes:
        for key, (process, log_file) in list(processes.items()):
            code = process.poll()
            if code is not None:
                codes[key], seconds[key] = code, time.monotonic() - start
                log_file.close()
                del processes[key]
        if gate and not any(a in gate for a, _ in processes) and any(a in gate for a in attentions):
            gated = start + 2 * (time.monotonic() - start)
            if gated < deadline:
                log(f"vit: {', '.join(gate)} finished in {time.monotonic() - start:.0f} s; the other runs get "
                    f"until {gated - start:.0f} s")
                deadline = gated
            gate = ()
        if processes and time.monotonic() > deadline:
            log(f"vit: stopping {len(processes)} run(s) at the deadline")
            codes.update(_stop(processes))
            seconds.update({key: time.monotonic() - start for key in processes})
            processes = {}
        time.sleep(0.5)
    return codes, seconds


def _epochs_done(runs: Path, attention: str, seed: int) -> int:
    """Epochs of a run's last finished training (its results file; a run stopped at the deadline keeps the
    results of the training before, which the report can use)."""
    results = runs / f"{attention}-seed{seed}" / "results.json"
    return int(json.loads(results.read_text())["epochs_done"]) if results.exists() else 0


#: the full protocol's epochs: at least MIN_EPOCHS, or until the softmax ViT's mean test accuracy has not
#: improved for PATIENCE epochs (probe.vit.loop.plateau_epoch); MAX_EPOCHS caps a run that keeps improving
MIN_EPOCHS, PATIENCE, MAX_EPOCHS = 30, 5, 80
#: seconds kept for writing every stopped run's results (one short process per run, side by side)
FINALISE_S = 40.0


_SEEN: dict = {}


def _run_epochs(runs: Path, attention: str, seed: int) -> list[float]:
    """The test accuracies of a run's finished epochs, from its checkpoint (rewritten atomically per epoch; read
    again only when it has changed)."""
    from probe.vit.train import read_checkpoint

    path = runs / f"{attention}-seed{seed}" / "checkpoint.pt"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return []
    if _SEEN.get(path, (None,))[0] != stamp:
        try:
            history = read_checkpoint(path, "")["history"]
        except Exception:  # noqa: BLE001 (a checkpoint being replaced: read it at the next look)
            return _SEEN.get(path, (None, []))[1]
        _SEEN[path] = (stamp, [e["test_accuracy"] for e in history])
    return _SEEN[path][1]


def softmax_curve(curves: dict, seeds) -> list[float]:
    """The softmax ViT's mean test accuracy per epoch, over the epochs every seed has finished."""
    done = [curves.get(("softmax", s), []) for s in seeds]
    return [sum(c[e] for c in done) / len(done) for e in range(min(map(len, done), default=0))]


def stop_epoch(curve: list[float], patience: int, max_epochs: int):
    """Where the main arms stop, and why: the plateau rule's epoch, or ``max_epochs``; (None, None) while
    neither is reached."""
    from probe.vit.loop import plateau_epoch

    plateau = plateau_epoch(curve, patience)
    if plateau is not None:
        return plateau, "plateau"
    return (max_epochs, "max_epochs") if len(curve) >= max_epochs else (None, None)


def _stop(processes: dict) -> dict:
    codes = {}
    for process, _ in processes.values():
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for key, (process, log_file) in processes.items():
        try:
            codes[key] = process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            codes[key] = process.wait()
        log_file.close()
    return codes


def _popen(args, runs: Path, attention: str, seed: int, epochs: int):
    log_file = open(runs / f"{attention}-seed{seed}.log", "a", encoding="utf-8")
    process = subprocess.Popen(
        _train_command(args, attention, seed, epochs, runs), cwd=ROOT, stdout=log_file, stderr=log_file,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        start_new_session=True)
    return process, log_file


def train_until_plateau(args, runs: Path, seeds, log: Log, deadline: float) -> dict:
    """The main arms' runs side by side, each trained toward ``args.max_epochs``, watched epoch by epoch: they stop
    when the softmax ViT's mean test accuracy has plateaued (:func:`stop_epoch`) and every run has reached that
    epoch, or at ``deadline``.  Every run's results are then written at its last finished epoch (the same
    command with ``--epochs`` set to it), so that the report compares them at the epoch they all reached."""
    keys = [(a, s) for a in MAIN_ARMS for s in seeds]
    processes = {key: _popen(args, runs, *key, args.max_epochs) for key in keys}
    start, stopped_by, target, curves, codes = time.monotonic(), "deadline", None, {}, {}
    first_epoch_s, reported = None, 0
    while processes:
        time.sleep(2.0)
        curves = {key: _run_epochs(runs, *key) for key in keys}
        least = min(len(c) for c in curves.values())
        if least >= 1 and first_epoch_s is None:
            first_epoch_s = time.monotonic() - start
            fit = int((deadline - time.monotonic() - FINALISE_S) // first_epoch_s) + 1
            log(f"vit: every main run finished epoch 1 after {first_epoch_s:.0f} s; about {fit} epochs fit the budget"
                f" (at least {args.min_epochs} wanted, or the plateau rule)")
        if least > reported:
            reported = least
            curve = softmax_curve(curves, seeds)
            log(f"vit: epoch {least} done by every main run ({time.monotonic() - start:.0f} s); softmax mean test "
                f"accuracy per epoch {[round(x, 4) for x in curve]}")
        target, why = stop_epoch(softmax_curve(curves, seeds), args.patience, args.max_epochs)
        for key, (process, log_file) in list(processes.items()):
            if process.poll() is not None:
                codes[key] = process.returncode
                log_file.close()
                del processes[key]
        if target is not None and least >= target:
            stopped_by = why
            log(f"vit: stopping the main runs at epoch {least} ({why}: epoch {target})")
            codes.update(_stop(processes))
            processes = {}
        elif processes and time.monotonic() > deadline - FINALISE_S:
            log(f"vit: stopping the main runs at the budget's end (every run has {least} epochs or more)")
            codes.update(_stop(processes))
            processes = {}
    curves = {key: _run_epochs(runs, *key) for key in keys}
    # every run's results.json at its last finished epoch: the same command with --epochs set to it
    finalising = {key: _popen(args, runs, *key, len(c)) for key, c in curves.items()
                  if c and _epochs_done(runs, *key) != len(c)}
    for process, _ in finalising.values():
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 10.0))
        except subprocess.TimeoutExpired:
            pass
    _stop(finalising)
    failed = {f"{a}-seed{s}": c for (a, s), c in codes.items() if c not in (0, -signal.SIGTERM) and not curves.get((a, s))}
    return {"stopped_by": stopped_by, "stop_epoch": target, "first_epoch_s": first_epoch_s,
            "seconds": time.monotonic() - start, "softmax_mean_curve": softmax_curve(curves, seeds),
            "epochs_done": {f"{a}-seed{s}": len(c) for (a, s), c in curves.items()}, "failed": failed}


def stopped_by_words(vit: dict) -> str:
    """Why the runs stopped where they did, in the report's words."""
    curve, patience = vit["softmax_mean_curve"], vit["patience"]
    if vit["stopped_by"] == "plateau":
        best = max(range(vit["stop_epoch"]), key=lambda e: (curve[e], -e)) + 1
        return (f"the plateau rule, the softmax ViT's mean test accuracy over the seeds not improved for {patience} "
                f"epochs after its best, {curve[best - 1]:.4f} at epoch {best}")
    if vit["stopped_by"] == "max_epochs":
        return f"the cap of {vit['max_epochs']} epochs, the softmax ViT still improving"
    wanted = "" if vit["epochs_compared"] >= vit["min_epochs"] else f", fewer than the {vit['min_epochs']} wanted"
    return f"the call's time ran out with the softmax ViT still improving (the plateau rule had not stopped it){wanted}"


def calibrate_precision(args, log: Log, steps: int = 40) -> dict:
    """Training steps per second of the softmax ViT in float32 and in bfloat16 on this device (the resident loop
    in this process, ``steps`` steps of batch 128 after as many to warm up): which precision the runs take with
    ``--vit-precision auto``.  In a run whose steps are bound by kernel launches, autocast's extra casts can cost
    more than its faster matrix products save."""
    import torch

    from probe.vit.data import load_data
    from probe.vit.loop import Resident, plan_epoch, train_epoch
    from probe.vit.model import ViT, ViTConfig

    data = load_data("fashion-mnist", args.data_dir)
    device = torch.device(args.device)
    size = dict(dim=32, depth=2, heads=2, head_dim=16, mlp_dim=64) if args.quick else {}
    steps = 4 if args.quick else steps
    n = 128 * steps
    resident = Resident(data, torch.arange(n), torch.arange(128), device)
    plan = plan_epoch(0, 0, n, 128, None, device)
    rates = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = ViT(ViTConfig(**size)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
        train_epoch(model, model, optimizer, resident, plan, precision=precision)  # warm-up
        _sync(args.device)
        start = time.perf_counter()
        train_epoch(model, model, optimizer, resident, plan, precision=precision)
        _sync(args.device)
        rates[precision] = steps / (time.perf_counter() - start)
    chosen = max(rates, key=rates.get)
    log(f"vit: softmax ViT training steps/s in this process: fp32 {rates['fp32']:.1f}, bf16 {rates['bf16']:.1f}")
    return {"steps_per_s": rates, "faster": chosen}


def part_vit(args, log: Log, workdir: Path, deadline: float) -> dict:
    """Softmax and OT first (:func:`train_until_plateau`); then Sinkhorn and exact to the same epoch if the
    budget's rest allows it at the main arms' pace (exact at twice their time per epoch); then the report."""
    args.min_epochs, args.patience, args.max_epochs = (MIN_EPOCHS, PATIENCE, MAX_EPOCHS) if not args.quick else (2, 1, 4)
    seeds = SEEDS[:1] if args.quick else SEEDS
    runs = workdir / "vit"
    runs.mkdir(parents=True, exist_ok=True)
    calibration = calibrate_precision(args, log)
    if args.vit_precision == "auto":
        args.vit_precision = calibration["faster"]
    log(f"vit: softmax and ot x {len(seeds)} seeds side by side, precision {args.vit_precision}, toward "
        f"{args.max_epochs} epochs or the plateau rule (patience {args.patience})")
    main = train_until_plateau(args, runs, seeds, log, deadline)
    done = {f"{a}-seed{s}": _epochs_done(runs, a, s) for a in MAIN_ARMS for s in seeds}
    common = min(done.values(), default=0)
    log(f"vit: main runs' results at epochs {done}; compared at {common}")
    others, extra = [a for a in vit_attentions() if a not in MAIN_ARMS], {}
    per_epoch = main["seconds"] / max(common, 1)
    for attention in others:
        needed = per_epoch * common * (2.0 if attention == "exact" else 1.0)
        left = deadline - time.monotonic() - FINALISE_S
        if not common or needed > left:
            extra[attention] = f"left out: needs about {needed:.0f} s at the main arms' pace, {max(left, 0):.0f} s left"
            log(f"vit: {attention} {extra[attention]}")
            continue
        codes, _ = _launch_all(args, runs, common, seeds, (attention,), log, deadline - FINALISE_S)
        extra[attention] = "done" if all(_epochs_done(runs, attention, s) == common for s in seeds) else \
            f"stopped before epoch {common} (exit codes {sorted(codes.values())})"
        log(f"vit: {attention}: {extra[attention]}")
    compared = [a for a in vit_attentions() if all(_epochs_done(runs, a, s) >= common for s in seeds)] if common else []
    result = {"attentions": list(vit_attentions()), "compared": compared, "seeds": list(seeds),
              "precision": args.vit_precision, "calibration": calibration, "min_epochs": args.min_epochs, "patience": args.patience,
              "max_epochs": args.max_epochs, **main, "results_epochs": done, "epochs_compared": common,
              "other_arms": extra, "left_out": [a for a in vit_attentions() if a not in compared]}
    if not common or "softmax" not in compared:
        return {**result, "report_exit_code": None}
    report_dir = Path(args.out) / "vit"
    report_dir.mkdir(parents=True, exist_ok=True)
    report = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "vit_experiment.py"), "--report-only", "--runs-dir", str(runs),
         "--report-dir", str(report_dir), "--attentions", *compared, "--seeds", *map(str, seeds),
         "--epochs", str(common), "--keep-checkpoint", "", "--jobs", str(len(MAIN_ARMS) * len(seeds)),
         "--machine", f"{args.device_name} ({args.device}), softmax and OT runs side by side, a process each, "
                      f"precision {args.vit_precision}", "--stopped-by", stopped_by_words(result)]
        + (["--data-dir", str(args.data_dir)] if args.data_dir else []),
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if report.returncode != 0:
        log(f"vit: the report failed: {report.stderr[-1500:]}")
    return {**result, "report_exit_code": report.returncode}


# --------------------------------------------------------------------------------------------------
# results


#: the parts of a call, in order (each a key of results_gpu.json)
