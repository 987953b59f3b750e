r"""One text seen at one attention site and head: the model's attention :math:`p_{att}` and the exact posterior
:math:`p^*` of the problem attention defines, as matrices over query × key tokens, and their difference
(``probe show``; the report's section on its worst row).

:math:`p^*_i \propto u_i e^{\langle t_i, \lambda^*\rangle}` is the primal solution at the dual optimum
:math:`\lambda^*` (eq. (D) of :mod:`probe.solve.dual`); the model's attention is the same softmax at
:math:`\lambda = \alpha z`.  Beside each query's row: its relative deviation
:math:`\|\lambda^* - \alpha z\| / \|\lambda^*\|` with the certificate of that number, the bound
:math:`\varepsilon(1 + r)/\|\hat\lambda\|` that the solver's ``error_bound`` :math:`\varepsilon \ge
\|\hat\lambda - \lambda^*\|` gives it (the quotient's perturbation bound, as ``probe verify`` uses it).

A :class:`TextView` holds the numbers; :mod:`probe.pipeline.recompute` computes them from the model files a
run's manifest names, and checks them against the run's stored rows.  Drawing needs no model.
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from probe.core.errors import ProbeError
from probe.report.data import type_label
from probe.report.style import PNG_DPI, Drawn, new_figure, style, wrap

#: the formats a text view is written in, by the file's ending
VIEW_FORMATS = ("png", "pdf")
#: inches per token along each axis of a matrix, and the bounds on a matrix's side
CELL_INCHES, MIN_SIDE, MAX_SIDE = 0.2, 2.6, 9.0
#: tokens longer than this are shortened in the labels
LABEL_CHARS = 12
#: the most tick labels along a matrix's side: a longer text labels every k-th token, with its position
MAX_LABELS = 80


@dataclass
class TextView:
    r"""One text (``example``) at one site (``attention_type``, ``layer``) and ``head``, in one ``space`` and
    ``alpha``: ``q`` query rows over ``k`` key columns, every array in query order.

    Attributes:
        attention: the model's attention, ``(q, k)``: its own eager probabilities, or for a run of its fast
            attention (``rebuilt``), which never formed them, the softmax of probe's logits, whose output the
            fidelity check held to the model's.
        posterior: the exact posterior :math:`p^*` of each query's problem, ``(q, k)``.
        rel_deviation: :math:`\|\hat\lambda - \alpha z\| / \|\hat\lambda\|` recomputed, ``(q,)``.
        error_bound: the certified :math:`\|\hat\lambda - \lambda^*\|` of the recomputed solve, ``(q,)``.
        lambda_norm: :math:`\|\hat\lambda\|`, ``(q,)``.
        stored_rel_deviation: the run's stored value of each query (NaN where the run has no row), ``(q,)``.
        largest_ratio: the largest difference between a recomputed and a stored relative deviation, as a share
            of what their two certificates allow (at most 1: they agree).
    """

    run: str
    model: str
    example: int
    attention_type: str
    layer: int
    head: int
    space: str
    alpha: float
    text: str
    query_tokens: list[str]
    key_tokens: list[str]
    query_positions: list[int]
    attention: np.ndarray
    posterior: np.ndarray
    rel_deviation: np.ndarray
    error_bound: np.ndarray
    lambda_norm: np.ndarray
    stored_rel_deviation: np.ndarray
    largest_ratio: float
    rebuilt: bool = False

    @property
    def certificate(self) -> np.ndarray:
        r"""What each recomputed relative deviation may differ from the exact one: :math:`\varepsilon(1 + r) /
        \|\hat\lambda\|` (:math:`\varepsilon`: the error bound, :math:`r`: the relative deviation)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.error_bound * (1 + self.rel_deviation) / self.lambda_norm

    @property
    def difference(self) -> np.ndarray:
        r""":math:`p^* - p_{att}`, ``(q, k)``."""
        return self.posterior - self.attention

    def figure(self):
        """The view drawn, as a :class:`matplotlib.figure.Figure` (:func:`view_figure`)."""
        with style():
            return view_figure(self).figure

    def save(self, path: str | Path) -> Path:
        """Write the view to ``path``, a .png or a .pdf (:func:`save_view`)."""
        return save_view(self, path)

    def _repr_png_(self) -> bytes:  # a notebook shows the view as its figure
        return view_png(self)

    @property
    def title(self) -> str:
        return (f"{self.run}: text {self.example}, {type_label(self.attention_type)} layer {self.layer} head "
                f"{self.head} · α = {self.alpha:g}, {self.space} space")

    def describe(self) -> str:
        """The figure's caption: what it shows and how the numbers were checked."""
        worst = int(np.nanargmax(self.rel_deviation)) if len(self.rel_deviation) else None
        where = ("" if worst is None else f" The largest relative deviation is at query {self.query_positions[worst]} "
                 f"({self.query_tokens[worst]!r}): {self.rel_deviation[worst]:.3g}.")
        return (
            f"{self.title}. Left: the model's attention (rows: query tokens; columns: key tokens). Middle: the exact "
            "posterior p* of each query's problem. Right: p* minus the attention (red: p* puts more weight there). "
            "Beside each row: the relative deviation ‖λ* − αz‖ / ‖λ*‖ and, after ±, what its certificate allows."
            f"{where} Recomputed from the model's files and checked against the run's stored rows: they agree "
            f"within their certificates (largest difference {100 * self.largest_ratio:.2g}% of what they allow)."
        )


def _label(token: str) -> str:
    token = token.replace("\n", "\\n")
    return token if len(token) <= LABEL_CHARS else token[: LABEL_CHARS - 1] + "…"


