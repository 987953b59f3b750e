"""Reading a run directory: the deviations table (a parquet file or a directory of part files) as a query,
the manifest, what to call the model and the data, and which slice (space, alpha) the main figures show.

A :class:`ReportRun` holds a query over the rows (:class:`probe.query.RunTable`), never the rows: every number
the report shows is asked of DuckDB (:mod:`probe.query`), so the report's memory grows with what it shows
(layers x heads x types, the explorer's worst rows, figure bins), not with the rows.  The questions several
parts of the report share (the census of rows, the relative deviation's statistics at every level, the
head-averaged values, the other measured quantities) are asked once, here, and cached on the run.

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

from probe.core.errors import ProbeError
from probe.core.naming import expand_path, is_texts_file, looks_like_path
from probe.query import Rank, RunTable, Table, both, where
from probe.query.aggregates import AVERAGED, AggregateTable, keeps
from probe.query.aggregates import QUANTILE_METHOD as SKETCH_METHOD
from probe.query.runs import LEGACY_COLUMNS, NEEDED_COLUMNS, OPTIONAL_COLUMNS, RUN_HINT
from probe.store.aggregates import RANK_ERROR
from probe.store.engine import literal
from probe.store.integrity import DamagedRunWarning, require_intact
from probe.store.storage import MANIFEST, check_format, with_liveness

__all__ = ["NEEDED_COLUMNS", "OPTIONAL_COLUMNS", "LEGACY_COLUMNS", "RUN_HINT", "ReportRun", "read_run"]

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
#: A row deviates "far" above this relative deviation (the share is a headline number).
FAR = 0.1
#: The keys of a (space, alpha) slice, and of the levels statistics are grouped by within one.
SLICE = ("space", "alpha")
LEVEL_KEYS = {
    "slice": SLICE,
    "type": SLICE + ("attention_type",),
    "layer": SLICE + ("attention_type", "layer"),
    "head": SLICE + ("attention_type", "layer", "head"),
}
#: The quantiles the report shows (median, p95), draws (box quartiles) and bins by (Freedman-Diaconis
#: on the quartiles, every panel's 1st to 99th percentile), all exact (:meth:`probe.query.Table.stats`).
QUANTILES = {"median": 0.5, "p95": 0.95, "q1": 0.25, "q3": 0.75, "p1": 0.01, "p99": 0.99}
#: The box plots' whiskers as matplotlib draws them for ``whis=(5, 95)``: the smallest value at or above
#: the 5th percentile and the largest at or below the 95th.
WHISKERS = {"whislo": Rank("above", 0.05), "whishi": Rank("below", 0.95)}
#: Quantities besides the relative deviation whose statistics the report shows, when a run has them.
QUANTITIES = ("second_order_deviation", "attention_tv", "output_deviation")
#: The drivers the deviation is drawn against (:mod:`probe.report.breakdowns`): column -> axis label.
DRIVERS = {
    "n_keys": "number of keys n",
    "attention_entropy": "attention entropy −Σ p log p (nats)",
    "evidence_norm": "‖αz‖ (the approximation's λ)",
}
#: A driver is binned by 20 quantile bins (``pandas.qcut``) unless it has few integral values.
QUANTILE_BINS = 20
DRIVER_QUANTILES = {f"qcut{i}": float(q) for i, q in enumerate(np.linspace(0, 1, QUANTILE_BINS + 1))}
#: How the report's quantiles are computed, as the page and summary.json say it.
QUANTILE_METHOD = ("exact: numpy's and pandas' linear interpolation between order statistics, each selected "
                   "exactly in two passes over the rows (no sketch, no rank error)")


def type_label(attention_type: str) -> str:
    return TYPE_LABELS.get(attention_type, attention_type)


def ordered_types(types) -> list[str]:
    """Attention types in display order: the known ones first, then any others sorted."""
    types = {str(t) for t in types}
    return [t for t in TYPE_ORDER if t in types] + sorted(types - set(TYPE_ORDER))


def in_slice(frame: pd.DataFrame, space: str | None, alpha: float | None) -> pd.DataFrame:
    """The rows of a statistics frame (with ``space`` and ``alpha`` columns) in one slice; a ``None`` key
    matches every row (a version-1 run may have one slice), alpha within a relative 1e-12 as :func:`probe.query.where`."""
    keep = np.ones(len(frame), dtype=bool)
    if space is not None:
        keep &= (frame["space"] == space).fillna(False).to_numpy(dtype=bool)
    if alpha is not None:
        keep &= np.isclose(frame["alpha"].to_numpy(dtype=float), alpha, rtol=1e-12, atol=0)
    return frame[keep]


#: Rows listed per head, worst first (the explorer's table).
WORST_ROWS = 8


@dataclass
class ReportRun:
    """A run directory as the report sees it (:class:`probe.Run` is the API's view of it): a query over its rows, and the small answers it needs.

    ``table`` is the rows (:class:`probe.query.RunTable`: every slice, ``trivial`` filled in from ``n_keys``
    where a run did not record it).  Trivial rows (``n_keys == 1``: ``lambda* = alpha z`` by construction)
    are left out of every statistic and histogram and only counted.  ``census`` counts the rows of every
    (space, alpha, attention type, layer, head): ``rows``, ``trivial``, ``non_converged``, ``measured``
    (non-trivial rows with a deviation), ``present_<column>`` (non-trivial rows where an optional column
    has a value) and, for the second-order figure, ``pairs`` (non-trivial rows with both deviations),
    ``pairs_better`` (those whose second-order deviation is the smaller) and ``pairs_max`` (the larger
    maximum of the two).  ``space`` and ``alpha`` name the main slice, the one the main figures and the
    landing summary show.
    """

    run_dir: Path
    manifest: dict
    name: str  # the model, as titles show it
    dataset: str  # the data, as titles show it
    table: RunTable
    census: pd.DataFrame
    space: str | None
    alpha: float | None
    notes: list[str] = field(default_factory=list)  # problems to show prominently on the page
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # answers of figure-level questions
    #: a run made with --keep aggregates or sample:N: its statistics (:class:`probe.query.aggregates.AggregateTable`),
    #: which every statistic is read from; ``table`` then holds its sample's rows (none for aggregates alone)
    aggregates: AggregateTable | None = None

    # ---- what the run kept

    @property
    def kept(self) -> str:
        """``rows``, ``aggregates`` or ``sample:N`` (``--keep``)."""
        return keeps(self.manifest) if self.aggregates is not None else "rows"

    @cached_property
    def sample_rows(self) -> int:
        """The rows a ``--keep sample:N`` run kept (0 for ``--keep aggregates``; every row for a run of rows)."""
        return self.table.row_count()

    @property
    def quantile_method(self) -> str:
        return QUANTILE_METHOD if self.aggregates is None else SKETCH_METHOD

    @property
    def rank_error(self) -> float:
        return 0.0 if self.aggregates is None else RANK_ERROR

    def needs_rows(self, what: str) -> str | None:
        """For a figure (or number) ``what`` that needs rows: None for a run of rows; for a run that kept a sample,
        the line that says it is drawn from the sample; None either way.  See :meth:`without_rows`."""
        if self.aggregates is None:
            return None
        return (f"{what}: drawn from the run's uniform sample of {self.sample_rows:,} rows ({self.kept}), not from "
                "every row")

    def without_rows(self, what: str) -> str | None:
        """Why ``what`` (which needs rows) is left out: a line for a ``--keep aggregates`` run (or a sample without
        rows in the main slice), None where there are rows to draw it from."""
        if self.aggregates is None or self.sample_rows:
            return None
        return (f"{what} is left out: it needs the rows, and the run kept its statistics only (--keep aggregates); "
                "run with --keep sample:N to draw it from a sample")

    # ---- what the run holds

    @property
    def main_where(self) -> str:
        """SQL: the rows of the main slice (trivial ones included)."""
        return where(space=self.space, alpha=self.alpha)

    @property
    def measured_where(self) -> str:
        """SQL: the main slice without its trivial rows: what statistics and histograms are over."""
        return where(space=self.space, alpha=self.alpha, trivial=False)

    @cached_property
    def main_census(self) -> pd.DataFrame:
        """The census of the main slice."""
        return in_slice(self.census, self.space, self.alpha)

    @cached_property
    def types(self) -> list[str]:
        return ordered_types(self.census["attention_type"].dropna().unique()) if len(self.census) else []

    @property
    def spaces(self) -> list[str]:
        return sorted(str(s) for s in self.census["space"].dropna().unique())

    @property
    def alphas(self) -> list[float]:
        return sorted(float(a) for a in self.census["alpha"].dropna().unique())

    def counts(self, attention_type: str | None = None, *, main: bool = True) -> dict[str, int]:
        """``rows``, ``trivial``, ``non_converged`` and ``measured`` of the main slice (``main=False``: of
        every slice), of one attention type or all."""
        census = self.main_census if main else self.census
        if attention_type is not None:
            census = census[census["attention_type"] == attention_type]
        return {k: int(census[k].sum()) for k in ("rows", "trivial", "non_converged", "measured")}

    def layers(self, attention_type: str, *, measured: bool = False) -> list[int]:
        """The layers of one attention type in the main slice (trivial rows included; ``measured``: only
        layers with non-trivial rows)."""
        census = self.main_census
        census = census[census["attention_type"] == attention_type]
        if measured:
            census = census[census["rows"] > census["trivial"]]
        return sorted(int(v) for v in census["layer"].unique())

    def heads(self, attention_type: str) -> list[int]:
        census = self.main_census
        return sorted(int(v) for v in census.loc[census["attention_type"] == attention_type, "head"].unique())

    def has(self, column: str, attention_type: str | None = None) -> bool:
        """Whether the main slice's non-trivial rows (of one attention type) have a value of ``column``."""
        census = self.main_census
        if attention_type is not None:
            census = census[census["attention_type"] == attention_type]
        present = f"present_{column}"
        return present in census.columns and bool(census[present].sum() > 0)

    # ---- the questions several parts of the report ask

    @cached_property
    def deviation(self) -> dict[str, pd.DataFrame]:
        """The relative deviation's statistics over the non-trivial rows of every slice, per level of
        :data:`LEVEL_KEYS` (and ``role``: per token role and layer, when the run has roles): count, mean,
        min, max, the share above :data:`FAR`, :data:`QUANTILES`, :data:`WHISKERS` and ``top``, the
        explorer's :data:`WORST_ROWS`-th largest value.  Two passes over the rows."""
        levels = dict(LEVEL_KEYS)
        if any(self.has("token_role", t) for t in self.types):
            levels["role"] = SLICE + ("attention_type", "token_role", "layer")
        if self.aggregates is not None:
            frames = self.aggregates.stats(
                "rel_deviation", list(levels.values()), quantiles=QUANTILES,
                ranks={**WHISKERS, "top": Rank("top", k=WORST_ROWS)}, above={f"share_above_{FAR:g}": FAR})
            return dict(zip(levels, frames))
        frames = self.table.stats(
            "rel_deviation", list(levels.values()), where(trivial=False),
            quantiles=QUANTILES, ranks={**WHISKERS, "top": Rank("top", k=WORST_ROWS)},
            above={f"share_above_{FAR:g}": FAR},
        )
        return dict(zip(levels, frames))

    def main_deviation(self, level: str, attention_type: str | None = None) -> pd.DataFrame:
        """:attr:`deviation` at one level in the main slice (of one attention type)."""
        frame = in_slice(self.deviation[level], self.space, self.alpha)
        return frame if attention_type is None else frame[frame["attention_type"] == attention_type]

    @cached_property
    def averaged_table(self) -> Table:
        """The head-averaged values: per (space, alpha, attention type, layer, example, query), the mean
        deviation over the layer's heads of the non-trivial rows (``value``, null where every row is
        trivial) and whether a trivial row is among them (``trivial``); written once to a scratch file."""
        return self.table.derive("averaged", (
            "SELECT space, alpha, attention_type, layer, example, query, "
            "avg(rel_deviation) FILTER (WHERE NOT trivial) AS value, bool_or(trivial) AS trivial "
            f"FROM {self.table.relation_name} GROUP BY ALL"
        ))

    @cached_property
    def averaged(self) -> dict[str, pd.DataFrame]:
        """Statistics of the head-averaged values per layer (``layer``) and pooled per slice (``slice``),
        every slice, as :attr:`deviation` has them."""
        if self.aggregates is not None:
            frames = self.aggregates.stats(AVERAGED, [LEVEL_KEYS["layer"], LEVEL_KEYS["slice"]], quantiles=QUANTILES,
                                           above={f"share_above_{FAR:g}": FAR})
            return {"layer": frames[0], "slice": frames[1]}
        frames = self.averaged_table.stats(
            "value", [LEVEL_KEYS["layer"], LEVEL_KEYS["slice"]], quantiles=QUANTILES,
            above={f"share_above_{FAR:g}": FAR},
        )
        return {"layer": frames[0], "slice": frames[1]}

    @cached_property
    def groups(self) -> dict[str, pd.DataFrame]:
        """Sizes, value counts, sums and counts above the type's 95th percentile of the main slice's
        non-trivial rows, grouped by what findings and breakdowns ask about: ``token_role``, ``query``,
        ``token``, ``head`` (layer, head) and ``position`` (layer, query), each within its attention type.
        Columns: the keys, ``rows``, ``count`` (rows with a deviation), ``sum``, ``above_p95`` (NaN for a run that
        kept aggregates: counting the values above a percentile needs the rows).  One pass."""
        if self.aggregates is not None:
            return self.aggregates.groups({"space": self.space, "alpha": self.alpha})
        p95 = self.main_deviation("type")
        cases = " ".join(f"WHEN {literal(t)} THEN {literal(float(v))}"
                         for t, v in zip(p95["attention_type"], p95["p95"]))
        threshold = f"CASE attention_type {cases} END" if cases else "NULL"
        kinds = {"token_role": ("token_role",), "token": ("token",), "head": ("layer", "head"),
                 "position": ("layer", "query")}
        frames = dict(zip(kinds, self.table.aggregate(
            {"rows": "CAST(count(*) AS BIGINT)", "count": "CAST(count(rel_deviation) AS BIGINT)",
             "sum": "fsum(rel_deviation)", "above_p95": f"CAST(count_if(rel_deviation > {threshold}) AS BIGINT)"},
            [("attention_type",) + keys for keys in kinds.values()], self.measured_where)))
        frames["query"] = frames["position"].groupby(["attention_type", "query"], as_index=False)[
            ["rows", "count", "sum", "above_p95"]].sum()
        return frames

    @cached_property
    def quantities(self) -> dict[str, pd.DataFrame]:
        """Statistics of the other measured quantities (:data:`QUANTITIES`) and of the drivers the breakdowns
        draw against (:data:`DRIVERS`) that the run has, over the main slice's non-trivial rows (a driver's
        only where the row has a deviation), per (quantity, attention type, layer) (``layer``) and (quantity,
        attention type) (``type``): count, mean, min, max, the number of distinct values (``distinct``, where
        pass 1 sees it), and for quantities :data:`QUANTILES` and :data:`WHISKERS`, for drivers (per type)
        the :data:`DRIVER_QUANTILES` that bin them.
        Two passes over the rows for all of them.  A run that kept aggregates has the quantities' statistics from
        them, and the drivers' from its sample (none without one)."""
        if self.aggregates is not None:
            return self._kept_quantities()
        present = [column for column in QUANTITIES + tuple(DRIVERS) if self.has(column)]
        if not present:
            empty = pd.DataFrame(columns=["quantity", "attention_type", "layer", "count", "mean", "max", "p95"])
            return {"layer": empty, "type": empty.drop(columns="layer")}
        stacked = Table(self.table.connection, "(" + " UNION ALL ".join(  # one scan each: cheaper than UNPIVOT
            f"SELECT attention_type, layer, {literal(c)} AS quantity, CAST({c} AS DOUBLE) AS value "
            f"FROM {self.table.relation_name} WHERE {self.measured_where} AND {c} IS NOT NULL"
            + ("" if c in QUANTITIES else " AND rel_deviation IS NOT NULL") for c in present) + ")", self.table.path)
        def needed(statistic: str, grouping: int, table: pd.DataFrame) -> np.ndarray:
            """Drivers: their quantile bins, per attention type; quantities: the box plots', per layer."""
            driver = table["quantity"].isin(list(DRIVERS)).to_numpy()
            return driver & (grouping == 1) if statistic in DRIVER_QUANTILES else ~driver

        layer, by_type = stacked.stats(
            "value", [("quantity", "attention_type", "layer"), ("quantity", "attention_type")],
            quantiles={**QUANTILES, **DRIVER_QUANTILES}, ranks=WHISKERS, distinct=True, needed=needed)
        return {"layer": layer, "type": by_type}

    def _kept_quantities(self) -> dict[str, pd.DataFrame]:
        """:attr:`quantities` of a run that kept aggregates: the quantities from them, the drivers from the sample."""
        layers, types = [], []
        for column in QUANTITIES:
            if not self.has(column):
                continue
            layer, by_type = self.aggregates.stats(
                column, [("attention_type", "layer"), ("attention_type",)], {"space": self.space, "alpha": self.alpha},
                quantiles=QUANTILES, ranks=WHISKERS)
            layers.append(layer.assign(quantity=column))
            types.append(by_type.assign(quantity=column))
        drivers = [d for d in DRIVERS if self.has(d)]
        if drivers and self.sample_rows:
            from dataclasses import replace

            found = replace(self, aggregates=None, memo={}, census=census(self.table)).quantities
            layers.append(found["layer"][found["layer"]["quantity"].isin(drivers)])
            types.append(found["type"][found["type"]["quantity"].isin(drivers)])
        columns = ["quantity", "attention_type", "layer", "count", "mean", "max", "p95"]
        if not layers:
            empty = pd.DataFrame(columns=columns)
            return {"layer": empty, "type": empty.drop(columns="layer")}
        return {"layer": pd.concat(layers, ignore_index=True), "type": pd.concat(types, ignore_index=True)}

    def averaged_trivial(self, keys) -> pd.Series:
        """Per group of ``keys`` (a layer's), the (example, query) values with a trivial row among their heads."""
        if self.aggregates is not None:
            (frame,) = self.aggregates.stats(AVERAGED, [tuple(keys)], trivial=True)
            return frame.set_index(list(keys))["trivial"]
        (trivial,) = self.averaged_table.aggregate({"trivial": "CAST(count_if(trivial) AS BIGINT)"}, [tuple(keys)])
        return trivial.set_index(list(keys))["trivial"]

    # ---- words

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

    @property
    def measured(self) -> str | None:
        """What the run measured when it selected part of the model (``"layers 0, 5, 11; 32 sampled query
        positions per text"``: the manifest's ``selection``, :mod:`probe.capture.selection`); None for a run of
        every layer, head and query position."""
        return selection_text(self.manifest)


def main_slice(census: pd.DataFrame) -> tuple[str | None, float | None]:
    """The slice the main figures show: alpha = 1 if present (else the smallest alpha), space "hidden"
    if present (else the first in sorted order)."""
    spaces = sorted(str(s) for s in census["space"].dropna().unique())
    alphas = sorted(float(a) for a in census["alpha"].dropna().unique())
    space = "hidden" if "hidden" in spaces else (spaces[0] if spaces else None)
    alpha = 1.0 if any(np.isclose(a, 1.0) for a in alphas) else (alphas[0] if alphas else None)
    return space, alpha


def census(table: RunTable) -> pd.DataFrame:
    """Row counts per (space, alpha, attention type, layer, head): see :class:`ReportRun`.  One pass."""
    paired = "NOT trivial AND rel_deviation IS NOT NULL AND second_order_deviation IS NOT NULL"
    counted = {
        "rows": "count(*)", "trivial": "count_if(trivial)", "non_converged": "count_if(NOT converged)",
        "measured": "count(rel_deviation) FILTER (WHERE NOT trivial)",
        **{f"present_{c}": f"count({c}) FILTER (WHERE NOT trivial)" for c in OPTIONAL_COLUMNS
           if c not in ("alpha", "space", "trivial")},
        "pairs": f"count(*) FILTER (WHERE {paired})",
        "pairs_better": f"count_if(second_order_deviation < rel_deviation) FILTER (WHERE {paired})",
    }
    (frame,) = table.aggregate(
        {**{k: f"CAST({v} AS BIGINT)" for k, v in counted.items()},
         "pairs_max": f"greatest(max(rel_deviation) FILTER (WHERE {paired}), "
                      f"max(second_order_deviation) FILTER (WHERE {paired}))"}, [LEVEL_KEYS["head"]])
    return frame


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




def run_title(manifest: dict, rows: pd.DataFrame | None = None) -> str:
    """The run as a reader knows it: the name given with ``probe run --name``; else the model's name
    (:func:`model_of`)."""
    given = given_name(manifest)
    return given if given is not None else model_of(manifest, rows)


def given_name(manifest: dict) -> str | None:
    """The name given with ``probe run --name`` (None: none was given)."""
    given = lookup(manifest, "config", "name")
    return given if isinstance(given, str) and given.strip() else None


def model_of(manifest: dict, rows: pd.DataFrame | None = None) -> str:
    """The model's real name as the run recorded it (``model.name``, read from its files by
    :mod:`probe.core.naming`), its hub id, or the name of its directory for a local model; for a version-1 run
    that records neither (:data:`probe.store.storage.FORMAT_VERSION`), the ``model`` column of ``rows`` (a frame
    with at least one of its values).  A random-initialisation control (``init`` in the manifest) is marked as
    such."""
    info = lookup(manifest, "model")
    model_id = lookup(info, "name")
    local = False
    if not isinstance(model_id, str) or not model_id.strip():
        model_id = lookup(info, "id")
        if (not isinstance(model_id, str) or not model_id.strip()) and rows is not None and "model" in rows.columns \
                and len(rows) and rows["model"].notna().any():
            model_id = str(rows["model"].dropna().iloc[0])
        local = isinstance(lookup(info, "path"), str) or (isinstance(model_id, str) and looks_like_path(model_id))
    if not isinstance(model_id, str) or not model_id.strip():
        return "unknown model"
    name = Path(model_id.rstrip("/\\")).name if local else model_id
    init = lookup(info, "init") or lookup(manifest, "init")
    if isinstance(init, str) and init not in ("pretrained", ""):
        name += f" ({init} init)"
    return name or model_id


def selection_text(manifest: dict) -> str | None:
    """What a run measured, in words, when it selected part of the model (None: everything, or a run recorded
    without a selection)."""
    description = lookup(manifest, "selection", "description")
    return None if description in (None, "every layer, head and query position") else str(description)


def dataset_text(manifest: dict, covered: int | None = None) -> str:
    """The data in one phrase: source (a local file by its name), config, split, text and target columns,
    and the texts: ``covered`` of them (a run not finished: the texts its finished batches hold) of all."""
    spec = lookup(manifest, "dataset")
    if not isinstance(spec, dict):
        return "unknown dataset"
    source = spec.get("name")
    n = spec.get("n_examples")
    count = f", {n:,} texts" if isinstance(n, int) and not isinstance(n, bool) else ""
    if covered is not None and count and covered != n:
        count = f", {covered:,} of {n:,} texts"
    if source is None:
        description = spec.get("description")
        if isinstance(description, str) and spec.get("column") in (None, "text") and "[" not in description:
            return f"{description}{count}"
        return f"embedded probe corpus{count}"
    source = str(source)
    if is_texts_file(expand_path(source)):  # probe.run(texts=[...]): a file of probe's cache, named by a hash
        return f"{n:,} texts given in Python" if isinstance(n, int) and not isinstance(n, bool) else \
            "texts given in Python"
    local = looks_like_path(source) or Path(source).suffix.lower() in (".txt", ".text", ".jsonl", ".json", ".csv", ".parquet")
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


def note_data_problems(run: ReportRun) -> None:
    """Page warnings for an empty or interrupted run, non-converged solves and a failed fidelity check."""
    counts = run.counts(main=False)
    if not counts["rows"]:
        run.notes.append("No data: the deviations table has no rows, so there are no figures or statistics.")
    status = lookup(run.manifest, "status")
    if isinstance(status, str) and status != "complete":
        run.notes.append(f"The run's status is '{status}': the statistics cover only the batches it finished.")
    if counts["non_converged"]:
        run.notes.append(
            f"{counts['non_converged']:,} of {counts['rows']:,} rows did not meet the solver's certificate; "
            "they are included in every figure and statistic."
        )
    if lookup(run.manifest, "fidelity", "passed") is False:
        run.notes.append("The fidelity check failed: reconstructed attention differs from the model's.")


def open_table(run_dir: Path, manifest: dict, problem: str | None, *, allow_damaged: bool = False,
               connection=None, view: str = "rows") -> tuple[RunTable, list[str]]:
    """A run directory's rows as a query, and the notes to show for them.  A directory of part files with a
    manifest is checked first (:func:`probe.store.integrity.require_intact`): a damaged one is refused, or with
    ``allow_damaged`` read without its damaged parts under a banner; without a usable manifest every part
    file is read."""
    table_path = run_dir / "deviations.parquet"
    notes, files, check = [], None, None
    if table_path.is_dir():
        if not problem:
            check = require_intact(run_dir, manifest, allow_damaged=allow_damaged)
            files = list(check.readable.values())
            if check.damaged:
                warnings.warn(check.banner(), DamagedRunWarning, stacklevel=3)
                notes.append(check.banner())
        table = RunTable(table_path, files, connection=connection, view=view, check=check)
        if not table.files:
            raise ProbeError(f"{table_path} holds no parquet part files. {RUN_HINT}")
        return table, notes
    return RunTable(table_path, connection=connection, view=view), notes


def _texts_covered(table: RunTable, manifest: dict, aggregates: AggregateTable | None = None) -> int | None:
    """The texts a run not (yet) complete has rows of (None for a complete run: all of them)."""
    if lookup(manifest, "status") == "complete" or not table.files:
        return None
    if aggregates is not None:
        return int(aggregates.table("queries")["example"].nunique())
    return int(table.frame(f"SELECT count(DISTINCT example) AS n FROM {table.relation_name}")["n"].iloc[0])


def require_run_dir(run_dir: str | Path) -> Path:
    """``run_dir`` as a path, when it is a folder; a :class:`ProbeError` that says what it is otherwise (a file,
    nothing), before anything else is checked: the readers' first check."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        return run_dir
    what = "is a file, not a run directory" if run_dir.exists() else "does not exist"
    raise ProbeError(f"{run_dir} {what}. Pass the run directory printed by `probe run` (it holds manifest.json and "
                     "deviations.parquet), or DIR/NAME for the newest run named NAME.")


def read_run(run_dir: str | Path, *, name: str | None = None, allow_damaged: bool = False, connection=None,
             view: str = "rows") -> ReportRun:
    """Read a run directory (``deviations.parquet`` file or directory, and ``manifest.json``) as a query.

    Raises :class:`ProbeError` when the directory or its table is missing or unreadable; a missing or
    invalid manifest only warns (on the page and through :mod:`warnings`).  A run of part files with a
    manifest is checked first (:func:`probe.store.integrity.require_intact`): a damaged one is refused, or with
    ``allow_damaged`` read without its damaged parts under a banner on the page.  Reads one pass of the
    rows (the census); ``connection`` and ``view``: a DuckDB connection and view name to share (compare).
    """
    run_dir = require_run_dir(run_dir)
    table_path = run_dir / "deviations.parquet"
    if not table_path.exists():
        raise ProbeError(
            f"{table_path} does not exist: {run_dir} is not a probe run directory. "
            "Pass the run directory printed by `probe run` (it holds deviations.parquet and manifest.json)."
        )
    manifest, problem = load_manifest(run_dir / MANIFEST)
    check_format(manifest, run_dir / MANIFEST)  # a run of a newer format is refused, not misread
    manifest = with_liveness(manifest)  # a "running" run whose process is gone was interrupted
    table, notes = open_table(run_dir, manifest, problem, allow_damaged=allow_damaged, connection=connection,
                              view=view)
    if problem:
        warnings.warn(problem, stacklevel=2)
        notes.append(problem)
    aggregates = AggregateTable.open(run_dir, manifest, allow_damaged=allow_damaged) if not problem else None
    counted = census(table) if aggregates is None else aggregates.census()
    space, alpha = main_slice(counted)
    legacy = None
    if "model" in (table.schema.names if table.schema is not None else []):
        legacy = table.frame(f"SELECT model FROM {table.relation_name} WHERE model IS NOT NULL LIMIT 1")
    run = ReportRun(
        run_dir=run_dir,
        manifest=manifest,
        name=name.strip() if name and name.strip() else run_title(manifest, legacy),
        dataset=dataset_text(manifest, _texts_covered(table, manifest, aggregates)),
        table=table,
        census=counted,
        space=space,
        alpha=alpha,
        notes=notes,
        aggregates=aggregates,
    )
    note_data_problems(run)
    return run


# --------------------------------------------------------------------------------------------------
# the query tokens' context


def token_sequences(run: ReportRun, keys: set[tuple[str, int]]) -> dict[tuple[str, int], list[str]]:
    """The query tokens of each wanted (attention type, example), in query order.

    Every real token of a sequence is a query of every head, so one head's rows spell the sequence out
    (read from the main slice's first layer and head of the type); the run directory need not hold the
    texts.  Empty when the table has no ``token`` values.
    """
    if not keys or not any(run.has("token", t) for t in run.types):
        return {}
    if run.aggregates is not None:
        return run.aggregates.token_sequences(keys, {"space": run.space, "alpha": run.alpha})
    sequences = {}
    for attention_type in sorted({t for t, _ in keys}):
        examples = sorted({e for t, e in keys if t == attention_type})
        layer, head = run.layers(attention_type)[0], run.heads(attention_type)[0]
        rows = run.table.frame(
            f"SELECT example, query, min(token) AS token FROM {run.table.relation_name} WHERE "
            f"{both(run.main_where, where(attention_type=attention_type, layer=layer, head=head, example=examples))} "
            "GROUP BY ALL ORDER BY example, query"
        )
        for example, group in rows.groupby("example", sort=True):
            tokens = [""] * (int(group["query"].max()) + 1)
            for query, token in zip(group["query"], group["token"]):
                tokens[int(query)] = "" if pd.isna(token) else str(token)
            sequences[(attention_type, int(example))] = tokens
    return sequences
