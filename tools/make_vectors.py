#!/usr/bin/env python3
"""Generate the dcr-log test vectors in spec/vectors/ (layout: spec/vectors/README.md).

Every log is built by hand, record by record, with the format-level API (LogIdentity,
CommitRecord, SegmentRef, Record, encode_segment, the codec encoders) rather than with
LogWriter, so that each record kind, encoding, dtype and box shape appears on purpose.
Each payload and segment is also re-encoded here from the rules of spec/FORMAT.md and must
come out byte-identical to the library's, and every digest of the feature `sum-digests` is
computed here from FORMAT.md section 7.1 and must equal dcr_log.digest's, so the spec text and
the code are checked against each other; so are the file names and file objects of the feature
`files` (section 22); and so are the manifests and markers of snapshots, squashes and
retention (sections 23 to 25), whose sealed bytes are derived here from section 3 as well.
Expected states are the dense states generated here, never a replay of the log.

The output is byte-for-byte reproducible: fixed log ids, timestamps, writer ids and segment
ids, and data drawn from SHAKE-256 (not a seeded RNG, whose stream may change between numpy
versions). Segment bytes, and so the sha256 in commit records, depend on the Arrow IPC writer
and the zstd compressor; README.md records the versions used.

    python tools/make_vectors.py [--out DIR]      # default: spec/vectors
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pcodec
import pyarrow as pa
import xxhash
import zstandard

from dcr_log.codec.base import ChangeSet
from dcr_log.codec.dense import DenseEncoding
from dcr_log.codec.raw import RawEncoding
from dcr_log.codec.sparse import SparseEncoding
from dcr_log.codec.ulp import UlpEncoding
from dcr_log.codec.ulp_rans import UlpRansEncoding
from dcr_log.coords import DTYPE_WIDTH, Box, numel, word_dtype
from dcr_log.digest import SUM
from dcr_log.format import (
    IDENTITY_KEY,
    SEGMENT_SCHEMA,
    CommitRecord,
    CommitStats,
    FileEntry,
    LogIdentity,
    Record,
    SegmentRef,
    encode_segment,
    file_name_problem,
    segment_key,
    version_key,
)
from dcr_log.format.canonical import canonical_bytes, seal
from dcr_log.format.commit import RANS_ENCODING, ULP_ENCODING
from dcr_log.format.lifecycle import CatchUp, Marker, check_object_key
from dcr_log.format.signature import signature_message
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.signing import SigningKey, public_text
from dcr_log.state import TensorBits

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rans_spec  # noqa: E402  (the ulp-rans coder written from the spec)

DEFAULT_OUT = ROOT / "spec" / "vectors"
WRITER = "vector-writer"
CREATED_AT = "2025-01-01T00:00:00.000000Z"


# -- deterministic data -------------------------------------------------------------------------


def shake(label: str, nbytes: int) -> bytes:
    return hashlib.shake_256(label.encode()).digest(nbytes)


def det_tensor(label: str, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    """Pseudo-random bits; BOOL tensors hold only 0 and 1."""
    word = word_dtype(dtype)
    words = np.frombuffer(shake(label, numel(shape) * word.itemsize), dtype=word).copy()
    if dtype == "BOOL":
        words &= 1
    return TensorBits(dtype, tuple(shape), words)


def words_tensor(dtype: str, shape: tuple[int, ...], words) -> TensorBits:
    return TensorBits(dtype, tuple(shape), np.array(words, dtype=word_dtype(dtype)).reshape(-1))


def zeros_tensor(dtype: str, shape: tuple[int, ...]) -> TensorBits:
    return TensorBits(dtype, tuple(shape), np.zeros(numel(shape), dtype=word_dtype(dtype)))


def box_flat(shape: tuple[int, ...], box: Box) -> np.ndarray:
    """Flat row-major tensor indices of the box's elements, in the box's row-major order."""
    idx = np.arange(numel(shape), dtype=np.int64).reshape(shape)
    return idx[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)


def det_positions(label: str, candidates: np.ndarray, k: int) -> np.ndarray:
    keys = np.frombuffer(shake(label, 8 * candidates.size), dtype="<u8")
    return np.sort(candidates[np.argsort(keys, kind="stable")[:k]])


def flipped(bits: TensorBits, label: str, k: int, box: Box | None = None,
            xor: tuple[int, ...] = (1, 3, 0x80)) -> TensorBits:
    """A copy with ``k`` words (inside ``box``) xored with small non-zero values."""
    box = box or Box.whole(bits.shape)
    where = det_positions(label, box_flat(bits.shape, box), k)
    return with_xor(bits, where, xor)


def with_xor(bits: TensorBits, flat, xor) -> TensorBits:
    flat = np.asarray(flat, dtype=np.int64)
    values = np.resize(np.array(xor, dtype=np.uint64), flat.size)
    if bits.dtype == "BOOL":
        values[:] = 1
    words = bits.words.copy()
    words[flat] ^= values.astype(words.dtype)
    return TensorBits(bits.dtype, bits.shape, words)


def with_words(bits: TensorBits, flat, values) -> TensorBits:
    words = bits.words.copy()
    words[np.asarray(flat, dtype=np.int64)] = np.asarray(values, dtype=np.uint64).astype(words.dtype)
    return TensorBits(bits.dtype, bits.shape, words)


def retyped(bits: TensorBits, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    """The same bytes seen as another dtype and/or shape."""
    return TensorBits(dtype, tuple(shape), bits.words.view(word_dtype(dtype)).copy())


# -- digests and encodings, written from spec/FORMAT.md --------------------------------------


def xxh3(words: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(words).tobytes())


# Feature sum-digests (FORMAT.md section 7.1): e(f, w) = mix64(((f + 1) * G mod 2^64) XOR w),
# a digest is the sum mod 2^64 of e over the elements it covers.
SUM_DIGESTS = "sum-digests"
MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * MIX1) & MASK64
    z ^= z >> 27
    z = (z * MIX2) & MASK64
    return z ^ (z >> 31)


def element_hash(f: int, w: int) -> int:
    """e(f, w) in plain integers, as FORMAT.md section 7.1 writes it."""
    return mix64((((f + 1) * GOLDEN) & MASK64) ^ w)


def element_hashes(flat, words: np.ndarray) -> np.ndarray:
    """e(flat[i], words[i]) for every i, vectorised (numpy's uint64 arithmetic wraps mod 2^64)."""
    f = np.asarray(flat, dtype=np.int64).astype(np.uint64)
    w = np.ascontiguousarray(words).view(np.dtype(f"<u{words.dtype.itemsize}")).astype(np.uint64)
    z = ((f + np.uint64(1)) * np.uint64(GOLDEN)) ^ w
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def sum_digest(flat, words: np.ndarray) -> int:
    return int(element_hashes(flat, words).sum(dtype=np.uint64)) if np.size(flat) else 0


def _check_element_hash() -> None:
    """The reference values of FORMAT.md section 7.1, and the vectorised form against them."""
    assert element_hash(0, 0) == 0xE220A8397B1DCDAF
    assert element_hash(1, 0) == 0x6E789E6AA1B965F4
    assert element_hash(0, 0x3F80) == 0x2F4107AE02771311
    flat = np.array([0, 1, 0, 7, 2**40 + 3, 2**63 - 1], dtype=np.int64)
    words = np.array([0, 0, 0x3F80, MASK64, 0x8000000000000000, 12345], dtype="<u8")
    plain = [element_hash(int(f), int(w)) for f, w in zip(flat, words)]
    assert element_hashes(flat, words).tolist() == plain
    assert sum_digest(flat, words) == sum(plain) & MASK64


_check_element_hash()


@dataclass(frozen=True)
class Digests:
    """A log's digest scheme (FORMAT.md sections 7 and 7.1), from its features. Sum digests are
    computed here from the spec and cross-checked against dcr_log.digest.SUM."""

    features: tuple[str, ...] = ()

    @property
    def sum(self) -> bool:
        return SUM_DIGESTS in self.features

    def tensor(self, bits: TensorBits) -> int:
        if not self.sum:
            return xxh3(bits.words)
        mine = sum_digest(np.arange(bits.words.size), bits.words)
        assert mine == SUM.tensor(bits.words, bits.shape), "library and spec tensor digests differ"
        return mine

    def at(self, flat: np.ndarray, words: np.ndarray, box: Box | None = None,
           shape: tuple[int, ...] | None = None) -> int:
        """Digest of ``words`` at tensor flat indices ``flat``; with ``box`` (``words`` are then
        the whole box, box-local row-major) the library's box digest is checked as well."""
        if not self.sum:
            return xxh3(words)
        mine = sum_digest(flat, words)
        assert mine == SUM.at(np.asarray(flat, dtype=np.int64), words), "library and spec digests differ"
        if box is not None:
            assert mine == SUM.box(box, shape, words), "library and spec box digests differ"
        return mine


XXH3_DIGESTS = Digests()


def spec_state_digest(state: dict[str, TensorBits], digests: Digests = XXH3_DIGESTS) -> int:
    lines = sorted(
        name.encode("utf-8") + b"\x00" + bits.dtype.encode() + b"\x00"
        + ",".join(str(d) for d in bits.shape).encode() + b"\x00"
        + f"{digests.tensor(bits):016x}".encode() + b"\n"
        for name, bits in state.items()
    )
    return xxhash.xxh3_64_intdigest(b"".join(lines))


def planes(words: np.ndarray) -> bytes:
    w = words.dtype.itemsize
    return words.astype(words.dtype.newbyteorder("<")).view(np.uint8).reshape(-1, w).T.tobytes()


def zstd_frame(body: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(body)


def gaps_of(positions: np.ndarray) -> np.ndarray:
    p = positions.astype(np.int64)
    return np.diff(p, prepend=-1) - 1


def min_gap_bytes(gaps: np.ndarray) -> int:
    top = int(gaps.max()) if gaps.size else 0
    return next(w for w in (1, 2, 4, 8) if w == 8 or top < 1 << (8 * w))


def sparse_payload(gaps: np.ndarray, values: np.ndarray, gap_bytes: int, level: int) -> bytes:
    gap_words = gaps.astype(np.dtype(f"<u{gap_bytes}"))
    return zstd_frame(planes(gap_words) + planes(values), level)


def spec_key(words: np.ndarray) -> np.ndarray:
    """FORMAT.md section 11, ulp: x XOR (2^W - 1) if the top bit is set, else x XOR 2^(W-1)."""
    bits = 8 * words.dtype.itemsize
    x = words.astype(np.uint64)
    top = np.uint64(1 << (bits - 1))
    return np.where(x >= top, x ^ np.uint64((1 << bits) - 1), x ^ top)


def pco_file(numbers: np.ndarray, level: int) -> bytes:
    cfg = pcodec.ChunkConfig(compression_level=level, delta_spec=pcodec.DeltaSpec.no_op(),
                             mode_spec=pcodec.ModeSpec.classic())
    return pcodec.standalone.simple_compress(np.ascontiguousarray(numbers), cfg)


def ulp_payload(positions, base, target, gap_bytes: int, level: int) -> bytes:
    bits = 8 * base.dtype.itemsize
    d = spec_key(target) - spec_key(base)  # uint64: wraps mod 2^64
    if bits < 64:  # mod 2^W, then read as a W-bit two's-complement integer
        top = np.int64(1 << (bits - 1))
        signed = ((d & np.uint64((1 << bits) - 1)).astype(np.int64) ^ top) - top
    else:
        signed = d.view(np.int64)
    number_type = {8: "<i2", 16: "<i2", 32: "<i4", 64: "<i8"}[bits]
    gaps = pco_file(gaps_of(positions).astype(f"<u{gap_bytes}"), level)
    distances = pco_file(signed.astype(number_type), level)
    return len(gaps).to_bytes(8, "little") + gaps + distances


def spec_encode(kind, encoding, n, positions, values, level, gap_bytes=None,
                base=None) -> tuple[dict, bytes]:
    """(params, payload) of one record, from the encoding rules of spec/FORMAT.md; ``base``:
    the base words at the positions (the ulp encoding codes values relative to them)."""
    values = np.ascontiguousarray(values)
    if encoding == "raw":
        pos = b"" if kind == "tensor" else positions.astype("<u8").tobytes()
        return {}, pos + values.tobytes()
    if encoding == "sparse":
        gaps = gaps_of(positions)
        gw = gap_bytes or min_gap_bytes(gaps)
        return {"gap_bytes": gw, "level": level}, sparse_payload(gaps, values, gw, level)
    if encoding == "dense":
        full = values if kind == "tensor" else np.zeros(n, dtype=values.dtype)
        if kind != "tensor":
            full[positions] = values
        return {"level": level}, zstd_frame(planes(full), level)
    if encoding == "ulp":
        assert kind == "xor"
        gw = gap_bytes or (4 if int(gaps_of(positions).max()) < 1 << 32 else 8)
        return {"gap_bytes": gw, "level": level}, ulp_payload(positions, base, base ^ values, gw, level)
    if encoding == "ulp-rans":
        assert kind == "xor"
        return {}, rans_payload(positions, base, base ^ values)
    raise ValueError(encoding)


def rans_payload(positions, base, target) -> bytes:
    """FORMAT.md section 11, ulp-rans: tools/rans_spec.py, written from that section."""
    return rans_spec.encode([int(p) for p in positions], [int(x) for x in base], [int(x) for x in target],
                            base.dtype.itemsize)


def encode(kind, encoding, n, positions, values, level=3, gap_bytes=None, base=None) -> tuple[dict, bytes]:
    """Encode with the library's encoder and check the spec's rules give the same bytes."""
    mine = spec_encode(kind, encoding, n, positions, values, level, gap_bytes, base)
    if gap_bytes is not None:  # a non-minimal gap width: the library encoder never picks one
        return mine
    changes = ChangeSet(n, None if kind == "tensor" else positions, values)
    if encoding == "ulp":
        lib = UlpEncoding(level).encode(kind, changes, base=base, new=base ^ values)
        assert lib == mine, f"{kind}/{encoding}: library and spec encodings differ"
        return lib
    if encoding == "ulp-rans":
        lib = UlpRansEncoding().encode(kind, changes, base=base, new=base ^ values)
        assert lib == mine, f"{kind}/{encoding}: library and spec encodings differ"
        return lib
    encoder = {"raw": RawEncoding(), "sparse": SparseEncoding(level), "dense": DenseEncoding(level)}[encoding]
    lib = encoder.encode(kind, changes)
    assert lib == mine, f"{kind}/{encoding}: library and spec encodings differ"
    return lib


# -- records ----------------------------------------------------------------------------------


class Step:
    """One version being built: the previous state, the new dense state and record builders."""

    def __init__(self, base: dict[str, TensorBits], new: dict[str, TensorBits],
                 digests: Digests = XXH3_DIGESTS):
        self.base = base
        self.new = new
        self.digests = digests

    def _box(self, name: str, box) -> Box:
        if box is None:
            return Box.whole(self.new[name].shape)
        return box if isinstance(box, Box) else Box(tuple(box[0]), tuple(box[1]))

    def delta(self, name: str, kind: str, encoding: str, box=None, *, extra=(), level: int = 3,
              gap_bytes: int | None = None, against: TensorBits | None = None) -> Record:
        """An xor or overwrite record for the changes of ``name`` inside ``box``.

        ``extra`` adds box-local positions that did not change (an overwrite "repair");
        ``against`` replaces the previous tensor (for a deliberately wrong record).
        """
        old, new = against or self.base[name], self.new[name]
        assert old.dtype == new.dtype and old.shape == new.shape, name
        box = self._box(name, box)
        flat = box_flat(new.shape, box)
        b, t = old.words[flat], new.words[flat]
        positions = np.union1d(np.flatnonzero(b != t), np.asarray(extra, dtype=np.int64))
        values = (b ^ t)[positions] if kind == "xor" else t[positions]
        params, payload = encode(kind, encoding, box.size, positions, values, level, gap_bytes,
                                 b[positions])
        at = flat[positions]  # record digests hash tensor flat indices, not box-local positions
        return Record(name, kind, box, encoding, params, int(positions.size),
                      self.digests.at(at, b[positions]), self.digests.at(at, t[positions]), payload)

    def xor(self, name, encoding, box=None, **kw) -> Record:
        return self.delta(name, "xor", encoding, box, **kw)

    def overwrite(self, name, encoding, box=None, **kw) -> Record:
        return self.delta(name, "overwrite", encoding, box, **kw)

    def tensor(self, name: str, encoding: str, box=None, *, level: int = 3) -> Record:
        new = self.new[name]
        box = self._box(name, box)
        flat = box_flat(new.shape, box)
        values = new.words[flat]
        params, payload = encode("tensor", encoding, box.size, None, values, level)
        target = self.digests.at(flat, values, box, new.shape)
        return Record(name, "tensor", box, encoding, params, box.size, 0, target, payload)


def rows_box(shape: tuple[int, ...], start: int, stop: int) -> Box:
    """Rows start..stop of a tensor: a row block."""
    return Box((start,) + (0,) * (len(shape) - 1), (stop - start,) + tuple(shape[1:]))


# -- files (feature files, FORMAT.md section 22) -----------------------------------------------

FILES = "files"


def spec_file_name_ok(name: str) -> bool:
    """A file name by the rules of FORMAT.md section 22, written out here."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    lowered = raw.lower()  # ASCII letters only
    return (0 < len(raw) <= 255 and not any(c in name for c in "/\\")
            and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in name) and not name.startswith(".")
            and not lowered.endswith(b".safetensors") and lowered != b"model.safetensors.index.json")


def file_entries(file_set: dict[str, bytes]) -> list[FileEntry]:
    """A version's file objects, from section 22 (and the library's name check against it)."""
    out = []
    for name in sorted(file_set, key=str.encode):
        assert spec_file_name_ok(name) and file_name_problem(name) is None, name
        data = file_set[name]
        entry = FileEntry(name, len(data), hashlib.sha256(data).hexdigest())
        assert entry.key == "files/" + entry.sha256
        out.append(entry)
    return out


def _check_file_names() -> None:
    """Names section 22 refuses, refused by the spec's rules here and by the library alike."""
    bad = ["", "a/b", "a\\b", "../x", ".", "..", ".dcr", ".hidden", "model.safetensors",
           "Model.SafeTensors", "shard-00001-of-00002.safetensors", "model.safetensors.index.json",
           "MODEL.SAFETENSORS.INDEX.JSON", "tab\tname", "nul\x00", "del\x7f", "\ud800", "x" * 256,
           "\u00e9" * 128]
    good = ["config.json", "tokenizer.json", "vocab.txt", "x" * 255, "\u00e9" * 127,
            "model.safetensors.txt", "safetensors", "caf\u00e9 notes.md", "a..b"]
    for name in bad:
        assert not spec_file_name_ok(name) and file_name_problem(name) is not None, repr(name)
    for name in good:
        assert spec_file_name_ok(name) and file_name_problem(name) is None, repr(name)


_check_file_names()


# -- segments ---------------------------------------------------------------------------------


def record_row(r: Record) -> dict:
    return {
        "tensor": r.tensor, "kind": r.kind, "box_offset": list(r.box.offset),
        "box_shape": list(r.box.shape), "encoding": r.encoding,
        "params": canonical_bytes(r.params).decode(), "n_changed": r.n_changed,
        "base_digest": r.base_digest, "target_digest": r.target_digest, "payload": bytes(r.payload),
    }


def segment_meta(log_id: str, version: int) -> dict[bytes, bytes]:
    return {b"dcr.format_version": b"1", b"dcr.log_id": log_id.encode(),
            b"dcr.version": str(version).encode()}


def write_segment(rows: list[dict], meta: dict[bytes, bytes], batches: list[int] | None = None,
                  schema: pa.Schema = SEGMENT_SCHEMA, stream: bool = False) -> bytes:
    """An Arrow IPC file (or, for a broken vector, stream) of ``rows``, in the given batch sizes."""
    sink = pa.BufferOutputStream()
    open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
    writer = open_writer(sink, schema.with_metadata(meta))
    sizes = batches if batches is not None else [len(rows)]
    assert sum(sizes) == len(rows)
    start = 0
    for size in sizes:
        chunk = rows[start : start + size]
        start += size
        writer.write_batch(pa.record_batch(
            [pa.array([r[f.name] for r in chunk], f.type) for f in schema], schema=schema))
    writer.close()
    return sink.getvalue().to_pybytes()


@dataclass
class Seg:
    records: list[Record]
    writer: str = WRITER
    batches: list[int] | None = None
    rows_hook: Callable[[list[dict]], list[dict]] | None = None
    bytes_hook: Callable[[bytes], bytes] | None = None  # before sha256 and size are taken
    meta: dict[bytes, bytes] | None = None
    schema: pa.Schema = SEGMENT_SCHEMA
    stream: bool = False


def vector_log_id(vector: str) -> str:
    return hashlib.sha256(f"dcr-log test vector {vector}".encode()).hexdigest()[:32]


def segment_id(vector: str, version: int, index: int) -> str:
    return hashlib.sha256(f"{vector}/{version}/{index}".encode()).hexdigest()[:32]


# -- logs -------------------------------------------------------------------------------------


class LogBuilder:
    """A log under construction: its files (key -> bytes), dense states and commit records."""

    def __init__(self, name: str, identity: LogIdentity | None = None, features: tuple[str, ...] = ()):
        """``features`` go into every commit record (and into dcr.json unless ``identity`` is
        given) and choose the digest scheme."""
        self.name = name
        self.log_id = vector_log_id(name)
        self.identity = identity or LogIdentity(log_id=self.log_id, created_at=CREATED_AT,
                                                features=tuple(features))
        self.features = tuple(features)
        self.digests = Digests(self.features)
        self.files: dict[str, bytes] = {IDENTITY_KEY: self.identity.to_bytes()}
        self.states: list[dict[str, TensorBits]] = []
        self.commits: list[CommitRecord] = []
        self.file_sets: list[dict[str, bytes]] = []  # feature files: each version's files
        # Sections 23 to 25: the log start (versions below it deleted) and the snapshots and
        # squashes written, each (manifest key, kind, version, from).
        self.start = 0
        self.catchups: list[tuple[str, str, int, int | None]] = []

    def step(self, new: dict[str, TensorBits]) -> Step:
        return Step(self.states[-1] if self.states else {}, new, self.digests)

    def commit(self, step: Step, segments: list[Seg], *, check: bool = True,
               commit_hook: Callable[[CommitRecord], CommitRecord] | None = None,
               ref_hook: Callable[[SegmentRef], SegmentRef] | None = None,
               file_set: dict[str, bytes] | None = None) -> CommitRecord:
        """``file_set`` (feature files): the version's files, name -> bytes; their objects are
        added to the log and their entries to the commit record."""
        version = len(self.commits)
        entries = None
        if FILES in self.features:
            file_set = dict(file_set or {})
            entries = tuple(file_entries(file_set))
            for e in entries:
                self.files[e.key] = file_set[e.name]
        else:
            assert file_set is None, "files in a log without the feature"
        if check:
            check_records(step, [r for s in segments for r in s.records])
        refs, changed, nrecords = [], 0, 0
        for i, seg in enumerate(segments):
            rows = [record_row(r) for r in seg.records]
            plain = seg.rows_hook is None and seg.meta is None and not seg.stream \
                and seg.schema is SEGMENT_SCHEMA
            if seg.rows_hook:
                rows = seg.rows_hook(rows)
            meta = seg.meta or segment_meta(self.log_id, version)
            data = write_segment(rows, meta, seg.batches, seg.schema, seg.stream)
            if plain and seg.batches is None:
                assert data == encode_segment(seg.records, self.log_id, version), "segment bytes differ"
            if seg.bytes_hook:
                data = seg.bytes_hook(data)
            key = segment_key(version, seg.writer, segment_id(self.name, version, i))
            self.files[key] = data
            ref = SegmentRef(key, len(data), hashlib.sha256(data).hexdigest(), len(rows))
            refs.append(ref_hook(ref) if ref_hook else ref)
            changed += sum(r["n_changed"] for r in rows)
            nrecords += len(rows)
        new = step.new
        digest = spec_state_digest(new, self.digests)
        table = tuple(TensorInfo(n, b.dtype, b.shape, self.digests.tensor(b)) for n, b in new.items())
        assert state_digest(table) == digest, "library and spec state digests differ"
        parent = self.commits[-1] if self.commits else None
        commit = CommitRecord(
            log_id=self.log_id, version=version,
            parent=None if parent is None else version - 1,
            parent_state_digest=None if parent is None else parent.state_digest,
            state_digest=digest, segments=tuple(refs), tensors=table,
            stats=CommitStats(changed, sum(b.words.size for b in new.values()), nrecords),
            created_at=f"2025-01-01T00:{version // 60:02d}:{version % 60:02d}.000000Z",
            writer_id=segments[0].writer if segments else WRITER,
            features=self.features, files=entries,
        )
        if commit_hook:
            commit = commit_hook(commit)
        self.files[version_key(version)] = commit.to_bytes()
        self.commits.append(commit)
        self.states.append(new)
        self.file_sets.append(file_set or {})
        return commit


def check_records(step: Step, records: list[Record]) -> None:
    """The hand-made records must take the base to the new state: every changed word covered,
    created tensors only by ``tensor`` records, and no two records of a tensor overlapping."""
    for name, new in step.new.items():
        old = step.base.get(name)
        created = old is None or old.dtype != new.dtype or old.shape != new.shape
        covered = np.zeros(new.words.size, dtype=np.int64)
        for r in records:
            if r.tensor == name:
                assert not created or r.kind == "tensor", f"{name}: {r.kind} record for a new tensor"
                covered[box_flat(new.shape, r.box)] += 1
        assert covered.max(initial=0) <= 1, f"{name}: records overlap"
        must = new.words != 0 if created else new.words != old.words
        assert np.all(covered[must] == 1), f"{name}: a change is not covered by any record"
    assert all(r.tensor in step.new for r in records)


def tensor_entries(b: LogBuilder, state: dict[str, TensorBits], with_bytes: bool = False) -> list[dict]:
    """Vectors with a digest scheme other than xxh3 also give each tensor's ``digest``; with
    ``with_bytes``, ``hex`` holds the tensor's bytes."""
    tensors = []
    for n, t in sorted(state.items(), key=lambda kv: kv[0].encode()):
        entry = {"name": n, "dtype": t.dtype, "shape": list(t.shape),
                 "sha256": hashlib.sha256(t.words.tobytes()).hexdigest(), "xxh3": f"{xxh3(t.words):016x}"}
        if b.digests.sum:
            entry["digest"] = f"{b.digests.tensor(t):016x}"
        if with_bytes:
            entry["hex"] = t.words.tobytes().hex()
        tensors.append(entry)
    return tensors


def expected_json(b: LogBuilder, description: str) -> dict:
    """The versions from the log start on; after retention (sections 23 to 25) also ``start``
    and ``catchups``: the state each snapshot and squash leads to (a squash's from-state in
    full, with its bytes)."""
    versions = []
    for v, state in enumerate(b.states):
        if v < b.start:
            continue
        entry = {"version": v, "state_digest": f"{spec_state_digest(state, b.digests):016x}",
                 "tensors": tensor_entries(b, state)}
        if FILES in b.features:
            entry["files"] = [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                              for n, d in sorted(b.file_sets[v].items(), key=lambda kv: kv[0].encode())]
        versions.append(entry)
    out = {"vector": b.name, "description": description, "log_id": b.log_id, "versions": versions}
    if b.start or b.catchups:
        out["start"] = b.start
        out["catchups"] = [catchup_entry(b, *c) for c in b.catchups]
    return out


def catchup_entry(b: LogBuilder, key: str, kind: str, version: int, start: int | None) -> dict:
    state = b.states[version]
    entry = {"key": key, "kind": kind, "version": version, "from": start,
             "retired": f"snapshots/{version}/retired.json" in b.files and kind == "snapshot",
             "state_digest": f"{spec_state_digest(state, b.digests):016x}",
             "tensors": tensor_entries(b, state)}
    if start is not None:
        entry["from_state_digest"] = f"{spec_state_digest(b.states[start], b.digests):016x}"
        entry["from_tensors"] = tensor_entries(b, b.states[start], with_bytes=True)
    return entry


# -- valid vectors ----------------------------------------------------------------------------

BF16 = {"one": 0x3F80, "m2": 0xC000, "half": 0x3F00, "three": 0x4040,
        "quarter": 0x3E80, "m1": 0xBF80, "eight": 0x4100, "zero": 0x0000}


def v_worked_example() -> LogBuilder:
    """The example decoded byte by byte in FORMAT.md."""
    b = LogBuilder("worked-example")
    w0 = words_tensor("BF16", (2, 4), [BF16[k] for k in
                                       ("one", "m2", "half", "three", "quarter", "m1", "eight", "zero")])
    s = b.step({"w": w0})
    b.commit(s, [Seg([s.tensor("w", "raw")])])
    # positions 1, 2, 6: one ulp, two low bits, the sign of 8.0
    s = b.step({"w": with_xor(w0, [1, 2, 6], [0x0001, 0x0003, 0x8000])})
    b.commit(s, [Seg([s.xor("w", "sparse")])])
    return b


def v_kinds_and_encodings() -> LogBuilder:
    b = LogBuilder("kinds-and-encodings")
    big = zeros_tensor("U8", (70000,))
    big = with_words(big, det_positions("big0", np.arange(70000), 20), np.arange(1, 21))
    st = {"a": det_tensor("a0", "BF16", (16, 32)), "b": det_tensor("b0", "F32", (64,)),
          "c": det_tensor("c0", "I64", (8, 8)), "big": big}
    s = b.step(st)
    b.commit(s, [Seg([
        s.tensor("a", "dense"), s.tensor("b", "raw"),
        s.tensor("c", "raw", rows_box((8, 8), 0, 4)),
        s.tensor("c", "dense", rows_box((8, 8), 4, 8), level=19),
        s.tensor("big", "dense"),
    ])])

    a = flipped(st["a"], "a1-top", 10, rows_box((16, 32), 0, 8))
    a = flipped(a, "a1-bottom", 110, rows_box((16, 32), 8, 16))
    bigv = with_xor(st["big"], [3, 69000, 69991, 69999], [0x40, 0x01, 0x02, 0x80])
    st = {"a": a, "b": flipped(st["b"], "b1", 6), "c": flipped(st["c"], "c1", 5), "big": bigv}
    s = b.step(st)
    recs = [
        s.xor("a", "sparse", rows_box((16, 32), 0, 8), level=1),  # 10 of 256 changed
        s.xor("a", "dense", rows_box((16, 32), 8, 16)),            # 110 of 256 changed
        s.xor("b", "raw"),
        s.overwrite("c", "raw"),
        s.xor("big", "sparse", Box((0,), (69990,))),               # a gap of 68996: gap_bytes 4
        s.xor("big", "sparse", Box((69990,), (10,)), gap_bytes=8),  # wider than needed: allowed
    ]
    b.commit(s, [Seg(recs, batches=[2, 0, 4])])  # three record batches, one of them empty

    st = dict(st)
    st["a"] = flipped(st["a"], "a2", 12)
    st["b"] = flipped(st["b"], "b2", 3)
    st["c"] = flipped(st["c"], "c2", 9)
    s = b.step(st)
    bpos = np.flatnonzero(s.base["b"].words != st["b"].words)
    repair = np.setdiff1d(np.arange(64), bpos)[:2]  # rewritten with the value they already hold
    b.commit(s, [Seg([
        s.overwrite("a", "sparse", level=9),
        s.overwrite("b", "raw", extra=repair),
        s.tensor("c", "raw", rows_box((8, 8), 0, 4)),     # a tensor record on an existing tensor
        s.tensor("c", "dense", rows_box((8, 8), 4, 8), level=1),
    ])])

    st = dict(st)
    st["a"] = with_xor(st["a"], [0, 300, 310], [0x0001, 0x0002, 0x0004])  # gap 299: gap_bytes 2
    st["b"] = flipped(st["b"], "b3", 20)
    st["c"] = flipped(st["c"], "c3", 40)
    s = b.step(st)
    b.commit(s, [Seg([s.xor("a", "sparse"), s.overwrite("b", "sparse", level=1),
                      s.xor("c", "dense", level=22)])])
    return b


def v_dtypes() -> LogBuilder:
    b = LogBuilder("dtypes")
    shapes = {d: (3, 5) for d in DTYPE_WIDTH}
    shapes.update({"F64": (3, 2), "BOOL": (3, 6), "U8": (3, 7)})
    names = {d: f"t.{d}" for d in DTYPE_WIDTH}
    st = {names[d]: det_tensor(f"dt0.{d}", d, shapes[d]) for d in DTYPE_WIDTH}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(names[d], "raw" if i % 2 == 0 else "dense")
                      for i, d in enumerate(DTYPE_WIDTH)])])

    def top(d):
        return rows_box(shapes[d], 0, 2)

    def last(d):
        return rows_box(shapes[d], 2, 3)

    plans = [  # per version: (function making the new tensor, records per dtype)
        (lambda d, t: flipped(flipped(t, f"dt1a.{d}", 3, top(d)), f"dt1b.{d}", 2, last(d)),
         lambda s, d: [s.xor(names[d], "sparse", top(d)), s.xor(names[d], "raw", last(d))]),
        (lambda d, t: flipped(flipped(t, f"dt2a.{d}", 2, top(d)), f"dt2b.{d}", 4, last(d)),
         lambda s, d: [s.overwrite(names[d], "raw", top(d)), s.xor(names[d], "dense", last(d))]),
        (lambda d, t: flipped(t, f"dt3.{d}", 4),
         lambda s, d: [s.overwrite(names[d], "sparse")]),
        (lambda d, t: det_tensor(f"dt4.{d}", d, shapes[d]),
         lambda s, d: [s.tensor(names[d], "raw", top(d)), s.tensor(names[d], "dense", last(d))]),
    ]
    for make, records in plans:
        st = {names[d]: make(d, st[names[d]]) for d in DTYPE_WIDTH}
        s = b.step(st)
        b.commit(s, [Seg([r for d in DTYPE_WIDTH for r in records(s, d)])])
    return b


