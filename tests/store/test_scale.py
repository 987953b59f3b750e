"""Runs larger than the readers' memory budget: export, verify's sample, status and the end of a run read
them in memory that does not grow with the rows; the scale benchmark (bench/scale.py) builds valid runs and
measures every command, here at a tiny size.

Memory is measured in a child process, as the peak of Arrow's memory pool (``max_memory``: every buffer
pyarrow allocates, from the first import on) against the size of the run's rows in Arrow, under
``PROBE_MEMORY_BUDGET`` set lower than that size; DuckDB (the export's sort) holds to its own memory limit,
a share of the budget, and spills to disk beyond it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli import app
from probe.batch.summary import Summary
from probe.core.config import RunConfig, config_to_json
from probe.core.schema import DEVIATION_SCHEMA, ROW_KEY
from probe.store import integrity, storage

ROOT = Path(__file__).resolve().parents[2]
#: the budget the readers are held to here: below the synthetic run's rows in memory
BUDGET = "32MB"


def synthetic_rows(examples: np.ndarray, seed: int, layers=6, heads=12, queries=16) -> pa.Table:
    """Rows of one batch for ``examples`` (every layer, head and query), in no particular order, every
    column filled with plausible values."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(np.arange(layers), np.arange(heads), examples, np.arange(queries), indexing="ij"), -1)
    grid = grid.reshape(-1, 4)[rng.permutation(layers * heads * len(examples) * queries)]
    n = len(grid)
    floats = {field.name: rng.gamma(2.0, 0.05, n) for field in DEVIATION_SCHEMA if pa.types.is_floating(field.type)}
    columns = {
        **floats, "alpha": np.ones(n), "attention_type": pa.repeat(pa.scalar("self"), n),
        "space": pa.repeat(pa.scalar("hidden"), n), "layer": grid[:, 0].astype(np.int32),
        "head": grid[:, 1].astype(np.int32), "example": grid[:, 2].astype(np.int64),
        "query": grid[:, 3].astype(np.int32), "n_keys": np.full(n, queries, np.int32),
        "iterations": rng.integers(3, 8, n).astype(np.int32), "converged": np.ones(n, bool),
        "token_id": rng.integers(0, 30_000, n).astype(np.int32), "trivial": np.zeros(n, bool),
    }
    columns["token"] = pa.array([f"w{i}" for i in range(100)]).take(pa.array(rng.integers(0, 100, n)))
    columns["token_role"] = pa.repeat(pa.scalar("word"), n)
    return pa.table({name: columns[name] for name in DEVIATION_SCHEMA.names}, schema=DEVIATION_SCHEMA)


@pytest.fixture(scope="module")
def large_run(tmp_path_factory) -> tuple[Path, int]:
    """A complete run of 12 parts of about 50,000 rows (examples interleaved across the parts, as the plan's
    longest-first order leaves them), each recorded in the manifest; and its rows' size in Arrow (bytes)."""
    run_dir = storage.create_run_directory(tmp_path_factory.mktemp("large"), "large")
    parts, per_part, records, size = 12, 43, [], 0
    for batch in range(parts):
        examples = np.arange(batch, parts * per_part, parts)
        table = synthetic_rows(examples, seed=batch)
        summary = Summary(1e-5)
        summary.add(table)
        size += table.nbytes
        record = {"examples": examples.tolist(), "segment": 0, "rank": 0, "summary": summary.state(),
                  "seconds": {"capture": 0, "solve": 0}}
        path = storage.write_part(run_dir, batch, table, record)
        records.append(storage.describe_part(path, batch))
    segment = {"segment": 0, "ranks": [{"rank": 0}], "timings_s": {"capture_s": 0.0, "solve_s": 0.0, "total_s": 0.0}}
    storage.write_manifest(run_dir, {
        "status": "complete", "batches_total": parts, "batches_done": parts, "parts": records, "segments": [segment],
        "config": config_to_json(RunConfig(model="synthetic")), "solver": {"rows": sum(r["rows"] for r in records)},
    })
    return run_dir, size


