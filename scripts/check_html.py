"""Render a report's index.html with headless Chromium and check that the screenshot is not blank.

Usage::

    python scripts/check_html.py runs/RUN/report/index.html [--screenshot page.png] [--chromium PATH]

The page is loaded from ``file://`` with networking features off, so a page that needed an external
resource would render without it.  The check passes when the screenshot exists, is larger than
``--min-kb`` and has more than ``--min-ink`` of its pixels not near white.  Exit status: 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

CHROMIUM = "/usr/bin/chromium"


def screenshot(html: Path, png: Path, *, chromium: str = CHROMIUM, size=(1400, 3000), timeout: float = 120) -> Path:
    """Render ``html`` to ``png`` with headless Chromium (fresh profile, no network services)."""
    png = png.resolve()
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="check-html-") as profile:
        command = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
            html.resolve().as_uri(),
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if not png.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot (exit {result.returncode}): {result.stderr[-2000:]}")
    return png


def problems(png: Path, *, min_kb: float = 20, min_ink: float = 0.02) -> list[str]:
    """What is wrong with a screenshot: too small a file, or too few pixels that are not near white."""
    found = []
    size_kb = png.stat().st_size / 1024
    if size_kb < min_kb:
        found.append(f"screenshot is {size_kb:.1f} KB, less than {min_kb} KB")
    with Image.open(png) as image:
        gray = image.convert("L")
        histogram = gray.histogram()
    ink = sum(histogram[:240]) / sum(histogram)
    if ink < min_ink:
        found.append(f"only {ink:.1%} of the pixels are not near white (need {min_ink:.0%})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="the index.html to render")
    parser.add_argument("--screenshot", type=Path, help="where to write the PNG (default: next to the page)")
    parser.add_argument("--chromium", default=CHROMIUM, help=f"Chromium executable (default: {CHROMIUM})")
    parser.add_argument("--min-kb", type=float, default=20, help="smallest acceptable screenshot size in KB")
    parser.add_argument("--min-ink", type=float, default=0.02, help="smallest fraction of non-white pixels")
    args = parser.parse_args(argv)
    if not args.html.is_file():
        print(f"FAIL: {args.html} does not exist", file=sys.stderr)
        return 1
    png = args.screenshot or args.html.with_name("screenshot.png")
    try:
        screenshot(args.html, png, chromium=args.chromium)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"FAIL: {error}", file=sys.stderr)
        return 1
    found = problems(png, min_kb=args.min_kb, min_ink=args.min_ink)
    for problem in found:
        print(f"FAIL: {problem}", file=sys.stderr)
    if not found:
        print(f"OK: {png} ({png.stat().st_size / 1024:.0f} KB)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
