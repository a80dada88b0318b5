"""The speed paths give the same answers as the plain ones: lane-wise change finding, byte
planes by shifts, plane-aligned zstd blocks, threaded encoding and threaded replay."""

from __future__ import annotations

import hashlib
import sys
import uuid

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log import DeltaLog, IntegrityError, create_log, native
from dcr_log.codec import ChangeSet, decode_changes, get_encoding
from dcr_log.codec.base import (
    PLANE_BLOCK_MIN,
    ZSTD_BLOCK_MAX,
    from_planes,
    to_planes,
    zstd_compress_planes,
    zstd_decompress_exact,
)
from dcr_log.coords import Box
from dcr_log.format import CommitRecord, CommitStats, Record, SegmentBuilder, SegmentRef, segment_key
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.log.records import apply_to_words
from dcr_log.log.replay import PARALLEL_MIN_ELEMENTS
from dcr_log.state import TensorBits, words_digest
from dcr_log.write import differ
from dcr_log.write.differ import Differ, EncodePolicy, find_changes
from helpers.cpu import x86_flags

WORDS = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))


def reference_planes(words: np.ndarray) -> bytes:
    w = words.dtype.itemsize
    return words.view(np.uint8).reshape(-1, w).T.tobytes()


@settings(deadline=None, max_examples=40)
@given(word=st.sampled_from(WORDS), count=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1))
def test_planes_match_the_transposed_bytes(word, count, seed):
    rng = np.random.default_rng(seed)
    words = rng.integers(0, np.iinfo(word).max, count, dtype=word, endpoint=True)
    planes = to_planes(words)
    assert planes.tobytes() == reference_planes(words)
    out = np.full(count, 7, dtype=word)
    back = from_planes(planes, count, word, out=out)
    assert back is out and np.array_equal(back.view(word), words)


