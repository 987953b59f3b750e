"""Reading a run directory: the deviations table (a parquet file or a directory of part files), the
manifest, what to call the model and the data, and which slice (space, alpha) the main figures show.

Everything the report says about provenance comes from here: the model by its hub id or its
directory's name (never a temporary path), the dataset with its text and target columns.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from ..errors import ProbeError
from ..schema import DEVIATION_SCHEMA
from ..storage import MANIFEST, DamagedRunWarning, deviations_dataset, require_intact, with_liveness

#: Columns the report cannot do without.
NEEDED_COLUMNS = ("attention_type", "layer", "head", "example", "query", "rel_deviation", "converged")
#: Columns read when present (old runs lack some; new columns may be all null until the pipeline fills them).
OPTIONAL_COLUMNS = (
    "alpha", "space", "n_keys", "trivial", "token", "token_role", "second_order_deviation",
    "attention_tv", "output_deviation", "evidence_norm", "attention_entropy",
)
#: Columns of runs written by older versions, read when present: ``model`` (the model on every row;
#: runs now name it once, in the manifest).
LEGACY_COLUMNS = ("model",)
#: String columns read dictionary-encoded (small in memory however many rows).
DICTIONARY_COLUMNS = ("attention_type", "space", "token", "token_role", "model")
#: Known attention types, in the order figures and tables show them; unknown ones follow, sorted.
TYPE_ORDER = ("self", "causal_self", "encoder_self", "decoder_self", "cross")
TYPE_LABELS = {
    "self": "self-attention",
    "causal_self": "causal self-attention",
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder self-attention",
    "cross": "cross-attention",
}
#: Attention types whose queries are decoder (target) tokens.
TARGET_QUERY_TYPES = ("decoder_self", "cross")
RUN_HINT = "Re-run `probe run`; a run killed before it finished can leave a parquet file without its footer."


def type_label(attention_type: str) -> str:
    return TYPE_LABELS.get(attention_type, attention_type)


def ordered_types(types) -> list[str]:
    """Attention types in display order: the known ones first, then any others sorted."""
    types = {str(t) for t in types}
    return [t for t in TYPE_ORDER if t in types] + sorted(types - set(TYPE_ORDER))


@dataclass
class Run:
    """A run directory as the report sees it.

    ``rows`` holds every row read (all spaces and alphas), with ``trivial`` filled in (``n_keys == 1``
    where the column is missing or null: ``lambda* = alpha z`` by construction, so these rows are left
    out of every statistic and histogram and only counted).  ``space`` and ``alpha`` name the main slice,
    the one the main figures and the landing summary show.
    """

    run_dir: Path
    manifest: dict
    name: str  # the model, as titles show it
    dataset: str  # the data, as titles show it
    rows: pd.DataFrame
    space: str | None
    alpha: float | None
    notes: list[str] = field(default_factory=list)  # problems to show prominently on the page

    @cached_property
    def main(self) -> pd.DataFrame:
        """The rows of the main slice (trivial ones included; see :attr:`measured`)."""
        return select_slice(self.rows, self.space, self.alpha)

    @cached_property
    def measured(self) -> pd.DataFrame:
        """The main slice without its trivial rows: what statistics and histograms are over."""
        return self.main[~self.main["trivial"]]

    @cached_property
    def types(self) -> list[str]:
        return ordered_types(self.rows["attention_type"].unique()) if len(self.rows) else []

    @property
    def spaces(self) -> list[str]:
        return sorted(str(s) for s in self.rows["space"].dropna().unique())

    @property
    def alphas(self) -> list[float]:
        return sorted(float(a) for a in self.rows["alpha"].dropna().unique())

    def has(self, column: str, frame: pd.DataFrame | None = None) -> bool:
        """Whether ``column`` exists with at least one non-null value (in the main slice by default)."""
        frame = self.main if frame is None else frame
        return column in frame.columns and bool(frame[column].notna().any())

    @property
    def slice_text(self) -> str:
        """The main slice in words, e.g. ``α = 1, hidden space``."""
        parts = ["α = ?" if self.alpha is None else f"α = {self.alpha:g}"]
        if self.space is not None:
            parts.append(f"{self.space} space")
        return ", ".join(parts)

    @property
    def title(self) -> str:
        return f"{self.name} · {shorten(self.dataset, 40)} · {self.slice_text}"


def select_slice(rows: pd.DataFrame, space: str | None, alpha: float | None) -> pd.DataFrame:
    """Rows of one (space, alpha) slice; a ``None`` key matches every row (old runs have one slice)."""
    keep = np.ones(len(rows), dtype=bool)
    if space is not None:
        keep &= (rows["space"] == space).to_numpy()
    if alpha is not None:
        keep &= np.isclose(rows["alpha"].to_numpy(dtype=float), alpha, rtol=1e-12, atol=0)
    return rows[keep]


def main_slice(rows: pd.DataFrame) -> tuple[str | None, float | None]:
    """The slice the main figures show: alpha = 1 if present (else the smallest alpha), space "hidden"
    if present (else the first in sorted order)."""
    spaces = sorted(str(s) for s in rows["space"].dropna().unique())
    alphas = sorted(float(a) for a in rows["alpha"].dropna().unique())
    space = "hidden" if "hidden" in spaces else (spaces[0] if spaces else None)
    alpha = 1.0 if any(np.isclose(a, 1.0) for a in alphas) else (alphas[0] if alphas else None)
    return space, alpha


# --------------------------------------------------------------------------------------------------
# the table


def _type_kind(arrow_type: pa.DataType) -> str:
    """Coarse kind of an Arrow type (dictionary-encoded columns count as their values)."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    for kind, test in (
        ("boolean", pa.types.is_boolean),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("null", pa.types.is_null),
    ):
        if test(arrow_type):
            return kind
    return str(arrow_type)


