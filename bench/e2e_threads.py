"""Thread settings: the plain forward and the analysis of runs over the embedded corpus and at 128 tokens
under OpenMP's default wait policy, a short spin, the passive policy (probe's default) and one thread, alone
and beside a busy neighbour process (one spinning core); each run a child process of its own, since the
OpenMP settings take effect only when torch starts.  The analysis's CPU seconds show what spinning threads
take from the machine.

    python bench/e2e_threads.py           # bench/results_e2e_threads.{json,md} (about 20 min)
    python bench/e2e_threads.py --quick   # a few texts, alone, once (a minute)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runs  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import common  # noqa: E402

child_main = runs.configuration_child


#: thread settings compared: (label, environment, --threads)
#: (GNU OpenMP, which torch's Linux wheels use, spins an idle thread GOMP_SPINCOUNT times before it sleeps:
#: 300,000 by default, 0 under PASSIVE)
THREAD_SETTINGS = (
    ("2 threads, OpenMP default wait policy", {"OMP_WAIT_POLICY": None}, 2),
    ("2 threads, short spin (GOMP_SPINCOUNT=10000)", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}, 2),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE (probe's default)", {"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    ("1 thread", {"OMP_WAIT_POLICY": "PASSIVE"}, 1),
)


NEIGHBOURS = ("alone", "beside a busy core")
#: where the thread settings are compared (-> texts): the embedded corpus's short texts (many small
#: operations; all of it) and 128 tokens (the solver's larger tiles)
THREAD_LENGTHS = {"corpus": None, 128: 16}


def threads(model_path: str, lengths: dict, repeats: int, workdir: Path, neighbours=NEIGHBOURS) -> dict:
    """Forward and analysis seconds (and the analysis's CPU seconds) of runs over ``lengths`` (token count,
    or ``"corpus"``, -> number of texts; ``None``: the whole corpus) under each of :data:`THREAD_SETTINGS`,
    alone and beside a busy neighbour; one child process per run, since the OpenMP settings take
    effect only when torch starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    by_length = {}
    for length, count in lengths.items():
        base = {"model": model_path, "workdir": str(workdir), "mode": "run", "batch_size": 8, "forward": True}
        if length == "corpus":
            base.update(length=128, samples=count)
        else:
            texts_file = workdir / f"threads-texts-{length}.json"
            texts_file.write_text(json.dumps(runs.texts_of_length(tokenizer, length, count)))
            base.update(length=length, texts_file=str(texts_file))
        measured = {label: {where: [] for where in neighbours} for label, _, _ in THREAD_SETTINGS}
        for _ in range(repeats):
            for neighbour in neighbours:
                busy = None
                if neighbour != "alone":
                    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    for label, env, count_threads in THREAD_SETTINGS:
                        environment = {k: v for k, v in os.environ.items() if k not in runs.THREAD_VARIABLES}
                        environment.update({k: v for k, v in env.items() if v is not None})
                        child = runs.run_child("e2e_threads", {**base, "threads": count_threads}, environment)
                        measured[label][neighbour].append({
                            "forward_s": child["forward_s"], "analysis_s": child["seconds"], "cpu_s": child["cpu_s"],
                            "environment": child["environment"],
                        })
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
        medians = {
            label: {
                where: {key: statistics.median(run[key] for run in runs) for key in ("forward_s", "analysis_s", "cpu_s")}
                for where, runs in by.items()
            }
            for label, by in measured.items()
        }
        for label, by in medians.items():
            print(f"threads, {length}: {label}: " + ", ".join(
                f"{where} forward {m['forward_s']:.2f}s analysis {m['analysis_s']:.2f}s" for where, m in by.items()
            ), flush=True)
        texts = len(runs.corpus()) if count is None else count
        by_length[str(length)] = {"texts": texts, "runs": measured, "median": medians}
    return {"repeats": repeats, "by_length": by_length}


def threads_markdown(thr: dict) -> list[str]:
    """The threads part: per length, forward and analysis seconds under each setting, and the fastest
    forward alone, against which probe's default analysis is also stated."""
    default = next(label for label, _, _ in THREAD_SETTINGS if "probe's default" in label)
    lines = [
        f"## Threads (MiniLM, batches of 8; median of {thr['repeats']}; one child process per run, the plain "
        "forward of the run's batches first, then the run)",
        "",
        "*CPU s*: the analysis's CPU seconds (user + system, all threads): what spinning idle threads take from "
        "the machine shows there.",
    ]
    for length, part in thr["by_length"].items():
        neighbours = list(next(iter(part["median"].values())))
        header = ["setting"] + [f"{what}, {where}" for where in neighbours
                                for what in ("forward s", "analysis s", "CPU s")]
        lines += [
            "",
            f"**{'the embedded corpus' if length == 'corpus' else f'{length} tokens'}** ({part['texts']} texts)",
            "",
            "| " + " | ".join(header) + " |",
            "|---" * len(header) + "|",
        ]
        for label, by in part["median"].items():
            cells = [f"{m['forward_s']:.3f} | {m['analysis_s']:.2f} | {m['cpu_s']:.1f}" for m in by.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        alone = {label: by[neighbours[0]] for label, by in part["median"].items()}
        fastest = min(alone, key=lambda label: alone[label]["forward_s"])
        mine = alone[default]
        lines += [
            "",
            f"{neighbours[0].capitalize()}, the forward is fastest under *{fastest}* ({alone[fastest]['forward_s']:.3f} s). "
            f"probe's default analysis is {mine['analysis_s'] / mine['forward_s']:.1f}x the forward under the same "
            f"setting and {mine['analysis_s'] / alone[fastest]['forward_s']:.1f}x that fastest forward.",
        ]
    return lines


def markdown(results: dict) -> str:
    return "\n".join(["# Thread settings: forward and analysis", "", common.header(results), "",
                      *threads_markdown(results["threads"])]) + "\n"


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_e2e_threads.json", quick="a few texts, alone, once")
    parser.add_argument("--child", default=None, help="(internal) one run in this process")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    env = common.environment()
    with tempfile.TemporaryDirectory(prefix="probe-threads-") as tmp:
        thr = threads(runs.minilm_path(), {"corpus": 4, 16: 2} if args.quick else THREAD_LENGTHS,
                      1 if args.quick else 3, Path(tmp), neighbours=("alone",) if args.quick else NEIGHBOURS)
    common.write_results(args.out, {"environment": env, "threads": thr}, markdown, benchmark="e2e_threads")
    return 0


if __name__ == "__main__":
    runs.entry(main, child_main)
