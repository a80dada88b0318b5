"""Receivers through the Python API: numpy, torch (CPU) and checkpoint-directory storage,
catch-up, --to, idempotent re-apply, lineage refusals, rollback and crash recovery."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dcr_log import DeltaLog, LineageError, TensorBits, UsageError, to_state
from dcr_log.checkpoint import load_checkpoint
from dcr_log.errors import IntegrityError
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.receiver import (
    CheckpointStorage,
    Journal,
    NumpyStorage,
    Receiver,
    TorchStorage,
    write_checkpoint,
)
from dcr_log.receiver.checks import SAMPLE_DIVISOR, sample_tensors
from dcr_log.state import to_torch
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import assert_same_bits, change_words, copy_state, make_state


class SimulatedCrash(BaseException):
    """Stands for SIGKILL: not an Exception, so no rollback runs."""


SPEC = {
    "w.a": ("BF16", (64, 48)),
    "w.b": ("F32", (40, 10)),
    "w.c": ("F16", (7,)),
    "w.d": ("U8", (3, 5, 9)),
    "step": ("I64", ()),
    "empty": ("I8", (0, 4)),
}
LAYOUT_VERSION = 3  # adds "w.new", drops "w.c", reshapes "w.b" and retypes "w.d"
OVERWRITE_VERSION = 2


def build_log(root: Path, seed: int = 0, versions: int = 5, rate: float = 0.08):
    """A log whose versions have many records and segments; returns (log, states)."""
    rng = np.random.default_rng(seed)
    state = make_state(rng, SPEC)
    states = [copy_state(state)]
    writer = LogWriter.create(root, state, policy=EncodePolicy(chunk_elements=64), segment_bytes=400)
    for v in range(1, versions + 1):
        state = {name: change_words(rng, bits, rate) for name, bits in state.items()}
        state["step"] = TensorBits("I64", (), np.array([v], dtype=np.uint64))
        if v == LAYOUT_VERSION:
            state["w.new"] = make_state(rng, {"x": ("F32", (5, 5))})["x"]
            del state["w.c"]
            state["w.b"] = TensorBits("F32", (20, 20), state["w.b"].words.copy())
            state["w.d"] = TensorBits("I8", (3, 5, 9), state["w.d"].words.copy())
        writer.append(state, kind="overwrite" if v == OVERWRITE_VERSION else "xor",
                      allow_layout_change=v == LAYOUT_VERSION)
        states.append(copy_state(state))
    return DeltaLog.open(root), states


@pytest.fixture
def logged(tmp_path):
    return build_log(tmp_path / "log")


def torch_copy(state) -> dict:
    """CPU torch tensors holding copies of a state's bits."""
    return {n: to_torch(TensorBits(b.dtype, b.shape, b.words.copy())) for n, b in state.items()}


def numpy_receiver(tmp_path: Path, state, name: str = "j") -> tuple[Receiver, dict]:
    tensors = copy_state(state)
    return Receiver.open(tensors, tmp_path / name, layout_changes="own"), tensors


def test_log_has_many_segments(logged):
    log, _ = logged
    assert all(len(log.commit(v).segments) >= 3 for v in range(1, 6))


@pytest.mark.parametrize("verify", ["none", "sample", "full"])
def test_numpy_catch_up_to_and_reapply(tmp_path, logged, verify):
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        assert rx.apply(log, to=2, verify=verify) == [1, 2]
        assert rx.version == 2 and rx.state_digest == log.commit(2).state_digest
        assert_same_bits(tensors, states[2])
        assert rx.apply(log, to=2, verify=verify) == []
        assert rx.apply(log, verify=verify) == [3, 4, 5]
        assert_same_bits(tensors, states[5])
        assert rx.apply(log, verify=verify) == []
        assert_same_bits(tensors, states[5])
        assert rx.inflight is None
        with pytest.raises(UsageError):
            rx.apply(log, to=1)


