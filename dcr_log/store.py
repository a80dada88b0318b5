"""The only module that does object I/O: a thin layer over obstore.

What a store must provide (spec/FORMAT.md, "Storage operations"): get, ranged get, put of a
new key, put-if-absent that fails atomically when the key exists, list by prefix, head and
delete. obstore gives all of these on local disk, memory, S3, GCS and Azure.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import numpy as np
import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.exceptions import NotFoundError as ObNotFound
from obstore.store import LocalStore, MemoryStore, from_url

from dcr_log import buffers
from dcr_log.errors import AlreadyExists, DcrError, NotFoundError, StoreError, UsageError, WrongSize, os_error

# Keys this module hands to a store: printable ASCII without ``\``, no empty, ``.`` or ``..``
# segment, at most MAX_KEY_BYTES (spec/FORMAT.md, section 15). Anything else is refused
# before the store sees it, so a bad key is a typed error and never a store's debug dump.
MAX_KEY_BYTES = 1024
# get_file reads and hashes an object in chunks of this many bytes.
FILE_CHUNK_BYTES = 8 << 20
_KEY = re.compile(r"[!-\[\]-~ ]+")


def check_key(key: str) -> str:
    if (not isinstance(key, str) or not key or len(key) > MAX_KEY_BYTES or not _KEY.fullmatch(key)
            or any(part in ("", ".", "..") for part in key.split("/"))):
        raise UsageError(f"invalid object key {key[:80]!r}" if isinstance(key, str) else "invalid object key")
    return key


def _cause(exc: BaseException) -> str:
    """One readable line for a store failure: the OS error if there is one, else the first
    line of the message (obstore's messages append multi-line debug dumps)."""
    if isinstance(exc, OSError) and exc.errno:
        return str(os_error(exc, "x")).removeprefix("x: ")
    text = str(exc)
    for marker in ("No space left on device", "Read-only file system", "Permission denied",
                   "Disk quota exceeded", "Input/output error", "Connection refused",
                   "dns error", "timed out", "Too many open files"):
        if marker.lower() in text.lower():
            return marker.lower()
    status = re.search(r"status code: (\d{3})([^:<]*)", text)
    if status:  # an HTTP refusal: its status and the S3 error code, not the XML
        code = re.search(r"<Code>([^<]{1,64})</Code>", text)
        return f"HTTP {status.group(1)}{status.group(2).rstrip()}" + (f" ({code.group(1)})" if code else "")
    first = text.split("\n", 1)[0].split(" Debug source:", 1)[0].strip()
    hung = re.search(r" in ([0-9.]+)s - HTTP error: (.*)$", first)
    if hung:
        return (f"no answer after {float(hung.group(1)):.1f} s ({hung.group(2).strip() or 'request failed'}; "
                f"retried up to DCR_STORE_DEADLINE={store_deadline():g} s)")
    return first[:200] or type(exc).__name__


def _failed(exc: BaseException, op: str, url: str, key: str = "") -> StoreError:
    where = f"{url}/{key}" if key else url
    return StoreError(f"cannot {op} {where}: {_cause(exc)}")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    # The store's last-modified time (seconds since the epoch), when it gives one: retention
    # ages markers and orphans by it.
    modified: float | None = None


def _info(meta) -> ObjectInfo:
    when = meta.get("last_modified")
    return ObjectInfo(meta["path"], meta["size"], None if when is None else when.timestamp())


_MEMORY_STORES: dict[str, MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()


class Store:
    """A key-value view of one log root on an object store."""

    def __init__(self, inner, url: str, local_root: Path | None = None):
        self._inner = inner
        self.url = url
        # A directory on this machine: large objects are written to files directly.
        self.local_root = local_root

    @staticmethod
    def url_of(location: str | os.PathLike) -> str:
        """The URL ``open`` would give the store at ``location``, without opening it (the
        location may be gone)."""
        text = os.fspath(location)
        return f"file://{_local_path(text)}" if urlparse(text).scheme in ("", "file") else text

    @staticmethod
    def open(location: str | os.PathLike, create: bool = False) -> Store:
        """A directory path, file://path, memory://name, s3://bucket/prefix (gs://, az:// too).

        S3 credentials and endpoint come from the usual AWS_* environment variables
        (AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true for a plain-HTTP test server).
        """
        text = os.fspath(location)
        parsed = urlparse(text)
        if parsed.scheme in ("", "file"):
            path = _local_path(text)
            if not create and not path.is_dir():
                raise NotFoundError(f"no log directory at {path}")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(exc, f"cannot create {path}") from None
            # automatic_cleanup: a delete also removes the directories it leaves empty (the
            # root excepted), so that gc does not leave a segments/<v>/ behind per version.
            return Store(LocalStore(path, automatic_cleanup=True), f"file://{path}", local_root=path)
        if parsed.scheme == "memory":
            with _MEMORY_LOCK:
                inner = _MEMORY_STORES.setdefault(text, MemoryStore())
            return Store(inner, text)
        if parsed.scheme in ("s3", "gs", "az", "abfs", "http", "https"):
            try:
                # (obstore's overloads are per scheme; the scheme here is known only at run time)
                inner = from_url(text, client_options=_client_options(), retry_config=_retry_config())  # type: ignore[call-overload]
                return Store(inner, text)
            except Exception as exc:  # obstore raises several config errors
                raise UsageError(f"cannot open {text}: {exc}") from None
        raise UsageError(f"unsupported log location {text!r}")

    def get(self, key: str, size: int | None = None, max_size: int | None = None) -> memoryview:
        """The whole value. With ``size`` (the size a commit record gives) or ``max_size``,
        the object's size is checked from its metadata before any byte of it is read
        (WrongSize), and the bytes read are checked again."""
        check_key(key)
        try:
            if self.local_root is not None and size is not None and size >= buffers.HUGE_MIN_BYTES:
                data = self._read_local(self.local_root / key, key, size)
            else:
                result = obstore.get(self._inner, key)
                _check_size(key, int(result.meta["size"]), size, max_size)
                data = memoryview(result.bytes())
        except (ObNotFound, FileNotFoundError, IsADirectoryError):  # (a directory: as obstore answers)
            raise NotFoundError(f"{self.url}: no object {key}") from None
        except DcrError:
            raise
        except MemoryError:
            raise StoreError(f"cannot read {self.url}/{key}: out of memory") from None
        except Exception as exc:
            raise _failed(exc, "read", self.url, key) from None
        _check_size(key, len(data), size, max_size)
        return data

    @staticmethod
    def _read_local(path: Path, key: str, size: int) -> memoryview:
        """A local directory's object of ``size`` bytes (a segment), read into a buffer of
        huge pages (dcr_log.buffers), not into a fresh buffer of ordinary pages as obstore's
        read gives, which is faulted in 4 KiB at a time (tools/bench_read.py --mib 512 --rates
        0.01 0.10 --repeats 5: a dense materialize of 512 MiB in 0.32 s against 0.42 s). A
        private copy, as obstore's: what is hashed is what is decoded."""
        with open(path, "rb", buffering=0) as f:
            _check_size(key, os.fstat(f.fileno()).st_size, size, None)
            data = buffers.zeros(size, np.uint8)
            view = data.data
            got = 0
            while got < size and (n := f.readinto(view[got:])):
                got += n
            if got == size and f.read(1):
                got += 1  # it grew since fstat
            _check_size(key, got, size, None)
        data.flags.writeable = False  # read-only, as obstore's bytes are
        return data.data

    def get_file(self, key: str, size: int):
        """An object too large to hold in memory, as an open binary file of exactly ``size``
        bytes, and its sha256 (hex), computed while the bytes are read in chunks: a local
        directory's own file is opened where it lies (and read once to hash it); another
        store's object is streamed into an unnamed temporary file (TMPDIR), gone once closed.
        The object's size is checked from its metadata before any byte of it is read."""
        check_key(key)
        sha = hashlib.sha256()
        f: IO[bytes] | None = None
        try:
            if self.local_root is not None:
                f = open(self.local_root / key, "rb")
                _check_size(key, os.fstat(f.fileno()).st_size, size, None)
                chunk = bytearray(FILE_CHUNK_BYTES)
                got = 0
                while n := f.readinto(chunk):
                    sha.update(memoryview(chunk)[:n])
                    got += n
            else:
                result = obstore.get(self._inner, key)
                _check_size(key, int(result.meta["size"]), size, None)
                f = tempfile.TemporaryFile(prefix="dcr-segment-")
                got = 0
                for piece in result.stream(min_chunk_size=FILE_CHUNK_BYTES):
                    view = memoryview(piece)
                    sha.update(view)
                    f.write(view)
                    got += view.nbytes
                f.flush()
            _check_size(key, got, size, None)
        except BaseException as exc:
            if f is not None:
                f.close()
            if isinstance(exc, (ObNotFound, FileNotFoundError)):
                raise NotFoundError(f"{self.url}: no object {key}") from None
            if isinstance(exc, (DcrError, KeyboardInterrupt, SystemExit)):
                raise
            if isinstance(exc, OSError) and self.local_root is None:  # the temporary file
                raise os_error(exc, f"cannot spool {self.url}/{key}") from None
            raise _failed(exc, "read", self.url, key) from None
        return f, sha.hexdigest()

    def get_range(self, key: str, start: int, end: int) -> memoryview:
        check_key(key)
        try:
            return memoryview(obstore.get_range(self._inner, key, start=start, end=end))
        except (ObNotFound, FileNotFoundError):
            raise NotFoundError(f"{self.url}: no object {key}") from None
        except Exception as exc:
            raise _failed(exc, "read", self.url, key) from None

    def put_new(self, key: str, data) -> None:
        """Create ``key``; raises AlreadyExists if it is there (nothing is ever overwritten).

        The caller may reuse ``data``'s buffer once this returns: a memory store, which would
        keep a reference to it, gets a copy."""
        check_key(key)
        if self.local_root is not None:
            # Our own temporary file and link (create_file): a process killed mid-write leaves
            # a dot file that listings show and retention removes, not obstore's hidden
            # staging file, which nothing would ever see again.
            self.create_file(key, lambda f: f.write(memoryview(data).cast("B")))
            return
        if isinstance(self._inner, MemoryStore):
            data = bytes(data)
        try:
            obstore.put(self._inner, key, np.frombuffer(data, dtype=np.uint8), mode="create")
        except (AlreadyExistsError, PreconditionError):
            raise AlreadyExists(f"{self.url}: {key} already exists") from None
        except Exception as exc:
            raise _failed(exc, "write", self.url, key) from None

    def create_file(self, key: str, write: Callable[[Any], None]) -> tuple[int, str]:
        """Create ``key`` in a local directory (``local_root``) with the bytes ``write(f)`` writes
        to a binary file object, and return their (size, sha256 hex). They go straight into a
        temporary file that is then hard-linked into place (create-if-absent, atomic: FORMAT.md
        section 15). Raises AlreadyExists like put_new; other stores take put_new."""
        check_key(key)
        if self.local_root is None:
            raise UsageError(f"{self.url} is not a local directory: use put_new")
        final = self.local_root / key
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        linked = False
        try:
            with _create_in_place(final.parent, tmp) as f:
                sink = _HashingWriter(f)
                write(sink)
            try:
                os.link(tmp, final)
            except FileExistsError:  # (only the link's: a directory's race is not the key's)
                raise AlreadyExists(f"{self.url}: {key} already exists") from None
            linked = True
        except OSError as exc:  # no space, read-only, permission: one typed line
            raise os_error(exc, f"cannot write {self.url}/{key}") from None
        finally:
            tmp.unlink(missing_ok=True)
            if not linked:  # as a delete does: no directory left that only the attempt made
                _remove_empty_parents(final.parent, self.local_root)
        return sink.size, sink.sha.hexdigest()

    def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        try:
            meta = obstore.head(self._inner, key)
        except (ObNotFound, FileNotFoundError):
            return None
        except Exception as exc:
            raise _failed(exc, "read", self.url, key) from None
        return _info(meta)

    def list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        try:
            for chunk in obstore.list(self._inner, prefix):
                out.extend(_info(m) for m in chunk)
        except (ObNotFound, FileNotFoundError):
            return out
        except Exception as exc:
            raise _failed(exc, "list", self.url, prefix) from None
        return out

    def delete(self, key: str) -> None:
        check_key(key)
        try:
            obstore.delete(self._inner, key)
        except (ObNotFound, FileNotFoundError):
            pass
        except Exception as exc:
            raise _failed(exc, "delete", self.url, key) from None


# Tries to create a file in a directory that a delete's cleanup or another writer's failed
# create may remove (while it is empty) between our mkdir and our open. Each try lost is
# another thread's progress; eight were lost in a row once on two busy cores (four threads
# creating and deleting in one directory, tests/test_store.py).
CREATE_TRIES = 64


def _create_in_place(directory: Path, path: Path) -> IO[bytes]:
    """``path`` opened for writing, its ``directory`` created first, and again if it was
    removed in between."""
    for _ in range(CREATE_TRIES - 1):
        try:
            # (mkdir's exist_ok re-raises FileExistsError when the directory it found is gone
            # by the time it looks again)
            directory.mkdir(parents=True, exist_ok=True)
            return open(path, "wb")
        except (FileNotFoundError, FileExistsError):
            if directory.exists() and not directory.is_dir():  # a file there: no retry helps
                raise
    directory.mkdir(parents=True, exist_ok=True)
    return open(path, "wb")


def _remove_empty_parents(directory: Path, root: Path) -> None:
    """Remove ``directory`` and its parents below ``root`` while they are empty (what obstore's
    automatic cleanup does after a delete)."""
    while directory != root and root in directory.parents:
        try:
            directory.rmdir()
        except OSError:  # not empty (another writer's file), or gone already
            return
        directory = directory.parent


def _check_size(key: str, actual: int, size: int | None, max_size: int | None) -> None:
    if size is not None and actual != size:
        raise WrongSize(f"{key}: {actual} bytes, commit says {size}")
    if max_size is not None and actual > max_size:
        raise WrongSize(f"{key}: {actual} bytes, more than the limit of {max_size}")


# A write is hashed in pieces of this many bytes, each right after it is written: the kernel's
# copy into the page cache has just brought its lines into this core's L2, where SHA-256 reads
# them 1.4x as fast as from memory (1.6-1.75 against 1.2 GB/s here, one core). Hashed beside
# the write on the side thread, the hash read the whole write from memory while its copy did
# (a dense create of 512 MiB hashed its 360 MB of segments at 0.82-0.88 GB/s). In pieces on
# one thread a create took 0.84-0.86 s of user CPU against 0.92-0.95, 0.627-0.639 s of wall
# against 0.648-0.665 (one-off, ten creates a way, three ways in turn).
HASH_PIECE_BYTES = 256 << 10


class _HashingWriter:
    """A binary file object that hashes and counts what goes through it."""

    closed = False

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, HASH_PIECE_BYTES):
            piece = view[start:start + HASH_PIECE_BYTES]
            self.raw.write(piece)
            self.sha.update(piece)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """The caller closes the underlying file."""


def _local_path(text: str) -> Path:
    parsed = urlparse(text)
    return Path(parsed.path if parsed.scheme == "file" else text).resolve()


# How long one store operation may take, retries included, before it fails with a StoreError
# (seconds; DCR_STORE_DEADLINE). Retries back off exponentially from 100 ms up to 5 s.
DEFAULT_DEADLINE = 60.0


def store_deadline() -> float:
    text = os.environ.get("DCR_STORE_DEADLINE")
    if not text:
        return DEFAULT_DEADLINE
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"DCR_STORE_DEADLINE={text!r}: seconds, a positive number") from None
    if not value > 0:
        raise UsageError(f"DCR_STORE_DEADLINE={text!r}: seconds, a positive number")
    return value


def _client_options() -> dict:
    deadline = store_deadline()
    # A request that hangs (a server that accepts and never answers) is cut at the deadline.
    opts: dict[str, str | bool] = {"timeout": f"{max(1, int(deadline * 1000))}ms",
            "connect_timeout": f"{max(1, int(min(deadline, 10.0) * 1000))}ms"}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
        opts["allow_http"] = True
    return opts


def _retry_config() -> dict:
    from datetime import timedelta

    return {"max_retries": 10, "retry_timeout": timedelta(seconds=store_deadline()),
            "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5),
                        "base": 2.0}}
