"""Relay mirrors: copy a log from one store to another (the trainer region's bucket to a rollout
region's, or to a disk cache beside the receivers), checking every object before publishing it
and each commit record after everything it names (spec/FORMAT.md section 26).

A mirror is a log of its own with the source's ``dcr.json`` bytes (so the same log id): every
object it holds is byte-identical to the source's object of the same key, so readers and
receivers use it exactly like the source, and mirrors of mirrors form a tree.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from dcr_log.errors import IntegrityError, LineageError, NotFoundError
from dcr_log.format import IDENTITY_KEY, limits, version_key
from dcr_log.format.lifecycle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    RETIRED,
    log_start_key,
    parse_log_start_key,
)
from dcr_log.format.signature import MAX_SIGNATURE_BYTES, SignatureRecord, parse_signature_key, signature_prefix
from dcr_log.log.deltalog import DeltaLog
from dcr_log.store import AlreadyExists, Store


@dataclass
class MirrorReport:
    versions: int = 0       # commit records published by this pass
    objects: int = 0        # objects created (segments, files, signatures, catch-up objects, markers)
    bytes: int = 0          # bytes of the objects created
    latest: int | None = None  # the mirror's latest version after the pass
    start: int = 0          # the mirror's log start


def _publish(dst: Store, key: str, data: bytes, report: MirrorReport) -> None:
    """Create ``key`` at the mirror; an object already there must hold the same bytes (a pass
    interrupted and run again, or another mirror process)."""
    try:
        dst.put_new(key, data)
    except AlreadyExists:
        held = bytes(dst.get(key))
        if held != data:
            raise IntegrityError(f"{dst.url}/{key} holds other bytes than the source's: not a mirror "
                                 "of this log") from None
        return
    report.objects += 1
    report.bytes += len(data)


def _present(dst: Store, key: str, size: int) -> bool:
    info = dst.head(key)
    return info is not None and info.size == size


class Mirror:
    """Copies ``src`` (a DeltaLog) to the store ``dst``; ``progress(v)``, if given, is called
    with each version of the source once the mirror holds it (copied by this pass or before)."""

    def __init__(self, src: DeltaLog, dst: Store, progress: Callable[[int], None] | None = None):
        self.src = src
        self.dst = dst
        self.progress = progress

    def _identity(self, report: MirrorReport) -> None:
        data = bytes(self.src.store.get(IDENTITY_KEY, max_size=limits.MAX_IDENTITY_BYTES))
        try:
            held = bytes(self.dst.get(IDENTITY_KEY, max_size=limits.MAX_IDENTITY_BYTES))
        except NotFoundError:
            _publish(self.dst, IDENTITY_KEY, data, report)
            return
        if held != data:
            raise LineageError(f"{self.dst.url} holds another log than {self.src.store.url}")

    def _dst_versions(self) -> set[int]:
        from dcr_log.format import parse_version_key
        return {v for o in self.dst.list("versions/") if (v := parse_version_key(o.key)) is not None}

    def _segments(self, version: int, refs, report: MirrorReport) -> None:
        for ref in refs:
            if _present(self.dst, ref.key, ref.size):
                continue
            data = bytes(self.src.read_segment(ref, version))  # size and sha256 against the record
            _publish(self.dst, ref.key, data, report)

    def _catchup(self, key: str, report: MirrorReport) -> None:
        cu, sha = self.src.catchup(key)  # checked against its commit record
        if _present(self.dst, cu.key, len(cu.to_bytes())):
            return
        self._segments(cu.version, cu.segments, report)
        data = bytes(self.src.store.get(cu.key, max_size=MAX_MANIFEST_BYTES))
        if hashlib.sha256(data).hexdigest() != sha:
            raise IntegrityError(f"{self.src.store.url}/{cu.key} changed while it was copied")
        _publish(self.dst, cu.key, data, report)

    def _version(self, v: int, previous_digest: int | None, report: MirrorReport) -> int:
        commit = self.src.commit(v)
        if previous_digest is not None and commit.parent_state_digest != previous_digest:
            raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
        self._segments(v, commit.segments, report)
        for entry in commit.files or ():
            if not _present(self.dst, entry.key, entry.size):
                _publish(self.dst, entry.key, self.src.read_file(entry), report)  # sha256 checked
        for o in self.src.store.list(signature_prefix(v)):
            parsed = parse_signature_key(o.key)
            if parsed is None or parsed[0] != v or _present(self.dst, o.key, o.size):
                continue
            data = bytes(self.src.store.get(o.key, max_size=MAX_SIGNATURE_BYTES))
            SignatureRecord.from_bytes(data, o.key)  # well formed (readers check it under a policy)
            _publish(self.dst, o.key, data, report)
        # The commit record last: the version exists at the mirror only once all it names does.
        data = bytes(self.src.store.get(version_key(v), max_size=limits.MAX_COMMIT_BYTES))
        if hashlib.sha256(data).hexdigest() != self.src.commit_sha256(v):
            raise IntegrityError(f"commit record {v} changed while it was copied")
        _publish(self.dst, version_key(v), data, report)
        report.versions += 1
        return commit.state_digest

    def run_once(self) -> MirrorReport:
        """One pass: every version, snapshot, squash and marker of the source that the mirror
        lacks, in an order that keeps the mirror a valid log between any two objects (once
        its first version is there)."""
        report = MirrorReport()
        self._identity(report)
        versions = self.src.versions()
        if not versions:
            report.latest = None
            return report
        start, latest = versions[0], versions[-1]
        have = self._dst_versions()
        # A log after retention: its start's snapshot, then its start version, then the marker.
        if start > 0:
            self._catchup(f"snapshots/{start}/{MANIFEST}", report)
        digest = None
        for v in range(start, latest + 1):
            if v in have:
                digest = self.src.commit(v).state_digest
            else:
                digest = self._version(v, digest, report)
                if v == start and start > 0:
                    self._markers(report)
            if self.progress is not None:
                self.progress(v)
        self._markers(report)
        for cu in list(self.src.snapshots(retired=True).values()) + self.src.squashes():
            self._catchup(cu.key, report)
        for o in self.src.store.list("snapshots/"):  # retire markers of snapshots it holds
            if o.key.endswith("/" + RETIRED) and not _present(self.dst, o.key, o.size):
                marker = self.src.marker(o.key)
                if self.dst.head(f"snapshots/{marker.version}/{MANIFEST}") is not None:
                    _publish(self.dst, o.key, bytes(self.src.store.get(o.key, max_size=MAX_MARKER_BYTES)), report)
        report.latest = latest
        report.start = start
        return report

    def _markers(self, report: MirrorReport) -> None:
        """Log-start markers whose version and snapshot the mirror already holds."""
        for o in self.src.store.list("log-start/"):
            s = parse_log_start_key(o.key)
            if s is None or _present(self.dst, o.key, o.size):
                continue
            if self.dst.head(version_key(s)) is None or self.dst.head(f"snapshots/{s}/{MANIFEST}") is None:
                continue  # not yet: a marker above what the mirror holds would break its listing
            self.src.marker(log_start_key(s))  # checked
            _publish(self.dst, o.key, bytes(self.src.store.get(o.key, max_size=MAX_MARKER_BYTES)), report)

    def follow(self, interval: float = 1.0, stop: Callable[[], bool] | None = None,
               on_pass: Callable[[MirrorReport], None] | None = None) -> None:
        """Mirror pass after pass until ``stop()``, waiting ``interval`` seconds between them."""
        stop = stop or (lambda: False)
        while not stop():
            report = self.run_once()
            if on_pass is not None:
                on_pass(report)
            deadline = time.monotonic() + interval
            while not stop() and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))


def mirror(src, dst, follow: bool = False, interval: float = 1.0,
           stop: Callable[[], bool] | None = None,
           progress: Callable[[int], None] | None = None) -> MirrorReport:
    """Copy log ``src`` (a location or DeltaLog) to ``dst`` (a location or Store); with
    ``follow``, keep copying new versions until ``stop()``. ``progress``: see Mirror."""
    log = src if isinstance(src, DeltaLog) else DeltaLog.open(src)
    store = dst if isinstance(dst, Store) else Store.open(dst, create=True)
    m = Mirror(log, store, progress)
    if follow:
        m.follow(interval, stop)
    return m.run_once()
