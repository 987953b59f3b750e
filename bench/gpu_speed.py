"""Part 3 of the GPU check (bench/gpu.py): the analysis against the plain forward on the GPU, with ``--keep rows``
and ``--keep aggregates``; the solver's rows per second on the GPU against the CPU; peak GPU memory; and a
``torch.profiler`` summary of one batch: the share of its wall time the device is busy, and the host's waits
(module docstring of bench/gpu.py)."""

from __future__ import annotations

import dataclasses
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
            kept = analysis_seconds(run(dataclasses.replace(config, keep="aggregates", name=f"{config.name}-agg")))
        except torch.cuda.OutOfMemoryError as error:  # what batch 64 needs is part of what this measures
            log(f"speed {length} tokens, batch {batch}: out of GPU memory ({str(error).splitlines()[0]})")
            out["ratio"].append({"tokens": length, "skipped": f"out of GPU memory at batch {batch}"})
            torch.cuda.empty_cache()
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else None
        entry = {"model": "bert-base-shape", "tokens": length, "texts": count, "batch_size": batch,
                 "forward_s": forward, **measured, "ratio": measured["seconds"] / forward,
                 "aggregates_s": kept["seconds"], "aggregates_ratio": kept["seconds"] / forward,
                 "aggregates_not_converged": kept["not_converged"]}
        out["ratio"].append(entry)
        out["memory"].append({"tokens": length, "batch_size": batch, "peak_gpu_memory_gib": peak})
        log(f"speed {length} tokens, batch {batch}: analysis {measured['seconds']:.2f} s against forward "
            f"{forward:.3f} s = {entry['ratio']:.1f}x (--keep aggregates {entry['aggregates_ratio']:.1f}x); "
            f"{measured['rows']:,} rows"
            + (f"; peak GPU memory {peak:.2f} GiB" if peak is not None else ""))
    if time.monotonic() < deadline:
        out["profile"] = profile_batch(loaded, models["bert-base-shape"], workdir, args)
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


#: the host's waits for the device, as the profiler names them
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
         "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def profile_batch(loaded, model: str, workdir: Path, args) -> dict:
    """One batch of the analysis (128 tokens, its capture, solves, derived quantities and rows) under
    ``torch.profiler``: its wall time, the device's busy time (the sum of its kernels' times; on a CPU dry run,
    none), the host's waits (the calls of :data:`WAITS`: count and time) and the operators taking most time."""
    from torch.profiler import ProfilerActivity, profile

    from probe.batch.columns import RowContext
    from probe.batch.rows import process_batch
    from probe.batch.summary import Summary
    from probe.capture.selection import resolve

    length, batch = (16, 4) if args.quick else (128, 64)
    data = data_file(workdir, model, length, batch)
    config = run_config(model, data, length, device=args.device, dtype="float32", batch_size=batch,
                        out=workdir / "profile")
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()][:batch]
    inputs = {k: v.to(args.device) for k, v in loaded.adapter.encode(loaded.tokenizer, texts, None, length).items()}
    context = RowContext(example_ids=list(range(len(texts))), special_ids=frozenset(loaded.tokenizer.all_special_ids),
                         token_text={}, tokenizer=loaded.tokenizer)
    config = dataclasses.replace(config, spaces=("hidden",), fidelity_tolerance=1e-5)
    selection = resolve(config, loaded.adapter.stacks(loaded.model.config))

    def one_batch():
        process_batch(loaded, inputs, context.example_ids, config, Summary(1e-5), context,
                      selection=selection)()

    one_batch()  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    _sync(args.device)
    started = time.perf_counter()
    with profile(activities=activities) as profiler:
        one_batch()
        _sync(args.device)
    wall = time.perf_counter() - started
    events = profiler.key_averages()
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]  # the device's own events
    device_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
                    for e in kernels)
    waits = {e.key: {"count": e.count, "host_ms": e.cpu_time_total / 1e3} for e in events if e.key in WAITS}
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {"tokens": length, "texts": len(texts), "wall_s": wall, "device_busy_s": device_us / 1e6,
            "device_busy_share": device_us / 1e6 / wall if wall else None, "host_waits": waits,
            "top_host_ops": [{"op": e.key, "count": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in top]}
