"""Texts to run through the model: the embedded corpus, local files, or a hub dataset.

Everything goes through the ``datasets`` library except the embedded corpus, which ships inside the
package so that ``probe run <local model>`` works offline.  Problems are reported by probe, naming the
file, the line or row and what was found there: when ``datasets`` cannot read a local file,
:func:`diagnose_file` reads it again to say where and why.
"""

from __future__ import annotations

import csv
import hashlib
import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from importlib import resources
from itertools import repeat
from pathlib import Path

from probe.capture.hub import check_hub_name, hub_reachable, no_connection
from probe.core.config import DatasetSpec
from probe.core.errors import ProbeError, first_line
from probe.core.spelling import option

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
class Texts:
    """The texts of a run, with their indices in the source and a content hash."""

    texts: list[str]
    indices: list[int]
    targets: list[str] | None = None
    skipped_empty: int = 0
    spec: DatasetSpec = field(default_factory=DatasetSpec)
    #: the hash of the texts as read, kept when they are cut to ``--max-length`` (:mod:`probe.capture.truncation`)
    read_sha256: str | None = None
    #: the ``--max-length`` the texts were cut for (None: as read), and how many of them it truncates
    cut_to: int | None = None
    truncated: int | None = None

    @property
    def sha256(self) -> str:
        """The texts' hash (with their indices and targets), as read: cutting them does not change it."""
        if self.read_sha256 is not None:
            return self.read_sha256
        digest = hashlib.sha256()
        for i, text in zip(self.indices, self.texts):
            digest.update(f"{i}\0{text}\0".encode())
        for target in self.targets or []:
            digest.update(f"{target}\0".encode())
        return digest.hexdigest()


