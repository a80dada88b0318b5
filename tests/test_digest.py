"""Sum digests (spec section 7.1): the C and numpy implementations against the plain-integer
reference, composition over boxes that tile a tensor, and updates by record digests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_log import digest as D
from dcr_log import native
from dcr_log.coords import Box, box_to_tensor_flat, flat_range_boxes, numel
from helpers.cpu import x86_flags

WORDS = (np.uint8, np.uint16, np.uint32, np.uint64)


def reference(flat, words) -> int:
    return sum(D.element_hash(int(f), int(w)) for f, w in zip(flat, words)) & D.MASK64


@pytest.fixture(params=["native", "numpy"])
def impl(request, monkeypatch):
    if request.param == "native":
        if native.digest is None:
            pytest.fail("dcr_log._digest is not built (pip install -e . compiles it)")
    else:
        monkeypatch.setattr(native, "digest", None)
    return request.param


def test_reference_values():
    assert D.element_hash(0, 0) == 0xE220A8397B1DCDAF
    assert D.element_hash(1, 0) == 0x6E789E6AA1B965F4
    assert D.element_hash(0, 0x3F80) == 0x2F4107AE02771311


def _box_words(full: np.ndarray, shape, box: Box) -> np.ndarray:
    return full.reshape(shape)[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)


def _spans_recorded(monkeypatch, digests, span: int) -> list[tuple[int, str]]:
    """Spans of ``span`` words for digest.box_digests, and the list where each call of the
    scheme's ``at`` records its span's length and the thread it ran on."""
    import threading

    monkeypatch.setattr(D, "DIGEST_SPAN", span)
    spans: list[tuple[int, str]] = []
    real_at = type(digests).at

    def at(self, flat, words):
        spans.append((flat.stop - flat.start, threading.current_thread().name))
        return real_at(self, flat, words)

    monkeypatch.setattr(type(digests), "at", at)
    return spans


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_sums_match_the_reference(impl, data):
    word = data.draw(st.sampled_from(WORDS))
    shape = tuple(data.draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    n = numel(shape)
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    full = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    # a few extreme words: all ones, zero, the top bit alone
    if n:
        full[rng.integers(0, n, 3)] = np.array([np.iinfo(word).max, 0, 1 << (8 * full.itemsize - 1)], dtype=word)
    assert D.SUM.tensor(full, shape) == reference(range(n), full)
    offset = tuple(data.draw(st.integers(0, s)) for s in shape)
    extent = tuple(data.draw(st.integers(0, s - o)) for s, o in zip(shape, offset))
    box = Box(offset, extent)
    words = _box_words(full, shape, box)
    flat = box_to_tensor_flat(box, shape, np.arange(box.size))
    assert D.sum_box(box, shape, words) == reference(flat, words)
    k = data.draw(st.integers(0, box.size))
    pick = np.sort(rng.choice(box.size, k, replace=False)) if k else np.empty(0, dtype=np.int64)
    assert D.sum_at(flat[pick], words[pick]) == reference(flat[pick], words[pick])


@pytest.mark.parametrize("word", WORDS)
def test_boxes_that_tile_a_tensor_add_up(impl, word):
    rng = np.random.default_rng(3)
    shape = (13, 5, 1021)  # odd sizes; runs longer and shorter than a numpy piece
    full = rng.integers(0, np.iinfo(word).max, numel(shape), dtype=word, endpoint=True)
    total = D.SUM.tensor(full, shape)
    # column split of the last dimension, then row split of the first
    tiles = [Box((0, 0, 0), (13, 5, 400)), Box((0, 0, 400), (6, 5, 621)), Box((6, 0, 400), (7, 5, 621))]
    assert D.add(*(D.sum_box(b, shape, _box_words(full, shape, b)) for b in tiles)) == total
    # an FSDP-style flat range cut mid-row, as contiguous boxes
    cut = 7 * 5 * 1021 + 333
    parts = flat_range_boxes(shape, 0, cut) + flat_range_boxes(shape, cut, numel(shape))
    assert D.add(*(D.sum_box(b, shape, _box_words(full, shape, b)) for b in parts)) == total


@pytest.mark.parametrize("scheme", ["sum", "xxh3"])
def test_box_digests_on_the_pool_equal_each_boxs_own(monkeypatch, scheme):
    """digest.box_digests: each box's digest as the scheme gives it whole, whether the box
    is a row block cut into spans (its flat start added: a sub-block from row 6, or mid-row
    blocks of an FSDP-style flat cut) or digested whole (a column split, a 0-d tensor, an
    empty box); xxh3 boxes never in spans."""
    import threading

    rng = np.random.default_rng(9)
    shape = (13, 5, 31)
    full = rng.integers(0, 1 << 16, numel(shape), dtype=np.uint16)
    boxes = [Box((6, 0, 0), (7, 5, 31)), Box((0, 0, 0), (13, 5, 11)), Box((0, 0, 0), (0, 5, 31)),
             *flat_range_boxes(shape, 3 * 5 * 31 + 7, 9 * 5 * 31 + 2)]
    items = [(b, shape, _box_words(full, shape, b)) for b in boxes]
    items.append((Box((), ()), (), np.array([4321], dtype=np.uint16)))
    digests = D.SumDigests() if scheme == "sum" else D.XXH3
    whole = [digests.box(b, s, w) for b, s, w in items]
    spans = _spans_recorded(monkeypatch, digests, 16)
    assert D.box_digests(digests, items, workers=2) == whole
    assert D.box_digests(digests, items, workers=2, parallel=False) == whole
    if scheme == "sum":
        assert spans and max(n for n, _ in spans) == 16
        assert {t for _, t in spans} != {threading.current_thread().name}  # on the pool
    else:
        assert spans == []


def test_a_record_moves_the_digest_by_target_minus_base(impl):
    rng = np.random.default_rng(4)
    base = rng.integers(0, 2**16, 50_000, dtype=np.uint16)
    new = base.copy()
    flat = np.sort(rng.choice(base.size, 700, replace=False))
    new[flat] ^= rng.integers(1, 2**16, flat.size, dtype=np.uint16)
    before, after = D.SUM.tensor(base, base.shape), D.SUM.tensor(new, new.shape)
    delta = D.sub(D.sum_at(flat, new[flat]), D.sum_at(flat, base[flat]))
    assert D.add(before, delta) == after
    # and the digest sees where: the same words one place further do not add up
    assert D.add(before, D.sub(D.sum_at(flat + 1, new[flat]), D.sum_at(flat + 1, base[flat]))) != after


def test_swapped_elements_change_the_digest(impl):
    words = np.arange(1000, dtype=np.uint32)
    swapped = words.copy()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert D.SUM.tensor(words, words.shape) != D.SUM.tensor(swapped, swapped.shape)


def test_native_and_numpy_agree_on_a_large_array(monkeypatch):
    if native.digest is None:
        pytest.fail("dcr_log._digest is not built")
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**16, (1 << 20) + 7, dtype=np.uint16)
    expected = D.sum_range(12345, words)
    monkeypatch.setattr(native, "digest", None)
    assert D.sum_range(12345, words) == expected


@pytest.mark.parametrize("word", WORDS)
def test_sum_at_over_any_indices_matches_the_reference(impl, word):
    """Indices in any order, repeated, and as large as int64 goes (the key wraps mod 2^64),
    for every count around the vector loops' widths (the C loop hashes 4 or 8 at a time)."""
    rng = np.random.default_rng(11)
    for k in list(range(0, 41)) + [1000, 4099]:
        flat = rng.integers(0, np.iinfo(np.int64).max, k, dtype=np.int64, endpoint=True)
        if k > 3:
            flat[:3] = [np.iinfo(np.int64).max, 0, flat[3]]  # the largest, zero, a repeat
        words = rng.integers(0, np.iinfo(word).max, k, dtype=word, endpoint=True)
        assert D.sum_at(flat, words) == reference(flat, words), k


