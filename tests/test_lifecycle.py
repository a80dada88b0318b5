"""Log lifecycle: snapshots, squashed catch-up, retention and gc, stats (FORMAT.md sections
23-25, RECEIVER.md section 8)."""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from pathlib import Path

import numpy as np
import pytest

from dcr_log.errors import CommitConflict, ExpiredError, IntegrityError, LineageError, UsageError
from dcr_log.format.keys import version_key
from dcr_log.format.lifecycle import Marker, log_start_key
from dcr_log.lifecycle import gc, parse_duration, write_snapshot, write_squash
from dcr_log.log import DeltaLog
from dcr_log.receiver import Receiver, open_directory
from dcr_log.synthetic import SyntheticTrainer, lr_for_rate, specs_for_params
from dcr_log.write import LogWriter
from dcr_log.write.sharded import utc_now
from helpers import assert_one_line, assert_same_bits, change_words, copy_state, counting_store, make_state, run_cli

SPEC = {"embed": ("BF16", (96, 40)), "norm": ("F32", (40,)), "head": ("F16", (33, 7)), "step": ("I64", ())}


def _trace(root: Path, versions: int, seed: int = 0, rate: float = 0.03) -> list[dict]:
    """A log of ``versions`` versions of a small model; returns every version's state."""
    rng = np.random.default_rng(seed)
    state = make_state(rng, SPEC)
    writer = LogWriter.create(root, state, cache_dir=False)
    states = [copy_state(state)]
    for _ in range(versions - 1):
        state = {n: change_words(rng, b, rate) if n != "step" else b for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    return states


def _memory_receiver(tmp_path: Path, log: DeltaLog, state: dict, version: int):
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / f"j-{uuid.uuid4().hex[:8]}",
                       dtypes={n: b.dtype for n, b in state.items()}, layout_changes="own")
    rx.bind(log, version)
    return rx, arrays


def _holds(arrays: dict, expected: dict) -> None:
    assert set(arrays) == set(expected)
    for name, bits in expected.items():
        assert arrays[name].dtype.itemsize == bits.words.dtype.itemsize
        assert arrays[name].tobytes() == bits.words.tobytes(), name


@pytest.fixture(scope="module")
def long_log(tmp_path_factory):
    root = tmp_path_factory.mktemp("long") / "log"
    return root, _trace(root, 200, seed=3)


def test_gc_keeps_the_last_versions_and_new_receivers_start_from_the_snapshot(long_log, tmp_path):
    root, states = long_log
    work = tmp_path / "log"
    import shutil
    shutil.copytree(root, work)
    log = DeltaLog.open(work)
    # A receiver left behind at version 50, before the gc.
    behind, behind_arrays = _memory_receiver(tmp_path, log, states[50], 50)
    report = gc(log, keep_last=20, grace=0)
    assert report.snapshot_written == 180 and report.start == 180 and report.expired_start == 180
    assert report.deleted_versions == 180
    log = DeltaLog.open(work)
    assert log.versions() == list(range(180, 200))
    assert not any((work / "versions" / f"{v:020d}.json").exists() for v in range(180))
    assert not any((work / "segments" / str(v)).exists() and any((work / "segments" / str(v)).iterdir())
                   for v in range(180))
    for v in range(180, 200):  # every kept version replays bit-exact
        assert_same_bits(log.materialize(v), states[v])
    assert log.verify(deep=True).start == 180
    # An expired version: a clear not-found naming where the log starts.
    with pytest.raises(ExpiredError, match="now starts at version 180") as info:
        log.materialize(120)
    assert info.value.start == 180 and info.value.exit_code == 2
    # The receiver behind catches up from the snapshot.
    routes = []
    assert behind.apply(log, on_version=lambda r: routes.append(r.route)) == list(range(180, 200))
    assert routes == ["snapshot"] + ["version"] * 19
    _holds(behind_arrays, states[199])
    # A new receiver reads the snapshot and the deltas after it, and little else.
    counting = counting_store(str(work))
    fresh = DeltaLog.open(counting)
    needed = fresh.snapshot(180).delta_bytes + sum(fresh.commit(v).delta_bytes for v in range(181, 200))
    counting.bytes_read = 0
    target = tmp_path / "fresh"
    with open_directory(fresh, target) as rx:
        assert rx.version == 199
    assert counting.bytes_read <= 1.1 * needed, (counting.bytes_read, needed)
    assert_same_bits_dir(target, states[199])


def assert_same_bits_dir(directory: Path, expected: dict) -> None:
    from helpers import assert_file_holds
    assert_file_holds(directory / "model.safetensors", expected)


