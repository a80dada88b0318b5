"""Dtypes as words, boxes in a tensor's index space, and vectorised coordinate maps.

Only bits matter to dcr-log: every safetensors dtype is handled as unsigned little-endian
words of its width. A box is a hyper-rectangle ``(offset, shape)`` inside a tensor whose
elements are enumerated in row-major order; every change is addressed by a box plus
box-local positions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from dcr_log.errors import IntegrityError, UsageError

# safetensors dtype name -> width of one element in bytes.
DTYPE_WIDTH: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}

_WORD_BY_WIDTH: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPE_WIDTH:
        raise UsageError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_WIDTH)}")
    return dtype


def word_dtype(dtype: str) -> np.dtype:
    """The unsigned little-endian numpy dtype that holds one element of ``dtype``."""
    return _WORD_BY_WIDTH[DTYPE_WIDTH[check_dtype(dtype)]]


def unsigned_words(words: np.ndarray) -> np.ndarray:
    """``words`` seen as unsigned little-endian integers of their width, what the C kernels
    and the digests read: the array itself where it already is one (a receiver's words, so
    no view is made twice a record), else a view (TypeError for an array of objects, or of
    a width no unsigned integer has)."""
    dt = words.dtype
    if dt.kind == "u" and dt.isnative:
        return words
    if dt.itemsize not in _WORD_BY_WIDTH:
        raise TypeError(f"no unsigned integer is {dt.itemsize} bytes wide ({dt})")
    return words.view(_WORD_BY_WIDTH[dt.itemsize])


def numel(shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(int(s) for s in shape)


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle ``offset .. offset+shape`` in a tensor's index space."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    # Cached: a receiver asks each record's box for it several times.
    @functools.cached_property
    def size(self) -> int:
        return numel(self.shape)

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    def check_inside(self, tensor_shape: tuple[int, ...]) -> None:
        if len(self.offset) != len(tensor_shape) or len(self.shape) != len(tensor_shape):
            raise IntegrityError(
                f"box rank {len(self.shape)} does not match tensor rank {len(tensor_shape)}"
            )
        for o, s, t in zip(self.offset, self.shape, tensor_shape):
            if o < 0 or s < 0 or o + s > t:
                raise IntegrityError(f"box {self} lies outside a tensor of shape {tensor_shape}")

    def check_inside_or_usage(self, tensor_shape: tuple[int, ...], name: str) -> None:
        """As check_inside, for boxes a caller gave (a UsageError, not damage)."""
        try:
            self.check_inside(tensor_shape)
        except IntegrityError as exc:
            raise UsageError(f"tensor {name!r}: {exc}") from None

    def is_row_block(self, tensor_shape: tuple[int, ...]) -> bool:
        """True when the box is contiguous in the tensor's flat row-major order."""
        return tuple(self.offset[1:]) == (0,) * (len(tensor_shape) - 1) and tuple(
            self.shape[1:]
        ) == tuple(tensor_shape[1:])

    def flat_start(self, tensor_shape: tuple[int, ...]) -> int:
        """Flat index of the box's first element (meaningful for row blocks)."""
        if not tensor_shape:
            return 0
        return int(self.offset[0]) * numel(tensor_shape[1:])


