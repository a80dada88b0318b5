"""Deferred sync of checkpoint-directory receivers (spec/RECEIVER.md, "Deferred sync"): the
journal keeps each written record's positions and target words until the files are synced,
so that a power loss at any point, which may leave any page of the files at its last synced
bytes, loses nothing once a receiver opens the directory again. The power loss is modelled by
helpers.powerloss (per page: durable bytes or current ones, at random; a new boot id)."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log import DeltaLog
from dcr_log.checkpoint import load_checkpoint
from dcr_log.receiver import Journal, Receiver, write_checkpoint
from dcr_log.receiver import batch as batch_module
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import assert_same_bits, change_words, copy_state, make_state
from helpers.powerloss import PowerLossModel
from test_receiver import CRASH_POINTS, LAYOUT_VERSION, SimulatedCrash, build_log, ckpt_receiver, reopen

VERSIONS = 5


@pytest.fixture
def logged(tmp_path):
    return build_log(tmp_path / "log", versions=VERSIONS)


def crash_at(point: str, nth: int):
    seen = {"n": 0}

    def hook(name, **info):
        if name == point:
            seen["n"] += 1
            if seen["n"] == nth:
                raise SimulatedCrash(name)
    return hook


@pytest.mark.parametrize("budget", ["large", "medium", "small"])
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_power_loss_anywhere_loses_nothing(tmp_path, monkeypatch, logged, point, budget):
    """Crash at a point of some version, then lose power (each page not synced since may
    revert): the next receiver restores the journal's images and ends bit for bit at the
    log's latest version; between versions it holds exactly the journal's version. Budgets:
    every version's images kept; one version's, dropped (after a sync) in the middle of the
    next; none (each version too large for its images: synced batch by batch)."""
    log, states = logged
    # The model's tensors hold about 8 KB: a quarter is below both floors set here.
    monkeypatch.setattr(batch_module, "WAL_MIN_BYTES", {"large": 1 << 26, "medium": 4096, "small": 600}[budget])
    stages = []
    real_stage = Journal.stage
    monkeypatch.setattr(Journal, "stage", lambda self, *a, **k: stages.append(k) or real_stage(self, *a, **k))
    model = PowerLossModel(monkeypatch, seed=CRASH_POINTS.index(point))
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000)
    nth = 2 if point == "layout_file" else 3
    rx = reopen(directory, fault=crash_at(point, nth))
    with pytest.raises(SimulatedCrash):
        rx.apply(log)
    rx.close()
    unsynced = model.unsynced_pages(directory)
    model.lose_power(directory)
    st = Journal.peek(directory / ".dcr")
    with reopen(directory) as rx:
        if st.inflight is None:
            assert rx.apply(log, to=st.version) == []  # restores, applies nothing
            assert_same_bits(load_checkpoint(directory), states[st.version])
        applied = rx.apply(log, verify="full")
        assert applied == list(range(st.version + 1, VERSIONS + 1))
    assert_same_bits(load_checkpoint(directory), states[VERSIONS])
    if budget == "large" and point in ("applied", "before_commit", "committed"):
        assert unsynced > 0  # the model did lose written pages
    kept = [k for k in stages if k.get("wal")]
    if budget == "small":
        assert not kept
    elif budget == "medium":
        assert kept and any(k["clear_wal"] for k in kept) or point in ("inflight", "layout", "layout_file")
    else:
        assert kept and not any(k["clear_wal"] for k in stages)


def test_power_loss_after_each_version_of_a_follow(tmp_path, monkeypatch, logged):
    """A receiver that loses power after every joint commit (the images of several versions
    restored in order, over a layout change) keeps every version's bits."""
    log, states = logged
    model = PowerLossModel(monkeypatch, seed=5)
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000)
    lost = 0
    for v in range(1, VERSIONS + 1):
        with reopen(directory) as rx:
            assert rx.apply(log, to=v) == [v]
        lost += model.lose_power(directory)
        with reopen(directory) as rx:
            assert rx.apply(log, to=v) == []
        assert_same_bits(load_checkpoint(directory), states[v])
    assert lost > 0


