"""User-facing errors.

Everything a user can cause (a bad model id, a missing column, a broken run directory) is raised as a
:class:`ProbeError` whose message says what went wrong and what to do.  The CLI prints the message and
exits with status 2 instead of showing a traceback from deep inside a library.
"""


class ProbeError(Exception):
    """An error caused by the user's input, with a message that says what to do."""