def test_numpy_arrays_of_native_dtypes_updated_in_place(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {"f": rng.standard_normal((30, 20)).astype(np.float32),
              "h": rng.standard_normal(50).astype(np.float16), "i": np.arange(12, dtype=np.int64)}
    writer = LogWriter.create(tmp_path / "log", arrays, policy=EncodePolicy(chunk_elements=16))
    expected = [{k: v.copy() for k, v in arrays.items()}]
    for _ in range(3):
        step = {k: v.copy() for k, v in expected[-1].items()}
        step["f"].reshape(-1)[rng.choice(600, 30, replace=False)] += np.float32(1e-3)
        step["i"][3] += 1
        writer.append(step)
        expected.append(step)
    log = DeltaLog.open(tmp_path / "log")
    mine = {k: v.copy() for k, v in expected[0].items()}
    ids = {k: id(v) for k, v in mine.items()}
    with Receiver.open(mine, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 0)
        assert rx.apply(log) == [1, 2, 3]
    for k in mine:
        assert id(mine[k]) == ids[k]
        assert mine[k].dtype == expected[-1][k].dtype
        assert np.array_equal(mine[k].view(np.uint8), expected[-1][k].view(np.uint8))


def test_torch_cpu_in_place_and_identity(tmp_path, logged):
    log, states = logged
    tensors = torch_copy(states[0])
    ptrs = {name: t.data_ptr() for name, t in tensors.items() if t.numel()}
    with Receiver.open(tensors, tmp_path / "j", layout_changes="own") as rx:
        assert isinstance(rx.storage, TorchStorage)
        rx.bind(log, 0)
        assert rx.apply(log, to=LAYOUT_VERSION - 1, verify="full") == [1, 2]
        for name, ptr in ptrs.items():
            assert tensors[name].data_ptr() == ptr, name
        assert_same_bits(to_state(tensors), states[2])
        assert rx.apply(log) == [3, 4, 5]
        assert_same_bits(to_state(tensors), states[5])
    # Unchanged dtype and shape: the same tensors, written in place.
    for name in ("w.a", "step"):
        assert tensors[name].data_ptr() == ptrs[name]
    assert tensors["w.b"].shape == (20, 20) and tensors["w.d"].dtype == torch.int8
    assert "w.c" not in tensors and tensors["w.new"].dtype == torch.float32


def test_bind_checks_the_state_digest(tmp_path, logged):
    log, states = logged
    rx, _ = numpy_receiver(tmp_path, states[1])
    with rx:
        with pytest.raises(LineageError):
            rx.bind(log, 2)
        with pytest.raises(LineageError):
            rx.bind(log, 0)  # same layout, other bits
        assert rx.version is None
        rx.bind(log, 1)
        assert rx.version == 1
    rx, _ = numpy_receiver(tmp_path, states[2], "j2")
    with rx:
        rx.bind(log, 1, verify="none")  # trusted: not checked
        assert rx.version == 1


def _snapshot(tensors) -> dict:
    return {k: (v.dtype, v.shape, v.words.copy()) for k, v in tensors.items()}


def _assert_unchanged(tensors, snap) -> None:
    assert sorted(tensors) == sorted(snap)
    for k, (dtype, shape, words) in snap.items():
        assert (tensors[k].dtype, tensors[k].shape) == (dtype, shape)
        assert np.array_equal(tensors[k].words, words), k


def test_foreign_log_skipped_version_and_fork_are_refused(tmp_path, logged):
    log, states = logged
    foreign, _ = build_log(tmp_path / "foreign", seed=0)  # same states, another log id
    # A fork: the same log id and versions 0..2, then other states.
    shutil.copytree(log.store.url.removeprefix("file://"), tmp_path / "fork")
    for v in range(3, 6):
        (tmp_path / "fork" / "versions" / f"{v:020d}.json").unlink()
        shutil.rmtree(tmp_path / "fork" / "segments" / str(v))
    writer = LogWriter.open(tmp_path / "fork", policy=EncodePolicy(chunk_elements=64))
    writer.append({k: change_words(np.random.default_rng(9), b, 0.1) for k, b in states[2].items()})
    writer.append({k: change_words(np.random.default_rng(10), b, 0.1) for k, b in states[2].items()})
    fork = DeltaLog.open(tmp_path / "fork")
    assert fork.log_id == log.log_id

    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        rx.apply(log, to=3)
        snap = _snapshot(tensors)
        before = rx.state
        with pytest.raises(LineageError, match="belongs to log"):
            rx.apply(foreign)
        with pytest.raises(LineageError):
            rx.apply_version(log, 5)  # skips version 4
        with pytest.raises(LineageError):
            rx.apply_version(log, 3)  # already applied: its parent is not the current version
        with pytest.raises(LineageError):
            rx.apply(fork)  # fork's version 4 follows another version 3
        _assert_unchanged(tensors, snap)
        assert rx.state == before


def test_receiver_ahead_of_the_log_is_refused(tmp_path, logged):
    log, states = logged
    short = tmp_path / "short"
    shutil.copytree(log.store.url.removeprefix("file://"), short)
    for v in (4, 5):
        (short / "versions" / f"{v:020d}.json").unlink()
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        rx.apply(log)
        with pytest.raises(LineageError, match="ends at 3"):
            rx.apply(DeltaLog.open(short))


@pytest.mark.parametrize("verify", ["full", "sample"])
def test_changed_behind_the_journals_back_refused_before_any_write(tmp_path, logged, verify):
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        rx.apply(log, to=1)
        if verify == "full":
            tensors["w.a"].words[100] ^= 1  # one bit anywhere
        else:
            for bits in tensors.values():  # every record's positions, so the sample sees it
                bits.words[...] = ~bits.words
        snap = _snapshot(tensors)
        with pytest.raises(LineageError, match="behind the journal's back"):
            rx.apply(log, verify=verify)
        _assert_unchanged(tensors, snap)
        assert rx.version == 1 and rx.inflight is None


@pytest.mark.parametrize("kind", ["xor", "overwrite"])
@pytest.mark.parametrize("how", ["apply", "stage"])
def test_changed_behind_the_back_with_verify_none(tmp_path, logged, how, kind):
    """At none a record found at neither base nor target is still refused. Applied in one
    call, pass one classifies it as it decodes it, so nothing is written; staged first, the
    write pass finds it after earlier records were written, and memory is rolled back."""
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])
    points: list[str] = []
    with rx:
        version = OVERWRITE_VERSION if kind == "overwrite" else LAYOUT_VERSION + 1  # the layout kept
        rx.bind(log, 0)
        rx.apply(log, to=version - 1)
        record = [r for r in log.records(version) if r.tensor == "w.a"][-1]  # in a late segment
        assert record.kind == kind
        tensors["w.a"].words.reshape(64, 48)[record.box.offset[0]] ^= 0xFFFF
        snap = _snapshot(tensors)
        rx.fault = lambda point, **info: points.append(point)
        with pytest.raises(LineageError, match="behind the journal's back"):
            if how == "stage":
                rx.stage(log, version, verify="none")
                rx.apply()
            else:
                rx.apply(log, to=version, verify="none")
        _assert_unchanged(tensors, snap)  # (staged: the records written before it were undone)
        assert rx.version == version - 1 and rx.inflight is None
        if how == "stage":
            assert "record" in points
        else:
            assert "inflight" not in points and "record" not in points


