"""Page-table advice for the shared file maps that are written in place: a checkpoint
receiver's safetensors files.

Once the kernel's writeback has cleaned such a map's pages, a read maps them read-only, and
each 4 KiB page written after that takes a write-protect fault of its own (on ext4, a walk
of the whole folio's buffers each time). Dropped from the page table first, the pages are
faulted in for writing a folio at a time (tools/bench_pagecache.py).
"""

from __future__ import annotations

import functools
import mmap
import os
import time
from pathlib import Path

from dcr_log import native

PAGE_BYTES = mmap.PAGESIZE


@functools.cache
def dirty_expiry() -> float:
    """Seconds after which the kernel's writeback takes dirty pages (Linux's
    vm.dirty_expire_centisecs; 30 elsewhere or where it cannot be read). Pages written less
    than this ago are, as a rule, still dirty and still mapped for writing."""
    try:
        return int(Path("/proc/sys/vm/dirty_expire_centisecs").read_text()) / 100
    except (OSError, ValueError):
        return 30.0


def still_writable(path: Path, start: int, length: int, written_at: float) -> bool:
    """Whether the pages of ``path``'s bytes ``start .. start + length`` that this process
    wrote through a shared map at ``written_at`` (time.monotonic) are, as a rule, still
    mapped for writing. Writeback write-protects each page it cleans (at the dirty expiry,
    under dirty-memory pressure, or at a sync by anyone), so where the kernel tells
    (cachestat, Linux 6.5): at least three quarters of the range's pages still dirty.
    Dropping and faulting in again costs about a quarter of what leaving clean pages to
    their write-protect faults does (tools/bench_pagecache.py). Elsewhere: the write is
    younger than the dirty expiry."""
    kernels = native.changes
    if kernels is not None and length > 0:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                dirty = kernels.dirty_pages(fd, start, length)
            except OSError:
                dirty = None
            finally:
                os.close(fd)
            if dirty is not None:
                first = start - start % PAGE_BYTES
                return 4 * dirty >= 3 * -(-(start + length - first) // PAGE_BYTES)
    return time.monotonic() - written_at <= dirty_expiry()

