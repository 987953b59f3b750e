"""The solver's code at the project's standard, measured on its source: no function over 100 lines, none
returning a tuple of more than 4, no module reaching into another's underscored names, and no library text
that points at bench/ files (which a wheel does not ship) or narrates the past."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SOLVE = Path(__file__).resolve().parents[2] / "probe" / "solve"
SOURCES = sorted(SOLVE.glob("*.py")) + sorted(SOLVE.glob("*.c"))
MODULES = {path.stem for path in SOLVE.glob("*.py")}


def _functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", sorted(SOLVE.glob("*.py")), ids=lambda path: path.name)
def test_functions_are_short_and_return_few_things(path):
    for function in _functions(path):
        length = function.end_lineno - function.lineno + 1
        assert length <= 100, f"{path.name}: {function.name} has {length} lines"
        for node in ast.walk(function):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
                assert len(node.value.elts) <= 4, f"{path.name}:{node.lineno}: {function.name} returns a tuple"


@pytest.mark.parametrize("path", sorted(SOLVE.glob("*.py")), ids=lambda path: path.name)
def test_no_module_uses_another_modules_private_names(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("probe."):
            assert not any(alias.name.startswith("_") and alias.name != "__all__" for alias in node.names), (
                f"{path.name}:{node.lineno} imports a private name from {node.module}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in MODULES:
            assert not node.attr.startswith("_"), f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}"


#: phrases that narrate the code's past rather than say what it does
PAST = re.compile(r"\b(used to|older versions?|as before|before it existed|formerly|no longer needed|was changed)\b",
                  re.IGNORECASE)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.name)
def test_library_text_names_no_bench_file_and_no_past(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        assert "bench/" not in line, f"{path.name}:{number}: {line.strip()}"
        assert not PAST.search(line), f"{path.name}:{number}: {line.strip()}"