SPECIALS = {  # +0, -0, +inf, -inf, qNaN, sNaN, NaN with payload, min/max subnormal, min normal,
    # max finite, 1, -1, 1 + ulp, -min subnormal, all-ones NaN (F8_E4M3 has no inf: NaNs instead)
    "F32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345,
            0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F800000, 0xBF800000, 0x3F800001,
            0x80000001, 0x7FFFFFFF],
    "F16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE5A, 0x0001, 0x03FF, 0x0400,
            0x7BFF, 0x3C00, 0xBC00, 0x3C01, 0x8001, 0x7FFF],
    "BF16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC5, 0x0001, 0x007F, 0x0080,
             0x7F7F, 0x3F80, 0xBF80, 0x3F81, 0x8001, 0x7FFF],
    "F64": [0x0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
            0x7FF0000000000001, 0xFFF8000000012345, 0x1, 0x000FFFFFFFFFFFFF, 0x0010000000000000,
            0x7FEFFFFFFFFFFFFF, 0x3FF0000000000000, 0xBFF0000000000000, 0x3FF0000000000001,
            0x8000000000000001, 0x7FFFFFFFFFFFFFFF],
    "F8_E4M3": [0x00, 0x80, 0x7F, 0xFF, 0x7F, 0xFF, 0xFF, 0x01, 0x07, 0x08, 0x7E, 0x38, 0xB8,
                0x39, 0x81, 0x7F],
    "F8_E5M2": [0x00, 0x80, 0x7C, 0xFC, 0x7E, 0x7D, 0xFF, 0x01, 0x03, 0x04, 0x7B, 0x3C, 0xBC,
                0x3D, 0x81, 0x7F],
}


