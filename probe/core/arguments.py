"""The grammar of probe's arguments: one reading of each kind of value, for the command line, the Python API,
the Trainer callback and the environment.

A value comes as a string from the command line (``--alpha 0.5,1``) or an environment variable
(``PROBE_MEMORY_BUDGET=2G``), and as a string, a number or a sequence from Python (``alpha=[0.5, 1]``).
Each function here takes every spelling of its kind and returns one canonical value, or raises a
:class:`~probe.core.errors.ProbeError` that names the option as the caller spells it
(:func:`probe.core.spelling.option`) and says what it takes.  Nothing here imports anything heavy.

The kinds:

* numbers and names: one, a sequence, or a comma-separated string (:func:`numbers`, :func:`names`);
* whole numbers (:func:`whole_numbers`, :func:`seed`), and how many texts (:func:`samples`: the first N, or N
  drawn at random);
* sizes in bytes, for ``--max-memory`` and ``PROBE_MEMORY_BUDGET`` alike (:func:`parse_size`, table
  :data:`SIZE_UNITS`);
* texts given in Python (:func:`texts`);
* the selection of what a run measures: layer and head indices (:func:`indices`) and query positions
  (:func:`queries`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from numbers import Real

from probe.core.errors import ProbeError
from probe.core.spelling import option

__all__ = [
    "SIZE_UNITS", "SEED_MAX", "QUERY_RULES", "IndexRange", "QueryRule", "numbers", "names", "parse_numbers",
    "parse_names", "is_number", "whole_numbers", "seed", "samples", "parse_size", "texts", "indices", "queries",
    "describe_indices", "parse_keep", "describe_keep",
]

# --------------------------------------------------------------------------------------------------
# numbers and names


def is_number(value) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def parse_numbers(text: str, name: str) -> tuple[float, ...]:
    """``"0.25,0.5,1"`` -> ``(0.25, 0.5, 1.0)``; one value or a comma-separated list (``name``: the option's
    parameter name, for the message)."""
    values = []
    for item in (item.strip() for item in str(text).split(",")):
        try:
            values.append(float(item))
        except ValueError:
            raise ProbeError(
                f"{option(name)} takes a number or comma-separated numbers (e.g. {option(name, '0.5,1,2')}); "
                f"{item!r} in {text!r} is not a number."
            ) from None
    return tuple(values)


def parse_names(text: str, name: str) -> tuple[str, ...]:
    """``"hidden, key"`` -> ``("hidden", "key")``; an empty entry is refused."""
    found = tuple(item.strip() for item in str(text).split(","))
    if any(not each for each in found):
        raise ProbeError(f"{option(name, text)} has an empty entry; separate names by single commas.")
    return found


def _items(value, name: str, takes: str) -> list:
    """``value`` as a list, when it is a sequence (a mapping, bytes and other single objects are refused)."""
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise ProbeError(f"{option(name)} takes {takes}; got {value!r} ({type(value).__name__}).")
    return list(value)


def numbers(value, name: str) -> tuple[float, ...]:
    """One number, a sequence of numbers, or a comma-separated string of them (as on the command line)."""
    if isinstance(value, str):
        return parse_numbers(value, name)
    if is_number(value):
        return (float(value),)
    items = _items(value, name, "a number, a list of numbers or a comma-separated string of them")
    for index, item in enumerate(items):
        if not is_number(item):
            raise ProbeError(
                f"{name}[{index}] is {item!r} ({type(item).__name__}), not a number: {option(name)} takes a number, "
                f"a list of numbers or a comma-separated string of them, e.g. {option(name, '0.5,1,2')}."
            )
    return tuple(float(item) for item in items)


def names(value, name: str) -> tuple[str, ...] | None:
    """None, one name, a sequence of names, or a comma-separated string of them."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_names(value, name)
    items = _items(value, name, "a name, a list of names or a comma-separated string of them")
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise ProbeError(f"{name}[{index}] is {item!r} ({type(item).__name__}), not a name: {option(name)} "
                             "takes a name, a list of names or a comma-separated string of them.")
    return tuple(items)


