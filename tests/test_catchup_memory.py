"""Snapshots and squashes without a whole copy of the model: a squash materializes, advances and
diffs one group of tensors at a time (write_squash, SQUASH_GROUPS); both check each record as
it is encoded instead of reading the object back (FORMAT.md sections 23 and 24 are unchanged: the same
objects are written)."""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from dcr_log.errors import IntegrityError
from dcr_log.lifecycle import catchup, write_snapshot, write_squash
from dcr_log.log import DeltaLog
from dcr_log.write import LogWriter
from dcr_log.write.differ import Differ
from helpers import change_words, copy_state, make_state


def _log(root, spec, versions, rate, seed=0, layout=None, segment_bytes=64 << 20):
    rng = np.random.default_rng(seed)
    state = make_state(rng, spec)
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=segment_bytes)
    states = [copy_state(state)]
    for v in range(1, versions):
        state = {n: change_words(rng, b, rate) for n, b in state.items()}
        if layout is not None:
            state = layout(v, state, rng)
        writer.append(state, allow_layout_change=layout is not None)
        states.append(copy_state(state))
    writer.close()
    return states


def _state_bytes(state) -> int:
    return sum(b.words.nbytes for b in state.values())


def _same(a, b) -> None:
    assert set(a) == set(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert a[name].words.tobytes() == b[name].words.tobytes(), name


@pytest.mark.parametrize("groups", [1, 3, 1000])
def test_squash_in_groups_is_the_delta_between_the_states(tmp_path, monkeypatch, groups):
    """Whatever the grouping (one group, a few, one tensor each), the squash is the same delta,
    through tensors created, dropped, retyped and reshaped on the way."""
    spec = {f"w{i}": ("BF16", (64, 33)) for i in range(6)} | {"n": ("F32", (40,)), "s": ("I64", ())}

    def layout(v, state, rng):
        if v == 2:
            state["new"] = make_state(rng, {"x": ("U8", (17, 3))})["x"]
            del state["w1"]
        if v == 3:
            state["n"] = make_state(rng, {"x": ("F64", (40,))})["x"]     # retyped
            state["w3"] = make_state(rng, {"x": ("BF16", (33, 64))})["x"]  # reshaped
        return state

    states = _log(tmp_path / "log", spec, 6, 0.05, layout=layout)
    monkeypatch.setattr(catchup, "SQUASH_GROUPS", groups)
    log = DeltaLog.open(tmp_path / "log")
    cu = write_squash(log, 1, 5)
    got = copy_state(states[1])
    log.apply_step(got, log.catchup_step(cu), check_all=True)
    _same(got, states[5])
    # The same records as a squash built from both whole states (what the writer would encode).
    differ = Differ(None, log.digests, features=log.identity.features)
    whole = [(r.tensor, r.kind, r.box, r.encoding, bytes(r.payload)) for name in sorted(states[5], key=str.encode)
             for r in differ.diff(name, states[1].get(name), states[5][name], "xor")]
    written = [(r.tensor, r.kind, r.box, r.encoding, bytes(r.payload)) for r in log.records(log.catchup_step(cu))]
    assert written == whole


def test_squash_of_twenty_versions_holds_one_group_at_a_time(tmp_path):
    """Traced allocations (numpy reports its buffers to tracemalloc) while squashing 20 versions
    of a 16 MiB model: one group's start and end (two sixteenths of the model) and the encoder's
    buffers, not the start state (1x) and not both states (2x)."""
    spec = {f"layer{i:02d}": ("BF16", (256, 512)) for i in range(64)}
    states = _log(tmp_path / "log", spec, 21, 0.01, seed=2, segment_bytes=1 << 20)
    model = _state_bytes(states[0])
    del states[1:-1]
    log = DeltaLog.open(tmp_path / "log")
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        cu = write_squash(log, 0, 20, segment_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (peak - before) / model < 0.5, f"squash held {(peak - before) / model:.2f}x the model"
    got = copy_state(states[0])
    log.apply_step(got, log.catchup_step(cu), check_all=True)
    _same(got, states[-1])


def test_a_snapshot_record_that_does_not_decode_to_the_state_is_refused(tmp_path, monkeypatch):
    """An encoder that writes a wrong byte (one flipped in a record's payload) is caught as the
    snapshot is written: no manifest, no segment left behind."""
    _log(tmp_path / "log", {"a": ("BF16", (128, 64)), "b": ("F32", (33,))}, 3, 0.1)
    log = DeltaLog.open(tmp_path / "log")
    real = Differ.diff

    def flipped(self, name, base, new, kind="xor"):
        for rec in real(self, name, base, new, kind):
            if name == "b":
                payload = bytearray(rec.payload)
                payload[len(payload) // 2] ^= 0x10
                rec = dataclasses.replace(rec, payload=bytes(payload))
            yield rec

    monkeypatch.setattr(Differ, "diff", flipped)
    with pytest.raises(IntegrityError, match="'b'"):
        write_snapshot(log, 2)
    assert not list((tmp_path / "log").glob("snapshots/**/*.*"))
    monkeypatch.setattr(Differ, "diff", real)
    cu = write_snapshot(log, 2)
    got: dict = {}
    log.apply_step(got, log.catchup_step(cu), check_all=True)
    _same(got, log.materialize(2))


@pytest.mark.parametrize("tensor", ["a", "b", "new"])
def test_a_squash_record_that_does_not_lead_to_the_end_state_is_refused(tmp_path, monkeypatch, tensor):
    """An encoder that writes a wrong byte in a squash (one flipped in a record's payload: an
    xor record of a kept tensor, one of a retyped tensor, a tensor record of a created one) is
    caught as the squash is written: no manifest, no segment left behind."""
    def layout(v, state, rng):
        if v == 2:
            state["b"] = make_state(rng, {"x": ("F64", (33,))})["x"]
            state["new"] = make_state(rng, {"x": ("BF16", (9, 7))})["x"]
        return state

    states = _log(tmp_path / "log", {"a": ("BF16", (128, 64)), "b": ("F32", (33,))}, 4, 0.1, layout=layout)
    log = DeltaLog.open(tmp_path / "log")
    real = Differ.diff

    def flipped(self, name, base, new, kind="xor"):
        for rec in real(self, name, base, new, kind):
            if name == tensor:
                payload = bytearray(rec.payload)
                payload[len(payload) // 2] ^= 0x10
                rec = dataclasses.replace(rec, payload=bytes(payload))
            yield rec

    monkeypatch.setattr(Differ, "diff", flipped)
    with pytest.raises(IntegrityError, match=repr(tensor)):
        write_squash(log, 1, 3)
    assert not list((tmp_path / "log").glob("squashes/**/*.*"))
    monkeypatch.setattr(Differ, "diff", real)
    cu = write_squash(log, 1, 3)
    got = copy_state(states[1])
    log.apply_step(got, log.catchup_step(cu), check_all=True)
    _same(got, states[3])


def test_snapshot_and_squash_report_progress_in_bytes(tmp_path):
    states = _log(tmp_path / "log", {"a": ("BF16", (128, 64)), "b": ("F32", (33,))}, 4, 0.1)
    log = DeltaLog.open(tmp_path / "log")
    for write in (lambda p: write_snapshot(log, 3, progress=p), lambda p: write_squash(log, 1, 3, progress=p)):
        seen: list[int] = []
        write(seen.append)
        assert sum(seen) == _state_bytes(states[3]) and len(seen) == 2
