"""The capture point (probe.capture.adapters.interface): probe's attention function is registered under its own
name and selected for the measured model alone, so nothing global changes and nothing needs restoring: another
eager model, in another thread, computes its own attention while probe measures, and two measurements in two
threads are each right.  The function delegates to the family's own eager attention, and what probe cannot
represent is refused with a ProbeError that says why -- never a silently wrong problem."""

from __future__ import annotations

import threading

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
from probe.capture.adapters.interface import ATTENTION, eager_attention_calls, runs_probe_attention
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


def ids(model, length=7, batch=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    inputs = {"input_ids": torch.randint(3, 60, (batch, length), generator=generator),
              "attention_mask": torch.ones(batch, length, dtype=torch.long)}
    if model.config.is_encoder_decoder:
        inputs.update(decoder_input_ids=inputs["input_ids"][:, :5],
                      decoder_attention_mask=inputs["attention_mask"][:, :5])
    return inputs


LLAMA = Family("llama", DECODER, ROTARY_DECODER_SITES, None)


def attentions(model, inputs):
    with torch.no_grad():
        return model(**inputs, output_attentions=True).attentions


def test_nothing_global_changes():
    """The probe function lives under its own name: transformers' "eager" entry is never touched, the measured
    model runs probe's function only within the capture, and gives its attention back afterwards."""
    model = llama_like()
    inputs = ids(model)
    interface, before = interface_entries()
    eager = attentions(model, inputs)
    calls = []
    with runs_probe_attention(model), eager_attention_calls(calls.append):
        assert model.config._attn_implementation == ATTENTION
        assert interface_entries()[1] == before  # no entry of the shared instance changed
        inside = attentions(model, inputs)
    assert model.config._attn_implementation == "eager" and interface_entries()[1] == before
    assert len(calls) == 2
    # the probabilities the calls carry are the model's own eager attention
    for call, attention, reference in zip(calls, inside, eager):
        assert torch.equal(call.probs, attention) and torch.equal(attention, reference)
    with torch.no_grad():
        model(**inputs)  # outside the block nothing is recorded
    assert len(calls) == 2

    def fail(call):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"), runs_probe_attention(model), \
            eager_attention_calls(fail), torch.no_grad():
        model(**inputs)
    assert model.config._attn_implementation == "eager" and interface_entries()[1] == before


def test_a_users_own_eager_registration_is_never_touched():
    interface, _ = interface_entries()

    def users_eager(*args, **kwargs):
        raise AssertionError("not called for a model probe measures")

    interface["eager"] = users_eager
    try:
        model = llama_like()
        sites = InterfaceAdapter(LLAMA).sites(model, ids(model))
        assert len(sites) == 2 and interface._local_mapping["eager"] is users_eager
    finally:
        del interface["eager"]


def test_blocks_do_not_nest_within_a_thread():
    with eager_attention_calls(lambda call: None):
        with pytest.raises(RuntimeError, match="nest"), eager_attention_calls(lambda call: None):
            pass


def test_another_eager_model_in_another_thread_keeps_its_own_attention():
    """While probe measures one model over and over, a second eager model runs in another thread (an evaluation
    beside a training with the callback): every one of its forward passes gives its own attention, and probe's
    captures stay those of its model alone."""
    measured, other = llama_like(), tiny("BertConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=32)
    measured_inputs, other_inputs = ids(measured), ids(other, length=9, seed=2)
    reference = [a.clone() for a in attentions(other, other_inputs)]
    alone = InterfaceAdapter(LLAMA).sites(measured, measured_inputs)
    stop, seen, problems = threading.Event(), [], []

    def evaluate():
        try:
            while not stop.is_set():
                for got, expected in zip(attentions(other, other_inputs), reference, strict=True):
                    assert torch.equal(got, expected)
                seen.append(1)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            problems.append(error)

    thread = threading.Thread(target=evaluate)
    thread.start()
    try:
        for _ in range(20):
            sites = InterfaceAdapter(LLAMA).sites(measured, measured_inputs)
            assert [(s.attention_type, s.layer) for s in sites] == [(s.attention_type, s.layer) for s in alone]
            for site, expected in zip(sites, alone):
                assert torch.equal(site.model_probs, expected.model_probs)
    finally:
        stop.set()
        thread.join()
    assert not problems, problems
    assert seen, "the other thread never ran"
    assert other.config._attn_implementation == "eager"


def test_two_measurements_in_two_threads_are_each_right():
    """Two models measured at once, one per thread: each capture holds its own model's sites, equal to its capture
    alone."""
    bart_family = Family("bart", ENCODER_DECODER, BART_SITES, "k_proj")
    models = {
        "llama": (llama_like(), LLAMA),
        "bart": (tiny("BartConfig", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32), bart_family),
    }
    inputs = {name: ids(model) for name, (model, _) in models.items()}
    alone = {name: InterfaceAdapter(family).sites(model, inputs[name]) for name, (model, family) in models.items()}
    results, problems = {name: [] for name in models}, []
    barrier = threading.Barrier(len(models))

    def measure(name):
        model, family = models[name]
        try:
            barrier.wait()
            for _ in range(10):
                results[name].append(InterfaceAdapter(family).sites(model, inputs[name]))
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            problems.append(error)

    threads = [threading.Thread(target=measure, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems
    for name, runs in results.items():
        assert len(runs) == 10
        for sites in runs:
            assert [(s.attention_type, s.layer) for s in sites] == [(s.attention_type, s.layer) for s in alone[name]]
            for site, expected in zip(sites, alone[name]):
                assert torch.equal(site.model_probs, expected.model_probs)
                assert torch.equal(site.queries, expected.queries)


#: (case, model builder, family declaration, what the error must say)
REFUSED = [
    ("logit soft-capping (gemma2)", lambda: llama_like("Gemma2Config"),
     Family("gemma2", DECODER, ROTARY_DECODER_SITES, None), "soft-capping"),
    ("attention sinks (gpt-oss)",
     lambda: llama_like("GptOssConfig", num_local_experts=2, num_experts_per_tok=1),
     Family("gpt_oss", DECODER, ROTARY_DECODER_SITES, None), "sinks"),
    ("a code path around the interface (gpt2 reorder_and_upcast_attn)",
     lambda: tiny("GPT2Config", n_embd=32, n_layer=2, n_head=4, reorder_and_upcast_attn=True),
     Family("gpt2", DECODER, {"causal_self": r"h\.\d+\.attn$"}, "c_attn", (1, 3)), "reorder_and_upcast_attn"),
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
    assert interface_entries()[1] == before and model.config._attn_implementation == "eager"  # after a failure too


def test_family_declarations_are_checked():
    with pytest.raises(ValueError, match="needs sites"):
        Family("half", ENCODER_DECODER, {"encoder_self": r"x$"}, key=None)
