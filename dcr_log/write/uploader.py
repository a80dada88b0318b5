"""Segment uploads on background threads: the write path's overlap of encoding and I/O."""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from dcr_log.format import SegmentBuilder, SegmentRef
from dcr_log.format.segment import load_pyarrow
from dcr_log.parallel import beside
from dcr_log.store import Store

# Segment uploads in flight at once on a remote store (each holds one segment in memory).
UPLOADS_IN_FLIGHT = 2


class SegmentUploader:
    """Writes segments on background threads while the next ones are encoded: up to
    ``UPLOADS_IN_FLIGHT`` at once on a remote store (one on a local directory, where each file is
    written straight from the records), so at most that many plus one segments are held in
    memory. Remote stores get the bytes from a ring of reused buffers (pages already faulted
    in). ``refs`` keeps the order the segments were started in, which is the commit's."""

    def __init__(self, store: Store):
        self._store = store
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 1 if store.local_root is not None else UPLOADS_IN_FLIGHT
        self._pending: deque[Future[SegmentRef]] = deque()
        self._buffers: list = [None] * (self._in_flight + 1)
        self._turn = 0
        self.refs: list[SegmentRef] = []    # segments created, in order
        self.keys: list[str] = []           # every key tried (what an abort deletes)

    def put(self, key: str, builder: SegmentBuilder) -> None:
        while len(self._pending) >= self._in_flight:
            self._wait_one()  # its buffer is free again
        self.keys.append(key)
        records = builder.records
        if self._store.local_root is not None:
            def job():
                size, sha = self._store.create_file(key, builder.write_to)
                return SegmentRef(key, size, sha, records)
        else:
            data = builder.finish(self._buffers[self._turn])
            if data.parent is not None and data.parent.is_mutable:
                self._buffers[self._turn] = data.parent
            self._turn = (self._turn + 1) % len(self._buffers)

            def job():
                sha = beside(lambda: hashlib.sha256(data).hexdigest(), lambda: self._store.put_new(key, data))
                return SegmentRef(key, data.size, sha, records)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="dcr-upload")
        self._pending.append(self._pool.submit(job))

    def _wait_one(self) -> None:
        self.refs.append(self._pending.popleft().result())

    def finish(self, raise_errors: bool = True) -> None:
        try:
            error = None
            while self._pending:
                try:
                    self._wait_one()
                except Exception as exc:  # let every upload end; the first error is raised
                    error = error or exc
            if error is not None:
                raise error
        except Exception:
            if raise_errors:
                raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
            # Arrow's pool keeps the segments' buffers for reuse; a trainer needs them back.
            load_pyarrow().default_memory_pool().release_unused()
