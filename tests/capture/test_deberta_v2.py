"""DeBERTa-v2 adapter: tiny random DeBERTa-v2/v3 models with relative (disentangled) attention.

Two configurations cover the code paths of ``DisentangledSelfAttention``: a v3-like one (both
content-to-position and position-to-content terms, keys shared with the content projections,
log-bucketed relative positions, layer-normed relative embeddings, no absolute positions) and a
v2-like one (c2p only, separate ``pos_key_proj``, unbucketed positions, absolute position embeddings).
Projection weights are drawn large enough that logits are of order one and the position terms matter.
The tokenizer is MiniLM's (BERT word pieces; pad id 0 as DeBERTa's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.capture.adapters import REGISTRY
from probe.capture.adapters.deberta_v2 import DebertaV2Adapter
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

CONFIGS = {
    "v3-like": dict(pos_att_type=["p2c", "c2p"], share_att_key=True, position_buckets=8, max_relative_positions=32,
                    norm_rel_ebd="layer_norm", position_biased_input=False),
    "v2-like": dict(pos_att_type=["c2p"], share_att_key=False, position_buckets=-1, max_relative_positions=-1,
                    norm_rel_ebd="none", position_biased_input=True),
}


def save_tiny_deberta(directory, minilm_dir, variant, *, layers=2, heads=4, hidden=64, seed=0):
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2Model

    torch.manual_seed(seed)
    config = DebertaV2Config(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * hidden, max_position_embeddings=128, relative_attention=True, type_vocab_size=0,
        pad_token_id=0, **CONFIGS[variant],
    )
    model = DebertaV2Model._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        model.encoder.rel_embeddings.weight.normal_(0, 1.0)
        for layer in model.encoder.layer:
            attention = layer.attention.self
            for name in ("query_proj", "key_proj", "pos_key_proj", "pos_query_proj"):
                if hasattr(attention, name):
                    getattr(attention, name).weight.normal_(0, 0.15)
                    getattr(attention, name).bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_deberta_dir(request, tmp_path_factory, minilm_dir):
    return save_tiny_deberta(tmp_path_factory.mktemp(f"tiny-deberta-{request.param}"), minilm_dir, request.param)


def explicit_problems(model_dir, texts):
    r"""``row -> (T, z, log u)`` built here from the weights and transformers' own DebertaV2Model run on
    each text alone: :math:`t_i = x_i/\sqrt{d'}`, :math:`z = W_k^\top q/\sqrt{s}` and the position terms
    in numpy, ``c2p_i = q . P_k[idx_i] / sqrt(s d')`` and ``p2c_i = k_i . P_q[idx_i] / sqrt(s d')`` with
    ``idx_i = clip(delta(j, i) + span, 0, 2 span - 1)``, ``delta`` the model's bucketed ``j - i``
    (``build_relative_position``) and ``P_k``, ``P_q`` the projected relative embeddings."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    model = AutoModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with torch.no_grad():
        relative_embeddings = model.encoder.get_rel_embedding().double().numpy()
    states = {}

    def linear(module, rows):
        return module.weight.detach().double().numpy()[rows], module.bias.detach().double().numpy()[rows]

    def problem(row):
        example, layer, head, j = int(row["example"]), int(row["layer"]), int(row["head"]), int(row["query"])
        if example not in states:
            with torch.no_grad():
                out = model(**tokenizer(texts[example], return_tensors="pt"), output_hidden_states=True)
            states[example] = [h[0].double().numpy() for h in out.hidden_states]
        x = states[example][layer]
        n = len(x)
        attention = model.encoder.layer[layer].attention.self
        d = attention.attention_head_size
        rows = slice(head * d, (head + 1) * d)
        kinds = attention.pos_att_type
        s = 1 + ("c2p" in kinds) + ("p2c" in kinds)
        w_q, b_q = linear(attention.query_proj, rows)
        w_k, b_k = linear(attention.key_proj, rows)
        q = w_q @ x[j] + b_q
        keys = x @ w_k.T + b_k
        span = attention.pos_ebd_size
        delta = build_relative_position(torch.zeros(n, 1), torch.zeros(n, 1), bucket_size=attention.position_buckets,
                                        max_position=attention.max_relative_positions)[0, j].numpy()
        index = np.clip(delta + span, 0, 2 * span - 1)
        embeddings = relative_embeddings[: 2 * span]
        log_u = np.zeros(n)
        if "c2p" in kinds:
            w, b = linear(attention.key_proj if attention.share_att_key else attention.pos_key_proj, rows)
            log_u += (embeddings @ w.T + b)[index] @ q / np.sqrt(s * d)
        if "p2c" in kinds:
            w, b = linear(attention.query_proj if attention.share_att_key else attention.pos_query_proj, rows)
            log_u += ((embeddings @ w.T + b)[index] * keys).sum(-1) / np.sqrt(s * d)
        return x / np.sqrt(d), w_k.T @ q / np.sqrt(s), log_u

    return problem


def test_registered():
    assert REGISTRY["deberta-v2"] is DebertaV2Adapter and DebertaV2Adapter.attention_types == ("self",)


def test_tiny_deberta_reproduces_attention_with_padding(tiny_deberta_dir):
    loaded = load_model(str(tiny_deberta_dir), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, TEXTS, None, 128)
    assert inputs["attention_mask"].sum(1).unique().numel() == len(TEXTS)  # really padded
    sites = loaded.adapter.sites(loaded.model, inputs)
    with torch.no_grad():
        attentions = loaded.model(**inputs, output_attentions=True).attentions
    assert_reproduces_output_attentions(sites, attentions)
    # the position terms matter: with the content term alone the reconstruction is far off
    site = sites[1]
    mask = torch.zeros_like(site.log_preference).masked_fill(~site.key_mask[:, None, None, :], float("-inf"))
    assert_preference_matters(site, attentions[1], mask)


def test_tiny_deberta_run_through_cli_and_cvxpy(tiny_deberta_dir, tmp_path):
    frame, manifest = cli_run(tiny_deberta_dir, write_texts(tmp_path), tmp_path / "runs", "--batch-size", 2)
    loaded = load_model(str(tiny_deberta_dir), device="cpu")
    config = loaded.model.config
    expected = sum(token_counts(loaded.tokenizer, TEXTS)) * config.num_attention_heads * config.num_hidden_layers
    assert_complete_run(frame, manifest, {"self": expected})
    assert "c2p" in manifest["parameterisation"]["preference"]
    cvxpy_spot_check(frame, explicit_problems(tiny_deberta_dir, TEXTS))
