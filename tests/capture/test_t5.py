"""T5 adapter: encoder self-, decoder (causal) self- and cross-attention of random T5s built from config.

No hub access: models are built from ``T5Config`` and saved with ``save_pretrained`` next to a small
T5 tokenizer (transformers' own ``T5Tokenizer``, a Unigram model, built from an explicit vocabulary
with T5's special ids pad=0, eos=1, unk=2), then loaded through :func:`probe.capture.loading.load_model`
exactly as a user's checkpoint would be.

Lengths are chosen so that T5's relative-position bucketing leaves its exact range: encoder buckets
are bidirectional (16 per direction, exact below distance 8) and decoder buckets unidirectional
(32, exact below distance 16), so the batch has encoder texts longer than 8 tokens and decoder
targets longer than 16.  Relative-attention-bias tables are drawn with standard deviation 1.5 so that
a wrong bias (or bucketing) shows in the fidelity check.
"""

from __future__ import annotations

import json
import string

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from probe.batch.rows import fidelity_error, site_problems
from probe.capture.adapters import adapter_for, space_problems
from probe.capture.adapters.t5 import T5Adapter
from probe.capture.data import DatasetSpec
from probe.capture.loading import load_model
from probe.pipeline.runner import RunConfig, run
from probe.solve.dual import solve_dual
from probe.solve.reference import lbfgs_dual, relative_deviation

WORDS = (
    "the quick brown fox jumps over lazy dog attention is a convex problem solution of closed form "
    "and every head layer query token model"
).split()

TEXTS = [
    "the quick brown fox",  # 5 encoder tokens (with </s>)
    "attention is the closed form solution of a convex problem , or so the claim goes for every head",
    "Why é?",  # characters outside the word list: pieces and <unk>
]
TARGETS = [
    "the lazy dog jumps over the quick brown fox and the dog is a fox",  # ~17 decoder tokens
    "every layer and every head of the model",  # ~9
    "a convex problem of closed form : the solution is attention over every token of the query , "
    "and the quick brown fox jumps",  # > 24
]


