"""The solver's torch path as a GPU runs it, checked on the CPU: host syncs and operators of a call on
real-shaped problems (counted with torch.profiler by bench/gpu_ready.py's counter), the fixed schedule's
answers against an independent solver, its capture by torch.compile, the batched factorisation of
rank-deficient Gram matrices, and the host side (tiles from the device's free memory, a stride-0
preference moved as one row per group)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from probe.solve import fixed, native, newton_cg, tiles
from probe.solve.dual import DualProblems, factor_gram, solve_dual
from probe.solve.problems import shares_rows

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture
def torch_path(monkeypatch):
    """The solver's torch loops, as on a GPU: the compiled kernel off (its loaded state replaced)."""
    monkeypatch.setattr(native, "_state", {"kernel": None, "reason": "PROBE_NATIVE=0"})
    monkeypatch.delenv("PROBE_SCHEDULE", raising=False)


def as_previous(problems):
    from ..support import previous_solver

    return previous_solver.solve_dual(
        previous_solver.DualProblems(**{k: v for k, v in vars(problems).items() if k != "factor"}),
        direction_dtype=torch.float64)


def agree(new, old, active, slack=0.0):
    """Both certified and their rel_deviation within what the two certificates allow (each lambda_hat is
    within error_bound of lambda*; rel_deviation moves by at most 2 ||delta lambda|| / ||lambda||), plus
    ``slack`` for the rounding of ||lambda_hat|| itself, and within 1e-9."""
    assert bool(new.converged[active].all()) and bool(old.converged[active].all())
    difference = (new.rel_deviation - old.rel_deviation).abs()[active]
    allowed = (2 * (new.error_bound / new.lambda_norm + old.error_bound / old.lambda_norm) + 1e-15 + slack)[active]
    assert bool((difference <= allowed).all()), float((difference - allowed).max())
    assert float(difference.max()) <= 1e-9
    assert bool(torch.isnan(new.rel_deviation[~active]).all())


def _count_call(problems, **kwargs):
    import gpu_ready

    answer = {}
    counted = gpu_ready.count(lambda: answer.setdefault("solution", solve_dual(problems, workers=0, **kwargs)))
    return counted, answer["solution"]


def _bert_call(keys):
    import gpu_ready

    return gpu_ready.bert_group(keys, layers=2, layer=1)


@pytest.fixture(scope="module")
def bert_128():
    return _bert_call(128)


def test_one_call_on_a_bert_base_group_makes_three_syncs_and_few_operators(torch_path, monkeypatch, bert_128):
    """One example, one layer of a bert-base-shaped BERT, 12 heads x 128 queries, 128 keys: at most 3 host
    syncs and 400 operators, every problem certified, the answers those of the solver as it was before
    (tests/support/previous_solver.py) within 1e-9.  The adaptive iterations alone, as the solver ran before the
    fixed schedule, made about 70 syncs and 1,300 operators on the same call: the counter sees them."""
    problems = bert_128
    assert problems.logits.shape == (1, 1536, 128) and shares_rows(problems.log_preference)
    solve_dual(problems, workers=0)  # warm-up (TorchScript's first runs)
    counted, new = _count_call(problems)
    assert counted["syncs"] <= 3, counted
    assert counted["operators"] <= 400, counted
    old = as_previous(problems)
    # ||lambda_hat|| is formed from ||z||^2 + 2 s^T(u - p) + ||A^T(u - p)||^2, whose rounding (not covered by
    # the certificates) is about eps ||z||^2 / ||lambda||^2 relative
    rounding = 64 * torch.finfo(torch.float64).eps * (problems.evidence_sqnorm / new.lambda_norm**2)
    agree(new, old, torch.ones_like(new.converged), slack=rounding)
    monkeypatch.setenv("PROBE_SCHEDULE", "0")
    adaptive_counted, adaptive = _count_call(problems)
    assert adaptive_counted["syncs"] > 30 and adaptive_counted["operators"] > 800
    agree(new, adaptive, torch.ones_like(new.converged), slack=rounding)


@pytest.mark.slow
def test_the_full_bert_base_model_at_512_keys(torch_path):
    """The same at 512 keys, a layer of the 12-layer model: one tile, at most 3 syncs and 400 operators."""
    import gpu_ready

    problems = gpu_ready.bert_group(512)
    solve_dual(problems, workers=0)
    counted, new = _count_call(problems)
    assert counted["syncs"] <= 3 and counted["operators"] <= 400, counted
    assert bool(new.converged.all())


