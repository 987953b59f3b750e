"""The query layer (probe.query) against pandas and numpy on the same Parquet, and every reader that streams
through it (report, compare, the API's headline, slices and .rows) on runs larger than a lowered memory budget.

Quantiles and order statistics are compared exactly (they are the same order statistics, interpolated as
numpy interpolates them); counts exactly, means to 1e-12, maxima exactly.  Each pass of the exact quantiles
(the logarithmic bins, their merge when bins overlap, the split of a bin too large to read) is forced here
on small data.  Memory is shown by what the old readers could not do: DuckDB's own ``quantile_cont`` runs
out of a 128 MB limit where :meth:`probe.query.Table.stats` does not, ``.rows`` is refused before it would
exceed the budget, and a reader's peak RSS stays flat from 0.3M to 3M rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import probe
from probe import query
from probe.core.errors import ProbeError
from probe.core.schema import DEVIATION_SCHEMA, ROW_KEY
from probe.query import Rank, Table, where
from probe.query import runs as query_runs
from probe.query import table as query_table
from probe.report import build_report, compare_runs
from probe.store import engine

from ..support.synthetic_runs import deviation_rows, manifest_for, write_run

ROOT = Path(__file__).resolve().parents[2]


def frame_table(frame: pd.DataFrame, tmp_path: Path, parts: int = 1):
    """``frame`` as Parquet files under ``tmp_path`` (``parts`` of them) and a :class:`Table` over them."""
    directory = tmp_path / "data"
    directory.mkdir()
    bounds = np.linspace(0, len(frame), parts + 1).astype(int)
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(pa.Table.from_pandas(frame.iloc[start:stop], preserve_index=False),
                       directory / f"part-{i:06d}.parquet", row_group_size=1000)
    return Table(engine.connect(), engine.parquet_source(sorted(directory.iterdir())))


@pytest.fixture
def values(tmp_path):
    """Values with ties, zeros, negatives, NaN (read as null), a null group key and groups of one value."""
    rng = np.random.default_rng(7)
    n = 60_000
    frame = pd.DataFrame({
        "g": rng.choice(["a", "b", "c", None], n, p=[0.5, 0.3, 0.15, 0.05]),
        "h": rng.integers(0, 4, n).astype(np.int32),
        "v": rng.gamma(2.0, 0.03, n),
    })
    frame.loc[rng.choice(n, 3000, replace=False), "v"] = 0.05  # a tie large enough to fill a bin
    frame.loc[rng.choice(n, 500, replace=False), "v"] = 0.0
    frame.loc[rng.choice(n, 500, replace=False), "v"] *= -1
    frame.loc[rng.choice(n, 200, replace=False), "v"] = np.nan
    frame.loc[len(frame)] = ["d", 9, 0.3]  # a group of one value
    return frame


QUANTILES = {"p0": 0.0, "p1": 0.01, "q1": 0.25, "median": 0.5, "p95": 0.95, "p99": 0.99, "p100": 1.0}
RANKS = {"whislo": Rank("above", 0.05), "whishi": Rank("below", 0.95), "top3": Rank("top", k=3)}


def expected(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The same statistics computed by pandas and numpy, group by group."""
    rows = []
    groups = frame.groupby(keys, dropna=False) if keys else [((), frame)]
    for key, group in groups:
        v = group["v"].dropna().to_numpy()
        if not v.size:
            continue
        s = np.sort(v)
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row.update(count=v.size, mean=v.mean(), max=v.max(), min=v.min(), share=(v > 0.1).mean(),
                   whislo=s[int(np.ceil(0.05 * (v.size - 1)))], whishi=s[int(np.floor(0.95 * (v.size - 1)))],
                   top3=s[max(v.size - 3, 0)])
        row.update({name: np.percentile(v, 100 * q) for name, q in QUANTILES.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def check(got: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    if keys:
        got, want = (f.astype({k: object for k in keys}).fillna({k: "null" for k in keys}).sort_values(keys)
                     .reset_index(drop=True) for f in (got, want))
        assert got[keys].astype(str).equals(want[keys].astype(str))
    assert got["count"].tolist() == want["count"].tolist()
    np.testing.assert_allclose(got["mean"], want["mean"], rtol=1e-12)
    for exact in ("max", "min", "whislo", "whishi", "top3", "p0", "p100"):
        np.testing.assert_array_equal(got[exact], want[exact], err_msg=exact)
    for name in QUANTILES:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-15, atol=0, err_msg=name)
    np.testing.assert_allclose(got["share"], want["share"], rtol=1e-15)


def test_stats_are_exact_against_pandas(values, tmp_path):
    table = frame_table(values, tmp_path, parts=3)
    groupings = [["g", "h"], ["g"], []]
    results = table.stats("v", [tuple(k) for k in groupings], quantiles=QUANTILES, ranks=RANKS, above={"share": 0.1})
    for got, keys in zip(results, groupings):
        check(got, expected(values, keys), keys)


def test_stats_stay_exact_when_bins_overlap_and_when_a_bin_is_split(values, tmp_path, monkeypatch):
    """A binning that is not monotone (as a rounding of log2 at a bin's edge could be) has its bins
    merged; while the values to read are more than read_limit(), the largest intervals are split into
    equal sub-bins, recursively."""
    table = frame_table(values, tmp_path)
    monkeypatch.setattr(query_table, "log_bin", lambda v: f"(floor({v} * 1000) % 7)")  # overlapping bins everywhere
    monkeypatch.setattr(query_table, "read_limit", lambda: 200)  # most intervals are split, some twice
    results = table.stats("v", [("g", "h"), ()], quantiles=QUANTILES, ranks=RANKS, above={"share": 0.1})
    for got, keys in zip(results, [["g", "h"], []]):
        check(got, expected(values, keys), keys)


def test_stats_of_an_empty_selection_and_needed_groups(values, tmp_path):
    table = frame_table(values, tmp_path)
    (empty,) = table.stats("v", [("g",)], "v > 100", quantiles={"median": 0.5})
    assert empty.empty and "median" in empty.columns
    (some,) = table.stats("v", [("h",)], quantiles={"median": 0.5},
                          needed=lambda name, grouping, frame: (frame["h"] == 2).to_numpy())
    assert some["median"].isna().tolist() == (some["h"] != 2).tolist()
    assert some.loc[some["h"] == 2, "median"].item() == values.loc[values["h"] == 2, "v"].median()


@pytest.mark.slow
def test_duckdb_quantiles_run_out_of_memory_where_stats_do_not(tmp_path):
    """DuckDB's quantile_cont keeps every value of a group in memory and cannot spill; the two-pass
    selection of Table.stats gives the exact median of the same 18M values (144 MB) under the same 128 MB
    limit."""
    directory = tmp_path / "big"
    directory.mkdir()
    rng = np.random.default_rng(3)
    for i in range(6):
        pq.write_table(pa.table({"v": rng.gamma(2.0, 0.03, 3_000_000)}), directory / f"part-{i}.parquet")
    connection = engine.connect(memory_limit=128 << 20, threads=2)
    source = engine.parquet_source(sorted(directory.iterdir()))
    import duckdb

    with pytest.raises(duckdb.OutOfMemoryException):
        connection.execute(f"SELECT quantile_cont(v, 0.5) FROM {source}").fetchall()
    (got,) = Table(connection, source).stats("v", [()], quantiles={"median": 0.5})
    everything = pq.read_table(directory).column("v").to_numpy()
    assert got["median"].item() == np.percentile(everything, 50)
    assert got["count"].item() == everything.size


@pytest.mark.parametrize("edges", [
    np.arange(41) * 0.0123456789, np.linspace(0.3, 2.7, 61), np.arange(401) * (0.25 / 400), np.linspace(-1, 1, 7),
])
def test_histograms_count_like_numpy(edges, tmp_path):
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(edges[0] - 0.1, edges[-1] + 0.1, 20_000), edges, np.nextafter(edges, 10),
                        np.nextafter(edges, -10)])
    y = rng.permutation(x)
    frame = pd.DataFrame({"x": x, "y": y, "k": rng.integers(0, 2, x.size)})
    table = frame_table(frame, tmp_path)
    counts = table.histogram("x", edges, ("k",))
    for k in (0, 1):
        want, _ = np.histogram(x[frame["k"] == k], bins=edges)
        got = np.zeros(len(edges) - 1, dtype=np.int64)
        part = counts[counts["k"] == k]
        got[part["bin"].to_numpy()] = part["count"].to_numpy()
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(table.histogram2d("x", "y", edges, edges),
                                  np.histogram2d(x, y, bins=[edges, edges])[0])


