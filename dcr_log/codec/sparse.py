"""``sparse``: gap-coded positions and values, each byte-planed, in one zstd frame.

gap[0] = p[0], gap[i] = p[i] - p[i-1] - 1, stored as ``gap_bytes``-wide little-endian words;
the frame holds the gaps' byte planes followed by the values' byte planes.
Params: ``level`` (zstd level used, informative) and ``gap_bytes`` (1, 2, 4 or 8).
"""

from __future__ import annotations

import numpy as np

from ..errors import IntegrityError
from .base import (
    ZSTD_LEVELS,
    ChangeSet,
    Encoding,
    check_params,
    check_positions,
    from_planes,
    to_planes,
    zstd_compress,
    zstd_decompress_exact,
)

_GAP_WORD = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def gap_width(max_gap: int) -> int:
    for w in (1, 2, 4):
        if max_gap < 1 << (8 * w):
            return w
    return 8


class SparseEncoding(Encoding):
    name = "sparse"
    kinds = ("xor", "overwrite")

    def __init__(self, level: int = 3):
        self.level = level

    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        self.check_kind(kind)
        p = changes.positions.astype(np.int64, copy=False)
        gaps = np.empty(p.size, dtype=np.int64)
        if p.size:
            gaps[0] = p[0]
            np.subtract(p[1:], p[:-1], out=gaps[1:])
            gaps[1:] -= 1
        gw = gap_width(int(gaps.max()) if gaps.size else 0)
        body = np.concatenate(
            [to_planes(gaps.astype(_GAP_WORD[gw])), to_planes(np.ascontiguousarray(changes.values))]
        )
        return {"level": self.level, "gap_bytes": gw}, zstd_compress(body, self.level)

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        self.check_kind(kind)
        check_params(self.name, params, {"level": ZSTD_LEVELS, "gap_bytes": (1, 2, 4, 8)})
        gw = params["gap_bytes"]
        body = zstd_decompress_exact(payload, k * (gw + word.itemsize))
        gaps = from_planes(body[: k * gw], k, _GAP_WORD[gw])
        values = from_planes(body[k * gw :], k, word)
        if k and int(gaps.max()) >= n:
            raise IntegrityError("sparse gap exceeds the box")
        positions = np.cumsum(gaps.astype(np.uint64) + np.uint64(1), dtype=np.uint64)
        positions -= np.uint64(1)
        check_positions(positions, n)
        return ChangeSet(n, positions.view(np.int64), values)
