"""A site's problems: from the captured sites to the solver's batches.

A site (:class:`probe.capture.adapters.base.SiteCapture`) gives its problems in each space
(:func:`probe.capture.adapters.base.space_problems`); here they become the solver's groups of problems sharing
their templates (:func:`dual_problems`, with their factor :func:`group_factor`), their reconstruction is checked
against the model's probabilities (:func:`fidelity_error`), and sites are split by examples into pieces of a
bounded size (:func:`pieces`) and stacked by shape into solver calls (:func:`site_stacks`, :func:`solve_stacked`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from probe.capture.adapters import SiteCapture
from probe.capture.adapters.base import SpaceProblems, real_values, space_problems
from probe.solve.dual import DualProblems, DualSolution, solve_dual
from probe.solve.gram import factor_from_templates, factor_gram
from probe.solve.problems import shares_rows

#: default bound on the float64 logits held at once (one stack of pieces)
STACK_BYTES = 1 << 28


def select(site: SiteCapture, examples: slice) -> SiteCapture:
    """The site restricted to some of its examples (views, no copies)."""

    def pick(x):
        return x if x is None or x.shape[0] == 1 else x[examples]

    fields = {name: getattr(site, name) for name in SiteCapture.__dataclass_fields__}
    for name in ("queries", "keys", "values", "log_preference", "query_mask", "key_mask", "query_ids",
                 "model_probs", "model_output", "key_hidden", "query_positions"):
        fields[name] = pick(fields[name])
    return SiteCapture(**fields)


def group_factor(problems: SpaceProblems) -> torch.Tensor:
    r""":math:`A` with :math:`AA^\top = TT^\top` for each group of the site's problems (one per example in the
    hidden space, one per (example, key head) in the key space), ``(groups, k, r)``.

    Where the templates are wider than they are many (:math:`d \ge k`, as hidden states of a short text), from
    the Gram matrix :math:`G = TT^\top` (:func:`probe.solve.gram.factor_gram`, :math:`k \times k`).  Where
    there are more keys than dimensions (:math:`k > d`: long contexts, the key space), from the templates
    themselves (:func:`probe.solve.gram.factor_from_templates`, :math:`r = d`): no :math:`k \times k` matrix is
    formed, so memory grows like :math:`O(k d)` per group, not :math:`O(k^2)`."""
    templates = problems.templates.reshape(-1, *problems.templates.shape[-2:])
    k, d = templates.shape[-2:]
    if d < k:
        return factor_from_templates(templates)
    return factor_gram(templates @ templates.transpose(-1, -2))


def dual_problems(site: SiteCapture, problems: SpaceProblems, alpha: float,
                  factor: torch.Tensor | None = None) -> DualProblems:
    r"""The site's problems for strength ``alpha``, grouped by shared templates.

    Hidden space: one group per example, its ``h * q`` problems head-major.  Key space: one group per
    (example, key head), its ``(h / g) * q`` problems head-major.  Adapters give :math:`\alpha = 1`
    quantities; for other :math:`\alpha` the evidence is rescaled to :math:`z/\alpha` so that
    :math:`\alpha\langle t_i, z\rangle + \log u_i` still equals the model's logits.  ``factor``: the groups'
    :func:`group_factor` (it depends on the templates only, so one serves every alpha); computed when not given.
    """
    b, h, q, k = site.shape
    factor = group_factor(problems) if factor is None else factor
    per_group = h * q * b // factor.shape[0]
    log_pref = site.log_preference.expand(b, h, q, k).reshape(-1, per_group, k)
    active = site.query_mask[:, None, :].expand(b, h, q).reshape(-1, per_group)
    logits = problems.logits.reshape(-1, per_group, k)
    return DualProblems(
        gram=None,
        logits=logits if alpha == 1 else logits / alpha,  # x / 1 == x: no copy of the largest input for alpha 1
        log_preference=log_pref,
        evidence_sqnorm=problems.evidence_sqnorm.reshape(-1, per_group) / alpha**2,
        alpha=alpha,
        active=active,
        factor=factor,
    )


def site_problems(site: SiteCapture, alpha: float, space: str = "hidden", *, gram: bool = True) -> DualProblems:
    """:func:`dual_problems` of the whole site in ``space``, with its factor, and with ``gram`` its Gram matrices
    too (``(groups, k, k)``: for comparisons with methods that take them; the pipeline never forms them)."""
    built = space_problems(site, space)
    problems = dual_problems(site, built, alpha)
    if gram:
        problems.gram = built.gram.reshape(problems.n_groups, *built.gram.shape[-2:])
    return problems


#: default fidelity tolerance per model dtype (max abs difference of attention probabilities).  The
#: reconstruction is exact in float64 from the queries and keys the model multiplies; what remains is the
#: model's own rounding of its logits and probabilities.  A logit error d moves a probability p by at most
#: about p(1 - p) * 2d, and rounding to a p-bit mantissa gives d ~ |logit| * 2^-p: float16 (p = 11) stays
#: within 1e-2 and bfloat16 (p = 8) within 5e-2 for logits up to about 50.  float64 models are held to 1e-6,
#: not tighter, because several families (Llama, Mistral, Qwen2, Gemma) take their softmax in float32.
FIDELITY_TOLERANCE = {"float64": 1e-6, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}


def fidelity_error(site: SiteCapture, problems: SpaceProblems | None = None) -> float:
    """Max |softmax(log u + s) - model probabilities| over the site's real queries (alpha = 1); for a site of the
    model's fast attention, which gives its output and not its probabilities, the output's error
    (:func:`output_errors`)."""
    errors = fidelity_errors(site, problems)
    return float(errors.max()) if errors.numel() else 0.0


def output_errors(site: SiteCapture, reconstructed: torch.Tensor) -> torch.Tensor:
    r"""The error of the attention output rebuilt from the ``reconstructed`` probabilities ``(b, h, q, k)``,
    :math:`\hat o = \sum_i p_i v_i`, against the model's own output (``site.model_output``, SDPA), as a share of
    the largest value entry of the example and key head, ``(b, h, q)``:
    :math:`\max_c |\hat o_c - o_c| / \max_{i, c} |v_{ic}|`.  It is at most the probabilities' error summed over
    the keys, :math:`\sum_i |\hat p_i - p_i|`, and unlike a check of the probabilities it needs no
    :math:`k \times k` matrix from the model."""
    b, h, q, k = reconstructed.shape
    values = real_values(site).to(torch.float64)  # (b, g, k, d_v); query head j reads key head j // (h / g)
    g = values.shape[1]
    rebuilt = (reconstructed.reshape(b, g, (h // g) * q, k) @ values).reshape(b, h, q, -1)
    scale = values.abs().amax(dim=(-2, -1)).clamp_min(torch.finfo(torch.float64).tiny)  # (b, g)
    scale = scale.repeat_interleave(h // g, dim=1)[:, :, None]
    return (rebuilt - site.model_output.to(torch.float64)).abs().amax(dim=-1) / scale


def fidelity_errors(site: SiteCapture, problems: SpaceProblems | None = None) -> torch.Tensor:
    """:func:`fidelity_error` of each example of the site, ``(b,)``."""
    problems = space_problems(site, site.spaces[0]) if problems is None else problems
    reconstructed = torch.softmax(site.log_preference + problems.logits, dim=-1)
    if site.model_probs is None:
        difference = output_errors(site, reconstructed)
    else:
        difference = (reconstructed - site.model_probs.to(torch.float64)).abs().amax(dim=-1)  # (b, h, q)
    # a NaN in what the model computed (or in what is rebuilt) is no agreement: an error beyond any tolerance
    difference = difference.nan_to_num(nan=float("inf"))
    difference = difference.masked_fill(~site.query_mask[:, None, :], 0.0)
    return difference.flatten(1).amax(dim=1) if difference.numel() else difference.new_zeros(site.shape[0])


def mergeable(sites: list[SiteCapture]) -> bool:
    """Whether sites of one problem shape (a stack) can be worked through as one: one attention type (its
    rows' roles follow the same rule), the same heads and the same logit scale."""
    first = sites[0]
    return all(site.attention_type == first.attention_type and site.head_ids == first.head_ids
               and site.logit_scale == first.logit_scale for site in sites)


def merged(sites: list[SiteCapture]) -> SiteCapture:
    """Sites of one problem shape (:func:`mergeable`) as one site of all their examples, in order: what is
    computed per example, row or group then runs once for all of them (a stack of small pieces, as a
    selection of a few heads and queries gives, spends its time in the fixed cost of each operation).  Its
    ``layer`` is the first site's, and it has no ``key_hidden`` or ``key_weight``: the problems that need each
    site's own (those of :data:`probe.capture.adapters.base.SITE_WEIGHT_SPACES`) are built per site
    (:func:`merged_problems`), and copying every example's hidden states would cost more than the few rows of
    a selection."""
    if len(sites) == 1:
        return sites[0]
    first = sites[0]

    def joined(name: str):
        values = [getattr(site, name) for site in sites]
        if values[0] is None:
            return None
        if name in ("query_positions",):
            values = [site.query_mask.long().cumsum(-1) - 1 if value is None else value
                      for site, value in zip(sites, values)]
        shape = [max(value.shape[axis] for value in values) for axis in range(values[0].dim())]
        return torch.cat([value.expand(site.shape[0], *shape[1:]) for site, value in zip(sites, values)])

    per_example = ("queries", "keys", "values", "log_preference", "query_mask", "key_mask", "query_ids",
                   "model_probs", "model_output", "query_positions")
    return replace(first, key_hidden=None, key_weight=None, **{name: joined(name) for name in per_example})


def merged_problems(problems: list[SpaceProblems]) -> SpaceProblems:
    """The problems of several sites' (:func:`merged`) in one space, their examples in order."""
    if len(problems) == 1:
        return problems[0]
    return SpaceProblems(templates=torch.cat([p.templates for p in problems]),
                         logits=torch.cat([p.logits for p in problems]),
                         evidence_sqnorm=torch.cat([p.evidence_sqnorm for p in problems]))


def stacked_problems(problems: list[DualProblems]) -> DualProblems:
    """Problems of one shape as one batch: their groups stacked along the group axis."""
    if len(problems) == 1:
        return problems[0]
    return DualProblems(
        gram=None if any(p.gram is None for p in problems) else torch.cat([p.gram for p in problems]),
        logits=torch.cat([p.logits for p in problems]),
        log_preference=_stacked_rows([p.log_preference for p in problems]),
        evidence_sqnorm=torch.cat([p.evidence_sqnorm for p in problems]),
        alpha=problems[0].alpha,
        active=torch.cat([p.active for p in problems]),
        factor=None if any(p.factor is None for p in problems) else torch.cat([p.factor for p in problems]),
    )


def _stacked_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along the group axis, keeping rows that share their group's values by construction
    (:func:`probe.solve.problems.shares_rows`, as an expanded preference) shared, so that the solver computes
    with them once per group."""
    if all(shares_rows(t) for t in tensors):
        first = torch.cat([t[:, :1] for t in tensors])
        return first.expand(first.shape[0], tensors[0].shape[1], first.shape[2])
    return torch.cat(tensors)


def solve_stacked(problems: list[DualProblems], rtol: float, memory_bytes: int | None = None) -> list[DualSolution]:
    """Solve problems of one shape with one :func:`solve_dual` call, one solution per entry.

    Per-call overhead is paid once and the solver's batched products run on larger batches; the
    problems stay independent of one another.
    """
    budget = {} if memory_bytes is None else {"memory_budget_bytes": memory_bytes}
    solution = solve_dual(stacked_problems(problems), rtol=rtol, **budget)
    solutions, start = [], 0
    for part in problems:
        stop = start + part.n_groups
        solutions.append(DualSolution(**{name: value[start:stop] for name, value in vars(solution).items()}))
        start = stop
    return solutions


def solve_sites(sites: list[SiteCapture], alpha: float, rtol: float, space: str = "hidden") -> list[DualSolution]:
    """Solve the problems of sites of one shape in ``space`` with one solver call, one solution per site."""
    return solve_stacked([site_problems(site, alpha, space) for site in sites], rtol)


def site_bytes(site: SiteCapture) -> int:
    """Bytes of the site's float64 logits and of its groups' factors, the measure of its problems' size: the
    logits grow with the rows (``b h q k``), the factors with the keys (``k min(k, d)`` per group:
    :func:`group_factor`), which a long context with few selected queries makes the larger part."""
    b, h, q, k = site.shape
    d_head = site.queries.shape[-1]
    hidden = site.key_hidden.shape[-1] if site.key_hidden is not None else d_head
    factors = b * max(site.keys.shape[1] * k * min(k, d_head), k * min(k, hidden))  # the larger of the two spaces
    return (b * h * q * k + factors) * 8


def pieces(site: SiteCapture, limit_bytes: int) -> list[SiteCapture]:
    """The site split by examples into pieces of at most ``limit_bytes`` of logits (at least one example)."""
    b = site.shape[0]
    per_example = max(1, site_bytes(site) // max(b, 1))
    step = max(1, limit_bytes // per_example)
    if step >= b:
        return [site]
    return [select(site, slice(start, start + step)) for start in range(0, b, step)]


def site_stacks(sites, limit_bytes: int = STACK_BYTES, site_of=lambda item: item):
    """Sites (or items holding one, ``site_of(item)``) grouped by problem shape, in order of first
    appearance, in lists of at most ``limit_bytes`` of logits: each list is one solver call."""
    stacks: dict[tuple, list] = {}
    sizes: dict[tuple, int] = {}
    for item in sites:
        site = site_of(item)
        key, nbytes = _stack_key(site), site_bytes(site)
        if key in stacks and sizes[key] + nbytes > limit_bytes:
            yield stacks.pop(key)
            del sizes[key]
        stacks.setdefault(key, []).append(item)
        sizes[key] = sizes.get(key, 0) + nbytes
    yield from stacks.values()


def _stack_key(site: SiteCapture):
    """Sites with equal keys have problems of one shape in every space."""
    _, h, q, k = site.shape
    return h, q, k, site.keys.shape[1]
