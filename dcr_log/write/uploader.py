"""Segment uploads on background threads: the write path's overlap of encoding and I/O."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from queue import SimpleQueue

from dcr_log.errors import UsageError
from dcr_log.format import Record, SegmentBuilder, SegmentRef
from dcr_log.format.segment import load_pyarrow
from dcr_log.parallel import beside
from dcr_log.store import Store

# Segment uploads in flight at once on a remote store (each holds one segment in memory).
UPLOADS_IN_FLIGHT = 2


class SegmentAborted(Exception):
    """A segment being written batch by batch was abandoned: its file is not created."""


class _Stream:
    """A local segment file being written batch by batch: its key, the builder whose batches
    go through ``batches`` (a list of records each; None once the segment is complete;
    SegmentAborted to give it up), and the future of its write."""

    def __init__(self, key: str, builder: SegmentBuilder):
        self.key = key
        self.builder = builder
        self.batches: SimpleQueue[list[Record] | None | type[SegmentAborted]] = SimpleQueue()
        self.future: Future[SegmentRef] | None = None

    def drain(self) -> Iterator[list[Record]]:
        while True:
            batch = self.batches.get()
            if batch is None:
                return
            if batch is SegmentAborted:
                raise SegmentAborted(f"segment {self.key} abandoned")
            yield batch  # type: ignore[misc]


class SegmentUploader:
    """Writes segments on background threads while the next ones are encoded: up to
    ``UPLOADS_IN_FLIGHT`` at once on a remote store (one on a local directory, where each file is
    written straight from the records), so at most that many plus one segments are held in
    memory. Remote stores get the bytes from a ring of reused buffers (pages already faulted
    in). ``refs`` keeps the order the segments were started in, which is the commit's.

    On a local directory a segment may also be written while it is built: ``feed`` after each
    record hands the builder's closed batches to the writing thread (the file is created under
    a temporary name and linked into place by ``put``, as a whole segment's is), so that only
    its last batch is written after the last record is encoded."""

    def __init__(self, store: Store):
        self._store = store
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight = 1 if store.local_root is not None else UPLOADS_IN_FLIGHT
        self._pending: deque[Future[SegmentRef]] = deque()
        self._buffers: list = [None] * (self._in_flight + 1)
        self._turn = 0
        self._stream: _Stream | None = None  # the segment being fed, if any
        self.refs: list[SegmentRef] = []    # segments created, in order
        self.keys: list[str] = []           # every key tried (what an abort deletes)

    def feed(self, key: str, builder: SegmentBuilder) -> None:
        """On a local directory, start writing the batches ``builder`` has closed into the
        segment ``key`` (which ``put`` completes); elsewhere nothing (``put`` uploads it whole).
        Raises the error of a write already failed."""
        if self._store.local_root is None:
            return
        stream = self._stream
        if stream is not None and stream.future is not None and stream.future.done():
            stream.future.result()  # its error now, not after the rest is encoded
        closed = builder.take_closed() if builder.closed_batches else []
        if not closed:
            return
        if stream is None or stream.key != key:
            if stream is not None:
                raise UsageError(f"segment {stream.key} was fed and not put before {key}")
            stream = self._stream = self._start(_Stream(key, builder))
        for batch in closed:
            stream.batches.put(batch)

    def put(self, key: str, builder: SegmentBuilder) -> None:
        stream = self._stream
        if stream is not None:
            if stream.key != key or stream.builder is not builder:
                raise UsageError(f"segment {stream.key} was fed and not put before {key}")
            for batch in builder.take_closed(everything=True):
                stream.batches.put(batch)
            stream.batches.put(None)
            self._stream = None
            return
        self._slot(key)  # (and with it the buffer of the upload it waited for)
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
        self._submit(job)

    def _start(self, stream: _Stream) -> _Stream:
        self._slot(stream.key)
        builder = stream.builder

        def job():
            size, sha = self._store.create_file(stream.key, lambda f: builder.write_batches(f, stream.drain()))
            return SegmentRef(stream.key, size, sha, builder.records)  # (final: put came first)
        stream.future = self._submit(job)
        return stream

    def _slot(self, key: str) -> None:
        """Wait until fewer than UPLOADS_IN_FLIGHT segments are being written, and record
        ``key`` as tried (what an abort deletes)."""
        while len(self._pending) >= self._in_flight:
            self._wait_one()
        self.keys.append(key)

    def _give_up_stream(self) -> bool:
        """Abandon the segment being fed, if any: its file is not created. Whether there was one."""
        if self._stream is None:
            return False
        self._stream.batches.put(SegmentAborted)
        self._stream = None
        return True

    def _submit(self, job: Callable[[], SegmentRef]) -> Future[SegmentRef]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._in_flight, thread_name_prefix="dcr-upload")
        future = self._pool.submit(job)
        self._pending.append(future)
        return future

    def _wait_one(self) -> None:
        self.refs.append(self._pending.popleft().result())

    def abort(self) -> None:
        """Give up the segment being fed, if any (its file is not created), and let the writing
        threads end once their segments are written, without waiting for them (an interrupt
        goes through at once). ``finish`` gives the fed segment up too, then waits."""
        self._give_up_stream()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def finish(self, raise_errors: bool = True) -> None:
        try:
            error: Exception | None = None
            key = None if self._stream is None else self._stream.key
            if self._give_up_stream():
                error = UsageError(f"segment {key} was fed and never put")
            while self._pending:
                try:
                    self._wait_one()
                except SegmentAborted:
                    pass
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


class SegmentSeries:
    """A version's records cut into segments of about ``segment_bytes`` of payload, each
    written by ``uploads``: fed batch by batch while it is built (``SegmentUploader.feed``:
    its key is drawn with the segment, by ``new_key()``), and put once full or at ``flush``."""

    def __init__(self, uploads: SegmentUploader, log_id: str, version: int, new_key: Callable[[], str],
                 segment_bytes: int):
        self._uploads = uploads
        self._new = lambda: (SegmentBuilder(log_id, version), new_key())
        self._segment_bytes = segment_bytes
        self._builder, self._key = self._new()

    def add(self, rec: Record) -> None:
        builder = self._builder
        builder.add(rec)
        if builder.payload_bytes >= self._segment_bytes:
            self.flush()
        else:
            self._uploads.feed(self._key, builder)  # its closed batches written while encoding goes on

    def flush(self) -> None:
        """Put the segment being built, if it holds a record, and start the next."""
        if self._builder.records:
            self._uploads.put(self._key, self._builder)
            self._builder, self._key = self._new()