def arrow_peak(code: str, *args) -> tuple[int, str]:
    """Run ``code`` in a child process under :data:`BUDGET`: the peak of its Arrow memory pool, and its output."""
    program = code + "\nimport pyarrow\nprint('ARROW_PEAK', pyarrow.default_memory_pool().max_memory())\n"
    env = {**os.environ, "PROBE_MEMORY_BUDGET": BUDGET,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", program, *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("ARROW_PEAK ")]
    return int(line.split()[1]), done.stdout


def test_the_large_run_is_larger_than_the_budget(large_run):
    from probe.store.engine import parse_size

    run_dir, size = large_run
    assert size > 2 * parse_size(BUDGET)
    assert integrity.check_parts(run_dir, checksums=True).ok


@pytest.mark.slow
def test_export_sorts_a_run_larger_than_the_budget_out_of_core(large_run, tmp_path):
    """The export holds a few buckets of rows in Arrow, a share of the budget (probe.store.keyorder);
    the file holds every row, in the row key's order."""
    run_dir, size = large_run
    to = tmp_path / "all.parquet"
    peak, _ = arrow_peak("import sys; from probe.store import export; export.export(sys.argv[1], sys.argv[2])", run_dir, to)
    assert peak < size / 4, (peak, size)
    keys = pq.read_table(to, columns=list(ROW_KEY[2:])).to_pandas()  # one space and alpha here
    assert len(keys) == sum(r["rows"] for r in json.loads((run_dir / "manifest.json").read_text())["parts"])
    values = keys[["layer", "head", "example", "query"]].to_numpy()
    steps = np.diff(values, axis=0)
    first_change = np.argmax(steps != 0, axis=1)  # lexicographic order: the first differing key increases
    assert (steps[np.arange(len(steps)), first_change] > 0).all()


def test_verify_draws_its_sample_without_loading_the_run(large_run):
    """The seeded sample is the one drawn over the whole table (positions in batch order), read one row
    group at a time."""
    from probe.pipeline.verify import sample_rows

    run_dir, size = large_run
    peak, _ = arrow_peak("import sys; from probe.store import integrity; from probe.pipeline.verify import sample_rows; "
                         "sample_rows(integrity.check_parts(sys.argv[1]), 64, 5)", run_dir)
    assert peak < size / 4, (peak, size)
    whole = pa.concat_tables([pq.read_table(path) for _, path in sorted(storage.part_files(run_dir).items())])
    chosen = np.sort(np.random.default_rng(5).choice(whole.num_rows, size=64, replace=False))
    sample = sample_rows(integrity.check_parts(run_dir), 64, 5)
    for name in ("layer", "head", "example", "query", "rel_deviation", "error_bound"):
        assert sample[name].to_pylist() == whole[name].take(pa.array(chosen)).to_pylist(), name


def test_status_reads_no_rows(large_run):
    run_dir, size = large_run
    peak, output = arrow_peak("import sys; from probe.cli import app; "
                              "app(['status', sys.argv[1]], standalone_mode=False)", run_dir)
    assert f"{run_dir}: complete, 12 of 12 batches" in output
    assert peak < size / 100, (peak, size)


def test_the_end_of_a_run_reads_no_rows(large_run, tmp_path):
    """What the pipeline does after its last batch (the totals folded from every part's record, as rank 0
    and resume fold them, and the manifest written) reads the parts' footers, not their rows; its totals are
    the rows' own (pandas over the parts, an independent count and sum)."""
    import shutil

    run_dir = Path(shutil.copytree(large_run[0], tmp_path / "run"))
    size = large_run[1]
    peak, _ = arrow_peak(
        "import sys, time; from probe.store import storage; from probe.pipeline import manifest as pipeline\n"
        "from probe.core.config import config_from_json\n"
        "manifest = storage.read_manifest(sys.argv[1])\n"
        "index = pipeline.PartIndex(sys.argv[1], 1e-5, storage.part_records(manifest))\n"
        "pipeline.record_completion(sys.argv[1], manifest, manifest['segments'][0], index, "
        "config_from_json(manifest['config']), time.perf_counter())", run_dir)
    assert peak < size / 100, (peak, size)
    manifest = storage.read_manifest(run_dir)
    rows = pq.read_table(run_dir / storage.PARTS, columns=["rel_deviation", "iterations"]).to_pandas()
    assert manifest["solver"]["rows"] == len(rows) and manifest["solver"]["max_iterations"] == rows["iterations"].max()
    mean = manifest["deviations"]["hidden, alpha=1"]["mean_rel_deviation"]
    assert mean == pytest.approx(rows["rel_deviation"].mean(), rel=1e-12)


def test_planning_tokenizes_the_texts_a_chunk_at_a_time(tiny_bert_dir, monkeypatch):
    """The batch plan keeps the texts' lengths, not their tokens: the tokenizer sees at most PLAN_CHUNK texts
    at once, and the lengths are those of one call over every text."""
    from probe.capture.data import Texts
    from probe.capture.loading import load_model
    from probe.pipeline import job as pipeline

    loaded = load_model(str(tiny_bert_dir), device="cpu")
    texts = Texts([f"text number {i} " + "word " * (i % 7) for i in range(11)], list(range(11)))
    whole = [len(ids) for ids in loaded.tokenizer(texts.texts, truncation=True, max_length=16)["input_ids"]]
    seen, tokenizer = [], loaded.tokenizer

    class Counting:
        def __call__(self, batch, **options):
            seen.append(len(batch))
            return tokenizer(batch, **options)

    monkeypatch.setattr(pipeline, "PLAN_CHUNK", 4)
    monkeypatch.setattr(loaded, "tokenizer", Counting())
    batches, lengths = pipeline.plan_batches(loaded, texts, 3, 16)
    assert seen == [4, 4, 3] and lengths == whole
    assert sorted(i for batch in batches for i in batch) == list(range(11))


@pytest.mark.slow
def test_the_scale_benchmark_builds_valid_runs_and_measures_them(tiny_bert_dir, tmp_path):
    """bench/scale.py at a tiny size, from a real tiny run: the run and its copies, two commands measured on
    each; the copies pass the readers' checks with checksums and `probe verify`'s checksum pass."""
    from ..support.runs import finished_run

    source = finished_run(tiny_bert_dir, tmp_path / "real", "--samples", "4", "--batch-size", "2", "--max-length", "16",
                          "--no-progress")
    out = tmp_path / "results_scale.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--source", str(source), "--sizes", "1,2000",
         "--run-texts", "", "--commands", "status,export", "--work", str(tmp_path), "--keep", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    real, copied = results["scale"]["sizes"]
    assert copied["rows"] == copied["copies"] * real["rows"] and copied["copies"] > 1
    for size in (real, copied):
        assert set(size["commands"]) == {"status", "export"}
        assert all(got["peak_rss_mb"] > 0 and got["wall_s"] > 0 for got in size["commands"].values())
    (copy_dir,) = [path for path in tmp_path.glob("probe-scale-*/scale-x*") if path.is_dir()]
    manifest = storage.read_manifest(copy_dir)
    assert integrity.check_parts(copy_dir, manifest, checksums=True).ok
    assert manifest["solver"]["rows"] == copied["rows"] and manifest["batches_done"] == manifest["batches_total"]
    examples = pq.read_table(copy_dir / storage.PARTS, columns=["example"])["example"].to_numpy()
    assert len(np.unique(examples)) == manifest["dataset"]["n_examples"]
    result = CliRunner().invoke(app, ["verify", str(copy_dir), "--sample", "0"])
    assert result.exit_code == 0, result.output
    assert "| export |" in out.with_suffix(".md").read_text()


# ------------------------------------------------------------------------------------- docs/large-runs.md

DOCS = ROOT / "docs" / "large-runs.md"


def bench_module(name: str):
    """A script of bench/ as a module (bench/ is not a package)."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_snippets_read_a_run_as_pandas_does(large_run):
    """The page's DuckDB and polars snippets (its Python blocks but Spark's) on a run of twelve parts: per
    layer and head, the rows, mean, linear 95th percentile and maximum of pandas over the whole table."""
    import re

    import pandas as pd

    run_dir, _ = large_run
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    tested = [block for block in blocks if "pyspark" not in block]
    assert len(tested) == 2 and any("duckdb" in b for b in tested) and any("polars" in b for b in tested)
    rows = pd.read_parquet(run_dir / storage.PARTS, columns=["space", "alpha", "trivial", "layer", "head",
                                                             "rel_deviation"])
    rows = rows[(rows["space"] == "hidden") & (rows["alpha"] == 1) & ~rows["trivial"]]
    grouped = rows.groupby(["layer", "head"], sort=True)["rel_deviation"]
    expected = pd.DataFrame({"rows": grouped.count(), "mean": grouped.mean(), "p95": grouped.quantile(0.95),
                             "max": grouped.max()}).reset_index()
    for block in tested:
        scope: dict = {}
        exec(block.replace("RUN_DIR", str(run_dir)), scope)
        got = scope["per_head"]
        got = got.to_pandas() if hasattr(got, "to_pandas") else got
        assert list(got.columns) == list(expected.columns)
        for column in expected.columns:
            np.testing.assert_allclose(got[column].to_numpy(float), expected[column].to_numpy(float), rtol=1e-12,
                                       err_msg=column)


def test_the_docs_numbers_are_the_results_files():
    """docs/large-runs.md quotes bench/results_storage.json, and its table is bench/results_scale.json's."""
    import re

    text = DOCS.read_text()
    storage_results = json.loads((ROOT / "bench" / "results_storage.json").read_text())
    for name, value in bench_module("storage").docs_values(storage_results).items():
        assert f"<!-- {name} -->{value}<!-- /{name} -->" in text, name
    scale_results = ROOT / "bench" / "results_scale.json"
    if scale_results.exists():  # written by the benchmark's full run
        block = re.search(r"<!-- scale:table -->\n(.*?)\n<!-- /scale:table -->", text, flags=re.S).group(1)
        assert block == bench_module("scale_report").docs_block(json.loads(scale_results.read_text()))


