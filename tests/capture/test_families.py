"""Every declared family, on a tiny random model saved to disk (tests/support/families.py):

1. the capture reproduces the model's own attention (``output_attentions``) to 1e-5 in every supported
   space, on a padded batch; decoder-only models give the same attention rows padded left or right;
2. ``probe run`` through the CLI: the expected row count per space and attention type, counted from
   the tokenizer alone, every row converged, fidelity passed;
3. 20 rows of that run against CVXPY on problems built here from the weights and the inputs of the
   model's q/k projections (recorded by hooks on a forward pass of the example alone): our own q/k
   arithmetic, rotary encoding, causal and sliding-window masks and T5 bias, independent of the adapter.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from probe.batch.rows import fidelity_error
from probe.capture.adapters import REGISTRY, adapter_for, space_problems
from probe.capture.loading import load_model
from probe.cli import app
from probe.core.errors import ProbeError
from probe.solve.reference import cvxpy_primal, relative_deviation
from tests.support.families import (
    ALL,
    CORPUS,
    ROTARY_TYPES,
    TARGETS,
    bpe_tokenizer,
    build_config,
    save_tiny,
    spec,
)


@pytest.fixture(scope="module", params=ALL)
def family(request, tmp_path_factory, minilm_dir):
    """(spec, model directory); decoder-only models are saved padding on the left (the harder side)."""
    family_spec = spec(request.param)
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save_tiny(family_spec, directory, minilm_dir, padding_side="left" if family_spec.kind == "decoder" else None)
    return family_spec, directory


@pytest.fixture(scope="module")
def loaded(family):
    return load_model(str(family[1]), device="cpu")


def encode(loaded, texts, targets=TARGETS):
    return loaded.adapter.encode(loaded.tokenizer, list(texts), list(targets) if targets else None, 128)


def reported_attentions(model, inputs, kind):
    """The attentions the model itself returns with output_attentions=True, per attention type."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, **({"use_cache": False} if kind != "encoder" else {}))
    if kind == "encoder_decoder":
        return {"encoder_self": out.encoder_attentions, "decoder_self": out.decoder_attentions,
                "cross": out.cross_attentions}
    return {"self" if kind == "encoder" else "causal_self": out.attentions}


# --------------------------------------------------------------------------------------------------
# 1. fidelity


def test_capture_reproduces_model_attention(family, loaded):
    family_spec, _ = family
    assert family_spec.model_type in REGISTRY
    assert loaded.model.config._attn_implementation == "probe"  # the family's eager attention, through probe
    inputs = encode(loaded, family_spec.texts)
    assert inputs["attention_mask"].sum(-1).unique().numel() > 2  # really padded
    sites = loaded.adapter.sites(loaded.model, inputs)
    layers = loaded.model.config.get_text_config().num_hidden_layers if family_spec.kind != "encoder_decoder" else 2
    expected = sorted((kind, layer) for kind in family_spec.attention_types for layer in range(layers))
    assert sorted((site.attention_type, site.layer) for site in sites) == expected
    assert loaded.adapter.spaces == (("key",) if family_spec.rotary else ("hidden", "key"))
    reported = reported_attentions(loaded.model, inputs, family_spec.kind)
    for site in sites:
        model_probs = reported[site.attention_type][site.layer].to(torch.float64)
        real = site.query_mask[:, None, :, None].expand_as(model_probs)
        for space in loaded.adapter.spaces:
            problems = space_problems(site, space)
            assert fidelity_error(site, problems) <= 1e-5, (site.attention_type, site.layer, space)
            rebuilt = torch.softmax(site.log_preference + problems.logits, dim=-1)
            assert float((rebuilt - model_probs).abs()[real].max()) <= 1e-5, (site.attention_type, site.layer, space)
    if family_spec.kind == "decoder":
        for site in sites:
            assert_support_is_the_window(site, sliding_window(loaded.model.config, site.layer))
        assert_left_and_right_padding_agree(loaded)


def assert_support_is_the_window(site, window):
    """Decoder-only: the preference's support (finite log u) of each real query j is exactly the real keys
    i with j - W < i <= j (W = the layer's sliding window, else no lower bound); with a window, some rows
    have keys that fall outside it."""
    b, h, q, k = site.shape
    support = torch.isfinite(site.log_preference.expand(b, h, q, k))
    positions = site.query_positions  # key positions too: self-attention over the same tokens
    j, i = positions[:, :, None], positions[:, None, :]
    allowed = site.key_mask[:, None, :] & (i <= j) & (i > j - (window or k))
    real = site.query_mask
    assert torch.equal(support.transpose(1, 2)[real], allowed[real][:, None, :].expand(-1, h, -1))
    if window:
        assert bool((real & (positions >= window)).any())  # the window excludes keys of the longer texts


