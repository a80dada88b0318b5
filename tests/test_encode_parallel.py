"""The write path's fast kernels give the bytes of the plain ones, and a log written on many
encoding threads is the log written on one: every file under the log, byte for byte."""

from __future__ import annotations

import hashlib
import itertools
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dcr_log import LogWriter, native
from dcr_log.codec import ChangeSet
from dcr_log.codec.base import from_planes, to_planes
from dcr_log.codec.ulp import UlpEncoding
from dcr_log.coords import Box, box_to_tensor_flat
from dcr_log.digest import SUM, XXH3, sum_at, sum_pair, xxh3_words
from dcr_log.state import TensorBits
from dcr_log.write import identity, sharded
from dcr_log.write.differ import EncodePolicy

WORDS = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))


def random_words(rng, word, n):
    return rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("count", [0, 1, 7, 4099])
def test_native_planes_equal_the_numpy_planes(word, count, monkeypatch):
    assert native.changes is not None
    words = random_words(np.random.default_rng(count), word, count)
    fast = to_planes(words).tobytes()
    monkeypatch.setattr(native, "changes", None)
    assert fast == to_planes(words).tobytes()
    assert fast == words.view(np.uint8).reshape(-1, word.itemsize).T.tobytes()


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("count", [0, 1, 7, 4099])
def test_native_unplanes_equal_the_numpy_unplanes(word, count, monkeypatch):
    assert native.changes is not None
    words = random_words(np.random.default_rng(count + 1), word, count)
    planes = np.frombuffer(words.view(np.uint8).reshape(-1, word.itemsize).T.tobytes(), dtype=np.uint8)
    fast = from_planes(planes, count, word, out=np.full(count, 5, dtype=word))
    # A float output (a tensor's own dtype) and a strided one (numpy's path) get the same words.
    as_float = from_planes(planes, count, np.dtype(f"<f{word.itemsize}") if word.itemsize > 1 else word)
    strided = np.zeros(2 * count, dtype=word)[::2]
    from_planes(planes, count, word, out=strided)
    monkeypatch.setattr(native, "changes", None)
    slow = from_planes(planes, count, word)
    assert fast.tobytes() == slow.tobytes() == words.tobytes() == as_float.tobytes() == strided.tobytes()


def changes_of(rng, word, n, k):
    positions = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    base = random_words(rng, word, k)
    new = random_words(rng, word, k)
    same = base == new
    new[same] ^= 1  # every position changes
    return positions, base, new


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("k", [1, 2, 3, 1000])
def test_native_ulp_payload_equals_the_numpy_payload(word, k, monkeypatch):
    rng = np.random.default_rng(k * 31 + word.itemsize)
    positions, base, new = changes_of(rng, word, 5000, k)
    changes = ChangeSet(5000, positions, base ^ new)
    fast = UlpEncoding().encode("xor", changes, base=base, new=new)
    monkeypatch.setattr(native, "changes", None)
    assert fast == UlpEncoding().encode("xor", changes, base=base, new=new)


def test_native_ulp_payload_with_gaps_past_32_bits(monkeypatch):
    word = np.dtype("<u2")
    positions = np.array([5, (1 << 32) + 9, (1 << 33) + 1], dtype=np.int64)
    base = np.array([0x3F80, 0xBF80, 0x0001], dtype=word)
    new = np.array([0x3F81, 0xBF7F, 0x8001], dtype=word)
    changes = ChangeSet(1 << 34, positions, base ^ new)
    params, payload = UlpEncoding().encode("xor", changes, base=base, new=new)
    assert params["gap_bytes"] == 8
    monkeypatch.setattr(native, "changes", None)
    assert (params, payload) == UlpEncoding().encode("xor", changes, base=base, new=new)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("offset", [0, 1, 12345, (1 << 64) - 3])
def test_sum_pair_equals_two_sums_at_the_flat_indices(word, offset, monkeypatch):
    rng = np.random.default_rng(offset % 1000 + word.itemsize)
    positions, base, new = changes_of(rng, word, 9000, 777)
    flat = positions.astype(np.uint64) + np.uint64(offset)  # wraps mod 2^64 like the sum
    expected = (sum_at(flat, base), sum_at(flat, new))
    assert sum_pair(positions, offset, base, new) == expected
    monkeypatch.setattr(native, "digest", None)
    assert sum_pair(positions, offset, base, new) == expected


