"""Scale benchmark: valid runs of 10^6, 10^7 and 10^8 rows, and the peak memory and wall time of every
command on each (issue 34).

**The runs.**  The smallest is real: ``probe run`` of all-MiniLM-L6-v2 over ``--texts`` texts of two
sentences each (pairs of the embedded corpus's sentences drawn with a fixed seed: texts no test uses).  Each
larger one is that run's part files replicated ``copies`` times through the real writer
(:func:`probe.store.storage.write_part`) with new example indices (copy c of example e is e + c n, n the real
run's texts) and new batch numbers, each part recorded (bytes, rows, SHA-256) in a manifest whose totals
are folded from the parts' own summaries, as a run folds them.  So they pass the readers' integrity checks
and ``probe verify``'s checksum pass, and their rows have the real run's distribution.  (Their batch plan is
not one the model would make, so ``probe verify`` can re-solve rows of the real run only.)

**The commands**, each in a child process: its peak resident set (GNU time's ``%M``: the command's own
process) and its wall time.

* ``end of run``: what the pipeline does after its last batch: the manifest's totals folded from every
  part's record (:class:`probe.pipeline.runner.PartIndex`, as rank 0 and ``probe resume`` fold them) and written
  (``record_completion``), then the final lines (``probe.cli.print_summary``, which calls
  ``Run.headline()``);
* ``report``, ``compare`` (the run against its twin: a second run directory whose part files are hard links
  to the run's, so two runs are read), ``export`` (to Parquet, in the row key's
  order), ``status``;
* ``verify``: ``probe verify --sample 0`` (every part's SHA-256), and ``verify sample``: reading its seeded
  sample of 64 rows (``probe.pipeline.verify.sample_rows``); on the real run, ``verify re-solve``: ``probe verify``
  with its default sample re-solved from the model;
* ``headline``: ``probe.load(RUN).headline()``.

**The run's own memory** (``--run-texts``, default 300 and 3,000 texts): ``probe run``'s peak resident set
(the run and its final lines; and the run alone, before its final lines), over texts of six sentences cut at
``--max-length 64``, so that (almost) every batch has the same shape at both sizes and the runs differ in
the number of texts only.  A run's working set is set by its largest batches (tokens squared, and the
heap's pages settle over the first few of them): with texts of natural lengths, more texts also bring longer
ones and more batches of the largest shape, which is another variable (bench/NOTES.md).

Results: ``bench/results_scale.json`` and ``.md``, and in ``docs/large-runs.md`` the figure
``docs/images/large-runs-scale.png`` and a table (``--figure`` redraws both from the JSON).  A section not
measured (``--sizes ''`` or ``--run-texts ''``) is kept from the results file.  The runs go under ``--work``
(default: the system's temporary directory; 10^8 rows take about 7 GB, 10^7 about 700 MB, and the export's
sort spills about as much again) and are deleted at the end unless ``--keep``.

    python bench/scale.py                                   # 10^6, 10^7, 10^8 rows; 300 and 3,000 texts
    python bench/scale.py --sizes 1e6,1e7 --run-texts ''    # the two smaller sizes only (the run's memory kept)
    python bench/scale.py --sizes 1e6,1e7 --run-texts '' --keep-sizes   # measure those again, keep 10^8
    python bench/scale.py --figure                          # redraw the figure from the results file
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "bench"
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import common  # noqa: E402

#: the seed of the texts' sentences
TEXTS_SEED = 34
#: what the issue asks of the report at the largest size: peak resident set and wall time
REPORT_TARGET = {"peak_rss_gb": 1.5, "wall_s": 15 * 60}
#: what it asks of ``probe run`` from the fewest to the most texts of --run-texts
RUN_GROWTH_TARGET = 1.15
#: what it asks of the readers over a tenfold step in rows (its 300 to 3,000 texts, 0.9M to 9.3M rows):
#: the peak resident set of each named command grows at most ``peak_ratio``x, the report's time at most
#: ``report_time_ratio``x (checked between the two smallest sizes of --sizes, 10^6 and 10^7 rows)
READER_GROWTH_TARGET = {"commands": ("report", "export", "headline"), "peak_ratio": 1.25, "report_time_ratio": 2.5}
#: when and under what load a section of the results, or one size of it, was measured
DATED = ("measured_at", "load_average_before", "load_average_after")
COMMANDS = ("end of run", "report", "compare", "export", "verify", "verify sample", "status", "headline")
FIGURE = ROOT / "docs" / "images" / "large-runs-scale.png"
DOCS = ROOT / "docs" / "large-runs.md"


def corpus_texts(count: int, sentences: int = 2, seed: int = TEXTS_SEED) -> list[str]:
    """``count`` texts, each ``sentences`` sentences of the embedded corpus drawn at random (with ``seed``)."""
    from probe.capture.data import embedded_corpus

    corpus = embedded_corpus()
    draw = random.Random(seed)
    return [" ".join(draw.choice(corpus) for _ in range(sentences)) for _ in range(count)]


def child_env(budget: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if budget:
        env["PROBE_MEMORY_BUDGET"] = budget
    return env


def measure(command: list[str], env: dict, log: Path) -> dict:
    """Run ``command`` as a child process: its wall seconds and peak resident set; its output goes to ``log``.
    A failure stops the benchmark.

    The peak is GNU time's (``/usr/bin/time``: the command is forked from that small process).  Where it is
    missing, the child's ``ru_maxrss`` from ``os.wait4``, which on Linux also counts this process's resident
    set at the fork (it is kept across ``exec``): an upper bound."""
    timing = log.with_suffix(".time")
    gnu_time = Path("/usr/bin/time")
    wrapped = [str(gnu_time), "-f", "%M", "-o", str(timing), *command] if gnu_time.exists() else command
    with open(log, "w") as out:
        started = time.perf_counter()
        process = subprocess.Popen(wrapped, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed ({process.returncode}):\n{log.read_text()[-4000:]}")
    peak_kb = int(timing.read_text().split()[-1]) if gnu_time.exists() else usage.ru_maxrss
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(peak_kb / 1024, 1)}


def python(code: str, *args) -> list[str]:
    return [sys.executable, "-c", code, *map(str, args)]


def probe_command(*args) -> list[str]:
    return [sys.executable, str(ROOT / "cli.py"), *map(str, args)]


#: ``probe run`` as the command line runs it (api.run, then the final lines), reporting the peak resident set
#: before the final lines too
RUN = """
import json, resource, sys
from probe import api
from probe.cli import print_summary
run = api.run(**json.loads(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print_summary(run.run_dir)
print("BENCH " + json.dumps({"run_dir": str(run.run_dir), "run_peak_rss_mb": before / 1024}))
"""

#: what the pipeline does after a run's last batch (see the module's docstring)
END_OF_RUN = """
import sys, time
from pathlib import Path
from probe.cli import print_summary
from probe.core.config import config_from_json
from probe.pipeline import manifest as pipeline
from probe.store import storage
run_dir = Path(sys.argv[1])
manifest = storage.read_manifest(run_dir)
config = config_from_json(manifest["config"])
index = pipeline.PartIndex(run_dir, config.fidelity_tolerance, storage.part_records(manifest))
index.refresh()
segment = manifest["segments"][-1]
pipeline.record_completion(run_dir, manifest, segment, index, config,
                            time.perf_counter() - segment["timings_s"]["total_s"])
print_summary(run_dir)
"""

VERIFY_SAMPLE = """
import sys
from probe.store import integrity
from probe.pipeline.verify import sample_rows
print(sample_rows(integrity.check_parts(sys.argv[1]), 64, 0).num_rows, "rows sampled")
"""

HEADLINE = """
import sys, probe
print(probe.load(sys.argv[1]).headline())
"""


def run_probe(texts: list[str], work: Path, name: str, model: str | None, max_length: int, env: dict) -> dict:
    """``probe run`` of ``model`` (default: the real all-MiniLM-L6-v2) over ``texts``, measured."""
    data = work / f"{name}.txt"
    data.write_text("\n".join(texts) + "\n", encoding="utf-8")
    settings = {"model": model, "dataset": str(data), "out": str(work / "runs"), "name": name,
                "max_length": max_length, "progress": False}
    log = work / f"{name}.log"
    measured = measure(python(RUN, json.dumps(settings)), env, log)
    (line,) = [line for line in log.read_text().splitlines() if line.startswith("BENCH ")]
    reported = json.loads(line[len("BENCH "):])
    manifest = json.loads((Path(reported["run_dir"]) / "manifest.json").read_text())
    return {**measured, "run_phase_peak_rss_mb": round(reported["run_peak_rss_mb"], 1),
            "texts": len(texts), "rows": manifest["solver"]["rows"], "max_length": max_length,
            "run_dir": reported["run_dir"]}


def replicate(source: Path, copies: int, target: Path) -> Path:
    """A valid run of ``copies`` copies of ``source``'s rows (see the module's docstring), at ``target``."""
    import copy

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from probe.pipeline.manifest import PartIndex
    from probe.store import storage

    manifest = storage.read_manifest(source)
    examples, batches = manifest["dataset"]["n_examples"], manifest["batches_total"]
    (target / storage.PARTS).mkdir(parents=True)
    sources = {batch: (pq.read_table(path), storage.part_record(path))
               for batch, path in storage.part_files(source).items()}
    index = PartIndex(target, manifest["fidelity"]["tolerance"])
    for copy_number in range(copies):
        shift = copy_number * examples
        for batch, (table, record) in sources.items():
            table = table.replace_schema_metadata(None)
            column = table.schema.get_field_index("example")
            table = table.set_column(column, "example", pc.add(table["example"], shift))
            record = {**{key: value for key, value in record.items() if key != "batch"},
                      "examples": [example + shift for example in record["examples"]]}
            number = copy_number * batches + batch
            index.add(number, storage.write_part(target, number, table, record), written=True)
    replicated = copy.deepcopy(manifest)
    replicated["dataset"]["n_examples"] = examples * copies
    replicated["synthetic"] = {"source": str(source), "copies": copies,
                               "note": "the source run's parts replicated with new example indices (bench/scale.py)"}
    for segment in replicated["segments"]:
        index.fold_into(segment)
    replicated.update(batches_total=batches * copies, batches_done=len(index.records), **index.tables(),
                      solver=index.summary.solver(), deviations=index.summary.settings(),
                      fidelity=index.summary.fidelity_summary())
    storage.write_manifest(target, replicated)
    return target


def twin(run_dir: Path, target: Path) -> Path:
    """A second run directory holding ``run_dir``'s manifest and hard links to its part files (no copy)."""
    from probe.store import storage

    if not target.exists():
        (target / storage.PARTS).mkdir(parents=True)
        shutil.copy(run_dir / storage.MANIFEST, target / storage.MANIFEST)
        for path in storage.part_files(run_dir).values():
            os.link(path, target / storage.PARTS / path.name)
    return target


def measure_size(run_dir: Path, work: Path, commands: list[str], env: dict, real: bool) -> dict:
    """Every command of ``commands`` on ``run_dir``."""
    from probe.store import storage

    manifest = storage.read_manifest(run_dir)
    parts = storage.part_files(run_dir)
    on_disk = sum(path.stat().st_size for path in parts.values())
    rows = manifest["solver"]["rows"]
    result = {"rows": rows, "parts": len(parts), "bytes_on_disk": on_disk, "bytes_per_row": round(on_disk / rows, 2),
              "commands": {}}
    label = run_dir.name
    todo = {
        "end of run": lambda: python(END_OF_RUN, run_dir),
        "report": lambda: probe_command("report", run_dir, "--out", work / f"report-{label}"),
        "compare": lambda: probe_command("compare", run_dir, twin(run_dir, work / f"{label}-twin"),
                                         "--out", work / f"compare-{label}"),
        "export": lambda: probe_command("export", run_dir, "--to", work / f"export-{label}.parquet"),
        "verify": lambda: probe_command("verify", run_dir, "--sample", "0"),
        "verify sample": lambda: python(VERIFY_SAMPLE, run_dir),
        "verify re-solve": lambda: probe_command("verify", run_dir),
        "status": lambda: probe_command("status", run_dir),
        "headline": lambda: python(HEADLINE, run_dir),
    }
    for name in [*commands, *(["verify re-solve"] if real and "verify" in commands else [])]:
        log = work / f"{label}-{name.replace(' ', '-')}.log"
        result["commands"][name] = measure(todo[name](), env, log)
        print(f"  {rows:>12,} rows  {name:<16} {result['commands'][name]['peak_rss_mb']:>8,.0f} MB "
              f"{result['commands'][name]['wall_s']:>8,.1f} s", flush=True)
        for leftover in (work / f"export-{label}.parquet", work / f"report-{label}", work / f"compare-{label}",
                         work / f"{label}-twin"):
            if leftover.is_dir():
                shutil.rmtree(leftover)
            elif leftover.exists():
                leftover.unlink()
    return result


def kept_commands(earlier: dict, size: int, commands: dict) -> dict:
    """``commands`` (measured now at ``size`` rows) and, in the order of :data:`COMMANDS`, those the earlier
    scale section measured at that size and these do not, each with the date and load it was measured under."""
    before = next((entry for entry in earlier["sizes"] if entry["target_rows"] == size), None)
    if before is None:
        return commands
    dated = {name: before.get(name, earlier.get(name)) for name in DATED}
    merged = dict(commands)
    for name, got in before["commands"].items():
        if name not in merged:
            merged[name] = {**{k: v for k, v in dated.items() if v is not None}, **got}
    order = {name: i for i, name in enumerate(COMMANDS)}
    return dict(sorted(merged.items(), key=lambda item: order.get(item[0], len(order))))


def parse_sizes(text: str) -> list[int]:
    return [int(float(size)) for size in text.split(",") if size.strip()]


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_scale.json")
    parser.add_argument("--sizes", default="1e6,1e7,1e8", help="row counts, comma separated (the first: the real run)")
    parser.add_argument("--texts", type=int, default=444, help="texts of the real run (444: about 10^6 rows)")
    parser.add_argument("--model", default=None, help="model directory [default: the real all-MiniLM-L6-v2]")
    parser.add_argument("--source", type=Path, default=None,
                        help="a finished run to take as the real run instead of running the model (it is not deleted)")
    parser.add_argument("--commands", default=",".join(COMMANDS), help="which commands to measure")
    parser.add_argument("--run-texts", default="300,3000", help="texts of the runs whose own memory is measured")
    parser.add_argument("--run-sentences", type=int, default=6, help="sentences per text of those runs")
    parser.add_argument("--run-max-length", type=int, default=64)
    parser.add_argument("--budget", default=None, help="PROBE_MEMORY_BUDGET for the readers [default: probe's]")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go [default: a temporary directory]")
    parser.add_argument("--keep", action="store_true", help="keep the runs")
    parser.add_argument("--figure", action="store_true",
                        help="only draw the figure and write the markdown and the docs' table again from --out's results")
    parser.add_argument("--keep-commands", action="store_true",
                        help="keep, at each size measured now, the commands of --out's results that --commands does "
                             "not name (each kept command keeps its date)")
    parser.add_argument("--keep-sizes", action="store_true",
                        help="keep the sizes of --out's results that --sizes does not name (each size is dated)")
    args = parser.parse_args(argv)
    if args.figure:  # the figure, the docs' table and the results (JSON and markdown) again, from the results
        results = common.portable(json.loads(args.out.read_text()))
        common.write_results(args.out, results, markdown, echo=False)
        publish(results)
        return 0

    from common import cpu_model, load_average

    commands = [name.strip() for name in args.commands.split(",") if name.strip()]
    unknown = set(commands) - set(COMMANDS)
    if unknown:
        parser.error(f"unknown commands {sorted(unknown)}: choose from {', '.join(COMMANDS)}")
    env = child_env(args.budget)
    work_parent = args.work or Path(tempfile.gettempdir())
    work_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="probe-scale-", dir=work_parent))
    # a section this call does not measure is kept from the results file it writes
    earlier = json.loads(args.out.read_text()) if args.out.exists() else {}
    results = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
               "targets": {"report": REPORT_TARGET, "run_growth": RUN_GROWTH_TARGET},
               "run_memory": earlier.get("run_memory"), "scale": earlier.get("scale")}
    model = args.model or "all-MiniLM-L6-v2"

    def section(settings: dict) -> dict:
        return {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "load_average_before": load_average(), "settings": {"model": model, **settings}}

    try:
        counts = parse_sizes(args.run_texts)
        if counts:
            memory = section({"sentences": args.run_sentences, "max_length": args.run_max_length,
                              "texts_seed": TEXTS_SEED})
            memory["runs"] = []
            for count in counts:
                print(f"probe run over {count:,} texts of {args.run_sentences} sentences (--max-length "
                      f"{args.run_max_length})", flush=True)
                measured = run_probe(corpus_texts(count, args.run_sentences), work, f"texts{count}", args.model,
                                     args.run_max_length, env)
                shutil.rmtree(measured.pop("run_dir"))
                memory["runs"].append(measured)
                print(f"  {measured['rows']:,} rows: {measured['peak_rss_mb']:,.0f} MB peak "
                      f"({measured['run_phase_peak_rss_mb']:,.0f} MB before the final lines), "
                      f"{measured['wall_s']:,.0f} s")
            memory["load_average_after"] = load_average()
            results["run_memory"] = memory
        sizes = parse_sizes(args.sizes)
        if sizes:
            scale = section({"texts": args.texts, "commands": commands, "texts_seed": TEXTS_SEED,
                             "memory_budget": args.budget or os.environ.get("PROBE_MEMORY_BUDGET") or "default"})
            if args.source is not None:
                source = args.source
                manifest = json.loads((source / "manifest.json").read_text())
                scale["real_run"] = {"texts": manifest["dataset"]["n_examples"], "rows": manifest["solver"]["rows"],
                                     "given": common.shown(source)}
            else:
                print(f"the real run: {args.texts:,} texts", flush=True)
                real = run_probe(corpus_texts(args.texts), work, "scale", args.model, 128, env)
                source = Path(real.pop("run_dir"))
                scale["real_run"] = real
            scale["sizes"] = []
            for size in sizes:
                copies = max(1, round(size / scale["real_run"]["rows"]))
                run_dir = source if copies == 1 else replicate(source, copies, work / f"scale-x{copies}")
                print(f"{copies} cop{'y' if copies == 1 else 'ies'} of the real run", flush=True)
                dated = {name: value for name, value in section({}).items() if name in DATED}
                measured = measure_size(run_dir, work, commands, env, real=copies == 1)
                if args.keep_commands and earlier.get("scale"):
                    measured["commands"] = kept_commands(earlier["scale"], size, measured["commands"])
                scale["sizes"].append({"target_rows": size, "copies": copies, **dated,
                                       "load_average_after": load_average(), **measured})
                if run_dir != source and not args.keep:
                    shutil.rmtree(run_dir)
            scale["load_average_after"] = load_average()
            if args.keep_sizes and earlier.get("scale"):  # the sizes not measured now, as they were measured
                kept = [{**{name: earlier["scale"][name] for name in DATED}, **size}  # undated: the call's dates
                        for size in earlier["scale"]["sizes"] if size["target_rows"] not in sizes]
                scale["sizes"] = sorted(scale["sizes"] + kept, key=lambda size: size["target_rows"])
            results["scale"] = scale
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["verdicts"] = verdicts(results)
    common.write_results(args.out, results, markdown)
    if args.out.resolve() == (HERE / "results_scale.json").resolve():  # the committed results: the docs follow
        publish(results)
    return 0


