"""The receiver journal: one LMDB environment per receiver (spec/RECEIVER.md, "Journal").

It holds the log identity, the current (version, state digest), the version in flight, per
segment how far that version got, and the redo images of the batch being written. Every
write is one synced LMDB transaction; the apply protocol batches them per segment.

LMDB pages carry no checksums, so the journal keeps its own: the ``checksum`` entry holds the
sum (mod 2**64) of one keyed xxh3 per entry and the id of the transaction that wrote it, and
every write transaction updates it with the entries it changes. It is verified, with the
structure of every entry, when the journal is first read, so a damaged journal is refused
(IntegrityError) before anything is written. A journal of format 1 (no checksum) is checked
structurally and gets its checksum, and format 2, at its next write transaction.

The environment is opened lazily: until the first write it is read without LMDB's lock file
(safe because the receiver lock, taken first, keeps every writer out), so a command that
refuses before writing leaves every byte of the journal directory as it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import xxhash

from dcr_log.errors import IntegrityError, NotFoundError, StoreError, UsageError, os_error
from dcr_log.format import file_name_problem
from dcr_log.format.tensors import digest_hex

JOURNAL_FORMAT = b"dcr-receiver-journal/2"
# Written before the journal had a checksum: still read, and upgraded at its next write.
LEGACY_FORMAT = b"dcr-receiver-journal/1"
LOCK_NAME = "receiver.lock"
DATA_NAME = "data.mdb"
# The map starts small (address space only: LMDB grows the file as pages are used) and grows
# on demand: a transaction that finds the map full is retried on a map twice as large (or as
# large as the transaction needs), up to MAX_MAP_SIZE. So a receiver runs under ``ulimit -v``.
MAP_SIZE = 1 << 26
MAX_MAP_SIZE = 1 << 40
LMDB_FILES = (DATA_NAME, "lock.mdb", LOCK_NAME)

K_FORMAT = b"format"
K_LOG_ID = b"log_id"
K_CURRENT = b"current"
K_INFLIGHT = b"inflight"
K_MATERIALIZING = b"materializing"
K_PLACEMENT = b"placement"
K_FILES = b"files"
K_CHECKSUM = b"checksum"
SEG_PREFIX = b"seg/"
REDO_PREFIX = b"redo/"
_KEYS = frozenset((K_FORMAT, K_LOG_ID, K_CURRENT, K_INFLIGHT, K_MATERIALIZING, K_PLACEMENT, K_FILES))
_KEY_PATTERN = re.compile(rb"seg/[0-9]{8}|redo/[0-9]{8}/[0-9]{8}")
_MASK = (1 << 64) - 1


def _seg_key(segment: int) -> bytes:
    return SEG_PREFIX + b"%08d" % segment


def _redo_key(segment: int, record: int) -> bytes:
    return REDO_PREFIX + b"%08d/%08d" % (segment, record)


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def entry_hash(key: bytes, value) -> int:
    """One entry's share of the checksum: xxh3_64 (seed 0) of the key's length (8 bytes,
    little-endian), the key and the value, hashed as one stream (no copy of a large value)."""
    h = xxhash.xxh3_64(len(key).to_bytes(8, "little"))
    h.update(key)
    h.update(value)
    return h.intdigest()


def _checksum_value(total: int, txn_id: int) -> bytes:
    return _json({"entries": "%016x" % total, "txn": txn_id})


def _parse_checksum(value) -> tuple[int, int] | None:
    """(entries sum, transaction id) of a ``checksum`` entry; None if it does not parse."""
    try:
        obj = json.loads(bytes(value))
        entries, txn_id = obj["entries"], obj["txn"]
        if (set(obj) != {"entries", "txn"} or type(entries) is not str or len(entries) != 16
                or entries.strip("0123456789abcdef") or type(txn_id) is not int or txn_id < 0):
            return None
        return int(entries, 16), txn_id
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _entries_sum(txn) -> int:
    total = 0
    for key, value in txn.cursor():
        key = bytes(key)
        if key != K_CHECKSUM:
            total += entry_hash(key, value)
    return total & _MASK


class _SumTxn:
    """A write transaction that keeps the ``checksum`` entry: every put and delete adds the
    new entry's hash and subtracts the old one's, so a transaction hashes only what it
    changes. (The transaction is opened with buffers: values are hashed where LMDB keeps
    them, not copied.)"""

    def __init__(self, txn):
        self.txn = txn
        stored = txn.get(K_CHECKSUM)
        if stored is None:
            # A new or a format-1 journal (verified structurally on open): sum what is there.
            self.total = _entries_sum(txn)
        else:
            parsed = _parse_checksum(stored)
            if parsed is None:
                raise IntegrityError("journal checksum entry is not readable")
            self.total = parsed[0]

    def get(self, key: bytes):
        return self.txn.get(key)

    def put(self, key: bytes, value) -> None:
        old = self.txn.get(key)
        if old is not None:
            self.total -= entry_hash(key, old)  # before the put: LMDB may reuse its buffer
        self.txn.put(key, value)
        self.total = (self.total + entry_hash(key, value)) & _MASK

    def delete(self, key: bytes) -> None:
        old = self.txn.get(key)
        if old is not None:
            self.total = (self.total - entry_hash(key, old)) & _MASK
            self.txn.delete(key)

    def delete_prefix(self, prefix: bytes) -> None:
        cur = self.txn.cursor()
        if not cur.set_range(prefix):
            return
        while True:
            key = bytes(cur.key())
            if not key.startswith(prefix):
                break
            self.total = (self.total - entry_hash(key, cur.value())) & _MASK
            if not cur.delete():
                break

    def seal(self) -> None:
        """Store the checksum, with this transaction's id (it ties the entry to the LMDB
        snapshot that holds it: an older snapshot read in its place is found)."""
        self.txn.put(K_CHECKSUM, _checksum_value(self.total, self.txn.id()))


@dataclass(frozen=True)
class JournalState:
    log_id: str | None
    version: int | None
    state_digest: int | None
    inflight: int | None
    materializing: int | None
    # The step in flight (RECEIVER.md section 8): "version", or a catch-up route's "squash"
    # (from ``inflight_from``) or "snapshot".
    inflight_kind: str = "version"
    inflight_from: int | None = None

    @property
    def bound(self) -> bool:
        return self.version is not None

    def to_json(self) -> dict:
        return {
            "log_id": self.log_id,
            "version": self.version,
            "state_digest": None if self.state_digest is None else digest_hex(self.state_digest),
            "inflight": self.inflight,
            "inflight_kind": None if self.inflight is None else self.inflight_kind,
            "inflight_from": self.inflight_from,
            "materializing": self.materializing,
        }


@dataclass(frozen=True)
class SegmentProgress:
    """Records ``[0, done)`` of a segment are applied and flushed; records ``[done,
    started_end)`` form the batch being written, whose xor records have redo images."""

    done: int = 0
    started_end: int = 0


def _read_state(txn) -> JournalState:
    fmt = txn.get(K_FORMAT)
    if fmt is not None and bytes(fmt) not in (JOURNAL_FORMAT, LEGACY_FORMAT):
        raise IntegrityError(f"journal format {bytes(fmt)!r} is not {JOURNAL_FORMAT!r}")
    log_id = txn.get(K_LOG_ID)
    current = txn.get(K_CURRENT)
    inflight = txn.get(K_INFLIGHT)
    materializing = txn.get(K_MATERIALIZING)
    try:
        cur = json.loads(bytes(current)) if current is not None else None
        step = json.loads(bytes(inflight)) if inflight is not None else {}
        kind = step.get("kind", "version")
        if kind not in ("version", "squash", "snapshot"):
            raise ValueError(kind)
        start = step.get("from")
        if (start is None) != (kind != "squash"):
            raise ValueError(start)
        return JournalState(
            log_id=None if log_id is None else bytes(log_id).decode(),
            version=None if cur is None else int(cur["version"]),
            state_digest=None if cur is None else int(cur["state_digest"], 16),
            inflight=None if inflight is None else int(step["version"]),
            materializing=None if materializing is None
            else int(json.loads(bytes(materializing))["version"]),
            inflight_kind=kind,
            inflight_from=None if start is None else int(start),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise IntegrityError("journal entries are not readable") from None


def _read_progress(txn) -> dict[int, SegmentProgress]:
    out: dict[int, SegmentProgress] = {}
    for suffix, value in _scan(txn, SEG_PREFIX):
        try:
            obj = json.loads(value)
            prog = SegmentProgress(obj["done"], obj["started_end"])
            if not (type(prog.done) is int and type(prog.started_end) is int
                    and 0 <= prog.done <= prog.started_end):
                raise ValueError
            out[int(suffix)] = prog
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise IntegrityError("segment progress is not readable") from None
    return out


def _read_files(txn) -> list[str]:
    value = txn.get(K_FILES)
    if value is None:
        return []
    try:
        names = json.loads(bytes(value))
        if not isinstance(names, list) or any(file_name_problem(n) is not None for n in names):
            raise ValueError
    except (ValueError, RecursionError):
        raise IntegrityError("the file list is not readable") from None
    return names


def verify_entries(txn) -> bool:
    """Check a journal snapshot (a read transaction) before anything is decided on it: its
    checksum against its entries and the transaction that wrote it, then the structure of
    every entry. Returns False for a journal without a checksum (format 1, or empty), which
    gets one at its next write. Raises IntegrityError naming what is wrong."""
    total = _entries_sum(txn)
    stored, fmt = txn.get(K_CHECKSUM), txn.get(K_FORMAT)
    stored = None if stored is None else bytes(stored)
    fmt = None if fmt is None else bytes(fmt)
    strange = next((key for key in map(bytes, txn.cursor().iternext(keys=True, values=False))
                    if key not in _KEYS and key != K_CHECKSUM and _KEY_PATTERN.fullmatch(key) is None), None)
    if stored is not None:
        parsed = _parse_checksum(stored)
        if parsed is None:
            raise IntegrityError("its checksum entry is not readable")
        if parsed[0] != total:
            raise IntegrityError("its entries do not match their checksum")
        if parsed[1] != txn.id():
            raise IntegrityError(f"its checksum was written by transaction {parsed[1]}, "
                                 f"not by the one LMDB reads ({txn.id()})")
        if fmt != JOURNAL_FORMAT:
            raise IntegrityError(f"format {fmt!r} with a checksum")
    elif fmt == JOURNAL_FORMAT:
        raise IntegrityError("its checksum entry is missing")
    # The structure, as every reader below expects it (a format-1 journal has only this).
    if strange is not None:
        raise IntegrityError(f"unknown entry {strange[:40]!r}")
    _read_state(txn)
    _read_progress(txn)
    _read_files(txn)
    placement = txn.get(K_PLACEMENT)
    if placement is not None and re.fullmatch(rb"[0-9a-f]{64}", bytes(placement)) is None:
        raise IntegrityError("the placement digest is not readable")
    return stored is not None


class Journal:
    """One receiver's journal. Holds the receiver lock (an exclusive flock) while open."""

    def __init__(self, path: Path, lock_file):
        self.path = path
        self._lock_file = lock_file
        self._env: lmdb.Environment | None = None
        self._writable = False
        # Time spent in write transactions (commit and sync included), for benchmarks.
        self.txn_seconds = 0.0
        self.txn_count = 0

    # -- opening ---------------------------------------------------------------------------

    @staticmethod
    def exists(path: str | os.PathLike) -> bool:
        from dcr_log.receiver.fs import check_regular

        path = Path(path)
        if not check_regular(path, "directory"):
            return False
        for name in LMDB_FILES:
            check_regular(path / name)
        return (path / DATA_NAME).is_file()

    @staticmethod
    def open(path: str | os.PathLike) -> Journal:
        """Open (creating the directory if needed) and take the receiver lock.

        Raises UsageError when another process holds the receiver."""
        path = Path(path)
        Journal.exists(path)  # refuses symbolic links: the journal never writes outside
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise os_error(exc, f"cannot open the receiver journal {path}") from None
        lock_file = os.fdopen(fd, "a+b")
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise UsageError(f"receiver journal {path} is in use by another process") from None
        return Journal(path, lock_file)

    @staticmethod
    def peek(path: str | os.PathLike) -> JournalState:
        """The journal's state, read as an ordinary LMDB reader (safe next to a running apply)."""
        path = Path(path)
        if not Journal.exists(path):
            raise NotFoundError(f"no receiver journal at {path}")
        _check_pages(path)
        try:
            env = lmdb.open(str(path), readonly=True, lock=True, subdir=True, max_dbs=0)
        except lmdb.Error as exc:
            raise _lmdb_error(exc, path, "read") from None
        try:
            with env.begin(buffers=True) as txn:
                _verify(txn, path)
                return _read_state(txn)
        finally:
            env.close()

    def _reader(self) -> lmdb.Environment | None:
        if self._env is None and Journal.exists(self.path):
            # No writer can run: this process holds the receiver lock. Opening without
            # LMDB's lock file keeps the directory byte-for-byte unchanged.
            _check_pages(self.path)
            try:
                env = lmdb.open(str(self.path), readonly=True, lock=False, subdir=True, max_dbs=0)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, self.path, "read") from None
            # Verified once, before anything is read from it or written to it (read-only: no
            # byte of the directory changes when it is refused).
            try:
                with env.begin(buffers=True) as txn:
                    _verify(txn, self.path)
            except BaseException:
                env.close()
                raise
            self._env = env
        return self._env

    def _writer(self) -> lmdb.Environment:
        if not self._writable:
            self._reader()  # verifies an existing journal before its first write
            if self._env is not None:
                self._env.close()
            self._env = None
            try:
                self._env = lmdb.open(str(self.path), map_size=MAP_SIZE, subdir=True, sync=True,
                                      metasync=True, max_dbs=0)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, self.path, "open") from None
            self._writable = True
        return self._env

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._writable = False
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    # -- reads -----------------------------------------------------------------------------

    def state(self) -> JournalState:
        env = self._reader()
        if env is None:
            return JournalState(None, None, None, None, None)
        with env.begin() as txn:
            return _read_state(txn)

    def progress(self) -> dict[int, SegmentProgress]:
        """Per segment index, how far the version in flight got."""
        env = self._reader()
        if env is None:
            return {}
        with env.begin() as txn:
            try:
                return _read_progress(txn)
            except IntegrityError as exc:
                raise IntegrityError(f"journal {self.path}: {exc}") from None

    def placement_digest(self) -> str | None:
        """The placement the receiver was bound with (engine receivers), if any."""
        env = self._reader()
        if env is None:
            return None
        with env.begin() as txn:
            value = txn.get(K_PLACEMENT)
        return None if value is None else bytes(value).decode()

    def files(self) -> list[str]:
        """The names of the files the log wrote into the receiver's directory for its current
        version (feature files); a receiver removes only these when a version drops them."""
        env = self._reader()
        if env is None:
            return []
        with env.begin() as txn:
            try:
                return _read_files(txn)
            except IntegrityError as exc:
                raise IntegrityError(f"journal {self.path}: {exc}") from None

    def redo_images(self, segment: int) -> dict[int, bytes]:
        """Redo images (target words) of a segment's batch in flight, by record index."""
        env = self._reader()
        out: dict[int, bytes] = {}
        if env is None:
            return out
        prefix = REDO_PREFIX + b"%08d/" % segment
        with env.begin() as txn:
            for suffix, value in _scan(txn, prefix):
                out[int(suffix)] = value
        return out

    # -- writes: each is one synced transaction ---------------------------------------------

    def _write(self, fn) -> None:
        env = self._writer()
        t0 = time.perf_counter()
        while True:
            try:
                with env.begin(write=True, buffers=True) as raw:
                    txn = _SumTxn(raw)
                    fmt = txn.get(K_FORMAT)
                    if fmt is None or bytes(fmt) != JOURNAL_FORMAT:
                        txn.put(K_FORMAT, JOURNAL_FORMAT)  # new, or format 1: now with a checksum
                    fn(txn)
                    txn.seal()
                break
            except lmdb.MapFullError:
                # The transaction was aborted: grow the map and run it again.
                size = env.info()["map_size"]
                if size >= MAX_MAP_SIZE:
                    raise StoreError(f"receiver journal {self.path}: map full at {size} bytes") from None
                try:
                    env.set_mapsize(min(MAX_MAP_SIZE, 2 * size))
                except lmdb.Error as exc:
                    raise _lmdb_error(exc, self.path, "grow") from None
            except lmdb.Error as exc:
                raise _lmdb_error(exc, self.path, "write") from None
        self.txn_seconds += time.perf_counter() - t0
        self.txn_count += 1

    @staticmethod
    def _clear_inflight(txn: _SumTxn) -> None:
        txn.delete(K_INFLIGHT)
        txn.delete_prefix(SEG_PREFIX)
        txn.delete_prefix(REDO_PREFIX)

    @staticmethod
    def _put_files(txn, files: Sequence[str] | None) -> None:
        if files is None:
            return  # storage without files: nothing to record
        if files:
            txn.put(K_FILES, _json(sorted(files, key=str.encode)))
        else:
            txn.delete(K_FILES)

    def bind(self, log_id: str, version: int, state_digest: int, files: Sequence[str] | None = None,
             placement: str | None = None) -> None:
        """Declare that the storage holds ``version`` (and, given ``files``, that the log wrote
        these files of it); forgets anything in flight. An engine receiver records the sha256
        of its placement."""
        def fn(txn):
            old = txn.get(K_LOG_ID)
            if old is not None and bytes(old).decode() != log_id:
                raise IntegrityError("journal already belongs to another log")
            txn.put(K_LOG_ID, log_id.encode())
            if placement is None:
                txn.delete(K_PLACEMENT)
            else:
                txn.put(K_PLACEMENT, placement.encode())
            txn.put(K_CURRENT, _json({"version": version, "state_digest": digest_hex(state_digest)}))
            txn.delete(K_MATERIALIZING)
            self._put_files(txn, files)
            self._clear_inflight(txn)
        self._write(fn)

    def begin_materialize(self, log_id: str, version: int) -> None:
        """Record that ``version`` is being written out whole (the receiver holds nothing yet)."""
        def fn(txn):
            txn.put(K_LOG_ID, log_id.encode())
            txn.put(K_MATERIALIZING, _json({"version": version}))
        self._write(fn)

    def begin(self, version: int, kind: str = "version", start: int | None = None) -> None:
        """``version`` in flight, by a version of the chain or a catch-up step (a squash from
        ``start``, or a snapshot): recovery finishes the same step."""
        entry = {"version": version}
        if kind != "version":
            entry["kind"] = kind
        if start is not None:
            entry["from"] = start
        self._write(lambda txn: txn.put(K_INFLIGHT, _json(entry)))

    def stage(self, segment: int, done: int, end: int, redo: Mapping[int, memoryview | bytes]) -> None:
        """Before a batch is written: its redo images and its extent, in one transaction."""
        def fn(txn):
            for record, image in redo.items():
                txn.put(_redo_key(segment, record), image)
            txn.put(_seg_key(segment), _json({"done": done, "started_end": end}))
        self._write(fn)

    def mark_applied(self, segment: int, done: int, started_end: int, redo_records: Iterable[int]) -> None:
        """After a batch is written and flushed: advance the segment, drop its redo images."""
        def fn(txn):
            for record in redo_records:
                txn.delete(_redo_key(segment, record))
            txn.put(_seg_key(segment), _json({"done": done, "started_end": started_end}))
        self._write(fn)

    def commit(self, version: int, state_digest: int, files: Sequence[str] | None = None) -> None:
        """The joint commit: the new version bound to its state digest (and, given ``files``,
        the names of its files the log wrote), nothing in flight."""
        def fn(txn):
            txn.put(K_CURRENT, _json({"version": version, "state_digest": digest_hex(state_digest)}))
            self._put_files(txn, files)
            self._clear_inflight(txn)
        self._write(fn)

    def abort(self) -> None:
        """Forget the version in flight (the storage was rolled back to the current version)."""
        self._write(self._clear_inflight)


