"""The receiver journal: one LMDB environment per receiver (spec/RECEIVER.md, "Journal").

It holds the log identity, the current (version, state digest), the version in flight, per
segment how far that version got, and the redo images of the batch being written. Every
write is one synced LMDB transaction; the apply protocol batches them per segment.

This module is the Journal API and its state machine (open, the reads, one method per
synced write). LMDB pages carry no checksums, so the journal keeps its own over its entries
(journal_entries: keys, encoding, checksum, structure) and checks LMDB's pages before mapping
the file (journal_pages); both are verified when the journal is first read, so a damaged
journal is refused (IntegrityError) before anything is written. A journal of format 1 (no
checksum) is checked structurally and gets its checksum, and format 2, at its next write
transaction.

The environment is opened lazily: until the first write it is read without LMDB's lock file
(safe because the receiver lock, taken first, keeps every writer out), so a command that
refuses before writing leaves every byte of the journal directory as it was.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO

import lmdb

from dcr_log.errors import IntegrityError, NotFoundError, StoreError, UsageError, os_error
from dcr_log.format.tensors import digest_hex
from dcr_log.receiver.journal_entries import (
    JOURNAL_FORMAT,
    K_CURRENT,
    K_FILES,
    K_FORMAT,
    K_INFLIGHT,
    K_LOG_ID,
    K_MATERIALIZING,
    K_PLACEMENT,
    K_WAL_BOOT,
    REDO_PREFIX,
    SEG_PREFIX,
    WAL_PREFIX,
    JournalState,
    SegmentProgress,
    SumTxn,
    WalImage,
    decode_wal_image,
    json_bytes,
    read_files,
    read_progress,
    read_state,
    redo_key,
    scan,
    seg_key,
    verify_entries,
    wal_key,
)
from dcr_log.receiver.journal_pages import DATA_NAME, check_pages

__all__ = ["Journal", "JournalState", "SegmentProgress"]

LOCK_NAME = "receiver.lock"
# The map starts small (address space only: LMDB grows the file as pages are used) and grows
# on demand: a transaction that finds the map full is retried on a map twice as large (or as
# large as the transaction needs), up to MAX_MAP_SIZE. So a receiver runs under ``ulimit -v``.
MAP_SIZE = 1 << 26
MAX_MAP_SIZE = 1 << 40
LMDB_FILES = (DATA_NAME, "lock.mdb", LOCK_NAME)


class Journal:
    """One receiver's journal. Holds the receiver lock (an exclusive flock) while open."""

    def __init__(self, path: Path, lock_file: IO[bytes] | None):
        self.path = path
        self._lock_file: IO[bytes] | None = lock_file
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
                return read_state(txn)
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
        if self._writable and self._env is not None:
            return self._env
        self._reader()  # verifies an existing journal before its first write
        if self._env is not None:
            self._env.close()
        self._env = None
        try:
            env = lmdb.open(str(self.path), map_size=MAP_SIZE, subdir=True, sync=True,
                            metasync=True, max_dbs=0)
        except lmdb.Error as exc:
            raise _lmdb_error(exc, self.path, "open") from None
        self._env, self._writable = env, True
        return env

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
            return read_state(txn)

    def progress(self) -> dict[int, SegmentProgress]:
        """Per segment index, how far the version in flight got."""
        env = self._reader()
        if env is None:
            return {}
        with env.begin() as txn:
            try:
                return read_progress(txn)
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
                return read_files(txn)
            except IntegrityError as exc:
                raise IntegrityError(f"journal {self.path}: {exc}") from None

    def redo_images(self, segment: int) -> dict[int, bytes]:
        """Redo images (target words) of a segment's batch in flight, by record index: the
        ``redo`` entries, or the deferred-sync images of the version in flight."""
        env = self._reader()
        out: dict[int, bytes] = {}
        if env is None:
            return out
        inflight = self.state().inflight
        with env.begin() as txn:
            for suffix, value in scan(txn, REDO_PREFIX + b"%08d/" % segment):
                out[int(suffix)] = value
            if inflight is not None:
                prefix = b"%08d/%08d/" % (inflight, segment)
                for suffix, value in scan(txn, WAL_PREFIX + prefix):
                    out[int(suffix)] = decode_wal_image(prefix + suffix, value).words.tobytes()
        return out

    def wal_boot(self) -> bytes | None:
        """The boot during which the deferred-sync images were written (None: there are none)."""
        return self.state().wal_boot

    def wal_bytes(self) -> int:
        """The bytes of the deferred-sync images."""
        env = self._reader()
        if env is None:
            return 0
        with env.begin(buffers=True) as txn:
            return sum(len(value) for _, value in scan(txn, WAL_PREFIX, copy=False))

    def wal_images(self) -> Generator[WalImage, None, None]:
        """The deferred-sync images in the order they were written (version, segment, record),
        one at a time where LMDB holds them (each valid until the next is asked for)."""
        env = self._reader()
        if env is None:
            return
        with env.begin(buffers=True) as txn:
            for suffix, value in scan(txn, WAL_PREFIX, copy=False):
                yield decode_wal_image(suffix, value)

    # -- writes: each is one synced transaction ---------------------------------------------

    def _write(self, fn: Callable[[SumTxn], None], adds: int = 0) -> None:
        """One synced write transaction; ``adds``: about the bytes it puts, for which the map
        is grown beforehand (a transaction that finds it full is run again)."""
        env = self._writer()
        t0 = time.perf_counter()
        if adds:
            info = env.info()
            used = (info["last_pgno"] + 1) * env.stat()["psize"]
            size = info["map_size"]
            while size < MAX_MAP_SIZE and size < used + 2 * adds:
                size *= 2
            if size != info["map_size"]:
                self._grow(env, size)
        while True:
            try:
                with env.begin(write=True, buffers=True) as raw:
                    txn = SumTxn(raw)
                    fmt = txn.get(K_FORMAT)
                    if fmt is None or bytes(fmt) != JOURNAL_FORMAT:
                        txn.put(K_FORMAT, JOURNAL_FORMAT)  # new, format 1 (now with a checksum) or 2
                    fn(txn)
                    txn.seal()
                break
            except lmdb.MapFullError:
                # The transaction was aborted: grow the map and run it again.
                size = env.info()["map_size"]
                if size >= MAX_MAP_SIZE:
                    raise StoreError(f"receiver journal {self.path}: map full at {size} bytes") from None
                self._grow(env, 2 * size)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, self.path, "write") from None
        self.txn_seconds += time.perf_counter() - t0
        self.txn_count += 1

    def _grow(self, env: lmdb.Environment, size: int) -> None:
        try:
            env.set_mapsize(min(MAX_MAP_SIZE, size))
        except lmdb.Error as exc:
            raise _lmdb_error(exc, self.path, "grow") from None

    @staticmethod
    def _clear_inflight(txn: SumTxn) -> None:
        txn.delete(K_INFLIGHT)
        txn.delete_prefix(SEG_PREFIX)
        txn.delete_prefix(REDO_PREFIX)

    @staticmethod
    def _clear_wal(txn: SumTxn) -> None:
        txn.delete_prefix(WAL_PREFIX)
        txn.delete(K_WAL_BOOT)

    @staticmethod
    def _put_files(txn: SumTxn, files: Sequence[str] | None) -> None:
        if files is None:
            return  # storage without files: nothing to record
        if files:
            txn.put(K_FILES, json_bytes(sorted(files, key=str.encode)))
        else:
            txn.delete(K_FILES)

    def bind(self, log_id: str, version: int, state_digest: int, files: Sequence[str] | None = None,
             placement: str | None = None) -> None:
        """Declare that the storage holds ``version`` (and, given ``files``, that the log wrote
        these files of it); forgets anything in flight. An engine receiver records the sha256
        of its placement."""
        def fn(txn: SumTxn) -> None:
            old = txn.get(K_LOG_ID)
            if old is not None and bytes(old).decode() != log_id:
                raise IntegrityError("journal already belongs to another log")
            txn.put(K_LOG_ID, log_id.encode())
            if placement is None:
                txn.delete(K_PLACEMENT)
            else:
                txn.put(K_PLACEMENT, placement.encode())
            txn.put(K_CURRENT, json_bytes({"version": version, "state_digest": digest_hex(state_digest)}))
            txn.delete(K_MATERIALIZING)
            self._put_files(txn, files)
            self._clear_inflight(txn)
            self._clear_wal(txn)  # the storage was synced: it holds the version on disk
        self._write(fn)

    def begin_materialize(self, log_id: str, version: int) -> None:
        """Record that ``version`` is being written out whole (the receiver holds nothing yet)."""
        def fn(txn: SumTxn) -> None:
            txn.put(K_LOG_ID, log_id.encode())
            txn.put(K_MATERIALIZING, json_bytes({"version": version}))
        self._write(fn)

    def forget_wal_boot(self) -> None:
        """A sync failed (a write-back error: the page cache may have dropped written words):
        the images are restored at the next start whatever its boot (an empty ``wal_boot``)."""
        def fn(txn: SumTxn) -> None:
            if txn.get(K_WAL_BOOT) is not None:
                txn.put(K_WAL_BOOT, b"")
        self._write(fn)

    def begin(self, version: int, kind: str = "version", start: int | None = None,
              clear_wal: bool = False, wal_boot: bytes | None = None) -> None:
        """``version`` in flight, by a version of the chain or a catch-up step (a squash from
        ``start``, or a snapshot): recovery finishes the same step. ``clear_wal``: the storage
        was just synced, its deferred-sync images are dropped; ``wal_boot``: they were
        restored in this boot (they stay, the entry says the page cache holds them)."""
        entry: dict[str, int | str] = {"version": version}
        if kind != "version":
            entry["kind"] = kind
        if start is not None:
            entry["from"] = start

        def fn(txn: SumTxn) -> None:
            txn.put(K_INFLIGHT, json_bytes(entry))
            if clear_wal:
                self._clear_wal(txn)
            elif wal_boot is not None and txn.get(K_WAL_BOOT) is not None:
                txn.put(K_WAL_BOOT, wal_boot)
        self._write(fn)

    def stage(self, segment: int, done: int, end: int, redo: Mapping[int, memoryview | bytes],
              wal: Mapping[int, bytes | memoryview] | None = None, version: int | None = None,
              clear_wal: bool = False, boot: bytes = b"") -> None:
        """Before a batch is written: its redo images and its extent, in one transaction.
        Deferred sync: ``wal`` holds the batch's images (by record of ``version``), written
        in ``boot``; ``clear_wal`` drops the earlier ones first (the storage was just synced)."""
        def fn(txn: SumTxn) -> None:
            if clear_wal:
                self._clear_wal(txn)
            for record, image in redo.items():
                txn.put(redo_key(segment, record), image)
            if wal:
                assert version is not None
                for record, image in wal.items():
                    txn.put(wal_key(version, segment, record), image)
                if txn.get(K_WAL_BOOT) is None:
                    txn.put(K_WAL_BOOT, boot)
            txn.put(seg_key(segment), json_bytes({"done": done, "started_end": end}))
        self._write(fn, sum(map(len, redo.values())) + sum(map(len, (wal or {}).values())))

    def mark_applied(self, segment: int, done: int, started_end: int, redo_records: Iterable[int]) -> None:
        """After a batch is written and flushed: advance the segment, drop its redo images."""
        def fn(txn: SumTxn) -> None:
            for record in redo_records:
                txn.delete(redo_key(segment, record))
            txn.put(seg_key(segment), json_bytes({"done": done, "started_end": started_end}))
        self._write(fn)

    def commit(self, version: int, state_digest: int, files: Sequence[str] | None = None) -> None:
        """The joint commit: the new version bound to its state digest (and, given ``files``,
        the names of its files the log wrote), nothing in flight."""
        def fn(txn: SumTxn) -> None:
            txn.put(K_CURRENT, json_bytes({"version": version, "state_digest": digest_hex(state_digest)}))
            self._put_files(txn, files)
            self._clear_inflight(txn)
        self._write(fn)

    def abort(self) -> None:
        """Forget the version in flight (the storage was rolled back to the current version)."""
        self._write(self._clear_inflight)


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

