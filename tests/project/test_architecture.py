"""The folder tree is the architecture: stages import downwards only, no import circles (imports inside
functions included), a short top level, modules of one idea, and every name the documentation shows
importable."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "probe"

grimp = pytest.importorskip("grimp", reason="needs grimp (pip install import-linter)")


def import_graph():
    """probe's modules and the probe modules each imports, every import statement counted (grimp reads
    imports inside functions and under TYPE_CHECKING too)."""
    graph = grimp.build_graph("probe", include_external_packages=False)
    return {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), and modules that
    import themselves."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = iter(range(10**9))

    def visit(v):
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(edges) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_circle_finder_finds_circles():
    """The check below can fail: a three-module circle, a self-import and a chain without a circle."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles_among_probes_modules():
    found = circles(import_graph())
    assert not found, "import circles (lazy imports count): " + "; ".join(" -> ".join(c) for c in found)


def test_nothing_imports_the_package_root():
    """``probe/__init__.py`` loads the API on first use; a module that imports it for ``__version__``
    would tie every stage to the API (it lives in probe.core.version)."""
    importers = sorted(m for m, imported in import_graph().items() if "probe" in imported and m != "probe")
    assert not importers, importers


def test_at_most_ten_modules_stand_loose_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 10, loose
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    for name in packages:  # each stage says what it does, takes and gives
        doc = importlib.import_module(f"probe.{name}").__doc__
        assert doc and len(doc.strip()) > 80, f"probe.{name} has no docstring worth the name"


def test_no_module_is_over_700_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 700}
    assert not long, long


#: dotted names in the docs that are not Python objects: keys in a part file's Parquet metadata
METADATA_KEYS = {"probe.batch", "probe.damaged"}
DOTTED = re.compile(r"(?<![\w./-])probe(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"^\s*(?:>>> )?from (probe(?:\.\w+)*) import ([\w, ()]+?)\s*(?:#.*)?$", re.M)
IMPORT = re.compile(r"^\s*(?:>>> )?import (probe(?:\.\w+)*)(?: as \w+)?\s*(?:#.*)?$", re.M)


def documented_names() -> dict[str, set[str]]:
    """Every ``probe.x.y`` and ``from probe.x import y`` the README and docs/ show, by where it appears."""
    found: dict[str, set[str]] = {}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        for name in DOTTED.findall(text):
            found.setdefault(name.rstrip("."), set()).add(where)
        for module, names in FROM_IMPORT.findall(text):
            for name in names.replace("(", "").replace(")", "").split(","):
                if name.strip():
                    found.setdefault(f"{module}.{name.strip().split(' as ')[0]}", set()).add(where)
        for module in IMPORT.findall(text):
            found.setdefault(module, set()).add(where)
    return found


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of probe or an attribute reached from one (``probe.run``,
    ``probe.solver.solve_dual``, ``probe.query.RunTable.select``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_the_name_resolver_can_fail():
    assert resolves("probe.solver.solve_dual") and resolves("probe.query.RunTable.select")
    assert not resolves("probe.solver.no_such_name") and not resolves("probe.no_such_module.x")


def test_every_name_the_docs_show_imports():
    names = documented_names()
    assert {"probe.run", "probe.solver.solve_dual", "probe.query.where"} <= set(names)  # the reader reads
    broken = {name: sorted(where) for name, where in names.items()
              if name not in METADATA_KEYS and not resolves(name)}
    assert not broken, broken


@pytest.mark.parametrize("name", [
    "probe.run", "probe.load", "probe.compare", "probe.export", "probe.resume", "probe.Run", "probe.ProbeError",
    "probe.query.where", "probe.query.RunTable", "probe.exact.exact_attention", "probe.ot.ot_posterior",
    "probe.solver.solve_dual", "probe.solver.DualProblems", "probe.pipeline.run", "probe.__version__",
])
def test_public_names_keep_working(name):
    assert resolves(name), name


def test_the_public_paths_are_the_solvers_own_objects():
    """``probe.solver``, ``probe.exact`` and ``probe.ot`` re-export the objects of probe.solve, not copies."""
    from probe import exact, ot, solver
    from probe.solve import dual
    from probe.solve import exact as solve_exact
    from probe.solve import ot as solve_ot

    for public, home in ((solver, dual), (exact, solve_exact), (ot, solve_ot)):
        assert public.__all__ == home.__all__
        for name in home.__all__:
            assert getattr(public, name) is getattr(home, name), name


def test_every_import_of_probe_in_the_repository_resolves():
    """Every ``from probe.x import y`` and ``import probe.x`` in probe/, tests/, bench/ and scripts/, imports
    inside functions included (a benchmark's or a test's import that names a module that moved fails only
    when that code runs, which may be on a GPU machine)."""
    import ast

    broken = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py"),
                        *(ROOT / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "probe":
                names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"] or [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.split(".")[0] == "probe"]
            else:
                continue
            broken += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names if not resolves(name)]
    assert not broken, broken
