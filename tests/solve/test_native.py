"""The solver's Newton iterations in compiled C (probe.solve.native, probe/solve/newton.c): built where a C compiler
is, the same certified answers as the torch loops and the previous solver, certificates that are those of
its own iterates, and the rows it leaves continued by the torch loops."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import probe.solve.native as native
from probe.solve.dual import factor_gram, solve_dual

from ..support.solver_problems import agree, as_previous, kernel_state, random_groups, torch_loops

FAMILIES = {  # (n, d, template scale, logit std): MiniLM-like, ill-conditioned, rank-deficient Gram matrices
    "minilm-like": (16, 384, 1 / 8, 2.0),
    "ill-conditioned": (48, 32, 1 / 2, 8.0),
    "more templates than dimensions": (40, 24, 1.0, 3.0),
}


def _needs_kernel():
    if not native.available():
        if shutil.which(os.environ.get("CC") or "cc"):
            pytest.fail(f"a C compiler is on PATH but the kernel is not available: {native.unavailable_reason()}")
        pytest.skip(f"no compiled kernel here: {native.unavailable_reason()}")


def test_the_kernel_is_built_where_a_c_compiler_is():
    """A compiler on PATH means the kernel must build and pass its BLAS check (a silent fallback would
    cost 2-3x in speed and nothing else would notice)."""
    _needs_kernel()
    assert native.unavailable_reason() is None


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_and_torch_loops_agree_and_match_the_previous_solver(family, monkeypatch):
    """The same problems by the kernel, by the torch loops (the fixed schedule first, then the adaptive
    iterations) and by the solver before its speed work (tests/support/previous_solver.py, float64 directions):
    the same certified answers; and about the same Newton iteration counts for the kernel and the torch
    loops' adaptive iterations alone (``PROBE_SCHEDULE=0``: the same method)."""
    from ..support import previous_solver

    _needs_kernel()
    n, d, scale, logit_std = FAMILIES[family]
    problems = random_groups(4, 40, n, d, scale, logit_std, seed=n + 1)
    compiled = solve_dual(problems)
    with torch_loops():
        loops = solve_dual(problems)
    old = previous_solver.solve_dual(as_previous(problems), direction_dtype=torch.float64)
    agree(compiled, loops, problems.active)
    agree(compiled, old, problems.active)
    active = problems.active
    mean = lambda s: float(s.iterations[active].float().mean())  # noqa: E731
    monkeypatch.setenv("PROBE_SCHEDULE", "0")
    with torch_loops():
        adaptive = solve_dual(problems)
    agree(compiled, adaptive, problems.active)
    assert abs(mean(compiled) - mean(adaptive)) <= 0.25, (mean(compiled), mean(adaptive))


def test_kernel_agrees_on_captured_minilm_problems(minilm_dir):
    """Real problems (a padded MiniLM batch, every layer): the kernel and the torch loops agree."""
    from probe.batch.problems import site_problems

    from ..support.bert_sites import captured

    _needs_kernel()
    _, _, sites, _ = captured(minilm_dir)
    for site in sites[::3]:
        problems = site_problems(site, 1.0)
        compiled = solve_dual(problems)
        with torch_loops():
            agree(compiled, solve_dual(problems), problems.active)


def test_blocks_of_rows_give_the_same_answers(monkeypatch):
    """A group's rows split into blocks of 7 (the kernel solves block after block): the same answers
    as whole groups, within the certificates."""
    _needs_kernel()
    problems = random_groups(3, 40, 24, 12, 0.7, 4.0, seed=11)
    whole = solve_dual(problems)
    monkeypatch.setattr(native, "block_rows", lambda n, r: 7)
    agree(solve_dual(problems), whole, problems.active)


FAMILY_CASES = [(*FAMILIES[name], seed) for name in FAMILIES for seed in (1, 2)]