def random_groups(groups, per_group, n, d, template_scale, logit_std, seed, duplicate=False):
    generator = torch.Generator().manual_seed(seed)
    T = torch.randn(groups, n, d, generator=generator, dtype=torch.float64) * template_scale
    if duplicate:
        T[:, 1] = T[:, 0]  # duplicate templates: a rank-deficient Gram matrix
    Z = torch.randn(groups, per_group, d, generator=generator, dtype=torch.float64)
    Z *= logit_std / (template_scale * d**0.5)
    log_u = torch.randn(groups, per_group, n, generator=generator, dtype=torch.float64)
    log_u[:, :, -2:] = -torch.inf  # padding keys
    active = torch.ones(groups, per_group, dtype=torch.bool)
    active[:, -3:] = False  # padding queries
    return DualProblems(gram=T @ T.transpose(1, 2), logits=Z @ T.transpose(1, 2), log_preference=log_u,
                        evidence_sqnorm=(Z * Z).sum(-1), active=active)


@pytest.mark.parametrize("n,d,template_scale,logit_std", [(16, 384, 1 / 8, 2.0), (48, 32, 1 / 2, 8.0), (40, 24, 1.0, 3.0)])
def test_the_fixed_schedule_then_the_adaptive_loop_agree_with_the_previous_solver(torch_path, monkeypatch, n, d,
                                                                                   template_scale, logit_std):
    """Families where the fixed schedule certifies every row (MiniLM-like) and where it leaves rows to the
    adaptive iterations (ill-conditioned; rank-deficient): the same certified answers as the solver before
    (tests/support/previous_solver.py, float64 directions).  The adaptive continuation is seen to run on the
    ill-conditioned family."""
    problems = random_groups(4, 40, n, d, template_scale, logit_std, seed=n)
    continued = []
    original = newton_cg.adaptive

    def counting(work, progress, *args):
        continued.append(int(progress.live.sum()))
        return original(work, progress, *args)

    monkeypatch.setattr(newton_cg, "adaptive", counting)
    old = as_previous(problems)
    for direction_dtype in (torch.float32, torch.float64):
        agree(solve_dual(problems, direction_dtype=direction_dtype), old, problems.active)
    if logit_std == 8.0:
        assert continued and max(continued) > 0


def test_the_fixed_schedule_alone_certifies_what_it_says(torch_path):
    """Rows the fixed schedule reports certified are certified by the solver's own certificate, recomputed
    from their point alone, and their lambda_hat agrees with the previous solver's within both
    certificates; the others are exactly those it reports as still live."""
    problems = random_groups(3, 30, 24, 16, 0.5, 8.0, seed=3)
    factor = factor_gram(problems.gram)
    inputs = tiles.tile_inputs(problems, 0, 3, 0, 30, torch.float64, torch.device("cpu"))
    active, u = inputs.active, inputs.u
    work = newton_cg.WorkingSet(factor, factor.float(), inputs.logits, inputs.base, u, inputs.evidence_sqnorm, 1.0)
    out = fixed.fixed_newton(work.A, work.A_low, inputs.base, u, work.m, inputs.logits, inputs.evidence_sqnorm,
                             active.clone(), 1.0, 1e-9, 1e-12)
    y, p, gradient_sq, live = out.state.y, out.state.p, out.state.gradient_sq, out.live
    # the certificate recomputed from y alone (probe.solve.dual's state at y)
    state = work.state(y)
    assert torch.allclose(state.gradient_sq.sqrt(), gradient_sq.sqrt(), rtol=1e-6, atol=1e-13)
    done = active & ~live
    assert int(done.sum()) > 0 and int((active & live).sum()) > 0
    error_bound = 2 * state.gradient_sq.sqrt()
    assert bool((error_bound[done] <= (1e-9 * state.lambda_norm[done] + 1e-12) * 1.0001).all())
    old = as_previous(problems)
    coefficients = u - p  # alpha = 1: c = alpha (u - p); lambda_hat - lambda_old in the row space of T
    delta = coefficients - old.coefficients
    distance = torch.einsum("gmi,gij,gmj->gm", delta, problems.gram, delta).clamp_min(0).sqrt()
    assert bool((distance[done] <= (error_bound + old.error_bound)[done] + 1e-12).all())


def test_the_fixed_schedule_compiles_whole():
    """torch.compile(fullgraph=True) captures the fixed schedule in one graph: no graph break."""
    problems = random_groups(2, 12, 10, 6, 1.0, 2.0, seed=1)
    factor = factor_gram(problems.gram)
    i = tiles.tile_inputs(problems, 0, 2, 0, 12, torch.float64, torch.device("cpu"))
    m = torch.bmm(i.u, factor)
    try:
        explained = torch._dynamo.explain(fixed.fixed_newton)(
            factor, factor.float(), i.base, i.u, m, i.logits, i.evidence_sqnorm, i.active, 1.0, 1e-9, 1e-12)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.slow
