"""Functions of a readable size, measured with ast: none in probe/ over 100 lines of code (what declares a
function is not counted: its signature, a typer command's option declarations included, and its docstring with
the ``Args:`` of each parameter), and none that returns a tuple of more than 4 values (a dataclass names them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "probe"
MAX_LINES = 100
MAX_TUPLE = 4


def modules(where: str) -> list[Path]:
    """probe's modules of the solver package (``where="solve"``) or of everything else (``"rest"``)."""
    solve = PACKAGE / "solve"
    return sorted(path for path in PACKAGE.rglob("*.py") if (solve in path.parents) == (where == "solve"))


def code_start(function: ast.FunctionDef) -> int:
    """The line of the function's first statement after its docstring (its declaration ends there)."""
    body = function.body
    documented = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    return body[1].lineno if documented and len(body) > 1 else body[0].lineno


def is_typer_command(function: ast.FunctionDef) -> bool:
    """Whether the function declares typer options (``typer.Option(...)``/``typer.Argument(...)`` defaults)."""
    defaults = [*function.args.defaults, *(d for d in function.args.kw_defaults if d is not None)]
    return any(isinstance(default, ast.Call) and isinstance(default.func, ast.Attribute)
               and default.func.attr in ("Option", "Argument") for default in defaults)


def is_autograd_backward(function: ast.FunctionDef, owner: ast.ClassDef | None) -> bool:
    """A ``backward`` of a ``torch.autograd.Function``: torch wants one gradient per input of ``forward``."""
    return (owner is not None and function.name == "backward"
            and any(isinstance(base, ast.Attribute) and base.attr == "Function" for base in owner.bases))


def tuple_size(annotation: ast.expr | None) -> int:
    """The number of values of a ``tuple[...]`` return annotation (0 for anything else)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) \
            and annotation.value.id in ("tuple", "Tuple"):
        inner = annotation.slice
        if isinstance(inner, ast.Tuple) and not any(isinstance(e, ast.Constant) and e.value is Ellipsis
                                                    for e in inner.elts):
            return len(inner.elts)
    return 0


def returned_tuples(function: ast.FunctionDef) -> list[int]:
    """The sizes of the tuple literals the function itself returns (not its nested functions')."""
    sizes, pending = [], list(function.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            sizes.append(len(node.value.elts))
        pending.extend(ast.iter_child_nodes(node))
    return sizes


def findings(path: Path) -> list[str]:
    """``module:line function: what`` for each function of ``path`` too long or returning too many values."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(PACKAGE.parent) if PACKAGE in path.parents else path.name
    found = []

    def visit(node: ast.AST, owner: ast.ClassDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - code_start(child) + 1
                if lines > MAX_LINES:
                    found.append(f"{name}:{child.lineno} {child.name}: {lines} lines")
                if not is_autograd_backward(child, owner):
                    sizes = [tuple_size(child.returns), *returned_tuples(child)]
                    if max(sizes) > MAX_TUPLE:
                        found.append(f"{name}:{child.lineno} {child.name}: returns a tuple of {max(sizes)}")
                visit(child, None)
            else:
                visit(child, child if isinstance(child, ast.ClassDef) else owner)

    visit(tree, None)
    return found


@pytest.mark.parametrize("where", ["rest", "solve"])
def test_functions_are_short_and_return_few_values(where):
    found = [finding for path in modules(where) for finding in findings(path)]
    assert not found, "\n".join(found)


def test_the_measure_finds_what_it_measures(tmp_path):
    """The measure itself: a long function, a long typer command, a long docstring, tuples of 5 (returned or
    annotated) and an autograd backward."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    long_docstring = "\n".join(f"        p{i}: a parameter." for i in range(MAX_LINES))
    options = "\n".join(f"    o{i}: int = typer.Option(1)," for i in range(MAX_LINES))
    source = (
        f"def long():\n{long_body}\n\n"
        f"def command(\n{options}\n):\n    return 1\n\n"
        f'def documented(**p):\n    """Args:\n{long_docstring}\n    """\n    return 1\n\n'
        "def five():\n    def inner():\n        return 1, 2, 3, 4, 5, 6\n    return 1, 2, 3, 4, 5\n\n"
        "def annotated() -> 'tuple[int, int, int, int, int]':\n    return values()\n\n"
        "def four() -> tuple[int, ...]:\n    return 1, 2, 3, 4\n\n"
        "class Exact(torch.autograd.Function):\n    @staticmethod\n    def backward(ctx, g):\n"
        "        return g, None, None, None, None\n"
    )
    module = tmp_path / "measured.py"
    module.write_text(source)
    found = [line.split(" ", 1)[1] for line in findings(module)]
    assert found == [f"long: {MAX_LINES + 1} lines", "five: returns a tuple of 5", "inner: returns a tuple of 6",
                     "annotated: returns a tuple of 5"], found
