"""Part 3 of the GPU check (bench/gpu.py): the analysis against the plain forward on the GPU, the solver's rows
per second on the GPU against the CPU, and peak GPU memory (module docstring of bench/gpu.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from gpu_agreement import captured_problems, solve_all
from gpu_runs import LENGTHS, Log, _sync, data_file, run_config


def forward_seconds(loaded, config, device: str, repeats: int = 2) -> float:
    """The plain eager forward over the run's batches (tokenised beforehand), best of ``repeats``."""
    import torch

    from probe.capture.data import load_texts
    from probe.pipeline.job import plan_batches

    source = load_texts(config.dataset)
    batches, _ = plan_batches(loaded, source, config.batch_size, config.max_length)
    encoded = []
    for batch in batches:
        targets = [source.targets[i] for i in batch] if source.targets else None
        inputs = loaded.adapter.encode(loaded.tokenizer, [source.texts[i] for i in batch], targets, config.max_length)
        encoded.append({k: v.to(device) for k, v in inputs.items()})
    best = math.inf
    with torch.no_grad():
        loaded.model(**encoded[0])  # warm-up
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for inputs in encoded:
                loaded.model(**inputs)
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return best



def analysis_seconds(run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    timings, solver = manifest["timings_s"], manifest["solver"]
    return {"seconds": timings["total_s"] - timings.get("load_model_s", 0.0) - timings.get("load_data_s", 0.0),
            "rows": solver["rows"], "not_converged": solver["not_converged"],
            "max_relative_error_bound": solver["max_relative_error_bound"]}



def part_speed(args, log: Log, models: dict, workdir: Path, deadline: float) -> dict:
    import torch

    from probe.capture.loading import load_model
    from probe.pipeline.runner import run

    lengths = (16,) if args.quick else LENGTHS
    batch = 4 if args.quick else 64
    model = models["bert-base-shape"]
    out = {"ratio": [], "solver": None, "memory": []}
    loaded = load_model(model, device=args.device)
    for length in lengths:
        if time.monotonic() > deadline:
            out["ratio"].append({"tokens": length, "skipped": "out of this part's time"})
            continue
        count = batch * (2 if length <= 128 and not args.quick else 1)
        data = data_file(workdir, model, length, count)
        config = run_config(model, data, length, device=args.device, dtype="float32", batch_size=batch,
                            out=workdir / "speed")
        try:
            forward = forward_seconds(loaded, config, args.device)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            measured = analysis_seconds(run(config))
        except torch.cuda.OutOfMemoryError as error:  # what batch 64 needs is part of what this measures
            log(f"speed {length} tokens, batch {batch}: out of GPU memory ({str(error).splitlines()[0]})")
            out["ratio"].append({"tokens": length, "skipped": f"out of GPU memory at batch {batch}"})
            torch.cuda.empty_cache()
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
        entry = {"model": "bert-base-shape", "tokens": length, "texts": count, "batch_size": batch,
                 "forward_s": forward, **measured, "ratio": measured["seconds"] / forward}
        out["ratio"].append(entry)
        out["memory"].append({"tokens": length, "batch_size": batch, "peak_gpu_memory_gib": peak})
        log(f"speed {length} tokens, batch {batch}: analysis {measured['seconds']:.2f} s against forward "
            f"{forward:.3f} s = {entry['ratio']:.1f}x; {measured['rows']:,} rows"
            + (f"; peak GPU memory {peak:.2f} GiB" if peak is not None else ""))
    del loaded
    out["solver"] = {"per_tokens": {}}
    for length in lengths:  # the same captured problems on the device and on this machine's CPU
        if time.monotonic() > deadline:
            out["solver"]["per_tokens"][str(length)] = {"skipped": "out of this part's time"}
            continue
        texts = 4 if args.quick else (8 if length <= 128 else 2)
        calls = captured_problems(model, length, texts, "cpu", "float64", args.quick)
        rows = sum(int(torch.isfinite(p.log_preference).any(-1).sum()) for p in calls)
        timings = {}
        for device in (args.device, "cpu"):
            solve_all(calls[:1], device)  # warm-up
            _sync(device)
            start = time.perf_counter()
            solve_all(calls, device)
            _sync(device)
            timings[device] = time.perf_counter() - start
        entry = {"rows": rows, "texts": texts, "gpu_s": timings[args.device], "cpu_s": timings["cpu"],
                 "gpu_rows_per_s": rows / timings[args.device], "cpu_rows_per_s": rows / timings["cpu"],
                 "gpu_over_cpu": timings["cpu"] / timings[args.device], "cpu_threads": torch.get_num_threads()}
        out["solver"]["per_tokens"][str(length)] = entry
        log(f"solver, {length} tokens: {entry['gpu_rows_per_s']:,.0f} rows/s on {args.device}, "
            f"{entry['cpu_rows_per_s']:,.0f} on the CPU ({torch.get_num_threads()} threads): {entry['gpu_over_cpu']:.1f}x")
    first = out["solver"]["per_tokens"].get(str(lengths[0]), {})
    if "rows" in first:  # the shortest length's figures also at the top, where earlier results had them
        out["solver"].update({k: v for k, v in first.items() if k != "texts"})
    return out
