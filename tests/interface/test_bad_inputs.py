"""The catalogue of bad inputs to `probe run`: one table, one row per case; and of every other command
(report, compare, export, resume, verify, vit train): a second table, ``COMMANDS``.

Every case must give exit status 2, a message containing the row's fragments, no traceback, and
leave nothing on disk (no run directory, no --out folder).  Rows marked ``LOAD`` are found while the
weights load (only loading can tell): still before the run directory exists.

To add a case, add a row to ``CASES``: ``Case(id, args, fragments)``, where ``args(b)`` builds the
arguments after ``run`` from ``b``, the broken models and files built once below (``b.out`` is the
run's --out unless the row gives its own); ``env``: environment variables the command runs with.

``COMMANDS`` rows give a whole command line, from ``b`` and the test's own folder: exit status 2 (74 for
an I/O error while writing), one line (the error), no traceback, and nothing written where the check
comes first.  Rows marked ``read_only`` run in a subprocess under ``unshare`` where their folder is a
read-only bind mount (root passes permission bits, not a read-only mount); they are skipped, saying why,
where this machine cannot make one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

from probe.cli import app

ROOT = Path(__file__).resolve().parents[2]
LOAD = "found while loading the weights"
HAS_CUDA = torch.cuda.is_available()
HAS_MPS = torch.backends.mps.is_available()
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@dataclass
class Case:
    id: str
    args: Callable[["Bad"], list]
    fragments: tuple[str, ...]
    note: str = ""  # LOAD: found while loading the weights
    skip: str | None = None  # a reason this machine cannot show the case
    env: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- the inputs


class Bad:
    """Broken models and data files, built once; ``out`` is set per test."""

    def __init__(self, root: Path, tiny: Path):
        self.root, self.tiny, self.out = root, tiny, None
        self.models, self.files = root / "models", root / "data"
        self.models.mkdir()
        self.files.mkdir()

    def model(self, name, remove=(), edit=None) -> Path:
        """A copy of the tiny BERT without ``remove``d files, then ``edit(directory)``."""
        directory = self.models / name
        shutil.copytree(self.tiny, directory)
        for file in remove:
            (directory / file).unlink()
        if edit:
            edit(directory)
        return directory

    def file(self, name, content: str | bytes) -> Path:
        path = self.files / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return path


TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def _edit_json(name, **changes):
    def edit(directory):
        path = directory / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def _truncate(name, keep=0.5):
    def edit(directory):
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: int(len(data) * keep)])
    return edit


def _without_weights(pattern):
    def edit(directory):
        from safetensors.torch import load_file, save_file

        tensors = load_file(directory / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if pattern not in k}, directory / "model.safetensors",
                  metadata={"format": "pt"})
    return edit


def _sharded_with_a_missing_shard(directory):
    from safetensors.torch import load_file

    names = list(load_file(directory / "model.safetensors"))
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    weight_map = {name: shards[i % 2] for i, name in enumerate(names)}
    (directory / "model.safetensors").rename(directory / shards[0])
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _torch_bin_truncated(directory):
    from safetensors.torch import load_file

    torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()
    _truncate("pytorch_model.bin")(directory)


class _RunsCode:
    """An object whose unpickling calls a function: what a malicious pytorch_model.bin holds."""

    def __reduce__(self):
        return (os.getcwd, ())


def _pickle_that_runs_code(directory):
    """The tiny BERT's weights as pytorch_model.bin, with an object beside them whose unpickling calls a
    function (a harmless one: the refusal comes before it runs)."""
    from safetensors.torch import load_file

    tensors = load_file(directory / "model.safetensors")
    torch.save({**tensors, "payload": _RunsCode()}, directory / "pytorch_model.bin")
    (directory / "model.safetensors").unlink()


def _tokenizer_larger_than_the_embeddings(directory):
    """A WordPiece vocabulary of 50,522 entries (20,000 new ones first, so the usual words get ids beyond the
    model's 30,522 embedding rows) beside the tiny BERT's 30,522-row embedding."""
    from transformers import AutoTokenizer

    vocabulary = AutoTokenizer.from_pretrained(directory).get_vocab()
    words = [word for word, _ in sorted(vocabulary.items(), key=lambda item: item[1])]
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.txt").write_text("\n".join([f"zzextra{i}" for i in range(20_000)] + words) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                                 "do_lower_case": True}))


def _vocabulary_of_special_tokens_only(directory):
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_bert_dir):
    from transformers import T5Config, XLNetConfig

    b = Bad(tmp_path_factory.mktemp("bad-inputs"), Path(tiny_bert_dir))
    m = b.model
    b.no_tokenizer = m("no-tokenizer", remove=TOKENIZER)
    b.no_vocabulary = m("no-vocabulary", edit=_vocabulary_of_special_tokens_only)
    b.big_vocabulary = m("big-vocabulary", edit=_tokenizer_larger_than_the_embeddings)
    b.no_weights = m("no-weights", remove=["model.safetensors"])
    b.no_config = m("no-config", remove=["config.json"])
    b.broken_config = m("broken-config", edit=lambda d: (d / "config.json").write_text('{"model_type": "bert",'))
    b.unknown_type = m("unknown-type", edit=_edit_json("config.json", model_type="no-such-architecture"))
    b.truncated = m("truncated", edit=_truncate("model.safetensors"))
    b.zero_bytes = m("zero-bytes", edit=_truncate("model.safetensors", keep=0))
    b.missing_shard = m("missing-shard", edit=_sharded_with_a_missing_shard)
    b.truncated_bin = m("truncated-bin", edit=_torch_bin_truncated)
    b.unsafe_pickle = m("unsafe-pickle", edit=_pickle_that_runs_code)
    b.mismatched = m("mismatched", edit=_edit_json("config.json", hidden_size=128, intermediate_size=256))
    b.no_attention = m("no-query-weights", edit=_without_weights("attention.self.query"))
    b.short_tokenizer = m("short-tokenizer", edit=_edit_json("tokenizer_config.json", model_max_length=64))
    b.empty_model = b.models / "empty"
    b.empty_model.mkdir()
    b.xlnet = b.models / "xlnet"  # an architecture probe has no adapter for
    XLNetConfig(n_layer=1, n_head=2, d_model=8).save_pretrained(b.xlnet)
    b.t5_encoder = b.models / "t5-encoder-only"
    T5Config(d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, architectures=["T5EncoderModel"]).save_pretrained(
        b.t5_encoder
    )
    from transformers import MPNetConfig

    b.mpnet = b.models / "mpnet"  # a family captured with hooks: it cannot substitute (--intervene)
    MPNetConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32).save_pretrained(b.mpnet)
    for name in TOKENIZER:
        if (b.tiny / name).exists():
            shutil.copy(b.tiny / name, b.mpnet / name)
    from transformers import AutoModel, Gemma2Config

    b.gemma2 = b.models / "gemma2"  # attention logit soft-capping (50, Gemma 2's default): not probe's logit form
    gemma2 = Gemma2Config(vocab_size=30522, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0)
    AutoModel.from_config(gemma2).save_pretrained(b.gemma2)
    for name in TOKENIZER:
        if (b.tiny / name).exists():
            shutil.copy(b.tiny / name, b.gemma2 / name)
    b.a_file = b.file("a-file", "not a folder\n")
    b.texts = b.file("texts.txt", "one text\nanother text\n")
    b.jsonl_ok = b.file("ok.jsonl", '{"text": "one"}\n{"text": "two"}\n')
    b.empty_txt = b.file("empty.txt", "")
    b.empty_jsonl = b.file("empty.jsonl", "")
    b.blank_txt = b.file("blank.txt", "\n  \n\n")
    b.blank_jsonl = b.file("blank.jsonl", "\n\n")
    b.bad_jsonl = b.file("bad.jsonl", '{"text": "fine"}\n\n{"text": oops}\n{"text": "fine"}\n')
    b.int_in_jsonl = b.file("mixed.jsonl", '{"text": "fine"}\n{"text": 3}\n')
    b.list_jsonl = b.file("lists.jsonl", '{"text": ["a", "b"]}\n')
    b.null_jsonl = b.file("nulls.jsonl", '{"text": null}\n{"text": null}\n')
    b.other_column = b.file("other.jsonl", '{"sentence": "hello"}\n')
    b.broken_json = b.file("broken.json", '[{"text": "a"}, {"text": "b"}')
    b.bad_csv = b.file("bad.csv", "text,label\nfine,1\nnot, fine,2\n")
    b.header_csv = b.file("header.csv", "text\n\n \n")
    b.latin1 = b.file("latin1.txt", "fine\ncaf\xe9\n".encode("latin-1"))
    b.xlsx = b.file("table.xlsx", b"PK\x03\x04 not really")
    b.no_data_dir = b.root / "no-data"
    b.no_data_dir.mkdir()
    (b.no_data_dir / "notes.md").write_text("nothing here\n")
    b.mixed_dir = b.root / "mixed"
    b.mixed_dir.mkdir()
    (b.mixed_dir / "a.txt").write_text("one\n")
    (b.mixed_dir / "b.csv").write_text("text\ntwo\n")
    import pandas as pd

    b.int_parquet = b.files / "ints.parquet"
    pd.DataFrame({"text": [1, 2, 3], "label": ["a", "b", "c"]}).to_parquet(b.int_parquet)
    b.corrupt_parquet = b.file("corrupt.parquet", b"PAR1 this is not parquet")
    b.nul_txt = b.file("zeros.txt", bytes(4096))  # valid UTF-8, and no text
    b.nul_in_a_line = b.file("nul-line.txt", b"fine\nalso fine\nbroken \x00 here\n")
    b.nul_jsonl = b.file("nul.jsonl", '{"text": "fine"}\n{"text": "a\\u0000b"}\n')
    return b


# ------------------------------------------------------------------------------------------ the table

CASES = [
    # 1. options
    Case("alpha nan", lambda b: [b.tiny, "--alpha", "nan"], ("--alpha must be a finite number > 0", "nan")),
    Case("alpha inf", lambda b: [b.tiny, "--alpha", "inf"], ("--alpha must be a finite number > 0", "inf")),
    Case("alpha negative", lambda b: [b.tiny, "--alpha", "-1"], ("--alpha must be a finite number > 0", "-1")),
    Case("alpha zero", lambda b: [b.tiny, "--alpha", "0"], ("--alpha must be a finite number > 0",)),
    Case("alpha not a number", lambda b: [b.tiny, "--alpha", "abc"], ("--alpha takes a number", "'abc'")),
    Case("alpha list with a gap", lambda b: [b.tiny, "--alpha", "0.5,,1"], ("--alpha takes a number", "'0.5,,1'")),
    Case("alpha list with nan", lambda b: [b.tiny, "--alpha", "0.5,nan"], ("--alpha must be a finite number > 0",)),
    Case("alpha repeated", lambda b: [b.tiny, "--alpha", "1,0.5,1"], ("--alpha lists a value twice",)),
    Case("fidelity tolerance negative", lambda b: [b.tiny, "--fidelity-tolerance", "-1"],
         ("--fidelity-tolerance must be a finite number > 0",)),
    Case("fidelity tolerance zero", lambda b: [b.tiny, "--fidelity-tolerance", "0"], ("--fidelity-tolerance",)),
    Case("fidelity tolerance nan", lambda b: [b.tiny, "--fidelity-tolerance", "nan"], ("--fidelity-tolerance",)),
    Case("format unknown", lambda b: [b.tiny, "--report", "--format", "svg"], ("Unknown figure format", "svg")),
    Case("format empty", lambda b: [b.tiny, "--report", "--format", ","], ("No figure format given",)),
    Case("format without report", lambda b: [b.tiny, "--format", "pdf"], ("--format applies to the report",)),
    Case("dtype unknown", lambda b: [b.tiny, "--dtype", "float8"], ("Unknown --dtype float8",)),
    Case("device meta", lambda b: [b.tiny, "--device", "meta"], ("Device 'meta'", "--device cpu")),
    Case("device mps", lambda b: [b.tiny, "--device", "mps"], ("MPS", "not available"),
         skip="MPS is available here" if HAS_MPS else None),
    Case("device cuda", lambda b: [b.tiny, "--device", "cuda"], ("CUDA is not available",),
         skip="CUDA is available here" if HAS_CUDA else None),
    Case("device cuda index", lambda b: [b.tiny, "--device", "cuda:99"], ("Device 'cuda:99' asked for",)),
    Case("device unknown", lambda b: [b.tiny, "--device", "tpu"], ("Unknown device 'tpu'",)),
    Case("device unsupported", lambda b: [b.tiny, "--device", "xla"], ("probe does not run on 'xla'",)),
    Case("batch size zero", lambda b: [b.tiny, "--batch-size", "0"], ("--batch-size must be at least 1",)),
    Case("batch size negative", lambda b: [b.tiny, "--batch-size", "-4"], ("--batch-size must be at least 1",)),
    Case("threads zero", lambda b: [b.tiny, "--threads", "0"], ("--threads must be at least 1",)),
    Case("samples zero", lambda b: [b.tiny, "--samples", "0"], ("--samples must be at least 1",)),
    Case("samples negative", lambda b: [b.tiny, "--samples", "-5"], ("--samples must be at least 1",)),
    Case("max length zero", lambda b: [b.tiny, "--max-length", "0"], ("--max-length must be at least 1",)),
    Case("samples neither a count nor random:N", lambda b: [b.tiny, "--samples", "random:some"],
         ("--samples takes N (the first N texts) or random:N", "'random:some'")),
    Case("samples random zero", lambda b: [b.tiny, "--samples", "random:0"], ("--samples must be at least 1",)),
    Case("space unknown", lambda b: [b.tiny, "--space", "hidden,query"], ("Unknown --space query", "hidden, key")),
    Case("space repeated", lambda b: [b.tiny, "--space", "key,key"], ("--space lists a space twice",)),
    Case("space empty entry", lambda b: [b.tiny, "--space", "hidden,"], ("--space", "empty entry")),
    Case("init unknown", lambda b: [b.tiny, "--init", "xavier"], ("Unknown --init xavier", "pretrained or random")),
    Case("max memory unit", lambda b: [b.tiny, "--max-memory", "4XB"], ("--max-memory 4XB is not a size",)),
    Case("max memory words", lambda b: [b.tiny, "--max-memory", "lots"], ("is not a size",)),
    Case("max memory negative", lambda b: [b.tiny, "--max-memory", "-1GB"], ("is not a size",)),
    Case("max memory zero", lambda b: [b.tiny, "--max-memory", "0GB"], ("--max-memory 0GB must be a finite size of at least 1 byte",)),
    # the selection: the tiny BERT has 2 layers and 4 heads of one attention type, self
    Case("layer out of range", lambda b: [b.tiny, "--layers", "0,2"],
         ("--layers 0,2: 2 is out of range for this model", "self: 2 layers, 0 to 1 (or -2 to -1)")),
    Case("layer negative out of range", lambda b: [b.tiny, "--layers", "-3"], ("-3 is out of range", "2 layers")),
    Case("layer range reversed", lambda b: [b.tiny, "--layers", "1-0"],
         ("--layers 1-0: 1-0 runs backwards: a range a-b goes from a up to b, e.g. 0-1",)),
    Case("layer range reversed from the end", lambda b: [b.tiny, "--layers", "-1-0"],
         ("--layers -1-0: -1-0 runs backwards in this model's self stack (from 1 down to 0)",)),
    Case("layers malformed", lambda b: [b.tiny, "--layers", "1;2"], ("--layers '1;2': '1;2' is not an index",)),
    Case("layers empty entry", lambda b: [b.tiny, "--layers", "0,,1"], ("'' is not an index or a range a-b",)),
    Case("head out of range", lambda b: [b.tiny, "--heads", "4"], ("--heads 4: 4 is out of range", "4 heads, 0 to 3")),
    Case("heads words", lambda b: [b.tiny, "--heads", "all"], ("--heads all: 'all' is not an index",)),
    Case("attention type absent", lambda b: [b.tiny, "--attention-types", "cross"],
         ("--attention-types cross: the model has no such attention type; its types are self",)),
    Case("attention type unknown", lambda b: [b.tiny, "--attention-types", "bogus"],
         ("--attention-types bogus: not an attention type. The types are self, causal_self, encoder_self, "
          "decoder_self, cross; this model has self.",)),
    Case("queries unknown", lambda b: [b.tiny, "--queries", "first"], ("Unknown --queries first",)),
    Case("queries every zero", lambda b: [b.tiny, "--queries", "every:0"], ("K must be at least 1, got 0",)),
    Case("queries sample negative", lambda b: [b.tiny, "--queries", "sample:-2"], ("N must be at least 1, got -2",)),
    Case("queries sample no number", lambda b: [b.tiny, "--queries", "sample:"], ("sample:N needs a whole number N",)),
    Case("queries sample words", lambda b: [b.tiny, "--queries", "sample:many"], ("sample:N needs a whole number",)),
    Case("queries last with a number", lambda b: [b.tiny, "--queries", "last:3"], ("last takes no number",)),
    Case("queries listed", lambda b: [b.tiny, "--queries", "every:2,last"], ("a run takes one query rule, not a list",)),
    Case("selection with interventions", lambda b: [b.tiny, "--layers", "0", "--intervene", "exact"],
         ("--intervene puts each site's exact posterior", "Remove --intervene, or the selection",)),
    Case("seed out of range", lambda b: [b.tiny, "--seed", "99999999999999999999"],
         ("--seed must be a whole number from 0 to 9223372036854775807",)),
    # 2. output location
    Case("out is a file", lambda b: [b.tiny, "--out", b.a_file], ("is a file, not a folder",)),
    Case("out below a file", lambda b: [b.tiny, "--out", b.a_file / "runs"], ("cannot be created", "is a file")),
    Case("out not writable (/proc)", lambda b: [b.tiny, "--out", "/proc/probe-runs"], ("is not writable",),
         skip=None if Path("/proc").is_dir() else "no /proc here"),
    Case("out read-only folder", lambda b: [b.tiny, "--out", _read_only(b) / "runs"], ("is not writable",),
         skip="root can write anywhere" if IS_ROOT else None),
    # 3. data
    Case("dataset path missing", lambda b: [b.tiny, "--dataset", "./no-such-dir/texts.txt"],
         ("does not exist", "./no-such-dir/texts.txt")),
    Case("dataset file missing", lambda b: [b.tiny, "--dataset", "missing.jsonl"], ("'missing.jsonl' does not exist",)),
    Case("dataset deep path missing", lambda b: [b.tiny, "--dataset", "data/train/x"], ("'data/train/x' does not exist",)),
    Case("dataset neither path nor id", lambda b: [b.tiny, "--dataset", "my texts"],
         ("neither an existing local path nor a Hugging Face Hub id",)),
    Case("dataset hub id offline", lambda b: [b.tiny, "--dataset", "someone/some-dataset"],
         ("No connection to the Hugging Face Hub", "pass a local file")),
    Case("empty txt", lambda b: [b.tiny, "--dataset", b.empty_txt], ("is empty (0 bytes)", "empty.txt")),
    Case("empty jsonl with samples", lambda b: [b.tiny, "--dataset", b.empty_jsonl, "--samples", 2],
         ("is empty (0 bytes)",)),
    Case("blank txt", lambda b: [b.tiny, "--dataset", b.blank_txt], ("has no non-empty texts",)),
    Case("blank jsonl", lambda b: [b.tiny, "--dataset", b.blank_jsonl], ("has no non-empty texts",)),
    Case("malformed jsonl", lambda b: [b.tiny, "--dataset", b.bad_jsonl],
         ("bad.jsonl", "line 3 is not valid JSON", "oops")),
    Case("malformed jsonl with samples", lambda b: [b.tiny, "--dataset", b.bad_jsonl, "--samples", 3],
         ("bad.jsonl", "line 3 is not valid JSON", "oops")),
    Case("number in a text column", lambda b: [b.tiny, "--dataset", b.int_in_jsonl], ("Row 1", "3 (int)", "not text")),
    Case("lists in a text column", lambda b: [b.tiny, "--dataset", b.list_jsonl], ("holds lists, not text",)),
    Case("nulls only", lambda b: [b.tiny, "--dataset", b.null_jsonl], ("no non-empty texts", "2 empty rows")),
    Case("missing column", lambda b: [b.tiny, "--dataset", b.other_column],
         ("no column 'text'", "Available columns: sentence", "--column")),
    Case("missing target column", lambda b: [b.tiny, "--dataset", b.jsonl_ok, "--target-column", "target"],
         ("no column 'target'", "--target-column")),
    Case("target column without dataset", lambda b: [b.tiny, "--target-column", "target"],
         ("--target-column needs --dataset",)),
    Case("broken json document", lambda b: [b.tiny, "--dataset", b.broken_json],
         ("broken.json", "not valid JSON at line 1")),
    Case("parquet column of ints", lambda b: [b.tiny, "--dataset", b.int_parquet],
         ("Column 'text'", "holds int64 values, not text", "Text columns: label")),
    Case("corrupt parquet", lambda b: [b.tiny, "--dataset", b.corrupt_parquet], ("not a readable parquet file",)),
    Case("csv row with extra field", lambda b: [b.tiny, "--dataset", b.bad_csv],
         ("bad.csv", "line 3 has 3 fields, the header has 2")),
    Case("csv header only", lambda b: [b.tiny, "--dataset", b.header_csv], ("no non-empty texts",)),
    Case("text not UTF-8", lambda b: [b.tiny, "--dataset", b.latin1], ("latin1.txt", "line 2 is not UTF-8")),
    Case("unsupported file type", lambda b: [b.tiny, "--dataset", b.xlsx], ("Unsupported data file", ".xlsx")),
    Case("folder without data files", lambda b: [b.tiny, "--dataset", b.no_data_dir], ("No data files in the folder",)),
    Case("folder of mixed files", lambda b: [b.tiny, "--dataset", b.mixed_dir], ("mixes data files of different kinds",)),
    Case("text file of NUL bytes", lambda b: [b.tiny, "--dataset", b.nul_txt],
         ("zeros.txt", "line 1 holds NUL characters", "binary data")),
    Case("text file with a NUL in a line", lambda b: [b.tiny, "--dataset", b.nul_in_a_line, "--samples", "random:2"],
         ("nul-line.txt", "line 3 holds NUL characters")),
    Case("jsonl text with a NUL", lambda b: [b.tiny, "--dataset", b.nul_jsonl], ("row 1", "holds NUL characters")),
    # 4. model
    Case("model path typo", lambda b: ["./no-such-model"], ("The model path './no-such-model' does not exist",)),
    Case("model absolute path typo", lambda b: [b.root / "no-such-model"], ("does not exist",)),
    Case("model hub id offline", lambda b: ["bert-base-uncased"],
         ("No connection to the Hugging Face Hub", "pass a local directory")),
    Case("model neither path nor id", lambda b: ["my model"], ("neither an existing local path nor a Hugging Face Hub id",)),
    Case("model is a file", lambda b: [b.a_file], ("is a file; pass the directory",)),
    Case("model folder without config", lambda b: [b.no_config], ("has no config.json",)),
    Case("model folder empty", lambda b: [b.empty_model], ("has no config.json", "save_pretrained")),
    Case("config.json not JSON", lambda b: [b.broken_config], ("Could not read the config",)),
    Case("config with unknown model type", lambda b: [b.unknown_type], ("Could not read the config",)),
    Case("architecture without adapter", lambda b: [b.xlnet],
         ("no adapter for model type 'xlnet'", "Supported model types:", "bert", "gpt2")),
    Case("checkpoint the adapter refuses", lambda b: [b.t5_encoder],
         ("T5EncoderModel", "only one half of the encoder-decoder", "no decoder")),
    Case("attention logit soft-capping", lambda b: [b.gemma2],
         ("this gemma2 model", "attn_logit_softcapping = 50.0", "soft-capping is not linear")),
    Case("no weights", lambda b: [b.no_weights], ("has no weights", "model.safetensors")),
    Case("no tokenizer files", lambda b: [b.no_tokenizer], ("has no tokenizer files", "--tokenizer")),
    Case("tokenizer path typo", lambda b: [b.no_tokenizer, "--tokenizer", "./no-such-tokenizer"],
         ("The tokenizer path './no-such-tokenizer' does not exist",)),
    Case("tokenizer folder without tokenizer", lambda b: [b.tiny, "--tokenizer", b.no_tokenizer],
         ("has no tokenizer files", "given with --tokenizer")),
    Case("tokenizer without vocabulary", lambda b: [b.no_vocabulary], ("has no vocabulary", "unknown token")),
    Case("truncated safetensors", lambda b: [b.truncated], ("model.safetensors' is corrupt or incomplete",)),
    Case("empty safetensors", lambda b: [b.zero_bytes], ("corrupt or incomplete",)),
    Case("missing weight shard", lambda b: [b.missing_shard], ("lacks 1 of the 2 weight shards",)),
    Case("truncated pytorch_model.bin", lambda b: [b.truncated_bin], ("pytorch_model.bin' is incomplete",)),
    Case("pytorch_model.bin whose pickle runs code", lambda b: [b.unsafe_pickle],
         ("were refused as unsafe", "weights-only", "posix.getcwd", "The file is not damaged", "safetensors"),
         note=LOAD),
    Case("weights that do not fit the config", lambda b: [b.mismatched],
         ("do not match its config.json", "(64, 64) in the checkpoint but (128, 128)"), note=LOAD),
    Case("weights without the attention queries", lambda b: [b.no_attention],
         ("lacks 4 weights the model needs", "attention.self.query"), note=LOAD),
    # interventions (--intervene, --intervene-modes): options, then a family that cannot substitute, from its
    # config (before any weights load)
    Case("intervene unknown substitute", lambda b: [b.tiny, "--intervene", "exact,posterior"],
         ("Unknown --intervene posterior", "exact, second-order, null, model")),
    Case("intervene substitute repeated", lambda b: [b.tiny, "--intervene", "exact,null,exact"],
         ("--intervene lists a value twice",)),
    Case("intervene empty entry", lambda b: [b.tiny, "--intervene", "exact,,null"], ("--intervene", "empty entry")),
    Case("intervene unknown mode", lambda b: [b.tiny, "--intervene", "exact", "--intervene-modes", "sites"],
         ("Unknown --intervene-modes sites", "per-site, whole")),
    Case("intervene modes without intervene", lambda b: [b.tiny, "--intervene-modes", "whole"],
         ("--intervene-modes applies to interventions", "add --intervene exact", "or remove --intervene-modes")),
    Case("intervene on a family that cannot substitute", lambda b: [b.mpnet, "--init", "random", "--intervene", "exact"],
         ("--intervene needs a model whose attention probe can substitute", "(mpnet)", "remove --intervene")),
    # the attention the model runs while it is measured (--attn-implementation)
    Case("attn implementation unknown", lambda b: [b.tiny, "--attn-implementation", "flash"],
         ("Unknown --attn-implementation flash", "Choose eager", "or sdpa")),
    Case("sdpa with interventions", lambda b: [b.tiny, "--attn-implementation", "sdpa", "--intervene", "exact"],
         ("--attn-implementation sdpa runs its fast attention", "Remove one of them")),
    Case("sdpa on a family captured with hooks", lambda b: [b.mpnet, "--init", "random", "--attn-implementation", "sdpa"],
         ("--attn-implementation sdpa runs the model's fast attention", "(mpnet)", "so remove --attn-implementation")),
    # 5. max length
    Case("max length beyond the position table", lambda b: [b.tiny, "--max-length", 1000],
         ("--max-length 1000", "position table has 256 entries", "--max-length 256 or less")),
    Case("max length beyond the tokenizer", lambda b: [b.short_tokenizer, "--max-length", 100],
         ("model_max_length is 64", "--max-length 64 or less")),
    Case("max length below the special tokens", lambda b: [b.tiny, "--max-length", 1],
         ("--max-length 1 is too small", "2 special tokens")),
    # 6. options that do not apply
    Case("split on a local file", lambda b: [b.tiny, "--dataset", b.texts, "--split", "test"],
         ("--split applies to hub datasets", "local file")),
    Case("config on a local file", lambda b: [b.tiny, "--dataset", b.texts, "--config", "raw"],
         ("--config applies to hub datasets",)),
    Case("column with the embedded corpus", lambda b: [b.tiny, "--column", "sentence"],
         ("--column applies to --dataset", "embedded corpus")),
    Case("split with the embedded corpus", lambda b: [b.tiny, "--split", "test"], ("--split applies to --dataset",)),
    Case("revision with a local model", lambda b: [b.tiny, "--revision", "main"],
         ("--revision applies to hub ids", "local directory")),
    # 7. the tokenizer against the model: every id it produces has an embedding row
    Case("tokenizer larger than the embeddings", lambda b: [b.big_vocabulary],
         ("The tokenizer does not fit", "ids up to 50,521", "30,522 rows")),
    # 8. environment variables, checked with the options (not after the run)
    Case("memory budget not a size", lambda b: [b.tiny], ("PROBE_MEMORY_BUDGET='garbage' is not a size",),
         env={"PROBE_MEMORY_BUDGET": "garbage"}),
    Case("memory budget zero", lambda b: [b.tiny], ("PROBE_MEMORY_BUDGET='0' must be a finite size of at least 1 byte",),
         env={"PROBE_MEMORY_BUDGET": "0"}),
    Case("memory budget negative", lambda b: [b.tiny], ("PROBE_MEMORY_BUDGET='-5' is not a size",),
         env={"PROBE_MEMORY_BUDGET": "-5"}),
    Case("native switch not 0 or 1", lambda b: [b.tiny], ("PROBE_NATIVE='yes'",), env={"PROBE_NATIVE": "yes"}),
    # 9. what a run keeps (--keep)
    Case("keep unknown", lambda b: [b.tiny, "--keep", "foo"], ("Unknown --keep foo", "rows, aggregates or sample:N")),
    Case("keep sample zero", lambda b: [b.tiny, "--keep", "sample:0"], ("--keep sample:0 would keep no row",)),
    Case("keep sample negative", lambda b: [b.tiny, "--keep", "sample:-3"], ("--keep sample:-3 would keep no row",)),
    Case("keep sample not a number", lambda b: [b.tiny, "--keep", "sample:x"],
         ("--keep sample:x", "'x' is not a whole number")),
    Case("keep sample fraction", lambda b: [b.tiny, "--keep", "sample:1.5"], ("'1.5' is not a whole number",)),
    Case("keep sample without N", lambda b: [b.tiny, "--keep", "sample"], ("--keep sample needs the number of rows",)),
    Case("keep sample empty N", lambda b: [b.tiny, "--keep", "sample:"], ("--keep sample: needs the number",)),
    Case("keep aggregate misspelt", lambda b: [b.tiny, "--keep", "aggregate"], ("Unknown --keep aggregate",)),
    # 2. output location, as root too: a path below a file, and a read-only file system
    Case("out on a read-only mount", lambda b: [b.tiny, "--out", "{read_only}/runs"],
         ("is not writable", "Read-only file system")),
]


def _read_only(b: Bad) -> Path:
    folder = b.root / "read-only"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o500)
    return folder


def _tree(*roots: Path) -> set[str]:
    return {str(p) for root in roots if root.exists() for p in root.rglob("*")}


def test_catalogue_ids_are_unique():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(CASES) >= 80


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case, bad: Bad, tmp_path):
    if case.skip:
        pytest.skip(case.skip)
    bad.out = tmp_path / "runs"
    args = [str(a) for a in case.args(bad)]
    if "--out" not in args:
        args += ["--out", str(bad.out)]
    if any("{read_only}" in arg for arg in args):
        (tmp_path / "read-only").mkdir()
    before = _tree(bad.root, tmp_path)
    if any("{read_only}" in arg for arg in args):
        code, output = _in_read_only_mount(tmp_path, ["run", *args, "--no-progress"], case.env)
        assert code == 2 and "Traceback" not in output, output
        for fragment in case.fragments:
            assert fragment in output, output
        assert _tree(bad.root, tmp_path) == before, "a rejected run left files behind"
        return
    result = CliRunner().invoke(app, ["run", *args, "--no-progress"], env=case.env)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    for fragment in case.fragments:
        assert fragment in result.output, result.output
    assert _tree(bad.root, tmp_path) == before, "a rejected run left files behind"


# ------------------------------------------------------------------------- a read-only file system


def _read_only_mounts() -> str | None:
    """None where this machine lets a process make a read-only bind mount in its own mount namespace
    (``unshare -rm``: as root, or where unprivileged user namespaces are allowed); else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "no unshare or mount command here"
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && ! touch {folder}/x"
        done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True)
    return None if done.returncode == 0 else f"cannot make a read-only bind mount here ({done.stderr.strip()[:100]})"


