"""Breakdowns of the relative deviation by what might drive it: the query token's role, the query
position (a layer x position heatmap), and the row's number of keys, attention entropy and ``||alpha z||``.

Every figure here is over the non-trivial rows of the main slice and uses the report's shared scales.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.colors import LogNorm

from probe.query import Table, both, where
from probe.query.sql import cut_bin, edges_bin, edges_guess
from probe.report.data import DRIVER_QUANTILES, DRIVERS, ReportRun, type_label
from probe.report.style import (
    CMAP,
    DEVIATION_LABEL,
    MEAN_COLOR,
    P95_COLOR,
    Drawn,
    Scale,
    file_stem,
    new_figure,
    suptitle,
)
from probe.store.engine import literal

#: A (layer, position) cell of the position heatmap needs this many rows, or it is left blank.
MIN_POSITION_ROWS = 20
ROLE_COLORS = {"special": "#d62728", "first": "#9467bd", "word": "#1f77b4"}
#: A driver with at most this many distinct integral values is binned by its values, else by
#: :data:`probe.report.data.QUANTILE_BINS` quantiles.
DISCRETE_VALUES = 40
#: Spearman's ρ is computed over every row up to this many rows of an attention type, else over a
#: deterministic sample of about this many (each row kept by the hash of its key); the title says which.
SPEARMAN_ROWS = 1_000_000
#: hist2d bins of the drivers and second-order figures
DENSITY_BINS = 60


def position_grid(run: ReportRun, attention_type: str) -> pd.DataFrame:
    """Mean deviation per (layer, query position), NaN where a cell has fewer than MIN_POSITION_ROWS rows."""
    cells = run.groups["position"]
    cells = cells[cells["attention_type"] == attention_type]
    means = (cells["sum"] / cells["count"]).where(cells["count"] >= MIN_POSITION_ROWS)
    grid = pd.Series(means.to_numpy(dtype=float), index=pd.MultiIndex.from_arrays(
        [cells["layer"].to_numpy(), cells["query"].to_numpy()], names=["layer", "query"])).unstack("query").sort_index()
    if grid.empty:
        return grid
    grid = grid.reindex(columns=range(int(grid.columns.min()), int(grid.columns.max()) + 1))
    keep = grid.columns[grid.notna().any(axis=0)]
    return grid.loc[:, keep.min() : keep.max()] if len(keep) else grid.iloc[:, :0]


def _measured_types(run: ReportRun) -> list[str]:
    return [t for t in run.types if run.counts(t)["rows"] > run.counts(t)["trivial"]]


def roles_figure(run: ReportRun, scale: Scale) -> Drawn | None:
    """Mean and p95 per layer for each token role, one panel per attention type (needs ``token_role``)."""
    if not run.has("token_role"):
        return None
    types = _measured_types(run)
    by_layer = run.main_deviation("role")
    roles = run.groups["token_role"]
    figure = new_figure(max(6.5, 3.6 * len(types) + 0.8), 4.3)
    axes = figure.subplots(1, len(types), squeeze=False, sharey=True)[0]
    for ax, attention_type in zip(axes, types):
        counts = run.counts(attention_type)
        type_rows = counts["rows"] - counts["trivial"]
        in_type = roles[(roles["attention_type"] == attention_type) & roles["token_role"].notna()]
        for role, size in sorted(zip(in_type["token_role"].astype(str), in_type["rows"])):
            stats = by_layer[(by_layer["attention_type"] == attention_type) & (by_layer["token_role"] == role)]
            stats = stats.set_index("layer").sort_index()
            color = ROLE_COLORS.get(role, "#7f7f7f")
            ax.plot(stats["mean"], marker="o", color=color, label=f"{role} ({size / type_rows:.1%} of rows): mean")
            ax.plot(stats["p95"], marker="o", linestyle="--", color=color, alpha=0.7, label=f"{role}: p95")
        ax.set_title(f"{type_label(attention_type)}\n{type_rows:,} rows")
        ax.set_xlabel("layer")
        ax.set_ylim(0, scale.x_max * 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(0, -0.18), ncol=2, frameon=False)
    axes[0].set_ylabel(DEVIATION_LABEL)
    details = suptitle(figure, f"{run.name} · by the query token's role", "trivial rows left out",
                       "y axis from 0, shared")
    caption = (
        "Relative deviation per layer for each query token role (special: the tokenizer's special tokens; first: "
        "the first decoder position; word: every other token); solid lines mean, dashed 95th percentile. " + details
    )
    return Drawn("roles", caption, figure)


def positions_figure(run: ReportRun, attention_type: str, scale: Scale) -> Drawn | None:
    """Layer x query position heatmap of the mean deviation, on the report's shared colour scale."""
    grid = position_grid(run, attention_type)
    if grid.empty:
        return None
    n_layers, n_positions = grid.shape
    figure = new_figure(min(24.0, max(6.5, 0.13 * n_positions + 2.6)), max(3.2, 0.38 * n_layers + 2.0))
    ax = figure.subplots()
    image = ax.pcolormesh(
        np.arange(n_positions + 1) - 0.5 + grid.columns[0], np.arange(n_layers + 1) - 0.5 + grid.index[0],
        np.ma.masked_invalid(grid.to_numpy(dtype=float)), cmap=CMAP, vmin=0, vmax=scale.color_max,
    )
    ax.set_facecolor("#e0e0e0")
    ax.grid(False)
    ax.invert_yaxis()
    ax.set_xlabel("query position (0 = first token)")
    ax.set_ylabel("layer")
    ax.yaxis.get_major_locator().set_params(integer=True)
    figure.colorbar(image, ax=ax, label="mean relative deviation", shrink=0.9)
    details = suptitle(figure, f"{run.name} · {type_label(attention_type)} · by query position", scale.color_text)
    caption = (
        f"{type_label(attention_type)}: mean relative deviation per layer and query position (trivial rows left "
        f"out; grey: cells with fewer than {MIN_POSITION_ROWS} rows). {details}"
    )
    return Drawn(f"positions_{file_stem(attention_type)}", caption, figure, attention_type, wide=n_positions > 60)


