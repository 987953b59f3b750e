"""Render a report's index.html in headless Chromium, check it, and click through it.

Usage::

    python scripts/check_html.py runs/RUN/report/index.html [--screenshot page.png] [--chromium PATH] [--no-click]

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: file descriptors 3
and 4, NUL-terminated JSON messages), so no driver package is needed.  The page is loaded from
``file://``; every network request it makes is recorded, and any request that is not ``file:`` or
``data:`` fails the check (the page must be self-contained).  Checks:

* the screenshot is larger than ``--min-kb`` and has more than ``--min-ink`` of its pixels not near white;
* the landing summary (headline numbers and findings) starts on the first screen (1400 x 900);
* at 800 px wide the page does not scroll sideways (``document.scrollWidth`` at most 800);
* unless ``--no-click``: a real mouse click on a heatmap cell reveals that head's panel (its title names
  the layer and head, it holds a histogram and the head's worst rows), and a click on a layer filter
  hides the other layers' heatmap rows.

Exit status: 0 pass, 1 fail.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
VIEWPORT = (1400, 900)
#: the narrowest window the page must fit without scrolling sideways
NARROW = 800


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol on a pipe."""

    def __init__(self, chromium: str = CHROMIUM, size: tuple[int, int] = VIEWPORT, timeout: float = 60):
        self.timeout = timeout
        self.events: list[dict] = []
        self._buffer = b""
        self._id = 0
        self._profile = tempfile.TemporaryDirectory(prefix="check-html-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes replies to fd 4.
        high_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)  # above 4, so the dup2s below cannot clash
        high_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)

        def child_fds():
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        command = [
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
            "--disable-dev-shm-usage", "--remote-debugging-pipe", f"--user-data-dir={self._profile.name}",
            f"--window-size={size[0]},{size[1]}", "about:blank",
        ]
        self.process = subprocess.Popen(
            command, preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for fd in (to_chrome_r, from_chrome_w, high_r, high_w):
            os.close(fd)
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable", session=True)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": False}, session=True)

    def send(self, method: str, params: dict | None = None, *, session: bool = False) -> dict:
        """Send one command and wait for its reply (events that arrive meanwhile are kept in ``events``)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no reply to {method} within {self.timeout} s")
                chunk = os.read(self._from_chrome, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the pipe while waiting for {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def open(self, path: Path) -> None:
        """Load a local file and wait until the document is complete."""
        self.send("Page.navigate", {"url": path.resolve().as_uri()}, session=True)
        deadline = time.monotonic() + self.timeout
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not finish loading")
            time.sleep(0.1)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable values only)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """Scroll the first element matching ``selector`` into view and click its centre with the mouse."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise RuntimeError(f"nothing on the page matches {selector}")
        x, y = box
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent",
                      {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}, session=True)

    def resize(self, width: int, height: int) -> None:
        """Lay the page out for a window of ``width`` x ``height`` CSS pixels."""
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)

    def screenshot(self, png: Path, *, full_height: int | None = None) -> Path:
        """Write a PNG of the page (the viewport, or the first ``full_height`` pixels)."""
        params = {"format": "png"}
        if full_height:
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": VIEWPORT[0], "height": full_height, "scale": 1})
        data = self.send("Page.captureScreenshot", params, session=True)["data"]
        png.write_bytes(base64.b64decode(data))
        return png

    def external_requests(self) -> list[str]:
        """URLs the page requested that are neither ``file:`` nor ``data:``."""
        urls = [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]
        return [url for url in urls if not url.startswith(("file:", "data:"))]

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ink_problems(png: Path, *, min_kb: float = 20, min_ink: float = 0.02) -> list[str]:
    """What is wrong with a screenshot: too small a file, or too few pixels that are not near white."""
    from PIL import Image

    found = []
    size_kb = png.stat().st_size / 1024
    if size_kb < min_kb:
        found.append(f"screenshot is {size_kb:.1f} KB, less than {min_kb} KB")
    with Image.open(png) as image:
        histogram = image.convert("L").histogram()
    ink = sum(histogram[:240]) / sum(histogram)
    if ink < min_ink:
        found.append(f"only {ink:.1%} of the pixels are not near white (need {min_ink:.0%})")
    return found