def test_top_rows_are_the_largest_per_group(values, tmp_path):
    table = frame_table(values.reset_index(names="row"), tmp_path)
    got = table.top_rows("v", 5, ("h",), columns=("g",), order=("row",))
    want = (values.reset_index(names="row").dropna(subset=["v"]).sort_values(["v", "row"], ascending=[False, True])
            .groupby("h").head(5))
    assert sorted(zip(got["h"], got["row"])) == sorted(zip(want["h"], want["row"]))


def test_where_is_the_one_place_for_slices_and_trivial_rows():
    assert where() == "TRUE"
    assert where(space=None, alpha=None) == "TRUE"  # an old run without the columns: every row
    text = where(space="hidden", alpha=0.1, trivial=False, layer=[1, 2], attention_type="self")
    assert "space = 'hidden'" in text and "NOT trivial" in text and '"layer" IN (1, 2)' in text
    assert "CAST('0.1' AS DOUBLE)" in text  # alpha by its exact double, within a relative 1e-12


def test_memory_budget_parses_sizes_and_refuses_nonsense(monkeypatch):
    monkeypatch.setenv(engine.MEMORY_BUDGET_ENV, "1.5GiB")
    assert query.memory_budget() == int(1.5 * 2**30)
    monkeypatch.setenv(engine.MEMORY_BUDGET_ENV, "lots")
    with pytest.raises(ProbeError, match="is not a size"):
        query.memory_budget()


