"""A Hypothesis state machine over receivers: appends (0-100% changes, tensors added, removed,
reshaped, retyped), applies to the latest or an earlier version, applies interrupted by an
exception, simulated crashes of a checkpoint-directory receiver (some followed by a power
loss, helpers.powerloss), re-applies and wrong lineages. Invariant: once nothing is in
flight, each receiver's storage equals, bit for bit, the dense state of its journal's
current version (the model keeps every version's state)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dcr_log import DeltaLog, LineageError, TensorBits
from dcr_log.checkpoint import load_checkpoint
from dcr_log.coords import DTYPE_WIDTH
from dcr_log.receiver import Receiver, write_checkpoint
from dcr_log.state import to_state, to_torch
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import change_words, copy_state, make_bits
from helpers.powerloss import PowerLossModel


class SimulatedCrash(BaseException):
    """Stands for SIGKILL: not an Exception, so no rollback runs."""


class Injected(Exception):
    pass


DTYPES = ("BF16", "F32", "F16", "U8", "I64", "BOOL", "F8_E4M3")
SHAPES = ((), (0,), (1,), (7,), (3, 11), (12, 20), (2, 3, 5), (40,))
POLICY = EncodePolicy(chunk_elements=32)
SEGMENT_BYTES = 256
MEMORY_POINTS = ("inflight", "layout", "record", "before_commit")
DURABLE_POINTS = MEMORY_POINTS + ("layout_file", "redo", "torn", "flushed", "applied", "committed")
RECEIVERS = ("numpy", "torch", "ckpt")


def _fault(points: tuple[str, ...], nth: int, exc: type[BaseException]):
    seen = {}

    def hook(name, **info):
        if name in points:
            seen[name] = seen.get(name, 0) + 1
            if seen[name] == nth:
                raise exc(name)
    return hook


class ReceiverMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), sharded=st.booleans(),
                spec=st.lists(st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES)), min_size=1, max_size=4))
    def setup(self, seed, sharded, spec):
        self.tmp = Path(tempfile.mkdtemp(prefix="dcr-sm-"))
        self.patches = pytest.MonkeyPatch()
        self.power = PowerLossModel(self.patches, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.next_name = len(spec)
        state = {f"t{i}": make_bits(self.rng, dtype, shape) for i, (dtype, shape) in enumerate(spec)}
        self.writer = LogWriter.create(self.tmp / "log", state, policy=POLICY, segment_bytes=SEGMENT_BYTES)
        self.log = DeltaLog.open(self.tmp / "log")
        self.states = [copy_state(state)]
        LogWriter.create(self.tmp / "foreign", state)  # the same states under another log id
        self.foreign = DeltaLog.open(self.tmp / "foreign")
        self.memory = {
            "numpy": copy_state(state),
            "torch": {n: to_torch(TensorBits(b.dtype, b.shape, b.words.copy())) for n, b in state.items()},
        }
        self.rx = {}
        for kind in ("numpy", "torch"):
            self.rx[kind] = Receiver.open(self.memory[kind], self.tmp / f"journal-{kind}", layout_changes="own")
            self.rx[kind].bind(self.log, 0)
        self.ckpt_dir = self.tmp / "ckpt"
        self.ckpt_dir.mkdir()
        nbytes = sum(b.nbytes for b in state.values())
        write_checkpoint(state, self.ckpt_dir, shard_bytes=max(1, nbytes // 3) if sharded else None)
        self.rx["ckpt"] = Receiver.open(self.ckpt_dir)
        self.rx["ckpt"].bind(self.log, 0, verify="full")

    def teardown(self):
        for rx in getattr(self, "rx", {}).values():
            rx.close()
        if hasattr(self, "patches"):
            self.patches.undo()
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model ---------------------------------------------------------------------------

    def storage_state(self, kind: str) -> dict[str, TensorBits]:
        if kind == "numpy":
            return self.memory["numpy"]
        if kind == "torch":
            return to_state(self.memory["torch"])
        storage = self.rx["ckpt"].storage
        return {n: TensorBits(d, s, storage.words(n)) for n, (d, s) in storage.layout().items()}

    def assert_holds(self, kind: str, version: int) -> None:
        got, expected = self.storage_state(kind), self.states[version]
        assert sorted(got) == sorted(expected), kind
        for name, exp in expected.items():
            assert (got[name].dtype, got[name].shape) == (exp.dtype, exp.shape), (kind, name)
            assert np.array_equal(got[name].words, exp.words), (kind, name, version)

    @property
    def latest(self) -> int:
        return len(self.states) - 1

    # -- rules -------------------------------------------------------------------------------

    @rule(seed=st.integers(0, 2**32 - 1), rate=st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.5, 1.0]),
          change=st.sampled_from(["none", "none", "add", "remove", "reshape", "retype"]),
          kind=st.sampled_from(["xor", "xor", "overwrite"]))
    def append(self, seed, rate, change, kind):
        rng = np.random.default_rng(seed)
        state = {n: change_words(rng, b, rate) for n, b in self.states[-1].items()}
        names = sorted(state)
        victim = names[int(rng.integers(len(names)))]
        if change == "add":
            state[f"t{self.next_name}"] = make_bits(rng, DTYPES[rng.integers(len(DTYPES))],
                                                    SHAPES[rng.integers(len(SHAPES))])
            self.next_name += 1
        elif change == "remove" and len(names) > 1:
            del state[victim]
        elif change == "reshape":
            state[victim] = make_bits(rng, state[victim].dtype, SHAPES[rng.integers(len(SHAPES))])
        elif change == "retype":
            same_width = [d for d in DTYPES if DTYPE_WIDTH[d] == DTYPE_WIDTH[state[victim].dtype]]
            dtype = same_width[rng.integers(len(same_width))] if rng.integers(2) else DTYPES[rng.integers(len(DTYPES))]
            state[victim] = make_bits(rng, dtype, state[victim].shape)
        self.writer.append(state, kind=kind, allow_layout_change=change != "none")
        self.states.append(copy_state(state))

    def _target(self, kind: str, to: int | None) -> int | None:
        st_ = self.rx[kind].state
        low = st_.version if st_.inflight is None else st_.inflight
        if to is None or low > self.latest:
            return None
        return low + to % (self.latest - low + 1)

    @rule(kind=st.sampled_from(RECEIVERS), to=st.none() | st.integers(0, 50),
          verify=st.sampled_from(["none", "sample", "full"]))
    def apply(self, kind, to, verify):
        rx = self.rx[kind]
        before = rx.version
        target = self._target(kind, to)
        applied = rx.apply(self.log, to=target, verify=verify)
        end = self.latest if target is None else target
        assert applied == list(range(before + 1, end + 1))
        assert rx.version == end and rx.inflight is None
        self.assert_holds(kind, end)

    @rule(kind=st.sampled_from(RECEIVERS), point=st.sampled_from(DURABLE_POINTS),
          nth=st.integers(1, 6), verify=st.sampled_from(["none", "sample", "full"]))
    def apply_interrupted(self, kind, point, nth, verify):
        rx = self.rx[kind]
        before = rx.state
        rx.fault = _fault((point,), nth, Injected)
        try:
            rx.apply(self.log, verify=verify)
        except Injected:
            after = rx.state
            assert after.version >= before.version
            if kind != "ckpt":
                # Memory storage is rolled back to the journal's version (the invariant checks it).
                assert after.inflight is None
        else:  # the fault point was not reached: a normal apply
            assert rx.version == self.latest and rx.inflight is None
        finally:
            rx.fault = None

    @rule(point=st.sampled_from(DURABLE_POINTS + ("torn", "torn", "redo", "record")), nth=st.integers(1, 2),
          verify=st.sampled_from(["none", "sample", "full"]), rerun=st.sampled_from([True, True, False]),
          rerun_verify=st.sampled_from(["none", "sample", "full"]), power_loss=st.sampled_from([False, True]))
    def crash_ckpt(self, point, nth, verify, rerun, rerun_verify, power_loss):
        rx = self.rx["ckpt"]
        rx.fault = _fault((point,), nth, SimulatedCrash)
        try:
            rx.apply(self.log, verify=verify)
            rx.fault = None
            return
        except SimulatedCrash:
            pass
        # The process dies: nothing more runs in it. Reopen everything from disk.
        rx.close()
        if power_loss:  # and the machine with it: pages not synced since may revert
            self.power.lose_power(self.ckpt_dir)
        rx = self.rx["ckpt"] = Receiver.open(self.ckpt_dir)
        rx.route(self.log)  # what a receiver does first: restores what a power loss took
        if rerun:  # run it again at once (otherwise a later rule finds the version in flight)
            assert rx.apply(self.log, verify=rerun_verify)[-1:] in ([], [self.latest])
            assert rx.version == self.latest and rx.inflight is None
            self.assert_holds("ckpt", self.latest)

    @rule(kind=st.sampled_from(RECEIVERS), how=st.sampled_from(["foreign", "skip"]),
          verify=st.sampled_from(["none", "sample", "full"]))
    def wrong_lineage(self, kind, how, verify):
        rx = self.rx[kind]
        before = rx.state
        bits = {n: (b.dtype, b.shape, b.words.copy()) for n, b in self.storage_state(kind).items()}
        skip_to = before.version + 2
        with pytest.raises(LineageError):
            if how == "skip" and skip_to <= self.latest:
                rx.apply_version(self.log, skip_to, verify=verify)
            else:
                rx.apply(self.foreign, verify=verify)
        assert rx.state == before
        after = self.storage_state(kind)
        assert sorted(after) == sorted(bits)
        for n, (dtype, shape, words) in bits.items():
            assert (after[n].dtype, after[n].shape) == (dtype, shape)
            assert np.array_equal(after[n].words, words)

    @precondition(lambda self: self.rx["ckpt"].inflight is None)
    @rule()
    def ckpt_loads_as_a_checkpoint(self):
        # What a serving process would load after a commit: the files and the index agree.
        got = load_checkpoint(self.ckpt_dir)
        expected = self.states[self.rx["ckpt"].version]
        assert sorted(got) == sorted(expected)
        for name, exp in expected.items():
            assert got[name].same_bits(exp), name

    @invariant()
    def storage_equals_journal_version(self):
        for kind, rx in getattr(self, "rx", {}).items():
            st_ = rx.state
            if kind != "ckpt":
                assert st_.inflight is None, kind
            if st_.inflight is None:
                self.assert_holds(kind, st_.version)


ReceiverMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestReceiverMachine = ReceiverMachine.TestCase
