"""Whether the tokenizer knows the texts: the share of their tokens it turns into its unknown token.

A tokenizer made for other data (a reaction-SMILES vocabulary on English sentences) maps most words to
one unknown token such as ``[UNK]``.  The model then sees runs of one token, and the rows measure that,
not the texts.  :func:`unknown_tokens` counts, over every text tokenized as the run tokenizes it
(truncated to ``--max-length``), the text's own tokens and how many of them are the tokenizer's
``unk_token_id``; the special tokens the tokenizer adds (``[CLS]``, ``[SEP]``, ``</s>``) are left out of
both counts, and there is no padding (each text is counted alone).  :func:`check_unknown_tokens` refuses
a run whose share is above :data:`UNKNOWN_LIMIT` before the model loads, unless it is allowed
(``--allow-unknown-tokens``); every run records the count in its manifest (``unknown_tokens``).

A tokenizer without an unknown token of its own has a share of 0 by construction: byte-level BPE
(GPT-2, RoBERTa, Llama 3) encodes every byte of every text, and GPT-2's ``unk_token`` is its
end-of-text token, which a text can only produce by spelling it out.  Such a tokenizer is recognised by
an ``unk_token_id`` that is None or that a token added to texts (bos, eos, cls, sep) also uses, and its
record says so.
"""

from __future__ import annotations

from probe.core.errors import ProbeError
from probe.core.spelling import option, switch

#: above this share of unknown tokens a run is refused (unless allowed): the tokenizer does not know the texts
UNKNOWN_LIMIT = 0.10

#: texts tokenized at once while counting (the counts, not the token ids, are kept)
_CHUNK = 1024

#: special tokens a tokenizer adds to texts: an unk token that is also one of them (GPT-2's end-of-text) cannot be
#: told from it, and is no unknown token of its own (padding and mask tokens do not occur: texts are not padded)
_ADDED_ROLES = ("bos", "eos", "cls", "sep")


def unknown_tokens(tokenizer, texts: list[str], max_length: int) -> dict:
    """The manifest's ``unknown_tokens`` record: the unknown token and its id, the texts' own tokens,
    how many of them are unknown, and their share (0 for a tokenizer without an unknown token)."""
    unknown_id = getattr(tokenizer, "unk_token_id", None)
    others = {getattr(tokenizer, f"{role}_token_id", None) for role in _ADDED_ROLES} - {None}
    has_unknown = unknown_id is not None and unknown_id not in others
    added = set(getattr(tokenizer, "all_special_ids", ())) - ({unknown_id} if has_unknown else set())
    tokens = unknown = 0
    for start in range(0, len(texts), _CHUNK):
        for ids in tokenizer(texts[start:start + _CHUNK], truncation=True, max_length=max_length)["input_ids"]:
            tokens += sum(1 for token in ids if token not in added)
            if has_unknown:
                unknown += sum(1 for token in ids if token == unknown_id)
    record = {
        "token": tokenizer.unk_token if has_unknown else None,
        "token_id": unknown_id if has_unknown else None,
        "tokens": tokens,
        "unknown": unknown,
        "share": unknown / tokens if tokens else 0.0,
        "limit": UNKNOWN_LIMIT,
    }
    if not has_unknown:
        record["note"] = ("the tokenizer has no unknown token of its own (byte-level BPE encodes every text): "
                          "0 by construction")
    return record


def describe(record: dict | None) -> str | None:
    """``5,067 tokens, 12 of them [UNK] (0.2%)`` (or why none is unknown), for the final lines and the report;
    None for a run that records no count (a version-1 run may not)."""
    if not isinstance(record, dict):
        return None
    if record.get("token") is None:
        return f"{record['tokens']:,} tokens, none unknown (the tokenizer has no unknown token)"
    return f"{record['tokens']:,} tokens, {record['unknown']:,} of them {record['token']} ({record['share']:.1%})"


def check_unknown_tokens(record: dict, model: str, allowed: bool) -> None:
    """Refuse a run whose tokenizer turns more than :data:`UNKNOWN_LIMIT` of the tokens into its unknown token,
    unless ``allowed`` (``--allow-unknown-tokens``)."""
    if allowed or record["share"] <= UNKNOWN_LIMIT:
        return
    raise ProbeError(
        f"The tokenizer of '{model}' does not know these texts: it turns {record['share']:.1%} of their tokens "
        f"({record['unknown']:,} of {record['tokens']:,}) into its unknown token {record['token']}, more than "
        f"the {UNKNOWN_LIMIT:.0%} probe accepts. The model would see mostly {record['token']}, and the rows would "
        "measure that, not the texts. A tokenizer made for other data does this (a chemistry or protein "
        f"vocabulary on English). Run the model on the kind of text it was trained on, or pass the right "
        f"tokenizer with {option('tokenizer', 'PATH')}; to run anyway, add {switch('allow_unknown_tokens')} (the "
        "share is recorded in the manifest)."
    )
