"""A version's segments between pass one and the writes: fetched once (ahead, on threads),
kept in memory within a budget or spooled to local disk, with the records pass one decoded,
located and (when the writes follow at once) classified kept for the write pass
(SegmentCache)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from dcr_log.errors import IntegrityError
from dcr_log.format import CommitRecord, Record
from dcr_log.log.deltalog import DeltaLog, Step, nothing_to_check
from dcr_log.log.segments import SegmentFile

# Segment bytes kept between pass 1 and the writes (and for rollback), beyond which they
# are read again from the log.
SEGMENT_CACHE_BYTES = 1 << 30


# Segments fetched ahead of the one being checked or applied (threads of one SegmentCache).
PREFETCH_SEGMENTS = 4


class SegmentCache:
    """A version's segments, each fetched once (size and sha256 checked by
    DeltaLog.read_segment): up to ``PREFETCH_SEGMENTS`` ahead of the one being read, on
    threads, so that fetching overlaps checking, decoding and applying. Segments are kept in
    memory within a byte budget and, beyond it, in a local spool directory (``spool``) rather
    than fetched again; a spooled segment's sha256 is checked again when it is read back, and
    it is read through a memory map (log.SegmentFile), as is a segment too large for the
    reader to hold in memory at all (which read_segment gives as a local file)."""

    def __init__(self, log: DeltaLog, commit: CommitRecord | Step, budget: int | None = None,
                 spool: Path | Callable[[], Path] | None = None):
        self.log = log
        self.commit = commit
        self.budget = SEGMENT_CACHE_BYTES if budget is None else budget
        # The spool's path, asked for when a segment is first spooled (then ``spool``).
        self._spool_at: Callable[[], Path] | None = (lambda: spool) if isinstance(spool, Path) else spool
        self.spool: Path | None = None
        self._data: dict[int, memoryview] = {}
        self._spooled: dict[int, Path] = {}
        self._files: dict[int, SegmentFile] = {}
        self._used = 0
        self._parsed: dict[int, list[Record]] = {}
        self._decoded: dict[tuple[int, int], Any] = {}
        self._decoded_used = 0
        self._places: dict[tuple[int, int], Any] = {}
        self._gathered: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, Any]] = {}
        self._pending: dict[int, Future[memoryview | SegmentFile]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _fetch(self, index: int) -> memoryview | SegmentFile:
        return self.log.read_segment(self.commit.segments[index], self.commit.version)

    def _ahead(self, index: int) -> None:
        """Start fetching the segments after ``index`` (a bounded window)."""
        refs = self.commit.segments
        if len(refs) <= 1:
            return
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(PREFETCH_SEGMENTS, thread_name_prefix="dcr-fetch")
        for j in range(index + 1, min(len(refs), index + 1 + PREFETCH_SEGMENTS)):
            if self._unfetched(j):
                self._pending[j] = pool.submit(self._fetch, j)

    def _unfetched(self, index: int) -> bool:
        """Whether the segment is neither held, spooled, mapped nor being fetched ahead (so
        that ``data(index)`` would fetch it on this thread)."""
        return not (index in self._data or index in self._files or index in self._spooled
                    or index in self._pending)

    def data(self, index: int) -> memoryview | SegmentFile:
        """The segment's bytes in memory, or a local file holding them (SegmentFile)."""
        held: memoryview | SegmentFile | None = self._data.get(index)
        if held is None:
            held = self._files.get(index)
        if held is not None:
            return held
        path = self._spooled.get(index)
        if path is not None:
            ref = self.commit.segments[index]
            spooled: SegmentFile | None
            try:
                spooled = SegmentFile.open(path)
            except OSError:
                spooled = None
            if spooled is None or spooled.size != ref.size or spooled.sha256 != ref.sha256:
                if spooled is not None:
                    spooled.close()
                raise IntegrityError(f"spooled segment {ref.key} at {path} changed on local disk")
            return spooled
        future = self._pending.pop(index, None)
        self._ahead(index)
        data = future.result() if future is not None else self._fetch(index)
        self._hold(index, data)
        return data

    def _hold(self, index: int, data: memoryview | SegmentFile) -> None:
        """Keep a segment just fetched: in memory within the budget, else spooled."""
        if isinstance(data, SegmentFile):  # already a local file, not in memory
            self._files[index] = data
        elif self._used + len(data) <= self.budget:
            self._data[index] = data
            self._used += len(data)
        elif self._spool_at is not None:
            try:
                self.spool = self.spool or self._spool_at()
                self.spool.mkdir(parents=True, exist_ok=True)
                path = self.spool / f"{index:08d}.arrow"
                path.write_bytes(data)
                self._spooled[index] = path
            except OSError:
                pass  # no room to spool: it is fetched again when needed

    def close(self) -> None:
        """Stop fetching ahead and remove the spool."""
        for future in self._pending.values():
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._pending.clear()
        self._parsed.clear()
        for path in self._spooled.values():
            path.unlink(missing_ok=True)
        self._spooled.clear()
        for f in self._files.values():
            f.close()  # a mapping still held keeps its own descriptor
        self._files.clear()
        if self.spool is not None and self.spool.is_dir():
            try:
                self.spool.rmdir()
            except OSError:
                pass

    def records(self, index: int) -> list[Record]:
        """The segment's records, checked (records_ahead, then its check)."""
        records, check = self.records_ahead(index)
        check()
        return records

    def records_ahead(self, index: int) -> tuple[list[Record], Callable[[], None]]:
        """The segment's records, parsed once while its bytes are held in memory (pass 1 and
        the write pass both read them; parsed again from a spooled or mapped segment), and
        ``check``: a segment fetched on this thread is parsed while its hash is computed,
        and may be returned before the hash is known (DeltaLog.read_segment_records), so
        that its records can be decoded meanwhile. ``check`` raises what the hash or the
        parse found, and keeps the segment once it passes; until then nothing taken from
        the records may be written, and ``records`` would fetch the segment again."""
        parsed = self._parsed.get(index)
        if parsed is not None:
            return parsed, nothing_to_check
        ref = self.commit.segments[index]
        if not self._unfetched(index):
            records = list(self.log.segment_records(self.commit.version, ref, self.data(index)))
            if index in self._data:
                self._parsed[index] = records
            return records, nothing_to_check
        self._ahead(index)
        data, records, verify = self.log.read_segment_records(ref, self.commit.version)
        passed: list[bool] = []

        def check() -> None:
            if passed:
                return
            verify()
            self._hold(index, data)
            if index in self._data:
                self._parsed[index] = records
            passed.append(True)
        return records, check

    def keep_changes(self, segment: int, record: int, changes) -> bool:
        """Keep a record decoded in pass 1 for the write pass, within the byte budget."""
        nbytes = changes.values.nbytes + (0 if changes.positions is None else changes.positions.nbytes)
        if self._decoded_used + nbytes <= self.budget:
            self._decoded[(segment, record)] = changes
            self._decoded_used += nbytes
            return True
        return False

    def keep_gathered(self, segment: int, record: int, current: np.ndarray, target: np.ndarray,
                      where) -> bool:
        """Keep the words pass 1 gathered at a record's positions, the target it computed from
        them and the positions (flat in the tensor), within the byte budget, for a write pass
        that runs right after it (see take_gathered). Not words on an accelerator: its memory
        is the engine's."""
        device = getattr(current, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            return False
        nbytes = current.nbytes + target.nbytes + getattr(where, "nbytes", 0)
        if self._decoded_used + nbytes <= self.budget:
            self._gathered[(segment, record)] = (current, target, where)
            self._decoded_used += nbytes
            return True
        return False

    def drop_gathered(self, segment: int, record: int) -> None:
        """Pass 1 did not find the record at its base: the write pass classifies it again."""
        self.take_gathered(segment, record)

    def take_gathered(self, segment: int, record: int) -> tuple[np.ndarray, np.ndarray, Any] | None:
        """(current words, target, flat positions) of a record pass 1 found at its base and
        whose target digest it checked, or None."""
        kept = self._gathered.pop((segment, record), None)
        if kept is not None:
            self._decoded_used -= kept[0].nbytes + kept[1].nbytes + getattr(kept[2], "nbytes", 0)
        return kept

    def staged_bytes(self) -> int:
        """Decoded records and mapped positions kept for the write pass."""
        placed = sum(w.nbytes * 2 for p in self._places.values()
                     if isinstance(w := getattr(p, "where", None), np.ndarray))
        return self._decoded_used + placed

    def keep_place(self, segment: int, record: int, place) -> None:
        """A record's located positions (engine parameters: mapped once, at staging)."""
        self._places[(segment, record)] = place

    def forget_places(self) -> None:
        self._places.clear()

    def take_place(self, segment: int, record: int):
        return self._places.pop((segment, record), None)

    def take_changes(self, segment: int, record: int):
        changes = self._decoded.pop((segment, record), None)
        if changes is not None:
            self._decoded_used -= changes.values.nbytes + (
                0 if changes.positions is None else changes.positions.nbytes)
        return changes