@pytest.mark.parametrize("point", ["inflight", "layout", "record", "before_commit"])
def test_memory_storage_rolls_back_on_exception(tmp_path, logged, point):
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])
    calls = {"n": 0}

    def fault(name, **info):
        if name == point and info.get("version") == LAYOUT_VERSION:
            calls["n"] += 1
            if name != "record" or calls["n"] == 17:
                raise RuntimeError("injected")

    with rx:
        rx.bind(log, 0)
        rx.apply(log, to=LAYOUT_VERSION - 1)
        ids = {k: id(v) for k, v in tensors.items()}
        rx.fault = fault
        with pytest.raises(RuntimeError, match="injected"):
            rx.apply(log)
        assert rx.version == LAYOUT_VERSION - 1 and rx.inflight is None
        assert_same_bits(tensors, states[LAYOUT_VERSION - 1])
        assert {k: id(v) for k, v in tensors.items()} == ids  # the layout change was undone
        rx.fault = None
        assert rx.apply(log) == [3, 4, 5]
        assert_same_bits(tensors, states[5])


def test_torch_storage_rolls_back_on_exception(tmp_path, logged):
    log, states = logged
    tensors = torch_copy(states[0])

    def fault(name, **info):
        if name == "record" and info["written"] == 5 and info["segment"] == 2:
            raise RuntimeError("injected")

    with Receiver.open(tensors, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 0)
        rx.fault = fault
        with pytest.raises(RuntimeError):
            rx.apply(log)
        assert rx.version == 0
        assert_same_bits(to_state(tensors), states[0])