def verdicts(results: dict) -> dict:
    """The issue's targets against what was measured."""
    out = {}
    runs = (results["run_memory"] or {}).get("runs", [])
    if len(runs) >= 2:
        first, last = runs[0], runs[-1]
        out["run_growth"] = {
            "texts": [first["texts"], last["texts"]],
            "peak_ratio": round(last["peak_rss_mb"] / first["peak_rss_mb"], 3),
            "run_phase_peak_ratio": round(last["run_phase_peak_rss_mb"] / first["run_phase_peak_rss_mb"], 3),
            "target": RUN_GROWTH_TARGET,
        }
        out["run_growth"]["met"] = out["run_growth"]["peak_ratio"] <= RUN_GROWTH_TARGET
    sizes = (results["scale"] or {}).get("sizes", [])
    reports = [(size["rows"], size["commands"]["report"]) for size in sizes if "report" in size["commands"]]
    if reports:
        rows, largest = max(reports, key=lambda item: item[0])
        out["report_at_largest"] = {
            "rows": rows, **largest, "target": REPORT_TARGET,
            "met": (largest["peak_rss_mb"] <= REPORT_TARGET["peak_rss_gb"] * 1000
                    and largest["wall_s"] <= REPORT_TARGET["wall_s"]),
        }
    if len(sizes) >= 2:
        small, large = sorted(sizes, key=lambda size: size["rows"])[:2]
        names = [name for name in READER_GROWTH_TARGET["commands"]
                 if name in small["commands"] and name in large["commands"]]
        peaks = {name: round(large["commands"][name]["peak_rss_mb"] / small["commands"][name]["peak_rss_mb"], 3)
                 for name in names}
        growth = {"rows": [small["rows"], large["rows"]], "peak_ratios": peaks, "target": READER_GROWTH_TARGET}
        met = all(ratio <= READER_GROWTH_TARGET["peak_ratio"] for ratio in peaks.values())
        if "report" in names:
            growth["report_time_ratio"] = round(large["commands"]["report"]["wall_s"]
                                                / small["commands"]["report"]["wall_s"], 3)
            met = met and growth["report_time_ratio"] <= READER_GROWTH_TARGET["report_time_ratio"]
        out["reader_growth"] = {**growth, "met": met}
    return out