READ_ONLY_SKIP = _read_only_mounts()


def _in_read_only_mount(tmp_path: Path, argv: list[str], env: dict | None = None) -> tuple[int, str]:
    """``probe ARGV`` in a subprocess whose ``{read_only}`` (a folder of ``tmp_path``) is a read-only bind
    mount: the way a read-only disk refuses root too."""
    if READ_ONLY_SKIP:
        pytest.skip(READ_ONLY_SKIP)
    folder = tmp_path / "read-only"  # made before the test takes stock of the files
    argv = [arg.replace("{read_only}", str(folder)) for arg in argv]
    import shlex

    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "probe", *argv])
    script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && exec {command}"
    environment = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=environment,
                          timeout=300)
    return done.returncode, done.stdout + done.stderr


# ------------------------------------------------------------------------------ every other command


@dataclass
class Command:
    id: str
    argv: Callable[["Bad"], list]  # the whole command line after `probe`; "{read_only}": a read-only mount
    fragments: tuple[str, ...]
    code: int = 2
    env: dict = field(default_factory=dict)
    fail: tuple[str, OSError] | None = None  # (what to patch, the OSError it raises): a write that fails


ENOSPC = OSError(28, "No space left on device")
GARBAGE = {"PROBE_MEMORY_BUDGET": "garbage"}
DAMAGED = ("is damaged: batch 1 (SHA-256 differs from the recorded one)", "probe resume", "probe verify")
NEWER = ("records run format 99, newer than this probe", "Upgrade probe")
KEPT_DAMAGED = ("is damaged (its aggregates.parquet): aggregates.parquet/merged.parquet (SHA-256 differs from the "
                "recorded one)", "probe resume")

