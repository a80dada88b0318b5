"""``dense``: the box's full word array (xor mask, or new values for ``tensor`` records),
byte-planed, in one zstd frame. For ``xor`` the changed positions are the non-zero words.
Params: ``level`` (zstd level used, informative).
"""

from __future__ import annotations

import numpy as np

from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import (
    FAST_LITERALS,
    ZSTD_LEVELS,
    ChangeSet,
    Encoding,
    check_params,
    from_planes,
    to_planes,
    zstd_compress_planes,
    zstd_decompress_exact,
)
from dcr_log.errors import IntegrityError

# Level 1: on byte-planed bf16 weights and xor masks it is as small as levels 2-5 (smaller,
# for weights) and 1.5-3x faster.
DEFAULT_LEVEL = 1


class DenseEncoding(Encoding):
    name = "dense"
    kinds = ("xor", "tensor")

    def __init__(self, level: int = DEFAULT_LEVEL, fast: bool = False):
        self.level = level
        self.fast = fast  # FAST_LITERALS parameters, reported as ``level`` 1

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        """``tensor`` records: always, with the fast-literals parameters into a reused planes
        buffer. ``xor``: from ``policy.dense_min_rate`` of changed elements on (or the higher
        rate an earlier encoding asked for), where it can win; the whole xor comes from the
        attempt."""
        policy = attempt.policy
        if attempt.kind == "tensor":
            planes = attempt.buffer("planes", np.dtype(np.uint8), attempt.changes.values.nbytes)
            return Candidate.encoded(cls.name, *cls(policy.dense_level, fast=True).encode(
                "tensor", attempt.changes, planes=planes))
        if attempt.rate < max(policy.dense_min_rate, attempt.whole_box_min_rate):
            return None
        return Candidate.encoded(cls.name, *cls(policy.dense_level).encode(
            attempt.kind, attempt.changes, full=attempt.full_xor()))

    def encode(self, kind: str, changes: ChangeSet, full: np.ndarray | None = None,
               planes: np.ndarray | None = None) -> tuple[dict, bytes]:
        """``full`` (the box's whole xor array) saves a scatter when the caller has it;
        ``planes`` (uint8, n x width) is a reusable buffer for the byte planes."""
        self.check_kind(kind)
        if full is None:
            if changes.positions is None:
                full = changes.values
            else:
                full = np.zeros(changes.n, dtype=changes.values.dtype)
                full[changes.positions] = changes.values
        planes = to_planes(np.ascontiguousarray(full), out=planes)
        if self.fast:
            return {"level": 1}, zstd_compress_planes(planes, full.size, FAST_LITERALS)
        return {"level": self.level}, zstd_compress_planes(planes, full.size, self.level)

    def decode_tensor_into(self, params, payload, out: np.ndarray) -> None:
        """A ``tensor`` record's words decoded straight into ``out`` (its box's words, unsigned,
        contiguous): decode's checks, without the array of values it returns."""
        check_params(self.name, params, {"level": ZSTD_LEVELS})
        from_planes(zstd_decompress_exact(payload, out.nbytes), out.size, out.dtype, out=out)

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        self.check_kind(kind)
        check_params(self.name, params, {"level": ZSTD_LEVELS})
        full = from_planes(zstd_decompress_exact(payload, n * word.itemsize), n, word)
        if kind == "tensor":
            if k != n:
                raise IntegrityError(f"tensor record declares {k} of {n} elements")
            return ChangeSet(n, None, full)
        positions = np.flatnonzero(full)
        if positions.size != k:
            raise IntegrityError(f"dense xor mask holds {positions.size} changes, record says {k}")
        return ChangeSet(n, positions, full[positions])
