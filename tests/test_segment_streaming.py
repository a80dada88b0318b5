"""Segments written while they are built: on a local directory the writer hands each closed
record batch to the writing thread (SegmentUploader.feed), and only links the file into place
once the segment is put. The file is the one a whole write gives; a segment given up leaves
nothing, and a failed write is raised while the encoding goes on."""

from __future__ import annotations

import errno
import hashlib
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dcr_log import DeltaLog, LogWriter
from dcr_log.errors import StoreError
from dcr_log.format import SegmentBuilder, iter_segment
from dcr_log.format import segment as segment_module
from dcr_log.store import Store
from dcr_log.write import differ, uploader
from dcr_log.write.uploader import SegmentUploader
from helpers import assert_same_bits, change_words, copy_state, make_state

SPEC = {"w": ("BF16", (96, 64)), "v": ("F32", (300,)), "n": ("BF16", (64,))}
VERSION = 1


def _records(tmp_path: Path) -> tuple[str, list]:
    """A log's version-1 records (a record per chunk of 512 elements), with its id."""
    rng = np.random.default_rng(5)
    s0 = make_state(rng, SPEC)
    s1 = copy_state(s0)
    for name in SPEC:
        s1[name] = change_words(rng, s0[name], 0.3)
    writer = LogWriter.create(tmp_path / "source", s0, cache_dir=False, policy=differ.EncodePolicy(chunk_elements=512))
    commit = writer.append(s1)
    writer.close()
    log = DeltaLog.open(tmp_path / "source")
    records = []
    for ref in commit.segments:
        _, recs, check = log.read_segment_records(ref, VERSION)
        check()
        records += recs
    assert len(records) >= 10
    return log.log_id, records


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def _upload_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dcr-upload") and t.is_alive()]


def _wait_until(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.005)


def test_a_local_segment_is_written_while_it_is_built(tmp_path, monkeypatch):
    """Batches closed by the builder reach the file before the segment is put; the file
    linked at its key holds exactly the bytes a whole write of the same records gives, its
    size and sha256 are those of its bytes, and it reads back as the same records."""
    monkeypatch.setattr(segment_module, "BATCH_PAYLOAD_BYTES", 300)
    log_id, records = _records(tmp_path)
    root = tmp_path / "store"
    uploads = SegmentUploader(Store.open(root, create=True))
    builder = SegmentBuilder(log_id, VERSION)
    key = "segments/v1/streamed.arrow"
    half = len(records) // 2
    for rec in records[:half]:
        builder.add(rec)
        uploads.feed(key, builder)
    # The first half's closed batches are in the temporary file before the segment is put.
    temporaries = lambda: [p for p in root.rglob("*.tmp") if p.stat().st_size > 0]  # noqa: E731
    _wait_until(temporaries, "the fed batches written")
    assert not (root / key).exists()
    for rec in records[half:]:
        builder.add(rec)
        uploads.feed(key, builder)
    uploads.put(key, builder)
    uploads.finish()

    data = (root / key).read_bytes()
    whole = SegmentBuilder(log_id, VERSION)
    for rec in records:
        whole.add(rec)
    assert data == whole.finish().to_pybytes()
    assert pa.ipc.open_file(pa.py_buffer(data)).num_record_batches > 2
    [ref] = uploads.refs
    assert (ref.key, ref.size, ref.sha256, ref.records) == (key, len(data), hashlib.sha256(data).hexdigest(),
                                                           len(records))
    again = list(iter_segment(data, log_id, VERSION))
    assert [(r.tensor, r.box, r.encoding, r.params, r.n_changed, r.base_digest, r.target_digest,
             bytes(r.payload)) for r in again] == \
        [(r.tensor, r.box, r.encoding, r.params, r.n_changed, r.base_digest, r.target_digest,
          bytes(r.payload)) for r in records]
    assert _files(root) == ["streamed.arrow"]


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_a_segment_given_up_leaves_no_file(tmp_path, monkeypatch, how):
    """A segment fed and then given up (``abort``, as an interrupt does; or ``finish`` with
    the segment never put, as an error does) is not created, its temporary file is removed,
    and its writing thread ends."""
    monkeypatch.setattr(segment_module, "BATCH_PAYLOAD_BYTES", 300)
    log_id, records = _records(tmp_path)
    root = tmp_path / "store"
    uploads = SegmentUploader(Store.open(root, create=True))
    builder = SegmentBuilder(log_id, VERSION)
    for rec in records:
        builder.add(rec)
        uploads.feed("segments/v1/given-up.arrow", builder)
    if how == "abort":
        uploads.abort()
        _wait_until(lambda: not _upload_threads(), "the writing thread ended")
    else:
        with pytest.raises(Exception, match="fed and never put"):
            uploads.finish()
        assert not _upload_threads()
    assert _files(root) == [] and uploads.refs == []
    assert list(root.iterdir()) == []  # nor the directory made for it


