"""The test vectors of spec/vectors/.

Every valid log reads back, version by version, to the tensors its expected.json lists, both
through dcr_log.DeltaLog and through a small independent reader written from spec/FORMAT.md
alone (pyarrow, zstandard, pcodec, xxhash and numpy, and tools/rans_spec.py for the rANS of
ulp-rans; nothing from dcr_log), features sum-digests (section 7.1), files (section 22),
ulp-encoding and rans-encoding (section 11) included, and so do its
snapshots and squashes, from the log start of retention on (sections 23 to 25). Every invalid
log fails with the stated error class at the stated stage and not before. The generator
reproduces the committed files byte for byte.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pcodec
import pyarrow as pa
import pytest
import xxhash
import zstandard

from dcr_log import DeltaLog, errors
from dcr_log.state import TensorBits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import rans_spec  # noqa: E402, I001  (the ulp-rans coder, from FORMAT.md section 11 alone)

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO / "spec" / "vectors"
VALID = sorted(p.name for p in VECTORS.iterdir() if (p / "expected.json").is_file())
INVALID = sorted(p.name for p in (VECTORS / "invalid").iterdir() if (p / "expected.json").is_file())

# Invalid vectors that this implementation accepts although FORMAT.md says a reader MUST reject
# them. strict: once the reader is fixed the test fails until the entry is removed.
KNOWN_READER_GAPS: dict[str, str] = {
}


def load_expected(path: Path) -> dict:
    return json.loads((path / "expected.json").read_bytes())


def utf8_sorted(names):
    return sorted(names, key=lambda n: n.encode("utf-8"))


# -- an independent reader, from spec/FORMAT.md ------------------------------------------------

WIDTH = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
         "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
MUST_ESCAPE = re.compile(r'["\\]|[^\x20-\x7e]')


def _escape(match: re.Match) -> str:
    ch = match.group(0)
    if ch in SHORT_ESCAPES:
        return SHORT_ESCAPES[ch]
    cp = ord(ch)
    if cp > 0xFFFF:
        cp -= 0x10000
        return f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}"
    return f"\\u{cp:04x}"


def spec_canonical(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool) or isinstance(value, float):
        raise AssertionError(f"{value!r}: only integers, strings, null, lists and objects")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + MUST_ESCAPE.sub(_escape, value) + '"'
    if isinstance(value, list):
        return "[" + ",".join(spec_canonical(v) for v in value) + "]"
    items = sorted(value.items(), key=lambda kv: kv[0].encode("utf-8"))
    return "{" + ",".join(spec_canonical(k) + ":" + spec_canonical(v) for k, v in items) + "}"


def spec_unseal(data: bytes) -> dict:
    obj = json.loads(data)
    assert spec_canonical(obj).encode() == data, "not the canonical form"
    body = {k: v for k, v in obj.items() if k != "checksum"}
    assert hashlib.sha256(spec_canonical(body).encode()).hexdigest() == obj["checksum"]
    return body


def word(width: int) -> np.dtype:
    return np.dtype(f"<u{width}")


def xxh3(words: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(words.tobytes())


# Feature sum-digests, FORMAT.md section 7.1.
SUM_DIGESTS = "sum-digests"
MASK64 = (1 << 64) - 1
G, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def e_plain(f: int, w: int) -> int:
    z = (((f + 1) * G) & MASK64) ^ w
    z ^= z >> 30
    z = (z * M1) & MASK64
    z ^= z >> 27
    z = (z * M2) & MASK64
    return z ^ (z >> 31)


def e_hashes(flat: np.ndarray, words: np.ndarray) -> np.ndarray:
    """e(flat[i], words[i]) as uint64 (numpy's uint64 arithmetic is mod 2^64)."""
    z = (np.asarray(flat, dtype=np.int64).astype(np.uint64) + np.uint64(1)) * np.uint64(G)
    z ^= words.astype(np.uint64)  # words are unsigned: zero-extended
    z ^= z >> np.uint64(30)
    z *= np.uint64(M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(M2)
    return z ^ (z >> np.uint64(31))


def sum_digest(flat: np.ndarray, words: np.ndarray) -> int:
    return int(np.sum(e_hashes(flat, words), dtype=np.uint64)) if words.size else 0


def digest_of(features: list[str], flat: np.ndarray, words: np.ndarray) -> int:
    """A record digest (words at tensor flat indices ``flat``) under the log's scheme."""
    return sum_digest(flat, words) if SUM_DIGESTS in features else xxh3(words)


def tensor_digest(features: list[str], words: np.ndarray) -> int:
    return digest_of(features, np.arange(words.size), words)


def unplane(buf: bytes, count: int, width: int) -> np.ndarray:
    assert len(buf) == count * width
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(width, count)
    return np.ascontiguousarray(planes.T).reshape(-1).view(word(width))


def zstd_exact(payload: bytes, size: int) -> bytes:
    """One frame declaring ``size`` bytes, holding them, with nothing after it."""
    assert zstandard.get_frame_parameters(payload).content_size == size
    frame = zstandard.ZstdDecompressor().decompressobj()
    body = frame.decompress(payload)
    assert frame.eof and frame.unused_data == b"" and len(body) == size
    return body


def spec_state_digest(table: list[dict]) -> str:
    lines = sorted(t["name"].encode() + b"\0" + t["dtype"].encode() + b"\0"
                   + ",".join(map(str, t["shape"])).encode() + b"\0" + t["digest"].encode() + b"\n"
                   for t in table)
    return f"{xxhash.xxh3_64_intdigest(b''.join(lines)):016x}"


# Features ulp-encoding and rans-encoding, FORMAT.md section 11.
ULP_ENCODING = "ulp-encoding"
RANS_ENCODING = "rans-encoding"


def spec_key(words: np.ndarray, bits: int) -> np.ndarray:
    x = words.astype(np.uint64)
    top = np.uint64(1 << (bits - 1))
    return np.where(x >= top, x ^ np.uint64((1 << bits) - 1), x ^ top)


def spec_unkey(keys: np.ndarray, bits: int) -> np.ndarray:
    top = np.uint64(1 << (bits - 1))
    return np.where(keys >= top, keys ^ top, keys ^ np.uint64((1 << bits) - 1))


def pco_numbers(data: bytes, k: int, number_type: str) -> np.ndarray:
    """Exactly k numbers of one pcodec standalone file."""
    assert data[:4] == b"pco!", "not a pcodec standalone file"
    out = np.empty(k, dtype=number_type)
    try:
        progress = pcodec.standalone.simple_decompress_into(data, out)
    except RuntimeError as exc:  # pcodec's corruption errors, another number type included
        raise ValueError(f"pcodec: {exc}") from None
    assert progress.n_processed == k and progress.finished, "pcodec file count"
    return out


class Distances:
    """ulp values: signed distances in key order from the base words (resolved when applied),
    of a record in ``encoding`` (ulp or ulp-rans)."""

    def __init__(self, d: np.ndarray, bits: int, encoding: str = "ulp"):
        self.d, self.bits, self.size, self.encoding = d, bits, d.size, encoding

    def xor_values(self, base: np.ndarray) -> np.ndarray:
        mod = np.uint64((1 << self.bits) - 1) if self.bits < 64 else None
        moved = spec_key(base, self.bits) + self.d.astype(np.int64).view(np.uint64)  # wraps mod 2^64
        if mod is not None:
            moved &= mod
        return (base.astype(np.uint64) ^ spec_unkey(moved, self.bits)).astype(base.dtype)


def decode_payload(row: dict, n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(box-local positions, values) of one record, per the encodings of FORMAT.md (values of
    ulp records: Distances, resolved against the base words)."""
    kind, k, payload = row["kind"], row["n_changed"], row["payload"]
    params = json.loads(row["params"])
    assert spec_canonical(params) == row["params"]  # also refuses non-integer values
    if row["encoding"] == "raw":
        assert params == {}
        if kind == "tensor":
            return np.arange(n), np.frombuffer(payload, dtype=word(w))
        assert len(payload) == 8 * k + w * k
        return (np.frombuffer(payload[: 8 * k], dtype="<u8").astype(np.int64),
                np.frombuffer(payload[8 * k :], dtype=word(w)))
    if row["encoding"] == "sparse":
        assert kind != "tensor" and set(params) == {"gap_bytes", "level"}
        gw = params["gap_bytes"]
        body = zstd_exact(payload, k * (gw + w))
        gaps = unplane(body[: k * gw], k, gw).astype(np.int64)
        return np.cumsum(gaps + 1) - 1, unplane(body[k * gw :], k, w)
    if row["encoding"] == "ulp":
        assert kind == "xor" and set(params) == {"gap_bytes", "level"} and 0 <= params["level"] <= 12
        assert params["gap_bytes"] in (4, 8) and k >= 1
        size = int.from_bytes(payload[:8], "little")
        assert len(payload) >= 8 and size <= len(payload) - 8
        gaps = pco_numbers(payload[8:8 + size], k, f"<u{params['gap_bytes']}").astype(np.uint64)
        d = pco_numbers(payload[8 + size:], k, f"<i{max(w, 2)}")
        assert np.all(d != 0), "a zero distance"
        assert w > 1 or (d.min() >= -128 and d.max() <= 127), "a 1-byte distance out of range"
        assert int(gaps.max()) < n, "gap beyond the box"
        return (np.cumsum(gaps + np.uint64(1)) - np.uint64(1)).astype(np.int64), Distances(d, 8 * w)
    if row["encoding"] == "ulp-rans":
        assert kind == "xor" and params == {} and k >= 1
        try:
            positions, words = rans_spec.decode(payload, n, k, w)
        except rans_spec.SpecError as exc:
            raise AssertionError(f"ulp-rans: {exc}") from None
        signed = [x - (1 << (8 * w)) if x >> (8 * w - 1) else x for x in words]
        return np.array(positions, dtype=np.int64), Distances(np.array(signed, dtype=np.int64), 8 * w, "ulp-rans")
    assert row["encoding"] == "dense" and kind != "overwrite" and set(params) == {"level"}
    full = unplane(zstd_exact(payload, n * w), n, w)
    if kind == "tensor":
        return np.arange(n), full
    positions = np.flatnonzero(full)
    return positions, full[positions]


SPEC_SCHEMA = pa.schema(
    [pa.field(n, pa.utf8(), nullable=False) for n in ("tensor", "kind")]
    + [pa.field(n, pa.list_(pa.field("item", pa.uint64(), nullable=False)), nullable=False)
       for n in ("box_offset", "box_shape")]
    + [pa.field(n, pa.utf8(), nullable=False) for n in ("encoding", "params")]
    + [pa.field(n, pa.uint64(), nullable=False) for n in ("n_changed", "base_digest", "target_digest")]
    + [pa.field("payload", pa.large_binary(), nullable=False)]
)


class Refused(Exception):
    """The spec reader refused a log; ``version`` is where (None: before any version) and
    ``stage`` at which step: "identity", "listing", "version" (a version's commit record,
    segments, files or records) or "catchup" (a snapshot or squash, whose manifest is
    ``catchup``)."""

    def __init__(self, version: int | None, why: str, stage: str = "version", catchup: str | None = None):
        super().__init__(f"{stage} {catchup or ''} version {version}: {why}")
        self.version = version
        self.stage = stage
        self.catchup = catchup


# Feature files, FORMAT.md section 22.
FILES = "files"
FILE_OBJECT = {"key", "name", "sha256", "size"}


def spec_file_name_ok(name) -> bool:
    """Section 22: 1 to 255 bytes of UTF-8, no / \\ or control characters, no leading '.',
    not a receiver's weights (ASCII letters compared case-insensitively)."""
    if not isinstance(name, str):
        return False
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    if not 1 <= len(raw) <= 255 or name.startswith(".") or "/" in name or "\\" in name:
        return False
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return False
    folded = raw.lower()
    return not folded.endswith(b".safetensors") and folded != b"model.safetensors.index.json"


def spec_read_files(root: Path, c: dict, features: list[str], facts: set[str],
                    previous: dict[str, bytes] | None) -> dict[str, bytes]:
    """name -> bytes of a commit record's files (section 22), every object checked."""
    if FILES not in features:
        assert "files" not in c, "a files member in a log without the feature"
        return {}
    files = c["files"]
    assert isinstance(files, list) and len(files) <= 4096
    names = []
    out = {}
    for f in files:
        assert isinstance(f, dict) and set(f) == FILE_OBJECT
        assert spec_file_name_ok(f["name"]), f"bad file name {f['name']!r}"
        assert isinstance(f["sha256"], str) and re.fullmatch("[0-9a-f]{64}", f["sha256"])
        assert f["key"] == "files/" + f["sha256"]
        assert type(f["size"]) is int and 0 <= f["size"] <= 1 << 30
        names.append(f["name"].encode("utf-8"))
    assert names == sorted(set(names)), "file names unsorted or repeated"
    assert sum(f["size"] for f in files) <= 1 << 32
    for f in files:
        path = root / f["key"]
        assert path.is_file(), f"file object {f['key']} is missing"
        assert path.stat().st_size == f["size"], "file object size"  # before reading it
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"], "file object sha256"
        out[f["name"]] = data
    if previous is not None:
        facts.update("file-added" for n in out if n not in previous)
        facts.update("file-removed" for n in previous if n not in out)
        facts.update("file-changed" if previous[n] != d else "file-unchanged"
                     for n, d in out.items() if n in previous)
    if not out:
        facts.add("no-files")
    if len({f["sha256"] for f in files}) < len(files):
        facts.add("file-shared-object")
    facts.update("file-empty" for d in out.values() if not d)
    facts.update("file-non-ascii-name" for n in out if not n.isascii())
    return out


def spec_replay(root: Path, facts: set[str], from_states: dict | None = None) -> list[tuple[dict, dict]]:
    """[(commit record, {name: (dtype, shape, words)})] for every version from the log start on;
    ``facts`` collects what the log exercises. Raises Refused at the first check that fails.
    With the feature files, each commit record gets ``_files``: name -> the bytes of its files."""
    return spec_read(root, facts, from_states)["versions"]


def spec_read(root: Path, facts: set[str], from_states: dict | None = None) -> dict:
    """The log as FORMAT.md reads it: ``start`` (the log start, section 25), ``versions`` (as
    spec_replay) and ``catchups``: every snapshot and squash at or above the start (sections 23
    and 24), each a dict with ``key``, ``kind``, ``version``, ``from``, ``retired`` and ``state``
    (the state it leads to). ``from_states`` (version -> state) gives the from-state of a squash
    whose from has expired; without it such a squash is checked but not applied (``state``
    None)."""
    where: dict = {"version": None, "stage": "identity", "catchup": None}
    try:
        return _spec_read(root, facts, where, from_states or {})
    except (AssertionError, LookupError, OSError, UnicodeError, ValueError, zstandard.ZstdError) as exc:
        raise Refused(where["version"], f"{type(exc).__name__}: {exc}", where["stage"], where["catchup"]) from exc


# Sections 23 to 25: manifests of snapshots and squashes, log-start and retire markers.
VERSION_KEY = re.compile(r"[0-9]{20}\.json")
NUMBER = re.compile(r"0|[1-9][0-9]*")
HEX16, HEX64 = re.compile(r"[0-9a-f]{16}"), re.compile(r"[0-9a-f]{64}")
SEGMENT_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
MARKER_MEMBERS = {"format_version", "log_id", "kind", "version", "snapshot_sha256", "created_at"}
MANIFEST_MEMBERS = {"format_version", "log_id", "kind", "version", "from", "from_state_digest", "state_digest",
                    "commit_sha256", "segments", "stats", "created_at", "writer_id"}
SEGMENT_MEMBERS = {"key", "size", "sha256", "records"}
STATS_MEMBERS = {"changed_elements", "total_elements", "records"}


def is_uint(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def is_text(value) -> bool:
    return isinstance(value, str) and len(value) <= 1024


def spec_marker(root: Path, key: str, log_id: str, kind: str, version: int) -> dict:
    """A log-start or retire marker (section 25), every member checked."""
    assert (root / key).stat().st_size <= 65536, f"{key}: too large"  # before reading it
    m = spec_unseal((root / key).read_bytes())
    assert set(m) == MARKER_MEMBERS, f"{key}: members"
    assert type(m["format_version"]) is int and m["format_version"] == 1
    assert m["log_id"] == log_id and m["kind"] == kind, f"{key}: log_id or kind"
    assert is_uint(m["version"]) and m["version"] == version, f"{key}: version"
    assert isinstance(m["snapshot_sha256"], str) and HEX64.fullmatch(m["snapshot_sha256"])
    assert is_text(m["created_at"])
    return m


def spec_segment_rows(root: Path, ref: dict, log_id: str, version: int, facts: set[str]) -> list[dict]:
    """The rows of one segment file (sections 9 and 13): size (before reading), sha256, an IPC
    file, the schema and its metadata, the record count."""
    path = root / ref["key"]
    assert path.is_file(), f"segment {ref['key']} is missing"
    assert path.stat().st_size == ref["size"], "segment size"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == ref["sha256"], "segment sha256"
    assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1"
    reader = pa.ipc.open_file(pa.py_buffer(data))
    assert reader.schema.remove_metadata().equals(SPEC_SCHEMA)
    assert reader.schema.metadata == {b"dcr.format_version": b"1", b"dcr.log_id": log_id.encode(),
                                      b"dcr.version": str(version).encode()}
    if reader.num_record_batches > 1:
        facts.add("multi-batch")
    rows = []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i).to_pylist()
        if not batch:
            facts.add("empty-batch")
        rows += batch
    assert len(rows) == ref["records"], "segment record count"
    return rows


def spec_catchups(root: Path) -> list[tuple[str, str, int, int | None]]:
    """(manifest key, kind, version, from) of every snapshot and squash: a prefix holds one if
    and only if its manifest exists (section 23)."""
    out = []
    for kind, top in (("snapshot", "snapshots"), ("squash", "squashes")):
        if not (root / top).is_dir():
            continue
        for d in sorted((root / top).iterdir(), key=lambda p: p.name):
            if not (d / "manifest.json").is_file():
                continue
            parts = d.name.split("-") if kind == "squash" else [d.name]
            if len(parts) != (2 if kind == "squash" else 1) or not all(NUMBER.fullmatch(p) for p in parts):
                continue  # not a key of this format
            numbers = [int(p) for p in parts]
            out.append((f"{top}/{d.name}/manifest.json", kind, numbers[-1], numbers[0] if kind == "squash" else None))
    return sorted(out, key=lambda c: (c[1], c[2], c[3] or 0))


def spec_catchup(root: Path, identity: dict, key: str, kind: str, version: int, start: int | None,
                 commits: dict[int, tuple[dict, bytes]], log_start: int, base: dict | None,
                 facts: set[str]) -> dict | None:
    """Sections 23 and 24: the manifest ``key`` checked against commit record ``version`` (and
    ``start``'s, while it is readable), its segments read, its records applied to nothing (a
    snapshot) or to ``base``, the from-state of a squash (None: checked, not applied), every
    tensor digest checked against ``version``'s table. Returns the state it leads to."""
    features = identity["features"]
    assert (root / key).stat().st_size <= 1 << 30, "manifest too large"
    data = (root / key).read_bytes()
    m = spec_unseal(data)
    assert set(m) == MANIFEST_MEMBERS, "manifest members"
    assert type(m["format_version"]) is int and m["format_version"] == 1
    assert m["log_id"] == identity["log_id"] and m["kind"] == kind
    assert is_uint(m["version"]) and m["version"] == version, "the manifest's version is not its key's"
    commit, commit_bytes = commits[version]
    if kind == "snapshot":
        assert m["from"] is None and m["from_state_digest"] is None
    else:
        assert is_uint(m["from"]) and m["from"] == start < version, "the manifest's from is not its key's"
        assert isinstance(m["from_state_digest"], str) and HEX16.fullmatch(m["from_state_digest"])
        if start >= log_start:
            assert m["from_state_digest"] == commits[start][0]["state_digest"], "from_state_digest"
    assert m["state_digest"] == commit["state_digest"], "state_digest"
    assert m["commit_sha256"] == hashlib.sha256(commit_bytes).hexdigest(), "commit_sha256 names another record"
    assert is_text(m["created_at"]) and is_text(m["writer_id"])
    prefix = key[: -len("manifest.json")]
    segments = m["segments"]
    assert isinstance(segments, list) and len(segments) <= 1 << 20
    for ref in segments:
        assert isinstance(ref, dict) and set(ref) == SEGMENT_MEMBERS
        assert isinstance(ref["key"], str) and ref["key"].startswith(prefix), f"segment {ref['key']} outside {prefix}"
        name = ref["key"][len(prefix):]
        assert SEGMENT_FILE_NAME.fullmatch(name) and name.endswith(".arrow"), f"segment file name {name!r}"
        assert is_uint(ref["size"]) and ref["size"] <= 1 << 34 and is_uint(ref["records"]) and ref["records"] <= 1 << 32
        assert isinstance(ref["sha256"], str) and HEX64.fullmatch(ref["sha256"])
    assert len({ref["key"] for ref in segments}) == len(segments), "a segment listed twice"
    stats = m["stats"]
    assert isinstance(stats, dict) and set(stats) == STATS_MEMBERS and all(is_uint(x) for x in stats.values())
    assert stats["records"] == sum(ref["records"] for ref in segments), "stats.records"
    assert stats["total_elements"] == commit["stats"]["total_elements"], "stats.total_elements"
    if kind == "snapshot":
        assert stats["changed_elements"] == stats["total_elements"], "a snapshot sets every element"
    rows = [row for ref in segments for row in spec_segment_rows(root, ref, identity["log_id"], version, facts)]
    assert sum(row["n_changed"] for row in rows) == stats["changed_elements"], "stats.changed_elements"
    if len(segments) > 1:
        facts.add(f"{kind}-multi-segment")
    if kind == "squash" and start < log_start:
        facts.add("squash-from-expired")
    if kind == "squash" and not segments:  # section 24: a squash between equal states
        assert stats["records"] == stats["changed_elements"] == 0
        facts.add("squash-empty")
    if kind == "squash" and base is None:
        return None
    table = {t["name"]: t for t in commit["tensors"]}
    state: dict = {}
    if kind == "squash":  # the from-state it is given is the one the manifest names
        given = [{"name": n, "dtype": d, "shape": list(s), "digest": f"{tensor_digest(features, w):016x}"}
                 for n, (d, s, w) in base.items()]
        assert spec_state_digest(given) == m["from_state_digest"], "not the squash's from-state"
        state = {n: (d, s, w.copy()) for n, (d, s, w) in base.items() if n in table}
        if len(state) < len(base):
            facts.add("squash-drops")
    created = set()
    for name, t in table.items():
        old = state.get(name)
        if old is None or old[0] != t["dtype"] or list(old[1]) != t["shape"]:
            zeros = np.zeros(math.prod(t["shape"]), dtype=word(WIDTH[t["dtype"]]))
            state[name] = (t["dtype"], tuple(t["shape"]), zeros)
            created.add(name)
    if kind == "squash" and created:
        facts.add("squash-creates")
    running = {n: tensor_digest(features, w) for n, (_, _, w) in state.items()}
    # section 24, with sum-digests: from's digest (0 for a created tensor) plus, per record,
    # target minus base (a tensor record: target)
    composed = {n: 0 if n in created else running[n] for n in state}
    for row in rows:
        assert row["tensor"] in table, f"record for {row['tensor']!r}, not in the table"
        if kind == "snapshot":
            assert row["kind"] == "tensor", f"a snapshot holds a {row['kind']} record"
        else:
            assert row["kind"] != "tensor" or row["tensor"] in created, \
                f"a tensor record for {row['tensor']!r}, which the squash keeps"
        apply_row(row, state, created, facts, features, running)
        composed[row["tensor"]] += row["target_digest"] - (0 if row["kind"] == "tensor" else row["base_digest"])
    for name, (_, _, words) in state.items():  # every tensor digest (section 23)
        digest = table[name]["digest"]
        assert f"{tensor_digest(features, words):016x}" == digest, f"{key}: tensor {name}"
        if SUM_DIGESTS in features:
            assert running[name] == int(digest, 16) and composed[name] & MASK64 == int(digest, 16), name
    facts.add(kind)
    return state


def _spec_read(root: Path, facts: set[str], where: dict, from_states: dict) -> dict:
    identity = spec_unseal((root / "dcr.json").read_bytes())
    assert set(identity) == {"format_version", "log_id", "created_at", "features"}
    features = identity["features"]
    # format 1 defines four features, listed in this order; a name is never listed twice
    assert identity["format_version"] == 1 and isinstance(features, list), features
    assert features == [f for f in (FILES, RANS_ENCODING, SUM_DIGESTS, ULP_ENCODING) if f in features], features
    facts.update(features)
    log_id = identity["log_id"]
    where["stage"] = "listing"
    found = sorted(int(p.name[:20]) for p in (root / "versions").iterdir() if VERSION_KEY.fullmatch(p.name))
    # section 25: the log start is the largest version of a log-start marker (0 if none); its
    # marker is checked, the versions are exactly start..latest, and replay starts from
    # snapshot start, whose manifest the marker names
    starts = sorted(int(p.name[:20]) for p in (root / "log-start").iterdir()
                    if VERSION_KEY.fullmatch(p.name)) if (root / "log-start").is_dir() else []
    log_start = max(starts, default=0)
    marker = spec_marker(root, f"log-start/{log_start:020d}.json", log_id, "log-start", log_start) if starts else None
    versions = [v for v in found if v >= log_start]
    assert versions == list(range(log_start, log_start + len(versions))), "versions are not contiguous"
    if log_start > 0:
        assert versions, "the log start's version is missing"
        snapshot_key = f"snapshots/{log_start}/manifest.json"
        assert (root / snapshot_key).stat().st_size <= 1 << 30
        assert hashlib.sha256((root / snapshot_key).read_bytes()).hexdigest() == marker["snapshot_sha256"], \
            "the log-start marker names another manifest"
        facts.add("log-start")
        if found[0] == log_start:
            facts.add("expired-deleted")
    commits: dict[int, tuple[dict, bytes]] = {}
    state: dict[str, tuple[str, tuple, np.ndarray]] = {}
    # sum-digests: each tensor's digest followed in O(changes) from the records alone (section
    # 7.1, informative), checked below against a full pass and the table
    running: dict[str, int] = {}
    out, previous, previous_files = [], None, None
    for v in versions:
        where["version"] = v
        where["stage"] = "version"
        data = (root / "versions" / f"{v:020d}.json").read_bytes()
        c = spec_unseal(data)
        assert all("\0" not in t["name"] and "\n" not in t["name"] and t["name"] for t in c["tensors"])
        assert c["version"] == v and c["log_id"] == log_id
        assert c["features"] == features, "commit features differ from dcr.json's"
        assert c["parent"] == (None if v == 0 else v - 1)
        if previous is None and v > 0:  # the log start: its parent expired and is not checked
            assert isinstance(c["parent_state_digest"], str) and HEX16.fullmatch(c["parent_state_digest"])
        else:
            assert c["parent_state_digest"] == (None if previous is None else previous["state_digest"])
        assert spec_state_digest(c["tensors"]) == c["state_digest"]
        table = {t["name"]: t for t in c["tensors"]}
        assert list(table) == utf8_sorted(table)
        commits[v] = (c, data)
        records = changed = 0
        if not c["segments"]:
            facts.add("zero-records")
        if len(c["segments"]) > 1:
            facts.add("multi-segment")
        if previous is None and v > 0:
            # replay starts from the snapshot of the log start (section 25); the version's own
            # records, whose parent expired, are read but not applied
            where["stage"] = "start"  # section 25: read with version start, after its commit record
            state = spec_catchup(root, identity, f"snapshots/{v}/manifest.json", "snapshot", v, None, commits,
                                 log_start, None, facts)
            where["stage"] = "version"
            running = {n: tensor_digest(features, w) for n, (_, _, w) in state.items()}
            facts.add("start-from-snapshot")
            for ref in c["segments"]:
                assert ref["key"].startswith(f"segments/{v}/") and ref["key"].endswith(".arrow")
                rows = spec_segment_rows(root, ref, log_id, v, facts)
                records += len(rows)
                changed += sum(row["n_changed"] for row in rows)
        else:
            created = set()
            for name in list(state):
                if name not in table:
                    del state[name]
                    running.pop(name, None)
                    facts.add("removed")
            for name, t in table.items():
                old = state.get(name)
                if old is None or old[0] != t["dtype"] or list(old[1]) != t["shape"]:
                    if old is not None:
                        facts.add("retyped" if old[0] != t["dtype"] else "reshaped")
                    elif v > 0:
                        facts.add("added")
                    state[name] = (t["dtype"], tuple(t["shape"]),
                                   np.zeros(math.prod(t["shape"]), dtype=word(WIDTH[t["dtype"]])))
                    created.add(name)
                    running[name] = tensor_digest(features, state[name][2])
            for ref in c["segments"]:
                assert ref["key"].startswith(f"segments/{v}/") and ref["key"].endswith(".arrow")
                for row in spec_segment_rows(root, ref, log_id, v, facts):
                    apply_row(row, state, created, facts, features, running)
                    records += 1
                    changed += row["n_changed"]
        files = spec_read_files(root, c, features, facts, previous_files)
        previous_files = files
        assert (records, changed) == (c["stats"]["records"], c["stats"]["changed_elements"])
        assert c["stats"]["total_elements"] == sum(w.size for _, _, w in state.values())
        for name, (dtype, shape, words) in state.items():
            digest = f"{tensor_digest(features, words):016x}"
            assert digest == table[name]["digest"], f"version {v}: {name}"
            if SUM_DIGESTS in features:
                assert running[name] == int(table[name]["digest"], 16), f"version {v}: {name}"
            facts.add(f"dtype:{dtype}")
            facts.add(f"width:{WIDTH[dtype]}")
            facts.add("0-d" if shape == () else "empty" if words.size == 0 else "n-d")
        c["_files"] = files
        out.append((c, {n: (d, s, w.copy()) for n, (d, s, w) in state.items()}))
        previous = c
    # every snapshot and squash (sections 23 and 24), once the versions read back; those below
    # the log start are ignored (retention deletes them)
    where["stage"] = "catchup"
    catchups = []
    for key, kind, version, start in spec_catchups(root):
        if version < log_start:
            continue
        where["version"], where["catchup"] = version, key
        retired = (root / f"snapshots/{version}/retired.json").is_file() and kind == "snapshot"
        if retired:
            m = spec_marker(root, f"snapshots/{version}/retired.json", log_id, "retired", version)
            assert m["snapshot_sha256"] == hashlib.sha256((root / key).read_bytes()).hexdigest()
            facts.add("retired")
        base = None
        if kind == "squash":
            base = out[start - log_start][1] if start >= log_start else from_states.get(start)
        result = spec_catchup(root, identity, key, kind, version, start, commits, log_start, base, facts)
        catchups.append({"key": key, "kind": kind, "version": version, "from": start, "retired": retired,
                         "state": result})
    return {"start": log_start, "versions": out, "catchups": catchups}


def apply_row(row: dict, state: dict, created: set, facts: set, features: list[str],
              running: dict[str, int]) -> None:
    dtype, shape, words = state[row["tensor"]]
    kind, offset, box = row["kind"], row["box_offset"], row["box_shape"]
    assert kind in ("xor", "overwrite", "tensor") and len(offset) == len(box) == len(shape)
    assert all(o + s <= d for o, s, d in zip(offset, box, shape))
    assert kind == "tensor" or row["tensor"] not in created
    n, w = math.prod(box), WIDTH[dtype]
    k = row["n_changed"]
    assert k <= n and (kind != "tensor" or k == n)
    positions, values = decode_payload(row, n, w)
    assert positions.size == k and values.size == k
    assert k == 0 or (positions[-1] < n and np.all(np.diff(positions) > 0))
    if shape:
        local = np.unravel_index(positions, box)
        flat = np.ravel_multi_index(tuple(i + o for i, o in zip(local, offset)), shape)
    else:
        flat = positions  # a 0-d tensor: one element, position 0
    flat = np.asarray(flat, dtype=np.int64)
    old = digest_of(features, flat, words[flat])  # for a tensor record: the box's old words
    if kind != "tensor":
        assert old == row["base_digest"], "precondition"
    else:
        assert row["base_digest"] == 0
    if isinstance(values, Distances):
        feature, fact = {"ulp": (ULP_ENCODING, "ulp"), "ulp-rans": (RANS_ENCODING, "rans")}[values.encoding]
        assert feature in features, f"a {values.encoding} record in a log without the feature"
        base = words[flat]
        d = values.d.astype(np.int64)
        values = values.xor_values(base)
        key_base, key_target = spec_key(base, 8 * w), spec_key(base ^ values, 8 * w)
        facts.add(f"{fact}-width:{w}")
        # key(B) + d left 0 .. 2^W - 1: a step up landed below its start, or one down above it.
        if np.any(((d > 0) & (key_target < key_base)) | ((d < 0) & (key_target > key_base))):
            facts.add(f"{fact}-wraps")
        if np.any(values >> (8 * w - 1)):  # the xor flips the sign bit: base and target differ in sign
            facts.add(f"{fact}-crosses-sign")
        if fact == "rans":
            if k >= 2 * rans_spec.LANES:
                facts.add("rans-every-stream")  # each of the four streams holds a symbol
            zigzag = [rans_spec.zigzag(int(x)) - 1 for x in d]
            if max(rans_spec.to_bin(v)[0] for v in zigzag) == rans_spec.NBINS - 1:
                facts.add("rans-widest-bin")
            if not shape:
                facts.add("rans-0-d")
    if kind == "xor":
        words[flat] ^= values
    else:
        if kind == "overwrite" and np.any(words[flat] == values):
            facts.add("overwrite-repair")
        if kind == "tensor" and row["tensor"] not in created:
            facts.add("tensor-on-existing")
        words[flat] = values
    assert digest_of(features, flat, words[flat]) == row["target_digest"], "postcondition"
    if SUM_DIGESTS in features:  # the tensor's digest changes by target minus the old words' digest
        running[row["tensor"]] = (running[row["tensor"]] + row["target_digest"] - old) & MASK64
    facts.add(f"{kind}/{row['encoding']}")
    if row["encoding"] in ("sparse", "ulp"):
        facts.add(f"gap_bytes:{json.loads(row['params'])['gap_bytes']}")
    if len(shape) >= 2 and (any(offset[1:]) or list(box[1:]) != list(shape[1:])):
        facts.add(f"interior-box-{len(shape)}d")


# -- valid vectors -----------------------------------------------------------------------------


def log_features(name: str) -> list[str]:
    return json.loads((VECTORS / name / "log" / "dcr.json").read_bytes())["features"]


def check_tensors(state_words: dict[str, tuple[str, tuple, np.ndarray]], expected: dict,
                  features: list[str]) -> None:
    """``digest`` (the tensor digest under the log's scheme) is given by vectors whose scheme is
    not xxh3; otherwise it is ``xxh3``."""
    assert utf8_sorted(state_words) == [t["name"] for t in expected["tensors"]]
    for t in expected["tensors"]:
        dtype, shape, words = state_words[t["name"]]
        assert (dtype, list(shape)) == (t["dtype"], t["shape"]), t["name"]
        assert hashlib.sha256(words.tobytes()).hexdigest() == t["sha256"], t["name"]
        assert f"{xxh3(words):016x}" == t["xxh3"], t["name"]
        assert ("digest" in t) == (SUM_DIGESTS in features), t["name"]
        assert f"{tensor_digest(features, words):016x}" == t.get("digest", t["xxh3"]), t["name"]


def check_files(files: dict[str, bytes], expected: dict, features: list[str]) -> None:
    """A version's files (name -> bytes) against expected.json's ``files`` (feature files)."""
    assert ("files" in expected) == (FILES in features)
    want = expected.get("files", [])
    assert list(files) == [f["name"] for f in want]
    for f in want:
        data = files[f["name"]]
        assert (len(data), hashlib.sha256(data).hexdigest()) == (f["size"], f["sha256"]), f["name"]


@pytest.mark.parametrize("name", VALID)
def test_valid_vector_reads_back(name):
    expected = load_expected(VECTORS / name)
    log = DeltaLog.open(VECTORS / name / "log")
    assert log.log_id == expected["log_id"]
    assert log.versions() == [v["version"] for v in expected["versions"]]
    features = log_features(name)
    for v in expected["versions"]:
        state = log.materialize(v["version"])
        check_tensors({n: (b.dtype, b.shape, b.words) for n, b in state.items()}, v, features)
        commit = log.commit(v["version"])
        assert f"{commit.state_digest:016x}" == v["state_digest"]
        assert list(commit.features) == features
        assert [(t.name, f"{t.digest:016x}") for t in commit.tensors] == [
            (t["name"], t.get("digest", t["xxh3"])) for t in v["tensors"]]
        assert (commit.files is not None) == (FILES in features)
        check_files(log.read_files(v["version"]), v, features)
    report = log.verify(deep=True)
    assert report.versions == len(expected["versions"])
    keys = {f["sha256"] for v in expected["versions"] for f in v.get("files", [])}
    assert report.files == len(keys)  # each object checked once
    assert report.start == expected.get("start", 0)
    assert report.catchups == len(expected.get("catchups", []))
    if "catchups" in expected:
        check_catchups_library(VECTORS / name / "log", expected, features)


def bits_words(state: dict[str, TensorBits]) -> dict[str, tuple[str, tuple, np.ndarray]]:
    return {n: (b.dtype, b.shape, b.words) for n, b in state.items()}


def from_tensors(entry: dict) -> dict[str, tuple[str, tuple, np.ndarray]]:
    """A squash's from-state as expected.json gives it (``hex``: the tensor's bytes)."""
    return {t["name"]: (t["dtype"], tuple(t["shape"]),
                        np.frombuffer(bytes.fromhex(t["hex"]), dtype=word(WIDTH[t["dtype"]])).copy())
            for t in entry["from_tensors"]}


def check_catchups_library(log_dir: Path, expected: dict, features: list[str]) -> None:
    """dcr_log reads the log start and every snapshot and squash to the expected states."""
    log = DeltaLog.open(log_dir)
    start = expected["start"]
    assert log.start() == start and log.versions()[0] == start
    if start > 0:
        with pytest.raises(errors.ExpiredError):
            log.materialize(start - 1)
        assert log.start_snapshot().version == start
    catchups = expected["catchups"]
    snapshots = [c for c in catchups if c["kind"] == "snapshot"]
    assert sorted(log.snapshots(retired=True)) == sorted(c["version"] for c in snapshots)
    assert sorted(log.snapshots()) == sorted(c["version"] for c in snapshots
                                             if not c["retired"] or c["version"] == start)
    assert sorted((cu.start, cu.version) for cu in log.squashes()) == sorted(
        (c["from"], c["version"]) for c in catchups if c["kind"] == "squash")
    for c in catchups:
        cu, _ = log.catchup(c["key"])
        assert (cu.kind, cu.version, cu.start, f"{cu.state_digest:016x}") == (
            c["kind"], c["version"], c["from"], c["state_digest"])
        state: dict[str, TensorBits] = {}
        if c["kind"] == "squash":
            given = from_tensors(c)
            check_tensors(given, {"tensors": c["from_tensors"]}, features)
            assert f"{cu.start_state_digest:016x}" == c["from_state_digest"]
            state = {n: TensorBits(d, s, w) for n, (d, s, w) in given.items()}
            if c["from"] >= start:  # the tensors of that version
                check_tensors(bits_words(log.materialize(c["from"])), {"tensors": c["from_tensors"]}, features)
        log.apply_step(state, log.catchup_step(cu))
        check_tensors(bits_words(state), c, features)


@pytest.mark.parametrize("name", VALID)
def test_valid_vector_spec_reader(name):
    """The format as FORMAT.md writes it down reads these logs too."""
    expected = load_expected(VECTORS / name)
    got = spec_read(VECTORS / name / "log", set(), expected_from_states(expected))
    versions = got["versions"]
    assert len(versions) == len(expected["versions"])
    for (commit, state), v in zip(versions, expected["versions"]):
        assert commit["version"] == v["version"]
        assert commit["state_digest"] == v["state_digest"]
        check_tensors(state, v, commit["features"])
        check_files(commit["_files"], v, commit["features"])
    assert got["start"] == expected.get("start", 0)
    features = log_features(name)
    catchups = expected.get("catchups", [])
    assert [c["key"] for c in got["catchups"]] == [c["key"] for c in catchups]
    for mine, c in zip(got["catchups"], catchups):
        assert (mine["kind"], mine["version"], mine["from"], mine["retired"]) == (
            c["kind"], c["version"], c["from"], c["retired"])
        assert spec_state_digest([{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"],
                                   "digest": t.get("digest", t["xxh3"])} for t in c["tensors"]]) == c["state_digest"]
        check_tensors(mine["state"], c, features)
        if c["kind"] == "squash" and c["from"] >= got["start"]:  # from_tensors: that version's
            check_tensors(versions[c["from"] - got["start"]][1], {"tensors": c["from_tensors"]}, features)


def test_routes_follow_the_tie_order():
    """FORMAT.md section 24: the reference's route, ties included. In squash-equal-states,
    squashes 0-2 and 2-3 and version 3 have no segments (0 bytes)."""
    log = DeltaLog.open(VECTORS / "squash-equal-states" / "log")

    def route(target, holding=None):
        return [s.describe() for s in log.plan(target, holding=holding)]

    assert route(2) == ["version 0", "squash 0-2"]  # fewest bytes
    assert route(2, holding=1) == ["version 2"]  # one version behind: that version, whatever else
    assert route(2, holding=0) == ["squash 0-2"]
    # at 3 from 2: version 3 and squash 2-3 both cost (0 bytes, one step): the version step wins
    assert route(3, holding=0) == ["squash 0-2", "version 3"]
    assert route(3) == ["version 0", "squash 0-2", "version 3"]
    log = DeltaLog.open(VECTORS / "retention" / "log")
    assert route(6) == ["snapshot 3", "squash 3-6"]
    assert route(5) == ["snapshot 5"]


def expected_from_states(expected: dict) -> dict[int, dict]:
    """from -> state of every squash in expected.json (the reader uses those it cannot replay)."""
    return {c["from"]: from_tensors(c) for c in expected.get("catchups", []) if c["kind"] == "squash"}


def test_vectors_cover_the_format():
    facts: set[str] = set()
    for name in VALID:
        spec_replay(VECTORS / name / "log", facts)
    wanted = {f"dtype:{d}" for d in WIDTH} | {
        "xor/raw", "xor/sparse", "xor/dense", "overwrite/raw", "overwrite/sparse", "tensor/raw",
        "tensor/dense", "gap_bytes:1", "gap_bytes:2", "gap_bytes:4", "gap_bytes:8", "0-d", "empty",
        "interior-box-2d", "interior-box-3d", "added", "removed", "reshaped", "retyped",
        "zero-records", "multi-segment", "multi-batch", "empty-batch", "tensor-on-existing",
        "overwrite-repair",
    }
    assert wanted <= facts, sorted(wanted - facts)


def test_retention_vectors_cover_sections_23_to_25():
    """Snapshots, squashes and retention, as the spec reader meets them."""
    facts: set[str] = set()
    for name in VALID:
        spec_read(VECTORS / name / "log", facts, expected_from_states(load_expected(VECTORS / name)))
    wanted = {"log-start", "expired-deleted", "start-from-snapshot", "snapshot", "squash", "retired",
              "snapshot-multi-segment", "squash-from-expired", "squash-creates", "squash-drops",
              "squash-empty"}
    assert wanted <= facts, sorted(wanted - facts)


def test_sum_digest_vectors_cover_the_format():
    """The logs with feature sum-digests exercise every digest path on their own."""
    facts: set[str] = set()
    names = [n for n in VALID if SUM_DIGESTS in log_features(n)]
    for name in names:
        spec_replay(VECTORS / name / "log", facts)
    wanted = {SUM_DIGESTS, "width:1", "width:2", "width:4", "width:8",
              "xor/raw", "xor/sparse", "xor/dense", "overwrite/raw", "overwrite/sparse", "tensor/raw",
              "tensor/dense", "0-d", "empty", "interior-box-2d", "interior-box-3d", "added", "removed",
              "reshaped", "retyped", "zero-records", "tensor-on-existing", "overwrite-repair"}
    assert wanted <= facts, sorted(wanted - facts)


def test_ulp_vectors_cover_the_feature():
    """The logs with feature ulp-encoding exercise every word width, both gap widths, a sign
    crossing and a key that wraps around."""
    facts: set[str] = set()
    for name in [n for n in VALID if ULP_ENCODING in log_features(n)]:
        spec_replay(VECTORS / name / "log", facts)
    wanted = {ULP_ENCODING, "xor/ulp", "xor/sparse", "ulp-width:1", "ulp-width:2", "ulp-width:4",
              "ulp-width:8", "gap_bytes:4", "gap_bytes:8", "ulp-wraps", "ulp-crosses-sign",
              "interior-box-2d"}
    assert wanted <= facts, sorted(wanted - facts)


def test_ulp_rans_vectors_cover_the_feature():
    """The logs with feature rans-encoding exercise every word width, a sign crossing, a key
    that wraps around, the widest bin, every stream and a 0-d tensor."""
    facts: set[str] = set()
    for name in [n for n in VALID if RANS_ENCODING in log_features(n)]:
        spec_replay(VECTORS / name / "log", facts)
    wanted = {RANS_ENCODING, "xor/ulp-rans", "xor/sparse", "rans-width:1", "rans-width:2", "rans-width:4",
              "rans-width:8", "rans-wraps", "rans-crosses-sign", "rans-every-stream", "rans-widest-bin",
              "rans-0-d", "interior-box-2d"}
    assert wanted <= facts, sorted(wanted - facts)


def test_file_vectors_cover_the_feature():
    """The logs with feature files exercise every way a file set changes."""
    facts: set[str] = set()
    for name in [n for n in VALID if FILES in log_features(n)]:
        spec_replay(VECTORS / name / "log", facts)
    wanted = {FILES, SUM_DIGESTS, "file-added", "file-removed", "file-changed", "file-unchanged",
              "no-files", "file-shared-object", "file-empty", "file-non-ascii-name"}
    assert wanted <= facts, sorted(wanted - facts)


def test_sum_digest_reference_values():
    """FORMAT.md section 7.1's reference values, and the vectorised e() against the plain one."""
    assert e_plain(0, 0) == 0xE220A8397B1DCDAF
    assert e_plain(1, 0) == 0x6E789E6AA1B965F4
    assert e_plain(0, 0x3F80) == 0x2F4107AE02771311
    flat = np.array([0, 1, 0, 5, 2**40 + 7, 2**63 - 1])
    words = np.array([0, 0, 0x3F80, MASK64, 1 << 63, 0xABCD], dtype=np.uint64)
    assert e_hashes(flat, words).tolist() == [e_plain(int(f), int(w)) for f, w in zip(flat, words)]
    text = (REPO / "spec" / "FORMAT.md").read_text()
    for value in ("e(0, 0) = 0xe220a8397b1dcdaf", "e(1, 0) = 0x6e789e6aa1b965f4",
                  "e(0, 0x3f80) = 0x2f4107ae02771311"):
        assert value in text, value


def test_float_specials_are_present():
    """-0.0, infinities, NaNs with payloads and subnormals, for every float dtype with them."""
    layout = {"F32": (8, 23), "F16": (5, 10), "BF16": (8, 7), "F64": (11, 52)}
    tensors = [(n, w) for _, s in spec_replay(VECTORS / "float-specials" / "log", set())
               for n, (_, _, w) in s.items()]
    seen = set()
    for name, words in tensors:
        dtype = name.split(".")[-1]
        if dtype not in layout:
            continue
        e_bits, m_bits = layout[dtype]
        w = words.astype(np.uint64)
        exp = (w >> np.uint64(m_bits)) & np.uint64((1 << e_bits) - 1)
        man = w & np.uint64((1 << m_bits) - 1)
        top = np.uint64((1 << e_bits) - 1)
        quiet_nan = np.uint64(1 << (m_bits - 1))
        if np.any(w == np.uint64(1 << (e_bits + m_bits))):
            seen.add((dtype, "-0"))
        if np.any((exp == top) & (man == 0)):
            seen.add((dtype, "inf"))
        if np.any((exp == top) & (man != 0) & (man != quiet_nan)):
            seen.add((dtype, "nan-payload"))
        if np.any((exp == 0) & (man != 0)):
            seen.add((dtype, "subnormal"))
    assert seen == {(d, f) for d in layout for f in ("-0", "inf", "nan-payload", "subnormal")}


def test_worked_example_matches_format_md():
    """The payload decoded byte by byte in FORMAT.md is the one in the vector."""
    log = DeltaLog.open(VECTORS / "worked-example" / "log")
    (record,) = list(log.records(1))
    text = (REPO / "spec" / "FORMAT.md").read_text()
    assert f"payload: {bytes(record.payload).hex()}" in text
    root = VECTORS / "worked-example" / "log"
    for key in ("dcr.json", "versions/00000000000000000001.json"):
        assert (root / key).read_text() in text, key


def test_sum_digests_worked_example_matches_format_md():
    """The sum-digests record worked through in FORMAT.md section 18.1 is the one in the vector:
    its bytes, its digests and the element hashes that make them up (read without dcr_log)."""
    root = VECTORS / "sum-digests-worked" / "log"
    text = (REPO / "spec" / "FORMAT.md").read_text()
    for key in ("dcr.json", "versions/00000000000000000001.json"):
        assert (root / key).read_text() in text, key
    commit = spec_unseal((root / "versions" / "00000000000000000001.json").read_bytes())
    (ref,) = commit["segments"]
    (row,) = pa.ipc.open_file(pa.py_buffer((root / ref["key"]).read_bytes())).get_batch(0).to_pylist()
    assert f"payload: {row['payload'].hex()}" in text
    for name in ("base_digest", "target_digest"):
        assert f"`{name}` = `0x{row[name]:016x}`" in text, name
    (_, before), (_, after) = spec_replay(root, set())
    elements = [(f, int(w)) for f, w in enumerate(before["w"][2])]  # version 0's tensor digest
    elements += [(f, int(after["w"][2][f])) for f in (2, 6)]  # the changed words' new values
    for f, w in elements:
        assert f"e({f}, 0x{w:04x}) = 0x{e_plain(f, w):016x}" in text, (f, w)


# -- invalid vectors ---------------------------------------------------------------------------


def _invalid_params():
    for name in INVALID:
        gap = KNOWN_READER_GAPS.get(name)
        yield pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=gap)) if gap else name


@pytest.mark.parametrize("name", list(_invalid_params()))
def test_invalid_vector_is_refused(name):
    root = VECTORS / "invalid" / name
    expected = load_expected(root)
    error = getattr(errors, expected["error"])
    stage, version = expected["stage"], expected["version"]
    log_dir = root / "log"
    if stage == "identity":
        with pytest.raises(error):
            DeltaLog.open(log_dir)
        return
    log = DeltaLog.open(log_dir)
    if stage == "listing":
        with pytest.raises(error):
            log.versions()
            log.start_snapshot()  # the marker's snapshot_sha256 against the start's manifest
        with pytest.raises(error):
            DeltaLog.open(log_dir).verify(deep=True)
        with pytest.raises(error):
            DeltaLog.open(log_dir).materialize()
        return
    if stage == "catchup":
        for _ in DeltaLog.open(log_dir).replay(check_all=True):  # every version reads back
            pass
        keys = sorted(o.key for prefix in ("snapshots/", "squashes/") for o in log.store.list(prefix)
                      if o.key.endswith("/manifest.json"))
        assert expected["catchup"] in keys
        for key in keys:  # every other snapshot and squash reads back
            if key != expected["catchup"]:
                library_catchup(log_dir, key)
        with pytest.raises(error):
            library_catchup(log_dir, expected["catchup"])
        with pytest.raises(error):
            DeltaLog.open(log_dir).verify(deep=True)
        return
    if stage == "start":  # the log start's snapshot (section 25): its marker and manifest are intact
        log.versions()
        assert log.start() == version and log.start_snapshot().version == version
        DeltaLog.open(log_dir).commit(version)
        with pytest.raises(error):
            DeltaLog.open(log_dir).materialize(version)
        with pytest.raises(error):
            for _ in DeltaLog.open(log_dir).replay():
                pass
        with pytest.raises(error):
            DeltaLog.open(log_dir).verify(deep=False)
        with pytest.raises(error):
            DeltaLog.open(log_dir).verify(deep=True)
        return
    if version > 0:  # everything before the broken version reads back
        DeltaLog.open(log_dir).materialize(version - 1)
        DeltaLog.open(log_dir).read_files(version - 1)
    if stage == "segment":
        DeltaLog.open(log_dir).commit(version)
        with pytest.raises(error):
            list(DeltaLog.open(log_dir).records(version))
    if stage == "files":
        DeltaLog.open(log_dir).commit(version)
        list(DeltaLog.open(log_dir).records(version))
        with pytest.raises(error):
            DeltaLog.open(log_dir).read_files(version)
    if stage == "apply":
        DeltaLog.open(log_dir).verify(deep=False)  # only applying the records finds it
    else:
        with pytest.raises(error):
            DeltaLog.open(log_dir).verify(deep=False)
    with pytest.raises(error):
        DeltaLog.open(log_dir).verify(deep=True)
    if stage == "files":  # a replay reads tensors only; the version's files are refused
        DeltaLog.open(log_dir).materialize(version)
        return
    with pytest.raises(error):
        DeltaLog.open(log_dir).materialize(version)


def chain_state(log_dir: Path, version: int) -> dict[str, TensorBits]:
    """Version ``version`` replayed along the versions from the log start (no other snapshot
    or squash read)."""
    state: dict[str, TensorBits] = {}
    for _, state in DeltaLog.open(log_dir).replay(version):  # noqa: B007 - the last state is used below
        pass
    return {n: TensorBits(b.dtype, b.shape, b.words.copy()) for n, b in state.items()}


def library_catchup(log_dir: Path, key: str) -> None:
    """Read one snapshot or squash with dcr_log and apply it: a snapshot to nothing, a squash to
    its start's state; a squash whose start expired is read but not applied."""
    log = DeltaLog.open(log_dir)
    cu = log.catchup(key)[0]
    step = log.catchup_step(cu)
    if cu.start is not None and cu.start < log.start():
        list(log.records(step))
        return
    log.apply_step({} if cu.start is None else chain_state(log_dir, cu.start), step)


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector_is_refused_by_the_spec_reader(name):
    """FORMAT.md's rules, as the independent reader implements them, refuse every invalid
    vector (the known gaps of dcr_log included) at the version the vector names."""
    expected = load_expected(VECTORS / "invalid" / name)
    with pytest.raises(Refused) as refused:
        spec_replay(VECTORS / "invalid" / name / "log", set())
    assert refused.value.version == expected["version"]
    stage = expected["stage"]
    assert refused.value.stage == (stage if stage in ("identity", "listing", "start", "catchup") else "version")
    assert refused.value.catchup == expected.get("catchup")


def test_invalid_vectors_cover_the_stages():
    stages = {load_expected(VECTORS / "invalid" / n)["stage"] for n in INVALID}
    assert stages == {"identity", "listing", "commit", "start", "segment", "files", "apply", "catchup"}


# -- the generator -----------------------------------------------------------------------------


def test_generator_reproduces_the_vectors(tmp_path):
    spec = importlib.util.spec_from_file_location("make_vectors", REPO / "tools" / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    module.generate(tmp_path)
    committed = {p.relative_to(VECTORS).as_posix() for p in VECTORS.rglob("*") if p.is_file()}
    produced = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert committed == produced
    # Commit records embed each segment's sha256, so a new Arrow or zstd library that writes
    # other (equally valid) segment bytes shows up here: the test extra pins both, and
    # README.md names the versions used (that line alone is not compared).
    differ = sorted(k for k in committed if _comparable(VECTORS / k) != _comparable(tmp_path / k))
    assert differ == [], differ[:10]


def _comparable(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name == "README.md":
        data = b"\n".join(line for line in data.split(b"\n") if not line.startswith(b"pyarrow "))
    return data


# -- signed versions (FORMAT.md section 21) -----------------------------------------------------

SIGNED = sorted(p.name for p in (VECTORS / "signed").iterdir() if (p / "expected.json").is_file())


@pytest.mark.parametrize("name", SIGNED)
def test_signed_vector(name):
    from dcr_log.signing import TrustPolicy

    root = VECTORS / "signed" / name
    expected = load_expected(root)
    policy = TrustPolicy.of(expected["trust"])
    log_dir = root / "log"
    assert DeltaLog.open(log_dir).verify(deep=True).versions == expected["versions"]  # no policy
    refused = expected["version"]
    if refused is None:
        assert DeltaLog.open(log_dir, trust=policy).verify(deep=True).versions == expected["versions"]
        return
    if refused > 0:
        DeltaLog.open(log_dir, trust=policy).materialize(refused - 1)
    with pytest.raises(getattr(errors, expected["error"])):
        DeltaLog.open(log_dir, trust=policy).commit(refused)
    with pytest.raises(errors.TrustError):
        DeltaLog.open(log_dir, trust=policy).verify()


def test_trust_file_comments(tmp_path):
    """Section 21: a trust file's '#' comments run to the end of the line, also after a key;
    whitespace around a key and empty lines are ignored; a key must be ed25519: + 64 lowercase
    hex digits."""
    from dcr_log.signing import TrustPolicy

    expected = load_expected(VECTORS / "signed" / "signed")
    a, b = expected["trust"]
    path = tmp_path / "trust"
    path.write_text(f"# the keys of the vector signed\n\n  {a}  # key A\n{b}#B, no space\n   # end\n")
    policy = TrustPolicy.load([path])
    assert policy.fingerprint == TrustPolicy.of([a, b]).fingerprint
    log_dir = VECTORS / "signed" / "signed" / "log"
    assert DeltaLog.open(log_dir, trust=policy).verify().versions == expected["versions"]
    pub = tmp_path / "only-a"  # the form dcr keygen writes KEY.pub in
    pub.write_text(f"{a}  # key id {expected['keys']['A']['key_id']}\n")
    assert TrustPolicy.load([pub]).fingerprint == TrustPolicy.of([a]).fingerprint
    for bad in ("ed25519:" + a[8:].upper(), f"{a} {b}", "ed25519:" + "0" * 63, "# no key at all\n"):
        path.write_text(bad + "\n")
        with pytest.raises(errors.UsageError):
            TrustPolicy.load([path])


def spec_signed_versions(log_dir: Path, trust: list[str]) -> list[bool]:
    """Section 21 from the text alone: per version, whether a trusted key's signature object
    of the commit record's SHA-256 verifies (cryptography's ed25519, nothing from dcr_log)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys = {}
    for text in trust:
        raw = bytes.fromhex(text.removeprefix("ed25519:"))
        keys[hashlib.sha256(raw).hexdigest()[:16]] = Ed25519PublicKey.from_public_bytes(raw)
    log_id = json.loads((log_dir / "dcr.json").read_bytes())["log_id"]
    out = []
    for record in sorted((log_dir / "versions").glob("*.json")):
        version = int(record.stem)
        sha = hashlib.sha256(record.read_bytes()).hexdigest()
        ok = False
        for kid, public in keys.items():
            path = log_dir / "signatures" / str(version) / f"{kid}-{sha}.sig"
            if not path.is_file():
                continue
            obj = json.loads(path.read_bytes())
            body = {k: v for k, v in obj.items() if k != "checksum"}
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            if hashlib.sha256(canonical).hexdigest() != obj["checksum"]:
                continue
            if (obj["algorithm"], obj["log_id"], obj["version"], obj["key_id"], obj["commit_sha256"]) != \
                    ("ed25519", log_id, version, kid, sha):
                continue
            message = (b"dcr-log/1 signed commit record\x00" + log_id.encode() + b"\x00"
                       + str(version).encode() + b"\x00" + bytes.fromhex(sha))
            try:
                public.verify(bytes.fromhex(obj["signature"]), message)
                ok = True
            except InvalidSignature:
                pass
        out.append(ok)
    return out


@pytest.mark.parametrize("name", SIGNED)
def test_signed_vector_spec_reader(name):
    expected = load_expected(VECTORS / "signed" / name)
    signed = spec_signed_versions(VECTORS / "signed" / name / "log", expected["trust"])
    first_refused = next((v for v, ok in enumerate(signed) if not ok), None)
    assert first_refused == expected["version"]
