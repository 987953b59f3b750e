"""Texts given in Python (``probe.run(texts=[...])``, the Trainer callback's probe set), kept as a file so that a
run records where its texts are and :func:`probe.pipeline.runner.resume` can read them again.

The texts are written once, as JSON lines named by their SHA-256, into probe's cache
(:func:`probe.core.naming.texts_folder`: ``$PROBE_CACHE_DIR/texts``, else ``~/.cache/probe/texts``).  A
:class:`GivenTexts` knows its path and content before anything is written: :meth:`GivenTexts.keep` writes it
once the run's options have passed their checks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from probe.core import arguments


@dataclass(frozen=True)
class GivenTexts:
    """Texts given in memory, as the JSON-lines file a run reads them from."""

    path: Path
    content: bytes
    texts: tuple[str, ...]

    @classmethod
    def of(cls, texts) -> "GivenTexts":
        """``texts`` as :func:`probe.core.arguments.texts` reads them (a list of strings, or one string: one
        text; a string naming an existing file is refused), and the file that will hold them."""
        from probe.core.naming import texts_folder

        items = arguments.texts(texts, path_exists=os.path.isfile)
        content = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in items).encode()
        return cls(texts_folder() / f"{hashlib.sha256(content).hexdigest()[:20]}.jsonl", content, tuple(items))

    def keep(self) -> Path:
        """Write the file (atomically, once: a file of the same name holds the same texts) and return its path."""
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_bytes(self.content)
            os.replace(tmp, self.path)
        return self.path