def v_float_specials() -> LogBuilder:
    """Bits, not float values: signed zeros, NaN payloads, infinities, subnormals."""
    b = LogBuilder("float-specials")
    st = {f"specials.{d}": words_tensor(d, (16,), w) for d, w in SPECIALS.items()}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(n, "raw") for n in st])])

    def sign(d):
        return 1 << (8 * DTYPE_WIDTH[d] - 1)

    # +0 -> -0, qNaN -> another NaN payload, sNaN -> another sNaN, +inf -> -inf, min subnormal -> +0;
    # the NaNs at 6 and 15 stay bit-identical (a float comparison would call them changed).
    st = {n: with_xor(t, [0, 4, 5, 2, 7], [sign(t.dtype), 1, 2, sign(t.dtype), 1]) for n, t in st.items()}
    s = b.step(st)
    b.commit(s, [Seg([s.xor(n, "raw") for n in st])])
    # -0 -> +0, payload NaN -> canonical qNaN bits, 1 -> 1 + ulp, -min subnormal -> -0
    st = {n: with_words(t, [1, 6, 11, 14], [0, SPECIALS[t.dtype][4], SPECIALS[t.dtype][13], sign(t.dtype)])
          for n, t in st.items()}
    s = b.step(st)
    b.commit(s, [Seg([s.overwrite(n, "sparse") for n in st])])
    # every sign bit flipped: NaNs stay NaNs, zeros and infinities swap sign
    st = {n: with_xor(t, np.arange(16), [sign(t.dtype)]) for n, t in st.items()}
    s = b.step(st)
    b.commit(s, [Seg([s.xor(n, "dense") for n in st])])
    return b


def v_boxes() -> LogBuilder:
    b = LogBuilder("boxes")
    st = {"grid": det_tensor("grid0", "F32", (6, 7)), "cube": det_tensor("cube0", "U16", (4, 5, 6)),
          "scalar": det_tensor("scalar0", "F64", ()), "empty": zeros_tensor("I32", (0, 3)),
          "empty1": zeros_tensor("U8", (0,)), "vec": det_tensor("vec0", "BF16", (10,))}
    s = b.step(st)
    b.commit(s, [Seg([
        s.tensor("grid", "raw", rows_box((6, 7), 0, 3)), s.tensor("grid", "dense", rows_box((6, 7), 3, 6)),
        s.tensor("cube", "raw"), s.tensor("scalar", "raw"), s.tensor("vec", "dense"),
    ])])  # the empty tensors have no elements and so no records

    interior = Box((1, 2), (3, 4))
    column = Box((0, 6), (6, 1))
    cube_in = Box((1, 1, 2), (2, 3, 3))
    cube_rows = Box((3, 0, 0), (1, 5, 6))  # a row block of a 3-D tensor
    cube_edge = Box((0, 0, 4), (1, 5, 2))
    st = dict(st)
    st["grid"] = flipped(flipped(st["grid"], "grid1", 5, interior), "grid1c", 3, column)
    st["cube"] = flipped(flipped(flipped(st["cube"], "cube1", 7, cube_in), "cube1r", 12, cube_rows),
                         "cube1e", 4, cube_edge)
    st["scalar"] = with_xor(st["scalar"], [0], [1 << 63])
    st["vec"] = flipped(st["vec"], "vec1", 2, Box((2,), (5,)))
    s = b.step(st)
    b.commit(s, [Seg([
        s.xor("grid", "raw", interior), s.overwrite("grid", "sparse", column),
        s.overwrite("cube", "sparse", cube_in), s.xor("cube", "dense", cube_rows),
        s.xor("cube", "raw", cube_edge), s.xor("scalar", "raw"), s.xor("vec", "sparse", Box((2,), (5,))),
    ])])

    g_box = Box((2, 1), (2, 3))
    c_box = Box((0, 1, 1), (2, 2, 2))
    st = dict(st)
    st["grid"] = with_words(st["grid"], box_flat((6, 7), g_box), np.arange(6) + 0x40000000)
    st["cube"] = with_words(st["cube"], box_flat((4, 5, 6), c_box), np.arange(8) * 257)
    st["scalar"] = words_tensor("F64", (), [0x8000000000000000])  # -0.0
    s = b.step(st)
    b.commit(s, [Seg([
        s.tensor("grid", "raw", g_box),  # a tensor record on an interior box: no precondition
        s.tensor("cube", "dense", c_box), s.overwrite("scalar", "raw"),
    ])])

    boxes = [Box((0, 0, 0), (2, 2, 2)), Box((2, 3, 1), (2, 2, 4)), Box((1, 2, 5), (3, 3, 1))]
    st = dict(st)
    for i, bx in enumerate(boxes):
        st["cube"] = flipped(st["cube"], f"cube3.{i}", 3, bx)
    s = b.step(st)
    b.commit(s, [Seg([s.xor("cube", "sparse", boxes[0]), s.overwrite("cube", "raw", boxes[1]),
                      s.xor("cube", "dense", boxes[2])])])
    return b


def v_lifecycle() -> LogBuilder:
    b = LogBuilder("lifecycle")
    st = {"keep": det_tensor("keep0", "BF16", (4, 8)), "drop": det_tensor("drop0", "F32", (5,)),
          "reshape": det_tensor("reshape0", "I16", (2, 6)), "retype": det_tensor("retype0", "F32", (4,)),
          "empty.shape": zeros_tensor("U8", (0, 3))}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(n, "raw") for n in ("keep", "drop", "reshape", "retype")])])

    b.commit(b.step(dict(st)), [])  # nothing changed: a version with zero records, no segments

    st = {"keep": flipped(st["keep"], "keep2", 3), "reshape": retyped(st["reshape"], "I16", (3, 4)),
          "retype": retyped(st["retype"], "I32", (4,)), "added": det_tensor("added2", "U32", (3, 3)),
          "empty.shape": zeros_tensor("U8", (3, 0))}
    s = b.step(st)
    b.commit(s, [  # two segments from two writers; "drop" is removed
        Seg([s.xor("keep", "sparse"), s.tensor("reshape", "raw")], writer="rank-0"),
        Seg([s.tensor("retype", "dense"), s.tensor("added", "raw")], writer="rank-1"),
    ])

    st = {k: v for k, v in st.items() if k != "keep"}
    st["zeros"] = zeros_tensor("U8", (4,))  # created zero-filled; all zero, so no record needed
    st["empty.f16"] = zeros_tensor("F16", (2, 0))
    b.commit(b.step(st), [])  # removals and additions with zero records

    st = dict(st)
    st["drop"] = det_tensor("drop4", "F64", (5,))  # a removed name comes back with another dtype
    st["retype"] = retyped(st["retype"], "F16", (8,))  # width 4 -> 2
    st["zeros"] = with_xor(st["zeros"], [1, 3], [7, 9])
    s = b.step(st)
    b.commit(s, [Seg([s.tensor("drop", "raw"), s.tensor("retype", "raw", Box((0,), (4,))),
                      s.tensor("retype", "dense", Box((4,), (4,))), s.xor("zeros", "raw")])])
    return b


NAMES = [
    "model.layers.0.self_attn.q_proj.weight", "/leading/slash", "space name", "tab\tname",
    'quote"back\\slash', "ctl\x01del\x7f", "caf\u00e9", "\uff21fullwidth", "\U0001f600emoji",
]


def v_names() -> LogBuilder:
    """Names needing JSON escapes, and names whose UTF-8 order differs from UTF-16 order."""
    b = LogBuilder("names")
    st = {n: det_tensor(f"name0.{i}", "U8" if i % 2 else "F32", (2, 3)) for i, n in enumerate(NAMES)}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(n, "raw") for n in sorted(st, key=str.encode)])])
    st = {n: flipped(t, f"name1.{i}", 2) for i, (n, t) in enumerate(st.items())}
    s = b.step(st)
    b.commit(s, [Seg([s.xor(n, "raw") for n in st])])
    return b


def v_sum_digests_worked() -> LogBuilder:
    """The sum-digests example of FORMAT.md section 18: the worked example's tensor, then one
    raw xor record on an interior box, so that box-local positions and flat indices differ."""
    b = LogBuilder("sum-digests-worked", features=(SUM_DIGESTS,))
    w0 = words_tensor("BF16", (2, 4), [BF16[k] for k in
                                       ("one", "m2", "half", "three", "quarter", "m1", "eight", "zero")])
    s = b.step({"w": w0})
    b.commit(s, [Seg([s.tensor("w", "raw")])])
    # the box rows 0..2, columns 1..3 holds flat indices 1, 2, 5, 6; change 2 and 6
    s = b.step({"w": with_xor(w0, [2, 6], [0x0003, 0x8000])})
    b.commit(s, [Seg([s.xor("w", "raw", Box((0, 1), (2, 2)))])])
    return b


def v_sum_digests() -> LogBuilder:
    """Feature sum-digests with every kind and encoding, 0-d, empty and large tensors, interior
    boxes, tensor records on existing tensors, and tensors added, removed, reshaped, retyped."""
    b = LogBuilder("sum-digests", features=(SUM_DIGESTS,))
    big = zeros_tensor("U8", (260, 250))  # 65000 elements: more than one piece of the library
    big = with_words(big, det_positions("sbig0", np.arange(65000), 40), np.arange(1, 41))
    st = {"grid": det_tensor("sgrid0", "F32", (6, 7)), "cube": det_tensor("scube0", "U16", (4, 5, 6)),
          "scalar": det_tensor("sscalar0", "F64", ()), "empty": zeros_tensor("I32", (0, 3)),
          "vec": det_tensor("svec0", "BF16", (10,)), "wide": det_tensor("swide0", "U64", (3, 4)),
          "bytes": det_tensor("sbytes0", "I8", (5, 6)), "flags": det_tensor("sflags0", "BOOL", (9,)),
          "big": big, "reshape": det_tensor("sreshape0", "I16", (2, 6)),
          "retype": det_tensor("sretype0", "F32", (4,))}
    s = b.step(st)
    b.commit(s, [Seg([
        s.tensor("grid", "raw", rows_box((6, 7), 0, 3)), s.tensor("grid", "dense", rows_box((6, 7), 3, 6)),
        s.tensor("cube", "raw"), s.tensor("scalar", "raw"), s.tensor("vec", "dense"),
        s.tensor("wide", "raw"), s.tensor("bytes", "dense"), s.tensor("flags", "raw"),
        s.tensor("big", "dense", rows_box((260, 250), 0, 140)),  # 35000 elements
        s.tensor("big", "dense", rows_box((260, 250), 140, 260)),
        s.tensor("reshape", "raw"), s.tensor("retype", "raw"),
    ])])  # the empty tensor has no elements and so no record; its digest is 0

    interior = Box((1, 2), (3, 4))
    column = Box((0, 6), (6, 1))
    cube_in = Box((1, 1, 2), (2, 3, 3))
    cube_rows = Box((3, 0, 0), (1, 5, 6))
    big_in = Box((40, 25), (200, 200))  # 40000 elements in runs of 200
    bytes_in = Box((1, 1), (3, 4))
    st = dict(st)
    st["grid"] = flipped(flipped(st["grid"], "sgrid1", 5, interior), "sgrid1c", 3, column)
    st["cube"] = flipped(flipped(st["cube"], "scube1", 7, cube_in), "scube1r", 12, cube_rows)
    st["scalar"] = with_xor(st["scalar"], [0], [1 << 63])
    st["vec"] = flipped(st["vec"], "svec1", 2, Box((2,), (5,)))
    st["wide"] = with_xor(st["wide"], [1, 5, 6, 11], [1 << 63, 0xFFFFFFFF00000000, 1, 0x0123456789ABCDEF])
    st["big"] = flipped(st["big"], "sbig1", 30, big_in, xor=(1, 0x80, 0xFF))
    st["bytes"] = with_words(st["bytes"], box_flat((5, 6), bytes_in), np.arange(12) + 100)
    st["flags"] = flipped(st["flags"], "sflags1", 3)
    s = b.step(st)
    fpos = np.flatnonzero(s.base["flags"].words != st["flags"].words)
    repair = np.setdiff1d(np.arange(9), fpos)[:1]  # rewritten with the value it already holds
    b.commit(s, [Seg([
        s.xor("grid", "raw", interior), s.overwrite("grid", "sparse", column),
        s.overwrite("cube", "sparse", cube_in), s.xor("cube", "dense", cube_rows),
        s.xor("scalar", "raw"), s.xor("vec", "sparse", Box((2,), (5,))), s.xor("wide", "dense"),
        s.xor("big", "sparse", big_in), s.tensor("bytes", "dense", bytes_in),
        s.overwrite("flags", "raw", extra=repair),
    ])])

    b.commit(b.step(dict(st)), [])  # nothing changed: a version with zero records

    g_box = Box((2, 1), (2, 3))
    c_box = Box((0, 1, 1), (2, 2, 2))
    st = {k: v for k, v in st.items() if k != "flags"}  # removed
    st["grid"] = with_words(st["grid"], box_flat((6, 7), g_box), np.arange(6) + 0x40000000)
    st["cube"] = with_words(st["cube"], box_flat((4, 5, 6), c_box), np.arange(8) * 257)
    st["scalar"] = words_tensor("F64", (), [0x8000000000000000])  # -0.0
    st["wide"] = with_words(st["wide"], [4, 5, 6, 7], [0, MASK64, 1 << 32, 7])
    big_box = Box((10, 5), (180, 200))  # 36000 elements in runs of 200
    st["big"] = with_words(with_xor(st["big"], [0, 64999], [0x01, 0x80]),
                           det_positions("sbig3", box_flat((260, 250), big_box), 25), np.arange(25) + 200)
    st["reshape"] = retyped(st["reshape"], "I16", (3, 4))
    st["retype"] = retyped(st["retype"], "I32", (4,))
    st["added"] = det_tensor("sadded3", "U32", (3, 3))
    s = b.step(st)
    b.commit(s, [Seg([
        s.tensor("grid", "raw", g_box), s.tensor("cube", "dense", c_box), s.overwrite("scalar", "raw"),
        s.tensor("wide", "raw", rows_box((3, 4), 1, 2)),  # a tensor record on an existing tensor
        s.xor("big", "sparse", rows_box((260, 250), 0, 10)),
        s.xor("big", "raw", rows_box((260, 250), 190, 260)),
        s.tensor("big", "dense", big_box), s.tensor("reshape", "dense"), s.tensor("retype", "raw"),
        s.tensor("added", "raw"),
    ])])
    return b


def v_files() -> LogBuilder:
    """Feature files (with sum-digests): files added, changed, removed and unchanged, an empty
    file, binary bytes, a name needing JSON escapes, two names with the same bytes (one object),
    a version without files and an object listed again by a later version."""
    b = LogBuilder("files", features=(FILES, SUM_DIGESTS))
    config0 = b'{"architectures":["BertModel"],"hidden_size":8,"model_type":"bert"}\n'
    config1 = b'{"architectures":["BertModel"],"hidden_act":"gelu","hidden_size":8,"model_type":"bert"}\n'
    vocab = b"".join(b"%s\n" % t for t in (b"[PAD]", b"[UNK]", b"[CLS]", b"[SEP]", b"the", b"caf\xc3\xa9"))
    files = {"config.json": config0, "tokenizer.json": b'{"model":{"type":"WordPiece"},"version":"1.0"}\n',
             "vocab.txt": vocab, "special_tokens_map.json": b"{}\n", "added_tokens.json": b"{}\n",
             "tokenizer.model": shake("files/tokenizer.model", 300)}
    st = {"w": det_tensor("fw0", "BF16", (4, 8)), "b": det_tensor("fb0", "F32", (8,))}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor("w", "raw"), s.tensor("b", "dense")])], file_set=files)

    files = {**files, "config.json": config1, "generation_config.json": b'{"max_length":20}\n'}
    st = {**st, "w": flipped(st["w"], "fw1", 3)}
    s = b.step(st)
    b.commit(s, [Seg([s.xor("w", "sparse")])], file_set=files)  # changed and added

    files = {k: v for k, v in files.items() if k != "vocab.txt"}  # removed
    files.update({"merges.txt": b"", "caf\u00e9 notes.md": "r\u00e9sum\u00e9\n".encode()})
    b.commit(b.step(dict(st)), [], file_set=files)  # files change, tensors do not

    st = {**st, "b": flipped(st["b"], "fb3", 2)}
    s = b.step(st)
    b.commit(s, [Seg([s.overwrite("b", "raw")])], file_set={})  # no files at all

    b.commit(b.step(dict(st)), [], file_set={"config.json": config0})  # version 0's object again
    return b


