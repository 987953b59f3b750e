"""The harness every benchmark in bench/ runs on.

* :func:`parser`: the command line's common options (``--out``, ``--quick``, ``--repeats``, ``--render``);
* :func:`environment` and :func:`header`: the machine and settings a result was measured with, recorded in
  every results file and shown as the second paragraph of its markdown;
* :func:`timed` and :func:`alternate`: the ways a benchmark compares, run in turn, repeat after repeat, in
  one process (or one parent), so that the machine's load moves all of them alike;
* :func:`write_results` and :func:`render`: the results in the one format, a JSON object
  ``{"benchmark": NAME, "environment": {...}, ...the benchmark's own keys}`` with its markdown beside it
  (``.md``), with no path of the machine in either.

A benchmark is a module of ``bench/`` with a ``main(argv)`` and a ``markdown(results) -> str``; ``--render
RESULTS.json`` rewrites its markdown from a results file without measuring anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parser(doc: str, out: str | None = None, *, quick: str | None = None, repeats: int | None = None
           ) -> argparse.ArgumentParser:
    """A benchmark's argument parser: ``doc`` (its module docstring) as the help text; ``--out`` (default
    ``bench/OUT``) and ``--render`` where it writes results; ``--quick`` (``quick``: its help) where it has a
    quick mode; ``--repeats`` (default ``repeats``) where it alternates."""
    made = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        made.add_argument("--out", type=Path, default=HERE / out, help=f"results file [default: bench/{out}]")
        made.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                          help="rewrite the markdown of this results file, measuring nothing")
    if quick is not None:
        made.add_argument("--quick", action="store_true", help=quick)
    if repeats is not None:
        made.add_argument("--repeats", type=int, default=repeats, help=f"repeats of each way [default: {repeats}]")
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


def environment(**extra) -> dict:
    """What a measurement ran with: the command, the date, the machine, torch and its threads, the wait
    policy, the solver's Newton iterations (compiled or torch), the load at the start, and ``extra``."""
    import torch

    from probe.solve import native

    found = {
        "command": "python " + " ".join(["bench/" + Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "started": time.time(),
        "machine": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "solver": native.describe("cpu"),
        "load_average": load_average(),
    }
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return {**found, **extra}


def header(results: dict) -> str:
    """The environment paragraph of a results file's markdown: command, date and duration, machine,
    threads and wait policy, the solver's iterations, and the load at the start and the end."""
    env = results.get("environment", {})
    command = env.get("command") or f"python bench/{results.get('benchmark', '?')}.py"
    parts = [f"Command: `{command}`, run {env.get('date', 'on a date not recorded')}"
             + (f" ({env['seconds']:.0f} s)" if env.get("seconds") is not None else "") + "."]
    machine = "Machine: " + ", ".join(str(item) for item in (
        env.get("machine"), f"{env['cores']} cores" if env.get("cores") else None, env.get("gpu")) if item)
    if machine == "Machine: ":
        machine = "Machine: not recorded"
    if env.get("torch"):
        threads = env.get("threads")
        settings = [f"{threads} thread{'' if threads == 1 else 's'}" if threads is not None else None,
                    f"OMP_WAIT_POLICY={env['omp_wait_policy']}" if env.get("omp_wait_policy") else None]
        settings = ", ".join(item for item in settings if item)
        machine += f"; torch {env['torch']}" + (f" ({settings})" if settings else "")
    parts.append(machine + ".")
    if env.get("solver"):
        parts.append(f"The solver's Newton iterations: {env['solver']}.")
    loads = [f"at the start {env['load_average']}" if env.get("load_average") is not None else None,
             f"at the end {env['load_average_end']}" if env.get("load_average_end") is not None else None]
    if any(loads):
        parts.append("Load average " + ", ".join(item for item in loads if item)
                     + " (the machine is shared: compare ratios measured in one run).")
    return " ".join(parts)


def timed(function: Callable[[], object]) -> float:
    """Seconds of wall time ``function()`` takes."""
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def alternate(ways: dict[str, Callable[[], object]], repeats: int, measure: Callable = timed,
              echo: bool = True) -> dict[str, list]:
    """Each of ``ways`` measured ``repeats`` times, in turn (way 1, way 2, ..., way 1, ...): ``{name: [what
    measure(way) gave, per repeat]}`` (seconds by default)."""
    found: dict[str, list] = {name: [] for name in ways}
    for repeat in range(repeats):
        for name, way in ways.items():
            found[name].append(measure(way))
            if echo:
                print(f"  repeat {repeat + 1}/{repeats} {name}: {_short(found[name][-1])}", flush=True)
    return found


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{key} {_short(item)}" for key, item in value.items() if isinstance(item, (int, float)))
    return str(value)


def median(values) -> float:
    return statistics.median(values)


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


def write_results(out: Path, results: dict, markdown: Callable[[dict], str], *, benchmark: str | None = None,
                  indent: int = 2, echo: bool = True) -> str:
    """Write ``results`` to ``out`` in the one format (JSON, through :func:`portable`), with ``benchmark`` (its
    script's name) and its ``environment`` (:func:`environment` at the start, completed here with the load
    at the end and the seconds since), and its ``markdown`` beside it (``.md``); print the markdown
    (``echo``).  Returns the markdown."""
    results = dict(results)
    if benchmark is not None:
        results["benchmark"] = benchmark
    results.setdefault("benchmark", Path(sys.argv[0]).stem)
    env = dict(results.pop("environment", None) or {})
    if "started" in env:
        env["seconds"] = round(time.time() - env.pop("started"), 1)
        env["load_average_end"] = load_average()
    results = {"benchmark": results.pop("benchmark"), "environment": env, **results}
    results = portable(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=indent, default=str) + "\n")
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    if echo:
        print(text)
    return text


def render(path: Path, markdown: Callable[[dict], str]) -> str:
    """Rewrite the markdown beside the results file ``path`` from it (``--render``); returns it."""
    text = markdown(json.loads(Path(path).read_text()))
    Path(path).with_suffix(".md").write_text(text)
    return text


def rendered(args, markdown: Callable[[dict], str]) -> bool:
    """Where ``--render`` was given, rewrite that file's markdown and say so (True): the benchmark then
    measures nothing."""
    if getattr(args, "render", None) is None:
        return False
    render(args.render, markdown)
    print(f"wrote {args.render.with_suffix('.md')}")
    return True


def fill_markers(path: Path, values: dict) -> None:
    """Replace what stands between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in ``path`` by ``values[NAME]``: the
    numbers and tables the documentation quotes from results files."""
    text = path.read_text(encoding="utf-8")
    for name, value in values.items():
        text, found = re.subn(rf"(<!-- {re.escape(name)} -->).*?(<!-- /{re.escape(name)} -->)",
                              lambda match, value=value: f"{match.group(1)}{value}{match.group(2)}", text, flags=re.S)
        if not found:
            raise SystemExit(f"{path} has no <!-- {name} --> marker")
    path.write_text(text, encoding="utf-8")


def marked(path: Path, name: str) -> str | None:
    """What stands between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in ``path`` (None: no such marker)."""
    found = re.search(rf"<!-- {re.escape(name)} -->(.*?)<!-- /{re.escape(name)} -->", path.read_text(encoding="utf-8"),
                      flags=re.S)
    return None if found is None else found.group(1)


def on_path() -> None:
    """Make ``import probe`` find this checkout, and ``import common`` (and the other benchmarks) bench/."""
    for path in (str(HERE), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
