"""ViT training steps on the CPU, the previous step-by-step loop against the device-resident loop
(probe/vit/loop.py): host syncs per step, steps per second, and what a GPU's arithmetic allows.

* **Host syncs per training step** (torch.profiler, CPU): the ops through which the host reads a tensor
  (``aten::_local_scalar_dense``, which every ``.item()``, ``float()``, ``int()`` and ``bool()`` of a tensor
  ends in, and ``aten::nonzero``, which reads its count), outside Adam's step (its step counter lives on the
  host, for a CUDA Adam too: no device sync).  Counted over whole runs of ``S`` and ``2S`` steps with the same
  evaluation and the per-epoch gap measurement left out; the difference divided by ``S`` is the count per
  step.  A small model (the counts do not depend on its size); the exact-ViT's solver reads its convergence
  back by design and is counted on the new loop's steps alone.
* **Steps per second** of the paper-size model (3.2M parameters, batch 128, Fashion-MNIST), the two loops
  alternating in one process (``--repeats`` times, the best of each), on ``--threads`` threads; the training
  time of one epoch of ``--steps`` steps (``train_s``: the new loop's includes drawing the epoch's plan).  The
  two loops' losses are compared bit for bit on the way.
* **The arithmetic of a step** (``torch.utils.flop_counter``, forward and backward of the paper-size model at
  batch 128) against the H100's published peaks, and the previous GPU call's measured seconds per step
  (``reports/vit/results-full.json``).

    PYTHONPATH=. python bench/vit_steps.py            # a few minutes: bench/results_vit_steps.json and .md
    PYTHONPATH=. python bench/vit_steps.py --quick    # a tiny model, seconds (tests/project/test_bench.py)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import common  # noqa: E402

#: the ops through which the host reads a tensor (a sync on a GPU)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
#: NVIDIA's published dense peaks of the H100 SXM (TFLOP/s): FP32 on the CUDA cores, TF32 and BF16 on the
#: tensor cores (the datasheet's figures without sparsity)
H100_PEAK_TFLOPS = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}
SMALL = dict(dim=32, depth=2, heads=2, head_dim=16, mlp_dim=64)


def syncs(profile) -> int:
    count = 0
    for event in profile.events():
        if event.name in SYNC_OPS:
            parent, inside = event.cpu_parent, False
            while parent is not None:
                inside = inside or parent.name.startswith("Optimizer.step")
                parent = parent.cpu_parent
            count += not inside
    return count


def run(module, attention: str, steps: int, batch: int, out: Path, *, threads: int, model: dict, gap: bool = True):
    """One epoch of ``steps`` steps with ``module``'s train (probe.vit.train, or the previous loop)."""
    settings = module.TrainSettings(attention=attention, epochs=1, batch_size=batch, train_subset=steps * batch,
                                    test_subset=batch, threads=threads, progress=False, out=str(out), **model)
    if gap:
        return module.train(settings)
    original = module.final_layer_gap
    module.final_layer_gap = lambda model, images: {"kl": {"tv_median": float("nan")}}
    try:
        return module.train(settings)
    finally:
        module.final_layer_gap = original


