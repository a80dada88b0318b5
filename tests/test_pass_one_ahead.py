"""Pass one classifies xor records on the pool's threads as it decodes them (gathers the words
at their positions, computes their targets and both digest parts), where the storage's reads
may run in parallel; it still takes the records in order, and the bits are the log's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dcr_log import LineageError, TensorBits
from dcr_log.receiver import Receiver, checks, write_checkpoint
from dcr_log.receiver.storage import memory
from helpers import assert_same_bits, flip_log
from test_receiver import LAYOUT_VERSION, build_log, numpy_receiver


@pytest.fixture
def ahead(monkeypatch):
    """The records classified ahead (tensor names), and the threads that did it."""
    seen: dict = {"tensors": [], "threads": set()}
    real = checks.PassOne._classify_ahead

    def counted(self, rec, changes, names):
        made = real(self, rec, changes, names)
        if made is not None:
            seen["tensors"].append(rec.tensor)
            seen["threads"].add(threading.current_thread().name)
        return made

    monkeypatch.setattr(checks.PassOne, "_classify_ahead", counted)
    return seen


def _xor_records(log, version, tensors) -> list[str]:
    return sorted(r.tensor for r in log.records(version) if r.kind == "xor" and r.tensor in tensors)


@pytest.mark.parametrize("parallel", [True, False])
def test_every_kept_xor_record_is_classified_ahead(tmp_path, ahead, monkeypatch, parallel):
    """With parallel reads every xor record of version 1 is classified ahead; without them
    none is. Either way the apply ends with the log's bits."""
    monkeypatch.setattr(memory.NumpyStorage, "parallel_reads", parallel)
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        rx.apply(log, to=1, verify="sample")
    assert_same_bits(tensors, states[1])
    assert sorted(ahead["tensors"]) == (_xor_records(log, 1, tensors) if parallel else [])


def test_a_layout_change_classifies_only_kept_tensors_ahead(tmp_path, ahead):
    """Across the version that adds, drops, reshapes and retypes tensors, no record of a
    created (reshaped, retyped) tensor is classified ahead, and the bits are the log's."""
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[LAYOUT_VERSION - 1])
    with rx:
        rx.bind(log, LAYOUT_VERSION - 1)
        rx.apply(log, to=LAYOUT_VERSION, verify="full")
    assert_same_bits(tensors, states[LAYOUT_VERSION])
    changed = {"w.new", "w.b", "w.d"}
    assert ahead["tensors"] and not changed & set(ahead["tensors"])


def test_a_word_changed_behind_the_journal_is_found_ahead_too(tmp_path, ahead):
    """A word that is neither the record's base nor its target is found by the records
    classified ahead: LineageError, nothing written."""
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    name = next(r.tensor for r in log.records(1) if r.kind == "xor" and r.tensor in tensors)
    with rx:
        rx.bind(log, 0)
        words = tensors[name].words
        words ^= np.array(0x5A5A5A5A5A5A5A5A, dtype=np.uint64).astype(words.dtype)
        before = {k: v.words.copy() for k, v in tensors.items()}
        with pytest.raises(LineageError):
            rx.apply(log, to=1, verify="sample")
        assert rx.version == 0
    assert name in ahead["tensors"]
    for k, v in before.items():
        assert np.array_equal(tensors[k].words, v), k


@pytest.mark.parametrize("receiver", ["numpy", "checkpoint"])
def test_large_segments_are_classified_on_pool_threads(tmp_path, ahead, receiver):
    # Two tensors, 5% of their words changed: segments large enough for the pool.
    log, base, new = flip_log(tmp_path / "log", tensors=2, n=1 << 20, rate=0.05, seed=5)
    if receiver == "numpy":
        tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
        rx = Receiver.open(tensors, tmp_path / "j")
    else:
        (tmp_path / "ckpt").mkdir()
        write_checkpoint(base, tmp_path / "ckpt")
        rx = Receiver.open(tmp_path / "ckpt")
    with rx:
        rx.bind(log, 0, verify="none")
        rx.apply(log, to=1, verify="sample")
        for k, v in new.items():
            got = tensors[k].words if receiver == "numpy" else rx.storage.words(k)
            assert np.array_equal(got, v.words), k
    assert sorted(ahead["tensors"]) == _xor_records(log, 1, new)
    assert ahead["threads"] and threading.current_thread().name not in ahead["threads"]


