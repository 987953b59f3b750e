"""Texts cut to what --max-length needs: the tokens a run keeps are those of the whole text, the count of
truncated texts is that of a full tokenization, and the run's final lines say it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from probe.capture.data import Texts
from probe.capture.truncation import cut_text, cut_texts
from probe.cli import app


@pytest.fixture(scope="module")
def tokenizer(tiny_bert_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_bert_dir)


def long_texts() -> list[str]:
    from probe.capture.data import embedded_corpus

    corpus = embedded_corpus()
    return [
        " ".join(corpus) * 3,  # ~100,000 characters of sentences
        "x" * 5_000 + " " + " ".join(corpus[:40]),  # a word longer than any token budget first
        "\n\n".join(corpus[:60]),  # line breaks as the whitespace
        "short text",
        "ünïcödé wörds, " * 2_000,
    ]


@pytest.mark.parametrize("max_length", [8, 32, 128])
def test_a_cut_text_keeps_the_tokens_of_the_whole_text(tokenizer, max_length):
    special = len(tokenizer("")["input_ids"])
    for text in long_texts():
        prefix, truncated = cut_text(tokenizer, text, max_length, special)
        assert text.startswith(prefix)
        whole = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        assert tokenizer(prefix, truncation=True, max_length=max_length)["input_ids"] == whole
        assert truncated == (len(tokenizer(text)["input_ids"]) > max_length)
        if len(text) > 20_000:
            assert len(prefix) < len(text) / 10  # the long ones are cut well short of their length


def test_cut_texts_counts_the_truncated_texts_and_keeps_the_hash(tokenizer):
    texts = long_texts()
    read = Texts(texts=texts, indices=list(range(len(texts))))
    cut = cut_texts(read, tokenizer, 16)
    assert cut.sha256 == read.sha256  # what resume compares: the texts as read
    assert cut.truncated == sum(len(tokenizer(text)["input_ids"]) > 16 for text in texts) == 4
    assert cut_texts(cut, tokenizer, 16) is cut


def test_the_final_lines_say_how_many_texts_were_cut(tiny_bert_dir, tmp_path):
    texts = tmp_path / "texts.txt"
    lines = ["one two", "a longer text with more words than eight tokens allow, surely", "x " * 2_000]
    texts.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["run", str(tiny_bert_dir), "--dataset", str(texts), "--max-length", "8",
                                      "--out", str(tmp_path / "runs"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "texts: 3 (" in result.output and "; 2 cut to 8 tokens (--max-length)" in result.output, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    dataset = json.loads(Path(run_dir / "manifest.json").read_text())["dataset"]
    assert dataset["truncated_examples"] == 2 and dataset["max_length"] == 8


CONTENTS = [
    "one\ntwo\n",
    "no line end at the end",
    "crlf\r\nlines\r\nand a lone\rreturn\n",
    "\n\n  \nblank lines first\n\t\n",
    "  leading spaces kept\ntrailing spaces kept  \n",
    "separators \u2028 and \x0c and \x85 stay inside a line\n",
    "a\n" * 3 + "x" * 50_000 + " long\n" + "b\n",
    "\ufeffa byte order mark\n",
]


@pytest.mark.parametrize("content", CONTENTS, ids=range(len(CONTENTS)))
@pytest.mark.parametrize("samples", [None, 2])
def test_text_files_read_in_pieces_are_the_texts_datasets_reads(tmp_path, content, samples, monkeypatch):
    """The piecewise reader against `datasets`' text builder (the reader without ``keep_chars``): the same
    texts, indices, skipped rows and hash; with ``keep_chars`` each text is the same text's prefix and the hash
    is still that of the whole texts."""
    import probe.capture.data as data
    from probe.capture.data import load_texts
    from probe.core.config import DatasetSpec

    monkeypatch.setattr(data, "TEXT_PIECE", 7)  # many pieces per line
    file = tmp_path / "texts.txt"
    file.write_bytes(content.encode("utf-8"))
    spec = DatasetSpec(name=str(file), samples=samples)
    reference = load_texts(spec)
    assert reference.read_sha256 is None  # read by datasets
    whole = load_texts(spec, keep_chars=10**9)
    assert (whole.texts, whole.indices, whole.skipped_empty) == (reference.texts, reference.indices,
                                                                 reference.skipped_empty)
    assert whole.sha256 == reference.sha256
    short = load_texts(spec, keep_chars=5)
    assert short.texts == [text[:5] for text in reference.texts] and short.sha256 == reference.sha256


def test_a_folder_of_text_files_reads_as_datasets_reads_it(tmp_path):
    from probe.capture.data import load_texts
    from probe.core.config import DatasetSpec

    (tmp_path / "a.txt").write_text("first\n\nsecond")
    (tmp_path / "b.txt").write_text("third\n")
    spec = DatasetSpec(name=str(tmp_path))
    reference, read = load_texts(spec), load_texts(spec, keep_chars=1000)
    assert (read.texts, read.indices, read.sha256) == (reference.texts, reference.indices, reference.sha256)
