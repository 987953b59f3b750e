"""Sentences the documentation quotes, recomputed from the results files committed under ``reports/``."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ot_quality_sentence() -> str:
    """The README's reading of the OT approximation at the trained OT-ViT's own setting."""
    quality = json.loads((ROOT / "reports" / "ot" / "quality_model.json").read_text())
    meta = quality["meta"]
    row = next(r for r in quality["rows"]
               if r["alpha"] == meta["model_alpha"] and abs(r["gamma"] - meta["model_gamma"]) < 1e-9)
    assert row["certified_fraction"] == 1.0
    return (f"median relative deviation {row['rel_deviation_median']:.3f} (10th to 90th percentile "
            f"{row['rel_deviation_p10']:.3f} to {row['rel_deviation_p90']:.3f}) and median attention total "
            f"variation {row['tv_median']:.3f} over {row['problems']:,} certified problems")
