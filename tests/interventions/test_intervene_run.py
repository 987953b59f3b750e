"""`probe run --intervene`: the interventions computed in the same run as the rows,
written as a second crash-safe table, resumed with the rows, checked by every reader, exported, and
totalled in the manifest.  Tiny random BERT; seconds."""

from __future__ import annotations

import json
import signal

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from probe import api
from probe.cli import app
from probe.core.schema import INTERVENTION_KEY, ROW_KEY
from probe.store import integrity, storage

from ..support.runs import finish, finished_run, probe_process
from ..support.runs import invoke_with_one_thread as invoke

#: 24 texts in 12 batches of 2: enough batches to be killed in the middle
ARGS = ["--samples", "24", "--batch-size", "2", "--max-length", "24", "--no-progress"]
SUBSTITUTES = "exact,second-order,null,model"


@pytest.fixture(scope="module")
def plain_dir(tiny_bert_dir, tmp_path_factory):
    return finished_run(tiny_bert_dir, tmp_path_factory.mktemp("plain"), *ARGS)


@pytest.fixture(scope="module")
def intervened_dir(tiny_bert_dir, tmp_path_factory):
    """The uninterrupted run with every substitute (in this process, one thread like the killed one)."""
    return finished_run(tiny_bert_dir, tmp_path_factory.mktemp("intervened"), *ARGS, "--intervene", SUBSTITUTES)


def test_the_interventions_table_has_one_record_per_key(intervened_dir):
    run = api.load(intervened_dir)
    frame = run.interventions
    manifest = run.manifest
    sites = sorted(run.rows.groupby(["attention_type", "layer"]).groups)  # the rows' sites
    examples = sorted(run.rows["example"].unique())
    assert len(examples) == 24 and len(sites) == 2
    expected = len(examples) * (len(sites) + 1) * 4  # per site and whole, four substitutes
    assert len(frame) == expected == manifest["interventions"]["records"]
    assert not frame.duplicated(list(INTERVENTION_KEY)).any()
    assert set(frame["site"]) == {f"{t}:{layer}" for t, layer in sites} | {"whole"}
    assert sorted(frame["example"].unique()) == examples
    assert frame.equals(frame.sort_values(list(INTERVENTION_KEY), ignore_index=True))  # sorted by the key
    # every part recorded, one per batch, in its own list of the manifest
    assert [r["batch"] for r in manifest["intervention_parts"]] == list(range(manifest["batches_total"]))
    assert integrity.check_parts(intervened_dir, manifest, checksums=True, table=storage.INTERVENTIONS).ok
    # the identity control reproduces the model; the exact posterior's solves converged everywhere
    model = frame[frame["substitute"] == "model"]
    assert model["hidden_change"].max() < 1e-5 and (model["embedding_cosine"] > 1 - 1e-9).all()
    exact = frame[frame["substitute"] == "exact"]
    assert (exact["solver_rows"] > 0).all() and exact["solver_not_converged"].sum() == 0
    # the null moves the attention by as much as the exact posterior does: a change, not the identity
    assert (frame[frame["substitute"] == "null"]["hidden_change"] > 1e-7).all()
    assert manifest["config"]["intervene"] == SUBSTITUTES.split(",")


def test_the_rows_come_from_the_same_forward_and_equal_a_plain_runs(intervened_dir, plain_dir):
    """The row solver receives the intervention's capture forward (no LM head here: the same inputs), so
    the rows are the plain run's, bitwise."""
    rows = api.load(intervened_dir).rows
    plain = api.load(plain_dir).rows
    pd.testing.assert_frame_equal(rows, plain, check_exact=True)


def test_the_manifest_totals_are_the_tables_means(intervened_dir):
    manifest = json.loads((intervened_dir / "manifest.json").read_text())
    frame = pd.read_parquet(intervened_dir / "interventions.parquet")
    means = manifest["interventions"]["means"]
    assert len(means) == 4 * 2  # substitutes x (per-site, whole)
    for entry in means:
        chosen = frame[(frame["substitute"] == entry["substitute"]) & (frame["space"] == entry["space"])
                       & ((frame["site"] == "whole") == (entry["mode"] == "whole"))]
        assert entry["records"] == len(chosen)
        assert entry["mean_hidden_change"] == pytest.approx(chosen["hidden_change"].mean(), rel=1e-12)
        assert entry["mean_embedding_cosine"] == pytest.approx(chosen["embedding_cosine"].mean(), rel=1e-12)
        assert entry["mean_lm_loss"] is None  # no LM head in a BertModel checkpoint


