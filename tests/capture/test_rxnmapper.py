"""The real ALBERT trained on reaction SMILES (rxnmapper 0.4.3), end to end through ``probe run``.

Its checkpoint has no usable tokenizer for ``AutoTokenizer``; ``scripts/smiles_tokenizer.py`` writes
one (rxnmapper's regex tokenisation as a fast tokenizer) next to links to the weights.  The checkpoint is
rebuilt by ``bash scripts/fetch_models.sh DIR`` and found under ``$PROBE_MODELS_DIR`` (default
``~/.cache/probe-models``); without it the end-to-end test is skipped and says so.

``albert`` itself is captured through transformers' attention interface (``probe.capture.adapters.generic``).
The run goes the way the README says: the original checkpoint with ``--tokenizer`` pointing at the
written tokenizer.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from probe.capture.adapters import REGISTRY

from ..support.family_checks import assert_complete_run, cli_run, real_model_dir, token_counts, write_texts

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from smiles_tokenizer import SMI_REGEX_PATTERN  # noqa: E402

#: reactions from rxnmapper's own tests (tests/test_mapper.py)
REACTIONS = [
    "CC(C)S.CN(C)C=O.Fc1cccnc1F.O=C([O-])[O-].[K+].[K+]>>CC(C)Sc1ncccc1F",
    "C1COCCO1.CC(C)(C)OC(=O)CONC(=O)NCc1cccc2ccccc12.Cl>>O=C(O)CONC(=O)NCc1cccc2ccccc12",
    "C=CCN=C=S.CNCc1ccc(C#N)cc1.NNC(=O)c1cn2c(n1)CCCC2>>C=CCN1C(C2=CN3CCCCC3=N2)=NN=C1N(C)CC1=CC=C(C#N)C=C1",
    "CC[O-]~[Na+].BrCC.[Na+]~[H-]>>CCOCC",
]
#: short ones for the end-to-end run (an esterification and a Williamson ether synthesis: one padded batch)
SHORT_REACTIONS = ["CC(=O)O.OCC>>CC(=O)OCC", REACTIONS[3]]


@pytest.fixture(scope="module")
def rxn_albert(tmp_path_factory):
    """(the checkpoint, the tokenizer directory scripts/smiles_tokenizer.py writes for it)"""
    checkpoint = real_model_dir("rxnmapper-albert")
    out = tmp_path_factory.mktemp("rxn") / "rxn-albert"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "smiles_tokenizer.py"), str(checkpoint), str(out)],
                   check=True, capture_output=True)
    return checkpoint, out


def test_smiles_tokenizer_matches_rxnmapper_regex(rxn_albert):
    from transformers import AutoTokenizer

    _, tokenizer_dir = rxn_albert
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for reaction in REACTIONS + SHORT_REACTIONS + ["Brc1ccccc1.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1"]:
        pieces = re.findall(SMI_REGEX_PATTERN, reaction)
        assert "".join(pieces) == reaction
        ids = tokenizer(reaction)["input_ids"]
        assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", *pieces, "[SEP]"]
        assert tokenizer.unk_token_id not in ids  # every token of these reactions is in the vocabulary


def test_rxnmapper_albert_end_to_end(rxn_albert, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    checkpoint, tokenizer_dir = rxn_albert
    assert "albert" in REGISTRY
    data = write_texts(tmp_path, SHORT_REACTIONS)
    frame, manifest = cli_run(checkpoint, data, tmp_path / "runs", "--tokenizer", tokenizer_dir, "--batch-size", 2)
    config = AutoConfig.from_pretrained(str(checkpoint))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("albert", 12, 8)
    rows = sum(token_counts(tokenizer, SHORT_REACTIONS)) * config.num_attention_heads * config.num_hidden_layers
    assert_complete_run(frame, manifest, {"self": rows})
    assert {">>", "[O-]", "[Na+]", "C", "[CLS]"} <= set(frame["token"])
