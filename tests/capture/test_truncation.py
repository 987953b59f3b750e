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
