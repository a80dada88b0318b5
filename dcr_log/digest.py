"""Tensor and record digests: the two schemes of the format. Pure: no I/O.

- ``xxh3`` (format 1 without features): a tensor digest is xxh3_64 of the tensor's bytes, a
  record digest xxh3_64 of the words at the record's positions. Fast, but only a process that
  holds a whole tensor can compute its digest.
- ``sum`` (feature ``sum-digests``, spec/FORMAT.md section 7.1): every element ``(f, w)`` (its
  flat row-major index in the tensor and its word) has a 64-bit hash ``e(f, w)``, and a digest
  is the sum mod 2^64 of the hashes of the elements it covers. A tensor digest is then the sum
  of the digests of any boxes that tile the tensor, so trainer ranks and receivers that hold
  slices compute it without gathering, and a record changes it by ``target - base``: digests
  follow a version in O(changes) instead of a pass over the model.

``e(f, w) = mix64(((f + 1) * G mod 2^64) XOR w)``, with ``w`` zero-extended to 64 bits, G the
golden-ratio constant and mix64 SplitMix64's finalizer. The sums run in the small C module
``dcr_log._digest`` when it was built (one loop, the GIL released), else vectorised in numpy
over reused buffers in pieces that stay in cache (numpy's uint64 arithmetic wraps mod 2^64);
``DCR_NO_NATIVE=1`` forces numpy. Both give the same sums.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import xxhash

from dcr_log import native
from dcr_log.coords import Box, box_to_tensor_flat, numel, unsigned_words
from dcr_log.parallel import map_grouped

SUM_DIGESTS = "sum-digests"
MASK64 = (1 << 64) - 1

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB

_G = np.uint64(GOLDEN)
_M1 = np.uint64(MIX1)
_M2 = np.uint64(MIX2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

# Elements hashed per piece: two uint64 buffers of this size stay in L2.
PIECE = 1 << 15
# (j + 1) * G mod 2^64 for a piece's offsets j: add start * G to get e's first operand.
_STEP_G = (np.arange(1, PIECE + 1, dtype=np.uint64) * _G)


def element_hash(f: int, w: int) -> int:
    """e(f, w) for one element, in plain integers (the reference the vectorised code follows)."""
    z = (((f + 1) * GOLDEN) & MASK64) ^ w
    z ^= z >> 30
    z = (z * MIX1) & MASK64
    z ^= z >> 27
    z = (z * MIX2) & MASK64
    z ^= z >> 31
    return z


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.x = np.empty(PIECE, dtype=np.uint64)
        self.t = np.empty(PIECE, dtype=np.uint64)


_BUF = _Buffers()


def _mix_sum(x: np.ndarray, t: np.ndarray) -> int:
    """mix64 of every entry of ``x`` in place (``t`` is scratch), then their sum mod 2^64."""
    return int(np.add.reduce(mix64_into(x, t), dtype=np.uint64))


def mix64_into(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer applied to every uint64 of ``x`` in place (``t``: scratch of
    the same size); returns ``x``."""
    np.right_shift(x, _S30, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _M1, out=x)
    np.right_shift(x, _S27, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _M2, out=x)
    np.right_shift(x, _S31, out=t)
    np.bitwise_xor(x, t, out=x)
    return x


def sum_range(start: int, words: np.ndarray) -> int:
    """Sum of e(start + j, words[j]): a contiguous run of flat indices."""
    words = unsigned_words(np.ascontiguousarray(words).reshape(-1))
    if native.digest is not None:
        return native.digest.sum_range(words, words.itemsize, start)
    buf = _BUF
    total = 0
    n = words.size
    for lo in range(0, n, PIECE):
        k = min(PIECE, n - lo)
        x, t = buf.x[:k], buf.t[:k]
        np.add(_STEP_G[:k], np.uint64(((start + lo) * GOLDEN) & MASK64), out=x)
        np.bitwise_xor(x, words[lo:lo + k], out=x, casting="unsafe")
        total += _mix_sum(x, t)
    return total & MASK64


