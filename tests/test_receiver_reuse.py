"""The write pass takes pass one's classification of a record (its gathered base words and the
target computed from them) when pass one ran in the same call (RECEIVER.md 5.4, step 1), and
classifies again after ``stage`` (the storage may have served, or been changed, since)."""

from __future__ import annotations

import numpy as np
import pytest

from dcr_log import LineageError
from dcr_log.receiver import Receiver
from dcr_log.receiver.storage import memory
from helpers import assert_same_bits, copy_state
from test_receiver import LAYOUT_VERSION, build_log, numpy_receiver


@pytest.fixture
def gathers(monkeypatch):
    """Counts of storage gathers before and after the write pass starts (its "inflight" point):
    calls of ``gather``, and of ``host_words``, through which a record's words are gathered
    with its targets and digests in one pass (GroupDigests.classify)."""
    seen = {"phase": "pass one", "pass one": 0, "writes": 0}
    for cls in (memory.NumpyStorage, memory.TorchStorage):
        for method in ("gather", "host_words"):
            real = getattr(cls, method)

            def counted(self, place, real=real):
                seen[seen["phase"]] += 1
                return real(self, place)

            monkeypatch.setattr(cls, method, counted)

    def hook(point, **info):
        if point == "inflight":
            seen["phase"] = "writes"
    seen["hook"] = hook
    return seen


def _records(log, version, tensors) -> int:
    return sum(1 for r in log.records(version) if r.kind != "tensor" and r.tensor in tensors)


@pytest.mark.parametrize("verify", ["none", "sample", "full"])
def test_apply_takes_pass_one_s_targets(tmp_path, gathers, verify):
    """Applied in one call, the write pass gathers only for its postconditions (sampled, or
    every record at full; none at none), never to classify; the bits are the log's. At none
    too pass one classifies the xor and overwrite records as it decodes them (without the
    checks none leaves out), so that the write pass finds them gathered."""
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    rx.fault = gathers["hook"]
    with rx:
        rx.bind(log, 0)
        reports = []
        rx.apply(log, to=1, verify=verify, on_version=reports.append)
    assert_same_bits(tensors, states[1])
    written = reports[0].written
    held = _records(log, 1, tensors)
    assert gathers["pass one"] >= held > 0
    if verify == "full":
        assert gathers["writes"] == written  # one read-back per written record, none to classify
    elif verify == "none":
        assert gathers["writes"] == 0
    else:
        assert gathers["writes"] < written   # sampled read-backs only


def test_stage_then_apply_classifies_again(tmp_path, gathers):
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    rx.fault = gathers["hook"]
    with rx:
        rx.bind(log, 0)
        rx.stage(log, 1, verify="full")
        rx.apply()
    assert_same_bits(tensors, states[1])
    held = _records(log, 1, tensors)
    assert gathers["writes"] >= 2 * held  # classified again, then read back


def test_a_tensor_changed_between_stage_and_apply_is_refused(tmp_path):
    """What pass one saw is not trusted after ``stage``: a word changed behind the receiver's
    back before ``apply`` is found, and the storage rolled back to version 0."""
    log, states = build_log(tmp_path / "log")
    rx, tensors = numpy_receiver(tmp_path, states[0])
    with rx:
        rx.bind(log, 0)
        rx.stage(log, 1, verify="sample")
        rec = next(r for r in log.records(1) if r.kind == "xor" and r.tensor in tensors)
        words = tensors[rec.tensor].words
        changed = np.flatnonzero(states[0][rec.tensor].words.reshape(-1) != states[1][rec.tensor].words.reshape(-1))
        words.reshape(-1)[changed[0]] ^= 1  # a position the version changes
        before = copy_state(tensors)
        with pytest.raises(LineageError, match="behind the journal's back"):
            rx.apply()
        assert_same_bits(tensors, before)
        assert rx.version == 0


def test_the_carried_targets_survive_a_layout_change(tmp_path):
    """Version LAYOUT_VERSION adds, drops, reshapes and retypes tensors: set_layout runs between
    pass one and the writes; the kept tensors' carried targets still land where they belong."""
    log, states = build_log(tmp_path / "log")
    for kind in ("numpy", "directory"):
        if kind == "numpy":
            rx, tensors = numpy_receiver(tmp_path, states[0], name=f"j-{kind}")
        else:
            from dcr_log.receiver import write_checkpoint

            d = tmp_path / "ckpt"
            d.mkdir()
            write_checkpoint(states[0], d)
            rx, tensors = Receiver.open(d), None
        with rx:
            rx.bind(log, 0)
            for v in range(1, LAYOUT_VERSION + 2):
                rx.apply(log, to=v, verify="sample")
            if tensors is not None:
                assert_same_bits(tensors, states[LAYOUT_VERSION + 1])
        if tensors is None:
            from dcr_log.checkpoint import load_checkpoint

            assert_same_bits(load_checkpoint(tmp_path / "ckpt"), states[LAYOUT_VERSION + 1])