def when(section: dict, minutes: bool = False) -> str:
    """When (the day, or with ``minutes`` the UTC time its measurement began) and under what load a section
    (or one size) was measured."""
    before, after = section.get("load_average_before"), section.get("load_average_after")
    if minutes:
        return (f"measured from {section['measured_at'][:16].replace('T', ' ')} UTC, 1-minute load average "
                f"{before[0] if before else '?'} before and {after[0] if after else '?'} after")
    return (f"measured on {section['measured_at'][:10]}, 1-minute load average {before[0] if before else '?'} before "
            f"and {after[0] if after else '?'} after")


def run_memory_lines(results: dict) -> list[str]:
    """The run's own memory at each --run-texts, as a table, and its growth against the target."""
    memory = results["run_memory"]
    settings = memory["settings"]
    lines = [
        f"`probe run` of {settings['model']} over texts of {settings['sentences']} sentences, `--max-length "
        f"{settings['max_length']}` ({when(memory)}):",
        "",
        "| texts | rows | peak resident set | of which before the final lines | wall time |",
        "|---|---|---|---|---|",
    ]
    for run in memory["runs"]:
        lines.append(f"| {run['texts']:,} | {run['rows']:,} | {run['peak_rss_mb']:,.0f} MB | "
                     f"{run['run_phase_peak_rss_mb']:,.0f} MB | {run['wall_s']:,.0f} s |")
    growth = verdicts(results).get("run_growth")
    if growth:
        lines += ["", against_target(
            f"From {growth['texts'][0]:,} to {growth['texts'][1]:,} texts the peak grows {growth['peak_ratio']:.2f}x "
            f"(the run before its final lines: {growth['run_phase_peak_ratio']:.2f}x)",
            f"at most {growth['target']}x", growth["met"])]
    return lines


