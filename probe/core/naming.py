"""What a run is called: the model's real name, read from its files, and the run's name built on it.

A model directory is often named after where it was put (``model``, ``checkpoint``, a hub cache
snapshot's commit hash), not after the model.  :func:`model_name` reads the name its files give, in
this order: the title of its model card (``README.md``'s first ``# heading``, when it is one word such
as ``all-MiniLM-L6-v2``); ``_name_or_path`` in ``config.json`` (skipped for sentence-transformers
directories, where it names the base model the embedding model was trained from); a hub cache
snapshot's repository (``models--org--name``); the directory's own name.  A hub id is its own name.
Nothing here imports torch or transformers: run names are decided before anything heavy loads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

#: a name as model cards and hub ids write them: one word of letters, digits, ``._-`` (and ``/`` for org/name)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
#: files that mark a sentence-transformers directory (its config.json's ``_name_or_path`` is the base model)
_SENTENCE_TRANSFORMERS = ("config_sentence_transformers.json", "modules.json", "sentence_bert_config.json")


def _card_title(directory: Path) -> str | None:
    card = directory / "README.md"
    try:
        lines = card.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    in_front_matter = bool(lines) and lines[0].strip() == "---"
    for number, line in enumerate(lines):
        if in_front_matter:
            if number > 0 and line.strip() == "---":
                in_front_matter = False
            continue
        if line.startswith("# "):
            title = line[2:].strip()
            return title if _NAME.fullmatch(title) else None
    return None


def _configured_name(directory: Path) -> str | None:
    if any((directory / marker).exists() for marker in _SENTENCE_TRANSFORMERS):
        return None
    try:
        value = json.loads((directory / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(value, str) or not value.strip() or value.startswith(("/", ".", "~")) or "\\" in value:
        return None
    return value.strip() if _NAME.fullmatch(value.strip()) else None


def _cached_repository(directory: Path) -> str | None:
    """``.../models--org--name/snapshots/<commit>`` -> ``org/name``."""
    parts = directory.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return None


def model_name(model: str) -> str:
    """The model's real name: for a local directory, from its files (see the module's docstring); for a
    hub id, the id itself."""
    path = Path(str(model)).expanduser()
    if not path.is_dir():
        return str(model)
    for read in (_card_title, _configured_name, _cached_repository):
        name = read(path)
        if name:
            return name
    return path.resolve().name or str(model)


def looks_like_path(name: str) -> bool:
    """Whether ``name`` was meant as a path: ``./x``, ``../x``, ``/x``, ``~x``, or separators a hub
    id cannot have (a hub id is ``name`` or ``namespace/name``)."""
    if name.startswith((".", "/", "~")) or (os.altsep and os.altsep in name):
        return True
    return os.sep in name and (os.sep != "/" or name.count("/") > 1 or name.endswith("/"))


#: what the default name of a run of texts given in memory (``probe.run(texts=[...])``) ends with
TEXTS_SUFFIX = "-texts"


def texts_folder() -> Path:
    """Where ``probe.run(texts=[...])`` keeps the texts it is given, as JSON lines named by their SHA-256:
    probe's cache (``$PROBE_CACHE_DIR``, else ``~/.cache/probe``), folder ``texts``."""
    from probe.core.environment import cache_dir

    return cache_dir() / "texts"


def is_texts_file(dataset: str | None) -> bool:
    """Whether a run's dataset is texts given in memory (a file of :func:`texts_folder`)."""
    if not dataset:
        return False
    path = Path(dataset).expanduser()
    return path.suffix == ".jsonl" and path.parent.resolve() == texts_folder().resolve()


def run_name(model: str, init: str = "pretrained", name: str | None = None, *, texts: bool = False) -> str:
    """The run's name: ``name`` when given (``--name``); else the model's name (its last part, for
    ``org/name``), with ``-random`` for a random-initialisation control, and :data:`TEXTS_SUFFIX` for a run
    of texts given in memory (``texts``): a few texts tried out are not the run that ``runs/MODEL`` (the
    newest run named MODEL) finds, but ``runs/MODEL-texts``."""
    if name:
        return name
    base = model_name(model).rstrip("/").split("/")[-1]
    return base + ("-random" if init == "random" else "") + (TEXTS_SUFFIX if texts else "")