@pytest.mark.parametrize("n,d,scale,logit_std,seed", FAMILY_CASES)
def test_the_kernels_certificates_are_those_of_its_iterates(n, d, scale, logit_std, seed, monkeypatch):
    """Every output the kernel writes equals what the torch code forms from the kernel's own iterates
    (its state at y afresh): attention, coefficients, correction, ||lambda_hat||, rel_deviation, gap,
    error bound and converged, to rounding.  So its iterations decide only where a row ends."""
    from probe.solve import newton_cg, tiles

    _needs_kernel()
    problems = random_groups(2, 30, n, d, scale, logit_std, seed=seed)
    iterates = {}
    original = native.newton_tile

    def keeping(work, active, *args):
        y = original(work, active, *args)
        iterates["work"], iterates["y"], iterates["active"] = work, y, active
        return y

    monkeypatch.setattr(native, "newton_tile", keeping)
    solution = solve_dual(problems, workers=0)
    work, y, active = iterates["work"], iterates["y"], iterates["active"]
    assert int(active.sum()) == int(problems.active.sum())
    recomputed = tiles.empty_solution(*problems.logits.shape, y.shape[-1], torch.float64, torch.device("cpu"))
    newton_cg.finish(work, work.state(y), active, 1e-9, 1e-12, solution.iterations, recomputed)
    assert bool(recomputed.converged[active].all()) and torch.equal(recomputed.converged, solution.converged)
    kept = factor_gram(problems.gram).abs().amax(dim=(0, 1)) > 0  # the solver drops the factor's zero columns
    dropped = solution.correction[active][:, ~kept]
    assert torch.equal(dropped, torch.zeros_like(dropped))
    solution.correction = solution.correction[..., kept]
    for name in ("attention", "coefficients", "correction", "lambda_norm", "rel_deviation"):
        torch.testing.assert_close(getattr(solution, name)[active], getattr(recomputed, name)[active],
                                   rtol=1e-12, atol=1e-14)
    for name in ("error_bound", "duality_gap"):  # small numbers: relative to lambda (and its square)
        scale = solution.lambda_norm[active] ** (2 if name == "duality_gap" else 1)
        difference = (getattr(solution, name) - getattr(recomputed, name))[active].abs() / scale
        assert float(difference.max()) <= 1e-14, name


def test_rows_the_kernel_leaves_are_continued_by_the_torch_loops(monkeypatch):
    """Rows the kernel did not certify (here: it runs out of iterations after one) are continued by the
    torch loops from its iterates, in a working set of their own, and come back certified with the torch
    loops' answers; the iterations of both count."""
    from probe.solve import newton_cg

    _needs_kernel()
    problems = random_groups(3, 30, 24, 12, 0.7, 4.0, seed=5)
    with torch_loops():
        reference = solve_dual(problems)
    original = native.newton_tile
    continued = []
    monkeypatch.setattr(native, "newton_tile", lambda work, active, rtol, atol, max_iter, *rest:
                        original(work, active, rtol, atol, 1, *rest))
    original_rows = newton_cg.continue_rows
    monkeypatch.setattr(newton_cg, "continue_rows",
                        lambda work, y, rows, *args: continued.append(int(rows.sum())) or original_rows(work, y, rows, *args))
    solution = solve_dual(problems, workers=0)
    assert continued and sum(continued) == int(problems.active.sum())  # one iteration certifies none of these
    agree(solution, reference, problems.active)
    assert int(solution.iterations[problems.active].min()) >= 2


def test_without_a_compiler_the_solver_says_so_once_and_runs_its_torch_loops(monkeypatch):
    """No C compiler: one warning that says why and what to do, then the torch loops' answers."""
    problems = random_groups(2, 20, 16, 8, 0.5, 3.0, seed=2)
    with torch_loops():
        reference = solve_dual(problems)
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with kernel_state():
        with pytest.warns(RuntimeWarning, match="no C compiler.*Install a C compiler"):
            first = solve_dual(problems)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once, not for every tile
            solve_dual(problems)
        assert not native.available() and "no-such-compiler-here" in native.unavailable_reason()
    agree(first, reference, problems.active)


def test_without_a_writable_cache_the_kernel_is_built_for_the_process(monkeypatch, tmp_path):
    """A cache directory that cannot be created (here: below a file) does not cost the kernel."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PROBE_CACHE_DIR", str(blocker / "cache"))
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    with kernel_state():
        assert native.available(), native.unavailable_reason()


def test_probe_native_0_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("PROBE_NATIVE", "0")
    with kernel_state():
        assert not native.available() and native.unavailable_reason() == "PROBE_NATIVE=0"


def test_the_kernel_is_not_used_off_its_precisions():
    """float64 directions (answers independent of the batch to 1e-16) run the torch loops, bitwise."""
    problems = random_groups(2, 20, 16, 8, 0.5, 3.0, seed=4)
    with torch_loops():
        loops = solve_dual(problems, direction_dtype=torch.float64)
    again = solve_dual(problems, direction_dtype=torch.float64)
    for name, value in vars(loops).items():
        assert torch.equal(torch.nan_to_num(value, nan=-7.0), torch.nan_to_num(getattr(again, name), nan=-7.0)), name