def test_interrupted_memory_receiver_must_be_bound_again(tmp_path, logged):
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])

    def crash(name, **info):
        if name == "record":
            raise SimulatedCrash()

    rx.bind(log, 0)
    rx.fault = crash
    with pytest.raises(SimulatedCrash):
        rx.apply(log)
    rx.close()
    # A new process: fresh arrays holding version 0, the journal says version 1 is in flight.
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        assert rx.inflight == 1
        with pytest.raises(LineageError, match="bind it again"):
            rx.apply(log)
        rx.bind(log, 0)
        assert rx.inflight is None
        assert rx.apply(log) == [1, 2, 3, 4, 5]
        assert_same_bits(tensors, states[5])


# -- checkpoint directories ----------------------------------------------------------------

def ckpt_receiver(tmp_path: Path, log: DeltaLog, state, shard_bytes: int | None = None,
                  name: str = "ckpt") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    write_checkpoint(state, directory, shard_bytes=shard_bytes)
    with Receiver.open(directory) as rx:
        rx.bind(log, 0)
    return directory


def reopen(directory: Path, fault=None) -> Receiver:
    return Receiver.open(directory, fault=fault)


@pytest.mark.parametrize("shard_bytes", [None, 2000])
def test_checkpoint_directory_apply(tmp_path, logged, shard_bytes):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes)
    files_before = sorted(p.name for p in directory.glob("*.safetensors"))
    with reopen(directory) as rx:
        assert isinstance(rx.storage, CheckpointStorage) and rx.storage.durable
        assert rx.storage.sharded == (shard_bytes is not None)
        assert rx.apply(log, to=2) == [1, 2]
        assert_same_bits(load_checkpoint(directory), states[2])
        assert rx.apply(log, verify="full") == [3, 4, 5]
    assert_same_bits(load_checkpoint(directory), states[5])  # checks the index matches too
    assert sorted(p.name for p in directory.glob("*.safetensors")) == files_before
    assert not list(directory.glob(".*.tmp"))
    with reopen(directory) as rx:
        assert rx.version == 5 and rx.apply(log) == []
        assert not rx.journal.progress()


CRASH_POINTS = ["inflight", "layout", "layout_file", "redo", "torn", "record", "flushed",
                "applied", "before_commit", "committed"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_checkpoint_crash_then_reopen_finishes_bit_exact(tmp_path, logged, point):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000)
    seen = {"n": 0}

    def crash(name, **info):
        if name == point:
            seen["n"] += 1
            if seen["n"] == (2 if point == "layout_file" else 3):  # layout_file: 3 files rewritten
                raise SimulatedCrash(name)

    rx = reopen(directory, fault=crash)
    with pytest.raises(SimulatedCrash):
        rx.apply(log, to=LAYOUT_VERSION)
    rx.close()
    st = Journal.peek(directory / ".dcr")
    if st.inflight is None:
        # Between versions: the bits are the journal's version.
        assert_same_bits(load_checkpoint(directory), states[st.version])
    with reopen(directory) as rx:
        applied = rx.apply(log, verify="sample")
        assert applied == list(range(st.version + 1, 6))
        assert rx.inflight is None
    assert_same_bits(load_checkpoint(directory), states[5])


def test_torn_xor_record_is_finished_from_its_redo_image(tmp_path, logged):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0])

    def crash(name, **info):
        if name == "torn":
            raise SimulatedCrash()

    rx = reopen(directory, fault=crash)
    with pytest.raises(SimulatedCrash):
        rx.apply_version(log, 1)
    rx.close()
    with reopen(directory) as rx:
        assert rx.inflight == 1
        progress = rx.journal.progress()[0]
        assert progress.done == 0 and progress.started_end > 0
        assert rx.journal.redo_images(0)  # the xor records' targets
        report = rx.recover(log, verify="none")
        # The 0-d "step" record was written whole before the torn one: found at its target.
        assert report.recovered and report.repaired == 1 and report.skipped == 1
        assert rx.version == 1 and not rx.journal.progress() and not rx.journal.redo_images(0)
    assert_same_bits(load_checkpoint(directory), states[1])