def ticks(tokens: list[str], positions: list[int] | None = None) -> tuple[list[int], list[str]]:
    """The ticks along a side of ``tokens``: every token, or for more than :data:`MAX_LABELS` every k-th one,
    labelled with its position (``positions``: each entry's position in its text; default its index)."""
    step = -(-len(tokens) // MAX_LABELS)
    kept = list(range(0, len(tokens), step))
    if step == 1:
        return kept, [_label(tokens[i]) for i in kept]
    return kept, [f"{i if positions is None else positions[i]} {_label(tokens[i])}" for i in kept]


def view_figure(view: TextView) -> Drawn:
    """The view drawn: three matrices on shared token axes (attention and :math:`p^*` on one colour scale from
    0, their difference on a scale symmetric about 0) and the rows' relative deviations with their certificates
    beside the last (call inside :func:`probe.report.style.style`)."""
    q, k = view.attention.shape
    width, height = (float(np.clip(CELL_INCHES * n, MIN_SIDE, MAX_SIDE)) for n in (k, q))
    figure = new_figure(3 * width + 3.6, height + 1.9)
    axes = figure.subplots(1, 3, sharey=True)
    top = float(max(view.attention.max(initial=0.0), view.posterior.max(initial=0.0))) or 1.0
    spread = float(np.abs(view.difference).max(initial=0.0)) or 1.0
    attention = "attention rebuilt from the logits (λ = αz; SDPA)" if view.rebuilt else "the model's attention (λ = αz)"
    panels = ((view.attention, attention, "viridis", 0.0, top),
              (view.posterior, "exact posterior p* (λ = λ*)", "viridis", 0.0, top),
              (view.difference, "p* − attention", "RdBu_r", -spread, spread))
    font = float(np.clip(7.5 - 0.03 * max(q, k), 4.0, 7.5))
    for ax, (matrix, title, cmap, low, high) in zip(axes, panels):
        image = ax.imshow(matrix, cmap=cmap, vmin=low, vmax=high, aspect="auto", interpolation="nearest")
        ax.set_title(title)
        ax.set_xticks(*ticks(view.key_tokens), rotation=90, fontsize=font)
        ax.set_yticks(*ticks(view.query_tokens, view.query_positions), fontsize=font)
        ax.set_xlabel("key token")
        ax.grid(False)
        figure.colorbar(image, ax=ax, shrink=0.8, pad=0.02)
    axes[0].set_ylabel("query token")
    right = axes[2].secondary_yaxis("right")  # each row's number beside it, on the right of the difference
    kept, _ = ticks(view.query_tokens)
    right.set_yticks(kept, [f"{view.rel_deviation[i]:.3g} ± {view.certificate[i]:.0e}" for i in kept], fontsize=font)
    right.set_ylabel("relative deviation ± certificate", fontsize="small")
    figure.suptitle(wrap(view.title, figure.get_figwidth()))
    stem = f"text_{view.example}_{view.attention_type}_layer{view.layer}_head{view.head}"
    return Drawn(stem, view.describe(), figure, view.attention_type, wide=True)


def view_format(path: str | Path, name: str = "out") -> str:
    """The format a view is written in at ``path`` (its ending); refused unless one of :data:`VIEW_FORMATS`."""
    from probe.core.spelling import option

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in VIEW_FORMATS:
        raise ProbeError(f"{option(name, str(path))} ends in {path.suffix or 'no extension'}: a text view is written "
                         "as a .png or a .pdf file (FILE.png, FILE.pdf).")
    return fmt


def save_view(view: TextView, path: str | Path) -> Path:
    """Write the view's figure to ``path``, PNG or PDF by its ending (TrueType fonts in a PDF)."""
    path = Path(path)
    fmt = view_format(path)
    with style():
        drawn = view_figure(view)
        drawn.figure.savefig(path, format=fmt, dpi=PNG_DPI)
    return path


def view_png(view: TextView) -> bytes:
    """The view's figure as PNG bytes (a notebook shows a :class:`TextView` by them)."""
    buffer = io.BytesIO()
    with style():
        view_figure(view).figure.savefig(buffer, format="png", dpi=PNG_DPI)
    return buffer.getvalue()


def worst_row(run) -> dict | None:
    """The row of largest relative deviation in the run's main slice (:class:`probe.report.data.ReportRun`; ties: the
    first text and query), or None without a measured row: what the report's section shows the text of."""
    from probe.store.engine import literal

    whole = run.main_deviation("slice")
    if whole.empty or not whole["count"].sum():
        return None
    top = float(whole["max"].max())
    found = run.table.frame(
        f"SELECT attention_type, layer, head, example, query, token, rel_deviation, space, alpha "
        f"FROM {run.table.relation_name} "
        f"WHERE {run.measured_where} AND rel_deviation >= {literal(top)} ORDER BY example, query, attention_type, "
        "layer, head LIMIT 1")
    return None if found.empty else {key: (value.item() if hasattr(value, "item") else value)
                                     for key, value in found.iloc[0].to_dict().items()}


def section_html(figure_html: str, row: dict | None, reason: str | None) -> str:
    """The report's section on its worst row: the text view of the row's text, site and head (``figure_html``),
    or why there is none (``reason``)."""
    esc = html.escape
    said = ("" if row is None else
            f"<p>The row of largest relative deviation in the main slice: text {row['example']}, "
            f"{esc(type_label(row['attention_type']))} layer {row['layer']} head {row['head']}, query "
            f"{row['query']} ({esc(str(row.get('token')))}), {row['rel_deviation']:.3g}. Its whole text at that site "
            "and head, recomputed from the model's files (<code>probe show</code> draws any other).</p>")
    body = figure_html if reason is None else f'<p class="note">No text view: {esc(reason)}</p>'
    return f'<section id="worst-text"><h2>The worst row\'s text</h2>{said}{body}</section>'
