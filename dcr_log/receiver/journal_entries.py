"""The receiver journal's entries: their keys, their JSON encoding and decoding, and the
checksum over them (spec/RECEIVER.md, "Journal").

LMDB pages carry no checksums, so the journal keeps its own: the ``checksum`` entry holds the
sum (mod 2**64) of one keyed xxh3 per entry and the id of the transaction that wrote it, and
every write transaction (``SumTxn``) updates it with the entries it changes. ``verify_entries``
checks it, with the structure of every entry, when the journal is first read. Pure decoding
over an LMDB transaction: no environment is opened here.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import xxhash

from dcr_log import native
from dcr_log.errors import IntegrityError
from dcr_log.format import file_name_problem
from dcr_log.format.tensors import digest_hex

JOURNAL_FORMAT = b"dcr-receiver-journal/3"
# Format 2 lacks the deferred-sync images with gaps (kinds 1 and 2), and format 1 the
# checksum too: both still read, and upgraded at their next write.
FORMAT_2 = b"dcr-receiver-journal/2"
LEGACY_FORMAT = b"dcr-receiver-journal/1"
CHECKSUM_FORMATS = (JOURNAL_FORMAT, FORMAT_2)

K_FORMAT = b"format"
K_LOG_ID = b"log_id"
K_CURRENT = b"current"
K_INFLIGHT = b"inflight"
K_MATERIALIZING = b"materializing"
K_PLACEMENT = b"placement"
K_FILES = b"files"
K_CHECKSUM = b"checksum"
K_WAL_BOOT = b"wal_boot"
SEG_PREFIX = b"seg/"
REDO_PREFIX = b"redo/"
WAL_PREFIX = b"wal/"
_KEYS = frozenset((K_FORMAT, K_LOG_ID, K_CURRENT, K_INFLIGHT, K_MATERIALIZING, K_PLACEMENT, K_FILES,
                   K_WAL_BOOT))
_KEY_PATTERN = re.compile(rb"seg/[0-9]{8}|redo/[0-9]{8}/[0-9]{8}|wal/[0-9]{8}/[0-9]{8}/[0-9]{8}")
# A deferred-sync image (RECEIVER.md, "Deferred sync"): u16 name length, the tensor name
# (UTF-8), u8 word width, u8 position kind, u64 count, the positions, then the words;
# little-endian. Kind 0: a span, one u64 start; 1 or 2: the first position as a u64, then
# count - 1 gaps of that many bytes (position i = position i-1 + 1 + gap i); 4 or 8: count
# positions of that many bytes.
_WAL_HEAD = struct.Struct("<H")
_WAL_FIELDS = struct.Struct("<BBQ")
_WIDTHS = (1, 2, 4, 8)
_KINDS = (0, 1, 2, 4, 8)
_MASK = (1 << 64) - 1


def seg_key(segment: int) -> bytes:
    return SEG_PREFIX + b"%08d" % segment


def redo_key(segment: int, record: int) -> bytes:
    return REDO_PREFIX + b"%08d/%08d" % (segment, record)


def wal_key(version: int, segment: int, record: int) -> bytes:
    return WAL_PREFIX + b"%08d/%08d/%08d" % (version, segment, record)


@dataclass(frozen=True)
class WalImage:
    """One written record's positions and target words, kept until the files are synced."""

    version: int
    segment: int
    record: int
    tensor: str
    where: slice | np.ndarray  # flat positions
    words: np.ndarray          # unsigned words of the image's width


def wal_image_bound(tensor: str, count: int, width: int) -> int:
    """The most bytes the image of ``count`` words of ``width`` bytes of ``tensor`` takes
    (what encode_wal_image's ``out`` must hold)."""
    return _WAL_HEAD.size + len(tensor.encode()) + _WAL_FIELDS.size + 8 + 8 * count + width * count


def _position_kind(where: np.ndarray) -> tuple[int, np.ndarray | None]:
    """The kind of an image's flat positions (>= 0), and their gaps for kinds 1 and 2. Gaps
    (a bf16 record at 1% changed: 2 bytes a position where 4 were, its images a third
    smaller) need positions strictly increasing, as a record's are."""
    count = where.size
    if count >= 2:
        gaps = np.diff(where)
        gaps -= 1
        if int(gaps.min()) >= 0:
            most = int(gaps.max())
            if most < (1 << 16):
                return (1 if most < (1 << 8) else 2), gaps
    return (4 if count == 0 or int(where.max()) < (1 << 32) else 8), None


def _image_head(name: bytes, width: int, kind: int, count: int) -> bytes:
    """An image's head (RECEIVER.md 5.6): the tensor's name, the word width, the positions'
    kind, the count."""
    return _WAL_HEAD.pack(len(name)) + name + _WAL_FIELDS.pack(width, kind, count)


