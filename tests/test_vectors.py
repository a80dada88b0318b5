"""The test vectors of spec/vectors/.

Every valid log reads back, version by version, to the tensors its expected.json lists, both
through dcr_log.DeltaLog and through a small independent reader written from spec/FORMAT.md
alone (pyarrow, zstandard, xxhash and numpy; nothing from dcr_log), features sum-digests
(section 7.1) and files (section 22) included. Every invalid log fails with the stated error class at the stated
stage and not before. The generator reproduces the committed files byte for byte.
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
import pyarrow as pa
import pytest
import xxhash
import zstandard

from dcr_log import DeltaLog, errors

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO / "spec" / "vectors"
VALID = sorted(p.name for p in VECTORS.iterdir() if (p / "expected.json").is_file())
INVALID = sorted(p.name for p in (VECTORS / "invalid").iterdir() if (p / "expected.json").is_file())

# Invalid vectors that this implementation accepts although FORMAT.md says a reader MUST reject
# them. strict: once the reader is fixed the test fails until the entry is removed.
KNOWN_READER_GAPS: dict[str, str] = {}


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


def decode_payload(row: dict, n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """(box-local positions, values) of one record, per the encodings of FORMAT.md."""
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
    """The spec reader refused a log; ``version`` is where (None: before any version)."""

    def __init__(self, version: int | None, why: str):
        super().__init__(f"version {version}: {why}")
        self.version = version


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


def spec_replay(root: Path, facts: set[str]) -> list[tuple[dict, dict]]:
    """[(commit record, {name: (dtype, shape, words)})] for every version; ``facts`` collects
    what the log exercises. Raises Refused at the first check that fails. With the feature
    files, each commit record gets ``_files``: name -> the bytes of its files."""
    where: dict[str, int | None] = {"version": None}
    try:
        return _spec_replay(root, facts, where)
    except (AssertionError, LookupError, OSError, UnicodeError, ValueError, zstandard.ZstdError) as exc:
        raise Refused(where["version"], f"{type(exc).__name__}: {exc}") from exc


def _spec_replay(root: Path, facts: set[str], where: dict) -> list[tuple[dict, dict]]:
    identity = spec_unseal((root / "dcr.json").read_bytes())
    assert set(identity) == {"format_version", "log_id", "created_at", "features"}
    features = identity["features"]
    # format 1 defines two features; a name is never listed twice
    assert identity["format_version"] == 1 and features in (
        [], [SUM_DIGESTS], [FILES], [FILES, SUM_DIGESTS]), features
    facts.update(features)
    keys = sorted(p.name for p in (root / "versions").iterdir())
    assert keys == [f"{v:020d}.json" for v in range(len(keys))], "versions are not contiguous"
    state: dict[str, tuple[str, tuple, np.ndarray]] = {}
    # sum-digests: each tensor's digest followed in O(changes) from the records alone (section
    # 7.1, informative), checked below against a full pass and the table
    running: dict[str, int] = {}
    out, previous, previous_files = [], None, None
    for v, key in enumerate(keys):
        where["version"] = v
        c = spec_unseal((root / "versions" / key).read_bytes())
        assert all("\0" not in t["name"] and "\n" not in t["name"] and t["name"] for t in c["tensors"])
        assert c["version"] == v and c["log_id"] == identity["log_id"]
        assert c["features"] == features, "commit features differ from dcr.json's"
        assert c["parent"] == (None if v == 0 else v - 1)
        assert c["parent_state_digest"] == (None if previous is None else previous["state_digest"])
        assert spec_state_digest(c["tensors"]) == c["state_digest"]
        table = {t["name"]: t for t in c["tensors"]}
        assert list(table) == utf8_sorted(table)
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
        records = changed = 0
        if not c["segments"]:
            facts.add("zero-records")
        if len(c["segments"]) > 1:
            facts.add("multi-segment")
        for ref in c["segments"]:
            assert ref["key"].startswith(f"segments/{v}/") and ref["key"].endswith(".arrow")
            data = (root / ref["key"]).read_bytes()
            assert len(data) == ref["size"] and hashlib.sha256(data).hexdigest() == ref["sha256"]
            assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1"
            reader = pa.ipc.open_file(pa.py_buffer(data))
            assert reader.schema.remove_metadata().equals(SPEC_SCHEMA)
            assert reader.schema.metadata == {b"dcr.format_version": b"1",
                                              b"dcr.log_id": identity["log_id"].encode(),
                                              b"dcr.version": str(v).encode()}
            if reader.num_record_batches > 1:
                facts.add("multi-batch")
            in_segment = 0
            for i in range(reader.num_record_batches):
                rows = reader.get_batch(i).to_pylist()
                if not rows:
                    facts.add("empty-batch")
                for row in rows:
                    apply_row(row, state, created, facts, features, running)
                    in_segment += 1
                    changed += row["n_changed"]
            assert in_segment == ref["records"]
            records += in_segment
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
    return out


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
    if row["encoding"] == "sparse":
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


@pytest.mark.parametrize("name", VALID)
def test_valid_vector_spec_reader(name):
    """The format as FORMAT.md writes it down reads these logs too."""
    expected = load_expected(VECTORS / name)
    versions = spec_replay(VECTORS / name / "log", set())
    assert len(versions) == len(expected["versions"])
    for (commit, state), v in zip(versions, expected["versions"]):
        assert commit["state_digest"] == v["state_digest"]
        check_tensors(state, v, commit["features"])
        check_files(commit["_files"], v, commit["features"])


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
        with pytest.raises(error):
            log.verify(deep=True)
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


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector_is_refused_by_the_spec_reader(name):
    """FORMAT.md's rules, as the independent reader implements them, refuse every invalid
    vector (the known gaps of dcr_log included) at the version the vector names."""
    expected = load_expected(VECTORS / "invalid" / name)
    with pytest.raises(Refused) as refused:
        spec_replay(VECTORS / "invalid" / name / "log", set())
    assert refused.value.version == expected["version"]


def test_invalid_vectors_cover_the_stages():
    stages = {load_expected(VECTORS / "invalid" / n)["stage"] for n in INVALID}
    assert stages == {"identity", "listing", "commit", "segment", "files", "apply"}


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