# --------------------------------------------------------------------------------------------------
# whole numbers

#: the largest seed (numpy's and torch's generators take seeds below 2**64; probe keeps to 2**63 - 1, which
#: both take and which JSON and Parquet store exactly)
SEED_MAX = 2**63 - 1


def whole_numbers(optional: Iterable[str] = (), **values) -> None:
    """Each ``name=value`` is a whole number (a bool is not); ``None`` is allowed for the names in ``optional``.
    ``batch_size="8"`` is refused by name, not met later as a TypeError."""
    optional = set(optional)
    for name, value in values.items():
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProbeError(f"{option(name)} takes a whole number, got {value!r} ({type(value).__name__}).")


def seed(value, name: str = "seed") -> int:
    """A seed: a whole number from 0 to :data:`SEED_MAX`."""
    whole_numbers(**{name: value})
    if not 0 <= value <= SEED_MAX:
        raise ProbeError(f"{option(name)} must be a whole number from 0 to {SEED_MAX} (2**63 - 1), got {value}.")
    return value


def samples(value, name: str = "samples") -> tuple[int | None, bool]:
    """``--samples``: ``None`` (every text), ``N`` or ``"N"`` (the first N non-empty texts), or ``"random:N"``
    (N of them drawn at random, seeded by the run's seed: :func:`probe.capture.data.sample_positions`).
    Returns ``(N, drawn)``; that N is at least 1 is checked with the other options."""
    if value is None:
        return None, False
    if isinstance(value, int) and not isinstance(value, bool):
        return value, False
    found = _SAMPLES.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise ProbeError(
            f"{option(name)} takes N (the first N texts) or random:N (N texts drawn at random, seeded by "
            f"{option('seed')}), e.g. {option(name, '200')} or {option(name, 'random:200')}; got {value!r}."
        )
    return int(found.group(2)), found.group(1) is not None


_SAMPLES = re.compile(r"\s*(random\s*:\s*)?([+-]?[0-9]+)\s*")


# --------------------------------------------------------------------------------------------------
# sizes

#: the units of a size, case-insensitive, in bytes: none or B; SI KB, MB, GB, TB (powers of 1000); binary
#: KiB, MiB, GiB, TiB and their one-letter forms K, M, G, T (powers of 1024, as ``free -g`` and ``ulimit``)
SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text, name: str = "max_memory", *, variable: bool = False) -> int:
    """Bytes from a size: ``4096``, ``1e9``, ``1e9B``, ``600MB``, ``1.5GiB`` or ``2G`` (:data:`SIZE_UNITS`).

    ``name``: the option (``max_memory``), or with ``variable=True`` the environment variable
    (``PROBE_MEMORY_BUDGET``) that the message names.  A size below one byte, not finite, or unreadable is
    refused."""
    given = f"{name}={text!r}" if variable else option(name, text)
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in SIZE_UNITS:
        unset = f" (or unset {name})" if variable else ""
        raise ProbeError(
            f"{given} is not a size. Give bytes, or a number with a unit: 4GB, 512MB, 1.5GiB or 2G "
            f"(units B, KB, MB, GB, TB; KiB, MiB, GiB, TiB or K, M, G, T){unset}."
        )
    size = float(match.group(1)) * SIZE_UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ProbeError(f"{given} must be a finite size of at least 1 byte, e.g. 4GB.")
    return int(size)


# --------------------------------------------------------------------------------------------------
# texts given in Python


