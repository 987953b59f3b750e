"""User-facing errors.

Everything a user can cause (a bad model id, a missing column, a broken run directory) is raised as a
:class:`ProbeError` whose message says what went wrong and what to do.  The CLI prints the message and
exits with status 2 instead of showing a traceback from deep inside a library.
"""


class ProbeError(Exception):
    """An error caused by the user's input, with a message that says what to do."""


#: exit status of a run stopped by an I/O error (sysexits.h's EX_IOERR)
EXIT_IO_ERROR = 74


class RunIOError(ProbeError):
    """Writing a run failed (a full disk, a read-only, vanished or no longer writable run directory).

    The message says what happened, what is safe and how to continue; the CLI prints it and exits with
    :data:`EXIT_IO_ERROR` (74) instead of 2, so that scripts can tell a failed disk from a bad input.
    """

    exit_code = EXIT_IO_ERROR


#: the prefix of every error probe's commands print (click prints usage errors with the same)
ERROR_PREFIX = "Error: "


def exit_with(error: Exception):
    """Print ``error`` as a command's one paragraph after :data:`ERROR_PREFIX` and leave the command with
    status 2 (bad input, refused), or the error's own ``exit_code`` (74: :class:`RunIOError`).  Shared by
    every typer app of probe (``probe``, ``probe vit``)."""
    import typer

    typer.secho(f"{ERROR_PREFIX}{error}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code=getattr(error, "exit_code", 2))


def first_line(error: BaseException) -> str:
    """An exception's first line, without a final full stop (for one-paragraph messages)."""
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
