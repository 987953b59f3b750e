"""Dual problems for the solver's tests: one group from explicit templates, random batched groups (padding
keys and queries included), the previous solver's form of them, and how two certified answers agree; the
solver with or without its compiled kernel."""

from __future__ import annotations

import contextlib

import torch

import probe.solve.native as native
from probe.solve.dual import DualProblems


def reduced(T, Z, log_u, alpha=1.0):
    """Reduced problems for one group: explicit templates T (n, d), evidences Z (m, d), log u (m, n)."""
    T = torch.as_tensor(T, dtype=torch.float64)
    Z = torch.as_tensor(Z, dtype=torch.float64)
    return DualProblems(
        gram=(T @ T.T)[None],
        logits=(Z @ T.T)[None],
        log_preference=torch.as_tensor(log_u, dtype=torch.float64)[None],
        evidence_sqnorm=(Z * Z).sum(-1)[None],
        alpha=alpha,
    )


def certified_difference(a, b):
    """How far two certified solutions of the same problems may be apart in rel_deviation: each
    lambda_hat is within error_bound of lambda*, and rel_deviation moves by at most
    2 ||delta lambda|| / ||lambda|| when lambda moves by delta lambda."""
    return 2 * (a.error_bound / a.lambda_norm + b.error_bound / b.lambda_norm) + 1e-15


def agree(new, old, active):
    """Both certified, and within 1e-9 of each other in rel_deviation and ||lambda|| (each is within its
    certificate, ``error_bound <= 1e-9 ||lambda||``, of the exact answer)."""
    assert bool(new.converged[active].all()) and bool(old.converged[active].all())
    assert float((new.rel_deviation - old.rel_deviation).abs()[active].max()) <= 1e-9
    assert bool(((new.rel_deviation - old.rel_deviation).abs() <= certified_difference(new, old))[active].all())
    assert float(((new.lambda_norm - old.lambda_norm).abs() / old.lambda_norm)[active].max()) <= 1e-9
    assert bool(torch.equal(new.converged, old.converged))
    assert bool(torch.isnan(new.rel_deviation[~active]).all())


def as_previous(problems):
    from . import previous_solver

    return previous_solver.DualProblems(**{k: v for k, v in vars(problems).items() if k != "factor"})


def random_groups(groups, per_group, n, d, template_scale, logit_std, seed):
    generator = torch.Generator().manual_seed(seed)
    T = torch.randn(groups, n, d, generator=generator, dtype=torch.float64) * template_scale
    Z = torch.randn(groups, per_group, d, generator=generator, dtype=torch.float64)
    Z *= logit_std / (template_scale * d**0.5)
    log_u = torch.randn(groups, 1, n, generator=generator, dtype=torch.float64).expand(groups, per_group, n).clone()
    log_u[:, :, -2:] = -torch.inf  # padding keys
    active = torch.ones(groups, per_group, dtype=torch.bool)
    active[:, -3:] = False  # padding queries
    return DualProblems(
        gram=T @ T.transpose(1, 2), logits=Z @ T.transpose(1, 2), log_preference=log_u,
        evidence_sqnorm=(Z * Z).sum(-1), active=active,
    )


@contextlib.contextmanager
def kernel_state(**state):
    """``probe.solve.native``'s kernel state set to ``state`` (empty: not looked for yet, so the next solve
    builds or loads it afresh), and restored afterwards."""
    saved = dict(native._state)
    native._state.clear()
    native._state.update(state)
    try:
        yield
    finally:
        native._state.clear()
        native._state.update(saved)


def torch_loops():
    """The solver without the compiled kernel, as where it cannot be built."""
    return kernel_state(kernel=None, reason="disabled by the test")