def test_applied_records_are_skipped_not_xored_again(tmp_path, logged):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0])

    def crash(name, **info):
        if name == "flushed":  # the first batch written and flushed, not yet marked applied
            raise SimulatedCrash()

    rx = reopen(directory, fault=crash)
    with pytest.raises(SimulatedCrash):
        rx.apply_version(log, 1)
    rx.close()
    commit = log.commit(1)
    with reopen(directory) as rx:
        assert rx.journal.progress()[0].done == 0
        report = rx.recover(log, verify="full")
        # The first segment's records are recognised as applied by their digests.
        assert report.skipped == commit.segments[0].records
        assert report.written == commit.stats.records - commit.segments[0].records
    assert_same_bits(load_checkpoint(directory), states[1])


def test_checkpoint_changed_behind_the_back_refused(tmp_path, logged):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0])
    with reopen(directory) as rx:
        rx.storage.words("w.a")[7] ^= 0x100
        rx.storage.flush()
        with pytest.raises(LineageError):
            rx.apply(log, verify="full")
        assert rx.version == 0 and rx.inflight is None


def test_full_verification_catches_a_log_whose_digest_lies(tmp_path, logged):
    log, states = logged
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        commit = log.commit(1)
        bad = TensorInfo("w.a", "BF16", (64, 48), commit.tensor_map()["w.a"].digest ^ 1)
        tensors_table = tuple(bad if t.name == "w.a" else t for t in commit.tensors)
        log._commits[1] = replace(commit, tensors=tensors_table, state_digest=state_digest(tensors_table))
        log._commits[2] = replace(log.commit(2), parent_state_digest=state_digest(tensors_table))
        with pytest.raises(IntegrityError):
            rx.apply_version(log, 1, verify="full")
        assert rx.version == 0 and rx.inflight is None
        assert_same_bits(tensors, states[0])


def test_sample_tensors_is_deterministic_and_bounded():
    tensors = tuple(TensorInfo(f"t{i}", "BF16", (i + 1, 100), 0) for i in range(40))
    total = sum((i + 1) * 200 for i in range(40))
    picked = sample_tensors(tensors, 7)
    assert picked == sample_tensors(tensors, 7)
    assert picked and sum(int(n[1:]) + 1 for n in picked) * 200 <= total // SAMPLE_DIVISOR
    assert sample_tensors(tensors, 8) != picked
    assert sample_tensors((TensorInfo("big", "F32", (1000,), 0),), 1) == ["big"]


def test_numpy_storage_refuses_read_only_and_strided_arrays():
    with pytest.raises(UsageError):
        NumpyStorage({"a": np.zeros((4, 4), np.float32)[:, ::2]})
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(UsageError):
        NumpyStorage({"a": frozen})
    with pytest.raises(UsageError):
        TorchStorage({"a": torch.zeros(4, 4).t()})


def test_journal_is_exclusive(tmp_path, logged):
    log, states = logged
    rx, _ = numpy_receiver(tmp_path, states[0])
    with rx:
        with pytest.raises(UsageError, match="in use"):
            Receiver.open(copy_state(states[0]), tmp_path / "j")
    with Receiver.open(copy_state(states[0]), tmp_path / "j"):
        pass


def test_torn_range_survives_other_batch_boundaries(tmp_path, logged, monkeypatch):
    """A batch torn by one crash, resumed with smaller batches and crashed again, finishes."""
    from dcr_log.receiver import batch as apply_module

    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0])
    written = {"n": 0}

    def crash_mid_batch(name, **info):
        if name == "record":
            written["n"] += 1
            if written["n"] == 6:
                raise SimulatedCrash()

    rx = reopen(directory, fault=crash_mid_batch)
    with pytest.raises(SimulatedCrash):
        rx.apply_version(log, 1)
    rx.close()
    torn_end = Journal.peek(directory / ".dcr")
    monkeypatch.setattr(apply_module, "BATCH_BYTES", 1)  # one record per batch now

    def crash_after_first_batch(name, **info):
        if name == "applied":
            raise SimulatedCrash()

    rx = reopen(directory, fault=crash_after_first_batch)
    with pytest.raises(SimulatedCrash):
        rx.recover(log)
    progress = rx.journal.progress()[0]
    rx.close()
    assert torn_end.inflight == 1
    assert progress.done == 1 and progress.started_end == log.commit(1).segments[0].records
    with reopen(directory) as rx:
        report = rx.recover(log, verify="full")
        assert report.recovered
    assert_same_bits(load_checkpoint(directory), states[1])


