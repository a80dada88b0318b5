"""Acceptance: damaged logs are refused (exit 3), never replayed into a wrong or partial file."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from dcr_log import CommitConflict, DeltaLog, IntegrityError, LogWriter, create_log
from dcr_log.format import CommitRecord, SegmentRef, version_key
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.store import Store
from dcr_log.write.differ import EncodePolicy
from helpers import assert_one_line, change_words, copy_state, make_state, run_cli, snapshot_files

SPEC = {"w": ("BF16", (40, 24)), "b": ("F32", (24,)), "n": ("I8", (3, 5))}
POLICY = EncodePolicy(chunk_elements=256)
SEGMENT_BYTES = 100
VERSIONS = 4


def _states():
    rng = np.random.default_rng(9)
    states = [make_state(rng, SPEC)]
    for v in range(1, VERSIONS):
        s = copy_state(states[-1])
        s["w"] = change_words(rng, s["w"], 0.05)
        s["b"] = change_words(rng, s["b"], 0.5 if v % 2 else 0.0)
        states.append(s)
    return states


def _build(location, states):
    writer = create_log(location, states[0], policy=POLICY, segment_bytes=SEGMENT_BYTES)
    for s in states[1:]:
        writer.append(s)
    return writer


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = tmp_path_factory.mktemp("corruption") / "log"
    states = _states()
    _build(root, states)
    log = DeltaLog.open(root)
    assert all(len(log.commit(v).segments) >= 2 for v in range(1, VERSIONS))
    return root, states


@pytest.fixture
def damaged(template, tmp_path):
    """A private copy of the template log, and an empty directory for replay output."""
    root, states = template
    copy = tmp_path / "log"
    shutil.copytree(root, copy)
    (tmp_path / "out").mkdir()
    return copy, tmp_path / "out"


def _middle_segment(root: Path) -> Path:
    commit = DeltaLog.open(root).commit(2)
    return root / commit.segments[0].key


def _assert_refused(root: Path, out_dir: Path) -> None:
    """verify and replay both exit 3 with one line on stderr; replay leaves nothing behind."""
    rc, out, err = run_cli("verify", root)
    assert rc == 3, (out, err)
    assert_one_line(err)
    rc, out, err = run_cli("replay", root, "--out", out_dir / "model.safetensors")
    assert rc == 3, (out, err)
    assert_one_line(err)
    assert list(out_dir.iterdir()) == []  # no output file and no temporary file


def _flip(path: Path, position: int, bit: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= bit
    path.write_bytes(bytes(data))


def test_undamaged_copy_is_accepted(damaged, template):
    root, out_dir = damaged
    rc, _, err = run_cli("verify", root, "--deep")
    assert rc == 0, err
    rc, _, err = run_cli("replay", root, "--out", out_dir / "model.safetensors")
    assert rc == 0, err


# Arrow IPC file: "ARROW1" magic and padding, schema message, record batches, footer
# (flatbuffer), footer length (4 bytes), "ARROW1".
SEGMENT_POSITIONS = {
    "first byte": lambda size: 0,
    "schema message": lambda size: 12,
    "payload middle": lambda size: size // 2,
    "footer flatbuffer": lambda size: size - 40,
    "footer length": lambda size: size - 8,
    "last byte": lambda size: size - 1,
}


@pytest.mark.parametrize("where", list(SEGMENT_POSITIONS))
def test_flipped_segment_byte_refused(damaged, where):
    root, out_dir = damaged
    segment = _middle_segment(root)
    _flip(segment, SEGMENT_POSITIONS[where](segment.stat().st_size))
    _assert_refused(root, out_dir)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_commit_record_byte_refused(damaged, where):
    root, out_dir = damaged
    record = root / version_key(2)
    size = record.stat().st_size
    _flip(record, {"first": 0, "middle": size // 2, "last": size - 1}[where], 0x02)
    _assert_refused(root, out_dir)


@pytest.mark.parametrize("what", ["segment", "commit record"])
def test_truncated_file_refused(damaged, what):
    root, out_dir = damaged
    path = _middle_segment(root) if what == "segment" else root / version_key(2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])
    _assert_refused(root, out_dir)


def test_deleted_segment_refused(damaged):
    root, out_dir = damaged
    _middle_segment(root).unlink()
    _assert_refused(root, out_dir)


def test_deleted_middle_commit_record_refused(damaged):
    root, out_dir = damaged
    (root / version_key(1)).unlink()
    rc, _, err = run_cli("verify", root)
    assert rc == 3
    assert_one_line(err)
    assert "contiguous" in err
    rc, _, err = run_cli("replay", root, "--out", out_dir / "model.safetensors")
    assert rc == 3
    assert list(out_dir.iterdir()) == []


def test_damaged_identity_refused(damaged):
    root, out_dir = damaged
    _flip(root / "dcr.json", 10)
    _assert_refused(root, out_dir)


def test_orphan_segment_is_harmless(damaged, template):
    """A segment no commit names (a writer that crashed before committing) changes nothing."""
    root, out_dir = damaged
    orphan = root / "segments" / "2" / f"crashed-{uuid.uuid4().hex}.arrow"
    orphan.write_bytes(b"garbage")
    rc, _, err = run_cli("verify", root, "--deep")
    assert rc == 0, err


# -- exhaustive checks in process -------------------------------------------------------------

def test_every_byte_of_a_segment_and_commit_record_is_covered():
    """Flipping any byte of a segment or of a commit record fails verify (even bytes) and
    materialize (odd bytes)."""
    rng = np.random.default_rng(8)
    s0 = make_state(rng, {"a": ("F16", (50,)), "b": ("U8", (3,))})
    s1 = copy_state(s0)
    s1["a"] = change_words(rng, s0["a"], 0.1)
    s2 = copy_state(s1)
    s2["b"] = change_words(rng, s1["b"], 1.0)
    store = Store.open(f"memory://corrupt-{uuid.uuid4().hex}")
    writer = create_log(store, s0)
    writer.append(s1)
    writer.append(s2)
    (ref,) = DeltaLog.open(store).commit(1).segments
    for key in (ref.key, version_key(1)):
        original = bytes(store.get(key))
        for i in range(len(original)):
            data = bytearray(original)
            data[i] ^= 0x10
            store.delete(key)
            store.put_new(key, bytes(data))
            with pytest.raises(IntegrityError):
                if i % 2:
                    DeltaLog.open(store).materialize()
                else:
                    DeltaLog.open(store).verify()
        store.delete(key)
        store.put_new(key, original)
    DeltaLog.open(store).verify(deep=True)


def test_resealed_segment_damage_is_caught_or_harmless():
    """Defence in depth: a flipped segment byte with a commit record re-sealed around it (so the
    sha256 matches) is still refused by the Arrow, codec or digest checks, or it changes
    nothing that is read: replay never yields wrong bits and never fails another way."""
    rng = np.random.default_rng(4)
    s0 = make_state(rng, {"a": ("BF16", (30,)), "b": ("U32", (2, 3))})
    s1 = copy_state(s0)
    s1["a"] = change_words(rng, s0["a"], 0.2)
    s1["b"] = change_words(rng, s0["b"], 1.0)
    store = Store.open(f"memory://reseal-{uuid.uuid4().hex}")
    create_log(store, s0, policy=EncodePolicy(chunk_elements=16)).append(s1, kind="xor")
    commit = DeltaLog.open(store).commit(1)
    ref = commit.segments[0]
    original = bytes(store.get(ref.key))
    outcomes = {"refused": 0, "same bits": 0}
    for i in range(len(original)):
        data = bytearray(original)
        data[i] ^= 0x01 if i % 2 else 0x80
        forged = dataclasses.replace(commit, segments=(
            SegmentRef(ref.key, len(data), hashlib.sha256(data).hexdigest(), ref.records),) + commit.segments[1:])
        for key, value in ((ref.key, bytes(data)), (version_key(1), forged.to_bytes())):
            store.delete(key)
            store.put_new(key, value)
        try:
            got = DeltaLog.open(store).materialize(1)
        except IntegrityError:
            outcomes["refused"] += 1
            continue
        assert sorted(got) == sorted(s1), i
        assert all(got[k].same_bits(s1[k]) for k in s1), f"byte {i}: wrong bits accepted"
        outcomes["same bits"] += 1
    assert outcomes["refused"] > len(original) // 2  # most bytes matter


def _forge(store: Store, version: int, edit) -> None:
    """Replace a commit record by a validly sealed edited copy (a forged, not a flipped, record)."""
    record = DeltaLog.open(store).commit(version)
    forged = edit(record)
    store.delete(version_key(version))
    store.put_new(version_key(version), forged.to_bytes())


def _with_tensor_digest(record: CommitRecord, name: str, digest: int) -> CommitRecord:
    tensors = tuple(TensorInfo(t.name, t.dtype, t.shape, digest) if t.name == name else t for t in record.tensors)
    return dataclasses.replace(record, tensors=tensors, state_digest=state_digest(tensors))


FORGERIES = {
    "tensor digest": lambda r: _with_tensor_digest(r, "b", 12345),
    "state digest": lambda r: dataclasses.replace(r, state_digest=r.state_digest ^ 1),
    "parent digest": lambda r: dataclasses.replace(r, parent_state_digest=r.parent_state_digest ^ 1),
    "record count": lambda r: dataclasses.replace(r, stats=dataclasses.replace(r.stats, records=r.stats.records + 1)),
    "changed count": lambda r: dataclasses.replace(
        r, stats=dataclasses.replace(r.stats, changed_elements=r.stats.changed_elements - 1)),
    "segment dropped": lambda r: dataclasses.replace(r, segments=r.segments[1:]),
    "segment records": lambda r: dataclasses.replace(
        r, segments=(dataclasses.replace(r.segments[0], records=r.segments[0].records + 1),) + r.segments[1:]),
    "segment size": lambda r: dataclasses.replace(
        r, segments=(dataclasses.replace(r.segments[0], size=r.segments[0].size + 1),) + r.segments[1:]),
    "log id": lambda r: dataclasses.replace(r, log_id="f" * 32),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_forged_commit_record_refused(forgery, template):
    root, states = template
    store = Store.open(f"memory://forged-{uuid.uuid4().hex}")
    _build(store, states)
    _forge(store, 2, FORGERIES[forgery])
    with pytest.raises(IntegrityError):
        DeltaLog.open(store).materialize()
    with pytest.raises(IntegrityError):
        DeltaLog.open(store).verify(deep=True)


def test_segment_moved_from_another_version_or_log_refused(template):
    root, states = template
    store = Store.open(f"memory://moved-{uuid.uuid4().hex}")
    _build(store, states)
    other = Store.open(f"memory://other-{uuid.uuid4().hex}")
    _build(other, states)  # same states, another log id
    log = DeltaLog.open(store)
    c1, c2 = log.commit(1), log.commit(2)
    for source_store, source_ref in ((store, c1.segments[0]), (other, DeltaLog.open(other).commit(2).segments[0])):
        data = bytes(source_store.get(source_ref.key))
        key = c2.segments[0].key.replace(".arrow", f"-{uuid.uuid4().hex[:6]}.arrow")
        store.put_new(key, data)
        ref = SegmentRef(key, len(data), hashlib.sha256(data).hexdigest(), source_ref.records)
        # A self-consistent forgery: stats.records follows the segments' records (checked with
        # the commit record itself), so only the segment's metadata tells it apart.
        _forge(store, 2, lambda r: dataclasses.replace(
            r, segments=(ref,) + r.segments[1:],
            stats=dataclasses.replace(r.stats, records=r.stats.records - r.segments[0].records + ref.records)))
        with pytest.raises(IntegrityError, match="another log or version"):
            DeltaLog.open(store).materialize(2)
        _forge(store, 2, lambda r: c2)


# -- conflicts change nothing -----------------------------------------------------------------

@pytest.mark.parametrize("where", ["local", "memory"])
def test_commit_to_existing_version_changes_nothing(where, template, tmp_path):
    _, states = template
    location = tmp_path / "log" if where == "local" else f"memory://conflict-{uuid.uuid4().hex}"
    writer = _build(location, states[:2])
    stale = LogWriter.open(location, policy=POLICY, segment_bytes=SEGMENT_BYTES)
    writer.append(states[2])  # wins version 2
    store = Store.open(location)
    before = {o.key: bytes(store.get(o.key)) for o in store.list("")}
    if where == "local":
        files_before = snapshot_files(tmp_path / "log")
    with pytest.raises(CommitConflict):
        stale.append(states[3])  # several segments written, then the commit is refused
    assert {o.key: bytes(store.get(o.key)) for o in store.list("")} == before
    if where == "local":
        assert snapshot_files(tmp_path / "log") == files_before
    assert stale.version == 1  # the loser's baseline did not move
    log = DeltaLog.open(location)
    assert log.versions() == [0, 1, 2]
    got = log.materialize(2)
    assert all(got[k].same_bits(states[2][k]) for k in states[2])
