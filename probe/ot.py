r"""OT-based attention: the theory's second half (entropy-regularised optimal transport instead of KL).

Pure tensor math, as :mod:`probe.solver`: nothing here knows about models.  Notation (README, The math):
candidates :math:`A = \{t\}` (N templates, rows of ``candidates``), the input's templates
:math:`t_1..t_n` with source weights :math:`u` (the preference), a cost :math:`M(t_j, t) \ge 0` between them
(``cost``, shape ``(n, N)``), evidence :math:`z`, strength :math:`\alpha` and entropic regularisation
:math:`\gamma`.

* OT measure (Cuturi 2013): :math:`W_\gamma(p, u; M) = \min_{X \in U(p,u)} \langle M, X\rangle - \gamma H(X)`.
* The closed-form approximation :math:`\lambda \approx \alpha z` of the OT dual (the paper's eq. 22, the
  "OT attention"):

  .. math::  p(t) = \sum_j u_j\, \mathrm{softmax}_{t \in A}\big((\alpha\langle t, z\rangle - M(t, t_j))/\gamma\big).
"""

from __future__ import annotations

import torch

__all__ = ["ot_attention"]


def ot_attention(
    candidates: torch.Tensor,
    source_weights: torch.Tensor,
    cost: torch.Tensor,
    evidence: torch.Tensor,
    alpha: float,
    gamma: float,
) -> torch.Tensor:
    r"""The OT attention (eq. 22): the closed form :math:`\lambda = \alpha z` of the OT dual's optimum.

    Shapes (any batch dimensions ``...`` in front, broadcast against each other):
    ``candidates (..., N, d)``, ``source_weights (..., n)``, ``cost (..., n, N)`` with ``cost[j, t] = M(t_j, t)``
    (``+inf`` excludes a candidate: it gets no mass), ``evidence (..., d)``.  Returns ``p`` of shape
    ``(..., N)``; differentiable in every tensor argument.  Sources of weight 0 contribute nothing (their
    cost row may be anything, ``inf`` included).
    """
    if not (alpha > 0 and gamma > 0):
        raise ValueError(f"alpha and gamma must be positive, got alpha={alpha}, gamma={gamma}")
    scores = alpha * (candidates @ evidence.unsqueeze(-1)).squeeze(-1)  # (..., N): alpha <t, z>
    logits = (scores.unsqueeze(-2) - cost) / gamma  # (..., n, N)
    used = source_weights > 0
    logits = torch.where(used.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    plans = torch.softmax(logits, dim=-1)  # row j: the transport of source j's mass over the candidates
    return (torch.where(used, source_weights, 0).unsqueeze(-1) * plans).sum(dim=-2)
