r"""Interventions: put a substitute for the model's attention weights into the forward pass and measure
what the model outputs then.

The question: the exact posterior :math:`p^*` of an attention site's inference problem moves
the head's output by a lot (``output_deviation``); does it change what the *model* computes, once
residual connections, layer norms and later layers have had their say?

What is substituted
-------------------
An *attention site* is one attention module call of a forward pass (attention type, layer; the same
``(attention type, layer)`` as the rows).  At a substituted site every head's attention weights
:math:`p_{att}` (``(b, h, q, k)``) are replaced by substitute weights :math:`p_{sub}` and the model goes
on with :math:`p_{sub} V` through its own code: probe's attention function, which the model runs
(:mod:`probe.capture.adapters.interface`), hands the forward's calls to a substitution that runs the family's own
``eager_attention_forward`` (for the site's problems and the check below), then returns
``(p_sub @ V).transpose(1, 2)`` with the key/value heads repeated for grouped-query attention
(``repeat_kv``), exactly the form every family's eager function returns its output in.  That this is the
form is checked on the first substituted call of each attention class (the eager output must equal
``probs @ V`` so transposed); the output projection, residuals, norms and everything after are the
model's.  Families whose adapter does not go through the attention interface (MPNet, DeBERTa-v2, BLOOM:
hooks on their own attention code) cannot substitute: :func:`~probe.interventions.model.can_intervene` says so before a run.

Substitutes (per row: example, head, query; from the site's problems in one space and alpha)
------------------------------------------------------------------------------------------
* ``exact``: :math:`p^* = p(\lambda^*)`, the solver's certified optimum (:func:`probe.solve.dual.solve_dual`
  on :func:`probe.batch.problems.site_problems`: the rows' :math:`p^*`);
* ``second-order``: :math:`p(\lambda_2)`, :math:`\lambda_2 = \alpha(I + \alpha\Sigma_u)^{-1}z` (the paper's
  second-order prediction; :func:`probe.solve.second_order.second_order_point` gives :math:`\lambda_2 = \alpha z +
  Vy_2`, so :math:`\log p(\lambda_2) = \log u + \alpha s + Ay_2` up to normalisation);
* ``null``: the control: a seeded random perturbation :math:`q` of the model's own attention with
  exactly the total variation :math:`\tau = TV(p^*, p_{att})` (:func:`null_attention`);
* ``model``: :math:`p_{att} = \mathrm{softmax}(\log u + \alpha s)` itself, rebuilt from the problems (the
  identity control: it reproduces the model's outputs to the fidelity tolerance).

Rows of padding queries keep the model's own weights.

Modes
-----
* *per site* (:func:`per_site_records`): one forward captures every site (and the reference outputs,
  and each layer's output: :class:`Trace`); then, per site and substitute, one forward *from the site
  on*: the layers (``ModuleList`` entries) called before the site's layer return what they returned in
  the capture, which is what they would compute again, and the model runs from the site's layer on.
  No family-specific layer call is needed: the layers' own modules are called by the model as usual,
  and the earlier ones answer from the trace; so do the linear projections of the site's layer called
  before its first attention call (query, key, value).  (``from_site=False``: a full forward per site.)
* *whole model* (:func:`whole_model_records`, "the inference transformer"): every site is substituted,
  its problems built and solved inside the attention call from the hidden states the earlier
  substitutions produced (new solves, certified: their convergence is recorded per example).  The
  first site's problems are the captured ones: it takes p* from the rows' solves, and with the per-site
  mode the forward starts after it, from that site's per-site forward (:class:`~probe.interventions.modes._HeadStart`).

Effects (per example; :func:`effects`)
--------------------------------------
With :math:`h, h'` the final hidden states of the original and the substituted model (the output of the
base model; the decoder's for encoder-decoders) over the example's real positions:

* ``hidden_change`` :math:`= \mathrm{mean}_j \|h'_j - h_j\| / \|h_j\|`;
* ``embedding_cosine``: cosine of the pooled embeddings; the pooling is the model's own where its files
  say so (sentence-transformers' ``modules.json`` + ``1_Pooling/config.json``: mean, cls, max,
  mean_sqrt_len, lasttoken), else the first token for encoders and the last real token for decoders
  and encoder-decoders (under causal attention the first position sees only itself); column
  ``pooling`` records which;
* with a language-model head (:func:`with_lm_head`): ``lm_loss_original`` and ``lm_loss`` (mean
  cross-entropy in nats over the scored positions) and ``top1_agreement`` (fraction of scored positions
  where the two models' most likely tokens agree).  Masked LM: 15% of each example's non-special
  tokens (at least one), drawn from the seed and the example id, replaced 80% by the mask token, 10% by
  a random token and 10% left (:func:`masked_lm_inputs`); every forward of the example, the reference
  included, then runs on these masked inputs.  Causal LM: every real position with a real next token,
  scored on that token; seq2seq: the same within the decoder input (teacher forcing).
"""

from probe.interventions.effects import effects, lm_labels
from probe.interventions.forward import Outputs, Trace, run_forward, site_name
from probe.interventions.model import (
    SUBSTITUTES,
    WHOLE,
    InterventionConfig,
    can_intervene,
    lm_kind,
    masked_lm_inputs,
    pool,
    pooling_of,
    require_intervention,
    with_lm_head,
)
from probe.interventions.modes import (
    COLUMNS,
    batch_records,
    intervention_records,
    per_site_records,
    records_table,
    run_config,
    whole_model_records,
)
from probe.interventions.substitutes import Substitute, null_attention, site_substitutes

__all__ = [
    "SUBSTITUTES", "WHOLE", "InterventionConfig", "Outputs", "can_intervene", "require_intervention", "with_lm_head",
    "lm_kind", "pooling_of", "masked_lm_inputs", "run_forward", "site_substitutes", "null_attention", "effects",
    "per_site_records", "whole_model_records", "intervention_records", "records_table", "COLUMNS", "Trace", "pool",
    "lm_labels", "site_name", "Substitute", "run_config", "batch_records",
]
