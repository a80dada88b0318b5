"""The receiver's segment pipeline: segments fetched ahead on threads while earlier ones are
checked and applied, each fetched once, spooled to local disk beyond the memory budget."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.log import DeltaLog
from dcr_log.receiver import Receiver
from dcr_log.receiver import segments as apply_module
from dcr_log.write import LogWriter
from helpers import change_words, copy_state, counting_store, make_state


@pytest.mark.parametrize("budget", [1 << 30, 4096])  # all in memory; most spooled
@pytest.mark.parametrize("verify", ["none", "sample", "full"])
def test_each_segment_is_fetched_once_and_the_spool_is_removed(tmp_path, monkeypatch, budget, verify):
    rng = np.random.default_rng(4)
    spec = {f"t{i}": ("BF16", (64, 48)) for i in range(12)}
    state = make_state(rng, spec)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=1024)
    states = [copy_state(state)]
    for _ in range(2):
        state = {n: change_words(rng, b, 0.3) for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    store = counting_store(str(root))
    log = DeltaLog.open(store)
    assert all(len(log.commit(v).segments) >= 8 for v in (1, 2))
    spools = tmp_path / "tmp"
    spools.mkdir()
    asked: list[int] = []
    monkeypatch.setattr(tempfile, "gettempdir", lambda: asked.append(1) or str(spools))
    monkeypatch.setattr(apply_module, "SEGMENT_CACHE_BYTES", budget)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in states[0].items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in states[0].items()})
    rx.bind(log, 0)
    store.gets.clear()
    spooled = []
    real_write = Path.write_bytes

    def spy(self, data):
        spooled.append(self)
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", spy)
    assert rx.apply(log, verify=verify) == [1, 2]
    for name, bits in states[2].items():
        assert arrays[name].tobytes() == bits.words.tobytes()
    segment_gets = {k: n for k, n in store.gets.items() if k.startswith("segments/")}
    assert set(segment_gets) == {ref.key for v in (1, 2) for ref in log.commit(v).segments}
    assert set(segment_gets.values()) == {1}  # fetched once, however small the budget
    assert (len(spooled) > 0) == (budget == 4096)
    # The temporary directory is asked for only when a segment is spooled: a process's first
    # gettempdir() creates a probe file there, which a kill would leave behind.
    assert (len(asked) > 0) == (len(spooled) > 0)
    assert list(spools.iterdir()) == []  # the spool is gone


def test_a_spooled_segment_changed_on_disk_is_refused(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    state = make_state(rng, {f"t{i}": ("F32", (32, 32)) for i in range(6)})
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=1024)
    writer.append({n: change_words(rng, b, 0.5) for n, b in state.items()})
    log = DeltaLog.open(root)
    cache = apply_module.SegmentCache(log, log.commit(1), budget=0, spool=tmp_path / "spool")
    first = bytes(cache.data(0))
    path = tmp_path / "spool" / "00000000.arrow"
    assert path.read_bytes() == first
    path.write_bytes(first[:-1] + bytes([first[-1] ^ 1]))
    from dcr_log.errors import IntegrityError
    with pytest.raises(IntegrityError, match="changed on local disk"):
        cache.data(0)
    cache.close()
    assert not (tmp_path / "spool").exists()


def _peak_rss_reset() -> bool:
    """Reset this process's peak resident set size (Linux: /proc/self/clear_refs, 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_segment_above_the_memory_budget_is_streamed_not_held(tmp_path, monkeypatch, where):
    """FORMAT.md section 20: a segment larger than the reader's memory budget is hashed while
    it is read in chunks and its records read through a memory map whose pages are given back;
    verify, replay and the receiver never hold it whole."""
    import uuid

    from dcr_log.log import segments as log_module
    from dcr_log.state import TensorBits
    from dcr_log.store import Store
    from dcr_log.write.differ import EncodePolicy

    monkeypatch.setattr(log_module, "SEGMENT_MEMORY_BYTES", 1 << 20)
    monkeypatch.setattr(log_module, "MAPPED_WINDOW_BYTES", 1 << 20)
    rng = np.random.default_rng(6)
    shape = (2048, 8192)  # 32 MiB of bf16: records of 1 MiB, one segment per version
    words = rng.integers(0, 1 << 16, shape[0] * shape[1], dtype=np.uint16)
    root = tmp_path / "log"
    writer = LogWriter.create(root, {"w": TensorBits("BF16", shape, words)}, cache_dir=False,
                              segment_bytes=64 << 20, policy=EncodePolicy(chunk_elements=1 << 19))
    words = words ^ rng.integers(1, 1 << 16, words.size, dtype=np.uint16)
    writer.append({"w": TensorBits("BF16", shape, words)})
    if where == "memory":
        url = f"memory://stream-{uuid.uuid4().hex}"
        target = Store.open(url)
        for p in sorted(root.rglob("*")):
            if p.is_file():
                target.put_new(p.relative_to(root).as_posix(), p.read_bytes())
        store = counting_store(url)
    else:
        store = counting_store(str(root))
    log = DeltaLog.open(store)
    refs = [ref for v in (0, 1) for ref in log.commit(v).segments]
    assert len(refs) == 2 and all(ref.size > 30 << 20 and ref.records == 32 for ref in refs)

    assert isinstance(log.read_segment(refs[1], 1), log_module.SegmentFile)
    # Peak memory on a local directory (a memory store holds the log in this process, and its
    # stream may hand the object over as one chunk).
    if where == "local" and _peak_rss_reset():
        before = _rss_kib("VmRSS")
        log.verify()
        grew = (_rss_kib("VmHWM") - before) << 10
        assert grew < refs[0].size // 2, f"verify took {grew} bytes more for a {refs[0].size}-byte segment"
    state = log.materialize(1)
    assert state["w"].words.tobytes() == words.tobytes()

    arrays = {"w": np.zeros(shape, np.uint16)}
    arrays["w"].reshape(-1)[:] = log.materialize(0)["w"].words
    monkeypatch.setattr(apply_module, "SEGMENT_CACHE_BYTES", 1 << 20)
    spools = tmp_path / "tmp"
    spools.mkdir()
    asked: list[int] = []
    monkeypatch.setattr(tempfile, "gettempdir", lambda: asked.append(1) or str(spools))
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={"w": "BF16"})
    rx.bind(log, 0)
    assert rx.apply(log, verify="full") == [1]
    assert arrays["w"].tobytes() == words.tobytes()
    # Never read whole: no get of a segment (read_segment streams it to a file instead).
    assert not [k for k in store.gets if k.startswith("segments/")]
    assert list(spools.iterdir()) == []


