"""How a message names an option: ``--alpha`` on the command line, ``alpha=`` in Python.

``probe run`` and ``probe.run()`` share their checks (:mod:`probe.pipeline.validate`, :mod:`probe.capture.data`, ...), so
a message names an option through :func:`option`, which spells it as the caller wrote it.  Python's
spelling is the default; the command line switches to its own for the length of a command
(:func:`command_line`, entered by :mod:`probe.cli`).  Nothing here imports anything heavy.
"""

from __future__ import annotations

import contextvars
import shlex
from contextlib import contextmanager

#: True while a ``probe`` command runs (its messages name flags); False for the Python API
_COMMAND_LINE = contextvars.ContextVar("probe_command_line", default=False)

#: Python parameters whose command-line spelling is not ``--`` and the name with dashes
_FLAGS = {"model": "MODEL", "names": "--name"}


def option(name: str, value=None) -> str:
    """The option ``name`` (the Python parameter's name) as the caller writes it, with ``value`` if given,
    quoted as a shell or Python would need it: ``option("max_length", 512)`` is ``--max-length 512`` on the
    command line and ``max_length=512`` in Python; ``option("init", "xavier")`` is ``init='xavier'``."""
    if _COMMAND_LINE.get():
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        return flag if value is None else f"{flag} {shlex.quote(str(value))}"
    if value is None:
        return f"{name}="
    return f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}"


def switch(name: str) -> str:
    """A boolean option turned on: ``--allow-unknown-tokens`` on the command line, ``allow_unknown_tokens=True``
    in Python."""
    return option(name) if _COMMAND_LINE.get() else f"{name}=True"


@contextmanager
def command_line():
    """Messages name command-line flags (``--alpha``) meanwhile."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)
