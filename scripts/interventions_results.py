"""The interventions results: a model's `probe run --intervene` run pretrained against its
`--init random` control, as tables generated from the runs' interventions.parquet (never typed).

    python scripts/interventions_results.py PRETRAINED_RUN RANDOM_RUN --name minilm \
        --out reports/interventions [--source "..."]

writes ``OUT/NAME-results.md`` (the tables and the computed observations docs/interventions.md quotes),
``OUT/NAME-results.csv`` (the side-by-side table: probe.report.interventions.compare_table) and
``OUT/NAME-interventions.png`` (the report's figure of the pretrained run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _fmt(value: float, digits: int = 4) -> str:
    return "" if value != value else f"{value:.{digits}f}"


def observations(frames: dict, labels: list[str]) -> list[str]:
    """Sentences computed from the records (means over examples)."""

    lines = []
    for label in labels:
        frame = frames[label]
        means = frame.groupby(["site", "substitute"])[
            ["hidden_change", "embedding_cosine", "lm_loss_original", "lm_loss", "top1_agreement"]].mean()
        whole = means.loc["whole"]
        text = (f"{label}: with every site's attention replaced by the exact posterior (whole, exact) the final "
                f"hidden states move by {_fmt(whole.loc['exact', 'hidden_change'])} of their norm on average and the "
                f"pooled embedding keeps cosine {_fmt(whole.loc['exact', 'embedding_cosine'])}")
        if "null" in whole.index:
            text += (f" (null: {_fmt(whole.loc['null', 'hidden_change'])} and "
                     f"{_fmt(whole.loc['null', 'embedding_cosine'])})")
        if "second-order" in whole.index:
            text += (f"; second-order: {_fmt(whole.loc['second-order', 'hidden_change'])} and "
                     f"{_fmt(whole.loc['second-order', 'embedding_cosine'])}")
        if whole["lm_loss"].notna().any():
            text += (f"; masked-LM loss {_fmt(whole.loc['exact', 'lm_loss_original'], 3)} nats unmodified, "
                     f"{_fmt(whole.loc['exact', 'lm_loss'], 3)} with exact inference"
                     + (f" ({_fmt(whole.loc['null', 'lm_loss'], 3)} under the null)" if "null" in whole.index else "")
                     + f", top-1 agreement {_fmt(whole.loc['exact', 'top1_agreement'], 3)}"
                     + (f" (null {_fmt(whole.loc['null', 'top1_agreement'], 3)})" if "null" in whole.index else ""))
        lines.append(text + ".")
        per_site = means.drop(index="whole", level="site")
        exact = per_site.xs("exact", level="substitute")["hidden_change"]
        text = (f"{label}: per site, the exact posterior moves the output most at {exact.idxmax()} "
                f"({_fmt(exact.max())}) and least at {exact.idxmin()} ({_fmt(exact.min())})")
        if "null" in per_site.index.get_level_values("substitute"):
            null = per_site.xs("null", level="substitute")["hidden_change"].reindex(exact.index)
            more = int((exact > null).sum())
            ratio = exact / null
            text += (f"; it moves it more than the null at {more} of {len(exact)} sites "
                     f"(exact / null from {_fmt(ratio.min(), 2)} to {_fmt(ratio.max(), 2)})")
            # per example, paired: how often exact beats its own null at the whole-model level
            paired = frame[frame["site"] == "whole"].pivot_table(index="example", columns="substitute",
                                                                  values="hidden_change")
            if {"exact", "null"} <= set(paired.columns):
                text += (f"; whole model, example by example, exact moves it more than its null in "
                         f"{int((paired['exact'] > paired['null']).sum())} of {len(paired)} examples")
        lines.append(text + ".")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pretrained", type=Path)
    parser.add_argument("random", type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "interventions")
    parser.add_argument("--source", default="", help="where the texts come from, for the header")
    parser.add_argument("--docs", type=Path, help="also put the results between the markers "
                        "<!-- interventions-results:NAME --> and <!-- /interventions-results:NAME --> of this file")
    args = parser.parse_args(argv)

    import pandas as pd

    from probe import api
    from probe.report import interventions as section
    from probe.report.style import save, style

    runs = {"pretrained": api.load(args.pretrained), "random": api.load(args.random)}
    frames = {label: run.interventions for label, run in runs.items()}
    labels = list(runs)
    table = section.compare_table([frames[label] for label in labels], labels)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / f"{args.name}-results.csv", index=False)
    with style():
        drawn = section.figure(section.effects_table(frames["pretrained"]), runs["pretrained"].name)
        saved = save(drawn, args.out, ["png"])
    saved.files[0].rename(args.out / f"{args.name}-interventions.png")

    manifest = runs["pretrained"].manifest
    settings = manifest["interventions"]
    header = (
        f"# Interventions on {runs['pretrained'].name}: pretrained against random init\n\n"
        f"Generated by `scripts/interventions_results.py` from two `probe run --intervene "
        f"{','.join(settings['substitutes'])}` runs (edit the script, not this file): "
        f"{manifest['dataset']['description']}{' (' + args.source + ')' if args.source else ''}, "
        f"{manifest['dataset']['n_examples']} texts, max length {manifest['dataset']['max_length']}, "
        f"{manifest['spaces'][0]} space, alpha {manifest['alpha'][0]:g}, pooling {settings['pooling']}, "
        f"LM head {settings['lm_head'] or 'none'}; random init: the same architecture with seed "
        f"{runs['random'].manifest['seed']}. probe {manifest['probe_version']}, torch "
        f"{manifest['versions']['torch']}. Each cell: the mean over the texts. A per-site row substitutes that "
        "site only; `whole` substitutes every site, each solved on the hidden states the earlier substitutions "
        "produced. `null`: a seeded random change of the model's attention with the exact posterior's total "
        "variation, per row.\n"
    )
    body = [header, "## What the numbers say (computed)\n"]
    body += [f"- {line}" for line in observations(frames, labels)]
    certificates = []
    for label in labels:
        exact = frames[label][frames[label]["substitute"] == "exact"]
        certificates.append(f"{label}: {int(exact['solver_rows'].sum()):,} exact solves, "
                            f"{int(exact['solver_not_converged'].sum())} not converged, largest relative error "
                            f"bound {exact['max_relative_error_bound'].max():.1e}")
    body += ["", "Certificates: " + "; ".join(certificates) + ".", ""]
    effects = [e for e in ("hidden_change", "embedding_cosine", "lm_loss", "top1_agreement")
               if any(frames[label][e].notna().any() for label in labels)]
    if "lm_loss" in effects:
        effects.insert(effects.index("lm_loss"), "lm_loss_original")
    for effect in effects:
        wide = {}
        for label in labels:
            column = f"{effect} [{label}]"
            pivot = table.pivot_table(index="site", columns="substitute", values=column, sort=False)
            for substitute in [s for s in section.ORDER if s in pivot.columns]:
                wide[f"{label}: {substitute}"] = pivot[substitute]
        wide = pd.DataFrame(wide)
        body += [f"## {effect}\n", "| site | " + " | ".join(wide.columns) + " |",
                 "|---|" + "---:|" * len(wide.columns)]
        for site, row in wide.iterrows():
            body.append(f"| {site} | " + " | ".join(_fmt(v) for v in row) + " |")
        body.append("")
    (args.out / f"{args.name}-results.md").write_text("\n".join(body) + "\n")
    if args.docs is not None:
        start, end = f"<!-- interventions-results:{args.name} -->", f"<!-- /interventions-results:{args.name} -->"
        text = args.docs.read_text()
        if start not in text or end not in text:
            raise SystemExit(f"{args.docs} has no {start} ... {end} block")
        block = "\n".join([start, f"*Generated by `scripts/interventions_results.py --docs` from the runs of "
                           f"`{(args.out / (args.name + '-results.md')).relative_to(ROOT)}`.*", "",
                           *[("###" + line[1:]) if line.startswith("## ") else line for line in body[1:]], end])
        args.docs.write_text(text[:text.index(start)] + block + text[text.index(end) + len(end):])
    print("\n".join(body))
    print(json.dumps({"written": [str(args.out / f"{args.name}-results.{x}") for x in ("md", "csv")]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
