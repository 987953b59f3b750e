"""The figures the README and the docs quote are the committed data's figures, not numbers typed by hand:
the speed table of ``docs/speed.md`` is the "Scaling" section of ``bench/results_e2e.md``, its memory
table and ratio are recomputed here from ``bench/results_e2e_memory.json``, and the README's MiniLM
table from the committed comparison ``reports/all-MiniLM-L6-v2-vs-random/compare.csv``.  (A rerun that
is not carried into the text fails here.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_after(text: str, heading: str) -> list[str]:
    """The lines of the first markdown table after ``heading``."""
    rest = text[text.index(heading):]
    lines = rest.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


SPEED = ROOT / "docs" / "speed.md"


def test_the_speed_table_is_the_results_files_scaling_table():
    readme = SPEED.read_text()
    results = (ROOT / "bench" / "results_e2e.md").read_text()
    in_readme = table_after(readme, "### Whole runs against the model's forward pass")
    in_results = table_after(results, "## Scaling (the table in the README)")
    assert len(in_results) > 2
    assert in_readme == in_results


def test_the_memory_table_is_recomputed_from_the_results_file():
    readme = SPEED.read_text()
    memory = json.loads((ROOT / "bench" / "results_e2e_memory.json").read_text())["memory"]
    load, runs = memory["load_only_peak_rss_mb"], memory["runs"]
    sizes = sorted((key for key in runs if key.isdigit()), key=int)
    smallest, largest = sizes[0], sizes[-1]
    budgeted = next(key for key in runs if "--max-memory" in key)
    budget = re.search(r"--max-memory (\S+)", budgeted).group(1)

    def row(label, peak):
        return f"| {label} | {peak:,.0f} MB | {peak - load:,.0f} MB |"

    expected = [
        "| MiniLM, texts of 512 tokens | peak RSS | above loading the model |",
        "|---|---|---|",
        f"| load the model only | {load:,.0f} MB | |",
        row(f"batch {smallest}", runs[smallest]["peak_rss_mb"]),
        row(f"batch {largest}", runs[largest]["peak_rss_mb"]),
        row(f"batch {largest}, `--max-memory {budget}`", runs[budgeted]["peak_rss_mb"]),
    ]
    assert memory["tokens"] == 512
    assert table_after(readme, "### Memory") == expected
    ratio = runs[largest]["peak_rss_mb"] / runs[smallest]["peak_rss_mb"]
    assert f"Sixteen times the batch costs {ratio:.2f}x the memory" in readme
    assert int(largest) == 16 * int(smallest)


def test_the_readme_minilm_table_is_recomputed_from_the_committed_comparison():
    import pandas as pd

    readme = (ROOT / "README.md").read_text()
    compare = pd.read_csv(ROOT / "reports" / "all-MiniLM-L6-v2-vs-random" / "compare.csv")
    labels = {"pretrained": "pretrained", "random-init": "random init"}
    expected = [
        "| all-MiniLM-L6-v2 | rows | mean | median | p95 | max | rows above 0.1 |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {labels[r['run']]} | {r['rows']:,} | {r['mean']:.3f} | {r['median']:.3f} | {r['p95']:.3f} | "
        f"{r['max']:.3f} | {r['share_above_0.1']:.1%} |"
        for _, r in compare.iterrows()
    ]
    assert table_after(readme, "## What it finds on MiniLM") == expected
    pretrained, random = (compare.set_index("run").loc[name] for name in ("pretrained", "random-init"))
    assert f"{pretrained['share_above_0.1']:.1%} of the pretrained rows deviate by more than 0.1" in readme
    assert f"against {random['share_above_0.1']:.1%} at random init" in readme
    assert (compare["attention_type"] == "self").all() and len(compare) == 2