def embedded_corpus() -> list[str]:
    """The few hundred English sentences shipped in ``probe/capture/corpus.txt``."""
    text = resources.files("probe.capture").joinpath("corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def local_files(path: Path) -> list[Path]:
    """The data files behind a local ``--dataset`` (a file, or a folder of files of one kind)."""
    files = sorted(p for p in path.iterdir() if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ProbeError(
            f"No data files in the folder '{path}'. Give a .txt, .jsonl, .csv or .parquet file (or a folder of them)."
        )
    for file in files:
        if file.suffix not in LOCAL_BUILDERS:
            raise ProbeError(
                f"Unsupported data file '{file}' (ending '{file.suffix}'). Use .txt (one text per line), "
                ".jsonl, .json, .csv or .parquet."
            )
        if file.is_dir():
            raise ProbeError(f"'{file}' is a folder, not a data file. Pass the file or the folder holding it.")
        try:
            size = file.stat().st_size
            with file.open("rb"):
                pass
        except OSError as error:
            raise ProbeError(f"Cannot read the dataset file '{file}': {error.strerror}.") from None
        if size == 0:
            raise ProbeError(f"The dataset file '{file}' is empty (0 bytes). Pass a file with texts.")
    builders = {LOCAL_BUILDERS[file.suffix] for file in files}
    if len(builders) > 1:
        raise ProbeError(
            f"The folder '{path}' mixes data files of different kinds ({', '.join(sorted({f.suffix for f in files}))}). "
            "Put one kind of file in it, or pass a single file."
        )
    return files


@contextmanager
def _quiet_datasets():
    """Silence ``datasets``' own logging and progress bars while it reads local files: probe reports
    problems itself (see :func:`diagnose_file`)."""
    import datasets
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _load_dataset(spec: DatasetSpec, streaming: bool):
    """The ``datasets`` dataset behind ``spec``; streamed when only the first rows are needed (so that
    ``--samples 200`` of a large hub dataset does not download the whole split)."""
    import datasets

    path = spec.local_path
    if path is not None:
        files = local_files(path)
        for file in files:
            problem = _first_json_value_problem(file, spec.text_column)
            if problem:
                raise ProbeError(f"Cannot read the dataset file '{file}': {problem}. Fix the file or pass another one.")
        try:
            return datasets.load_dataset(
                LOCAL_BUILDERS[files[0].suffix], data_files=[str(f) for f in files], split="train", streaming=streaming
            )
        except ValueError as error:
            if "corresponds to no data" in str(error):  # datasets' word for 0 rows
                raise ProbeError(
                    f"The dataset {spec.describe()} has no non-empty texts (it has no rows: only blank lines?). "
                    "Pass a file with texts."
                ) from None
            raise
    if Path(spec.name).suffix in LOCAL_BUILDERS:
        raise ProbeError(f"The dataset file '{spec.name}' does not exist ({option('dataset')}). Check the path.")
    check_hub_name(spec.name, "dataset", option("dataset"), "wikitext")
    reachable = hub_reachable()
    try:
        return datasets.load_dataset(spec.name, spec.config, split=spec.split_name, streaming=streaming)
    except Exception as error:  # datasets raises many types (FileNotFound, ConnectionError, ...)
        if not reachable:
            raise no_connection(spec.name, "dataset", "file (.txt, .jsonl, .csv or .parquet)") from None
        raise _load_error(spec, error) from None


def _load_error(spec: DatasetSpec, error: Exception) -> ProbeError:
    return ProbeError(
        f"Could not load the hub dataset '{spec.name}' (config '{spec.config}', split '{spec.split_name}'): "
        f"{first_line(error)}. Check the dataset name, {option('config')} and {option('split')}, or pass a local "
        ".txt/.jsonl/.csv/.parquet file."
    )




# --------------------------------------------------------------------------------------------------
# what is wrong with a local file that datasets could not read


def unreadable(spec: DatasetSpec, files: list[Path], error: Exception) -> ProbeError:
    """A message naming the file, the line and what was found there, where probe can tell."""
    for file in files:
        problem = diagnose_file(file, spec.text_column)
        if problem:
            return ProbeError(f"Cannot read the dataset file '{file}': {problem}. Fix the file or pass another one.")
    cause = error.__cause__ or error.__context__ or error
    return ProbeError(
        f"Cannot read the dataset '{spec.name}': {first_line(cause)}. Check that it is a valid "
        f"{', '.join(sorted({f.suffix for f in files}))} file."
    )


def _excerpt(text: str, width: int = 60) -> str:
    text = text.strip()
    return repr(text if len(text) <= width else text[:width] + "...")


class _Found(Exception):
    """A problem found while reading a file line by line (its message is the description)."""


def _lines(file: Path):
    """``(number, text)`` of each line of ``file``, read one line at a time; a line that is not UTF-8
    raises :class:`_Found`."""
    with file.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _Found(
                    f"line {number} is not UTF-8 text (byte 0x{raw[error.start]:02x}); save the file as UTF-8"
                ) from None


def diagnose_file(file: Path, column: str) -> str | None:
    """The first problem in a local data file, in words (``None`` if none is found).  Reads the file
    once, one line (parquet: one batch) at a time."""
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            for _ in pq.ParquetFile(file).iter_batches():
                pass
        except Exception as error:  # pyarrow: ArrowInvalid, OSError, ...
            return f"it is not a readable parquet file ({first_line(error)})"
        return None
    try:
        if file.suffix == ".json":
            return _json_document_problem(file, column)
        if file.suffix == ".jsonl":
            return _json_lines_problem(_lines(file), column)
        if file.suffix == ".csv":
            return _csv_problem(_lines(file))
        for _ in _lines(file):
            pass
    except _Found as found:
        return str(found)
    return None


def _first_json_value_problem(file: Path, column: str) -> str | None:
    """A JSON file whose first value is ``null`` crashes the process inside pyarrow's JSON reader
    (pyarrow 26: a segmentation fault, found by tests/capture/test_fuzz.py), which ``datasets`` calls first: so it
    is refused before.  Reads the file's first non-blank line only."""
    if file.suffix not in (".json", ".jsonl"):
        return None
    try:
        for number, line in _lines(file):
            if line.strip():
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    return None  # a document over several lines, or bad JSON: diagnosed if datasets fails
                if value is None:
                    return f"line {number} is a JSON null, not an object like {{\"{column}\": \"...\"}}"
                return None
    except _Found as found:
        return str(found)
    return None


def _json_document_problem(file: Path, column: str) -> str | None:
    """A .json file holds one JSON document (read whole, as ``datasets`` does) or JSON lines."""
    first = next((line for _, line in _lines(file) if line.strip()), "")
    try:
        json.loads(first)
        return _json_lines_problem(_lines(file), column)  # its first line is a whole record: JSON lines
    except json.JSONDecodeError:
        pass
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        return f"it is not valid JSON at line {error.lineno}, column {error.colno} ({error.msg})"
    return None


def _json_lines_problem(lines, column: str) -> str | None:
    records = 0
    for number, line in lines:
        if not line.strip():
            continue
        records += 1
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            return f"line {number} is not valid JSON ({error.msg} at column {error.colno}): found {_excerpt(line)}"
        if not isinstance(record, dict):
            return f"line {number} is a JSON {type(record).__name__}, not an object like {{\"{column}\": \"...\"}}"
        value = record.get(column)
        if value is not None and not isinstance(value, str):
            return f"line {number} has {column!r}: {_excerpt(json.dumps(value))}, which is not text"
    return None if records else "it has no JSON lines (only blank lines)"


def _csv_problem(lines) -> str | None:
    reader = csv.reader(line for _, line in lines)
    try:
        header = next(reader, None)
        if header is None:
            return "it has no header line"
        for row in reader:
            if row and len(row) != len(header):
                return (
                    f"line {reader.line_num} has {len(row)} fields, the header has {len(header)} "
                    f"({', '.join(header)}); quote fields that contain commas"
                )
    except csv.Error as error:
        return f"line {reader.line_num} is not valid CSV ({error})"
    return None


# --------------------------------------------------------------------------------------------------
# texts


def _check_text_feature(spec: DatasetSpec, dataset, column: str) -> None:
    """A column that is declared as something other than text (a parquet column of ints, lists)."""
    import datasets

    feature = (getattr(dataset, "features", None) or {}).get(column)
    if feature is None or isinstance(feature, datasets.Json):  # undeclared or mixed: checked row by row
        return
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null"):
        return
    if isinstance(feature, datasets.Value):
        kind = f"{feature.dtype} values"
    elif isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence, list)):
        kind = "lists"
    elif isinstance(feature, dict):
        kind = "records"
    else:
        kind = f"{type(feature).__name__} values"
    text_columns = [
        name for name, f in dataset.features.items()
        if isinstance(f, datasets.Value) and f.dtype in ("string", "large_string")
    ]
    raise ProbeError(
        f"Column '{column}' of the dataset '{spec.name}' holds {kind}, not text. "
        + (f"Text columns: {', '.join(text_columns)}; choose one with {option('column')}." if text_columns
           else "It has no text column.")
    )


