r"""The substitutes for a site's attention weights: the exact posterior :math:`p^*`, the second-order point
:math:`p(\lambda_2)`, and the null, a seeded random change of the model's attention of the same total variation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probe.batch.problems import site_problems
from probe.capture.adapters.base import SiteCapture
from probe.interventions.forward import site_name
from probe.interventions.model import example_generator
from probe.solve import derived, second_order
from probe.solve.dual import DualProblems, DualSolution, solve_dual

_F64 = torch.float64

# --------------------------------------------------------------------------------------------------
# substitutes


@dataclass
class Substitute:
    """One substitute of a site: its weights and what its solve certified (per example).

    Attributes:
        weights: ``(b, h, q, k)`` float64 (padding queries: the model's own weights).
        solver_rows: rows solved per example ``(b,)`` (0 where no solve was needed).
        not_converged: rows whose certificate missed the tolerance, per example ``(b,)``.
        max_relative_error_bound: max ``error_bound / lambda_norm`` per example ``(b,)`` (NaN: no solve).
    """

    weights: torch.Tensor
    solver_rows: torch.Tensor
    not_converged: torch.Tensor
    max_relative_error_bound: torch.Tensor


def _solve(site: SiteCapture, alpha: float, space: str, rtol: float) -> tuple[DualProblems, DualSolution]:
    problems = site_problems(site, alpha, space, gram=False)  # its factor only
    return problems, solve_dual(problems, rtol=rtol)


def null_attention(p_att: torch.Tensor, tau: torch.Tensor, allowed: torch.Tensor,
                   generator: torch.Generator) -> torch.Tensor:
    r"""A random distribution :math:`q` with :math:`TV(q, p_{att}) = \tau` exactly, per row.

    Rows ``(r, n)``: ``p_att`` distributions over the ``allowed`` keys, ``tau`` ``(r,)`` in
    :math:`[0, 1 - \min_{allowed} p_{att}]` (which holds for :math:`\tau = TV(p^*, p_{att})` with :math:`p^*`
    on the allowed keys: :math:`\tau = p^*(S) - p_{att}(S) \le 1 - p_{att}(S)` for :math:`S = \{p^* >
    p_{att}\}`).  Keys are split at random into acceptors :math:`A` (a random-length prefix of a random
    order of the keys with :math:`p_i \le 1 - \tau`, as long as :math:`p(A) \le 1 - \tau`; at least one)
    and donors :math:`D` (the other allowed keys, so :math:`p(D) \ge \tau`).  With random weights
    :math:`a` on :math:`A` (a flat Dirichlet draw) and :math:`d = p|_D / p(D)`,

    .. math::  q = p + \tau(a - d) \ge 0, \qquad \textstyle\sum q = 1, \qquad
               TV(q, p) = \tfrac{\tau}{2}(\sum_A a + \sum_D d) = \tau,

    since :math:`A` and :math:`D` are disjoint and :math:`\tau d_i = \tau p_i/p(D) \le p_i`.
    """
    device = p_att.device
    p, tau, allowed = p_att.to("cpu", _F64), tau.to("cpu", _F64).clamp(min=0), allowed.to("cpu")
    rows, n = p.shape
    draws = torch.rand(rows, n, generator=generator, dtype=_F64)
    slack = 4 * torch.finfo(_F64).eps  # tau = 1 - min p (the edge) must keep the least likely key feasible
    feasible = allowed & (p <= 1 - tau.unsqueeze(-1) + slack)
    least = torch.where(allowed, p, torch.inf).argmin(-1, keepdim=True)
    feasible.scatter_(-1, least, feasible.gather(-1, least) | allowed.gather(-1, least))
    order = torch.where(feasible, draws, 2.0).argsort(-1)  # feasible keys first, in random order
    cumulative = p.gather(-1, order).cumsum(-1)
    position = torch.arange(n).expand(rows, n)
    n_allowed = allowed.sum(-1, keepdim=True)
    length = 1 + (torch.rand(rows, 1, generator=generator, dtype=_F64) * (n_allowed - 1).clamp(min=0)).long()
    prefix = (position < length) & (position < feasible.sum(-1, keepdim=True))
    prefix &= cumulative <= 1 - tau.unsqueeze(-1) + slack  # a prefix, as the cumulative sum grows
    prefix[:, 0] |= feasible.gather(-1, order[:, :1]).squeeze(-1)  # at least one acceptor, whatever the rounding
    acceptors = torch.zeros_like(allowed).scatter(-1, order, prefix)
    donors = allowed & ~acceptors
    weights = torch.where(acceptors, -torch.log1p(-torch.rand(rows, n, generator=generator, dtype=_F64)), 0.0)
    a = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    donor_mass = torch.where(donors, p, 0.0).sum(-1, keepdim=True)
    d = torch.where(donors, p, 0.0) / donor_mass.clamp_min(1e-300)
    moved = (tau > 0) & acceptors.any(-1) & (donor_mass.squeeze(-1) > 0)
    q = p + tau.unsqueeze(-1) * (a - d)
    return torch.where(moved.unsqueeze(-1), q.clamp_min(0), p).to(device)


def site_substitutes(site: SiteCapture, kinds, alpha: float, space: str, rtol: float, seed: int,
                     example_ids, solved: tuple[DualProblems, DualSolution] | None = None) -> dict[str, Substitute]:
    """The substitute weights of ``site`` for each of ``kinds`` (module docstring), from its problems in
    ``space`` at ``alpha`` (one solve shared by ``exact`` and ``null``).  ``solved``: the site's problems and
    their solution as the rows' solver computed them (:meth:`probe.batch.rows.BatchSolver.solved`), which
    ``exact`` and ``null`` then take instead of solving again."""
    b, h, q, k = site.shape
    kinds = tuple(kinds)
    own = site.model_probs.to(_F64)
    real = site.query_mask[:, None, :, None].expand(b, h, q, 1)

    def shaped(rows):  # (g, m, n) -> (b, h, q, k); padding queries keep the model's weights
        return torch.where(real, rows.reshape(b, h, q, k).nan_to_num(0.0), own)

    none = torch.zeros(b, dtype=torch.long)
    no_bound = torch.full((b,), float("nan"), dtype=_F64)
    if any(kind in ("exact", "null") for kind in kinds):
        problems, solution = _solve(site, alpha, space, rtol) if solved is None else solved
        per_example = lambda x: x.reshape(b, -1)  # noqa: E731  (groups are example-major in both spaces)
        active = per_example(problems.active)
        stats = dict(  # on the CPU, like the records they go to
            solver_rows=active.sum(-1).cpu(),
            not_converged=(active & ~per_example(solution.converged)).sum(-1).cpu(),
            max_relative_error_bound=torch.where(
                active, per_example(solution.error_bound / solution.lambda_norm), -torch.inf).amax(-1).cpu(),
        )
    else:
        problems = site_problems(site, alpha, space, gram=False)  # its factor only
        solution, stats = None, None
    log_pref = problems.log_preference.expand_as(problems.logits)
    p_att = None
    if any(kind in ("model", "null") for kind in kinds):
        p_att = derived.model_attention(problems.logits, log_pref, alpha, active=problems.active)
    out = {}
    for kind in kinds:
        entry = dict(solver_rows=none, not_converged=none, max_relative_error_bound=no_bound)
        if kind == "model":
            weights = shaped(p_att)
        elif kind == "exact":
            weights, entry = shaped(solution.attention), stats
        elif kind == "second-order":
            point, _ = second_order.second_order_point(problems.factor, problems.logits, log_pref, alpha,
                                                  active=problems.active)
            # log p(lambda_2) = log u + alpha s + A y_2 (+ const): <t_i, alpha z + V y_2> = alpha s_i + (A y_2)_i
            theta = torch.add(log_pref, problems.logits, alpha=alpha)
            theta += torch.bmm(point, problems.factor.transpose(1, 2))
            weights = shaped(torch.softmax(theta.masked_fill(~(log_pref > -torch.inf), -torch.inf), dim=-1))
        elif kind == "null":
            tau = 0.5 * (solution.attention - p_att).abs().sum(-1)  # attention_tv of the rows
            allowed = (log_pref > -torch.inf).reshape(b, h * q, k)
            rows_p, rows_tau = p_att.reshape(b, h * q, k), tau.reshape(b, h * q)
            drawn = [
                null_attention(rows_p[i].nan_to_num(0.0), rows_tau[i].nan_to_num(0.0), allowed[i],
                               example_generator(seed, example, site_name(site.attention_type, site.layer), "null"))
                for i, example in enumerate(example_ids)
            ]
            weights, entry = shaped(torch.stack(drawn)), stats
        else:
            raise ValueError(f"unknown substitute {kind!r}")
        out[kind] = Substitute(weights=weights, **entry)
    return out


