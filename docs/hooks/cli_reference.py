"""MkDocs hook: the CLI reference page (``cli.md``), generated from the typer app at every build.

One section per command: what it does, its usage line, and a table of its arguments and options with
their value, default and help, read from the same objects ``probe COMMAND --help`` prints.  So the page
cannot drift from the code.  The page exists only in the built site; nothing is written to docs/.
"""

from __future__ import annotations

import html
import re
from pathlib import Path, PurePath

import typer
from mkdocs.structure.files import File

PAGE = "cli.md"
#: a help text's own statement of its default, at its end: "... [default: train]."
DEFAULT_IN_HELP = re.compile(r"\s*\[default: (.*)\]\.?\s*$", re.S)


def text(value: str) -> str:
    """Help text as Markdown safe in a table cell: backtick spans kept as code, everything else literal
    (``<time>``, ``c*q`` and ``|`` are not markup here)."""
    out = []
    for i, piece in enumerate(re.split(r"`([^`]*)`", value)):
        escaped = html.escape(piece, quote=False).replace("|", "&#124;")
        out.append(f"<code>{escaped}</code>" if i % 2 else escaped.replace("*", "&#42;").replace("_", "&#95;"))
    return "".join(out)


def cell(value: str) -> str:
    return text(" ".join(value.split()))


def default(param) -> str:
    """The default as the table shows it: the help text's own words where it states one, else the value."""
    stated = DEFAULT_IN_HELP.search(param.help or "")
    if stated:
        return cell(stated.group(1))
    if param.required:
        return "required"
    value = param.default
    if getattr(param, "is_flag", False):
        if param.secondary_opts:
            return f"<code>{(param.opts if value else param.secondary_opts)[0]}</code>"
        return "off" if not value else "on"
    if value is None or value == "":
        return ""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if isinstance(value, PurePath):
        value = value.as_posix()
    return f"<code>{html.escape(str(value))}</code>"


#: the table's name for a parameter's Python type
KINDS = {int: "integer", float: "number", str: "text", bool: "flag", Path: "path"}


def kind(param) -> str:
    """The parameter's type: ``flag`` for an on/off switch, else its annotation's (or click's) name."""
    if getattr(param, "is_flag", False):
        return "flag"
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation is not None:
        return KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return getattr(getattr(param, "type", None), "name", "")


def sentence(value: str) -> str:
    value = value.strip()
    return value if not value or value[-1] in ".:;!?)" else value + "."


def row(param) -> str:
    metavar = "" if getattr(param, "is_flag", False) else (param.metavar or param.name.upper()).strip("[]")
    if param.param_type_name == "argument":
        names = f"<code>{html.escape(metavar)}</code>"
    else:
        names = " / ".join(f"<code>{name}</code>" for name in [*param.opts, *param.secondary_opts])
        if metavar:
            names += f" <code>{html.escape(metavar).replace('|', '&#124;')}</code>"
    description = cell(sentence(DEFAULT_IN_HELP.sub("", param.help or "")))
    return f"| {names} | {kind(param)} | {default(param)} | {description} |"


def table(params, kind: str) -> list[str]:
    params = [p for p in params if p.param_type_name == kind and not getattr(p, "hidden", False)]
    if not params:
        return []
    title = "Argument" if kind == "argument" else "Option"
    return ["", f"| {title} | Type | Default | What it does |", "|---|---|---|---|", *map(row, params)]


def commands(group, context):
    """``(path, command, context)`` for every command under ``group``, depth first, in the app's order."""
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if command is None or command.hidden:
            continue
        child = type(context)(command, info_name=name, parent=context)
        yield child.command_path, command, child
        if hasattr(command, "list_commands"):
            yield from commands(command, child)


def anchor(path: str) -> str:
    return path.replace(" ", "-")


def paragraphs(help_text: str) -> list[str]:
    return [text(p.strip()) for p in help_text.replace("\b\n", "").split("\n\n") if p.strip()]


def section(path: str, command, context) -> list[str]:
    lines = [f"## {path}"]  # its anchor: the toc's slug of the path, as anchor() writes it
    for paragraph in paragraphs(command.help or ""):
        lines += ["", paragraph]
    pieces = " ".join(command.collect_usage_pieces(context))
    lines += ["", "```text", f"{path} {pieces}".rstrip(), "```"]
    if hasattr(command, "list_commands"):
        names = [f"[`{sub}`](#{anchor(sub)})" for sub, _, _ in commands(command, context)]
        lines += ["", "Commands: " + ", ".join(names) + "."]
    for kind_ in ("argument", "option"):
        lines += table(command.params, kind_)
    return lines


def render() -> str:
    from probe.cli import app

    group = typer.main.get_command(app)
    context = group.context_class(group, info_name="probe")
    found = list(commands(group, context))
    lines = [
        "# CLI reference",
        "",
        "Generated from the typer app (`probe/cli.py`) when the site is built. Each command also prints "
        "this with `--help`. Every command has a Python twin in `probe.api` ([Python API](api.md)).",
        "",
        *paragraphs(group.help or ""),
        "",
        "| Command | What it does |",
        "|---|---|",
    ]
    for path, command, _ in found:
        summary = (paragraphs(command.help or "") or [""])[0]
        lines.append(f"| [`{path}`](#{anchor(path)}) | {' '.join(summary.split())} |")
    lines += table(group.params, "option")  # the app's own options (--version), if it has any
    for path, command, child in found:
        lines += ["", *section(path, command, child)]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=render()))
    return files
