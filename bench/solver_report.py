"""The report of bench/solver.py: its markdown, and the summary table docs/speed.md quotes."""

from __future__ import annotations

import common
from solver_problems import ACCURACY, RTOL


def _fmt_rate(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:,.2f}" if x >= 1 else f"{x:.3f}"



def _fmt_x(x, lower_bound=False):
    s = f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"
    return ("≥ " + s) if lower_bound else s



FAMILY_LABELS = {
    "minilm": "real MiniLM, embedded corpus", "illcond-64": "random, ill-conditioned (κ ≤ 64)",
}



def readme_table(results) -> str:
    """The summary table docs/speed.md quotes: probe's rate and its speedups, per family."""

    def ratio(x):
        return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x < 10 else f"{x:.0f}"

    lines = [
        "| problems | n | probe /s | x CVXPY | x L-BFGS | x gradient ascent, paper's method "
        "| x the same, on probe's reduced form | x gradient ascent, best step, probe's layout |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in results["families"]:
        low, high = min(f["n_keys"]), max(f["n_keys"])
        n = str(low) if low == high else f"{low}–{high}"
        lines.append(
            f"| {FAMILY_LABELS.get(f['family'], 'random')} | {n} | {f['probe_problems_per_s']:,.0f} | "
            f"{ratio(f['speedup_vs_cvxpy'])} ({ratio(f['speedup_vs_cvxpy_single_process'])}) | "
            f"{ratio(f['speedup_vs_lbfgs'])} | {ratio(f['speedup_vs_ascent'])} | "
            f"{ratio(f['speedup_vs_ascent_reduced'])} | {ratio(f['speedup_vs_ascent_best'])} |"
        )
    return "\n".join(lines)



def markdown(results) -> str:
    env = results["environment"]
    cores = env["cores"]
    fams = results["families"]
    lines = [
        f"# Solver benchmark ({env['device']})",
        "",
        common.header(results),
        "",
        f"numpy {env['numpy']}, scipy {env['scipy']}, cvxpy {env['cvxpy']} (Clarabel {env['clarabel']}); float64 "
        "throughout (probe computes its Newton directions in float32; its gradient, line search and certificate "
        "are float64). Each family's `load_average_*` is in the JSON.",
        "",
        f"Every method solves the same problems to the same accuracy: probe to its certificate "
        f"`error_bound <= {RTOL:g} ||lambda||`, gradient ascent to `alpha ||grad D|| <= {RTOL:g} ||lambda||`, "
        f"L-BFGS to the gradient tolerance that certifies the same, CVXPY/Clarabel at 1e-12 tolerances; "
        f"each method's largest |rel_deviation - probe's| is in the second table (required <= {ACCURACY:g}).",
        "",
        "## Problems per second, and probe's speedup (×)",
        "",
        "| family | n | problems | probe /s | Newton its mean/max | converged | max err/‖λ‖ "
        "| CVXPY /s | × CVXPY | L-BFGS /s | × L-BFGS | ascent, reference /s | × ascent, reference "
        "| ascent, grouped /s | × | ascent, best step /s | × |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fams:
        n = ",".join(str(k) for k in r["n_keys"]) if len(r["n_keys"]) <= 3 else f"{r['n_keys'][0]}–{r['n_keys'][-1]}"
        if r.get("ascent_reduced_same_as_ascent"):
            ref_rate = f"{_fmt_rate(r['ascent_problems_per_s'])} ({r['ascent_form']})"
            ref_x = _fmt_x(r["speedup_vs_ascent"], not r["ascent_reached_tolerance"])
        else:
            ref_rate = (f"{_fmt_rate(r['ascent_problems_per_s'])} ({r['ascent_form']}) / "
                        f"{_fmt_rate(r['ascent_reduced_problems_per_s'])} (reduced)")
            ref_x = (f"{_fmt_x(r['speedup_vs_ascent'], not r['ascent_reached_tolerance'])} / "
                     f"{_fmt_x(r['speedup_vs_ascent_reduced'], not r['ascent_reduced_reached_tolerance'])}")
        lines.append(
            f"| {r['family']} | {n} | {r['problems']:,} | **{_fmt_rate(r['probe_problems_per_s'])}** | "
            f"{r['probe_mean_iterations']:.2f}/{r['probe_max_iterations']} | {r['probe_converged_fraction']:.3f} | "
            f"{r['probe_max_relative_error_bound']:.1e} | "
            f"{_fmt_rate(r['cvxpy_problems_per_s'])} ({r['cvxpy_form']}) | **{_fmt_x(r['speedup_vs_cvxpy'])}** | "
            f"{_fmt_rate(r['lbfgs_problems_per_s'])} ({r['lbfgs_form']}) | **{_fmt_x(r['speedup_vs_lbfgs'])}** | "
            f"{ref_rate} | **{ref_x}** | "
            f"{_fmt_rate(r['ascent_grouped_problems_per_s'])} | "
            f"**{_fmt_x(r['speedup_vs_ascent_grouped'], not r['ascent_grouped_reached_tolerance'])}** | "
            f"{_fmt_rate(r['ascent_best_problems_per_s'])} | "
            f"**{_fmt_x(r['speedup_vs_ascent_best'], not r['ascent_best_reached_tolerance'])}** |"
        )
    lines += [
        "",
        f"- **CVXPY, L-BFGS**: `probe.solve.reference.cvxpy_primal` / `lbfgs_dual`, one problem at a time with "
        f"single-threaded BLAS on a random subset, best of a few solves per problem. Their rate is the "
        f"measured single-process rate; the speedup credits them with ideal parallel scaling over the "
        f"{cores} cores (rate × {cores}), since they parallelise perfectly over problems (single-process "
        f"ratios are in the JSON). Every family is timed on the native form (T in R^384; captured problems "
        f"embedded isometrically there) and the reduced form (`templates_from_reduced`, rank+1 columns); "
        f"the faster is shown.",
        "- **ascent, reference**: `probe.solve.reference.gradient_ascent_dual` (the paper's method: step 1/L, "
        "L = 1/α + max‖t_i‖²) batched over a random subset (as large as memory allows, up to 2,048), on the "
        "native and on the reduced explicit form.",
        "- **ascent, grouped**: the same iterates (iteration counts checked equal to the reference's on its "
        "subset) computed on probe's reduced form with the Gram factor shared per group, two `bmm` per "
        "iteration, batched over every problem of the family.",
        "- **ascent, best step**: as grouped, with the optimal safe constant step 2/(μ+L), μ = 1/α, and the exact "
        "global smoothness constant L = 1/α + diam({t_i})²/4.",
        "- `≥` marks a ratio that is only a lower bound because gradient ascent hit its iteration or time cap"
        + (" (none did in this run)." if all(
            r[f"{m}_reached_tolerance"] for r in fams for m in ("ascent", "ascent_reduced", "ascent_grouped", "ascent_best")
        ) else "."),
        "",
        "## Accuracy and detail",
        "",
        "| family | max diff CVXPY | L-BFGS | ascent ref. | ascent grouped | ascent best | CVXPY subset (d) "
        "| L-BFGS subset | ascent ref. subset, its mean/max | grouped its mean/max | best step its mean/max "
        "| probe /s 1 thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fams:
        cvx_d = "/".join(f"{f['d']}" for f in r["cvxpy_forms"].values())
        lines.append(
            f"| {r['family']} | {r['cvxpy_max_abs_diff_rel_deviation']:.1e} | "
            f"{r['lbfgs_max_abs_diff_rel_deviation']:.1e} | "
            f"{max(r['ascent_max_abs_diff_rel_deviation'], r['ascent_reduced_max_abs_diff_rel_deviation']):.1e} | "
            f"{r['ascent_grouped_max_abs_diff_rel_deviation']:.1e} | {r['ascent_best_max_abs_diff_rel_deviation']:.1e} | "
            f"{r['cvxpy_subset']} ({cvx_d}) | {r['lbfgs_subset']} | "
            f"{r['ascent_subset']}, {r['ascent_mean_iterations']:.0f}/{r['ascent_max_iterations']} | "
            f"{r['ascent_grouped_mean_iterations']:.0f}/{r['ascent_grouped_max_iterations']} | "
            f"{r['ascent_best_mean_iterations']:.0f}/{r['ascent_best_max_iterations']} | "
            f"{_fmt_rate(r['probe_problems_per_s_1thread']) if 'probe_problems_per_s_1thread' in r else '–'} |"
        )
    lines += [
        "",
        "## Targets (CPU): ≥ 10,000× CVXPY and ≥ 20× batched gradient ascent, at equal accuracy",
        "",
    ]

    def ok(x, t):
        return "met" if x >= t else "**NOT met**"

    for r in fams:
        acc = all(
            r[f"{m}_max_abs_diff_rel_deviation"] <= ACCURACY
            for m in ("cvxpy", "lbfgs", "ascent", "ascent_reduced", "ascent_grouped", "ascent_best")
        )
        ref = f"{r['ascent_form']} form {ok(r['speedup_vs_ascent'], 20)} ({_fmt_x(r['speedup_vs_ascent'])}×)"
        if not r.get("ascent_reduced_same_as_ascent"):
            ref += f", reduced form {ok(r['speedup_vs_ascent_reduced'], 20)} ({_fmt_x(r['speedup_vs_ascent_reduced'])}×)"
        lines.append(
            f"- **{r['family']}**: 10,000× CVXPY {ok(r['speedup_vs_cvxpy'], 1e4)} ({_fmt_x(r['speedup_vs_cvxpy'])}×; "
            f"{_fmt_x(r['speedup_vs_cvxpy_single_process'])}× against one CVXPY process). "
            f"20× gradient ascent: reference implementation on the {ref}; same iterates, grouped {ok(r['speedup_vs_ascent_grouped'], 20)} "
            f"({_fmt_x(r['speedup_vs_ascent_grouped'])}×); best safe step {ok(r['speedup_vs_ascent_best'], 20)} "
            f"({_fmt_x(r['speedup_vs_ascent_best'])}×). Equal accuracy {'verified' if acc else '**NOT verified**'}."
        )
    return "\n".join(lines) + "\n"