def test_writer_resumes_from_a_snapshot_after_gc(tmp_path):
    root = tmp_path / "log"
    states = _trace(root, 12)
    log = DeltaLog.open(root)
    gc(log, keep_last=3, grace=0)
    writer = LogWriter.open(root, cache_dir=False)  # no baseline cache: the route from the snapshot
    rng = np.random.default_rng(9)
    new = {n: change_words(rng, b, 0.05) if n != "step" else b for n, b in states[-1].items()}
    commit = writer.append(new)
    assert commit.version == 12
    assert_same_bits(DeltaLog.open(root).materialize(12), new)


def test_squash_catches_a_receiver_up_in_fewer_bytes(tmp_path):
    """A receiver 20 versions behind on an Adam-like trace, through a squash."""
    root = tmp_path / "log"
    trainer = SyntheticTrainer(specs_for_params(1 << 20, layers=2), seed=5)
    lr = lr_for_rate(0.03)
    writer = LogWriter.create(root, trainer.state(), cache_dir=False)
    states = [copy_state(trainer.state())]
    for _ in range(21):
        trainer.step(lr)
        writer.append(trainer.state())
        states.append(copy_state(trainer.state()))
    log = DeltaLog.open(root)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    squash = write_squash(log, 1, 21)
    chain = sum(log.commit(v).delta_bytes for v in range(2, 22))
    counting = counting_store(str(root))
    reader = DeltaLog.open(counting)
    assert [s.describe() for s in rx.route(reader)] == ["squash 1-21"]
    counting.bytes_read = 0
    reports = []
    assert rx.apply(reader, verify="full", on_version=reports.append) == [21]
    assert reports[0].route == "squash" and reports[0].start == 1
    assert counting.bytes_read <= 0.6 * chain, (counting.bytes_read, chain)
    assert squash.delta_bytes <= 0.6 * chain
    _holds(arrays, states[21])
    # The same through a reader: materialize(21) from a state at 1 equals the chain's.
    state = log.materialize(1)
    log.apply_step(state, log.catchup_step(squash))
    assert_same_bits(state, states[21])


def test_squash_creates_drops_and_retypes_tensors(tmp_path):
    rng = np.random.default_rng(4)
    s0 = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, s0, cache_dir=False)
    s1 = {**copy_state(s0), "extra": make_state(rng, {"x": ("U8", (17,))})["x"]}
    writer.append(s1, allow_layout_change=True)
    s2 = copy_state(s1)
    del s2["head"]
    s2["norm"] = make_state(rng, {"n": ("F64", (40,))})["n"]  # retyped
    writer.append(s2, allow_layout_change=True)
    s3 = {n: change_words(rng, b, 0.2) for n, b in s2.items()}
    writer.append(s3)
    log = DeltaLog.open(root)
    cu = write_squash(log, 0, 3)
    kinds = {rec.tensor: rec.kind for rec in log.records(log.catchup_step(cu))}
    assert kinds["extra"] == kinds["norm"] == "tensor" and kinds["embed"] == "xor"
    rx, arrays = _memory_receiver(tmp_path, log, s0, 0)
    assert rx.apply(log) == [3] and rx.version == 3
    _holds(arrays, s3)


def test_durable_receiver_interrupted_in_a_catch_up_step_finishes_it(tmp_path):
    root = tmp_path / "log"
    states = _trace(root, 10, seed=6, rate=0.3)
    log = DeltaLog.open(root)
    target = tmp_path / "rx"
    with open_directory(log, target, to=2):
        pass
    write_squash(log, 2, 7)
    write_snapshot(log, 5)
    for step_kind, start, kill_at in (("squash", 2, 1), ("snapshot", 1, 2)):
        if step_kind == "snapshot":  # a receiver at an expired version takes the snapshot
            target = tmp_path / "rx2"
            with open_directory(log, target, to=1):
                pass
            gc(log, keep_last=5, grace=0, snapshot=False)
            log = DeltaLog.open(root)
            assert log.versions()[0] == 5

        class Kill(Exception):
            pass

        seen = []

        def fault(point, **info):
            if point == "record":
                seen.append(info)
                if len(seen) == kill_at:
                    raise Kill()

        rx = open_directory(log, target, fault=fault)
        with pytest.raises(Kill):
            rx.apply(log)
        st = rx.state
        rx.close()
        assert st.inflight == 7 if step_kind == "squash" else st.inflight == 5
        assert st.inflight_kind == step_kind and st.version == start
        code, out, err = run_cli("status", "--receiver", target, "--json")
        assert code == 0 and json.loads(out)["inflight_kind"] == step_kind
        with open_directory(log, target) as rx:
            assert rx.route(log)[0].kind == step_kind
            done = rx.apply(log, verify="none")
            assert done[-1] == 9 and rx.inflight is None
        assert_same_bits_dir(target, states[9])