def _schema(path: Path, files=None) -> pa.Schema:
    """The Arrow schema of a run's part files (or of one exported parquet file)."""
    dataset = deviations_dataset(path, files)
    if path.is_dir() and not dataset.files:
        raise ProbeError(f"{path} holds no parquet part files. {RUN_HINT}")
    return dataset.schema


def read_deviations(path: Path, files=None) -> pd.DataFrame:
    """The columns the report uses, from a parquet file or a directory of part files (``files``: the
    part files to read, as :func:`probe.storage.require_intact` passed them; default: all).

    Checks that the needed columns exist with the right types; optional columns are read when present
    (all-null columns, as written before the pipeline computes them, come back as NaN / None).
    """
    try:
        schema = _schema(path, files)
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read {path} as parquet ({error}). {RUN_HINT}") from None
    missing = [name for name in NEEDED_COLUMNS if name not in schema.names]
    if missing:
        raise ProbeError(
            f"{path} lacks the column(s) {', '.join(missing)} (it has: {', '.join(schema.names) or 'none'}). "
            "The report needs the deviations table written by `probe run`; re-run it with this version of probe."
        )
    columns = list(NEEDED_COLUMNS) + [name for name in OPTIONAL_COLUMNS + LEGACY_COLUMNS if name in schema.names]
    wrong = [
        f"{name} is {schema.field(name).type}, expected {DEVIATION_SCHEMA.field(name).type}"
        for name in columns
        if name not in LEGACY_COLUMNS and _type_kind(schema.field(name).type) not in (_type_kind(DEVIATION_SCHEMA.field(name).type), "null")
    ]
    if wrong:
        raise ProbeError(f"{path} has columns of the wrong type: {'; '.join(wrong)}. Re-run `probe run`.")
    dictionary = [name for name in DICTIONARY_COLUMNS if name in columns]
    try:
        table = deviations_dataset(path, files).to_table(columns=columns)
        for name in dictionary:  # strings repeated on every row: categoricals, small however many rows
            table = table.set_column(table.schema.get_field_index(name), name, table[name].dictionary_encode())
    except (pa.ArrowException, OSError) as error:
        raise ProbeError(f"Cannot read the data in {path} ({error}). {RUN_HINT}") from None
    return _normalise(table.to_pandas())


