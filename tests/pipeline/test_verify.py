"""`probe verify`: every part against its SHA-256 record, then a seeded sample of rows re-solved from
the model by the reference solver (gradient ascent on the full dual, not the run's Newton-CG); exit 0
only when every check holds.  A number tampered in a part whose checksum was updated to match, so that
only the re-solve can catch it, fails."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli import app
from probe.pipeline.verify import sample_rows
from probe.store import integrity, storage

from ..support.runs import flip_a_byte, invoke_with_one_thread, part

SAMPLE = ["--sample", "12", "--seed", "3"]


def test_a_clean_run_verifies(clean_run):
    result = invoke_with_one_thread("verify", clean_run, *SAMPLE)
    assert result.exit_code == 0, result.output
    assert "parts: 6 of 6 batches checked against their SHA-256 records" in result.output
    assert "re-solved: 12 rows (seed 3)" in result.output and "verified: every check holds" in result.output
    for column in ("rel_deviation", "lambda_norm", "attention_tv", "evidence_norm", "attention_entropy",
                   "second_order_deviation", "output_deviation"):
        assert f"  {column}: largest difference" in result.output and "FAILS" not in result.output


def tamper(run_dir: Path, column: str, factor: float) -> dict:
    """Multiply ``column`` of the first sampled row by ``factor`` in its part file (rewritten with its
    metadata), and record the new file's size and SHA-256 in the manifest, as a careful forger would."""
    check = integrity.check_parts(run_dir)
    target = sample_rows(check, 12, 3).slice(0, 1).to_pylist()[0]
    path = part(run_dir, target["batch"])
    table = pq.read_table(path)
    hit = np.ones(table.num_rows, bool)
    for key in ("space", "alpha", "attention_type", "layer", "head", "example", "query"):
        hit &= pc.equal(table[key], pa.scalar(target[key], table.schema.field(key).type)).to_numpy(zero_copy_only=False)
    assert hit.sum() == 1
    values = table[column].to_numpy().copy()
    values[hit] *= factor
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values, pa.float64()))
    pq.write_table(table, path)
    manifest = json.loads((run_dir / storage.MANIFEST).read_text())
    for record in manifest["parts"]:
        if record["batch"] == target["batch"]:
            record.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    storage.write_manifest(run_dir, manifest)
    return target


@pytest.mark.parametrize("column,factor", [("rel_deviation", 1 + 1e-7), ("attention_tv", 1 + 1e-6),
                                           ("second_order_deviation", 1 + 1e-4), ("output_deviation", 1 + 1e-5)])
def test_a_tampered_number_with_a_matching_checksum_fails(clean_run, tmp_path, column, factor):
    run_dir = Path(shutil.copytree(clean_run, tmp_path / "run"))
    target = tamper(run_dir, column, factor)
    assert integrity.check_parts(run_dir, checksums=True).ok  # the checksums cannot see it
    result = invoke_with_one_thread("verify", run_dir, *SAMPLE)
    assert result.exit_code == 1, result.output
    assert "parts: 6 of 6 batches checked" in result.output and "DAMAGED" not in result.output
    assert f"  {column}: largest difference" in result.output and "FAILS on 1 row(s)" in result.output, result.output
    assert f"example {target['example']} query {target['query']}" in result.output
    assert "NOT verified" in result.output


def test_a_damaged_part_fails_verify_and_names_the_repair(clean_run, tmp_path):
    run_dir = Path(shutil.copytree(clean_run, tmp_path / "run"))
    flip_a_byte(part(run_dir, 2))
    result = CliRunner().invoke(app, ["verify", str(run_dir), "--sample", "0"])
    assert result.exit_code == 1, result.output
    assert "DAMAGED: batch 2 (SHA-256 differs from the recorded one)" in result.output
    assert f"probe resume {run_dir}" in result.output


def test_verify_refuses_a_non_run(tmp_path):
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output