def _dataset_rows(spec: DatasetSpec):
    """(text, target) pairs of a local file or hub dataset, after checking that the columns exist
    and hold text; a stream is read only as far as the caller iterates (the first N texts of ``--samples N``;
    a random sample reads them all)."""
    streaming = spec.samples is not None and spec.sample_seed is None
    dataset = _load_dataset(spec, streaming)
    columns = dataset.column_names
    if columns is None:  # a stream that does not declare its features: look at its first row
        first = next(iter(dataset), None)
        columns = [] if first is None else list(first)
    for wanted, name in ((spec.text_column, "column"), (spec.target_column, "target_column")):
        if wanted is not None and columns and wanted not in columns:
            raise ProbeError(
                f"Dataset '{spec.name}' has no column '{wanted}'. Available columns: {', '.join(columns)}. "
                f"Choose one with {option(name)}."
            )
    _check_text_feature(spec, dataset, spec.text_column)
    if streaming:
        yield from ((row.get(spec.text_column), row.get(spec.target_column)) for row in dataset)
    else:
        yield from zip(dataset[spec.text_column], dataset[spec.target_column] if spec.target_column else repeat(None))


#: the character no text holds: a file with it is binary data (a file of zero bytes, an image, a database)
NUL = "\x00"


def nul_problem(where: str) -> str:
    """What to say of a text (at ``where``: "line 3", "row 2") that holds :data:`NUL` characters."""
    return (f"{where} holds NUL characters (0x00), which no text holds: it is binary data, refused as a file "
            "that is not UTF-8 is. Pass texts (.txt, .jsonl, .csv or .parquet)")


