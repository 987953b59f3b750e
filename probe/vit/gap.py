r"""How far a ViT's final layer is from exact inference, on a fixed batch of test images: what ``probe vit train``
records after every epoch (``final_layer_gap`` in each entry of the learning curve).

The problems are the final layer's class-token queries, one per image and head, at test time (no dropout, the
image's own tokens): templates :math:`t_i = k_i/\gamma` (the layer's keys, :math:`\gamma = \sqrt{d'}`), evidence
:math:`z = q`, :math:`u` uniform over the tokens, :math:`\alpha = 1`, so that softmax attention,
:math:`\mathrm{softmax}(\langle t_i, z\rangle)`, is the closed-form approximation :math:`\lambda = \alpha z` of
the problem, and its exact posterior :math:`p^*` is :func:`probe.solve.exact.exact_attention`'s (certified).  Recorded
for every arm (``kl``): the total variation :math:`\tfrac12\|p^* - \mathrm{softmax}\|_1` and
``rel_deviation`` :math:`= \|\lambda^* - \alpha z\| / \|\lambda^*\|` with
:math:`\lambda^* = \alpha z + T^\top\alpha(u - p^*)`.  For the softmax arm this is its own layer's distance from
exact inference; the exact arm's layer is :math:`p^*` itself (its distance is 0), and there the numbers say how far
softmax attention of the same queries and keys would be.  The OT arm also gets its own layer's (``ot``): eq. 22
against the exact OT posterior of the same problems (:func:`probe.solve.ot.approximation_quality`).  The Sinkhorn arm's
layer approximates no problem probe solves: only ``kl``.
"""

from __future__ import annotations

import math

import torch

#: the test images (the first of the run's test subset) the gap is measured on
GAP_IMAGES = 256


def final_layer_posteriors(model, images: torch.Tensor) -> dict:
    r"""The final layer's class-token problems of ``images`` (normalised as in training) and their solutions, in
    float64: ``templates`` ``(B, H, N, d')``, ``evidence`` ``(B, H, d')``, the exact posterior ``exact`` and the
    ``softmax`` ``(B, H, N)``, ``lam`` :math:`\lambda^*` ``(B, H, d')``, and ``not_converged`` (problems the solver
    did not certify)."""
    from probe.solve.exact import exact_attention
    from probe.vit.problems import final_layer_problems

    problems = final_layer_problems(model, images)
    keys, queries = problems["candidates"].double(), problems["evidence"].double()
    gamma = float(model.blocks[-1].attn.gamma)
    templates = keys / gamma
    with torch.no_grad():
        exact, certificate = exact_attention(templates, queries, torch.zeros(keys.shape[:-1], dtype=torch.float64),
                                             1.0, return_certificate=True)
    softmax = torch.softmax((templates @ queries.unsqueeze(-1)).squeeze(-1), dim=-1)
    uniform = torch.full_like(exact, 1.0 / exact.shape[-1])
    lam = queries + (templates.transpose(-1, -2) @ (uniform - exact).unsqueeze(-1)).squeeze(-1)
    return {"templates": templates, "evidence": queries, "exact": exact, "softmax": softmax, "lam": lam,
            "not_converged": int(certificate.not_converged), "problems": problems}


def _summary(values: torch.Tensor, name: str) -> dict:
    values = values.flatten().double()  # quantiles as numpy's and pandas' (torch's median is the lower one)
    return {f"{name}_median": float(torch.quantile(values, 0.5)), f"{name}_p90": float(torch.quantile(values, 0.9)),
            f"{name}_max": float(values.max())}


def final_layer_gap(model, images: torch.Tensor) -> dict:
    """The module's numbers for ``model`` on ``images``: ``images``, ``problems``, ``kl`` (``tv_*`` and
    ``rel_deviation_*``: median, 90th percentile, maximum; ``not_converged``) and, for an OT final layer, ``ot``
    (the same of eq. 22 against the exact OT posterior, and ``certified``: the share of its problems solved to
    their certificate)."""
    solved = final_layer_posteriors(model, images)
    tv = 0.5 * (solved["exact"] - solved["softmax"]).abs().sum(-1)
    rel = (solved["lam"] - solved["evidence"]).norm(dim=-1) / solved["lam"].norm(dim=-1)
    gap = {"images": int(images.shape[0]), "problems": int(tv.numel()),
           "kl": {**_summary(tv, "tv"), **_summary(rel, "rel_deviation"), "not_converged": solved["not_converged"]}}
    attention = model.blocks[-1].attn
    if attention.kind == "ot":
        from probe.solve.ot import approximation_quality

        p = solved["problems"]
        quality = approximation_quality(p["candidates"], p["source_weights"], p["cost"], p["evidence"], p["alpha"],
                                        p["gamma"])
        gap["ot"] = {**_summary(quality.total_variation, "tv"), **_summary(quality.rel_deviation, "rel_deviation"),
                     "certified": float(quality.solution.converged.double().mean())}
    return gap


def gap_line(gap: dict) -> str:
    """The gap in the words of the training log."""
    kl = gap["kl"]
    line = (f"final layer vs exact: TV median {kl['tv_median']:.3g}, rel_deviation median "
            f"{kl['rel_deviation_median']:.3g}")
    if "ot" in gap:
        line += f" (eq. 22 vs exact OT: rel_deviation median {gap['ot']['rel_deviation_median']:.3g})"
    return line if math.isfinite(kl["tv_median"]) else "final layer vs exact: not measured"
