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
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "bench"
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from scale_report import (  # noqa: E402
    REPORT_TARGET,
    RUN_GROWTH_TARGET,
    docs_block,  # noqa: E402, F401 (the table of docs/large-runs.md, read from here)
    markdown,
    publish,
    verdicts,
)
from scale_runs import (  # noqa: E402
    END_OF_RUN,
    HEADLINE,
    TEXTS_SEED,
    VERIFY_SAMPLE,
    child_env,
    corpus_texts,
    measure,
    probe_command,
    python,
    replicate,
    run_probe,
    twin,
)

#: when and under what load a section of the results, or one size of it, was measured
DATED = ("measured_at", "load_average_before", "load_average_after")
COMMANDS = ("end of run", "report", "compare", "export", "verify", "verify sample", "status", "headline")


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
        common.write_results(args.out, results, markdown, benchmark="scale", echo=False)
        publish(results)
        return 0

    from common import load_average

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
    results = {"environment": common.environment(),
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
    common.write_results(args.out, results, markdown, benchmark="scale")
    if args.out.resolve() == (HERE / "results_scale.json").resolve():  # the committed results: the docs follow
        publish(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
