"""Boxes and coordinate maps, checked against numpy fancy indexing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log.coords import (
    DTYPE_WIDTH,
    Box,
    box_to_tensor_flat,
    box_view,
    check_dtype,
    numel,
    row_blocks,
    tensor_flat_to_box,
    word_dtype,
)
from dcr_log.errors import IntegrityError, UsageError

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


def _covered(shape, boxes) -> np.ndarray:
    """How many boxes cover each element of the tensor (via an independent index reference)."""
    count = np.zeros(shape, dtype=np.int64)
    for box in boxes:
        sl = tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))
        count[sl] += 1
    return count


def _check_row_blocks(shape, max_elements):
    boxes = row_blocks(shape, max_elements)
    n = numel(shape)
    assert np.all(_covered(shape, boxes) == 1)
    assert sum(b.size for b in boxes) == n
    if n == 0:
        assert boxes == []
        return
    row = numel(shape[1:])
    flat = np.arange(n)
    expected_start = 0
    for box in boxes:
        box.check_inside(shape)
        assert box.is_row_block(shape)
        assert box.size >= 1
        # At most max_elements, except a single row larger than the limit (rows are never split).
        assert box.size <= max_elements or (len(shape) > 0 and box.size == row)
        assert box.flat_start(shape) == expected_start
        assert np.array_equal(box_view(flat, shape, box), np.arange(expected_start, expected_start + box.size))
        expected_start += box.size
    assert expected_start == n


@pytest.mark.parametrize("shape,max_elements", [
    ((), 1), ((), 100), ((0,), 4), ((0, 3), 4), ((3, 0), 4), ((4, 0, 2), 1), ((1,), 1), ((7,), 3),
    ((7, 3), 5), ((3, 1000), 10), ((5, 7, 11), 77), ((5, 7, 11), 76), ((5, 7, 11), 10**9), ((13, 1), 2),
])
def test_row_blocks_examples(shape, max_elements):
    _check_row_blocks(shape, max_elements)


def test_row_blocks_exact_split():
    assert row_blocks((5, 3), 6) == [Box((0, 0), (2, 3)), Box((2, 0), (2, 3)), Box((4, 0), (1, 3))]
    assert row_blocks((2, 9), 4) == [Box((0, 0), (1, 9)), Box((1, 0), (1, 9))]
    assert row_blocks((), 8) == [Box((), ())]
    assert row_blocks((0, 5), 8) == []


@settings(max_examples=150, deadline=None)
@given(shape=shapes, max_elements=st.integers(1, 60))
def test_row_blocks_cover_each_element_once(shape, max_elements):
    _check_row_blocks(shape, max_elements)


@st.composite
def boxes_in_tensors(draw):
    shape = draw(st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple))
    offset, box_shape = [], []
    for dim in shape:
        o = draw(st.integers(0, dim))
        offset.append(o)
        box_shape.append(draw(st.integers(0, dim - o)))
    box = Box(tuple(offset), tuple(box_shape))
    seed = draw(st.integers(0, 2**32 - 1))
    return shape, box, seed


@settings(max_examples=200, deadline=None)
@given(case=boxes_in_tensors())
def test_box_maps_match_fancy_indexing_and_invert(case):
    shape, box, seed = case
    rng = np.random.default_rng(seed)
    box.check_inside(shape)
    sl = tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))
    reference = np.arange(numel(shape), dtype=np.int64).reshape(shape)[sl].reshape(-1)
    assert reference.size == box.size
    positions = np.sort(rng.choice(box.size, rng.integers(0, box.size + 1), replace=False)).astype(np.int64)
    flat = box_to_tensor_flat(box, shape, positions)
    assert np.array_equal(flat, reference[positions])
    assert np.array_equal(tensor_flat_to_box(box, shape, flat), positions)
    words = rng.integers(0, 2**16, numel(shape), dtype=np.uint16)
    assert np.array_equal(box_view(words, shape, box), words.reshape(shape)[sl].reshape(-1))


def test_box_maps_general_box_example():
    """A column box (not a row block) of a 3x4 tensor: elements (0..2, 1..2)."""
    shape, box = (3, 4), Box((0, 1), (3, 2))
    assert not box.is_row_block(shape)
    flat = box_to_tensor_flat(box, shape, np.arange(6))
    assert flat.tolist() == [1, 2, 5, 6, 9, 10]
    assert tensor_flat_to_box(box, shape, np.array([10, 1, 6])).tolist() == [5, 0, 3]


def test_zero_d_box():
    box = Box.whole(())
    assert box.size == 1 and box.is_row_block(())
    assert box_to_tensor_flat(box, (), np.array([0])).tolist() == [0]
    assert box_view(np.array([42], np.uint8), (), box).tolist() == [42]


@pytest.mark.parametrize("box,shape", [
    (Box((0,), (5,)), (4,)), (Box((3,), (2,)), (4,)), (Box((-1,), (2,)), (4,)), (Box((0,), (-1,)), (4,)),
    (Box((0, 0), (1, 1)), (4,)), (Box((0,), (1,)), (4, 4)), (Box((0,), (1,)), ()),
])
def test_box_outside_tensor_rejected(box, shape):
    with pytest.raises(IntegrityError):
        box.check_inside(shape)


def test_dtypes_and_words():
    widths = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
    assert DTYPE_WIDTH == widths
    for dtype, width in widths.items():
        word = word_dtype(dtype)
        assert word.itemsize == width and word.kind == "u" and word.byteorder in ("<", "=", "|")
        assert word == np.dtype(f"<u{width}")
    for bad in ("F4", "float32", "bf16", ""):
        with pytest.raises(UsageError):
            check_dtype(bad)
    assert numel(()) == 1 and numel((0, 5)) == 0 and numel((3, 4)) == 12
