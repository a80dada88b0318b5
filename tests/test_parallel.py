"""The shared pool's ordered maps: every result in order, consecutive light items grouped into
one task, errors reaching the caller only once no task still runs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dcr_log import LogWriter, TensorBits, parallel
from dcr_log.receiver import Receiver


@pytest.mark.parametrize("workers", [1, 2, 4])
@pytest.mark.parametrize("parallel_on", [True, False])
def test_map_grouped_yields_every_result_in_order(workers, parallel_on):
    rng = np.random.default_rng(workers)
    for n in (0, 1, 2, 7, 100):
        for weights in (rng.integers(0, 1000, n), np.zeros(n, int), np.full(n, 10**9)):
            items = list(range(n))
            got = list(parallel.map_grouped(lambda x: x * x, items, [int(w) for w in weights], 500, workers,
                                            parallel_on))
            assert got == [x * x for x in items]


def test_map_grouped_groups_consecutive_items_up_to_the_grain(monkeypatch):
    """Each task holds consecutive items; each but the last reaches the grain, and none holds
    more than it needs to; the grain shrinks so that every worker gets at least four tasks."""
    seen: list[list] = []
    real = parallel.map_ordered

    def recorded(fn, groups, workers, on=True):
        seen.append(list(groups))
        return real(fn, groups, workers, on)

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


def test_an_apply_hands_the_pool_a_task_per_group_of_records(tmp_path, monkeypatch):
    """Pass 1, the writes and the checks after writing give the pool consecutive records
    together, and the write pass sends it none of the records pass 1 already gathered (a task
    a record was three hand-offs per record). The bits are the log's."""
    rng = np.random.default_rng(4)
    n = 1 << 14
    base = {f"w{i}": TensorBits("BF16", (n // 256, 256), rng.integers(0, 1 << 16, n, dtype=np.uint16))
            for i in range(64)}
    new = {}
    for k, b in base.items():
        words = b.words.copy()
        words[rng.random(n) < 0.1] ^= 1
        new[k] = TensorBits(b.dtype, b.shape, words)
    writer = LogWriter.create(tmp_path / "log", base, cache_dir=False)
    writer.append(new)
    records = writer.log.commit(1).stats.records
    assert records >= 64
    tensors = {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in base.items()}
    tasks: list[str] = []
    pool = parallel.shared_pool(parallel.DEFAULT_WORKERS)
    real_submit = pool.submit

    def counted(fn, *args, **kwargs):
        tasks.append(threading.current_thread().name)
        return real_submit(fn, *args, **kwargs)

    with Receiver.open(tensors, tmp_path / "j") as rx:
        rx.bind(writer.log, 0, verify="none")
        monkeypatch.setattr(pool, "submit", counted)
        rx.apply(writer.log, to=1, verify="full")
        monkeypatch.undo()
    for k, v in new.items():
        assert np.array_equal(tensors[k].words, v.words), k
    assert 0 < len(tasks) <= records / 2
