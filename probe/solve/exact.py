r"""Exact inference as a differentiable layer: the KL problem's posterior :math:`p^*` with implicit gradients.

For templates :math:`t_1..t_n` (rows of :math:`T`), a preference :math:`u = \mathrm{softmax}(\ell)` with mean
:math:`\mu = T^\top u`, evidence :math:`z` and strength :math:`\alpha`, the dual of :mod:`probe.solve.dual`

.. math::  \max_\lambda\ \langle\lambda, \mu + z\rangle - \|\lambda\|^2/(2\alpha)
           - \log\sum_i u_i e^{\langle t_i,\lambda\rangle}

has one maximiser :math:`\lambda^*`, and :func:`exact_attention` returns the exact posterior

.. math::  p^*_i = \frac{u_i\, e^{\langle t_i, \lambda^*\rangle}}{\sum_j u_j\, e^{\langle t_j, \lambda^*\rangle}}
           = \mathrm{softmax}(\ell + T\lambda^*)_i .

Softmax attention is its closed-form approximation :math:`\lambda \approx \alpha z`:
:math:`\mathrm{softmax}(\ell + \alpha T z)`.

Forward
-------
:func:`probe.solve.dual.solve_dual`, the rows' certified batched Newton solver, with its conventions: one
problem per group, given by its factor alone (:func:`probe.solve.gram.factor_from_templates`): :math:`A = T`
when :math:`d \le n` (then :math:`\lambda = \alpha z + y` with :math:`y \in R^d`: the dual itself) and the
QR-reduced :math:`A = R^\top` (:math:`T^\top = QR`) when :math:`d > n`.  The certificate is the
solver's: ``error_bound`` :math:`\ge \|\hat\lambda - \lambda^*\|`.  Computed in float64 whatever the
inputs' dtype; ``p`` comes back in the inputs' dtype.

Backward (implicit differentiation, no unrolling)
-------------------------------------------------
At the optimum the dual's gradient vanishes:

.. math::  F(\lambda; T, z, \ell) = T^\top u(\ell) + z - \lambda/\alpha - T^\top p(\lambda) = 0,
           \qquad p(\lambda) = \mathrm{softmax}(\ell + T\lambda),

with Jacobian :math:`\partial F/\partial\lambda = -K`, :math:`K = I/\alpha + T^\top\Sigma_p T` and
:math:`\Sigma_p = \mathrm{diag}\,p - pp^\top`: the negated Hessian of the dual at :math:`\lambda^*`, the
matrix of the solver's Newton system.  For an incoming gradient :math:`v = \partial L/\partial p^*`, let
:math:`w = \Sigma_p v` (the softmax's adjoint), :math:`a = K^{-1}T^\top w` (one linear solve),
:math:`b = Ta` and :math:`e = w - \Sigma_p b`.  From :math:`Ka = T^\top w`,
:math:`a = \alpha T^\top e`, and differentiating :math:`p^* = \mathrm{softmax}(\ell + T\lambda^*)` with
:math:`d\lambda^* = K^{-1}\,dF` gives

.. math::  \frac{\partial L}{\partial z} = \alpha T^\top e, \qquad
           \frac{\partial L}{\partial \ell} = e + \Sigma_u b, \qquad
           \frac{\partial L}{\partial T} = e\,\lambda^{*\top}
           + (u - p^*)\,\Big(\frac{\partial L}{\partial z}\Big)^{\!\top}.

The solve runs in the solver's reduced space: with :math:`T = AV^\top` (:math:`V` orthonormal),
:math:`b = A\,K_r^{-1}A^\top w` with :math:`K_r = I/\alpha + A^\top\Sigma_p A`, which is the Newton system
of (R-D) at the solution, solved by :func:`probe.solve.dual.solve_spd_reduced` (the Newton systems' batched
conjugate gradients).  Keys with :math:`u_i = 0` have :math:`p^*_i = 0`, so every term above is 0 in
their rows: their templates and log-preferences get zero gradients, as they have no effect.  With one
key, :math:`p^* = 1` and every gradient is 0.  docs/exact.md derives these formulas step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from probe.core.errors import ProbeError
from probe.solve.dual import DualProblems, solve_dual, solve_spd_reduced
from probe.solve.gram import factor_from_templates
from probe.solve.problems import row_dot

__all__ = ["exact_attention", "ExactCertificate", "merge_summaries"]

#: relative residual to which the backward's Newton system is solved (float64)
BACKWARD_RTOL = 1e-12


@dataclass
class ExactCertificate:
    r"""What :func:`exact_attention` certifies about each problem, shaped like the batch ``(...)``.

    Attributes:
        error_bound: the solver's certified bound on :math:`\|\hat\lambda - \lambda^*\|` (float64).
        lambda_norm: :math:`\|\hat\lambda\|` (float64).
        iterations: Newton iterations taken (int32).
        converged: whether ``error_bound <= rtol * lambda_norm + atol`` (bool).

    The properties summarise the batch as Python numbers, for a training loop's log.
    """

    error_bound: torch.Tensor
    lambda_norm: torch.Tensor
    iterations: torch.Tensor
    converged: torch.Tensor

    @property
    def problems(self) -> int:
        return self.converged.numel()

    @property
    def not_converged(self) -> int:
        """How many problems are not certified within the tolerance."""
        return int((~self.converged).sum())

    @property
    def max_error_bound(self) -> float:
        r"""The largest certified bound on :math:`\|\hat\lambda - \lambda^*\|`."""
        return float(self.error_bound.max()) if self.problems else 0.0

    @property
    def max_relative_error_bound(self) -> float:
        r"""The largest ``error_bound / lambda_norm`` (:math:`\hat\lambda = 0` counts its bound as it is)."""
        if not self.problems:
            return 0.0
        norm = torch.where(self.lambda_norm > 0, self.lambda_norm, torch.ones_like(self.lambda_norm))
        return float((self.error_bound / norm).max())

    @property
    def max_iterations(self) -> int:
        return int(self.iterations.max()) if self.problems else 0

    @property
    def mean_iterations(self) -> float:
        return float(self.iterations.double().mean()) if self.problems else 0.0

    def summary(self) -> dict:
        """The properties as one dictionary (JSON-ready)."""
        names = ("problems", "not_converged", "max_error_bound", "max_relative_error_bound", "max_iterations",
                 "mean_iterations")
        return {name: getattr(self, name) for name in names}


def merge_summaries(summaries: list[dict]) -> dict:
    """The :meth:`ExactCertificate.summary` of several batches as one: counts added, maxima of the maxima, the
    mean of the iterations weighted by the problems (a training loop's per-epoch record)."""
    problems = sum(s["problems"] for s in summaries)
    merged = {"problems": problems, "not_converged": sum(s["not_converged"] for s in summaries)}
    for name in ("max_error_bound", "max_relative_error_bound", "max_iterations"):
        merged[name] = max((s[name] for s in summaries), default=0)
    merged["mean_iterations"] = sum(s["mean_iterations"] * s["problems"] for s in summaries) / max(problems, 1)
    return merged


def exact_attention(
    templates: torch.Tensor,
    evidence: torch.Tensor,
    log_preference: torch.Tensor,
    alpha: float = 1.0,
    *,
    return_certificate: bool = False,
    rtol: float = 1e-9,
    atol: float = 1e-12,
    max_iter: int = 100,
):
    r"""The exact posterior :math:`p^*` of the KL problem (module docstring), differentiable in all three tensors.

    Args:
        templates: :math:`T`, ``(..., n, d)``.
        evidence: :math:`z`, ``(..., d)``.
        log_preference: :math:`\ell = \log u` up to a constant per problem, ``(..., n)``; ``-inf`` removes a
            key (its :math:`p^*` is 0).  Every problem needs at least one finite entry.
        alpha: the strength :math:`\alpha > 0`.
        return_certificate: also return an :class:`ExactCertificate`.
        rtol: the solver's relative tolerance on :math:`\|\hat\lambda - \lambda^*\|`
            (:func:`probe.solve.dual.solve_dual`).
        atol: its absolute tolerance on the same distance.
        max_iter: its iteration limit.

    The leading dimensions ``...`` of the three tensors broadcast against one another.  Returns ``p`` of
    shape ``(..., n)`` in the inputs' (promoted) dtype, or ``(p, certificate)``.  Problems that do not
    reach the tolerance in ``max_iter`` iterations are returned as they are and counted in
    ``certificate.not_converged``.  The backward pass is implicit differentiation through the optimality
    condition: one linear solve per problem, no unrolled iterations; it is not differentiable twice.
    """
    batch, n, d = _check(templates, evidence, log_preference, alpha)
    dtype = torch.promote_types(torch.promote_types(templates.dtype, evidence.dtype), log_preference.dtype)
    T = templates.expand(*batch, n, d).reshape(-1, n, d)
    z = evidence.expand(*batch, d).reshape(-1, d)
    ell = log_preference.expand(*batch, n).reshape(-1, n)
    p, columns = _ExactPosterior.apply(T, z, ell, (float(alpha), float(rtol), float(atol), int(max_iter)))
    p = p.to(dtype).reshape(*batch, n)
    if not return_certificate:
        return p
    error_bound, lambda_norm, iterations, converged = columns.unbind(-1)
    certificate = ExactCertificate(error_bound.reshape(batch), lambda_norm.reshape(batch),
                                   iterations.to(torch.int32).reshape(batch), converged.bool().reshape(batch))
    return p, certificate


def _check(templates, evidence, log_preference, alpha) -> tuple[torch.Size, int, int]:
    """Every check on the inputs (a :class:`ProbeError` that says what to do); returns (batch shape, n, d)."""
    for name, value in (("templates", templates), ("evidence", evidence), ("log_preference", log_preference)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ProbeError(f"exact_attention: {name} must be a floating-point torch.Tensor, got "
                             f"{getattr(value, 'dtype', type(value).__name__)}.")
    if templates.dim() < 2 or evidence.dim() < 1 or log_preference.dim() < 1:
        raise ProbeError(
            "exact_attention: the shapes are templates (..., n, d), evidence (..., d) and log_preference (..., n); "
            f"got {tuple(templates.shape)}, {tuple(evidence.shape)} and {tuple(log_preference.shape)}."
        )
    n, d = templates.shape[-2:]
    if evidence.shape[-1] != d or log_preference.shape[-1] != n or n == 0 or d == 0:
        raise ProbeError(
            f"exact_attention: templates {tuple(templates.shape)} give n = {n} keys of dimension d = {d}, so the "
            f"evidence must end in d and log_preference in n (both at least 1); got evidence "
            f"{tuple(evidence.shape)} and log_preference {tuple(log_preference.shape)}."
        )
    try:
        batch = torch.broadcast_shapes(templates.shape[:-2], evidence.shape[:-1], log_preference.shape[:-1])
    except RuntimeError:
        raise ProbeError(
            f"exact_attention: the leading (batch) dimensions {tuple(templates.shape[:-2])}, "
            f"{tuple(evidence.shape[:-1])} and {tuple(log_preference.shape[:-1])} of templates, evidence and "
            "log_preference do not broadcast against one another."
        ) from None
    if len({templates.device, evidence.device, log_preference.device}) > 1:
        raise ProbeError(
            f"exact_attention: the inputs are on different devices ({templates.device}, {evidence.device}, "
            f"{log_preference.device}); move them to one."
        )
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ProbeError(f"exact_attention: alpha must be a positive number, got {alpha!r}.")
    with torch.no_grad():
        for name, value in (("templates", templates), ("evidence", evidence)):
            if not bool(torch.isfinite(value).all()):
                raise ProbeError(f"exact_attention: {name} holds NaN or infinite entries; every entry must be finite.")
        if bool((torch.isnan(log_preference) | (log_preference == math.inf)).any()):
            raise ProbeError("exact_attention: log_preference holds NaN or +inf; use finite values, or -inf to "
                             "remove a key.")
        if log_preference.numel() and not bool(torch.isfinite(log_preference).any(-1).all()):
            raise ProbeError("exact_attention: a problem has log_preference -inf for every key; each problem needs "
                             "at least one key.")
    return batch, n, d


class _ExactPosterior(torch.autograd.Function):
    r"""``(T (P, n, d), z (P, d), ell (P, n), settings)`` -> ``p*`` and its certificate, each problem its own
    group; ``settings`` is ``(alpha, rtol, atol, max_iter)``, the certificate ``(P, 4)`` float64 columns
    error bound, :math:`\|\hat\lambda\|`, iterations, converged."""

    @staticmethod
    def forward(ctx, T, z, ell, settings):
        alpha, rtol, atol, max_iter = settings
        f64 = torch.float64
        ctx.dtypes = (T.dtype, z.dtype, ell.dtype)
        T, z, ell = T.detach().to(f64), z.detach().to(f64), ell.detach().to(f64)
        A = factor_from_templates(T)
        problems = DualProblems(
            gram=None, logits=(T @ z.unsqueeze(-1)).transpose(-1, -2), log_preference=ell.unsqueeze(1),
            evidence_sqnorm=row_dot(z, z).unsqueeze(1), alpha=alpha, factor=A,
        )
        solution = solve_dual(problems, rtol=rtol, atol=atol, max_iter=max_iter)
        p = solution.attention[:, 0]
        ctx.save_for_backward(T, z, ell, A, p)
        ctx.alpha = alpha
        certificate = torch.stack([solution.error_bound[:, 0], solution.lambda_norm[:, 0],
                                   solution.iterations[:, 0].to(f64), solution.converged[:, 0].to(f64)], dim=-1)
        ctx.mark_non_differentiable(certificate)
        return p, certificate

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_p, _):
        T, z, ell, A, p = ctx.saved_tensors
        alpha = ctx.alpha
        v = grad_p.to(torch.float64)
        u = torch.softmax(ell, dim=-1)
        w = p * (v - row_dot(p, v).unsqueeze(-1))  # Sigma_p v
        rhs = torch.bmm(w.unsqueeze(1), A)  # A^T w, as rows (P, 1, r)
        y, _ = solve_spd_reduced(A, p.unsqueeze(1), rhs, alpha, rtol=BACKWARD_RTOL, residual=False)
        b = torch.bmm(y, A.transpose(1, 2))[:, 0]  # T a = A K_r^{-1} A^T w
        e = w - p * (b - row_dot(p, b).unsqueeze(-1))
        grad_z = alpha * torch.bmm(e.unsqueeze(1), T)[:, 0]  # a = alpha T^T e
        grad_ell = e + u * (b - row_dot(u, b).unsqueeze(-1))
        lam = alpha * z + torch.bmm((alpha * (u - p)).unsqueeze(1), T)[:, 0]  # lambda* = alpha z + T^T c
        grad_T = e.unsqueeze(-1) * lam.unsqueeze(1) + (u - p).unsqueeze(-1) * grad_z.unsqueeze(1)
        grad_T, grad_z, grad_ell = (grad.to(dtype) for grad, dtype in zip((grad_T, grad_z, grad_ell), ctx.dtypes))
        return grad_T, grad_z, grad_ell, None
