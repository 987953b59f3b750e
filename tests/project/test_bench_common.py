"""bench/common.py: the benchmarks' shared command line and results writer, which keeps this machine's
paths out of committed results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import common  # noqa: E402


def test_results_name_no_path_of_the_machine(tmp_path):
    results = {"run": str(tmp_path / "scale-real"), "inside": str(ROOT / "bench" / "results_scale.json"),
               "command": f"python {ROOT}/bench/scale.py --figure", "nested": [{"dir": "/var/lib/x/y"}],
               "text": "not a path: 3/4 of the rows", "number": 1.5}
    out = tmp_path / "results_x.json"
    text = common.write_results(out, results, lambda r: f"# x\n\n{r['run']}\n", echo=False)
    written = json.loads(out.read_text())
    assert written["run"] == f"<elsewhere>/{tmp_path.name}/scale-real"
    assert written["inside"] == "bench/results_scale.json"
    assert written["command"] == "python bench/scale.py --figure"
    assert written["nested"] == [{"dir": "<elsewhere>/x/y"}]
    assert written["text"] == results["text"] and written["number"] == 1.5
    assert out.with_suffix(".md").read_text() == text == f"# x\n\n<elsewhere>/{tmp_path.name}/scale-real\n"
    assert str(tmp_path) not in out.read_text() and str(ROOT) not in out.read_text()


def test_the_parser_has_out_and_quick_where_asked():
    args = common.parser("doc", "results_y.json", quick="small").parse_args(["--quick"])
    assert args.quick and args.out == ROOT / "bench" / "results_y.json"
    assert not hasattr(common.parser("doc").parse_args([]), "out")