def test_torch_parameters_are_updated_in_place(tmp_path, logged):
    """A rollout worker's model parameters (requiring grad) are refitted without copies."""
    log, states = logged
    params = {n: torch.nn.Parameter(to_torch(TensorBits(b.dtype, b.shape, b.words.copy())), requires_grad=False)
              if b.dtype in ("BF16", "F32", "F16") else to_torch(TensorBits(b.dtype, b.shape, b.words.copy()))
              for n, b in states[0].items()}
    params["w.a"].requires_grad_(True)
    objects = {n: p for n, p in params.items()}
    with Receiver.open(params, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 0)
        assert rx.apply(log, to=2) == [1, 2]
    assert all(params[n] is objects[n] for n in params)
    assert params["w.a"].requires_grad
    assert_same_bits(to_state(params), states[2])


def test_interrupted_layout_rewrite_leaves_no_temporaries(tmp_path, logged):
    log, states = logged
    directory = ckpt_receiver(tmp_path, log, states[0], shard_bytes=2000)
    files = sorted(p.name for p in directory.glob("*.safetensors"))

    def crash_before_rename(name, **info):
        if name == "layout_file":
            raise SimulatedCrash()

    rx = reopen(directory, fault=crash_before_rename)
    with pytest.raises(SimulatedCrash):
        rx.apply(log)
    rx.close()
    (directory / f".{files[-1]}.x1y2.tmp").write_bytes(b"left by a kill before the rename")
    with reopen(directory) as rx:
        assert rx.apply(log) == list(range(LAYOUT_VERSION, 6))
    assert not list(directory.glob(".*.tmp"))
    assert sorted(p.name for p in directory.glob("*.safetensors")) == files
    assert_same_bits(load_checkpoint(directory), states[5])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_reapplying_an_applied_version_changes_nothing(tmp_path, logged, kind):
    """Storage already holding version 2, told it holds version 1: every record of version 2
    is found at its target and skipped (an xor applied twice is applied once)."""
    log, states = logged
    if kind == "numpy":
        tensors = copy_state(states[2])
    else:
        tensors = torch_copy(states[2])
    reports = []
    with Receiver.open(tensors, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 1, verify="none")  # trusted, and wrong: the words are version 2's
        assert rx.apply(log, to=2, verify="sample", on_version=reports.append) == [2]
    n = log.commit(2).stats.records
    assert reports[0].records == n and reports[0].skipped == n and reports[0].written == 0
    assert_same_bits(to_state(tensors), states[2])


def test_checkpoint_with_tensors_sharing_bytes_is_refused(tmp_path):
    import json
    import struct

    header = json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04")
    with pytest.raises(IntegrityError, match="share bytes"):
        CheckpointStorage(tmp_path)


# -- torch receivers with their words on the device (device_words) ------------------------------


def _device_receiver(tmp_path, states, name="jd"):
    tensors = torch_copy(states[0])
    # On the CPU here; the receiver turns this on by itself for tensors on an accelerator.
    return Receiver.open(TorchStorage(tensors, device_words=True, owns_layout=True), tmp_path / name), tensors


def _ulp_steps(rng, bits: TensorBits, rate: float) -> TensorBits:
    """Weight-like changes: a ``rate`` of the words one or two units in the last place away."""
    from dcr_log.codec.ulp import step_from

    words = bits.words.copy()
    where = np.flatnonzero(rng.random(words.size) < rate)
    d = rng.choice(np.array([1, -1, 2, -1], dtype=np.int64), where.size)
    words[where] = step_from(words[where], d.astype(f"<i{words.itemsize}").view(words.dtype))
    return TensorBits(bits.dtype, bits.shape, words)


