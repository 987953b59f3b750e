"""The GPU check: one prepared command that proves the solver on a real GPU and runs the
OT-ViT comparison at the paper's full protocol, within one call of the lent machine.

What it runs, in order, each part within its share of ``--budget-s`` (default 480 s: the call's 9 minutes
less installation and the copy back), each writing what it measured before the next starts:

1. **device tests**: the test files whose tests run on CUDA when torch sees a GPU (:data:`DEVICE_TESTS`).
2. **agreement**: the same run on the GPU and on the CPU, compared row by row.
   *a. whole runs*: a random model of bert-base's shape and one of t5-small's shape, built from their
   configs, at 128 and 512 tokens, in float64 on both devices (so the two forwards differ by rounding
   alone).  For every row (the row key: space, alpha, type, layer, head, example, query) the difference of
   ``rel_deviation`` is compared with what the two certificates allow,
   ``(e_cpu + e_gpu)(1 + rel) / ||lambda*||`` (``e``: each row's certified ``error_bound`` on
   ``||lambda - lambda*||``), as ``probe verify`` does.  The two forwards' own difference shows in
   ``evidence_norm`` (computed from the inputs alone) and is reported beside it.
   *b. one solver, the same problems*: problems captured once (bert-base shape, 128 tokens, float64),
   solved on the CPU and on the GPU: here the two sides solve identical problems, so the certificates
   alone bound the difference.
3. **speed**: the analysis against the plain forward pass on the GPU at 128 and 512 tokens (analysis:
   the run's ``total_s - load_model_s - load_data_s``, as bench/e2e.py times it; forward: the model's own
   eager forward over the same batches), the solver's rows per second on the GPU against the CPU (the
   problems of 2b, in one process), and peak GPU memory at batch 64.
4. **a large model**: a Llama-3-8B-shaped model from its config on 8 texts of 4,096 tokens with
   ``--queries sample:64``: the analysis against its forward, peak device memory, every row certified
   (bench/gpu_large.py).
5. **OT-ViT, full protocol**: ``probe vit train`` (the device-resident loop; ``--precision`` the faster of
   fp32 and bf16 in a short measurement on the device first, :func:`calibrate_precision`) on all 60,000 training and 10,000 test images, seeds 0, 1, 2.  First
   the paper's two arms, softmax and OT, each run a process of its own, side by side, trained toward
   :data:`MAX_EPOCHS` and watched epoch by epoch through their checkpoints: they stop once the softmax ViT's
   mean test accuracy over the seeds has not improved for :data:`PATIENCE` epochs (``probe.vit.loop.plateau_epoch``;
   at least :data:`MIN_EPOCHS` are wanted) and every run has reached that epoch, or when the budget runs out;
   every run's results are then written at its last finished epoch.  Then Sinkhorn and exact, to the same
   epoch, if the rest of the budget allows it at the main arms' pace.  The report comes from
   ``scripts/vit_experiment.py --report-only`` over these runs, compared at the epoch every run reached, with
   why the runs stopped (``--stopped-by``).

Everything goes to ``--out`` (on the lent machine: ``$OUT``): ``results_gpu.json`` / ``.md``,
``vit/results.json`` / ``.md`` and ``log.txt``.  ``--collect DIR`` (here, after the call) copies them to
``bench/results_gpu.{json,md}`` and ``reports/vit/results-full.{json,md}``.

    bash scripts/gpu_prepare.sh                          # here: wheels and data into .gpu/ (git-ignored)
    # one device call:  carry [".gpu"], command: bash scripts/gpu_check.sh
    python bench/gpu.py --collect /work/.device/...      # here: the results into the repository
    python bench/gpu.py --device cpu --quick --out DIR   # the CPU dry run (tests/project/test_gpu_check.py)

The CPU dry run runs every part on tiny models, a few images and one epoch, so that the script is known to
work before a GPU is lent; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from gpu_agreement import part_agreement  # noqa: E402
from gpu_large import part_large  # noqa: E402
from gpu_report import markdown  # noqa: E402
from gpu_runs import Log, _write_json, build_models, environment, part_tests  # noqa: E402
from gpu_speed import part_speed  # noqa: E402
from gpu_vit import part_vit  # noqa: E402

#: the part shares of the budget (the ViT part takes what the others leave)
SHARES = {"tests": 0.10, "agreement": 0.18, "speed": 0.22, "large": 0.40}
#: seconds kept back at the end for the ViT report and writing the results
RESERVE_S = 25.0


# --------------------------------------------------------------------------------------------------
# small helpers


# --------------------------------------------------------------------------------------------------
# models and texts


# --------------------------------------------------------------------------------------------------
# 1. device tests


# --------------------------------------------------------------------------------------------------
# 2. agreement


# --------------------------------------------------------------------------------------------------
# 3. speed


PARTS = ("tests", "agreement", "speed", "large", "vit")


def merge_calls(calls: list[dict]) -> dict:
    """One results dict from the results of several calls of the machine, oldest first: a part that a later
    call ran replaces the earlier call's (a second call reruns what the first could not finish); ``calls``
    says which call ran which part."""
    merged = dict(calls[0])
    merged["calls"] = []
    for number, results in enumerate(calls, 1):
        ran = [part for part in PARTS if part in results]
        merged.update({part: results[part] for part in ran})
        merged["calls"].append({"call": number, "date": results["environment"]["date"],
                                "device_name": results["environment"]["device_name"], "parts": ran,
                                "budget_s": results.get("budget_s"), "seconds": results.get("seconds")})
    merged["seconds"] = sum(c["seconds"] or 0.0 for c in merged["calls"])
    return merged


def collect(sources: list[Path]) -> None:
    """Copy the results of one or more GPU calls (oldest first) into the repository: bench/results_gpu.{json,md}
    from their merged results (:func:`merge_calls`), reports/vit/results-full.{json,md} from the newest call that
    has them."""
    found = [s for s in sources if (s / "results_gpu.json").exists()]
    for source in sources:
        if source not in found:
            print(f"missing: {source / 'results_gpu.json'}")
    if not found:
        return
    results = merge_calls([json.loads((s / "results_gpu.json").read_text()) for s in found])
    if len({c["device_name"] for c in results["calls"]}) > 1:
        raise SystemExit("Error: these calls ran on different devices; collect one device's calls at a time.")
    _write_json(HERE / "results_gpu.json", results)
    (HERE / "results_gpu.md").write_text(markdown(results))
    print(f"{', '.join(map(str, found))} -> bench/results_gpu.json, bench/results_gpu.md")
    vit = next((s / "vit" for s in reversed(found) if (s / "vit" / "results.json").exists()), None)
    if vit is None:
        print("no vit/results.json in these calls")
        return
    for name, target in (("results.json", "results-full.json"), ("results.md", "results-full.md")):
        shutil.copyfile(vit / name, ROOT / "reports" / "vit" / target)
        print(f"{vit / name} -> reports/vit/{target}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the results (on the lent machine: $OUT)")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu (the dry run)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few texts and images, one epoch")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all four parts together")
    parser.add_argument("--data-dir", type=Path, default=None, help="Fashion-MNIST's idx files")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: OUT/../gpu-work)")
    parser.add_argument("--vit-precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="the ViT runs' --precision; auto: the faster on this device (calibrate_precision)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: tests,agreement,speed,large,vit")
    parser.add_argument("--collect", type=Path, nargs="+", default=None, metavar="DIR",
                        help="copy the results of one or more calls (oldest first) into the repository")
    args = parser.parse_args(argv)
    if args.collect:
        collect(args.collect)
        return 0
    if args.out is None:
        parser.error("--out is required")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("Error: --device cuda, but torch sees no CUDA device here. Use --device cpu for the dry run.",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / "probe-gpu-work"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    log = Log(args.out / "log.txt")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    results = {"benchmark": "gpu", "environment": environment(args.device), "quick": args.quick,
               "budget_s": args.budget_s}
    path = args.out / "results_gpu.json"
    _write_json(path, results)
    args.device_name = results["environment"]["device_name"]
    log(f"device: {args.device_name}")
    start = time.monotonic()

    def deadline(share: float) -> float:
        return time.monotonic() + share * args.budget_s

    def part(name: str, measure) -> None:
        """One part, its results written before the next starts; a part that fails is recorded (its
        traceback's end) and the next one runs: the call's few minutes are not lost to one error."""
        try:
            results[name] = measure()
        except Exception as error:  # noqa: BLE001 (whatever broke, the other parts still run)
            import traceback

            log(f"{name}: FAILED: {type(error).__name__}: {error}")
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()[-3000:]}
        _write_json(path, results)

    if "tests" not in skip:
        part("tests", lambda: part_tests(args, log, SHARES["tests"] * args.budget_s))
    models = build_models(workdir / "models", args.quick) if {"agreement", "speed"} - skip else {}
    if "agreement" not in skip:
        part("agreement", lambda: part_agreement(args, log, models, workdir, deadline(SHARES["agreement"])))
    if "speed" not in skip:
        part("speed", lambda: part_speed(args, log, models, workdir, deadline(SHARES["speed"])))
    if "large" not in skip:
        part("large", lambda: part_large(args, log, workdir, deadline(SHARES["large"])))
    if "vit" not in skip:
        part("vit", lambda: part_vit(args, log, workdir, start + args.budget_s - RESERVE_S))
    results["seconds"] = time.monotonic() - start
    _write_json(path, results)
    (args.out / "results_gpu.md").write_text(markdown(results))
    log(f"done in {results['seconds']:.0f} s: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