def test_the_compiled_fixed_schedule_computes_what_the_eager_one_does():
    problems = random_groups(2, 12, 10, 6, 1.0, 2.0, seed=2)
    factor = factor_gram(problems.gram)
    i = tiles.tile_inputs(problems, 0, 2, 0, 12, torch.float64, torch.device("cpu"))
    args = (factor, factor.float(), i.base, i.u, torch.bmm(i.u, factor), i.logits, i.evidence_sqnorm, i.active, 1.0,
            1e-9, 1e-12)
    try:
        compiled = torch.compile(fixed.fixed_newton, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    eager = fixed.fixed_newton(*args)
    assert torch.equal(compiled.live, eager.live)  # the same rows go on
    assert torch.allclose(compiled.state.lambda_norm, eager.state.lambda_norm, rtol=1e-12)


def test_cholesky_factors_and_falls_back_to_eigh_for_rank_deficient_groups(torch_path):
    """A positive definite group is factored by Cholesky (lower triangular); a group with duplicate
    templates and one with more keys than dimensions by the eigendecomposition (their null directions
    as zero columns).  Every factor reproduces G, and the problems solved with it certify and agree
    with the previous solver (which factors by eigh)."""
    generator = torch.Generator().manual_seed(7)
    n = 12
    full = torch.randn(n, 20, generator=generator, dtype=torch.float64)
    duplicate = full.clone()
    duplicate[3] = duplicate[5]
    thin = torch.randn(n, 5, generator=generator, dtype=torch.float64)
    T = [full, duplicate, torch.cat([thin, torch.zeros(n, 15, dtype=torch.float64)], 1)]
    gram = torch.stack([t @ t.T for t in T])
    factor = factor_gram(gram, method="cholesky")
    assert torch.allclose(factor @ factor.transpose(1, 2), gram, rtol=0, atol=1e-12 * float(gram.abs().max()))
    assert torch.equal(factor[0], factor[0].tril())  # Cholesky where positive definite
    zero_columns = [int((factor[g].abs().amax(0) == 0).sum()) for g in range(3)]
    assert zero_columns[0] == 0 and zero_columns[1] >= 1 and zero_columns[2] >= n - 5
    assert torch.allclose(factor[1:], factor_gram(gram[1:], method="eigh"))
    Z = torch.randn(3, 9, 20, generator=generator, dtype=torch.float64)
    logits = torch.stack([Z[g] @ T[g].T for g in range(3)])
    problems = DualProblems(gram=gram, logits=logits, log_preference=torch.zeros_like(logits),
                            evidence_sqnorm=(Z * Z).sum(-1), factor=factor)
    everything = torch.ones(3, 9, dtype=torch.bool)
    agree(solve_dual(problems), as_previous(problems), everything)


def test_tiles_on_a_gpu_come_from_its_free_memory(monkeypatch):
    """On CUDA a tile is a quarter of the free memory (at least the fixed 512 MiB): a 512-key call of
    64 examples x 12 layers, 768 tiles at 512 MiB, is a handful on an 80 GB device with 70 GB free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
    cuda = torch.device("cuda")
    groups, m, n = 64 * 12, 12 * 512, 512
    planned, workers = tiles.plan_tiles(groups, m, n, cuda, torch.float64, True, None, 0)
    at_least = tiles.bytes_per_row(n, torch.float64) * m * groups / (512 << 20)
    assert at_least > 500 and len(planned) <= 30 and workers == 0
    assert sorted((g0, j0) for g0, _, j0, _ in planned)[0] == (0, 0)
    covered = np.zeros((groups, m), dtype=int)
    for g0, g1, j0, j1 in planned:
        covered[g0:g1, j0:j1] += 1
    assert (covered == 1).all()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))  # almost full
    assert tiles.tile_bytes(cuda, True, 0) == tiles.TILE_BYTES["cuda"]


def test_a_shared_preference_moves_as_one_row_per_group():
    """Moving a call's problems to another device does not expand a stride-0 preference first: the tile
    inputs move one row per group (here to the meta device, which keeps what it is given)."""
    problems = random_groups(2, 6, 8, 5, 1.0, 2.0, seed=4)
    problems.log_preference = problems.log_preference[:, :1].expand(2, 6, 8)
    moved = []
    original = tiles._on

    def recording(tensor, device, dtype=None):
        moved.append(tuple(tensor.shape))
        return original(tensor, device, dtype)

    tiles._on, saved = recording, tiles._on
    try:
        u = tiles.tile_inputs(problems, 0, 2, 0, 6, torch.float64, torch.device("cpu")).u
    finally:
        tiles._on = saved
    assert (2, 1, 8) in moved and (2, 6, 8) in moved  # the preference's one row, the logits' every row
    assert shares_rows(u)
    import gpu_agreement

    on_meta = gpu_agreement._moved(problems, "meta")
    assert on_meta.log_preference.shape == (2, 6, 8) and shares_rows(on_meta.log_preference)
