r"""How :func:`probe.solve.dual.solve_dual` cuts a call into tiles: their size on each device
(:func:`tile_bytes`, :func:`plan_tiles`), a tile's inputs in the solver's dtype (:func:`tile_inputs`, with
no host synchronisation) and the call's output before the tiles fill it (:func:`empty_solution`).
Notation: :mod:`probe.solve.dual`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probe.solve.problems import DualSolution, shares_rows

__all__ = ["TILE_BYTES", "TileInputs", "bytes_per_row", "empty_solution", "plan_tiles", "tile_bytes", "tile_inputs"]

#: tile size per device type: on a CPU, small enough for a tile's working set to stay in the caches the
#: cores share; on a GPU, the least (:func:`tile_bytes`)
TILE_BYTES = {"cpu": 1 << 24, "cuda": 1 << 29}

#: a call of at least twice this many problems is cut into an even number (at least 2) of equal tiles, so
#: that two workers share it evenly (three tiles on two workers leave one idle for a third of the call)
MIN_TILE_ROWS = 1024


def tile_bytes(device: torch.device, whole_groups: bool, group_bytes: int) -> int:
    """Bytes of one tile's working set on ``device`` (``group_bytes``: one group's).

    On a CPU, :data:`TILE_BYTES`, or at least one whole group where ``whole_groups`` (the fixed schedule of
    :mod:`probe.solve.fixed`, whose fixed cost per tile, its operators and its one read of the host, would
    otherwise be paid for every slice of a group).  On a GPU, a quarter of the device's free memory, and
    at least :data:`TILE_BYTES`'s entry for it: one tile where the call fits.
    """
    base = TILE_BYTES.get(device.type, TILE_BYTES["cuda"])
    if device.type == "cpu":
        return max(base, group_bytes) if whole_groups else base
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(base, free // 4)
    return base


def plan_tiles(n_groups, m, n, device, dtype, whole_groups, memory_budget_bytes, workers):
    """``(tiles, workers)`` of a :func:`probe.solve.dual.solve_dual` call: tiles ``(g0, g1, j0, j1)`` of whole
    groups, or slices of one group, of equal size, each within :func:`tile_bytes` (and the memory budget,
    if any), and the number of workers whose tiles fit in the budget together."""
    per_row = bytes_per_row(n, dtype)
    tile = tile_bytes(device, whole_groups, m * per_row)
    if memory_budget_bytes is not None:
        tile = min(tile, memory_budget_bytes)
    rows_per_tile = max(1, tile // per_row)
    if memory_budget_bytes is not None and workers > 1:  # each tile in flight holds its working set
        workers = max(1, min(workers, memory_budget_bytes // (min(rows_per_tile, m * n_groups) * per_row)))
    if rows_per_tile >= m:  # whole groups, in tiles of equal size
        count = -(-n_groups // max(1, rows_per_tile // m))
        if n_groups * m >= 2 * MIN_TILE_ROWS:
            count = min(n_groups, max(2, count + count % 2))
        return [(g0, g1, 0, m) for g0, g1 in _equal_parts(n_groups, count)], workers
    return [(g, g + 1, j0, j1) for g in range(n_groups) for j0, j1 in _equal_parts(m, -(-m // rows_per_tile))], workers


def _equal_parts(length: int, count: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``count`` consecutive parts of ``range(length)`` whose sizes differ by at most 1."""
    bounds = [round(i * length / count) for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def bytes_per_row(n: int, dtype: torch.dtype) -> int:
    """Working-set bytes per problem: about 16 (m, n)-sized tensors of the solver's dtype are live at once
    (in the fixed schedule, the line search's trial points are 4 of them)."""
    return 16 * n * torch.finfo(dtype).bits // 8


def empty_solution(n_groups, m, n, r, dtype, device) -> DualSolution:
    """The output of :func:`probe.solve.dual.solve_dual` for ``r`` columns of the factor, unfilled: the
    tiles write every entry (their certificates, then NaN on inactive problems)."""

    def empty(*shape, kind=dtype):
        return torch.empty(shape, dtype=kind, device=device)

    return DualSolution(
        coefficients=empty(n_groups, m, n), attention=empty(n_groups, m, n), rel_deviation=empty(n_groups, m),
        lambda_norm=empty(n_groups, m), duality_gap=empty(n_groups, m), error_bound=empty(n_groups, m),
        iterations=empty(n_groups, m, kind=torch.int32), converged=empty(n_groups, m, kind=torch.bool),
        correction=empty(n_groups, m, r),
    )


def _on(tensor: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``, with no operator where it already is."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device=device, dtype=dtype)


@dataclass
class TileInputs:
    r"""One tile's problems in the solver's dtype, each ``(g, m, n)`` or ``(g, m)``.

    Attributes:
        logits: :math:`s`, 0 on inactive problems.
        base: :math:`\log u + \alpha s` with :math:`u` normalised (``-inf`` off the support).
        u: the normalised preference :math:`u`; a stride-0 view where the rows share it.
        evidence_sqnorm: :math:`\|z\|^2`.
        active: the problems to solve.
    """

    logits: torch.Tensor
    base: torch.Tensor
    u: torch.Tensor
    evidence_sqnorm: torch.Tensor
    active: torch.Tensor


def tile_inputs(problems, g0, g1, j0, j1, dtype, device) -> TileInputs:
    r"""The inputs of the tile ``(g0, g1, j0, j1)`` of ``problems`` (:class:`TileInputs`).  Inactive problems
    get a harmless uniform problem, so that no NaN enters the batched products.  No host
    synchronisation: the inactive rows are replaced by ``torch.where``, whether there are any or not.

    Rows that share their group's preference by construction (a stride-0 view: BERT-like models'
    masks) are moved to the device as one row per group and normalised once; they keep sharing
    :math:`u`.
    """
    alpha = problems.alpha
    logits = _on(problems.logits[g0:g1, j0:j1], device, dtype)
    evidence_sqnorm = _on(problems.evidence_sqnorm[g0:g1, j0:j1], device, dtype)
    log_pref = problems.log_preference[g0:g1, j0:j1]
    shared = shares_rows(log_pref)
    row_pref = _on(log_pref[:, :1] if shared else log_pref, device, dtype)
    row_has_key = torch.isfinite(row_pref).any(-1)  # a problem needs at least one key
    has_key = row_has_key.expand(logits.shape[:-1])  # every row of the tile, also where they share u
    active = has_key.clone() if problems.active is None else _on(problems.active[g0:g1, j0:j1], device) & has_key
    if shared:  # a group without keys: uniform (its rows are inactive)
        row_pref = torch.where(row_has_key.unsqueeze(-1), row_pref, 0.0)
    log_u = torch.sub(row_pref, torch.logsumexp(row_pref, dim=-1, keepdim=True))  # normalise u
    keep = active.unsqueeze(-1)
    base = torch.where(keep, torch.add(log_u, logits, alpha=alpha), 0.0)  # log u + alpha s
    u = log_u.exp_().expand_as(logits) if shared else torch.where(keep, log_u.exp_(), 1.0 / logits.shape[-1])
    logits = torch.where(keep, logits, 0.0)  # a copy: the caller's logits stay as given
    evidence_sqnorm = torch.where(active, evidence_sqnorm, 1.0)
    return TileInputs(logits, base, u, evidence_sqnorm, active)
