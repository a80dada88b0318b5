"""The write pass's one applier core: ``BatchWriter`` writes a version's records, segment by
segment, in batches (spec/RECEIVER.md section 5, step 5).

A batch is one journal transaction with its redo images and extent, the writes (overwrites of
target values, so that a torn batch is finished by writing them again and an xor is never
applied twice), a flush, and one transaction marking it applied. Every write goes through the
Storage interface; memory storage keeps an ``Undo`` instead of a journal, so that a failed
version is rolled back."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcr_log.codec import ChangeSet
from dcr_log.coords import DTYPE_WIDTH, word_dtype
from dcr_log.errors import IntegrityError, LineageError
from dcr_log.format import Record
from dcr_log.format.tensors import TensorInfo
from dcr_log.log.records import decode_record, flat_positions, record_bases
from dcr_log.parallel import TASK_CHANGES, map_grouped, start_grouped
from dcr_log.receiver.checks import sampled
from dcr_log.receiver.context import APPLY_WORKERS, ApplyContext, GroupDigests, pool_pays
from dcr_log.receiver.journal import Journal, SegmentProgress
from dcr_log.receiver.journal_entries import encode_wal_image, wal_image_bound
from dcr_log.receiver.segments import SegmentCache
from dcr_log.receiver.storage import FaultHook, Storage, Where
from dcr_log.receiver.storage.placed import PlacedStorage

# A batch holds records up to about this many decoded bytes (positions, values, targets).
BATCH_BYTES = 256 << 20


# Deferred sync (RECEIVER.md, "Deferred sync"): the journal keeps the images of written
# records up to a quarter of the storage's bytes, within these bounds, before the storage is
# synced and they are dropped. A batch whose images alone exceed it is synced as it is written.
WAL_MIN_BYTES = 64 << 20
WAL_MAX_BYTES = 4 << 30


def wal_budget(storage_bytes: int) -> int:
    return min(WAL_MAX_BYTES, max(WAL_MIN_BYTES, storage_bytes // 4))


def wal_image_bytes(changes: int, width: int) -> int:
    """About the most bytes the images of ``changes`` written words of ``width`` bytes take
    (a 4-byte position and the word per change; gaps take fewer: RECEIVER.md 5.6)."""
    return changes * (4 + width)


def wal_image_spread_bytes(changes: int, elements: int, width: int) -> int:
    """About the bytes the images of ``changes`` written words take where they are spread
    evenly over ``elements``: gaps of the fewest bytes that hold 16 times the mean gap (the
    longest gap among the tens of thousands of changes of a record at random positions is
    about ten times their mean), 4-byte positions past 2^16. A version whose changes cluster
    takes fewer; one with a few long gaps in each record may take more, and its batches
    then sync where the images outgrow the budget."""
    mean_gap = (elements - changes) / max(changes, 1)
    position = 1 if 16 * mean_gap < 1 << 8 else 2 if 16 * mean_gap < 1 << 16 else 4
    return changes * (position + width)


def wal_image_min_bytes(changes: int, width: int) -> int:
    """The fewest bytes those images can take (a 1-byte gap and the word per change)."""
    return changes * (1 + width)


# The bytes a batch's deferred-sync images are laid into before the stage transaction copies
# them into the journal: one buffer, lent to a batch and taken back after its stage, kept for
# the process's next version (of any receiver) up to IMAGE_BUFFER_KEEP bytes. Fresh for each
# image, they came from the C heap, which gave them back when they were freed and faulted them
# in again at the next version: the faults, and the address-space lock they take, held back
# the pool's prefault beside the stage (tools/bench_apply.py --gib 0.5 --reps 9 --verify
# sample --receivers ckpt, a new receiver per version: 0.125-0.128 s at 3% changed against
# 0.133-0.142 s; unchanged at 1%).
IMAGE_BUFFER_KEEP = 256 << 20
_image_buffer_lock = threading.Lock()
_image_buffer: np.ndarray | None = None


def borrow_image_buffer(nbytes: int) -> np.ndarray:
    """At least ``nbytes`` bytes to lay images into, the kept buffer where it is large enough;
    give it back with return_image_buffer."""
    global _image_buffer
    with _image_buffer_lock:
        kept, _image_buffer = _image_buffer, None
    if kept is not None and kept.size >= nbytes:
        return kept
    del kept  # (dropped before the larger one is allocated: never both held)
    return np.empty(nbytes, np.uint8)


def return_image_buffer(buffer: np.ndarray) -> None:
    global _image_buffer
    if buffer.size > IMAGE_BUFFER_KEEP:
        return
    with _image_buffer_lock:
        if _image_buffer is None or _image_buffer.size < buffer.size:
            _image_buffer = buffer


def _forget_image_buffer() -> None:
    """In a forked child: a fresh lock (the parent's may have been held by another thread at
    the fork) and no buffer."""
    global _image_buffer, _image_buffer_lock
    _image_buffer_lock = threading.Lock()
    _image_buffer = None


os.register_at_fork(after_in_child=_forget_image_buffer)


@dataclass(slots=True)
class Deferred:
    """A receiver under deferred sync: its image budget, the bytes its journal holds in
    images, and this boot's id (stored with them)."""

    budget: int
    used: int
    boot: bytes