def density(ax, counts: np.ndarray, x_edges: np.ndarray, y_edges: np.ndarray) -> None:
    """A 2-D histogram from its counts, drawn as ``Axes.hist2d(..., cmap="Greys", norm=LogNorm())`` draws it."""
    ax.pcolormesh(x_edges, y_edges, counts.T.astype(float), cmap="Greys", norm=LogNorm(), rasterized=True)
    ax.set_xlim(x_edges[[0, -1]])
    ax.set_ylim(y_edges[[0, -1]])


def _drivers_source(run: ReportRun, drivers: list[str]) -> Table:
    """The main slice's non-trivial rows with a deviation, one row per driver value (``driver``, ``x``)."""
    return Table(run.table.connection, "(" + " UNION ALL ".join(  # one scan each: cheaper than UNPIVOT
        f"SELECT attention_type, rel_deviation, {literal(d)} AS driver, CAST({d} AS DOUBLE) AS x FROM "
        f"{run.table.relation_name} WHERE {both(run.measured_where, 'rel_deviation IS NOT NULL', f'{d} IS NOT NULL')}"
        for d in drivers) + ")", run.table.path)


def _is_driver(key: tuple[str, str]) -> str:
    return f"attention_type = {literal(key[0])} AND driver = {literal(key[1])}"