def test_sum_at_takes_indices_and_words_in_any_form_alike(impl):
    """The receiver's form (int64 indices and unsigned words, contiguous and flat) and every
    other: unsigned or strided indices, a list, signed or float words of the same bits, words
    in two dimensions; and indices and words of different counts, and words that are Python
    objects, are refused either way."""
    rng = np.random.default_rng(12)
    flat = rng.integers(0, 1 << 40, 301, dtype=np.int64)
    words = rng.integers(0, 1 << 16, 301, dtype=np.uint16)
    expected = reference(flat, words)
    spread = np.zeros(2 * flat.size, dtype=np.int64)
    spread[::2] = flat
    forms = [(flat, words), (flat.view(np.uint64), words), (spread[::2], words), (flat.tolist(), words),
             (flat, words.view(np.int16)), (flat, words.view(np.float16)), (flat[:300].reshape(3, 100),
                                                                             words[:300].reshape(3, 100))]
    for n, (f, w) in enumerate(forms):
        want = expected if np.size(w) == words.size else reference(flat[:300], words[:300])
        assert D.sum_at(f, w) == want, n
    with pytest.raises(ValueError):
        D.sum_at(flat[:-1], words)
    with pytest.raises(TypeError):  # an array of Python objects holds pointers, not words
        D.sum_at(flat, words.astype(object))