def redo_journal_bytes(redo_bytes: int) -> int:
    """About how many journal bytes the redo images of a version's largest batch take, given
    the bytes of all its xor records' targets (checked against free space before any write)."""
    return 2 * min(redo_bytes, BATCH_BYTES)


@dataclass(frozen=True, slots=True)
class Batch:
    """Records ``[start, end)`` of a segment, written as one batch."""

    segment: int
    records: Sequence[Record]
    start: int
    end: int
    # Records an interrupted apply may have left half written, and the redo images that
    # finish their xors (durable storage).
    torn: range
    redo: Mapping[int, bytes]


@dataclass(slots=True)
class Write:
    """One record's write: its target words at its place."""

    index: int
    record: Record
    place: Any
    where: Where             # flat indices or a slice: what the record digests are keyed by
    target: np.ndarray
    base: np.ndarray | None  # gathered words before the write (memory rollback)
    redo: bool               # an xor whose target goes to the journal as a redo image
    repaired: bool


@dataclass(frozen=True, slots=True)
class UndoRecord:
    """A written record to undo: ``base`` words to put back, or None for an xor (undone by
    xor-ing again)."""

    segment: int
    record: int
    base: np.ndarray | None


@dataclass(slots=True)
class Undo:
    """Memory storage only: how to take the storage back to the journal's version."""

    layout: Any = None
    records: list[UndoRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Held:
    """A record of the batch that the storage holds, with what pass one kept of it (its
    decoded changes, located place, and gathered words and target, or None: decoded, located
    and classified again)."""

    index: int
    record: Record
    info: TensorInfo
    changes: ChangeSet | None
    place: Any
    gathered: tuple[np.ndarray, np.ndarray, Any] | None  # (current words, target, positions) from pass 1


@dataclass(slots=True)
class _Gathered:
    """A record with a precondition, gathered: its digests decide whether it is skipped,
    written or repaired."""

    index: int
    record: Record
    info: TensorInfo
    place: Any
    where: Where
    current: np.ndarray
    values: np.ndarray
    target: np.ndarray
    parts: tuple[int, int]   # digest parts of the current words and of the target


def record_info(table: Mapping[str, TensorInfo], rec: Record, version: int) -> TensorInfo:
    info = table.get(rec.tensor)
    if info is None:
        raise IntegrityError(f"version {version}: record for unknown tensor {rec.tensor!r}")
    return info


class BatchWriter:
    """Writes one version's records into a storage, batch by batch, with its journal."""

    def __init__(self, storage: Storage, journal: Journal, digests: GroupDigests,
                 fault: FaultHook | None = None, deferred: Deferred | None = None):
        self.storage = storage
        self.journal = journal
        self.digests = digests
        self.fault = fault
        self.deferred = deferred

    def _hook(self, point: str, **info: Any) -> None:
        if self.fault is not None:
            self.fault(point, **info)

    def apply_segment(self, ctx: ApplyContext, seg: int, prog: SegmentProgress) -> None:
        ref = ctx.commit.segments[seg]
        if prog.done >= ref.records:
            return
        records = ctx.cache.records(seg)
        torn = range(prog.done, prog.started_end)
        redo = self.journal.redo_images(seg) if len(torn) else {}
        start = prog.done
        while start < len(records):
            end, budget = start, 0
            while end < len(records) and (end == start or budget < BATCH_BYTES):
                rec = records[end]
                width = DTYPE_WIDTH[record_info(ctx.table, rec, ctx.version).dtype]
                budget += rec.n_changed * (8 + 3 * width)
                end += 1
            self.apply_batch(ctx, Batch(seg, records, start, end, torn, redo))
            start = end

    def apply_batch(self, ctx: ApplyContext, batch: Batch) -> None:
        storage, report, version, seg = self.storage, ctx.report, ctx.version, batch.segment
        undo, torn = ctx.undo, batch.torn
        work: list[Write] = []
        gathered: list[_Gathered] = []
        items: list[_Held] = []
        for i in range(batch.start, batch.end):
            rec = batch.records[i]
            info = record_info(ctx.table, rec, version)
            report.records += 1
            if not storage.holds(rec.tensor):
                report.unheld += 1
                continue
            items.append(_Held(i, rec, info, ctx.cache.take_changes(seg, i), ctx.cache.take_place(seg, i),
                               None if i in torn else ctx.cache.take_gathered(seg, i)))
            report.changed_elements += rec.n_changed
            ctx.touched.add(rec.tensor)

        def prepare(item: _Held) -> Write | _Gathered:
            """Gather, targets and digest parts of one record: reads only, so records run
            on the shared pool's threads (numpy, the digests and pcodec release the GIL)."""
            i, rec, info = item.index, item.record, item.info
            if item.gathered is not None:
                # Pass 1 of this call found it at base and checked its target; nothing was
                # written since (RECEIVER.md 5.4, step 1).
                cur, target, where = item.gathered
                place = item.place or storage.locate(rec.tensor, where)
                return Write(i, rec, place, where, target, cur, rec.kind == "xor", False)
            changes = item.changes or decode_record(rec, info, flat=True)
            where = flat_positions(rec, info.shape, changes)
            place = item.place or storage.locate(rec.tensor, where)
            values = storage.select(place, changes.values)
            if rec.kind == "tensor":
                # Whole values and no precondition: writing them again is harmless.
                base = None
                if undo is not None and rec.tensor not in ctx.created:
                    base = storage.gather(place)
                return Write(i, rec, place, where, values, base, False, i in torn)
            cur, target, current_part, target_part = self.digests.classify(place, where, rec.kind, changes, values)
            return _Gathered(i, rec, info, place, where, cur, values, target, (current_part, target_part))

        parallel = pool_pays(sum(it.record.n_changed for it in items), len(items))
        # Records pass 1 kept ready take no work here: they skip the pool (a task each would
        # only hand them to a thread and back).
        ready = [prepare(it) for it in items if it.gathered is not None]
        rest = [it for it in items if it.gathered is None]
        prepared_rest = map_grouped(prepare, rest, [it.record.n_changed for it in rest], TASK_CHANGES,
                                    APPLY_WORKERS, parallel)
        for prepared in itertools.chain(ready, prepared_rest):
            if isinstance(prepared, Write):
                work.append(prepared)
            else:
                gathered.append(prepared)
        sums = self.digests.sums([d for g in gathered for d in g.parts])
        for n, g in enumerate(gathered):
            rec, target = g.record, g.target
            d, d_target = sums[2 * n], sums[2 * n + 1]
            if d == rec.target_digest:
                report.skipped += 1
                continue
            repaired = False
            if d == rec.base_digest:
                if ctx.verify != "none" and d_target != rec.target_digest:
                    raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not lead to "
                                         "its target digest")
            elif g.index in torn:  # durable storage: a group of one, so digests are local
                repaired = True
                if rec.kind == "xor":
                    image = batch.redo.get(g.index)
                    if image is None:
                        raise LineageError(f"version {version}: torn xor record of {rec.tensor!r} "
                                           "has no redo image: changed behind the journal's back")
                    target = np.frombuffer(image, dtype=word_dtype(g.info.dtype))
                    if target.size != g.current.size:
                        raise IntegrityError(f"version {version}: redo image of {rec.tensor!r} has "
                                             f"{target.size} words, expected {g.current.size}")
                else:
                    target = g.values
                if ctx.verify != "none" and self.digests.part(g.place, g.where, target) != rec.target_digest:
                    raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not lead to "
                                         "its target digest")
            else:
                raise LineageError(f"version {version}: tensor {rec.tensor!r} holds neither the record's "
                                   "base nor its target: changed behind the journal's back")
            work.append(Write(g.index, rec, g.place, g.where, target, g.current, rec.kind == "xor", repaired))
        work.sort(key=lambda w: w.index)
        self._write_batch(ctx, batch, work, parallel)

    def _write_batch(self, ctx: ApplyContext, batch: Batch, work: list[Write], parallel: bool) -> None:
        """The batch's journal transactions around its writes, then its checks after writing."""
        storage, report, version, seg = self.storage, ctx.report, ctx.version, batch.segment
        start, end, torn = batch.start, batch.end, batch.torn
        durable = storage.durable
        # A torn range left by an interrupted apply stays declared until passed, whatever
        # the batch boundaries of this run.
        started_end = max(end, torn.stop)
        # The pages the writes will dirty are faulted in on the pool while this thread waits
        # for the journal to sync the redo images: no byte changes, and the writes then find
        # them ready (a checkpoint directory at 1% changed writes every page of its tensors).
        # Only where the images are small beside the spans written: writing larger ones into
        # the journal takes the CPU the faults would (tools/bench_apply.py --gib 0.5 --reps 9
        # --verify sample --receivers ckpt: the apply 17% faster at 1% changed, and with
        # PREFAULT_SPAN_TO_IMAGES = 0, always on, 8% slower at 3%).
        images: dict[int, memoryview] | None = None  # deferred sync: the batch's images
        if durable and work:
            images, clear, buffer = self._wal_images(work, parallel)
            storage.begin_writes([w.place for w in work])  # (after _wal_images' sync, if any)
            prefaulting: list[Future] = []
            image_bytes = sum(wal_image_bytes(w.target.size, w.target.itemsize) for w in work)
            if parallel and PREFAULT_SPAN_TO_IMAGES * image_bytes <= sum(map(_span_bytes, work)):
                prefaulting = start_grouped(lambda w: storage.prepare_write(w.place, w.target.size), work,
                                            [w.record.n_changed for w in work], TASK_CHANGES, APPLY_WORKERS)
            try:
                self.journal.stage(seg, start, started_end,
                                   {} if images is not None else
                                   {w.index: np.ascontiguousarray(w.target).data.cast("B")
                                    for w in work if w.redo},
                                   wal=images, version=version, clear_wal=clear,
                                   boot=b"" if self.deferred is None else self.deferred.boot)
            finally:
                if buffer is not None:  # the journal holds copies of the images now
                    return_image_buffer(buffer)
                wait(prefaulting)
            for future in prefaulting:
                future.result()
            self._hook("redo", version=version, segment=seg, start=start, end=end)
        checks = [] if ctx.verify == "none" else [
            w for w in work if ctx.verify == "full" or sampled(version, seg, w.index)]
        read_back: list[int] | None = None  # the checked records' digest parts, in order
        if self.fault is None and parallel and disjoint(work):
            # Records that do not overlap are written in parallel. (Those of a version must
            # not, but a reader does not take it on trust: overlapping ones are written in
            # order. With a fault hook installed too, so that a test stops at a known record.)
            # A checked record is read back by the task that wrote it, once it is written (no
            # other record of the batch writes its words), while the lines it wrote are still
            # in the cache; read back after the whole batch, they came from memory again.
            checked = {id(w) for w in checks}

            def write(w: Write) -> int | None:
                self._write(w, seg, ctx.undo)
                return self.digests.part(w.place, w.where, storage.gather(w.place)) if id(w) in checked else None

            parts = map_grouped(write, work, [w.record.n_changed for w in work], TASK_CHANGES, APPLY_WORKERS)
            read_back = [part for part in parts if part is not None]
            report.written += len(work)
            report.repaired += sum(w.repaired for w in work)
        else:
            for n, w in enumerate(work):
                self._write(w, seg, ctx.undo)
                report.written += 1
                report.repaired += w.repaired
                self._hook("record", version=version, segment=seg, record=w.index, written=n + 1)
        if durable:
            if work:
                if images is None:  # else the journal holds the batch's images
                    storage.sync() if storage.deferred_sync else storage.flush()
                self._hook("flushed", version=version, segment=seg, end=end)
            self.journal.mark_applied(seg, end, max(end, torn.stop), range(start, end))
            self._hook("applied", version=version, segment=seg, end=end)
        if ctx.verify != "none":
            if read_back is None:
                # Reads only, like the batch's gathers: on the pool's threads.
                read_back = list(map_grouped(lambda w: self.digests.part(w.place, w.where, storage.gather(w.place)),
                                             checks, [w.record.n_changed for w in checks], TASK_CHANGES,
                                             APPLY_WORKERS, parallel))
            sums = self.digests.sums(read_back)
            for w, d in zip(checks, sums, strict=True):
                if d != w.record.target_digest:
                    raise IntegrityError(f"version {version}: tensor {w.record.tensor!r} differs from "
                                         "the record's target after writing")

    def _wal_images(self, work: list[Write], parallel: bool
                    ) -> tuple[dict[int, memoryview] | None, bool, np.ndarray | None]:
        """Deferred sync: the batch's images to keep in the journal (None: too large, the batch
        is synced as it is written; or no deferred sync), whether the images held so far are
        dropped in the stage transaction (the storage is synced first), and the borrowed
        buffer the images lie in (borrow_image_buffer). ``parallel``: the batch goes to the
        pool (apply_batch's choice), so its images are laid there too."""
        deferred = self.deferred
        if deferred is None:
            return None, False, None
        # Laid first, each at its own offset of one borrowed buffer (its bound: an image's
        # size depends on its positions' gaps), then counted against the budget.
        bounds = [wal_image_bound(w.record.tensor, w.target.size, w.target.itemsize) for w in work]
        buffer = borrow_image_buffer(sum(bounds))
        starts = itertools.accumulate(bounds, initial=0)

        def lay(item: tuple[Write, int, int]) -> memoryview:
            w, at, bound = item
            return encode_wal_image(w.record.tensor, w.where, w.target, buffer[at:at + bound])

        # On the pool's threads (the C module lays an image in one call, the GIL released):
        # laid on this thread, they held the prefault and the stage back behind them
        # (tools/bench_apply.py --gib 0.5 --reps 9 --verify sample --receivers ckpt, two
        # alternating pairs: 0.054 s at 1% changed against 0.058-0.059, 0.116-0.122 s at 3%
        # against 0.121-0.128; tools/bench_side.py's checkpoint columns did not move beyond
        # their spread).
        laid = list(map_grouped(lay, list(zip(work, starts, bounds)), [w.record.n_changed for w in work],
                                TASK_CHANGES, APPLY_WORKERS, parallel))
        size = sum(len(image) for image in laid)
        keep = size <= deferred.budget  # else too large to keep: synced as it is written
        clear = deferred.used > 0 and (not keep or deferred.used + size > deferred.budget)
        if clear:
            # The images held so far are dropped in the stage transaction: their words must
            # be on disk first.
            self.storage.sync()
            deferred.used = 0
        if not keep:
            return_image_buffer(buffer)
            return None, clear, None
        deferred.used += size
        images = {w.index: image for w, image in zip(work, laid)}
        return images, clear, buffer

    def _write(self, w: Write, seg: int, undo: Undo | None) -> None:
        if undo is None:
            self.storage.write(w.place, w.target)
            return
        try:
            self.storage.write(w.place, w.target)
        except BaseException:
            if w.base is not None:  # possibly half written: restore the gathered base
                undo.records.append(UndoRecord(seg, w.index, w.base))
            raise
        if w.record.kind == "xor":
            undo.records.append(UndoRecord(seg, w.index, None))
        elif w.base is not None:
            undo.records.append(UndoRecord(seg, w.index, w.base))

    def rollback(self, table: Mapping[str, TensorInfo], cache: SegmentCache, undo: Undo) -> None:
        """Memory storage: undo the residual rebuild, the written records (newest first),
        then the layout change."""
        storage = self.storage
        if isinstance(storage, PlacedStorage):
            storage.abort()
        records_by_seg: dict[int, list[Record]] = {}
        for undone in reversed(undo.records):
            recs = records_by_seg.get(undone.segment)
            if recs is None:
                recs = records_by_seg[undone.segment] = cache.records(undone.segment)
            rec = recs[undone.record]
            info = table[rec.tensor]
            changes = decode_record(rec, info, flat=True)
            place = storage.locate(rec.tensor, flat_positions(rec, info.shape, changes))
            if undone.base is None:  # an xor is its own inverse
                values = storage.select(place, changes.values)
                storage.write(place, record_bases(rec.kind, changes, storage.gather(place), values))
            else:
                storage.write(place, undone.base)
        if undo.layout:
            storage.restore_layout(undo.layout)
        self.journal.abort()


# The batch writer faults a durable storage's pages in beside the journal's stage only where
# the spans written hold at least this many times the bytes of the redo images (1% of bf16:
# about 32 times; 3%: about 11).
PREFAULT_SPAN_TO_IMAGES = 16


def _span(w: Write) -> tuple[int, int] | None:
    """A record's first and last flat position (None: it writes nothing)."""
    where = w.where
    if isinstance(where, slice):
        return (where.start, where.stop - 1) if where.stop > where.start else None
    return (int(where[0]), int(where[-1])) if where.size else None  # flat positions of a box increase


def _span_bytes(w: Write) -> int:
    """The bytes from a record's first written word to its last."""
    span = _span(w)
    return 0 if span is None else (span[1] - span[0] + 1) * w.target.itemsize


def disjoint(work: Iterable[Write]) -> bool:
    """Whether the records' flat spans (first to last position, per tensor) are disjoint."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for w in work:
        span = _span(w)
        if span is not None:
            spans.setdefault(w.record.tensor, []).append(span)
    for pieces in spans.values():
        pieces.sort()
        if any(start <= prev_end for (_, prev_end), (start, _) in zip(pieces, pieces[1:])):
            return False
    return True
