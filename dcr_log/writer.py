"""LogWriter: create a log and append states as deltas against a baseline it keeps."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from datetime import datetime, timezone
from typing import Any, Callable, Mapping


from .delta import Differ, EncodePolicy
from .errors import CommitConflict, UsageError
from .format import (
    IDENTITY_KEY,
    CommitRecord,
    CommitStats,
    LogIdentity,
    SegmentBuilder,
    SegmentRef,
    segment_key,
)
from .format.keys import check_writer_id
from .log import DeltaLog
from .state import TensorBits, TensorInfo, state_digest, to_state, words_digest
from .store import AlreadyExists, Store

# A segment file is closed and uploaded once it holds this many payload bytes.
DEFAULT_SEGMENT_BYTES = 256 << 20


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_writer_id() -> str:
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


class LogWriter:
    """Appends versions to one log. Keeps its own copy of the last committed state (the
    baseline), so an append costs one pass over the new state and no replay.
    """

    def __init__(self, log: DeltaLog, baseline: dict[str, TensorBits], baseline_version: int,
                 writer_id: str | None = None, policy: EncodePolicy | None = None,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES):
        self.log = log
        self.writer_id = check_writer_id(writer_id or default_writer_id())
        self.segment_bytes = segment_bytes
        self._differ = Differ(policy)
        self._baseline = baseline
        self._baseline_version = baseline_version
        self._baseline_table = {
            t.name: t for t in log.commit(baseline_version).tensors
        } if baseline_version >= 0 else {}

    @property
    def version(self) -> int:
        """The last version this writer committed or started from."""
        return self._baseline_version

    @staticmethod
    def create(location: str | os.PathLike | Store, state: Mapping[str, Any],
               progress: Callable[[int], None] | None = None, **kwargs) -> "LogWriter":
        """Create a new log whose version 0 is the full ``state``."""
        store = location if isinstance(location, Store) else Store.open(location, create=True)
        identity = LogIdentity(log_id=uuid.uuid4().hex, created_at=utc_now())
        try:
            store.put_new(IDENTITY_KEY, identity.to_bytes())
        except AlreadyExists:
            raise CommitConflict(f"{store.url} already holds a log") from None
        writer = LogWriter(DeltaLog(store, identity), {}, -1, **kwargs)
        writer.append(state, progress=progress)
        return writer

    @staticmethod
    def open(location: str | os.PathLike | Store | DeltaLog, progress=None, **kwargs) -> "LogWriter":
        """Resume writing a log: its latest version, rebuilt by replay, is the baseline."""
        log = location if isinstance(location, DeltaLog) else DeltaLog.open(location)
        latest = log.latest_version()
        return LogWriter(log, log.materialize(latest, progress=progress), latest, **kwargs)

    def append(self, state: Mapping[str, Any], kind: str = "xor",
               progress: Callable[[int], None] | None = None) -> CommitRecord:
        """Commit ``state`` as the next version. ``kind`` is ``xor`` or ``overwrite``.

        Raises CommitConflict (and leaves the baseline as it was) if another writer already
        committed that version.
        """
        if kind not in ("xor", "overwrite"):
            raise UsageError(f"append kind must be xor or overwrite, not {kind!r}")
        new = to_state(state)
        version = self._baseline_version + 1
        log = self.log
        refs: list[SegmentRef] = []
        builder = SegmentBuilder(log.log_id, version)
        changed = records = 0
        table: dict[str, TensorInfo] = {}
        changed_words: dict[str, list] = {}  # per tensor: (flat indices, new words) of its deltas

        def flush() -> None:
            nonlocal builder
            if builder.records == 0:
                return
            data = builder.finish()
            key = segment_key(version, self.writer_id, uuid.uuid4().hex)
            log.store.put_new(key, data)
            refs.append(SegmentRef(key, data.size, hashlib.sha256(data).hexdigest(), builder.records))
            builder = SegmentBuilder(log.log_id, version)

        for name in sorted(new, key=str.encode):
            bits = new[name]
            base = self._baseline.get(name)
            touched = False
            changed_words[name] = []
            for rec in self._differ.diff(name, base, bits, kind=kind, changed=changed_words[name]):
                builder.add(rec)
                touched = True
                changed += rec.n_changed
                records += 1
                if builder.payload_bytes >= self.segment_bytes:
                    flush()
            old = self._baseline_table.get(name)
            if not touched and old is not None and old.dtype == bits.dtype and old.shape == bits.shape:
                table[name] = old  # unchanged bits: the digest carries over without a pass
            else:
                table[name] = TensorInfo(name, bits.dtype, bits.shape, words_digest(bits.words))
            if progress:
                progress(bits.nbytes)
        flush()
        parent = self._baseline_version if version > 0 else None
        commit = CommitRecord(
            log_id=log.log_id,
            version=version,
            parent=parent,
            parent_state_digest=None if parent is None else log.commit(parent).state_digest,
            state_digest=state_digest(table),
            segments=tuple(refs),
            tensors=tuple(table.values()),
            stats=CommitStats(changed, sum(b.words.size for b in new.values()), records),
            created_at=utc_now(),
            writer_id=self.writer_id,
        )
        try:
            log.write_commit(commit)
        except CommitConflict:
            for ref in refs:  # never referenced by any commit: safe to remove
                log.store.delete(ref.key)
            raise
        self._advance_baseline(new, table, version, changed_words)
        return commit

    def _advance_baseline(self, new: dict[str, TensorBits], table, version: int,
                          changed_words: dict[str, list]) -> None:
        """Make the baseline equal the committed state: a scatter of the changed words into
        tensors whose dtype and shape stayed, a copy of the others (new, reshaped, retyped)."""
        baseline = {}
        for name, bits in new.items():
            old = self._baseline.get(name)
            if old is not None and old.dtype == bits.dtype and old.shape == bits.shape:
                for flat, words in changed_words.get(name, ()):
                    old.words[flat] = words
                baseline[name] = old
            else:
                baseline[name] = TensorBits(bits.dtype, bits.shape, bits.words.copy())
        self._baseline = baseline
        self._baseline_table = table
        self._baseline_version = version


def create_log(location, state, **kwargs) -> LogWriter:
    return LogWriter.create(location, state, **kwargs)
