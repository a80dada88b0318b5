"""A checkpoint directory's pages are faulted in for writing on the pool's threads while the
journal stages the batch's redo images (batch.PREFAULT_SPAN_TO_IMAGES), before any write."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dcr_log.receiver import Receiver, write_checkpoint
from dcr_log.receiver.journal import Journal
from dcr_log.receiver.storage.checkpoint import CheckpointStorage
from helpers import DirtyCount, flip_log


@pytest.mark.parametrize("rate, prefaulted", [(0.01, True), (0.1, False)])
def test_pages_are_faulted_in_beside_the_stage(tmp_path, monkeypatch, rate, prefaulted):
    """At 1% of two 8 MiB bf16 tensors (spans 32 times the images' bytes) every written
    record's pages are prepared on pool threads, while the stage transaction runs (it waits
    here for the first one), and all before the first write; at 10% (images a third of the
    spans) none are, and the writes fault their pages themselves. Each record's pages are
    faulted in once either way (a write does not again what prepare_write did). The bits are
    the log's."""
    from dcr_log import native

    log, base, new = flip_log(tmp_path / "log", tensors=2, n=1 << 22, rate=rate, seed=7)
    (tmp_path / "ckpt").mkdir()
    write_checkpoint(base, tmp_path / "ckpt")
    events: list[tuple[str, str]] = []
    started = threading.Event()
    real_prepare, real_write, real_stage = (CheckpointStorage.prepare_write, CheckpointStorage.write,
                                            Journal.stage)

    def prepare_write(self, place, count):
        started.set()
        events.append(("prepare", threading.current_thread().name))
        real_prepare(self, place, count)
        events.append(("prepared", threading.current_thread().name))

    def write(self, place, values):
        events.append(("write", threading.current_thread().name))
        real_write(self, place, values)

    def stage(self, *args, **kwargs):
        if prefaulted:  # the faults run beside the transaction, not after it
            assert started.wait(timeout=60)
        real_stage(self, *args, **kwargs)
        events.append(("staged", threading.current_thread().name))

    assert native.changes is not None
    real_populate = native.changes.populate_write
    populated: list[tuple[int, int]] = []

    def populate_write(buffer, start, length):
        populated.append((start, length))
        return real_populate(buffer, start, length)

    with Receiver.open(tmp_path / "ckpt") as rx:
        rx.bind(log, 0, verify="none")
        monkeypatch.setattr(native.changes, "populate_write", populate_write)
        monkeypatch.setattr(CheckpointStorage, "prepare_write", prepare_write)
        monkeypatch.setattr(CheckpointStorage, "write", write)
        monkeypatch.setattr(Journal, "stage", stage)
        assert rx.apply(log, to=1) == [1]
        for k, v in new.items():
            assert np.array_equal(rx.storage.words(k), v.words), k
    kinds = [e for e, _ in events]
    writes = kinds.count("write")
    assert writes == len([r for r in log.records(1) if r.kind == "xor"]) > 1
    assert len(populated) == len(set(populated)) == writes, populated
    if prefaulted:
        assert kinds.count("prepare") == kinds.count("prepared") == writes
        assert max(i for i, e in enumerate(kinds) if e == "prepared") < kinds.index("write")
        assert threading.current_thread().name not in {t for e, t in events if e == "prepare"}
    else:
        assert "prepare" not in kinds


@pytest.mark.parametrize("dirty_count", ["kernel", "counted", "none"])
def test_pages_an_earlier_apply_left_writable_are_walked_not_dropped(tmp_path, monkeypatch, dirty_count):
    """Before its writes a checkpoint receiver drops the page-table entries of each tensor it
    writes (begin_writes: drop_pages, one call a tensor) on its first apply; on the next one,
    while its files are unsynced and their pages still dirty, it does not (they are still
    mapped for writing); once the files are synced by the storage, or cleaned behind its
    back, it does again. Whether they are still dirty: helpers.DirtyCount (the kernel's
    count of the range's dirty pages, where only the drops that must follow are checked; a
    count the test sets; none, and the dirty expiry). The bits are the log's after every
    apply."""
    from dcr_log import native
    from dcr_log.write import LogWriter

    log, base, new = flip_log(tmp_path / "log", tensors=2, n=1 << 22, rate=0.01, seed=8)
    with LogWriter.open(tmp_path / "log", cache_dir=False) as writer:
        for state in (base, new, base):
            writer.append(state)
    (tmp_path / "ckpt").mkdir()
    write_checkpoint(base, tmp_path / "ckpt")
    assert native.changes is not None
    count = DirtyCount(monkeypatch, dirty_count, tmp_path)
    real = native.changes.drop_pages
    drops: list[int] = []

    def drop_pages(buffer, start, length):
        drops.append(start)
        return real(buffer, start, length)

    monkeypatch.setattr(native.changes, "drop_pages", drop_pages)
    tensors = len(base)
    with Receiver.open(tmp_path / "ckpt") as rx:
        rx.bind(log, 0, verify="none")
        dropped = []
        for version, expected in ((1, new), (2, base), ("sync", None), (3, new), ("behind", None), (4, base)):
            if version == "sync":
                rx.storage.sync()
                continue
            if version == "behind":
                count.clean()
                continue
            drops.clear()
            assert rx.apply(log, to=version) == [version]
            count.written()
            for k, v in expected.items():
                assert np.array_equal(rx.storage.words(k), v.words), (version, k)
            dropped.append(sorted(drops))
    first = dropped[0]
    assert len(first) == len(set(first)) == tensors > 1, dropped
    if dirty_count == "kernel":
        assert dropped[2:] == [first, first], dropped
    else:
        assert dropped == [first, [], first, first], dropped
