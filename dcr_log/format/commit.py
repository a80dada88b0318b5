"""Log identity (dcr.json) and commit records (versions/NNN.json). Pure: bytes in, bytes out."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from dcr_log.coords import DTYPE_WIDTH
from dcr_log.digest import SUM_DIGESTS
from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format import limits as L
from dcr_log.format.canonical import seal, unseal
from dcr_log.format.files import FILES, FileEntry, parse_files
from dcr_log.format.keys import check_segment_key
from dcr_log.format.tensors import TensorInfo, digest_hex

FORMAT_VERSION = 1
# The log features that allow the ``ulp`` and ``ulp-rans`` encodings (section 14).
ULP_ENCODING = "ulp-encoding"
RANS_ENCODING = "rans-encoding"
# Features this implementation reads and writes. A reader MUST refuse a log or commit that
# lists a feature it does not know.
KNOWN_FEATURES: frozenset[str] = frozenset({SUM_DIGESTS, FILES, ULP_ENCODING, RANS_ENCODING})

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_UUID = re.compile(r"^[0-9a-f]{32}$")
_TENSOR_MEMBERS = frozenset({"name", "dtype", "shape", "digest"})



def _expect(cond: bool, what: str, msg: str) -> None:
    if not cond:
        raise IntegrityError(f"{what}: {msg}")


def _int(v, what, name, minimum=0) -> int:
    _expect(type(v) is int and minimum <= v < 1 << 64, what,
            f"{name} must be an integer >= {minimum} and below 2^64")
    return v


def _str(v, what, name, pattern: re.Pattern | None = None) -> str:
    # fullmatch: ``$`` alone would also accept a trailing newline.
    _expect(isinstance(v, str) and (pattern is None or pattern.fullmatch(v) is not None), what, f"bad {name}")
    return v


def _text(v, what, name) -> str:
    """An informative string (created_at, writer_id): any string within the limit."""
    _expect(isinstance(v, str), what, f"{name} must be a string")
    L.check(len(v) <= L.MAX_TEXT_CHARS, what, f"{name} longer than {L.MAX_TEXT_CHARS} characters")
    return v


def _shape(v, what) -> tuple[int, ...]:
    # A commit has a shape per tensor: the common case checked in one pass, the checks below
    # (which name the fault) only when it fails.
    if type(v) is list and len(v) <= L.MAX_RANK and all(type(d) is int and 0 <= d <= L.MAX_DIM for d in v):
        return tuple(v)
    _expect(isinstance(v, list), what, "shape must be a list")
    L.check(len(v) <= L.MAX_RANK, what, f"rank {len(v)} above {L.MAX_RANK}")
    shape = tuple(_int(d, what, "dimension") for d in v)
    L.check(all(d <= L.MAX_DIM for d in shape), what, f"a dimension above {L.MAX_DIM}")
    return shape


def _valid_name(name) -> bool:
    """Non-empty, no NUL or LF (the state digest's separators), valid UTF-8 (no lone surrogates)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\n" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= L.MAX_NAME_BYTES
    except UnicodeEncodeError:
        return False


def _keys(obj: dict, what: str, keys: set[str] | frozenset[str]) -> None:
    _expect(isinstance(obj, dict), what, "expected an object")
    if obj.keys() != keys:  # (the message only when it is needed: a commit has a table per tensor)
        raise IntegrityError(f"{what}: members {sorted(obj)} differ from {sorted(keys)}")


def check_features(features, what: str) -> tuple[str, ...]:
    _expect(isinstance(features, list) and all(isinstance(f, str) for f in features), what,
            "features must be a list of strings")
    L.check(len(features) <= 64, what, "too many features")
    unknown = sorted(set(features) - KNOWN_FEATURES)
    if unknown:
        raise IntegrityError(f"{what}: unsupported features {unknown}; upgrade dcr-log")
    _expect(len(set(features)) == len(features), what, "a feature is listed twice")
    _expect(features == sorted(features, key=lambda f: f.encode()), what,
            "features are not in increasing order (FORMAT.md section 14)")
    return tuple(features)


def check_format_version(obj: dict, what: str) -> None:
    if type(obj["format_version"]) is not int or obj["format_version"] != FORMAT_VERSION:
        raise IntegrityError(f"{what}: format version {obj['format_version']!r} is not supported")


def parse_segments(value, what: str, check_key: Callable[[str], None]) -> tuple[SegmentRef, ...]:
    """A list of segment objects (a commit record's, a snapshot's or a squash's), each key
    checked by ``check_key``, within the limits of section 20, no key twice."""
    _expect(isinstance(value, list), what, "segments must be a list")
    L.check(len(value) <= L.MAX_SEGMENTS, what, f"more than {L.MAX_SEGMENTS} segments")
    segments = []
    for s in value:
        _keys(s, what, {"key", "size", "sha256", "records"})
        check_key(_str(s["key"], what, "segment key"))
        ref = SegmentRef(s["key"], _int(s["size"], what, "size"), _str(s["sha256"], what, "sha256", _HEX64),
                         _int(s["records"], what, "records"))
        L.check(ref.size <= L.MAX_SEGMENT_BYTES, what, f"segment {ref.key} of {ref.size} bytes")
        L.check(ref.records <= L.MAX_SEGMENT_RECORDS, what, f"segment {ref.key} of {ref.records} records")
        segments.append(ref)
    _expect(len({s.key for s in segments}) == len(segments), what, "duplicate segment")
    return tuple(segments)


def parse_stats(value, what: str) -> CommitStats:
    _keys(value, what, {"changed_elements", "total_elements", "records"})
    return CommitStats(_int(value["changed_elements"], what, "changed_elements"),
                       _int(value["total_elements"], what, "total_elements"),
                       _int(value["records"], what, "records"))


@dataclass(frozen=True)
class LogIdentity:
    log_id: str
    created_at: str
    format_version: int = FORMAT_VERSION
    features: tuple[str, ...] = ()

    def to_bytes(self) -> bytes:
        return seal({
            "format_version": self.format_version,
            "log_id": self.log_id,
            "created_at": self.created_at,
            "features": list(self.features),
        })

    @staticmethod
    def from_bytes(data: bytes) -> LogIdentity:
        what = "dcr.json"
        L.check(len(data) <= L.MAX_IDENTITY_BYTES, what, f"more than {L.MAX_IDENTITY_BYTES} bytes")
        obj = unseal(data, what)
        _keys(obj, what, {"format_version", "log_id", "created_at", "features"})
        check_format_version(obj, what)
        return LogIdentity(
            log_id=_str(obj["log_id"], what, "log_id", _UUID),
            created_at=_text(obj["created_at"], what, "created_at"),
            format_version=obj["format_version"],
            features=check_features(obj["features"], what),
        )


@dataclass(frozen=True)
class SegmentRef:
    key: str
    size: int
    sha256: str
    records: int

    def to_json(self) -> dict:
        return {"key": self.key, "size": self.size, "sha256": self.sha256, "records": self.records}


@dataclass(frozen=True)
class CommitStats:
    changed_elements: int
    total_elements: int
    records: int

    def to_json(self) -> dict:
        return {
            "changed_elements": self.changed_elements,
            "total_elements": self.total_elements,
            "records": self.records,
        }


@dataclass(frozen=True)
class CommitRecord:
    log_id: str
    version: int
    parent: int | None
    parent_state_digest: int | None
    state_digest: int
    segments: tuple[SegmentRef, ...]
    tensors: tuple[TensorInfo, ...]
    stats: CommitStats
    created_at: str
    writer_id: str
    format_version: int = FORMAT_VERSION
    features: tuple[str, ...] = field(default=())
    # Feature ``files``: every file of the version, sorted by name; None in a log without it
    # (the record then has no ``files`` member).
    files: tuple[FileEntry, ...] | None = None

    @property
    def delta_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def tensor_map(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def to_bytes(self) -> bytes:
        if (self.parent is None) != (self.version == 0) or (self.parent is None) != (
            self.parent_state_digest is None
        ):
            raise UsageError("version 0 and only version 0 has no parent")
        body = {
            "format_version": self.format_version,
            "features": list(self.features),
            "log_id": self.log_id,
            "version": self.version,
            "parent": self.parent,
            "parent_state_digest": None
            if self.parent_state_digest is None
            else digest_hex(self.parent_state_digest),
            "state_digest": digest_hex(self.state_digest),
            "segments": [s.to_json() for s in self.segments],
            "tensors": [t.to_json() for t in sorted(self.tensors, key=lambda t: t.name.encode())],
            "stats": self.stats.to_json(),
            "created_at": self.created_at,
            "writer_id": self.writer_id,
        }
        if self.files is not None:
            body["files"] = [f.to_json() for f in sorted(self.files, key=lambda f: f.name.encode())]
        data = seal(body)
        if len(data) > L.MAX_COMMIT_BYTES:  # writers MUST NOT write what readers refuse
            raise UsageError(f"commit record {self.version}: {len(data)} bytes, more than the limit of "
                             f"{L.MAX_COMMIT_BYTES} (too many tensors or segments for one version)")
        return data

    @staticmethod
    def from_bytes(data: bytes, expect_version: int | None = None) -> CommitRecord:
        what = "commit record" if expect_version is None else f"commit record {expect_version}"
        L.check(len(data) <= L.MAX_COMMIT_BYTES, what, f"more than {L.MAX_COMMIT_BYTES} bytes")
        obj = unseal(data, what)
        _expect(isinstance(obj, dict), what, "expected an object")
        features = check_features(obj.get("features"), what)
        members = {
            "format_version", "features", "log_id", "version", "parent", "parent_state_digest",
            "state_digest", "segments", "tensors", "stats", "created_at", "writer_id",
        }
        _keys(obj, what, members | {"files"} if FILES in features else members)
        check_format_version(obj, what)
        version = _int(obj["version"], what, "version")
        if expect_version is not None and version != expect_version:
            raise IntegrityError(f"{what}: holds version {version}")
        if version == 0:
            _expect(obj["parent"] is None and obj["parent_state_digest"] is None, what,
                    "version 0 has no parent")
            parent, parent_digest = None, None
        else:
            parent = _int(obj["parent"], what, "parent")
            _expect(parent == version - 1, what, f"parent {parent} is not version {version - 1}")
            parent_digest = int(_str(obj["parent_state_digest"], what, "parent_state_digest", _HEX16), 16)
        segments = parse_segments(obj["segments"], what, lambda key: check_segment_key(key, version))
        tensors = []
        _expect(isinstance(obj["tensors"], list), what, "tensors must be a list")
        L.check(len(obj["tensors"]) <= L.MAX_TENSORS, what, f"more than {L.MAX_TENSORS} tensors")
        state_bytes = elements = 0
        # Once per tensor, and a model may have tens of thousands: no message is formatted
        # unless its check fails.
        for t in obj["tensors"]:
            _keys(t, what, _TENSOR_MEMBERS)
            name, dtype, digest = t["name"], t["dtype"], t["digest"]
            _expect(_valid_name(name), what, "bad tensor name")
            if not (isinstance(dtype, str) and dtype in DTYPE_WIDTH):
                raise IntegrityError(f"{what}: unknown dtype {str(dtype)[:40]!r}")
            shape = _shape(t["shape"], what)
            count = math.prod(shape)  # (numel, of a shape _shape checked to be ints)
            nbytes = count * DTYPE_WIDTH[dtype]
            if nbytes > L.MAX_TENSOR_BYTES:
                L.check(False, what, f"tensor {name[:80]!r} of {nbytes} bytes")
            if not (isinstance(digest, str) and _HEX16.fullmatch(digest)):
                raise IntegrityError(f"{what}: bad digest")
            state_bytes += nbytes
            elements += count
            tensors.append(TensorInfo(name, dtype, shape, int(digest, 16)))
        L.check(state_bytes <= L.MAX_STATE_BYTES, what, f"a state of {state_bytes} bytes")
        names = [t.name.encode() for t in tensors]
        _expect(names == sorted(set(names)), what, "tensor names must be unique and sorted")
        stats = parse_stats(obj["stats"], what)
        _expect(stats.total_elements == elements, what, "stats.total_elements differs from the tensor table")
        _expect(stats.records == sum(s.records for s in segments), what,
                "stats.records differs from the sum of the segments' records")
        files = parse_files(obj["files"], what) if FILES in features else None
        return CommitRecord(
            log_id=_str(obj["log_id"], what, "log_id", _UUID),
            version=version,
            parent=parent,
            parent_state_digest=parent_digest,
            state_digest=int(_str(obj["state_digest"], what, "state_digest", _HEX16), 16),
            segments=segments,
            tensors=tuple(tensors),
            stats=stats,
            created_at=_text(obj["created_at"], what, "created_at"),
            writer_id=_text(obj["writer_id"], what, "writer_id"),
            format_version=obj["format_version"],
            features=features,
            files=files,
        )