def make_tokenizer():
    """A T5 (Unigram) tokenizer with pad=0, eos=1, unk=2: whole words from WORDS, else characters."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [("▁" + word, -1.0) for word in WORDS]
    symbols = string.ascii_letters + string.digits + ",.:;!?'-"
    vocab += [(c, -5.0) for c in symbols] + [("▁" + c, -5.5) for c in symbols]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    return tokenizer


def save_tiny_t5(directory, *, d_model=64, d_kv=16, heads=4, layers=2, decoder_layers=2, d_ff=128, buckets=32,
                 max_distance=128, feed_forward_proj="relu", model_class="T5ForConditionalGeneration", seed=0):
    """Build a random T5 from config, save it with the tokenizer and return the directory."""
    import transformers
    from transformers import T5Config

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_heads=heads, num_layers=layers,
        num_decoder_layers=decoder_layers, relative_attention_num_buckets=buckets,
        relative_attention_max_distance=max_distance, feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=feed_forward_proj == "relu",  # flan-t5 (gated-gelu) unties them
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.1,
    )
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():  # a strong position bias, so that its handling is exercised
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 1.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_t5_dir(tmp_path_factory):
    return save_tiny_t5(tmp_path_factory.mktemp("tiny-t5"))


@pytest.fixture(scope="module")
def tiny_t5(tiny_t5_dir):
    return load_model(str(tiny_t5_dir), device="cpu")


def batch(loaded, texts=TEXTS, targets=TARGETS, max_length=128):
    return loaded.adapter.encode(loaded.tokenizer, texts, targets, max_length)


def lengths(tokenizer, strings, max_length=128):
    return [len(ids) for ids in tokenizer(strings, truncation=True, max_length=max_length)["input_ids"]]


def capture_all(loaded, inputs):
    return loaded.adapter.sites(loaded.model, inputs)


def assert_sites_complete(loaded, sites):
    config = loaded.model.config
    expected = (
        [("encoder_self", i) for i in range(config.num_layers)]
        + [("decoder_self", i) for i in range(config.num_decoder_layers)]
        + [("cross", i) for i in range(config.num_decoder_layers)]
    )
    # emitted in the order the model runs them (decoder self- and cross-attention interleaved)
    assert sorted((site.attention_type, site.layer) for site in sites) == sorted(expected)


def assert_fidelity(sites, tolerance=1e-5):
    for site in sites:
        error = fidelity_error(site)
        assert error <= tolerance, f"{site.attention_type} layer {site.layer}: fidelity error {error:.2e}"


def assert_matches_output_attentions(loaded, sites, inputs, tolerance=1e-5):
    """softmax(log u + s) equals the attentions the model reports with output_attentions=True (eager)."""
    with torch.no_grad():
        out = loaded.model(**inputs, output_attentions=True, use_cache=False)
    reported = {"encoder_self": out.encoder_attentions, "decoder_self": out.decoder_attentions,
                "cross": out.cross_attentions}
    for site in sites:
        model_probs = reported[site.attention_type][site.layer].to(torch.float64)
        reconstructed = torch.softmax(site.log_preference + space_problems(site, "hidden").logits, dim=-1)
        real = site.query_mask[:, None, :, None].expand_as(model_probs)
        difference = (reconstructed - model_probs).abs()[real]
        assert difference.numel() and float(difference.max()) <= tolerance, (site.attention_type, site.layer)


# --------------------------------------------------------------------------------------------------
# 1. tiny T5: fidelity for every site and agreement with output_attentions


def test_encode_shifts_targets_right(tiny_t5):
    inputs = batch(tiny_t5)
    labels = tiny_t5.tokenizer(TARGETS, padding=True, return_tensors="pt")
    shifted = tiny_t5.model.prepare_decoder_input_ids_from_labels(labels["input_ids"])  # the model's shift-right
    assert torch.equal(inputs["decoder_input_ids"], shifted)
    assert (inputs["decoder_input_ids"][:, 0] == 0).all()  # decoder_start_token_id = pad = 0
    assert inputs["decoder_attention_mask"].sum(-1).tolist() == lengths(tiny_t5.tokenizer, TARGETS)
    assert inputs["attention_mask"].sum(-1).tolist() == lengths(tiny_t5.tokenizer, TEXTS)
    # no targets: the text itself is the target
    own = tiny_t5.adapter.encode(tiny_t5.tokenizer, TEXTS, None, 128)
    assert own["decoder_attention_mask"].sum(-1).tolist() == lengths(tiny_t5.tokenizer, TEXTS)
    assert torch.equal(own["decoder_input_ids"][:, 1:], own["input_ids"][:, :-1] * own["attention_mask"][:, :-1])


def test_tiny_t5_fidelity_all_sites(tiny_t5):
    assert isinstance(tiny_t5.adapter, T5Adapter)
    assert tiny_t5.model.config._attn_implementation == "probe"  # the family's eager attention, through probe
    inputs = batch(tiny_t5)
    enc_lengths = inputs["attention_mask"].sum(-1).tolist()
    dec_lengths = inputs["decoder_attention_mask"].sum(-1).tolist()
    assert len(set(enc_lengths)) == len(enc_lengths) and max(enc_lengths) > 8  # padded, bidirectional log buckets
    assert min(dec_lengths) > 8 and max(dec_lengths) > 16  # unidirectional log buckets
    sites = capture_all(tiny_t5, inputs)
    assert_sites_complete(tiny_t5, sites)
    assert_fidelity(sites)
    assert_matches_output_attentions(tiny_t5, sites, inputs)

    b, n_enc = inputs["input_ids"].shape
    n_dec = inputs["decoder_input_ids"].shape[1]
    heads = tiny_t5.model.config.num_heads
    shapes = {"encoder_self": (n_enc, n_enc), "decoder_self": (n_dec, n_dec), "cross": (n_dec, n_enc)}
    enc_mask = inputs["attention_mask"].bool()
    dec_mask = inputs["decoder_attention_mask"].bool()
    causal = torch.ones(n_dec, n_dec, dtype=torch.bool).tril()
    allowed = {
        "encoder_self": enc_mask[:, None, None, :].expand(b, heads, n_enc, n_enc),
        "decoder_self": (dec_mask[:, None, None, :] & causal).expand(b, heads, n_dec, n_dec),
        "cross": enc_mask[:, None, None, :].expand(b, heads, n_dec, n_enc),
    }
    enc_bias = tiny_t5.model.encoder.block[0].layer[0].SelfAttention.compute_bias(n_enc, n_enc)[0].double()
    dec_bias = tiny_t5.model.decoder.block[0].layer[0].SelfAttention.compute_bias(n_dec, n_dec)[0].double()
    for site in sites:
        q, k = shapes[site.attention_type]
        assert space_problems(site, "hidden").logits.shape == (b, heads, q, k) and space_problems(site, "hidden").gram.shape == (b, k, k)
        assert space_problems(site, "hidden").evidence_sqnorm.shape == (b, heads, q)
        log_u = site.log_preference.expand(b, heads, q, k)
        assert log_u.shape == (b, heads, q, k)
        ok = allowed[site.attention_type]
        assert torch.equal(torch.isfinite(log_u), ok)  # -inf exactly at padding (and future) keys
        assert (log_u[~ok] == float("-inf")).all()
        # the position bias is exactly the model's compute_bias of the stack's first layer (every layer)
        no_bias = torch.zeros(heads, q, k, dtype=torch.float64)
        bias = {"encoder_self": enc_bias, "decoder_self": dec_bias, "cross": no_bias}
        expected = bias[site.attention_type].expand(b, heads, q, k)
        torch.testing.assert_close(log_u[ok], expected[ok], rtol=0, atol=1e-6)
        assert torch.equal(site.query_mask, enc_mask if site.attention_type == "encoder_self" else dec_mask)


def test_a_model_running_sdpa_is_captured_through_its_eager_attention(tiny_t5_dir):
    """A T5 loaded with sdpa attention is measured with its family's eager attention (probe's attention function,
    selected for the forward pass alone): the same sites as the model probe loads, and sdpa afterwards."""
    from transformers import AutoModelForSeq2SeqLM

    loaded = load_model(str(tiny_t5_dir), device="cpu")
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_t5_dir, attn_implementation="sdpa").eval()
    inputs = batch(loaded)
    for mine, theirs in zip(loaded.adapter.sites(loaded.model, inputs), loaded.adapter.sites(model, inputs),
                            strict=True):
        assert (mine.attention_type, mine.layer) == (theirs.attention_type, theirs.layer)
        torch.testing.assert_close(mine.model_probs, theirs.model_probs, rtol=0, atol=1e-6)
        torch.testing.assert_close(mine.log_preference, theirs.log_preference, rtol=0, atol=1e-6)
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------------
# 2. t5-small attention shapes, 2 + 2 layers; 3. flan-t5 (gated-gelu) and T5Model-only checkpoints


def test_t5_small_shape_fidelity(tmp_path):
    path = save_tiny_t5(tmp_path / "t5-small-2l", d_model=512, d_kv=64, heads=8, layers=2, decoder_layers=2,
                        d_ff=2048, buckets=32, max_distance=128, seed=1)
    loaded = load_model(str(path), device="cpu")
    inputs = batch(loaded)
    sites = capture_all(loaded, inputs)
    assert_sites_complete(loaded, sites)
    assert_fidelity(sites)
    assert_matches_output_attentions(loaded, sites, inputs)


@pytest.mark.parametrize(
    "feed_forward_proj, model_class, buckets, max_distance",
    [
        ("gated-gelu", "T5ForConditionalGeneration", 8, 12),  # flan-t5 style; small max distance: clamped buckets
        ("relu", "T5Model", 32, 128),  # a checkpoint without the LM head
    ],
)
def test_variants_load_and_pass_fidelity(tmp_path, feed_forward_proj, model_class, buckets, max_distance):
    path = save_tiny_t5(tmp_path / "variant", feed_forward_proj=feed_forward_proj, model_class=model_class,
                        buckets=buckets, max_distance=max_distance, layers=2, decoder_layers=3, seed=2)
    loaded = load_model(str(path), device="cpu")
    assert type(loaded.model).__name__ == model_class
    assert loaded.info["model_type"] == "t5"
    assert loaded.model.config.feed_forward_proj == feed_forward_proj
    inputs = batch(loaded)
    sites = capture_all(loaded, inputs)
    assert_sites_complete(loaded, sites)
    assert_fidelity(sites)
    assert_matches_output_attentions(loaded, sites, inputs)


def test_registry_and_describe():
    adapter = adapter_for("t5")
    assert isinstance(adapter, T5Adapter)
    assert adapter.attention_types == ("encoder_self", "decoder_self", "cross")
    described = adapter.describe()
    for key in ("templates", "evidence", "preference", "decoder_input"):
        assert key in described
    assert "sqrt(d')" in described["templates"] and "target" in described["decoder_input"]


# --------------------------------------------------------------------------------------------------
# 4. end to end


def test_run_end_to_end(tiny_t5_dir, tmp_path):
    records = [{"text": t, "target": s} for t, s in zip(TEXTS, TARGETS)]
    records += [
        {"text": "the dog", "target": "a fox jumps over the lazy dog"},
        {"text": "every model of every layer is a convex problem over the query token", "target": "ok"},
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    run_dir = run(RunConfig(
        model=str(tiny_t5_dir), dataset=DatasetSpec(name=str(data), target_column="target"), out=tmp_path / "runs",
        batch_size=2, device="cpu", progress=False,
    ))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    table = pq.read_table(run_dir / "deviations.parquet").to_pandas()

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_t5_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_t5_dir)
    enc = lengths(tokenizer, [r["text"] for r in records])
    dec = lengths(tokenizer, [r["target"] for r in records])
    heads = config.num_heads
    expected = {
        "encoder_self": sum(enc) * heads * config.num_layers,
        "decoder_self": sum(dec) * heads * config.num_decoder_layers,
        "cross": sum(dec) * heads * config.num_decoder_layers,
    }
    assert table.groupby("attention_type").size().to_dict() == expected
    assert table["converged"].all()
    assert manifest["status"] == "complete"
    assert manifest["fidelity"]["passed"]
    assert set(manifest["fidelity"]["by_attention_type"]) == set(expected)
    assert manifest["attention_types"] == ["encoder_self", "decoder_self", "cross"]
    assert manifest["adapter"] == "T5Adapter"
    assert manifest["dataset"]["target_column"] == "target"
    assert "decoder_input" in manifest["parameterisation"]
    assert manifest["solver"]["not_converged"] == 0

    decoder = table[table.attention_type == "decoder_self"]
    assert (decoder["n_keys"] == decoder["query"] + 1).all()  # causal
    for kind, lens in (("encoder_self", enc), ("cross", enc)):
        part = table[table.attention_type == kind]
        assert (part["n_keys"].to_numpy() == np.asarray(lens)[part["example"].to_numpy()]).all()
    for kind, lens in (("encoder_self", enc), ("decoder_self", dec), ("cross", dec)):
        part = table[table.attention_type == kind]
        assert (part["query"].to_numpy() < np.asarray(lens)[part["example"].to_numpy()]).all()


# --------------------------------------------------------------------------------------------------
# 5. the solver on captured decoder problems agrees with an independent reference


def test_decoder_problem_matches_lbfgs_reference(tiny_t5):
    model = tiny_t5.model
    inputs = batch(tiny_t5)
    sites = [s for s in capture_all(tiny_t5, inputs) if s.attention_type == "decoder_self"]

    # independent: the LayerNorm outputs entering each decoder self-attention, recorded by our own hooks
    normed = {}
    handles = [
        block.layer[0].layer_norm.register_forward_hook(
            lambda module, args, output, layer=layer: normed.__setitem__(layer, output.detach().double())
        )
        for layer, block in enumerate(model.decoder.block)
    ]
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():  # layer 0 from first principles: LayerNorm(embedding)
        first = model.decoder.block[0].layer[0].layer_norm(model.shared(inputs["decoder_input_ids"])).double()
    torch.testing.assert_close(normed[0], first, rtol=0, atol=0)

    d_kv, heads = model.config.d_kv, model.config.num_heads
    n_dec = inputs["decoder_input_ids"].shape[1]
    bias = model.decoder.block[0].layer[0].SelfAttention.compute_bias(n_dec, n_dec)[0].detach().double().numpy()
    dec_lengths = inputs["decoder_attention_mask"].sum(-1).tolist()
    checked = 0
    for site in sites:
        attention = model.decoder.block[site.layer].layer[0].SelfAttention
        w_q = attention.q.weight.detach().double().numpy().reshape(heads, d_kv, -1)
        w_k = attention.k.weight.detach().double().numpy().reshape(heads, d_kv, -1)
        solution = solve_dual(site_problems(site, 1.0), rtol=1e-10)
        for example, head, query in [(0, 0, 0), (0, 1, 5), (0, 3, dec_lengths[0] - 1), (1, 2, dec_lengths[1] - 1),
                                     (2, 1, dec_lengths[2] - 1), (2, 0, 18)]:
            n = dec_lengths[example]
            x = normed[site.layer][example, :n].numpy()  # real decoder positions only
            T = x / np.sqrt(d_kv)
            z = np.sqrt(d_kv) * w_k[head].T @ (w_q[head] @ x[query])
            log_u = bias[head, query, :n].copy()
            log_u[query + 1 :] = -np.inf  # causal
            lam, _ = lbfgs_dual(T, z, log_u, 1.0, gtol=1e-13)
            reference = relative_deviation(lam, z, 1.0)
            # the captured reduced data is the explicit problem's, up to float32 rounding: the capture takes the
            # queries the model multiplies (float32), the explicit problem computes q here in float64
            np.testing.assert_allclose(space_problems(site, "hidden").logits[example, head, query, :n].numpy(), T @ z, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(float(space_problems(site, "hidden").evidence_sqnorm[example, head, query]), z @ z, rtol=1e-6)
            row = head * n_dec + query
            assert bool(solution.converged[example, row])
            got = float(solution.rel_deviation[example, row])
            assert abs(got - reference) <= 1e-6 * max(1.0, abs(reference)), (site.layer, example, head, query)
            checked += 1
    assert checked == 6 * len(sites)


def test_length_one_rows_are_written_with_zero_deviation(tiny_t5_dir, tmp_path):
    """Texts truncated to one token give n = 1 problems (a single key): lambda* = alpha z exactly, and
    the rows are still written for all three attention types."""
    data = tmp_path / "one.txt"
    data.write_text("the quick brown fox\nevery head\n")
    run_dir = run(RunConfig(model=str(tiny_t5_dir), dataset=DatasetSpec(name=str(data)), out=tmp_path,
                            max_length=1, progress=False))
    table = pq.read_table(run_dir / "deviations.parquet").to_pandas()
    config = json.loads((tiny_t5_dir / "config.json").read_text())
    per_type = 2 * config["num_heads"] * config["num_layers"]  # 2 examples x 1 token x heads x layers
    assert table.groupby("attention_type").size().to_dict() == {"cross": per_type, "decoder_self": per_type,
                                                                 "encoder_self": per_type}
    assert (table["n_keys"] == 1).all() and (table["rel_deviation"] == 0).all() and table["converged"].all()


def test_stacked_sites_give_each_site_its_own_answers(tiny_t5):
    """The pipeline solves the sites of one problem shape in one stacked solver call; each
    site must get the answers it gets alone (within both certificates; the float32 Newton direction
    is the only source of difference), and sites of other shapes must not be stacked together."""
    from probe.batch.rows import site_problems, site_stacks, solve_sites
    from probe.solve.dual import solve_dual

    sites = capture_all(tiny_t5, batch(tiny_t5))
    chunks = list(site_stacks(iter(sites)))
    assert sorted(id(site) for chunk in chunks for site in chunk) == sorted(id(site) for site in sites)
    for chunk in chunks:
        assert len({(site.shape[1] * site.shape[2], site.shape[3]) for site in chunk}) == 1
    # encoder self, decoder self and cross attention have three shapes here: three stacks of two layers
    assert [len(chunk) for chunk in chunks] == [2, 2, 2]
    assert len(list(site_stacks(iter(sites), limit_bytes=1))) == len(sites)  # the memory limit splits stacks

    for chunk in chunks:
        for site, stacked in zip(chunk, solve_sites(chunk, alpha=1.0, rtol=1e-9)):
            alone = solve_dual(site_problems(site, 1.0), rtol=1e-9)
            real = site_problems(site, 1.0).active
            assert bool(stacked.converged[real].all()) and bool(alone.converged[real].all())
            bound = 2 * (stacked.error_bound / stacked.lambda_norm + alone.error_bound / alone.lambda_norm) + 1e-15
            difference = (stacked.rel_deviation - alone.rel_deviation).abs()
            assert bool((difference[real] <= bound[real]).all())
            assert bool(stacked.rel_deviation[~real].isnan().all())
