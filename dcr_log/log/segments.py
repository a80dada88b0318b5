"""Segments held for reading: in memory when small, else in a local file read through a
memory map whose pages are given back behind the reader, hashed (sha256) in chunks as they
are read so a segment is checked against its commit record before a record is used."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections import deque
from collections.abc import Callable

from dcr_log.format.segment import load_pyarrow

# A reader holds a segment of at most this many bytes in memory (writers keep them near 64
# MiB); a larger one is read from a local file through a memory map (SegmentFile): its sha256
# is computed while it is read in chunks, and its records are read batch by batch.
SEGMENT_MEMORY_BYTES = 256 << 20


# Of a mapped segment, the pages of the payloads decoded last, up to about this many bytes,
# stay mapped; older ones are given back (they count in resident memory while mapped).
MAPPED_WINDOW_BYTES = 64 << 20


_PAGE = mmap.PAGESIZE


class SegmentFile:
    """A segment checked against its commit record (size, sha256) that is held in a local
    file, not in memory: the log's own file on a local directory, else an unnamed temporary
    file it was streamed into. ``records`` read it through a read-only memory map."""

    def __init__(self, file, size: int, sha256: str):
        self._file = file
        self.size = size
        self.sha256 = sha256

    @staticmethod
    def open(path: os.PathLike) -> SegmentFile:
        """A local file (a receiver's spool), hashed in chunks: the caller checks the result."""
        f = open(path, "rb")
        try:
            sha = hashlib.sha256()
            chunk = bytearray(8 << 20)
            size = 0
            while n := f.readinto(chunk):
                sha.update(memoryview(chunk)[:n])
                size += n
        except BaseException:
            f.close()
            raise
        return SegmentFile(f, size, sha.hexdigest())

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        """The whole segment in memory (what a mirror copies)."""
        return os.pread(self._file.fileno(), self.size, 0)

    def map(self) -> _Mapping:
        return _Mapping(mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ))

    def close(self) -> None:
        self._file.close()


class _Mapping:
    """A read-only memory map of a segment file whose pages are given back (MADV_DONTNEED:
    read again from the file if touched again) as reading moves on: a payload's once
    MAPPED_WINDOW_BYTES of later payloads have been decoded, all of them when the segment's
    records have been read."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.address = load_pyarrow().py_buffer(mm).address
        self._recent: deque[tuple[int, int]] = deque()
        self._held = 0
        self._lock = threading.Lock()

    def hook(self, payload) -> Callable[[], None] | None:
        """What a record calls once its payload is decoded (Record.done)."""
        length = len(payload)
        if not length:
            return None
        start = load_pyarrow().py_buffer(payload).address - self.address
        return lambda: self._done(start, length)

    def _done(self, start: int, length: int) -> None:
        with self._lock:
            self._recent.append((start, length))
            self._held += length
            while self._held > MAPPED_WINDOW_BYTES and len(self._recent) > 1:
                s, n = self._recent.popleft()
                self._held -= n
                self._drop(s, n)

    def _drop(self, start: int, length: int) -> None:
        first = start - start % _PAGE
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, first, min(start + length, len(self.mm)) - first)
        except (ValueError, OSError):  # closed meanwhile: nothing left to give back
            pass

    def drop_all(self) -> None:
        with self._lock:
            self._recent.clear()
            self._held = 0
            self._drop(0, len(self.mm))