# Flat index arrays the C sum takes as they are (its indices are read as int64).
_INDEX_DTYPES = (np.dtype(np.int64), np.dtype(np.uint64))


def sum_at(flat: np.ndarray, words: np.ndarray) -> int:
    """Sum of e(flat[i], words[i]) for arbitrary flat indices (O(len(flat)))."""
    if (native.digest is not None and type(flat) is np.ndarray and type(words) is np.ndarray
            and flat.ndim == 1 and words.ndim == 1 and flat.dtype in _INDEX_DTYPES
            and flat.flags.c_contiguous and words.flags.c_contiguous and flat.size == words.size
            and not words.dtype.hasobject):
        # A receiver's case, twice a record: its conversions below cost five times the call.
        return native.digest.sum_at(flat, words, words.itemsize)
    flat = np.asarray(flat).reshape(-1)
    if flat.dtype != np.uint64:  # an int64 operand would promote the product to float64
        flat = flat.astype(np.int64, copy=False).view(np.uint64)
    words = unsigned_words(np.asarray(words).reshape(-1))
    if flat.size != words.size:
        raise ValueError(f"{flat.size} indices for {words.size} words")
    if native.digest is not None:
        return native.digest.sum_at(np.ascontiguousarray(flat), np.ascontiguousarray(words), words.itemsize)
    buf = _BUF
    total = 0
    for lo in range(0, flat.size, PIECE):
        k = min(PIECE, flat.size - lo)
        x, t = buf.x[:k], buf.t[:k]
        np.multiply(flat[lo:lo + k], _G, out=x, casting="unsafe")
        np.add(x, _G, out=x)
        np.bitwise_xor(x, words[lo:lo + k], out=x, casting="unsafe")
        total += _mix_sum(x, t)
    return total & MASK64


def sum_pair(positions: np.ndarray, offset: int, base: np.ndarray, new: np.ndarray) -> tuple[int, int]:
    """(sum of e(positions[i] + offset, base[i]), the same over ``new``): a record's base and
    target digests in one pass, for positions that are flat indices less ``offset`` (a row
    block's box-local positions)."""
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    base = unsigned_words(np.ascontiguousarray(base).reshape(-1))
    new = unsigned_words(np.ascontiguousarray(new).reshape(-1))
    if not positions.size == base.size == new.size or base.dtype != new.dtype:
        raise ValueError(f"{positions.size} positions for {base.size} base and {new.size} new words")
    if native.digest is not None:
        return native.digest.sum_pair(positions, offset & MASK64, base, new, base.itemsize)
    flat = positions.view(np.uint64) + np.uint64(offset & MASK64)  # wraps mod 2^64, as in C
    return sum_at(flat, base), sum_at(flat, new)


