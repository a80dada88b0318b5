"""``raw``: positions as little-endian uint64, then values as little-endian words. No params."""

from __future__ import annotations

import numpy as np

from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import ChangeSet, Encoding, check_params, check_positions, delta_positions
from dcr_log.errors import IntegrityError


def payload_size(kind: str, k: int, word_size: int) -> int:
    """A raw payload's size, known without encoding it."""
    return k * word_size if kind == "tensor" else k * (8 + word_size)


class RawEncoding(Encoding):
    name = "raw"
    kinds = ("xor", "overwrite", "tensor")

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate:
        """Always a candidate; the words are copied only if it wins."""
        size = payload_size(attempt.kind, attempt.changes.k, attempt.word_size)
        return Candidate(cls.name, size, deferred=cls())

    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        self.check_kind(kind)
        values = np.ascontiguousarray(changes.values)
        if kind == "tensor":
            return {}, values.tobytes()
        return {}, delta_positions(changes).astype("<u8").tobytes() + values.tobytes()

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        self.check_kind(kind)
        check_params(self.name, params, {})
        w = word.itemsize
        pos_bytes = 0 if kind == "tensor" else 8 * k
        if len(payload) != pos_bytes + k * w:
            raise IntegrityError(f"raw payload is {len(payload)} bytes, expected {pos_bytes + k * w}")
        buf = np.frombuffer(payload, dtype=np.uint8)
        if buf.ctypes.data % 8:  # a payload lies where its segment put it: its words aligned here
            buf = buf.copy()
        values = buf[pos_bytes:].view(word)
        if kind == "tensor":
            return ChangeSet(n, None, values)
        positions = buf[:pos_bytes].view("<u8")
        check_positions(positions, n)
        return ChangeSet(n, positions, values)