ULP_FEATURES = {"ulp": ("sum-digests", "ulp-encoding"), "ulp-rans": ("rans-encoding", "sum-digests"),
                "xxh3": ()}


@pytest.mark.parametrize("verify", ["none", "sample", "full"])
@pytest.mark.parametrize("kind", ["layout", "ulp", "ulp-rans", "xxh3"])
def test_torch_device_words_receiver_is_bit_exact(tmp_path, kind, verify):
    """Gathers, targets and digests computed on the tensors' device (torch ops; sum digests in
    torch, xxh3 through the host) give every version bit for bit: a log with layout changes and
    an overwrite version, logs whose records are ulp distances (pcodec and rANS), and a plain
    xxh3 log."""
    if kind == "layout":
        log, states = build_log(tmp_path / "log", seed=4)
    else:
        rng = np.random.default_rng(4)
        state = make_state(rng, SPEC)
        states = [copy_state(state)]
        # Whole-tensor boxes: big enough for ulp's pcodec files to beat raw and sparse.
        writer = LogWriter.create(tmp_path / "log", state, segment_bytes=400, features=ULP_FEATURES[kind])
        for _ in range(1, 4):
            state = {n: _ulp_steps(rng, b, 0.08) if b.dtype in ("BF16", "F32", "F16") else
                     change_words(rng, b, 0.08) for n, b in state.items()}
            writer.append(state)
            states.append(copy_state(state))
        log = DeltaLog.open(tmp_path / "log")
    used = {r.encoding for v in log.versions()[1:] for r in log.records(v)}
    assert ("ulp" in used) == (kind == "ulp") and ("ulp-rans" in used) == (kind == "ulp-rans")
    rx, tensors = _device_receiver(tmp_path, states)
    with rx:
        rx.bind(log, 0)
        assert rx.storage.device_words
        for v in log.versions()[1:]:
            assert rx.apply(log, to=v, verify=verify) == [v]
            assert_same_bits(to_state(rx.storage.tensors), states[v])


def test_torch_device_words_receiver_refuses_a_changed_tensor_and_keeps_it(tmp_path, logged):
    log, states = logged
    rx, tensors = _device_receiver(tmp_path, states)
    with rx:
        rx.bind(log, 0)
        t = tensors["w.a"]
        t.view(-1)[:200].view(torch.int16).add_(1)  # behind the journal's back
        before = to_state(tensors)
        with pytest.raises(LineageError):
            rx.apply(log, to=1)
        assert_same_bits(to_state(tensors), before)
        assert rx.version == 0


def test_torch_device_sum_digest_of_whole_tensors(tmp_path, logged):
    log, states = logged
    rx, tensors = _device_receiver(tmp_path, states)
    with rx:
        storage = rx.storage
        for name in tensors:
            host = TorchStorage(tensors).tensor_digest(name, log.digests)
            assert storage.tensor_digest(name, log.digests) == host


@pytest.mark.parametrize("encoding", ["ulp", "ulp-rans"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_memory_rollback_undoes_ulp_records(tmp_path, kind, encoding):
    """A failure after some ulp records were written: the rollback steps each one back by its
    distances (record_bases), and the tensors hold version 0's bits again."""
    rng = np.random.default_rng(9)
    state = make_state(rng, {"w.a": ("BF16", (64, 48)), "w.b": ("F32", (40, 10)), "w.c": ("F16", (300,))})
    first = copy_state(state)
    writer = LogWriter.create(tmp_path / "log", state, segment_bytes=400, features=ULP_FEATURES[encoding])
    writer.append({n: _ulp_steps(rng, b, 0.1) for n, b in state.items()})
    log = DeltaLog.open(tmp_path / "log")
    assert {r.encoding for r in log.records(1)} == {encoding}
    if kind == "numpy":
        tensors = copy_state(first)
    else:
        tensors = torch_copy(first)
    written = []

    def fault(name, **info):
        if name == "record":
            written.append(info["record"])
            if len(written) == 2:
                raise RuntimeError("injected")

    with Receiver.open(tensors, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 0)
        rx.fault = fault
        with pytest.raises(RuntimeError):
            rx.apply(log)
        assert rx.version == 0 and len(written) == 2
        assert_same_bits(to_state(tensors), first)
