"""MkDocs hook: the CLI reference page (``cli.md``), generated from the typer app at every build.

Each command's ``--help`` as click renders it (the same text ``probe COMMAND --help`` prints), so the
page cannot drift from the code.  The page exists only in the built site; nothing is written to docs/.
"""

from __future__ import annotations

import click
import typer
from mkdocs.structure.files import File

PAGE = "cli.md"


def _help(command: click.Command, path: list[str]) -> str:
    with click.Context(command, info_name=" ".join(path), terminal_width=100, max_content_width=100) as context:
        return command.get_help(context)


def render() -> str:
    from probe.cli import app

    group = typer.main.get_command(app)
    parts = [
        "# CLI reference\n\n",
        "Generated from the typer app (`probe/cli.py`) when the site is built: each command's `--help`. "
        "Every command has a Python twin in `probe.api` ([API reference](api.md)).\n\n",
        "```text\n" + _help(group, ["probe"]) + "\n```\n",
    ]
    with click.Context(group, info_name="probe") as context:
        for name in group.list_commands(context):
            command = group.get_command(context, name)
            parts.append(f"\n## probe {name}\n\n```text\n{_help(command, ['probe', name])}\n```\n")
    return "".join(parts)


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=render()))
    return files