def test_a_failed_write_is_raised_while_the_segment_is_fed(tmp_path, monkeypatch):
    """A write of the fed batches that fails (a full disk) is raised by the next ``feed``,
    as the typed error of the store, not only once the whole segment is encoded; nothing is
    left in the directory."""
    monkeypatch.setattr(segment_module, "BATCH_PAYLOAD_BYTES", 300)
    log_id, records = _records(tmp_path)
    root = tmp_path / "store"
    uploads = SegmentUploader(Store.open(root, create=True))

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(uploader.Store, "create_file", _failing_create_file(full))
    builder = SegmentBuilder(log_id, VERSION)
    raised = None
    for rec in records * 50:
        builder.add(rec)
        try:
            uploads.feed("segments/v1/full.arrow", builder)
        except StoreError as exc:
            raised = exc
            break
        time.sleep(0.001)
    assert raised is not None and "space" in str(raised)
    uploads.finish(raise_errors=False)
    assert _files(root) == [] and not _upload_threads()
    assert list(root.iterdir()) == []


def _failing_create_file(write_fails):
    """Store.create_file whose file object's writes call ``write_fails``."""
    real = Store.create_file

    def create_file(self, key, write):
        class Failing:
            def __init__(self, f):
                self.f = f

            def __getattr__(self, name):
                return getattr(self.f, name)

            def write(self, data):
                return write_fails(self, data)
        return real(self, key, lambda f: write(Failing(f)))
    return create_file


def test_an_append_interrupted_while_its_segment_is_written(tmp_path, monkeypatch):
    """Ctrl-C in the middle of an append whose segment is being written batch by batch: no
    segment file of the version is left, the writing thread ends, and the same writer's next
    append commits the version with the state's bits."""
    monkeypatch.setattr(segment_module, "BATCH_PAYLOAD_BYTES", 300)
    rng = np.random.default_rng(8)
    s0 = make_state(rng, SPEC)
    s1 = copy_state(s0)
    for name in SPEC:
        s1[name] = change_words(rng, s0[name], 0.3)
    policy = differ.EncodePolicy(chunk_elements=512, workers=1)
    writer = LogWriter.create(tmp_path / "log", s0, policy=policy, cache_dir=False)
    before = _files(tmp_path / "log")
    real = differ.Differ.diff_box
    calls: list[int] = []
    fed: list[int] = []
    real_feed = SegmentUploader.feed

    def counted_feed(self, key, builder):
        real_feed(self, key, builder)
        if self._stream is not None:
            fed.append(1)

    def interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 9:
            _wait_until(lambda: any(p.stat().st_size for p in (tmp_path / "log").rglob("*.tmp")),
                        "a fed batch written")
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(differ.Differ, "diff_box", interrupted)
        m.setattr(SegmentUploader, "feed", counted_feed)
        with pytest.raises(KeyboardInterrupt):
            writer.append(s1)
    assert fed  # the interrupt came while the segment was being fed
    _wait_until(lambda: not _upload_threads(), "the writing thread ended")
    assert _files(tmp_path / "log") == before
    assert not (tmp_path / "log" / "segments" / "1").exists()
    commit = writer.append(s1)
    writer.close()
    assert commit.version == 1
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)