def test_squash_of_another_start_is_refused_before_any_write(tmp_path):
    root = tmp_path / "log"
    states = _trace(root, 6)
    log = DeltaLog.open(root)
    cu = write_squash(log, 2, 5)
    rx, arrays = _memory_receiver(tmp_path, log, states[3], 3)
    before = {n: a.copy() for n, a in arrays.items()}
    with pytest.raises(LineageError):
        rx.apply_step(log, log.catchup_step(cu))
    assert all(before[n].tobytes() == arrays[n].tobytes() for n in arrays)
    assert rx.version == 3 and rx.inflight is None


def test_forged_squash_is_refused_before_any_write(tmp_path):
    """A squash whose records claim digests that do not compose to its version's."""
    root = tmp_path / "log"
    states = _trace(root, 6)
    log = DeltaLog.open(root)
    real = write_squash(log, 1, 5)
    # Write a squash 1-4 that carries the records of 1-5: composition fails against 4's digests.
    import dataclasses
    fake = dataclasses.replace(real, version=4, state_digest=log.commit(4).state_digest,
                               commit_sha256=log.commit_sha256(4), segments=())
    refs = []
    for ref in real.segments:
        key = ref.key.replace("squashes/1-5/", "squashes/1-4/")
        log.store.put_new(key, bytes(log.store.get(ref.key)))
        refs.append(dataclasses.replace(ref, key=key))
    fake = dataclasses.replace(fake, segments=tuple(refs))
    log.store.put_new(fake.key, fake.to_bytes())
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    before = {n: a.copy() for n, a in arrays.items()}
    with pytest.raises(IntegrityError):
        rx.apply_step(log, log.catchup_step(log.squash(1, 4)), verify="none")
    assert all(before[n].tobytes() == arrays[n].tobytes() for n in arrays)
    assert rx.inflight is None
    with pytest.raises(IntegrityError):  # a reader checks every tensor digest after a squash
        state = log.materialize(1)
        log.apply_step(state, log.catchup_step(log.squash(1, 4)))


def test_snapshot_races_have_one_winner(tmp_path):
    root = tmp_path / "log"
    states = _trace(root, 4)
    results, errors = [], []

    def one():
        try:
            results.append(write_snapshot(DeltaLog.open(root), 3))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len({r.to_bytes() for r in results}) == 1
    listed = {ref.key for ref in results[0].segments}
    on_disk = {f"snapshots/3/{p.name}" for p in (root / "snapshots" / "3").iterdir() if p.suffix == ".arrow"}
    assert on_disk == listed  # the losers deleted their segments
    state = {}
    log = DeltaLog.open(root)
    log.apply_step(state, log.catchup_step(log.snapshot(3)))
    assert_same_bits(state, states[3])


def test_gc_waits_for_the_grace_period_and_removes_orphans(tmp_path):
    root = tmp_path / "log"
    _trace(root, 10)
    log = DeltaLog.open(root)
    orphan = "segments/4/ghost-" + "0" * 32 + ".arrow"
    log.store.put_new(orphan, b"lost commit")
    future = "segments/10/ghost-" + "1" * 32 + ".arrow"  # a commit in flight: never touched
    log.store.put_new(future, b"in flight")
    report = gc(log, keep_last=4, grace=3600)
    assert report.start == 6 and report.expired_start == 0 and report.deleted_objects == 0
    assert report.waiting == 1  # the marker waits (the orphan lies below it: it goes with it)
    log = DeltaLog.open(root)
    assert log.versions() == list(range(6, 10))
    assert (root / "versions" / f"{0:020d}.json").exists()  # still there for readers in flight
    later = gc(log, keep_last=4, grace=3600, now=time.time() + 3601)
    assert later.expired_start == 6 and later.deleted_versions == 6
    assert not (root / orphan).exists()
    assert (root / future).exists()
    # The expired versions' segment directories went with their last segment.
    assert sorted(int(p.name) for p in (root / "segments").iterdir()) == list(range(6, 11))
    assert gc(DeltaLog.open(root), keep_last=4, grace=0).deleted_objects == 0  # idempotent
    orphan2 = "segments/8/ghost-" + "2" * 32 + ".arrow"
    log.store.put_new(orphan2, b"lost")
    assert gc(DeltaLog.open(root), keep_last=4, grace=0).orphans == 1
    assert not (root / orphan2).exists() and (root / future).exists()