#: characters read from a text file at a time: a long line is read in pieces of this size
TEXT_PIECE = 1 << 20


def _read_text_files(spec: DatasetSpec, files: list[Path], keep_chars: int, *, limit: int | None = None,
                     lines: set[int] | None = None) -> Texts:
    """The texts of local ``.txt`` files, one per line, as ``datasets``' text builder reads them (UTF-8,
    universal newlines, split at each line end), read in pieces of :data:`TEXT_PIECE` characters: each text
    keeps its first ``keep_chars`` characters only, so that a long line costs no more memory than that,
    while the texts' hash (:attr:`Texts.sha256`) is computed over every character as read.  ``limit``: stop
    after that many texts; ``lines``: read only the lines of these indices (counted over the files from 0,
    blank lines included), the others are only counted."""
    digest = hashlib.sha256()
    texts, indices, skipped, index = [], [], 0, 0
    kept: list[str] = []
    pending: list[str] = []  # a line's leading whitespace, until it shows whether the line is blank
    state = {"length": 0, "blank": True, "open": False}

    def add(piece: str) -> None:
        state["open"] = True
        if state["blank"]:
            if not piece.strip():
                pending.append(piece)
                return
            state["blank"] = False
            if lines is not None and index not in lines:
                return
            digest.update(f"{index}\0".encode())
            pieces, pending[:] = [*pending, piece], []
        elif lines is not None and index not in lines:
            return
        else:
            pieces = [piece]
        for part in pieces:
            digest.update(part.encode())
            room = keep_chars - state["length"]
            if room > 0:
                kept.append(part[:room])
                state["length"] += min(room, len(part))

    def end_line() -> None:
        nonlocal index, skipped
        if state["blank"]:
            skipped += 1
        elif lines is None or index in lines:
            digest.update(b"\0")
            texts.append("".join(kept))
            indices.append(index)
        index += 1
        kept.clear()
        pending.clear()
        state.update(length=0, blank=True, open=False)

    try:
        for file in files:
            line = 1
            with open(file, encoding="utf-8") as handle:  # universal newlines, as datasets opens it
                while piece := handle.readline(TEXT_PIECE):
                    ends = piece.endswith("\n")
                    if NUL in piece:
                        raise ProbeError(f"Cannot read the dataset file '{file}': {nul_problem(f'line {line}')}.")
                    line += ends
                    add(piece[:-1] if ends else piece)
                    if ends:
                        end_line()
                        if limit is not None and len(texts) >= limit:
                            break
                if state["open"]:  # the last line, without a line end
                    end_line()
            if limit is not None and len(texts) >= limit:
                break
    except (UnicodeDecodeError, OSError) as error:
        raise unreadable(spec, files, error) from None
    return Texts(texts=texts, indices=indices, skipped_empty=skipped, spec=spec, read_sha256=digest.hexdigest())


