"""Runs that keep mergeable statistics instead of every row (``--keep aggregates``, ``--keep sample:N``), checked
against a full run of the same settings, whose rows are the reference: the report's summary.csv (every group and
column; counts, means, maxima and shares equal, medians and 95th percentiles within the sketch's rank error of
the rows' exact ranks, computed here with numpy), the statistics behind the figures and findings (pandas over the
rows), the sample (the full run's rows, by key), and the merging over batches, a killed-and-resumed run and
torchrun's ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from probe.cli import app
from probe.core.schema import ROW_KEY
from probe.query.aggregates import AggregateTable
from probe.store import aggregates as stored
from probe.store import storage

#: a handful of texts of the embedded corpus, 3 batches
MINILM_ARGS = ["--samples", "6", "--batch-size", "2", "--max-length", "24", "--no-progress"]
TINY_ARGS = ["--samples", "12", "--batch-size", "2", "--max-length", "16", "--no-progress"]
LEVEL_KEYS = {"layer": ["space", "alpha", "attention_type", "layer"],
              "head": ["space", "alpha", "attention_type", "layer", "head"]}


def probe_run(model, out: Path, *args) -> Path:
    result = CliRunner().invoke(app, ["run", str(model), *map(str, args), "--out", str(out)])
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def rows_of(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / storage.PARTS)


@pytest.fixture(scope="module")
def minilm_runs(minilm_dir, tmp_path_factory):
    """The real MiniLM on a handful of texts: every row, aggregates, and a sample of 200 rows."""
    root = tmp_path_factory.mktemp("minilm")
    return {keep: probe_run(minilm_dir, root / keep.replace(":", "-"), *MINILM_ARGS, "--keep", keep)
            for keep in ("rows", "aggregates", "sample:200")}


# ------------------------------------------------------------------------------------------- the reference


def averaged_values(rows: pd.DataFrame) -> pd.DataFrame:
    """The head-averaged deviation of every (example, query) of a layer, from the rows (pandas)."""
    measured = rows[~rows["trivial"] & rows["rel_deviation"].notna()]
    return (measured.groupby(LEVEL_KEYS["layer"] + ["example", "query"])["rel_deviation"].mean()
            .rename("value").reset_index())


def within_rank(values: np.ndarray, found: float, q: float, error: float = stored.RANK_ERROR) -> bool:
    """Whether ``found`` has a normalized rank among ``values`` within ``error`` of ``q``."""
    values = np.sort(values)
    below = np.searchsorted(values, found, side="left") / len(values)
    at_most = np.searchsorted(values, found, side="right") / len(values)
    return below - error <= q <= at_most + error


def check_summary(full_dir: Path, kept_dir: Path) -> None:
    """The summary.csv of a run that kept aggregates against the full run's (see the module)."""
    from probe.report.data import read_run
    from probe.report.summary import summarize

    full, kept = summarize(read_run(full_dir)), summarize(read_run(kept_dir))
    assert list(kept.columns) == list(full.columns)
    keys = ["level", "space", "alpha", "attention_type", "layer", "head"]
    assert kept[keys].astype(str).equals(full[keys].astype(str))  # the same groups, in the same order
    for column in ("count", "trivial", "non_converged"):
        assert (kept[column].to_numpy() == full[column].to_numpy()).all(), column
    for column in ("max", "share_above_0.1"):
        assert np.array_equal(kept[column].to_numpy(float), full[column].to_numpy(float), equal_nan=True), column
    assert np.allclose(kept["mean"], full["mean"], rtol=1e-9, atol=0, equal_nan=True)
    rows = rows_of(full_dir)
    measured = rows[~rows["trivial"] & rows["rel_deviation"].notna()]
    averaged = averaged_values(rows)
    for record in kept.to_dict("records"):
        level = record["level"]
        if level == "layer_head_averaged":
            values, by = averaged, LEVEL_KEYS["layer"]
            column = "value"
        else:
            values, by = measured, LEVEL_KEYS[level]
            column = "rel_deviation"
        pick = np.ones(len(values), dtype=bool)
        for key in by:
            pick &= (values[key] == record[key]).to_numpy()
        group = values.loc[pick, column].to_numpy()
        assert len(group) == record["count"]
        for name, q in (("median", 0.5), ("p95", 0.95)):
            assert within_rank(group, record[name], q), (record, name)