def command_lines(results: dict) -> list[str]:
    """Every command's peak resident set and wall time at each size, as a table, and the report's target."""
    scale = results["scale"]
    sizes = scale["sizes"]
    commands = list(dict.fromkeys(name for size in sizes for name in size["commands"]))
    dates = {size.get("measured_at", scale["measured_at"])[:16] for size in sizes}
    measured = (when(scale) if len(dates) == 1 else "; ".join(
        f"{size['rows']:,} rows {when({**scale, **size}, minutes=True)}" for size in sizes))
    lines = [f"Readers' memory budget: {scale['settings']['memory_budget']}; {measured}.", "",
             "| command | " + " | ".join(f"{size['rows']:,} rows" for size in sizes) + " |",
             "|---|" + "---|" * len(sizes),
             "| bytes per row on disk | " + " | ".join(f"{size['bytes_per_row']:.1f}" for size in sizes) + " |"]
    for name in commands:
        cells = []
        for size in sizes:
            got = size["commands"].get(name)
            cells.append("" if got is None else f"{got['peak_rss_mb']:,.0f} MB, {got['wall_s']:,.1f} s"
                         + (" *" if "measured_at" in got else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    earlier: dict[tuple, list[str]] = {}  # (rows, when) -> the commands then
    for size in sizes:
        for name, got in size["commands"].items():
            if "measured_at" in got:
                earlier.setdefault((size["rows"], when(got, minutes=True)), []).append(name)
    if earlier:
        lines += ["", "\\* kept from an earlier measurement of the same run sizes: " + "; ".join(
            f"at {rows:,} rows, {', '.join(names)}, {measured}" for (rows, measured), names in earlier.items()) + "."]
    report = verdicts(results).get("report_at_largest")
    if report:
        target = report["target"]
        lines += ["", against_target(
            f"The report at {report['rows']:,} rows: {report['peak_rss_mb']:,.0f} MB, {report['wall_s']:,.0f} s",
            f"at most {target['peak_rss_gb']} GB and {target['wall_s'] // 60} minutes", report["met"])]
    growth = verdicts(results).get("reader_growth")
    if growth:
        target = growth["target"]
        ratios = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in growth["peak_ratios"].items())
        time_ratio = (f", and the report's time grows {growth['report_time_ratio']:.2f}x"
                      if "report_time_ratio" in growth else "")
        lines += ["", against_target(
            f"From {growth['rows'][0]:,} to {growth['rows'][1]:,} rows the peak resident set grows: {ratios}"
            f"{time_ratio}", f"at most {target['peak_ratio']}x for the memory and {target['report_time_ratio']}x "
            "for the time", growth["met"])]
    return lines


def against_target(measured: str, target: str, met: bool) -> str:
    return f"{measured}; the target is {target}: {'met' if met else '**not met**'}."


def docs_block(results: dict) -> str:
    """What docs/large-runs.md shows of the results, between its ``scale:table`` markers."""
    lines = []
    if results["scale"]:
        lines += ["**Every command** on runs of each size, peak resident set and wall time:", "",
                  *command_lines(results), ""]
    if results["run_memory"]:
        lines += ["**The run's own memory.**", "", *run_memory_lines(results), ""]
    lines.append(f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores shared with other work.")
    return "\n".join(lines)


def fill_markers(path: Path, values: dict) -> None:
    """Replace what stands between ``<!-- NAME -->`` and ``<!-- /NAME -->`` in ``path`` by ``values[NAME]``."""
    import re

    text = path.read_text(encoding="utf-8")
    for name, value in values.items():
        text, found = re.subn(rf"(<!-- {re.escape(name)} -->).*?(<!-- /{re.escape(name)} -->)",
                              lambda match, value=value: f"{match.group(1)}{value}{match.group(2)}", text, flags=re.S)
        if not found:
            raise SystemExit(f"{path} has no <!-- {name} --> marker")
    path.write_text(text, encoding="utf-8")


def markdown(results: dict) -> str:
    lines = [
        "# Scale: memory and time of every command against the number of rows",
        "",
        f"Written by `bench/scale.py` ({results['machine']['cpu']}, {results['machine']['cores']} cores shared with "
        "other work). Peak resident set of each command's own process, and wall time.",
        "",
    ]
    if results["run_memory"]:
        lines += ["## The run's own memory", "", *run_memory_lines(results), ""]
    if results["scale"]:
        real = results["scale"]["real_run"]
        made = (f"`probe run` {real['wall_s']:,.0f} s at {real['peak_rss_mb']:,.0f} MB" if "wall_s" in real
                else f"given: {real['given']}")
        lines += [
            "## Every command against the run's size",
            "",
            f"The smallest run is real ({real['texts']:,} texts of two sentences, {real['rows']:,} rows, {made}); the "
            "larger ones are its parts replicated through the real writer.",
            "",
            *command_lines(results),
            "",
        ]
    return "\n".join(lines)


def publish(results: dict) -> None:
    """The figure and the table of docs/large-runs.md, from the results."""
    if results["scale"]:
        draw_figure(results, FIGURE)
    fill_markers(DOCS, {"scale:table": "\n" + docs_block(results) + "\n"})


def draw_figure(results: dict, path: Path) -> None:
    """Peak resident set and wall time of each command against the rows (log-log), from the results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sizes = results["scale"]["sizes"]
    commands = list(dict.fromkeys(name for size in sizes for name in size["commands"]))
    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name in commands:
        points = [(size["rows"], size["commands"][name]) for size in sizes if name in size["commands"]]
        rows = [row for row, _ in points]
        memory.plot(rows, [got["peak_rss_mb"] / 1000 for _, got in points], marker="o", label=name)
        seconds.plot(rows, [got["wall_s"] for _, got in points], marker="o", label=name)
    memory.axhline(REPORT_TARGET["peak_rss_gb"], color="grey", linestyle="--", linewidth=1, label="the report's target")
    seconds.axhline(REPORT_TARGET["wall_s"], color="grey", linestyle="--", linewidth=1, label="the report's target")
    for axis, label in ((memory, "peak resident set (GB)"), (seconds, "wall time (s)")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("rows in the run")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    seconds.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