def _one_segment_log(tmp_path):
    rng = np.random.default_rng(9)
    state = make_state(rng, {"a": ("BF16", (40, 30)), "b": ("F32", (7,))})
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False)
    new = {n: change_words(rng, b, 0.3) for n, b in state.items()}
    writer.append(new)
    return root, state, new


def test_a_segment_is_parsed_beside_its_hash_and_damage_reads_as_a_hash_mismatch(tmp_path, monkeypatch):
    """The first segment is parsed while its sha256 is computed on the side thread; whatever
    byte is damaged, the receiver reports the hash mismatch (never the parse's own error, which
    would hide what happened) and writes nothing, journal included."""
    import hashlib
    import threading

    from dcr_log.errors import IntegrityError
    from dcr_log.store import Store

    root, state, new = _one_segment_log(tmp_path)
    store = Store.open(str(root))
    (ref,) = DeltaLog.open(store).commit(1).segments
    original = bytes(store.get(ref.key))
    hashed_on: list[str] = []
    real_sha256 = hashlib.sha256

    def spy(data=b""):
        if len(data) == ref.size:
            hashed_on.append(threading.current_thread().name)
        return real_sha256(data)

    monkeypatch.setattr(hashlib, "sha256", spy)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    dtypes = {n: b.dtype for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes=dtypes)
    rx.bind(DeltaLog.open(store), 0, verify="none")
    journal = {p: p.read_bytes() for p in sorted((tmp_path / "j").rglob("*")) if p.is_file()}
    assert journal
    # Every byte of the Arrow file's head and tail (where a flip breaks the parse), and a
    # spread of the rest.
    flips = sorted(set(range(64)) | set(range(len(original) - 400, len(original))) | set(range(0, len(original), 13)))
    for i in flips:
        data = bytearray(original)
        data[i] ^= 0x20
        store.delete(ref.key)
        store.put_new(ref.key, bytes(data))
        with pytest.raises(IntegrityError, match="sha256 mismatch"):
            rx.apply(DeltaLog.open(store), verify="sample")
        assert rx.version == 0
        assert all(arrays[n].tobytes() == b.words.tobytes() for n, b in state.items()), i
        assert {p: p.read_bytes() for p in journal} == journal, i
    assert hashed_on and all(name.startswith("dcr-side") for name in hashed_on)
    store.delete(ref.key)
    store.put_new(ref.key, original)
    assert rx.apply(DeltaLog.open(store), verify="sample") == [1]
    assert all(arrays[n].tobytes() == b.words.tobytes() for n, b in new.items())


def test_a_parse_error_beside_a_matching_hash_is_raised(tmp_path):
    """A segment whose sha256 matches its commit record but is not an Arrow file (the record
    re-sealed around it): the parse's error comes through."""
    import dataclasses
    import hashlib

    from dcr_log.errors import IntegrityError
    from dcr_log.format import SegmentRef
    from dcr_log.format.keys import version_key
    from dcr_log.store import Store

    root, state, _ = _one_segment_log(tmp_path)
    store = Store.open(str(root))
    commit = DeltaLog.open(store).commit(1)
    (ref,) = commit.segments
    data = bytes(store.get(ref.key))[:-6] + b"NOTARR"  # the footer's magic
    forged = dataclasses.replace(commit, segments=(SegmentRef(ref.key, len(data), hashlib.sha256(data).hexdigest(),
                                                              ref.records),))
    for key, value in ((ref.key, data), (version_key(1), forged.to_bytes())):
        store.delete(key)
        store.put_new(key, value)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in state.items()})
    rx.bind(DeltaLog.open(store), 0, verify="none")
    with pytest.raises(IntegrityError, match="not an Arrow IPC file"):
        rx.apply(DeltaLog.open(store), verify="sample")
    assert rx.version == 0


