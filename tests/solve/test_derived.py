"""Derived quantities (probe.solve.derived) against independent dense computations in the explicit template
space: the second-order prediction from Sigma_u formed from explicit templates, lambda* from CVXPY or
a dense Newton solver written here, softmaxes, outputs and entropies in numpy/scipy; and their certified
bounds against the true errors, also for solves stopped early and hard instances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy

from probe.solve.derived import (
    attention_deviations,
    attention_entropy,
    attention_quantities,
    attention_tv,
    model_attention,
    model_log_attention,
    output_deviation,
)
from probe.solve.dual import factor_gram, solve_dual
from probe.solve.reference import cvxpy_primal
from probe.solve.second_order import second_order_deviation, second_order_point

from ..support.dense_references import (
    TOL,
    dense_lambda_2,
    derive,
    instance,
    lifted,
    newton_dual,
    softmax,
)
from ..support.solver_problems import reduced

# ---------------------------------------------------------------- attention, output, entropy


def attention_case(heads=2, per_head=3, n=9, d=7, d_v=5, alpha=0.8, seed=5):
    """One group with `heads` heads of `per_head` rows each (head-major), values per head."""
    T, Z, log_u = instance(n, d, heads * per_head, scale=0.8, zeros=2, seed=seed)
    values = np.random.default_rng(seed + 1).normal(size=(heads, n, d_v)) + 2.0  # a common offset
    return T, Z, log_u, values, alpha


def test_attention_tv_output_and_entropy_match_numpy_on_cvxpy_solutions():
    T, Z, log_u, values, alpha = attention_case()
    problems = reduced(T, Z, log_u, alpha)
    derived = derive(problems, solve_dual(problems), values[None])
    p_att, entropy = derived["p_att"], derived["entropy"]
    (tv, tv_bound), (out, out_bound) = derived["tv"], derived["output"]
    per_head = len(Z) // len(values)
    for j in range(len(Z)):
        lam_star, _ = cvxpy_primal(T, Z[j], log_u[j], alpha)
        p_star = softmax(log_u[j] + T @ lam_star)
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        np.testing.assert_allclose(p_att[0, j].numpy(), p_model, rtol=0, atol=1e-14)
        assert tv[0, j].item() == pytest.approx(0.5 * np.abs(p_star - p_model).sum(), abs=TOL)
        v = values[j // per_head]
        expected = np.linalg.norm((p_star - p_model) @ v) / np.linalg.norm(p_model @ v)
        assert out[0, j].item() == pytest.approx(expected, abs=TOL)
        assert entropy[0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        assert derived["entropy from p"][0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        assert tv_bound[0, j].item() < 1e-7 and out_bound[0, j].item() < 1e-7
    # the pipeline's call computes both at once, with the same values and bounds
    for ours, theirs in zip(derived["together"], (derived["tv"], derived["output"])):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-15, atol=0)


def test_inactive_rows_are_nan_and_active_rows_unchanged():
    T, Z, log_u, values, alpha = attention_case(heads=1, per_head=4)
    log_u[2] = -np.inf  # a row with no key
    problems = reduced(T, Z, log_u, alpha)
    problems.active = torch.tensor([[True, False, True, True]])
    problems.logits[0, 1] = float("nan")  # whatever an inactive row holds
    derived = derive(problems, solve_dual(problems), values[None])
    outputs = {
        "point": derived["point"].isnan().all(-1),
        "point_error": derived["point_error"].isnan(),
        "p_att": derived["p_att"].isnan().all(-1),
        "entropy": derived["entropy"].isnan(),
    }
    for name in ("second_order", "tv", "output"):
        value, bound = derived[name]
        outputs[name], outputs[name + " bound"] = value.isnan(), bound.isnan()
    expected = torch.tensor([[False, True, True, False]])
    for name, nan in outputs.items():
        assert torch.equal(nan, expected), name
    alone = reduced(T, Z[[0, 3]], log_u[[0, 3]], alpha)
    point_alone, _ = second_order_point(factor_gram(alone.gram), alone.logits, alone.log_preference, alpha)
    torch.testing.assert_close(derived["point"][0, [0, 3]], point_alone[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("budget", [1, 1 << 28])
@pytest.mark.parametrize("templates", ["factor", "gram"])
def test_attention_quantities_tile_by_tile_are_those_of_the_whole_site(budget, templates):
    """attention_quantities, a row at a time (budget 1) or all at once, against model_log_attention,
    attention_deviations and attention_entropy on the whole site: the same values and bounds, bit for bit,
    with inactive rows (a row with no key, NaN logits) among three value heads in two groups."""
    heads, per_head, n, alpha = 3, 4, 9, 0.8
    groups = [attention_case(heads=heads, per_head=per_head, n=n, seed=seed) for seed in (5, 6)]
    for group in groups:
        group[2][2] = -np.inf  # a row with no key
    parts = [reduced(T, Z, log_u, alpha) for T, Z, log_u, _, _ in groups]
    problems = parts[0]
    for name in ("logits", "log_preference", "gram", "evidence_sqnorm"):
        setattr(problems, name, torch.cat([getattr(part, name) for part in parts]))
    problems.active = torch.ones(2, heads * per_head, dtype=torch.bool)
    problems.active[1, 5] = False
    problems.logits[1, 5] = float("nan")  # whatever an inactive row holds
    solution = solve_dual(problems)
    values = torch.as_tensor(np.stack([values for _, _, _, values, _ in groups]))
    factor = factor_gram(problems.gram)
    given = {"factor": factor} if templates == "factor" else {"gram": problems.gram}
    found = attention_quantities(solution.attention, problems.logits, problems.log_preference, alpha, values,
                                 solution.error_bound, active=problems.active, memory_budget_bytes=budget, **given)
    log_p = model_log_attention(problems.logits, problems.log_preference, alpha, problems.active)
    p_att = log_p.exp()
    expected = (*attention_deviations(solution.attention, p_att, values, problems.gram, solution.error_bound,
                                      factor=factor if templates == "factor" else None),
                attention_entropy(p_att, log_p))
    for got, want in zip((*found[0], *found[1], found[2]), (*expected[0], *expected[1], expected[2])):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert bool(found[0][0][1, 5].isnan()) and bool(found[0][0][0, 2].isnan())  # inactive rows: NaN
    assert bool(torch.isfinite(found[1][1][0, :2]).all())  # and bounds for the others


# ---------------------------------------------------------------- certified bounds


def hard_instances():
    """(T, Z, log_u, values, alpha): random, huge logits (~1e3), duplicate templates, zero preferences."""
    out = []
    for seed in range(12):
        rng = np.random.default_rng(1000 + seed)
        n = int(rng.integers(2, 16))
        d = int(rng.integers(1, 12))
        scale = [0.5, 2.0, 8.0, 30.0][seed % 4]
        alpha = [0.1, 1.0, 10.0][seed % 3]
        T, Z, log_u = instance(n, d, 4, scale=scale, duplicates=seed % 3, zeros=seed % 4, seed=seed)
        values = rng.normal(size=(2, n, 3)) * scale + rng.normal(size=3)
        out.append((T, Z, log_u, values, alpha))
    return out


def test_hard_instances_have_huge_logits_and_duplicates():
    logits = [np.abs(Z @ T.T).max() for T, Z, *_ in hard_instances()]
    assert max(logits) > 1e3
    assert any(len(np.unique(T, axis=0)) < len(T) for T, *_ in hard_instances())
    # a single Newton step leaves errors for the bounds to cover on most of them
    left = [(solve_dual(reduced(T, Z, lu, a), max_iter=1).error_bound[0].numpy() / np.linalg.norm(a * Z, axis=1)).max()
            for T, Z, lu, _, a in hard_instances()]
    assert sum(e > 1e-6 for e in left) >= 9


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("newton_steps,cg_rtol,path", [(1, 1e-2, "cg"), (3, 1e-6, "cg"), (100, 1e-12, "cg"),
                                                        (1, 1e-2, "direct"), (100, 1e-12, "direct"),
                                                        (100, 1e-12, "direct rows")])
def test_bounds_hold_against_exact_values(case, newton_steps, cg_rtol, path):
    """Every reported bound dominates the actual error against dense references, for solves stopped
    after 1 or 3 Newton steps and second-order solves stopped at a loose CG tolerance too (or solved by
    factorisation).  The references carry their own certified error (dense Newton: alpha ||grad D||),
    added to the slack."""
    T, Z, log_u, values, alpha = hard_instances()[case]
    problems = reduced(T, Z, log_u, alpha)
    derived = derive(problems, solve_dual(problems, max_iter=newton_steps), values[None], cg_rtol, path)
    lam_2s, point_error = lifted(T, Z, alpha, derived["factor"], derived["point"]), derived["point_error"]
    (second, second_bound), (tv, tv_bound), (out, out_bound) = (derived[k] for k in ("second_order", "tv", "output"))
    per_head = len(Z) // len(values)
    norms = np.linalg.norm(T, axis=1)
    for j in range(len(Z)):
        lam_ref, ref_error = newton_dual(T, Z[j], log_u[j], alpha)
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        rounding = 1e-12 * max(1.0, np.linalg.norm(lam_ref), np.linalg.norm(lam_2), alpha * np.linalg.norm(Z[j]))
        # lambda_2
        assert np.linalg.norm(lam_2s[j] - lam_2) <= point_error[0, j].item() + rounding
        # second-order deviation: the reference's own uncertainty is (1 + v) ref_error / (||lam|| - ref_error)
        lam_norm = np.linalg.norm(lam_ref)
        exact = np.linalg.norm(lam_ref - lam_2) / lam_norm
        slack = (2 * ref_error + 2 * rounding) * (1 + exact) / max(lam_norm - ref_error, 1e-300)
        assert abs(second[0, j].item() - exact) <= second_bound[0, j].item() + slack
        # attention: p* from the reference, p_att from the model's logits, both in numpy
        p_ref = softmax(log_u[j] + T @ lam_ref)
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        ref_tv = np.tanh(2 * norms.max() * (ref_error + rounding) / 4)  # TV(p_ref, p*) by the same lemma
        assert abs(tv[0, j].item() - 0.5 * np.abs(p_ref - p_model).sum()) <= tv_bound[0, j].item() + ref_tv + 1e-13
        v = values[j // per_head]
        scale = np.linalg.norm(p_model @ v)
        exact_out = np.linalg.norm((p_ref - p_model) @ v) / scale
        ref_out = 2 * ref_tv * np.abs(v).sum(1).max() / scale
        assert abs(out[0, j].item() - exact_out) <= out_bound[0, j].item() + ref_out + 1e-12


def test_bounds_are_attained_by_their_worst_cases():
    """Each bound is the exact worst case of its derivation, so none can be lowered: inputs built at
    that worst case (certified errors used in full, in the worst direction) make |value - true| equal
    the bound."""
    # second order, T = I (lambda = alpha z + c): lambda_hat overshoots ||lambda*|| by eps along e1,
    # lambda_2_hat undershoots lambda_2 by eps2, so the numerator shrinks by eps + eps2
    a, gap, eps, eps2, alpha = 2.0, 0.7, 0.05, 0.03, 1.0
    e1 = np.array([1.0, 0.0, 0.0])
    z = np.array([0.3, -0.2, 0.5])
    lam_star, lam_2 = a * e1, (a + gap) * e1
    lam_hat, lam_2_hat = lam_star + eps * e1, lam_2 - eps2 * e1

    def row(x):
        return torch.tensor(x, dtype=torch.float64)[None, None]

    value, bound = second_order_deviation(  # T = I: the factor's coordinates are the space's
        row(lam_hat - alpha * z), row(lam_2_hat - alpha * z), row(np.linalg.norm(lam_hat)),
        row(eps), row(eps2),
    )
    true = np.linalg.norm(lam_star - lam_2) / np.linalg.norm(lam_star)
    assert value.item() == pytest.approx((gap - eps - eps2) / (a + eps), rel=1e-14)
    assert abs(true - value.item()) == pytest.approx(bound.item(), rel=1e-12)

    # attention: two templates at +-D/2, the iterate eps/2 from lambda* along them, and p* placed where
    # the softmax lemma is tight (p*_1 = e^{-w/4} / (e^{w/4} + e^{-w/4}), w = D eps / 2); p_att = p*
    D, eps = 3.0, 0.4
    templates = np.array([[D / 2], [-D / 2]])
    w = D * eps / 2
    p_star = np.array([np.exp(-w / 4), np.exp(w / 4)]) / (np.exp(w / 4) + np.exp(-w / 4))
    p_hat = softmax(np.log(p_star) + templates[:, 0] * eps / 2)
    gram = torch.tensor(templates @ templates.T)[None]
    tv, tv_bound = attention_tv(row(p_hat), row(p_star), gram, row(eps))
    assert tv.item() == pytest.approx(tv_bound.item(), rel=1e-12)
    assert tv_bound.item() == pytest.approx(np.tanh(D * eps / 8), rel=1e-14)
    # output: values at c +- R e, so that sum_i (p_hat - p*)_i v_i = 2 TV R e
    centre, R = np.array([1.0, -2.0, 0.5]), 0.8
    values = np.stack([centre + R * np.array([0, 1.0, 0]), centre - R * np.array([0, 1.0, 0])])
    out, out_bound = output_deviation(row(p_hat), row(p_star), torch.tensor(values)[None, None], gram, row(eps))
    assert out.item() == pytest.approx(out_bound.item(), rel=1e-12)


def test_tv_bound_is_not_vacuous_on_early_stops():
    """On a solve stopped after two Newton steps the TV bound is well below 1 and above the error."""
    T, Z, log_u, _, alpha = attention_case(heads=1, per_head=4, alpha=1.0)
    problems = reduced(T, Z, log_u, alpha)
    solution = solve_dual(problems, max_iter=2)
    derived = derive(problems, solution)
    p_att, (tv, bound) = derived["p_att"], derived["tv"]
    errors = []
    for j in range(len(Z)):
        lam_ref, _ = newton_dual(T, Z[j], log_u[j], alpha)
        errors.append(abs(tv[0, j].item() - 0.5 * np.abs(softmax(log_u[j] + T @ lam_ref) - p_att[0, j].numpy()).sum()))
    assert np.all(np.array(errors) <= bound[0].numpy()) and float(bound.max()) < 0.1
    assert max(errors) > 1e-6  # really stopped early


# ---------------------------------------------------------------- the real MiniLM


#: the capture holds the queries the model multiplied (float32); the dense problems here compute z in
#: float64 from the hidden states, so the two agree to float32 rounding, not to the solver's accuracy
CAPTURED = {"rel": 1e-6, "abs": 1e-7}


def test_minilm_derived_quantities_match_dense_computation(minilm_dir):
    from probe.batch.problems import site_problems

    from ..support.bert_sites import captured, explicit_problem

    texts = ["The cat sat on the mat.", "Attention weights are the solution of a convex problem."]
    loaded, inputs, sites, reference = captured(minilm_dir, texts)
    mask = inputs["attention_mask"]
    chosen = [(0, 3, 0, 1), (2, 7, 1, 4), (5, 11, 1, 0)]  # (layer, head, example, query)
    alpha = 1.0
    for layer in sorted({c[0] for c in chosen}):
        site = sites[layer]
        problems = site_problems(site, alpha)
        solution = solve_dual(problems)
        module = loaded.model.encoder.layer[layer].attention.self
        hidden = reference.hidden_states[layer].double()
        heads, d_head = module.num_attention_heads, module.attention_head_size
        values = (hidden @ module.value.weight.double().T + module.value.bias.double()).detach()
        values = values.view(hidden.shape[0], hidden.shape[1], heads, d_head).transpose(1, 2)  # (b, H, n, d_v)
        derived = derive(problems, solution, values)
        (second, _), (tv, _), (out, _) = derived["second_order"], derived["tv"], derived["output"]
        entropy = derived["entropy"]
        q_len = site.shape[2]
        for layer_, head, example, query in chosen:
            if layer_ != layer:
                continue
            row = head * q_len + query
            assert bool(solution.converged[example, row])
            T, z, log_u = explicit_problem(loaded.model, reference.hidden_states, layer, head, example, query, mask)
            lam_star, _ = cvxpy_primal(T, z, log_u, alpha)
            lam_2 = dense_lambda_2(T, z, log_u, alpha)
            assert second[example, row].item() == pytest.approx(
                np.linalg.norm(lam_star - lam_2) / np.linalg.norm(lam_star), **CAPTURED
            )
            p_star = softmax(log_u + T @ lam_star)
            p_model = softmax(log_u + alpha * T @ z)
            keys = mask[example].numpy().astype(bool)
            assert tv[example, row].item() == pytest.approx(0.5 * np.abs(p_star - p_model).sum(), **CAPTURED)
            v = values[example, head].numpy()[keys]
            expected = np.linalg.norm((p_star - p_model) @ v) / np.linalg.norm(p_model @ v)
            assert out[example, row].item() == pytest.approx(expected, **CAPTURED)
            assert entropy[example, row].item() == pytest.approx(scipy_entropy(p_model), **CAPTURED)


@pytest.mark.parametrize("garbage", [np.inf, -np.inf, np.nan, 1e300])
def test_logits_at_excluded_keys_play_no_part(garbage):
    """Whatever a logit holds at a key the preference excludes (-inf in log u), the model's attention,
    its entropy and the second-order point are those of the dense computation."""
    T, Z, log_u, values, alpha = attention_case(heads=1, per_head=4)
    excluded = np.isinf(log_u)
    assert excluded.any()
    problems = reduced(T, Z, log_u, alpha)
    problems.logits[torch.as_tensor(excluded)[None]] = garbage
    derived = derive(problems, solve_dual(reduced(T, Z, log_u, alpha)), values[None])
    lam_2s = lifted(T, Z, alpha, derived["factor"], derived["point"])
    p_att = model_attention(problems.logits, problems.log_preference, alpha)  # the public helper alike
    for j in range(len(Z)):
        p_model = softmax(log_u[j] + alpha * T @ Z[j])
        np.testing.assert_allclose(derived["p_att"][0, j].numpy(), p_model, rtol=0, atol=1e-14)
        np.testing.assert_allclose(p_att[0, j].numpy(), p_model, rtol=0, atol=1e-14)
        assert derived["entropy"][0, j].item() == pytest.approx(scipy_entropy(p_model), abs=1e-12)
        lam_2 = dense_lambda_2(T, Z[j], log_u[j], alpha)
        assert np.linalg.norm(lam_2s[j] - lam_2) <= TOL * np.linalg.norm(lam_2)
