"""The encoding interface shared by every codec, and the checked zstd and byte-plane helpers.

An encoding turns one record's change set into payload bytes and back. A change set is
``positions`` (strictly increasing box-local row-major indices, or ``None`` meaning every
position of the box, for records of kind ``tensor``) and ``values`` (one word per position).
Decoders check every declared length and bound before they allocate or write.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import numpy as np
import zstandard

from dcr_log import native
from dcr_log.errors import IntegrityError

if TYPE_CHECKING:
    from dcr_log.codec.attempt import Attempt, Candidate


@dataclass(frozen=True)
class ChangeSet:
    """Box-local changes: ``positions is None`` means all ``n`` positions in order.

    ``relative``: the values are distances in ulps from the base words (the ``ulp``
    encoding), not xor words; ``xor_values`` turns them into xor words given the base.

    ``origin``: added to every position by the decoder (``Encoding.decode_at``): a row
    block's flat start, so that its positions are the tensor's flat ones without a second
    array; the box-local positions are ``positions - origin``.
    """

    n: int
    positions: np.ndarray | None
    values: np.ndarray
    relative: bool = False
    origin: int = 0

    @property
    def k(self) -> int:
        return self.n if self.positions is None else int(self.positions.size)


def delta_positions(changes: ChangeSet) -> np.ndarray:
    """The positions of a delta record's change set (which always has them), typed as such.
    Not a check: a caller passing a tensor's change set fails on None as it always did."""
    return cast(np.ndarray, changes.positions)


class Encoding(ABC):
    """One payload encoding. ``feature``: the log feature a reader needs to decode it (None:
    every log allows it). ``try_encode`` is how the writer tries it on one box; the registry
    (dcr_log.codec.registry) decides the order and keeps the smallest."""

    name: str
    kinds: tuple[str, ...]
    feature: str | None = None

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        """A candidate for ``attempt`` (whose kind this encoding carries), or None where it
        cannot win or is not meant for writers (the default: decode only)."""
        return None

    @abstractmethod
    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        """Return (params, payload)."""

    @abstractmethod
    def decode(
        self, kind: str, params: dict, payload: bytes, n: int, k: int, word: np.dtype
    ) -> ChangeSet:
        """Inverse of encode; raises IntegrityError on any inconsistency."""

    def decode_at(self, kind: str, params: dict, payload: bytes, n: int, k: int, word: np.dtype,
                  origin: int) -> ChangeSet:
        """``decode`` with ``origin`` added to every position (ChangeSet.origin). Here in a
        second array; an encoding whose decoder writes positions adds it as it writes them."""
        changes = self.decode(kind, params, payload, n, k, word)
        if not origin or changes.positions is None:
            return changes
        return replace(changes, positions=np.add(changes.positions, np.int64(origin), dtype=np.int64), origin=origin)

    def check_kind(self, kind: str) -> None:
        if kind not in self.kinds:
            raise IntegrityError(f"encoding {self.name!r} cannot carry records of kind {kind!r}")


def check_params(name: str, params: dict, allowed: dict[str, tuple]) -> None:
    """Every key known and every value one of the allowed ones (or of the allowed type)."""
    if not isinstance(params, dict):
        raise IntegrityError(f"{name}: params must be an object")
    for key, value in params.items():
        if key not in allowed:
            raise IntegrityError(f"{name}: unknown parameter {key!r}")
        ok = allowed[key]
        # Exact types: JSON true and 3.0 compare equal to 1 and 3 in Python, but are not ints.
        if isinstance(ok, type):
            if type(value) is not ok:
                raise IntegrityError(f"{name}: parameter {key!r} must be {ok.__name__}")
        elif type(value) is not int or value not in ok:
            raise IntegrityError(f"{name}: parameter {key!r}={value!r} not in {ok}")
    missing = set(allowed) - set(params)
    if missing:
        raise IntegrityError(f"{name}: missing parameters {sorted(missing)}")


