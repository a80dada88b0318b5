"""The only module that does object I/O: a thin layer over obstore.

What a store must provide (spec/FORMAT.md, "Storage operations"): get, ranged get, put of a
new key, put-if-absent that fails atomically when the key exists, list by prefix, head and
delete. obstore gives all of these on local disk, memory, S3, GCS and Azure.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import numpy as np
import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError as ObNotFound, PreconditionError
from obstore.store import LocalStore, MemoryStore, from_url

from .errors import DcrError, NotFoundError, UsageError


class AlreadyExists(DcrError):
    """put_if_absent found the key already there."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int


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
    def open(location: str | os.PathLike, create: bool = False) -> "Store":
        """A directory path, file://path, memory://name, s3://bucket/prefix (gs://, az:// too).

        S3 credentials and endpoint come from the usual AWS_* environment variables
        (AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true for a plain-HTTP test server).
        """
        text = os.fspath(location)
        parsed = urlparse(text)
        if parsed.scheme in ("", "file"):
            path = Path(parsed.path if parsed.scheme == "file" else text).resolve()
            if not create and not path.is_dir():
                raise NotFoundError(f"no log directory at {path}")
            path.mkdir(parents=True, exist_ok=True)
            return Store(LocalStore(path), f"file://{path}", local_root=path)
        if parsed.scheme == "memory":
            with _MEMORY_LOCK:
                inner = _MEMORY_STORES.setdefault(text, MemoryStore())
            return Store(inner, text)
        if parsed.scheme in ("s3", "gs", "az", "abfs", "http", "https"):
            try:
                return Store(from_url(text, client_options=_client_options()), text)
            except Exception as exc:  # obstore raises several config errors
                raise UsageError(f"cannot open {text}: {exc}") from None
        raise UsageError(f"unsupported log location {text!r}")

    def get(self, key: str) -> memoryview:
        try:
            return memoryview(obstore.get(self._inner, key).bytes())
        except (ObNotFound, FileNotFoundError):
            raise NotFoundError(f"{self.url}: no object {key}") from None

    def get_range(self, key: str, start: int, end: int) -> memoryview:
        try:
            return memoryview(obstore.get_range(self._inner, key, start=start, end=end))
        except (ObNotFound, FileNotFoundError):
            raise NotFoundError(f"{self.url}: no object {key}") from None

    def put_new(self, key: str, data) -> None:
        """Create ``key``; raises AlreadyExists if it is there (nothing is ever overwritten).

        The caller may reuse ``data``'s buffer once this returns: a memory store, which would
        keep a reference to it, gets a copy."""
        if isinstance(self._inner, MemoryStore):
            data = bytes(data)
        try:
            obstore.put(self._inner, key, np.frombuffer(data, dtype=np.uint8), mode="create")
        except (AlreadyExistsError, PreconditionError):
            raise AlreadyExists(f"{self.url}: {key} already exists") from None

    def create_file(self, key: str, write: Callable[[Any], None]) -> tuple[int, str]:
        """Create ``key`` with the bytes ``write(f)`` writes to a binary file object, and return
        their (size, sha256 hex). In a local directory they go straight into a temporary file
        that is then hard-linked into place (create-if-absent, atomic: FORMAT.md section 15);
        elsewhere they are buffered and put. Raises AlreadyExists like put_new."""
        if self.local_root is None:
            sink = _HashingWriter(io.BytesIO())
            write(sink)
            self.put_new(key, sink.raw.getbuffer())
            return sink.size, sink.sha.hexdigest()
        final = self.local_root / key
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                sink = _HashingWriter(f)
                write(sink)
            try:
                os.link(tmp, final)
            except FileExistsError:
                raise AlreadyExists(f"{self.url}: {key} already exists") from None
        finally:
            tmp.unlink(missing_ok=True)
        return sink.size, sink.sha.hexdigest()

    def head(self, key: str) -> ObjectInfo | None:
        try:
            meta = obstore.head(self._inner, key)
        except (ObNotFound, FileNotFoundError):
            return None
        return ObjectInfo(meta["path"], meta["size"])

    def list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for chunk in obstore.list(self._inner, prefix):
            out.extend(ObjectInfo(m["path"], m["size"]) for m in chunk)
        return out

    def delete(self, key: str) -> None:
        try:
            obstore.delete(self._inner, key)
        except (ObNotFound, FileNotFoundError):
            pass


class _HashingWriter:
    """A binary file object that hashes and counts what goes through it."""

    closed = False

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.raw.write(view)
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


def _client_options() -> dict:
    opts = {}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
        opts["allow_http"] = True
    return opts
