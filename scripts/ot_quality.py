"""How good is the OT approximation?  The OT analogue of probe's headline number, over a grid of alpha and gamma.

For each (alpha, gamma): ``rel_deviation = ||lambda* - alpha z|| / ||lambda*||`` and the total variation
``TV = 1/2 ||p* - p_22||_1`` between the exact OT posterior (``probe.solve.ot.ot_posterior``, certified) and the
OT attention (eq. 22, ``probe.solve.ot.ot_attention``), summarised by median, 10th and 90th percentile and
mean over the problems, with the fraction of problems certified.

Mode ``random`` (a): problems shaped like the OT-ViT's final layer at test time.  ``--problems``
instances (default 200) per grid cell, the same instances in every cell: n = 50 source templates with
i.i.d. N(0, 1) coordinates in R^d (d = 32, a head of the 256-wide OT-ViT with 8 heads), the candidate set
A = the sources (N = 50), uniform source weights, evidence z ~ N(0, I_d), and the OT-ViT's cost
M(a, b) = -<a, b> + C (C the largest inner product of the instance, so M >= 0; it cancels in eq. 22).

Mode ``model`` (b): the trained OT-ViT's own final-layer problems (its class-token queries, the image's
templates and cost, per head) on ``--images`` test images, at the model's (alpha, gamma) and over the
same grid (the grid rescales alpha and gamma of the model's problems; the model's own point is marked).
It needs ``probe.vit`` (``load_checkpoint``, ``final_layer_problems``) and the test images.

    python scripts/ot_quality.py random                         # reports/ot/quality_random.{csv,json,png}
    python scripts/ot_quality.py model --checkpoint CKPT.pt     # reports/ot/quality_model.{csv,json,png}

Every number in the outputs is computed here; the figure is drawn from the CSV's numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from probe.solve.ot import approximation_quality  # noqa: E402

ALPHAS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GAMMAS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # 8 = sqrt(64), 16 = sqrt(256)
OUT = ROOT / "reports" / "ot"


# ------------------------------------------------------------------------------------------------ problems


def random_problems(count: int, n: int = 50, d: int = 32, seed: int = 0) -> dict:
    """Mode (a)'s instances (module docstring): the OT-ViT's test-time shape with Gaussian templates."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(count, n, d, generator=generator, dtype=torch.float64)
    inner = templates @ templates.transpose(1, 2)  # (count, n, N = n): <t_j, t>
    cost = inner.amax(dim=(-2, -1), keepdim=True) - inner  # M = -<a, b> + C >= 0
    return dict(
        candidates=templates,
        source_weights=torch.full((count, n), 1.0 / n, dtype=torch.float64),
        cost=cost,
        evidence=torch.randn(count, d, generator=generator, dtype=torch.float64),
    )


def _test_images(n: int):
    """The first ``n`` Fashion-MNIST test images, normalised as the OT-ViT was trained on them (the one place
    that reads them)."""
    from probe.vit.data import load_data

    data = load_data("fashion-mnist")
    return data.normalise(data.test_images[:n])


def model_problems(checkpoint: Path, images: int) -> tuple[dict, float, float, dict]:
    """The trained OT-ViT's final-layer problems on ``images`` test images, flattened to one batch, with
    the model's alpha and gamma (the contract of ``probe.vit.final_layer_problems``)."""
    try:
        from probe.vit import final_layer_problems, load_checkpoint
    except ImportError as error:
        raise SystemExit(
            f"mode 'model' needs probe.vit (load_checkpoint, final_layer_problems), which is not importable "
            f"here ({error}); run it from a checkout that has the ViT code."
        ) from None
    model, info = load_checkpoint(checkpoint)
    with torch.no_grad():
        problems = final_layer_problems(model, _test_images(images))
    alpha, gamma = float(problems["alpha"]), float(problems["gamma"])
    flat = flatten_problems(problems)
    return flat, alpha, gamma, dict(info) if isinstance(info, dict) else {"info": str(info)}