def slug(name: str) -> str:
    """``name`` as a directory name: runs of characters other than letters, digits and ``._-`` become ``-``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"


#: what ``probe run`` adds to a run's name for its directory: ``-<YYYYmmdd>-<HHMMSS>``, and ``-k`` for the
#: k-th run started in the same second (probe.store.storage.create_run_directory)
_STAMP = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")


def runs_named(path: str | Path) -> list[Path]:
    """The run directories ``probe run`` made for the name ``path.name`` in ``path``'s folder
    (``runs/NAME`` -> ``runs/NAME-<time>``, not ``runs/NAME-random-<time>``), oldest first."""
    path = Path(path)
    folder, prefix = path.parent, slug(path.name)
    if not folder.is_dir():
        return []
    found = []
    for candidate in folder.iterdir():
        stamp = _STAMP.match(candidate.name[len(prefix):]) if candidate.name.startswith(prefix) else None
        if stamp and (candidate / "manifest.json").is_file():
            found.append((stamp.group(1), int(stamp.group(2) or 1), candidate))
    return [candidate for *_, candidate in sorted(found)]


def name_of(run_dir: str | Path) -> str:
    """The name a run directory was made for: ``runs/NAME-<time>`` -> ``NAME`` (any other name as it is)."""
    return _STAMP.sub("", Path(run_dir).name)


def newest_run(path: str | Path) -> tuple[Path, str | None]:
    """``path`` when it exists; else the newest run directory named ``path.name`` in its folder (``runs/NAME``
    for the latest ``runs/NAME-<time>``), with a sentence that says which it took; else ``path`` as given
    (its reader then says that it does not exist)."""
    path = Path(path)
    if path.exists():
        return path, None
    runs = runs_named(path)
    if not runs:
        return path, None
    others = f" (the newest of {len(runs)} runs named {path.name})" if len(runs) > 1 else ""
    return runs[-1], f"{path} is {runs[-1]}{others}"


# --------------------------------------------------------------------------------------------------
# paths as a manifest records them

#: how a manifest writes the folder of installed packages (site-packages) at the start of a path inside it
SITE_PACKAGES = "<site-packages>"


def _package_folders() -> list[Path]:
    """The folders Python installs packages into here (site-packages, system and user)."""
    import site
    import sysconfig

    folders = [sysconfig.get_paths()[key] for key in ("purelib", "platlib")]
    folders += list(getattr(site, "getsitepackages", lambda: [])()) + [site.getusersitepackages()]
    return list(dict.fromkeys(Path(folder).resolve() for folder in folders))


def recorded_path(path: str | Path) -> str:
    """A local path as a manifest records it, without this machine's layout where possible: inside an
    installed package's folder (the demo model, a model shipped as a package) as ``<site-packages>/...``;
    under the home directory as ``~/...``; any other absolute path as it is.  A relative path, a hub id
    included, is kept as given.  :func:`expand_path` reads it back, on this machine or another."""
    text = str(path)
    given = Path(text).expanduser()
    if not given.is_absolute():
        return text
    candidates = (given, given.resolve())
    for folder in _package_folders():
        for candidate in candidates:
            if candidate.is_relative_to(folder):
                return f"{SITE_PACKAGES}/{candidate.relative_to(folder).as_posix()}"
    home = Path.home()
    if home != Path(home.anchor):  # a home directory that is the root would swallow every path
        for root in dict.fromkeys((home, home.resolve())):
            for candidate in candidates:
                if candidate.is_relative_to(root):
                    return f"~/{candidate.relative_to(root).as_posix()}"
    return str(given)


def expand_path(text: str | None) -> str | None:
    """A path recorded by :func:`recorded_path` as a path here: ``<site-packages>/x`` in the package folder
    that holds ``x`` (the first one, if none does), ``~/x`` under the home directory; anything else as it is."""
    if not isinstance(text, str):
        return text
    if text.startswith(SITE_PACKAGES + "/"):
        rest = text[len(SITE_PACKAGES) + 1:]
        folders = _package_folders()
        found = next((folder / rest for folder in folders if (folder / rest).exists()), None)
        return str(found or (folders[0] / rest))
    return str(Path(text).expanduser()) if text.startswith("~") else text
