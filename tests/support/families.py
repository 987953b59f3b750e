"""Tiny random models of every family probe declares, saved with a real tokenizer that builds offline.

Each :class:`Spec` says how to build a 2-layer, 4-head, 32-64 wide model of one ``model_type`` and which
tokenizer goes with it:

* encoders: the real MiniLM WordPiece tokenizer (fixture ``minilm_dir``);
* encoder-decoders: the T5 Unigram tokenizer of ``tests/capture/test_t5.py`` (pad 0, eos 1, unk 2);
* decoder-only: a byte-level BPE trained here with the ``tokenizers`` library on a few sentences, wrapped
  as ``GPT2TokenizerFast`` (no pad token, as GPT-2's: probe pads with the end token).

Query/key biases and position biases are drawn large (standard deviation 0.5 to 1.5) so that their
handling shows in the fidelity checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "albert", "distilbert")
T5_TYPES = ("t5", "flan-t5", "mt5", "umt5")
BART_TYPES = ("bart", "mbart", "marian")
DECODER_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "qwen3", "phi3", "olmo2", "gemma2", "gemma3_text", "gemma3")
ROTARY_TYPES = ("llama", "mistral", "qwen2", "gemma", "qwen3", "phi3", "olmo2", "gemma2", "gemma3_text", "gemma3")
#: sliding-window attention: window 5 (mistral: every layer; gemma2, gemma3: layer 0, layer 1 is global)
WINDOW = 5

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is the closed-form solution of a convex problem, or so the claim goes.",
    "Researchers measured the deviation for every layer, head and query token of the model.",
    "Why?",
    "Every head of every layer attends to the tokens before it, and some heads attend to the first one.",
]

#: encoder-decoder pairs, in words the T5 test tokenizer knows (other words become characters)
SOURCES = [
    "the quick brown fox",
    "attention is a convex problem and every head of the model is a query",
    "Why é?",
    "every layer and every head",
    "the lazy dog jumps over the quick brown fox and the dog is a fox over every token",
]
TARGETS = [
    "the lazy dog jumps over the quick brown fox",
    "every layer and every head of the model",
    "a convex problem",
    "attention over every token of the query , and the quick brown fox jumps over the lazy dog",
    "ok",
]


@dataclass
class Spec:
    name: str  # the family's test name (flan-t5 is model_type t5)
    model_type: str
    kind: str  # "encoder", "encoder_decoder", "decoder"
    config: dict = field(default_factory=dict)

    @property
    def attention_types(self):
        return {"encoder": ("self",), "decoder": ("causal_self",)}.get(
            self.kind, ("encoder_self", "decoder_self", "cross")
        )

    @property
    def texts(self):
        """The texts the tests run on (encoder input for encoder-decoders)."""
        return SOURCES if self.kind == "encoder_decoder" else CORPUS

    @property
    def rotary(self):
        return self.name in ROTARY_TYPES


def spec(name: str) -> Spec:
    if name in ENCODER_TYPES:
        return Spec(name, name, "encoder")
    if name in T5_TYPES:
        return Spec(name, "t5" if name == "flan-t5" else name, "encoder_decoder")
    if name in BART_TYPES:
        return Spec(name, name, "encoder_decoder")
    return Spec(name, name, "decoder")


#: the families of the test table (plain bert and t5 have their own tests: test_bert.py, test_t5.py)
ALL = tuple(n for n in ENCODER_TYPES + T5_TYPES + BART_TYPES + DECODER_TYPES if n not in ("bert", "t5"))


def bpe_tokenizer(padding_side="right"):
    """A byte-level BPE (GPT-2 style) trained on CORPUS, as a GPT2TokenizerFast with an end token."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=400, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    return GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                             unk_token="<|endoftext|>", padding_side=padding_side)


def tokenizer_for(spec: Spec, minilm_dir, padding_side=None):
    from transformers import AutoTokenizer

    if spec.kind == "encoder":
        return AutoTokenizer.from_pretrained(minilm_dir)
    if spec.kind == "encoder_decoder":
        from tests.capture.test_t5 import make_tokenizer

        return make_tokenizer()
    return bpe_tokenizer(padding_side or "right")