def test_images_are_dropped_only_once_every_file_is_synced(tmp_path, monkeypatch):
    """A process writes one file and dies (same boot: nothing is restored); the next writes
    only the other file and drops every image when they outgrow the budget. The first
    process's words must be synced too before their images go."""
    rng = np.random.default_rng(3)
    state = make_state(rng, {"a": ("F32", (64, 64)), "b": ("F32", (64, 64))})
    states = [copy_state(state)]
    writer = LogWriter.create(tmp_path / "log", state, policy=EncodePolicy(chunk_elements=256))
    for changed in ("a", "b"):
        state = dict(state)
        state[changed] = change_words(rng, state[changed], 0.5)
        writer.append(state)
        states.append(copy_state(state))
    log = DeltaLog.open(tmp_path / "log")
    model = PowerLossModel(monkeypatch, seed=1)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint(states[0], directory, shard_bytes=20000)  # "a" and "b" in two files
    with Receiver.open(directory) as rx:
        rx.bind(log, 0)
        assert rx.apply(log, to=1) == [1]
    assert model.unsynced_pages(directory) > 0 and Journal.peek(directory / ".dcr").version == 1
    monkeypatch.setattr(batch_module, "WAL_MIN_BYTES", 1)  # version 2 drops version 1's images
    with Receiver.open(directory) as rx:
        assert rx.apply(log) == [2]
        assert rx.journal.wal_boot() is None  # version 2's own batch was too large to keep
    model.lose_power(directory)
    with Receiver.open(directory) as rx:
        assert rx.apply(log) == []
    assert_same_bits(load_checkpoint(directory), states[2])


@pytest.mark.parametrize("rate", [0.5, 0.2, 0.07, 0.05, 0.02, 0.01, 0.001, 1e-5])
def test_spread_changes_take_at_most_the_estimated_image_bytes(rate):
    """The estimate that decides whether a version keeps its images holds for changes at
    random positions, in records as large as the writer's chunks: gaps of the kind it
    counts hold the longest gap."""
    from dcr_log.receiver.journal_entries import encode_wal_image

    rng = np.random.default_rng(int(rate * 1e6))
    for n in (1 << 12, 1 << 16, 1 << 22):
        where = np.flatnonzero(rng.random(n) < rate)
        if where.size < 2:
            continue
        words = np.zeros(where.size, np.uint16)
        # The image's positions and words (an empty image is its header), less the first
        # position's 8 bytes, which the estimate leaves out.
        taken = len(encode_wal_image("w", where, words)) - len(encode_wal_image("w", where[:0], words[:0]))
        assert taken - 8 <= batch_module.wal_image_spread_bytes(where.size, n, 2), (n, where.size)


@pytest.mark.parametrize("kept", [True, False])
def test_a_version_keeps_its_images_by_the_bytes_its_gaps_take(tmp_path, monkeypatch, kept):
    """A version changing a fifth of its words, spread: its images take 1-byte gaps and the
    words (3 bytes a change), half what 4-byte positions would. With a budget between the
    two it keeps them (the files stay unsynced, and a power loss loses nothing); below the
    smaller, its batches are synced as they are written."""
    rng = np.random.default_rng(11)
    state = make_state(rng, {"w": ("BF16", (200, 100))})
    new = {"w": change_words(rng, state["w"], 0.2)}
    writer = LogWriter.create(tmp_path / "log", state)
    changed = writer.append(new).stats.changed_elements
    log = DeltaLog.open(tmp_path / "log")
    model = PowerLossModel(monkeypatch, seed=2)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint(state, directory)
    with Receiver.open(directory) as rx:
        rx.bind(log, 0)
    model.lose_power(directory)  # bound and on disk
    budget = changed * (9 if kept else 5) // 2  # the model's quarter (10 KB) is below both
    monkeypatch.setattr(batch_module, "WAL_MIN_BYTES", budget)
    with Receiver.open(directory) as rx:
        assert rx.apply(log) == [1]
        held = rx.journal.wal_bytes()
    if kept:
        assert 0 < held <= budget and model.unsynced_pages(directory) > 0
    else:
        assert held == 0 and model.unsynced_pages(directory) == 0
    model.lose_power(directory)
    with Receiver.open(directory) as rx:
        assert rx.apply(log) == []
    assert_same_bits(load_checkpoint(directory), {"w": new["w"]})