def test_many_small_records_stay_on_the_calling_thread(tmp_path, ahead, monkeypatch):
    """A version of many small records (about 800 changes each, 80 thousand in all) is
    decoded, classified and written on the calling thread: on the pool their Python would
    take turns at the GIL (parallel.RECORD_MIN_CHANGES). The bits are the log's."""
    from dcr_log.receiver import batch, context

    log, base, new = flip_log(tmp_path / "log", tensors=100, n=1 << 14, rate=0.05, seed=6)
    records = [r for r in log.records(1)]
    changes = sum(r.n_changed for r in records)
    assert changes >= context.PARALLEL_MIN_CHANGES and not context.pool_pays(changes, len(records))
    threads: set[str] = set()
    for owner, name in ((checks.PassOne, "_decode_ahead"), (batch.BatchWriter, "_write")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real: threads.add(threading.current_thread().name)
                            or real(*a))
    tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    with Receiver.open(tensors, tmp_path / "j") as rx:
        rx.bind(log, 0, verify="none")
        rx.apply(log, to=1, verify="sample")
    assert_same_bits(tensors, new)
    assert ahead["threads"] == threads == {threading.current_thread().name}


def test_the_pool_takes_records_that_average_enough_changes():
    from dcr_log.parallel import RECORD_MIN_CHANGES
    from dcr_log.receiver.context import PARALLEL_MIN_CHANGES, pool_pays

    assert pool_pays(PARALLEL_MIN_CHANGES, 1) and not pool_pays(PARALLEL_MIN_CHANGES - 1, 1)
    many = PARALLEL_MIN_CHANGES // RECORD_MIN_CHANGES + 10
    assert pool_pays(RECORD_MIN_CHANGES * many, many)
    assert not pool_pays(RECORD_MIN_CHANGES * many - 1, many)


def test_the_write_pass_decodes_nothing_pass_one_gathered(tmp_path, monkeypatch):
    """A record whose words, target and flat positions pass 1 kept is written from them: the
    write pass decodes no record again, and pass 1 lets go of the record's decoded changes
    once those are kept (they are not needed twice). The bits are the log's."""
    from dcr_log.receiver import batch, segments

    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    decoded_again: list[str] = []
    real_decode = batch.decode_record

    def counted(rec, info, *args):
        decoded_again.append(rec.tensor)
        return real_decode(rec, info, *args)

    held: list[int] = []
    real_take = segments.SegmentCache.take_gathered

    def take_gathered(self, segment, record):
        held.append(len(self._decoded))  # decoded change sets still held at the write pass
        return real_take(self, segment, record)

    monkeypatch.setattr(batch, "decode_record", counted)
    monkeypatch.setattr(segments.SegmentCache, "take_gathered", take_gathered)
    with rx:
        rx.bind(log, 0)
        rx.apply(log, to=1, verify="sample")
    assert_same_bits(tensors, states[1])
    assert held and decoded_again == [] and max(held) == 0


@pytest.mark.parametrize("receiver", ["numpy", "torch", "checkpoint"])
def test_xor_records_on_host_words_take_one_c_pass(tmp_path, monkeypatch, receiver):
    """Every xor record is gathered, stepped and digested by one C call (GroupDigests.classify,
    records.classify_at) on a numpy, CPU torch or checkpoint receiver, once, in pass one; the
    bits are the log's."""
    from dcr_log import native
    from dcr_log.state import to_torch

    calls: list[int] = []

    class Counting:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def classify(self, *args):
            calls.append(1)
            return self.real.classify(*args)

    assert native.digest is not None
    monkeypatch.setattr(native, "digest", Counting(native.digest))
    log, base, new = flip_log(tmp_path / "log", tensors=3, n=1 << 16, rate=0.05, seed=9)
    if receiver == "checkpoint":
        (tmp_path / "ckpt").mkdir()
        write_checkpoint(base, tmp_path / "ckpt")
        rx = Receiver.open(tmp_path / "ckpt")
    elif receiver == "torch":
        tensors = {k: to_torch(TensorBits(v.dtype, v.shape, v.words.copy())) for k, v in base.items()}
        rx = Receiver.open(tensors, tmp_path / "j")
    else:
        tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
        rx = Receiver.open(tensors, tmp_path / "j")
    with rx:
        rx.bind(log, 0, verify="none")
        rx.apply(log, to=1, verify="sample")
        for k, v in new.items():
            got = rx.storage.words(k) if receiver == "checkpoint" else rx.storage.tensor_words(k)
            assert np.asarray(got).tobytes() == v.words.tobytes(), k
    assert len(calls) == len(_xor_records(log, 1, new)) > 0