def to_planes(words: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Byte planes: all least significant bytes first, then the next byte of each word, ...

    Built by shifts and truncating casts (vectorised), not by a transposing copy, which numpy
    does several times slower. ``out`` (uint8, ``words.size * width`` bytes) is filled if given.
    """
    words = np.ascontiguousarray(words)
    w = words.dtype.itemsize
    count = words.size
    if out is None:
        out = np.empty(count * w, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.size != count * w:
        raise ValueError(f"out must hold {count * w} bytes")
    if w == 1:
        np.copyto(out, words.view(np.uint8))
        return out
    unsigned = words.view(np.dtype(f"<u{w}"))
    if native.changes is not None and out.flags.c_contiguous:
        native.changes.planes(unsigned.reshape(-1), w, out)  # one pass, the GIL released
        return out
    np.copyto(out[:count], unsigned, casting="unsafe")  # truncation keeps the low byte
    if w == 2:
        shifted = np.right_shift(unsigned, 8)
        np.copyto(out[count:], shifted, casting="unsafe")
        return out
    shifted = np.empty(count, dtype=unsigned.dtype)
    for i in range(1, w):
        np.right_shift(unsigned, 8 * i, out=shifted)
        np.copyto(out[i * count:(i + 1) * count], shifted, casting="unsafe")
    return out


def from_planes(buf: np.ndarray, count: int, word: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of to_planes: ``count`` words of dtype ``word`` from their byte planes."""
    word = np.dtype(word)
    w = word.itemsize
    if buf.size != count * w:
        raise IntegrityError(f"byte planes hold {buf.size} bytes, expected {count * w}")
    if out is None:
        out = np.empty(count, dtype=word)
    if w == 1:
        np.copyto(out, buf.view(word))
        return out
    unsigned = out.view(np.dtype(f"<u{w}"))
    if native.changes is not None and unsigned.flags.c_contiguous:
        # One pass with the GIL released, where numpy widens the first plane, then shifts and
        # ors each further one over the whole output (tools/bench_codec.py's "unplanes").
        native.changes.unplanes(np.ascontiguousarray(buf), w, unsigned.reshape(-1))
        return out
    unplanes_numpy(buf, count, unsigned)
    return out


def unplanes_numpy(buf: np.ndarray, count: int, unsigned: np.ndarray) -> None:
    """from_planes without the C module: ``unsigned`` (``count`` unsigned words) filled."""
    w = unsigned.dtype.itemsize
    if w == 2:
        np.left_shift(buf[count:], 8, out=unsigned, dtype=unsigned.dtype)
        np.bitwise_or(unsigned, buf[:count], out=unsigned)
        return
    np.copyto(unsigned, buf[:count])
    shifted = np.empty(count, dtype=unsigned.dtype)
    for i in range(1, w):
        np.left_shift(buf[i * count:(i + 1) * count], 8 * i, out=shifted, dtype=unsigned.dtype)
        np.bitwise_or(unsigned, shifted, out=unsigned)


ZSTD_LEVELS = tuple(range(1, 23))

# zstd contexts are costly to create and not thread-safe: one per thread and level.
_ZSTD = threading.local()


# Whole-box planes of weights (dense ``tensor`` records) are mostly literals: a tiny match
# table and long minimum matches make zstd nearly a pure entropy coder there. Measured on
# bf16 Adam weights: 1.9x faster than level 1 and 2% smaller. Reported as level 1 (the
# parameter is informative; readers do not need it).
FAST_LITERALS = "fast-literals"
_FAST_PARAMS = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                    target_length=0, strategy=zstandard.STRATEGY_FAST)


def _compressor(level: int | str) -> zstandard.ZstdCompressor:
    cache = getattr(_ZSTD, "compressors", None)
    if cache is None:
        cache = _ZSTD.compressors = {}
    c = cache.get(level)
    if c is None:
        if level == FAST_LITERALS:
            params = zstandard.ZstdCompressionParameters(write_content_size=True, **_FAST_PARAMS)
            c = zstandard.ZstdCompressor(compression_params=params)
        else:
            c = zstandard.ZstdCompressor(level=cast(int, level), write_content_size=True)
        cache[level] = c
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_ZSTD, "decompressor", None)
    if d is None:
        d = _ZSTD.decompressor = zstandard.ZstdDecompressor()
    return d


def zstd_compress(data: np.ndarray | bytes, level: int | str) -> bytes:
    """One zstd frame; ``level`` a zstd level or FAST_LITERALS."""
    return _compressor(level).compress(
        np.ascontiguousarray(data).data.cast("B") if isinstance(data, np.ndarray) else data
    )


# Planes smaller than this share blocks (a block per tiny plane costs more than it saves).
PLANE_BLOCK_MIN = 4096
# zstd's largest block: a one-shot frame cuts its blocks every this many bytes, so planes that
# are multiples of it get their own blocks without the streaming API.
ZSTD_BLOCK_MAX = zstandard.BLOCKSIZE_MAX


