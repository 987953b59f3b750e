"""Synthetic run directories for the readers' tests: a deviations table with the exact schema of
``probe.core.schema`` (a parquet file, or a directory of part files) filled with reproducible random
deviations and planted effects, and a manifest."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from probe.core.schema import DEVIATION_SCHEMA

SOURCE_TYPES = ("self", "encoder_self")  # queries are source tokens: [CLS] first, [SEP] last


CAUSAL_TYPES = ("decoder_self", "causal_self")  # the first query has one key: a trivial row


def deviation_rows(
    shapes: dict[str, tuple[int, int]], *, examples=4, queries=6, non_converged=4, alphas=(1.0,), spaces=("hidden",),
    cls_factor=1.0, null_columns=(), seed=0,
) -> pd.DataFrame:
    """Rows for every (space, alpha, type, layer, head, example, query); ``shapes``: type -> (layers, heads).

    Planted structure: the deviation grows with the layer, with alpha (``alpha ** 0.3``) and in key space
    (x 1.25); source-side queries are ``[CLS]`` (position 0, role special, deviation x ``cls_factor``),
    ``[SEP]`` (last, special) and words; causal types have ``n_keys = query + 1``, so their first query is
    trivial (deviation exactly 0).  ``null_columns`` are written as nulls, as the pipeline does before it
    computes them.
    """
    rng = np.random.default_rng(seed)
    index = pd.MultiIndex.from_tuples(
        [
            (space, alpha, kind, layer, head, example, query)
            for space in spaces
            for alpha in alphas
            for kind, (layers, heads) in shapes.items()
            for layer in range(layers)
            for head in range(heads)
            for example in range(examples)
            for query in range(queries)
        ],
        names=["space", "alpha", "attention_type", "layer", "head", "example", "query"],
    )
    rows = index.to_frame(index=False)
    n = len(rows)
    source = rows["attention_type"].isin(SOURCE_TYPES).to_numpy()
    causal = rows["attention_type"].isin(CAUSAL_TYPES).to_numpy()
    first, last = (rows["query"] == 0).to_numpy(), (rows["query"] == queries - 1).to_numpy()
    rows.insert(0, "model", "org/tiny-model")
    rows["n_keys"] = np.where(causal, rows["query"] + 1, queries)
    deviation = rng.gamma(2.0, 0.03, n) * (1 + 0.2 * rows["layer"]) * rows["alpha"] ** 0.3
    deviation *= np.where(rows["space"] == "key", 1.25, 1.0) * np.where(source & first, cls_factor, 1.0)
    rows["trivial"] = rows["n_keys"] == 1
    rows["rel_deviation"] = np.where(rows["trivial"], 0.0, deviation)
    rows["lambda_norm"] = rng.uniform(1, 5, n)
    rows["duality_gap"] = rng.uniform(0, 1e-12, n)
    rows["error_bound"] = rng.uniform(0, 1e-10, n)
    rows["iterations"] = rng.integers(1, 8, n)
    rows["converged"] = True
    rows.loc[rng.choice(n, size=non_converged, replace=False), "converged"] = False
    rows["token"] = np.where(source & first, "[CLS]", np.where(source & last, "[SEP]", "w" + (
        (rows["example"] + rows["query"]) % 3).astype(str)))
    rows["token_id"] = rows["token"].map(lambda t: zlib.crc32(t.encode()) % 30000)
    rows["token_role"] = np.where(source & (first | last), "special", np.where(~source & first, "first", "word"))
    for name in ("second_order_deviation", "attention_tv", "output_deviation"):
        rows[name] = rows["rel_deviation"] * rng.uniform(0.1, 0.5, n)
    rows["evidence_norm"] = rows["lambda_norm"] * rng.uniform(0.9, 1.1, n)
    rows["attention_entropy"] = np.log(rows["n_keys"]) * rng.uniform(0.5, 1.0, n)
    for name in null_columns:
        rows[name] = None
    return rows


def write_run(run_dir: Path, rows: pd.DataFrame, manifest: dict | str | None, *, parts: int = 0,
              columns=None) -> Path:
    """A run directory: rows as deviations.parquet (a file, or a directory of ``parts`` part files) and
    the manifest (dict, raw text or none).  ``columns`` writes only those columns (old runs)."""
    run_dir.mkdir(parents=True)
    schema = DEVIATION_SCHEMA if columns is None else pa.schema([DEVIATION_SCHEMA.field(c) for c in columns])
    if columns is None and "model" in rows.columns:  # the model on every row, as runs before the manifest named it
        schema = schema.insert(0, pa.field("model", pa.string()))
    table = pa.Table.from_pandas(rows[list(schema.names)], schema=schema, preserve_index=False)
    path = run_dir / "deviations.parquet"
    if parts:
        path.mkdir()
        bounds = np.linspace(0, len(rows), parts + 1).astype(int)
        for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            pq.write_table(table.slice(start, stop - start), path / f"part-{i:05d}.parquet")
    else:
        pq.write_table(table, path, row_group_size=100)  # several row groups
    if isinstance(manifest, dict):
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    elif isinstance(manifest, str):
        (run_dir / "manifest.json").write_text(manifest)
    return run_dir


def manifest_for(description="tiny <b>corpus</b> & co", alpha=1.0, **model):
    return {
        "probe_version": "0.1.0",
        "status": "complete",
        "model": {"id": "org/tiny-model", "path": None, "model_type": "t5", **model},
        "dataset": {"name": None, "description": description, "n_examples": 4, "column": "text"},
        "alpha": alpha,
        "attention_implementation": "eager",
        "device": "cpu",
        "dtype": "float32",
        "fidelity": {"max_abs_error": 3.2e-7, "tolerance": 1e-5, "passed": True},
        "solver": {"rows": 123, "not_converged": 4, "max_duality_gap": 1e-12, "max_relative_error_bound": 2.5e-10},
    }
