"""Catch-up objects and retention markers (spec/FORMAT.md sections 23-25). Pure: bytes in,
bytes out.

- a *snapshot* of version V (``snapshots/<V>/manifest.json``): the full state of V as
  ``tensor`` records in segment files beside the manifest;
- a *squash* from A to B (``squashes/<A>-<B>/manifest.json``): one delta taking A's state to
  B's, records as in a version;
- a *log-start marker* (``log-start/<20 digits>.json``): versions below it are expired;
- a *retire marker* (``snapshots/<V>/retired.json``): a snapshot that retention will delete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format import limits as L
from dcr_log.format.canonical import seal, unseal
from dcr_log.format.commit import (
    FORMAT_VERSION,
    CommitStats,
    SegmentRef,
    _expect,
    _int,
    _keys,
    _str,
    _text,
    check_format_version,
    parse_segments,
    parse_stats,
)
from dcr_log.format.tensors import digest_hex

SNAPSHOTS_PREFIX = "snapshots/"
SQUASHES_PREFIX = "squashes/"
LOG_START_PREFIX = "log-start/"
MANIFEST = "manifest.json"
RETIRED = "retired.json"
MAX_MANIFEST_BYTES = L.MAX_COMMIT_BYTES
MAX_MARKER_BYTES = 65536

_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UUID = re.compile(r"[0-9a-f]{32}")
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{0,249}\.arrow")
_SNAPSHOT_KEY = re.compile(r"snapshots/(0|[1-9][0-9]{0,19})/(manifest|retired)\.json")
_SQUASH_KEY = re.compile(r"squashes/(0|[1-9][0-9]{0,19})-(0|[1-9][0-9]{0,19})/manifest\.json")
_START_KEY = re.compile(r"log-start/([0-9]{20})\.json")


def snapshot_prefix(version: int) -> str:
    return f"{SNAPSHOTS_PREFIX}{version}/"


def squash_prefix(start: int, end: int) -> str:
    return f"{SQUASHES_PREFIX}{start}-{end}/"


def log_start_key(start: int) -> str:
    return f"{LOG_START_PREFIX}{start:020d}.json"


def parse_snapshot_key(key: str) -> tuple[int, str] | None:
    """(version, "manifest" or "retired") for the keys of section 23, else None."""
    m = _SNAPSHOT_KEY.fullmatch(key)
    return (int(m.group(1)), m.group(2)) if m else None


def parse_squash_key(key: str) -> tuple[int, int] | None:
    m = _SQUASH_KEY.fullmatch(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_log_start_key(key: str) -> int | None:
    m = _START_KEY.fullmatch(key)
    return int(m.group(1)) if m else None


def check_object_key(key: str, prefix: str, what: str) -> None:
    """A segment of a catch-up object: ``prefix`` then a file name ending in ``.arrow``."""
    if not key.startswith(prefix) or not _SEGMENT_NAME.fullmatch(key[len(prefix):]):
        raise IntegrityError(f"{what}: segment key {key[:300]!r} does not lie under {prefix}")


@dataclass(frozen=True)
class CatchUp:
    """A snapshot (``start`` None: the whole state of ``version``) or a squash (the changes
    from ``start`` to ``version``). ``commit_sha256`` binds it to the commit record of
    ``version``, whose tensor table it must reproduce."""

    log_id: str
    version: int
    start: int | None
    start_state_digest: int | None
    state_digest: int
    commit_sha256: str
    segments: tuple[SegmentRef, ...]
    stats: CommitStats
    created_at: str
    writer_id: str
    format_version: int = FORMAT_VERSION

    @property
    def kind(self) -> str:
        return "snapshot" if self.start is None else "squash"

    @property
    def prefix(self) -> str:
        return snapshot_prefix(self.version) if self.start is None else squash_prefix(self.start, self.version)

    @property
    def key(self) -> str:
        return self.prefix + MANIFEST

    @property
    def delta_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def to_bytes(self) -> bytes:
        if (self.start is None) != (self.start_state_digest is None):
            raise UsageError("a squash has a start and its state digest; a snapshot neither")
        if self.start is not None and not self.start < self.version:
            raise UsageError(f"a squash goes forward: {self.start} to {self.version}")
        data = seal({
            "format_version": self.format_version,
            "log_id": self.log_id,
            "kind": self.kind,
            "version": self.version,
            "from": self.start,
            "from_state_digest": None if self.start_state_digest is None else digest_hex(self.start_state_digest),
            "state_digest": digest_hex(self.state_digest),
            "commit_sha256": self.commit_sha256,
            "segments": [s.to_json() for s in self.segments],
            "stats": self.stats.to_json(),
            "created_at": self.created_at,
            "writer_id": self.writer_id,
        })
        if len(data) > MAX_MANIFEST_BYTES:
            raise UsageError(f"{self.key}: {len(data)} bytes, more than the limit of {MAX_MANIFEST_BYTES}")
        return data

    @staticmethod
    def from_bytes(data: bytes, key: str) -> CatchUp:
        what = key
        L.check(len(data) <= MAX_MANIFEST_BYTES, what, f"more than {MAX_MANIFEST_BYTES} bytes")
        obj = unseal(data, what)
        _keys(obj, what, {"format_version", "log_id", "kind", "version", "from", "from_state_digest",
                          "state_digest", "commit_sha256", "segments", "stats", "created_at", "writer_id"})
        check_format_version(obj, what)
        kind = obj["kind"]
        _expect(kind in ("snapshot", "squash"), what, f"unknown kind {str(kind)[:40]!r}")
        version = _int(obj["version"], what, "version")
        if kind == "snapshot":
            _expect(obj["from"] is None and obj["from_state_digest"] is None, what,
                    "a snapshot has no from")
            start = start_digest = None
            _expect(parse_snapshot_key(key) == (version, "manifest"), what, "key does not name its version")
        else:
            start = _int(obj["from"], what, "from")
            _expect(start < version, what, f"squash from {start} to {version} does not go forward")
            start_digest = int(_str(obj["from_state_digest"], what, "from_state_digest", _HEX16), 16)
            _expect(parse_squash_key(key) == (start, version), what, "key does not name its versions")
        prefix = key[: -len(MANIFEST)]
        segments = parse_segments(obj["segments"], what, lambda k: check_object_key(k, prefix, what))
        stats = parse_stats(obj["stats"], what)
        _expect(stats.records == sum(s.records for s in segments), what,
                "stats.records differs from the sum of the segments' records")
        return CatchUp(
            log_id=_str(obj["log_id"], what, "log_id", _UUID),
            version=version, start=start, start_state_digest=start_digest,
            state_digest=int(_str(obj["state_digest"], what, "state_digest", _HEX16), 16),
            commit_sha256=_str(obj["commit_sha256"], what, "commit_sha256", _HEX64),
            segments=segments, stats=stats,
            created_at=_text(obj["created_at"], what, "created_at"),
            writer_id=_text(obj["writer_id"], what, "writer_id"),
            format_version=obj["format_version"],
        )


@dataclass(frozen=True)
class Marker:
    """A log-start marker (``kind`` "log-start": versions below ``version`` are expired; the
    snapshot of ``version`` whose manifest has ``snapshot_sha256`` is where readers start) or a
    retire marker (``kind`` "retired": the snapshot of ``version`` is to be deleted)."""

    log_id: str
    kind: str
    version: int
    snapshot_sha256: str
    created_at: str
    format_version: int = FORMAT_VERSION

    @property
    def key(self) -> str:
        return log_start_key(self.version) if self.kind == "log-start" else snapshot_prefix(self.version) + RETIRED

    def to_bytes(self) -> bytes:
        if self.kind not in ("log-start", "retired"):
            raise UsageError(f"unknown marker kind {self.kind!r}")
        return seal({"format_version": self.format_version, "log_id": self.log_id, "kind": self.kind,
                     "version": self.version, "snapshot_sha256": self.snapshot_sha256,
                     "created_at": self.created_at})

    @staticmethod
    def from_bytes(data: bytes, key: str) -> Marker:
        what = key
        L.check(len(data) <= MAX_MARKER_BYTES, what, f"more than {MAX_MARKER_BYTES} bytes")
        obj = unseal(data, what)
        _keys(obj, what, {"format_version", "log_id", "kind", "version", "snapshot_sha256", "created_at"})
        check_format_version(obj, what)
        kind = obj["kind"]
        _expect(kind in ("log-start", "retired"), what, f"unknown kind {str(kind)[:40]!r}")
        version = _int(obj["version"], what, "version")
        if kind == "log-start":
            _expect(parse_log_start_key(key) == version, what, "key does not name its version")
        else:
            _expect(parse_snapshot_key(key) == (version, "retired"), what, "key does not name its version")
        return Marker(_str(obj["log_id"], what, "log_id", _UUID), kind, version,
                      _str(obj["snapshot_sha256"], what, "snapshot_sha256", _HEX64),
                      _text(obj["created_at"], what, "created_at"), obj["format_version"])