def width_problems(browser: Browser, width: int = NARROW) -> list[str]:
    """Check that the loaded page, laid out ``width`` pixels wide, does not scroll sideways; the window is
    restored to :data:`VIEWPORT` afterwards."""
    browser.resize(width, VIEWPORT[1])
    try:
        scroll = browser.evaluate("document.documentElement.scrollWidth")
    finally:
        browser.resize(*VIEWPORT)
    return [f"at {width} px wide the page scrolls sideways (scrollWidth {scroll} px)"] if scroll > width else []


def page_problems(browser: Browser, *, click: bool = True) -> list[str]:
    """Check the loaded page: landing summary on the first screen; a cell click opens the head panel."""
    found = []
    tops = browser.evaluate(
        "(() => { const f = document.getElementById('findings'), h = document.getElementById('headline');"
        " return f && h ? [h.getBoundingClientRect().top, f.getBoundingClientRect().top] : null; })()"
    )
    if tops is None:
        found.append("the page has no #headline / #findings landing summary")
    elif max(tops) >= VIEWPORT[1]:
        found.append(f"the landing summary starts {max(tops):.0f} px down, below the first screen ({VIEWPORT[1]} px)")
    if not click or not browser.evaluate("document.querySelectorAll('td.cell').length"):
        return found
    cell = browser.evaluate(
        "(() => { const c = document.querySelectorAll('td.cell'); const e = c[c.length - 1];"
        " return [e.dataset.type, e.dataset.layer, e.dataset.head]; })()"
    )
    selector = f'td.cell[data-type="{cell[0]}"][data-layer="{cell[1]}"][data-head="{cell[2]}"]'
    browser.click(selector)
    state = browser.evaluate(
        "(() => { const p = document.getElementById('head-panel'); return {hidden: p.hidden,"
        " shown: p.dataset.shown || null, title: document.getElementById('head-title').textContent,"
        " bars: p.querySelectorAll('svg rect.bar').length, worst: p.querySelectorAll('tr.worst').length}; })()"
    )
    if state["hidden"] or state["shown"] != "/".join(cell):
        found.append(f"clicking {selector} did not reveal its head panel ({state})")
    elif f"layer {cell[1]} · head {cell[2]}" not in state["title"] or not state["bars"] or not state["worst"]:
        found.append(f"the head panel after the click lacks its title, histogram or worst rows ({state})")
    layer = cell[1]
    browser.click(f'button.filter[data-filter="layer"][data-value="{layer}"]')
    visible = browser.evaluate(
        "Array.from(document.querySelectorAll('table.heat tr[data-layer]')).filter(r => !r.hidden)"
        ".map(r => r.dataset.layer)"
    )
    if not visible or any(v != layer for v in visible):
        found.append(f"the layer filter {layer} left rows of layers {sorted(set(visible))} visible")
    browser.click('button.filter[data-filter="layer"][data-value="all"]')
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path, help="the index.html to render")
    parser.add_argument("--screenshot", type=Path, help="where to write the PNG (default: next to the page)")
    parser.add_argument("--chromium", default=CHROMIUM, help=f"Chromium executable (default: {CHROMIUM})")
    parser.add_argument("--min-kb", type=float, default=20, help="smallest acceptable screenshot size in KB")
    parser.add_argument("--min-ink", type=float, default=0.02, help="smallest fraction of non-white pixels")
    parser.add_argument("--no-click", action="store_true", help="only render, do not click through the page")
    args = parser.parse_args(argv)
    if not args.html.is_file():
        print(f"FAIL: {args.html} does not exist", file=sys.stderr)
        return 1
    png = (args.screenshot or args.html.with_name("screenshot.png")).resolve()
    try:
        with Browser(args.chromium) as browser:
            browser.open(args.html)
            browser.screenshot(png, full_height=3000)
            found = page_problems(browser, click=not args.no_click) + width_problems(browser)
            found += [f"the page requested {url}" for url in browser.external_requests()]
    except (OSError, RuntimeError, TimeoutError) as error:
        print(f"FAIL: {error}", file=sys.stderr)
        return 1
    found += ink_problems(png, min_kb=args.min_kb, min_ink=args.min_ink)
    for problem in found:
        print(f"FAIL: {problem}", file=sys.stderr)
    if not found:
        print(f"OK: {png} ({png.stat().st_size / 1024:.0f} KB)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
