"""Records applied to words: decode a record's payload for its tensor, locate its changes
(box or flat), and turn current words and payload values into target words (xor, ulp steps,
plain values) or back into bases. Pure array code: no I/O."""

from __future__ import annotations

import numpy as np

from dcr_log import buffers, native
from dcr_log.codec import ChangeSet, decode_changes
from dcr_log.codec.dense import DenseEncoding
from dcr_log.codec.registry import check_counts
from dcr_log.codec.ulp import step_from
from dcr_log.coords import box_to_tensor_flat, numel, unsigned_words, word_dtype
from dcr_log.digest import XXH3, DigestScheme
from dcr_log.errors import IntegrityError
from dcr_log.format import Record
from dcr_log.format.tensors import TensorInfo


def _check_placed(record: Record, info: TensorInfo) -> None:
    if record.tensor != info.name:
        raise IntegrityError(f"record for {record.tensor!r} checked against {info.name!r}")
    record.box.check_inside(info.shape)


def decode_record(record: Record, info: TensorInfo, flat: bool = False) -> ChangeSet:
    """Decode a record's payload for a tensor of the given (new) dtype and shape. With
    ``flat``, a row block's positions come as the tensor's flat ones (ChangeSet.origin, its
    flat start: what flat_positions then returns as it is)."""
    _check_placed(record, info)
    box = record.box
    origin = box.flat_start(info.shape) if flat and box.is_row_block(info.shape) else 0
    try:
        return decode_changes(
            record.kind, record.encoding, record.params, record.payload,
            box.size, record.n_changed, word_dtype(info.dtype), origin,
        )
    finally:
        if record.done is not None:
            record.done()


def decode_dense_tensor_into(record: Record, info: TensorInfo, words: np.ndarray) -> slice:
    """A ``dense`` ``tensor`` record of a row block decoded straight into the tensor's flat
    ``words`` (unsigned), with decode_record's checks and no array of values; where it wrote."""
    _check_placed(record, info)
    check_counts(record.kind, record.box.size, record.n_changed)
    start = record.box.flat_start(info.shape)
    where = slice(start, start + record.box.size)
    try:
        DenseEncoding().decode_tensor_into(record.params, record.payload, words[where])
    finally:
        if record.done is not None:
            record.done()
    return where


def flat_positions(record: Record, shape: tuple[int, ...], changes: ChangeSet) -> np.ndarray | slice:
    """Where the record's values go in the tensor's flat words: indices, or a slice for whole
    boxes. A row block decoded with its flat start as origin (decode_record's ``flat``), or at
    the tensor's start, has flat positions equal to the decoded ones: the decoded array
    itself, not a copy (every caller only reads it): a receiver's pass one then makes no
    second array of positions for the record, nor reads and writes one."""
    box = record.box
    if box.is_row_block(shape):
        start = box.flat_start(shape)
        if changes.positions is None:
            return slice(start, start + box.size)
        if changes.origin == start:
            return np.asarray(changes.positions, dtype=np.int64)
    if changes.positions is None:
        positions = np.arange(box.size)
    else:
        positions = changes.positions - changes.origin if changes.origin else changes.positions
    return box_to_tensor_flat(box, shape, positions)


def _native_moves(words: np.ndarray, where) -> bool:
    """Whether the C gather and scatter take these arrays (callers check that the C module
    loaded). Words at an offset that is not a multiple of their width (a safetensors file may
    place a tensor anywhere after its header) take numpy's indexing."""
    return (isinstance(where, np.ndarray) and where.dtype == np.int64
            and where.ndim == 1 and where.flags.c_contiguous and words.ndim == 1
            and words.flags.c_contiguous and words.flags.aligned and words.dtype.itemsize in (1, 2, 4, 8))


def gather_words(words: np.ndarray, where) -> np.ndarray:
    """``words[where]`` (a copy), with the C gather for index arrays: it requests the cache
    lines of later positions early, where numpy waits for each in turn (on 1% of a 256 MiB
    array, gathers 1.2x and scatters 1.5x faster; tools/bench_codec.py)."""
    changes = native.changes
    if changes is None or not _native_moves(words, where):
        return words[where].copy() if isinstance(where, slice) else words[where]
    out = np.empty(where.size, dtype=words.dtype)
    changes.gather(unsigned_words(words), where, words.itemsize, unsigned_words(out))
    return out


