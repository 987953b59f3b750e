"""A tiny random T5 (encoder-decoder, relative position bias) with its own small Unigram tokenizer, and
source and target texts for it."""

from __future__ import annotations

import string

import torch

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
