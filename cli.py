"""``python cli.py ...``: the command line, which lives in :mod:`probe.cli` (installed as ``probe``).
Found as ``probe.cli``, this file says that Python started above a clone named ``probe/``, which shadows the
package (a folder without ``__init__.py`` is a namespace package)."""

if __name__ == "probe.cli":
    from pathlib import Path

    raise ImportError(
        f"'import probe' found the folder {Path(__file__).absolute().parent} (a clone of probe's repository), not "
        "the probe package inside it: Python started in the folder that holds the clone, and a folder named "
        "probe there shadows the package. Start Python inside the clone (cd probe) or in another folder, or "
        "clone into a folder with another name (git clone URL probe-src)."
    )
from probe.cli import app, main  # noqa: E402, F401 (app: python -c "from cli import app")

if __name__ == "__main__":
    main()
