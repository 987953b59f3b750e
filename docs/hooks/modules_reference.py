"""MkDocs hook: the page ``modules.md``, every module of probe that no other page documents, generated at
every build from the package's files.

The API pages render a few modules whole (``::: probe.api`` and the like); this page renders the rest,
so that every cross-reference in a docstring has a target, a module added later appears without an edit,
and no object is documented twice.  Nothing is written to docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

PAGE = "modules.md"
#: modules that re-export another module's public names under a stable path (``probe.solver`` is
#: ``probe.solve.dual``'s): shown by their docstring only, so that no object is documented twice
PUBLIC_PATHS = {"probe.solver", "probe.exact", "probe.ot"}
#: a page's mkdocstrings directive: ``::: probe.solve.dual``
DIRECTIVE = re.compile(r"^:::\s+(probe[\w.]*)\s*$", re.M)


def modules(root: Path) -> list[str]:
    """Every module of the package under ``root / "probe"``, by dotted name, in file order."""
    names = []
    for path in sorted((root / "probe").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return sorted(names)


def render(root: Path, documented: set[str]) -> str:
    parts = [
        "# All modules\n\n",
        "Every module of probe that the [Python API](api.md) and [solvers and bounds](api-solvers.md) pages "
        "do not show, generated from the docstrings when the site is built. This is the developers' "
        "reference: the layers and how data flows through them are in the package's docstring below.\n",
    ]
    for name in modules(root):
        if name in documented:
            continue
        if name in PUBLIC_PATHS:  # their objects are documented where they live, once
            parts.append(f"\n::: {name}\n    options:\n      members: false\n")
            continue
        # every public object, documented or not: a docstring may refer to any of them
        parts.append(f"\n::: {name}\n    options:\n      show_if_no_docstring: true\n")
    return "".join(parts)


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    documented = set()
    for file in files.documentation_pages():
        if file.src_uri != PAGE and file.abs_src_path:
            documented |= set(DIRECTIVE.findall(Path(file.abs_src_path).read_text()))
    files.append(File.generated(config, PAGE, content=render(root, documented)))
    return files
