"""``python cli.py ...``: the repository's entry to the command line, which lives in :mod:`probe.cli`
(installed as the ``probe`` command; ``python -m probe`` works too).

Imported as ``probe.cli``, this file is not the package's: Python started in the folder that holds a
clone of the repository named ``probe/``, and that folder shadowed the probe package (a folder without
``__init__.py`` on the path becomes a namespace package).  It says so instead of failing in a circular
import.
"""

if __name__ == "probe.cli":
    from pathlib import Path

    raise ImportError(
        f"'import probe' found the folder {Path(__file__).absolute().parent} (a clone of probe's repository), not "
        "the probe package inside it: Python started in the folder that holds the clone, and a folder named "
        "probe there shadows the package. Start Python inside the clone (cd probe) or in another folder, or "
        "clone into a folder with another name (git clone URL probe-src)."
    )

from probe.cli import app, main

if __name__ == "__main__":
    main()
