"""probe.solve.exact: the KL problem's exact posterior p* as a differentiable layer.

References are independent of the code under test: CVXPY (Clarabel, the primal with the posterior as a
variable, polished by Newton's method on the primal) and SciPy's L-BFGS on the dual for p*; central finite
differences (``torch.autograd.gradcheck`` in float64) for the gradients; the rows' key-space problems built
by probe.batch.rows from a captured site, for the conventions.  Small instances only (seconds).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import probe.solve.exact as exact_module
from probe.core.errors import ProbeError
from probe.solve.exact import ExactCertificate, exact_attention
from probe.solve.reference import cvxpy_primal, lbfgs_dual

F64 = torch.float64
TIGHT = dict(rtol=1e-14, atol=1e-15)  # the forward far below the finite differences' resolution


def instance(batch, n, d, scale=1.0, seed=0, masked=()):
    """Templates (batch, n, d), evidence (batch, d), log preference (batch, n) with ``-inf`` at ``masked``."""
    g = torch.Generator().manual_seed(seed)
    T = scale * torch.randn(batch, n, d, generator=g, dtype=F64)
    z = torch.randn(batch, d, generator=g, dtype=F64)
    ell = torch.randn(batch, n, generator=g, dtype=F64)
    for key in masked:
        ell[:, key] = -math.inf
    return T, z, ell


def softmax_p(ell, T, lam):
    """p = softmax(ell + T lam) in numpy (the posterior at lam)."""
    theta = np.asarray(ell) + np.asarray(T) @ lam
    keep = np.isfinite(theta)
    p = np.zeros_like(theta)
    w = np.exp(theta[keep] - theta[keep].max())
    p[keep] = w / w.sum()
    return p


# --------------------------------------------------------------------------- p* against independent solvers
@pytest.mark.parametrize("n,d,alpha,scale,masked", [
    (6, 3, 1.0, 1.0, ()),  # more keys than dimensions: the dual in its own coordinates
    (4, 9, 1.0, 1.0, ()),  # more dimensions than keys: the reduced form
    (7, 5, 0.4, 1.5, (1, 4)),  # masked keys
    (5, 6, 3.0, 0.7, (0,)),
    (1, 4, 1.0, 1.0, ()),  # one key: p* = 1
])
def test_posterior_matches_cvxpy_and_lbfgs(n, d, alpha, scale, masked):
    T, z, ell = instance(3, n, d, scale, seed=n * 10 + d, masked=masked)
    p, certificate = exact_attention(T, z, ell, alpha, return_certificate=True, rtol=1e-12)
    assert p.shape == (3, n) and p.dtype == F64
    assert certificate.not_converged == 0 and certificate.problems == 3
    for j in range(3):
        _, p_ref = cvxpy_primal(T[j].numpy(), z[j].numpy(), ell[j].numpy(), alpha)
        np.testing.assert_allclose(p[j].numpy(), p_ref, rtol=0, atol=1e-9)
        lam, _ = lbfgs_dual(T[j].numpy(), z[j].numpy(), ell[j].numpy(), alpha)  # good to about 1e-9 only
        np.testing.assert_allclose(p[j].numpy(), softmax_p(ell[j].numpy(), T[j].numpy(), lam), rtol=0, atol=1e-7)
    for key in masked:
        assert bool((p[:, key] == 0).all())
    torch.testing.assert_close(p.sum(-1), torch.ones(3, dtype=F64), rtol=0, atol=1e-14)


def test_peaked_and_ill_conditioned_posteriors_match_cvxpy():
    T, z, ell = instance(2, 6, 4, scale=4.0, seed=7)
    ell = 6 * ell  # a peaked preference and large logits: p* nearly one-hot, entries down to 1e-30
    T[:, 3] = T[:, 2] + 1e-6 * torch.randn(2, 4, dtype=F64)  # two nearly equal templates: G nearly singular
    p = exact_attention(T, z, ell, 2.0, rtol=1e-12)
    for j in range(2):
        _, p_ref = cvxpy_primal(T[j].numpy(), z[j].numpy(), ell[j].numpy(), 2.0)
        np.testing.assert_allclose(p[j].numpy(), p_ref, rtol=0, atol=1e-9)
    assert float(p.max()) > 0.9 and float(p.min()) < 1e-20


def test_posterior_is_the_rows_key_space_solution():
    """The exact posterior of templates k / sqrt(d') and evidence q (a ViT layer's ExactAttention) is the
    rows' solution of a captured site in probe's key space (probe.batch.rows), padding keys excluded."""
    from probe.batch.problems import solve_sites
    from probe.capture.adapters import SiteCapture

    g = torch.Generator().manual_seed(3)
    b, h, q, k, dh = 2, 2, 3, 5, 4
    queries, keys = torch.randn(b, h, q, dh, generator=g, dtype=F64), torch.randn(b, h, k, dh, generator=g, dtype=F64)
    key_mask = torch.ones(b, k, dtype=torch.bool)
    key_mask[1, 3:] = False
    log_preference = torch.zeros(b, 1, 1, k, dtype=F64).masked_fill(~key_mask[:, None, None, :], -math.inf)
    site = SiteCapture(
        attention_type="self", layer=0, queries=queries, keys=keys, values=keys, logit_scale=1 / math.sqrt(dh),
        log_preference=log_preference, query_mask=torch.ones(b, q, dtype=torch.bool), key_mask=key_mask,
        query_ids=torch.zeros(b, q, dtype=torch.long), model_probs=torch.zeros(b, h, q, k),
    )
    (rows,) = solve_sites([site], alpha=1.0, rtol=1e-12, space="key")
    p = exact_attention((keys / math.sqrt(dh)).unsqueeze(2), queries, log_preference, **TIGHT)  # (b, h, q, k)
    torch.testing.assert_close(p.reshape(rows.attention.shape), rows.attention, rtol=0, atol=1e-10)
    # and softmax attention is the approximation lambda = alpha z of the same problem
    softmax = torch.softmax(queries @ keys.transpose(-1, -2) / math.sqrt(dh) + log_preference, dim=-1)
    assert float((p - softmax).abs().max()) > 1e-3


def test_leading_dimensions_broadcast_and_float32():
    T, z, ell = instance(2, 5, 3, seed=11)
    queries = torch.randn(2, 4, 3, dtype=F64)  # four evidences per template set
    p = exact_attention(T.unsqueeze(1), queries, ell.unsqueeze(1))
    assert p.shape == (2, 4, 5)
    for i in range(4):
        torch.testing.assert_close(p[:, i], exact_attention(T, queries[:, i], ell), rtol=0, atol=1e-12)
    p32 = exact_attention(T.float().unsqueeze(1), queries.float(), ell.float().unsqueeze(1))
    assert p32.dtype == torch.float32
    rounded = [x.float().double() for x in (T.unsqueeze(1), queries, ell.unsqueeze(1))]  # the same inputs, in float64
    torch.testing.assert_close(p32.double(), exact_attention(*rounded))


# --------------------------------------------------------------------------- gradients: finite differences
def check_gradients(T, z, ell, alpha, mask=None):
    """gradcheck in float64 of a scalar-free map (T, z, ell) -> p*, to 1e-5 relative; masked keys stay -inf
    (finite differences cannot move an infinite input) and their template rows must get zero gradients."""
    T, z, ell = (x.clone().requires_grad_(True) for x in (T, z, ell))

    def f(T, z, ell):
        if mask is not None:
            ell = torch.where(mask, ell, torch.tensor(-math.inf, dtype=F64))
        return exact_attention(T, z, ell, alpha, **TIGHT)

    assert torch.autograd.gradcheck(f, (T, z, ell), eps=1e-6, atol=1e-8, rtol=1e-5)
    return f, (T, z, ell)


@pytest.mark.parametrize("n,d,alpha", [(6, 3, 1.0), (3, 7, 1.0), (5, 5, 0.3), (4, 6, 4.0)])
def test_gradients_match_finite_differences(n, d, alpha):
    check_gradients(*instance(2, n, d, seed=n + d), alpha)


def test_gradients_with_masked_keys():
    T, z, ell = instance(2, 6, 3, seed=5)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 1] = mask[1, 4] = mask[1, 5] = False
    f, inputs = check_gradients(T, z, ell, 1.0, mask)
    out = f(*inputs)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), inputs)
    assert bool((grads[0][~mask] == 0).all()) and bool((grads[2][~mask] == 0).all())
    # on its own, a -inf entry of log_preference gets a zero gradient too (not NaN)
    ell_inf = torch.where(mask, ell, torch.tensor(-math.inf, dtype=F64)).requires_grad_(True)
    p = exact_attention(T, z, ell_inf)
    (grad,) = torch.autograd.grad((p * torch.randn_like(p)).sum(), ell_inf)
    assert bool(torch.isfinite(grad).all()) and bool((grad[~mask] == 0).all())


def test_gradients_with_one_key_are_zero():
    T, z, ell = instance(3, 1, 4, seed=2)
    f, inputs = check_gradients(T, z, ell, 1.0)
    grads = torch.autograd.grad(f(*inputs).sum() * 2.5, inputs)
    assert all(bool((g == 0).all()) for g in grads)


def test_gradients_of_peaked_and_ill_conditioned_instances():
    T, z, ell = instance(2, 5, 4, scale=3.0, seed=9)
    ell = 6 * ell  # peaked: the largest p* above 0.95, the smallest below 1e-10
    p = exact_attention(T, z, ell)
    assert float(p.max()) > 0.95 and float(p.min()) < 1e-10
    check_gradients(T, z, ell, 1.0)
    T, z, ell = instance(2, 5, 4, seed=10)
    T[:, 4] = T[:, 3] + 1e-4 * torch.randn(2, 4, dtype=F64)  # nearly duplicate templates
    check_gradients(T, z, ell, 5.0)  # and a large alpha: cond(K) grows with alpha


def test_the_backward_is_one_linear_solve_and_no_unrolled_iterations(monkeypatch):
    calls = []
    original = exact_module.solve_spd_reduced

    def counting(factor, weights, rhs, *args, **kwargs):
        calls.append(rhs.shape)
        return original(factor, weights, rhs, *args, **kwargs)

    monkeypatch.setattr(exact_module, "solve_spd_reduced", counting)
    T, z, ell = (x.requires_grad_(True) for x in instance(7, 6, 3, seed=1))
    p, certificate = exact_attention(T, z, ell, return_certificate=True)
    assert certificate.max_iterations > 1  # the forward took several Newton steps...
    assert p.grad_fn.next_functions[0][0].name().startswith("_ExactPosterior")  # ...none of them in the graph
    p.sum().backward()
    assert calls == [torch.Size([7, 1, 3])]  # one system per problem, all in one batched solve


def test_float32_gradients_match_float64():
    T, z, ell = instance(2, 5, 3, seed=4)
    grads = {}
    for dtype in (torch.float32, F64):
        inputs = [x.to(dtype).requires_grad_(True) for x in (T, z, ell)]
        p = exact_attention(*inputs)
        p.pow(2).sum().backward()
        grads[dtype] = [x.grad for x in inputs]
        assert all(g.dtype == dtype for g in grads[dtype])
    for a, b in zip(grads[torch.float32], grads[F64]):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- certificate and bad inputs
def test_certificate_counts_problems_stopped_early():
    T, z, ell = instance(4, 8, 3, scale=3.0, seed=12)
    p, certificate = exact_attention(T, z, ell, 2.0, return_certificate=True, max_iter=1)
    assert isinstance(certificate, ExactCertificate) and certificate.error_bound.shape == (4,)
    assert certificate.not_converged > 0 and certificate.max_iterations == 1
    lam_error = []
    for j in range(4):  # the bound holds for the point returned, against an independent optimum
        lam_ref, p_ref = cvxpy_primal(T[j].numpy(), z[j].numpy(), ell[j].numpy(), 2.0)
        lam_hat = 2.0 * (T[j].T @ (torch.softmax(ell[j], -1) - p[j]) + z[j]).numpy()
        lam_error.append(np.linalg.norm(lam_hat - lam_ref))
    assert np.all(np.array(lam_error) <= certificate.error_bound.numpy() * (1 + 1e-9))
    summary = certificate.summary()
    assert summary["not_converged"] == certificate.not_converged and summary["problems"] == 4
    assert summary["max_error_bound"] == pytest.approx(float(certificate.error_bound.max()))


@pytest.mark.parametrize("args,words", [
    ((torch.zeros(3, 2), torch.zeros(2), torch.zeros(4)), "log_preference in n"),
    ((torch.zeros(3, 2), torch.zeros(5), torch.zeros(3)), "evidence must end in d"),
    ((torch.zeros(2, 3, 2), torch.zeros(4, 2), torch.zeros(3)), "do not broadcast"),
    ((torch.zeros(3, 2, dtype=torch.long), torch.zeros(2), torch.zeros(3)), "floating-point"),
    ((torch.full((3, 2), math.nan), torch.zeros(2), torch.zeros(3)), "templates holds NaN"),
    ((torch.zeros(3, 2), torch.zeros(2), torch.tensor([0.0, math.inf, 0.0])), "NaN or \\+inf"),
    ((torch.zeros(3, 2), torch.zeros(2), torch.full((3,), -math.inf)), "at least one key"),
    ((torch.zeros(2), torch.zeros(2), torch.zeros(3)), "the shapes are"),
])
def test_bad_inputs_give_one_clear_error(args, words):
    with pytest.raises(ProbeError, match=words):
        exact_attention(*args)


def test_bad_alpha():
    with pytest.raises(ProbeError, match="alpha must be a positive number"):
        exact_attention(torch.zeros(3, 2), torch.zeros(2), torch.zeros(3), alpha=0.0)