@pytest.mark.slow
def test_the_summary_check_agrees_with_the_report_and_flags_a_changed_number(tmp_path):
    """bench/summary_exact.py (the big run's summary.csv against pandas) passes a report of a small run with
    non-converged and trivial rows and two slices, and fails where one number of its summary is changed."""
    import pandas as pd

    sys.path.insert(0, str(ROOT / "bench"))
    import summary_exact

    from probe.report import build_report

    from ..support.synthetic_runs import deviation_rows, manifest_for, write_run

    rows = deviation_rows({"self": (2, 3), "causal": (1, 2)}, examples=10, queries=6, alphas=(0.5, 1.0), seed=5)
    run_dir = write_run(tmp_path / "run", rows.drop(columns="model"), manifest_for(), parts=3)
    report = build_report(run_dir, tmp_path / "report", ("png",))
    summary = pd.read_csv(report / "summary.csv")
    read = summary_exact.read_rows(run_dir)
    reference = summary_exact.pandas_summary(read)
    checked = summary_exact.compare(summary, reference, read)
    assert summary_exact.passed(checked), checked
    assert checked["head"]["groups"] == 2 * (2 * 3 + 1 * 2)  # two alphas, every head of both types
    for column, level in (("p95", "head"), ("count", "layer"), ("mean", "layer_head_averaged")):
        changed = summary.copy()
        row = changed.index[(changed["level"] == level) & (changed["count"] > 0)][0]
        changed.loc[row, column] = (changed.loc[row, column] + 1 if column == "count"
                                    else changed.loc[row, column] * (1 + 1e-6))
        assert not summary_exact.passed(summary_exact.compare(changed, reference, read)), (column, level)


