"""Make rxnmapper's reaction-SMILES ALBERT usable by probe: a Hugging Face tokenizer for its vocabulary.

The checkpoint (``rxnmapper-albert``, rebuilt by ``scripts/fetch_models.sh``) ships only a
``vocab.txt`` of SMILES tokens and an empty ``tokenizer_config.json``.  ``AutoTokenizer`` then falls
back to the model type's tokenizer, ``AlbertTokenizer``, which has no vocabulary here and turns a whole
reaction into one unknown piece; a ``BertTokenizer`` over ``vocab.txt`` lower-cases and splits on
punctuation, so most atoms become ``[UNK]``.  rxnmapper itself (0.4.3, ``tokenization_smiles.py``)
tokenises with a regular expression (``SMI_REGEX_PATTERN`` in ``smiles_utils.py``, copied below) and
wraps the tokens as ``[CLS] tokens [SEP]``.

This script writes the same tokenisation as a fast tokenizer (``tokenizer.json``: word-level model over
``vocab.txt``, the regex as pre-tokenizer, the ``[CLS] ... [SEP]`` template), which ``AutoTokenizer``
loads.  The output directory also links the checkpoint's ``config.json`` and weights, so that it is a
complete model directory::

    python scripts/smiles_tokenizer.py /path/to/rxnmapper-albert rxn-albert
    probe run rxn-albert --dataset reactions.txt

(or, with ``--tokenizer``, ``probe run /path/to/rxnmapper-albert --tokenizer rxn-albert``).  One
difference from rxnmapper: characters the regex does not match (none in a valid SMILES) become
``[UNK]`` instead of being dropped, and whitespace separates tokens.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

#: rxnmapper 0.4.3, rxnmapper/smiles_utils.py
SMI_REGEX_PATTERN = (
    r"(\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>>?|\*|\$|\%[0-9]{2}|[0-9])"
)
SPECIAL_TOKENS = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
#: the model files linked into the output directory (those that exist)
MODEL_FILES = ("config.json", "pytorch_model.bin", "model.safetensors")


def smiles_tokenizer(vocab_file: Path, model_max_length: int = 512):
    """A ``PreTrainedTokenizerFast`` tokenising SMILES as rxnmapper's ``SmilesTokenizer`` does."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = Path(vocab_file).read_text(encoding="utf-8").splitlines()
    vocab = {token: index for index, token in enumerate(tokens)}
    missing = [token for token in SPECIAL_TOKENS.values() if token not in vocab]
    if missing:
        raise SystemExit(f"{vocab_file} lacks the special tokens {missing}: not a SMILES BERT vocabulary")
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(SMI_REGEX_PATTERN), behavior="isolated"),
    ])
    cls, sep = SPECIAL_TOKENS["cls_token"], SPECIAL_TOKENS["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length, **SPECIAL_TOKENS)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="the rxnmapper ALBERT directory (with vocab.txt)")
    parser.add_argument("out_dir", type=Path, help="directory to write the tokenizer (and model links) to")
    args = parser.parse_args(argv)
    vocab = args.model_dir / "vocab.txt"
    if not vocab.exists():
        raise SystemExit(f"{args.model_dir} has no vocab.txt")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    smiles_tokenizer(vocab).save_pretrained(args.out_dir)
    for name in MODEL_FILES:
        source, link = (args.model_dir / name).resolve(), args.out_dir / name
        if source.exists() and not link.exists():
            os.symlink(source, link)
    print(args.out_dir)


if __name__ == "__main__":
    main()