def test_images_restore_only_after_a_restart(tmp_path, monkeypatch, logged):
    """In the boot that wrote them the page cache holds the words: opening reads no image.
    After a restart every image is checked and the differing words written back."""
    log, states = logged
    model = PowerLossModel(monkeypatch, seed=2)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        assert rx.apply(log, to=2) == [1, 2]
        assert rx.journal.wal_boot() == model.boot and rx.journal.wal_bytes() > 0
    reads = []
    real = Journal.wal_images
    monkeypatch.setattr(Journal, "wal_images", lambda self: reads.append(1) or real(self))
    with reopen(directory) as rx:
        assert rx.apply(log, to=3) == [3]
    assert reads == []
    model.lose_power(directory)
    with reopen(directory) as rx:
        assert rx.apply(log, to=3) == []  # restored; nothing applied, so the journal is not written
    assert reads == [1, 1]  # checked, then written
    assert_same_bits(load_checkpoint(directory), states[3])
    with reopen(directory) as rx:  # the images are checked again, and this apply's begin records the boot
        assert rx.apply(log, to=4) == [4]
        assert rx.journal.wal_boot() == model.boot
    assert reads == [1] * 4
    with reopen(directory) as rx:
        assert rx.apply(log) == [5]
    assert reads == [1] * 4
    assert_same_bits(load_checkpoint(directory), states[5])


def test_a_format_2_journal_restores_and_is_upgraded(tmp_path, monkeypatch, logged):
    """A journal written before images had gaps (format 2: every image's positions 4 bytes
    each) is restored after a power loss, and its next write makes it format 3."""
    import lmdb

    from dcr_log.receiver import journal_entries as je
    from dcr_log.receiver.journal_entries import SumTxn

    log, states = logged
    model = PowerLossModel(monkeypatch, seed=3)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        assert rx.apply(log, to=2) == [1, 2]
    env = lmdb.open(str(directory / ".dcr"), subdir=True)
    kinds = set()
    with env.begin(write=True, buffers=True) as raw:
        txn = SumTxn(raw)
        for key, value in [(bytes(k), bytes(v)) for k, v in raw.cursor() if bytes(k).startswith(je.WAL_PREFIX)]:
            image = je.decode_wal_image(key[len(je.WAL_PREFIX):], value)
            kinds.add(value[2 + len(image.tensor.encode()) + 1])
            if isinstance(image.where, slice):
                continue
            # as format 2 laid it: the u8 kind 4, then the positions as u32
            name = image.tensor.encode()
            txn.put(key, struct.pack("<H", len(name)) + name + struct.pack("<BBQ", image.words.itemsize, 4,
                                                                          image.words.size)
                    + np.asarray(image.where).astype("<u4").tobytes() + image.words.tobytes())
        txn.put(je.K_FORMAT, je.FORMAT_2)
        txn.seal()
    env.close()
    assert kinds & {1, 2}  # the rewrite changed images with gaps
    model.lose_power(directory)
    model.boot = b"another boot"
    with reopen(directory) as rx:
        assert rx.apply(log, to=3) == [3]
        assert rx.journal.wal_boot() == model.boot
    assert_same_bits(load_checkpoint(directory), states[3])
    env = lmdb.open(str(directory / ".dcr"), subdir=True, readonly=True)
    with env.begin() as txn:
        assert txn.get(je.K_FORMAT) == je.JOURNAL_FORMAT
    env.close()


