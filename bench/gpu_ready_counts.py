"""The counters of bench/gpu_ready.py: host syncs and operators of a call (torch.profiler), per CG step and per
Newton iteration, graph breaks, bytes moved per row, the fixed schedule's share and its flops."""

from __future__ import annotations

from collections import Counter

import torch

#: the rates "what the arithmetic allows" assumes: about an H100's float32 and float64 rates (FLOP/s)
FLOAT32_RATE, FLOAT64_RATE = 60e12, 30e12


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
    from probe.solve import newton_cg, tiles

    inputs = tiles.tile_inputs(problems, 0, 1, 0, problems.logits.shape[1], torch.float64, torch.device("cpu"))
    make = newton_cg.WorkingSet if module is newton_cg else module._WorkingSet
    return make(factor, factor.float(), inputs.logits, inputs.base, inputs.u, inputs.evidence_sqnorm,
                problems.alpha), inputs.active



def cg_step_counts(module, work) -> dict:
    """Operators and syncs per CG step (8 steps less 4, over 4), on the Newton system at y = 0."""
    from probe.solve import fixed

    state = work.initial_state()
    p_low, rhs = state.p.float(), state.gradient.float()
    counts = {}
    for steps in (4, 8):
        if module is fixed:
            tiny = torch.tensor(torch.finfo(torch.float32).tiny)
            run = lambda steps=steps, tiny=tiny: fixed._conjugate_gradient(  # noqa: E731
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
    from probe.solve import fixed

    results, cg_steps = {}, {}
    for iterations in (1, 2):
        if module is fixed:
            run = lambda iterations=iterations: fixed.fixed_newton(  # noqa: E731
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
    schedule than :data:`probe.solve.fixed.CG_STEPS`), and certified."""
    from probe.solve import fixed

    out = fixed.fixed_newton(work.A, work.A_low, work.base, work.u, work.m, work.logits, work.evidence_sqnorm,
                             active.clone(), float(work.alpha), rtol, atol,
                             cg_steps=fixed.CG_STEPS if cg_steps is None else cg_steps)
    gradient_sq, lambda_norm, live = out.state.gradient_sq, out.state.lambda_norm, out.live
    certified = (2 * work.alpha * gradient_sq.sqrt() <= rtol * lambda_norm + atol) & active
    rows = int(active.sum())
    return {"rows": rows, "within_goal": int((active & ~live).sum()) / rows, "certified": int(certified.sum()) / rows}



def schedule_flops(n: int, r: int, cg_steps=None) -> dict:
    """The fixed schedule's matrix-product flops per row (elementwise work not counted), by precision: per CG
    step two products with the group's n x r factor (float32, the direction's), per Newton iteration
    two (A dy for the line search and A^T (u - p) for the gradient, float64), and one at y = 0; and the
    rows per second they allow at :data:`FLOAT32_RATE` and :data:`FLOAT64_RATE`."""
    from probe.solve import fixed

    steps = fixed.CG_STEPS if cg_steps is None else cg_steps
    float32 = 4 * n * r * sum(steps)
    float64 = 4 * n * r * len(steps) + 2 * n * r
    return {"float32": float32, "float64": float64, "total": float32 + float64,
            "rows_per_s_at_the_rates": 1 / (float32 / FLOAT32_RATE + float64 / FLOAT64_RATE)}