def assert_left_and_right_padding_agree(loaded):
    """Decoder-only: the same texts padded left and right give the same attention rows at the same query
    positions (positions count each text's tokens from 0 either way)."""
    tokenizer = loaded.tokenizer
    sides = {}
    for side in ("left", "right"):
        tokenizer.padding_side = side
        inputs = encode(loaded, CORPUS, targets=None)
        sides[side] = (inputs, loaded.adapter.sites(loaded.model, inputs))
    tokenizer.padding_side = "left"
    (left_inputs, left_sites), (right_inputs, right_sites) = sides["left"], sides["right"]
    assert (left_inputs["attention_mask"][:, 0] == 0).any() and (right_inputs["attention_mask"][:, -1] == 0).any()
    lengths = left_inputs["attention_mask"].sum(-1).tolist()
    width = left_inputs["input_ids"].shape[1]
    space = loaded.adapter.spaces[0]
    for left, right in zip(left_sites, right_sites):
        attention = {
            side: torch.softmax(site.log_preference + space_problems(site, space).logits, dim=-1)
            for side, site in (("left", left), ("right", right))
        }
        for example, n in enumerate(lengths):
            lo = width - n
            torch.testing.assert_close(attention["left"][example, :, lo:, lo:], attention["right"][example, :, :n, :n],
                                       rtol=0, atol=1e-5)
            assert left.query_positions[example, lo:].tolist() == list(range(n))
            assert right.query_positions[example, :n].tolist() == list(range(n))


# --------------------------------------------------------------------------------------------------
# 2. probe run through the CLI


@pytest.fixture(scope="module")
def cli_run(family, tmp_path_factory):
    """One `probe run` per family: both spaces where supported, the default (key) for rotary models."""
    family_spec, directory = family
    work = tmp_path_factory.mktemp(f"run-{family_spec.name}")
    if family_spec.kind == "encoder_decoder":
        data = work / "pairs.jsonl"
        pairs = zip(family_spec.texts, TARGETS)
        data.write_text("".join(json.dumps({"text": t, "target": g}) + "\n" for t, g in pairs))
        options = ["--target-column", "target"]
    else:
        data = work / "texts.txt"
        data.write_text("\n".join(CORPUS) + "\n")
        options = []
    if not family_spec.rotary:
        options += ["--space", "hidden,key"]
    out = work / "runs"
    result = CliRunner().invoke(app, ["run", str(directory), "--dataset", str(data), "--batch-size", "5", "--out",
                                      str(out), "--no-progress", *options])
    assert result.exit_code == 0, result.output
    (run_dir,) = list(out.iterdir())
    frame = pd.read_parquet(run_dir / "deviations.parquet")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return frame, manifest


def token_lengths(tokenizer, texts):
    return np.asarray([len(ids) for ids in tokenizer(list(texts))["input_ids"]])


def test_cli_run_rows_converged_and_faithful(family, cli_run):
    from transformers import AutoConfig, AutoTokenizer

    family_spec, directory = family
    frame, manifest = cli_run
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.padding_side == ("left" if family_spec.kind == "decoder" else "right")  # the run's padding
    config = AutoConfig.from_pretrained(directory)
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or text.num_heads
    layers = 2
    source = token_lengths(tokenizer, family_spec.texts)
    target = token_lengths(tokenizer, TARGETS)
    queries = {"self": source, "causal_self": source, "encoder_self": source, "decoder_self": target, "cross": target}
    spaces = ["key"] if family_spec.rotary else ["hidden", "key"]
    expected = {(space, kind): int(queries[kind].sum()) * heads * layers
                for space in spaces for kind in family_spec.attention_types}
    assert frame.groupby(["space", "attention_type"]).size().to_dict() == expected
    assert frame["converged"].all() and manifest["solver"]["not_converged"] == 0
    assert manifest["status"] == "complete" and manifest["fidelity"]["passed"]
    assert manifest["fidelity"]["max_abs_error"] <= 1e-5
    assert manifest["spaces"] == spaces and manifest["attention_types"] == list(family_spec.attention_types)
    assert manifest["parameterisation"]["spaces_supported"] == spaces
    # keys per row, from the lengths and the masks' definitions
    for kind in family_spec.attention_types:
        part = frame[frame["attention_type"] == kind]
        own = queries[kind][part["example"].to_numpy()]
        assert (part["query"].to_numpy() < own).all()
        if kind in ("self", "encoder_self", "cross"):
            n_keys = source[part["example"].to_numpy()]
        else:
            n_keys = part["query"].to_numpy() + 1
            if family_spec.kind == "decoder":
                windows = np.asarray([sliding_window(config, layer) or np.inf for layer in range(layers)])
                n_keys = np.minimum(n_keys, windows[part["layer"].to_numpy()])
        assert (part["n_keys"].to_numpy() == n_keys).all(), kind