def scatter_words(words: np.ndarray, where, values: np.ndarray) -> None:
    """``words[where] = values``, with the C scatter for index arrays (see gather_words)."""
    changes = native.changes
    if (changes is None or not _native_moves(words, where) or values.shape != where.shape
            or values.dtype.itemsize != words.dtype.itemsize or not values.flags.aligned):
        words[where] = values
        return
    values = np.ascontiguousarray(values)
    changes.scatter(unsigned_words(words), where, words.itemsize, unsigned_words(values))


def record_targets(kind: str, changes: ChangeSet, current: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The words a record writes where ``current`` holds its base: ``values`` are the record's
    values at those positions (all of them, or the subset a receiver holds)."""
    if kind != "xor":
        return values
    if not isinstance(current, np.ndarray):  # torch words on their device
        from dcr_log import torch_ops

        return torch_ops.step_from(current, values) if changes.relative else current ^ values
    if changes.relative:
        return step_from(current, values)
    return np.bitwise_xor(current, values)


def classify_at(words: np.ndarray, where: np.ndarray, values: np.ndarray, relative: bool
                ) -> tuple[np.ndarray, np.ndarray, int, int] | None:
    """An xor record's words at flat positions ``where`` of a tensor's unsigned ``words``, its
    targets (``values`` as ulp distances, ``relative``, or xor words) and the sum digest parts
    of both, in one C pass (what gather_words, record_targets and two sum_at calls give); None
    where the C module is not built or the arrays are not in the form it takes."""
    digest = native.digest
    width = words.dtype.itemsize
    if (digest is None or not _native_moves(words, where) or type(values) is not np.ndarray
            or values.shape != where.shape or values.dtype.itemsize != width or not values.flags.c_contiguous
            or not values.flags.aligned or words.dtype.hasobject or values.dtype.hasobject):
        return None
    current = np.empty(where.size, dtype=words.dtype)
    target = np.empty(where.size, dtype=words.dtype)
    sums = digest.classify(unsigned_words(words), where, unsigned_words(values), width, relative,
                           unsigned_words(current), unsigned_words(target))
    return current, target, sums[0], sums[1]


def record_bases(kind: str, changes: ChangeSet, target: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Inverse of record_targets for ``xor`` records: the base words, from the target's."""
    if not isinstance(target, np.ndarray):
        from dcr_log import torch_ops

        return torch_ops.step_from(target, values, backwards=True) if changes.relative else target ^ values
    if changes.relative:
        return step_from(target, values, backwards=True)
    return np.bitwise_xor(target, values)


def apply_to_words(record: Record, changes: ChangeSet, words: np.ndarray, shape: tuple[int, ...],
                   digests: DigestScheme = XXH3, check: bool = True) -> None:
    """Apply one decoded record to a tensor's flat words in place.

    With ``check`` the base digest (of the values found) and the target digest (of the values
    to write) are both verified before anything is written: a failing record leaves the words
    as they were. One gather and one scatter per record.
    """
    positions = changes.positions
    if (record.kind != "tensor" and positions is not None and not changes.origin
            and record.box.is_row_block(shape)):
        # A row block is a contiguous run of the words: moved at its box-local positions, with
        # both digests in one pass over them (no flat index array).
        start = record.box.flat_start(shape)
        run = words[start:start + record.box.size]
        current = gather_words(run, positions)
        target = record_targets(record.kind, changes, current, changes.values)
        if check:
            base_digest, target_digest = digests.record(record.box, shape, positions, current, target)
            if base_digest != record.base_digest:
                raise IntegrityError(f"{record.tensor}: base values differ from the record's precondition")
            if target_digest != record.target_digest:
                raise IntegrityError(f"{record.tensor}: values to write differ from the record's target")
        scatter_words(run, positions, target)
        return
    where = flat_positions(record, shape, changes)
    if record.kind == "tensor":
        target = changes.values
    else:
        current = gather_words(words, where)  # ``where`` is an index array for xor and overwrite
        if check and digests.at(where, current) != record.base_digest:
            raise IntegrityError(f"{record.tensor}: base values differ from the record's precondition")
        target = record_targets(record.kind, changes, current, changes.values)
    if check and digests.at(where, target) != record.target_digest:
        raise IntegrityError(f"{record.tensor}: values to write differ from the record's target")
    scatter_words(words, where, target)


def empty_words(info: TensorInfo) -> np.ndarray:
    try:
        return buffers.zeros(numel(info.shape), word_dtype(info.dtype))
    except (MemoryError, ValueError, OSError):
        from dcr_log.errors import StoreError

        raise StoreError(f"cannot allocate tensor {info.name!r} ({numel(info.shape)} words): "
                         "out of memory") from None
