"""Names that may be local paths or Hugging Face Hub ids, and whether the Hub can be reached.

A model or dataset name is first looked up on disk.  A name that does not exist there is a hub id if it
is one syntactically; a name that looks like a path (``./x``, ``/x``, ``~/x``, ``a/b/c``) is reported
as a missing path instead of the Hub's "Repo id must be in the form ...".

Whether the Hub is reachable is decided once per process: ``HF_HUB_OFFLINE`` set, or one short HTTP
request to the Hub endpoint that fails or takes longer than :data:`PROBE_TIMEOUT_S`, means closed.  A
closed Hub switches ``huggingface_hub`` and ``datasets`` to offline mode, so that cached models and
datasets still load and everything else fails at once instead of after ~28 s of retries.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from probe.core.errors import ProbeError
from probe.core.naming import looks_like_path

#: Seconds the connection probe may take before the Hub counts as unreachable.
PROBE_TIMEOUT_S = 2.0

_closed_because: str | None = None  # decided once per process: "" when reachable, else why not



def is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_hub_name(name: str, what: str, option: str, example: str) -> None:
    """``name`` does not exist on disk: raise unless it can be a hub id (``what`` = "model", ...)."""
    if looks_like_path(name):
        raise ProbeError(f"The {what} path '{name}' does not exist ({option}). Check the path.")
    if not is_hub_id(name):
        raise ProbeError(
            f"'{name}' ({option}) is neither an existing local path nor a Hugging Face Hub id "
            f"(hub ids look like '{example}' or 'namespace/name'). Check the spelling."
        )


def _probe(endpoint: str) -> bool:
    """One HEAD request to the Hub endpoint, bounded by PROBE_TIMEOUT_S even where DNS hangs."""
    from huggingface_hub import get_session

    answered = []

    def request():
        try:
            get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
            answered.append(True)
        except Exception:  # any failure to get an HTTP answer means: not reachable
            pass

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    return bool(answered)


def _go_offline() -> None:
    """Make huggingface_hub, transformers and datasets use their caches only.  They read the flag when
    imported: set the environment for later imports and the module constants for earlier ones."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True


def hub_reachable() -> bool:
    """Whether the Hub can be reached (decided once); when not, switch the libraries to offline mode."""
    global _closed_because
    if _closed_because is None:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            _closed_because = "HF_HUB_OFFLINE is set"
        elif not _probe(constants.ENDPOINT):
            _closed_because = f"no answer from {constants.ENDPOINT} within {PROBE_TIMEOUT_S:.0f} s"
        else:
            _closed_because = ""
        if _closed_because:
            _go_offline()
    return not _closed_because


def cached_snapshot(repo_id: str, revision: str | None = None, marker: str = "config.json") -> Path | None:
    """The local snapshot directory of a hub repository whose ``marker`` file is in the Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, marker, revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def no_connection(name: str, what: str, local: str) -> ProbeError:
    """The error for a hub id that is not in the cache while the Hub is closed (``local``: "directory", ...)."""
    return ProbeError(
        f"No connection to the Hugging Face Hub ({_closed_because or 'unreachable'}); pass a local {local}. "
        f"'{name}' is not a local path, and this {what} is not in the Hugging Face cache: download it where "
        "there is a connection and pass its local copy."
    )
