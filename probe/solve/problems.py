"""The reduced dual problems and their solutions as the solvers exchange them (:class:`DualProblems`,
:class:`DualSolution`), and the certificate every solution carries: the duality gap of eq. (D) at a point
(:func:`duality_gap_reduced`).  Notation: :mod:`probe.solve.dual`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DualProblems:
    r"""A batch of reduced dual problems, laid out by group.

    Shapes: ``n_groups`` groups that each share one Gram matrix, ``m`` problems per group, ``n`` keys.
    The templates of a group are given by :math:`G`, by a factor :math:`A` of it, or by both.

    Attributes:
        gram: :math:`G = TT^\top`, ``(n_groups, n, n)``, or ``None`` where ``factor`` is given (then
            nothing of size :math:`n \times n` is formed: long contexts).
        logits: :math:`s = Tz` (without :math:`\alpha`), ``(n_groups, m, n)``.
        log_preference: :math:`\log u` up to an additive constant per problem, ``-inf`` for keys that
            are not part of the problem, ``(n_groups, m, n)``.
        evidence_sqnorm: :math:`\|z\|^2`, ``(n_groups, m)``.
        alpha: strength :math:`\alpha > 0`.
        active: which problems to solve, ``(n_groups, m)`` bool; inactive ones (e.g. padding queries)
            are skipped and their outputs are NaN.  ``None`` means all.
        factor: any :math:`A` with :math:`AA^\top = G`, ``(n_groups, n, r)`` with any width :math:`r`
            (rank-deficient allowed): from :func:`probe.solve.gram.factor_gram` or
            :func:`probe.solve.gram.factor_from_templates`, :math:`T` itself included.  It depends on the
            templates only, so one factorisation serves every alpha.  ``None``: factored from ``gram``.
    """

    gram: torch.Tensor | None
    logits: torch.Tensor
    log_preference: torch.Tensor
    evidence_sqnorm: torch.Tensor
    alpha: float = 1.0
    active: torch.Tensor | None = None
    factor: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """The device of the templates (``gram``, else ``factor``), where the solvers run."""
        return (self.gram if self.gram is not None else self.factor).device

    @property
    def n_groups(self) -> int:
        """The number of groups."""
        return self.logits.shape[0]


@dataclass
class DualSolution:
    r"""Per-problem results, each ``(n_groups, m)`` unless stated.

    Attributes:
        coefficients: :math:`c` with :math:`\hat\lambda = \alpha z + T^\top c`, ``(n_groups, m, n)``
            (:math:`c = \alpha(u - p)`); the reduced form of :math:`\lambda^*`.
        attention: :math:`p(\lambda)`, the optimal primal distribution, ``(n_groups, m, n)``.
        rel_deviation: :math:`\|\hat\lambda - \alpha z\| / \|\hat\lambda\|`.
        lambda_norm: :math:`\|\hat\lambda\|`.
        duality_gap: :math:`P(p) - D(\lambda)` at the final iterate (>= 0).
        error_bound: certified bound on :math:`\|\hat\lambda - \lambda^*\|`.
        iterations: Newton iterations taken.
        converged: ``error_bound <= rtol * lambda_norm + atol``.
        correction: :math:`A^\top\hat c`, which is :math:`\hat\lambda - \alpha z = VA^\top\hat c` in the
            coordinates of the factor's columns (those of ``DualProblems.factor``, or of
            :func:`probe.solve.gram.factor_gram` of ``gram`` where none was given), ``(n_groups, m, r)``:
            what :func:`probe.solve.second_order.second_order_deviation` compares with the second-order point.
    """

    coefficients: torch.Tensor
    attention: torch.Tensor
    rel_deviation: torch.Tensor
    lambda_norm: torch.Tensor
    duality_gap: torch.Tensor
    error_bound: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor
    correction: torch.Tensor


def _log_softmax_normalised(log_preference: torch.Tensor) -> torch.Tensor:
    """Normalise log u over the last axis so that sum_i u_i = 1 (``-inf`` entries stay ``-inf``)."""
    return log_preference - torch.logsumexp(log_preference, dim=-1, keepdim=True)


def duality_gap_reduced(gradient: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""Duality gap :math:`P(p(y)) - D(y) = \tfrac{\alpha}{2}\|g(y)\|^2` (closed form).

    Derivation: with :math:`\theta = \log u + \alpha s + Ay`, :math:`p = \mathrm{softmax}(\theta)` and
    :math:`KL(p\|u) = p^\top(\alpha s + Ay) - \mathrm{LSE}(\theta)`, the primal at :math:`p` is
    :math:`\tfrac{\alpha}{2}(\|z\|^2 + 2s^\top(u-p) + \|A^\top(u-p)\|^2) + KL(p\|u)`.  Subtracting
    (R-D), the :math:`\|z\|^2`, :math:`s^\top p` and LSE terms cancel and what is left is
    :math:`\tfrac{\alpha}{2}\|A^\top(u-p)\|^2 - y^\top A^\top(u-p) + \|y\|^2/(2\alpha)
    = \tfrac{1}{2\alpha}\|\alpha A^\top(u-p) - y\|^2 = \tfrac{\alpha}{2}\|g\|^2`.
    Computed as a squared norm it is non-negative and free of cancellation.
    """
    return 0.5 * alpha * (gradient * gradient).sum(-1)


def shares_rows(rows: torch.Tensor) -> bool:
    """Whether every row of each group of ``(g, m, n)`` is the group's first by construction: a view whose
    rows have stride 0, as an expanded preference is (then computed once per group)."""
    return rows.dim() == 3 and rows.shape[1] > 1 and rows.stride(1) == 0


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise inner products ``(..., k), (..., k) -> (...)``, as a batch of ``1 x k`` by ``k x 1`` matrix
    products: on a CPU four to five times faster than ``torch.linalg.vecdot``, which forms the
    elementwise product in a fresh tensor and then sums it."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1).squeeze(-1)

