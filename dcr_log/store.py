"""The only module that does object I/O: a thin layer over obstore.

What a store must provide (spec/FORMAT.md, "Storage operations"): get, ranged get, put of a
new key, put-if-absent that fails atomically when the key exists, list by prefix, head and
delete. obstore gives all of these on local disk, memory, S3, GCS and Azure.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
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

    def __init__(self, inner, url: str):
        self._inner = inner
        self.url = url

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
            return Store(LocalStore(path), f"file://{path}")
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


def _client_options() -> dict:
    opts = {}
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
        opts["allow_http"] = True
    return opts
