"""``ulp`` (feature ``ulp-encoding``, ``xor`` records only): positions as gaps and values as
signed distances in the base's order, each compressed by pcodec.

Most changes of a training step move a weight by one or two units in the last place. As xor
words those steps are spread over many symbols (the carry depends on the base's low bits);
as distances between ``key(base)`` and ``key(new)`` they are a few symbols (+1 and -1 about
84-90% of the time): 1.8 bits per change instead of 2.7 on bf16 Adam steps at 1% changed
(entropies; tools/bench_codec.py gives these figures and those below). The distance is
decoded without the base; only turning it into the new word needs the base word at the same
position, element by element, so a receiver holding part of a box can apply its part.

pcodec (tANS over adaptive bins, a documented format) codes both sequences within 1-6% of
their empirical entropy; a whole record decodes at 95-145 M changes/s with the GIL released.
A static rANS coder (constriction) of the same gaps and distances is 1-2% smaller but decodes
24-28 M symbols/s (two per change) holding the GIL: slower than the rest of a receiver.

Payload: the byte length of the gap file (u64 LE), the gap file, the distance file; each a
pcodec standalone file of ``k`` integers (gaps u32, or u64 when one is 2^32 or more;
distances signed, of the word's width). Params: ``gap_bytes`` (4 or 8) and ``level``, the
pcodec compression level (informative, 0..12).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np

from dcr_log import native
from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import ChangeSet, Encoding, check_params, delta_positions, positions_from_gaps
from dcr_log.codec.raw import payload_size
from dcr_log.codec.sparse import SparseEncoding
from dcr_log.errors import IntegrityError
from dcr_log.format.commit import ULP_ENCODING

PCO_LEVELS = tuple(range(0, 13))
# Level 8: on gaps and distances of bf16 Adam steps, 10.0 bits per change at 1% changed
# (level 6: 10.3; 4: 11.3; 2: 12.0), and no slower: 25-45 M changes/s encoding on one core
# at every level (tools/bench_codec.py).
DEFAULT_LEVEL = 8

_pcodec = None


def _pco():
    # Imported on first use: only logs with this encoding need the package.
    global _pcodec
    if _pcodec is None:
        import pcodec

        _pcodec = pcodec
    return _pcodec


def _config(level: int):
    pco = _pco()
    # No delta and the classic mode: gaps and distances are already differences, and the
    # automatic search costs time without finding anything smaller on them.
    return pco.ChunkConfig(compression_level=level, delta_spec=pco.DeltaSpec.no_op(),
                           mode_spec=pco.ModeSpec.classic())


# --- the order-preserving key of sign-magnitude words -------------------------------------

def _sign_mask(word: np.dtype):
    w = np.dtype(word).itemsize
    return np.dtype(f"<u{w}").type(1 << (8 * w - 1))


def to_key(words: np.ndarray) -> np.ndarray:
    """Sign-magnitude words (IEEE floats) to unsigned integers in the same order:
    a word with the sign bit clear gets it set, a word with it set has every bit flipped."""
    u = words.view(np.dtype(f"<u{words.dtype.itemsize}"))
    sign = _sign_mask(u.dtype)
    negative = (u >> np.uint8(8 * u.dtype.itemsize - 1)).astype(u.dtype)
    flip = np.bitwise_or(np.multiply(negative, sign - 1, dtype=u.dtype), sign)
    return np.bitwise_xor(u, flip)


def from_key(keys: np.ndarray) -> np.ndarray:
    """Inverse of to_key."""
    sign = _sign_mask(keys.dtype)
    positive = (keys >> np.uint8(8 * keys.dtype.itemsize - 1)).astype(keys.dtype)
    flip = np.bitwise_or(np.multiply(positive ^ 1, sign - 1, dtype=keys.dtype), sign)
    return np.bitwise_xor(keys, flip)


def ulp_distance(base: np.ndarray, new: np.ndarray) -> np.ndarray:
    """key(new) - key(base), modulo 2^bits, as unsigned words of the same width."""
    return np.subtract(to_key(new), to_key(base))


def step_from(base: np.ndarray, distance: np.ndarray, backwards: bool = False) -> np.ndarray:
    """The words ``distance`` ulps from ``base`` (or back from it, ``backwards``), as words of
    ``base``'s dtype; element by element, so any subset of a record's positions works."""
    u = np.dtype(f"<u{base.dtype.itemsize}")
    d = np.asarray(distance).view(u)
    if native.changes is not None and base.shape == d.shape and base.ndim == 1:
        out = np.empty(base.size, dtype=base.dtype)
        native.changes.step(np.ascontiguousarray(base).view(u), np.ascontiguousarray(d), u.itemsize,
                     backwards, out.view(u))
        return out
    return step_from_numpy(base, d, backwards)


def step_from_numpy(base: np.ndarray, distance: np.ndarray, backwards: bool = False) -> np.ndarray:
    """step_from in numpy (the reference of the C pass)."""
    u = np.dtype(f"<u{base.dtype.itemsize}")
    d = np.asarray(distance).view(u)
    key = to_key(np.ascontiguousarray(base))
    moved = np.subtract(key, d) if backwards else np.add(key, d)
    return from_key(moved).view(base.dtype)


def xor_from_distance(base: np.ndarray, distance: np.ndarray) -> np.ndarray:
    """The xor words that take ``base`` to ``step_from(base, distance)``."""
    return np.bitwise_xor(base, step_from(base, distance))


def distance_dtype(word: np.dtype) -> np.dtype:
    """Distances are stored as signed integers of the word's width, 1-byte words as int16
    (pcodec does not take 8-bit integers by default)."""
    return np.dtype(f"<i{max(np.dtype(word).itemsize, 2)}")


def _compress(values: np.ndarray, level: int) -> bytes:
    try:
        return _pco().standalone.simple_compress(np.ascontiguousarray(values), _config(level))
    except RuntimeError as exc:  # pragma: no cover - pcodec refuses nothing we give it
        raise IntegrityError(f"ulp: pcodec could not compress: {exc}") from None


def _decompress(data: memoryview, k: int, dtype: np.dtype, what: str) -> np.ndarray:
    """Exactly ``k`` integers of ``dtype`` from one standalone file, into a buffer of k."""
    if len(data) < 4 or bytes(data[:4]) != b"pco!":
        raise IntegrityError(f"ulp: the {what} are not a pcodec standalone file")
    out = np.empty(k, dtype=dtype)
    try:
        progress = _pco().standalone.simple_decompress_into(bytes(data), out)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise IntegrityError(f"ulp: corrupt {what}: {exc}") from None
    if progress.n_processed != k or not progress.finished:
        raise IntegrityError(f"ulp: the {what} do not hold exactly {k} numbers")
    return out


def steer(attempt: Attempt, size: int) -> None:
    """What a payload of ulp distances (``ulp`` or ``ulp-rans``) of ``size`` bytes tells the
    encodings tried after it: below ``policy.ulp_dense_min_rate`` it is smaller than dense on
    every weight pair measured, and sparse is worth trying only when it is above
    ``policy.ulp_sparse_ratio`` of raw's (words that are not floats)."""
    policy = attempt.policy
    if size <= policy.ulp_sparse_ratio * payload_size(attempt.kind, attempt.changes.k, attempt.word_size):
        attempt.skip.add(SparseEncoding.name)
    attempt.whole_box_min_rate = max(attempt.whole_box_min_rate, policy.ulp_dense_min_rate)