def box_runs(box: Box, tensor_shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """A box as contiguous runs of the tensor's flat order: (first flat index of each run,
    run length). A row block is one run; other boxes are runs along the last dimension."""
    shape = tuple(int(s) for s in tensor_shape)
    if box.size == 0:
        return np.empty(0, dtype=np.int64), 0
    if not shape:
        return np.zeros(1, dtype=np.int64), 1
    if box.is_row_block(shape):
        return np.array([box.flat_start(shape)], dtype=np.int64), box.size
    outer = box.shape[:-1]
    idx = np.indices(outer, dtype=np.int64).reshape(len(outer), -1) if outer else np.zeros((0, 1), np.int64)
    starts = np.zeros(idx.shape[1], dtype=np.int64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        if d == len(shape) - 1:
            starts += box.offset[d]
        else:
            starts += (idx[d] + box.offset[d]) * stride
        stride *= shape[d]
    return starts, int(box.shape[-1])


def sum_box(box: Box, tensor_shape: tuple[int, ...], words: np.ndarray) -> int:
    """Sum of e over a box whose words are given in box-local row-major order."""
    starts, run = box_runs(box, tensor_shape)
    return sum_runs(starts, run, words)


def sum_runs(starts: np.ndarray, run: int, words: np.ndarray) -> int:
    """Sum of e over runs of ``run`` flat indices from each of ``starts``; ``words`` holds the
    runs one after another (any array of ``starts.size * run`` words, strided views copied in
    bounded pieces)."""
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if words.ndim == 2 and not words.flags.c_contiguous and starts.size:
        rows = max(1, (1 << 22) // max(run, 1))
        return sum(sum_runs(starts[r:r + rows], run, np.ascontiguousarray(words[r:r + rows]))
                   for r in range(0, starts.size, rows)) & MASK64
    words = np.ascontiguousarray(words).reshape(-1)
    if native.digest is not None and starts.size:
        return native.digest.sum_runs(np.ascontiguousarray(starts), run, unsigned_words(words), words.itemsize)
    if starts.size == 1:
        return sum_range(int(starts[0]), words)
    if run >= PIECE // 4 or starts.size == 0:
        total = 0
        for i, s in enumerate(starts.tolist()):
            total += sum_range(s, words[i * run:(i + 1) * run])
        return total & MASK64
    # Short runs: several rows per piece, their flat indices built by broadcasting.
    rows = max(1, PIECE // run)
    words = unsigned_words(words).reshape(starts.size, run)
    col_g = _STEP_G[:run]
    buf = _BUF
    total = 0
    for r0 in range(0, starts.size, rows):
        r1 = min(starts.size, r0 + rows)
        k = (r1 - r0) * run
        x, t = buf.x[:k].reshape(r1 - r0, run), buf.t[:k]
        np.multiply(starts[r0:r1, None].view(np.uint64), _G, out=x[:, :1])
        np.add(x[:, :1], col_g[None, :], out=x)
        np.bitwise_xor(x, words[r0:r1], out=x, casting="unsafe")
        total += _mix_sum(x.reshape(-1), t)
    return total & MASK64


_ZERO_CHUNK = 1 << 22


def zero_range(start: int, count: int) -> int:
    """Sum of e(f, 0) for f in start .. start+count-1: zero words, in chunks (O(chunk) memory)."""
    zeros = np.zeros(min(count, _ZERO_CHUNK), dtype=np.uint8)
    total = 0
    for lo in range(0, count, _ZERO_CHUNK):
        total += sum_range(start + lo, zeros[:min(_ZERO_CHUNK, count - lo)])
    return total & MASK64


def zeros_outside(boxes: list[Box], shape: tuple[int, ...]) -> int:
    """Sum digest of the zero words of a created tensor outside ``boxes`` (disjoint boxes
    inside it, the ones its records write): what its uncovered elements contribute."""
    total = zero_range(0, numel(shape))
    for box in boxes:
        if not box.size:
            continue
        if box.is_row_block(shape):
            total -= zero_range(box.flat_start(shape), box.size)
        else:
            total -= sum_box(box, shape, np.zeros(box.size, dtype=np.uint8))
    return total & MASK64


def add(*digests: int) -> int:
    return sum(digests) & MASK64


def sub(a: int, b: int) -> int:
    return (a - b) & MASK64


class DigestScheme:
    """How a log's tensor and record digests are computed (chosen by its features)."""

    name: str
    # True when digests of disjoint parts add up to the digest of their union.
    composable: bool

    def tensor(self, words: np.ndarray, shape: tuple[int, ...]) -> int:
        raise NotImplementedError

    def at(self, flat: np.ndarray | slice, words: np.ndarray) -> int:
        """Digest of ``words`` found at flat indices ``flat`` (an index array or a slice)."""
        raise NotImplementedError

    def box(self, box: Box, shape: tuple[int, ...], words: np.ndarray) -> int:
        """Digest of a box's words in box-local row-major order."""
        raise NotImplementedError

    def record(self, box: Box, shape: tuple[int, ...], positions: np.ndarray, base: np.ndarray,
               new: np.ndarray) -> tuple[int, int]:
        """(base digest, target digest) of a delta record: the words ``base`` and ``new`` at
        the box-local ``positions`` of ``box`` in a tensor of ``shape``."""
        raise NotImplementedError

    def empty(self) -> int:
        raise NotImplementedError


class Xxh3Digests(DigestScheme):
    name = "xxh3"
    composable = False

    def tensor(self, words, shape) -> int:
        return xxh3_words(words)

    def at(self, flat, words) -> int:
        return xxh3_words(words)

    def box(self, box, shape, words) -> int:
        return xxh3_words(words)

    def record(self, box, shape, positions, base, new) -> tuple[int, int]:
        return xxh3_words(base), xxh3_words(new)

    def empty(self) -> int:
        return XXH3_EMPTY


class SumDigests(DigestScheme):
    name = "sum"
    composable = True

    def tensor(self, words, shape) -> int:
        return sum_range(0, words)

    def at(self, flat, words) -> int:
        if isinstance(flat, slice):
            return sum_range(flat.start or 0, words)
        return sum_at(flat, words)

    def box(self, box, shape, words) -> int:
        return sum_box(box, shape, words)

    def record(self, box, shape, positions, base, new) -> tuple[int, int]:
        shape = tuple(int(s) for s in shape)
        if box.is_row_block(shape):  # box-local positions are flat ones less its start
            return sum_pair(positions, box.flat_start(shape), base, new)
        flat = box_to_tensor_flat(box, shape, positions)
        return sum_at(flat, base), sum_at(flat, new)

    def empty(self) -> int:
        return 0


# Words of a box digested as one piece where the scheme composes (box_digests).
DIGEST_SPAN = 1 << 21


def box_digests(scheme: DigestScheme, boxes: list[tuple[Box, tuple[int, ...], np.ndarray]],
                workers: int, parallel: bool = True) -> list[int]:
    """The digest of each ``(box, tensor shape, the box's words in box-local row-major
    order)``, on ``workers`` threads of the shared pool (the C digests release the GIL).
    Where the scheme composes, a row block in spans of DIGEST_SPAN words whose digests add
    up to the box's (a row block's box-local order is the tensor's flat order from its
    first word): a few large boxes then take every thread, not one each."""
    # (box, the box's first flat index in its tensor, first word, end); end -1: the box whole
    spans: list[tuple[int, int, int, int]] = []
    weights: list[int] = []
    for i, (box, shape, words) in enumerate(boxes):
        n = words.size
        dims = tuple(int(d) for d in shape)
        if scheme.composable and n > 0 and box.is_row_block(dims):
            start = box.flat_start(dims)
            for lo in range(0, n, DIGEST_SPAN):
                spans.append((i, start, lo, min(lo + DIGEST_SPAN, n)))
                weights.append(min(DIGEST_SPAN, n - lo))
        else:
            spans.append((i, 0, 0, -1))
            weights.append(n)

    def one(span: tuple[int, int, int, int]) -> int:
        i, start, lo, hi = span
        box, shape, words = boxes[i]
        if hi < 0:
            return scheme.box(box, shape, words)
        return scheme.at(slice(start + lo, start + hi), words.reshape(-1)[lo:hi])

    # Up to a span's words in all, the calling thread is faster than the pool's hops (14
    # tensors of 2^16 words: 0.05 ms against 0.18; even at 2^21, 0.32 against 0.35).
    parallel = parallel and sum(weights) > DIGEST_SPAN
    totals = [scheme.empty()] * len(boxes)
    for (i, _, _, hi), part in zip(spans, map_grouped(one, spans, weights, 4 * DIGEST_SPAN, workers, parallel)):
        totals[i] = part if hi < 0 else (totals[i] + part) & MASK64
    return totals


def xxh3_words(words: np.ndarray) -> int:
    """xxh3_64 (seed 0) of the words' little-endian bytes."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(words).data.cast("B"))


XXH3_EMPTY = xxhash.xxh3_64_intdigest(b"")
XXH3 = Xxh3Digests()
SUM = SumDigests()


def scheme_for(features: Iterable[str]) -> DigestScheme:
    return SUM if SUM_DIGESTS in set(features) else XXH3