def _lay_native(name: bytes, where: slice | np.ndarray, words: np.ndarray, out: np.ndarray | None
                ) -> memoryview | None:
    """encode_wal_image's image of gap kind 1 or 2 in one C call (the GIL released: the
    receiver lays a batch's images on the pool's threads), or None where the C module, the
    positions or their gaps do not allow it."""
    changes = native.changes
    count = words.size
    if (changes is None or not isinstance(where, np.ndarray) or where.dtype != np.int64 or where.ndim != 1
            or not where.flags.c_contiguous or count < 2 or where.size != count):
        return None
    at = _WAL_HEAD.size + len(name) + _WAL_FIELDS.size
    bound = at + 8 + 2 * (count - 1) + words.itemsize * count
    buf = np.empty(bound, np.uint8) if out is None else out[:bound]
    kind = changes.image_lay(where, words, words.itemsize, buf[at:])
    if not kind:
        return None
    buf[:at] = np.frombuffer(_image_head(name, words.itemsize, kind, count), np.uint8)
    return buf[:at + 8 + kind * (count - 1) + words.itemsize * count].data


def encode_wal_image(tensor: str, where: slice | np.ndarray, words: np.ndarray,
                     out: np.ndarray | None = None) -> memoryview:
    """One written record's image, laid into ``out`` (uint8, at least wal_image_bound bytes:
    a receiver reuses one buffer for its batches' images) or into new memory, as a view of
    exactly its bytes. The positions take the smallest kind that holds them."""
    name = tensor.encode()
    count, width = int(words.size), words.itemsize
    bits = np.ascontiguousarray(words).reshape(-1).view(f"<u{width}")  # whatever their dtype says
    laid = _lay_native(name, where, bits, out)
    if laid is not None:
        return laid
    gaps = None
    if isinstance(where, slice):
        kind, located = 0, 8
    else:
        kind, gaps = _position_kind(where)
        located = 8 + kind * (count - 1) if gaps is not None else kind * count
    head = _image_head(name, width, kind, count)
    size = len(head) + located + width * count
    buf = np.empty(size, np.uint8) if out is None else out[:size]
    at = len(head)
    buf[:at] = np.frombuffer(head, np.uint8)
    if isinstance(where, slice):
        buf[at:at + 8] = np.frombuffer(struct.pack("<Q", where.start or 0), np.uint8)
    elif gaps is not None:
        buf[at:at + 8] = np.frombuffer(struct.pack("<Q", int(where[0])), np.uint8)
        np.copyto(buf[at + 8:at + located].view(f"<u{kind}"), gaps, casting="unsafe")
    else:
        np.copyto(buf[at:at + located].view("<u4" if kind == 4 else "<u8"), where, casting="unsafe")
    at += located
    np.copyto(buf[at:].view(bits.dtype), bits)
    return buf.data


def decode_wal_image(key_suffix: bytes, value) -> WalImage:
    """An image of ``wal/<suffix>``; IntegrityError when it does not parse."""
    try:
        version, segment, record = (int(p) for p in bytes(key_suffix).split(b"/"))
        buf = memoryview(value)
        (n,) = _WAL_HEAD.unpack_from(buf, 0)
        tensor = bytes(buf[2:2 + n]).decode()
        at = 2 + n
        width, kind, count = _WAL_FIELDS.unpack_from(buf, at)
        at += _WAL_FIELDS.size
        if width not in _WIDTHS or kind not in _KINDS or (kind in (1, 2) and count < 1) or count > len(buf):
            raise ValueError
        where: slice | np.ndarray
        if kind == 0:
            (start,) = struct.unpack_from("<Q", buf, at)
            at += 8
            where = slice(start, start + count)
        elif kind in (1, 2):
            (first,) = struct.unpack_from("<Q", buf, at)
            at += 8
            steps = np.empty(count, np.uint64)
            steps[0] = first
            np.add(np.frombuffer(buf, dtype=f"<u{kind}", count=count - 1, offset=at), 1, out=steps[1:],
                   dtype=np.uint64, casting="unsafe")
            where = np.cumsum(steps, out=steps)  # mod 2^64: a wrapped position is past any tensor
            at += kind * (count - 1)
        else:
            where = np.frombuffer(buf, dtype="<u4" if kind == 4 else "<u8", count=count, offset=at)
            at += kind * count
        if len(buf) - at != width * count:
            raise ValueError
        words = np.frombuffer(buf, dtype=f"<u{width}", count=count, offset=at)
        return WalImage(version, segment, record, tensor, where, words)
    except (ValueError, struct.error, UnicodeDecodeError):
        raise IntegrityError(f"deferred-sync image {bytes(key_suffix)[:40]!r} is not readable") from None