def driver_bins(run: ReportRun) -> dict:
    """Per (attention type, driver) with more than one value: ``rows`` (rows with both values), the driver's
    range ``min``, ``max``, its bins (``discrete``: its own values, when at most :data:`DISCRETE_VALUES`,
    all close to integers; else ``edges``: :data:`probe.report.data.QUANTILE_BINS` quantile bins as ``pandas.qcut`` makes
    them) and the deviation's mean and 95th percentile per bin (``binned``, indexed by the bin's value or
    interval midpoint).  Four passes over the rows, whatever the drivers.  Cached on the run."""
    if "drivers" in run.memo:
        return run.memo["drivers"]
    present = [d for d in DRIVERS if run.has(d)]
    found = {}
    if present:
        source = _drivers_source(run, present)
        facts = run.quantities["type"]
        for fact in facts[facts["quantity"].isin(present)].to_dict("records"):
            if not (fact["count"] and fact["max"] > fact["min"]):
                continue
            key = (fact["attention_type"], fact["quantity"])
            few = fact["distinct"] <= DISCRETE_VALUES if np.isfinite(fact["distinct"]) else (
                fact["intervals"] <= DISCRETE_VALUES and len(run.table.frame(  # rare: count them
                    f"SELECT DISTINCT x FROM {source.relation_name} WHERE {_is_driver(key)} "
                    f"LIMIT {DISCRETE_VALUES + 1}")) <= DISCRETE_VALUES)
            found[key] = {"rows": int(fact["count"]), "min": float(fact["min"]), "max": float(fact["max"]),
                          "discrete": few, "edges": np.unique([fact[q] for q in DRIVER_QUANTILES])}
        for _attempt in range(2):  # a few values that are not all integers: binned by quantiles after all
            bins = " ".join(f"WHEN {_is_driver(key)} THEN "
                            + ("x" if fact["discrete"] else f"CAST({cut_bin('x', fact['edges'])} AS DOUBLE)")
                            for key, fact in found.items())
            if not bins:
                break
            (binned,) = source.stats("rel_deviation", [("attention_type", "driver", "bin")],
                                     columns={"bin": f"CASE {bins} END"}, quantiles={"p95": 0.95})
            redo = False
            for key, fact in found.items():
                part = binned[(binned["attention_type"] == key[0]) & (binned["driver"] == key[1])]
                part = part[part["bin"].notna()]
                x = part["bin"].to_numpy(dtype=float)
                if fact["discrete"] and not np.allclose(x, np.round(x)):
                    fact["discrete"], redo = False, True
                    continue
                if not fact["discrete"]:
                    intervals = pd.cut(fact["edges"], fact["edges"], include_lowest=True).categories
                    x = np.asarray([interval.mid for interval in intervals], dtype=float)[x.astype(np.int64)]
                order = np.argsort(x, kind="stable")
                fact["binned"] = pd.DataFrame(
                    {"mean": part["mean"].to_numpy()[order], "p95": part["p95"].to_numpy()[order]},
                    index=pd.Index(x[order], name="bin"))
            if not redo:
                break
    run.memo["drivers"] = found
    return found


def _densities(run: ReportRun, found: dict, y_edges: np.ndarray) -> dict:
    """The 2-D histogram counts (driver x deviation) of each (attention type, driver): one pass, a grouping
    set per driver."""
    drivers = sorted({d for _, d in found})
    if not drivers:
        return {}
    x_edges = {key: np.linspace(f["min"], f["max"], DENSITY_BINS + 1) for key, f in found.items()}
    guesses, bins = [], []
    for d in drivers:
        keys = [key for key in found if key[1] == d]
        guesses.append("CASE " + " ".join(f"WHEN attention_type = {literal(key[0])} THEN {edges_guess(d, x_edges[key])}"
                                          for key in keys) + f" END AS _g_{d}")
        bins.append("CASE " + " ".join(f"WHEN attention_type = {literal(key[0])} THEN "
                                       f"{edges_bin(d, x_edges[key], f'_g_{d}')}" for key in keys) + f" END AS _x_{d}")
    sets = ", ".join(f"(attention_type, _x_{d}, _y)" for d in drivers)
    cells = run.table.frame(
        f"SELECT {', '.join(f'GROUPING(_x_{d}) AS _in_{d}' for d in drivers)}, attention_type, "
        f"{', '.join(f'_x_{d}' for d in drivers)}, _y, count(*) AS n FROM (SELECT attention_type, {', '.join(bins)}, "
        f"{edges_bin('rel_deviation', y_edges, '_gy')} AS _y FROM (SELECT attention_type, rel_deviation, "
        f"{', '.join(drivers)}, {', '.join(guesses)}, {edges_guess('rel_deviation', y_edges)} AS _gy "
        f"FROM {run.table.relation_name} WHERE {both(run.measured_where, 'rel_deviation IS NOT NULL')})) "
        f"GROUP BY GROUPING SETS ({sets})"
    )
    counts = {}
    for key, edges in x_edges.items():
        grid = np.zeros((DENSITY_BINS, len(y_edges) - 1))
        part = cells[(cells[f"_in_{key[1]}"] == 0) & (cells["attention_type"] == key[0])]
        part = part[part[f"_x_{key[1]}"].notna() & part["_y"].notna()]
        grid[part[f"_x_{key[1]}"].to_numpy(dtype=np.int64), part["_y"].to_numpy(dtype=np.int64)] = part["n"].to_numpy()
        counts[key] = (edges, grid)
    return counts