COMMANDS = [
    # destinations: checked before any work, as root too
    Command("report on a read-only mount", lambda b: ["report", b.run, "--out", "{read_only}/report"],
            ("is not writable", "Read-only file system")),
    Command("compare on a read-only mount", lambda b: ["compare", b.run, b.run2, "--out", "{read_only}/compare"],
            ("is not writable", "Read-only file system")),
    Command("export on a read-only mount", lambda b: ["export", b.run, "--to", "{read_only}/rows.parquet"],
            ("is not writable", "Read-only file system")),
    Command("report below a file", lambda b: ["report", b.run, "--out", b.a_file / "report"],
            ("cannot be created", "is a file")),
    Command("compare below a file", lambda b: ["compare", b.run, b.run2, "--out", b.a_file / "compare"],
            ("cannot be created", "is a file")),
    Command("report into /proc", lambda b: ["report", b.run, "--out", "/proc/probe-report"], ("is not writable",)),
    Command("export into /proc", lambda b: ["export", b.run, "--to", "/proc/probe-rows.parquet"], ("is not writable",)),
    Command("vit training below a file", lambda b: ["vit", "train", "--epochs", "1", "--out", b.a_file / "vit"],
            ("cannot be created", "is a file")),
    # a write that fails half-way: one line, exit 74
    Command("report write fails", lambda b: ["report", b.run, "--out", "{tmp}/report"],
            ("Writing the report", "No space left on device (ENOSPC)"), code=74, fail=("probe.report.page", ENOSPC)),
    Command("compare write fails", lambda b: ["compare", b.run, b.run2, "--out", "{tmp}/compare"],
            ("Writing the comparison", "(ENOSPC)"), code=74, fail=("probe.report.compare.save", ENOSPC)),
    Command("export write fails", lambda b: ["export", b.run, "--to", "{tmp}/rows.parquet"],
            ("Writing the export", "(ENOSPC)"), code=74, fail=("probe.store.export.replace_atomically", ENOSPC)),
    # a byte changed inside a value of a part: every reader refuses the run by name
    Command("report of a flipped byte", lambda b: ["report", b.flipped, "--out", "{tmp}/report"], DAMAGED),
    Command("compare of a flipped byte", lambda b: ["compare", b.run, b.flipped, "--out", "{tmp}/compare"], DAMAGED),
    Command("export of a flipped byte", lambda b: ["export", b.flipped, "--to", "{tmp}/rows.parquet"], DAMAGED),
    # environment variables, before any work
    Command("resume with a bad memory budget", lambda b: ["resume", b.run, "--no-progress"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    Command("verify with a bad memory budget", lambda b: ["verify", b.run, "--sample", "0"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    # settings checked before the work, not after it
    Command("resume with an unknown report format", lambda b: ["resume", b.run, "--report", "--format", "svg"],
            ("Unknown figure format", "svg")),
    Command("vit training with a bad memory budget", lambda b: ["vit", "train", "--out", "{tmp}/vit"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    # what a run keeps (--keep): options of the other commands, and a damaged aggregates file refused by name
    Command("series with an unknown keep",
            lambda b: ["series", b.tiny, "--steps", "10", "--keep", "foo", "--out", "{tmp}/series", "--no-progress"],
            ("Unknown --keep foo",)),
    Command("report of a damaged aggregates file", lambda b: ["report", b.kept_flipped, "--out", "{tmp}/report"],
            KEPT_DAMAGED),
    Command("compare of a damaged aggregates file",
            lambda b: ["compare", b.run, b.kept_flipped, "--out", "{tmp}/compare"], KEPT_DAMAGED),
    Command("export of a damaged aggregates file",
            lambda b: ["export", b.kept_flipped, "--table", "aggregates", "--to", "{tmp}/a.parquet"], KEPT_DAMAGED),
    Command("export the rows of a run that kept none", lambda b: ["export", b.kept, "--to", "{tmp}/rows.parquet"],
            ("kept only its statistics", "--table aggregates")),
    Command("export the aggregates of a run of rows",
            lambda b: ["export", b.run, "--table", "aggregates", "--to", "{tmp}/a.parquet"], ("has no aggregates",)),
    # what a command is given, said as what it is
    Command("report of a file", lambda b: ["report", b.run / "manifest.json"],
            ("manifest.json is a file, not a run directory", "Pass the run directory")),
    Command("compare of a file", lambda b: ["compare", b.run, b.run / "manifest.json", "--out", "{tmp}/compare"],
            ("manifest.json is a file, not a run directory",)),
    Command("verify with a negative seed", lambda b: ["verify", b.run, "--seed", "-1"],
            ("--seed must be a whole number from 0",)),
    # a report and a comparison replace their folder whole: a folder of other files is not theirs to delete
    Command("report into a folder of other files", lambda b: ["report", b.run, "--out", b.other_files],
            ("holds files that are not a report", "replacing the folder and everything in it")),
    Command("compare into a folder of other files", lambda b: ["compare", b.run, b.run2, "--out", b.other_files],
            ("holds files that are not a comparison",)),
    # probe show: what to show, checked against the run before the model loads; then the model files
    Command("show a text the run does not have", lambda b: ["show", b.run, "--example", "9", "--layer", "0",
                                                            "--head", "0"],
            ("has no rows of text --example 9", "numbered 0 to 3")),
    Command("show a layer the run does not have", lambda b: ["show", b.run, "--example", "1", "--layer", "7",
                                                             "--head", "0"], ("no rows of --layer 7", "its layers are 0, 1")),
    Command("show a head the run does not have", lambda b: ["show", b.run, "--example", "1", "--layer", "1",
                                                            "--head", "9"], ("no rows of --head 9", "its heads are 0, 1, 2, 3")),
    Command("show a layer before the stack's first", lambda b: ["show", b.run, "--example", "1", "--layer", "-3",
                                                                "--head", "0"],
            ("--layer -3 is out of range: the model's self stack has 2 layers, 0 to 1 (or -2 to -1)",)),
    Command("show an attention type the run does not have",
            lambda b: ["show", b.run, "--example", "1", "--layer", "1", "--head", "0", "--attention-type", "cross"],
            ("no --attention-type cross rows", "its attention types are self")),
    Command("show a space the run does not have",
            lambda b: ["show", b.run, "--example", "1", "--layer", "1", "--head", "0", "--space", "key"],
            ("no --space key rows", "its spaces are hidden")),
    Command("show an alpha the run does not have",
            lambda b: ["show", b.run, "--example", "1", "--layer", "1", "--head", "0", "--alpha", "2"],
            ("no rows at --alpha 2", "its alphas are 1")),
    Command("show into a file that is not a png or a pdf",
            lambda b: ["show", b.run, "--example", "1", "--layer", "1", "--head", "0", "--out", "{tmp}/view.svg"],
            ("ends in .svg", "a .png or a .pdf")),
    Command("show of a file", lambda b: ["show", b.run / "manifest.json", "--example", "1", "--layer", "1", "--head",
                                         "0"], ("manifest.json is a file, not a run directory",)),
    Command("show a run whose model files changed",
            lambda b: ["show", b.changed_run, "--example", "1", "--layer", "1", "--head", "0"],
            ("The model files of", "changed since the run (config.json changed", "Restore the files in")),
    Command("series with a bad memory budget",
            lambda b: ["series", b.tiny, "--steps", "10", "--out", "{tmp}/series", "--no-progress"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    # a run of a newer format than this probe reads: refused by name, not misread
    Command("report of a newer run format", lambda b: ["report", b.newer, "--out", "{tmp}/report"], NEWER),
    Command("resume of a newer run format", lambda b: ["resume", b.newer, "--no-progress"], NEWER),
    Command("export of a newer run format", lambda b: ["export", b.newer, "--to", "{tmp}/rows.parquet"], NEWER),
    Command("status of a newer run format", lambda b: ["status", b.newer], NEWER),
]


#: refusals the readers made before the rows above were added: kept as guards, outside the table (whose
#: every row is a case that once failed)
GUARDS = [
    Command("report with a bad memory budget", lambda b: ["report", b.run, "--out", "{tmp}/report"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    Command("compare with a bad memory budget", lambda b: ["compare", b.run, b.run2, "--out", "{tmp}/compare"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
    Command("export with a bad memory budget", lambda b: ["export", b.run, "--to", "{tmp}/rows.parquet"],
            ("PROBE_MEMORY_BUDGET='garbage' is not a size",), env=GARBAGE),
]


def _flip_a_value_byte(path: Path) -> None:
    """Flip one byte in the middle of the first column's data pages: size, footer and row count unchanged."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).metadata.row_group(0).column(0)
    offset = column.data_page_offset + column.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(bad: Bad) -> Bad:
    """Two finished tiny runs (``b.run``, ``b.run2``), a copy of the first with a byte flipped in a
    value of its part 1 (``b.flipped``) and one whose manifest records a future format (``b.newer``)."""
    args = ["--samples", "4", "--batch-size", "2", "--max-length", "16", "--no-progress"]
    for attribute, seed in (("run", "0"), ("run2", "1")):
        out = bad.root / f"runs-{attribute}"
        result = CliRunner().invoke(app, ["run", str(bad.tiny), *args, "--seed", seed, "--out", str(out)])
        assert result.exit_code == 0, result.output
        (run_dir,) = out.iterdir()
        setattr(bad, attribute, run_dir)
    bad.flipped = Path(shutil.copytree(bad.run, bad.root / "flipped" / bad.run.name))
    model = Path(shutil.copytree(bad.tiny, bad.root / "changed-model"))  # a run of it, then its config changed
    result = CliRunner().invoke(app, ["run", str(model), *args, "--out", str(bad.root / "runs-changed")])
    assert result.exit_code == 0, result.output
    (bad.changed_run,) = (bad.root / "runs-changed").iterdir()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-6}))
    bad.other_files = bad.root / "notes"
    bad.other_files.mkdir()
    (bad.other_files / "draft.md").write_text("not a report\n")
    _flip_a_value_byte(bad.flipped / "deviations.parquet" / "part-000001.parquet")
    bad.newer = Path(shutil.copytree(bad.run, bad.root / "newer" / bad.run.name))
    manifest = json.loads((bad.newer / "manifest.json").read_text())
    (bad.newer / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    out = bad.root / "runs-kept"  # a run that kept aggregates, and a copy with a byte flipped in their file
    result = CliRunner().invoke(app, ["run", str(bad.tiny), *args, "--keep", "aggregates", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (bad.kept,) = out.iterdir()
    bad.kept_flipped = Path(shutil.copytree(bad.kept, bad.root / "kept-flipped" / bad.kept.name))
    _flip_a_value_byte(bad.kept_flipped / "aggregates.parquet" / "merged.parquet")
    return bad


@pytest.mark.parametrize("case", COMMANDS + GUARDS, ids=[case.id for case in COMMANDS + GUARDS])
def test_bad_command(case: Command, runs: Bad, tmp_path, monkeypatch):
    argv = [str(a).replace("{tmp}", str(tmp_path)) for a in case.argv(runs)]
    if any("{read_only}" in arg for arg in argv):
        (tmp_path / "read-only").mkdir()
    before = _tree(runs.root, tmp_path)
    if any("{read_only}" in arg for arg in argv):
        code, output = _in_read_only_mount(tmp_path, argv, case.env)
    else:
        if case.fail is not None:
            target, error = case.fail

            def fail(*args, **kwargs):
                raise error

            monkeypatch.setattr(target, fail)
        result = CliRunner().invoke(app, argv, env=case.env)
        code, output = result.exit_code, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), (output, result.exception)
    assert code == case.code and "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("probe report: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), output  # one line (after the report's progress)
    for fragment in case.fragments:
        assert fragment in output, output
    if case.code == 2:
        assert _tree(runs.root, tmp_path) == before, "a refused command left files behind"


# ------------------------------------------------------------------------------- the ways out work


def _probe_run(*args, env=None, timeout=300):
    """`probe run` in a fresh process, the Hub "reachable" at a closed port (no HF_HUB_OFFLINE)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    environment.update(HF_ENDPOINT="http://127.0.0.1:9", **(env or {}))
    environment["PYTHONPATH"] = str(ROOT) + os.pathsep + environment.get("PYTHONPATH", "")
    process = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "run", *map(str, args), "--no-progress"],
        capture_output=True, text=True, env=environment, timeout=timeout,
    )
    return process.returncode, process.stdout + process.stderr


def test_closed_hub_is_detected_at_once(tmp_path):
    """Without HF_HUB_OFFLINE, one short probe finds the Hub unreachable (here: a closed port) and the
    run says so, instead of retrying a hub id for ~28 s."""
    code, output = _probe_run("some-org/some-model", "--out", tmp_path / "runs")
    assert code == 2, output
    assert "No connection to the Hugging Face Hub (no answer from http://127.0.0.1:9" in output
    assert "pass a local directory" in output
    assert "Retrying" not in output and "Traceback" not in output
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_closed_hub_still_runs_a_cached_model(tiny_bert_dir, tmp_path):
    """A hub id whose files are in the Hugging Face cache runs while the Hub is unreachable: the probe
    switches the libraries to offline mode instead of rejecting the id."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repository = tmp_path / "hub" / "models--some-org--tiny-bert"
    shutil.copytree(tiny_bert_dir, repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    code, output = _probe_run("some-org/tiny-bert", "--samples", 2, "--out", tmp_path / "runs",
                              env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert code == 0, output
    (run_dir,) = (tmp_path / "runs").iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["model"]["id"] == "some-org/tiny-bert"


def test_tokenizer_option_supplies_a_missing_tokenizer(bad, tmp_path):
    """The way out the "no tokenizer files" message names: --tokenizer gives the same rows as the
    model with its tokenizer beside it."""
    runner = CliRunner()
    common = ["--samples", "3", "--no-progress"]
    with_option = runner.invoke(app, ["run", str(bad.no_tokenizer), "--tokenizer", str(bad.tiny), "--out",
                                      str(tmp_path / "a"), *common])
    beside = runner.invoke(app, ["run", str(bad.tiny), "--out", str(tmp_path / "b"), *common])
    assert with_option.exit_code == 0 and beside.exit_code == 0, (with_option.output, beside.output)
    import pandas as pd

    (a,), (b,) = (tmp_path / "a").iterdir(), (tmp_path / "b").iterdir()
    columns = ["example", "layer", "head", "query", "rel_deviation"]
    frame_a = pd.read_parquet(a / "deviations.parquet")[columns].sort_values(columns[:4]).reset_index(drop=True)
    frame_b = pd.read_parquet(b / "deviations.parquet")[columns].sort_values(columns[:4]).reset_index(drop=True)
    pd.testing.assert_frame_equal(frame_a, frame_b)
    assert json.loads((a / "manifest.json").read_text())["model"]["tokenizer"] == str(bad.tiny)


def test_random_init_needs_no_weights(bad, tmp_path):
    """--init random builds the architecture from config.json: a directory without weights is fine."""
    result = CliRunner().invoke(app, ["run", str(bad.no_weights), "--init", "random", "--samples", "2",
                                      "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    (run_dir,) = tmp_path.iterdir()
    assert json.loads((run_dir / "manifest.json").read_text())["model"]["init"] == "random"


@pytest.mark.parametrize(
    "text,expected",
    [("4GB", 4 * 10**9), ("4 gb", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("100B", 100),
     # the spellings PROBE_MEMORY_BUDGET took: plain bytes, one-letter binary units
     ("4096", 4096), ("2G", 2 * 2**30), ("600m", 600 * 2**20), ("1k", 1024),
     # the spellings --max-memory took: scientific notation, with or without a unit
     ("1e9B", 10**9), ("1e9", 10**9), ("2.5e3 KB", 2_500_000)],
)
def test_one_size_grammar_for_the_option_and_the_variable(text, expected, monkeypatch):
    """--max-memory and PROBE_MEMORY_BUDGET read sizes by one grammar: every spelling either took is
    read the same by both."""
    from probe.core.arguments import parse_size
    from probe.core.environment import memory_budget_bytes

    assert parse_size(text) == expected
    monkeypatch.setenv("PROBE_MEMORY_BUDGET", text)
    assert memory_budget_bytes(1) == expected


def test_alpha_lists():
    from probe.core.arguments import parse_numbers

    assert parse_numbers("0.25, 0.5,1", "alpha") == (0.25, 0.5, 1.0)
    assert parse_numbers("2", "alpha") == (2.0,)
