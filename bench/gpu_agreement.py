"""Part 2 of the GPU check (bench/gpu.py): the same run on the GPU and on the CPU compared row by row, and the
same captured problems solved on both (module docstring of bench/gpu.py)."""

from __future__ import annotations

import time
from pathlib import Path

from gpu_runs import LENGTHS, Log, data_file, read_rows, run_config, texts_of_length

#: what the two certificates allow beyond rounding (probe.pipeline.verify's SLACK)
SLACK = 1e-9



def compare_runs(gpu_dir: Path, cpu_dir: Path) -> dict:
    """Row-by-row comparison of two runs of the same settings (see the module's docstring)."""
    import numpy as np

    from probe.core.schema import ROW_KEY

    columns = list(ROW_KEY) + ["rel_deviation", "lambda_norm", "error_bound", "evidence_norm", "converged"]
    a, b = read_rows(gpu_dir, columns), read_rows(cpu_dir, columns)
    a["space"], b["space"] = a["space"].astype(str), b["space"].astype(str)
    a["attention_type"], b["attention_type"] = a["attention_type"].astype(str), b["attention_type"].astype(str)
    joined = a.merge(b, on=list(ROW_KEY), suffixes=("_gpu", "_cpu"), how="outer", indicator=True)
    unmatched = int((joined["_merge"] != "both").sum())
    both = joined[joined["_merge"] == "both"]
    lam = both[["lambda_norm_gpu", "lambda_norm_cpu"]].max(axis=1).to_numpy()
    rel = both[["rel_deviation_gpu", "rel_deviation_cpu"]].max(axis=1).to_numpy()
    difference = np.abs(both["rel_deviation_gpu"].to_numpy() - both["rel_deviation_cpu"].to_numpy())
    eps = both["error_bound_gpu"].to_numpy() + both["error_bound_cpu"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(lam > 0, eps * (1 + rel) / lam, 0.0) + SLACK
        ratio = difference / bound
        evidence = np.abs(both["evidence_norm_gpu"].to_numpy() - both["evidence_norm_cpu"].to_numpy()) / np.maximum(
            both["evidence_norm_cpu"].to_numpy(), 1e-300)
    finite = np.isfinite(ratio)
    worst = int(np.nanargmax(np.where(finite, ratio, -np.inf))) if finite.any() else None
    row = both.iloc[worst] if worst is not None else None
    return {
        "rows": int(len(both)),
        "rows_unmatched": unmatched,
        "not_converged_gpu": int((~both["converged_gpu"].astype(bool)).sum()),
        "not_converged_cpu": int((~both["converged_cpu"].astype(bool)).sum()),
        "max_difference": float(difference.max()) if len(difference) else 0.0,
        "max_difference_over_bound": float(ratio[finite].max()) if finite.any() else None,
        "rows_over_bound": int((ratio > 1).sum()),
        "max_relative_evidence_difference": float(np.nanmax(evidence)) if len(evidence) else 0.0,
        "worst_row": None if row is None else {k: (v.item() if hasattr(v, "item") else v)
                                               for k, v in row.drop("_merge").to_dict().items()},
    }



def captured_problems(model: str, length: int, count: int, device: str, dtype: str, quick: bool):
    """The dual problems of one batch of ``count`` texts of ``length`` tokens, as ``probe run`` builds them
    (every site of the batch, stacked into solver calls), on ``device``."""
    import torch

    from probe.batch.problems import site_problems, site_stacks, stacked_problems
    from probe.capture.loading import load_model

    loaded = load_model(model, device=device, dtype=dtype)
    texts = texts_of_length(loaded.tokenizer, length, count)
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, None, length)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        sites = loaded.adapter.sites(loaded.model, inputs)
        calls = [stacked_problems([site_problems(site, 1.0) for site in chunk]) for chunk in site_stacks(sites)]
    return calls



def _moved(problems, device: str):
    """The problems on ``device``; a preference shared by every row of a group (a stride-0 view) moves as
    one row per group and is expanded there, not on the host."""
    from dataclasses import fields, replace

    import torch

    from probe.solve.problems import shares_rows

    def move(tensor):
        if shares_rows(tensor):
            return tensor[:, :1].to(device).expand(tensor.shape)
        return tensor.to(device)

    return replace(problems, **{f.name: move(getattr(problems, f.name)) for f in fields(problems)
                                if isinstance(getattr(problems, f.name), torch.Tensor)})



def solve_all(calls, device: str, rtol: float = 1e-9):
    from probe.solve.dual import solve_dual

    return [solve_dual(_moved(p, device), rtol=rtol) for p in calls]



def compare_solutions(calls, gpu, cpu) -> dict:
    import torch

    ratios, diffs, rows, not_converged = [], [], 0, 0
    for problems, a, b in zip(calls, gpu, cpu):
        active = torch.isfinite(problems.log_preference).any(-1).cpu()
        if problems.active is not None:
            active &= problems.active.cpu()
        ra, rb = a.rel_deviation.cpu()[active], b.rel_deviation.cpu()[active]
        lam = torch.maximum(a.lambda_norm.cpu()[active], b.lambda_norm.cpu()[active])
        eps = a.error_bound.cpu()[active] + b.error_bound.cpu()[active]
        bound = torch.where(lam > 0, eps * (1 + torch.maximum(ra, rb)) / lam, torch.zeros_like(lam)) + SLACK
        diff = (ra - rb).abs()
        ratios.append(diff / bound)
        diffs.append(diff)
        rows += int(active.sum())
        not_converged += int((~a.converged.cpu()[active]).sum()) + int((~b.converged.cpu()[active]).sum())
    ratio, diff = torch.cat(ratios), torch.cat(diffs)
    return {"rows": rows, "not_converged": not_converged, "max_difference": float(diff.max()),
            "max_difference_over_bound": float(ratio.max()), "rows_over_bound": int((ratio > 1).sum())}



def part_agreement(args, log: Log, models: dict, workdir: Path, deadline: float) -> dict:
    from probe.pipeline.runner import run

    lengths = (16,) if args.quick else LENGTHS
    count = 2 if args.quick else 4
    out = {"runs": [], "same_problems": None}
    for name, model in models.items():
        for length in lengths:
            if time.monotonic() > deadline:
                out["runs"].append({"model": name, "tokens": length, "skipped": "out of this part's time"})
                continue
            data = data_file(workdir, model, length, count)
            dirs = {}
            for device in (args.device, "cpu"):
                config = run_config(model, data, length, device=device, dtype="float64", batch_size=count,
                                    out=workdir / "agreement")
                dirs[device] = run(config)
            result = {"model": name, "tokens": length, "texts": count, "dtype": "float64",
                      **compare_runs(dirs[args.device], dirs["cpu"])}
            log(f"agreement {name} {length} tokens: {result['rows']:,} rows, largest difference "
                f"{result['max_difference']:.2e} = {result['max_difference_over_bound']:.3g} of its bound "
                f"({result['rows_over_bound']} over); inputs differ by {result['max_relative_evidence_difference']:.1e}")
            out["runs"].append(result)
    model = models["bert-base-shape"]
    length = lengths[0] if args.quick else 128
    calls = captured_problems(model, length, count, "cpu", "float64", args.quick)
    gpu, cpu = solve_all(calls, args.device), solve_all(calls, "cpu")
    out["same_problems"] = {"model": "bert-base-shape", "tokens": length, "texts": count,
                            **compare_solutions(calls, gpu, cpu)}
    log(f"agreement, same problems: {out['same_problems']['rows']:,} rows, "
        f"{out['same_problems']['max_difference_over_bound']:.3g} of the bound at most")
    return out