def test_without_deferred_sync_every_batch_is_synced(tmp_path, monkeypatch, logged):
    """deferred_sync=False: no image is kept, nothing is left unsynced after a version, and
    images kept by an earlier deferred-sync apply are dropped once synced."""
    log, states = logged
    model = PowerLossModel(monkeypatch)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with Receiver.open(directory, deferred_sync=False) as rx:
        assert rx.apply(log, to=2) == [1, 2]
        assert rx.journal.wal_boot() is None
    assert model.unsynced_pages(directory) == 0
    with Receiver.open(directory) as rx:
        assert rx.apply(log, to=3) == [3]
        assert rx.journal.wal_bytes() > 0
    assert model.unsynced_pages(directory) > 0
    # Opened without deferred sync over kept images: they are synced and dropped first
    # (restored after a power loss, they would put back version 3's words over version 4's).
    with Receiver.open(directory, deferred_sync=False) as rx:
        assert rx.apply(log, to=4) == [4]
        assert rx.journal.wal_boot() is None
    assert model.unsynced_pages(directory) == 0
    model.lose_power(directory)
    with Receiver.open(directory) as rx:
        assert rx.apply(log) == [5]
    assert_same_bits(load_checkpoint(directory), states[5])


@pytest.mark.parametrize("damage", ["unreadable", "unknown tensor", "past the tensor"])
def test_a_damaged_image_is_refused_before_any_write(tmp_path, monkeypatch, logged, damage):
    """An image that does not parse (found when the journal is first read), or that names a
    tensor the storage lacks or positions past it (found when restoring), is refused with
    IntegrityError before a byte of the directory is written."""
    import lmdb

    from dcr_log.errors import IntegrityError
    from dcr_log.receiver.journal_entries import WAL_PREFIX, SumTxn, encode_wal_image

    log, states = logged
    model = PowerLossModel(monkeypatch)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        assert rx.apply(log, to=2) == [1, 2]
    model.lose_power(directory)  # some words to restore
    bad = {"unreadable": b"\x00",
           "unknown tensor": encode_wal_image("nope", np.arange(3), np.zeros(3, np.uint16)),
           "past the tensor": encode_wal_image("w.a", np.arange(64 * 48 - 1, 64 * 48 + 1),
                                               np.zeros(2, np.uint16))}[damage]
    env = lmdb.open(str(directory / ".dcr"), subdir=True)
    with env.begin(write=True, buffers=True) as raw:
        txn = SumTxn(raw)
        # The last image: those before it are checked and restorable, and must not be written.
        key = [bytes(k) for k in raw.cursor().iternext(values=False) if bytes(k).startswith(WAL_PREFIX)][-1]
        txn.put(key, bad)
        txn.seal()
    env.close()
    model.boot = b"another boot"  # a restart: the images are restored
    before = {p: p.read_bytes() for p in directory.glob("*.safetensors")}
    with pytest.raises(IntegrityError):
        with Receiver.open(directory) as rx:
            rx.apply(log)
    assert {p: p.read_bytes() for p in directory.glob("*.safetensors")} == before


def test_layout_change_drops_earlier_images(tmp_path, monkeypatch, logged):
    """A version that changes the tensor table syncs and drops the images before its files
    are rewritten: none is ever put back into a tensor of another shape."""
    log, states = logged
    PowerLossModel(monkeypatch)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        assert rx.apply(log, to=LAYOUT_VERSION - 1) == list(range(1, LAYOUT_VERSION))
        assert list(rx.journal.wal_images())
        assert rx.apply(log, to=LAYOUT_VERSION) == [LAYOUT_VERSION]
        assert {i.version for i in rx.journal.wal_images()} == {LAYOUT_VERSION}
    assert_same_bits(load_checkpoint(directory), states[LAYOUT_VERSION])


