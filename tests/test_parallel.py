"""The shared pool's ordered maps: every result in order, consecutive light items grouped into
one task, errors reaching the caller only once no task still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dcr_log import TensorBits, digest, parallel
from dcr_log.receiver import Receiver
from helpers import flip_log


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("parallel_on", [True, False])
def test_map_grouped_yields_every_result_in_order(workers, parallel_on):
    rng = np.random.default_rng(workers)
    for n in (0, 1, 2, 7, 100):
        for weights in (rng.integers(0, 1000, n), np.zeros(n, int), np.full(n, 10**9)):
            items = list(range(n))
            for budget in (0, 2000):
                got = list(parallel.map_grouped(lambda x: x * x, items, [int(w) for w in weights], 500, workers,
                                                parallel_on, budget))
                assert got == [x * x for x in items]


def test_map_grouped_groups_consecutive_items_up_to_the_grain(monkeypatch):
    """Each task holds consecutive items; each but the last reaches the grain, and none holds
    more than it needs to; the grain shrinks so that every worker gets at least four tasks."""
    seen: list[list] = []
    real = parallel.map_ordered

    def recorded(fn, groups, workers, on=True, *weighed):
        seen.append(list(groups))
        return real(fn, groups, workers, on, *weighed)

    monkeypatch.setattr(parallel, "map_ordered", recorded)
    rng = np.random.default_rng(3)
    weights = [int(w) for w in rng.integers(1, 100, 400)]
    list(parallel.map_grouped(lambda x: x, list(range(400)), weights, 300, 2))
    groups = seen.pop()
    assert [x for g in groups for x in g] == list(range(400))
    for g in groups[:-1]:
        assert sum(weights[x] for x in g) >= 300
        assert sum(weights[x] for x in g[:-1]) < 300
    assert len(groups) < 400 / 2  # grouped: about 300 / 50 items a task
    # Light in all: the grain falls to a quarter of each worker's share.
    list(parallel.map_grouped(lambda x: x, list(range(40)), [1] * 40, 300, 2))
    assert [len(g) for g in seen.pop()] == [5] * 8


@pytest.fixture
def submitted(monkeypatch):
    """The items handed to the shared pool (of two threads), in order."""
    items: list = []
    pool = parallel.shared_pool(2)
    real_submit = pool.submit

    def recorded(fn, item):
        items.append(item)
        return real_submit(fn, item)

    monkeypatch.setattr(pool, "submit", recorded)
    return items


@pytest.mark.parametrize("seed", range(4))
def test_map_ordered_keeps_its_weights_in_flight_within_the_budget(submitted, seed):
    """Every result in order; at each one yielded, the items handed out and not yet yielded are
    at most workers + 1, or more only while they weigh at most the budget together and are
    at most LIGHT_ITEMS_PER_WORKER a worker. Without weights: at most workers + 1."""
    rng = np.random.default_rng(seed)
    n, budget = 200, 1000
    weights = [int(w) for w in rng.choice([0, 1, 40, 400, 999, 3000], n)]
    most = parallel.LIGHT_ITEMS_PER_WORKER * 2
    for given in (weights, None):
        submitted.clear()
        for got, item in enumerate(parallel.map_ordered(lambda x: x, list(range(n)), 2, True, given, budget)):
            assert item == got
            ahead = submitted[got:]  # handed out, this one included, not yet yielded before it
            if given is None or len(ahead) <= 3:
                assert len(ahead) <= 3
            else:
                assert sum(weights[x] for x in ahead) <= budget and len(ahead) <= most
        assert submitted == list(range(n))


def test_map_ordered_gives_light_items_to_a_thread_while_a_heavy_one_runs(submitted):
    """While the oldest item (heavy, slow) runs, the other thread takes the light ones after it,
    up to LIGHT_ITEMS_PER_WORKER a worker in flight: with weights, a thread does not idle until
    the oldest is yielded (without them, three items are in flight)."""
    started: list[int] = []
    lock = threading.Lock()
    all_in = threading.Event()

    def fn(x: int) -> int:
        with lock:
            started.append(x)
            if len(started) == expected:
                all_in.set()
        if x == 0:  # heavy: ends once the items expected in flight have started (or after 10 s)
            all_in.wait(10)
        return x

    weights = [500] + [1] * 40
    for given, expected in ((weights, parallel.LIGHT_ITEMS_PER_WORKER * 2), (None, 3)):
        started.clear()
        all_in.clear()
        results = parallel.map_ordered(fn, list(range(41)), 2, True, given, 1000)
        assert next(results) == 0
        assert len(started) == expected, started  # (nothing more is handed out until 0 is yielded)
        assert list(results) == list(range(1, 41))


def test_map_grouped_raises_only_once_every_task_ended():
    started, ended = [], []

    def fn(x):
        started.append(x)
        time.sleep(0.002)
        ended.append(x)
        if x == 9:
            raise ValueError("nine")
        return x

    with pytest.raises(ValueError, match="nine"):
        for _ in parallel.map_grouped(fn, list(range(60)), [1] * 60, 3, 2):
            pass
    assert sorted(started) == sorted(ended)


def _many_records(root, n: int = 1 << 14, rate: float = 0.1):
    """A version of 64 records (by default ~1600 changes each, 100k in all: enough for a
    receiver's pool)."""
    log, base, new = flip_log(root, tensors=64, n=n, rate=rate, seed=4)
    assert log.commit(1).stats.records >= 64
    return log, base, new


@pytest.fixture
def pool_tasks(monkeypatch):
    """The tasks (functions) handed to the shared pool."""
    tasks: list = []
    pool = parallel.shared_pool(parallel.DEFAULT_WORKERS)
    real_submit = pool.submit

    def counted(fn, *args, **kwargs):
        tasks.append(fn)
        return real_submit(fn, *args, **kwargs)

    monkeypatch.setattr(pool, "submit", counted)
    return tasks


def test_an_apply_hands_the_pool_a_task_per_group_of_records(tmp_path, pool_tasks, monkeypatch):
    """Pass 1, the writes and the checks after writing give the pool consecutive records
    together, and the write pass sends it none of the records pass 1 already gathered (a task
    a record was three hand-offs per record). The bits are the log's. (verify=full's
    whole-state digests go to the pool in spans of their own: counted apart.)"""
    from dcr_log.receiver.storage import base as storage_base

    # Records of ~1600 changes stay on the calling thread by default (pool_pays): here the
    # pool's hand-offs are what is checked. So are the state digests' spans (a model of 1M
    # words is digested on the calling thread by default: box_digests).
    monkeypatch.setattr(parallel, "RECORD_MIN_CHANGES", 0)
    monkeypatch.setattr(digest, "DIGEST_SPAN", 1 << 16)

    digest_tasks: list[int] = []
    real_digests = storage_base.tensor_digests

    def counted_digests(*args, **kwargs):
        before = len(pool_tasks)
        try:
            return real_digests(*args, **kwargs)
        finally:
            digest_tasks.append(len(pool_tasks) - before)

    monkeypatch.setattr(storage_base, "tensor_digests", counted_digests)
    log, base, new = _many_records(tmp_path / "log")
    tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    with Receiver.open(tensors, tmp_path / "j") as rx:
        rx.bind(log, 0, verify="none")
        pool_tasks.clear()
        digest_tasks.clear()
        rx.apply(log, to=1, verify="full")
        tasks = len(pool_tasks) - sum(digest_tasks)
    for k, v in new.items():
        assert np.array_equal(tensors[k].words, v.words), k
    assert digest_tasks and all(n > 0 for n in digest_tasks)  # the state digests, on the pool
    assert 0 < tasks <= log.commit(1).stats.records / 2


def test_a_replay_hands_the_pool_a_task_per_group_of_records(tmp_path, pool_tasks, monkeypatch):
    """Records large enough for the pool (replay.PARALLEL_MIN_ELEMENTS) but with few changes go
    to it together; the state ends at the log's bits. (With the pool required: records that
    average so few changes stay on the calling thread by default.)"""
    monkeypatch.setattr(parallel, "RECORD_MIN_CHANGES", 0)
    log, base, new = _many_records(tmp_path / "log", n=1 << 17, rate=0.005)
    state = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    pool_tasks.clear()
    log.apply_version(state, 1)
    assert 0 < len(pool_tasks) <= log.commit(1).stats.records / 4
    for k, v in new.items():
        assert np.array_equal(state[k].words, v.words), k


_AFFINITY_PROBE = """
import json, os, sys, threading
cpus = [int(c) for c in sys.argv[1].split(",")]
os.sched_setaffinity(0, set(cpus))
from dcr_log import parallel
out = {}
for workers in (1, len(cpus)):
    barrier = threading.Barrier(workers)
    def probe():
        barrier.wait(timeout=30)  # one task on each thread of the pool
        return sorted(os.sched_getaffinity(0))
    pool = parallel.shared_pool(workers)
    out[workers] = sorted(f.result() for f in [pool.submit(probe) for _ in range(workers)])
out["caller"] = sorted(os.sched_getaffinity(0))
print(json.dumps(out))
"""


def _pool_affinities(setting: str | None, cpus: list[int]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != parallel.PIN_ENV}
    if setting is not None:
        env[parallel.PIN_ENV] = setting
    return subprocess.run([sys.executable, "-c", _AFFINITY_PROBE, ",".join(map(str, cpus))], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="binding threads to CPUs needs two CPUs and sched_setaffinity")
def test_pool_threads_are_bound_one_per_cpu_where_the_pool_covers_the_cpus():
    """By default (and with DCR_PIN_THREADS=1) a pool with a thread for every CPU the process
    may use binds each thread to its own CPU; a smaller pool is bound only when asked to, and
    with DCR_PIN_THREADS=0 none is. The caller's own affinity is never changed."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    pinned = [[cpus[0]], [cpus[1]]]
    for setting, small, full in ((None, [cpus], pinned), ("auto", [cpus], pinned), ("1", [[cpus[0]]], pinned),
                                 ("0", [cpus], [cpus, cpus])):
        proc = _pool_affinities(setting, cpus)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got == {"1": small, "2": full, "caller": cpus}, (setting, got)


def test_a_bad_pin_setting_is_a_usage_error():
    proc = _pool_affinities("sometimes", sorted(os.sched_getaffinity(0))[:2])
    assert proc.returncode != 0
    assert "UsageError" in proc.stderr and "DCR_PIN_THREADS='sometimes': auto, 1 or 0" in proc.stderr


@pytest.mark.parametrize("n, verify", [(1 << 14, "full"), (1 << 14, "sample"), (1 << 8, "full")])
def test_a_write_that_misses_its_target_is_caught_by_the_read_back(tmp_path, monkeypatch, n, verify):
    """A storage whose write puts one wrong bit into a record is refused after writing, at
    ``full`` and, for the first record (always sampled), at ``sample``: with records read
    back by the pool's task that wrote them (64 records of ~1600 changes each) and after the
    batch (few changes: written in order on the calling thread). The memory receiver rolls
    back the other tensors to their base bits (the victim's xor record is undone by stepping
    back from the words it holds, which the bad write left off by one bit)."""
    from dcr_log.errors import IntegrityError
    from dcr_log.receiver.storage.memory import NumpyStorage

    log, base, _ = _many_records(tmp_path / "log", n=n)
    first = log.segment_records(1, log.commit(1).segments[0])
    victim = next(first).tensor
    real_write = NumpyStorage.write
    missed: list[bool] = []

    def bad_write(self, place, values):
        words, _ = place
        if words is self._bits[victim].words and values.size and not missed:
            missed.append(True)
            values = values.copy()
            values[0] ^= 2  # not the low bit the version flips: neither base nor target
        real_write(self, place, values)

    monkeypatch.setattr(NumpyStorage, "write", bad_write)
    tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    with Receiver.open(tensors, tmp_path / "j") as rx:
        rx.bind(log, 0, verify="none")
        with pytest.raises(IntegrityError, match=f"tensor '{victim}' differs from the record's target after writing"):
            rx.apply(log, to=1, verify=verify)
        assert rx.version == 0
    assert missed
    for k, v in base.items():
        if k != victim:
            assert np.array_equal(tensors[k].words, v.words), k


@pytest.fixture
def alarm_interrupt():
    """A KeyboardInterrupt raised in the main thread after the given seconds (as SIGINT's
    handler raises it), whatever the main thread is waiting on."""
    import signal

    def on_alarm(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_an_interrupted_wait_lets_the_item_waited_for_finish(alarm_interrupt):
    """Interrupted while it waits for the oldest item's result, map_ordered still lets that
    item finish before the interrupt reaches its caller (a rollback must not race a write)."""
    finished: list[int] = []

    def slow(x: int) -> int:
        time.sleep(0.4 if x == 0 else 0.0)
        finished.append(x)
        return x

    alarm_interrupt(0.1)
    with pytest.raises(KeyboardInterrupt):
        for _ in parallel.map_ordered(slow, list(range(6)), 2):
            pass
    assert 0 in finished


def test_an_interrupted_replay_lets_the_records_in_flight_finish(tmp_path, monkeypatch, alarm_interrupt):
    """Interrupted while it waits for a group of records (the first, which outlasts the
    others), apply_version lets the groups in flight finish before the interrupt reaches its
    caller: nothing writes the state after."""
    from dcr_log.log import replay

    monkeypatch.setattr(parallel, "RECORD_MIN_CHANGES", 0)  # (the pool required, as above)
    log, base, _ = _many_records(tmp_path / "log", n=1 << 17, rate=0.005)
    state = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    real_group = replay._apply_group
    running: list[int] = []
    ended: list[int] = []

    def slow_group(*args, **kwargs):
        running.append(1)
        if len(running) == 1:  # the first group outlasts the others
            time.sleep(0.4)
        try:
            return real_group(*args, **kwargs)
        finally:
            ended.append(1)

    monkeypatch.setattr(replay, "_apply_group", slow_group)
    alarm_interrupt(0.15)
    with pytest.raises(KeyboardInterrupt):
        log.apply_version(state, 1)
    assert running and len(ended) == len(running)


def test_a_replay_of_records_with_few_changes_stays_on_the_calling_thread(tmp_path, pool_tasks):
    """A version whose records average fewer than parallel.RECORD_MIN_CHANGES changes
    is applied without the pool (their Python would take turns at the GIL there); one whose
    records hold more goes to it. Both end at the log's bits."""
    for rate, pooled in ((0.005, False), (0.05, True)):
        log, base, new = _many_records(tmp_path / f"log-{rate}", n=1 << 17, rate=rate)
        stats = log.commit(1).stats
        assert (stats.changed_elements >= parallel.RECORD_MIN_CHANGES * stats.records) == pooled
        state = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
        pool_tasks.clear()
        log.apply_version(state, 1)
        assert bool(pool_tasks) == pooled, (rate, len(pool_tasks))
        for k, v in new.items():
            assert np.array_equal(state[k].words, v.words), k
