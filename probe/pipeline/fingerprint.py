"""What resume checks before it continues a run: that the model files are still the run's.

A model directory (a local one, or a hub model's cache snapshot) is fingerprinted by every file's
name, size and SHA-256 (sampled for large files); the texts and the batch plan are checked by the
pipeline through their own SHA-256.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_directory(name: str, revision: str | None) -> Path:
    """The directory the model's files were loaded from (a local directory, or its hub cache snapshot)."""
    from transformers.utils.hub import cached_file

    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    return Path(cached_file(name, "config.json", revision=revision)).parent


#: a file's content is hashed whole up to this size, and beyond it in this many evenly spread chunks
SAMPLE_CHUNKS, CHUNK_BYTES = 16, 1 << 16


def sampled_sha256(path: Path) -> str:
    """SHA-256 of the file (or, beyond 1 MiB, of 16 chunks of 64 KiB spread over it): other weights
    of the same shapes change it, and a checkpoint of many GB costs 1 MiB of reading."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= SAMPLE_CHUNKS * CHUNK_BYTES:
            digest.update(handle.read())
        else:
            for k in range(SAMPLE_CHUNKS):
                handle.seek((size - CHUNK_BYTES) * k // (SAMPLE_CHUNKS - 1))
                digest.update(handle.read(CHUNK_BYTES))
    return digest.hexdigest()


def model_fingerprint(directory: Path) -> dict:
    """Every file of the model directory: its size and a SHA-256 of its content (sampled for large
    files, see :func:`sampled_sha256`), so resume can tell that the files are still the run's."""
    directory = Path(directory)
    return {
        "files": {
            str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sampled_sha256(p)}
            for p in sorted(directory.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
        },
        "sampled": f"files over {SAMPLE_CHUNKS * CHUNK_BYTES} bytes: {SAMPLE_CHUNKS} chunks of {CHUNK_BYTES} bytes",
    }


def differences(recorded: dict, now: dict) -> list[str]:
    differences = []
    before, after = recorded.get("files", {}), now.get("files", {})
    for name in sorted(set(before) | set(after)):
        if name not in after:
            differences.append(f"{name} is gone")
        elif name not in before:
            differences.append(f"{name} is new")
        elif before[name]["size"] != after[name]["size"]:
            differences.append(f"{name} changed size ({before[name]['size']:,} -> {after[name]['size']:,} bytes)")
        elif before[name]["sha256"] != after[name]["sha256"]:
            differences.append(f"{name} changed content")
    return differences