def test_a_failed_sync_makes_the_next_start_restore(tmp_path, monkeypatch, logged):
    """A write-back error reported by msync (EIO: the kernel may have dropped written words
    from its page cache) fails the apply with StoreError and leaves the images to be
    restored at the next start, in the same boot too."""
    import errno

    from dcr_log.errors import StoreError

    log, states = logged
    model = PowerLossModel(monkeypatch, seed=4)
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        assert rx.apply(log, to=1) == [1]
    monkeypatch.setattr(batch_module, "WAL_MIN_BYTES", 1)  # version 2 syncs version 1's images first

    def failing(mapped):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(np.memmap, "flush", failing)
        with reopen(directory) as rx, pytest.raises(StoreError, match="cannot sync"):
            rx.apply(log, to=2)
    st = Journal.peek(directory / ".dcr")
    assert st.version == 1 and st.wal_boot == b""
    reads = []
    real = Journal.wal_images
    monkeypatch.setattr(Journal, "wal_images", lambda self: reads.append(1) or real(self))
    model.lose_power(directory)
    model.boot = b"boot-0"  # the same boot as the failed sync
    with reopen(directory) as rx:
        assert rx.apply(log) == [2, 3, 4, 5]
    assert reads == [1, 1]
    assert_same_bits(load_checkpoint(directory), states[VERSIONS])


def spread_positions(rng: np.random.Generator, count: int, top: int, most_gap: int | None) -> np.ndarray:
    """``count`` strictly increasing flat positions below ``top``; with ``most_gap``, the gaps
    between them (position i - position i-1 - 1) at most that, one of them exactly that."""
    if most_gap is None or count == 0:
        return np.sort(rng.choice(top, count, replace=False)).astype(np.int64) if count else np.zeros(0, np.int64)
    gaps = rng.integers(0, most_gap, count, endpoint=True, dtype=np.int64)
    if count >= 2:
        gaps[rng.integers(1, count)] = most_gap
    first = int(rng.integers(0, top))
    gaps[0] = 0
    return first + np.cumsum(gaps + 1) - 1


@settings(max_examples=300, deadline=None)
@given(name=st.text(min_size=1, max_size=8), width=st.sampled_from([1, 2, 4, 8]), count=st.integers(0, 40),
       kind=st.sampled_from(["span", "u1", "u2", "u4", "u8", "unsorted"]), start=st.integers(0, 1 << 40),
       lead=st.integers(0, 9), seed=st.integers(0, 2**32 - 1), floats=st.booleans(), edge=st.booleans(),
       c_path=st.booleans())
def test_an_image_laid_into_a_buffer_is_the_image(name, width, count, kind, start, lead, seed, floats, edge,
                                                  c_path):
    """A batch lays its images into a reused buffer: each must be exactly the bytes
    RECEIVER.md 5.6 lays out (whatever an earlier batch left there), with the smallest kind
    that holds its positions, and nothing outside it is touched. Words given in a float
    dtype (NaN payloads, -0.0 among random bits) are kept as bits, not converted. The same
    bytes from the C module's gaps (``c_path``, where it is built) as from numpy's."""
    from dcr_log import native

    with pytest.MonkeyPatch.context() as patch:
        if not c_path:
            patch.setattr(native, "changes", None)
        _check_image_laid(name, width, count, kind, start, lead, seed, floats, edge)


