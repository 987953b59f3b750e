"""The child processes of bench/scale.py: a real run, its parts replicated to larger sizes, and each command
measured in a process of its own (wall time and peak resident set)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the seed of the texts' sentences
TEXTS_SEED = 34



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
from probe.cli import _print_summary
run = api.run(**json.loads(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_print_summary(run.run_dir)
print("BENCH " + json.dumps({"run_dir": str(run.run_dir), "run_peak_rss_mb": before / 1024}))
"""



#: what the pipeline does after a run's last batch (see the module's docstring)
END_OF_RUN = """
import sys, time
from pathlib import Path
from probe.cli import _print_summary
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
_print_summary(run_dir)
"""



VERIFY_SAMPLE = """
import sys
from probe.store import integrity
from probe.pipeline.verify import _sample_rows
print(_sample_rows(integrity.check_parts(sys.argv[1]), 64, 0).num_rows, "rows sampled")
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
