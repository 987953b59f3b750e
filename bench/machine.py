"""What the benchmarks record about the machine they ran on (the scripts in bench/ import this)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none): the machine is shared."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