def _check_image_laid(name, width, count, kind, start, lead, seed, floats, edge):
    from dcr_log.receiver.journal_entries import decode_wal_image, encode_wal_image, wal_image_bound

    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 63, count, dtype=np.uint64).astype(f"<u{width}")
    if floats and width > 1:
        words[:1] = np.array(-0.0, f"<f{width}").view(f"<u{width}")  # and NaNs among the random bits
        words = words.view(f"<f{width}")
    if kind == "span":
        where: slice | np.ndarray = slice(start, start + count)
    elif kind in ("u1", "u2"):  # gaps up to the kind's largest, or one past it (edge)
        most = (1 << (8 if kind == "u1" else 16)) - 1 + edge
        where = spread_positions(rng, count, 1 << 40, most)
    elif kind == "unsorted":  # close together, but not increasing: no gaps
        where = rng.permutation(spread_positions(rng, count, 1 << 20, 3))
    else:
        where = spread_positions(rng, count, (1 << 32) if kind == "u4" else (1 << 48), None)
    whole = bytes(encode_wal_image(name, where, words))
    # The bytes RECEIVER.md 5.6 lays out, built here from its words (u16 n, the name, u8 width,
    # u8 kind, u64 count, the positions, the words).
    raw = name.encode()
    if kind == "span":
        kind_byte, located = 0, struct.pack("<Q", start)
    else:
        gaps = np.diff(where) - 1
        if count >= 2 and int(gaps.min()) >= 0 and int(gaps.max()) < (1 << 16):
            kind_byte = 1 if int(gaps.max()) < (1 << 8) else 2
            located = struct.pack("<Q", int(where[0])) + gaps.astype(f"<u{kind_byte}").tobytes()
        else:
            kind_byte = 4 if count == 0 or int(where.max()) < (1 << 32) else 8
            located = where.astype(f"<u{kind_byte}").tobytes()
    assert whole == (struct.pack("<H", len(raw)) + raw + struct.pack("<BBQ", width, kind_byte, count) + located
                     + words.tobytes())
    bound = wal_image_bound(name, count, width)
    assert bound >= len(whole)
    buffer = rng.integers(0, 256, lead + bound + 7, dtype=np.uint8)  # an earlier batch's bytes
    before = buffer.copy()
    laid = encode_wal_image(name, where, words, buffer[lead:lead + bound])
    assert bytes(laid) == whole
    assert np.array_equal(buffer[:lead], before[:lead]) and np.array_equal(buffer[lead + len(whole):],
                                                                          before[lead + len(whole):])
    image = decode_wal_image(b"00000001/00000002/00000003", whole)
    assert image.tensor == name and image.words.tobytes() == words.tobytes()
    if kind == "span":
        assert image.where == where
    else:
        assert np.array_equal(np.asarray(image.where, np.int64), where)


@pytest.mark.parametrize("damage", ["count past the bytes", "gaps cut short", "gaps of no position",
                                    "unknown kind", "wrapping gaps"])
def test_a_damaged_image_with_gaps_is_refused(damage):
    """Images with gaps (kinds 1 and 2) that do not parse are IntegrityError, not a crash or
    an allocation of their count; gaps that wrap past 2^64 give a position no tensor holds."""
    from dcr_log.errors import IntegrityError
    from dcr_log.receiver.journal_entries import decode_wal_image, encode_wal_image

    where = np.array([5, 9, 10, 300], np.int64)
    image = bytearray(encode_wal_image("w", where, np.arange(4, dtype=np.uint16)))
    kind_at = 2 + 1 + 1  # u16 n, the name, u8 width: the kind
    assert image[kind_at] == 2
    if damage == "wrapping gaps":
        image[kind_at + 9:kind_at + 17] = struct.pack("<Q", (1 << 64) - 2)  # the first position
        got = decode_wal_image(b"00000001/00000002/00000003", bytes(image))
        assert int(np.asarray(got.where).max()) >= (1 << 64) - 2  # refused by any tensor's size
        return
    if damage == "count past the bytes":
        image[kind_at + 1:kind_at + 9] = struct.pack("<Q", 1 << 60)
    elif damage == "gaps cut short":
        del image[-3:]
    elif damage == "gaps of no position":
        image[kind_at + 1:kind_at + 9] = struct.pack("<Q", 0)
        del image[kind_at + 9:]
    else:
        image[kind_at] = 3
    with pytest.raises(IntegrityError):
        decode_wal_image(b"00000001/00000002/00000003", bytes(image))