@pytest.mark.slow
def test_killed_then_resumed_equals_an_uninterrupted_run(tiny_bert_dir, intervened_dir, tmp_path):
    """SIGKILL after a part, then `probe resume`: both tables equal the uninterrupted run's, bitwise, and
    the resumed run keeps the recorded --intervene settings."""
    out = tmp_path / "runs"
    process = probe_process("run", tiny_bert_dir, *ARGS, "--out", out, "--intervene", SUBSTITUTES)
    import time

    deadline = time.time() + 300
    while not list(out.glob("*/deviations.parquet/part-*.parquet")):
        assert process.poll() is None, finish(process)[1]
        assert time.time() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    (run_dir,) = out.iterdir()
    done = storage.part_files(run_dir)
    assert 0 < len(done) < 12
    assert set(done) <= set(storage.part_files(run_dir, storage.INTERVENTIONS))  # interventions are written first
    result = invoke("resume", run_dir, "--no-progress")
    assert result.exit_code == 0, result.output
    for table in (storage.PARTS, storage.INTERVENTIONS):
        pd.testing.assert_frame_equal(pd.read_parquet(run_dir / table), pd.read_parquet(intervened_dir / table),
                                      check_exact=True)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["segments"]) == 2
    assert manifest["config"]["intervene"] == SUBSTITUTES.split(",")
    reference = json.loads((intervened_dir / "manifest.json").read_text())
    assert manifest["interventions"] == reference["interventions"]


def test_a_batch_whose_interventions_were_written_but_not_its_rows_is_redone(intervened_dir, tmp_path):
    """A kill between a batch's two part files (its interventions are written first) leaves the batch
    unfinished: resume computes it again and both tables are whole."""
    run_dir = tmp_path / "run"
    import shutil

    shutil.copytree(intervened_dir, run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    storage.part_path(run_dir, 5).unlink()
    manifest["parts"] = [r for r in manifest["parts"] if r["batch"] != 5]
    manifest["intervention_parts"] = [r for r in manifest["intervention_parts"] if r["batch"] != 5]
    manifest.update(status="interrupted", batches_done=11)
    storage.write_manifest(run_dir, manifest)
    result = invoke("resume", run_dir, "--no-progress")
    assert result.exit_code == 0, result.output
    for table in (storage.PARTS, storage.INTERVENTIONS):
        pd.testing.assert_frame_equal(pd.read_parquet(run_dir / table), pd.read_parquet(intervened_dir / table),
                                      check_exact=True)


def test_a_damaged_interventions_part_is_refused_by_readers_and_repaired_by_resume(intervened_dir, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(intervened_dir, run_dir)
    part = storage.part_path(run_dir, 3, storage.INTERVENTIONS)
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(integrity.DamagedRunError, match=r"damaged \(its interventions.parquet\): batch 3"):
        api.Run(run_dir).interventions
    api.Run(run_dir).rows  # the other table is intact
    export = CliRunner().invoke(app, ["export", str(run_dir), "--table", "interventions", "--to", str(tmp_path / "x.csv")])
    assert export.exit_code != 0 and "batch 3" in export.output
    result = invoke("resume", run_dir, "--no-progress")
    assert result.exit_code == 0, result.output
    assert list((run_dir / "quarantine").glob("*/interventions.parquet/part-000003.parquet"))
    pd.testing.assert_frame_equal(pd.read_parquet(run_dir / storage.INTERVENTIONS),
                                  pd.read_parquet(intervened_dir / storage.INTERVENTIONS), check_exact=True)


def test_export_writes_either_table(intervened_dir, plain_dir, tmp_path):
    to = tmp_path / "interventions.parquet"
    result = CliRunner().invoke(app, ["export", str(intervened_dir), "--table", "interventions", "--to", str(to)])
    assert result.exit_code == 0, result.output
    written = pq.read_table(to).to_pandas()
    assert f"{len(written):,} rows written" in result.output
    # in the records' key's order, as Run.interventions has them
    pd.testing.assert_frame_equal(written, api.load(intervened_dir).interventions, check_exact=True)
    missing = CliRunner().invoke(app, ["export", str(plain_dir), "--table", "interventions", "--to",
                                       str(tmp_path / "none.parquet")])
    assert missing.exit_code != 0 and "run without --intervene" in missing.output
    unknown = CliRunner().invoke(app, ["export", str(plain_dir), "--table", "rows", "--to", str(tmp_path / "r.parquet")])
    assert unknown.exit_code != 0 and "Unknown --table 'rows'" in unknown.output
    with pytest.raises(api.ProbeError, match="without --intervene"):
        api.load(plain_dir).interventions


def test_whole_model_mode_alone(tiny_bert_dir, intervened_dir, tmp_path):
    """--intervene-modes whole: the rows still come from the reference forward; the exact whole-model
    records equal the full run's (other batches here: the same examples padded to other lengths; the
    null's draws depend on the padded length, so only its presence is compared)."""
    result = invoke("run", tiny_bert_dir, *ARGS[:1], "6", *ARGS[2:], "--out", tmp_path, "--intervene", "exact,null",
                    "--intervene-modes", "whole")
    assert result.exit_code == 0, result.output
    (run_dir,) = tmp_path.iterdir()
    run, full = api.load(run_dir), api.load(intervened_dir)
    assert set(run.interventions["site"]) == {"whole"}
    expected = full.interventions
    assert set(run.interventions["substitute"]) == {"exact", "null"}
    expected = expected[(expected["site"] == "whole") & expected["substitute"].isin(["exact"])
                        & expected["example"].isin(run.interventions["example"])].reset_index(drop=True)
    columns = ["substitute", "example", "hidden_change", "embedding_cosine", "solver_rows"]
    got = run.interventions[run.interventions["substitute"] == "exact"]
    got = got.sort_values(["substitute", "example"], ignore_index=True)[columns]
    want = expected.sort_values(["substitute", "example"], ignore_index=True)[columns]
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-4, atol=1e-9)
    rows = full.rows[full.rows["example"].isin(run.rows["example"])].reset_index(drop=True)
    np.testing.assert_allclose(run.rows.sort_values(list(ROW_KEY))["rel_deviation"],
                               rows.sort_values(list(ROW_KEY))["rel_deviation"], rtol=1e-6)  # float32 padding


@pytest.mark.slow
def test_the_report_section_and_figure_show_the_tables_means(intervened_dir, tmp_path):
    from probe.report import build_report
    from probe.report import interventions as section

    out = build_report(intervened_dir, tmp_path / "report")
    page = (out / "index.html").read_text()
    assert 'id="interventions"' in page and "interventions.png" in page
    frame = pd.read_parquet(intervened_dir / "interventions.parquet")  # the direct computation
    direct = frame.groupby(["site", "substitute"])[["hidden_change", "embedding_cosine"]].mean()
    table = pd.read_csv(out / "interventions.csv", keep_default_na=False, na_values=[""])  # "null" is a name
    assert len(table) == len(direct) == 3 * 4 and (table["examples"] == 24).all()
    for _, row in table.iterrows():
        for effect in ("hidden_change", "embedding_cosine"):
            assert row[effect] == pytest.approx(direct.loc[(row["site"], row["substitute"]), effect], rel=1e-12)
    assert list(table["site"].unique()) == ["self:0", "self:1", "whole"]  # forward order, whole last
    wide = section.side_by_side(section.effects_table(frame), "hidden_change")
    assert wide.loc[wide["site"] == "whole", "hidden_change [null]"].item() == pytest.approx(
        direct.loc[("whole", "null"), "hidden_change"], rel=1e-12)
    # the figure's markers are these means: hidden change (left), 1 - cosine (right), per substitute
    drawn = section.figure(section.effects_table(frame), "tiny")
    left, right = drawn.figure.axes
    for line in left.lines:
        if line.get_label() in section.ORDER:
            expected = [direct.loc[(site, line.get_label()), "hidden_change"] for site in ["self:0", "self:1", "whole"]]
            np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-12)
    for line in right.lines:
        if line.get_label() in section.ORDER:
            expected = [1 - direct.loc[(site, line.get_label()), "embedding_cosine"]
                        for site in ["self:0", "self:1", "whole"]]
            np.testing.assert_allclose(line.get_ydata(), expected, rtol=1e-9, atol=1e-15)