# --------------------------------------------------------------------------------------------------
# the readers on a run larger than a lowered budget


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    """A run of 12,800 rows in 24 part files (two slices, two attention types), and its rows."""
    rows = deviation_rows({"self": (2, 3), "cross": (2, 2)}, examples=40, queries=16, alphas=(0.5, 1.0),
                          non_converged=7, seed=11)
    run_dir = write_run(tmp_path_factory.mktemp("runs") / "budget-run", rows.drop(columns="model"), manifest_for(),
                        parts=24)
    return run_dir, rows


@pytest.fixture
def low_budget(monkeypatch):
    """A memory budget far below what the run's rows take in pandas (12,800 rows x 600 bytes = 7.7 MB)."""
    monkeypatch.setenv(engine.MEMORY_BUDGET_ENV, "2MB")


def test_rows_are_refused_over_the_budget_and_name_the_lazy_way(budget_run, low_budget):
    run_dir, rows = budget_run
    run = probe.load(run_dir)
    with pytest.raises(ProbeError) as error:
        run.rows
    message = str(error.value)
    assert f"{len(rows):,} rows" in message and "run.sql(" in message and "run.select(" in message
    assert engine.MEMORY_BUDGET_ENV in message
    with pytest.raises(ProbeError, match="memory budget"):
        run.select(alpha=1.0)