class UlpEncoding(Encoding):
    name = "ulp"
    kinds = ("xor",)
    feature = ULP_ENCODING

    def __init__(self, level: int = DEFAULT_LEVEL):
        self.level = level

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        """Not above ``policy.sparse_max_rate``; once tried it steers the rest (steer)."""
        policy = attempt.policy
        if attempt.rate > policy.sparse_max_rate:
            return None
        params, payload = cls(policy.ulp_level).encode(attempt.kind, attempt.changes,
                                                       base=attempt.base_values, new=attempt.new_values,
                                                       buffer=attempt.buffer)
        steer(attempt, len(payload))
        return Candidate.encoded(cls.name, params, payload)

    def encode(self, kind: str, changes: ChangeSet, base: np.ndarray | None = None,
               new: np.ndarray | None = None, buffer: Callable[[str, np.dtype, int], np.ndarray] | None = None
               ) -> tuple[dict, bytes]:
        """``base`` and ``new``: the words at the changed positions (the writer has them);
        without them ``changes`` must be relative (its values the distances). ``buffer``
        (tag, dtype, n) gives reusable scratch arrays for the gaps and distances."""
        self.check_kind(kind)
        positions = delta_positions(changes)
        k = positions.size
        if k == 0:
            raise ValueError("ulp: a record needs at least one change")
        if base is not None and new is not None:
            fused = self._encode_native(positions, base, new, buffer)
            if fused is not None:
                return fused
        if base is None:
            if not changes.relative:
                raise ValueError("ulp: encode needs the base and new words, or distances")
            distance = changes.values
        else:
            distance = ulp_distance(base, cast(np.ndarray, new))
        w = distance.dtype.itemsize
        signed = distance.view(np.dtype(f"<i{w}")).astype(distance_dtype(distance.dtype), copy=False)
        positions = positions.astype(np.int64, copy=False)
        gaps = np.empty(k, dtype=np.int64)
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
        gap_bytes = 4 if int(gaps.max()) < 1 << 32 else 8
        return self._payload(gaps.astype(f"<u{gap_bytes}"), signed, gap_bytes)

    def _encode_native(self, positions: np.ndarray, base: np.ndarray, new: np.ndarray,
                       buffer: Callable[[str, np.dtype, int], np.ndarray] | None) -> tuple[dict, bytes] | None:
        """The gaps and distances in one C pass (None: inputs it does not take)."""
        kernels = native.changes
        w = base.dtype.itemsize
        if (kernels is None or positions.dtype != np.int64 or new.dtype.itemsize != w
                or not positions.flags.c_contiguous or not base.size == new.size == positions.size):
            return None
        get = buffer or (lambda tag, dtype, n: np.empty(n, dtype=dtype))
        k = positions.size
        word = np.dtype(f"<u{w}")
        gaps = get("ulp_gaps", np.dtype(np.uint32), k)
        signed = get("ulp_distances", distance_dtype(word), k)
        largest = kernels.ulp_prepare(positions, np.ascontiguousarray(base).view(word),
                                      np.ascontiguousarray(new).view(word), w, gaps, signed)
        if largest >= 1 << 32:  # a gap that needs 8 bytes: redo them wide (rare: huge boxes)
            wide = np.empty(k, dtype=np.uint64)
            wide[0] = positions[0]
            np.subtract(positions[1:], positions[:-1], out=wide[1:].view(np.int64))
            wide[1:] -= np.uint64(1)
            return self._payload(wide, signed, 8)
        return self._payload(gaps, signed, 4)

    def _payload(self, gaps: np.ndarray, signed: np.ndarray, gap_bytes: int) -> tuple[dict, bytes]:
        gap_file = _compress(gaps, self.level)
        distance_file = _compress(signed, self.level)
        return {"level": self.level, "gap_bytes": gap_bytes}, b"".join(
            [np.uint64(len(gap_file)).astype("<u8").tobytes(), gap_file, distance_file])

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        """Positions and distances (``relative``): the xor words follow from the base words."""
        self.check_kind(kind)
        check_params(self.name, params, {"level": PCO_LEVELS, "gap_bytes": (4, 8)})
        if k == 0:
            raise IntegrityError("ulp: a record needs at least one change")
        buf = memoryview(payload).cast("B")
        if len(buf) < 8:
            raise IntegrityError("ulp: payload ends before the gap file's length")
        gap_len = int(np.frombuffer(buf[:8], dtype="<u8")[0])
        if gap_len > len(buf) - 8:
            raise IntegrityError(f"ulp: gap file of {gap_len} bytes in a payload of {len(buf)}")
        gap_data = buf[8:8 + gap_len]
        gap_type = np.dtype(np.uint32 if params["gap_bytes"] == 4 else np.uint64)
        gaps = _decompress(gap_data, k, gap_type, "gaps").astype(np.uint64, copy=False)
        dtype = distance_dtype(word)
        signed = _decompress(buf[8 + gap_len:], k, dtype, "distances")
        bits = 8 * word.itemsize
        if bits < 8 * dtype.itemsize:
            lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
            if int(signed.min()) < lo or int(signed.max()) >= hi:
                raise IntegrityError("ulp: a distance does not fit the word")
        if not signed.all():
            raise IntegrityError("ulp: a distance of zero (an unchanged position)")
        distance = signed.astype(np.dtype(f"<i{word.itemsize}"), copy=False).view(word)
        return ChangeSet(n, positions_from_gaps(gaps, n, "ulp:"), distance, relative=True)
