"""The test session's caches, outside the home directory: one temporary folder for every cache a test could
fill (probe's own, Hugging Face's, matplotlib's, XDG's, Chromium's profile under ``XDG_CONFIG_HOME``).
``tests/conftest.py`` points the environment variables there before any library reads them."""

from __future__ import annotations

import tempfile
from pathlib import Path

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