def test_slices_under_the_budget_equal_pandas(budget_run, low_budget):
    run_dir, rows = budget_run
    run = probe.load(run_dir)
    got = run.select(space="hidden", alpha=1.0, attention_type="self", layer=1, head=2,
                     columns=["example", "query", "rel_deviation", "trivial"])
    want = rows[(rows["alpha"] == 1.0) & (rows["attention_type"] == "self") & (rows["layer"] == 1)
                & (rows["head"] == 2)]
    want = want.sort_values(list(ROW_KEY))[["example", "query", "rel_deviation", "trivial"]].reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_rows_keep_their_contract_when_they_fit(budget_run):
    run_dir, rows = budget_run
    got = probe.load(run_dir).rows
    want = rows[DEVIATION_SCHEMA.names].sort_values(list(ROW_KEY), ignore_index=True)
    assert list(got.columns) == list(want.columns)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def test_select_of_an_unknown_column_names_it_and_the_columns(budget_run):
    run = probe.load(budget_run[0])
    with pytest.raises(ProbeError) as error:
        run.select(layer=0, columns=["example", "nope"])
    message = str(error.value)
    assert "no column 'nope'" in message and "rel_deviation" in message and "example," in message


def test_aggregates_keep_integer_keys_integers(budget_run):
    """Grouping sets leave a key null in the other groupings' rows; each grouping's own keys come back as
    integers, with pandas' own groupby's counts."""
    run_dir, rows = budget_run
    by_head, by_layer = probe.load(run_dir).query.aggregate({"rows": "count(*)"}, [("layer", "head"), ("layer",)])
    assert by_head["head"].dtype == "int64" and by_head["layer"].dtype == "int64"
    assert by_layer["layer"].dtype == "int64"
    want = rows.groupby(["layer", "head"]).size().reset_index(name="rows")
    pd.testing.assert_frame_equal(by_head, want, check_dtype=False)