def flatten_problems(problems: dict) -> dict:
    """``final_layer_problems``' tensors ``(B, H, ...)`` (any leading dimensions) as one batch of problems."""
    trailing = {"candidates": 2, "source_weights": 1, "cost": 2, "evidence": 1}
    flat = {}
    for name, kept in trailing.items():
        tensor = torch.as_tensor(problems[name]).detach().to(torch.float64)
        flat[name] = tensor.reshape(-1, *tensor.shape[tensor.dim() - kept:])
    # A cost M = -<a, b> + C whose C was computed in float32 can dip a rounding below 0.  Adding a constant
    # to a problem's cost changes nothing (every plan has mass 1, so W_gamma shifts by it; the softmaxes of
    # u~, p* and eq. 22 do not see it), so such problems are shifted to min M = 0 instead of refused.
    cost = flat["cost"]
    finite = torch.where(torch.isfinite(cost), cost, torch.inf)
    low = finite.amin(dim=(-2, -1), keepdim=True).clamp(max=0.0)
    flat["cost"] = cost - torch.where(torch.isfinite(low), low, 0.0)
    return flat


# ------------------------------------------------------------------------------------------------- the grid


def summarise(values: torch.Tensor) -> dict:
    v = values.numpy()
    v = v[np.isfinite(v)]
    return dict(median=float(np.median(v)), p10=float(np.percentile(v, 10)), p90=float(np.percentile(v, 90)),
                mean=float(v.mean()), max=float(v.max()))