# -- snapshots, squashes and retention (FORMAT.md sections 23 to 25) -------------------------

CATCHUP_AT = "2025-01-01T01:00:00.000000Z"  # created_at of the manifests and markers
HEX16_RE, HEX64_RE = r"[0-9a-f]{16}", r"[0-9a-f]{64}"


def spec_seal(body: dict) -> bytes:
    """Section 3 written out: the canonical form of the body (members sorted by key, no
    whitespace, ASCII escapes) and its SHA-256 as the member ``checksum``."""
    def canonical(obj) -> bytes:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return canonical({**body, "checksum": hashlib.sha256(canonical(body)).hexdigest()})


def catchup_prefix(start: int | None, version: int) -> str:
    return f"snapshots/{version}/" if start is None else f"squashes/{start}-{version}/"


def spec_segment_name_ok(name: str) -> bool:
    """Section 2's file name of a segment (sections 23 and 24 use it under their prefix)."""
    return 1 <= len(name) <= 255 and name.endswith(".arrow") and all(
        c.isascii() and (c.isalnum() or c in "._-") for c in name)


def add_catchup(b: LogBuilder, start: int | None, version: int,
                make: Callable[[Step], list[list[Record]]], check: bool = True) -> CatchUp:
    """A snapshot (``start`` None) or a squash from ``start`` to ``version``: the records
    ``make`` builds from the step (the from-state, or nothing, to ``version``'s state), one
    segment per list, then the manifest of section 23, sealed here by section 3 and by
    dcr_log.format.lifecycle.CatchUp alike."""
    kind = "snapshot" if start is None else "squash"
    prefix = catchup_prefix(start, version)
    step = Step({} if start is None else b.states[start], b.states[version], b.digests)
    segments = make(step)
    records = [r for seg in segments for r in seg]
    if check:
        check_records(step, records)
        for r in records:  # section 23: tensor records only; 24: for the tensors it creates only
            old, new = step.base.get(r.tensor), step.new[r.tensor]
            kept = old is not None and (old.dtype, old.shape) == (new.dtype, new.shape)
            assert r.kind == "tensor" if kind == "snapshot" else (r.kind == "tensor") == (not kept), r
        if kind == "snapshot":  # every element covered exactly once
            for name, t in step.new.items():
                covered = np.zeros(t.words.size, dtype=np.int64)
                for r in records:
                    if r.tensor == name:
                        covered[box_flat(t.shape, r.box)] += 1
                assert np.all(covered == 1), name
    refs = []
    for i, recs in enumerate(segments):
        data = write_segment([record_row(r) for r in recs], segment_meta(b.log_id, version))
        assert data == encode_segment(recs, b.log_id, version), "segment bytes differ"
        key = f"{prefix}{WRITER}-{segment_id(b.name, prefix, i)}.arrow"
        assert spec_segment_name_ok(key[len(prefix):])
        check_object_key(key, prefix, key)
        b.files[key] = data
        refs.append(SegmentRef(key, len(data), hashlib.sha256(data).hexdigest(), len(recs)))
    target = b.commits[version]
    commit_sha = hashlib.sha256(b.files[version_key(version)]).hexdigest()
    changed = sum(r.n_changed for r in records)
    total = sum(t.words.size for t in step.new.values())
    if kind == "snapshot":
        assert changed == total or not check
    from_digest = None if start is None else spec_state_digest(b.states[start], b.digests)
    body = {  # the manifest table of section 23, member by member
        "format_version": 1, "log_id": b.log_id, "kind": kind, "version": version, "from": start,
        "from_state_digest": None if from_digest is None else f"{from_digest:016x}",
        "state_digest": f"{spec_state_digest(step.new, b.digests):016x}", "commit_sha256": commit_sha,
        "segments": [{"key": r.key, "size": r.size, "sha256": r.sha256, "records": r.records} for r in refs],
        "stats": {"changed_elements": changed, "total_elements": total, "records": len(records)},
        "created_at": CATCHUP_AT, "writer_id": WRITER,
    }
    cu = CatchUp(b.log_id, version, start, None if start is None else b.commits[start].state_digest,
                 target.state_digest, commit_sha, tuple(refs),
                 CommitStats(changed, target.stats.total_elements, len(records)), CATCHUP_AT, WRITER)
    data = cu.to_bytes()
    assert data == spec_seal(body), "library and spec manifests differ"
    assert cu.key == prefix + "manifest.json" and CatchUp.from_bytes(data, cu.key) == cu
    b.files[cu.key] = data
    b.catchups.append((cu.key, kind, version, start))
    return cu


def add_marker(b: LogBuilder, kind: str, version: int) -> Marker:
    """A log-start marker (``kind`` "log-start") or a retire marker ("retired") naming the
    manifest of snapshot ``version`` (section 25), sealed here and by Marker alike."""
    key = f"log-start/{version:020d}.json" if kind == "log-start" else f"snapshots/{version}/retired.json"
    sha = hashlib.sha256(b.files[f"snapshots/{version}/manifest.json"]).hexdigest()
    body = {"format_version": 1, "log_id": b.log_id, "kind": kind, "version": version,
            "snapshot_sha256": sha, "created_at": CATCHUP_AT}
    marker = Marker(b.log_id, kind, version, sha, CATCHUP_AT)
    data = marker.to_bytes()
    assert data == spec_seal(body), "library and spec markers differ"
    assert marker.key == key and Marker.from_bytes(data, key) == marker
    b.files[key] = data
    return marker


def expire(b: LogBuilder, start: int) -> None:
    """Retention's deletions below the log start ``start`` (section 25, step 3): commit
    records, segments and signatures of the versions before it."""
    for key in list(b.files):
        top, _, rest = key.partition("/")
        if top in ("versions", "segments", "signatures") and int(rest.split("/")[0][:20]) < start:
            del b.files[key]
    b.start = start


RETENTION_W = (4, 8)


def _snapshot_3(s: Step) -> list[list[Record]]:
    return [[s.tensor("added", "raw"), s.tensor("b", "raw"), s.tensor("gone", "dense"),
             s.tensor("w", "raw", rows_box(RETENTION_W, 0, 2)),
             s.tensor("w", "dense", rows_box(RETENTION_W, 2, 4))]]  # one tensor in two boxes


def _snapshot_4(s: Step) -> list[list[Record]]:
    return [[s.tensor(n, "raw") for n in sorted(s.new)]]


def _snapshot_5(s: Step) -> list[list[Record]]:
    return [[s.tensor("w", "raw")], [s.tensor("added", "dense"), s.tensor("b", "raw")]]  # two segments


def _squash_1_5(s: Step) -> list[list[Record]]:
    # "added" is created (absent at 1): tensor records; "gone" is dropped with no record
    return [[s.tensor("added", "raw"), s.overwrite("b", "raw"), s.xor("w", "sparse")]]


def _squash_3_6(s: Step) -> list[list[Record]]:
    return [[s.xor("added", "raw"), s.xor("b", "sparse"), s.xor("w", "dense")]]


RETENTION_CATCHUPS = {"snapshots/3/": _snapshot_3, "snapshots/4/": _snapshot_4, "snapshots/5/": _snapshot_5,
                      "squashes/1-5/": _squash_1_5, "squashes/3-6/": _squash_3_6}


def retention_log(name: str, catchups: dict | None = None, check: bool = True) -> LogBuilder:
    """Versions 0 to 6 (sum-digests): w BF16 [4,8], b F32 [6] and gone I16 [3] at 0; added U8
    [2,3] from 2 on; gone removed at 4; version 5 changes one of 4's words of w back. Then
    snapshots at 3, 4 and 5, squashes 1-5 and 3-6, snapshot 4 retired, the log start at 3, and
    versions 0 to 2 deleted. ``catchups`` replaces the records of some of them (by prefix)."""
    b = LogBuilder(name, features=(SUM_DIGESTS,))
    st = {"b": det_tensor("rb0", "F32", (6,)), "gone": det_tensor("rgone0", "I16", (3,)),
          "w": det_tensor("rw0", "BF16", RETENTION_W)}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor("b", "raw"), s.tensor("gone", "raw"), s.tensor("w", "dense")])])
    st = {**st, "b": flipped(st["b"], "rb1", 2), "w": flipped(st["w"], "rw1", 3)}
    s = b.step(st)
    b.commit(s, [Seg([s.xor("b", "raw"), s.xor("w", "sparse")])])
    st = {**st, "added": det_tensor("radded2", "U8", (2, 3)), "w": flipped(st["w"], "rw2", 2)}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor("added", "raw"), s.overwrite("w", "raw")])])
    st = {**st, "added": flipped(st["added"], "radded3", 2), "b": flipped(st["b"], "rb3", 2)}
    s = b.step(st)
    b.commit(s, [Seg([s.xor("added", "raw"), s.overwrite("b", "sparse")])])
    w3 = st["w"]
    st = {k: v for k, v in st.items() if k != "gone"}
    st.update(added=flipped(st["added"], "radded4", 1), w=flipped(w3, "rw4", 12))
    s = b.step(st)
    b.commit(s, [Seg([s.overwrite("added", "raw"), s.xor("w", "dense")])])
    back = int(np.flatnonzero(w3.words != st["w"].words)[0])  # changed at 4, changed back at 5
    w5 = with_xor(flipped(st["w"], "rw5", 3), [back], [int(w3.words[back] ^ st["w"].words[back])])
    st = {**st, "b": flipped(st["b"], "rb5", 3), "w": w5}
    assert w5.words[back] == w3.words[back]
    s = b.step(st)
    b.commit(s, [Seg([s.xor("b", "raw"), s.xor("w", "sparse")])])
    st = {**st, "added": flipped(st["added"], "radded6", 2), "w": flipped(st["w"], "rw6", 2)}
    s = b.step(st)
    b.commit(s, [Seg([s.xor("added", "raw"), s.overwrite("w", "sparse")])])
    makers = {**RETENTION_CATCHUPS, **(catchups or {})}
    for prefix in ("snapshots/3/", "snapshots/4/", "snapshots/5/", "squashes/1-5/", "squashes/3-6/"):
        numbers = prefix.split("/")[1]
        start, _, end = numbers.rpartition("-")
        add_catchup(b, int(start) if start else None, int(end), makers[prefix],
                    check=check or prefix not in (catchups or {}))
    add_marker(b, "retired", 4)
    add_marker(b, "log-start", 3)
    expire(b, 3)
    return b


def v_retention() -> LogBuilder:
    return retention_log("retention")


def v_squash_equal_states() -> LogBuilder:
    """Version 2 has version 0's state again (sum-digests): the squash 0-2 has no records and
    no segments (section 24); the squash 1-2 undoes version 1. Version 3 changes nothing (no
    segments), and neither does the squash 2-3: a route tie at 0 bytes (section 24)."""
    b = LogBuilder("squash-equal-states", features=(SUM_DIGESTS,))
    st0 = {"b": det_tensor("eb0", "F32", (6,)), "w": det_tensor("ew0", "BF16", (2, 4))}
    s = b.step(st0)
    b.commit(s, [Seg([s.tensor("b", "raw"), s.tensor("w", "raw")])])
    st1 = {**st0, "b": flipped(st0["b"], "eb1", 2), "w": flipped(st0["w"], "ew1", 3)}
    s = b.step(st1)
    b.commit(s, [Seg([s.xor("b", "raw"), s.xor("w", "sparse")])])
    s = b.step(dict(st0))
    b.commit(s, [Seg([s.xor("b", "raw"), s.xor("w", "raw")])])
    s = b.step(dict(st0))
    b.commit(s, [])
    add_catchup(b, 0, 2, lambda s: [])
    add_catchup(b, 1, 2, lambda s: [[s.xor("b", "raw"), s.xor("w", "raw")]])
    add_catchup(b, 2, 3, lambda s: [])
    return b


def spec_unkey(keys: np.ndarray, bits: int) -> np.ndarray:
    top = np.uint64(1 << (bits - 1))
    return np.where(keys >= top, keys ^ top, keys ^ np.uint64((1 << bits) - 1))


def ulp_stepped(bits: TensorBits, flat, distances) -> TensorBits:
    """A copy whose words at ``flat`` moved by ``distances`` steps in key order (mod 2^W)."""
    flat = np.asarray(flat, dtype=np.int64)
    w = 8 * bits.words.dtype.itemsize
    # The distances (a few parameters) as their two's complement images; uint64 sums wrap.
    d = np.resize(np.array([x % (1 << 64) for x in distances], dtype=np.uint64), flat.size)
    moved = spec_key(bits.words[flat]) + d
    if w < 64:
        moved &= np.uint64((1 << w) - 1)
    words = bits.words.copy()
    words[flat] = spec_unkey(moved, w).astype(words.dtype)
    return TensorBits(bits.dtype, bits.shape, words)


def v_ulp() -> LogBuilder:
    """Feature ulp-encoding (with sum-digests): xor records coded as distances from the base."""
    b = LogBuilder("ulp", features=(SUM_DIGESTS, ULP_ENCODING))
    w0 = det_tensor("uw0", "BF16", (16, 64))
    big = zeros_tensor("U8", (70000,))
    st = {"w": w0, "specials": words_tensor("BF16", (16,), SPECIALS["BF16"]),
          "f32": det_tensor("uf32", "F32", (40,)), "f16": det_tensor("uf16", "F16", (3, 10)),
          "f64": det_tensor("uf64", "F64", (8,)), "fp8": det_tensor("ufp8", "F8_E4M3", (20,)),
          "i8": det_tensor("ui8", "I8", (12,)), "u16": det_tensor("uu16", "U16", (9,)), "big": big}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(n, "raw") for n in st])])

    interior = Box((2, 8), (4, 16))
    st = dict(st)
    # Weight-like steps: mostly one unit in the last place, some two or three, a few far.
    st["w"] = ulp_stepped(st["w"], det_positions("uw1", box_flat((16, 64), rows_box((16, 64), 0, 2)), 24),
                          [1, -1, 1, -1, 2, -1, 1, -3, 1, -2, 1, -1, 700, -1, 1, -40000])
    st["w"] = ulp_stepped(st["w"], det_positions("uw1i", box_flat((16, 64), interior), 9), [1, -1, 2])
    st["w"] = ulp_stepped(st["w"], det_positions("uw1s", box_flat((16, 64), rows_box((16, 64), 6, 16)), 20),
                          [1, -1])
    # +0 one step down is -0; -0 down is the negative minimum subnormal; +inf up is a NaN;
    # the largest positive NaN up wraps to the all-ones NaN; 1 up is 1 + ulp.
    st["specials"] = ulp_stepped(st["specials"], [0, 1, 2, 15, 11], [-1, -1, 1, 1, 1])
    st["f32"] = ulp_stepped(st["f32"], det_positions("uf32", np.arange(40), 7), [1, -1, 5, -100000, 1 << 30])
    st["f16"] = ulp_stepped(st["f16"], det_positions("uf16", np.arange(30), 6), [1, -2])
    st["f64"] = ulp_stepped(st["f64"], [0, 3, 7], [1, -(1 << 62), (1 << 63) - 1])
    st["fp8"] = ulp_stepped(st["fp8"], det_positions("ufp8", np.arange(20), 20), [1, -1, 127, -128])
    st["i8"] = ulp_stepped(st["i8"], [0, 5, 11], [-128, 127, 1])
    st["u16"] = ulp_stepped(st["u16"], [2, 4], [3, -3])
    st["big"] = ulp_stepped(st["big"], [3, 69000, 69991, 69999], [1, -1, 2, 64])
    s = b.step(st)
    b.commit(s, [Seg([
        s.xor("w", "ulp", rows_box((16, 64), 0, 2)), s.xor("w", "ulp", interior),
        s.xor("w", "sparse", rows_box((16, 64), 6, 16)),
        s.xor("specials", "ulp"), s.xor("f32", "ulp"), s.xor("f16", "ulp", level=4),
        s.xor("f64", "ulp", level=0), s.xor("fp8", "ulp"),  # every element changed
        s.xor("i8", "ulp"), s.xor("u16", "ulp", level=12),
        s.xor("big", "ulp", Box((0,), (69990,))),                # a gap of 68996
        s.xor("big", "ulp", Box((69990,), (10,)), gap_bytes=8),  # u64 gaps: wider than needed
    ])])
    st = dict(st)
    st["w"] = ulp_stepped(st["w"], det_positions("uw2", box_flat((16, 64), rows_box((16, 64), 2, 16)), 30),
                          [-1, 1, 1, -1, 2])
    s = b.step(st)
    b.commit(s, [Seg([s.xor("w", "ulp", rows_box((16, 64), 2, 16))])])
    return b


