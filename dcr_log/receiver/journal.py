"""The receiver journal: one LMDB environment per receiver (spec/RECEIVER.md, "Journal").

It holds the log identity, the current (version, state digest), the version in flight, per
segment how far that version got, and the redo images of the batch being written. Every
write is one synced LMDB transaction; the apply protocol batches them per segment.

The environment is opened lazily: until the first write it is read without LMDB's lock file
(safe because the receiver lock, taken first, keeps every writer out), so a command that
refuses before writing leaves every byte of the journal directory as it was.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import lmdb

from ..errors import IntegrityError, NotFoundError, StoreError, UsageError, os_error
from ..format import file_name_problem
from ..state import digest_hex

JOURNAL_FORMAT = b"dcr-receiver-journal/1"
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
SEG_PREFIX = b"seg/"
REDO_PREFIX = b"redo/"


def _seg_key(segment: int) -> bytes:
    return SEG_PREFIX + b"%08d" % segment


def _redo_key(segment: int, record: int) -> bytes:
    return REDO_PREFIX + b"%08d/%08d" % (segment, record)


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


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
    if fmt is not None and bytes(fmt) != JOURNAL_FORMAT:
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
        from .storage import check_regular

        path = Path(path)
        if not check_regular(path, "directory"):
            return False
        for name in LMDB_FILES:
            check_regular(path / name)
        return (path / DATA_NAME).is_file()

    @staticmethod
    def open(path: str | os.PathLike) -> "Journal":
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
        try:
            env = lmdb.open(str(path), readonly=True, lock=True, subdir=True, max_dbs=0)
        except lmdb.Error as exc:
            raise _lmdb_error(exc, path, "read") from None
        try:
            with env.begin() as txn:
                return _read_state(txn)
        finally:
            env.close()

    def _reader(self) -> lmdb.Environment | None:
        if self._env is None and Journal.exists(self.path):
            # No writer can run: this process holds the receiver lock. Opening without
            # LMDB's lock file keeps the directory byte-for-byte unchanged.
            try:
                self._env = lmdb.open(str(self.path), readonly=True, lock=False, subdir=True, max_dbs=0)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, self.path, "read") from None
        return self._env

    def _writer(self) -> lmdb.Environment:
        if not self._writable:
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
        out: dict[int, SegmentProgress] = {}
        if env is None:
            return out
        with env.begin() as txn:
            for suffix, value in _scan(txn, SEG_PREFIX):
                try:
                    obj = json.loads(value)
                    prog = SegmentProgress(obj["done"], obj["started_end"])
                    if not (type(prog.done) is int and type(prog.started_end) is int
                            and 0 <= prog.done <= prog.started_end):
                        raise ValueError
                    out[int(suffix)] = prog
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                    raise IntegrityError(f"journal {self.path}: segment progress is not readable") from None
        return out

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
            value = txn.get(K_FILES)
        if value is None:
            return []
        try:
            names = json.loads(bytes(value))
            if not isinstance(names, list) or any(file_name_problem(n) is not None for n in names):
                raise ValueError
        except (ValueError, RecursionError):
            raise IntegrityError(f"journal {self.path}: the file list is not readable") from None
        return names

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
                with env.begin(write=True) as txn:
                    if txn.get(K_FORMAT) is None:
                        txn.put(K_FORMAT, JOURNAL_FORMAT)
                    fn(txn)
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
    def _delete_prefix(txn, prefix: bytes) -> None:
        cur = txn.cursor()
        if not cur.set_range(prefix):
            return
        while cur.key().startswith(prefix):
            if not cur.delete():
                break

    def _clear_inflight(self, txn) -> None:
        txn.delete(K_INFLIGHT)
        self._delete_prefix(txn, SEG_PREFIX)
        self._delete_prefix(txn, REDO_PREFIX)

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


def _lmdb_error(exc: Exception, path: Path, op: str) -> StoreError:
    """LMDB's errors as one readable line with their cause (a full disk shows as ENOSPC or,
    at commit, as EIO: the free space says which)."""
    from .storage import free_bytes

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
        if not key.startswith(prefix):
            return
        yield bytes(key[len(prefix):]), bytes(value)
