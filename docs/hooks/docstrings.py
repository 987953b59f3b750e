"""Griffe extension: the docstrings' reStructuredText, turned into the Markdown the API reference renders.

probe's docstrings are written for ``help()`` and Sphinx: ``:math:`...``` roles and ``.. math::`` blocks,
``:class:``/``:func:``-style cross-references, ``>>>`` examples and ``::`` literal blocks.  mkdocstrings
renders Markdown, where none of these mean anything.  This extension rewrites each docstring when the
site is built, so the source stays plain reST and the site shows:

- math as LaTeX for ``pymdownx.arithmatex`` (``$...$`` inline, ``$$...$$`` displayed), which KaTeX renders;
- cross-references to probe's objects as autorefs links ``[text][path]`` to the object's canonical path
  (a ``~`` shows the last name only); one that names no object is a warning, so ``mkdocs build --strict``
  fails; builtins and other packages' names stay code;
- ``>>>`` examples and ``::`` literal blocks as fenced code;
- the ``#:`` comment above a module's or class's attribute as its docstring, as Sphinx reads it.

mkdocs.yml loads it through mkdocstrings' ``extensions`` option.  ``python docs/hooks/docstrings.py
MODULE.OBJECT`` prints one object's rewritten docstring.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import logging
import re
import textwrap

import griffe

LOGGER = logging.getLogger("mkdocs.plugins.probe.docstrings")

#: a cross-reference role, with Sphinx's optional ``py:`` domain: ``:class:`~probe.api.Run```
ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|data|attr|exc|obj|const):`([^`]+)`")
#: an inline math role: ``:math:`\lambda^*```
MATH = re.compile(r":math:`([^`]+)`")
#: a displayed-math directive, its first line of LaTeX on the same line
MATH_BLOCK = re.compile(r"^(\s*)\.\. math::\s*(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence(lines: list[str], language: str) -> list[str]:
    body = textwrap.dedent("\n".join(lines)).strip("\n").splitlines()
    return ["", f"```{language}", *body, "```", ""]


def _language(lines: list[str]) -> str:
    """``python`` for a literal block that parses as Python, else ``text``."""
    try:
        ast.parse(textwrap.dedent("\n".join(lines)))
    except SyntaxError:
        return "text"
    return "python"


def blocks(text: str) -> list[tuple[bool, str]]:
    """``text`` cut into pieces, each ``(is_code, markdown)``: the reST block constructs rewritten."""
    lines = text.splitlines()
    pieces: list[tuple[bool, list[str]]] = [(False, [])]

    def add(code: bool, new: list[str]) -> None:
        if pieces[-1][0] == code:
            pieces[-1][1].extend(new)
        else:
            pieces.append((code, list(new)))

    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        math = MATH_BLOCK.match(line)
        if math:  # .. math:: first line, continued by lines indented deeper
            indent, body = _indent(line), [math.group(2)]
            i += 1
            while i < len(lines) and lines[i].strip() and _indent(lines[i]) > indent:
                body.append(lines[i].strip())
                i += 1
            add(True, ["", "$$", *[b for b in body if b], "$$", ""])
            continue
        if stripped.startswith(">>>"):  # a doctest example: to the next blank line
            start = i
            while i < len(lines) and lines[i].strip():
                i += 1
            add(True, _fence(lines[start:i], "pycon"))
            continue
        if stripped.endswith("::") and not stripped.startswith(".."):  # a literal block follows
            indent = _indent(line)
            if stripped != "::":
                add(False, [line[: len(line.rstrip()) - 1]])  # "Layout::" -> "Layout:"
            i += 1
            body: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > indent):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            if body:
                add(True, _fence(body, _language(body)))
            continue
        add(False, [line])
        i += 1
    return [(code, "\n".join(piece)) for code, piece in pieces]


def _find(collection, path: str):
    try:
        return collection[path]
    except (KeyError, ValueError, IndexError, TypeError):
        return None


def _canonical(found) -> str | None:
    try:
        return found.target_path if found.is_alias else found.path
    except griffe.AliasResolutionError:
        return None


def _runtime(path: str) -> str | None:
    """The canonical path of what ``path`` names when imported (a package's lazily exported names)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                value = getattr(value, name)
        except AttributeError:
            return None
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        return f"{module}.{qualname}" if module and qualname else None
    return None


def resolve(obj: griffe.Object, name: str) -> str | None:
    """The canonical path of ``name`` as written in ``obj``'s docstring: an absolute path, or a name
    relative to ``obj`` or one of its parents (members and imports), or a name a package exports lazily."""
    collection = obj.modules_collection
    scopes = [name]
    scope = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        scopes.append(f"{scope.path}.{name}")
        scope = scope.parent
    for path in scopes:
        found = _find(collection, path)
        if found is not None and (canonical := _canonical(found)):
            return canonical
    runtime = _runtime(name)
    if runtime and _find(collection, runtime) is not None:
        return runtime
    return None


def _outside(obj: griffe.Object, name: str) -> bool:
    """Whether ``name`` is a builtin or lies in an importable package other than ``obj``'s."""
    first = name.split(".")[0]
    if first in vars(builtins):
        return True
    if first == obj.package.name:
        return False
    try:
        importlib.import_module(first)
    except ImportError:
        return False
    return True


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def inline(obj: griffe.Object, text: str) -> str:
    """The inline roles of ``text`` as Markdown: math as ``$...$``, cross-references as autorefs links."""

    def math(match: re.Match) -> str:
        return "$" + " ".join(match.group(1).split()) + "$"

    def reference(match: re.Match) -> str:
        role, target = match.group(1), match.group(2).strip()
        title = None
        explicit = re.fullmatch(r"(.*?)\s*<(.+)>", target, re.S)
        if explicit:
            title, target = explicit.group(1), explicit.group(2)
        if target.startswith("!"):  # Sphinx's "no link"
            return f"`{target[1:]}`"
        short = target.startswith("~")
        target = target.lstrip("~.")
        path = resolve(obj, target)
        shown = title or (target.rsplit(".", 1)[-1] if short else target)
        if path is None:
            if not _outside(obj, target):  # not a builtin or another package's name: a broken reference
                LOGGER.warning(f"{obj.path}: the docstring's :{role}:`{match.group(2)}` names no object probe has")
            return f"`{shown}`"
        if path.split(".")[0] != obj.package.name or _private(path):
            return f"`{shown}`"  # imported from another package, or a private helper the reference omits
        return f"[`{shown}`][{path}]"

    return ROLE.sub(reference, MATH.sub(math, text))


def markdown(obj: griffe.Object, text: str) -> str:
    """``obj``'s docstring ``text`` rewritten: reST blocks, then inline roles outside code."""
    return "\n".join(piece if code else inline(obj, piece) for code, piece in blocks(text)).strip("\n")


def _comment_docstring(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above an attribute (Sphinx's attribute docstrings), as text."""
    try:
        lines = obj.lines_collection[obj.filepath]
    except (KeyError, TypeError):
        return None
    found, i = [], (obj.lineno or 0) - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        found.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return "\n".join(found) or None


class ReSTToMarkdown(griffe.Extension):
    """Rewrites every docstring of a package once it is loaded (names resolve across its modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        seen: set[int] = set()

        def visit(obj) -> None:
            if id(obj) in seen or obj.is_alias:
                return
            seen.add(id(obj))
            if obj.is_attribute and obj.docstring is None:
                comment = _comment_docstring(obj)
                if comment:
                    obj.docstring = griffe.Docstring(comment, parent=obj)
            if obj.docstring is not None:
                obj.docstring.value = markdown(obj, obj.docstring.value)
            for member in obj.members.values():
                visit(member)

        visit(pkg)


if __name__ == "__main__":  # pragma: no cover - a look at one docstring
    import sys

    path = sys.argv[1]
    package = griffe.load(path.split(".")[0], extensions=griffe.load_extensions(ReSTToMarkdown))
    print(package.modules_collection[path].docstring.value)