def test_a_command_measured_again_keeps_the_others_with_their_dates():
    """--keep-commands: the export measured again at a size keeps that size's other commands from the earlier
    results, each with the date it was measured, and the table marks them and says when."""
    scale = bench_module("scale")
    earlier = {"measured_at": "2026-11-26T01:00:00+00:00", "load_average_before": [1.0], "load_average_after": [2.0],
               "sizes": [{"target_rows": 10, "measured_at": "2026-11-26T02:00:00+00:00",
                          "load_average_before": [0.5], "load_average_after": [0.6],
                          "commands": {"report": {"peak_rss_mb": 100.0, "wall_s": 5.0},
                                       "export": {"peak_rss_mb": 900.0, "wall_s": 9.0}}}]}
    merged = scale.kept_commands(earlier, 10, {"export": {"peak_rss_mb": 300.0, "wall_s": 3.0}})
    assert list(merged) == ["report", "export"]  # the order of COMMANDS
    assert merged["export"] == {"peak_rss_mb": 300.0, "wall_s": 3.0}
    assert merged["report"]["measured_at"] == "2026-11-26T02:00:00+00:00" and merged["report"]["wall_s"] == 5.0
    assert scale.kept_commands(earlier, 20, {"export": {}}) == {"export": {}}  # a size not measured before
    results = {"scale": {**earlier, "measured_at": "2026-11-27T00:00:00+00:00", "settings": {"memory_budget": "default"},
                         "sizes": [{"target_rows": 10, "rows": 10, "bytes_per_row": 70.0, "commands": merged,
                                    "measured_at": "2026-11-27T00:00:00+00:00"}]},
               "run_memory": None, "targets": {}}
    text = "\n".join(bench_module("scale_report").command_lines(results))
    assert "| report | 100 MB, 5.0 s * |" in text and "| export | 300 MB, 3.0 s |" in text
    assert "at 10 rows, report, measured from 2026-11-26 02:00 UTC" in text