def test_the_summary_of_an_aggregates_run_is_the_full_runs(minilm_runs):
    check_summary(minilm_runs["rows"], minilm_runs["aggregates"])
    check_summary(minilm_runs["rows"], minilm_runs["sample:200"])


def test_the_aggregates_hold_what_the_rows_give(minilm_runs):
    """Census, histograms, worst rows and the per-example, per-query and per-position sums against pandas and
    numpy over the full run's rows."""
    rows = rows_of(minilm_runs["rows"])
    table = AggregateTable.open(minilm_runs["aggregates"])
    head = LEVEL_KEYS["head"]
    census = table.census().set_index(head).sort_index()
    assert (census["rows"] == rows.groupby(head).size().sort_index()).all()
    assert (census["trivial"] == rows.groupby(head)["trivial"].sum().sort_index()).all()
    measured = rows[~rows["trivial"] & rows["rel_deviation"].notna()]
    assert (census["measured"] == measured.groupby(head).size().reindex(census.index, fill_value=0)).all()
    # histograms on the fixed bins: numpy's, per head
    for key, counts in table.fine_counts("rel_deviation", head).items():
        values = measured.set_index(head).loc[key, "rel_deviation"].to_numpy()
        assert (counts == np.histogram(values, np.r_[stored.FINE_EDGES[:-1], 2.0**30])[0]).all(), key
    # the worst rows of every head
    worst = table.worst_rows().sort_values(head + ["rel_deviation", "example", "query"],
                                           ascending=[True] * 5 + [False, True, True])
    expected = measured.sort_values(head + ["rel_deviation", "example", "query"],
                                    ascending=[True] * 5 + [False, True, True]).groupby(head).head(8)
    for column in ("rel_deviation", "example", "query", "token", "n_keys"):
        assert (worst[column].to_numpy() == expected[column].to_numpy()).all(), column
    # per (head, example), per (example, query) and per (layer, query)
    sums = table.example_sums(by=head + ["example"]).set_index(head + ["example"]).sort_index()
    reference = measured.groupby(head + ["example"])["rel_deviation"]
    assert (sums["n"] == reference.size()).all() and np.allclose(sums["sum"], reference.sum(), rtol=1e-12)
    assert (sums["above"] == reference.apply(lambda x: int((x > 0.1).sum()))).all()
    cells = table.query_cells().set_index(["attention_type", "example", "query"]).sort_index()
    by_cell = measured.groupby(["attention_type", "example", "query"])
    assert (cells.loc[by_cell.size().index, "n"] == by_cell.size()).all()
    assert np.allclose(cells.loc[by_cell.size().index, "sum"], by_cell["rel_deviation"].sum(), rtol=1e-12)
    assert (cells.loc[by_cell.size().index, "token"] == by_cell["token"].first()).all()
    groups = table.groups({"space": "hidden", "alpha": 1.0})
    position = groups["position"].set_index(["attention_type", "layer", "query"]).sort_index()
    nontrivial = rows[~rows["trivial"]].groupby(["attention_type", "layer", "query"])
    assert (position["rows"] == nontrivial.size()).all()
    assert np.allclose(position["sum"], nontrivial["rel_deviation"].sum(), rtol=1e-12)


def test_a_sample_is_the_full_runs_rows_of_smallest_hash(minilm_runs):
    rows, sample = rows_of(minilm_runs["rows"]), rows_of(minilm_runs["sample:200"])
    assert len(sample) == 200 and not sample.duplicated(list(ROW_KEY)).any()
    merged = sample.merge(rows, on=list(ROW_KEY), suffixes=("", "_full"), validate="one_to_one")
    assert len(merged) == 200
    for column in rows.columns:  # each the full run's row with the same key, bit for bit
        if column not in ROW_KEY:
            assert merged[column].equals(merged[f"{column}_full"].rename(column)), column
    # the 200 smallest of the row key's seeded hash (splitmix64 over the key, here in numpy)
    hashes = stored.row_hash(0, "hidden", 1.0, "self", rows["layer"], rows["head"], rows["example"], rows["query"])
    chosen = rows.iloc[np.argsort(hashes)[:200]]
    assert set(map(tuple, chosen[list(ROW_KEY)].to_numpy())) == set(map(tuple, sample[list(ROW_KEY)].to_numpy()))


