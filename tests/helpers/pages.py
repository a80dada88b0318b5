"""Whether a file's pages are still dirty, as a test of dcr_log.pages.still_writable sets it."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from dcr_log import native, pages


class DirtyCount:
    """How ``native.changes.dirty_pages`` answers during a test, by ``mode``:

    - ``kernel``: the kernel's own count (cachestat; the test is skipped where the kernel has
      none). Writeback cleans the pages behind the writer's back at ``clean()`` (an
      ``os.sync``), and so may another test's sync at any time, as the tests run side by
      side: a test checks only what must follow from a clean;
    - ``counted``: every page of a range dirty, none between ``clean()`` and ``written()``;
    - ``none``: no count, as on a kernel before Linux 6.5: still_writable falls back to the
      dirty expiry, which ``clean()`` sets to 0 s and ``written()`` back to 30 s.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mode: str, scratch: Path):
        assert native.changes is not None
        self.monkeypatch, self.mode, self.cleaned = monkeypatch, mode, False
        if mode == "kernel":
            probe = scratch / "dirty-probe"
            fd = os.open(probe, os.O_RDWR | os.O_CREAT)
            try:
                os.write(fd, b"x")
                counted = native.changes.dirty_pages(fd, 0, 1)
            finally:
                os.close(fd)
                probe.unlink()
            if counted is None:
                pytest.skip("this kernel does not count a file's dirty pages (cachestat: Linux 6.5)")
        elif mode == "counted":
            def dirty_pages(fd: int, start: int, length: int) -> int:
                first = start // mmap.PAGESIZE
                return 0 if self.cleaned else -(-(start + length) // mmap.PAGESIZE) - first
            monkeypatch.setattr(native.changes, "dirty_pages", dirty_pages)
        else:
            monkeypatch.setattr(native.changes, "dirty_pages", lambda fd, start, length: None)
        self.written()

    def clean(self) -> None:
        self.cleaned = True
        if self.mode == "kernel":
            os.sync()
        elif self.mode == "none":
            self.monkeypatch.setattr(pages, "dirty_expiry", lambda: 0.0)

    def written(self) -> None:
        self.cleaned = False
        if self.mode == "none":
            self.monkeypatch.setattr(pages, "dirty_expiry", lambda: 30.0)
