"""Texts to run through the model: the embedded corpus, local files, or a hub dataset.

Everything goes through the ``datasets`` library except the embedded corpus, which ships inside the
package so that ``probe run <local model>`` works offline.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import repeat
from importlib import resources
from pathlib import Path

from .errors import ProbeError

#: Local file endings and the ``datasets`` builder that reads them.
LOCAL_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}


@dataclass
class DatasetSpec:
    """Where texts come from.  ``name=None`` means the embedded corpus."""

    name: str | None = None
    config: str | None = None
    split: str = "train"
    column: str = "text"
    target_column: str | None = None
    samples: int | None = None

    def describe(self) -> str:
        if self.name is None:
            return "embedded probe corpus"
        parts = [self.name] + ([self.config] if self.config else []) + [self.split]
        return "/".join(parts) + f" [{self.column}]"


@dataclass
class Texts:
    """The texts of a run, with their indices in the source and a content hash."""

    texts: list[str]
    indices: list[int]
    targets: list[str] | None = None
    skipped_empty: int = 0
    spec: DatasetSpec = field(default_factory=DatasetSpec)

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for i, text in zip(self.indices, self.texts):
            digest.update(f"{i}\0{text}\0".encode())
        for target in self.targets or []:
            digest.update(f"{target}\0".encode())
        return digest.hexdigest()


def embedded_corpus() -> list[str]:
    """The few hundred English sentences shipped in ``probe/data/corpus.txt``."""
    text = resources.files("probe").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def _load_dataset(spec: DatasetSpec, streaming: bool):
    """The ``datasets`` dataset behind ``spec``; streamed when only the first rows are needed (so that
    ``--samples 200`` of a large hub dataset does not download the whole split)."""
    import datasets

    path = Path(spec.name).expanduser()
    try:
        if path.exists():
            files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
            if not files:
                raise ProbeError(
                    f"No data files in '{path}'. Give a .txt, .jsonl, .csv or .parquet file (or a folder of them)."
                )
            suffix = files[0].suffix
            if suffix not in LOCAL_BUILDERS:
                raise ProbeError(
                    f"Unsupported data file '{files[0]}'. Use .txt (one text per line), .jsonl, .csv or .parquet."
                )
            return datasets.load_dataset(
                LOCAL_BUILDERS[suffix], data_files=[str(f) for f in files], split="train", streaming=streaming
            )
        return datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=streaming)
    except ProbeError:
        raise
    except ValueError as error:
        if path.exists() and "corresponds to no data" in str(error):  # datasets' word for 0 rows
            raise ProbeError(f"The dataset '{spec.name}' has no non-empty texts: the file has no rows.") from None
        raise _load_error(spec, path, error) from None
    except Exception as error:  # datasets raises many types (FileNotFound, ConnectionError, ...)
        raise _load_error(spec, path, error) from None


def _load_error(spec: DatasetSpec, path: Path, error: Exception) -> ProbeError:
    return ProbeError(
        f"Could not load dataset '{spec.name}'"
        + (f" (config '{spec.config}', split '{spec.split}')" if not path.exists() else "")
        + f": {error}. Pass a local .txt/.jsonl/.csv/.parquet file, or check the dataset name, config, "
        "split and your connection."
    )


def load_texts(spec: DatasetSpec) -> Texts:
    """Load the texts (and targets, if asked) described by ``spec``; empty texts are skipped."""
    if spec.samples is not None and spec.samples < 1:
        raise ProbeError(f"--samples must be at least 1, got {spec.samples}.")
    if spec.name is None:
        if spec.target_column:
            raise ProbeError("--target-column needs --dataset: the embedded corpus has only a text column.")
        rows = ((text, None) for text in embedded_corpus())
    else:
        streaming = spec.samples is not None
        dataset = _load_dataset(spec, streaming)
        columns = dataset.column_names
        if columns is None:  # a stream that does not declare its features: look at its first row
            first = next(iter(dataset), None)
            columns = [] if first is None else list(first)
        for wanted, option in ((spec.column, "--column"), (spec.target_column, "--target-column")):
            if wanted is not None and columns and wanted not in columns:
                raise ProbeError(
                    f"Dataset '{spec.name}' has no column '{wanted}'. Available columns: {', '.join(columns)}. "
                    f"Choose one with {option}."
                )
        if streaming:
            rows = ((row.get(spec.column), row.get(spec.target_column)) for row in dataset)
        else:
            rows = zip(dataset[spec.column], dataset[spec.target_column] if spec.target_column else repeat(None))

    texts, indices, targets, skipped = [], [], [], 0
    try:
        for i, (text, target) in enumerate(rows):  # (text, target) pairs; a stream is read only this far
            if not isinstance(text, str) or not text.strip():
                skipped += 1
                continue
            texts.append(text)
            indices.append(i)
            targets.append(target if isinstance(target, str) or target is None else str(target))
            if spec.samples is not None and len(texts) >= spec.samples:
                break
    except Exception as error:  # a stream fails while it is read (connection lost, a corrupt file)
        raise _load_error(spec, Path(spec.name or ""), error) from None
    if not texts:
        raise ProbeError(
            f"The dataset {spec.describe()} has no non-empty texts"
            + (f" ({skipped} empty rows skipped)" if skipped else "")
            + ". Choose another dataset, split or column."
        )
    return Texts(texts=texts, indices=indices, targets=targets if spec.target_column else None,
                 skipped_empty=skipped, spec=spec)
