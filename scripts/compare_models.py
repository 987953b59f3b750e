"""Compare probe runs of several models layer by layer, from their ``deviations.parquet``.

    python scripts/compare_models.py RUN_DIR [RUN_DIR ...] [--attention-type self] [--space hidden] [--alpha 1]

For each run (one attention type, space and alpha): per layer, the number of rows, the mean, median and
95th percentile of ``rel_deviation``, the mean over the first query of each example (``query == 0``:
BERT's ``[CLS]``, MPNet's ``<s>``), over the other special tokens (``[SEP]``, ``</s>``) and over word
tokens, the share of the layer's rows above 0.12 (where MiniLM's second mode starts), and two
quantities that help read the deviation: the mean evidence norm ``||alpha z||`` and the mean entropy of
the attention rows (nats).  A second table says which tokens make the upper tail: per layer, the
queries whose head-averaged deviation is in the layer's top 5% (the per-token histograms of the
report), and the three tokens most frequent among them.  Layers are
also given as relative depth ``layer / (layers - 1)``, so that models of different depth line up.  The
output is Markdown (the comparison docs/guide.md quotes is computed with this script, not typed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

#: rel_deviation above which a row counts toward the upper mode
HIGH = 0.12


def load_run(run_dir: Path, attention_type: str, space: str, alpha: float) -> tuple[str, dict, pd.DataFrame]:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    columns = ["attention_type", "layer", "example", "query", "rel_deviation", "token_role", "space", "alpha",
               "evidence_norm", "attention_entropy", "token"]
    frame = pd.read_parquet(run_dir / "deviations.parquet", columns=columns)
    frame = frame[(frame["attention_type"] == attention_type) & (frame["space"] == space) & (frame["alpha"] == alpha)]
    if frame.empty:
        raise SystemExit(f"{run_dir}: no rows for attention type {attention_type}, space {space}, alpha {alpha}")
    name = Path(str(manifest["model"]["id"]).rstrip("/")).name
    return name, manifest, frame


def per_layer(frame: pd.DataFrame) -> pd.DataFrame:
    layers = frame["layer"].max() + 1
    first = frame["query"] == 0
    groups = frame.groupby("layer")["rel_deviation"]
    table = pd.DataFrame({
        "depth": groups.size().index / max(layers - 1, 1),
        "rows": groups.size(),
        "mean": groups.mean(),
        "median": groups.median(),
        "p95": groups.quantile(0.95),
        "first query": frame[first].groupby("layer")["rel_deviation"].mean(),
        "other special": frame[~first & (frame["token_role"] == "special")].groupby("layer")["rel_deviation"].mean(),
        "words": frame[~first & (frame["token_role"] == "word")].groupby("layer")["rel_deviation"].mean(),
        f"share > {HIGH}": frame.assign(high=frame["rel_deviation"] > HIGH).groupby("layer")["high"].mean(),
        "evidence norm": frame.groupby("layer")["evidence_norm"].mean(),
        "entropy": frame.groupby("layer")["attention_entropy"].mean(),
    })
    table.index.name = "layer"
    return table


def tail_tokens(frame: pd.DataFrame, top: float = 0.05, shown: int = 3) -> pd.DataFrame:
    """Per layer: the queries (example, query) whose head-averaged deviation is in the layer's top
    ``top`` share, their mean, and the ``shown`` most frequent tokens among them with their share."""
    per_token = frame.groupby(["layer", "example", "query"]).agg(
        deviation=("rel_deviation", "mean"), token=("token", "first")
    ).reset_index()
    rows = {}
    for layer, part in per_token.groupby("layer"):
        tail = part[part["deviation"] >= part["deviation"].quantile(1 - top)]
        shares = tail["token"].value_counts(normalize=True).head(shown)
        shares = shares[shares >= 0.005]  # shown as at least 1%
        rows[layer] = {
            "tail from": tail["deviation"].min(),
            "tail mean": tail["deviation"].mean(),
            "rest mean": part.loc[part.index.difference(tail.index), "deviation"].mean(),
            "tokens of the tail": ", ".join(f"`{token}` {share:.0%}" for token, share in shares.items()),
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "layer"
    return table


def markdown(name: str, table: pd.DataFrame) -> str:
    header = "| layer | " + " | ".join(table.columns) + " |"
    lines = [f"**{name}**", "", header, "|" + " --- |" * (len(table.columns) + 1)]
    for layer, row in table.iterrows():
        cells = [cell(column, row[column]) for column in table.columns]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(column: str, value) -> str:
    if isinstance(value, str):
        return value
    if column == "rows":
        return f"{int(value):,}"
    return f"{value:.3g}" if column == "evidence norm" else f"{value:.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (deviations.parquet + manifest.json)")
    parser.add_argument("--attention-type", default="self")
    parser.add_argument("--space", default="hidden")
    parser.add_argument("--alpha", type=float, default=1.0)
    args = parser.parse_args(argv)
    digests = set()
    for run_dir in args.runs:
        name, manifest, frame = load_run(run_dir, args.attention_type, args.space, args.alpha)
        digests.add(manifest["dataset"].get("texts_sha256"))
        table = per_layer(frame)
        print(markdown(name, table))
        print()
        print(markdown(f"{name}: the top 5% of queries per layer (head-averaged)", tail_tokens(frame)))
        overall = frame["rel_deviation"]
        print(f"\nall layers: {len(frame):,} rows, {frame['example'].nunique()} examples, mean {overall.mean():.3f}, "
              f"median {overall.median():.3f}, p95 {overall.quantile(0.95):.3f}; highest layer mean "
              f"{table['mean'].max():.3f} (layer {int(table['mean'].idxmax())}), lowest {table['mean'].min():.3f} "
              f"(layer {int(table['mean'].idxmin())})\n")
    if len(args.runs) > 1:
        print("same texts in every run" if len(digests) == 1 else "WARNING: the runs used different texts")


if __name__ == "__main__":
    main()
