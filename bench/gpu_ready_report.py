"""The report of bench/gpu_ready.py: the counters, the fixed schedule's share and the kernel path's time."""

from __future__ import annotations

import common
from gpu_ready_counts import FLOAT32_RATE, FLOAT64_RATE


def markdown(results: dict) -> str:
    lines = [
        "# The solver's torch path, counted for a GPU (`bench/gpu_ready.py`)",
        "",
        common.header(results) + " One example and one layer "
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
              "schedule's share, and the default CPU path (the compiled kernel `probe/solve/newton.c`, all workers) "
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
            from probe.solve import fixed

            lines += ["", f"Other schedules on the same MiniLM batch ({entry['tokens']} tokens): the share of rows "
                      "within their goal and certified after the fixed schedule alone, by its CG steps per Newton "
                      "iteration.", "", "| CG steps | within the goal | certified |", "|---|---:|---:|"]
            mine = ",".join(map(str, fixed.CG_STEPS))
            lines.append(f"| {mine} (probe's) | {entry['fixed_schedule']['within_goal']:.4f} "
                         f"| {entry['fixed_schedule']['certified']:.4f} |")
            for steps, value in entry["other_schedules"].items():
                lines.append(f"| {steps} | {value['within_goal']:.4f} | {value['certified']:.4f} |")
    lines += [
        "",
        "- Graph breaks: `torch._dynamo.explain` of the fixed schedule (`probe.solve.fixed.fixed_newton`, now) and of "
        "the adaptive iterations (`_newton` with its Python loops, before).",
        "- Operators per Newton iteration: two iterations less one, less the second's CG steps at the per-step count "
        "(its line search, state and bookkeeping). Syncs per Newton iteration include its CG steps'.",
        "- Bytes moved per row: the problems' tensors moved from the host to a device, before as `Tensor.to` moves "
        "them (the stride-0 preference expanded to every row), now with it moved as one row per group.",
        "- CPU seconds per call: the torch path on this shared CPU, `workers=0`, before and now alternating, best of "
        "three; it says nothing about a GPU.",
    ]
    return "\n".join(lines) + "\n"


def docs_table(results: dict) -> str:
    """The counters docs/speed.md quotes: per size, the solver before the fixed schedule and now."""
    lines = ["| keys | | host syncs per call | operators per call | per CG step | per Newton iteration, CG steps "
             "apart | graph breaks |", "|---|---|---|---|---|---|---|"]
    labels = {"before": "adaptive iterations alone", "now": "fixed schedule first"}
    for size in results["sizes"]:
        for name, label in labels.items():
            entry = size[name]
            step, newton = entry["cg_step"], entry["newton_iteration"]
            step_text = f"{step['operators']:.0f} operators" + (f", {step['syncs']:.0f} sync" if step["syncs"] else "")
            newton_text = (f"{newton['operators']:.0f} operators"
                           + (f", {newton['syncs']} syncs" if newton["syncs"] else ""))
            breaks = entry.get("graph_breaks", {}).get("graph_breaks", "?")
            lines.append(f"| {size['keys']} | {label} | {entry['syncs_per_call']} | {entry['operators_per_call']:,} | "
                         f"{step_text} | {newton_text} | {breaks} |")
    return "\n".join(lines)
