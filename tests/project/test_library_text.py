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


#: a control character other than a newline: what ``"\alpha"`` or ``"\theta"`` becomes in a string that is not raw
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".html", ".css", ".js", ".txt", ".json"}


def control_characters_in(paths) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {CONTROL.search(line).group(0)!r}"
            for path in paths for number, line in enumerate(path.read_text().split("\n"), 1) if CONTROL.search(line)]


def test_text_files_hold_no_control_characters():
    """The package's, the tests', the docs' and the benchmarks' text files hold no tab, bell, carriage return
    or other control character: a formula written through a string that is not raw leaves them behind."""
    paths = sorted(path for folder in ("probe", "tests", "docs", "bench", "scripts", "reports")
                   for path in (ROOT / folder).rglob("*") if path.suffix in TEXT_SUFFIXES and path.is_file()
                   and "assets" not in path.parts)
    paths += [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    found = control_characters_in(paths)
    assert not found, "\n".join(found[:20])


def test_the_control_character_check_finds_a_formula_written_without_r(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("it forms $\theta = \\log u + \alpha s$\n")
    found = [each.split(": ", 1)[1] for each in control_characters_in([page])]
    assert found == ["'\\t'"]
