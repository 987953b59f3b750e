"""BERT capture: the reduced problems reproduce the model's own (eager) attention, on tiny random
models and on the real pretrained MiniLM, and the solver's answers on captured problems match an
independent solver run on templates and evidence computed here from the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probe.batch.rows import fidelity_error, site_problems
from probe.capture.adapters import space_problems
from probe.capture.loading import load_model
from probe.solve.dual import solve_dual
from probe.solve.reference import cvxpy_primal, relative_deviation
from tests.conftest import save_tiny_bert

TEXTS = [
    "A padded batch: this sentence is much longer than the next one, by design of the test.",
    "Tiny.",
    "Medium length sentence with some words.",
]


def captured(model_dir, texts=TEXTS, max_length=64):
    loaded = load_model(str(model_dir), device="cpu")
    inputs = loaded.adapter.encode(loaded.tokenizer, texts, None, max_length)
    with torch.no_grad():
        sites = loaded.adapter.sites(loaded.model, inputs)
        reference = loaded.model(**inputs, output_attentions=True, output_hidden_states=True)
    return loaded, inputs, sites, reference


def assert_reproduces_model_attention(sites, inputs, reference):
    mask = inputs["attention_mask"].bool()
    assert len(sites) == len(reference.attentions)
    for site, attention in zip(sites, reference.attentions):
        assert fidelity_error(site) <= 1e-5
        # independent of the hook: the attentions the model returns with output_attentions=True
        rebuilt = torch.softmax(site.log_preference + space_problems(site, "hidden").logits, dim=-1)
        real = mask[:, None, :, None].expand_as(rebuilt)
        assert (rebuilt - attention.double()).abs()[real].max() <= 1e-5


def test_tiny_bert_capture_reproduces_attention(tiny_bert_dir):
    loaded, inputs, sites, reference = captured(tiny_bert_dir)
    assert inputs["attention_mask"].sum(1).unique().numel() == 3  # really padded
    assert [s.layer for s in sites] == [0, 1] and {s.attention_type for s in sites} == {"self"}
    assert_reproduces_model_attention(sites, inputs, reference)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_models_saved_under_either_attention_implementation(tmp_path, minilm_dir, implementation):
    directory = save_tiny_bert(tmp_path / implementation, minilm_dir, attn_implementation=implementation, seed=3)
    loaded, inputs, sites, reference = captured(directory)
    assert loaded.model.config._attn_implementation == "probe"  # the family's eager attention, through probe
    assert_reproduces_model_attention(sites, inputs, reference)


def test_minilm_capture_reproduces_attention(minilm_dir):
    _, inputs, sites, reference = captured(minilm_dir)
    assert len(sites) == 6 and space_problems(sites[0], "hidden").logits.shape[1] == 12
    assert_reproduces_model_attention(sites, inputs, reference)


def explicit_problem(model, hidden_states, layer, head, example, query, mask):
    """Templates t_i = x_i / sqrt(d') and evidence z = W_k^T q built here from the weights and the
    hidden states the model returns (independent of probe's adapter)."""
    attention = model.encoder.layer[layer].attention.self
    d_head = attention.attention_head_size
    rows = slice(head * d_head, (head + 1) * d_head)
    x = hidden_states[layer][example].detach().double().numpy()
    keys = mask[example].numpy().astype(bool)
    w_q = attention.query.weight[rows].detach().double().numpy()
    b_q = attention.query.bias[rows].detach().double().numpy()
    w_k = attention.key.weight[rows].detach().double().numpy()
    q = w_q @ x[query] + b_q
    T = x[keys] / np.sqrt(d_head)
    z = w_k.T @ q
    return T, z, np.zeros(keys.sum())


def test_minilm_solutions_match_cvxpy_on_independently_built_problems(minilm_dir):
    loaded, inputs, sites, reference = captured(minilm_dir)
    mask = inputs["attention_mask"]
    chosen = [(0, 0, 0, 0), (2, 5, 1, 2), (5, 11, 2, 4), (3, 7, 0, 9)]  # (layer, head, example, query)
    for layer, head, example, query in chosen:
        solution = solve_dual(site_problems(sites[layer], 1.0))
        heads = space_problems(sites[layer], "hidden").logits.shape[1]
        q_len = space_problems(sites[layer], "hidden").logits.shape[2]
        ours = solution.rel_deviation[example, head * q_len + query].item()
        assert bool(solution.converged[example, head * q_len + query])
        T, z, log_u = explicit_problem(loaded.model, reference.hidden_states, layer, head, example, query, mask)
        lam, _ = cvxpy_primal(T, z, log_u)
        assert ours == pytest.approx(relative_deviation(lam, z, 1.0), abs=1e-7), (layer, head, heads)


@pytest.mark.parametrize("key_heads", [4, 2, 1])
def test_space_problems_with_shared_key_heads_follow_their_formulas(key_heads):
    """Both spaces, written out per query head in numpy: query head j uses key head j // (h / g)
    (transformers' repeat_kv), the hidden space's templates are x_i / sqrt(d') and its evidence
    c W_k,h^T q; padding keys carry no weight.  Covers g < h, which no hidden-space family has yet."""
    from probe.capture.adapters import SiteCapture

    rng = np.random.default_rng(key_heads)
    b, h, q, k, d, width, scale = 2, 4, 3, 5, 8, 16, 0.3
    x = rng.standard_normal((b, k, width))
    w_key = rng.standard_normal((key_heads * d, width))
    queries = rng.standard_normal((b, h, q, d))
    key_mask = np.ones((b, k), bool)
    key_mask[1, 3:] = False
    keys = np.einsum("bkD,gdD->bgkd", x, w_key.reshape(key_heads, d, width))
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731 - captures are in the model's dtype
    site = SiteCapture(
        attention_type="self", layer=0, queries=f32(queries).transpose(1, 2).contiguous().transpose(1, 2),
        keys=f32(keys), values=f32(keys), logit_scale=scale, log_preference=torch.zeros(1, 1, 1, k, dtype=torch.float64),
        query_mask=torch.ones(b, q, dtype=torch.bool), key_mask=torch.tensor(key_mask),
        query_ids=torch.zeros(b, q, dtype=torch.long), model_probs=torch.zeros(b, h, q, k),
        key_hidden=f32(x), key_weight=f32(w_key),
    )
    queries, keys, x, w_key = (np.asarray(a, np.float32).astype(np.float64) for a in (queries, keys, x, w_key))
    c = scale * np.sqrt(d)
    for space in ("hidden", "key"):
        built = space_problems(site, space)
        for e in range(b):
            templates_all = x[e] if space == "hidden" else None
            for j in range(h):
                head = j // (h // key_heads)
                w = w_key[head * d:(head + 1) * d]  # (d', D)
                if space == "hidden":
                    templates, z = templates_all / np.sqrt(d), c * (w.T @ queries[e, j].T)  # (k, D), (D, q)
                else:
                    templates, z = keys[e, head] / np.sqrt(d), c * queries[e, j].T
                templates = templates * key_mask[e][:, None]
                np.testing.assert_allclose(built.logits[e, j].numpy(), (templates @ z).T, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(built.evidence_sqnorm[e, j].numpy(), (z * z).sum(0), rtol=1e-12)
                gram = built.gram[e] if space == "hidden" else built.gram[e, head]
                np.testing.assert_allclose(gram.numpy(), templates @ templates.T, rtol=1e-12, atol=1e-12)
