"""The capture point (probe.capture.adapters.interface): the probe attention function is registered only inside
its block (also when the forward fails), delegates to the family's own eager attention, and what probe
cannot represent is refused with a ProbeError that says why -- never a silently wrong problem."""

from __future__ import annotations

import pytest
import torch

from probe.capture.adapters.generic import (
    BART_SITES,
    DECODER,
    ENCODER_DECODER,
    ROTARY_DECODER_SITES,
    Family,
    InterfaceAdapter,
)
from probe.capture.adapters.interface import eager_attention_calls
from probe.core.errors import ProbeError


def interface_entries():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, dict(ALL_ATTENTION_FUNCTIONS._local_mapping)


def tiny(config_name, **settings):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=64, **settings)
    return transformers.AutoModel.from_config(config, attn_implementation="eager").eval()


def llama_like(config_name="LlamaConfig", **settings):
    return tiny(config_name, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, **settings)


def ids(model, length=7, batch=2):
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(3, 60, (batch, length), generator=generator),
              "attention_mask": torch.ones(batch, length, dtype=torch.long)}
    if model.config.is_encoder_decoder:
        inputs.update(decoder_input_ids=inputs["input_ids"][:, :5],
                      decoder_attention_mask=inputs["attention_mask"][:, :5])
    return inputs


def test_registration_lives_only_inside_the_block():
    model = llama_like()
    inputs = ids(model)
    interface, before = interface_entries()
    calls = []
    with eager_attention_calls(calls.append), torch.no_grad():
        assert "eager" in interface._local_mapping
        inside = model(**inputs, output_attentions=True).attentions
    assert len(calls) == 2 and interface_entries()[1] == before
    # the probabilities the calls carry are the model's own (the family's eager function ran)
    for call, attention in zip(calls, inside):
        assert torch.equal(call.probs, attention)
    with torch.no_grad():
        model(**inputs)  # outside the block nothing is recorded
    assert len(calls) == 2

    def fail(call):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"), eager_attention_calls(fail), torch.no_grad():
        model(**inputs)
    assert interface_entries()[1] == before


def test_a_users_own_eager_registration_is_restored():
    interface, _ = interface_entries()

    def users_eager(*args, **kwargs):
        raise AssertionError("not called inside probe's block")

    interface["eager"] = users_eager
    try:
        model = llama_like()
        with eager_attention_calls(lambda call: None), torch.no_grad():
            model(**ids(model))
        assert interface._local_mapping["eager"] is users_eager
    finally:
        del interface["eager"]


def test_blocks_do_not_nest():
    with eager_attention_calls(lambda call: None):
        with pytest.raises(RuntimeError, match="nest"), eager_attention_calls(lambda call: None):
            pass


#: (case, model builder, family declaration, what the error must say)
REFUSED = [
    ("logit soft-capping (gemma2)", lambda: llama_like("Gemma2Config"),
     Family("gemma2", DECODER, ROTARY_DECODER_SITES, None), "soft-capping"),
    ("attention sinks (gpt-oss)",
     lambda: llama_like("GptOssConfig", num_local_experts=2, num_experts_per_tok=1),
     Family("gpt_oss", DECODER, ROTARY_DECODER_SITES, None), "sinks"),
    ("a code path around the interface (gpt2 reorder_and_upcast_attn)",
     lambda: tiny("GPT2Config", n_embd=32, n_layer=2, n_head=4, reorder_and_upcast_attn=True),
     Family("gpt2", DECODER, {"causal_self": r"h\.\d+\.attn$"}, "c_attn", (1, 3)), "without transformers' eager"),
    ("sites that match no module",
     lambda: llama_like(), Family("llama", DECODER, {"causal_self": r"no_such_module$"}, None), "does not fit"),
    ("an attention module left undeclared",
     lambda: tiny("BartConfig", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32),
     Family("bart", ENCODER_DECODER, {**BART_SITES, "encoder_self": r"encoder\.layers\.0\.self_attn$"}, "k_proj"),
     "not declared"),
]


@pytest.mark.parametrize("case, build, family, message", REFUSED, ids=[case for case, *_ in REFUSED])
def test_what_cannot_be_represented_is_refused(case, build, family, message):
    model = build()
    interface, before = interface_entries()
    with pytest.raises(ProbeError, match=message):
        InterfaceAdapter(family).sites(model, ids(model))
    assert interface_entries()[1] == before  # removed after the failure too


def test_family_declarations_are_checked():
    with pytest.raises(ValueError, match="needs sites"):
        Family("half", ENCODER_DECODER, {"encoder_self": r"x$"}, key=None)