def test_compare_sets_the_interventions_of_two_runs_side_by_side(intervened_dir, tiny_bert_dir, tmp_path):
    result = invoke("run", tiny_bert_dir, "--samples", "4", *ARGS[2:], "--out", tmp_path / "runs", "--init", "random",
                    "--seed", "1", "--intervene", "exact,null")
    assert result.exit_code == 0, result.output
    (other,) = (tmp_path / "runs").iterdir()
    compared = CliRunner().invoke(app, ["compare", str(intervened_dir), str(other), "--out", str(tmp_path / "cmp")])
    assert compared.exit_code == 0, compared.output
    table = pd.read_csv(tmp_path / "cmp" / "compare_interventions.csv", keep_default_na=False, na_values=[""])
    assert set(table["substitute"]) == {"exact", "null"}  # the substitutes both runs have
    assert "Interventions" in (tmp_path / "cmp" / "index.html").read_text()
    for run_dir in (intervened_dir, other):
        frame = pd.read_parquet(run_dir / "interventions.parquet")
        label = [c for c in table.columns if c.startswith("hidden_change [")][0 if run_dir == intervened_dir else 1]
        direct = frame.groupby(["site", "substitute"])["hidden_change"].mean()
        for _, row in table.iterrows():
            assert row[label] == pytest.approx(direct.loc[(row["site"], row["substitute"])], rel=1e-12)


