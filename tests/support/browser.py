"""A real browser for the report's page: headless Chromium driven by ``scripts/check_html.py`` over the
DevTools protocol (real mouse clicks); tests that need it are marked ``needs_chromium``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


CHROMIUM = Path("/usr/bin/chromium")


needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")


def load_check_html():
    spec = importlib.util.spec_from_file_location("check_html", REPO / "scripts" / "check_html.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