def v_ulp_rans() -> LogBuilder:
    """Feature rans-encoding (with sum-digests): the ulp vector's changes in ulp-rans."""
    b = LogBuilder("ulp-rans", features=(RANS_ENCODING, SUM_DIGESTS))
    w0 = det_tensor("rw0", "BF16", (16, 64))
    big = zeros_tensor("U8", (70000,))
    st = {"w": w0, "specials": words_tensor("BF16", (16,), SPECIALS["BF16"]),
          "f32": det_tensor("rf32", "F32", (40,)), "f16": det_tensor("rf16", "F16", (3, 10)),
          "f64": det_tensor("rf64", "F64", (8,)), "fp8": det_tensor("rfp8", "F8_E4M3", (20,)),
          "i8": det_tensor("ri8", "I8", (12,)), "u16": det_tensor("ru16", "U16", (9,)), "big": big,
          "one": det_tensor("rone", "F32", ())}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor(n, "raw") for n in st])])

    interior = Box((2, 8), (4, 16))
    st = dict(st)
    # Weight-like steps: mostly one unit in the last place, some two or three, a few far.
    st["w"] = ulp_stepped(st["w"], det_positions("rw1", box_flat((16, 64), rows_box((16, 64), 0, 2)), 24),
                          [1, -1, 1, -1, 2, -1, 1, -3, 1, -2, 1, -1, 700, -1, 1, -40000])
    st["w"] = ulp_stepped(st["w"], det_positions("rw1i", box_flat((16, 64), interior), 9), [1, -1, 2])
    st["w"] = ulp_stepped(st["w"], det_positions("rw1s", box_flat((16, 64), rows_box((16, 64), 6, 16)), 20),
                          [1, -1])
    # +0 one step down is -0; -0 down is the negative minimum subnormal; +inf up is a NaN;
    # the largest positive NaN up wraps to the all-ones NaN; 1 up is 1 + ulp.
    st["specials"] = ulp_stepped(st["specials"], [0, 1, 2, 15, 11], [-1, -1, 1, 1, 1])
    st["f32"] = ulp_stepped(st["f32"], det_positions("rf32", np.arange(40), 7), [1, -1, 5, -100000, 1 << 30])
    st["f16"] = ulp_stepped(st["f16"], det_positions("rf16", np.arange(30), 6), [1, -2])
    # 64-bit distances of 61 and 62 extra bits: the widest bins
    st["f64"] = ulp_stepped(st["f64"], [0, 3, 6, 7], [1, -(1 << 62), -(1 << 63), (1 << 63) - 1])
    st["fp8"] = ulp_stepped(st["fp8"], det_positions("rfp8", np.arange(20), 20), [1, -1, 127, -128])
    st["i8"] = ulp_stepped(st["i8"], [0, 5, 11], [-128, 127, 1])
    st["u16"] = ulp_stepped(st["u16"], [2, 4], [3, -3])
    st["big"] = ulp_stepped(st["big"], [3, 69000, 69991, 69999], [1, -1, 2, 64])
    st["one"] = ulp_stepped(st["one"], [0], [-1])
    s = b.step(st)
    b.commit(s, [Seg([
        s.xor("w", "ulp-rans", rows_box((16, 64), 0, 2)), s.xor("w", "ulp-rans", interior),
        s.xor("w", "sparse", rows_box((16, 64), 6, 16)),
        s.xor("specials", "ulp-rans"), s.xor("f32", "ulp-rans"), s.xor("f16", "ulp-rans"),
        s.xor("f64", "ulp-rans"), s.xor("fp8", "ulp-rans"),  # every element changed
        s.xor("i8", "ulp-rans"), s.xor("u16", "ulp-rans"), s.xor("one", "ulp-rans"),  # a 0-d tensor
        s.xor("big", "ulp-rans", Box((0,), (69990,))),  # a gap of 68996
        s.xor("big", "ulp-rans", Box((69990,), (10,))),
    ])])
    st = dict(st)
    st["w"] = ulp_stepped(st["w"], det_positions("rw2", box_flat((16, 64), rows_box((16, 64), 2, 16)), 300),
                          [-1, 1, 1, -1, 2, 1, -1, 1, -1, -1, 1, 3])
    s = b.step(st)
    b.commit(s, [Seg([s.xor("w", "ulp-rans", rows_box((16, 64), 2, 16))])])  # 300 changes, both lanes
    return b


VALID = [
    (v_worked_example, "one BF16 tensor; version 1 is the sparse xor record decoded in FORMAT.md"),
    (v_kinds_and_encodings, "every record kind with every encoding it allows; gap_bytes 1, 2, 4 and "
     "8; tensor records on existing tensors; an overwrite repair; a segment of three batches"),
    (v_dtypes, "all 15 dtypes, each with every kind/encoding pair"),
    (v_float_specials, "signed zeros, NaN payloads, infinities and subnormals change bit-exactly"),
    (v_boxes, "0-d and empty tensors; interior sub-rectangles of 2-D and 3-D tensors"),
    (v_lifecycle, "tensors added, removed, reshaped and retyped; versions with zero records; "
     "two segments in one version"),
    (v_names, "tensor names needing JSON escapes and sorted by UTF-8 bytes"),
    (v_sum_digests_worked, "feature sum-digests: the worked example's BF16 tensor, then one raw "
     "xor record on an interior box, the sum-digests example of FORMAT.md section 18.1"),
    (v_sum_digests, "feature sum-digests: 0-d, empty, 64-bit and large tensors; every kind with "
     "every encoding it allows; interior boxes of 2-D and 3-D tensors; tensor records on existing "
     "tensors; an overwrite repair; a version with zero records; tensors added, removed, reshaped "
     "and retyped"),
    (v_files, "feature files (with sum-digests): a version's non-tensor files: added, changed, "
     "removed and unchanged across versions; an empty file; binary bytes; a name needing JSON "
     "escapes; two names with the same bytes (one object); a version without files; an object "
     "listed again by a later version"),
    (v_ulp, "feature ulp-encoding (with sum-digests): xor records as distances from the base, "
     "on BF16 (interior boxes, steps of one to 40000 units), float specials (+0 to -0, +inf to a "
     "NaN, the largest NaN wrapping around), F32, F16, F64, F8_E4M3 (every element changed), "
     "I8 and U16 (1-byte distances at -128 and 127), a gap of 68996 and a record with u64 gaps; "
     "pcodec levels 0, 4, 8 and 12"),
    (v_ulp_rans, "feature rans-encoding (with sum-digests): xor records as distances from the base "
     "in the encoding ulp-rans (bins, static rANS, extra bits), on BF16 (interior boxes, steps of one "
     "to 40000 units, a record of 300 changes), float specials (+0 to -0, +inf to a NaN, the largest "
     "NaN wrapping around), F32, F16, F64 (distances of up to 2^63 units: the widest bins), F8_E4M3 "
     "(every element changed), I8 and U16 (1-byte distances at -128 and 127), a 0-d F32 and a gap of "
     "68996"),
    (v_retention, "sections 23 to 25 (with sum-digests): a log after retention, starting at "
     "version 3 (a log-start marker naming snapshot 3's manifest; versions 0 to 2 and their "
     "segments deleted); snapshots at 3 (one tensor in two boxes), 4 (retired) and 5 (two "
     "segments); a squash from the expired version 1 to 5 that creates a tensor (tensor "
     "records) and drops one (no record); a squash from 3 to 6 over a word changed at 4 and "
     "changed back at 5"),
    (v_squash_equal_states, "section 24 (with sum-digests): version 2 returns to version 0's "
     "state; the squash from 0 to 2 has no records and no segments, the squash from 1 to 2 undoes "
     "version 1; version 3 and the squash from 2 to 3 change nothing (no segments: 0 bytes each)"),
]


# -- invalid vectors --------------------------------------------------------------------------


def invalid_base(name: str, *, identity_kw: dict | None = None, v1_records=None, rows_hook=None,
                 seg_kw: dict | None = None, ref_hook=None, commit_hooks: dict | None = None,
                 v1_state=None, check: bool = True, features: tuple[str, ...] = ()) -> LogBuilder:
    """A 3-version log: v0 creates three tensors, v1 adds one and changes the others with one
    record per kind/encoding family, v2 changes nothing. ``features`` are the log's (dcr.json's
    and every commit record's); with ``files``, the versions have the files INVALID_FILES. The
    hooks break one thing in it."""
    sets = INVALID_FILES if FILES in features else [None] * 3
    identity = None
    if identity_kw:
        identity = LogIdentity(**{"log_id": vector_log_id(name), "created_at": CREATED_AT,
                                  "features": tuple(features), **identity_kw})
    b = LogBuilder(name, identity, features)
    hooks = commit_hooks or {}
    st = {"n": det_tensor("n0", "I32", (2, 3)), "w": det_tensor("w0", "BF16", (4, 8)),
          "x": det_tensor("x0", "F32", (6,))}
    s = b.step(st)
    b.commit(s, [Seg([s.tensor("n", "raw"), s.tensor("w", "raw"), s.tensor("x", "dense")])],
             commit_hook=hooks.get(0), file_set=sets[0])
    st = {"added": det_tensor("added1", "U8", (5,)), "n": flipped(st["n"], "n1", 6),
          "w": flipped(st["w"], "w1", 3), "x": flipped(st["x"], "x1", 2)}
    if v1_state:
        st = v1_state(st)
    s = b.step(st)
    recs = [s.tensor("added", "raw"), s.xor("n", "dense"), s.xor("w", "sparse"), s.overwrite("x", "raw")]
    if v1_records:
        recs = v1_records(s, recs)
    b.commit(s, [Seg(recs, rows_hook=rows_hook, **(seg_kw or {}))], check=check,
             ref_hook=ref_hook, commit_hook=hooks.get(1), file_set=sets[1])
    b.commit(b.step(dict(st)), [], commit_hook=hooks.get(2), file_set=sets[2])
    return b


# Files of the invalid vectors with the feature files: version 1 changes config.json and adds
# tokenizer.json; version 2 keeps them.
_CONFIG0, _CONFIG1 = b'{"hidden_size":8}\n', b'{"hidden_size":8,"vocab_size":6}\n'
_TOKENIZER, _VOCAB = b'{"model":{"type":"WordPiece"}}\n', b"[PAD]\n[UNK]\nthe\n"
INVALID_FILES = [{"config.json": _CONFIG0, "vocab.txt": _VOCAB},
                 {"config.json": _CONFIG1, "tokenizer.json": _TOKENIZER, "vocab.txt": _VOCAB},
                 {"config.json": _CONFIG1, "tokenizer.json": _TOKENIZER, "vocab.txt": _VOCAB}]
FILES_FEATURES = (FILES, SUM_DIGESTS)


def _file_object(data: bytes) -> str:
    return "files/" + hashlib.sha256(data).hexdigest()


def _edit_v1_files(fn: Callable[[list[dict]], list[dict] | None]):
    """Edit commit record 1's file objects (the record re-sealed); ``fn`` returns the new list
    or edits it in place. Names are kept in order unless ``fn`` returns a list."""
    def edit(b: LogBuilder) -> None:
        def change(obj):
            files = [dict(f) for f in obj["files"]]
            out = fn(files)
            obj["files"] = out if out is not None else sorted(files, key=lambda f: f["name"].encode())
        replace_commit(b, 1, reseal(change))
    return edit


def _rename_tokenizer(name: str):
    def fn(files):
        next(f for f in files if f["name"] == "tokenizer.json")["name"] = name
    return _edit_v1_files(fn)


def _tokenizer_key_of_vocab(files):
    next(f for f in files if f["name"] == "tokenizer.json")["key"] = _file_object(_VOCAB)


def _drop_files_member(b: LogBuilder) -> None:
    replace_commit(b, 1, reseal(lambda obj: obj.pop("files")))


def _files_without_feature(b: LogBuilder) -> None:
    (entry,) = file_entries({"config.json": _CONFIG1})
    b.files[entry.key] = _CONFIG1
    replace_commit(b, 1, reseal(lambda obj: obj.update(files=[entry.to_json()])))


def row_hook(tensor: str, fn: Callable[[dict], None]):
    def hook(rows):
        rows = [dict(r) for r in rows]
        fn(next(r for r in rows if r["tensor"] == tensor))
        return rows
    return hook


def v1_segment_key(b: LogBuilder) -> str:
    return next(k for k in b.files if k.startswith("segments/1/"))


def replace_file(b: LogBuilder, key: str, fn: Callable[[bytes], bytes]) -> None:
    b.files[key] = fn(b.files[key])


def replace_commit(b: LogBuilder, version: int, fn: Callable[[bytes], bytes]) -> None:
    replace_file(b, version_key(version), fn)


