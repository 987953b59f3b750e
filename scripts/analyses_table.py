"""Per-layer means of the deviation columns for a pretrained run and its random-init control.

    python scripts/analyses_table.py PRETRAINED_RUN RANDOM_RUN [--out FILE.md]

Both runs should cover the same spaces and alphas (e.g. ``--alpha 0.25,1,4 --space hidden,key``).  Trivial
rows (one key) are left out.  Prints (and writes) markdown tables: for each quantity, one row per (init,
space, alpha) and one column per layer; the analyses section of docs/guide.md is this output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

QUANTITIES = ("rel_deviation", "second_order_deviation", "attention_tv", "output_deviation")
COLUMNS = ["space", "alpha", "attention_type", "layer", "trivial", "converged", *QUANTITIES]


def layer_means(run_dir: Path, init: str) -> pd.DataFrame:
    frame = pd.read_parquet(Path(run_dir) / "deviations.parquet", columns=COLUMNS)
    if not frame["converged"].all():
        raise SystemExit(f"{run_dir}: {(~frame['converged']).sum()} rows not converged")
    frame = frame[~frame["trivial"]]
    means = frame.groupby(["space", "alpha", "attention_type", "layer"])[list(QUANTITIES)].mean().reset_index()
    means.insert(0, "init", init)
    return means


def tables(pretrained: Path, random: Path) -> str:
    means = pd.concat([layer_means(pretrained, "pretrained"), layer_means(random, "random")])
    out = []
    for quantity in QUANTITIES:
        wide = means.pivot_table(index=["init", "space", "alpha", "attention_type"], columns="layer", values=quantity)
        wide.columns = [f"layer {c}" for c in wide.columns]
        out.append(f"**{quantity}** (mean per layer, trivial rows left out)\n")
        header = "| init | space | alpha | type | " + " | ".join(wide.columns) + " |"
        out += [header, "|" + "---|" * (4 + len(wide.columns))]
        for (init, space, alpha, kind), row in wide.iterrows():
            out.append(f"| {init} | {space} | {alpha:g} | {kind} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pretrained", type=Path)
    parser.add_argument("random", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = tables(args.pretrained, args.random)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
