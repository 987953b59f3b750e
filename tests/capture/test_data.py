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


# --------------------------------------------------------------------------------------------------
# --samples random:N


@pytest.fixture
def numbered(tmp_path):
    """The same 40 texts as a .txt file (a blank line after every fifth) and as JSON lines (an empty row there)."""
    texts = [f"text number {i}" for i in range(40)]
    lines = [line for i, text in enumerate(texts) for line in ([text, ""] if i % 5 == 4 else [text])]
    txt, jsonl = tmp_path / "numbered.txt", tmp_path / "numbered.jsonl"
    txt.write_text("\n".join(lines) + "\n")
    import json

    jsonl.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return texts, lines, txt, jsonl


@pytest.mark.parametrize("kind", ["txt read in pieces", "txt", "jsonl"])
def test_a_random_sample_is_drawn_from_every_text_by_the_seed(numbered, kind):
    """``random:N`` takes the texts at N positions drawn without replacement by numpy.random.default_rng(seed)
    among the non-empty texts, in their order, with their indices in the source (blank lines counted)."""
    import numpy as np

    texts, lines, txt, jsonl = numbered
    path, keep = {"txt read in pieces": (txt, 4096), "txt": (txt, None), "jsonl": (jsonl, None)}[kind]
    got = load_texts(DatasetSpec(name=str(path), samples=7, sample_seed=11), keep)
    positions = sorted(np.random.default_rng(11).choice(len(texts), size=7, replace=False))
    assert got.texts == [texts[p] for p in positions]
    assert got.indices == [lines.index(texts[p]) for p in positions]
    assert got.texts != texts[:7]  # not the first seven
    first = load_texts(DatasetSpec(name=str(path), samples=7), keep)
    assert first.texts == texts[:7] and first.sha256 != got.sha256
    again = load_texts(DatasetSpec(name=str(path), samples=7, sample_seed=11), keep)
    assert again.sha256 == got.sha256  # what resume compares
    other = load_texts(DatasetSpec(name=str(path), samples=7, sample_seed=12), keep)
    assert other.texts != got.texts
    every = load_texts(DatasetSpec(name=str(path), samples=100, sample_seed=11), keep)
    assert every.texts == texts  # more than there are: all of them


def test_a_random_sample_of_the_embedded_corpus():
    import numpy as np

    corpus = embedded_corpus()
    got = load_texts(DatasetSpec(samples=5, sample_seed=3))
    positions = sorted(np.random.default_rng(3).choice(len(corpus), size=5, replace=False))
    assert got.texts == [corpus[p] for p in positions] and got.indices == positions
    assert DatasetSpec(samples=5, sample_seed=3).describe() == "embedded probe corpus, a random sample of 5 drawn with seed 3"


@pytest.mark.parametrize("value, parsed", [(None, (None, False)), (12, (12, False)), ("12", (12, False)),
                                           ("random:12", (12, True)), (" random : 3 ", (3, True)),
                                           ("0", (0, False)), ("random:-2", (-2, True))])
def test_samples_are_a_count_or_random_count(value, parsed):
    from probe.core.arguments import samples as parse_samples

    assert parse_samples(value) == parsed


@pytest.mark.parametrize("value", ["random", "random:", "first:3", "3.5", "random:3.5", "", True, 2.0])
def test_other_samples_are_refused(value):
    from probe.core.arguments import samples as parse_samples

    with pytest.raises(ProbeError, match=r"samples= takes N \(the first N texts\) or random:N"):
        parse_samples(value)
