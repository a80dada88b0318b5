"""Build records from a base and a new tensor, and apply records to words. Pure: no I/O.

Both directions are vectorised: per record the work is a few numpy passes over the box
(diff) or over the changed positions (apply), never a Python loop per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .codec import ChangeSet, decode_changes
from .codec.dense import DenseEncoding
from .codec.raw import RawEncoding
from .codec.sparse import SparseEncoding
from .coords import Box, box_to_tensor_flat, box_view, numel, row_blocks, word_dtype
from .errors import IntegrityError
from .format import Record
from .state import TensorBits, TensorInfo, words_digest

# A record covers at most this many elements, so that encode and apply stream in chunks.
DEFAULT_CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class EncodePolicy:
    """How the writer picks a record's encoding: the smallest of the candidates it tries.

    Sparse is not tried above ``sparse_max_rate`` and dense not below ``dense_min_rate`` of
    changed elements, where they cannot win; raw is always a candidate (its size is known).
    """

    sparse_level: int = 9
    dense_level: int = 3
    sparse_max_rate: float = 0.6
    dense_min_rate: float = 0.05
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS


def _smallest(candidates: list[tuple[str, dict, bytes]]) -> tuple[str, dict, bytes]:
    return min(candidates, key=lambda c: len(c[2]))


class Differ:
    """Turns (base, new) tensor pairs into records, reusing scratch buffers across calls."""

    def __init__(self, policy: EncodePolicy | None = None):
        self.policy = policy or EncodePolicy()
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self._mask: np.ndarray | None = None

    def _buf(self, word: np.dtype, n: int) -> np.ndarray:
        buf = self._scratch.get(word)
        if buf is None or buf.size < n:
            buf = self._scratch[word] = np.empty(max(n, 1), dtype=word)
        return buf[:n]

    def _mask_buf(self, n: int) -> np.ndarray:
        if self._mask is None or self._mask.size < n:
            self._mask = np.empty(max(n, 1), dtype=np.bool_)
        return self._mask[:n]

    def diff(self, name: str, base: TensorBits | None, new: TensorBits, kind: str = "xor") -> Iterator[Record]:
        """Records taking ``base`` to ``new``. A new, reshaped or retyped tensor gets ``tensor`` records."""
        whole = base is None or base.dtype != new.dtype or base.shape != new.shape
        for box in row_blocks(new.shape, self.policy.chunk_elements):
            new_box = box_view(new.words, new.shape, box)
            if whole:
                yield self._tensor_record(name, box, new_box)
                continue
            base_box = box_view(base.words, base.shape, box)
            rec = self._delta_record(name, box, base_box, new_box, kind)
            if rec is not None:
                yield rec

    def _tensor_record(self, name: str, box: Box, values: np.ndarray) -> Record:
        p = self.policy
        changes = ChangeSet(values.size, None, values)
        cands = [("raw", *RawEncoding().encode("tensor", changes))]
        cands.append(("dense", *DenseEncoding(p.dense_level).encode("tensor", changes)))
        enc, params, payload = _smallest(cands)
        return Record(name, "tensor", box, enc, params, values.size, 0, words_digest(values), payload)

    def _delta_record(self, name, box, base_box, new_box, kind) -> Record | None:
        p = self.policy
        n = new_box.size
        xor = np.bitwise_xor(base_box, new_box, out=self._buf(new_box.dtype, n))
        positions = np.flatnonzero(np.not_equal(xor, 0, out=self._mask_buf(n)))
        k = positions.size
        if k == 0:
            return None
        values = xor[positions] if kind == "xor" else new_box[positions]
        changes = ChangeSet(n, positions, values)
        w = new_box.dtype.itemsize
        cands = [("raw", {}, None)]  # raw's size is known without encoding it
        raw_size = k * (8 + w)
        rate = k / n
        if rate <= p.sparse_max_rate:
            cands.append(("sparse", *SparseEncoding(p.sparse_level).encode(kind, changes)))
        if kind == "xor" and rate >= p.dense_min_rate:
            cands.append(("dense", *DenseEncoding(p.dense_level).encode(kind, changes, full=xor)))
        enc, params, payload = min(cands, key=lambda c: raw_size if c[2] is None else len(c[2]))
        if payload is None:
            params, payload = RawEncoding().encode(kind, changes)
        return Record(
            name, kind, box, enc, params, k,
            words_digest(base_box[positions]), words_digest(new_box[positions]), payload,
        )


def decode_record(record: Record, info: TensorInfo) -> ChangeSet:
    """Decode a record's payload for a tensor of the given (new) dtype and shape."""
    if record.tensor != info.name:
        raise IntegrityError(f"record for {record.tensor!r} checked against {info.name!r}")
    record.box.check_inside(info.shape)
    return decode_changes(
        record.kind, record.encoding, record.params, record.payload,
        record.box.size, record.n_changed, word_dtype(info.dtype),
    )


def flat_positions(record: Record, shape: tuple[int, ...], changes: ChangeSet) -> np.ndarray | slice:
    """Where the record's values go in the tensor's flat words: indices, or a slice for whole boxes."""
    if changes.positions is None and record.box.is_row_block(shape):
        start = record.box.flat_start(shape)
        return slice(start, start + record.box.size)
    positions = np.arange(record.box.size) if changes.positions is None else changes.positions
    return box_to_tensor_flat(record.box, shape, positions)


def apply_to_words(record: Record, changes: ChangeSet, words: np.ndarray, shape: tuple[int, ...],
                   check: bool = True) -> None:
    """Apply one decoded record to a tensor's flat words in place.

    With ``check`` the base digest is verified before any write and the target digest after.
    """
    where = flat_positions(record, shape, changes)
    if check and record.kind != "tensor" and words_digest(words[where]) != record.base_digest:
        raise IntegrityError(f"{record.tensor}: base values differ from the record's precondition")
    if record.kind == "xor":
        words[where] ^= changes.values
    else:
        words[where] = changes.values
    if check and words_digest(words[where]) != record.target_digest:
        raise IntegrityError(f"{record.tensor}: values after apply differ from the record's target")


def empty_words(info: TensorInfo) -> np.ndarray:
    return np.zeros(numel(info.shape), dtype=word_dtype(info.dtype))