def test_a_sample_larger_than_the_run_keeps_every_row_and_its_keys_do_not_depend_on_the_batches(
        tiny_bert_dir, tmp_path):
    full = rows_of(probe_run(tiny_bert_dir, tmp_path / "full", *TINY_ARGS))
    everything = rows_of(probe_run(tiny_bert_dir, tmp_path / "all", *TINY_ARGS, "--keep", "sample:1000000"))
    pd.testing.assert_frame_equal(everything.sort_values(list(ROW_KEY)).reset_index(drop=True),
                                  full.sort_values(list(ROW_KEY)).reset_index(drop=True), check_exact=True)
    keys = []
    for batch_size in ("1", "3"):
        args = [*TINY_ARGS, "--batch-size", batch_size, "--keep", "sample:40"]
        sample = rows_of(probe_run(tiny_bert_dir, tmp_path / f"b{batch_size}", *args))
        assert len(sample) == 40
        keys.append(set(map(tuple, sample[list(ROW_KEY)].to_numpy())))
    assert keys[0] == keys[1]


# ------------------------------------------------------------------------------- merging


def assert_same_aggregates(found: AggregateTable, expected: AggregateTable) -> None:
    """Two runs' aggregates: exactly equal but for the sketches (their quantiles within the stated bound of each
    other's exact values is checked against the rows elsewhere: here, the same counts behind them)."""
    for kind, (keys, sums, others) in stored.KINDS.items():
        a = found.state[kind].sort_values(list(keys)).reset_index(drop=True)
        b = expected.state[kind].sort_values(list(keys)).reset_index(drop=True)
        if kind == "worst":
            a = a.sort_values(list(keys) + ["rel_deviation", "example", "query"]).reset_index(drop=True)
            b = b.sort_values(list(keys) + ["rel_deviation", "example", "query"]).reset_index(drop=True)
        assert len(a) == len(b), kind
        assert a[list(keys)].astype(str).equals(b[list(keys)].astype(str)), kind
        for column in [*sums, *others]:
            if column == "sketch":
                assert [stored.merged_sketch([x]).n for x in a[column]] == [stored.merged_sketch([x]).n
                                                                          for x in b[column]]
            elif column in ("bins", "counts"):
                assert all(np.array_equal(x, y) for x, y in zip(a[column], b[column])), (kind, column)
            elif column in ("sum", "sumsq"):
                assert np.allclose(a[column].astype(float), b[column].astype(float), rtol=1e-12, atol=0), kind
            else:
                assert np.array_equal(a[column].to_numpy(), b[column].to_numpy()), (kind, column)


