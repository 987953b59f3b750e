"""Interventions (probe.interventions): substituting attention weights inside the forward pass, the substitutes,
and the effects on what the model outputs.

References, none of them probe's own substitution path:
* the model's own forward (no registration at all): substituting the model's own attention reproduces it;
* BERT written out here with torch ops from the weights (embeddings, attention with the substituted weights,
  feed-forward, layer norms), in float64;
* Llama and T5: the substituted weights applied by hooks on the value and output projections instead of
  the attention interface;
* transformers' own masked-LM and causal-LM losses (``labels=``);
* the whole-model mode rebuilt from sequential per-site forwards, and its alpha -> 0 limit (p* -> p_att
  linearly in alpha when the model's logits are fixed);
* sentence-transformers' own MiniLM embeddings for the mean pooling.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probe.interventions as iv
from probe.batch.problems import FIDELITY_TOLERANCE
from probe.capture.adapters.mpnet import MPNetAdapter
from probe.capture.loading import LoadedModel, load_model
from probe.core.errors import ProbeError
from probe.interventions.forward import site_blocks

from ..support.families import CORPUS, SOURCES, TARGETS, build_config, save_tiny, spec, tokenizer_for
from ..support.models import save_tiny_bert

TEXTS = [
    "A padded batch: this sentence is much longer than the next one, by design of the test.",
    "Tiny.",
    "Medium length sentence with some words.",
]


def encode(loaded, texts, targets=None):
    return loaded.adapter.encode(loaded.tokenizer, list(texts), list(targets) if targets else None, 64)


@pytest.fixture(scope="module")
def bert(tmp_path_factory, minilm_dir):
    directory = save_tiny_bert(tmp_path_factory.mktemp("iv-bert"), minilm_dir, seed=5)
    return load_model(str(directory), device="cpu")


@pytest.fixture(scope="module")
def bert64(tmp_path_factory, minilm_dir):
    directory = save_tiny_bert(tmp_path_factory.mktemp("iv-bert64"), minilm_dir, seed=6)
    return load_model(str(directory), device="cpu", dtype="float64")


@pytest.fixture(scope="module", params=["t5", "llama"])
def generic(request, tmp_path_factory, minilm_dir):
    family = spec(request.param)
    directory = save_tiny(family, tmp_path_factory.mktemp(f"iv-{request.param}"), minilm_dir)
    return family, load_model(str(directory), device="cpu")


def generic_inputs(family, loaded):
    if family.kind == "encoder_decoder":
        return encode(loaded, SOURCES[:3], TARGETS[:3])
    return encode(loaded, CORPUS[:3])


def own_attention_everywhere(config=iv.InterventionConfig()):
    """at_site: every site gets the 'model' substitute (p_att rebuilt from its problems)."""
    def at_site(name, site):
        space = site.spaces[0]
        return iv.site_substitutes(site, ("model",), 1.0, space, 1e-9, 0, range(site.shape[0]))["model"].weights
    return at_site


# --------------------------------------------------------------------------------------------------
# 1. the identity: the model's own attention reproduces the model


def test_own_attention_reproduces_bert(bert):
    inputs = encode(bert, TEXTS)
    with torch.no_grad():
        plain = bert.model(**inputs).last_hidden_state
    substituted = iv.run_forward(bert, inputs, own_attention_everywhere())
    real = inputs["attention_mask"].bool()
    assert float((substituted.hidden - plain).abs()[real].max()) <= 10 * FIDELITY_TOLERANCE["float32"]
    records = iv.intervention_records(bert, inputs, [0, 1, 2], iv.InterventionConfig(substitutes=("model",)))
    assert {r["site"] for r in records} == {"self:0", "self:1", "whole"}
    assert all(r["hidden_change"] <= 1e-5 and r["embedding_cosine"] >= 1 - 1e-10 for r in records)


def test_own_attention_reproduces_generic_families(generic):
    family, loaded = generic
    inputs = generic_inputs(family, loaded)
    with torch.no_grad():
        plain = loaded.model(**inputs, use_cache=False)
    reference = iv.run_forward(loaded, inputs)
    substituted = iv.run_forward(loaded, inputs, own_attention_everywhere())
    real = reference.mask
    if family.kind == "encoder_decoder":  # the seq2seq head's logits are the model's own
        torch.testing.assert_close(reference.logits, plain.logits, rtol=0, atol=1e-6)
        assert float((substituted.logits - plain.logits).abs()[real].max()) <= 1e-4
    else:
        torch.testing.assert_close(reference.hidden, plain.last_hidden_state, rtol=0, atol=1e-6)
        assert float((substituted.hidden - plain.last_hidden_state).abs()[real].max()) <= 1e-4
    records = iv.whole_model_records(loaded, inputs, [0, 1, 2], iv.InterventionConfig(substitutes=("model",)))
    assert all(r["hidden_change"] <= 1e-5 for r in records)
    if family.kind == "encoder_decoder":
        assert all(r["lm_head"] == "seq2seq" and r["top1_agreement"] == 1.0 for r in records)
        assert all(abs(r["lm_loss"] - r["lm_loss_original"]) <= 1e-5 for r in records)
        # teacher forcing: position j is scored on the next decoder input token; transformers' own loss
        ids, mask = inputs["decoder_input_ids"], inputs["decoder_attention_mask"].bool()
        for row in records:
            i = row["example"]
            labels = torch.full_like(ids[i:i + 1], -100)
            n = int(mask[i].sum())
            labels[0, :n - 1] = ids[i, 1:n]
            with torch.no_grad():
                expected = loaded.model(**{k: v[i:i + 1] for k, v in inputs.items()}, labels=labels).loss
            assert row["scored_tokens"] == n - 1
            assert row["lm_loss_original"] == pytest.approx(float(expected), rel=1e-6)


def test_capture_forward_emits_the_adapters_sites(bert):
    """The per-site mode's capture forward hands the pipeline's row solver the sites the adapter captures."""
    inputs = encode(bert, TEXTS)
    emitted = []
    config = iv.InterventionConfig(substitutes=("model",), whole_model=False)
    iv.intervention_records(bert, inputs, [0, 1, 2], config, emit=emitted.append)
    captured = bert.adapter.sites(bert.model, inputs)
    assert [(s.attention_type, s.layer) for s in emitted] == [(s.attention_type, s.layer) for s in captured]
    for ours, theirs in zip(emitted, captured):
        for name in ("queries", "keys", "values", "log_preference", "query_mask", "key_mask", "model_probs",
                     "key_hidden", "key_weight", "query_positions"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
        assert ours.logit_scale == theirs.logit_scale


# --------------------------------------------------------------------------------------------------
# 2. substitution checked against independent forwards


def random_weights(site, seed):
    """Random distributions over each row's allowed keys, (b, h, q, k)."""
    b, h, q, k = site.shape
    logits = torch.randn(b, h, q, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    return torch.softmax(logits + site.log_preference.expand(b, h, q, k), dim=-1)


@torch.no_grad()
def manual_bert(model, inputs, substituted_layer=None, weights=None):
    """BERT's forward written out from the weights in float64; ``weights`` replace the attention weights of
    ``substituted_layer`` (every head)."""
    f64 = torch.float64
    config = model.config
    ids, mask = inputs["input_ids"], inputs["attention_mask"].bool()
    embeddings = model.embeddings
    positions = torch.arange(ids.shape[1])
    token_types = inputs.get("token_type_ids", torch.zeros_like(ids))
    x = (embeddings.word_embeddings.weight[ids] + embeddings.position_embeddings.weight[positions]
         + embeddings.token_type_embeddings.weight[token_types]).to(f64)

    def layer_norm(y, norm):
        return torch.nn.functional.layer_norm(y, y.shape[-1:], norm.weight.to(f64), norm.bias.to(f64), norm.eps)

    def linear(y, module):
        return y @ module.weight.to(f64).T + module.bias.to(f64)

    x = layer_norm(x, embeddings.LayerNorm)
    heads = config.num_attention_heads
    b, n, width = x.shape
    d = width // heads
    split = lambda y: y.view(b, n, heads, d).transpose(1, 2)  # noqa: E731
    for index, layer in enumerate(model.encoder.layer):
        attention = layer.attention.self
        q, k, v = (split(linear(x, m)) for m in (attention.query, attention.key, attention.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(~mask[:, None, None, :], -torch.inf)
        p = torch.softmax(scores, dim=-1)
        if index == substituted_layer:
            p = weights.to(f64)
        context = (p @ v).transpose(1, 2).reshape(b, n, width)
        x = layer_norm(linear(context, layer.attention.output.dense) + x, layer.attention.output.LayerNorm)
        inner = torch.nn.functional.gelu(linear(x, layer.intermediate.dense))
        x = layer_norm(linear(inner, layer.output.dense) + x, layer.output.LayerNorm)
    return x


def test_bert_substitution_matches_a_manual_forward(bert64):
    loaded = bert64
    inputs = encode(loaded, TEXTS)
    real = inputs["attention_mask"].bool()
    sites = loaded.adapter.sites(loaded.model, inputs)
    plain = manual_bert(loaded.model, inputs)
    reference = iv.run_forward(loaded, inputs)
    assert float((reference.hidden - plain).abs()[real].max()) <= 1e-10  # the manual forward is BERT's
    for layer in (0, 1):
        weights = random_weights(sites[layer], seed=layer)
        manual = manual_bert(loaded.model, inputs, layer, weights)
        ours = iv.run_forward(loaded, inputs, lambda name, site: weights if name == f"self:{layer}" else None)
        assert float((manual - plain).abs()[real].max()) > 1e-2  # the substitution changes the model
        assert float((ours.hidden - manual).abs()[real].max()) <= 1e-10


def test_bert_effects_match_a_manual_forward(bert64):
    """The records of per-site exact and null substitution = effects computed here from manual forwards
    with the same weights (hidden change, cosine of the first token, as this checkpoint has no pooling
    files)."""
    loaded = bert64
    inputs = encode(loaded, TEXTS)
    real = inputs["attention_mask"].bool()
    config = iv.InterventionConfig(substitutes=("exact", "null"), alphas=(4.0,), whole_model=False, seed=3)
    records = iv.per_site_records(loaded, inputs, [10, 11, 12], config)
    sites = loaded.adapter.sites(loaded.model, inputs)
    plain = manual_bert(loaded.model, inputs)
    for site in sites:
        substitutes = iv.site_substitutes(site, ("exact", "null"), 4.0, "hidden", 1e-9, 3, [10, 11, 12])
        for kind, substitute in substitutes.items():
            manual = manual_bert(loaded.model, inputs, site.layer, substitute.weights)
            change = ((manual - plain).norm(dim=-1) / plain.norm(dim=-1) * real).sum(-1) / real.sum(-1)
            cosine = torch.nn.functional.cosine_similarity(manual[:, 0], plain[:, 0], dim=-1)
            mine = sorted((r for r in records if r["site"] == f"self:{site.layer}" and r["substitute"] == kind),
                          key=lambda r: r["example"])
            assert [r["pooling"] for r in mine] == ["first"] * 3
            assert change.min() > 1e-6  # a visible effect
            np.testing.assert_allclose([r["hidden_change"] for r in mine], change.numpy(), rtol=1e-7)
            np.testing.assert_allclose([1 - r["embedding_cosine"] for r in mine], (1 - cosine).numpy(), rtol=1e-5,
                                       atol=1e-14)


def test_generic_substitution_matches_projection_hooks(generic):
    """Llama (rotary, grouped-query) and T5 (position bias; decoder self- and cross-attention): substituted
    weights applied through the interface = the same weights applied by hooks on the value and output
    projections (o_proj / o) of the site's module, the model's own attention left running."""
    family, loaded = generic
    model = loaded.model
    inputs = generic_inputs(family, loaded)
    sites = {f"{s.attention_type}:{s.layer}": s for s in loaded.adapter.sites(model, inputs)}
    modules = {}
    counts = {}
    for module, kind in loaded.adapter.site_modules(model).items():  # named_modules order = call order here
        modules[f"{kind}:{counts.get(kind, 0)}"] = module
        counts[kind] = counts.get(kind, 0) + 1
    chosen = ["causal_self:1"] if family.kind == "decoder" else ["decoder_self:1", "cross:0", "encoder_self:0"]
    value_name, output_name = ("v_proj", "o_proj") if family.kind == "decoder" else ("v", "o")
    for name in chosen:
        weights = random_weights(sites[name], seed=len(name)).float()
        module = modules[name]
        values = {}
        hooks = [
            getattr(module, value_name).register_forward_hook(lambda _m, _a, out: values.__setitem__("v", out)),
            getattr(module, output_name).register_forward_pre_hook(
                lambda _m, args: (replace(args[0], values["v"], weights),)),
        ]
        try:
            with torch.no_grad():
                hooked = model(**inputs, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        ours = iv.run_forward(loaded, inputs, lambda at, _s, name=name: weights if at == name else None)
        expected = hooked.logits if family.kind == "encoder_decoder" else hooked.last_hidden_state
        got = ours.logits if family.kind == "encoder_decoder" else ours.hidden
        real = ours.mask
        reference = iv.run_forward(loaded, inputs)
        before = reference.logits if family.kind == "encoder_decoder" else reference.hidden
        assert float((expected - before).abs()[real].max()) > 1e-3, name  # the substitution changes the model
        assert float((got - expected).abs()[real].max()) <= 1e-5, name


def replace(attention_output, value_output, weights):
    """(b, q, h * d) attention output from ``weights`` (b, h, q, k) and the value projection's output."""
    b, h, q, k = weights.shape
    d = attention_output.shape[-1] // h
    groups = value_output.shape[-1] // d
    v = value_output.view(b, k, groups, d).transpose(1, 2).repeat_interleave(h // groups, dim=1)
    return (weights @ v).transpose(1, 2).reshape(b, q, h * d)


# --------------------------------------------------------------------------------------------------
# 3. language-model heads


def test_masked_lm_loss_is_transformers_loss(tmp_path, minilm_dir):
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(tmp_path)
    base = load_model(str(tmp_path), device="cpu")
    assert iv.lm_kind(base) is None  # probe loads the base model
    loaded = iv.with_lm_head(base)
    assert iv.lm_kind(loaded) == "masked" and loaded.info["lm_head"] == "masked"
    inputs = encode(loaded, TEXTS)
    masked, labels = iv.masked_lm_inputs(inputs, loaded.tokenizer, 7, [0, 1, 2])
    config = iv.InterventionConfig(substitutes=("model", "exact"), seed=7, whole_model=False)
    records = [r for r in iv.per_site_records(loaded, inputs, [0, 1, 2], config) if r["site"] == "self:0"]
    # transformers' own head and loss, on the model loaded by transformers itself
    reference_model = BertForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = float(reference_model(**masked, labels=labels).loss)
    for kind in ("model", "exact"):
        rows = sorted((r for r in records if r["substitute"] == kind), key=lambda r: r["example"])
        counts = np.array([r["scored_tokens"] for r in rows])
        assert counts.tolist() == (labels != -100).sum(-1).tolist()
        pooled = float(np.sum([r["lm_loss_original"] for r in rows] * counts) / counts.sum())
        assert pooled == pytest.approx(expected, rel=1e-6)
    model_rows = [r for r in records if r["substitute"] == "model"]
    assert all(r["top1_agreement"] == 1.0 and abs(r["lm_loss"] - r["lm_loss_original"]) < 1e-5 for r in model_rows)


def test_masked_lm_inputs_follow_the_recipe(minilm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (120, 60), generator=generator)
    ids[:, 0], ids[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    attention_mask = torch.ones_like(ids)
    attention_mask[::2, 40:] = 0  # half the examples padded
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    masked, labels = iv.masked_lm_inputs(inputs, tokenizer, 1, list(range(120)))
    chosen = labels != -100
    candidates = attention_mask.bool() & ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    assert not (chosen & ~candidates).any()  # only real, non-special tokens
    assert chosen.sum(-1).tolist() == [max(1, round(0.15 * int(c))) for c in candidates.sum(-1)]
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(masked["input_ids"][~chosen], ids[~chosen])
    replaced = masked["input_ids"][chosen]
    share_mask = float((replaced == tokenizer.mask_token_id).double().mean())
    share_kept = float((replaced == ids[chosen]).double().mean())
    assert abs(share_mask - 0.8) < 0.04 and abs(share_kept - 0.1) < 0.03  # of ~1100 draws
    # an example's mask depends on the seed and its id, not on its batch
    alone, alone_labels = iv.masked_lm_inputs({k: v[5:6] for k, v in inputs.items()}, tokenizer, 1, [5])
    assert torch.equal(alone["input_ids"][0], masked["input_ids"][5]) and torch.equal(alone_labels[0], labels[5])
    other, _ = iv.masked_lm_inputs(inputs, tokenizer, 2, list(range(120)))
    assert not torch.equal(other["input_ids"], masked["input_ids"])


def test_causal_lm_loss_is_transformers_loss(tmp_path, minilm_dir):
    from transformers import GPT2LMHeadModel

    family = spec("gpt2")
    tokenizer = tokenizer_for(family, minilm_dir)
    torch.manual_seed(0)
    GPT2LMHeadModel(build_config(family, tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = iv.with_lm_head(load_model(str(tmp_path), device="cpu"))
    assert iv.lm_kind(loaded) == "causal"
    inputs = encode(loaded, CORPUS[:3])
    records = iv.whole_model_records(loaded, inputs, [0, 1, 2], iv.InterventionConfig(substitutes=("model",)))
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    reference_model = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for row in records:
        i = row["example"]
        n = int(inputs["attention_mask"][i].sum())
        with torch.no_grad():
            expected = reference_model(input_ids=inputs["input_ids"][i:i + 1, :n], labels=labels[i:i + 1, :n]).loss
        assert row["scored_tokens"] == n - 1
        assert row["lm_loss_original"] == pytest.approx(float(expected), rel=1e-6)
        assert row["pooling"] == "last" and row["top1_agreement"] == 1.0


# --------------------------------------------------------------------------------------------------
# 4. the null


def test_null_has_the_total_variation_of_the_exact_posterior(bert):
    inputs = encode(bert, TEXTS)
    for site in bert.adapter.sites(bert.model, inputs):
        for alpha in (1.0, 8.0):
            subs = iv.site_substitutes(site, ("exact", "null", "model"), alpha, "hidden", 1e-9, 0, [0, 1, 2])
            p_att, exact, null = (subs[k].weights for k in ("model", "exact", "null"))
            real = site.query_mask[:, None, :].expand(p_att.shape[:3])
            tv_exact = 0.5 * (exact - p_att).abs().sum(-1)[real]
            tv_null = 0.5 * (null - p_att).abs().sum(-1)[real]
            assert float(tv_exact.max()) > 1e-4  # a real perturbation to match
            torch.testing.assert_close(tv_null, tv_exact, rtol=0, atol=1e-12)
            assert float(null.min()) >= 0 and torch.allclose(null.sum(-1), torch.ones_like(null.sum(-1)), atol=1e-12)
            excluded = ~torch.isfinite(site.log_preference.expand_as(null))
            assert float(null[excluded].abs().max()) == 0
            assert float((null - exact).abs().sum(-1)[real].max()) > 1e-4  # not p* itself
            again = iv.site_substitutes(site, ("null",), alpha, "hidden", 1e-9, 0, [0, 1, 2])["null"].weights
            other = iv.site_substitutes(site, ("null",), alpha, "hidden", 1e-9, 1, [0, 1, 2])["null"].weights
            assert torch.equal(again, null) and not torch.equal(other, null)


@st.composite
def null_instances(draw):
    """Peaked and flat distributions, some keys excluded, and tau anywhere in [0, 1 - min p], its edge included."""
    n = draw(st.integers(2, 12))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 40.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=generator, dtype=torch.float64) * scale
    allowed = torch.rand(n, generator=generator) < 0.8
    allowed[draw(st.integers(0, n - 1))] = True
    p = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1)
    edge = 1 - float(p[allowed].min())
    tau = draw(st.sampled_from([0.0, edge, "fraction"]))
    if tau == "fraction":
        tau = edge * draw(st.floats(0, 1))
    return p, torch.tensor(tau, dtype=torch.float64), allowed, seed


@settings(max_examples=100, deadline=None, database=None)
@given(null_instances())
def test_null_attention_property(instance):
    p, tau, allowed, seed = instance
    q = iv.null_attention(p[None], tau[None], allowed[None], torch.Generator().manual_seed(seed))[0]
    assert float(q.min()) >= 0 and abs(float(q.sum()) - 1) <= 1e-12
    assert float(q[~allowed].abs().sum()) == 0
    assert abs(0.5 * float((q - p).abs().sum()) - float(tau)) <= 1e-12


# --------------------------------------------------------------------------------------------------
# 5. whole model


def test_whole_model_is_sequential_exact_substitution(bert64):
    """The whole-model record = two forwards built here: substitute layer 0's p* (from the plain capture),
    capture layer 1 on the states that gives, solve it, then substitute both.  Every row certified."""
    loaded = bert64
    inputs = encode(loaded, TEXTS)
    config = iv.InterventionConfig(substitutes=("exact",), alphas=(4.0,), per_site=False)
    records = sorted(iv.whole_model_records(loaded, inputs, [0, 1, 2], config), key=lambda r: r["example"])
    real_rows = int(inputs["attention_mask"].sum()) * loaded.model.config.num_attention_heads * 2
    assert sum(r["solver_rows"] for r in records) == real_rows
    assert all(r["solver_not_converged"] == 0 and r["max_relative_error_bound"] <= 1e-9 for r in records)

    def exact(site):
        return iv.site_substitutes(site, ("exact",), 4.0, "hidden", 1e-9, 0, [0, 1, 2])["exact"].weights

    first = exact(loaded.adapter.sites(loaded.model, inputs)[0])
    captured = {}

    def layer0_then_capture(name, site):
        if name == "self:1":
            captured["site"] = site
            return None
        return first

    iv.run_forward(loaded, inputs, layer0_then_capture)
    second = exact(captured["site"])
    both = iv.run_forward(loaded, inputs, lambda name, site: first if name == "self:0" else second)
    reference = iv.run_forward(loaded, inputs)
    expected = iv.effects(reference, both, "first")
    np.testing.assert_allclose([r["hidden_change"] for r in records], expected["hidden_change"].numpy(), rtol=1e-9)
    # not the per-site substitution of layer 1's original problems
    per_site = exact(loaded.adapter.sites(loaded.model, inputs)[1])
    assert float((per_site - second).abs().max()) > 1e-6


def test_whole_model_starts_after_the_per_site_forward_of_the_first_site(bert):
    """With both modes, the whole-model forward takes its first block from the per-site forward of the
    first site (the same substitution on the same inputs) and runs the model once less; its records are
    those of the whole-model mode alone, bit for bit, certificates included."""
    inputs = encode(bert, TEXTS)
    kinds = ("exact", "second-order", "null", "model")
    config = iv.InterventionConfig(substitutes=kinds, alphas=(1.0, 3.0))
    first_block = site_blocks(bert.model, bert.adapter.site_modules(bert.model))[0]
    original, calls = first_block.forward, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    first_block.forward = counting
    try:
        both = [r for r in iv.intervention_records(bert, inputs, [0, 1, 2], config) if r["site"] == iv.WHOLE]
    finally:
        del first_block.forward
    # the reference, then per alpha and substitute one per-site forward from site 0; the whole model: none
    assert len(calls) == 1 + len(config.alphas) * len(kinds)
    alone = iv.whole_model_records(bert, inputs, [0, 1, 2], config)
    def comparable(records):  # NaN (no solve) compares equal to NaN
        return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in records]

    assert comparable(both) == comparable(alone)
    assert {r["substitute"] for r in both} == set(kinds) and max(r["hidden_change"] for r in both) > 1e-6


def test_whole_model_effect_vanishes_linearly_as_alpha_goes_to_zero(bert64):
    """With the model's logits fixed, p* = softmax(logits + alpha G (u - p*)) -> p_att as alpha -> 0, with
    TV of order alpha: the effect of the inference transformer goes to 0 at the same rate."""
    loaded = bert64
    inputs = encode(loaded, TEXTS)
    change = {}
    for alpha in (1e-2, 1e-3, 1e-4):
        config = iv.InterventionConfig(substitutes=("exact",), alphas=(alpha,), per_site=False)
        records = iv.whole_model_records(loaded, inputs, [0, 1, 2], config)
        assert all(r["solver_not_converged"] == 0 for r in records)
        change[alpha] = np.array([r["hidden_change"] for r in records])
    assert change[1e-4].max() < 1e-4
    np.testing.assert_allclose(change[1e-3] / change[1e-2], 0.1, rtol=0.05)
    np.testing.assert_allclose(change[1e-4] / change[1e-3], 0.1, rtol=0.02)


# --------------------------------------------------------------------------------------------------
# 6. refusals and configuration


def test_families_without_the_interface_are_refused(bert):
    fake = LoadedModel(adapter=MPNetAdapter(), model=bert.model, tokenizer=bert.tokenizer, info={"model_type": "mpnet"})
    assert "hooks" in iv.can_intervene(fake)
    with pytest.raises(ProbeError, match="Cannot intervene"):
        iv.per_site_records(fake, encode(bert, TEXTS), [0, 1, 2], iv.InterventionConfig())
    assert iv.can_intervene(bert) is None


@pytest.mark.parametrize("arguments, message", [
    ({"substitutes": ("exact", "posterior")}, "Unknown substitute"),
    ({"substitutes": ()}, "Unknown substitute"),
    ({"alphas": (0.0,)}, "alpha must be positive"),
    ({"alphas": (float("inf"),)}, "alpha must be positive"),
])
def test_bad_configurations(arguments, message):
    with pytest.raises(ProbeError, match=message):
        iv.InterventionConfig(**arguments)


def test_rotary_models_refuse_the_hidden_space(generic):
    family, loaded = generic
    if family.kind != "decoder":  # T5 has both spaces
        records = iv.whole_model_records(loaded, generic_inputs(family, loaded), [0, 1, 2],
                                         iv.InterventionConfig(substitutes=("model",), spaces=("hidden", "key")))
        assert sorted({r["space"] for r in records}) == ["hidden", "key"]
        return
    with pytest.raises(ProbeError, match="key only"):
        iv.whole_model_records(loaded, generic_inputs(family, loaded), [0, 1, 2],
                               iv.InterventionConfig(spaces=("hidden",)))


def test_pooling_files_are_read(tmp_path, bert):
    info = dict(bert.info, path=str(tmp_path))
    other = LoadedModel(adapter=bert.adapter, model=bert.model, tokenizer=bert.tokenizer, info=info)
    assert iv.pooling_of(other) == "first"
    (tmp_path / "modules.json").write_text('[{"idx": 1, "name": "1", "path": "1_Pooling", '
                                           '"type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    assert iv.pooling_of(other) == "max"
    (tmp_path / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_max_tokens": true, "pooling_mode_cls_token": true}')
    with pytest.raises(ProbeError, match="exactly one mode"):
        iv.pooling_of(other)


# --------------------------------------------------------------------------------------------------
# 7. the real MiniLM


def test_minilm_per_site_exact(minilm_dir):
    from sentence_transformers import SentenceTransformer

    loaded = load_model(str(minilm_dir), device="cpu")
    texts = ["The cat sat on the mat.", "Attention is inference, or is it?"]
    inputs = encode(loaded, texts)
    assert iv.pooling_of(loaded) == "mean"
    # the mean pooling is sentence-transformers' own embedding (before its Normalize module)
    reference = iv.run_forward(loaded, inputs)
    ours = torch.nn.functional.normalize(iv.pool(reference.hidden, reference.mask, "mean"), dim=-1)
    theirs = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=1e-5)
    config = iv.InterventionConfig(substitutes=("exact",), whole_model=False)
    records = iv.records_table(iv.per_site_records(loaded, inputs, [0, 1], config)).to_pylist()
    assert sorted({r["site"] for r in records}) == [f"self:{i}" for i in range(6)]
    assert all(r["pooling"] == "mean" and r["lm_head"] is None and r["solver_not_converged"] == 0 for r in records)
    for name in ("hidden_change", "embedding_cosine"):
        assert all(math.isfinite(r[name]) for r in records)
    assert all(0 < r["hidden_change"] and -1 <= r["embedding_cosine"] < 1 for r in records)


def test_lm_heads_the_checkpoint_lacks(tmp_path, minilm_dir):
    """A config naming BertForMaskedLM over weights without its head is refused (the head would be random);
    ELECTRA's discriminator (ElectraForPreTraining, no masked-LM head) gives no LM effects, not an error."""
    import json

    from transformers import AutoTokenizer, BertConfig, BertModel, ElectraConfig, ElectraForPreTraining

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    bert_dir, electra_dir = tmp_path / "bert", tmp_path / "electra"
    small = dict(vocab_size=len(tokenizer), num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=64)
    BertModel(BertConfig(hidden_size=16, **small)).save_pretrained(bert_dir)
    saved = json.loads((bert_dir / "config.json").read_text())
    (bert_dir / "config.json").write_text(json.dumps(dict(saved, architectures=["BertForMaskedLM"])))
    ElectraForPreTraining(ElectraConfig(hidden_size=16, embedding_size=8, **small)).save_pretrained(electra_dir)
    for directory in (bert_dir, electra_dir):
        tokenizer.save_pretrained(directory)
    with pytest.raises(ProbeError, match="would be random"):
        iv.with_lm_head(load_model(str(bert_dir), device="cpu"))
    electra = iv.with_lm_head(load_model(str(electra_dir), device="cpu"))
    assert electra.info["lm_head"] is None and iv.lm_kind(electra) is None
    assert type(electra.model).__name__ == "ElectraModel"


@pytest.fixture(scope="module", params=["albert", "gpt2", "bart"])
def more_families(request, tmp_path_factory, minilm_dir):
    family = spec(request.param)
    directory = save_tiny(family, tmp_path_factory.mktemp(f"iv-{request.param}"), minilm_dir)
    return family, load_model(str(directory), device="cpu")


def assert_from_site_equals_full(loaded, inputs):
    """Per site, the rerun that replays the earlier layers' recorded outputs gives the outputs of a full
    forward with the same substituted weights, and really skips layers (the first layer runs fewer times)."""
    trace = iv.Trace(outputs=[], sites=[], block_of={}, modules={})
    sites = {}
    iv.run_forward(loaded, inputs, lambda name, site: sites.__setitem__(name, site), trace=trace)
    assert len(sites) >= 2 and set(trace.block_of) == set(sites)
    first_block = site_blocks(loaded.model, loaded.adapter.site_modules(loaded.model))[0]
    original = first_block.forward
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    first_block.forward = counting
    try:
        for index, (name, site) in enumerate(sites.items()):
            weights = random_weights(site, seed=index).to(site.values.dtype)
            at_site = lambda at, _site, name=name: weights if at == name else None  # noqa: E731
            calls.clear()
            full = iv.run_forward(loaded, inputs, at_site)
            full_calls = len(calls)
            calls.clear()
            fast = iv.run_forward(loaded, inputs, at_site, trace=trace, start_at=trace.block_of[name])
            if trace.block_of[name] > 0:  # block call 0 is the first block's: replayed, not run
                assert len(calls) < full_calls, name
            assert torch.equal(fast.hidden, full.hidden), name
            assert (fast.logits is None) == (full.logits is None) and (
                fast.logits is None or torch.equal(fast.logits, full.logits)), name
    finally:
        del first_block.forward
    assert_projections_replayed(loaded, inputs, trace, sites)


def assert_projections_replayed(loaded, inputs, trace, sites):
    """A rerun from a site's block answers the projections of that block's first site (called before its
    attention) from the trace: each is computed once less than in the same rerun without them, and the
    outputs are the same."""
    replayed = 0
    for index, name in enumerate(sites):
        start_at = trace.block_of[name]
        first = trace.sites[start_at][0]
        projections = trace.projections[first]
        weights = random_weights(sites[name], seed=10 + index).to(sites[name].values.dtype)
        at_site = lambda at, _site, name=name: weights if at == name else None  # noqa: E731
        counts = {}
        for projection in projections:  # counts the computations (a replayed call does not reach them)
            def counting(*args, projection=projection, original=projection.forward, **kwargs):
                counts[projection] = counts.get(projection, 0) + 1
                return original(*args, **kwargs)
            projection.forward = counting
        try:
            fast = iv.run_forward(loaded, inputs, at_site, trace=trace, start_at=start_at)
            computed = dict(counts)
            counts.clear()
            without = iv.Trace(outputs=trace.outputs, sites=trace.sites, block_of=trace.block_of,
                               modules=trace.modules)  # no recorded projections
            slow = iv.run_forward(loaded, inputs, at_site, trace=without, start_at=start_at)
        finally:
            for projection in projections:
                del projection.forward
        assert torch.equal(fast.hidden, slow.hidden), name
        assert all(counts[projection] - computed.get(projection, 0) == 1 for projection in projections), name
        replayed += len(projections)
    assert replayed >= len(sites)  # every family here has its query, key and value in the site's module


def test_forward_from_the_site_on_bert(bert):
    inputs = encode(bert, TEXTS)
    assert_from_site_equals_full(bert, inputs)
    config = dict(substitutes=("null",), whole_model=False, alphas=(2.0,))
    full = iv.per_site_records(bert, inputs, [0, 1, 2], iv.InterventionConfig(**config, from_site=False))
    fast = iv.per_site_records(bert, inputs, [0, 1, 2], iv.InterventionConfig(**config))
    def comparable(records):  # NaN (no LM head, no solve) compares equal to NaN
        return [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in records]

    assert comparable(full) == comparable(fast) and max(r["hidden_change"] for r in fast) > 1e-6


def test_forward_from_the_site_on_generic(generic):
    """T5: encoder layers replayed for decoder sites; Llama: decoder-only, rotary."""
    family, loaded = generic
    assert_from_site_equals_full(loaded, generic_inputs(family, loaded))


def test_forward_from_the_site_on_more_families(more_families):
    """ALBERT: one layer module called for every layer; GPT-2; BART."""
    family, loaded = more_families
    assert_from_site_equals_full(loaded, generic_inputs(family, loaded))


@pytest.mark.parametrize("pooling, expected", [
    ("first", [[1.0, -1.0], [4.0, -4.0]]),  # the first real position, left padding included
    ("cls", [[1.0, -1.0], [4.0, -4.0]]),
    ("last", [[2.0, -2.0], [7.0, -7.0]]),
    ("lasttoken", [[2.0, -2.0], [7.0, -7.0]]),
    ("mean", [[1.5, -1.5], [5.5, -5.5]]),
    ("mean_sqrt_len", [[3 / math.sqrt(2), -3 / math.sqrt(2)], [11.0, -11.0]]),
    ("max", [[2.0, -1.0], [7.0, -4.0]]),
])
def test_pooling_modes(pooling, expected):
    positions = torch.arange(8.0).view(2, 4, 1)
    hidden = torch.cat([positions, -positions], dim=-1)  # (2 examples, 4 positions, 2 dims)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(iv.pool(hidden, mask, pooling), torch.tensor(expected, dtype=torch.float64))
