"""MkDocs hook: the committed figures under ``reports/`` that the docs show, served from the same
files (``reports/ot/*.png`` appear in the site as ``reports/ot/*.png``), so no copy lives in docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

#: folders of ``reports/`` whose figures the pages embed
FOLDERS = ("all-MiniLM-L6-v2", "all-MiniLM-L6-v2-vs-random", "ot", "vit", "interventions")


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    for folder in FOLDERS:
        for path in sorted((root / "reports" / folder).glob("*.png")):
            name = path.relative_to(root).as_posix()
            files.append(File.generated(config, name, abs_src_path=str(path)))
    return files
