"""Texts from local files, with and without --samples (which streams), and their bad-input errors."""

from __future__ import annotations

import pytest

from probe.capture.data import DatasetSpec, embedded_corpus, load_texts
from probe.core.errors import ProbeError


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        '{"source": "first text", "target": "erste"}\n'
        '{"source": "", "target": "leer"}\n'
        '{"source": "third text", "target": 3}\n'
        '{"source": "fourth text", "target": "vierte"}\n'
    )
    return path


@pytest.mark.parametrize("samples", [None, 2, 10])
def test_texts_targets_and_indices(jsonl, samples):
    texts = load_texts(DatasetSpec(name=str(jsonl), column="source", target_column="target", samples=samples))
    expected = [("first text", "erste", 0), ("third text", "3", 2), ("fourth text", "vierte", 3)][: samples or 3]
    assert list(zip(texts.texts, texts.targets, texts.indices)) == expected
    assert texts.skipped_empty == 1


@pytest.mark.parametrize("samples", [None, 1])
def test_missing_column_lists_the_available_ones(jsonl, samples):
    with pytest.raises(ProbeError, match=r"no column 'text'\. Available columns: source, target"):
        load_texts(DatasetSpec(name=str(jsonl), samples=samples))


@pytest.mark.parametrize("samples", [None, 3])
def test_empty_file(tmp_path, samples):
    path = tmp_path / "empty.csv"
    path.write_text("text\n\n \n")
    with pytest.raises(ProbeError, match="no non-empty texts"):
        load_texts(DatasetSpec(name=str(path), samples=samples))


def test_embedded_corpus_and_hash():
    corpus = embedded_corpus()
    assert len(corpus) == 300 and all(line.strip() for line in corpus)
    first = load_texts(DatasetSpec(samples=5))
    assert first.texts == corpus[:5] and first.targets is None
    assert first.sha256 == load_texts(DatasetSpec(samples=5)).sha256 != load_texts(DatasetSpec(samples=6)).sha256