def tiles(boxes: list[Box], shape: tuple[int, ...]) -> bool:
    """Whether ``boxes`` (each inside ``shape``) cover every element of a tensor of ``shape``
    exactly once: their sizes add up to its size and no two of them meet."""
    boxes = [b for b in boxes if b.size]
    if sum(b.size for b in boxes) != numel(shape):
        return False
    if len(boxes) < 2:
        return True
    if all(b.is_row_block(shape) for b in boxes):  # the usual case: flat spans, sorted
        spans = sorted((b.flat_start(shape), b.size) for b in boxes)
        return all(s + n <= t for (s, n), (t, _) in zip(spans, spans[1:]))
    # Any boxes: two meet when their ranges overlap in every dimension. Sizes add up, so
    # disjoint boxes tile; checked pairwise in blocks of rows (vectorised, bounded memory).
    lo = np.array([b.offset for b in boxes], dtype=np.int64)
    hi = lo + np.array([b.shape for b in boxes], dtype=np.int64)
    step = max(1, (1 << 22) // len(boxes))
    for i in range(0, len(boxes), step):
        meet = np.all((lo[i:i + step, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[i:i + step, None, :]), axis=2)
        rows = np.arange(i, min(i + step, len(boxes)))
        meet[rows - i, rows] = False
        if meet.any():
            return False
    return True


def row_blocks(shape: tuple[int, ...], max_elements: int) -> list[Box]:
    """Split a tensor into contiguous row-block boxes of at most ``max_elements`` each.

    A 0-d tensor is one box; a row larger than ``max_elements`` still forms one box (a box
    never splits a row). Empty tensors have no boxes.
    """
    shape = tuple(int(s) for s in shape)
    n = numel(shape)
    if n == 0:
        return []
    if not shape:
        return [Box((), ())]
    row = numel(shape[1:])
    rows_per_box = max(1, max_elements // row)
    tail = shape[1:]
    zeros = (0,) * len(tail)
    return [
        Box((r,) + zeros, (min(rows_per_box, shape[0] - r),) + tail)
        for r in range(0, shape[0], rows_per_box)
    ]


def box_to_tensor_flat(
    box: Box, tensor_shape: tuple[int, ...], positions: np.ndarray
) -> np.ndarray:
    """Map box-local row-major positions to flat row-major indices of the tensor."""
    positions = np.asarray(positions, dtype=np.int64)
    if box.is_row_block(tensor_shape):
        return positions + box.flat_start(tensor_shape)
    local = np.unravel_index(positions, box.shape)
    idx = tuple(li + o for li, o in zip(local, box.offset))
    return np.ravel_multi_index(idx, tensor_shape).astype(np.int64, copy=False)


def tensor_flat_to_box(box: Box, tensor_shape: tuple[int, ...], flat: np.ndarray) -> np.ndarray:
    """Map flat tensor indices (inside the box) to box-local row-major positions."""
    flat = np.asarray(flat, dtype=np.int64)
    if box.is_row_block(tensor_shape):
        return flat - box.flat_start(tensor_shape)
    idx = np.unravel_index(flat, tensor_shape)
    local = tuple(i - o for i, o in zip(idx, box.offset))
    return np.ravel_multi_index(local, box.shape).astype(np.int64, copy=False)


def box_view(words: np.ndarray, tensor_shape: tuple[int, ...], box: Box) -> np.ndarray:
    """A view (row blocks) or copy (other boxes) of a flat word array's box, flattened."""
    if box.is_row_block(tensor_shape):
        start = box.flat_start(tensor_shape)
        return words[start : start + box.size]
    nd = words.reshape(tensor_shape)
    sl = tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))
    return nd[sl].reshape(-1)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The flat row-major range ``[start, stop)`` of a tensor as few boxes, in flat order.

    Each box is contiguous in the tensor's flat order (a partial innermost run, whole rows,
    and so on up), so ``[start, stop)`` of a flat buffer fills the boxes one after another:
    an FSDP flat shard becomes at most 2 x rank - 1 boxes.
    """
    shape = tuple(int(s) for s in shape)
    total = numel(shape)
    if not 0 <= start <= stop <= total:
        raise UsageError(f"flat range [{start}, {stop}) lies outside a tensor of {total} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = numel(shape[1:])
    tail = shape[1:]
    zeros = (0,) * len(tail)
    if inner == 0:
        return []
    r0, r1 = start // inner, (stop - 1) // inner
    if start % inner == 0 and stop % inner == 0:
        return [Box((r0,) + zeros, ((stop - start) // inner,) + tail)]
    if r0 == r1:
        return [Box((r0,) + b.offset, (1,) + b.shape)
                for b in flat_range_boxes(tail, start - r0 * inner, stop - r0 * inner)]
    boxes: list[Box] = []
    first_full = r0
    if start % inner:
        boxes += [Box((r0,) + b.offset, (1,) + b.shape)
                  for b in flat_range_boxes(tail, start - r0 * inner, inner)]
        first_full = r0 + 1
    last_full = r1 + 1 if stop % inner == 0 else r1
    if last_full > first_full:
        boxes.append(Box((first_full,) + zeros, (last_full - first_full,) + tail))
    if stop % inner:
        boxes += [Box((r1,) + b.offset, (1,) + b.shape)
                  for b in flat_range_boxes(tail, 0, stop - r1 * inner)]
    return boxes


def flat_span(box: Box, shape: tuple[int, ...]) -> tuple[int, int]:
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


def box_end(box: Box) -> tuple[int, ...]:
    return tuple(o + s for o, s in zip(box.offset, box.shape))


def boxes_intersect(a: Box, b: Box) -> bool:
    if a.size == 0 or b.size == 0:
        return False
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape))


def flat_inside(box: Box, tensor_shape: tuple[int, ...], flat: np.ndarray) -> np.ndarray:
    """A boolean mask: which of the tensor flat indices ``flat`` lie inside ``box``."""
    flat = np.asarray(flat, dtype=np.int64)
    if box.is_row_block(tensor_shape):
        start = box.flat_start(tensor_shape)
        return (flat >= start) & (flat < start + box.size)
    idx = np.unravel_index(flat, tensor_shape)
    inside = np.ones(flat.shape, dtype=bool)
    for i, o, s in zip(idx, box.offset, box.shape):
        inside &= (i >= o) & (i < o + s)
    return inside