def test_keep_snapshots_retires_and_deletes_after_grace(tmp_path):
    root = tmp_path / "log"
    states = _trace(root, 12)
    log = DeltaLog.open(root)
    for v in (2, 4, 6, 8, 10):
        write_snapshot(log, v)
    report = gc(log, keep_last=10, keep_snapshots=2, grace=3600)
    assert report.start == 2 and report.retired == [4, 6]
    assert sorted(DeltaLog.open(root).snapshots()) == [2, 8, 10]
    assert (root / "snapshots" / "4" / "manifest.json").exists()  # within the grace period
    gc(DeltaLog.open(root), keep_last=10, keep_snapshots=2, grace=3600, now=time.time() + 3601)
    assert not (root / "snapshots" / "4").exists() or not any((root / "snapshots" / "4").iterdir())
    assert (root / "snapshots" / "2" / "manifest.json").exists()
    assert_same_bits(DeltaLog.open(root).materialize(11), states[11])


def test_a_bad_log_start_marker_is_refused(tmp_path):
    root = tmp_path / "log"
    _trace(root, 5)
    log = DeltaLog.open(root)
    write_snapshot(log, 3)
    marker = Marker(log.log_id, "log-start", 3, "0" * 64, utc_now())
    log.store.put_new(log_start_key(3), marker.to_bytes())
    with pytest.raises(IntegrityError, match="another snapshot"):
        DeltaLog.open(root).materialize(4)
    (root / log_start_key(3)).unlink()
    log.store.put_new(log_start_key(3), b"{}")
    with pytest.raises(IntegrityError):
        DeltaLog.open(root).versions()