def grid(problems: dict, alphas, gammas) -> list[dict]:
    """One row per (alpha, gamma): the summaries of rel_deviation and TV, and the fraction certified."""
    rows = []
    for alpha in alphas:
        for gamma in gammas:
            start = time.perf_counter()
            quality = approximation_quality(**problems, alpha=alpha, gamma=gamma)
            certified = quality.solution.converged
            row = dict(alpha=alpha, gamma=gamma, problems=int(certified.numel()),
                       certified_fraction=float(certified.double().mean()),
                       seconds=round(time.perf_counter() - start, 3))
            # statistics over the certified problems only (flagged ones are counted, not used), and the
            # largest certified error of each quantity (values below it are not resolved)
            for name, values, errors in (("rel_deviation", quality.rel_deviation, quality.rel_deviation_error),
                                         ("tv", quality.total_variation, quality.total_variation_error)):
                for stat, value in summarise(values[certified]).items():
                    row[f"{name}_{stat}"] = value
                row[f"{name}_error_max"] = float(errors[certified].max())
            rows.append(row)
            print(f"alpha={alpha:g} gamma={gamma:g}: rel_deviation median {row['rel_deviation_median']:.4f}, "
                  f"TV median {row['tv_median']:.4f}, certified {row['certified_fraction']:.3f}", flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- the figure


def draw(rows: list[dict], path: Path, title: str, marks=((1.0, 8.0), (1.0, 16.0))) -> None:
    """Two heatmaps (median rel_deviation, median TV) over alpha x gamma, the cells ``marks`` outlined."""
    import matplotlib as mpl
    import seaborn as sns
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    alphas = sorted({r["alpha"] for r in rows})
    gammas = sorted({r["gamma"] for r in rows})
    with sns.axes_style("white"), sns.plotting_context("paper", font_scale=1.15), mpl.rc_context(
        {"pdf.fonttype": 42, "ps.fonttype": 42}
    ):
        figure = Figure(figsize=(11.5, 5.0), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, 2)
        panels = (("rel_deviation_median", r"median $\|\lambda^* - \alpha z\| / \|\lambda^*\|$"),
                  ("tv_median", r"median TV$(p^*, p_{\mathrm{eq.\,22}})$"))
        for ax, (column, label) in zip(axes, panels):
            table = np.array([[next(r[column] for r in rows if r["alpha"] == a and r["gamma"] == g)
                               for g in gammas] for a in alphas])
            floor = 1e-4  # colours below it (down to exact 0) share the darkest shade; the numbers are exact
            norm = mpl.colors.LogNorm(vmin=floor, vmax=max(float(table.max()), 10 * floor))
            errors = np.array([[next(r[column.replace("_median", "_error_max")] for r in rows
                                     if r["alpha"] == a and r["gamma"] == g) for g in gammas] for a in alphas])
            # a median below its certified error is not resolved: shown as "<" the error
            labels = np.where(table > errors, np.vectorize(lambda x: f"{x:.2g}")(table),
                              np.vectorize(lambda e: f"<{e:.0e}")(errors))
            sns.heatmap(np.clip(table, floor, None), ax=ax, cmap="viridis", norm=norm, annot=labels, fmt="",
                        annot_kws={"fontsize": 8}, xticklabels=[f"{g:g}" for g in gammas],
                        yticklabels=[f"{a:g}" for a in alphas], cbar_kws={"label": label}, square=True,
                        linewidths=0.4, linecolor="white")
            ax.invert_yaxis()
            ax.set_xlabel(r"entropic regularisation $\gamma$")
            ax.set_ylabel(r"strength $\alpha$")
            ax.set_title(label)
            for a, g in marks:
                if a in alphas and g in gammas:
                    ax.add_patch(Rectangle((gammas.index(g), alphas.index(a)), 1, 1, fill=False,
                                           edgecolor="#d62728", linewidth=2.2))
        import textwrap

        figure.suptitle("\n".join(textwrap.wrap(title, 120)))
        figure.savefig(path, dpi=150)


def summary_markdown(rows: list[dict], meta: dict, marks) -> str:
    """The rows at the marked alphas (the experiment's setting), every gamma, as a Markdown table."""
    alphas = sorted({a for a, _ in marks})
    lines = [
        f"# OT approximation quality ({meta['mode']}), from scripts/ot_quality.py",
        "",
        "Statistics over the certified problems of each cell; `certified` is their fraction. Full grid: the "
        "CSV/JSON beside this file.",
        "",
        "| alpha | gamma | problems | certified | rel. deviation median [p10, p90] | TV median [p10, p90] |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["alpha"] in alphas:
            lines.append(
                f"| {r['alpha']:g} | {r['gamma']:g} | {r['problems']} | {r['certified_fraction']:.3f} | "
                f"{r['rel_deviation_median']:.3g} [{r['rel_deviation_p10']:.3g}, {r['rel_deviation_p90']:.3g}] | "
                f"{r['tv_median']:.3g} [{r['tv_p10']:.3g}, {r['tv_p90']:.3g}] |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------ main


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(float(x) for x in text.split(","))
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["random", "model"])
    parser.add_argument("--problems", type=int, default=200, help="random mode: instances per grid cell")
    parser.add_argument("--checkpoint", type=Path, help="model mode: the OT-ViT checkpoint")
    parser.add_argument("--images", type=int, default=256, help="model mode: test images")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--alphas", type=_floats, default=ALPHAS, help="comma-separated grid of alpha")
    parser.add_argument("--gammas", type=_floats, default=GAMMAS, help="comma-separated grid of gamma")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    marks = ((1.0, 8.0), (1.0, 16.0))
    if args.mode == "random":
        problems = random_problems(args.problems)
        meta = dict(mode="random", distribution=__doc__.split("\n\n")[2].replace("\n", " "),
                    problems_per_cell=args.problems, n=50, N=50, d=32, seed=0)
        title = (f"OT attention (eq. 22) against the exact OT posterior: {args.problems} random problems per cell "
                 "(n = N = 50, d = 32, Gaussian templates, M = -<a,b> + C); red: alpha = 1, gamma = 8, 16")
        stem = "quality_random"
        alphas, gammas = args.alphas, args.gammas
    else:
        if args.checkpoint is None:
            parser.error("model mode needs --checkpoint")
        problems, alpha, gamma, info = model_problems(args.checkpoint, args.images)
        meta = dict(mode="model", checkpoint=str(args.checkpoint), images=args.images, model_alpha=alpha,
                    model_gamma=gamma, problems=int(problems["evidence"].shape[0]), info=info)
        marks = ((alpha, gamma),)
        alphas = tuple(sorted(set(args.alphas) | {alpha}))
        gammas = tuple(sorted(set(args.gammas) | {gamma}))
        title = (f"OT-ViT final layer, {args.images} test images: eq. 22 against the exact OT posterior; "
                 f"red: the model's alpha = {alpha:g}, gamma = {gamma:g}")
        stem = "quality_model"
    rows = grid(problems, alphas, gammas)
    import pandas as pd

    pd.DataFrame(rows).to_csv(args.out / f"{stem}.csv", index=False)
    (args.out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str) + "\n")
    draw(rows, args.out / f"{stem}.png", title, marks)
    (args.out / f"{stem}.md").write_text(summary_markdown(rows, meta, marks))
    print(f"wrote {args.out / stem}.csv, .json, .png, .md")


if __name__ == "__main__":
    main()