def reseal(fn: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    """Edit a sealed JSON object and seal it again (the checksum stays right)."""
    def edit(data: bytes) -> bytes:
        obj = json.loads(data)
        del obj["checksum"]
        fn(obj)
        return seal(obj)
    return edit


def flip_byte(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


def _flip_last_value_byte(row):
    row["payload"] = flip_byte(row["payload"], len(row["payload"]) - 1)  # last byte of a value


def _swap_positions(row):
    p = np.frombuffer(row["payload"][:16], "<u8")
    v = np.frombuffer(row["payload"][16:], "<u4")
    row["payload"] = p[::-1].tobytes() + v[::-1].tobytes()


def _gap_beyond_box(row):
    k = row["n_changed"]
    values = np.zeros(k, dtype="<u2") + 1
    row["payload"] = sparse_payload(np.array([32] + [0] * (k - 1)), values, 1, 3)


def _dense_overwrite(row):
    values = np.frombuffer(row["payload"][16:], "<u4")
    full = np.zeros(6, dtype="<u4")
    full[np.frombuffer(row["payload"][:16], "<u8").astype(np.int64)] = values
    row.update(encoding="dense", params='{"level":3}', payload=zstd_frame(planes(full), 3))


ULP_FEATURES = (SUM_DIGESTS, ULP_ENCODING)


def _w_as_ulp(s: Step, recs):
    """Version 1's xor record of the BF16 tensor w in the ulp encoding."""
    return [s.xor("w", "ulp") if r.tensor == "w" else r for r in recs]


def _x_overwrite_as_ulp(s: Step, recs):
    return [Record("x", "overwrite", r.box, "ulp", {"gap_bytes": 4, "level": 3}, r.n_changed,
                   r.base_digest, r.target_digest, ulp_payload(
                       np.flatnonzero(s.base["x"].words != s.new["x"].words),
                       s.base["x"].words[s.base["x"].words != s.new["x"].words],
                       s.new["x"].words[s.base["x"].words != s.new["x"].words], 4, 3))
            if r.tensor == "x" else r for r in recs]


def _ulp_files(row) -> tuple[np.ndarray, np.ndarray]:
    payload = row["payload"]
    size = int.from_bytes(payload[:8], "little")
    return (pcodec.standalone.simple_decompress(payload[8:8 + size]),
            pcodec.standalone.simple_decompress(payload[8 + size:]))


def _ulp_rewrite(row, gaps: np.ndarray, distances: np.ndarray, length=None) -> None:
    g, d = pco_file(gaps, 3), pco_file(distances, 3)
    size = len(g) if length is None else length(len(g), len(g) + len(d) + 8)
    row["payload"] = size.to_bytes(8, "little") + g + d


def _ulp_zero_distance(row):
    gaps, d = _ulp_files(row)
    d[0] = 0
    _ulp_rewrite(row, gaps, d)


def _ulp_short_distances(row):
    gaps, d = _ulp_files(row)
    _ulp_rewrite(row, gaps, d[:-1])


def _ulp_wrong_distance(row):
    gaps, d = _ulp_files(row)
    d[0] = d[0] + 1 if d[0] != -1 else 1
    _ulp_rewrite(row, gaps, d)


def _ulp_u64_gaps(row):
    gaps, d = _ulp_files(row)
    _ulp_rewrite(row, gaps.astype("<u8"), d)  # params still say gap_bytes 4


def _ulp_gap_beyond_box(row):
    gaps, d = _ulp_files(row)
    gaps[0] = 32  # the box holds 32 elements
    _ulp_rewrite(row, gaps, d)


def _ulp_length_beyond_payload(row):
    gaps, d = _ulp_files(row)
    _ulp_rewrite(row, gaps, d, length=lambda gap_len, total: total - 7)


RANS_FEATURES = (RANS_ENCODING, SUM_DIGESTS)


def _w_as_rans(s: Step, recs):
    """Version 1's xor record of the BF16 tensor w (3 changes in a box of 32) in ulp-rans."""
    return [s.xor("w", "ulp-rans") if r.tensor == "w" else r for r in recs]


def _x_overwrite_as_rans(s: Step, recs):
    x0, x1 = s.base["x"].words, s.new["x"].words
    changed = x0 != x1
    return [Record("x", "overwrite", r.box, "ulp-rans", {}, r.n_changed, r.base_digest, r.target_digest,
                   rans_payload(np.flatnonzero(changed), x0[changed], x1[changed]))
            if r.tensor == "x" else r for r in recs]


def _rans_parts(payload: bytes) -> dict:
    """Where the parts of a ulp-rans payload start (FORMAT.md section 11)."""
    blen = int.from_bytes(payload[:8], "little")
    at, tables = 8 + blen, []
    for _ in range(2):
        tables.append(at)
        at += 32 + 2 * sum(bin(x).count("1") for x in payload[at:at + 32])
    return {"bits": 8, "blen": blen, "tables": tables, "lengths": at, "streams": at + 12}


def _rans_edit(fn: Callable[[bytearray, dict], bytes | None]):
    """A row hook's edit of the w record's ulp-rans payload."""
    def edit(row):
        data = bytearray(row["payload"])
        out = fn(data, _rans_parts(bytes(data)))
        row["payload"] = bytes(data) if out is None else out
    return edit


def _w_rans_payload(payload_of):
    """A v1_records hook: _w_as_rans with the w record's payload ``payload_of(positions, base,
    new)``, from w's changed words in version 1 (box-local positions)."""
    def records(s: Step, recs):
        b, t = s.base["w"].words, s.new["w"].words
        positions = np.flatnonzero(b != t)
        payload = payload_of(positions, b[positions], t[positions])
        return [dataclasses.replace(r, payload=payload) if r.tensor == "w" else r for r in _w_as_rans(s, recs)]
    return records


def _rans_table_sum(data, parts):
    data[parts["tables"][0] + 32] ^= 1  # the gap table's first frequency: they sum to 4095 or 4097


def _rans_table_symbol(data, parts):
    data[parts["tables"][1] + 31] |= 0x80  # symbol 255 in the distance table


def _rans_low_state(data, parts):
    data[parts["streams"]:parts["streams"] + 4] = (0xFFFF).to_bytes(4, "little")


def _rans_moved_state(data, parts):
    data[parts["streams"]] ^= 1  # stream 0's state, still in range: it cannot end at 2^16


def _rans_word_left(data, parts):
    return bytes(data) + b"\0\0"  # one more word in stream 3


def _rans_stream_length(data, parts):
    at = parts["lengths"]
    data[at:at + 4] = (len(data)).to_bytes(4, "little")  # stream 0 runs past the payload


def _rans_padding(data, parts):
    last = parts["bits"] + parts["blen"] - 1
    assert data[last] < 0x80, "the w record's bit stream must end in padding bits"
    data[last] |= 0x80


def _rans_gap_beyond_box(positions, base, new):
    positions = positions.copy()
    positions[-1] = 32  # the box holds 32 elements
    return rans_payload(positions, base, new)


def _rans_distance_beyond_word(positions, base, _):
    # as 32-bit words: a step of 40000 units, whose zigzag image does not fit 16 bits
    wide = base.astype("<u4") << 16
    far = spec_unkey((spec_key(wide) + np.uint64(40000)) & np.uint64(0xFFFFFFFF), 32).astype("<u4")
    return rans_payload(positions, wide, far)


def _rans_wrong_distance(positions, base, new):
    new = new.copy()
    new[0] = spec_unkey(spec_key(new[:1]) + np.uint64(1) & np.uint64(0xFFFF), 16)[0]
    if new[0] == base[0]:
        new[0] = spec_unkey(spec_key(new[:1]) + np.uint64(1) & np.uint64(0xFFFF), 16)[0]
    return rans_payload(positions, base, new)


def _rans_two_changes(positions, base, new):
    return rans_payload(positions[:2], base[:2], new[:2])  # the record says 3


def _new_tensor_as_xor(s: Step, recs):
    zero = zeros_tensor("U8", (5,))
    return [s.delta("added", "xor", "raw", against=zero)] + recs[1:]


def _record_for_ghost(s: Step, recs):
    ghost = Record("ghost", "tensor", Box((0,), (2,)), "raw", {}, 2, 0, xxh3(np.zeros(2, "<u1")), b"\0\0")
    return recs + [ghost]


def _with_tensor(name: str, bits: TensorBits):
    def edit(st):
        return {**st, name: bits}
    return edit


def _lone_surrogate_table(obj):
    name = "\ud800"
    empty = f"{xxh3(np.zeros(0, 'u1')):016x}"
    obj["tensors"].append({"name": name, "dtype": "U8", "shape": [0], "digest": empty})
    obj["tensors"].sort(key=lambda t: t["name"].encode("utf-8", "surrogatepass"))
    lines = sorted(t["name"].encode("utf-8", "surrogatepass") + b"\0" + t["dtype"].encode() + b"\0"
                   + ",".join(map(str, t["shape"])).encode() + b"\0" + t["digest"].encode() + b"\n"
                   for t in obj["tensors"])
    obj["state_digest"] = f"{xxhash.xxh3_64_intdigest(b''.join(lines)):016x}"


def _wrong_digest_for_x(c: CommitRecord) -> CommitRecord:
    tensors = tuple(dataclasses.replace(t, digest=t.digest ^ 1) if t.name == "x" else t for t in c.tensors)
    return dataclasses.replace(c, tensors=tensors, state_digest=state_digest(tensors))


def _xxh3_record_digests(s: Step, recs):
    """The sparse xor record of w with the digests an xxh3 writer would give it."""
    w = next(r for r in recs if r.tensor == "w")
    flat = np.flatnonzero(s.base["w"].words != s.new["w"].words)
    fixed = dataclasses.replace(w, base_digest=xxh3(s.base["w"].words[flat]),
                                target_digest=xxh3(s.new["w"].words[flat]))
    return [fixed if r is w else r for r in recs]


def _box_local_digests(s: Step, recs):
    """n's changes as two row records; the one on row 1 hashes box-local positions 0..2 instead
    of the tensor flat indices 3..5 (the digests of a writer that forgot the box's offset)."""
    top, bottom = rows_box((2, 3), 0, 1), rows_box((2, 3), 1, 2)
    r1 = s.xor("n", "dense", bottom)
    local = np.arange(3)
    wrong = dataclasses.replace(r1, base_digest=sum_digest(local, s.base["n"].words[3:]),
                                target_digest=sum_digest(local, s.new["n"].words[3:]))
    assert r1.n_changed == 3 and wrong.base_digest != r1.base_digest
    return [recs[0], s.xor("n", "dense", top), wrong] + recs[2:]


def _xxh3_table(b: LogBuilder) -> None:
    """Commit 1's tensor table gets xxh3 tensor digests and the state digest computed from
    them; commit 2's parent_state_digest follows, so the parent chain holds."""
    state = b.states[1]
    new_digest = {}

    def table(obj):
        for t in obj["tensors"]:
            t["digest"] = f"{xxh3(state[t['name']].words):016x}"
        tensors = [TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), int(t["digest"], 16))
                   for t in obj["tensors"]]
        obj["state_digest"] = new_digest["v1"] = f"{state_digest(tensors):016x}"

    replace_commit(b, 1, reseal(table))
    replace_commit(b, 2, reseal(lambda obj: obj.update(parent_state_digest=new_digest["v1"])))


def _drop_v1(b: LogBuilder) -> None:
    for key in [k for k in b.files if k.startswith("segments/1/") or k == version_key(1)]:
        del b.files[key]


def _move_segment_to_v2(b: LogBuilder) -> None:
    key = v1_segment_key(b)
    b.files[key.replace("segments/1/", "segments/2/")] = b.files.pop(key)


def _other_log_id() -> str:
    return hashlib.sha256(b"another log").hexdigest()[:32]


def _schema_with_binary_payload() -> pa.Schema:
    return pa.schema([f if f.name != "payload" else pa.field("payload", pa.binary(), nullable=False)
                      for f in SEGMENT_SCHEMA])