def killed_between_parts(model_dir, out: Path, monkeypatch, *args) -> Path:
    """A run stopped (Ctrl-C) right after it wrote batch 1's aggregates part, before that batch's rows' part: as
    a kill at that moment leaves it."""
    real_write = storage.write_part

    def write(run_dir, batch, table, record, name=storage.PARTS):
        if name == storage.PARTS and batch == 1:
            raise KeyboardInterrupt
        return real_write(run_dir, batch, table, record, name)

    with monkeypatch.context() as patch:
        patch.setattr(storage, "write_part", write)
        result = CliRunner().invoke(app, ["run", str(model_dir), *map(str, args), "--out", str(out)])
    assert result.exit_code == 130, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def test_a_killed_and_resumed_run_has_the_uninterrupted_runs_aggregates(tiny_bert_dir, tmp_path, monkeypatch):
    args = [*TINY_ARGS, "--keep", "sample:30"]
    single = probe_run(tiny_bert_dir, tmp_path / "single", *args)
    run_dir = killed_between_parts(tiny_bert_dir, tmp_path / "stopped", monkeypatch, *args)
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "interrupted" and not manifest.get(stored.MERGED_RECORD)
    assert set(storage.part_files(run_dir)) == {0} and set(storage.part_files(run_dir, storage.AGGREGATES)) == {0, 1}
    partial = AggregateTable.open(run_dir)  # read from the parts of the finished batches only
    assert partial.census()["rows"].sum() == storage.part_record(storage.part_files(run_dir)[0])["summary"]["rows"]
    result = CliRunner().invoke(app, ["resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    manifest = storage.read_manifest(run_dir)
    assert manifest["status"] == "complete" and manifest[stored.MERGED_RECORD]["batches"] == manifest["batches_total"]
    assert len(manifest["segments"]) == 2 and not storage.part_files(run_dir, storage.AGGREGATES)  # merged
    assert_same_aggregates(AggregateTable.open(run_dir), AggregateTable.open(single))  # batch 1 counted once
    pd.testing.assert_frame_equal(rows_of(run_dir).sort_values(list(ROW_KEY)).reset_index(drop=True),
                                  rows_of(single).sort_values(list(ROW_KEY)).reset_index(drop=True), check_exact=True)
    assert manifest["solver"]["rows"] == storage.read_manifest(single)["solver"]["rows"]


@pytest.mark.slow
def test_two_torchrun_ranks_give_a_single_processs_aggregates(tiny_bert_dir, tmp_path):
    from ..support.runs import finish, probe_process

    args = [*TINY_ARGS, "--keep", "sample:30"]
    code, output = finish(probe_process("run", tiny_bert_dir, *args, "--out", tmp_path / "single"))
    assert code == 0, output
    code, output = finish(probe_process("run", tiny_bert_dir, *args, "--out", tmp_path / "ranks", processes=2))
    assert code == 0, output
    (single,), (ranks,) = (tmp_path / "single").iterdir(), (tmp_path / "ranks").iterdir()
    records = storage.finished_batches(ranks)
    assert {record["rank"] for record in records.values()} == {0, 1}  # both ranks wrote batches
    assert_same_aggregates(AggregateTable.open(ranks), AggregateTable.open(single))
    pd.testing.assert_frame_equal(rows_of(ranks).sort_values(list(ROW_KEY)).reset_index(drop=True),
                                  rows_of(single).sort_values(list(ROW_KEY)).reset_index(drop=True), check_exact=True)


@pytest.mark.slow
def test_the_summary_of_a_larger_aggregates_run_is_the_full_runs(minilm_dir, tmp_path):
    """More texts: the sketches compact (thousands of values per head), and stay within their bound."""
    args = ["--samples", "40", "--batch-size", "8", "--max-length", "64", "--no-progress"]
    full = probe_run(minilm_dir, tmp_path / "full", *args)
    kept = probe_run(minilm_dir, tmp_path / "kept", *args, "--keep", "aggregates")
    sketch = stored.merged_sketch(AggregateTable.open(kept).values["sketch"])
    assert sketch.is_estimation_mode()
    check_summary(full, kept)


# ------------------------------------------------------------------------------- every reader


@pytest.fixture(scope="module")
def tiny_kept(tiny_bert_dir, tmp_path_factory):
    """A tiny run of each kind, and a copy of the aggregates run with a byte flipped in its merged file."""
    root = tmp_path_factory.mktemp("kept")
    runs = {keep: probe_run(tiny_bert_dir, root / keep.replace(":", "-"), *TINY_ARGS, "--keep", keep)
            for keep in ("rows", "aggregates", "sample:40")}
    flipped = Path(shutil.copytree(runs["aggregates"], root / "flipped" / runs["aggregates"].name))
    path = flipped / storage.AGGREGATES / stored.MERGED
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    runs["flipped"] = flipped
    return runs


def test_every_reader_takes_every_kind_of_run(tiny_kept, tmp_path):
    import probe

    full = probe.load(tiny_kept["rows"])
    for keep in ("aggregates", "sample:40"):
        run = probe.load(tiny_kept[keep])
        assert run.kept == keep
        (mine,), (theirs,) = run.headline(), full.headline()
        assert mine["rows"] == theirs["rows"] and mine["max"] == theirs["max"]
        assert mine["mean"] == pytest.approx(theirs["mean"], rel=1e-9)
        values = full.select(trivial=False, columns=["rel_deviation"])["rel_deviation"].to_numpy()
        assert within_rank(values, mine["p95"], 0.95)
        report = CliRunner().invoke(app, ["report", str(tiny_kept[keep]), "--out", str(tmp_path / keep)])
        assert report.exit_code == 0, report.output
        summary = json.loads((tmp_path / keep / "summary.json").read_text())
        assert summary["kept"] == keep and summary["quantiles"]["rank_error"] == stored.RANK_ERROR
        page = (tmp_path / keep / "index.html").read_text()
        assert "KLL" in page and "0.0090" in page
        exported = tmp_path / f"{keep}.csv"
        result = CliRunner().invoke(app, ["export", str(tiny_kept[keep]), "--table", "aggregates", "--to",
                                          str(exported)])
        assert result.exit_code == 0, result.output
        table = pd.read_csv(exported)
        assert table.loc[table["column"] == "rel_deviation", "count"].sum() == mine["rows"]
        verify = CliRunner().invoke(app, ["verify", str(tiny_kept[keep]), "--sample", "4"])
        assert verify.exit_code == 0 and "merged.parquet: checked" in verify.output, verify.output
    page = (tmp_path / "aggregates" / "index.html").read_text()
    assert "left out: it needs the rows" in page  # the drivers' figure, said in one line
    assert "drivers_self" in " ".join(p.name for p in (tmp_path / "sample:40").iterdir())  # drawn from the sample
    compared = CliRunner().invoke(app, ["compare", *(str(tiny_kept[k]) for k in ("rows", "aggregates", "sample:40")),
                                        "--out", str(tmp_path / "compare"), "--name", "rows", "--name", "aggregates",
                                        "--name", "sample"])
    assert compared.exit_code == 0, compared.output
    table = pd.read_csv(tmp_path / "compare" / "compare.csv")
    assert table["count"].nunique() == 1 and table["max"].nunique() == 1
    # a reader that needs rows the run does not have says so in one line
    with pytest.raises(probe.ProbeError, match="kept only its statistics"):
        probe.load(tiny_kept["aggregates"]).rows
    result = CliRunner().invoke(app, ["export", str(tiny_kept["aggregates"]), "--to", str(tmp_path / "rows.csv")])
    assert result.exit_code == 2 and "kept only its statistics" in result.output


def test_every_reader_refuses_a_damaged_aggregates_file_by_name(tiny_kept, tmp_path):
    import probe

    name = "aggregates.parquet/merged.parquet (SHA-256 differs from the recorded one)"
    flipped = tiny_kept["flipped"]
    with pytest.raises(probe.ProbeError, match=r"merged\.parquet \(SHA-256 differs"):
        probe.load(flipped)
    for argv in (["report", str(flipped), "--out", str(tmp_path / "report")],
                 ["compare", str(tiny_kept["rows"]), str(flipped), "--out", str(tmp_path / "compare")],
                 ["export", str(flipped), "--table", "aggregates", "--to", str(tmp_path / "a.parquet")]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and name in result.output and "probe resume" in result.output, result.output
    verify = CliRunner().invoke(app, ["verify", str(flipped), "--sample", "0"])
    assert verify.exit_code == 1 and "DAMAGED" in verify.output, verify.output
    status = CliRunner().invoke(app, ["status", str(flipped)])
    assert "damaged (aggregates.parquet/merged.parquet)" in status.output, status.output
    repaired = Path(shutil.copytree(flipped, tmp_path / "repaired" / flipped.name))
    result = CliRunner().invoke(app, ["resume", str(repaired), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert_same_aggregates(AggregateTable.open(repaired), AggregateTable.open(tiny_kept["aggregates"]))