def texts(value, path_exists=None) -> list[str]:
    """``texts=`` as the list of texts it means: a list (or any iterable) of strings, or one string, which is
    one text (never its characters).  The first item that is not a string is named; with ``path_exists``
    (a function of a string), a string that names an existing file is refused (its texts are read with
    ``dataset=``)."""
    if isinstance(value, str):
        if path_exists is not None and path_exists(value):
            raise ProbeError(
                f"{option('texts')} takes the texts themselves, and {value!r} is a file. To analyse the texts in it, "
                f"pass {option('dataset', value)}; to analyse this one string, pass {option('texts')}[{value!r}]."
            )
        return [value]
    items = _items(value, "texts", "a list of strings (one string is one text), or pass dataset= a file")
    for index, text in enumerate(items):
        if not isinstance(text, str):
            raise ProbeError(
                f"texts[{index}] is {text!r} ({type(text).__name__}), not a string: {option('texts')} takes a list "
                "of strings. Convert or remove that item (empty strings are skipped, as empty rows of a file are)."
            )
    if not any(text.strip() for text in items):
        raise ProbeError(f"{option('texts')} holds no text ({len(items)} item(s), every one empty). Give at least "
                         "one non-empty string.")
    return items


# --------------------------------------------------------------------------------------------------
# what a run measures: layers, heads, query positions


@dataclass(frozen=True)
class IndexRange:
    """Indices ``first`` to ``last``, both included, as given: a negative index counts from the end (``-1``
    is the last), and is resolved against a size by :meth:`resolve`."""

    first: int
    last: int

    def resolve(self, size: int) -> range | None:
        """The indices within ``range(size)``, or None when an end lies outside it or the range is empty."""
        first, last = self.resolve_end(size, self.first), self.resolve_end(size, self.last)
        if first is None or last is None or first > last:
            return None
        return range(first, last + 1)

    @staticmethod
    def resolve_end(size: int, index: int) -> int | None:
        """``index`` within ``range(size)`` (negative from the end), or None when it lies outside."""
        index = index + size if index < 0 else index
        return index if 0 <= index < size else None

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


_INDEX = re.compile(r"\s*(-?[0-9]+)\s*(?:-\s*(-?[0-9]+)\s*)?")


def indices(value, name: str) -> tuple[IndexRange, ...] | None:
    """Layer or head indices: None (all), a whole number, a sequence of them, or a string of comma-separated
    entries, each an index or a range ``a-b`` (both included); negative indices count from the end
    (``-1`` is the last; ``-4--1`` the last four).  Checked against the model's sizes when they are known
    (:meth:`IndexRange.resolve`)."""
    if value is None:
        return None
    example = option(name, "0,5,-1") + " or " + option(name, "2-4")
    if isinstance(value, str):
        ranges = []
        for entry in value.split(","):
            match = _INDEX.fullmatch(entry)
            if not match:
                raise ProbeError(
                    f"{option(name, value)}: {entry.strip()!r} is not an index or a range a-b. Give comma-separated "
                    f"whole numbers and ranges, negative from the end, e.g. {example}."
                )
            first = int(match.group(1))
            last = int(match.group(2)) if match.group(2) is not None else first
            if (first < 0) == (last < 0) and first > last:  # backwards whatever the size
                raise ProbeError(
                    f"{option(name, value)}: {entry.strip()} runs backwards: a range a-b goes from a up to b, "
                    f"e.g. {last}-{first}."
                )
            ranges.append(IndexRange(first, last))
        return tuple(ranges)
    if isinstance(value, int) and not isinstance(value, bool):
        return (IndexRange(value, value),)
    items = _items(value, name, f"an index, a list of indices or a string of them ({example})")
    for index, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ProbeError(f"{name}[{index}] is {item!r} ({type(item).__name__}), not a whole number: "
                             f"{option(name)} takes indices, e.g. {example}.")
    if not items:
        raise ProbeError(f"{option(name)} is empty: give at least one index, e.g. {example}, or leave it out for all.")
    return tuple(IndexRange(item, item) for item in items)


def describe_indices(ranges: tuple[IndexRange, ...] | None) -> str:
    """``"0,5,-1"`` for the ranges as given (``"all"`` for None)."""
    return "all" if ranges is None else ",".join(str(each) for each in ranges)


#: the query rules: every real position, each text's last real token, positions 0, K, 2K, ..., N sampled
QUERY_RULES = ("all", "last", "every", "sample")