def test_a_run_of_several_alphas_in_both_spaces_verifies(tiny_bert_dir, tmp_path):
    """Rows of alpha 0.5 and 2 (the evidence rescaled to z / alpha) in the hidden and the key space (one
    Gram matrix per key head) are rebuilt and re-solved right."""
    out = tmp_path / "runs"
    result = invoke_with_one_thread("run", tiny_bert_dir, "--samples", "4", "--batch-size", "2", "--max-length", "24",
                                    "--alpha", "0.5,2", "--space", "hidden,key", "--no-progress", "--out", out)
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    result = invoke_with_one_thread("verify", run_dir, "--sample", "16", "--seed", "1")
    assert result.exit_code == 0, result.output
    assert "verified: every check holds" in result.output
    sampled = sample_rows(integrity.check_parts(run_dir), 16, 1)
    assert set(sampled["space"].to_pylist()) == {"hidden", "key"} and set(sampled["alpha"].to_pylist()) == {0.5, 2.0}


def test_the_reference_finishes_an_ill_conditioned_problem(monkeypatch):
    """Gradient ascent cut short (10 steps) on templates of norm ~100, where it needs ~10^5: the Newton
    steps finish the solve to its tolerance, and the answer is SciPy L-BFGS's optimum (an independent
    check); with neither, the row would be reported as not re-solved."""
    import probe.pipeline.verify as verify
    from probe.solve.reference import lbfgs_dual, templates_from_reduced

    rng = np.random.default_rng(0)
    T = rng.normal(size=(6, 4)) * 50.0
    z = rng.normal(size=4)
    log_u = rng.normal(size=6)
    monkeypatch.setattr(verify, "REFERENCE_MAX_ITER", 10)
    ref = verify._reference(T @ T.T, T @ z, float(z @ z), log_u, 1.0)
    assert ref["converged"] and ref["epsilon"] <= 10 * verify.REFERENCE_TOL * ref["lambda_norm"], ref
    explicit_T, explicit_z = templates_from_reduced(T @ T.T, T @ z, float(z @ z))
    lam, _ = lbfgs_dual(explicit_T, explicit_z, log_u, 1.0)
    assert ref["lambda_norm"] == pytest.approx(np.linalg.norm(lam), rel=1e-4)  # L-BFGS: ~5e-5 here


@pytest.fixture(scope="module")
def intervened_run(tiny_bert_dir, tmp_path_factory):
    """A tiny run with ``--intervene exact``: two tables, each with its part records."""
    out = tmp_path_factory.mktemp("intervened")
    result = invoke_with_one_thread("run", tiny_bert_dir, "--samples", "4", "--batch-size", "2", "--max-length", "16",
                                    "--intervene", "exact", "--no-progress", "--out", out)
    assert result.exit_code == 0, result.output
    (run_dir,) = out.iterdir()
    return run_dir


def test_verify_and_status_check_the_interventions_parts(intervened_run, tmp_path):
    clean = CliRunner().invoke(app, ["verify", str(intervened_run), "--sample", "0"])
    assert clean.exit_code == 0, clean.output
    assert "interventions.parquet: 2 of 2 batches checked against their SHA-256 records" in clean.output
    run_dir = Path(shutil.copytree(intervened_run, tmp_path / "run"))
    target = storage.part_path(run_dir, 1, storage.INTERVENTIONS)
    data = bytearray(target.read_bytes())
    data[len(data) // 8] ^= 0xFF  # in the first column's pages (a third in hits this small file's footer)
    target.write_bytes(bytes(data))  # same size, footer intact: only the checksum can tell
    result = CliRunner().invoke(app, ["verify", str(run_dir), "--sample", "0"])
    assert result.exit_code == 1, result.output
    assert ("interventions.parquet: 1 of 2 batches checked against their SHA-256 records; DAMAGED: batch 1 "
            "(SHA-256 differs from the recorded one)") in result.output
    assert f"probe resume {run_dir}" in result.output and "NOT verified" in result.output
    # status checks cheaply (presence, size, footer): a cut part is what it sees, in either table
    cut = storage.part_path(run_dir, 0, storage.INTERVENTIONS)
    cut.write_bytes(cut.read_bytes()[:-100])
    status = CliRunner().invoke(app, ["status", str(run_dir)])
    assert status.exit_code == 0, status.output
    assert "damaged (interventions.parquet): batch 0 (" in status.output, status.output
    assert f"repair with: probe resume {run_dir}" in status.output
    assert "damaged: " not in status.output  # the rows' parts are intact