def _normalise(rows: pd.DataFrame) -> pd.DataFrame:
    """Fill what old runs lack: ``trivial`` from ``n_keys``, and null ``space`` / ``alpha`` columns."""
    for name in ("space", "alpha", "token", "token_role", "n_keys"):
        if name not in rows.columns:
            rows[name] = None if name in ("space", "token", "token_role") else np.nan
    trivial = rows["trivial"] if "trivial" in rows.columns else pd.Series(pd.NA, index=rows.index, dtype="boolean")
    from_keys = pd.Series(pd.to_numeric(rows["n_keys"], errors="coerce") == 1, index=rows.index)
    rows["trivial"] = trivial.astype("boolean").fillna(from_keys).astype(bool)
    rows["converged"] = rows["converged"].astype(bool)
    for name in ("space", "token", "token_role", "attention_type"):
        if isinstance(rows[name].dtype, pd.CategoricalDtype):
            rows[name] = rows[name].cat.remove_unused_categories()
    return rows


# --------------------------------------------------------------------------------------------------
# the manifest and provenance


def load_manifest(path: Path) -> tuple[dict, str | None]:
    """The manifest as a dict, and a note saying what is wrong with it (None when it is fine)."""
    if not path.is_file():
        return {}, f"{path} is missing: the facts below are incomplete."
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return {}, f"{path} could not be read ({error}): the facts below are incomplete."
    if not isinstance(manifest, dict):
        return {}, f"{path} does not hold a JSON object: the facts below are incomplete."
    return manifest, None


def lookup(mapping, *keys):
    """``mapping[k1][k2]...``, or None where a level is missing or not a dict."""
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _looks_like_path(text: str) -> bool:
    """A local path rather than a hub id (``name`` or ``org/name``)."""
    return text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1


def model_name(manifest: dict, rows: pd.DataFrame | None = None) -> str:
    """The run as a reader knows it: the name given with ``probe run --name``; else the model's real
    name as the run recorded it (``model.name``, read from its files by :mod:`probe.naming`), its hub id,
    or the name of its directory for a local model (runs written before names were recorded); for the
    oldest runs, the ``model`` column of ``rows``.  A random-initialisation control (``init`` in the
    manifest) is marked as such."""
    given = lookup(manifest, "config", "name")
    if isinstance(given, str) and given.strip():
        return given
    info = lookup(manifest, "model")
    model_id = lookup(info, "name")
    local = False
    if not isinstance(model_id, str) or not model_id.strip():
        model_id = lookup(info, "id")
        if (not isinstance(model_id, str) or not model_id.strip()) and rows is not None and "model" in rows.columns \
                and len(rows) and rows["model"].notna().any():
            model_id = str(rows["model"].dropna().iloc[0])
        local = isinstance(lookup(info, "path"), str) or (isinstance(model_id, str) and _looks_like_path(model_id))
    if not isinstance(model_id, str) or not model_id.strip():
        return "unknown model"
    name = Path(model_id.rstrip("/\\")).name if local else model_id
    init = lookup(info, "init") or lookup(manifest, "init")
    if isinstance(init, str) and init not in ("pretrained", ""):
        name += f" ({init} init)"
    return name or model_id


def dataset_text(manifest: dict) -> str:
    """The data in one phrase: source (a local file by its name), config, split, text and target columns."""
    spec = lookup(manifest, "dataset")
    if not isinstance(spec, dict):
        return "unknown dataset"
    source = spec.get("name")
    n = spec.get("n_examples")
    count = f", {n:,} texts" if isinstance(n, int) and not isinstance(n, bool) else ""
    if source is None:
        description = spec.get("description")
        if isinstance(description, str) and spec.get("column") in (None, "text") and "[" not in description:
            return f"{description}{count}"
        return f"embedded probe corpus{count}"
    source = str(source)
    local = _looks_like_path(source) or Path(source).suffix.lower() in (".txt", ".text", ".jsonl", ".json", ".csv", ".parquet")
    parts = [Path(source).name if local else source]
    if spec.get("config"):
        parts.append(str(spec["config"]))
    if not local and spec.get("split"):
        parts.append(str(spec["split"]))
    columns = str(spec.get("column") or "text")
    if spec.get("target_column"):
        columns += f" → {spec['target_column']}"
    return f"{'/'.join(parts)} [{columns}]{count}"