# (name, error class, stage, version, reason, build, after-build edit of the files)
INVALID = [
    ("identity-missing", "NotFoundError", "identity", None,
     "the log has no dcr.json", {}, lambda b: b.files.pop(IDENTITY_KEY)),
    ("identity-unknown-feature", "IntegrityError", "identity", None,
     "dcr.json lists a feature this reader does not know",
     {"identity_kw": {"features": ("x-future",)}}, None),
    ("identity-format-version", "IntegrityError", "identity", None,
     "dcr.json has format_version 2", {"identity_kw": {"format_version": 2}}, None),
    ("identity-not-canonical", "IntegrityError", "identity", None,
     "dcr.json is valid JSON with a valid checksum but has a space after a colon",
     {}, lambda b: replace_file(b, IDENTITY_KEY, lambda d: d.replace(b'"features":', b'"features": '))),
    ("identity-bad-checksum", "IntegrityError", "identity", None,
     "dcr.json's created_at was edited after sealing", {},
     lambda b: replace_file(b, IDENTITY_KEY, lambda d: d.replace(b"2025-01-01", b"2025-01-02"))),
    ("listing-version-gap", "IntegrityError", "listing", None,
     "versions 0 and 2 exist, version 1 does not", {}, _drop_v1),
    ("commit-not-canonical-whitespace", "IntegrityError", "commit", 1,
     "commit record 1 is indented JSON (its checksum is right)", {},
     lambda b: replace_commit(b, 1, lambda d: json.dumps(json.loads(d), indent=1, sort_keys=True).encode())),
    ("commit-not-canonical-escape", "IntegrityError", "commit", 1,
     "commit record 1 escapes a '-' as \\u002d: same value, not the canonical bytes", {},
     lambda b: replace_commit(b, 1, lambda d: d.replace(b"vector-writer", b"vector\\u002dwriter", 1))),
    ("commit-not-canonical-key-order", "IntegrityError", "commit", 1,
     "commit record 1 has its members in reverse order", {},
     lambda b: replace_commit(b, 1, lambda d: json.dumps(
         dict(reversed(list(json.loads(d).items()))), separators=(",", ":")).encode())),
    ("commit-bad-checksum", "IntegrityError", "commit", 1,
     "commit record 1's created_at was edited after sealing", {},
     lambda b: replace_commit(b, 1, lambda d: d.replace(b"2025-01-01", b"2025-01-02"))),
    ("commit-unknown-feature", "IntegrityError", "commit", 1,
     "commit record 1 lists a feature this reader does not know",
     {"commit_hooks": {1: lambda c: dataclasses.replace(c, features=("x-future",))}}, None),
    ("commit-parent-digest", "IntegrityError", "commit", 1,
     "commit record 1's parent_state_digest is not version 0's state_digest",
     {"commit_hooks": {1: lambda c: dataclasses.replace(
         c, parent_state_digest=c.parent_state_digest ^ 1)}}, None),
    ("commit-state-digest", "IntegrityError", "commit", 1,
     "commit record 1's state_digest does not match its tensor table",
     {"commit_hooks": {1: lambda c: dataclasses.replace(c, state_digest=c.state_digest ^ 1)}}, None),
    ("commit-parent-not-previous", "IntegrityError", "commit", 2,
     "commit record 2 names version 0 as its parent",
     {"commit_hooks": {2: lambda c: dataclasses.replace(c, parent=0)}}, None),
    ("commit-other-log", "IntegrityError", "commit", 1,
     "commit record 1 carries another log's log_id",
     {"commit_hooks": {1: lambda c: dataclasses.replace(c, log_id=_other_log_id())}}, None),
    ("commit-float-integer", "IntegrityError", "commit", 1,
     "commit record 1 writes stats.records as 4.0, a number that is not an integer",
     {"commit_hooks": {1: lambda c: dataclasses.replace(
         c, stats=dataclasses.replace(c.stats, records=4.0))}}, None),
    ("commit-unsorted-tensors", "IntegrityError", "commit", 1,
     "commit record 1 lists its tensors in reverse order", {},
     lambda b: replace_commit(b, 1, reseal(lambda o: o["tensors"].reverse()))),
    ("commit-segment-key-other-version", "IntegrityError", "commit", 1,
     "commit record 1 lists a segment under segments/2/",
     {"ref_hook": lambda r: dataclasses.replace(r, key=r.key.replace("segments/1/", "segments/2/"))},
     _move_segment_to_v2),
    ("commit-tensor-name-newline", "IntegrityError", "commit", 1,
     "a tensor name contains a line feed",
     {"v1_state": _with_tensor("bad\nname", zeros_tensor("U8", (0,)))}, None),
    ("commit-tensor-name-lone-surrogate", "IntegrityError", "commit", 1,
     "a tensor name is the lone surrogate \\ud800, not a Unicode scalar value", {},
     lambda b: replace_commit(b, 1, reseal(_lone_surrogate_table))),
    ("commit-stats-total-elements", "IntegrityError", "commit", 1,
     "commit record 1's stats.total_elements is not the number of elements of its tensors",
     {"commit_hooks": {1: lambda c: dataclasses.replace(
         c, stats=dataclasses.replace(c.stats, total_elements=c.stats.total_elements + 1))}}, None),
    ("segment-sha256", "IntegrityError", "segment", 1,
     "a byte of version 1's segment is flipped; the commit record still has the old sha256", {},
     lambda b: replace_file(b, v1_segment_key(b), lambda d: flip_byte(d, 300))),
    ("segment-missing", "IntegrityError", "segment", 1,
     "version 1's segment file is missing", {}, lambda b: b.files.pop(v1_segment_key(b))),
    ("segment-other-version", "IntegrityError", "segment", 1,
     "version 1's segment says dcr.version 2 in its schema metadata",
     {"seg_kw": {"meta": segment_meta(vector_log_id("segment-other-version"), 2)}}, None),
    ("segment-other-log", "IntegrityError", "segment", 1,
     "version 1's segment carries another log's dcr.log_id",
     {"seg_kw": {"meta": segment_meta(_other_log_id(), 1)}}, None),
    ("segment-schema", "IntegrityError", "segment", 1,
     "the payload column is binary instead of large_binary",
     {"seg_kw": {"schema": _schema_with_binary_payload()}}, None),
    ("segment-stream-format", "IntegrityError", "segment", 1,
     "version 1's segment is an Arrow IPC stream, not an IPC file", {"seg_kw": {"stream": True}}, None),
    ("segment-record-count", "IntegrityError", "segment", 1,
     "the commit record says the segment has 5 records (and stats.records agrees); it has 4",
     {"ref_hook": lambda r: dataclasses.replace(r, records=r.records + 1),
      "commit_hooks": {1: lambda c: dataclasses.replace(
          c, stats=dataclasses.replace(c.stats, records=c.stats.records + 1))}}, None),
    ("commit-stats-records", "IntegrityError", "commit", 1,
     "commit record 1's stats.records is one more than the sum of its segments' records",
     {"commit_hooks": {1: lambda c: dataclasses.replace(
         c, stats=dataclasses.replace(c.stats, records=c.stats.records + 1))}}, None),
    ("segment-unknown-kind", "IntegrityError", "segment", 1,
     "a record has kind 'add'", {"rows_hook": row_hook("n", lambda r: r.update(kind="add"))}, None),
    ("segment-null-value", "IntegrityError", "segment", 1,
     "a record's target_digest is null (every field is declared non-nullable; Arrow writes the null "
     "anyway)", {"rows_hook": row_hook("n", lambda r: r.update(target_digest=None))}, None),
    ("segment-params-not-canonical", "IntegrityError", "segment", 1,
     "a record's params text has a space after the colon",
     {"rows_hook": row_hook("n", lambda r: r.update(params='{"level": 3}'))}, None),
    ("apply-flipped-payload-byte", "IntegrityError", "apply", 1,
     "a value byte of a raw overwrite payload is flipped and the segment sha256 recomputed: "
     "only the record's target digest catches it", {"rows_hook": row_hook("x", _flip_last_value_byte)}, None),
    ("apply-positions-not-increasing", "IntegrityError", "apply", 1,
     "a raw record lists its two positions in decreasing order",
     {"rows_hook": row_hook("x", _swap_positions)}, None),
    ("apply-sparse-gap-beyond-box", "IntegrityError", "apply", 1,
     "a sparse record's first gap is 32 in a box of 32 elements",
     {"rows_hook": row_hook("w", _gap_beyond_box)}, None),
    ("segment-ulp-without-feature", "IntegrityError", "segment", 1,
     "a record uses the encoding 'ulp' in a log whose features (sum-digests) do not list ulp-encoding",
     {"features": (SUM_DIGESTS,), "v1_records": _w_as_ulp}, None),
    ("apply-ulp-zero-distance", "IntegrityError", "apply", 1,
     "a ulp record's first distance is 0 (an unchanged position)",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp, "rows_hook": row_hook("w", _ulp_zero_distance)}, None),
    ("apply-ulp-distance-count", "IntegrityError", "apply", 1,
     "a ulp record's distance file holds 2 numbers for its 3 changes",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp, "rows_hook": row_hook("w", _ulp_short_distances)}, None),
    ("apply-ulp-gap-number-type", "IntegrityError", "apply", 1,
     "a ulp record with gap_bytes 4 holds a gap file of u64 numbers",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp, "rows_hook": row_hook("w", _ulp_u64_gaps)}, None),
    ("apply-ulp-gap-beyond-box", "IntegrityError", "apply", 1,
     "a ulp record's first gap is 32 in a box of 32 elements",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp, "rows_hook": row_hook("w", _ulp_gap_beyond_box)}, None),
    ("apply-ulp-length-beyond-payload", "IntegrityError", "apply", 1,
     "a ulp record's gap file length runs past the end of its payload",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp,
      "rows_hook": row_hook("w", _ulp_length_beyond_payload)}, None),
    ("apply-ulp-wrong-distance", "IntegrityError", "apply", 1,
     "a ulp record's first distance is off by one: a valid payload whose target digest fails",
     {"features": ULP_FEATURES, "v1_records": _w_as_ulp, "rows_hook": row_hook("w", _ulp_wrong_distance)}, None),
    ("apply-ulp-overwrite", "IntegrityError", "apply", 1,
     "an overwrite record uses the ulp encoding, which carries only xor records",
     {"features": ULP_FEATURES, "v1_records": _x_overwrite_as_ulp}, None),
    ("segment-ulp-rans-without-feature", "IntegrityError", "segment", 1,
     "a record uses the encoding 'ulp-rans' in a log whose features (sum-digests) do not list rans-encoding",
     {"features": (SUM_DIGESTS,), "v1_records": _w_as_rans}, None),
    ("apply-ulp-rans-table-sum", "IntegrityError", "apply", 1,
     "a ulp-rans record's gap table has frequencies that do not sum to 4096",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans, "rows_hook": row_hook("w", _rans_edit(_rans_table_sum))},
     None),
    ("apply-ulp-rans-table-symbol", "IntegrityError", "apply", 1,
     "a ulp-rans record's distance table lists symbol 255 (bins end at 251)",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans,
      "rows_hook": row_hook("w", _rans_edit(_rans_table_symbol))}, None),
    ("apply-ulp-rans-initial-state", "IntegrityError", "apply", 1,
     "a ulp-rans record's stream 0 starts at the state 65535, below 2^16",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans, "rows_hook": row_hook("w", _rans_edit(_rans_low_state))},
     None),
    ("apply-ulp-rans-final-state", "IntegrityError", "apply", 1,
     "a ulp-rans record's stream 0 starts at another state in range: it does not end at 2^16",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans,
      "rows_hook": row_hook("w", _rans_edit(_rans_moved_state))}, None),
    ("apply-ulp-rans-word-left-over", "IntegrityError", "apply", 1,
     "a ulp-rans record's last stream holds a word no symbol reads",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans, "rows_hook": row_hook("w", _rans_edit(_rans_word_left))},
     None),
    ("apply-ulp-rans-stream-length", "IntegrityError", "apply", 1,
     "a ulp-rans record's stream 0 length runs past the end of its payload",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans,
      "rows_hook": row_hook("w", _rans_edit(_rans_stream_length))}, None),
    ("apply-ulp-rans-padding", "IntegrityError", "apply", 1,
     "a ulp-rans record's bit stream has a padding bit set",
     {"features": RANS_FEATURES, "v1_records": _w_as_rans, "rows_hook": row_hook("w", _rans_edit(_rans_padding))},
     None),
    ("apply-ulp-rans-gap-beyond-box", "IntegrityError", "apply", 1,
     "a ulp-rans record's last position is 32 in a box of 32 elements",
     {"features": RANS_FEATURES, "v1_records": _w_rans_payload(_rans_gap_beyond_box)}, None),
    ("apply-ulp-rans-distance-beyond-word", "IntegrityError", "apply", 1,
     "a ulp-rans record of BF16 words holds distances of 40000 units as 32-bit words: zigzagged, they "
     "do not fit 16 bits",
     {"features": RANS_FEATURES, "v1_records": _w_rans_payload(_rans_distance_beyond_word)}, None),
    ("apply-ulp-rans-change-count", "IntegrityError", "apply", 1,
     "a ulp-rans record's payload holds 2 changes for its 3",
     {"features": RANS_FEATURES, "v1_records": _w_rans_payload(_rans_two_changes)}, None),
    ("apply-ulp-rans-wrong-distance", "IntegrityError", "apply", 1,
     "a ulp-rans record's first distance is one unit more: a valid payload whose target digest fails",
     {"features": RANS_FEATURES, "v1_records": _w_rans_payload(_rans_wrong_distance)},
     None),
    ("apply-ulp-rans-overwrite", "IntegrityError", "apply", 1,
     "an overwrite record uses the ulp-rans encoding, which carries only xor records",
     {"features": RANS_FEATURES, "v1_records": _x_overwrite_as_rans}, None),
    ("apply-unknown-encoding", "IntegrityError", "apply", 1,
     "a record names encoding 'lz4'", {"rows_hook": row_hook("x", lambda r: r.update(encoding="lz4"))}, None),
    ("apply-unknown-param", "IntegrityError", "apply", 1,
     "a sparse record has an extra parameter 'window'",
     {"rows_hook": row_hook("w", lambda r: r.update(params='{"gap_bytes":1,"level":3,"window":8}'))}, None),
    ("apply-missing-param", "IntegrityError", "apply", 1,
     "a sparse record lacks its gap_bytes parameter",
     {"rows_hook": row_hook("w", lambda r: r.update(params='{"level":3}'))}, None),
    ("apply-param-float", "IntegrityError", "apply", 1,
     "a sparse record's level is 3.0, not the integer 3",
     {"rows_hook": row_hook("w", lambda r: r.update(params='{"gap_bytes":1,"level":3.0}'))}, None),
    ("apply-encoding-not-for-kind", "IntegrityError", "apply", 1,
     "an overwrite record uses the dense encoding, which carries only xor and tensor records",
     {"rows_hook": row_hook("x", _dense_overwrite)}, None),
    ("apply-zstd-declared-size", "IntegrityError", "apply", 1,
     "a sparse record says 4 changes; its zstd frame declares the size of 3",
     {"rows_hook": row_hook("w", lambda r: r.update(n_changed=r["n_changed"] + 1))}, None),
    ("apply-zstd-trailing-bytes", "IntegrityError", "apply", 1,
     "a sparse payload has a byte after its zstd frame",
     {"rows_hook": row_hook("w", lambda r: r.update(payload=r["payload"] + b"\0"))}, None),
    ("apply-zstd-trailing-bytes-empty-frame", "IntegrityError", "apply", 1,
     "a dense tensor record of an empty tensor added in version 1 has a byte after its zstd frame of "
     "no content",
     {"v1_state": _with_tensor("empty", zeros_tensor("U8", (0,))),
      "v1_records": lambda s, recs: recs + [s.tensor("empty", "dense")],
      "rows_hook": row_hook("empty", lambda r: r.update(payload=r["payload"] + b"\0"))}, None),
    ("apply-dense-count", "IntegrityError", "apply", 1,
     "a dense xor record says 5 changes; its mask has 6 non-zero words",
     {"rows_hook": row_hook("n", lambda r: r.update(n_changed=r["n_changed"] - 1))}, None),
    ("apply-raw-length", "IntegrityError", "apply", 1,
     "a raw payload is one byte short",
     {"rows_hook": row_hook("x", lambda r: r.update(payload=r["payload"][:-1]))}, None),
    ("apply-tensor-count", "IntegrityError", "apply", 1,
     "a tensor record says 4 elements for a box of 5",
     {"rows_hook": row_hook("added", lambda r: r.update(n_changed=4, payload=r["payload"][:4]))}, None),
    ("apply-base-digest", "IntegrityError", "apply", 1,
     "an xor record's base digest is wrong (its precondition fails)",
     {"rows_hook": row_hook("w", lambda r: r.update(base_digest=r["base_digest"] ^ 1))}, None),
    ("apply-box-outside", "IntegrityError", "apply", 1,
     "a record's box [1..7) lies outside its tensor of shape [6]",
     {"rows_hook": row_hook("x", lambda r: r.update(box_offset=[1]))}, None),
    ("apply-box-rank", "IntegrityError", "apply", 1,
     "a record's box has rank 1 for a tensor of rank 2",
     {"rows_hook": row_hook("n", lambda r: r.update(box_offset=[0], box_shape=[6]))}, None),
    ("apply-xor-for-new-tensor", "IntegrityError", "apply", 1,
     "a tensor created in version 1 gets an xor record (against zeros) instead of a tensor record",
     {"v1_records": _new_tensor_as_xor, "check": False}, None),
    ("apply-unknown-tensor", "IntegrityError", "apply", 1,
     "a record names a tensor that is not in the commit's tensor table",
     {"v1_records": _record_for_ghost, "check": False}, None),
    ("apply-stats-changed", "IntegrityError", "apply", 1,
     "commit record 1's stats.changed_elements is one more than its records' n_changed",
     {"commit_hooks": {1: lambda c: dataclasses.replace(
         c, stats=dataclasses.replace(c.stats, changed_elements=c.stats.changed_elements + 1))}}, None),
    ("apply-tensor-digest", "IntegrityError", "apply", 0,
     "version 0's tensor table has a wrong digest for 'x' (state digest recomputed to match)",
     {"commit_hooks": {0: _wrong_digest_for_x}}, None),
    # feature sum-digests
    ("identity-duplicate-feature", "IntegrityError", "identity", None,
     "dcr.json lists sum-digests twice",
     {"features": (SUM_DIGESTS,), "identity_kw": {"features": (SUM_DIGESTS, SUM_DIGESTS)}}, None),
    ("identity-sum-digests-and-unknown-feature", "IntegrityError", "identity", None,
     "dcr.json lists sum-digests and a feature this reader does not know (so does every commit record)",
     {"features": (SUM_DIGESTS, "x-future")}, None),
    ("commit-features-missing", "IntegrityError", "commit", 1,
     "in a sum-digests log, commit record 1 lists no features: they differ from dcr.json's",
     {"features": (SUM_DIGESTS,),
      "commit_hooks": {1: lambda c: dataclasses.replace(c, features=())}}, None),
    ("commit-features-added", "IntegrityError", "commit", 1,
     "in a log without features, commit record 1 lists sum-digests: they differ from dcr.json's",
     {"commit_hooks": {1: lambda c: dataclasses.replace(c, features=(SUM_DIGESTS,))}}, None),
    ("apply-sum-record-xxh3-digests", "IntegrityError", "apply", 1,
     "in a sum-digests log, an xor record carries xxh3 base and target digests: its precondition fails",
     {"features": (SUM_DIGESTS,), "v1_records": _xxh3_record_digests}, None),
    ("apply-sum-box-local-index", "IntegrityError", "apply", 1,
     "in a sum-digests log, an xor record on row 1 hashes box-local positions instead of tensor "
     "flat indices: its precondition fails",
     {"features": (SUM_DIGESTS,), "v1_records": _box_local_digests}, None),
    ("apply-sum-table-xxh3", "IntegrityError", "apply", 1,
     "in a sum-digests log, commit record 1's tensor table has xxh3 tensor digests (state digest "
     "computed from them, so it matches): only the tensor digest check catches it",
     {"features": (SUM_DIGESTS,)}, _xxh3_table),
    # feature files
    ("files-sha256", "IntegrityError", "files", 1,
     "in a log with files, a byte of the object of version 1's config.json is flipped (same size): "
     "it fails its sha256",
     {"features": FILES_FEATURES},
     lambda b: replace_file(b, _file_object(_CONFIG1), lambda d: flip_byte(d, 3))),
    ("files-size", "IntegrityError", "files", 1,
     "in a log with files, the object of version 1's tokenizer.json has one byte more than its size",
     {"features": FILES_FEATURES}, lambda b: replace_file(b, _file_object(_TOKENIZER), lambda d: d + b"\n")),
    ("files-missing", "IntegrityError", "files", 1,
     "in a log with files, the object of version 1's tokenizer.json is missing",
     {"features": FILES_FEATURES}, lambda b: b.files.pop(_file_object(_TOKENIZER))),
    ("commit-file-name-parent", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 names a file '../x' (not a file of the directory)",
     {"features": FILES_FEATURES}, _rename_tokenizer("../x")),
    ("commit-file-name-weights", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 names a file 'model.safetensors' (a receiver's weights)",
     {"features": FILES_FEATURES}, _rename_tokenizer("model.safetensors")),
    ("commit-file-name-journal", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 names a file '.dcr' (a receiver's journal)",
     {"features": FILES_FEATURES}, _rename_tokenizer(".dcr")),
    ("commit-file-duplicate-name", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 lists two files named config.json",
     {"features": FILES_FEATURES}, _rename_tokenizer("config.json")),
    ("commit-files-unsorted", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 lists its files in reverse order",
     {"features": FILES_FEATURES}, _edit_v1_files(lambda files: files[::-1])),
    ("commit-file-key", "IntegrityError", "commit", 1,
     "in a log with files, tokenizer.json's key in commit record 1 names vocab.txt's object, not "
     "files/ + its sha256", {"features": FILES_FEATURES}, _edit_v1_files(_tokenizer_key_of_vocab)),
    ("commit-files-member-missing", "IntegrityError", "commit", 1,
     "in a log with files, commit record 1 has no files member",
     {"features": FILES_FEATURES}, _drop_files_member),
    ("commit-files-without-feature", "IntegrityError", "commit", 1,
     "in a log without the feature files, commit record 1 lists a file (its object present)",
     {"features": (SUM_DIGESTS,)}, _files_without_feature),
]


def _shape_nested(obj) -> None:
    """Tensor x's shape [6] as [[6]]: depth 5, one more than any member takes (section 20)."""
    (x,) = [t for t in obj["tensors"] if t["name"] == "x"]
    x["shape"] = [x["shape"]]


def _schema_with_dictionary_kind() -> pa.Schema:
    return pa.schema([f if f.name != "kind" else
                      pa.field("kind", pa.dictionary(pa.int32(), pa.utf8()), nullable=False)
                      for f in SEGMENT_SCHEMA])


INVALID += [
    ("commit-json-too-deep", "IntegrityError", "commit", 1,
     "commit record 1 gives tensor x the shape [[6]] (re-sealed): JSON nested to depth 5, one "
     "more than any member takes", {}, lambda b: replace_commit(b, 1, reseal(_shape_nested))),
    ("segment-dictionary-field", "IntegrityError", "segment", 1,
     "version 1's segment stores the kind column dictionary-encoded (an Arrow dictionary of "
     "utf8, not utf8)", {"seg_kw": {"schema": _schema_with_dictionary_kind()}}, None),
    ("identity-features-out-of-order", "IntegrityError", "identity", None,
     "dcr.json (and every commit record) lists ulp-encoding before sum-digests: the features of "
     "section 14, not in its order",
     {"features": (ULP_ENCODING, SUM_DIGESTS), "identity_kw": {"features": (ULP_ENCODING, SUM_DIGESTS)}},
     None),
]


# Invalid vectors of sections 23 to 25: the log of the vector retention with one defect.


def _zeros_like(t: TensorBits) -> TensorBits:
    return zeros_tensor(t.dtype, t.shape)


def _snapshot_5_xor(s: Step) -> list[list[Record]]:
    """b as an xor record against zeros: from nothing its digests and counts hold."""
    assert np.all(s.new["b"].words != 0)  # so that it changes every element (n_changed = 6)
    return [[s.tensor("w", "raw")],
            [s.tensor("added", "dense"), s.delta("b", "xor", "raw", against=_zeros_like(s.new["b"]))]]


def _snapshot_5_uncovered(s: Step) -> list[list[Record]]:
    """w's rows 0-1 and 1-2: row 3 uncovered, row 1 twice, so the counts still hold."""
    return [[s.tensor("w", "raw", rows_box(RETENTION_W, 0, 2)), s.tensor("w", "raw", rows_box(RETENTION_W, 1, 3))],
            [s.tensor("added", "dense"), s.tensor("b", "raw")]]


def _squash_3_6_tensor_for_kept(s: Step) -> list[list[Record]]:
    return [[s.xor("added", "raw"), s.tensor("b", "raw"), s.xor("w", "dense")]]


def _squash_3_6_without_b(s: Step) -> list[list[Record]]:
    return [[s.xor("added", "raw"), s.xor("w", "dense")]]


def _drop_version_3(b: LogBuilder) -> None:
    for key in [k for k in b.files if k.startswith("segments/3/") or k == version_key(3)]:
        del b.files[key]


def _sha_of(b: LogBuilder, key: str) -> str:
    return hashlib.sha256(b.files[key]).hexdigest()


def _marker_names_snapshot_5(b: LogBuilder) -> None:
    sha = _sha_of(b, "snapshots/5/manifest.json")
    replace_file(b, "log-start/00000000000000000003.json", reseal(lambda o: o.update(snapshot_sha256=sha)))


def _snapshot_5_names_commit_4(b: LogBuilder) -> None:
    sha = _sha_of(b, version_key(4))
    replace_file(b, "snapshots/5/manifest.json", reseal(lambda o: o.update(commit_sha256=sha)))


def _squash_segment_under_segments(b: LogBuilder) -> None:
    """Squash 3-6's segment moved to segments/6/ (an orphan there) and listed there."""
    manifest = json.loads(b.files["squashes/3-6/manifest.json"])
    (ref,) = manifest["segments"]
    moved = "segments/6/" + ref["key"].rsplit("/", 1)[1]
    b.files[moved] = b.files.pop(ref["key"])

    def edit(obj):
        obj["segments"][0]["key"] = moved
    replace_file(b, "squashes/3-6/manifest.json", reseal(edit))


def _flip_snapshot_3_segment(b: LogBuilder) -> None:
    """A byte of the log start's snapshot segment flipped; its manifest keeps the old sha256."""
    key = json.loads(b.files["snapshots/3/manifest.json"])["segments"][0]["key"]
    replace_file(b, key, lambda d: flip_byte(d, len(d) // 2))


def _drop_snapshot_5_segment(b: LogBuilder) -> None:
    key = json.loads(b.files["snapshots/5/manifest.json"])["segments"][1]["key"]
    del b.files[key]


# (name, error class, stage, version, manifest key (stage catchup), reason, catchups, edit)
RETENTION_INVALID = [
    ("listing-log-start-version-missing", "IntegrityError", "listing", None, None,
     "the log-start marker names version 3, whose commit record (and segments) are missing; "
     "versions 4 to 6 exist", None, _drop_version_3),
    ("listing-log-start-bad-checksum", "IntegrityError", "listing", None, None,
     "the log-start marker's created_at was edited after sealing", None,
     lambda b: replace_file(b, "log-start/00000000000000000003.json",
                            lambda d: d.replace(b"2025-01-01", b"2025-01-02"))),
    ("listing-log-start-other-manifest", "IntegrityError", "listing", None, None,
     "the log-start marker at 3 names snapshot 5's manifest (its snapshot_sha256, re-sealed), "
     "not the manifest of snapshot 3", None, _marker_names_snapshot_5),
    ("catchup-snapshot-commit-sha256", "IntegrityError", "catchup", 5, "snapshots/5/manifest.json",
     "snapshot 5's manifest has commit_sha256 of commit record 4 (re-sealed)", None,
     _snapshot_5_names_commit_4),
    ("catchup-snapshot-xor-record", "IntegrityError", "catchup", 5, "snapshots/5/manifest.json",
     "snapshot 5 holds b as an xor record (against zeros, so its digests and counts hold): a "
     "snapshot has tensor records only", {"snapshots/5/": _snapshot_5_xor}, None),
    ("catchup-snapshot-uncovered", "IntegrityError", "catchup", 5, "snapshots/5/manifest.json",
     "snapshot 5's tensor records of w cover rows 0-1 and 1-2: row 3 is left uncovered (zero) and "
     "row 1 is written twice, so the counts hold and only w's tensor digest fails",
     {"snapshots/5/": _snapshot_5_uncovered}, None),
    ("catchup-squash-tensor-record-kept", "IntegrityError", "catchup", 6, "squashes/3-6/manifest.json",
     "squash 3-6 carries b, which version 3 holds with the same dtype and shape, as a tensor "
     "record (with the right words)", {"squashes/3-6/": _squash_3_6_tensor_for_kept}, None),
    ("catchup-squash-target-digest", "IntegrityError", "catchup", 6, "squashes/3-6/manifest.json",
     "squash 3-6 has no record for b, which changes between 3 and 6 (its stats agree): its "
     "records hold but do not lead to version 6's tensor digests",
     {"squashes/3-6/": _squash_3_6_without_b}, None),
    ("catchup-segment-key-outside-prefix", "IntegrityError", "catchup", 6, "squashes/3-6/manifest.json",
     "squash 3-6's manifest lists its segment under segments/6/ (the file moved there, an orphan "
     "of version 6), not under squashes/3-6/", None, _squash_segment_under_segments),
    ("catchup-snapshot-segment-missing", "IntegrityError", "catchup", 5, "snapshots/5/manifest.json",
     "the second segment of snapshot 5 is missing (its manifest is there)", None, _drop_snapshot_5_segment),
    ("catchup-retire-marker-bad-checksum", "IntegrityError", "catchup", 4, "snapshots/4/manifest.json",
     "snapshot 4's retire marker has its created_at edited after sealing (the snapshot itself is "
     "intact)", None,
     lambda b: replace_file(b, "snapshots/4/retired.json", lambda d: d.replace(b"2025-01-01", b"2025-01-02"))),
    ("start-snapshot-segment-sha256", "IntegrityError", "start", 3, None,
     "a byte of the segment of snapshot 3, the log start's, is flipped; its manifest still has the "
     "old sha256 (the marker and the manifest are intact)", None, _flip_snapshot_3_segment),
]


def build_retention_invalid(name, catchups, edit) -> LogBuilder:
    b = retention_log(name, catchups, check=False)
    if edit:
        edit(b)
    return b


# -- signed vectors (FORMAT.md section 21) ----------------------------------------------------
# Fixed test keys: each private key is the SHAKE-256 of a label (32 bytes), so the signatures
# (ed25519 is deterministic) regenerate byte for byte. Never use them for anything else.

SIGNING_KEYS = {label: SigningKey.from_seed(shake(f"dcr-log test vector signing key {label}", 32))
                for label in ("A", "B", "C")}


def sign_version(b: LogBuilder, version: int, label: str) -> None:
    """Add the signature object of version ``version`` by key ``label``, computed here from
    section 21 (the message) and checked against dcr_log's."""
    key = SIGNING_KEYS[label]
    sha = hashlib.sha256(b.files[version_key(version)]).hexdigest()
    message = (b"dcr-log/1 signed commit record\x00" + b.log_id.encode() + b"\x00"
               + str(version).encode() + b"\x00" + bytes.fromhex(sha))
    assert message == signature_message(b.log_id, version, sha), "signed message differs from the spec"
    rec = key.sign(b.log_id, version, sha)
    assert rec.key == f"signatures/{version}/{key.key_id}-{sha}.sig"
    b.files[rec.key] = rec.to_bytes()


def signed_base(name: str, labels=("A", "A", "B")) -> LogBuilder:
    """The 3-version log of the invalid vectors, version v signed by key labels[v] (a key
    rotation from A to B at version 2)."""
    b = invalid_base(name)
    for v, label in enumerate(labels):
        if label:
            sign_version(b, v, label)
    return b


def _sig_keys(b: LogBuilder, version: int) -> list[str]:
    return sorted(k for k in b.files if k.startswith(f"signatures/{version}/"))


def _drop_signature(version: int):
    def edit(b: LogBuilder) -> None:
        for k in _sig_keys(b, version):
            del b.files[k]
    return edit


def _forge_signature(b: LogBuilder) -> None:
    (key,) = _sig_keys(b, 1)
    def flip(obj):
        sig = bytearray(bytes.fromhex(obj["signature"]))
        sig[0] ^= 0x01
        obj["signature"] = bytes(sig).hex()
    replace_file(b, key, reseal(flip))


def _unknown_key(b: LogBuilder) -> None:
    _drop_signature(1)(b)
    sign_version(b, 1, "C")


def _signature_of_another_record(b: LogBuilder) -> None:
    """Version 1's valid signature, edited to name version 2's record (the signature no longer
    verifies: it signs version 1's message)."""
    (src,) = _sig_keys(b, 1)
    _drop_signature(2)(b)
    sha2 = hashlib.sha256(b.files[version_key(2)]).hexdigest()
    obj = json.loads(b.files[src])
    del obj["checksum"]
    obj.update(version=2, commit_sha256=sha2)
    b.files[f"signatures/2/{obj['key_id']}-{sha2}.sig"] = seal(obj)


def _replaced_history(b: LogBuilder) -> None:
    """Another writer, without the key, replaces version 2 by a valid version of its own (a
    changed tensor, its segment, a record chained to version 1): it passes deep verification;
    the signature of the original version 2 signs other bytes."""
    for k in [k for k in b.files if k.startswith("segments/2/") or k == version_key(2)]:
        del b.files[k]
    b.commits.pop()
    b.states.pop()
    st = dict(b.states[-1])
    st["x"] = flipped(st["x"], "x-forged", 1)
    s = b.step(st)
    b.commit(s, [Seg([s.xor("x", "raw")], writer="intruder")])


def _malformed_signature(b: LogBuilder) -> None:
    """Version 1's only signature object (key A's) with its signature member edited and not
    re-sealed: it fails its checksum."""
    (key,) = _sig_keys(b, 1)
    obj = json.loads(b.files[key])
    sig = obj["signature"]
    b.files[key] = b.files[key].replace(sig.encode(), (sig[:-1] + ("0" if sig[-1] != "0" else "1")).encode())


SIGNED_OK = "signed"
SIGNED = [
    # name, trust (key labels), first version refused (None: accepted), reason, edit
    (SIGNED_OK, ("A", "B"), None,
     "versions 0 and 1 signed by key A, version 2 by key B (a rotation); accepted under a policy "
     "listing A and B", None),
    ("signed-rotation-old-policy", ("A",), 2,
     "the same log under a policy listing only A: version 2, signed by B alone, is refused", None),
    ("signed-unsigned-version", ("A", "B"), 1, "version 1 has no signature object",
     _drop_signature(1)),
    ("signed-forged", ("A", "B"), 1,
     "version 1's signature has a flipped bit (the object re-sealed): it does not verify",
     _forge_signature),
    ("signed-unknown-key", ("A", "B"), 1, "version 1 is signed only by key C, which the policy does "
     "not list", _unknown_key),
    ("signed-other-record", ("A", "B"), 2,
     "version 2's signature object is version 1's signature edited to name version 2's record",
     _signature_of_another_record),
    ("signed-replaced-history", ("A", "B"), 2,
     "another writer replaced version 2 by a valid version of its own (it passes deep "
     "verification); the only signature of version 2 signs the original record", _replaced_history),
    ("signed-malformed", ("A", "B"), 1,
     "version 1's only signature object, by the trusted key A, fails its checksum (its signature "
     "edited, not re-sealed): not a valid signature, so TrustError (not IntegrityError)",
     _malformed_signature),
]


def build_signed(name, edit) -> LogBuilder:
    b = signed_base(name)
    if edit:
        edit(b)
    return b


def signed_expected(b: LogBuilder, name: str, trust, refused, reason) -> dict:
    keys = {label: {"seed": shake(f"dcr-log test vector signing key {label}", 32).hex(),
                    "public": public_text(k.public), "key_id": k.key_id}
            for label, k in SIGNING_KEYS.items()}
    return {"vector": name, "reason": reason, "trust": [public_text(SIGNING_KEYS[t].public) for t in trust],
            "error": None if refused is None else "TrustError", "version": refused,
            "versions": len(b.commits), "keys": keys}


def build_invalid(name, kw, edit) -> LogBuilder:
    b = invalid_base(name, **kw)
    if edit:
        edit(b)
    return b


# -- output -----------------------------------------------------------------------------------


def write_log(files: dict[str, bytes], dest: Path) -> None:
    for key, data in sorted(files.items()):
        path = dest / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def dump(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True) + "\n").encode()


README = """\
# dcr-log test vectors

Generated by `python tools/make_vectors.py` (deterministic; do not edit by hand) and checked
by `tests/test_vectors.py`. Every log here was built record by record from the rules of
`spec/FORMAT.md`; the expected states are the dense states the generator started from, not a
replay of the log.

## Layout

```
<name>/log/                     a complete log (dcr.json, versions/, segments/; after
                                retention also snapshots/, squashes/, log-start/)
<name>/expected.json            what a reader must produce from it
invalid/<name>/log/             a log with one defect
invalid/<name>/expected.json    the defect and the error a reader must report
```

`expected.json` of a valid vector:

- `log_id`: the log's id;
- `versions`: one entry per version, in order, with `version`, `state_digest` (16 hex digits)
  and `tensors`, sorted by the UTF-8 bytes of their names, each with `name`, `dtype`, `shape`,
  `sha256` (of the tensor's little-endian bytes, row-major) and `xxh3` (`xxh3_64` of those
  bytes: the tensor digest of a log without features); in a log with the feature
  `sum-digests`, also `digest` (its tensor digest under the log's scheme, FORMAT.md
  section 7.1); in a log with the feature `files`, also `files`: the version's files, sorted by
  the UTF-8 bytes of their names, each with `name`, `size` and `sha256` (FORMAT.md section 22);
- `start` and `catchups`, in a log with snapshots, squashes or retention (FORMAT.md sections 23
  to 25): `start` is the log start (the largest version of a log-start marker; `versions`
  begins there, the versions below it are expired and their commit records and segments
  deleted); `catchups` has one entry per manifest (`snapshots/<V>/manifest.json`,
  `squashes/<A>-<B>/manifest.json`), with `key` (the manifest's key), `kind` (`snapshot` or
  `squash`), `version`, `from` (a squash's start, `null` for a snapshot), `retired` (a snapshot
  with a retire marker `snapshots/<V>/retired.json`), and `state_digest` and `tensors` (as in
  `versions`) of the state it leads to: a snapshot applied to nothing, a squash applied to the
  state of its `from`. A squash also gives that state in full, as `from_state_digest` and
  `from_tensors`: the tensors as in `versions`, each with `hex` as well, its bytes
  (little-endian words in row-major order) as lowercase hex, so that a reader can apply a
  squash whose `from` has expired.

A reader passes a valid vector when, for every version, it lists exactly these tensors with
these dtypes, shapes and bytes (and these files, with these bytes), and verifies every digest
on the way; and, in a log with `catchups`, when it starts at `start` and reads every snapshot
and squash (its manifest checked against its version's commit record) to exactly the tensors
given, a squash applied to `from_tensors` (which, for a `from` at or above `start`, are the
tensors of that version).

`expected.json` of an invalid vector: `reason` (one line), `error` (the error class of
FORMAT.md, section "Errors"), `stage` and `version`, and at the stage `catchup` also `catchup`:
the key of the manifest whose snapshot or squash fails. `stage` names the first step of reading at
which the defect must be reported; every earlier step must succeed:

| stage | step |
|---|---|
| `identity` | reading `dcr.json` |
| `listing` | listing the versions and the log start (FORMAT.md section 25; below) |
| `commit` | reading and checking commit record `version` (parent chain and state digest included) |
| `start` | reading snapshot `version`, the log start's (FORMAT.md section 25): manifest, segments, records, digests |
| `segment` | reading the segments of `version`: size, sha256, Arrow schema and metadata, record fields |
| `files` | reading the file objects of `version` (feature `files`): each one's size and sha256 |
| `apply` | decoding and applying the records of `version`: payloads, digests, stats |
| `catchup` | reading a snapshot or squash and applying it: manifest, segments, records, digests |

At `listing` the log-start marker of the largest version is checked, the versions are exactly
start to latest, and the SHA-256 of the start's snapshot manifest equals the marker's
`snapshot_sha256`.

The stages are listed in the order a reader goes through them (for each version `u`, its
`commit`, then, for the log start `u` after retention, `start`, then its `segment`s, then its
`files`, then `apply`, before version `u + 1`; then `catchup`, every snapshot and squash, once
every version has been read; the snapshot of the log start alone is read with version `start`,
since replay begins there). Plain verification (FORMAT.md section 13) goes through the versions
in the same order, but reads the segments of every snapshot, the log start's included, after
the versions; each vector has one defect, so its stage does not depend on the order in which a
verifier checks the log's objects. A defect at
`files` is found by reading the version's files and by verification; a replay of the tensors
alone does not read files and reads such a log back. `version` is the version
whose reading fails (at `catchup`, the manifest's `version`; at `start`, the log start), and
`null` for the stages `identity` and `listing`, which concern no version. At `commit`,
`segment`, `files` and `apply`, every version before `version` reads back; at `start`, no
version reads back by replay from the log start (its commit record and the marker are
intact); at `catchup`, every version reads back (replayed from the log start), and so does
every other snapshot and squash.

A reader may report a defect earlier than its stage (for example a reader that checks payloads
while listing records); it must never accept the log.

## Vectors

{count}

{valid}

Invalid:

{invalid}

## Signed versions

`signed/<name>/log/` is a log with signature objects (FORMAT.md section 21);
`signed/<name>/expected.json` gives `trust` (the public keys of the policy to read it under),
`error` (`TrustError`, or null when every version is accepted), `version` (the first version a
reader under that policy must refuse: every earlier one reads; null when none is refused),
`versions` (the log's count) and `keys`: the three fixed test keys, each with its private
`seed` (32 bytes, hex: ed25519 is deterministic, so these regenerate the signatures), `public`
and `key_id`. Without a policy every one of these logs verifies (deeply): only the signatures
tell them apart. The logs are the 3-version log of the invalid vectors.

{signed}

## Generated with

{versions}
Segment bytes (and so the `sha256` and `size` in commit records) depend on the Arrow IPC
writer and the zstd compressor; another version of either may produce other, equally valid
bytes.
"""


def generate(out: Path) -> list[str]:
    """Write every vector under ``out``; returns their names."""
    out.mkdir(parents=True, exist_ok=True)
    for child in out.iterdir():  # remove earlier output only: vector directories
        if child.is_dir() and (child.name in ("invalid", "signed") or (child / "expected.json").exists()):
            shutil.rmtree(child)
    names, valid_lines, invalid_lines = [], [], []
    for build, description in VALID:
        b = build()
        write_log(b.files, out / b.name / "log")
        (out / b.name / "expected.json").write_bytes(dump(expected_json(b, description)))
        names.append(b.name)
        valid_lines.append(f"- `{b.name}`: {description}.")
    for name, error, stage, version, reason, kw, edit in INVALID:
        b = build_invalid(name, kw, edit)
        dest = out / "invalid" / name
        write_log(b.files, dest / "log")
        (dest / "expected.json").write_bytes(dump(
            {"vector": name, "reason": reason, "error": error, "stage": stage, "version": version}))
        names.append(f"invalid/{name}")
        invalid_lines.append(f"- `{name}` ({error}, {stage}): {reason}.")
    for name, error, stage, version, catchup, reason, catchups, edit in RETENTION_INVALID:
        b = build_retention_invalid(name, catchups, edit)
        dest = out / "invalid" / name
        write_log(b.files, dest / "log")
        expected = {"vector": name, "reason": reason, "error": error, "stage": stage, "version": version}
        if stage == "catchup":
            expected["catchup"] = catchup
        (dest / "expected.json").write_bytes(dump(expected))
        names.append(f"invalid/{name}")
        invalid_lines.append(f"- `{name}` ({error}, {stage}): {reason}.")
    signed_lines = []
    for name, trust, refused, reason, edit in SIGNED:
        b = build_signed(name, edit)
        dest = out / "signed" / name
        write_log(b.files, dest / "log")
        (dest / "expected.json").write_bytes(dump(signed_expected(b, name, trust, refused, reason)))
        names.append(f"signed/{name}")
        outcome = "accepted" if refused is None else f"TrustError at version {refused}"
        signed_lines.append(f"- `{name}` (trust {', '.join(trust)}; {outcome}): {reason}.")
    versions = (f"pyarrow {pa.__version__}, zstandard {zstandard.__version__} "
                f"(libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}), "
                f"xxhash {xxhash.VERSION}, numpy {np.__version__}.\n")
    count = (f"{len(names)} vectors: {len(valid_lines)} valid, {len(invalid_lines)} invalid and "
             f"{len(signed_lines)} signed.")
    (out / "README.md").write_text(README.format(
        count=count, valid="\n".join(valid_lines), invalid="\n".join(invalid_lines),
        signed="\n".join(signed_lines), versions=versions))
    (out / ".gitattributes").write_text("# vectors are compared byte for byte\n* -text\n*.arrow binary\n")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    names = generate(args.out)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{len(names)} vectors, {total} bytes in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