@pytest.mark.parametrize("name", ROTARY_TYPES[:1])
def test_rotary_models_refuse_the_hidden_space(name, tmp_path, minilm_dir):
    directory = save_tiny(spec(name), tmp_path / name, minilm_dir)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(CORPUS[:2]) + "\n")
    result = CliRunner().invoke(app, ["run", str(directory), "--dataset", str(data), "--space", "hidden",
                                      "--out", str(tmp_path / "runs"), "--no-progress"])
    assert result.exit_code == 2
    assert "rotary" in result.output and "--space key" in result.output


# --------------------------------------------------------------------------------------------------
# Gemma: soft-capped attention logits are refused, by name and with the reason


@pytest.mark.parametrize("name, overrides", [
    ("gemma2", {"attn_logit_softcapping": 50.0}),  # Gemma 2's released value
    ("gemma3_text", {"attn_logit_softcapping": 30.0}),
    ("gemma3", {"attn_logit_softcapping": 30.0}),  # set in the multimodal config's text_config
])
def test_soft_capped_gemma_is_refused_before_it_loads(name, overrides):
    """The adapter refuses the config (``probe run``, ``probe.run`` and the callback ask it before loading:
    tests/interface/test_bad_inputs.py shows the CLI's exit 2); no number is computed."""
    config = build_config(spec(name), bpe_tokenizer(), **overrides)
    cap = overrides["attn_logit_softcapping"]
    with pytest.raises(ProbeError) as refused:
        adapter_for(config.model_type).model_class(config)
    message = str(refused.value)
    assert f"this {name} model" in message and f"attn_logit_softcapping = {cap}" in message
    assert "soft-capping is not linear in the evidence" in message


def test_soft_capping_that_reaches_attention_is_refused_there():
    """Past the config check (an adapter made without it), Gemma 2's attention function receives the cap and
    the capture point refuses the call: a soft-capped logit never becomes a row."""
    from transformers import AutoModel

    from probe.capture.adapters.generic import DECODER, ROTARY_DECODER_SITES, Family, InterfaceAdapter

    tokenizer = bpe_tokenizer()
    config = build_config(spec("gemma2"), tokenizer, attn_logit_softcapping=50.0)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    adapter = InterfaceAdapter(Family("gemma2", DECODER, ROTARY_DECODER_SITES, key=None))  # no config check
    adapter.prepare(model)
    inputs = adapter.encode(tokenizer, CORPUS[:2], None, 64)
    with pytest.raises(ProbeError, match="soft-capping"):
        adapter.sites(model, inputs)


def test_bidirectional_gemma3_is_refused():
    config = build_config(spec("gemma3_text"), bpe_tokenizer(), use_bidirectional_attention=True)
    with pytest.raises(ProbeError, match="use_bidirectional_attention"):
        adapter_for("gemma3_text").model_class(config)


# --------------------------------------------------------------------------------------------------
# 3. 20 rows against CVXPY, on problems built here


def layout(family_spec, attention_type, layer):
    """(query projection, key projection, call index) module names of a site, and whether q/k/v are fused."""
    name = family_spec.name
    if name == "albert":
        base = "encoder.albert_layer_groups.0.albert_layers.0.attention"
        return f"{base}.query", f"{base}.key", layer  # one module, called once per layer
    if name == "distilbert":
        base = f"transformer.layer.{layer}.attention"
        return f"{base}.q_lin", f"{base}.k_lin", 0
    if family_spec.kind == "encoder":
        base = f"encoder.layer.{layer}.attention.self"
        return f"{base}.query", f"{base}.key", 0
    if name == "gpt2":
        return f"h.{layer}.attn.c_attn", f"h.{layer}.attn.c_attn", 0
    if family_spec.kind == "decoder":
        base = f"{'language_model.' if name == 'gemma3' else ''}layers.{layer}.self_attn"
        if name == "phi3":
            return f"{base}.qkv_proj", f"{base}.qkv_proj", 0
        return f"{base}.q_proj", f"{base}.k_proj", 0
    if family_spec.model_type in ("t5", "mt5", "umt5"):
        stack = "encoder" if attention_type == "encoder_self" else "decoder"
        module = "layer.1.EncDecAttention" if attention_type == "cross" else "layer.0.SelfAttention"
        base = f"{stack}.block.{layer}.{module}"
        return f"{base}.q", f"{base}.k", 0
    stack = "encoder" if attention_type == "encoder_self" else "decoder"
    module = "encoder_attn" if attention_type == "cross" else "self_attn"
    base = f"model.{stack}.layers.{layer}.{module}"
    return f"{base}.q_proj", f"{base}.k_proj", 0


