"""A run's aggregates on disk: the mergeable statistics a run made with ``--keep aggregates`` or ``--keep sample:N``
keeps instead of its rows (:mod:`probe.batch.aggregates` computes them where the rows are).

Layout.  ``RUN_DIR/aggregates.parquet/`` holds one part per finished batch, ``part-000000.parquet`` and so on,
written atomically and recorded in the manifest (``aggregate_parts``: name, bytes, rows and SHA-256) exactly as
the rows' parts are, so that every check of :mod:`probe.store.integrity` (a missing, resized or altered part is
refused by name; ``probe resume`` quarantines and recomputes it) holds for them too.  A batch is finished when
both its aggregate part and its deviations part exist (the aggregate part is written first), so a run killed at
any moment resumes with nothing counted twice.  When the last batch is done the pipeline merges every part
into one file, ``merged.parquet`` (recorded under ``aggregates_merged``), and removes the parts: a complete run
keeps one file whose size does not grow with its rows.

What a part holds: an :class:`AggregateState`, a few tables (``KINDS``) of statistics per group, each stored as
an Arrow IPC stream in one row of the part (``kind``, ``table``).  Every statistic merges exactly (counts, sums,
sums of squares, minima, maxima, histograms on :data:`FINE_EDGES`, the worst rows) except the quantile sketches of
the relative deviation and its head-averaged values, Apache DataSketches' KLL (``kll_doubles_sketch`` with ``k =``
:data:`KLL_K`), which merge within their normalized rank error :data:`RANK_ERROR`: a quantile read from a sketch of
``n`` values has a true rank within ``RANK_ERROR * n`` of the one asked for (with 99% confidence, DataSketches'
statement of the bound).  The other quantities have no sketch (a sketch update costs the host about 30 ns a
value): their quantiles are read from their histograms, exact to one fine bin.

The fixed bins.  :data:`FINE_EDGES`: 4,096 bins of width 1/1024 on [0, 4), then 16 bins per octave (factor of
two) up to 2^20, then one bin to infinity; a value's bin is computed exactly (a scaling by a power of two and
``frexp``), the same in numpy and torch.  :data:`COARSE_EDGES` join 8 linear (or 16 logarithmic) fine bins.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from probe.core.errors import ProbeError
from probe.store.storage import AGGREGATES  # noqa: F401 (the parts' directory: probe.store.aggregates.AGGREGATES)

#: the one file a complete run's parts are merged into (in :data:`AGGREGATES`), and its manifest record
MERGED = "merged.parquet"
MERGED_RECORD = "aggregates_merged"

# ------------------------------------------------------------------------------------------------ sketches

#: KLL's k: 300, whose normalized rank error (single-sided, as quantiles are asked) is 0.0090: at most 0.01 with a
#: margin (k = 270 is the smallest multiple of 10 within 0.01).  A saturated sketch keeps about 900 values (7 kB)
KLL_K = 300


def kll_sketch():
    """An empty KLL sketch of :data:`KLL_K` (``datasketches.kll_doubles_sketch``)."""
    from datasketches import kll_doubles_sketch

    return kll_doubles_sketch(KLL_K)


def rank_error() -> float:
    """The normalized rank error of a KLL sketch of :data:`KLL_K`, as DataSketches states it (99% confidence)."""
    from datasketches import kll_doubles_sketch

    return float(kll_doubles_sketch.get_normalized_rank_error(KLL_K, False))


#: the stated bound, 0.00896 for k = 300 (tests/store/test_aggregates.py checks it against DataSketches)
RANK_ERROR = 0.008963278439525532


def merged_sketch(blobs) -> object:
    """One KLL sketch from serialized ones (``None`` and empty bytes left out)."""
    from datasketches import kll_doubles_sketch

    sketch = kll_sketch()
    for blob in blobs:
        if blob:
            sketch.merge(kll_doubles_sketch.deserialize(bytes(blob)))
    return sketch


def sketch_bytes(values: np.ndarray) -> bytes:
    """A KLL sketch of ``values`` (float64, best sorted: the sketch's compactions then cost less), serialized."""
    sketch = kll_sketch()
    if len(values):
        sketch.update(np.ascontiguousarray(values, dtype=np.float64))
    return sketch.serialize()


# ------------------------------------------------------------------------------------------------ fixed bins

#: the linear part: bins of 1/LINEAR_SCALE on [0, LINEAR_TOP)
LINEAR_SCALE, LINEAR_TOP = 1024, 4.0
LINEAR_BINS = int(LINEAR_SCALE * LINEAR_TOP)
#: the logarithmic part: BINS_PER_OCTAVE bins per factor of two, from LINEAR_TOP (frexp exponent 3) to 2^LAST_EXPONENT
BINS_PER_OCTAVE, FIRST_EXPONENT, LAST_EXPONENT = 16, 3, 20
LOG_BINS = (LAST_EXPONENT - FIRST_EXPONENT + 1) * BINS_PER_OCTAVE
#: every fine bin, the last one [2^20, inf)
FINE_BINS = LINEAR_BINS + LOG_BINS + 1
FINE_EDGES = np.concatenate([
    np.arange(LINEAR_BINS + 1) / LINEAR_SCALE,
    np.array([2.0 ** (e - 1) * (1 + j / BINS_PER_OCTAVE) for e in range(FIRST_EXPONENT, LAST_EXPONENT + 1)
              for j in range(BINS_PER_OCTAVE)][1:] + [2.0 ** LAST_EXPONENT, np.inf]),
])
#: coarse bins: 8 linear fine bins (1/128) or one octave of logarithmic ones each
COARSE_LINEAR = 8
COARSE_OF_FINE = np.concatenate([
    np.arange(LINEAR_BINS) // COARSE_LINEAR,
    LINEAR_BINS // COARSE_LINEAR + np.arange(LOG_BINS) // BINS_PER_OCTAVE,
    [LINEAR_BINS // COARSE_LINEAR + LOG_BINS // BINS_PER_OCTAVE],
]).astype(np.int64)
COARSE_BINS = int(COARSE_OF_FINE[-1]) + 1
COARSE_EDGES = np.concatenate([FINE_EDGES[np.flatnonzero(np.r_[True, np.diff(COARSE_OF_FINE) > 0])], [np.inf]])


def fine_bins(values: np.ndarray) -> np.ndarray:
    """The fine bin of each value (numpy; :func:`probe.batch.aggregates.fine_bins` is the same in torch): values
    below 0 in bin 0, values of 2^20 and more in the last bin."""
    x = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
    linear = np.floor(np.minimum(x, LINEAR_TOP) * LINEAR_SCALE).astype(np.int64)
    mantissa, exponent = np.frexp(np.maximum(x, LINEAR_TOP))
    log = LINEAR_BINS + (exponent.astype(np.int64) - FIRST_EXPONENT) * BINS_PER_OCTAVE + np.floor(
        (mantissa * 2 - 1) * BINS_PER_OCTAVE).astype(np.int64)
    return np.where(x < LINEAR_TOP, linear, np.minimum(log, FINE_BINS - 1))


# ------------------------------------------------------------------------------------------------ the sample


def string_code(text: str) -> int:
    """A stable signed 64-bit code of a string (the first 8 bytes of its BLAKE2b digest)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def alpha_code(alpha: float) -> int:
    """The bits of ``alpha`` as a float64, as a signed 64-bit integer."""
    return int(np.array([alpha], dtype=np.float64).view(np.int64)[0])


_MASK = (1 << 64) - 1
#: splitmix64's constants (Steele, Lea and Flood 2014), as signed 64-bit integers
MIX_ADD = 0x9E3779B97F4A7C15 - (1 << 64)
MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(MIX_ADD & _MASK)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX_1 & _MASK)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX_2 & _MASK)
        return x ^ (x >> np.uint64(31))


def row_hash(seed: int, space: str, alpha: float, attention_type: str, layer, head, example, query) -> np.ndarray:
    """The sample's key of each row: splitmix64 folded over the row key (:data:`probe.core.schema.ROW_KEY`) and
    the run's seed, as signed 64-bit integers.  A ``--keep sample:N`` run keeps the N rows of smallest key: a
    uniform sample, the same whatever the batches, resumes or ranks (:func:`probe.batch.aggregates.row_hash`
    computes it on the run's device, bit for bit the same)."""
    head = np.asarray(head, dtype=np.int64)
    state = np.full(head.shape, np.uint64(np.int64(seed).view(np.uint64)), dtype=np.uint64)
    for field_ in (string_code(space), alpha_code(alpha), string_code(attention_type)):
        state = _mix(state ^ np.uint64(np.int64(field_).view(np.uint64)))
    for field_ in (layer, head, example, query):
        state = _mix(state ^ np.asarray(field_, dtype=np.int64).astype(np.uint64))
    return state.view(np.int64)


# ------------------------------------------------------------------------------------------------ the state

#: the statistics' thresholds: a row is "far" above this relative deviation (the report's headline share)
FAR = 0.1
#: worst rows kept per head (the report's explorer)
WORST_ROWS = 8
#: a slice of one site: its groups' first keys
SITE_KEYS = ("space", "alpha", "attention_type", "layer")
#: the measured columns with statistics, histograms and sketches per (site, head, token role) (rel_deviation)
#: or per site (the head-averaged deviation and the other quantities the report draws)
QUANTITY_COLUMNS = ("second_order_deviation", "attention_tv", "output_deviation")
AVERAGED = "layer_head_averaged"
#: the census' counts of rows where an optional column has a value (probe.report.data.census)
PRESENT_COLUMNS = ("n_keys", "token", "token_role", "second_order_deviation", "attention_tv", "output_deviation",
                   "evidence_norm", "attention_entropy")
#: the token roles, by code (probe.batch.rows)
ROLES = ("word", "special", "first")

#: each table of a state: its key columns, its summed columns, its columns reduced otherwise
KINDS = {
    # rows of every kind per head (the report's census)
    "census": (SITE_KEYS + ("head",), ("rows", "trivial", "non_converged", "measured",
                                       *(f"present_{c}" for c in PRESENT_COLUMNS), "pairs", "pairs_better"),
               {"pairs_max": "max"}),
    # a measured column's statistics: rel_deviation per (head, token role); the others per site (head -1, role "")
    "values": (("column",) + SITE_KEYS + ("head", "token_role"), ("count", "trivial", "sum", "sumsq", "above"),
               {"min": "min", "max": "max", "bins": "hist", "counts": "hist", "sketch": "sketch"}),
    # the worst rows of each head
    "worst": (SITE_KEYS + ("head",), (), {"rel_deviation": "worst", "example": "worst", "query": "worst",
                                          "token_id": "worst", "token_role": "worst", "n_keys": "worst"}),
    # per head and example: the measured rows, their sum and those above FAR (findings, series)
    "examples": (SITE_KEYS + ("head", "example"), ("n", "sum", "above"), {}),
    # per query token of each example, over every layer and head: its token, role, rows and measured sum
    "queries": (("space", "alpha", "attention_type", "example", "query"), ("rows", "n", "sum"),
                {"token_id": "first", "token_role": "first"}),
    # per layer and query position (the positions heatmap)
    "positions": (SITE_KEYS + ("query",), ("rows", "n", "sum"), {}),
    # per layer and example: the coarse histogram of the deviations (the series' bootstrap of the p95)
    "example_bins": (SITE_KEYS + ("example",), (), {"bins": "hist", "counts": "hist"}),
    # the token strings of the token ids met
    "tokens": (("token_id",), (), {"token": "first"}),
}


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


@dataclass
class AggregateState:
    """The statistics of some rows, by kind (:data:`KINDS`): a batch's (Arrow tables, as the device made them), or
    many merged (pandas frames); ``state[kind]`` is always a frame."""

    tables: dict = field(default_factory=dict)

    def __getitem__(self, kind: str) -> pd.DataFrame:
        table = self.tables.get(kind)
        if table is None:
            return _empty(kind)
        if isinstance(table, pa.Table):
            table = self.tables[kind] = table.to_pandas()
        return table

    def to_arrow(self) -> pa.Table:
        """The state as the table of a part file: one row per kind, its table as an Arrow IPC stream."""
        kinds = [k for k in KINDS if k in self.tables]
        blobs = [_ipc(self.tables[k] if isinstance(self.tables[k], pa.Table)
                      else pa.Table.from_pandas(self.tables[k], preserve_index=False)) for k in kinds]
        return pa.table({"kind": pa.array(kinds, pa.string()), "table": pa.array(blobs, pa.binary())})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "AggregateState":
        kinds, blobs = table.column("kind").to_pylist(), table.column("table").to_pylist()
        return cls({kind: _from_ipc(blob) for kind, blob in zip(kinds, blobs)})

    @classmethod
    def read(cls, path: Path) -> "AggregateState":
        """A part or merged file (checked against its record by the caller)."""
        try:
            return cls.from_arrow(pq.read_table(path))
        except (OSError, pa.ArrowException, KeyError) as error:
            raise ProbeError(f"{path} is not a readable aggregates file ({str(error).splitlines()[0][:120]}). "
                             f"Repair the run with `probe resume {Path(path).parents[1]}`.") from None


def _empty(kind: str) -> pd.DataFrame:
    keys, sums, others = KINDS[kind]
    return pd.DataFrame(columns=[*keys, *sums, *others])


def merge(states) -> AggregateState:
    """One state from several (batches, segments, ranks): counts, sums, extremes and histograms exactly, the
    sketches by KLL's merge, the worst rows re-ranked."""
    states = list(states)
    out = {}
    for kind, (keys, sums, others) in KINDS.items():
        tables = [state.tables[kind] for state in states if kind in state.tables and len(state.tables[kind])]
        if not tables:
            continue
        if kind in DISJOINT and all(isinstance(t, pa.Table) for t in tables):  # every batch its own examples
            out[kind] = pa.concat_tables(tables, promote_options="permissive")
            continue
        frames = [t.to_pandas() if isinstance(t, pa.Table) else t for t in tables]
        frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
        out[kind] = frame.drop_duplicates("token_id") if kind == "tokens" else _reduce(frame, list(keys), list(sums),
                                                                                        others)
    return AggregateState(out)


#: the kinds keyed by example: a batch's rows are of its own examples, so merged states only join their rows
DISJOINT = ("examples", "queries", "example_bins")


def _reduce(frame: pd.DataFrame, keys: list[str], sums: list[str], others: dict) -> pd.DataFrame:
    """Rows of equal keys folded into one, column by column (:data:`KINDS`' rules)."""
    if "worst" in others.values():
        return worst_rows(frame, keys)
    group = frame.groupby(keys, sort=True, dropna=False).ngroup().to_numpy()
    if len(group) == group.max(initial=-1) + 1 and (np.diff(group) > 0).all():
        return frame.reset_index(drop=True)  # every key once, in order: nothing to fold
    order = np.argsort(group, kind="stable")
    group, frame = group[order], frame.iloc[order].reset_index(drop=True)
    starts = np.flatnonzero(np.r_[True, np.diff(group) > 0])
    result = frame.iloc[starts][keys].reset_index(drop=True)
    for column in sums:
        result[column] = np.add.reduceat(frame[column].to_numpy(), starts)
    for column, rule in others.items():
        values = frame[column].to_numpy()
        if rule == "min":
            result[column] = np.fmin.reduceat(values.astype(float), starts)
        elif rule == "max":
            result[column] = np.fmax.reduceat(values.astype(float), starts)
        elif rule == "first":
            result[column] = values[starts]
        elif rule == "sketch":
            bounds = np.r_[starts, len(values)]
            result[column] = [merged_sketch(values[a:b]).serialize() if any(len(v) for v in values[a:b]) else b""
                              for a, b in zip(bounds[:-1], bounds[1:])]  # no sketch (a quantity's): none
    if "bins" in others:
        result["bins"], result["counts"] = _merged_histograms(frame["bins"].to_numpy(), frame["counts"].to_numpy(),
                                                              group, starts)
    return result


def _merged_histograms(bins, counts, group, starts):
    """Sparse histograms (bin lists and count lists) added per group."""
    lengths = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat_bins = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins]) if len(bins) else np.zeros(0, np.int64)
    flat_counts = np.concatenate([np.asarray(c, dtype=np.int64) for c in counts]) if len(bins) else flat_bins
    owner = np.repeat(group, lengths)
    key = owner * (FINE_BINS + 1) + flat_bins
    unique, inverse = np.unique(key, return_inverse=True)
    added = np.bincount(inverse, weights=flat_counts, minlength=len(unique)).astype(np.int64)
    unique_owner, unique_bin = unique // (FINE_BINS + 1), unique % (FINE_BINS + 1)
    cut = np.searchsorted(unique_owner, group[starts])
    ends = np.r_[cut[1:], len(unique)]
    return ([unique_bin[a:b].astype(np.int32) for a, b in zip(cut, ends)],
            [added[a:b] for a, b in zip(cut, ends)])


def worst_rows(frame: pd.DataFrame, keys=SITE_KEYS + ("head",), k: int = WORST_ROWS) -> pd.DataFrame:
    """The ``k`` rows of largest deviation per group of ``keys``; ties: the smaller example, then query, first
    (as the report's worst-rows table orders them)."""
    ordered = frame.assign(_v=-frame["rel_deviation"].astype(float)).sort_values(
        list(keys) + ["_v", "example", "query"], kind="stable")
    return ordered.groupby(list(keys), sort=False, dropna=False).head(k).drop(columns="_v").reset_index(drop=True)


def dense(bins, counts, size: int = FINE_BINS) -> np.ndarray:
    """A sparse histogram as its dense counts."""
    out = np.zeros(size, dtype=np.int64)
    np.add.at(out, np.asarray(bins, dtype=np.int64), np.asarray(counts, dtype=np.int64))
    return out


def write_merged(path: Path, state: AggregateState, record: dict, replace_atomically) -> None:
    """The merged state of a complete run, written atomically (``replace_atomically``: :mod:`probe.store.storage`'s)."""
    import json

    table = state.to_arrow().replace_schema_metadata({b"probe.aggregates": json.dumps(record).encode()})
    replace_atomically(path, lambda handle: pq.write_table(table, handle, compression="zstd"))


# ------------------------------------------------------------------------------------------------ a complete run


def table_hashes(table: pa.Table, seed: int) -> np.ndarray:
    """:func:`row_hash` of every row of a deviations table."""
    out = np.zeros(table.num_rows, dtype=np.int64)
    if not table.num_rows:
        return out
    frame = table.select(["space", "alpha", "attention_type", "layer", "head", "example", "query"]).to_pandas()
    for (space, alpha, attention_type), rows in frame.groupby(["space", "alpha", "attention_type"], sort=False):
        out[rows.index.to_numpy()] = row_hash(seed, space, float(alpha), attention_type, rows["layer"].to_numpy(),
                                              rows["head"].to_numpy(), rows["example"].to_numpy(),
                                              rows["query"].to_numpy())
    return out


def sample_threshold(files, count: int, seed: int) -> int | None:
    """The ``count``-th smallest :func:`row_hash` over the rows of the part files (None: fewer rows than that)."""
    hashes = [table_hashes(pq.read_table(path, columns=["space", "alpha", "attention_type", "layer", "head",
                                                          "example", "query"]), seed) for path in files]
    every = np.concatenate(hashes) if hashes else np.zeros(0, np.int64)
    if len(every) <= count:
        return None
    return int(np.partition(every, count - 1)[count - 1])


def rows_within(path: Path, threshold: int, seed: int) -> pa.Table | None:
    """The part's rows whose hash is at most ``threshold`` (its metadata kept), or None when that is every row."""
    table = pq.read_table(path)
    keep = table_hashes(table, seed) <= threshold
    if keep.all():
        return None
    return table.filter(pa.array(keep))


def merge_files(paths) -> AggregateState:
    """The merged state of several aggregates files (already checked against their records)."""
    return merge(AggregateState.read(path) for path in paths)


def merged_path(run_dir: Path) -> Path:
    return Path(run_dir) / AGGREGATES / MERGED


def describe_merged(path: Path, batches: int) -> dict:
    """The manifest's record of the merged file: name, bytes, SHA-256 and the batches it covers."""
    from probe.store.storage import file_sha256

    return {"file": f"{AGGREGATES}/{MERGED}", "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "batches": batches}


def merged_problem(run_dir: Path, manifest: dict) -> str | None:
    """What is wrong with a run's merged aggregates file against its record (None: nothing, or no record)."""
    record = (manifest or {}).get(MERGED_RECORD)
    if not record:
        return None
    path = merged_path(run_dir)
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != record.get("bytes"):
        return f"{size:,} bytes, recorded {record.get('bytes'):,}"
    from probe.store.integrity import checksum_matches

    if not checksum_matches(path, record.get("sha256", ""), cached=True):
        return "SHA-256 differs from the recorded one"
    return None


def remove_parts(run_dir: Path) -> None:
    """The aggregates' per-batch parts, once merged (their merged file recorded), deleted."""
    from probe.store.storage import fsync_directory, part_files

    for path in part_files(run_dir, AGGREGATES).values():
        path.unlink(missing_ok=True)
    fsync_directory(Path(run_dir) / AGGREGATES)


def quarantine_merged(run_dir: Path, manifest: dict) -> Path | None:
    """Move a damaged merged file into ``RUN_DIR/quarantine/<time>/aggregates.parquet/`` and drop its record
    (``manifest`` is updated): the run's batches are then computed again by ``probe resume``."""
    import shutil
    from datetime import datetime

    manifest.pop(MERGED_RECORD, None)
    path = merged_path(run_dir)
    if not path.exists():
        return None
    target = Path(run_dir) / "quarantine" / datetime.now().strftime("%Y%m%d-%H%M%S-%f") / AGGREGATES
    target.mkdir(parents=True)
    shutil.move(str(path), target / path.name)
    return target