def build_config(spec: Spec, tokenizer, **overrides):
    """The family's tiny config; ``overrides`` replace entries of a decoder-only config (e.g. soft-capping)."""
    import transformers as T

    vocab = len(tokenizer)
    width, heads, layers = 32, 4, 2
    if spec.kind == "encoder":
        pad = tokenizer.pad_token_id
        common = dict(vocab_size=vocab, num_attention_heads=heads, num_hidden_layers=layers, pad_token_id=pad,
                      max_position_embeddings=128)
        if spec.name == "distilbert":
            return T.DistilBertConfig(vocab_size=vocab, dim=width, n_heads=heads, n_layers=layers, hidden_dim=2 * width,
                                      pad_token_id=pad, max_position_embeddings=128)
        if spec.name == "albert":
            return T.AlbertConfig(**common, hidden_size=width, embedding_size=16, intermediate_size=2 * width)
        if spec.name == "electra":
            return T.ElectraConfig(**common, hidden_size=width, embedding_size=16, intermediate_size=2 * width)
        config_class = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "xlm-roberta": T.XLMRobertaConfig,
                        "camembert": T.CamembertConfig}[spec.name]
        return config_class(**common, hidden_size=width, intermediate_size=2 * width)
    if spec.name in T5_TYPES:
        config_class = {"t5": T.T5Config, "flan-t5": T.T5Config, "mt5": T.MT5Config, "umt5": T.UMT5Config}[spec.name]
        gated = spec.name != "t5"  # flan-t5, mt5 and umt5 use gated-gelu
        return config_class(vocab_size=vocab, d_model=width, d_kv=8, d_ff=2 * width, num_heads=heads,
                            num_layers=layers, num_decoder_layers=layers, relative_attention_num_buckets=8,
                            relative_attention_max_distance=16,
                            feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
                            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if spec.name in BART_TYPES:
        config_class = {"bart": T.BartConfig, "mbart": T.MBartConfig, "marian": T.MarianConfig}[spec.name]
        start = 0 if spec.name == "marian" else 1  # Marian starts with the pad token, BART with </s>
        return config_class(vocab_size=vocab, d_model=width, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * width,
                            decoder_ffn_dim=2 * width, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
                            bos_token_id=1, decoder_start_token_id=start, forced_eos_token_id=1)
    eos = tokenizer.eos_token_id
    if spec.name == "gpt2":
        return T.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=128,
                            bos_token_id=eos, eos_token_id=eos)
    config_class = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "gemma": T.GemmaConfig,
                    "qwen3": T.Qwen3Config, "phi3": T.Phi3Config, "olmo2": T.Olmo2Config, "gemma2": T.Gemma2Config,
                    "gemma3_text": T.Gemma3TextConfig, "gemma3": T.Gemma3TextConfig}[spec.name]
    # Gemma 2 and 3: a sliding layer then a global one, and a logit scale 1/sqrt(24) that is not 1/sqrt(d')
    gemma = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"],
             "query_pre_attn_scalar": 24, "attn_logit_softcapping": None}
    extra = {
        "llama": {"attention_bias": True},
        "mistral": {"sliding_window": WINDOW},
        "qwen2": {},  # q/k biases (attention_bias is always on in Qwen2)
        "phi3": {"partial_rotary_factor": 0.5},  # fused qkv_proj; rotary on half of each head's dimensions
        "gemma2": gemma,
        "gemma3_text": gemma,
        "gemma3": gemma,
    }.get(spec.name, {})
    text = config_class(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        bos_token_id=eos, eos_token_id=eos, pad_token_id=None, **{**extra, **overrides})
    if spec.name != "gemma3":
        return text
    # the multimodal Gemma 3 (model_type gemma3): the text model above beside a tiny SigLIP vision tower
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return T.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=vocab, boi_token_index=vocab, eoi_token_index=vocab,
                          bos_token_id=eos, eos_token_id=eos, pad_token_id=None)


def strengthen(model, spec: Spec, generator):
    """Large query/key biases, position biases and q/k norm gains, so that their handling is exercised."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            last = name.rsplit(".", 2)
            if last[-1] == "bias" and last[-2] in ("query", "key", "q_lin", "k_lin", "q_proj", "k_proj", "c_attn"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            if last[-2] in ("q_norm", "k_norm"):  # q/k norm gains away from their initial 1 (or 0: Gemma's 1 + w)
                parameter.copy_(1.0 + torch.randn(parameter.shape, generator=generator) * 0.5)
            if "relative_attention_bias" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 1.5)


def save_tiny(spec: Spec, directory, minilm_dir, *, padding_side: str | None = None, seed: int = 0,
              overrides: dict | None = None):
    """Build the family's tiny random model, save it with its tokenizer and return the directory
    (``overrides``: config entries of a decoder-only family, see :func:`build_config`)."""
    from transformers import AutoModel, AutoModelForSeq2SeqLM

    tokenizer = tokenizer_for(spec, minilm_dir, padding_side)  # saved with the tokenizer (decoder-only)
    config = build_config(spec, tokenizer, **(overrides or {}))
    torch.manual_seed(seed)
    model_class = AutoModelForSeq2SeqLM if spec.kind == "encoder_decoder" else AutoModel
    model = model_class.from_config(config, attn_implementation="eager")
    strengthen(model, spec, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