@dataclass(frozen=True)
class QueryRule:
    """Which query positions of each text a run measures.

    Attributes:
        kind: ``"all"``, ``"last"`` (the text's last real token), ``"every"`` (positions 0, K, 2K, ...)
            or ``"sample"`` (N positions per text without replacement, seeded by the run's seed and the
            text, the same at every site and head).
        count: K for ``every``, N for ``sample``; None otherwise.
    """

    kind: str = "all"
    count: int | None = None

    def __str__(self) -> str:
        return self.kind if self.count is None else f"{self.kind}:{self.count}"

    @property
    def selects(self) -> bool:
        """Whether the rule leaves some query positions out."""
        return self.kind != "all"

    def describe(self) -> str:
        """In words, for reports: ``"32 sampled query positions per text"``."""
        return {
            "all": "every query position",
            "last": "the last token of each text",
            "every": f"query positions 0, {self.count}, {2 * (self.count or 0)}, ... of each text",
            "sample": f"{self.count} sampled query positions per text (all of a shorter text)",
        }[self.kind]


def queries(value) -> QueryRule:
    """``all``, ``last``, ``every:K`` or ``sample:N`` (K, N >= 1), or a :class:`QueryRule`."""
    if isinstance(value, QueryRule):
        return value
    example = f"{option('queries', 'all')}, {option('queries', 'last')}, {option('queries', 'every:4')} or " \
              f"{option('queries', 'sample:32')}"
    if not isinstance(value, str):
        raise ProbeError(f"{option('queries')} takes a string, {example}; got {value!r} ({type(value).__name__}).")
    if "," in value:
        raise ProbeError(f"{option('queries', value)}: a run takes one query rule, not a list. Give {example}.")
    kind, _, count = value.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in QUERY_RULES:
        raise ProbeError(f"Unknown {option('queries', value)}. Give {example}.")
    if kind in ("all", "last"):
        if count.strip():
            raise ProbeError(f"{option('queries', value)}: {kind} takes no number. Give {example}.")
        return QueryRule(kind)
    letter = "K" if kind == "every" else "N"
    try:
        number = int(count.strip())
    except ValueError:
        raise ProbeError(f"{option('queries', value)}: {kind}:{letter} needs a whole number {letter} >= 1, e.g. "
                         f"{option('queries', kind + ':32')}.") from None
    if number < 1:
        raise ProbeError(f"{option('queries', value)}: {letter} must be at least 1, got {number}.")
    return QueryRule(kind, number)


# --------------------------------------------------------------------------------------------------
# what a run keeps


def parse_keep(value) -> tuple[str, int | None]:
    """``--keep`` as ``(mode, N)``: ``("rows", None)``, ``("aggregates", None)`` or ``("sample", N)`` with N >= 1;
    anything else is refused with a :class:`ProbeError` that says what the option takes."""
    example = option("keep", "sample:100000")
    takes = f"{option('keep')} takes rows, aggregates or sample:N (N rows to sample, e.g. {example})"
    if not isinstance(value, str):
        raise ProbeError(f"{takes}; got {value!r} ({type(value).__name__}).")
    text = value.strip()
    if text in ("rows", "aggregates"):
        return text, None
    mode, colon, count = text.partition(":")
    if mode.strip() != "sample":
        raise ProbeError(f"Unknown {option('keep', value)}: {takes}.")
    count = count.strip()
    if not colon or not count:
        raise ProbeError(f"{option('keep', value)} needs the number of rows to sample, e.g. {example}.")
    if not count.lstrip("-").isdigit():
        raise ProbeError(f"{option('keep', value)}: {count!r} is not a whole number of rows, as in {example}.")
    if int(count) < 1:
        raise ProbeError(f"{option('keep', value)} would keep no row: N must be at least 1, as in {example}.")
    return "sample", int(count)


def describe_keep(parsed: tuple[str, int | None]) -> str:
    """``("sample", 100)`` -> ``"sample:100"``: ``--keep`` as the manifest records it."""
    mode, count = parsed
    return mode if count is None else f"{mode}:{count}"
