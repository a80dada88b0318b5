"""Page-table advice for the shared file maps that are written in place: a checkpoint
receiver's safetensors files and a writer's baseline cache.

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
from collections.abc import Hashable, Sequence
from concurrent.futures import wait
from pathlib import Path

import numpy as np

from dcr_log import native
from dcr_log.parallel import side_thread

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
    Dropping clean pages and faulting them in again never cost more than leaving them to
    their write-protect faults, and down to 0.05 of it, by how the file was written
    (tools/bench_pagecache.py --repeats 3), so a range mostly clean is dropped. Elsewhere:
    the write is younger than the dirty expiry."""
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


def _shared_map_bytes(words: np.ndarray) -> np.ndarray | None:
    """``words`` as bytes, where they lie in a shared file map (a numpy memmap opened ``r+``
    or ``w+``, or a view of one; anything else is a ValueError); None where they are empty
    or the C kernels are missing."""
    if words.nbytes == 0:
        return None  # (numpy gives an empty slice of a memmap as a plain array)
    if not (isinstance(words, np.memmap) and words.mode in ("r+", "w+")):
        raise ValueError("only the words of a shared file map can be dropped and faulted in again")
    if native.changes is None:
        return None
    return words.reshape(-1).view(np.uint8)


def drop_page_entries(words: np.ndarray) -> bool:
    """Drop the page-table entries of ``words`` (MADV_DONTNEED), the GIL released. ONLY for
    words in a shared file map (see _shared_map_bytes): there the page cache keeps every
    byte; on private or anonymous memory the drop would discard them. False where the C
    kernels or the kernel's advice are missing (the writes then fault the pages in one at a
    time)."""
    raw = _shared_map_bytes(words)
    return raw is not None and bool(native.changes.drop_pages(raw, 0, raw.nbytes))  # type: ignore[union-attr]


def fault_in_for_writing(words: np.ndarray) -> bool:
    """Fault the pages of ``words`` in for writing (MADV_POPULATE_WRITE), the GIL released;
    after drop_page_entries, a folio at a time. No byte changes. False as drop_page_entries."""
    raw = _shared_map_bytes(words)
    return raw is not None and bool(native.changes.populate_write(raw, 0, raw.nbytes))  # type: ignore[union-attr]


class RemapAhead:
    """Arrays of shared file maps remapped for writing ahead of the tasks that write them:
    every array's page-table entries dropped at once, on the calling thread, then each
    faulted in for writing, in order, on the side thread, while the pool's tasks work on the
    arrays before it; a task calls ``wait(key)`` before it reads or writes an array. The drops
    come first, all on this thread, before the tasks start: a drop while the pool's threads
    run has the kernel interrupt their CPUs to flush their TLBs. The faults stay on one
    thread: taken by the encoding threads themselves, each task its own rows, they cost more
    CPU, not less wall time."""

    def __init__(self, arrays: Sequence[tuple[Hashable, np.ndarray]]):
        for _, words in arrays:
            drop_page_entries(words)
        side = side_thread()  # (one thread: its tasks run in the order they were given)
        self._faults = {key: side.submit(fault_in_for_writing, words) for key, words in arrays}

    def wait(self, key: Hashable) -> None:
        """Until the array ``key`` (if it is one of them) is faulted in; the error faulting it
        in raised, if one did."""
        fault = self._faults.get(key)
        if fault is not None:
            fault.result()

    def close(self) -> None:
        """The faults not begun yet cancelled, and the side thread done with the array it is
        on (a fault for writing changes no byte, but stamps the file's modification time)."""
        for fault in self._faults.values():
            fault.cancel()
        wait(self._faults.values())