def load_texts(spec: DatasetSpec, keep_chars: int | None = None) -> Texts:
    """Load the texts (and targets, if asked) described by ``spec``; empty texts are skipped.

    A value that is neither text nor missing (a number, a list) is an error naming its row.  ``keep_chars``:
    local ``.txt`` files are read in pieces, and each text keeps only its first ``keep_chars`` characters
    (:func:`_read_text_files`: memory does not grow with a line's length; the hash is of the whole texts).
    """
    if spec.samples is not None and spec.samples < 1:
        raise ProbeError(f"{option('samples')} must be at least 1, got {spec.samples}.")
    drawn = spec.samples is not None and spec.sample_seed is not None  # a random sample: every text is read
    if keep_chars is not None and spec.local_path is not None and spec.target_column is None:
        files = local_files(spec.local_path)
        if files[0].suffix == ".txt":
            if drawn:  # which lines are texts first (one character kept of each), then only the drawn ones
                every = _read_text_files(spec, files, 1).indices
                lines = {every[i] for i in sample_positions(len(every), spec.samples, spec.sample_seed)}
                texts = _read_text_files(spec, files, keep_chars, lines=lines)
            else:
                texts = _read_text_files(spec, files, keep_chars, limit=spec.samples)
            if texts.texts:
                return texts
            # no text: the reader below says why, as for any file
    if spec.name is None:
        if spec.target_column:
            raise ProbeError(f"{option('target_column')} needs {option('dataset')}: the embedded corpus has only a "
                             "text column.")
        rows = ((text, None) for text in embedded_corpus())
    else:
        rows = _dataset_rows(spec)

    local = spec.local_path
    texts, indices, targets, skipped = [], [], [], 0
    try:
        with _quiet_datasets() if local is not None else nullcontext():
            for i, (text, target) in enumerate(rows):  # a stream is read only this far
                if text is not None and not isinstance(text, str):
                    raise ProbeError(
                        f"Row {i} (counting from 0) of the dataset '{spec.name}' has {text!r} "
                        f"({type(text).__name__}) in column '{spec.text_column}', which is not text. "
                        f"Fix the data or choose a text column with {option('column')}."
                    )
                if text is None or not text.strip():
                    skipped += 1
                    continue
                if NUL in text:
                    raise ProbeError(f"The dataset '{spec.name}' cannot be read as text: "
                                     f"{nul_problem(f'row {i} (counting from 0)')}.")
                texts.append(text)
                indices.append(i)
                targets.append(target if isinstance(target, str) or target is None else str(target))
                if spec.samples is not None and not drawn and len(texts) >= spec.samples:
                    break
    except ProbeError:
        raise
    except Exception as error:  # datasets raises many types while reading (ArrowInvalid, connection lost)
        if local is not None:
            raise unreadable(spec, local_files(local), error) from None
        raise _load_error(spec, error) from None
    if not texts:
        raise ProbeError(
            f"The dataset {spec.describe()} has no non-empty texts"
            + (f" ({skipped} empty rows skipped)" if skipped else " (it has no rows)")
            + ". Choose another dataset"
            + (" or column." if local is not None else ", split or column.")
        )
    if drawn:
        chosen = sample_positions(len(texts), spec.samples, spec.sample_seed)
        texts, indices, targets = ([values[i] for i in chosen] for values in (texts, indices, targets))
    return Texts(texts=texts, indices=indices, targets=targets if spec.target_column else None,
                 skipped_empty=skipped, spec=spec)


def sample_positions(total: int, samples: int, seed: int) -> list[int]:
    """Which of ``total`` texts a random sample of ``samples`` takes (``--samples random:N``): positions drawn
    without replacement by ``numpy.random.default_rng(seed)``, in the texts' own order; every text when there
    are no more than ``samples``."""
    import numpy as np

    if samples >= total:
        return list(range(total))
    return sorted(int(i) for i in np.random.default_rng(seed).choice(total, size=samples, replace=False))


# --------------------------------------------------------------------------------------------------
# whether runs saw the same data


class DifferentDataWarning(UserWarning):
    """Runs set side by side (``probe compare``) that did not see the same data."""


def data_differences(manifests: dict[str, dict]) -> str | None:
    """How the data of runs differ (``manifests``: each run's manifest by its directory), in one sentence;
    None when every run saw the same texts (the same SHA-256), as many of them, cut at the same
    ``--max-length``.  A run whose manifest lacks a field is not compared on it."""
    def seen(manifest: dict) -> tuple:
        dataset = manifest.get("dataset") or {}
        return dataset.get("texts_sha256"), dataset.get("n_examples"), dataset.get("max_length")

    found = {run: seen(manifest) for run, manifest in manifests.items()}
    for position, label in ((0, "texts"), (1, "number of texts"), (2, "max length")):  # noqa: B007 (label: read after)
        if len({values[position] for values in found.values() if values[position] is not None}) > 1:
            break
    else:
        return None
    described = "; ".join(
        f"{run}: {(manifests[run].get('dataset') or {}).get('description', '?')}, {n if n is not None else '?'} "
        f"texts, max length {length if length is not None else '?'}"
        for run, (_, n, length) in found.items()
    )
    return (
        f"The runs did not see the same data ({label} differ): {described}. Their numbers describe different "
        "texts, so a difference between them is not only the models'. Compare runs made with the same "
        f"{option('dataset')}, {option('samples')} and {option('max_length')}."
    )