def batch_with_the_rows_solver(model_dir, config):
    """``batch_records`` of three texts with a run's row solver (keeping its solutions) as ``emit``:
    ``(loaded, inputs, records, solver, layers)``, ``layers`` the layer of every site that
    ``probe.interventions`` solved itself (beyond the rows' solves)."""
    import torch

    import probe.interventions as intervene
    from probe.batch.columns import RowContext
    from probe.batch.rows import BatchSolver
    from probe.batch.summary import Summary
    from probe.capture.loading import load_model
    from probe.interventions import substitutes

    loaded = intervene.with_lm_head(load_model(str(model_dir), device="cpu"))
    texts = ["The quick brown fox jumps over the lazy dog.", "Short one.", "Attention is inference, or so it goes."]
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, None, 32)
    context = RowContext(example_ids=[4, 5, 6], special_ids=frozenset(loaded.tokenizer.all_special_ids),
                         token_text={}, tokenizer=loaded.tokenizer)
    solver = BatchSolver(("hidden",), config.alphas, config.rtol, context, Summary(1e-5))
    layers = []
    original = substitutes._solve
    substitutes._solve = lambda *a, **k: (layers.append(a[0].layer), original(*a, **k))[1]
    try:
        with torch.no_grad():
            records = intervene.batch_records(loaded, inputs, [4, 5, 6], config, solver)
    finally:
        substitutes._solve = original
    return loaded, inputs, records, solver, layers


def test_exact_and_null_from_the_rows_solves_equal_their_own_solves(tiny_bert_dir):
    """In a run, exact and null take p* from the rows' solver (BatchSolver.keep/solved) instead of solving
    again: no second solve per site, and the records equal those of intervention_records solving on its
    own (per-site mode; the whole-model mode solves new problems anyway)."""
    import copy

    import probe.interventions as intervene

    config = intervene.InterventionConfig(substitutes=("exact", "null", "second-order"), alphas=(1.0, 2.0),
                                          whole_model=False)
    loaded, inputs, reused, solver, calls = batch_with_the_rows_solver(tiny_bert_dir, config)
    assert calls == [] and len(solver.tables) == 2 * 2  # rows: 2 sites x 2 alphas, solved once
    assert solver.kept == {}  # taken, then let go as each site's substitutes were built
    own = intervene.intervention_records(loaded, inputs, [4, 5, 6], copy.deepcopy(config))
    assert len(reused) == len(own) == 2 * 2 * 3 * 3  # sites x alphas x substitutes x examples
    for mine, theirs in zip(reused, own):
        assert [mine[k] for k in ("space", "alpha", "substitute", "site", "example")] == \
               [theirs[k] for k in ("space", "alpha", "substitute", "site", "example")]
        assert mine["solver_rows"] == theirs["solver_rows"] and mine["solver_not_converged"] == 0
        for effect in ("hidden_change", "embedding_cosine"):
            assert mine[effect] == pytest.approx(theirs[effect], rel=1e-6, abs=1e-12), (mine["site"], mine["substitute"])


@pytest.mark.parametrize("modes", [("whole",), ("per-site", "whole")])
def test_the_whole_model_solves_only_the_sites_after_the_first(tiny_bert_dir, modes):
    """In a run, the whole-model forward's first site is the captured one (nothing is substituted before
    it): it takes p* from the rows' solver (whole mode alone) or starts after the per-site forward of that
    site (both modes), and solves only the later sites; its records equal those of whole_model_records
    solving every site on its own."""
    import probe.interventions as intervene

    config = intervene.InterventionConfig(substitutes=("exact",), alphas=(1.0,), per_site="per-site" in modes)
    loaded, inputs, records, solver, calls = batch_with_the_rows_solver(tiny_bert_dir, config)
    assert calls == [1]  # the tiny BERT's two layers: the whole model solves layer 1 only
    if modes == ("whole",):  # the rows' solver keeps the first site's solution only
        assert set(solver.kept) == {("self", 0, "hidden", 1.0)}
    whole = [r for r in records if r["site"] == intervene.WHOLE]
    own = intervene.whole_model_records(loaded, inputs, [4, 5, 6], config)
    assert len(whole) == len(own) == 3
    for mine, theirs in zip(whole, own):
        assert mine["example"] == theirs["example"] and mine["solver_rows"] == theirs["solver_rows"] > 0
        assert mine["solver_not_converged"] == 0
        for effect in ("hidden_change", "embedding_cosine", "lm_loss", "top1_agreement"):  # NaN: no LM head
            assert mine[effect] == pytest.approx(theirs[effect], rel=1e-6, abs=1e-12, nan_ok=True), effect