@pytest.mark.parametrize("find", ["native", "native-scalar", "numpy"])
@settings(deadline=None, max_examples=50)
@given(
    word=st.sampled_from(WORDS),
    n=st.one_of(st.integers(0, 80), st.integers(0, 5000)),
    base_skew=st.integers(0, 7),
    new_skew=st.integers(0, 7),
    rate=st.sampled_from([0.0, 0.001, 0.03, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_find_changes_equals_flatnonzero(find, word, n, base_skew, new_skew, rate, seed):
    """The C pass (dcr_log._changes; its AVX-512 path where the CPU has it, which the
    writer's buffers with FIND_SLACK entries to spare allow, and its scalar path, which
    exact-size buffers force) and the numpy reference, on every width and alignment."""
    rng = np.random.default_rng(seed)
    # Slices at every byte skew from an 8-byte boundary: the lane path and its fallbacks.
    base_buf = rng.integers(0, np.iinfo(word).max, n + 8, dtype=word, endpoint=True)
    new_buf = np.empty_like(base_buf)
    b0, n0 = base_skew % (8 // word.itemsize), new_skew % (8 // word.itemsize)
    base = base_buf[b0:b0 + n]
    new = new_buf[n0:n0 + n]
    new[:] = base
    flip = rng.random(n) < rate
    new[flip] ^= rng.integers(1, np.iinfo(word).max, int(flip.sum()), dtype=word, endpoint=True)
    expected = np.flatnonzero(base != new)
    for piece in (differ.FIND_PIECE_WORDS, 64):  # one piece, and many pieces per box
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(differ, "FIND_PIECE_WORDS", piece)
            if find == "native":
                mp.setattr(differ, "find_changes_numpy", None)  # the C pass or nothing
            if find == "native-scalar":
                positions, base_vals, new_vals = (np.empty(n, np.int64), np.empty(n, word), np.empty(n, word))
                k = native.changes.find(base, new, word.itemsize, positions, base_vals, new_vals)
                found = [(positions[:k], base_vals[:k], new_vals[:k])]
            else:
                found = [(find_changes if find == "native" else differ.find_changes_numpy)(base, new)]
        if find == "native":
            # and every vector path this CPU has, each asked for (the default takes the widest)
            for path in native.changes.FIND_PATHS:
                room = n + differ.FIND_SLACK
                positions, base_vals, new_vals = (np.empty(room, np.int64), np.empty(room, word),
                                                  np.empty(room, word))
                k = native.changes.find(base, new, word.itemsize, positions, base_vals, new_vals, path)
                found.append((positions[:k], base_vals[:k], new_vals[:k]))
        for positions, base_vals, new_vals in found:
            assert positions.dtype == np.int64 and np.array_equal(positions, expected)
            assert base_vals.dtype == word and np.array_equal(base_vals, base[expected])
            assert new_vals.dtype == word and np.array_equal(new_vals, new[expected])


@pytest.mark.parametrize("path", native.changes.FIND_PATHS if native.changes is not None else [0])
@pytest.mark.parametrize("word", [np.dtype("<u2"), np.dtype("<u4")])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 1000, 4096])
def test_the_vector_change_pass_writes_only_inside_its_slack(word, n, path):
    """Every word changed (the most the vector paths store): nothing is written past n +
    FIND_SLACK entries of any output, on each path this CPU has."""
    rng = np.random.default_rng(n)
    base = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    new = base ^ word.type(1)
    room = n + differ.FIND_SLACK
    outs = [np.full(room + 16, 0x5A, np.int64), np.full(room + 16, 0x5A, word), np.full(room + 16, 0x5A, word)]
    k = native.changes.find(base, new, word.itemsize, *(o[:room] for o in outs), path)
    assert k == n
    assert np.array_equal(outs[0][:n], np.arange(n)) and np.array_equal(outs[1][:n], base)
    assert np.array_equal(outs[2][:n], new)
    assert all((o[room:] == 0x5A).all() for o in outs)


def test_the_change_pass_refuses_a_negative_path():
    words = np.zeros(40, np.uint16)
    outs = [np.empty(40 + differ.FIND_SLACK, np.int64), np.empty(40 + differ.FIND_SLACK, np.uint16),
            np.empty(40 + differ.FIND_SLACK, np.uint16)]
    with pytest.raises(ValueError, match="path"):
        native.changes.find(words, words, 2, *outs, -1)


def test_the_change_pass_is_built():
    """make test builds the C extension; without it appends fall back to numpy, 1.3x slower.
    On x86-64 Linux its vector paths are there for the CPU's flags (AVX2: 1, AVX-512 with
    VBMI2: 2)."""
    assert native.changes is not None
    assert native.changes.FIND_PATHS[0] == 0
    flags = x86_flags()
    if flags:
        expect = 2 if {"avx512f", "avx512bw", "avx512vl", "avx512_vbmi2"} <= flags else 1 if "avx2" in flags else 0
        assert native.changes.FIND_PATHS[-1] == expect


@pytest.mark.parametrize("planes", [1, 2, 6])
@pytest.mark.parametrize("plane_bytes", [PLANE_BLOCK_MIN - 1, PLANE_BLOCK_MIN, 200_000])
def test_plane_aligned_frame_is_one_ordinary_frame(planes, plane_bytes):
    rng = np.random.default_rng(plane_bytes + planes)
    data = rng.integers(0, 40, planes * plane_bytes, dtype=np.uint8)  # compressible
    frame = zstd_compress_planes(data, plane_bytes, 1)
    assert zstandard.frame_content_size(frame) == data.size
    assert zstd_decompress_exact(frame, data.size).tobytes() == data.tobytes()
    # Exactly one frame: a streaming decoder finds nothing after it.
    dobj = zstandard.ZstdDecompressor().decompressobj()
    assert dobj.decompress(frame) == data.tobytes() and dobj.eof and dobj.unused_data == b""
    assert len(frame) < data.size


@pytest.mark.parametrize("plane_bytes", [ZSTD_BLOCK_MAX, 3 * ZSTD_BLOCK_MAX])
def test_block_multiple_planes_are_coded_as_the_stream_codes_them(plane_bytes):
    # Planes that are multiples of zstd's block size go through the one-shot frame: its blocks
    # must still start at the plane boundaries, so it is as small as the streamed frame that
    # flushes a block at each boundary (a block across the two planes of bf16 weights, the
    # mantissa's nearly uniform low bytes and the exponents' skewed high bytes, is not).
    rng = np.random.default_rng(plane_bytes)
    weights = (rng.standard_normal(plane_bytes).astype(np.float32) * 0.02).view(np.uint32) >> 16
    data = to_planes(weights.astype(np.uint16))
    frame = zstd_compress_planes(data, plane_bytes, 1)
    assert zstd_decompress_exact(frame, data.size).tobytes() == data.tobytes()
    stream = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=data.size)
    parts = []
    for start in range(0, data.size, plane_bytes):
        parts += [stream.compress(data[start:start + plane_bytes].tobytes()),
                  stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
    streamed = b"".join(parts + [stream.flush()])
    assert len(frame) <= len(streamed) + 16
    # The same bytes turned by half a block: blocks across the planes' boundaries cost more,
    # so the check above can tell a frame whose blocks straddle them.
    turned = np.roll(data, ZSTD_BLOCK_MAX // 2)
    assert len(zstandard.ZstdCompressor(level=1).compress(turned.tobytes())) > len(frame) + 1000


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("content", ["skewed", "random", "constant", "empty", "tiny"])
def test_a_zstd_payload_is_one_whole_frame(content, checksum):
    # Compressed, raw and RLE blocks, and a frame of no content. Anything after the frame, a
    # second frame, a skippable one, or a frame cut short (its checksum included) is refused:
    # zstd's decompress takes trailing bytes after a frame of no content.
    rng = np.random.default_rng(len(content))
    data = {"skewed": rng.geometric(0.5, 300_000).astype(np.uint8).tobytes(),
            "random": rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes(),
            "constant": b"\7" * 300_000, "empty": b"", "tiny": b"abc"}[content]
    frame = zstandard.ZstdCompressor(level=1, write_checksum=checksum, write_content_size=True).compress(data)
    got = zstd_decompress_exact(frame, len(data))
    assert got.tobytes() == data
    skippable = bytes.fromhex("502a4d18") + (3).to_bytes(4, "little") + b"abc"
    for bad in (frame + b"x", frame + frame, frame + skippable, frame[:-1], frame[: len(frame) // 2]):
        with pytest.raises(IntegrityError):
            zstd_decompress_exact(bad, len(data))


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("kind", ["xor", "overwrite"])
def test_sparse_records_with_large_planes_round_trip(word, kind):
    rng = np.random.default_rng(word.itemsize)
    n = 1 << 20
    positions = np.flatnonzero(rng.random(n) < 0.02)  # k ~ 21000: planes above PLANE_BLOCK_MIN
    values = rng.integers(1, 2**min(8 * word.itemsize, 63), positions.size, dtype=word)
    changes = ChangeSet(n, positions, values)
    params, payload = get_encoding("sparse").encode(kind, changes)
    got = decode_changes(kind, "sparse", params, memoryview(payload), n, positions.size, word)
    assert np.array_equal(got.positions, positions) and np.array_equal(got.values, values)


def _pair(rng, rows: int, cols: int, rate: float):
    base = rng.integers(0, 2**16, rows * cols, dtype=np.uint16)
    new = base.copy()
    flip = rng.random(base.size) < rate
    new[flip] ^= rng.integers(1, 2**16, int(flip.sum()), dtype=np.uint16)
    return TensorBits("BF16", (rows, cols), base), TensorBits("BF16", (rows, cols), new)


@pytest.mark.parametrize("kind", ["xor", "overwrite"])
def test_threaded_diff_gives_the_serial_records(kind):
    rng = np.random.default_rng(5)
    base, new = _pair(rng, 300, 8192, 0.02)  # 2.4M elements, boxes of 64K: many per worker
    serial = list(Differ(EncodePolicy(workers=1, chunk_elements=1 << 16)).diff("w", base, new, kind))
    threaded = list(Differ(EncodePolicy(workers=2, chunk_elements=1 << 16)).diff("w", base, new, kind))
    assert len(serial) == len(threaded) > 20
    for a, b in zip(serial, threaded):
        assert (a.box, a.encoding, a.params, a.n_changed, a.base_digest, a.target_digest) == (
            b.box, b.encoding, b.params, b.n_changed, b.base_digest, b.target_digest)
        assert bytes(a.payload) == bytes(b.payload)


def test_threaded_replay_of_many_large_records(tmp_path, monkeypatch):
    from dcr_log import parallel

    monkeypatch.setattr(parallel, "RECORD_MIN_CHANGES", 0)  # records of ~650 changes, on the pool
    rng = np.random.default_rng(6)
    base, new = _pair(rng, 64, PARALLEL_MIN_ELEMENTS, 0.01)
    other_base, other_new = _pair(rng, 7, 1000, 0.3)  # small records, applied inline
    policy = EncodePolicy(chunk_elements=PARALLEL_MIN_ELEMENTS)
    writer = create_log(tmp_path / "log", {"a": base, "b": other_base}, policy=policy)
    writer.append({"a": new, "b": other_new})
    writer.append({"a": base, "b": other_new})
    log = DeltaLog.open(tmp_path / "log")
    assert log.commit(1).stats.records > 20
    for version, expected in ((1, (new, other_new)), (2, (base, other_new))):
        state = log.materialize(version)
        assert np.array_equal(state["a"].words, expected[0].words)
        assert np.array_equal(state["b"].words, expected[1].words)


def _commit_records(log: DeltaLog, version: int, records: list[Record], table: list[TensorInfo],
                    total: int) -> None:
    builder = SegmentBuilder(log.log_id, version)
    for rec in records:
        builder.add(rec)
    data = builder.finish()
    key = segment_key(version, "test", uuid.uuid4().hex)
    log.store.put_new(key, data)
    parent = log.commit(version - 1)
    log.write_commit(CommitRecord(
        log_id=log.log_id, version=version, parent=version - 1,
        parent_state_digest=parent.state_digest, state_digest=state_digest(table),
        segments=(SegmentRef(key, data.size, hashlib.sha256(data).hexdigest(), len(records)),),
        tensors=tuple(table), stats=CommitStats(sum(r.n_changed for r in records), total, len(records)),
        created_at=parent.created_at, writer_id="test",
    ))


def _xor_record(words: np.ndarray, shape, box: Box, positions: np.ndarray, xor: np.ndarray) -> Record:
    """An xor record over ``box`` (box-local positions) valid for ``words`` as they are now."""
    cols = shape[1]
    flat = positions + box.offset[0] * cols
    params, payload = get_encoding("sparse").encode("xor", ChangeSet(box.size, positions, xor))
    return Record("w", "xor", box, "sparse", params, positions.size, words_digest(words[flat]),
                  words_digest(words[flat] ^ xor), payload)


def test_overlapping_records_apply_as_in_order(tmp_path):
    # The writer never emits overlapping records, but a reader must not race on them: each
    # record's precondition holds only after the one before it.
    rows, cols = 4, PARALLEL_MIN_ELEMENTS
    shape = (rows, cols)
    words = np.arange(rows * cols, dtype=np.uint16)
    # The records below carry xxh3 digests.
    writer = create_log(tmp_path / "log", {"w": TensorBits("BF16", shape, words.copy())}, features=())
    log = writer.log
    state = words.copy()
    records = []
    rng = np.random.default_rng(7)
    for start in (0, 1, 2, 0, 1):  # boxes of two rows, each overlapping the one before
        box = Box((start, 0), (2, cols))
        positions = np.flatnonzero(rng.random(box.size) < 0.05)
        xor = rng.integers(1, 2**16, positions.size, dtype=np.uint16)
        records.append(_xor_record(state, shape, box, positions, xor))
        state[positions + start * cols] ^= xor
    table = [TensorInfo("w", "BF16", shape, words_digest(state))]
    _commit_records(log, 1, records, table, state.size)
    for _ in range(5):
        assert np.array_equal(DeltaLog.open(tmp_path / "log").materialize(1)["w"].words, state)


def test_a_failing_record_in_a_worker_is_raised(tmp_path, monkeypatch):
    from dcr_log import parallel

    monkeypatch.setattr(parallel, "RECORD_MIN_CHANGES", 0)  # records of ~1300 changes, on the pool
    rows, cols = 8, PARALLEL_MIN_ELEMENTS
    shape = (rows, cols)
    words = np.arange(rows * cols, dtype=np.uint16)
    # The records below carry xxh3 digests.
    writer = create_log(tmp_path / "log", {"w": TensorBits("BF16", shape, words.copy())}, features=())
    records = []
    state = words.copy()
    for r in range(rows):
        box = Box((r, 0), (1, cols))
        positions = np.arange(0, cols, 50)
        xor = np.ones(positions.size, dtype=np.uint16)
        rec = _xor_record(state, shape, box, positions, xor)
        if r == 5:  # a wrong precondition in the middle of the version
            rec = Record(rec.tensor, rec.kind, rec.box, rec.encoding, rec.params, rec.n_changed,
                         rec.base_digest ^ 1, rec.target_digest, rec.payload)
        records.append(rec)
        state[positions + r * cols] ^= xor
    _commit_records(writer.log, 1, records, [TensorInfo("w", "BF16", shape, words_digest(state))], state.size)
    log = DeltaLog.open(tmp_path / "log")
    replayed = log.materialize(0)
    with pytest.raises(IntegrityError, match="precondition"):
        log.apply_version(replayed, 1)


def test_a_record_with_a_wrong_target_writes_nothing():
    words = np.arange(1000, dtype=np.uint16)
    positions = np.array([3, 500, 999])
    xor = np.array([1, 2, 3], dtype=np.uint16)
    params, payload = get_encoding("sparse").encode("xor", ChangeSet(1000, positions, xor))
    rec = Record("w", "xor", Box((0,), (1000,)), "sparse", params, 3, words_digest(words[positions]),
                 words_digest(words[positions] ^ xor) ^ 1, payload)
    before = words.copy()
    with pytest.raises(IntegrityError, match="target"):
        apply_to_words(rec, ChangeSet(1000, positions, xor), words, (1000,))
    assert np.array_equal(words, before)


def test_sparse_nonzero_scan_at_every_density():
    rng = np.random.default_rng(8)
    scratch = differ._Scratch()  # shared: the dense-mask hint carries over between calls
    for density in [0.0, 0.001, 0.01, 0.05, 0.3, 0.9, 1.0, 0.01, 0.001] * 2:
        for n in (8, 1000, 1024, 4096, 100_000, 100_001):
            mask = rng.random(n) < density
            assert np.array_equal(differ._flatnonzero_sparse(mask, scratch), np.flatnonzero(mask))


def test_threads_work_again_in_a_forked_child():
    import multiprocessing

    from dcr_log import parallel

    rng = np.random.default_rng(9)
    base, new = _pair(rng, 40, 1 << 16, 0.02)
    parent = [r.payload for r in Differ().diff("w", base, new)]  # starts the parent's diff pool
    assert parallel.shared_pool(parallel.DEFAULT_WORKERS).submit(int, 3).result() == 3
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as child:
        result = child.apply_async(_child_diffs, (base, new))
        assert result.get(timeout=60) == [bytes(p) for p in parent]


def _child_diffs(base, new) -> list[bytes]:
    from dcr_log import parallel

    assert parallel.shared_pool(parallel.DEFAULT_WORKERS).submit(int, 4).result() == 4
    return [bytes(r.payload) for r in Differ().diff("w", base, new)]


@pytest.mark.parametrize("word", WORDS, ids=lambda w: w.str)
def test_native_gather_scatter_and_ulp_step_equal_numpy(word):
    """The C gather, scatter (dcr_log._changes) and ulp step against plain numpy, on random
    words, sorted and unsorted positions, empty ones, and positions outside the words."""
    from dcr_log.codec.ulp import step_from, step_from_numpy
    from dcr_log.log.records import gather_words, scatter_words

    assert native.changes is not None
    rng = np.random.default_rng(word.itemsize)
    words = rng.integers(0, np.iinfo(word).max, 5000, dtype=word, endpoint=True)
    for where in (np.sort(rng.choice(5000, 300, replace=False)), rng.choice(5000, 50, replace=False),
                  np.zeros(0, np.int64), np.array([0, 4999])):
        where = where.astype(np.int64)
        assert np.array_equal(gather_words(words, where), words[where])
        values = rng.integers(0, np.iinfo(word).max, where.size, dtype=word, endpoint=True)
        mine, ref = words.copy(), words.copy()
        scatter_words(mine, where, values)
        ref[where] = values
        assert np.array_equal(mine, ref)
        for backwards in (False, True):
            assert np.array_equal(step_from(words[where], values, backwards),
                                  step_from_numpy(words[where], values, backwards))
    for bad in (np.array([5000]), np.array([-1]), np.array([3, 1 << 40])):
        with pytest.raises(IndexError):
            gather_words(words, bad.astype(np.int64))
        before = words.copy()
        with pytest.raises(IndexError):
            scatter_words(words, bad.astype(np.int64), np.ones(bad.size, word))
        assert np.array_equal(words, before)  # nothing written
    # The bounds check runs vectorized (4 or 8 indices a step, then a tail): a bad index at
    # every place of arrays shorter, as long as and longer than a step is found.
    extremes = (5000, -1, np.iinfo(np.int64).max, np.iinfo(np.int64).min)
    for k in (1, 3, 4, 7, 8, 9, 17, 33):
        ok = np.full(k, 4999, np.int64)
        assert np.array_equal(gather_words(words, ok), words[ok])
        for j in range(k):
            for value in extremes:
                bad = ok.copy()
                bad[j] = value
                with pytest.raises(IndexError):
                    gather_words(words, bad)
                before = words.copy()
                with pytest.raises(IndexError):
                    scatter_words(words, bad, np.ones(k, word))
                assert np.array_equal(words, before)


@pytest.mark.parametrize("word", WORDS, ids=lambda w: w.str)
def test_moves_give_numpy_s_bits_whether_changes_lie_close_or_far_apart(word):
    """The C moves and the one-call classification request lines one way where a record's
    changes lie close together and another where they lie far apart (_prefetch.h): sorted
    positions of both kinds, many more than the prefetch distance, and unsorted ones, give
    numpy's bits."""
    from dcr_log.codec.ulp import step_from_numpy
    from dcr_log.digest import sum_at
    from dcr_log.log.records import classify_at, gather_words, scatter_words

    rng = np.random.default_rng(5)
    n = 400_000
    words = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    gap = 224 // word.itemsize  # _prefetch.h's DENSE_GAP in words
    close = np.sort(rng.choice(n, n // gap * 4, replace=False))  # a quarter of the gap apart
    far = np.arange(7, n, gap * 3)  # three gaps apart
    for where in (close, far, rng.permutation(far)):
        where = where.astype(np.int64)
        assert where.size > 256  # several times the prefetch distance
        assert gather_words(words, where).tobytes() == words[where].tobytes()
        values = rng.integers(0, np.iinfo(word).max, where.size, dtype=word, endpoint=True)
        mine, ref = words.copy(), words.copy()
        scatter_words(mine, where, values)
        ref[where] = values
        assert mine.tobytes() == ref.tobytes()
        current, target, current_sum, target_sum = classify_at(words, where, values, True)
        expected = step_from_numpy(words[where], values)
        assert current.tobytes() == words[where].tobytes() and target.tobytes() == expected.tobytes()
        assert (current_sum, target_sum) == (sum_at(where, words[where]), sum_at(where, expected))


@pytest.mark.parametrize("dtype", ["<i2", "<f2", ">u2", "<f4", "<c8", "<c16", "?"])
def test_gather_and_scatter_take_words_of_any_dtype(dtype):
    """Words that are not unsigned integers of the machine's order (the C moves see their
    bytes as unsigned words of their width; 16-byte words take numpy's path) gather and
    scatter as numpy indexing does, bit for bit."""
    from dcr_log.log.records import gather_words, scatter_words

    rng = np.random.default_rng(3)
    dt = np.dtype(dtype)
    words = rng.integers(0, 256, 4000 * dt.itemsize, dtype=np.uint8).view(dt)
    if dt.kind == "b":
        words = rng.integers(0, 2, 4000).astype(bool)
    where = np.sort(rng.choice(4000, 200, replace=False)).astype(np.int64)
    got = gather_words(words, where)
    assert got.dtype == words.dtype
    assert got.tobytes() == words[where].tobytes()
    values = words[rng.choice(4000, 200)]
    mine, ref = words.copy(), words.copy()
    scatter_words(mine, where, values)
    ref[where] = values
    assert mine.tobytes() == ref.tobytes()


@pytest.mark.parametrize("word", WORDS[1:], ids=lambda w: w.str)
def test_gather_and_scatter_take_words_at_any_offset(word):
    """Words and values that start at a byte offset that is not a multiple of their width (a
    tensor of a safetensors file may) gather and scatter as numpy indexing does; the C moves
    refused them with a ValueError."""
    from dcr_log.log.records import gather_words, scatter_words

    rng = np.random.default_rng(4)
    w = word.itemsize
    raw = rng.integers(0, 256, 4001 * w, dtype=np.uint8)
    words = raw[1:1 + 4000 * w].view(word)
    assert not words.flags.aligned
    where = np.sort(rng.choice(4000, 300, replace=False)).astype(np.int64)
    assert gather_words(words, where).tobytes() == words[where].tobytes()
    values = rng.integers(0, 256, 300 * w + 1, dtype=np.uint8)[1:].view(word)
    assert not values.flags.aligned and values.flags.c_contiguous
    for into in (words, words.copy()):  # at an odd offset, and aligned
        ref = into.copy()
        ref[where] = values
        scatter_words(into, where, values)
        assert into.tobytes() == ref.tobytes()


@pytest.mark.parametrize("relative", [True, False])
@settings(deadline=None, max_examples=60)
@given(word=st.sampled_from(WORDS), n=st.integers(1, 3000),
       count=st.sampled_from([0, 1, 63, 64, 65, 255, 256, 257, 700]), ordered=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_classify_at_equals_gather_targets_and_sums(relative, word, n, count, ordered, seed):
    """One C pass over a record (records.classify_at) gives what the gather, the targets and
    two sum_at calls give in turn, bit for bit, for every width, block boundaries (256 changes
    a block) and positions in any order."""
    from dcr_log.codec.ulp import step_from_numpy
    from dcr_log.digest import sum_at
    from dcr_log.log.records import classify_at

    rng = np.random.default_rng(seed)
    words = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    where = rng.choice(n, min(count, n), replace=False).astype(np.int64)
    if ordered:
        where.sort()
    values = rng.integers(0, np.iinfo(word).max, where.size, dtype=word, endpoint=True)
    got = classify_at(words, where, values, relative)
    assert got is not None
    current, target, current_sum, target_sum = got
    expected = step_from_numpy(words[where], values) if relative else words[where] ^ values
    assert current.dtype == target.dtype == word
    assert current.tobytes() == words[where].tobytes()
    assert target.tobytes() == expected.tobytes()
    assert (current_sum, target_sum) == (sum_at(where, words[where]), sum_at(where, expected))


def test_classify_at_checks_what_it_is_given():
    """Positions outside the words are an IndexError before any word is read; arrays it does
    not take (a slice, values of another count or width, misaligned words) give None, so that
    the caller takes the calls in turn; the C call refuses outputs of the wrong size."""
    from dcr_log.log.records import classify_at

    assert native.digest is not None
    rng = np.random.default_rng(8)
    words = rng.integers(0, 1 << 16, 5000, dtype=np.uint16)
    for k in (1, 9, 300):
        for bad in (5000, -1, np.iinfo(np.int64).max):
            where = np.sort(rng.choice(5000, k, replace=False)).astype(np.int64)
            where[rng.integers(k)] = bad
            with pytest.raises(IndexError):
                classify_at(words, where, np.ones(k, np.uint16), True)
    where = np.arange(0, 5000, 7, dtype=np.int64)
    values = np.ones(where.size, np.uint16)
    assert classify_at(words, slice(0, 10), values[:10], True) is None
    assert classify_at(words, where, values[:-1], True) is None
    assert classify_at(words, where, values.astype(np.uint32), True) is None
    assert classify_at(np.zeros(5001, np.uint8)[1:].view(np.uint16), where[:300], values[:300], True) is None
    out = np.empty(where.size - 1, np.uint16)
    with pytest.raises(ValueError):
        native.digest.classify(words, where, values, 2, True, out, np.empty(where.size, np.uint16))


def test_receivers_write_in_parallel_only_disjoint_records():
    """A batch's writes go to the pool only when no two records' flat spans meet in a tensor."""
    from types import SimpleNamespace

    from dcr_log.receiver.batch import disjoint as _disjoint

    def work(tensor, where):
        return SimpleNamespace(record=SimpleNamespace(tensor=tensor), where=where)

    a = work("w", np.array([0, 5, 9]))
    b = work("w", np.array([10, 11]))
    assert _disjoint([a, b, work("v", np.array([0, 9])), work("w", np.zeros(0, np.int64))])
    assert _disjoint([work("w", slice(0, 10)), work("w", slice(10, 20))])
    assert not _disjoint([a, work("w", np.array([9, 12]))])          # meet at 9
    assert not _disjoint([b, work("w", slice(0, 11))])                # a slice over 10
    assert not _disjoint([work("w", np.array([3, 20])), work("w", np.array([4, 5]))])  # nested


def test_tensor_records_compose_to_the_digest_only_when_they_cover_exactly():
    """A created tensor's digest is the sum of its row-block tensor records' target digests
    only when those cover every element once; anything else is hashed again."""
    from dcr_log.log.replay import _covers_exactly

    assert _covers_exactly([(5, 5, 0), (0, 5, 0)], 10)
    assert _covers_exactly([], 0)
    assert not _covers_exactly([], 3)
    assert not _covers_exactly(None, 10)                      # a record that is not a row block
    assert not _covers_exactly([(0, 5, 0), (0, 5, 0)], 10)    # one box twice, another missing
    assert not _covers_exactly([(0, 4, 0), (5, 5, 0)], 10)    # a gap
    assert not _covers_exactly([(0, 6, 0), (5, 5, 0)], 10)    # an overlap
    assert not _covers_exactly([(0, 5, 0)], 10)               # short


def _mapping_kib(address: int, field: str) -> int:
    """One field of /proc/self/smaps (kB) for the mapping that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_populate_write_dirties_the_range_and_changes_no_byte(tmp_path):
    """The checkpoint storage's prefault (dcr_log._changes.populate_write, the GIL released):
    the range's pages are mapped for writing (dirty, after an fsync left them clean; the kernel
    may take whole folios around them), no byte changes, and a range outside the buffer is
    refused."""
    import os
    import platform

    assert native.changes is not None
    page = os.sysconf("SC_PAGE_SIZE")
    data = np.random.default_rng(3).integers(0, 256, 64 * page, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: only a write fault dirties them again
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    address = mm.ctypes.data
    assert _mapping_kib(address, "Rss") == 0
    done = native.changes.populate_write(mm, 5 * page + 100, 20 * page)
    kernel = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    if kernel >= (5, 14):
        assert done is True
        # pages 5 .. 25 (the range's first byte lies inside page 5) at least: mapped and dirty
        dirty = _mapping_kib(address, "Shared_Dirty") + _mapping_kib(address, "Private_Dirty")
        assert dirty >= 21 * page // 1024
    else:
        assert done is False
    assert np.array_equal(np.asarray(mm), data)
    assert native.changes.populate_write(mm, 0, 0) is True
    for start, length in ((-1, 10), (0, 64 * page + 1), (64 * page, 1)):
        with pytest.raises(ValueError):
            native.changes.populate_write(mm, start, length)
    del mm


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_dropped_pages_keep_every_byte_written_through_the_map(tmp_path):
    """drop_pages drops a range's page-table entries (pages that reads mapped read-only), as
    the checkpoint storage does before faulting them in for writing: on a shared file map the
    bytes written through the map before it, not yet synced, are still what the map and the
    file read; after a sync left the range clean, drop and populate_write leave it mapped for
    writing (dirty); a range outside the buffer is refused."""
    import os

    assert native.changes is not None
    page = os.sysconf("SC_PAGE_SIZE")
    data = np.random.default_rng(4).integers(0, 256, 64 * page, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    int(mm[::page].sum())  # every page mapped read-only, as pass one's gathers leave them
    written = data.copy()
    written[3 * page + 7: 40 * page: 97] ^= 0x5A  # unsynced writes through the map, inside the range
    mm[:] = written
    assert native.changes.drop_pages(mm, 2 * page + 1, 50 * page) is True
    assert np.array_equal(np.asarray(mm), written)
    with open(path, "rb") as f:
        assert f.read() == written.tobytes()  # the page cache holds them: nothing was dropped
    mm.flush()  # clean: only a write fault or the populate dirties a page again
    assert native.changes.drop_pages(mm, 2 * page + 1, 50 * page) is True
    assert native.changes.populate_write(mm, 2 * page + 1, 50 * page) is True
    dirty = _mapping_kib(mm.ctypes.data, "Shared_Dirty") + _mapping_kib(mm.ctypes.data, "Private_Dirty")
    assert dirty >= 50 * page // 1024
    mm[5 * page] ^= 1  # and the map writes on
    mm.flush()
    with open(path, "rb") as f:
        assert f.read(5 * page + 1)[-1] == written[5 * page] ^ 1
    for start, length in ((-1, 10), (0, 64 * page + 1), (64 * page, 1)):
        with pytest.raises(ValueError):
            native.changes.drop_pages(mm, start, length)
    del mm


def test_dirty_pages_counts_the_pages_writeback_has_not_cleaned(tmp_path):
    """dirty_pages(fd, start, length), the kernel's count of a file range's dirty pages
    (cachestat): every page of a range written through a shared map, until a sync of the
    file cleans them; 0 for an empty range; a negative range refused; a descriptor that is
    not open an OSError. None where the kernel has no such count (then the test is skipped: the
    callers' fallback is tested with the count switched off)."""
    import os

    assert native.changes is not None
    page = os.sysconf("SC_PAGE_SIZE")
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(64 * page))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        first = native.changes.dirty_pages(fd, 0, 64 * page)
        if first is None:
            pytest.skip("this kernel does not count a file's dirty pages (cachestat: Linux 6.5)")
        assert first == 0
        mm = np.memmap(path, dtype=np.uint8, mode="r+")
        for _ in range(3):  # another test's os.sync may clean them between the two lines
            mm[8 * page:40 * page:page] += 1
            dirty = native.changes.dirty_pages(fd, 8 * page, 32 * page)
            if dirty == 32:
                break
        assert dirty == 32
        assert native.changes.dirty_pages(fd, 8 * page + 1, 0) == 0
        mm.flush()
        assert native.changes.dirty_pages(fd, 0, 64 * page) == 0
        del mm
        with pytest.raises(ValueError):
            native.changes.dirty_pages(fd, -1, page)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        native.changes.dirty_pages(-1, 0, page)


def test_remap_for_writing_keeps_every_byte_and_refuses_memory_it_could_lose(tmp_path):
    """pages.RemapAhead drops a shared file map's page-table entries and faults its pages in
    for writing (on the side thread), as a writer does to its baseline cache: the bytes written through
    the map and not synced are still what the map and the file read, and every page of the
    words is mapped dirty after. Anonymous memory and a copy-on-write map, where the drop
    would lose what was written, are refused before any advice is given."""
    import os

    from dcr_log import pages

    assert native.changes is not None
    page = os.sysconf("SC_PAGE_SIZE")
    data = np.random.default_rng(6).integers(0, 1 << 16, 32 * page, dtype=np.uint16)
    path = tmp_path / "words.bin"
    path.write_bytes(data.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    words = mm[64:64 + 60 * page].view(np.uint16)  # as a piece lies in the cache file
    written = data.view(np.uint8)[64:64 + 60 * page].view(np.uint16).copy()
    written[::37] ^= 0x1234
    words[:] = written
    mm.flush()
    int(np.asarray(mm[::page]).sum())  # clean, and every page mapped read-only by the read
    words[5 * page // 2] ^= 1  # one unsynced write
    written[5 * page // 2] ^= 1
    remapping = pages.RemapAhead([("words", words)])
    remapping.wait("words")
    remapping.close()
    assert np.array_equal(np.asarray(words), written)
    with open(path, "rb") as f:
        assert f.read()[64:64 + 60 * page] == written.tobytes()
    dirty = _mapping_kib(mm.ctypes.data, "Shared_Dirty") + _mapping_kib(mm.ctypes.data, "Private_Dirty")
    assert dirty >= 59 * page // 1024
    for other in (np.zeros(4 * page, np.uint16), np.memmap(path, dtype=np.uint16, mode="c")):
        other[:] = 7
        for refused in (lambda: pages.RemapAhead([("other", other)]), lambda: pages.drop_page_entries(other),
                        lambda: pages.fault_in_for_writing(other)):
            with pytest.raises(ValueError):
                refused()
        assert (np.asarray(other) == 7).all()
    del mm, words


def test_flat_positions_of_a_row_block_at_the_start_are_the_decoded_ones():
    """Such a record's box-local positions are its flat ones: flat_positions gives the decoded
    array itself; any other box gets a new array (or a slice for a dense record), but a row
    block decoded with its flat start as origin (decode_record's ``flat``)."""
    from types import SimpleNamespace

    from dcr_log.coords import box_to_tensor_flat
    from dcr_log.log.records import flat_positions

    shape = (6, 5)
    values = np.arange(4, dtype=np.uint16)
    pos = np.array([0, 3, 7, 11], np.int64)
    cases = [Box((0, 0), (3, 5)), Box((3, 0), (3, 5)), Box((1, 1), (3, 4)), Box((0, 1), (6, 4))]
    for box in cases:
        where = flat_positions(SimpleNamespace(box=box), shape, ChangeSet(box.size, pos, values))
        assert np.array_equal(where, box_to_tensor_flat(box, shape, pos)) and where.dtype == np.int64
        assert np.shares_memory(where, pos) == (box == cases[0])
    dense = flat_positions(SimpleNamespace(box=cases[1]), shape, ChangeSet(15, None, np.zeros(15, np.uint16)))
    assert dense == slice(15, 30)
    scalar = np.array([0], np.int64)
    assert flat_positions(SimpleNamespace(box=Box((), ())), (), ChangeSet(1, scalar, values[:1])) is scalar
    for box in cases:
        origin = box.flat_start(shape) if box.is_row_block(shape) else 9  # (9: no decoder gives it)
        moved = pos + origin
        where = flat_positions(SimpleNamespace(box=box), shape, ChangeSet(box.size, moved, values, origin=origin))
        assert np.array_equal(where, box_to_tensor_flat(box, shape, pos))
        assert (where is moved) == box.is_row_block(shape)


@pytest.mark.parametrize("receiver", ["numpy", "checkpoint"])
def test_an_apply_maps_no_row_block_s_positions_again(tmp_path, monkeypatch, receiver):
    """A receiver decodes each row block's positions as the tensor's flat ones (its flat start
    the decoder's origin), so no record of a version cut into row blocks, at its tensor's
    start or not, has its positions mapped into a second array (box_to_tensor_flat); the
    result is the writer's state, bit for bit."""
    from dcr_log.log import records
    from dcr_log.receiver import Receiver, open_directory, write_checkpoint

    rng = np.random.default_rng(12)
    base = {f"t{i}": TensorBits("BF16", (64, 256), rng.integers(0, 1 << 16, 64 * 256, dtype=np.uint16))
            for i in range(3)}
    new = {}
    for name, bits in base.items():
        words = bits.words.copy()
        words[rng.choice(words.size, words.size // 20, replace=False)] ^= 1
        new[name] = TensorBits("BF16", bits.shape, words)
    writer = create_log(tmp_path / "log", base, cache_dir=False, policy=EncodePolicy(chunk_elements=4096))
    writer.append(new)
    log = DeltaLog.open(tmp_path / "log")
    assert sum(1 for rec in log.records(1) if rec.box.offset[0] > 0) == 3 * 3  # four row blocks a tensor
    mapped = []
    real = records.box_to_tensor_flat
    monkeypatch.setattr(records, "box_to_tensor_flat", lambda box, *a: mapped.append(box) or real(box, *a))
    if receiver == "numpy":
        held = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
        with Receiver.open(held, tmp_path / "journal") as rx:
            rx.bind(log, 0, verify="none")
            assert rx.apply(log, verify="full") == [1]
        got = {k: v.words for k, v in held.items()}
    else:
        (tmp_path / "rx").mkdir()
        write_checkpoint(base, tmp_path / "rx")
        with open_directory(log, tmp_path / "rx", to=0) as rx:
            assert rx.apply(log, verify="full") == [1]
            got = {k: rx.storage.words(k).copy() for k in base}
    assert mapped == []
    assert all(np.array_equal(got[k].reshape(-1), new[k].words) for k in new)


@pytest.mark.parametrize("receiver", ["numpy", "checkpoint"])
def test_an_apply_leaves_the_decoded_positions_as_they_were(tmp_path, monkeypatch, receiver):
    """flat_positions hands the decoded positions themselves to the storage, the gathers, the
    digests and the writes (a row block, decoded with its flat start as origin): none of them
    may write into them. Every record's positions are copied as decoded and compared after
    the apply."""
    from dcr_log.receiver import Receiver, batch, checks, open_directory, write_checkpoint

    rng = np.random.default_rng(11)
    states = [{f"t{i}": TensorBits("BF16", (64, 256), rng.integers(0, 1 << 16, 64 * 256, dtype=np.uint16))
               for i in range(3)}]
    for _ in range(2):
        nxt = {}
        for name, bits in states[-1].items():
            words = bits.words.copy()
            words[rng.choice(words.size, words.size // 20, replace=False)] ^= 1
            nxt[name] = TensorBits("BF16", bits.shape, words)
        states.append(nxt)
    writer = create_log(tmp_path / "log", states[0], cache_dir=False, policy=EncodePolicy(chunk_elements=4096))
    for st_ in states[1:]:
        writer.append(st_)
    log = DeltaLog.open(tmp_path / "log")
    decoded: list[tuple[np.ndarray, np.ndarray]] = []

    def keeping(real):
        def decode(rec, info, **flat):
            changes = real(rec, info, **flat)
            if changes.positions is not None:
                decoded.append((changes.positions, changes.positions.copy()))
            return changes
        return decode

    monkeypatch.setattr(checks, "decode_record", keeping(checks.decode_record))
    monkeypatch.setattr(batch, "decode_record", keeping(batch.decode_record))
    if receiver == "numpy":
        held = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in states[0].items()}
        with Receiver.open(held, tmp_path / "journal") as rx:
            rx.bind(log, 0, verify="none")
            assert rx.apply(log, verify="full") == [1, 2]
        got = held
    else:
        (tmp_path / "rx").mkdir()
        write_checkpoint(states[0], tmp_path / "rx")
        with open_directory(log, tmp_path / "rx", to=0) as rx:
            assert rx.apply(log, verify="full") == [1, 2]
            got = {k: TensorBits(v.dtype, v.shape, rx.storage.words(k).copy()) for k, v in states[0].items()}
    assert all(np.array_equal(got[k].words.reshape(-1), states[-1][k].words) for k in states[-1])
    assert len(decoded) >= 2 * 3 * 4  # every version's records, each tensor four row blocks
    assert all(np.array_equal(now, then) for now, then in decoded)