def shorten(text: str, limit: int = 32) -> str:
    """Text short enough for a figure title: long paths keep their last components after an ellipsis."""
    if len(text) <= limit:
        return text
    parts = text.split("/")
    for start in range(1, len(parts)):
        tail = "/".join(parts[start:])
        if len(tail) <= limit - 2:
            return "…/" + tail
    return text[: limit - 1] + "…"


def note_data_problems(run: Run) -> None:
    """Page warnings for an empty or interrupted run, non-converged solves and a failed fidelity check."""
    rows = run.rows
    if rows.empty:
        run.notes.append("No data: the deviations table has no rows, so there are no figures or statistics.")
    status = lookup(run.manifest, "status")
    if isinstance(status, str) and status != "complete":
        run.notes.append(f"The run's status is '{status}': the statistics cover only the batches it finished.")
    non_converged = int((~rows["converged"]).sum())
    if non_converged:
        run.notes.append(
            f"{non_converged:,} of {len(rows):,} rows did not meet the solver's certificate; "
            "they are included in every figure and statistic."
        )
    if lookup(run.manifest, "fidelity", "passed") is False:
        run.notes.append("The fidelity check failed: reconstructed attention differs from the model's.")


def read_run(run_dir: str | Path, *, name: str | None = None, allow_damaged: bool = False) -> Run:
    """Read a run directory (``deviations.parquet`` file or directory, and ``manifest.json``).

    Raises :class:`ProbeError` when the directory or its table is missing or unreadable; a missing or
    invalid manifest only warns (on the page and through :mod:`warnings`).  A run of part files with a
    manifest is checked first (:func:`probe.storage.require_intact`): a damaged one is refused, or with
    ``allow_damaged`` read without its damaged parts under a banner on the page.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ProbeError(
            f"Run directory {run_dir} does not exist (or is not a directory). "
            "Pass the run directory printed by `probe run`."
        )
    table_path = run_dir / "deviations.parquet"
    if not table_path.exists():
        raise ProbeError(
            f"{table_path} does not exist: {run_dir} is not a probe run directory. "
            "Pass the run directory printed by `probe run` (it holds deviations.parquet and manifest.json)."
        )
    manifest, problem = load_manifest(run_dir / MANIFEST)
    manifest = with_liveness(manifest)  # a "running" run whose process is gone was interrupted
    notes, files = [], None
    if table_path.is_dir() and not problem:
        check = require_intact(run_dir, manifest, allow_damaged=allow_damaged)
        files = list(check.readable.values())
        if check.damaged:
            warnings.warn(check.banner(), DamagedRunWarning, stacklevel=3)
            notes.append(check.banner())
    rows = read_deviations(table_path, files)
    if problem:
        warnings.warn(problem, stacklevel=3)
        notes.append(problem)
    space, alpha = main_slice(rows)
    run = Run(
        run_dir=run_dir,
        manifest=manifest,
        name=name.strip() if name and name.strip() else model_name(manifest, rows),
        dataset=dataset_text(manifest),
        rows=rows,
        space=space,
        alpha=alpha,
        notes=notes,
    )
    note_data_problems(run)
    return run


# --------------------------------------------------------------------------------------------------
# the query tokens' context


def token_sequences(main: pd.DataFrame, keys: set[tuple[str, int]]) -> dict[tuple[str, int], list[str]]:
    """The query tokens of each wanted (attention type, example), in query order.

    Every real token of a sequence is a query of every head, so one head's rows spell the sequence out;
    the run directory need not hold the texts.  Empty when the table has no ``token`` column values.
    """
    if not keys or "token" not in main.columns or main["token"].isna().all():
        return {}
    pairs = pd.MultiIndex.from_arrays([main["attention_type"].astype(str), main["example"]])
    subset = main.loc[pairs.isin(list(keys)), ["attention_type", "example", "query", "token"]]
    subset = subset.assign(attention_type=subset["attention_type"].astype(str)).drop_duplicates(
        ["attention_type", "example", "query"]
    )
    sequences = {}
    for (attention_type, example), group in subset.sort_values("query").groupby(["attention_type", "example"]):
        tokens = [None] * (int(group["query"].max()) + 1)
        for query, token in zip(group["query"], group["token"]):
            tokens[int(query)] = None if pd.isna(token) else str(token)
        sequences[(str(attention_type), int(example))] = ["" if t is None else t for t in tokens]
    return sequences
