"""The receiver journal's checksum (RECEIVER.md section 4): a damaged journal, LMDB's file or an
entry, is refused with a typed error before any byte of the receiver or its journal changes;
a journal written without a checksum (format 1) still applies and gets one."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import lmdb
import pytest

from dcr_log import DeltaLog
from dcr_log.errors import DcrError, IntegrityError, StoreError
from dcr_log.receiver import Receiver, open_directory
from dcr_log.receiver import journal as jm
from dcr_log.receiver import journal_entries as je
from dcr_log.receiver import journal_pages as jp
from helpers import snapshot_files
from test_receiver import build_log


class Stop(Exception):
    pass


@pytest.fixture(scope="module", params=["redo", "wal"])
def template(tmp_path_factory, request):
    """A log of 5 versions and a checkpoint receiver at version 2 interrupted inside version 3
    after a batch with redo images was staged (redo images, segment progress, files, in
    flight); or, under deferred sync, one that applied version 2 and was interrupted likewise
    (deferred-sync images and their boot entry instead of redo images)."""
    root = tmp_path_factory.mktemp("journal-sum")
    log, states = build_log(root / "log", versions=5)
    rx = root / "rx"
    deferred = request.param == "wal"
    with open_directory(log, rx, to=1 if deferred else 2) as receiver:
        if deferred:
            receiver.apply(log, to=2)

    def crash(name, **info):
        if name == "redo" and info["segment"] >= 1 and receiver.journal.redo_images(info["segment"]):
            raise Stop()

    with Receiver.open(rx, fault=crash, deferred_sync=deferred) as receiver, pytest.raises(Stop):
        receiver.apply(log, to=3)
    entries = read_entries(rx / ".dcr")
    assert entries[b"inflight"] and any(k.startswith(b"seg/") for k in entries)
    images = [k for k in entries if k.startswith(b"wal/" if deferred else b"redo/")]
    assert images and je.K_CHECKSUM in entries
    if deferred:
        assert je.K_WAL_BOOT in entries  # version 3 changes the table: only its own images
    return root, log, states


def read_entries(jdir: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(jdir), readonly=True, lock=False, subdir=True)
    try:
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def rewrite(jdir: Path, edit) -> None:
    """Change the journal through LMDB itself (``edit(txn)``), then drop LMDB's lock file: it is
    the editor's, not the receiver's."""
    env = lmdb.open(str(jdir), map_size=1 << 26, subdir=True)
    with env.begin(write=True) as txn:
        edit(txn)
    env.close()
    (jdir / "lock.mdb").unlink(missing_ok=True)


@pytest.fixture
def copy(template, tmp_path):
    root, log, states = template
    rx = tmp_path / "rx"
    shutil.copytree(root / "rx", rx)
    (rx / ".dcr" / "lock.mdb").unlink(missing_ok=True)
    return log, states, rx


def assert_refused(log: DeltaLog, rx: Path, errors=(IntegrityError, StoreError)) -> DcrError:
    before = snapshot_files(rx)
    with pytest.raises(DcrError) as info:
        with Receiver.open(rx) as receiver:
            receiver.apply(log)
    assert isinstance(info.value, errors), info.value
    assert snapshot_files(rx) == before  # lock.mdb and data.mdb included
    return info.value


def flip(data: bytes, i: int) -> bytes:
    out = bytearray(data)
    out[i % len(out)] ^= 1 << (i % 8)
    return bytes(out)


def test_undamaged_copy_recovers_and_applies(copy):
    log, states, rx = copy
    with Receiver.open(rx) as receiver:
        receiver.apply(log)
        assert receiver.version == 5
    entries = read_entries(rx / ".dcr")
    assert entries[je.K_FORMAT] == je.JOURNAL_FORMAT
    with Receiver.open(rx) as receiver:
        assert receiver.version == 5


def test_every_entry_flipped_is_refused(copy, tmp_path):
    log, states, rx = copy
    jdir = rx / ".dcr"
    entries = read_entries(jdir)
    pristine = tmp_path / "pristine"
    shutil.copytree(rx, pristine)
    cases = 0
    for key, value in sorted(entries.items()):
        for i in sorted({0, len(value) // 2, len(value) - 1, 8 * len(value) - 1}):
            if not value:
                break
            shutil.rmtree(rx)
            shutil.copytree(pristine, rx)
            rewrite(jdir, lambda txn: txn.put(key, flip(value, i)))
            exc = assert_refused(log, rx)
            assert "is damaged" in str(exc) and str(jdir) in str(exc), exc
            cases += 1
        # the key itself (its last bit), and the entry gone
        for edit in (lambda txn: (txn.delete(key), txn.put(flip(key, 8 * len(key) - 1), value)),
                     lambda txn: txn.delete(key)):
            shutil.rmtree(rx)
            shutil.copytree(pristine, rx)
            rewrite(jdir, edit)
            assert "is damaged" in str(assert_refused(log, rx))
            cases += 1
    assert cases > 30


def _resealed(txn, total_of=None):
    """Store the checksum entry again with the id of the transaction writing it (so only the
    sum can find what changed); ``total_of`` recomputes the sum too (only the id is stale)."""
    stored = je._parse_checksum(txn.get(je.K_CHECKSUM))
    total = stored[0] if total_of is None else total_of(txn)
    txn.put(je.K_CHECKSUM, je._checksum_value(total, txn.id() if total_of is None else stored[1] + 5))


def test_the_sum_and_the_transaction_id_are_each_checked(copy, tmp_path):
    log, states, rx = copy
    jdir = rx / ".dcr"
    entries = read_entries(jdir)
    redo = next(k for k in entries if k.startswith((je.REDO_PREFIX, je.WAL_PREFIX)))
    pristine = tmp_path / "pristine"
    shutil.copytree(rx, pristine)
    for key in (je.K_CURRENT, je.K_INFLIGHT, redo):
        shutil.rmtree(rx)
        shutil.copytree(pristine, rx)

        def edit(txn, key=key):
            txn.put(key, flip(entries[key], 3))
            _resealed(txn)

        rewrite(jdir, edit)
        assert "do not match their checksum" in str(assert_refused(log, rx))
    # Every entry as it was, the sum right, the transaction id another one's: an older LMDB
    # snapshot read in place of the newest one.
    shutil.rmtree(rx)
    shutil.copytree(pristine, rx)
    rewrite(jdir, lambda txn: _resealed(txn, total_of=je._entries_sum))
    assert "transaction" in str(assert_refused(log, rx))


def test_raw_bit_flips_of_data_mdb(copy, tmp_path):
    """One bit flipped at every byte of LMDB's meta pages' fields and of every used byte of the
    journal's pages: refused before any byte changes, or (a bit LMDB does not use) read as the
    same entries and applied."""
    log, states, rx = copy
    jdir = rx / ".dcr"
    data = (jdir / "data.mdb").read_bytes()
    entries = read_entries(jdir)
    psize = struct.unpack_from("<I", data, 40)[0]
    positions = [p * psize + i for p in (0, 1) for i in range(16, 152)]
    for page in sorted(jp.check_pages(jdir)):  # the pages in use (free ones may hold anything)
        pgno, _, flags, lower, upper = struct.unpack_from("<QHHHH", data, page * psize)
        if pgno != page:  # a page of a large value after its first: the value's bytes
            used = range(0, psize, 331)
        elif flags == jp._P_OVERFLOW:
            used = [*range(8), *range(10, 16), *range(16, psize, 331)]
        else:  # the header (but its unused pad, bytes 8 and 9), pointers and nodes
            used = [*range(8), *range(10, lower)]
            for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", data, page * psize + 16):
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, page * psize + ptr)
                dsize = 0 if flags == jp._P_BRANCH else 8 if nflags else lo | hi << 16
                used += range(ptr, ptr + 8 + ksize + dsize)
        positions += [page * psize + i for i in used]
    work = tmp_path / "work"
    outcomes = {"refused": 0, "same": 0}
    for n, pos in enumerate(positions):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(jdir, work)
        damaged = bytearray(data)
        damaged[pos] ^= 1 << (n % 8)
        (work / "data.mdb").write_bytes(damaged)
        before = snapshot_files(work)
        j = jm.Journal.open(work)
        try:
            j.state(), j.progress(), j.files()
        except (IntegrityError, StoreError):
            outcomes["refused"] += 1
            assert snapshot_files(work) == before, pos
            continue
        finally:
            j.close()
        assert read_entries(work) == entries, pos
        (work / "lock.mdb").unlink(missing_ok=True)
        outcomes["same"] += 1
        # Only a meta page may hold bits that do not matter (the older one, the map size).
        assert pos < 2 * psize, pos
    assert outcomes["refused"] > 1000, outcomes
    # A sample of them through a whole apply.
    pristine = tmp_path / "pristine"
    shutil.copytree(rx, pristine)
    for n, pos in enumerate(positions[:: max(1, len(positions) // 25)]):
        shutil.rmtree(rx)
        shutil.copytree(pristine, rx)
        damaged = bytearray(data)
        damaged[pos] ^= 1 << (n % 8)
        (jdir / "data.mdb").write_bytes(damaged)
        before = snapshot_files(rx)
        try:
            with Receiver.open(rx) as receiver:
                receiver.apply(log)
        except DcrError as exc:
            assert isinstance(exc, (IntegrityError, StoreError)), exc
            assert snapshot_files(rx) == before, pos


def _legacy(jdir: Path) -> None:
    """The journal as the code before the checksum wrote it: format 1, no checksum entry."""
    def edit(txn):
        txn.delete(je.K_CHECKSUM)
        txn.put(je.K_FORMAT, je.LEGACY_FORMAT)
    rewrite(jdir, edit)


def test_legacy_journal_applies_and_gets_its_checksum(copy):
    log, states, rx = copy
    jdir = rx / ".dcr"
    _legacy(jdir)
    assert je.K_CHECKSUM not in read_entries(jdir)
    assert jm.Journal.peek(jdir).inflight == 3
    with Receiver.open(rx) as receiver:
        receiver.apply(log, to=4)
    entries = read_entries(jdir)
    assert entries[je.K_FORMAT] == je.JOURNAL_FORMAT and je.K_CHECKSUM in entries
    with Receiver.open(rx) as receiver:  # verified on open, now with its checksum
        receiver.apply(log)
        assert receiver.version == 5


def test_legacy_journal_is_checked_structurally(copy, tmp_path):
    log, states, rx = copy
    jdir = rx / ".dcr"
    _legacy(jdir)
    pristine = tmp_path / "pristine"
    shutil.copytree(rx, pristine)
    for edit in (lambda txn: txn.put(b"zz", b"1"),                       # an unknown entry
                 lambda txn: txn.put(b"seg/0000000x", b"{}"),            # a malformed key
                 lambda txn: txn.put(je.K_CURRENT, b'{"version":"x"}'),
                 lambda txn: txn.put(je.K_PLACEMENT, b"not a digest")):
        shutil.rmtree(rx)
        shutil.copytree(pristine, rx)
        rewrite(jdir, edit)
        assert_refused(log, rx, IntegrityError)
        assert je.K_CHECKSUM not in read_entries(jdir)


def test_format_2_without_its_checksum_is_refused(copy):
    log, states, rx = copy
    rewrite(rx / ".dcr", lambda txn: txn.delete(je.K_CHECKSUM))
    assert "missing" in str(assert_refused(log, rx, IntegrityError))


def test_status_verifies_too(copy):
    log, states, rx = copy
    jdir = rx / ".dcr"
    rewrite(jdir, lambda txn: txn.put(je.K_CURRENT, flip(txn.get(je.K_CURRENT), 5)))
    with pytest.raises(IntegrityError, match="is damaged"):
        jm.Journal.peek(jdir)


def test_a_transaction_hashes_only_what_it_changes(tmp_path, monkeypatch):
    """The per-transaction cost: a write hashes the entries it puts and deletes, not the
    journal (here 64 MiB of redo images stay in it while other entries change)."""
    j = jm.Journal.open(tmp_path / "j")
    j.bind("L", 1, 7)
    j.begin(2)
    big = os.urandom(1 << 20)
    j.stage(0, 0, 64, {r: big for r in range(64)})
    hashed = []
    real = je.entry_hash
    monkeypatch.setattr(je, "entry_hash", lambda k, v: hashed.append(len(v)) or real(k, v))
    j.stage(1, 0, 1, {})
    assert sum(hashed) < 1000, hashed
    hashed.clear()
    j.mark_applied(0, 64, 64, range(64))
    assert sum(hashed) == 64 << 20 or sum(hashed) < (64 << 20) + 1000
    j.close()
    j = jm.Journal.open(tmp_path / "j")
    assert j.progress()[0].done == 64 and j.redo_images(0) == {}
    j.close()