def test_the_image_buffer_is_kept_for_the_next_version(tmp_path, monkeypatch, logged):
    """The buffer a batch's images are laid into is lent back after the stage and serves the
    next version's batches, also those of another receiver (a fresh buffer per image made
    the C heap fault its pages in again at every version); one above IMAGE_BUFFER_KEEP bytes
    is not kept. The power-loss tests above check the images themselves."""
    log, states = logged
    monkeypatch.setattr(batch_module, "_image_buffer", None)
    lent: list[tuple[int, int, np.ndarray]] = []  # (receiver, bytes asked, buffer)
    real_borrow = batch_module.borrow_image_buffer
    receiver = 0
    monkeypatch.setattr(batch_module, "borrow_image_buffer",
                        lambda n: lent.append((receiver, n, real_borrow(n))) or lent[-1][2])
    for receiver, name in enumerate(("one", "two")):  # noqa: B007 (the borrow above reads it)
        directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000, name=name)
        with reopen(directory) as rx:
            assert rx.apply(log, to=2) == [1, 2]
        assert_same_bits(load_checkpoint(directory), states[2])
    kept: np.ndarray | None = None
    for _, n, buffer in lent:
        assert buffer.size >= n
        if kept is not None and kept.size >= n:
            assert buffer is kept
        elif kept is not None:
            assert buffer is not kept
        kept = buffer if kept is None or kept.size < buffer.size else kept
    assert batch_module._image_buffer is kept
    # The second receiver's batches were laid into the first one's buffer.
    assert any(r == 1 and buffer is first for r, _, buffer in lent for s, _, first in lent if s == 0)

    monkeypatch.setattr(batch_module, "_image_buffer", None)
    monkeypatch.setattr(batch_module, "IMAGE_BUFFER_KEEP", 16)
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000, name="three")
    with reopen(directory) as rx:
        assert rx.apply(log, to=2) == [1, 2]
    assert batch_module._image_buffer is None
    assert_same_bits(load_checkpoint(directory), states[2])


def test_images_laid_on_the_pool_are_each_records_own(tmp_path, monkeypatch, logged):
    """A batch's images are laid into the buffer by the pool's threads, each at its own offset:
    after an apply the journal holds, for every changed word of the version, its position and
    its new bits, and every image's words are the new state's at its positions (an image laid
    at another's offset would overwrite that one's bytes, or leave a hole that does not parse)."""
    log, states = logged
    # Every batch on the pool, a record per task, however few its changes.
    monkeypatch.setattr(batch_module, "pool_pays", lambda changes, records: True)
    monkeypatch.setattr(batch_module, "TASK_CHANGES", 1)
    threads: set[int] = set()
    real = batch_module.encode_wal_image
    monkeypatch.setattr(batch_module, "encode_wal_image",
                        lambda *args: threads.add(threading.get_ident()) or real(*args))
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000)
    with reopen(directory) as rx:
        assert rx.apply(log, to=1) == [1]
        # (An image is a view of the journal's pages, valid until the next is read: copied.)
        images = [(i.version, i.tensor, i.where if isinstance(i.where, slice) else i.where.copy(),
                   i.words.copy()) for i in rx.journal.wal_images()]
    assert threads - {threading.get_ident()}, "no image was laid on the pool"
    assert images and {version for version, *_ in images} == {1}
    covered: dict[str, list[np.ndarray]] = {}
    for _, tensor, where, words in images:
        new = states[1][tensor].words.reshape(-1)
        positions = np.arange(new.size)[where]
        assert np.array_equal(new[positions].view(words.dtype), words), tensor
        covered.setdefault(tensor, []).append(positions)
    for name, before in states[0].items():
        after = states[1][name].words.reshape(-1)
        changed = np.flatnonzero(before.words.reshape(-1) != after)
        assert np.isin(changed, np.concatenate(covered.get(name, [np.empty(0, np.int64)]))).all(), name


def test_a_forked_child_borrows_an_image_buffer_even_with_the_lock_held_at_the_fork(monkeypatch):
    """Engines fork workers: a child forked while another thread held the buffer's lock gets
    a fresh lock and no buffer (it would otherwise wait forever at its first batch)."""
    import os
    import signal

    monkeypatch.setattr(batch_module, "_image_buffer", np.zeros(64, np.uint8))
    lock = batch_module._image_buffer_lock
    with lock:
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if borrowing works and lends no parent's buffer
            signal.alarm(10)
            try:
                buffer = batch_module.borrow_image_buffer(32)
                status = 0 if buffer.size >= 32 and batch_module._image_buffer is None else 3
            except BaseException:
                status = 4
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
