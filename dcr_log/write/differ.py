"""Build records from a base and a new tensor, and apply records to words. Pure: no I/O.

Both directions are vectorised: per record the work is a few numpy passes over the box
(diff) or over the changed positions (apply), never a Python loop per element."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from dcr_log import native
from dcr_log.codec import Attempt, ChangeSet, choose
from dcr_log.codec.dense import DEFAULT_LEVEL as DENSE_LEVEL
from dcr_log.codec.sparse import DEFAULT_LEVEL as SPARSE_LEVEL
from dcr_log.codec.ulp import DEFAULT_LEVEL as ULP_LEVEL
from dcr_log.coords import Box, box_to_tensor_flat, box_view, row_blocks
from dcr_log.digest import MASK64, XXH3, DigestScheme
from dcr_log.format import Record
from dcr_log.format.commit import ULP_ENCODING
from dcr_log.log.records import scatter_words
from dcr_log.parallel import DEFAULT_WORKERS, map_ordered
from dcr_log.state import TensorBits

# A record covers at most this many elements, so that encode and apply stream in chunks and
# the chunks of a large tensor are encoded in parallel. 4 Mi elements (8 MiB of bf16) keep the
# per-record overhead (~200 bytes) under 0.5% of a 1%-changed record's payload.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


# Tensors smaller than this are encoded on the calling thread: a thread hop costs more.
PARALLEL_MIN_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class EncodePolicy:
    """How the writer picks a record's encoding: the smallest of the candidates the encodings
    of dcr_log.codec.registry offer (each encoding's try_encode reads its own fields here).

    Sparse is not tried above ``sparse_max_rate`` and dense not below ``dense_min_rate`` of
    changed elements, where they cannot win; raw is always a candidate (its size is known).
    """

    sparse_level: int = SPARSE_LEVEL
    dense_level: int = DENSE_LEVEL
    sparse_max_rate: float = 0.6
    dense_min_rate: float = 0.05
    # With the ulp encoding (logs with the feature ulp-encoding): dense is tried only from
    # this rate on (below it ulp is smaller on every weight pair measured), and sparse only
    # when ulp's payload is above ``ulp_sparse_ratio`` of raw's (words that are not floats).
    ulp_level: int = ULP_LEVEL
    ulp_dense_min_rate: float = 0.3
    ulp_sparse_ratio: float = 0.5
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    workers: int = DEFAULT_WORKERS


class _Scratch:
    """One thread's reusable buffers (a full-box pass must not allocate per record)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, np.dtype], np.ndarray] = {}
        self.dense_masks = 0  # a speed hint only: boxes to scan plainly before trying again

    def get(self, tag: str, dtype: DTypeLike, n: int) -> np.ndarray:
        key = (tag, np.dtype(dtype))
        buf = self._bufs.get(key)
        if buf is None or buf.size < n:
            buf = self._bufs[key] = np.empty(max(n, 1), dtype=dtype)
        return buf[:n]


def _simple_changes(base: np.ndarray, new: np.ndarray, scratch: _Scratch
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mask = np.not_equal(base, new, out=scratch.get("mask", np.bool_, base.size))
    positions = np.flatnonzero(mask)
    return positions, base[positions], new[positions]


def _flatnonzero_sparse(mask: np.ndarray, scratch: _Scratch) -> np.ndarray:
    """np.flatnonzero of a boolean mask, faster when few entries are set.

    The mask is first read 8 entries at a time (as uint64 words): only the words with a set
    entry are expanded. At 1% changed bf16 (~4% of 4-word groups set) this halves the cost;
    when most words have an entry set it falls back to the plain scan (1/8 extra work).
    """
    n = mask.size
    if n < 1024 or n % 8 or scratch.dense_masks > 2:
        scratch.dense_masks = max(scratch.dense_masks - 1, 0)  # retry the sparse path now and then
        return np.flatnonzero(mask)
    words = mask.view(np.uint64)
    coarse = np.flatnonzero(np.not_equal(words, 0, out=scratch.get("coarse", np.bool_, words.size)))
    if coarse.size * 2 > words.size:
        # Dense: the plain scan is faster. Skip the coarse pass for the next boxes too.
        scratch.dense_masks = 8
        return np.flatnonzero(mask)
    fine = np.take(words, coarse, out=scratch.get("fine", np.uint64, coarse.size), mode="clip")
    idx = np.flatnonzero(fine.view(np.bool_))
    hits = coarse[idx >> 3]
    hits <<= 3
    np.bitwise_and(idx, 7, out=idx)
    hits += idx
    return hits


# dcr_log._changes.find's vector path stores whole registers: its outputs hold this many
# entries past the box (with fewer it takes the scalar path).
FIND_SLACK = getattr(native.changes, "FIND_SLACK", 0)

# find_changes works through a box in pieces of this many words, so that the gathers that
# follow the compare pass find the piece still in the L2 cache (measured ~25% faster at 1%).
FIND_PIECE_WORDS = 1 << 19


def _lane_changes(b64: np.ndarray, n64: np.ndarray, word: np.dtype, offset: int, scratch: _Scratch
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Changes between two aligned uint64 views holding ``word``-sized words, positions + offset."""
    lanes = 8 // word.itemsize
    shift = lanes.bit_length() - 1  # lanes is 2, 4 or 8
    mask = np.not_equal(b64, n64, out=scratch.get("mask", np.bool_, b64.size))
    groups = _flatnonzero_sparse(mask, scratch)
    # take into reused buffers: no page faults on fresh outputs; "clip" skips bounds checks.
    base_groups = np.take(b64, groups, out=scratch.get("base_groups", np.uint64, groups.size), mode="clip").view(word)
    new_groups = np.take(n64, groups, out=scratch.get("new_groups", np.uint64, groups.size), mode="clip").view(word)
    # flatnonzero is several times faster on a boolean mask than on integers.
    lanes_mask = np.not_equal(base_groups, new_groups, out=scratch.get("lanes", np.bool_, base_groups.size))
    lane_idx = np.flatnonzero(lanes_mask)  # index into the groups' words
    base_vals = base_groups[lane_idx]
    new_vals = new_groups[lane_idx]
    positions = groups[lane_idx >> shift]
    positions <<= shift
    np.bitwise_and(lane_idx, lanes - 1, out=lane_idx)
    positions += lane_idx
    if offset:
        positions += offset
    return positions, base_vals, new_vals


def find_changes(base: np.ndarray, new: np.ndarray, scratch: _Scratch | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, base values, new values) where the word arrays ``base`` and ``new`` differ.

    Positions are increasing int64 indices. With the C extension this is one pass reading
    each array once; the results are copied out of per-thread buffers (O(changes)).
    """
    scratch = scratch or _Scratch()
    pos, bv, nv, in_scratch = _find_changes_in(base, new, scratch)
    if in_scratch:
        return pos.copy(), bv.copy(), nv.copy()
    return pos, bv, nv


def _find_changes_in(base: np.ndarray, new: np.ndarray, scratch: _Scratch
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """find_changes, its results left in ``scratch``'s buffers when the last item is True
    (valid until the thread's next call: the caller copies what it keeps)."""
    if (native.changes is not None and base.flags.c_contiguous and new.flags.c_contiguous
            and base.dtype == new.dtype and base.size == new.size):
        n = base.size
        word = np.dtype(f"<u{base.dtype.itemsize}")
        # FIND_SLACK entries past n: the vector path stores whole registers
        pos = scratch.get("found_positions", np.int64, n + FIND_SLACK)
        bv = scratch.get("found_base", word, n + FIND_SLACK)
        nv = scratch.get("found_new", word, n + FIND_SLACK)
        k = native.changes.find(base.view(word), new.view(word), word.itemsize, pos, bv, nv)
        return pos[:k], bv[:k].view(base.dtype), nv[:k].view(base.dtype), True
    return (*find_changes_numpy(base, new, scratch), False)


def find_changes_numpy(base: np.ndarray, new: np.ndarray, scratch: _Scratch | None = None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """find_changes in numpy. Narrow words are compared 8 bytes at a time (as uint64 lanes):
    the one full pass reads both arrays and writes a mask of n/4 bytes (bf16); only the few
    differing groups are then gathered and looked at word by word."""
    scratch = scratch or _Scratch()
    n = base.size
    w = base.dtype.itemsize
    lanes = 8 // w
    skew = base.ctypes.data % 8
    if (w == 8 or n < 64 or skew != new.ctypes.data % 8 or skew % w
            or not (base.flags.c_contiguous and new.flags.c_contiguous)):
        return _simple_changes(base, new, scratch)
    word = np.dtype(f"<u{w}")
    head = (8 - skew) % 8 // w  # words before the first 8-byte boundary
    body_end = head + (n - head) // lanes * lanes
    parts = []
    if head:
        parts.append(_simple_changes(base[:head], new[:head], scratch))
    for start in range(head, body_end, FIND_PIECE_WORDS):
        stop = min(start + FIND_PIECE_WORDS, body_end)
        b64 = base[start:stop].view(word).view(np.uint64)
        n64 = new[start:stop].view(word).view(np.uint64)
        parts.append(_lane_changes(b64, n64, word, start, scratch))
    if body_end < n:
        p, b, v = _simple_changes(base[body_end:], new[body_end:], scratch)
        parts.append((p + body_end, b, v))
    if len(parts) == 1:
        p, b, v = parts[0]
    else:
        p, b, v = (np.concatenate(x) for x in zip(*parts))
    return p, b.view(base.dtype), v.view(base.dtype)



@dataclass
class BoxDelta:
    """One box's record plus what a caller keeping the base needs to follow it.

    ``positions`` and ``new_values`` are the changed box-local positions and their new words
    (None for ``tensor`` records, which replace the whole box); ``digest_delta`` is what the
    record adds to its tensor's digest under a composable scheme (target minus base), else None.
    """

    record: Record
    positions: np.ndarray | None
    new_values: np.ndarray | None
    digest_delta: int | None
    # diff_box(..., advance=True): the new words are in ``base`` already, ``new_values`` holds
    # the words they replaced. For an xor record both are None: its payload is what undoes it
    # (Pending.abort), and keeping 10 bytes a change for a rare abort cost the copies.
    advanced: bool = False


class Differ:
    """Turns (base, new) box pairs into records, reusing scratch buffers across calls.

    Record digests follow ``digests`` (the log's scheme). Encodings are chosen by the codec
    registry among those the log's ``features`` allow; ``ulp`` (kept for callers that pass
    it) adds the feature ``ulp-encoding``. The boxes of a large tensor are encoded by
    ``policy.workers`` threads, each with its own scratch buffers; records come out in box
    order.
    """

    def __init__(self, policy: EncodePolicy | None = None, digests: DigestScheme = XXH3,
                 ulp: bool = False, features: Iterable[str] = ()):
        self.policy = policy or EncodePolicy()
        self.digests = digests
        self.features = frozenset(features) | ({ULP_ENCODING} if ulp else frozenset())
        self._local = threading.local()

    @property
    def ulp(self) -> bool:
        """Whether records may use the ulp encoding."""
        return ULP_ENCODING in self.features

    def _scratch(self) -> _Scratch:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _Scratch()
        return scratch

    def diff(self, name: str, base: TensorBits | None, new: TensorBits, kind: str = "xor",
             changed: list | None = None) -> Iterator[Record]:
        """Records taking ``base`` to ``new``. A new, reshaped or retyped tensor gets ``tensor`` records.

        ``changed``, if given, receives (flat indices, new words) of every delta record, so a
        caller keeping ``base`` can advance it by a scatter instead of a full copy.
        """
        whole = base is None or base.dtype != new.dtype or base.shape != new.shape
        boxes = row_blocks(new.shape, self.policy.chunk_elements)

        def record(box: Box) -> BoxDelta | None:
            base_box = None if whole or base is None else box_view(base.words, base.shape, box)
            return self.diff_box(name, box, new.shape, base_box, box_view(new.words, new.shape, box), kind)

        parallel = new.words.size >= PARALLEL_MIN_ELEMENTS
        for delta in map_ordered(record, boxes, self.policy.workers, parallel):
            if delta is None:
                continue
            if changed is not None and delta.positions is not None:
                changed.append((box_to_tensor_flat(delta.record.box, new.shape, delta.positions),
                                delta.new_values))
            yield delta.record

    def diff_box(self, name: str, box: Box, shape: tuple[int, ...], base: np.ndarray | None,
                 new: np.ndarray, kind: str = "xor", advance: bool = False) -> BoxDelta | None:
        """The record taking one box of tensor ``name`` (canonical ``shape``) from ``base`` to
        ``new`` (the box's words, box-local row-major); a ``tensor`` record when ``base`` is
        None; None when nothing changed. ``advance``: a record of changed positions also
        writes the new words into ``base`` once it is encoded, and gives back the words it
        replaced (BoxDelta.advanced)."""
        if base is None:
            return self._tensor_record(name, box, shape, new)
        return self._delta_record(name, box, shape, base, new, kind, advance)

    def _attempt(self, kind: str, changes: ChangeSet, base_values: np.ndarray | None,
                 new_values: np.ndarray, full_xor_source: Callable[[], np.ndarray] | None = None
                 ) -> Attempt:
        # Encodings get the thread's scratch buffers: a fresh one per box costs page faults.
        return Attempt(kind, changes, base_values, new_values, self.policy, full_xor_source,
                       buffer=self._scratch().get)

    def _tensor_record(self, name: str, box: Box, shape, values: np.ndarray) -> BoxDelta:
        changes = ChangeSet(values.size, None, values)
        enc, params, payload = choose(self._attempt("tensor", changes, None, values), self.features)
        target = self.digests.box(box, shape, values)
        rec = Record(name, "tensor", box, enc, params, values.size, 0, target, payload)
        return BoxDelta(rec, None, values, target if self.digests.composable else None)

    def _delta_record(self, name: str, box: Box, shape: tuple[int, ...], base_box: np.ndarray,
                      new_box: np.ndarray, kind: str, advance: bool = False) -> BoxDelta | None:
        n = new_box.size
        scratch = self._scratch()
        advance = advance and base_box.flags.c_contiguous and base_box.flags.writeable  # (else a copy)
        positions, base_vals, new_vals, in_scratch = _find_changes_in(base_box, new_box, scratch)
        k = positions.size
        if k == 0:
            return None
        # The delta keeps the positions and the new words (advance: the words they replace,
        # unless its xor record undoes it); the others die with this call.
        keeps = not advance or kind != "xor"
        if in_scratch and keeps:
            positions = positions.copy()
            if advance:
                base_vals = base_vals.copy()
            else:
                new_vals = new_vals.copy()
        values = np.bitwise_xor(base_vals, new_vals) if kind == "xor" else new_vals
        changes = ChangeSet(n, positions, values)

        def full_xor() -> np.ndarray:
            return np.bitwise_xor(base_box, new_box, out=scratch.get("xor", new_box.dtype, n))

        attempt = self._attempt(kind, changes, base_vals, new_vals, full_xor)
        enc, params, payload = choose(attempt, self.features)
        digests = self.digests
        base_d, target_d = digests.record(box, shape, positions, base_vals, new_vals)
        rec = Record(name, kind, box, enc, params, k, base_d, target_d, payload)
        delta = (target_d - base_d) & MASK64 if digests.composable else None
        if advance:
            out = BoxDelta(rec, positions if keeps else None, base_vals if keeps else None, delta, advanced=True)
            # Last: every read of the base words is done.
            scatter_words(base_box.reshape(-1), positions, new_vals)
            return out
        return BoxDelta(rec, positions, new_vals, delta)
