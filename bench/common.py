"""What every benchmark in bench/ shares: its command line's common options, the machine it ran on, and
how its results are written (JSON and markdown, with no path of the machine in them)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parser(doc: str, out: str | None = None, *, quick: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's argument parser: ``doc`` (its module docstring) as the help text, ``--out`` (default
    ``bench/OUT``) where it writes its results, and ``--quick`` (with ``quick`` as its help) where it has
    a quick mode."""
    made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        made.add_argument("--out", type=Path, default=HERE / out, help=f"results file [default: bench/{out}]")
    if quick is not None:
        made.add_argument("--quick", action="store_true", help=quick)
    return made


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none): the machine is shared."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def shown(path: str | Path) -> str:
    """``path`` as a results file may name it: relative to the repository where it is inside it, else its
    last two parts under ``<elsewhere>/`` (a scratch folder, say), which do not name the machine."""
    path = Path(path).expanduser().resolve()
    if path.is_relative_to(ROOT):
        return path.relative_to(ROOT).as_posix() or "."
    return "<elsewhere>/" + "/".join(path.parts[-2:])


#: a string that is one absolute path (POSIX), as a results value might hold one
_ABSOLUTE = re.compile(r"^/(?:[\w.~+-]+/)*[\w.~+-]+/?$")


def portable(value):
    """``value`` (a results dict) with every string that is an absolute path replaced by :func:`shown`,
    and the repository's own folder dropped from any other string (commands that name its files)."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [portable(item) for item in value]
    if isinstance(value, str):
        if _ABSOLUTE.match(value):
            return shown(value)
        return value.replace(f"{ROOT}/", "")
    return value


def write_results(out: Path, results: dict, markdown: Callable[[dict], str], *, indent: int = 2,
                  echo: bool = True) -> str:
    """Write ``results`` to ``out`` (JSON, through :func:`portable`) and its ``markdown`` beside it (``.md``);
    print the markdown (``echo``).  Returns the markdown."""
    results = portable(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=indent, default=str) + "\n")
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    if echo:
        print(text)
    return text