@pytest.mark.parametrize("box", [Box((2, 0), (3, 8)), Box((1, 2), (4, 5)), Box((0, 0), (6, 8))])
def test_record_digests_of_any_box_equal_the_flat_sums(box):
    shape = (6, 8)
    rng = np.random.default_rng(box.size)
    positions, base, new = changes_of(rng, np.dtype("<u2"), box.size, box.size // 2)
    flat = box_to_tensor_flat(box, shape, positions)
    assert SUM.record(box, shape, positions, base, new) == (sum_at(flat, base), sum_at(flat, new))
    assert XXH3.record(box, shape, positions, base, new) == (xxh3_words(base), xxh3_words(new))


# -- a log written on one thread and on many ----------------------------------------------------

def states(seed: int):
    """A base and three steps (about 1%, 10% and 40% of the words changed) of four bf16 tensors
    large enough to be encoded in parallel, one of them a float32 and one small."""
    rng = np.random.default_rng(seed)
    shapes = {"a": (1024, 1536), "b": (2048, 640), "c": (300, 7), "d": (700, 2048)}
    base = {k: random_words(rng, np.dtype("<u2"), int(np.prod(s))).reshape(s) for k, s in shapes.items()}
    base["e"] = random_words(rng, np.dtype("<u4"), 1 << 20).reshape(1024, 1024)
    steps = []
    for rate in (0.01, 0.10, 0.40):
        new = {}
        for k, w in base.items():
            flip = rng.random(w.shape) < rate
            delta = rng.choice(np.array([1, -1, 2], dtype=np.int64), size=w.shape).astype(w.dtype)
            new[k] = np.where(flip, w + delta, w)
        steps.append(new)
    return base, steps


def as_bits(words: dict) -> dict:
    return {k: TensorBits("BF16" if w.dtype.itemsize == 2 else "F32", w.shape, w.reshape(-1)) for k, w in words.items()}


def write_log(root: Path, workers: int, monkeypatch) -> dict[str, str]:
    # Segment names, the log id and the timestamps are the only things meant to differ between
    # two runs: make them deterministic, then every byte must agree.
    counter = itertools.count(1)
    fake_uuid = type("FakeUuid", (), {"uuid4": staticmethod(lambda: uuid.UUID(int=next(counter)))})
    for module in (sharded, identity):
        monkeypatch.setattr(module, "uuid", fake_uuid)
        monkeypatch.setattr(module, "utc_now", lambda: "2026-01-01T00:00:00.000000Z")
    policy = replace(EncodePolicy(), workers=workers, chunk_elements=1 << 18)
    base, steps = states(7)
    writer = LogWriter.create(root, as_bits(base), writer_id="w", policy=policy, segment_bytes=1 << 18,
                              cache_dir=root.parent / f"cache-{workers}")
    for new in steps:
        writer.append(as_bits(new))
    writer.close()
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("workers", [2, 4])
def test_a_log_written_on_many_threads_is_the_log_written_on_one(tmp_path, monkeypatch, workers):
    serial = write_log(tmp_path / "one" / "log", 1, monkeypatch)
    threaded = write_log(tmp_path / "many" / "log", workers, monkeypatch)
    assert len([k for k in serial if k.startswith("segments/")]) > 8  # several segments a version
    assert serial == threaded


def test_a_model_of_many_small_tensors_goes_to_the_pool_in_a_few_tasks(tmp_path, monkeypatch):
    """The write pass hands the pool consecutive small chunks together (sharded.WRITE_GRAIN
    elements or a quarter of each thread's share a task): 1200 tensors of a norm's size go in
    a handful of tasks, not one each, and the log holds the bits. (Such a model alone is
    encoded on the calling thread, PARALLEL_MIN_PIECE_ELEMENTS, below; here the pool is
    required, as for the small tensors of a model whose large ones take it.)"""
    from dcr_log import DeltaLog, parallel
    from dcr_log.write import sharded

    monkeypatch.setattr(sharded, "PARALLEL_MIN_PIECE_ELEMENTS", 0)

    rng = np.random.default_rng(12)
    base = {f"layers.{i:04d}.norm": TensorBits("BF16", (1024,), random_words(rng, np.dtype("<u2"), 1024))
            for i in range(1200)}
    new = {}
    for name, bits in base.items():
        words = bits.words.copy()
        words[rng.choice(1024, 3, replace=False)] ^= np.uint16(1)
        new[name] = TensorBits("BF16", (1024,), words)
    policy = replace(EncodePolicy(), workers=2)
    writer = LogWriter.create(tmp_path / "log", base, policy=policy, cache_dir=tmp_path / "cache")
    pool = parallel.shared_pool(2)
    tasks: list = []
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn, *a: tasks.append(fn) or real_submit(fn, *a))
    writer.append(new)
    writer.close()
    assert 4 <= len(tasks) <= 16, len(tasks)  # at least four a thread's worth, far fewer than 1200
    got = DeltaLog.open(tmp_path / "log").materialize(1)
    assert all(np.array_equal(got[name].words, bits.words) for name, bits in new.items())


@pytest.mark.parametrize("elements, create_pooled, append_pooled",
                         [(1024, False, False), (1 << 14, True, False), (1 << 20, True, True)])
def test_a_model_of_small_pieces_is_encoded_on_the_calling_thread(tmp_path, monkeypatch, elements,
                                                                  create_pooled, append_pooled):
    """The write pass goes to the pool only where the pieces' C passes are expected to
    outweigh their Python (sharded.PARALLEL_MIN_PIECE_ELEMENTS): two threads would take turns
    at the GIL for it and run slower than one. A create writes every element; an append is
    expected to change what the last version changed (here 3 words a piece). Either way the
    log holds the bits."""
    from dcr_log import DeltaLog, parallel

    rng = np.random.default_rng(13)
    count = max(4, (1 << 21) // elements)  # at least the 1 Mi elements the pool starts at
    states = [{f"layers.{i:04d}.w": TensorBits("BF16", (elements,), random_words(rng, np.dtype("<u2"), elements))
               for i in range(count)}]
    for _ in range(2):
        new = {}
        for name, bits in states[-1].items():
            words = bits.words.copy()
            words[rng.choice(elements, 3, replace=False)] ^= np.uint16(1)
            new[name] = TensorBits("BF16", (elements,), words)
        states.append(new)
    pool = parallel.shared_pool(2)
    tasks: list = []
    real_submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn, *a: tasks.append(fn) or real_submit(fn, *a))
    writer = LogWriter.create(tmp_path / "log", states[0], policy=replace(EncodePolicy(), workers=2),
                              cache_dir=tmp_path / "cache")
    assert bool(tasks) == create_pooled, len(tasks)
    writer.append(states[1])  # expected to change every element (the last version was the create)
    tasks.clear()
    writer.append(states[2])  # expected to change 3 words a piece
    writer.close()
    assert bool(tasks) == append_pooled, len(tasks)
    log = DeltaLog.open(tmp_path / "log")
    for version in (1, 2):
        got = log.materialize(version)
        assert all(np.array_equal(got[name].words, bits.words) for name, bits in states[version].items())
