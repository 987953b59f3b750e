"""BLOOM adapter: tiny random BLOOM models (ALiBi, fused query_key_value), padded left and right.

Six heads, so that ALiBi's slopes include the extra ones for a head count that is not a power of two;
fused projection weights drawn large enough that logits are of order one.  The tokenizer is MiniLM's
(BERT word pieces), saved with the padding side under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probe.capture.adapters import REGISTRY
from probe.capture.adapters.bloom import BloomAdapter
from probe.capture.loading import load_model

from ..support.family_checks import (
    TEXTS,
    assert_complete_run,
    assert_preference_matters,
    assert_reproduces_output_attentions,
    cli_run,
    cvxpy_spot_check,
    token_counts,
    write_texts,
)


def save_tiny_bloom(directory, minilm_dir, padding_side, *, layers=2, heads=6, hidden=96, seed=0):
    from transformers import AutoTokenizer, BloomConfig, BloomModel

    torch.manual_seed(seed)
    config = BloomConfig(vocab_size=30522, hidden_size=hidden, n_layer=layers, n_head=heads)
    model = BloomModel._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for block in model.h:
            block.self_attention.query_key_value.weight.normal_(0, 0.15)
            block.self_attention.query_key_value.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)
    tokenizer.padding_side = padding_side
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=["left", "right"])
def tiny_bloom_dir(request, tmp_path_factory, minilm_dir):
    return save_tiny_bloom(tmp_path_factory.mktemp(f"tiny-bloom-{request.param}"), minilm_dir, request.param)


def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's slopes (Press et al., reference implementation): a geometric sequence from
    2^(-8/n) for the closest power of two n, then every other slope of 2n for the remaining heads."""
    def geometric(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    return geometric(n) + geometric(2 * n)[0::2][: heads - n]


def explicit_problems(model_dir, texts):
    r"""``row -> (T, z, log u)`` built here from each text run alone (no padding) through transformers'
    BloomModel: :math:`x` = the block's ``input_layernorm`` of the hidden state entering it,
    :math:`t_i = x_i/\sqrt{d'}`, :math:`z = W_k^\top (W_q x_j + b_q)` with the query and key rows of the
    fused weight (laid out per head as query, key, value), :math:`\log u_i = m_h\, i` for ``i <= j``."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    slopes = alibi_slopes(model.config.n_head)
    states = {}

    def problem(row):
        example, layer, head, j = int(row["example"]), int(row["layer"]), int(row["head"]), int(row["query"])
        if example not in states:
            with torch.no_grad():
                out = model(**tokenizer(texts[example], return_tensors="pt"), output_hidden_states=True)
            states[example] = list(out.hidden_states)
        block = model.h[layer]
        with torch.no_grad():
            x = block.input_layernorm(states[example][layer])[0].double().numpy()
        d = model.config.hidden_size // model.config.n_head
        weight = block.self_attention.query_key_value.weight.detach().double().numpy().reshape(-1, 3, d, x.shape[1])
        bias = block.self_attention.query_key_value.bias.detach().double().numpy().reshape(-1, 3, d)
        q = weight[head, 0] @ x[j] + bias[head, 0]
        z = weight[head, 1].T @ q  # c = (1/sqrt(d')) sqrt(d') = 1
        positions = np.arange(len(x))
        log_u = np.where(positions <= j, slopes[head] * positions, -np.inf)
        return x / np.sqrt(d), z, log_u

    return problem


def test_registered():
    assert REGISTRY["bloom"] is BloomAdapter and BloomAdapter.attention_types == ("causal_self",)
    assert BloomAdapter.spaces == ("hidden", "key")  # no rotary: the hidden space exists


def test_tiny_bloom_reproduces_attention_with_padding(tiny_bloom_dir):
    loaded = load_model(str(tiny_bloom_dir), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, TEXTS, None, 128)
    mask = inputs["attention_mask"]
    assert mask.sum(1).unique().numel() == len(TEXTS)  # really padded, on the tokenizer's side
    assert bool((mask[:, 0] == 0).any()) == (loaded.tokenizer.padding_side == "left")
    sites = loaded.adapter.sites(loaded.model, inputs)
    assert all(site.spaces == ("hidden", "key") for site in sites)
    with torch.no_grad():
        attentions = loaded.model(**inputs, output_attentions=True).attentions
    assert_reproduces_output_attentions(sites, attentions)
    # query = position within its own sequence, also under left padding
    lengths = mask.sum(1)
    for example in range(len(TEXTS)):
        positions = sites[0].query_positions[example][mask[example].bool()]
        assert positions.tolist() == list(range(int(lengths[example])))
    # ALiBi matters: without it the reconstruction is far off
    site = sites[0]
    causal = torch.where(torch.isfinite(site.log_preference), 0.0, float("-inf"))
    assert_preference_matters(site, attentions[0], causal)


def test_tiny_bloom_run_through_cli_and_cvxpy(tiny_bloom_dir, tmp_path):
    frame, manifest = cli_run(tiny_bloom_dir, write_texts(tmp_path), tmp_path / "runs", "--batch-size", 2)
    loaded = load_model(str(tiny_bloom_dir), device="cpu")
    config = loaded.model.config
    lengths = np.asarray(token_counts(loaded.tokenizer, TEXTS))
    assert_complete_run(frame, manifest, {"causal_self": int(lengths.sum()) * config.n_head * config.n_layer})
    assert (frame["n_keys"] == frame["query"] + 1).all()  # causal; the first query has one key and is kept
    assert (frame["query"] < lengths[frame["example"]]).all()
    first = frame[frame["query"] == 0]
    assert len(first) == len(TEXTS) * config.n_head * config.n_layer and (first["rel_deviation"] == 0).all()
    cvxpy_spot_check(frame[frame["query"] > 0], explicit_problems(tiny_bloom_dir, TEXTS))
