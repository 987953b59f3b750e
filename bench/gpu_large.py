"""Part 4 of the GPU check (bench/gpu.py): a large model at a long context.

A Llama-3-8B-shaped model built from its config on the device (random weights, seed 0, bfloat16: 32 layers,
32 query heads on 8 key-value heads, hidden 4,096, head width 128, intermediate 14,336; a byte-level BPE
tokenizer trained on the embedded corpus), on 8 texts of 4,096 tokens, measured in memory
(:func:`probe.callbacks.measure`, the model where it is) with ``--queries sample:64``: every layer and head,
64 sampled positions per text.  Recorded: the analysis against the plain eager forward of the same texts,
the peak device memory of each, the rows and whether every one is certified, and the fidelity.  Then, as time
allows, one text of 32,768 tokens under the model's fast attention (``attn_implementation="sdpa"``, batches of
one text, the same selection): its plain SDPA forward and the run, their seconds and peak device memory, the
rows and the fidelity (under SDPA the check compares the attention output).

The CPU dry run (``--quick``) runs the same code on a 2-layer model of that shape's proportions, 2 texts of
64 tokens and ``sample:8``, and one of 256 tokens under SDPA.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu_runs import Log, _sync
from runs import corpus_texts, llama_tokenizer_and_config

#: the Llama-3-8B shape (its config.json's numbers), and the dry run's
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, rope_theta=500000.0)
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=8)


def build(device: str, quick: bool, tokens: int):
    """The model on ``device`` (initialised there: no copy of 16 GB through the host) and its tokenizer."""
    import torch
    import transformers as T

    tokenizer, config = llama_tokenizer_and_config(QUICK_SHAPE if quick else SHAPE, tokens, vocab_size=4000)
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = T.AutoModel.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    return model, tokenizer


def forward_seconds(model, tokenizer, texts: list[str], tokens: int, device: str) -> float:
    """The plain eager forward of ``texts`` (one batch, cut to ``tokens``), after a warm-up."""
    import torch

    encoded = tokenizer(texts, truncation=True, max_length=tokens, return_tensors="pt")
    inputs = {key: value.to(device) for key, value in encoded.items()}
    with torch.no_grad():
        model(**inputs, use_cache=False)
        _sync(device)
        started = time.perf_counter()
        model(**inputs, use_cache=False)
        _sync(device)
    return time.perf_counter() - started


def part_large(args, log: Log, workdir: Path, deadline: float) -> dict:
    import torch

    from probe.callbacks import measure

    tokens, count, sample = (64, 2, 8) if args.quick else (4096, 8, 64)
    long_tokens = 256 if args.quick else 32768
    cuda = args.device.startswith("cuda")
    started = time.perf_counter()
    model, tokenizer = build(args.device, args.quick, long_tokens)
    built_s = time.perf_counter() - started
    texts = corpus_texts(tokenizer, tokens, count)
    parameters = sum(p.numel() for p in model.parameters())
    log(f"large: a Llama-3-8B-shaped model ({parameters / 1e9:.2f}B parameters) built on {args.device} in "
        f"{built_s:.0f} s; {count} texts of {tokens} tokens")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    forward = forward_seconds(model, tokenizer, texts, tokens, args.device)
    forward_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if time.monotonic() > deadline:
        return {"forward_s": forward, "skipped": "out of this part's time after the forward"}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    run = measure(model, tokenizer, texts, workdir / "large", name="llama-3-8b-shape", max_length=tokens,
                  batch_size=count, queries=f"sample:{sample}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    manifest = run.manifest
    timings, solver, fidelity = manifest["timings_s"], manifest["solver"], manifest["fidelity"]
    analysis = timings["total_s"] - timings.get("load_model_s", 0.0) - timings.get("load_data_s", 0.0)
    found = {
        "model": "llama-3-8b-shape", "parameters": parameters, "dtype": str(next(model.parameters()).dtype),
        "tokens": tokens, "texts": count, "queries": f"sample:{sample}", "built_s": built_s,
        "forward_s": forward, "analysis_s": analysis, "ratio": analysis / forward,
        "capture_s": timings.get("capture_s"), "solve_s": timings.get("solve_s"),
        "rows": solver["rows"], "not_converged": solver["not_converged"],
        "max_relative_error_bound": solver["max_relative_error_bound"], "fidelity_passed": fidelity["passed"],
        "fidelity_max_abs_error": fidelity["max_abs_error"], "forward_peak_gib": forward_peak, "peak_gib": peak,
        "selection": manifest["selection"]["description"],
    }
    log(f"large: analysis {analysis:.1f} s against forward {forward:.2f} s = {found['ratio']:.1f}x; "
        f"{found['rows']:,} rows, {found['not_converged']} not converged; fidelity "
        f"{'passed' if found['fidelity_passed'] else 'FAILED'}"
        + (f"; peak device memory {peak:.1f} GiB (forward {forward_peak:.1f} GiB)" if cuda else ""))
    (workdir / "large.json").write_text(json.dumps(found, indent=2))
    if time.monotonic() > deadline:
        found["long"] = {"skipped": "out of this part's time after the 4,096-token run"}
    else:
        found["long"] = long_context(model, tokenizer, long_tokens, sample, args.device, workdir, log)
    (workdir / "large.json").write_text(json.dumps(found, indent=2))
    return found


def long_context(model, tokenizer, tokens: int, sample: int, device: str, workdir: Path, log: Log) -> dict:
    """One text of ``tokens`` under the model's fast attention: its plain SDPA forward and the run
    (``attn_implementation="sdpa"``), their seconds and peak device memory."""
    import torch

    from probe.callbacks import measure

    cuda = device.startswith("cuda")
    texts = corpus_texts(tokenizer, tokens, 1)
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        forward = forward_seconds(model, tokenizer, texts, tokens, device)
        forward_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        model.set_attn_implementation(saved)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    run = measure(model, tokenizer, texts, workdir / "long", name="llama-3-8b-shape-sdpa", max_length=tokens,
                  batch_size=1, queries=f"sample:{sample}", attn_implementation="sdpa")
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    manifest = run.manifest
    solver, fidelity = manifest["solver"], manifest["fidelity"]
    found = {
        "tokens": tokens, "texts": 1, "queries": f"sample:{sample}", "attn_implementation": "sdpa",
        "forward_s": forward, "run_s": seconds, "solve_s": manifest["timings_s"].get("solve_s"),
        "rows": solver["rows"], "not_converged": solver["not_converged"],
        "max_relative_error_bound": solver["max_relative_error_bound"], "fidelity_passed": fidelity["passed"],
        "fidelity_max_abs_error": fidelity["max_abs_error"], "fidelity_check": fidelity["check"],
        "forward_peak_gib": forward_peak, "peak_gib": peak,
    }
    log(f"large, SDPA: one text of {tokens:,} tokens, run {seconds:.1f} s against forward {forward:.2f} s; "
        f"{found['rows']:,} rows, {found['not_converged']} not converged; fidelity "
        f"{'passed' if found['fidelity_passed'] else 'FAILED'}"
        + (f"; peak device memory {peak:.1f} GiB (forward {forward_peak:.1f} GiB)" if cuda else ""))
    return found


def markdown_lines(large: dict) -> list[str]:
    """The section of results_gpu.md for this part."""
    if not large or "error" in large:
        return []
    if "skipped" in large:
        return ["", "## 4. A large model at a long context", "", f"Not measured: {large['skipped']}."]
    memory = ("n/a" if large.get("peak_gib") is None else f"{large['peak_gib']:.1f} GiB (the plain forward's: "
              f"{large['forward_peak_gib']:.1f} GiB)")
    return [
        "", "## 4. A large model at a long context", "",
        f"A Llama-3-8B-shaped model from its config ({large['parameters'] / 1e9:.2f}B parameters, {large['dtype']}, "
        f"random weights), {large['texts']} texts of {large['tokens']:,} tokens, `--queries {large['queries']}` "
        f"({large['selection']}).", "",
        "| analysis (s) | forward (s) | analysis / forward | rows | not converged | largest error bound | fidelity "
        "| peak device memory |",
        "|---|---|---|---|---|---|---|---|",
        f"| {large['analysis_s']:.1f} | {large['forward_s']:.2f} | {large['ratio']:.1f}x | {large['rows']:,} | "
        f"{large['not_converged']} | {large['max_relative_error_bound']:.1e} | "
        f"{'passed' if large['fidelity_passed'] else 'FAILED'} ({large['fidelity_max_abs_error']:.1e}) | {memory} |",
    ] + long_lines(large.get("long"))


def long_lines(long: dict | None) -> list[str]:
    """The SDPA long-context measurement of this part, for results_gpu.md."""
    if not long:
        return []
    if "skipped" in long:
        return ["", f"One long text under SDPA: not measured ({long['skipped']})."]
    memory = ("n/a" if long.get("peak_gib") is None else f"{long['peak_gib']:.1f} GiB (the plain SDPA forward's: "
              f"{long['forward_peak_gib']:.1f} GiB)")
    return [
        "", f"One text of {long['tokens']:,} tokens under the model's fast attention (`--attn-implementation sdpa`, "
        f"`--queries {long['queries']}`, batches of one text):", "",
        "| run (s) | plain SDPA forward (s) | rows | not converged | largest error bound | fidelity (output) "
        "| peak device memory |",
        "|---|---|---|---|---|---|---|",
        f"| {long['run_s']:.1f} | {long['forward_s']:.2f} | {long['rows']:,} | {long['not_converged']} | "
        f"{long['max_relative_error_bound']:.1e} | {'passed' if long['fidelity_passed'] else 'FAILED'} "
        f"({long['fidelity_max_abs_error']:.1e}) | {memory} |",
    ]
