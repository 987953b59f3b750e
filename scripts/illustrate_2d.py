"""The 2-D illustration (the source paper's Figure 3): exact inference against its attention approximation.

(a) KL: a discrete preference u on five templates in the plane (weights labelled), its mean mu, the
    evidence z (arrow from mu to mu + z), and for several alpha the exact posterior mean T^T p*
    (p* from lambda*, probe.solve.dual.solve_dual, certified) against the attention approximation
    T^T p_att, p_att(t) ∝ u(t) exp(alpha <t, z>) (lambda = alpha z).
(b) OT: the same sources and weights transported onto a wider candidate set A (a 21 x 21 grid),
    cost M(t, t_j) = ||t - t_j||^2, gamma = 0.5: the true preference's mean mu~, and for the same
    alphas the exact posterior mean T^T p* (probe.solve.ot.ot_posterior, certified) against eq. (22)'s
    T^T p_22 (probe.solve.ot.ot_attention, lambda = alpha z).
(c) OT at alpha = 4: the mass of p* and of eq. (22) on the grid.

    python scripts/illustrate_2d.py        # reports/ot/illustration_2d.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from probe.solve.dual import DualProblems, solve_dual  # noqa: E402
from probe.solve.ot import ot_attention, ot_posterior  # noqa: E402

TEMPLATES = np.array([[0.0, 0.0], [2.0, 0.3], [1.0, 1.7], [-1.0, 1.1], [0.5, -1.1]])
WEIGHTS = np.array([0.35, 0.2, 0.15, 0.2, 0.1])
EVIDENCE = np.array([1.6, 1.2])
ALPHAS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
GAMMA = 0.5
GRID = np.linspace(-2.0, 3.0, 21)
MASS_ALPHA = 4.0


def kl_panel_data():
    """Exact and approximate posterior means of the KL problem for each alpha."""
    T, z = torch.tensor(TEMPLATES), torch.tensor(EVIDENCE)
    exact, approx = [], []
    for alpha in ALPHAS:
        solution = solve_dual(DualProblems(gram=(T @ T.T)[None], logits=(T @ z)[None, None],
                                           log_preference=torch.tensor(np.log(WEIGHTS))[None, None],
                                           evidence_sqnorm=(z @ z).reshape(1, 1), alpha=alpha),
                              direction_dtype=torch.float64)
        assert bool(solution.converged.all()), "the KL solve was not certified"
        exact.append(solution.attention[0, 0].numpy() @ TEMPLATES)
        logits = np.log(WEIGHTS) + alpha * TEMPLATES @ EVIDENCE
        p_att = np.exp(logits - logits.max())
        approx.append((p_att / p_att.sum()) @ TEMPLATES)
    return np.array(exact), np.array(approx)


def ot_panel_data():
    """Exact (certified) and eq. (22) posteriors on the grid for each alpha, and the true preference."""
    xx, yy = np.meshgrid(GRID, GRID)
    candidates = np.stack([xx.ravel(), yy.ravel()], axis=1)
    cost = ((TEMPLATES[:, None, :] - candidates[None, :, :]) ** 2).sum(-1)  # (n, N)
    args = [torch.tensor(x) for x in (candidates, WEIGHTS, cost, EVIDENCE)]
    exact, approx = [], []
    u_tilde = None
    for alpha in ALPHAS:
        solution = ot_posterior(*args, alpha, GAMMA)
        assert bool(solution.converged), "the OT solve was not certified"
        u_tilde = solution.u_tilde.numpy()
        exact.append(solution.p.numpy())
        approx.append(ot_attention(*args, alpha, GAMMA).numpy())
    return candidates, u_tilde, np.array(exact), np.array(approx)


def draw(path: Path) -> None:
    import matplotlib as mpl
    import seaborn as sns
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kl_exact, kl_approx = kl_panel_data()
    candidates, u_tilde, ot_exact, ot_approx = ot_panel_data()
    mu = WEIGHTS @ TEMPLATES
    mu_tilde = u_tilde @ candidates
    exact_color, approx_color, data_color = "#1f77b4", "#ff7f0e", "#444444"
    with sns.axes_style("whitegrid"), sns.plotting_context("paper", font_scale=1.15), mpl.rc_context(
        {"pdf.fonttype": 42, "ps.fonttype": 42}
    ):
        figure = Figure(figsize=(16.5, 5.8), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, 3)

        def base(ax, center, center_label):
            ax.scatter(*TEMPLATES.T, s=2200 * WEIGHTS, color=data_color, alpha=0.25, zorder=2,
                       label="templates $t_i$ (area ∝ $u_i$)")
            for (x, y), w in zip(TEMPLATES, WEIGHTS):
                ax.annotate(f"u={w:g}", (x, y), xytext=(0, -24), textcoords="offset points", ha="center",
                            fontsize=9, color=data_color)
            ax.scatter(*center, marker="X", s=140, color="black", zorder=5, label=center_label)
            ax.annotate("", xy=center + EVIDENCE, xytext=center, zorder=4,
                        arrowprops=dict(arrowstyle="-|>", color="#2ca02c", lw=2.2, mutation_scale=18))
            ax.plot([], [], color="#2ca02c", lw=2.2, label="evidence $z$ (from the mean)")
            ax.set_aspect("equal")
            ax.set_xlim(-2.2, 3.25)
            ax.set_ylim(-2.2, 3.25)
            ax.set_xlabel("$x_1$")
            ax.set_ylabel("$x_2$")

        def trajectories(ax, exact_means, approx_means, exact_label, approx_label, labelled=ALPHAS):
            ax.plot(*exact_means.T, "-o", color=exact_color, ms=6, zorder=6, label=exact_label)
            ax.plot(*approx_means.T, "--s", color=approx_color, ms=6, zorder=6, mfc="white", label=approx_label)
            for alpha, e, a in zip(ALPHAS, exact_means, approx_means):  # exact below-right, approximation above-left
                if alpha not in labelled:
                    continue
                ax.annotate(f"{alpha:g}", e, xytext=(7, -9), textcoords="offset points", fontsize=8.5,
                            color=exact_color, ha="left")
                ax.annotate(f"{alpha:g}", a, xytext=(-7, 5), textcoords="offset points", fontsize=8.5,
                            color=approx_color, ha="right")

        ax = axes[0]
        base(ax, mu, r"preference mean $\mu$")
        trajectories(ax, kl_exact, kl_approx, r"exact: $T^\top p^*$ (from $\lambda^*$), labels: $\alpha$",
                     r"attention: $T^\top p$ at $\lambda = \alpha z$", labelled=(0.25, 1.0, 8.0))
        ax.set_title("(a) KL: exact posterior mean vs attention")
        ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95)

        ax = axes[1]
        ax.scatter(*candidates.T, s=3, color="#999999", zorder=1, label="candidates $A$ (21 x 21 grid)")
        base(ax, mu_tilde, r"true preference mean $\tilde\mu$")
        trajectories(ax, ot_exact @ candidates, ot_approx @ candidates, r"exact: $A^\top p^*$ (from $\lambda^*$), labels: $\alpha$",
                     r"OT attention (eq. 22): $\lambda = \alpha z$")
        ax.set_title(f"(b) OT (γ = {GAMMA:g}, M = ‖t − t_j‖²): exact vs eq. 22")
        ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95)

        ax = axes[2]
        k = ALPHAS.index(MASS_ALPHA)
        scale = 1500
        shown = lambda mass: mass > 1e-4  # noqa: E731  (no outline for candidates without visible mass)
        ax.scatter(*candidates[shown(ot_exact[k])].T, s=scale * ot_exact[k][shown(ot_exact[k])], color=exact_color, alpha=0.6, lw=0, zorder=3,
                   label=r"exact $p^*$ (area ∝ mass > 1e-4)")
        ax.scatter(*candidates[shown(ot_approx[k])].T, s=scale * ot_approx[k][shown(ot_approx[k])], facecolors="none", edgecolors=approx_color, lw=1.0,
                   zorder=4, label="eq. 22 (area ∝ mass > 1e-4)")
        ax.scatter(*TEMPLATES.T, marker="+", s=90, color=data_color, zorder=5, label="templates $t_i$")
        tv = 0.5 * np.abs(ot_exact[k] - ot_approx[k]).sum()
        ax.set_aspect("equal")
        ax.set_xlim(-2.2, 3.25)
        ax.set_ylim(-2.2, 3.25)
        ax.set_xlabel("$x_1$")
        ax.set_ylabel("$x_2$")
        ax.set_title(f"(c) OT posterior on the grid at α = {MASS_ALPHA:g} (TV = {tv:.2f})")
        ax.legend(loc="upper left", fontsize=8.5, framealpha=0.95)
        figure.savefig(path, dpi=140)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "ot" / "illustration_2d.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