def test_records_are_decoded_while_the_first_segments_hash_runs(tmp_path, monkeypatch):
    """The hash of a segment fetched by the receiver itself does not hold its records back:
    here it waits until pass one has begun decoding them (and would wait in vain, 10 s, were
    they held back until it returned)."""
    import hashlib
    import threading

    from dcr_log.receiver.checks import PassOne

    root, state, new = _one_segment_log(tmp_path)
    log = DeltaLog.open(root)
    (ref,) = log.commit(1).segments
    decoding = threading.Event()
    waited: list[bool] = []
    real_sha256, real_decode = hashlib.sha256, PassOne._decode_ahead

    def sha256(data=b""):
        if len(data) == ref.size:
            waited.append(decoding.wait(10))
        return real_sha256(data)

    def decode_ahead(self, rec, wanted):
        decoding.set()
        return real_decode(self, rec, wanted)

    monkeypatch.setattr(hashlib, "sha256", sha256)
    monkeypatch.setattr(PassOne, "_decode_ahead", decode_ahead)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in state.items()})
    rx.bind(log, 0, verify="none")
    assert rx.apply(log, verify="sample") == [1]
    assert waited == [True]
    assert all(arrays[n].tobytes() == b.words.tobytes() for n, b in new.items())


def test_replay_reads_the_next_segment_beside_the_records_of_this_one(tmp_path):
    """DeltaLog.records: segment i + 1 is read on the side thread while segment i's records are
    taken, and segment i is hashed meanwhile (on the pool where replay decodes on it); the
    result is the same state; damage in a later segment is raised by the end of its records,
    before any of the next (the earlier segments' records were all taken), and in place of what
    a damaged record did to replay; and a caller that stops early leaves nothing reading."""
    import threading

    from dcr_log.errors import IntegrityError
    from dcr_log.log.replay import state_equal

    rng = np.random.default_rng(6)
    spec = {f"t{i}": ("BF16", (64, 48)) for i in range(12)}
    state = make_state(rng, spec)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=1024)
    new = {n: change_words(rng, b, 0.3) for n, b in state.items()}
    writer.append(new)
    log = DeltaLog.open(root)
    refs = log.commit(1).segments
    assert len(refs) >= 8
    readers: list[tuple[str, str]] = []
    real_fetch = log._fetch_segment

    def spy(ref, version=None):
        readers.append((ref.key, threading.current_thread().name))
        return real_fetch(ref, version)

    log._fetch_segment = spy  # type: ignore[method-assign]
    replayed = log.materialize(0)
    log.apply_version(replayed, 1)
    assert state_equal(replayed, new)
    ones = [(k, t) for k, t in readers if k in {r.key for r in refs}]
    assert [k for k, _ in ones] == [r.key for r in refs]  # each once, in order
    assert all(t.startswith("dcr-side") for _, t in ones[1:]) and not ones[0][1].startswith("dcr-side")

    # The sixth segment damaged: the five before it are taken whole, then at most its own
    # records, then the mismatch.
    damaged = root / refs[5].key
    original = damaged.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 1  # in a record's payload: the segment parses
    damaged.write_bytes(bytes(data))
    taken = []
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        for rec in DeltaLog.open(root).records(1):
            taken.append(rec)
    assert sum(r.records for r in refs[:5]) <= len(taken) <= sum(r.records for r in refs[:6])
    # Replay decodes the damaged record before the hash is done: the mismatch is what it says.
    held = DeltaLog.open(root).materialize(0)
    with pytest.raises(IntegrityError, match=f"segment {refs[5].key}: sha256 mismatch"):
        DeltaLog.open(root).apply_version(held, 1)

    # Stopped after the first record: the read ahead (slowed down here) has ended by the time
    # the generator is closed (one not begun yet is cancelled).
    damaged.write_bytes(original)
    slow = DeltaLog.open(root)
    events: list[str] = []
    real_slow = slow._fetch_segment

    def slow_read(ref, version=None):
        events.append("start")
        time.sleep(0.2)
        try:
            return real_slow(ref, version)
        finally:
            events.append("end")

    slow._fetch_segment = slow_read  # type: ignore[method-assign]
    records = slow.records(1)
    next(records)
    time.sleep(0.05)  # the second segment's read has begun on the side thread
    records.close()
    assert events == ["start", "end", "start", "end"]