# LMDB's file (lmdb.h/mdb.c, file format of 0.9): the page header is pgno (8 bytes), pad (2),
# flags (2), lower and upper (2 each; an overflow page's page count, 4, in their place); the
# meta (pages 0 and 1, after the header) magic, version, address, map size, the free and the
# main database (pad: the page size in the free one; flags, depth, branch, leaf and overflow
# page counts, entries, root), the last page and the transaction id.
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_P_INVALID = (1 << 64) - 1
_MDB_INTEGERKEY = 0x08
_DB = struct.Struct("<IHHQQQQQ")


def check_pages(path: Path) -> set[int]:
    """LMDB's own structures in ``data.mdb``, read as a plain file before LMDB maps it: the
    meta page LMDB will use, and every page of both trees (page numbers within the file,
    page headers, node bounds, page counts). LMDB trusts these without checks, and a damaged
    one makes it fail (or crash) only when it reads or writes that page. Returns the pages in
    use (beside the meta pages); raises IntegrityError naming what is wrong."""
    try:
        fd = os.open(path / DATA_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise os_error(exc, f"cannot read the receiver journal {path}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return set()  # never written: LMDB initializes it at the first write
        head = os.pread(fd, 4096 + 160, 0)
        if len(head) < 160:
            raise IntegrityError("the file is shorter than a meta page")
        psize = _DB.unpack_from(head, 40)[0]
        if psize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536) or size < 2 * psize:
            raise IntegrityError(f"meta page 0 gives page size {psize} for a file of {size} bytes")
        metas = []
        for n in (0, 1):
            page = os.pread(fd, 160, n * psize)
            magic, fmt = struct.unpack_from("<II", page, 16)
            if magic != 0xBEEFC0DE or fmt != 1 or struct.unpack_from("<Q", page, 0)[0] != n:
                raise IntegrityError(f"meta page {n} is not an LMDB meta page")
            metas.append(page)
        meta = metas[1] if struct.unpack_from("<Q", metas[0], 144)[0] < struct.unpack_from("<Q", metas[1], 144)[0] \
            else metas[0]
        last = struct.unpack_from("<Q", meta, 136)[0]
        if not 1 <= last or (last + 1) * psize > size:
            raise IntegrityError(f"the meta page's last page {last} lies beyond the file")
        seen: set[int] = set()

        def read_page(pgno: int, flags: int) -> bytes:
            if not 2 <= pgno <= last or pgno in seen:
                raise IntegrityError(f"page {pgno} is out of place")
            seen.add(pgno)
            page = os.pread(fd, psize, pgno * psize)
            got_no, _, got_flags, lower, upper = struct.unpack_from("<QHHHH", page, 0)
            if len(page) != psize or got_no != pgno or got_flags != flags:
                raise IntegrityError(f"page {pgno} has another header")
            if flags != _P_OVERFLOW and not (16 <= lower <= upper <= psize and lower % 2 == 0):
                raise IntegrityError(f"page {pgno} has bounds {lower}, {upper}")
            return page

        def walk(db: tuple, free: bool) -> list[bytes]:
            flags, depth, branches, leaves, overflows, entries, root = db[1:]
            if flags != (_MDB_INTEGERKEY if free else 0):
                raise IntegrityError(f"a database has flags {flags:#x}")
            counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
            values: list[bytes] = []

            def visit(pgno: int, level: int) -> None:
                leaf = level == 1
                page = read_page(pgno, _P_LEAF if leaf else _P_BRANCH)
                counts[1 if leaf else 0] += 1
                lower, upper = struct.unpack_from("<HH", page, 12)
                used = 0
                for i in range((lower - 16) // 2):
                    ptr = struct.unpack_from("<H", page, 16 + 2 * i)[0]
                    if ptr % 2 or not upper <= ptr <= psize - 8:
                        raise IntegrityError(f"page {pgno}: node {i} lies outside the page")
                    lo, hi, nflags, ksize = struct.unpack_from("<HHHH", page, ptr)
                    if leaf:
                        dsize = lo | hi << 16
                        if nflags not in (0, _F_BIGDATA):
                            raise IntegrityError(f"page {pgno}: node {i} has flags {nflags:#x}")
                        nsize = 8 + ksize + (8 if nflags else dsize)
                    else:
                        nsize = 8 + ksize
                    if ptr + nsize > psize:
                        raise IntegrityError(f"page {pgno}: node {i} runs past the page")
                    used += nsize + nsize % 2
                    if not leaf:
                        visit(lo | hi << 16 | nflags << 32, level - 1)
                        continue
                    counts[3] += 1
                    data = page[ptr + 8 + ksize: ptr + nsize]
                    if nflags:
                        first = struct.unpack_from("<Q", data)[0]
                        over = read_page(first, _P_OVERFLOW)
                        pages = struct.unpack_from("<I", over, 12)[0]
                        if not 1 <= pages <= last + 1 - first or pages * psize - 16 < dsize:
                            raise IntegrityError(f"overflow page {first} has {pages} pages")
                        seen.update(range(first + 1, first + pages))
                        counts[2] += pages
                        if free:
                            data = os.pread(fd, dsize, first * psize + 16)
                    if free:
                        values.append(bytes(data[:dsize]))
                if used != psize - upper:
                    raise IntegrityError(f"page {pgno}: its nodes do not fill it from {upper}")

            if root == _P_INVALID:
                if depth != 0 or entries != 0:
                    raise IntegrityError("an empty database has depth or entries")
            elif not 1 <= depth <= 32:
                raise IntegrityError(f"a database has depth {depth}")
            else:
                visit(root, depth)
            if counts != [branches, leaves, overflows, entries]:
                raise IntegrityError(f"a database's page counts {counts} differ from its meta's")
            return values

        free_db = _DB.unpack_from(meta, 40)
        main_db = _DB.unpack_from(meta, 88)
        walk(main_db, False)
        live = set(seen)
        free: set[int] = set()
        for value in walk(free_db, True):
            n = len(value) // 8 - 1
            ids = struct.unpack_from("<%dQ" % (n + 1), value) if len(value) % 8 == 0 and n >= 0 else ()
            pages = ids[1:]
            if (not ids or ids[0] != n or any(a <= b for a, b in zip(pages, pages[1:]))
                    or any(not 2 <= pg <= last or pg in seen or pg in free for pg in pages)):
                raise IntegrityError("a free-page list names pages out of place")
            free.update(pages)
        # LMDB accounts for every page: the meta pages, those in use and the free ones.
        if len(seen) + len(free) + 2 != last + 1:
            raise IntegrityError(f"{len(seen)} pages in use and {len(free)} free do not make "
                                 f"the {last + 1} pages of the file")
        return live
    except OSError as exc:
        raise os_error(exc, f"cannot read the receiver journal {path}") from None
    finally:
        os.close(fd)


def _check_pages(path: Path) -> None:
    try:
        check_pages(path)
    except IntegrityError as exc:
        raise IntegrityError(f"receiver journal {path} is damaged: {exc}") from None
    except struct.error:
        raise IntegrityError(f"receiver journal {path} is damaged: a page is cut short") from None


def _verify(txn, path: Path) -> bool:
    try:
        return verify_entries(txn)
    except IntegrityError as exc:
        raise IntegrityError(f"receiver journal {path} is damaged: {exc}") from None
    except lmdb.Error as exc:
        raise _lmdb_error(exc, path, "read") from None


def _lmdb_error(exc: Exception, path: Path, op: str) -> StoreError:
    """LMDB's errors as one readable line with their cause (a full disk shows as ENOSPC or,
    at commit, as EIO: the free space says which)."""
    from dcr_log.receiver.fs import free_bytes

    text = str(exc).split("\n", 1)[0]
    errno_ = getattr(exc, "errno", None)
    if isinstance(exc, OSError) and errno_:
        return os_error(exc, f"cannot {op} the receiver journal {path}")
    lowered = text.lower()
    if "no space" in lowered or (("input/output" in lowered or "disk" in lowered)
                                 and free_bytes(path) < (1 << 20)):
        cause = "no space left on device"
    elif "read-only" in lowered or "readonly" in lowered:
        cause = "read-only file system"
    elif "permission" in lowered:
        cause = "permission denied"
    else:
        cause = text.split(": ", 1)[-1][:200] or type(exc).__name__
    return StoreError(f"cannot {op} the receiver journal {path}: {cause}")


def _scan(txn, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key without prefix, value) of every key starting with ``prefix``, in key order."""
    cur = txn.cursor()
    if not cur.set_range(prefix):
        return
    for key, value in cur:
        key = bytes(key)
        if not key.startswith(prefix):
            return
        yield key[len(prefix):], bytes(value)