def syncs_per_step(module, attention: str, work: Path, steps: int) -> float:
    import torch

    counts = []
    for s in (steps, 2 * steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run(module, attention, s, 32, work / f"{module.__name__}-{attention}-{s}", threads=1, model=SMALL,
                gap=False)
        counts.append(syncs(profile))
    return (counts[1] - counts[0]) / steps


def exact_syncs_per_step(steps: int) -> float:
    """The new loop's training steps alone (train_epoch), exact-ViT: its solver's reads."""
    import torch

    from probe.vit.data import load_data
    from probe.vit.loop import Resident, plan_epoch, train_epoch
    from probe.vit.model import ViT, ViTConfig

    data = load_data("fashion-mnist")
    torch.manual_seed(0)
    model = ViT(ViTConfig(attention="exact", **SMALL))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    resident = Resident(data, torch.arange(steps * 32), torch.arange(32), "cpu")
    plan = plan_epoch(0, 0, steps * 32, 32, None, torch.device("cpu"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train_epoch(model, model, optimizer, resident, plan, exact=model.blocks[-1].attn)
    return (syncs(profile) - 2) / steps  # less the epoch's two reads of the loss and the correct predictions


def flops_per_step(batch: int, attention: str) -> float:
    """Forward and backward of the paper-size model on one batch (torch's flop counter: matmuls and
    convolutions, the arithmetic that dominates)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from probe.vit.model import ViT, ViTConfig

    torch.manual_seed(0)
    model = ViT(ViTConfig(attention=attention))
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return float(counter.get_total_flops())


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_vit_steps.json", quick="a tiny model and 2 steps: seconds")
    parser.add_argument("--steps", type=int, default=4, help="steps per timed epoch [default: 4]")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per loop and arm [default: 3]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads [default: 1, the machine is shared]")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    import torch

    import probe.vit.train as now_module
    from tests.support import previous_vit_train as before_module

    steps, repeats = (2, 1) if args.quick else (args.steps, args.repeats)
    model = SMALL if args.quick else {}
    arms = ("softmax", "ot")
    torch.set_num_threads(args.threads)
    results = {"environment": common.environment(), "threads": args.threads, "quick": args.quick, "batch_size": 128, "steps_per_epoch_timed": steps, "repeats": repeats,
               "model": "a small model" if args.quick else "the paper-size model, 3,183,114 parameters"}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        results["syncs_per_step"] = {
            attention: {"before": syncs_per_step(before_module, attention, work, 2),
                        "after": syncs_per_step(now_module, attention, work, 2)}
            for attention in ("softmax", "ot", "sinkhorn")}
        results["syncs_per_step"]["exact"] = {"before": None, "after": exact_syncs_per_step(2)}
        timing = {}
        for attention in arms:
            best = {"before": float("inf"), "after": float("inf")}
            losses = {}
            for repeat in range(repeats):
                for label, module in (("before", before_module), ("after", now_module)):
                    r = run(module, attention, steps, 128, work / f"t-{label}-{attention}-{repeat}",
                            threads=args.threads, model=model, gap=False)
                    best[label] = min(best[label], r["learning_curve"][0]["train_s"])
                    losses[label] = r["learning_curve"][0]["train_loss"]
            timing[attention] = {"before_steps_per_s": steps / best["before"], "after_steps_per_s": steps / best["after"],
                                 "after_over_before": best["before"] / best["after"],
                                 "same_train_loss": losses["before"] == losses["after"]}
        results["steps_per_s"] = timing
    flops = {a: flops_per_step(128, a) for a in arms}
    previous = json.loads((ROOT / "reports" / "vit" / "results-full.json").read_text())
    gpu_before = {a: previous["summary"][a]["mean_train_s_per_step"] for a in arms}
    results["gpu"] = {
        "flops_per_step": flops,
        "gflop_per_image": {a: f / 128 / 1e9 for a, f in flops.items()},
        "h100_peak_tflops": H100_PEAK_TFLOPS,
        "steps_per_s_at_peak": {a: {k: v * 1e12 / flops[a] for k, v in H100_PEAK_TFLOPS.items()} for a in arms},
        "previous_call_s_per_step": gpu_before,
        "previous_call_parallel_runs": previous["protocol"].get("parallel_runs"),
        "previous_call_machine": previous["protocol"].get("machine"),
    }
    common.write_results(args.out, results, markdown, benchmark="vit_steps")
    return 0


def markdown(r: dict) -> str:
    lines = ["# ViT training steps: the previous loop against the device-resident loop", "",
             common.header(r) + f" {r['threads']} torch thread(s). Nothing here is typed by hand.", ""]
    if r["quick"]:
        lines += ["**Quick mode**: a small model and 2 steps; the numbers show that the script works.", ""]
    lines += ["## Host syncs per training step (torch.profiler, CPU)", "",
              "| model | previous loop | resident loop |", "|---|---|---|"]
    for attention, c in r["syncs_per_step"].items():
        before = "not counted" if c["before"] is None else f"{c['before']:g}"
        lines.append(f"| {attention} | {before} | {c['after']:g} |")
    lines += ["", "The exact-ViT's count is its solver's: the Newton iterations read their convergence back.", "",
              f"## Steps per second on the CPU ({r['model']}, batch {r['batch_size']}, best of {r['repeats']} "
              f"epochs of {r['steps_per_epoch_timed']} steps)", "",
              "| model | previous loop | resident loop | resident / previous | same training loss, bit for bit |",
              "|---|---|---|---|---|"]
    for attention, t in r["steps_per_s"].items():
        lines.append(f"| {attention} | {t['before_steps_per_s']:.3f} | {t['after_steps_per_s']:.3f} | "
                     f"{t['after_over_before']:.2f}x | {'yes' if t['same_train_loss'] else 'NO'} |")
    g = r["gpu"]
    lines += ["", "## What a GPU's arithmetic allows (the paper-size model, batch 128)", "",
              "| model | GFLOP per image (forward + backward) | steps/s at the H100's FP32 peak | at TF32 | at BF16 | "
              "previous GPU call: s per step |", "|---|---|---|---|---|---|"]
    for a, f in g["gflop_per_image"].items():
        peak = g["steps_per_s_at_peak"][a]
        lines.append(f"| {a} | {f:.2f} | {peak['fp32']:,.0f} | {peak['tf32']:,.0f} | {peak['bf16']:,.0f} | "
                     f"{g['previous_call_s_per_step'][a]:.3f} |")
    lines += ["", f"Peaks: NVIDIA's H100 SXM datasheet, dense ({g['h100_peak_tflops']} TFLOP/s). The previous call "
              f"ran {g['previous_call_parallel_runs']} runs at a time ({g['previous_call_machine']}); its seconds "
              "per step are per run."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
