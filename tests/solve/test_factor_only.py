"""Problems given by a factor of their Gram matrix only (``gram=None``), the templates themselves
included: the solver and the derived quantities against CVXPY, closed forms and the Gram path, on
random problems with more keys than dimensions and on rank-deficient templates; and no ``n x n``
tensor anywhere on the way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.distance import pdist
from torch.utils._python_dispatch import TorchDispatchMode

from probe.solve import derived, second_order
from probe.solve.dual import DualProblems, solve_dual
from probe.solve.gram import factor_from_templates, factor_gram
from probe.solve.reference import cvxpy_primal

F64 = torch.float64


def instance(n, d, m, *, rank=None, duplicates=0, zeros=0, scale=0.7, seed=0):
    """Templates T (n, d) of rank ``rank`` (with ``duplicates`` copies of the first), evidences (m, d), log u."""
    rng = np.random.default_rng(seed)
    T = rng.normal(size=(n, d)) * scale
    if rank is not None:
        T = rng.normal(size=(n, rank)) @ rng.normal(size=(rank, d)) * scale / np.sqrt(rank)
    if duplicates:
        T[1 : 1 + duplicates] = T[0]
    Z = rng.normal(size=(m, d)) * scale
    log_u = rng.normal(size=(m, n))
    for row in log_u:
        row[rng.permutation(n)[:zeros]] = -np.inf
    return T, Z, log_u


def problems_of(T, Z, log_u, alpha, *, gram: bool, factor=None):
    T, Z = torch.as_tensor(T, dtype=F64), torch.as_tensor(Z, dtype=F64)
    return DualProblems(
        gram=(T @ T.T)[None] if gram else None,
        logits=(Z @ T.T)[None],
        log_preference=torch.as_tensor(log_u, dtype=F64)[None],
        evidence_sqnorm=(Z * Z).sum(-1)[None],
        alpha=alpha,
        factor=factor,
    )


@pytest.mark.parametrize("n,d,rank", [(6, 20, None), (20, 6, None), (12, 12, None), (30, 8, 3), (8, 30, 5)])
def test_factor_from_templates_factors_the_gram_matrix(n, d, rank):
    T = torch.as_tensor(instance(n, d, 1, rank=rank)[0])
    batched = torch.stack([T, 2 * T]).unsqueeze(0)  # (1, 2, n, d): any leading axes
    A = factor_from_templates(batched)
    assert A.shape == (1, 2, n, min(n, d)) and A.dtype == F64
    torch.testing.assert_close(A @ A.transpose(-1, -2), batched @ batched.transpose(-1, -2), rtol=0, atol=1e-12)
    if d <= n:
        assert torch.equal(A[0, 0], T)  # the templates themselves: the dual in its own coordinates


CASES = [  # (n, d, m, alpha, rank, duplicates, zeros)
    (40, 8, 4, 1.0, None, 0, 0),  # more keys than dimensions
    (64, 16, 3, 0.3, None, 0, 5),
    (30, 10, 3, 3.0, 4, 0, 0),  # rank-deficient templates (rank 4 of 10 columns)
    (25, 6, 3, 1.0, None, 5, 3),  # duplicate templates
    (12, 40, 3, 1.0, None, 0, 2),  # more dimensions than keys: QR-reduced
]


@pytest.mark.parametrize("n,d,m,alpha,rank,duplicates,zeros", CASES)
def test_solver_given_the_templates_matches_cvxpy_and_the_gram_path(n, d, m, alpha, rank, duplicates, zeros):
    T, Z, log_u = instance(n, d, m, rank=rank, duplicates=duplicates, zeros=zeros, seed=n + d)
    factor = factor_from_templates(torch.as_tensor(T))[None]
    solution = solve_dual(problems_of(T, Z, log_u, alpha, gram=False, factor=factor))
    by_gram = solve_dual(problems_of(T, Z, log_u, alpha, gram=True))
    assert bool(solution.converged.all()) and bool(by_gram.converged.all())
    bound = solution.error_bound[0] + by_gram.error_bound[0]
    for j in range(m):
        lam_ref, p_ref = cvxpy_primal(T, Z[j], log_u[j], alpha)
        lam = alpha * Z[j] + solution.coefficients[0, j].numpy() @ T  # lambda_hat in the full space
        assert np.linalg.norm(lam - lam_ref) <= 1e-7 * np.linalg.norm(lam_ref)
        assert solution.lambda_norm[0, j].item() == pytest.approx(np.linalg.norm(lam_ref), rel=1e-8)
        np.testing.assert_allclose(solution.attention[0, j].numpy(), p_ref, atol=1e-7)
        # the Gram path: the same lambda within both certificates
        lam_gram = alpha * Z[j] + by_gram.coefficients[0, j].numpy() @ T
        assert np.linalg.norm(lam - lam_gram) <= bound[j].item() + 1e-12
    torch.testing.assert_close(solution.rel_deviation, by_gram.rel_deviation, rtol=0, atol=1e-8)


def test_the_templates_themselves_as_factor_in_several_groups_with_inactive_rows():
    """A = T directly (no helper), two groups of different templates, padding queries and keys."""
    rng = np.random.default_rng(7)
    T = torch.as_tensor(rng.normal(size=(2, 50, 8)) * 0.8)
    Z = torch.as_tensor(rng.normal(size=(2, 5, 8)))
    log_u = torch.zeros(2, 5, 50, dtype=F64)
    log_u[1, :, -10:] = -torch.inf
    active = torch.ones(2, 5, dtype=torch.bool)
    active[0, -1] = False
    problems = DualProblems(
        gram=None, logits=Z @ T.transpose(1, 2), log_preference=log_u, evidence_sqnorm=(Z * Z).sum(-1),
        active=active, factor=T,
    )
    solution = solve_dual(problems)
    assert bool(solution.converged[active].all()) and bool(solution.rel_deviation[~active].isnan().all())
    for g, j in active.nonzero().tolist():
        lam_ref, _ = cvxpy_primal(T[g].numpy(), Z[g, j].numpy(), log_u[g, j].numpy())
        lam = Z[g, j].numpy() + solution.coefficients[g, j].numpy() @ T[g].numpy()
        assert np.linalg.norm(lam - lam_ref) <= 1e-7 * np.linalg.norm(lam_ref)


def second_order_closed_form(T, z, log_u, alpha):
    r"""lambda_2 = alpha (I + alpha Sigma_u)^{-1} z in the full space, from the definitions."""
    u = np.exp(log_u - np.logaddexp.reduce(log_u))
    mean = T.T @ u
    sigma = (T * u[:, None]).T @ T - np.outer(mean, mean)
    return alpha * np.linalg.solve(np.eye(len(z)) + alpha * sigma, z)


@pytest.mark.parametrize("n,d,m,alpha,rank,duplicates,zeros", CASES)
def test_derived_quantities_given_the_templates_match_closed_forms_and_the_gram_path(
    n, d, m, alpha, rank, duplicates, zeros
):
    T, Z, log_u = instance(n, d, m, rank=rank, duplicates=duplicates, zeros=zeros, seed=3 * n + d)
    factor = factor_from_templates(torch.as_tensor(T))[None]
    problems = problems_of(T, Z, log_u, alpha, gram=False, factor=factor)
    solution = solve_dual(problems)
    gram_problems = problems_of(T, Z, log_u, alpha, gram=True)
    gram_factor = factor_gram(gram_problems.gram)
    eps = solution.error_bound

    gram_solution = solve_dual(gram_problems)

    def deviation(a, solved):
        point, point_error = second_order.second_order_point(a, problems.logits, problems.log_preference, alpha)
        return second_order.second_order_deviation(solved.correction, point, solved.lambda_norm, solved.error_bound,
                                                   point_error)

    value, bound = deviation(factor, solution)
    value_gram, bound_gram = deviation(gram_factor, gram_solution)
    for j in range(m):
        lam_ref, _ = cvxpy_primal(T, Z[j], log_u[j], alpha)
        expected = np.linalg.norm(lam_ref - second_order_closed_form(T, Z[j], log_u[j], alpha)) / np.linalg.norm(lam_ref)
        assert abs(value[0, j].item() - expected) <= bound[0, j].item() + 1e-7
    # two solutions, each within its certificate: the values within the sum of their bounds
    assert bool(((value - value_gram).abs() <= bound + bound_gram).all())

    p_att = derived.model_attention(problems.logits, problems.log_preference, alpha)
    values = torch.as_tensor(np.random.default_rng(n).normal(size=(1, 1, n, 5)))
    (tv, tau), (output, output_bound) = derived.attention_deviations(
        solution.attention, p_att, values, None, eps, factor=factor
    )
    (tv_gram, tau_gram), (output_gram, output_bound_gram) = derived.attention_deviations(
        solution.attention, p_att, values, gram_problems.gram, eps
    )
    assert torch.equal(tv, tv_gram) and torch.equal(output, output_gram)
    torch.testing.assert_close(tau, tau_gram, rtol=1e-9, atol=0)
    torch.testing.assert_close(output_bound, output_bound_gram, rtol=1e-9, atol=0)
    # tau = tanh(D eps / 8) with D the spread of the templates in use: the two largest distances from their
    # mean (every key carries probability somewhere here, except those excluded in every row)
    in_use = np.isfinite(log_u).any(0)
    np.testing.assert_allclose(tau[0].numpy(), np.tanh(spread(T[in_use]) * eps[0].numpy() / 8), rtol=1e-9)
    tv_alone, tau_alone = derived.attention_tv(solution.attention, p_att, None, eps, factor=factor)
    assert torch.equal(tv_alone, tv) and torch.equal(tau_alone, tau)


def spread(T: np.ndarray) -> float:
    """The sum of the two largest distances of the rows of ``T`` from their mean (0 for one row)."""
    distances = np.sort(np.linalg.norm(T - T.mean(0), axis=1))[::-1]
    return float(distances[:2].sum()) if len(T) > 1 else 0.0


@pytest.mark.parametrize("n, d, duplicates, shift", [(1, 3, 0, 0.0), (2, 5, 0, 0.0), (30, 4, 0, 0.0),
                                                     (30, 4, 0, 50.0), (12, 40, 5, 0.0), (64, 8, 20, 3.0)])
def test_the_tv_bound_uses_a_spread_between_the_diameter_and_twice_it(n, d, duplicates, shift):
    """The bound's D, read back from tau = tanh(D eps / 8), is the templates' spread, whatever their offset
    from the origin, and lies between their diameter (pairs of keys, scipy) and twice it, from the factor and
    from the Gram matrix alike."""
    T, Z, log_u = instance(n, d, 3, duplicates=min(duplicates, n - 1), seed=n + d)
    T = T + shift  # the spread is taken about the templates' mean: a common offset changes nothing
    eps_value = 1e-6
    for gram in (False, True):
        factor = None if gram else torch.as_tensor(T)[None]
        problems = problems_of(T, Z, log_u, 1.0, gram=gram, factor=factor)
        solution = solve_dual(problems)
        p_att = derived.model_attention(problems.logits, problems.log_preference, 1.0)
        eps = torch.full_like(solution.error_bound, eps_value)
        _, tau = derived.attention_tv(solution.attention, p_att, problems.gram, eps, factor=factor)
        bound_d = 8 * np.arctanh(tau[0, 0].item()) / eps_value
        in_use = np.isfinite(log_u).any(0)
        diameter = pdist(T[in_use]).max() if in_use.sum() > 1 else 0.0
        assert bound_d == pytest.approx(spread(T[in_use]), rel=1e-6, abs=1e-9)
        assert diameter * (1 - 1e-6) <= bound_d <= 2 * diameter * (1 + 1e-6) + 1e-9


class _LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest, self.operator = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.operator = tensor.numel(), func
        return out


def test_long_context_forms_no_n_by_n_tensor():
    """n = 4096 keys of width 64, as a long context's key space: the solve and every derived quantity
    hold nothing near n x n (16.8M entries); the largest tensor is far below it."""
    n, d, m = 4096, 64, 16
    generator = torch.Generator().manual_seed(0)
    T = torch.randn(1, n, d, generator=generator, dtype=F64) / 8
    Z = torch.randn(1, m, d, generator=generator, dtype=F64)
    problems = DualProblems(
        gram=None, logits=Z @ T.transpose(1, 2), log_preference=torch.zeros(1, 1, n, dtype=F64).expand(1, m, n),
        evidence_sqnorm=(Z * Z).sum(-1), factor=factor_from_templates(T),
    )
    values = torch.randn(1, 1, n, d, generator=generator, dtype=F64)
    with _LargestTensor() as watch:
        solution = solve_dual(problems, workers=0)
        point, point_error = second_order.second_order_point(problems.factor, problems.logits, problems.log_preference, 1.0)
        second_order.second_order_deviation(
            solution.correction, point, solution.lambda_norm, solution.error_bound, point_error
        )
        p_att = derived.model_attention(problems.logits, problems.log_preference, 1.0)
        derived.attention_deviations(solution.attention, p_att, values, None, solution.error_bound, factor=problems.factor)
    assert bool(solution.converged.all())
    assert watch.largest <= n * n // 16, f"{watch.operator} returned {watch.largest} entries"


def test_problems_without_templates_are_refused():
    T, Z, log_u = instance(5, 3, 1)
    with pytest.raises(ValueError, match="gram, factor"):
        solve_dual(problems_of(T, Z, log_u, 1.0, gram=False))
    wrong = problems_of(T, Z, log_u, 1.0, gram=False, factor=torch.zeros(1, 4, 3, dtype=F64))
    with pytest.raises(ValueError, match="inconsistent shapes"):
        solve_dual(wrong)
    with pytest.raises(ValueError, match="gram or factor"):
        derived.attention_tv(torch.ones(1, 1, 5), torch.ones(1, 1, 5), None, torch.ones(1, 1))
