"""probe's comments and docstrings speak of the code as it is: no pointer to the repository's bench/ files
(which a wheel does not ship), no story of what the code or its runs were; runs of earlier formats are
spoken of by their ``format_version``.  Tests are named after what they test, never after an issue."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "probe"

#: what a comment or docstring must not say (case-insensitive)
HISTORY = re.compile(
    r"bench/|older (?:probe|version|run)s?\b|\bold runs?\b|oldest runs|written before|made before|"
    r"used to be|what used to|\bas before\b|before (?:it|they|this|that|records|names) (?:existed|were recorded)|"
    r"\bissue \d+|\(issue",
    re.IGNORECASE,
)


def library_text(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings (every string statement) of a module, with their first lines."""
    source = path.read_text()
    found = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.append((node.lineno, node.value.value))
    return sorted(found)


def history_in(paths) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}: {HISTORY.search(text).group(0)!r}"
            for path in paths for line, text in library_text(path) if HISTORY.search(text)]


def test_library_text_tells_no_history():
    found = history_in(sorted(PACKAGE.rglob("*.py")))
    assert not found, "\n".join(found)



def test_tests_are_named_after_what_they_test():
    """No test module's text names an issue number: a test says what it shows."""
    found = history_in(sorted((ROOT / "tests").rglob("*.py")))
    issue = [finding for finding in found if "issue" in finding.lower()]
    assert not issue, "\n".join(issue)


def test_the_pattern_finds_history(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Parts written before that hold one row group."""\n'
                      "x = 1  # what used to be here (bench/NOTES.md)\n"
                      "def f():\n    '''A run of format version 1 may lack it.'''\n")
    assert [finding.split(": ", 1)[1] for finding in history_in_file(module)] == ["'written before'", "'what used to'"]


def history_in_file(path: Path) -> list[str]:
    return [f"{line}: {HISTORY.search(text).group(0)!r}" for line, text in library_text(path) if HISTORY.search(text)]
