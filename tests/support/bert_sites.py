"""A BERT's attention sites captured by probe beside the model's own outputs, and one row's problem built
independently of probe's adapter, from the model's weights and hidden states."""

from __future__ import annotations

import numpy as np
import torch

from probe.capture.loading import load_model

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