def spearman(run: ReportRun, attention_type: str, drivers: list[str]) -> dict[str, tuple[float, int]]:
    """Spearman's rank correlation of the deviation with each driver over the rows of one attention type that
    have both: ``(rho, rows used)``; over every row up to :data:`SPEARMAN_ROWS`, else over a deterministic
    sample of about that many (a row is kept by the hash of its key)."""
    sample, _ = run.table.sample(
        ["rel_deviation", *drivers], both(run.measured_where, where(attention_type=attention_type),
                                          "rel_deviation IS NOT NULL"), SPEARMAN_ROWS,
        ("layer", "head", "example", "query"),
        total=run.counts(attention_type)["measured"] if run.aggregates is None else None)
    out = {}
    for driver in drivers:
        ok = sample[driver].notna()
        x, y = sample.loc[ok, driver].astype(float), sample.loc[ok, "rel_deviation"].astype(float)
        rho = x.reset_index(drop=True).corr(y.reset_index(drop=True), method="spearman") \
            if len(x) > 2 and np.ptp(y.to_numpy()) > 0 else math.nan
        out[driver] = (rho, int(ok.sum()))
    return out


def drivers_figure(run: ReportRun, attention_type: str, scale: Scale) -> Drawn | None:
    """Deviation against n_keys, attention entropy and ||alpha z||: a 2-D histogram of the rows with the
    binned mean and 95th percentile, and Spearman's rank correlation in the panel title."""
    found = driver_bins(run)
    drivers = [d for d in DRIVERS if (attention_type, d) in found and run.has(d, attention_type)]
    counts = run.counts(attention_type)
    if not drivers or counts["rows"] - counts["trivial"] < 2:
        left_out = run.without_rows(f"The drivers figure of {type_label(attention_type)}")
        if left_out is not None and left_out not in run.notes:
            run.notes.append(left_out)
        return None
    y_edges = np.linspace(0, scale.x_max * 1.05, DENSITY_BINS + 1)
    key = ("densities", y_edges.tobytes())
    if key not in run.memo:
        run.memo[key] = _densities(run, found, y_edges)
    densities = run.memo[key]
    correlations = spearman(run, attention_type, drivers)
    figure = new_figure(max(6.5, 4.0 * len(drivers) + 0.6), 4.2)
    axes = figure.subplots(1, len(drivers), squeeze=False, sharey=True)[0]
    for ax, column in zip(axes, drivers):
        fact = found[(attention_type, column)]
        if (attention_type, column) in densities:
            density(ax, densities[(attention_type, column)][1], densities[(attention_type, column)][0], y_edges)
        binned = fact["binned"]
        ax.plot(binned["mean"], color=MEAN_COLOR, marker=".", label="mean")
        ax.plot(binned["p95"], color=P95_COLOR, marker=".", label="95th percentile")
        rho, used = correlations[column]
        rows = f"{used:,} rows" if used == fact["rows"] else f"a sample of {used:,} of {fact['rows']:,} rows"
        ax.set_title(f"against {column}\nSpearman ρ = {rho:.2f} over {rows}")
        ax.set_xlabel(DRIVERS[column])
        ax.set_ylim(0, scale.x_max * 1.05)
        ax.legend(fontsize="x-small", loc="upper right")
    axes[0].set_ylabel(DEVIATION_LABEL)
    details = suptitle(figure, f"{run.name} · {type_label(attention_type)} · against likely drivers",
                       "y axis from 0, shared", run.needs_rows("every panel") or "")
    caption = (
        f"{type_label(attention_type)}: relative deviation against the number of keys, the attention entropy of "
        "the row and ‖αz‖ (where present): density of rows (grey, log), binned mean (red) and 95th percentile "
        f"(orange), Spearman's ρ. {details}"
    )
    return Drawn(f"drivers_{file_stem(attention_type)}", caption, figure, attention_type)
