"""TODO"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, wait

import numpy as np

from dcr_log.digest import DigestScheme
from dcr_log.format import Record
from dcr_log.log.records import apply_to_words, decode_record
from dcr_log.parallel import DEFAULT_WORKERS, shared_pool
from dcr_log.state import TensorBits


def _covers_exactly(pieces: list | None, count: int) -> bool:
    """Whether (flat start, size, ...) spans cover 0..count-1 once each, without gaps."""
    if pieces is None or (not pieces and count):
        return False
    end = 0
    for start, size, *_ in sorted(pieces):
        if start != end:
            return False
        end = start + size
    return end == count




# Records of boxes smaller than this are applied on the calling thread: a hop costs more.
PARALLEL_MIN_ELEMENTS = 1 << 16


def _decode_and_apply(rec: Record, info, bits: TensorBits, digests: DigestScheme) -> None:
    apply_to_words(rec, decode_record(rec, info), bits.words, bits.shape, digests)


class _ParallelApply:
    """Decodes and applies the records of one version on a few threads, as if in order.

    Records of one version never overlap, but a reader does not take that on trust: a record
    whose flat span may meet an earlier record's span in the same tensor waits until every
    earlier record is applied, so the result is always that of applying them in order.
    A bounded number of records is in flight; on the first error the rest are drained and the
    error is raised.
    """

    def __init__(self, digests: DigestScheme, window: int = 2 * DEFAULT_WORKERS):
        self._digests = digests
        self._window = window
        self._pending: deque[Future] = deque()
        self._span_end: dict[str, int] = {}  # per tensor: end of the flat spans submitted

    def __enter__(self) -> _ParallelApply:
        return self

    def submit(self, rec: Record, info, bits: TensorBits) -> None:
        start, end = _flat_span(rec.box, info.shape)
        if start < self._span_end.get(rec.tensor, 0):
            self._drain()  # may overlap an earlier record: let everything before it land first
            self._span_end.clear()
        self._span_end[rec.tensor] = max(end, self._span_end.get(rec.tensor, 0))
        if rec.box.size < PARALLEL_MIN_ELEMENTS:
            _decode_and_apply(rec, info, bits, self._digests)
            return
        self._pending.append(shared_pool(DEFAULT_WORKERS).submit(_decode_and_apply, rec, info, bits,
                                                                self._digests))
        while len(self._pending) > self._window:
            self._pending.popleft().result()

    def _drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._drain()
        finally:
            # On any error let the records in flight finish (nothing may write to the state
            # after apply_version returns); the first error is the one raised.
            wait(self._pending)
            self._pending.clear()


def _flat_span(box, shape: tuple[int, ...]) -> tuple[int, int]:
    """[first, last + 1) flat indices of a box's elements: every element lies inside."""
    if box.size == 0:
        return 0, 0
    if not shape:
        return 0, 1
    first = last = 0
    for o, s, dim in zip(box.offset, box.shape, shape):
        first = first * dim + o
        last = last * dim + o + s - 1
    return first, last + 1


def state_equal(a: dict[str, TensorBits], b: dict[str, TensorBits]) -> bool:
    """Bit-exact equality of two states (same names, dtypes, shapes and words)."""
    return a.keys() == b.keys() and all(a[k].same_bits(b[k]) for k in a)


def as_numpy(state: dict[str, TensorBits]) -> dict[str, np.ndarray]:
    """Shaped word arrays (bf16 as uint16 and so on): the bits, in numpy."""
    return {name: bits.words.reshape(bits.shape) for name, bits in state.items()}
