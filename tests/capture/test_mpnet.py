"""MPNet adapter: a tiny random MPNet built from config, and the real all-mpnet-base-v2.

The tiny model gets MPNet's own tokenizer class (``MPNetTokenizer``) over MiniLM's vocabulary with
MPNet's special ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2), so that padding and position ids behave as in
the real model, and a strong relative-attention-bias table (standard deviation 1.5) so that a wrong
or missing bias shows in the fidelity check.

The real all-mpnet-base-v2 is rebuilt by ``bash scripts/fetch_models.sh DIR`` (``.ci/run`` does it,
into a cache outside the clone) and found under ``$PROBE_MODELS_DIR`` (default
``~/.cache/probe-models``); without it those tests are skipped and say so.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from probe.capture.adapters import REGISTRY
from probe.capture.adapters.mpnet import MPNetAdapter
from probe.capture.loading import load_model

from ..support.family_checks import (
    TEXTS,
    assert_complete_run,
    assert_preference_matters,
    assert_reproduces_output_attentions,
    cli_run,
    cvxpy_spot_check,
    real_model_dir,
    token_counts,
    write_texts,
)


def make_tokenizer(minilm_dir):
    """``MPNetTokenizer`` over MiniLM's word pieces, with MPNet's special tokens and ids."""
    from transformers import MPNetTokenizer

    pieces = [p for p in (Path(minilm_dir) / "vocab.txt").read_text().splitlines() if not p.startswith("[")]
    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "[UNK]", "<mask>", *pieces])}
    tokenizer = MPNetTokenizer(vocab=vocab)
    assert (tokenizer.cls_token_id, tokenizer.pad_token_id, tokenizer.sep_token_id) == (0, 1, 2)
    return tokenizer


def save_tiny_mpnet(directory, minilm_dir, *, layers=2, heads=4, hidden=64, seed=0):
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(seed)
    tokenizer = make_tokenizer(minilm_dir)
    config = MPNetConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * hidden, max_position_embeddings=258, relative_attention_num_buckets=32,
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    model = MPNetModel._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.encoder.relative_attention_bias.weight.normal_(0, 1.5)
        for layer in model.encoder.layer:  # logits of order one and non-trivial q/k biases
            for linear in (layer.attention.attn.q, layer.attention.attn.k):
                linear.weight.normal_(0, 0.15)
                linear.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_mpnet_dir(tmp_path_factory, minilm_dir):
    return save_tiny_mpnet(tmp_path_factory.mktemp("tiny-mpnet"), minilm_dir)


@pytest.fixture(scope="module")
def real_mpnet_dir():
    return real_model_dir("all-mpnet-base-v2", "model.safetensors")


def capture(model_dir, texts):
    loaded = load_model(str(model_dir), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, None, 128)
    sites = loaded.adapter.sites(loaded.model, inputs)
    with torch.no_grad():
        attentions = loaded.model(**inputs, output_attentions=True).attentions
    return loaded, inputs, sites, attentions


def explicit_problems(model_dir, texts):
    """``row -> (T, z, log u)`` built here, independent of the adapter: each text run alone (no padding)
    through transformers' own MPNetModel for the hidden states entering each layer,
    :math:`t_i = x_i/\\sqrt{d'}`, :math:`z = W_k^\\top (W_q x_j + b_q)` and :math:`\\log u_i` looked up in
    the relative-attention-bias table at MPNet's bucket of the distance ``i - j``."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    table = model.encoder.relative_attention_bias.weight.detach().double().numpy()
    states = {}

    def problem(row):
        example, layer, head, j = int(row["example"]), int(row["layer"]), int(row["head"]), int(row["query"])
        if example not in states:
            with torch.no_grad():
                out = model(**tokenizer(texts[example], return_tensors="pt"), output_hidden_states=True)
            states[example] = [h[0].double().numpy() for h in out.hidden_states]
        x = states[example][layer]
        attention = model.encoder.layer[layer].attention.attn
        d = attention.attention_head_size
        rows = slice(head * d, (head + 1) * d)
        w_q = attention.q.weight.detach().double().numpy()[rows]
        b_q = attention.q.bias.detach().double().numpy()[rows]
        w_k = attention.k.weight.detach().double().numpy()[rows]
        z = w_k.T @ (w_q @ x[j] + b_q)  # c = (1/sqrt(d')) sqrt(d') = 1
        distance = torch.arange(len(x)) - j  # key - query
        buckets = MPNetEncoder.relative_position_bucket(distance, num_buckets=32).numpy()
        return x / np.sqrt(d), z, table[buckets, head]

    return problem


# --------------------------------------------------------------------------------------------------
# tiny random MPNet


def test_registered():
    assert REGISTRY["mpnet"] is MPNetAdapter and MPNetAdapter.attention_types == ("self",)


def test_tiny_mpnet_reproduces_attention_with_padding(tiny_mpnet_dir):
    loaded, inputs, sites, attentions = capture(tiny_mpnet_dir, TEXTS)
    assert inputs["attention_mask"].sum(1).unique().numel() == len(TEXTS)  # really padded
    assert {site.attention_type for site in sites} == {"self"} and sites[0].spaces == ("hidden", "key")
    assert_reproduces_output_attentions(sites, attentions)
    # the position bias matters: without it the reconstruction is far off (so the check can fail)
    site = sites[0]
    mask = torch.zeros_like(site.log_preference).masked_fill(~site.key_mask[:, None, None, :], float("-inf"))
    assert_preference_matters(site, attentions[0], mask)


def test_tiny_mpnet_run_through_cli_and_cvxpy(tiny_mpnet_dir, tmp_path):
    frame, manifest = cli_run(tiny_mpnet_dir, write_texts(tmp_path), tmp_path / "runs", "--batch-size", 2)
    loaded = load_model(str(tiny_mpnet_dir), device="cpu")
    config = loaded.model.config
    expected = sum(token_counts(loaded.tokenizer, TEXTS)) * config.num_attention_heads * config.num_hidden_layers
    assert_complete_run(frame, manifest, {"self": expected})
    assert manifest["adapter"] == "MPNetAdapter" and "position bias" in manifest["parameterisation"]["preference"]
    cvxpy_spot_check(frame, explicit_problems(tiny_mpnet_dir, TEXTS))


# --------------------------------------------------------------------------------------------------
# the real all-mpnet-base-v2

REAL_TEXTS = [
    "The cat sat on the mat.",
    "Attention weights are the solution of a convex problem.",
    "A short one.",
    "Sentence embeddings from MPNet are trained on a billion sentence pairs.",
]


@pytest.mark.slow
def test_real_mpnet_reproduces_attention(real_mpnet_dir):
    loaded, inputs, sites, attentions = capture(real_mpnet_dir, REAL_TEXTS)
    config = loaded.model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (
        "mpnet", 12, 768, 12)
    assert_reproduces_output_attentions(sites, attentions)


@pytest.mark.slow
def test_real_mpnet_run_through_cli_and_cvxpy(real_mpnet_dir, tmp_path):
    frame, manifest = cli_run(real_mpnet_dir, write_texts(tmp_path, REAL_TEXTS), tmp_path / "runs", "--batch-size", 2)
    loaded = load_model(str(real_mpnet_dir), device="cpu")
    assert_complete_run(frame, manifest, {"self": sum(token_counts(loaded.tokenizer, REAL_TEXTS)) * 12 * 12})
    cvxpy_spot_check(frame, explicit_problems(real_mpnet_dir, REAL_TEXTS))
