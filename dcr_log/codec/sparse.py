"""``sparse``: gap-coded positions and values, each byte-planed, in one zstd frame.

gap[0] = p[0], gap[i] = p[i] - p[i-1] - 1, stored as ``gap_bytes``-wide little-endian words;
the frame holds the gaps' byte planes followed by the values' byte planes.
Params: ``level`` (zstd level used, informative) and ``gap_bytes`` (1, 2, 4 or 8).
"""

from __future__ import annotations

import numpy as np

from dcr_log import native
from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import (
    ZSTD_LEVELS,
    ChangeSet,
    Encoding,
    check_params,
    delta_positions,
    from_planes,
    positions_from_gaps,
    to_planes,
    zstd_compress_planes,
    zstd_decompress_exact,
)
from dcr_log.errors import IntegrityError

_GAP_WORD: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

# Level 1 is the right default: on byte-planed gaps and values (close to noise, few useful
# matches) levels up to 9 save under 1% of the bytes (at 3% changed they are larger) and cost
# 5-10x the time; zstd's Huffman-coded literals do the work at every level.
DEFAULT_LEVEL = 1


def gap_width(max_gap: int) -> int:
    for w in (1, 2, 4):
        if max_gap < 1 << (8 * w):
            return w
    return 8


def sparse_body(positions: np.ndarray, values: np.ndarray) -> tuple[int, np.ndarray]:
    """(gap_bytes, uncompressed frame body): gap planes then value planes, in one buffer."""
    k = positions.size
    gaps = np.empty(k, dtype=np.int64)
    if k:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    gw = gap_width(int(gaps.max()) if k else 0)
    w = values.dtype.itemsize
    body = np.empty(k * (gw + w), dtype=np.uint8)
    to_planes(gaps.astype(_GAP_WORD[gw]), out=body[: k * gw])
    to_planes(values, out=body[k * gw:])
    return gw, body


class SparseEncoding(Encoding):
    name = "sparse"
    kinds = ("xor", "overwrite")

    def __init__(self, level: int = DEFAULT_LEVEL):
        self.level = level

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        """Not above ``policy.sparse_max_rate`` of changed elements (it cannot win there), nor
        once an earlier encoding found it not worth trying."""
        if attempt.rate > attempt.policy.sparse_max_rate or cls.name in attempt.skip:
            return None
        return Candidate.encoded(cls.name, *cls(attempt.policy.sparse_level).encode(attempt.kind, attempt.changes))

    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        self.check_kind(kind)
        gw, body = sparse_body(delta_positions(changes).astype(np.int64, copy=False), changes.values)
        return {"level": self.level, "gap_bytes": gw}, zstd_compress_planes(body, changes.k, self.level)

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        self.check_kind(kind)
        check_params(self.name, params, {"level": ZSTD_LEVELS, "gap_bytes": (1, 2, 4, 8)})
        gw = params["gap_bytes"]
        body = zstd_decompress_exact(payload, k * (gw + word.itemsize))
        kernels = native.changes
        if kernels is not None and 0 < k and n < 1 << 63:
            # One C pass: the numpy steps below are a dozen calls a record whatever its size
            # (tools/bench_tensors.py --tensors 2000 --repeats 5, a record a norm: a replay
            # 32 us a tensor against 46-49, a numpy receiver's apply 63-66 against 75-81).
            positions = np.empty(k, dtype=np.int64)
            values = np.empty(k, dtype=word)
            code = kernels.sparse_unpack(body, k, gw, word.itemsize, n, positions, values.view(np.uint8))
            if code == 1:
                raise IntegrityError("sparse gap exceeds the box")
            if code == 2:
                raise IntegrityError("positions are not strictly increasing inside the box")
            return ChangeSet(n, positions, values)
        gaps = from_planes(body[: k * gw], k, _GAP_WORD[gw])
        values = from_planes(body[k * gw:], k, word)
        if k == 0:
            return ChangeSet(n, np.empty(0, dtype=np.int64), values)
        return ChangeSet(n, positions_from_gaps(gaps, n, "sparse"), values)
