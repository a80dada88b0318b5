"""The CPU's flags, for tests that check a vector path is there where the CPU has it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def x86_flags() -> set[str]:
    """cpu_flags() on x86-64, else empty (no x86 vector path to expect)."""
    return cpu_flags() if platform.machine() == "x86_64" else set()
