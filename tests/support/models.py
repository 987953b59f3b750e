"""Tiny random models saved to disk, loaded by the tests through the path users take (``save_pretrained``
folders given to ``probe.capture.loading.load_model`` or the command line)."""

from __future__ import annotations

import json
from pathlib import Path


def save_tiny_bert(directory, minilm_dir, *, layers=2, heads=4, hidden=64, attn_implementation=None, seed=0):
    """Build a random BERT from config, save it (with MiniLM's tokenizer) and return the directory."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=2 * hidden, max_position_embeddings=256,
    )
    model = BertModel._from_config(config, attn_implementation=attn_implementation or "eager")
    with torch.no_grad():  # non-trivial query/key biases, so that bias handling is exercised
        for layer in model.encoder.layer:
            layer.attention.self.query.bias.normal_(0, 0.5)
            layer.attention.self.key.bias.normal_(0, 0.5)
    model.save_pretrained(directory)
    if attn_implementation is not None:  # record it the way checkpoints that keep it do
        config_file = Path(directory) / "config.json"
        saved = json.loads(config_file.read_text())
        saved["_attn_implementation"] = attn_implementation
        config_file.write_text(json.dumps(saved))
    AutoTokenizer.from_pretrained(minilm_dir).save_pretrained(directory)
    return directory


def save_word_bert(directory, words, *, layers: int, heads: int, lowercase: bool = False):
    """Build a random BERT (hidden 32, seed 0) whose WordPiece tokenizer knows BERT's special tokens and
    ``words`` only, built here (no MiniLM package needed), save both and return the directory."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    tokenizer = BertTokenizer(vocab={word: index for index, word in enumerate(vocabulary)}, do_lower_case=lowercase)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=64, max_position_embeddings=128)
    BertModel._from_config(config, attn_implementation="eager").save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