def json_bytes(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def entry_hash(key: bytes, value) -> int:
    """One entry's share of the checksum: xxh3_64 (seed 0) of the key's length (8 bytes,
    little-endian), the key and the value, hashed as one stream (no copy of a large value)."""
    h = xxhash.xxh3_64(len(key).to_bytes(8, "little"))
    h.update(key)
    h.update(value)
    return h.intdigest()


def _checksum_value(total: int, txn_id: int) -> bytes:
    return json_bytes({"entries": f"{total:016x}", "txn": txn_id})


def _parse_checksum(value) -> tuple[int, int] | None:
    """(entries sum, transaction id) of a ``checksum`` entry; None if it does not parse."""
    try:
        obj = json.loads(bytes(value))
        entries, txn_id = obj["entries"], obj["txn"]
        if (set(obj) != {"entries", "txn"} or type(entries) is not str or len(entries) != 16
                or entries.strip("0123456789abcdef") or type(txn_id) is not int or txn_id < 0):
            return None
        return int(entries, 16), txn_id
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _entries_sum(txn) -> int:
    total = 0
    for key, value in txn.cursor():
        key = bytes(key)
        if key != K_CHECKSUM:
            total += entry_hash(key, value)
    return total & _MASK


class SumTxn:
    """A write transaction that keeps the ``checksum`` entry: every put and delete adds the
    new entry's hash and subtracts the old one's, so a transaction hashes only what it
    changes. (The transaction is opened with buffers: values are hashed where LMDB keeps
    them, not copied.)"""

    def __init__(self, txn):
        self.txn = txn
        stored = txn.get(K_CHECKSUM)
        if stored is None:
            # A new or a format-1 journal (verified structurally on open): sum what is there.
            self.total = _entries_sum(txn)
        else:
            parsed = _parse_checksum(stored)
            if parsed is None:
                raise IntegrityError("journal checksum entry is not readable")
            self.total = parsed[0]

    def get(self, key: bytes):
        return self.txn.get(key)

    def put(self, key: bytes, value) -> None:
        old = self.txn.get(key)
        if old is not None:
            self.total -= entry_hash(key, old)  # before the put: LMDB may reuse its buffer
        self.txn.put(key, value)
        self.total = (self.total + entry_hash(key, value)) & _MASK

    def delete(self, key: bytes) -> None:
        old = self.txn.get(key)
        if old is not None:
            self.total = (self.total - entry_hash(key, old)) & _MASK
            self.txn.delete(key)

    def delete_prefix(self, prefix: bytes) -> None:
        cur = self.txn.cursor()
        if not cur.set_range(prefix):
            return
        while True:
            key = bytes(cur.key())
            if not key.startswith(prefix):
                break
            self.total = (self.total - entry_hash(key, cur.value())) & _MASK
            if not cur.delete():
                break

    def seal(self) -> None:
        """Store the checksum, with this transaction's id (it ties the entry to the LMDB
        snapshot that holds it: an older snapshot read in its place is found)."""
        self.txn.put(K_CHECKSUM, _checksum_value(self.total, self.txn.id()))


@dataclass(frozen=True)
class JournalState:
    log_id: str | None
    version: int | None
    state_digest: int | None
    inflight: int | None
    materializing: int | None
    # The step in flight (RECEIVER.md section 8): "version", or a catch-up route's "squash"
    # (from ``inflight_from``) or "snapshot".
    inflight_kind: str = "version"
    inflight_from: int | None = None
    # Deferred sync: the boot in which the journal's images were written (None: no image).
    wal_boot: bytes | None = None

    @property
    def bound(self) -> bool:
        return self.version is not None

    def restore_needed(self, boot: bytes) -> bool:
        """Whether the images must be put back before the storage is read, in boot ``boot``:
        written in another boot (or an unnamed one, or before a failed sync), the page cache
        may have lost their words (RECEIVER.md 5.6)."""
        return self.wal_boot is not None and (not self.wal_boot or self.wal_boot != boot)

    def to_json(self) -> dict:
        return {
            "log_id": self.log_id,
            "version": self.version,
            "state_digest": None if self.state_digest is None else digest_hex(self.state_digest),
            "inflight": self.inflight,
            "inflight_kind": None if self.inflight is None else self.inflight_kind,
            "inflight_from": self.inflight_from,
            "materializing": self.materializing,
        }


@dataclass(frozen=True)
class SegmentProgress:
    """Records ``[0, done)`` of a segment are applied and flushed; records ``[done,
    started_end)`` form the batch being written, whose xor records have redo images."""

    done: int = 0
    started_end: int = 0


def read_state(txn) -> JournalState:
    fmt = txn.get(K_FORMAT)
    if fmt is not None and bytes(fmt) not in (*CHECKSUM_FORMATS, LEGACY_FORMAT):
        raise IntegrityError(f"journal format {bytes(fmt)!r} is not {JOURNAL_FORMAT!r} (or an older one)")
    log_id = txn.get(K_LOG_ID)
    current = txn.get(K_CURRENT)
    inflight = txn.get(K_INFLIGHT)
    materializing = txn.get(K_MATERIALIZING)
    wal_boot = txn.get(K_WAL_BOOT)
    try:
        cur = json.loads(bytes(current)) if current is not None else None
        step = json.loads(bytes(inflight)) if inflight is not None else {}
        kind = step.get("kind", "version")
        if kind not in ("version", "squash", "snapshot"):
            raise ValueError(kind)
        start = step.get("from")
        if (start is None) != (kind != "squash"):
            raise ValueError(start)
        return JournalState(
            log_id=None if log_id is None else bytes(log_id).decode(),
            version=None if cur is None else int(cur["version"]),
            state_digest=None if cur is None else int(cur["state_digest"], 16),
            inflight=None if inflight is None else int(step["version"]),
            materializing=None if materializing is None
            else int(json.loads(bytes(materializing))["version"]),
            inflight_kind=kind,
            inflight_from=None if start is None else int(start),
            wal_boot=None if wal_boot is None else bytes(wal_boot),
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise IntegrityError("journal entries are not readable") from None


def read_progress(txn) -> dict[int, SegmentProgress]:
    out: dict[int, SegmentProgress] = {}
    for suffix, value in scan(txn, SEG_PREFIX):
        try:
            obj = json.loads(value)
            prog = SegmentProgress(obj["done"], obj["started_end"])
            if not (type(prog.done) is int and type(prog.started_end) is int
                    and 0 <= prog.done <= prog.started_end):
                raise ValueError
            out[int(suffix)] = prog
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise IntegrityError("segment progress is not readable") from None
    return out


def read_files(txn) -> list[str]:
    value = txn.get(K_FILES)
    if value is None:
        return []
    try:
        names = json.loads(bytes(value))
        if not isinstance(names, list) or any(file_name_problem(n) is not None for n in names):
            raise ValueError
    except (ValueError, RecursionError):
        raise IntegrityError("the file list is not readable") from None
    return names


def verify_entries(txn) -> bool:
    """Check a journal snapshot (a read transaction) before anything is decided on it: its
    checksum against its entries and the transaction that wrote it, then the structure of
    every entry. Returns False for a journal without a checksum (format 1, or empty), which
    gets one at its next write. Raises IntegrityError naming what is wrong."""
    total = _entries_sum(txn)
    stored, fmt = txn.get(K_CHECKSUM), txn.get(K_FORMAT)
    stored = None if stored is None else bytes(stored)
    fmt = None if fmt is None else bytes(fmt)
    strange = next((key for key in map(bytes, txn.cursor().iternext(keys=True, values=False))
                    if key not in _KEYS and key != K_CHECKSUM and _KEY_PATTERN.fullmatch(key) is None), None)
    if stored is not None:
        parsed = _parse_checksum(stored)
        if parsed is None:
            raise IntegrityError("its checksum entry is not readable")
        if parsed[0] != total:
            raise IntegrityError("its entries do not match their checksum")
        if parsed[1] != txn.id():
            raise IntegrityError(f"its checksum was written by transaction {parsed[1]}, "
                                 f"not by the one LMDB reads ({txn.id()})")
        if fmt not in CHECKSUM_FORMATS:
            raise IntegrityError(f"format {fmt!r} with a checksum")
    elif fmt in CHECKSUM_FORMATS:
        raise IntegrityError("its checksum entry is missing")
    # The structure, as every reader below expects it (a format-1 journal has only this).
    if strange is not None:
        raise IntegrityError(f"unknown entry {strange[:40]!r}")
    read_state(txn)
    read_progress(txn)
    read_files(txn)
    placement = txn.get(K_PLACEMENT)
    if placement is not None and re.fullmatch(rb"[0-9a-f]{64}", bytes(placement)) is None:
        raise IntegrityError("the placement digest is not readable")
    images = 0
    for suffix, value in scan(txn, WAL_PREFIX, copy=False):
        decode_wal_image(suffix, value)
        images += 1
    if (txn.get(K_WAL_BOOT) is None) != (images == 0):
        raise IntegrityError("deferred-sync images and their boot entry do not go together")
    return stored is not None


def scan(txn, prefix: bytes, copy: bool = True) -> Iterator[tuple[bytes, bytes]]:
    """(key without prefix, value) of every key starting with ``prefix``, in key order;
    ``copy=False`` yields the values as LMDB holds them (valid within the transaction)."""
    cur = txn.cursor()
    if not cur.set_range(prefix):
        return
    for key, value in cur:
        key = bytes(key)
        if not key.startswith(prefix):
            return
        yield key[len(prefix):], bytes(value) if copy else value
