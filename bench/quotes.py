"""The bench results the documentation quotes, written into it from the results files.

Each quote stands in a page between ``<!-- NAME -->`` and ``<!-- /NAME -->`` and is rendered from its results
file by the benchmark that wrote it (:data:`QUOTES`), so that a table in the docs is never typed by hand and
never older than its results.  ``tests/project/test_bench_quotes.py`` checks that every quote is what its
results file renders.

    python bench/quotes.py            # write every quote into the docs
    python bench/quotes.py --check    # exit 1 where a quote is not its results file's
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

common.on_path()

SPEED = common.ROOT / "docs" / "speed.md"
KEEP = common.ROOT / "docs" / "keep.md"
LONG = common.ROOT / "docs" / "long-contexts.md"


def _render(module: str, function: str, results: str):
    def render() -> str:
        imported = __import__(module)
        return "\n" + getattr(imported, function)(json.loads((common.HERE / results).read_text())) + "\n"

    return render


#: marker name -> (page, the function that renders it from its results file)
QUOTES = {
    "bench:e2e:scaling": (SPEED, _render("e2e", "scaling_table", "results_e2e.json")),
    "bench:speedup": (SPEED, _render("speedup", "table", "results_speedup.json")),
    "bench:floor": (SPEED, _render("floor", "table", "results_floor.json")),
    "bench:solver": (SPEED, _render("solver_report", "readme_table", "results_cpu_xeon.json")),
    "bench:gpu_ready": (SPEED, _render("gpu_ready_report", "docs_table", "results_gpu_ready.json")),
    "bench:keep": (KEEP, _render("keep", "docs_table", "results_keep.json")),
    "bench:long_context:memory": (LONG, _render("long_context", "memory_table", "results_long_context.json")),
    "bench:long_context:share": (LONG, _render("long_context", "share_table", "results_long_context.json")),
    "bench:speedup:causal": (LONG, _render("speedup", "table", "results_speedup_causal.json")),
    "bench:fast_attention": (LONG, _render("fast_attention", "table", "results_fast_attention.json")),
}


def stale() -> list[str]:
    """The quotes whose text in their page is not what their results file renders."""
    return [name for name, (page, render) in QUOTES.items() if common.marked(page, name) != render()]


def main(argv=None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--check", action="store_true", help="only say which quotes are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for name in found:
            print(f"stale: {name} in {QUOTES[name][0].relative_to(common.ROOT)}")
        return 1 if found else 0
    for name, (page, render) in QUOTES.items():
        common.fill_markers(page, {name: render()})
    print(f"wrote {len(QUOTES)} quotes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