def zstd_compress_planes(data: np.ndarray, plane_bytes: int, level: int | str) -> bytes:
    """One zstd frame of ``data`` (byte planes of ``plane_bytes`` each), a block boundary at
    every plane boundary.

    Each zstd block carries one Huffman table for its literals; a block that straddles two
    planes (uniform gap bytes and skewed value bytes, say) codes both with one table. Aligning
    blocks to planes made sparse records of bf16 Adam steps (1% changed) 5-9% smaller; the
    frame is an ordinary one, readers see no difference.
    """
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if plane_bytes < PLANE_BLOCK_MIN or data.size <= plane_bytes:
        return zstd_compress(data, level)  # small records: the plain one-shot frame
    if plane_bytes % ZSTD_BLOCK_MAX == 0:
        # Block boundaries already fall on the plane boundaries (a dense record of 4 Mi
        # bf16 words, say): the one-shot frame skips the stream's copies of the input into
        # its window and of the parts into one result.
        return zstd_compress(data, level)
    view = data.data
    stream = _compressor(level).compressobj(size=data.size)
    parts = []
    for start in range(0, data.size, plane_bytes):
        parts.append(stream.compress(view[start:start + plane_bytes]))
        if start + plane_bytes < data.size:
            parts.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    parts.append(stream.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
    return b"".join(parts)


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Readers accept windows up to this (spec/FORMAT.md section 11: zstd's default decoder limit).
ZSTD_MAX_WINDOW = 1 << 27


def zstd_decompress_exact(payload: bytes, expected: int) -> np.ndarray:
    """Decompress one zstd frame that must declare and hold exactly ``expected`` bytes.

    The frame rules of spec/FORMAT.md section 11, checked on the header before anything is
    decompressed: the zstd magic number (a skippable frame is not a payload), the reserved bit
    0, no dictionary id, a window of at most ZSTD_MAX_WINDOW, the declared content size."""
    head = bytes(payload[:5])
    if len(head) < 5 or head[:4] != ZSTD_MAGIC:
        raise IntegrityError("not a zstd frame: the payload does not start with the zstd magic number")
    descriptor = head[4]
    if descriptor & 0x08 or descriptor & 0x03:
        raise IntegrityError("zstd frame sets the reserved bit or names a dictionary")
    try:
        params = zstandard.get_frame_parameters(payload)
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"not a zstd frame: {exc}") from None
    if params.dict_id != 0 or params.window_size > ZSTD_MAX_WINDOW:
        raise IntegrityError(f"zstd frame needs a dictionary or a window of {params.window_size} bytes")
    if declared != expected:
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {expected}")
    _check_frame_end(memoryview(payload).cast("B"), params.has_checksum)
    try:
        # allow_extra_data=False: bytes after the frame make the payload invalid, not ignored.
        out = _decompressor().decompress(payload, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"corrupt zstd frame: {exc}") from None
    if len(out) != expected:
        raise IntegrityError(f"zstd frame held {len(out)} bytes, expected {expected}")
    return np.frombuffer(out, dtype=np.uint8)


def _check_frame_end(view: memoryview, has_checksum: bool) -> None:
    """The frame's blocks walked from its header: it must end exactly where the payload does
    (zstd's decompress, told to refuse bytes after the frame, takes them after a frame of no
    content). A block holds up to 128 KiB of content: a few dozen a record."""
    try:
        at = zstandard.frame_header_size(view)
    except zstandard.ZstdError as exc:  # (the header was read once already: a typed error all the same)
        raise IntegrityError(f"not a zstd frame: {exc}") from None
    while True:
        if at + 3 > len(view):
            raise IntegrityError("zstd frame is cut short")
        head = view[at] | view[at + 1] << 8 | view[at + 2] << 16
        kind, size = (head >> 1) & 3, head >> 3
        if kind == 3:
            raise IntegrityError("corrupt zstd frame: a block of the reserved type")
        at += 3 + (1 if kind == 1 else size)  # an RLE block holds one byte
        if head & 1:
            break
    if at + (4 if has_checksum else 0) != len(view):
        raise IntegrityError("zstd frame does not end where the payload does")


def positions_from_gaps(gaps: np.ndarray, n: int, what: str) -> np.ndarray:
    """Box-local positions (int64) from k >= 1 gap-coded ones: p[i] = sum(gap[0..i] + 1) - 1,
    accumulated in uint64, every gap below n and the positions strictly increasing below n."""
    k = gaps.size
    if int(gaps.max()) >= n:
        raise IntegrityError(f"{what} gap exceeds the box")
    positions = np.empty(k, dtype=np.uint64)
    np.add(gaps, np.uint64(1), out=positions, casting="unsafe")
    np.cumsum(positions, out=positions)
    positions -= np.uint64(1)
    if k * n < 1 << 63:
        # Each gap is below n, so the sum cannot wrap: positions strictly increase.
        if int(positions[-1]) >= n:
            raise IntegrityError("positions are not strictly increasing inside the box")
    else:
        check_positions(positions, n)
    return positions.view(np.int64)


def check_positions(positions: np.ndarray, n: int) -> None:
    """Strictly increasing and below n (also catches uint64 wrap-around of a cumulative sum)."""
    if positions.size == 0:
        return
    if int(positions[-1]) >= n or (positions.size > 1 and not np.all(positions[1:] > positions[:-1])):
        raise IntegrityError("positions are not strictly increasing inside the box")