def affine(module, x, part=None, rows=None):
    """``W x + b`` in float64 numpy (Conv1D: ``x W + b``); ``part`` = (index, count) of a fused output
    cut in equal parts, ``rows`` = a slice of the output (Phi-3's ``qkv_proj``: q, k, v of unequal sizes)."""
    weight = module.weight.detach().double().numpy()
    bias = module.bias.detach().double().numpy() if module.bias is not None else 0.0
    fused = type(module).__name__ == "Conv1D"
    weight = weight.T if fused else weight  # (out, in)
    if part is not None:
        size = weight.shape[0] // part[1]
        rows = slice(part[0] * size, (part[0] + 1) * size)
    if rows is not None:
        weight, bias = weight[rows], bias[rows] if np.ndim(bias) else bias
    return x @ weight.T + bias, weight


def rotate(x, positions, theta, rotated=None):
    """Rotary position encoding (rotate-half convention) of rows ``x`` (n, d) at ``positions``, on the
    first ``rotated`` dimensions (all by default; the rest pass unchanged: partial rotary)."""
    d = x.shape[-1] if rotated is None else rotated
    x, rest = x[:, :d], x[:, d:]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=-1)
    half = np.concatenate([-x[:, d // 2:], x[:, : d // 2]], axis=-1)
    return np.concatenate([x * np.cos(angles) + half * np.sin(angles), rest], axis=-1)


def rms_norm(x, gain, eps):
    """RMSNorm of the rows of ``x``: ``x / sqrt(mean(x^2) + eps) * gain``."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain


def qk_norms(family_spec, model, q_name, q_all, k_all, heads, d):
    """The q/k norms of the families that have them, applied to the projected queries and keys:
    OLMo-2 normalises the whole projection, Qwen3 and Gemma 3 each head (Gemma's gain is 1 + w)."""
    name = family_spec.name
    if name not in ("olmo2", "qwen3", "gemma3_text", "gemma3"):
        return q_all, k_all
    attention = model.get_submodule(q_name.rsplit(".", 1)[0])
    eps = model.config.get_text_config().rms_norm_eps
    gains = [norm.weight.detach().double().numpy() + (1.0 if name.startswith("gemma") else 0.0)
             for norm in (attention.q_norm, attention.k_norm)]
    if name == "olmo2":
        return rms_norm(q_all, gains[0], eps), rms_norm(k_all, gains[1], eps)

    def per_head(x, gain):
        n = x.shape[0]
        return rms_norm(x.reshape(n, -1, d), gain, eps).reshape(n, -1)

    return per_head(q_all, gains[0]), per_head(k_all, gains[1])


def sliding_window(config, layer):
    """The layer's sliding window (keys j - W < i <= j), or None: ``layer_types`` where the config has them,
    else ``sliding_window`` on every layer (Mistral)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None and types[layer] != "sliding_attention":
        return None
    return window


def rotary_theta(config, layer):
    """The rotary base of a layer (Gemma 3: one per layer type)."""
    text = config.get_text_config()
    parameters = text.rope_parameters
    if "rope_theta" not in parameters:
        parameters = parameters[text.layer_types[layer]]
    return parameters["rope_theta"]


def single_example_inputs(family_spec, model, tokenizer, example):
    """The example alone (no padding): the model's inputs, built here."""
    import inspect

    accepted = inspect.signature(model.forward).parameters
    encoded = tokenizer(family_spec.texts[example], return_tensors="pt")
    inputs = {k: v for k, v in encoded.items() if k in accepted}
    if family_spec.kind == "encoder_decoder":
        target = tokenizer(TARGETS[example], return_tensors="pt")["input_ids"]
        start = model.config.decoder_start_token_id
        inputs["decoder_input_ids"] = torch.cat([torch.tensor([[start]]), target[:, :-1]], dim=1)  # teacher forcing
    return inputs


def recorded_projection_inputs(model, inputs, names):
    """The inputs of the named modules on one forward pass, in call order."""
    seen = {name: [] for name in names}
    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: seen[name].append(args[0][0].detach().double().numpy())) for name in names]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def t5_bias(model, attention_type, layer, q_len, k_len):
    if attention_type == "cross":
        return np.zeros((model.config.num_heads, q_len, k_len))
    stack = model.encoder if attention_type == "encoder_self" else model.decoder
    attention = stack.block[layer].layer[0].SelfAttention
    if not attention.has_relative_attention_bias:  # t5, mt5: layer 0's bias is shared
        attention = stack.block[0].layer[0].SelfAttention
    with torch.no_grad():
        return attention.compute_bias(q_len, k_len)[0].double().numpy()


def explicit_problem(family_spec, model, tokenizer, row, cache):
    """Templates, evidence and log preference of one row, built from the weights and projection inputs."""
    config = model.config
    kind, layer, head, example, j = row.attention_type, int(row.layer), int(row.head), int(row.example), int(row.query)
    q_name, k_name, call = layout(family_spec, kind, layer)
    if example not in cache:
        inputs = single_example_inputs(family_spec, model, tokenizer, example)
        names = {layout(family_spec, t, l)[i] for t in family_spec.attention_types for l in range(2) for i in (0, 1)}
        cache[example] = recorded_projection_inputs(model, inputs, sorted(names))
    x_q, x_k = cache[example][q_name][call], cache[example][k_name][call]
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or text.num_heads
    if family_spec.name == "phi3":  # qkv_proj = [q (h d'), k (g d'), v (g d')]
        d = text.head_dim
        q_all, _ = affine(model.get_submodule(q_name), x_q, rows=slice(0, heads * d))
        k_all, w_k = affine(model.get_submodule(k_name), x_k,
                            rows=slice(heads * d, (heads + text.num_key_value_heads) * d))
    else:
        fused = family_spec.name == "gpt2"
        q_all, _ = affine(model.get_submodule(q_name), x_q, (0, 3) if fused else None)
        k_all, w_k = affine(model.get_submodule(k_name), x_k, (1, 3) if fused else None)
        d = q_all.shape[-1] // heads
    q_all, k_all = qk_norms(family_spec, model, q_name, q_all, k_all, heads, d)
    kv_heads = k_all.shape[-1] // d
    g = head // (heads // kv_heads)
    q = q_all[:, head * d:(head + 1) * d]
    k = k_all[:, g * d:(g + 1) * d]
    n = k.shape[0]
    if family_spec.rotary:
        theta = rotary_theta(config, layer)
        rotated = int(d * text.rope_parameters.get("partial_rotary_factor", 1.0)) if family_spec.name == "phi3" else None
        q = rotate(q, np.arange(q.shape[0]), theta, rotated)
        k = rotate(k, np.arange(n), theta, rotated)
    scale = 1.0 if family_spec.model_type in ("t5", "mt5", "umt5") else d**-0.5
    if family_spec.name in ("gemma2", "gemma3_text", "gemma3"):
        scale = text.query_pre_attn_scalar**-0.5
    c = scale * np.sqrt(d)
    log_u = np.zeros(n)
    if family_spec.model_type in ("t5", "mt5", "umt5"):
        log_u = log_u + t5_bias(model, kind, layer, q.shape[0], n)[head, j]
    if kind in ("causal_self", "decoder_self"):
        log_u[j + 1:] = -np.inf
        window = sliding_window(config, layer) if family_spec.kind == "decoder" else None
        if window:
            log_u[: max(0, j - window + 1)] = -np.inf
    if row.space == "hidden":
        T = x_k / np.sqrt(d)
        z = c * w_k[g * d:(g + 1) * d].T @ q[j]
    else:
        T = k / np.sqrt(d)
        z = c * q[j]
    return T, z, log_u


def test_twenty_rows_match_cvxpy_on_problems_built_here(family, loaded, cli_run):
    from transformers import AutoTokenizer

    family_spec, directory = family
    frame, _ = cli_run
    groups = frame.groupby(["space", "attention_type"])
    per_group = -(-20 // groups.ngroups)  # every space and attention type, 20 rows in all
    rows = groups.sample(n=per_group, random_state=0).sample(frac=1, random_state=1).head(20)
    assert len(rows) == 20
    tokenizer = AutoTokenizer.from_pretrained(directory)
    cache = {}
    for row in rows.itertuples():
        T, z, log_u = explicit_problem(family_spec, loaded.model, tokenizer, row, cache)
        assert int(np.isfinite(log_u).sum()) == row.n_keys
        lam, _ = cvxpy_primal(T, z, log_u)
        reference = relative_deviation(lam, z, 1.0)
        assert abs(row.rel_deviation - reference) <= 1e-5 * max(1.0, reference), (row, reference)