@pytest.mark.parametrize("kind", ["numpy", "torch", "checkpoint"])
@pytest.mark.parametrize("scheme", ["sum", "xxh3"])
def test_tensor_digests_in_spans_equal_each_tensors_own(tmp_path, monkeypatch, kind, scheme):
    """tensor_digests sums a composable scheme's digest in spans on the pool: with spans of 7
    words, tensors of 0-d, empty, odd and several-span sizes get exactly the digest the
    storage gives each whole (and the xxh3 scheme, which does not compose, each whole)."""
    import threading

    from dcr_log.receiver import CheckpointStorage, NumpyStorage, TorchStorage, write_checkpoint
    from dcr_log.receiver.storage import base as storage_base
    from dcr_log.state import TensorBits, to_torch

    rng = np.random.default_rng(3)
    shapes = {"scalar": (), "empty": (0, 4), "odd": (5,), "spans": (3, 11), "long": (50,)}
    state = {n: TensorBits("BF16", s, rng.integers(0, 1 << 16, size=int(np.prod(s)), dtype=np.uint16))
             for n, s in shapes.items()}
    if kind == "numpy":
        storage = NumpyStorage({n: TensorBits(b.dtype, b.shape, b.words.copy()) for n, b in state.items()})
    elif kind == "torch":
        storage = TorchStorage({n: to_torch(b) for n, b in state.items()})
    else:
        (tmp_path / "ckpt").mkdir()
        write_checkpoint(state, tmp_path / "ckpt")
        storage = CheckpointStorage(tmp_path / "ckpt")
    digests = D.SumDigests() if scheme == "sum" else D.XXH3
    names = list(shapes)
    whole = [storage.tensor_digest(n, digests) for n in names]
    spans = _spans_recorded(monkeypatch, digests, 7)
    assert storage_base.tensor_digests(storage, names, digests, workers=2) == whole
    if scheme == "sum":
        assert sorted(n for n, _ in spans) == sorted([7] * 11 + [1, 5, 5, 1])  # 1, 5, 33 and 50 words
        assert {t for _, t in spans} != {threading.current_thread().name}  # on the pool
        # No more than a span's words in all: on this thread (the pool's hops cost more).
        spans.clear()
        assert storage_base.tensor_digests(storage, ["odd", "scalar"], digests, workers=2) == [whole[2], whole[0]]
        assert spans == [(5, threading.current_thread().name), (1, threading.current_thread().name)]
    else:
        assert spans == []
    assert storage_base.tensor_digests(storage, names, digests, workers=2, parallel=False) == whole


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(word=st.sampled_from(WORDS), n=st.one_of(st.integers(0, 40), st.integers(0, 3000), st.integers(3000, 9000)),
       start=st.one_of(st.integers(0, 1000), st.integers(2**64 - 3000, 2**64 - 1)),
       seed=st.integers(0, 2**32 - 1))
def test_every_run_loop_matches_the_reference(word, n, start, seed):
    """Each loop a run may be summed with on this CPU (RUN_PATHS: the compiled one; where
    the CPU has AVX2, the vector-and-scalar one), every word width, lengths around its steps
    of 11, and starts whose keys wrap past 2^64."""
    if native.digest is None:
        pytest.fail("dcr_log._digest is not built (pip install -e . compiles it)")
    words = np.random.default_rng(seed).integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    expected = reference(((start + i) & D.MASK64 for i in range(n)), words)
    for path in native.digest.RUN_PATHS:
        assert native.digest.sum_range(words, words.itemsize, start, path) == expected, path
    assert native.digest.sum_range(words, words.itemsize, start) == expected


@pytest.mark.parametrize("word", WORDS)
def test_runs_of_several_prefetch_blocks_match_the_reference(word):
    """A run is hashed in blocks of 4096 bytes (their lines requested first): lengths around
    one, two and several blocks, from a start whose keys wrap past 2^64, on every loop."""
    if native.digest is None:
        pytest.fail("dcr_log._digest is not built (pip install -e . compiles it)")
    per = 4096 // np.dtype(word).itemsize
    rng = np.random.default_rng(13)
    for n in (per - 1, per, per + 1, 2 * per + 3, 3 * per + 7):
        words = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
        for start in (0, 2**64 - per // 2):
            expected = reference(((start + i) & D.MASK64 for i in range(n)), words)
            for path in native.digest.RUN_PATHS:
                assert native.digest.sum_range(words, words.itemsize, start, path) == expected, (n, start, path)


def test_the_vector_and_scalar_run_loop_is_there_with_avx2():
    if native.digest is None:
        pytest.fail("dcr_log._digest is not built (pip install -e . compiles it)")
    if "avx2" in x86_flags():
        assert native.digest.RUN_PATHS == (0, 1)
