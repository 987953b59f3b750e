r"""OT-based attention: the theory's second half (entropy-regularised optimal transport instead of KL).

Pure tensor math, as :mod:`probe.solve.dual`: nothing here knows about models.  Notation (README, The math):
candidates :math:`A = \{t\}` (N templates, rows of ``candidates``, the matrix :math:`T \in R^{N\times d}`),
the input's templates :math:`t_1..t_n` with source weights :math:`u` (the preference), a cost
:math:`M(t, t_j) \ge 0` between them (``cost``, shape ``(n, N)``, ``cost[j, t]``), evidence :math:`z`,
strength :math:`\alpha` and entropic regularisation :math:`\gamma`.

* OT measure (Cuturi 2013): :math:`W_\gamma(p, u; M) = \min_{X \in U(p,u)} \langle M, X\rangle - \gamma H(X)`,
  :math:`H(X) = -\sum X_{tj}\log X_{tj}`, :math:`U(p, u)` the nonnegative :math:`N\times n` matrices with
  row sums :math:`p` and column sums :math:`u`.
* true preference: :math:`\tilde u = \arg\min_p W_\gamma(p, u; M) = \nabla W^*(0)`,
  :math:`\tilde u(t) = \sum_j u_j\,\mathrm{softmax}_{t\in A}(-M(t, t_j)/\gamma)`, mean :math:`\tilde\mu = T^\top\tilde u`.
* primal (OT-P): :math:`\min_p\ \tfrac{\alpha}{2}\|\tilde\mu + z - T^\top p\|^2 + W_\gamma(p, u; M)`.
* dual (OT-D):   :math:`\max_\lambda\ D(\lambda) = \langle\tilde\mu + z, \lambda\rangle - \|\lambda\|^2/(2\alpha)
  - W^*(T\lambda)`, optimum :math:`p^* = \nabla W^*(T\lambda^*)`, :math:`\lambda^* = \alpha(\tilde\mu + z - T^\top p^*)
  = \alpha z + T^\top c^*` with :math:`c^* = \alpha(\tilde u - p^*)`.
* The closed-form approximation :math:`\lambda \approx \alpha z` of the OT dual's optimum (the paper's eq. 22,
  the "OT attention", :func:`ot_attention`):

  .. math::  p(t) = \sum_j u_j\, \mathrm{softmax}_{t \in A}\big((\alpha\langle t, z\rangle - M(t, t_j))/\gamma\big).

The conjugate
-------------
For :math:`g \in R^N`, :math:`W^*(g) = \sup_p \langle g, p\rangle - W_\gamma(p, u; M)
= \sup_{X \ge 0,\ X^\top 1 = u} \sum_{t,j} X_{tj}(g_t - M(t, t_j)) + \gamma H(X)` (the sup over :math:`p`
frees the row sums).  The columns separate: writing column :math:`j` as :math:`u_j q` with :math:`q` in the
simplex, :math:`H` of it is :math:`u_j H(q) - u_j\log u_j`, and :math:`\sup_q \langle q, a\rangle + \gamma H(q)
= \gamma\,\mathrm{LSE}(a/\gamma)` (Gibbs), attained at :math:`q = \mathrm{softmax}(a/\gamma)`.  Hence

.. math::  W^*(g) = \gamma\Big(H(u) + \sum_j u_j \log\sum_{t \in A} e^{(g_t - M(t, t_j))/\gamma}\Big),
           \qquad \nabla W^*(g)_t = \sum_j u_j\, q_j(t),\quad q_j = \mathrm{softmax}_t\big((g_t - M(t,t_j))/\gamma\big).

(The paper prints the inner sum over :math:`t'` with :math:`p(t)` inside it; the sum runs over the
candidates :math:`t'` of the exponent's argument, as derived here.)  :math:`W^*` is smooth and convex with
Hessian :math:`\tfrac1\gamma\Sigma`, :math:`\Sigma = \mathrm{diag}\,p - \sum_j u_j q_j q_j^\top \succeq 0`, and
:math:`W_\gamma(\cdot, u; M)` is convex and closed, so :math:`W = W^{**}`.

Reduced form and Newton
-----------------------
As in :mod:`probe.solve.dual`, :math:`\lambda^* \in \alpha z + \mathrm{row}(T)`.  Write :math:`T = BV^\top` with
:math:`V \in R^{d\times r}` orthonormal: :math:`V = I`, :math:`B = T` when :math:`d \le N`, else
:math:`T^\top = VR` (thin QR, exact to rounding: no squared condition number and no rank cut) and
:math:`B = R^\top`.  With :math:`\lambda = \alpha z + Vy`, :math:`s = Tz`, :math:`m = B^\top\tilde u`:

.. math::  D(y) = \alpha s^\top\tilde u + \tfrac{\alpha}{2}\|z\|^2 + m^\top y - \tfrac{1}{2\alpha}\|y\|^2
           - W^*(\alpha s + By), \qquad g = B^\top(\tilde u - p) - y/\alpha,
           \qquad -\nabla^2 D = I/\alpha + \tfrac1\gamma B^\top\Sigma B,

:math:`1/\alpha`-strongly concave.  Each problem takes Newton steps from :math:`y = 0` (where
:math:`p` is eq. 22) with the dense :math:`r\times r` system solved by Cholesky (OT-ViT sizes: N ~ 50-100,
r <= 64) and Armijo backtracking on :math:`D`; near the optimum, where :math:`D` cannot resolve a step's
gain, full steps are taken while they halve the gradient (as :mod:`probe.solve.dual` does).

Certificate (Fenchel-Young)
---------------------------
Take any :math:`\lambda`, :math:`p = \nabla W^*(T\lambda)`.  Fenchel-Young holds with equality at a
gradient: :math:`W_\gamma(p, u; M) = \langle T\lambda, p\rangle - W^*(T\lambda)` -- the primal value at
:math:`p` needs no inner Sinkhorn solve (the optimal plan is :math:`X_{tj} = u_j q_j(t)`, whose row sums
are :math:`p`).  With :math:`b = \tilde\mu + z`:

.. math::  P(p) - D(\lambda) = \tfrac{\alpha}{2}\|b - T^\top p\|^2 + \langle\lambda, T^\top p\rangle
           - \langle\lambda, b\rangle + \tfrac{\|\lambda\|^2}{2\alpha}
           = \tfrac{1}{2\alpha}\|\alpha(b - T^\top p) - \lambda\|^2 = \tfrac{\alpha}{2}\|\nabla D(\lambda)\|^2,

since :math:`\nabla D(\lambda) = b - \lambda/\alpha - T^\top p`.  :math:`D` is :math:`1/\alpha`-strongly
concave, so :math:`\|\lambda - \lambda^*\| \le \alpha\|\nabla D(\lambda)\| = \sqrt{2\alpha\,\mathrm{gap}}`,
and :math:`\hat\lambda = \alpha(b - T^\top p) = \lambda + \alpha\nabla D(\lambda)` satisfies
:math:`\|\hat\lambda - \lambda^*\| \le 2\alpha\|\nabla D(\lambda)\| = 2\sqrt{2\alpha\,\mathrm{gap}}`
(``error_bound``).  The final certificate is evaluated in the full space (:math:`\lambda = \alpha z + Vy`
formed explicitly, :math:`p` recomputed from it, :math:`\nabla D = T^\top(\tilde u - p) - Vy/\alpha`), not
from the Newton iterations' reduced quantities.  A problem is ``converged`` only when
``error_bound <= rtol * ||lambda_hat|| + atol``; otherwise it is returned flagged, never silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.core.errors import ProbeError

__all__ = ["ApproximationQuality", "OTInputError", "OTPosterior", "approximation_quality", "ot_attention", "ot_posterior", "true_preference"]


class OTInputError(ProbeError, ValueError):
    """Bad input to :func:`ot_posterior` / :func:`true_preference` (a :class:`ValueError` and a
    :class:`probe.core.errors.ProbeError`): the message says what is wrong and what to do."""


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


@dataclass
class OTPosterior:
    r"""Per-problem results of :func:`ot_posterior`, float64, with the inputs' batch shape ``...`` in front.

    Attributes:
        lam: :math:`\hat\lambda = \alpha(\tilde\mu + z - T^\top p) = \alpha z + T^\top c`, ``(..., d)``;
            :math:`\|\hat\lambda - \lambda^*\| \le` ``error_bound``.
        p: :math:`p = \nabla W^*(T\lambda)` at the final dual iterate :math:`\lambda` (within
            ``error_bound / 2`` of :math:`\lambda^*`), the posterior over the candidates, ``(..., N)``.
        dual_point: that iterate :math:`\lambda = \alpha z + Vy`, ``(..., d)``: ``p`` and ``duality_gap``
            are those of the pair (``p``, ``dual_point``) (with a small :math:`\gamma`, :math:`p(\hat\lambda)`
            can differ from ``p`` by far more than :math:`\hat\lambda` differs from the iterate).
        u_tilde: the true preference :math:`\tilde u`, ``(..., N)``.
        coefficients: :math:`c = \alpha(\tilde u - p)`, the reduced form of :math:`\hat\lambda`, ``(..., N)``.
        lambda_norm: :math:`\|\hat\lambda\|`.
        rel_deviation: :math:`\|\hat\lambda - \alpha z\| / \|\hat\lambda\|` (the OT analogue of probe's
            headline number).
        duality_gap: :math:`P(p) - D(\lambda) = \tfrac{\alpha}{2}\|\nabla D(\lambda)\|^2 \ge 0`.
        error_bound: certified bound :math:`2\sqrt{2\alpha\,\mathrm{gap}}` on :math:`\|\hat\lambda - \lambda^*\|`.
        iterations: Newton iterations taken.
        converged: ``error_bound <= rtol * lambda_norm + atol``.
    """

    lam: torch.Tensor
    p: torch.Tensor
    dual_point: torch.Tensor
    u_tilde: torch.Tensor
    coefficients: torch.Tensor
    lambda_norm: torch.Tensor
    rel_deviation: torch.Tensor
    duality_gap: torch.Tensor
    error_bound: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor


# ---------------------------------------------------------------------------------------------- checks


def _as_tensor(name: str, value) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value)
    except Exception as error:  # lists of unequal lengths, strings, ...
        raise OTInputError(f"{name} must be an array of numbers ({error}); pass a torch tensor or numpy array.") from None
    if not (tensor.dtype.is_floating_point or tensor.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                                               torch.uint8)):
        raise OTInputError(f"{name} must hold real numbers, got dtype {tensor.dtype}; pass a float tensor.")
    return tensor


def _positive(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise OTInputError(f"{name} must be a positive number, got {value!r}.") from None
    if not (math.isfinite(number) and number > 0):
        raise OTInputError(f"{name} must be a positive finite number, got {number}; the OT problem needs "
                           f"{name} > 0 (alpha: the evidence's strength, gamma: the entropic regularisation).")
    return number


def _check_weights(source_weights: torch.Tensor, weight_tol: float) -> None:
    if not bool(torch.isfinite(source_weights).all()):
        raise OTInputError("source_weights contains NaN or infinite values; every weight must be a finite number.")
    if bool((source_weights < 0).any()):
        raise OTInputError(f"source_weights must be nonnegative (smallest: {source_weights.min().item():.3g}); "
                           "they are a distribution u over the input's templates.")
    totals = source_weights.to(torch.float64).sum(-1)
    worst = (totals - 1).abs().max().item() if totals.numel() else 0.0
    if worst > weight_tol:
        raise OTInputError(
            f"source_weights must sum to 1 over their last axis (off by up to {worst:.3g}, tolerance "
            f"{weight_tol:g}); normalise them (u / u.sum(-1, keepdim=True)) before calling."
        )


def _check_cost(cost: torch.Tensor, source_weights: torch.Tensor) -> None:
    if bool(torch.isnan(cost).any()) or bool((cost == -math.inf).any()):
        raise OTInputError("cost contains NaN or -inf; costs must be finite and >= 0 (+inf only to exclude a "
                           "candidate from a source).")
    if bool((cost < 0).any()):
        raise OTInputError(
            f"cost must be nonnegative (smallest entry {cost.min().item():.3g}); the OT measure needs M >= 0. "
            "For M(a, b) = -<a, b> add a constant C >= max <a, b> (it cancels in the softmax)."
        )
    finite_somewhere = torch.isfinite(cost).any(-1)  # (..., n)
    stuck = (source_weights > 0) & ~finite_somewhere
    if bool(stuck.any()):
        raise OTInputError("a source with positive weight has an infinite cost to every candidate, so its mass "
                           "cannot be transported; give it at least one finite cost or weight 0.")


def _shapes(candidates, source_weights, cost, evidence):
    if candidates.dim() < 2 or source_weights.dim() < 1 or cost.dim() < 2 or evidence.dim() < 1:
        raise OTInputError(
            "expected candidates (..., N, d), source_weights (..., n), cost (..., n, N), evidence (..., d); got "
            f"shapes {tuple(candidates.shape)}, {tuple(source_weights.shape)}, {tuple(cost.shape)}, "
            f"{tuple(evidence.shape)}."
        )
    N, d = candidates.shape[-2:]
    n = source_weights.shape[-1]
    if cost.shape[-2:] != (n, N) or evidence.shape[-1] != d:
        raise OTInputError(
            f"inconsistent shapes: candidates {tuple(candidates.shape)} (N={N}, d={d}), source_weights "
            f"{tuple(source_weights.shape)} (n={n}), cost {tuple(cost.shape)} (must end in (n, N) = ({n}, {N}): "
            f"cost[j, t] = M(t_j, t)), evidence {tuple(evidence.shape)} (must end in d = {d})."
        )
    if N == 0 or n == 0:
        raise OTInputError(f"need at least one candidate and one source, got N={N}, n={n}.")
    try:
        batch = torch.broadcast_shapes(candidates.shape[:-2], source_weights.shape[:-1], cost.shape[:-2],
                                       evidence.shape[:-1])
    except RuntimeError:
        raise OTInputError(
            f"the batch dimensions do not broadcast: candidates {tuple(candidates.shape[:-2])}, source_weights "
            f"{tuple(source_weights.shape[:-1])}, cost {tuple(cost.shape[:-2])}, evidence "
            f"{tuple(evidence.shape[:-1])}."
        ) from None
    return batch, N, d, n


# --------------------------------------------------------------------------------------- the math


def _transport(theta: torch.Tensor, cost_over_gamma: torch.Tensor, u: torch.Tensor, gamma: float):
    r"""At :math:`g = \theta` (``(b, N)``): the plans' rows :math:`q_j` ``(b, n, N)``, :math:`p = \nabla W^*`
    ``(b, N)`` and :math:`\sum_j u_j \mathrm{LSE}_j` ``(b,)`` (:math:`W^*` without :math:`\gamma H(u)`, over
    :math:`\gamma`).  Sources with :math:`u_j = 0` have their cost row set to 0 beforehand (harmless)."""
    logits = theta.unsqueeze(-2) / gamma - cost_over_gamma
    top = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp(logits - top)
    total = weights.sum(-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)
    q = weights / total  # normalised by its own sum: rows sum to 1 to rounding even when |logits| is huge
    p = (u.unsqueeze(-1) * q).sum(-2)
    return q, p, (u * lse).sum(-1)


def true_preference(source_weights, cost, gamma: float) -> torch.Tensor:
    r""":math:`\tilde u = \nabla W^*(0)`: :math:`\tilde u(t) = \sum_j u_j\,\mathrm{softmax}_t(-M(t, t_j)/\gamma)`,
    the minimiser of :math:`W_\gamma(\cdot, u; M)`.  ``source_weights (..., n)``, ``cost (..., n, N)``;
    returns ``(..., N)`` in float64.  Bad input raises :class:`OTInputError`."""
    gamma = _positive("gamma", gamma)
    source_weights = _as_tensor("source_weights", source_weights)
    cost = _as_tensor("cost", cost)
    if source_weights.dim() < 1 or cost.dim() < 2 or cost.shape[-2] != source_weights.shape[-1]:
        raise OTInputError(f"expected source_weights (..., n) and cost (..., n, N); got {tuple(source_weights.shape)}"
                           f" and {tuple(cost.shape)}.")
    _check_weights(source_weights, 1e-6)
    _check_cost(cost, source_weights)
    u = source_weights.to(torch.float64)
    u = u / u.sum(-1, keepdim=True)
    c = torch.where((u > 0).unsqueeze(-1), cost.to(torch.float64), 0.0) / gamma
    q = torch.softmax(-c, dim=-1)
    return (u.unsqueeze(-1) * q).sum(-2)


@dataclass
class _State:
    r"""Newton's state at :math:`y`: the plans' rows ``q``, :math:`p`, (R-D) without its constant, its gradient,
    and the size of the terms whose rounding limits the objective's resolution
    (:math:`|m^\top y| + \|y\|^2/(2\alpha) + \max_t|\theta_t| + \sum_j u_j\max_t M(t, t_j)`)."""

    q: torch.Tensor
    p: torch.Tensor
    objective: torch.Tensor
    gradient: torch.Tensor
    magnitude: torch.Tensor

    def take(self, index) -> "_State":
        return _State(*(value[index] for value in vars(self).values()))


class _Problems:
    """The fixed data of a set of problems (flattened batch ``b``), in float64."""

    def __init__(self, T, u, cost_over_gamma, z, alpha, gamma):
        self.T, self.u, self.cg, self.z, self.alpha, self.gamma = T, u, cost_over_gamma, z, alpha, gamma
        b, N, d = T.shape
        if d <= N:
            self.V = None
            self.B = T
        else:  # T^T = V R: B = R^T (N x N), exact to rounding
            self.V, R = torch.linalg.qr(T.transpose(1, 2))
            self.B = R.transpose(1, 2)
        self.s = torch.bmm(T, z.unsqueeze(-1)).squeeze(-1)  # s = T z
        self.u_tilde = (u.unsqueeze(-1) * torch.softmax(-cost_over_gamma, dim=-1)).sum(-2)
        self.m = torch.bmm(self.u_tilde.unsqueeze(1), self.B).squeeze(1)  # B^T u~
        finite = torch.where(torch.isfinite(cost_over_gamma), cost_over_gamma.abs(), 0.0)
        self.cost_size = gamma * (u * finite.amax(-1)).sum(-1)  # sum_j u_j max_t M(t, t_j) (finite ones)

    def take(self, index):
        out = _Problems.__new__(_Problems)
        for name, value in vars(self).items():
            setattr(out, name, value[index] if isinstance(value, torch.Tensor) else value)
        return out

    def state(self, y) -> "_State":
        """The :class:`_State` at ``y``."""
        theta = self.alpha * self.s + torch.bmm(self.B, y.unsqueeze(-1)).squeeze(-1)
        q, p, ulse = _transport(theta, self.cg, self.u, self.gamma)
        m_dot_y, y_sq = (self.m * y).sum(-1), (y * y).sum(-1) / (2 * self.alpha)
        objective = m_dot_y - y_sq - self.gamma * ulse
        gradient = torch.bmm((self.u_tilde - p).unsqueeze(1), self.B).squeeze(1) - y / self.alpha
        magnitude = m_dot_y.abs() + y_sq + theta.abs().amax(-1) + self.cost_size
        return _State(q, p, objective, gradient, magnitude)

    def objective(self, y):
        theta = self.alpha * self.s + torch.bmm(self.B, y.unsqueeze(-1)).squeeze(-1)
        logits = theta.unsqueeze(-2) / self.gamma - self.cg
        ulse = (self.u * torch.logsumexp(logits, dim=-1)).sum(-1)
        return (self.m * y).sum(-1) - (y * y).sum(-1) / (2 * self.alpha) - self.gamma * ulse

    def lambda_norm(self, p):
        r""":math:`\|\hat\lambda\| = \alpha\|z + T^\top(\tilde u - p)\|`."""
        spread = torch.bmm((self.u_tilde - p).unsqueeze(1), self.T).squeeze(1)
        return self.alpha * (self.z + spread).norm(dim=-1)

    def direction(self, q, p, gradient):
        r"""The Newton direction :math:`(I/\alpha + B^\top\Sigma B/\gamma)^{-1} g` by Cholesky; rows whose
        factorisation fails (rounding in an ill-conditioned :math:`\Sigma`) fall back to :math:`\alpha g`."""
        B = self.B
        r = B.shape[-1]
        Bq = torch.bmm(q, B)  # (b, n, r): rows B^T q_j
        H = torch.bmm(B.transpose(1, 2), p.unsqueeze(-1) * B) - torch.bmm(Bq.transpose(1, 2), self.u.unsqueeze(-1) * Bq)
        H = 0.5 * (H + H.transpose(1, 2)) / self.gamma
        H.diagonal(dim1=1, dim2=2).add_(1.0 / self.alpha)
        L, info = torch.linalg.cholesky_ex(H)
        ok = info == 0
        if not bool(ok.all()):
            L = torch.where(ok[:, None, None], L, torch.eye(r, dtype=H.dtype, device=H.device))
        step = torch.cholesky_solve(gradient.unsqueeze(-1), L).squeeze(-1)
        return torch.where(ok.unsqueeze(-1), step, self.alpha * gradient)


def _newton(prob: _Problems, rtol: float, atol: float, max_iter: int):
    """Damped Newton on (R-D) for every problem of ``prob``; returns ``(y, iterations)``."""
    b, r = prob.m.shape
    eps = torch.finfo(torch.float64).eps
    y = prob.m.new_zeros(b, r)
    iterations = torch.zeros(b, dtype=torch.int64, device=y.device)
    live_index = torch.arange(b, device=y.device)
    work = prob
    state = work.state(y)
    for _ in range(max_iter):
        gradient_norm = state.gradient.norm(dim=-1)
        goal = 0.25 * (rtol * work.lambda_norm(state.p) + atol) / (2 * work.alpha)
        live = gradient_norm > goal
        if not bool(live.all()):  # compact: drop the finished problems from the working set
            keep = live.nonzero().squeeze(-1)
            live_index, work, state = live_index[keep], work.take(keep), state.take(keep)
            gradient_norm = gradient_norm[keep]
            if len(keep) == 0:
                break
        y_work = y[live_index]
        direction = work.direction(state.q, state.p, state.gradient)
        slope = (state.gradient * direction).sum(-1)
        # Below this gain the objective cannot tell two points apart (its terms' rounding): such steps are
        # not searched but judged by the gradient, which still resolves them.
        floor = 64 * eps * (state.magnitude + 1)
        step = torch.ones_like(slope)
        new = work.state(y_work + direction)  # the full step first: usually accepted, and its state reused
        searching = (slope > floor) & ~(torch.isfinite(new.objective) & (new.objective >= state.objective + 1e-4 * slope))
        unresolved = slope <= floor
        if bool(searching.any()):
            step = torch.where(searching, 0.5, step)
            for _trial in range(60):  # Armijo backtracking on the dual objective
                lost = searching & (step * slope <= floor)  # backtracked into the rounding: no verdict possible
                unresolved = unresolved | lost
                searching = searching & ~lost
                if not bool(searching.any()):
                    break
                trial = work.objective(y_work + step.unsqueeze(-1) * direction)
                accepted = torch.isfinite(trial) & (trial >= state.objective + 1e-4 * step * slope)
                searching = searching & ~accepted
                step = torch.where(searching, 0.5 * step, step)
        failed = searching  # 60 halvings without an acceptable step
        step = torch.where(unresolved | failed, 1.0, step)
        y_new = y_work + step.unsqueeze(-1) * direction
        if not bool((step == 1).all()):
            new = work.state(y_new)
        new_norm = new.gradient.norm(dim=-1)
        # a step taken on the gradient's word alone must shrink it; one that does not is undone, and the
        # problem stops (its certificate alone then says whether it converged), as does one that keeps
        # shrinking it by less than half
        undo = (unresolved | failed) & ~(new_norm < gradient_norm)
        stalled = undo | ((unresolved | failed) & (new_norm > 0.5 * gradient_norm))
        y_new = torch.where(undo.unsqueeze(-1), y_work, y_new)
        state = _State(*(torch.where(undo.view(-1, *([1] * (old.dim() - 1))), old, fresh)
                         for old, fresh in zip(vars(state).values(), vars(new).values())))
        iterations[live_index] += 1
        y[live_index] = y_new
        if bool(stalled.any()):
            keep = (~stalled).nonzero().squeeze(-1)
            live_index, work, state = live_index[keep], work.take(keep), state.take(keep)
            if len(keep) == 0:
                break
    return y, iterations


def _certify(prob: _Problems, y, rtol, atol):
    r"""The certificate in the full space: :math:`\lambda = \alpha z + Vy`, :math:`p = \nabla W^*(T\lambda)`,
    :math:`\nabla D = T^\top(\tilde u - p) - Vy/\alpha`, :math:`\hat\lambda = \lambda + \alpha\nabla D`."""
    alpha = prob.alpha
    shift = y if prob.V is None else torch.bmm(prob.V, y.unsqueeze(-1)).squeeze(-1)  # lambda - alpha z
    lam = alpha * prob.z + shift
    theta = torch.bmm(prob.T, lam.unsqueeze(-1)).squeeze(-1)
    _, p, _ = _transport(theta, prob.cg, prob.u, prob.gamma)
    spread = torch.bmm((prob.u_tilde - p).unsqueeze(1), prob.T).squeeze(1)  # T^T (u~ - p)
    gradient = spread - shift / alpha
    gradient_norm = gradient.norm(dim=-1)
    lam_hat = alpha * (prob.z + spread)
    lambda_norm = lam_hat.norm(dim=-1)
    error_bound = 2 * alpha * gradient_norm
    converged = torch.isfinite(error_bound) & (error_bound <= rtol * lambda_norm + atol)
    return dict(
        lam=lam_hat, p=p, dual_point=lam, u_tilde=prob.u_tilde, coefficients=alpha * (prob.u_tilde - p), lambda_norm=lambda_norm,
        rel_deviation=alpha * spread.norm(dim=-1) / lambda_norm, duality_gap=0.5 * alpha * gradient_norm ** 2,
        error_bound=error_bound, converged=converged,
    )


#: problems per tile: a tile's working set (about 6 float64 arrays of n x N per problem) stays near 32 MB
_TILE_BYTES = 1 << 25


def ot_posterior(
    candidates,
    source_weights,
    cost,
    evidence,
    alpha: float,
    gamma: float,
    *,
    rtol: float = 1e-9,
    atol: float = 1e-12,
    max_iter: int = 200,
    weight_tol: float = 1e-6,
) -> OTPosterior:
    r"""Solve the OT dual (OT-D) exactly, with a certificate, for every problem of a batch.

    Shapes (batch dimensions ``...`` in front, broadcast against each other): ``candidates (..., N, d)`` the
    set :math:`A`; ``source_weights (..., n)`` :math:`u`, nonnegative, summing to 1 (within ``weight_tol``;
    renormalised); ``cost (..., n, N)`` with ``cost[j, t] = M(t, t_j) >= 0`` (``+inf`` excludes candidate
    ``t`` from source ``j``); ``evidence (..., d)`` :math:`z`; ``alpha, gamma > 0`` numbers.

    Runs in float64 on the inputs' device (damped Newton on the reduced dual, module docstring), from
    :math:`\lambda = \alpha z`, whose :math:`p` is :func:`ot_attention`.  Returns an :class:`OTPosterior`:
    ``.lam (..., d)``, ``.p (..., N)``, ``.u_tilde (..., N)``, ``.duality_gap``, ``.error_bound``,
    ``.converged`` (``error_bound <= rtol * ||lam|| + atol``) and more.  Problems that do not reach the
    tolerance within ``max_iter`` Newton steps (or whose float64 rounding forbids it) come back with
    ``converged`` False and their honest ``error_bound``.

    Bad input (shapes, negative or NaN costs, weights not summing to 1, nonpositive alpha or gamma,
    non-finite values) raises :class:`OTInputError`, a :class:`ValueError`, before any work.
    """
    alpha = _positive("alpha", alpha)
    gamma = _positive("gamma", gamma)
    if not (rtol >= 0 and atol >= 0 and (rtol > 0 or atol > 0)):
        raise OTInputError(f"rtol and atol must be nonnegative and not both 0, got rtol={rtol}, atol={atol}.")
    if int(max_iter) < 0:
        raise OTInputError(f"max_iter must be >= 0, got {max_iter}.")
    candidates = _as_tensor("candidates", candidates)
    source_weights = _as_tensor("source_weights", source_weights)
    cost = _as_tensor("cost", cost)
    evidence = _as_tensor("evidence", evidence)
    batch, N, d, n = _shapes(candidates, source_weights, cost, evidence)
    for name, tensor in (("candidates", candidates), ("evidence", evidence)):
        if not bool(torch.isfinite(tensor).all()):
            raise OTInputError(f"{name} contains NaN or infinite values; every entry must be a finite number.")
    _check_weights(source_weights, weight_tol)
    _check_cost(cost, source_weights)

    f64 = torch.float64
    device = candidates.device
    count = math.prod(batch)
    T = candidates.to(f64).expand(*batch, N, d).reshape(count, N, d)
    u = source_weights.to(device=device, dtype=f64).expand(*batch, n).reshape(count, n)
    u = u / u.sum(-1, keepdim=True)
    M = cost.to(device=device, dtype=f64).expand(*batch, n, N).reshape(count, n, N)
    z = evidence.to(device=device, dtype=f64).expand(*batch, d).reshape(count, d)

    results = []
    rows = max(1, _TILE_BYTES // (6 * 8 * max(1, n * N)))
    for start in range(0, count, rows):
        sl = slice(start, min(count, start + rows))
        u_t = u[sl]
        cg = torch.where((u_t > 0).unsqueeze(-1), M[sl], 0.0) / gamma  # sources of weight 0: harmless rows
        prob = _Problems(T[sl], u_t, cg, z[sl], alpha, gamma)
        y, iterations = _newton(prob, rtol, atol, int(max_iter))
        out = _certify(prob, y, rtol, atol)
        out["iterations"] = iterations
        results.append(out)
    if not results:  # an empty batch
        empty = torch.empty(0, dtype=f64, device=device)
        results = [dict(lam=empty.reshape(0, d), p=empty.reshape(0, N), dual_point=empty.reshape(0, d), u_tilde=empty.reshape(0, N),
                        coefficients=empty.reshape(0, N), lambda_norm=empty, rel_deviation=empty,
                        duality_gap=empty, error_bound=empty, iterations=empty.long(), converged=empty.bool())]
    merged = {name: torch.cat([r[name] for r in results]) for name in results[0]}
    return OTPosterior(**{name: value.reshape(tuple(batch) + tuple(value.shape[1:])) for name, value in merged.items()})


@dataclass
class ApproximationQuality:
    r"""How far the OT attention (eq. 22) is from the exact OT posterior, per problem, with certified errors.

    Attributes:
        rel_deviation: :math:`\|\hat\lambda - \alpha z\| / \|\hat\lambda\|`.
        rel_deviation_error: bound on its distance to the exact :math:`\|\lambda^* - \alpha z\| / \|\lambda^*\|`:
            with :math:`\varepsilon` = ``error_bound``, :math:`\varepsilon(1 + \mathrm{rel})/(\|\hat\lambda\| - \varepsilon)`
            (write :math:`A/B - a/b = A(b - B)/(Bb) + (A - a)/b` with :math:`|A - a|, |B - b| \le \varepsilon`).
        total_variation: :math:`\tfrac12\|p - p_{22}\|_1`, ``p`` the solver's posterior.
        total_variation_error: bound on its distance to :math:`\tfrac12\|p^* - p_{22}\|_1`:
            :math:`\max_t\|t\|\,\varepsilon / (2\gamma)`.  (``p = p(\lambda)`` at the dual point, within
            :math:`\delta = \varepsilon/2` of :math:`\lambda^*`; each plan row is a softmax of logits that move by
            at most :math:`v = \max_t\|t\|\delta/\gamma` in sup norm, and a softmax's Jacobian maps
            :math:`w \mapsto` a vector of 1-norm :math:`\sum_i q_i |w_i - q^\top w| \le 2\|w\|_\infty`, so
            :math:`\|p - p^*\|_1 \le 2v`.)
        solution: the :class:`OTPosterior` (``converged`` says which problems are certified).
    """

    rel_deviation: torch.Tensor
    rel_deviation_error: torch.Tensor
    total_variation: torch.Tensor
    total_variation_error: torch.Tensor
    solution: OTPosterior


def approximation_quality(candidates, source_weights, cost, evidence, alpha: float, gamma: float,
                          **solver_options) -> ApproximationQuality:
    r"""How good the OT attention (eq. 22) is on a batch of problems: the exact posterior by
    :func:`ot_posterior` against the closed form :math:`\lambda = \alpha z` (:func:`ot_attention`, in
    float64).  Same shapes and checks as :func:`ot_posterior`; returns an :class:`ApproximationQuality`
    whose tensors have the batch's shape.
    """
    solution = ot_posterior(candidates, source_weights, cost, evidence, alpha, gamma, **solver_options)
    f64 = torch.float64
    args = [torch.as_tensor(x).to(f64) for x in (candidates, source_weights, cost, evidence)]
    closed = ot_attention(*args, float(alpha), float(gamma))
    eps = solution.error_bound
    rel = solution.rel_deviation
    rel_error = eps * (1 + rel) / (solution.lambda_norm - eps).clamp_min(0)
    radius = args[0].norm(dim=-1).amax(-1).expand(rel.shape)
    return ApproximationQuality(
        rel_deviation=rel,
        rel_deviation_error=torch.where(solution.lambda_norm > eps, rel_error, torch.full_like(rel, math.inf)),
        total_variation=0.5 * (solution.p - closed).abs().sum(-1),
        total_variation_error=radius * eps / (2 * float(gamma)),
        solution=solution,
    )
