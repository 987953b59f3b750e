"""Texts cut to what ``--max-length`` needs, before anything tokenizes them whole.

A run keeps the first ``--max-length`` tokens of each text.  Tokenizing a long text whole to keep 128 of
its tokens costs time and memory in proportion to the text (a 50 MB line: minutes and gigabytes of
token offsets).  :func:`cut_texts` replaces each long text by a prefix that still yields those tokens:

1. the text's first ``CHARS_PER_TOKEN * max_length`` characters, ended at its last whitespace (so that
   no word is cut: tokenizers split on whitespace before they split words, and a word's tokens come
   after those of the words before it);
2. tokenized without special tokens; if that gives at least ``max_length + MARGIN_TOKENS`` tokens, the
   prefix holds every token the run keeps, followed by some the truncation drops;
3. otherwise the prefix grows fourfold, up to the whole text.

Before that, a local ``.txt`` file is read in pieces, each text keeping only its first
:func:`kept_characters` characters (:func:`probe.capture.data.load_texts`): 1,024 per token of
``--max-length``, far more than any tokenizer needs for that many tokens of text, so that reading a long
line costs no more memory than that either.

The texts' hash (:attr:`probe.capture.data.Texts.sha256`, which ``probe resume`` compares) stays that of
the texts as read, and the count of texts the truncation cuts (their own tokens with the special ones
beyond ``max_length``) is recorded in the manifest and said in the run's final lines.
"""

from __future__ import annotations

import re
from dataclasses import replace

from probe.capture.data import Texts

#: characters looked at first per token ``--max-length`` allows (a token of English is about 4)
CHARS_PER_TOKEN = 16
#: tokens beyond ``max_length`` a prefix must yield: the last words' tokens are then past the cut
MARGIN_TOKENS = 8
#: characters of each text kept while a text file is read, per token ``--max-length`` allows
KEPT_CHARS_PER_TOKEN = 1024
_LAST_SPACE = re.compile(r"\s(?=\S*$)")


def kept_characters(max_length: int) -> int:
    """How many characters of each text are read and kept, for ``max_length`` tokens."""
    return KEPT_CHARS_PER_TOKEN * max_length + 1024


def _prefix(text: str, length: int) -> str:
    """``text``'s first ``length`` characters, ended at a whitespace in their second half when there is one."""
    if length >= len(text):
        return text
    head = text[:length]
    space = _LAST_SPACE.search(head, length // 2)
    return head[: space.start()] if space else head


def cut_text(tokenizer, text: str, max_length: int, special: int) -> tuple[str, bool]:
    """``text``, or a prefix of it that yields the same first ``max_length`` tokens (module docstring); and
    whether the run truncates it (its own tokens and the ``special`` ones added to every text exceed
    ``max_length``)."""
    length = CHARS_PER_TOKEN * max_length + 64
    while True:
        prefix = _prefix(text, length)
        # verbose=False: no warning that the prefix is longer than the model takes (it is cut after this)
        tokens = len(tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"])
        if prefix is text or len(prefix) == len(text):
            return text, tokens + special > max_length
        if tokens >= max_length + MARGIN_TOKENS:
            return prefix, True
        length *= 4


def cut_texts(texts: Texts, tokenizer, max_length: int) -> Texts:
    """``texts`` with each text cut to what ``max_length`` needs (:func:`cut_text`), its hash that of the
    texts as read, and ``truncated`` the number of texts the run truncates.  Texts cut before are returned
    as they are."""
    if texts.cut_to == max_length:
        return texts
    sha256 = texts.sha256  # of the texts as read, before any is cut
    special = len(tokenizer("")["input_ids"])
    kept, truncated = [], 0
    for text in texts.texts:
        prefix, cut = cut_text(tokenizer, text, max_length, special)
        kept.append(prefix)
        truncated += cut
    return replace(texts, texts=kept, read_sha256=sha256, cut_to=max_length, truncated=truncated)
