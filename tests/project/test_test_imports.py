"""The tests share fixtures through ``conftest.py`` files and plain helpers through ``tests/support/``: no
test module imports another test module, none imports ``tests.`` by its absolute name, and ruff's F811
(a name defined twice, which importing fixtures would need) applies to the tests too."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports from, relative imports resolved against its package (line, dotted name)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((node.lineno, module))
            if node.module is None:  # from . import name: name may be a module
                found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def test_no_test_module_imports_another_or_tests_by_name():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        source = path.read_text()
        for line, module in imported_modules(path):
            absolute = f"from {module}" in source or f"import {module}" in source
            if module.startswith("tests") and absolute:
                found.append(f"{path.relative_to(ROOT)}:{line}: imports {module} by its absolute name")
            if module.split(".")[-1].startswith("test_") or module.split(".")[-1] == "conftest":
                found.append(f"{path.relative_to(ROOT)}:{line}: imports the test module {module}")
    assert not found, "\n".join(found)


def test_ruff_checks_redefinitions_in_the_tests_too():
    ignores = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["per-file-ignores"]
    assert not any("F811" in codes or "F" in codes for codes in ignores.values()), ignores


def test_the_import_reader_resolves_relative_imports():
    assert "tests.support.runs" in [m for _, m in imported_modules(TESTS / "pipeline" / "test_resume.py")]
