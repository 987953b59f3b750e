"""The solver's answers on the problems of real and family models, against the previous solver
(tests/support/previous_solver.py, float64 directions, its own eigendecomposition): the real MiniLM,
the real all-mpnet-base-v2, a random T5 (position bias, cross attention) and the grouped-query Llama of
the family checks, every site and every space; every row certified by both and the two within what
their certificates allow.  The second-order deviation from the solver's correction against the same
quantity formed from its coefficients in the previous way."""

from __future__ import annotations

import pytest
import torch

from probe.batch.problems import site_problems
from probe.capture.loading import load_model
from probe.solve import second_order
from probe.solve.dual import factor_gram, solve_dual

from ..support import families, previous_solver
from ..support.family_checks import real_model_dir
from ..support.solver_problems import agree, as_previous

pytestmark = pytest.mark.slow


def model_sites(model_dir, texts, targets=None, max_length=48):
    loaded = load_model(str(model_dir), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, targets, max_length)
    return loaded.adapter.sites(loaded.model, inputs)


def check_sites(sites):
    checked = 0
    for site in sites:
        for space in site.spaces:
            problems = site_problems(site, 1.0, space)
            problems.factor = factor_gram(problems.gram)
            new = solve_dual(problems)
            old = previous_solver.solve_dual(as_previous(problems), direction_dtype=torch.float64)
            agree(new, old, problems.active)
            # the correction A^T c the solver returns is the one its coefficients give
            point, point_error = second_order.second_order_point(problems.factor, problems.logits, problems.log_preference,
                                                           1.0, problems.active)
            value, bound = second_order.second_order_deviation(new.correction, point, new.lambda_norm, new.error_bound,
                                                          point_error)
            from_coefficients = torch.bmm(old.coefficients.nan_to_num(), problems.factor).sub(point).norm(dim=-1)
            from_coefficients = from_coefficients / old.lambda_norm
            active = problems.active
            allowed = bound + 2 * old.error_bound / old.lambda_norm
            assert bool(((value - from_coefficients).abs() <= allowed)[active].all()), (site.layer, space)
            checked += int(active.sum())
    return checked


def test_real_minilm(minilm_dir):
    assert check_sites(model_sites(minilm_dir, families.CORPUS)) > 1000


def test_real_all_mpnet_base_v2():
    assert check_sites(model_sites(real_model_dir("all-mpnet-base-v2"), families.CORPUS[:3])) > 1000


def test_random_t5(tmp_path, minilm_dir):
    spec = families.spec("t5")
    model_dir = families.save_tiny(spec, tmp_path / "t5", minilm_dir)
    sites = model_sites(model_dir, families.SOURCES, families.TARGETS)
    assert {site.attention_type for site in sites} == {"encoder_self", "decoder_self", "cross"}
    assert check_sites(sites) > 100


def test_grouped_query_llama(tmp_path, minilm_dir):
    spec = families.spec("llama")
    model_dir = families.save_tiny(spec, tmp_path / "llama", minilm_dir)
    sites = model_sites(model_dir, families.CORPUS)
    assert sites[0].keys.shape[1] < sites[0].queries.shape[1]  # fewer key heads than query heads
    assert check_sites(sites) > 100