def test_gc_is_safe_with_concurrent_writers_and_receivers(tmp_path):
    """4 writers, 4 receivers and readers, gc every few milliseconds for 100 rounds: no reader
    fails for a missing object, nothing committed and kept is lost."""
    root = tmp_path / "log"
    rng = np.random.default_rng(11)
    first = make_state(rng, {"w": ("BF16", (64, 32)), "b": ("F32", (32,))})
    LogWriter.create(root, first, cache_dir=False)
    committed: dict[int, dict] = {0: copy_state(first)}
    lock = threading.Lock()
    stop = threading.Event()
    failures: list[str] = []
    grace = 2.0

    expired = [0]  # reads that found their version expired (allowed)

    def writer(seed: int) -> None:
        local = np.random.default_rng(seed)
        while not stop.is_set():
            try:
                w = LogWriter.open(root, cache_dir=False, writer_id=f"w{seed}")
                base = DeltaLog.open(root).materialize(w.version)
                new = {n: change_words(local, b, 0.05) for n, b in base.items()}
                commit = w.append(new)
                with lock:
                    committed[commit.version] = copy_state(new)
            except CommitConflict:
                continue
            except ExpiredError:
                # Other writers committed past keep_last between open and materialize, and gc
                # moved the log start: the documented answer below it. Open again.
                expired[0] += 1
                continue
            except Exception as exc:
                failures.append(f"writer {seed}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return

    def receiver(index: int) -> None:
        log = DeltaLog.open(root)
        v = log.latest_version()
        state = log.materialize(v)
        rx, arrays = _memory_receiver(tmp_path, log, state, v)
        while not stop.is_set():
            try:
                log = DeltaLog.open(root)
                rx.apply(log)
                if index % 2:  # readers too: a fresh materialize of the latest
                    try:
                        log.materialize(rx.version)
                    except ExpiredError:
                        # Writers committed past keep_last meanwhile and gc moved the log
                        # start: the documented answer to a request below it, never wrong bits.
                        expired[0] += 1
            except Exception as exc:
                failures.append(f"receiver {index}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return
        with lock:
            expected = committed.get(rx.version)
        if expected is not None:
            try:
                _holds(arrays, expected)
            except AssertionError as exc:
                failures.append(f"receiver {index} at {rx.version}: {exc}")

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
    threads += [threading.Thread(target=receiver, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    rounds = 0
    try:
        while rounds < 100 and not failures:
            gc(DeltaLog.open(root), keep_last=3, keep_snapshots=1, grace=grace)
            rounds += 1
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:5]
    assert rounds == 100
    log = DeltaLog.open(root)
    versions = log.versions()
    assert versions[0] > 0, "the gc never expired anything"
    for v in versions:  # every kept version replays to what its writer committed
        assert_same_bits(log.materialize(v), committed[v])
    log.verify(deep=True)


def test_a_receiver_takes_the_next_version_after_retention_removed_its_own_meanwhile(tmp_path):
    """A receiver at version 1 planned the step to 2 from a listing where the log started at 0;
    before the step ran, gc moved the start to 2 and deleted version 1's objects (a receiver
    stalled past the grace period). Version 2's own objects are kept, so the step is applied:
    it reads version 2, not version 1's record. So is a squash from 1 whose manifest is read
    after the gc."""
    root = tmp_path / "log"
    states = _trace(root, 4, seed=12)
    log = DeltaLog.open(root)
    write_squash(log, 1, 3)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    rx2, arrays2 = _memory_receiver(tmp_path, log, states[1], 1)
    log = DeltaLog.open(root)  # a later loop's: it has not read version 1's record yet
    step = log.version_step(2)  # the log start as of this listing: 0
    log2 = DeltaLog.open(root)  # another receiver's, listed before the gc too
    assert log2.versions()[0] == 0
    gc(DeltaLog.open(root), keep_last=2, grace=0)
    gc(DeltaLog.open(root), keep_last=2, grace=0)  # the marker has stood for 0 s: deleted
    assert DeltaLog.open(root).versions()[0] == 2 and not (root / version_key(1)).exists()
    assert rx.apply_step(log, step).version == 2
    _holds(arrays, states[2])
    assert rx.apply(DeltaLog.open(root)) == [3]
    _holds(arrays, states[3])
    assert rx2.apply_step(log2, log2.catchup_step(log2.squash(1, 3))).version == 3
    _holds(arrays2, states[3])


def _gc_after_planning(log: DeltaLog, root: Path, times: int = 1) -> list[list[int]]:
    """Make ``log.plan`` run gc (keep the last 2, no grace, twice: the objects below the new
    start are deleted) after each of its first ``times`` plans: a receiver stalled past the
    grace period between planning its route and reading it. Returns the routes planned."""
    planned: list[list[int]] = []
    plan = log.plan

    def plan_then_gc(*args, **kwargs):
        route = plan(*args, **kwargs)
        planned.append([step.version for step in route])
        if len(planned) <= times:
            gc(DeltaLog.open(root), keep_last=2, grace=0)
            gc(DeltaLog.open(root), keep_last=2, grace=0)
        return route

    log.plan = plan_then_gc  # type: ignore[method-assign]
    return planned


def test_a_receiver_plans_again_when_retention_removes_its_route_before_it_is_read(tmp_path):
    """The route from version 1 was planned through versions 2..5; gc then moved the log start
    to 4 and deleted versions 2 and 3 before the receiver read them. Nothing was written for
    the step that found them gone: the receiver plans again (snapshot 4, then 5) and ends bit
    for bit at 5. A requested target that expired meanwhile is the ExpiredError, and nothing
    is written."""
    root = tmp_path / "log"
    states = _trace(root, 6, seed=13)
    log = DeltaLog.open(root)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    planned = _gc_after_planning(log, root)
    assert rx.apply(log) == [4, 5]
    assert planned == [[2, 3, 4, 5], [4, 5]]
    assert DeltaLog.open(root).versions()[0] == 4
    _holds(arrays, states[5])
    assert rx.version == 5

    root2 = tmp_path / "log2"
    states = _trace(root2, 6, seed=14)
    log = DeltaLog.open(root2)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    _gc_after_planning(log, root2)
    with pytest.raises(ExpiredError, match="version 3 has expired: the log now starts at version 4"):
        rx.apply(log, to=3)
    _holds(arrays, states[1])
    assert rx.version == 1
    assert rx.apply(DeltaLog.open(root2)) == [4, 5]
    _holds(arrays, states[5])


def test_a_route_planned_while_gc_moves_the_log_start_goes_through_the_new_start(tmp_path):
    """The versions were listed with the log starting at 0; gc moved the start to 4 (and
    deleted versions 2 and 3) before the snapshots were listed. The route from version 1
    goes through the new start's snapshot, not through version 2, which the listing of
    snapshots has since shown expired."""
    root = tmp_path / "log"
    states = _trace(root, 6, seed=16)
    log = DeltaLog.open(root)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    log = DeltaLog.open(root)
    snapshots = log.snapshots

    def gc_then_list(*args, **kwargs):
        gc(DeltaLog.open(root), keep_last=2, grace=0)
        gc(DeltaLog.open(root), keep_last=2, grace=0)
        return snapshots(*args, **kwargs)

    log.snapshots = gc_then_list  # type: ignore[method-assign]
    assert [step.version for step in log.plan(5, holding=1)] == [4, 5]
    log.snapshots = snapshots  # type: ignore[method-assign]
    assert rx.apply(log) == [4, 5]
    _holds(arrays, states[5])


def test_a_receiver_gives_up_planning_again_after_three_expired_routes(tmp_path, monkeypatch):
    """A receiver that keeps falling behind gc raises the ExpiredError after three new plans
    instead of planning forever; it still holds its version, untouched."""
    root = tmp_path / "log"
    states = _trace(root, 4, seed=15)
    log = DeltaLog.open(root)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    calls = []

    def expired(*args, **kwargs):
        calls.append(args[1].version)
        raise log.expired(1, "version 1")

    monkeypatch.setattr(rx, "_apply_step", expired)
    with pytest.raises(ExpiredError, match="version 1 has expired"):
        rx.apply(log)
    assert calls == [2, 2, 2, 2]
    monkeypatch.undo()
    _holds(arrays, states[1])
    assert rx.apply(log) == [2, 3]


def test_parse_duration():
    assert parse_duration("90") == 90 and parse_duration("15m") == 900 and parse_duration("2h") == 7200
    assert parse_duration("7d") == 7 * 86400 and parse_duration("500ms") == 0.5
    with pytest.raises(UsageError, match="bad duration"):
        parse_duration("soon")


def test_cli_snapshot_squash_gc_stats_and_log(tmp_path):
    root = tmp_path / "log"
    _trace(root, 12)
    rx = tmp_path / "rx"
    code, out, err = run_cli("apply", root, "--receiver", rx, "--to", "2")
    assert code == 0, err
    code, out, err = run_cli("squash", root, "2", "9")
    assert code == 0 and out.startswith("squash 2-9: ")
    code, out, err = run_cli("snapshot", root, "--version", "8")
    assert code == 0 and out.startswith("snapshot 8: ")
    code, out, err = run_cli("gc", root, "--keep-last", "4", "--grace", "0", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["start"] == 8 and report["deleted_versions"] == 8
    code, out, err = run_cli("replay", root, "--version", "3", "--out", tmp_path / "x.safetensors")
    assert code == 2 and "expired" in err and "starts at version 8" in err
    assert_one_line(err)
    assert not (tmp_path / "x.safetensors").exists()
    code, out, err = run_cli("log", root, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["version"] for r in rows if "kind" not in r] == list(range(8, 12))
    assert {(r["kind"], r["version"]) for r in rows if "kind" in r} == {("snapshot", 8), ("squash", 9)}
    code, out, err = run_cli("log", root)
    assert code == 0 and "log starts at version 8" in out and "squash" in out
    plot = tmp_path / "stats.png"
    code, out, err = run_cli("stats", root, "--json", "--plot", plot)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    versions = [r for r in rows if "kind" not in r]
    assert [r["version"] for r in versions] == list(range(8, 12))
    assert all(r["encodings"] and r["ratio"] > 1 and 0 < r["changed_pct"] < 100 for r in versions)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run_cli("gc", root, "--keep-last", "0")
    assert code == 2 and "--keep-last" in err
    code, out, err = run_cli("verify", root, "--deep")
    assert code == 0 and "from version 8" in out, err
    # The receiver at 2 (expired) catches up through the squash from 2, then versions 10, 11.
    code, out, err = run_cli("apply", root, "--receiver", rx)
    assert code == 0, err
    assert out.splitlines()[0].startswith("applied version 9 (squash from 2): ")
    code, out, err = run_cli("status", "--receiver", rx, "--json")
    assert json.loads(out)["version"] == 11


# -- engine receivers and trust --------------------------------------------------------------

def test_engine_receivers_catch_up_through_a_squash_and_a_snapshot(tmp_path):
    """A vLLM-like engine (fused, padded, tied, residual norms) at version 1 takes the squash
    1-6 (which retypes a norm and drops a tensor: through the loader), another at version 0
    (expired) the snapshot; both end bit-exact against a fresh engine's load_weights."""
    import torch  # noqa: F401  (the engines are torch modules)

    import engine_job as job
    from dcr_log.engines.discovery import discover
    from helpers.engines import EngineConfig, TestEngine, engine_params, fresh_engine

    cfg = EngineConfig()
    root = tmp_path / "log"
    w = LogWriter.create(root, job.canonical_at(cfg, 0), cache_dir=False)
    for v in range(1, 7):
        w.append(job.canonical_at(cfg, v), allow_layout_change=v in job.LAYOUT_CHANGES)
    log = DeltaLog.open(root)
    scratch = TestEngine(cfg)

    def rediscover(table):
        return discover(scratch.load_weights, table, engine_params(scratch), restore=False)

    def words(params):
        return {n: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, t in params.items()}

    engines = []
    for version in (1, 0):
        engine = fresh_engine(cfg, job.canonical_at(cfg, version))
        rx = Receiver.open(engine_params(engine), tmp_path / f"j{version}", loader=engine.load_weights,
                           placement=rediscover(log.commit(version)), rediscover=rediscover)
        rx.bind(log, version)
        engines.append((engine, rx))
    write_squash(log, 1, 6)
    gc(log, keep_last=2, grace=0)  # snapshot at 5, start 5: versions 0-4 expire
    log = DeltaLog.open(root)
    expected = words(engine_params(fresh_engine(cfg, job.canonical_at(cfg, 6))))
    for (engine, rx), route in zip(engines, (["squash"], ["snapshot", "version"])):
        reports = []
        rx.apply(log, on_version=reports.append)
        assert [r.route for r in reports] == route
        assert words(engine_params(engine)) == expected
        rx.close()


def test_under_a_trust_policy_catch_up_steps_are_checked_in_full(tmp_path):
    from dcr_log.signing import SigningKey

    key = SigningKey.generate()
    rng = np.random.default_rng(2)
    state = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, signing_key=key)
    states = [copy_state(state)]
    for _ in range(6):
        state = {n: change_words(rng, b, 0.1) for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    log = DeltaLog.open(root, trust=[key.public])
    real = write_squash(log, 1, 5)
    # A forger (anyone who can write the store) replaces the squash: one value changed, the
    # record digests kept, so they still compose; only checking the values shows it.
    import dataclasses
    import hashlib

    from dcr_log.codec.raw import RawEncoding
    from dcr_log.format import SegmentRef, encode_segment
    from dcr_log.log.records import decode_record

    records = list(log.records(log.catchup_step(real)))
    table = log.commit(5).tensor_map()
    i = next(i for i, r in enumerate(records) if r.kind == "xor")
    changes = decode_record(records[i], table[records[i].tensor])
    changes.values[0] ^= 1
    params, payload = RawEncoding().encode("xor", changes)
    records[i] = dataclasses.replace(records[i], encoding="raw", params=params, payload=payload)
    data = encode_segment(records, log.log_id, 5)
    for ref in real.segments:
        (root / ref.key).unlink()
    (root / real.key).unlink()
    key_name = "squashes/1-5/forger-" + "f" * 32 + ".arrow"
    log.store.put_new(key_name, data)
    forged = dataclasses.replace(real, segments=(SegmentRef(key_name, len(data), hashlib.sha256(data).hexdigest(),
                                                            len(records)),))
    log.store.put_new(forged.key, forged.to_bytes())

    def receiver(trust):
        arrays = {n: b.words.reshape(b.shape).copy() for n, b in states[1].items()}
        rx = Receiver.open(arrays, tmp_path / f"j{uuid.uuid4().hex[:6]}",
                           dtypes={n: b.dtype for n, b in states[1].items()}, trust=trust)
        rx.bind(DeltaLog.open(root, trust=trust), 1)
        return rx, arrays

    rx, arrays = receiver([key.public])
    log = DeltaLog.open(root, trust=[key.public])
    assert [s.kind for s in rx.route(log)] == ["squash", "version"]
    reports = []
    # verify=none asked, full applied to the squash: refused (and rolled back), then the
    # signed chain of versions, applied without checks, ends bit-exact.
    rx.apply(log, verify="none", on_version=reports.append)
    assert [r.route for r in reports] == ["version"] * 5 and forged.key in log.excluded
    _holds(arrays, states[6])
    # The genuine squash under the same policy: applied, bit-exact.
    (root / key_name).unlink()
    (root / real.key.replace("manifest.json", "") / "manifest.json").unlink()
    log = DeltaLog.open(root, trust=[key.public])
    write_squash(log, 1, 5)
    rx, arrays = receiver([key.public])
    reports = []
    rx.apply(DeltaLog.open(root, trust=[key.public]), verify="none", on_version=reports.append)
    assert [r.route for r in reports] == ["squash", "version"]
    _holds(arrays, states[6])


def test_a_damaged_squash_or_snapshot_is_avoided(tmp_path):
    """Routes avoid a catch-up object that fails its checks; verify reports it."""
    root = tmp_path / "log"
    states = _trace(root, 8)
    log = DeltaLog.open(root)
    squash = write_squash(log, 1, 6)
    snap = write_snapshot(log, 6)
    for ref in squash.segments + snap.segments:  # damage both: one byte each
        path = root / ref.key
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    log = DeltaLog.open(root)
    rx, arrays = _memory_receiver(tmp_path, log, states[1], 1)
    assert [s.kind for s in rx.route(log)][0] == "squash"
    reports = []
    assert rx.apply(log, on_version=reports.append) == list(range(2, 8))
    assert {r.route for r in reports} == {"version"}
    _holds(arrays, states[7])
    assert squash.key in log.excluded
    fresh = DeltaLog.open(root)
    assert_same_bits(fresh.materialize(7), states[7])  # around the damaged snapshot
    assert snap.key in fresh.excluded
    with pytest.raises(IntegrityError):
        DeltaLog.open(root).verify()


def test_recovering_a_squash_from_an_expired_version_that_reshapes(tmp_path):
    """Interrupted inside a squash whose start has expired and which reshapes a tensor: the
    storage then already has the new layout; recovery finishes the same squash."""
    rng = np.random.default_rng(8)
    s0 = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, s0, cache_dir=False, segment_bytes=256)
    s1 = copy_state(s0)
    s1["embed"] = type(s0["embed"])("BF16", (40, 96), s0["embed"].words.copy())  # reshaped
    states = [s0, s1]
    writer.append(s1, allow_layout_change=True)
    for _ in range(3):
        states.append({n: change_words(rng, b, 0.02) for n, b in states[-1].items()})
        writer.append(states[-1])
    log = DeltaLog.open(root)
    target = tmp_path / "rx"
    with open_directory(log, target, to=0):
        pass
    write_squash(log, 0, 3, segment_bytes=256)
    write_snapshot(log, 3)
    gc(log, keep_last=2, grace=0)
    log = DeltaLog.open(root)

    class Kill(Exception):
        pass

    def fault(point, **info):
        if point == "record":  # the first record written: the reshaped tensor's
            raise Kill()

    rx = open_directory(log, target, fault=fault)
    with pytest.raises(Kill):  # the squash itself (the snapshot reads fewer bytes here)
        rx.apply_step(log, log.catchup_step(log.squash(0, 3)))
    assert rx.state.inflight_kind == "squash"
    rx.close()
    with open_directory(log, target) as rx:
        reports = []
        assert rx.apply(log, on_version=reports.append) == [3, 4]
        assert reports[0].recovered and reports[0].route == "squash"
    assert_same_bits_dir(target, states[4])


def test_gc_removes_temporary_files_a_killed_writer_left(tmp_path):
    root = tmp_path / "log"
    _trace(root, 4)
    stale = [root / "versions" / ".00000000000000000004.json.0123.tmp",
             root / "segments" / "3" / ".w-0.arrow.4567.tmp"]
    for path in stale:
        path.write_bytes(b"half written")
    log = DeltaLog.open(root)
    assert log.versions() == [0, 1, 2, 3]  # ignored by readers
    assert gc(log, keep_last=10, grace=3600).deleted_objects == 0  # too young
    report = gc(DeltaLog.open(root), keep_last=10, grace=3600, now=time.time() + 3601)
    assert report.orphans == 2 and not any(p.exists() for p in stale)
    assert DeltaLog.open(root).versions() == [0, 1, 2, 3]


@pytest.mark.parametrize("deep", [False, True])
def test_verify_reads_the_log_starts_own_segments(tmp_path, deep):
    """After retention the log start S > 0 is replayed from snapshot S, not from version S's own
    segments (their parent expired); verification still reads those, deep or not."""
    rng = np.random.default_rng(0)
    state = make_state(rng, {"w": ("BF16", (64, 64))})
    writer = LogWriter.create(tmp_path / "log", state, cache_dir=False)
    for _ in range(4):
        state = {n: change_words(rng, b, 0.05) for n, b in state.items()}
        writer.append(state)
    gc(DeltaLog.open(tmp_path / "log"), 2, grace=0)
    log = DeltaLog.open(tmp_path / "log")
    start = log.start()
    assert start == 3
    log.verify(deep=deep)
    path = tmp_path / "log" / log.commit(start).segments[0].key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        DeltaLog.open(tmp_path / "log").verify(deep=deep)
