"""``python cli.py ...``: the repository's entry to the command line, which lives in :mod:`probe.cli`
(installed as the ``probe`` command; ``python -m probe`` works too)."""

from probe.cli import app, main

if __name__ == "__main__":
    main()