def test_load_reads_no_rows(budget_run, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load read rows")

    monkeypatch.setattr(query_runs, "connect", refuse)
    run = probe.load(budget_run[0])
    assert run.name == "org/tiny-model"


def test_headline_and_lazy_statistics_equal_pandas(budget_run, low_budget):
    run_dir, rows = budget_run
    run = probe.load(run_dir)
    measured = rows[rows["n_keys"] > 1]
    lines = run.headline()
    assert [(line["space"], line["alpha"]) for line in lines] == [("hidden", 0.5), ("hidden", 1.0)]
    for line in lines:
        values = measured.loc[measured["alpha"] == line["alpha"], "rel_deviation"]
        assert line["rows"] == len(values) and line["max"] == values.max()
        assert line["mean"] == pytest.approx(values.mean(), rel=1e-12)
        assert line["p95"] == pytest.approx(values.quantile(0.95), rel=1e-14)
    # the documented per-head statistic, without loading the run
    (per_head,) = run.query.stats("rel_deviation", [("attention_type", "layer", "head")],
                                  where(alpha=1.0, trivial=False), quantiles={"median": 0.5, "p95": 0.95})
    want = measured[measured["alpha"] == 1.0].groupby(["attention_type", "layer", "head"])["rel_deviation"]
    per_head = per_head.set_index(["attention_type", "layer", "head"]).loc[want.median().index]
    np.testing.assert_allclose(per_head["median"], want.median(), rtol=1e-14)
    np.testing.assert_allclose(per_head["p95"], want.quantile(0.95), rtol=1e-14)
    means = run.sql("SELECT layer, avg(rel_deviation) AS mean FROM rows WHERE NOT trivial AND attention_type = 'self' "
                    "GROUP BY ALL ORDER BY layer").df()
    np.testing.assert_allclose(means["mean"], measured[measured["attention_type"] == "self"].groupby("layer")[
        "rel_deviation"].mean(), rtol=1e-12)


@pytest.mark.slow
def test_report_and_compare_under_the_budget_equal_pandas(budget_run, low_budget, tmp_path):
    """The report's summary over a run larger than the budget: counts exact, means to 1e-12, maxima exact,
    quantiles exact; compare's table likewise."""
    run_dir, rows = budget_run
    report = build_report(run_dir, tmp_path / "report")
    summary = pd.read_csv(report / "summary.csv")
    measured = rows[rows["n_keys"] > 1]
    keys = ["space", "alpha", "attention_type", "layer", "head"]
    got = summary[summary["level"] == "head"].set_index(keys).sort_index()
    want = measured.groupby(keys)["rel_deviation"]
    assert got["count"].tolist() == want.count().tolist()
    np.testing.assert_allclose(got["mean"], want.mean(), rtol=1e-12)
    np.testing.assert_array_equal(got["max"], want.max())
    np.testing.assert_allclose(got["median"], want.median(), rtol=1e-14)
    np.testing.assert_allclose(got["p95"], want.quantile(0.95), rtol=1e-14)
    assert json.loads((report / "summary.json").read_text())["quantiles"]["rank_error"] == 0
    assert "exact" in (report / "index.html").read_text(encoding="utf-8")
    other = write_run(tmp_path / "other", deviation_rows({"self": (3, 2)}, examples=20, queries=16, seed=3)
                      .drop(columns="model"), manifest_for(), parts=5)
    table = pd.read_csv(compare_runs([run_dir, other], tmp_path / "compare") / "compare.csv")
    first = table[(table["run_dir"] == run_dir.name) & (table["attention_type"] == "self")].iloc[0]
    values = measured[(measured["alpha"] == 1.0) & (measured["attention_type"] == "self")]["rel_deviation"]
    assert first["count"] == len(values) and first["max"] == values.max()
    assert first["median"] == pytest.approx(values.median(), rel=1e-14)
    assert first["p95"] == pytest.approx(values.quantile(0.95), rel=1e-14)


# --------------------------------------------------------------------------------------------------
# peak memory does not grow with the rows


PEAK = textwrap.dedent("""
    import resource, sys
    import probe
    lines = probe.load(sys.argv[1]).headline()
    (stats,) = probe.load(sys.argv[1]).query.stats("rel_deviation", [("layer", "head")],
                                                   quantiles={"median": 0.5, "p95": 0.95})
    assert lines and len(stats)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # kB on Linux
""")


def synthetic_run(run_dir: Path, rows: int, parts: int) -> Path:
    """A run of ``rows`` random rows (one slice, 12 x 12 heads) in ``parts`` part files, written part by part."""
    (run_dir / "deviations.parquet").mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_part = rows // parts
    for i in range(parts):
        n = per_part
        table = pa.table({
            "attention_type": pa.array(["self"] * n), "layer": pa.array(rng.integers(0, 12, n), pa.int32()),
            "head": pa.array(rng.integers(0, 12, n), pa.int32()), "example": pa.array(np.arange(n) + i * n, pa.int64()),
            "query": pa.array(np.zeros(n), pa.int32()), "n_keys": pa.array(np.full(n, 30), pa.int32()),
            "alpha": pa.array(np.ones(n)), "rel_deviation": pa.array(rng.gamma(2.0, 0.03, n)),
            "converged": pa.array(np.ones(n, dtype=bool)), "space": pa.array(["hidden"] * n),
            "trivial": pa.array(np.zeros(n, dtype=bool)),
        })
        pq.write_table(table, run_dir / "deviations.parquet" / f"part-{i:06d}.parquet")
    (run_dir / "manifest.json").write_text(json.dumps(manifest_for()))
    return run_dir


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_rows(tmp_path):
    """The headline and a per-head median and p95 at 0.3M and 3M rows, each in a fresh process under a
    128 MB budget: the peak RSS grows by less than 40 MB, where holding the rows in pandas, as the readers
    did, took about 115 bytes a row (300 MB more)."""
    peaks = []
    for rows, parts in ((300_000, 6), (3_000_000, 60)):
        run_dir = synthetic_run(tmp_path / f"run-{rows}", rows, parts)
        out = subprocess.run([sys.executable, "-c", PEAK, str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                             env={**__import__("os").environ, engine.MEMORY_BUDGET_ENV: "128MB"}, check=True)
        peaks.append(int(out.stdout.split()[-1]) / 1024)
    assert peaks[1] - peaks[0] < 40, peaks
