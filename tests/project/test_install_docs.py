"""The way in: the README is short and its commands are the ones CI runs; the real-checkpoint script is
the project's own.  (The documentation site's build is checked in test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The commands of the README's set-up block (the first bash block), without their comments."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up and test.*?```bash\n(.*?)```", readme, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def ci_lines() -> list[str]:
    text = (ROOT / ".ci" / "run").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_the_readme_is_short_and_installs_cpu_torch_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = readme_commands()
    # CI's timeout and retries: where PyTorch's index cannot be reached, pip gives up at once instead of
    # waiting through its default retries
    assert commands[0] == "pip install torch --index-url https://download.pytorch.org/whl/cpu --timeout 20 --retries 1"
    assert commands[1] == 'pip install -e ".[demo,test]"'
    # the everyday tests on every core, then the slow end-to-end checks
    assert commands[2:] == ["pytest -n auto", "pytest -n auto -m slow"]


def test_ci_runs_the_readme_commands():
    torch_cpu, install, *tests = readme_commands()
    lines = ci_lines()
    assert lines[-len(tests):] == tests  # CI ends with the README's test commands, the everyday and the slow
    assert "ruff check" in lines and "lint-imports" in lines  # and checks the code and its layers first
    quiet = [line.replace(" -q ", " ") for line in lines]
    assert any(line.startswith(f"python3 -m {torch_cpu}") for line in quiet)  # the same CPU index first ...
    assert any("torch==2.13.0" in line for line in lines)  # ... with the fallback the README names
    ci_installs = [line for line in lines if "pip install" in line and "-e" in line]
    assert [line.replace(" -q ", " ") for line in ci_installs] == [f"python3 -m {install}"]  # exactly the README's
    assert any("mkdocs build --strict" in line for line in lines)


def test_the_test_extra_holds_what_the_tests_need():
    """The README's set-up (demo and test extras) runs every everyday test: the documentation's tools come with
    the test extra, as the tests build and read the site (a fresh install once failed on a missing griffe)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "probe[docs]" in extras["test"] and "griffe" in (ROOT / "docs" / "hooks" / "docstrings.py").read_text()
    assert "mkdocstrings[python]>=0.26" in extras["docs"]  # which brings griffe


def test_the_real_checkpoints_come_from_the_projects_own_script():
    script = ROOT / "scripts" / "fetch_models.sh"
    assert script.exists() and "all-mpnet-base-v2" in script.read_text()
    assert any("bash scripts/fetch_models.sh" in line for line in ci_lines())
    for path in [ROOT / "tests" / "support" / "family_checks.py", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "../shared" not in path.read_text(), path
    from ..support.family_checks import real_model_dir

    with pytest.raises(pytest.skip.Exception, match="bash scripts/fetch_models.sh"):
        real_model_dir("no-such-checkpoint")
