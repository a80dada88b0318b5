"""The process-wide thread pools and ``map_ordered``, the one way work goes to them.

Writers, readers and receivers come and go; their threads should not pile up, so every pool
of one size is shared (and forgotten in a forked child)."""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

# Threads that encode the boxes of one tensor (numpy and zstd release the GIL); more than a
# few only add memory traffic to a pass that is already bound by it.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))


# Work on records goes to the pool in tasks of at least this many changes where it can
# (map_grouped): at 1% changed, about four records of a few million elements.
TASK_CHANGES = 1 << 17

# Records go to the pool only where they average at least this many changes (receivers' pass
# one and writes, replay): each record also costs its thread tens of microseconds of Python,
# which two threads take turns at (the GIL), so many small records ran slower on the pool than
# on one thread. tools/bench_apply.py --gib 0.0625 --layers 24 --reps 9 --receivers
# numpy,torch,ckpt --verify sample --rates 0.01 (219 records of 1450 changes on average), two
# runs each way, alternating: numpy 0.022-0.023 s on the calling thread against 0.026 on the
# pool, torch 0.023-0.024 against 0.038, a checkpoint directory 0.038 against 0.054-0.058; with
# --gib 0.125 (2970 changes a record, the pool either way) the same.
RECORD_MIN_CHANGES = 1 << 11


def records_large_enough(changes: int, records: int) -> bool:
    """Whether ``records`` holding ``changes`` in all average RECORD_MIN_CHANGES or more."""
    return changes >= RECORD_MIN_CHANGES * records


T = TypeVar("T")
R = TypeVar("R")


_POOLS: dict[int, ThreadPoolExecutor] = {}


# DCR_PIN_THREADS: "auto" (the default), "1" or "0". Whether each thread of a shared pool is
# bound to one CPU of the set its creator may use (round-robin). On a 2-core virtual machine
# the kernel woke the threads that hand the GIL and the tasks to each other on the waker's CPU
# after an idle moment while the other core idled: tools/bench_side.py --gib 0.5 --rates 0.01
# --no-minilm gave the numpy receiver after a 0.5 s pause (rx_numpy_idle) 0.58 of copyto's
# speed unbound (DCR_PIN_THREADS=0), 0.87 bound. "auto" binds only where
# the pool has a thread for every CPU the process may use, so a thread is never bound away
# from a CPU that no other thread of the pool would take.
PIN_ENV = "DCR_PIN_THREADS"


def _pinning(workers: int) -> Callable[[], None] | None:
    """The pool threads' initializer that binds each to its CPU, or None (not bound)."""
    setting = os.environ.get(PIN_ENV, "auto").strip().lower() or "auto"
    if setting not in ("auto", "0", "1"):
        from dcr_log.errors import UsageError

        raise UsageError(f"{PIN_ENV}={setting!r}: auto, 1 or 0")
    if setting == "0" or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or (setting == "auto" and workers < len(cpus)):
        return None
    turn = itertools.count()

    def pin() -> None:
        try:
            os.sched_setaffinity(0, {cpus[next(turn) % len(cpus)]})
        except OSError:
            pass  # (a CPU taken away since: the thread stays where the kernel puts it)

    return pin


_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int) -> ThreadPoolExecutor:
    """One process-wide pool per size, shared by every Differ and replay (writers and readers
    come and go; their threads should not pile up). Tasks never wait on other tasks, so
    sharing cannot deadlock. Its threads may be bound to CPUs (PIN_ENV)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="dcr",
                                                        initializer=_pinning(workers))
        return pool


_SIDE: list[ThreadPoolExecutor] = []


def side_thread() -> ThreadPoolExecutor:
    """One process-wide thread for work that runs beside its caller's own (a segment's hash
    beside its write), so that it never queues behind the shared pools' tasks. Its tasks
    never wait on other tasks."""
    with _POOLS_LOCK:
        if not _SIDE:
            _SIDE.append(ThreadPoolExecutor(1, thread_name_prefix="dcr-side"))
        return _SIDE[0]


def beside(side: Callable[[], R], main: Callable[[], object]) -> R:
    """``side()`` on the side thread while ``main()`` runs on this one (each should release the
    GIL: a hash beside the write or upload of its bytes), and side's result. Both have ended
    when this returns or raises, so the caller may reuse what they read; main's error first."""
    future = side_thread().submit(side)
    try:
        main()
    finally:
        wait([future])
    return future.result()


def _forget_pools() -> None:
    global _POOLS_LOCK
    _POOLS.clear()  # a forked child has none of the parent's threads
    _SIDE.clear()
    _POOLS_LOCK = threading.Lock()  # nor a lock another thread held at the fork


def take_oldest(pending: deque[Future[R]]) -> R:
    """The oldest future's result, the future taken off the queue only once it has ended: a
    wait that is interrupted (a signal's KeyboardInterrupt) leaves it there, for the caller's
    cleanup to wait for, so that no task outlives a rollback."""
    result = pending[0].result()
    pending.popleft()
    return result


# With weights, map_ordered keeps at most this many items in flight per worker, however light.
LIGHT_ITEMS_PER_WORKER = 4


def map_ordered(fn: Callable[[T], R], items: Sequence[T], workers: int, parallel: bool = True,
                weights: Sequence[int] | None = None, budget: int = 0) -> Generator[R, None, None]:
    """``fn(item)`` for each item, on ``workers`` threads of the shared pool, yielded in order,
    with at most ``workers + 1`` results in flight. Given ``weights`` (what each item's result
    may hold), more while the items in flight weigh at most ``budget`` together (up to
    LIGHT_ITEMS_PER_WORKER per worker): with items of mixed sizes (a model's norms and small
    matrices among its large ones), a thread that has ended a light item takes the next one
    instead of idling until the heavy oldest is yielded."""
    if workers <= 1 or len(items) < 2 or not parallel:
        for item in items:
            yield fn(item)
        return
    pool = shared_pool(workers)
    pending: deque[Future[R]] = deque()
    held: deque[int] = deque()  # the weights of the items in pending, in the same order
    in_flight = 0
    most = LIGHT_ITEMS_PER_WORKER * workers

    def full(weight: int) -> bool:
        if len(pending) <= workers:
            return False
        return weights is None or in_flight + weight > budget or len(pending) >= most

    try:
        for n, item in enumerate(items):
            weight = 0 if weights is None else weights[n]
            while full(weight):
                result = take_oldest(pending)
                in_flight -= held.popleft()
                yield result
            pending.append(pool.submit(fn, item))
            held.append(weight)
            in_flight += weight
        while pending:
            result = take_oldest(pending)
            held.popleft()
            yield result
    finally:
        # Abandoned early (an error, an interrupt, or the consumer stopped): let running items
        # finish so that no thread still reads or writes the caller's arrays after we return.
        for f in pending:
            f.cancel()
        wait(pending)


def task_grain(total: int, workers: int, grain: int = TASK_CHANGES) -> int:
    """The weight a task gathers before it goes to the pool: ``grain``, or less so that
    ``total`` makes at least four tasks per worker (the last one then leaves the others idle
    for less)."""
    return max(1, min(grain, total // (4 * max(workers, 1))))


def map_grouped(fn: Callable[[T], R], items: Sequence[T], weights: Sequence[int], grain: int, workers: int,
                parallel: bool = True, budget: int = 0) -> Generator[R, None, None]:
    """``map_ordered`` where consecutive items whose ``weights`` sum to less than ``grain`` run
    together as one task (``task_grain``: at least four tasks per worker): each task costs two
    hand-offs between threads (a queue and a future), and on a virtual machine whose idle
    cores halt, each wakes a core. With a ``budget``, tasks are handed out as map_ordered
    hands out weighted items, each task weighing what its items weigh."""
    groups, sizes = _groups(items, weights, grain, workers)
    tasks = map_ordered(_each(fn), groups, workers, parallel, sizes if budget else None, budget)
    try:
        for results in tasks:
            yield from results
    finally:
        tasks.close()


def _groups(items: Sequence[T], weights: Sequence[int], grain: int, workers: int
            ) -> tuple[list[list[T]], list[int]]:
    """Consecutive items, each group's weights summing to at least the task grain (but the last),
    and each group's summed weight."""
    grain = task_grain(sum(weights), workers, grain)
    groups: list[list[T]] = []
    sizes: list[int] = []
    for item, weight in zip(items, weights):
        if not sizes or sizes[-1] >= grain:
            groups.append([])
            sizes.append(0)
        groups[-1].append(item)
        sizes[-1] += weight
    return groups, sizes


def start_grouped(fn: Callable[[T], object], items: Sequence[T], weights: Sequence[int], grain: int,
                  workers: int) -> list[Future]:
    """``fn(item)`` for every item on the shared pool, grouped as map_grouped groups them and
    all submitted now: work that runs while the caller does something else. The caller waits
    for every future (``concurrent.futures.wait``) before it returns or touches what they
    read, and takes their errors from ``result()``."""
    pool = shared_pool(workers)
    return [pool.submit(_each(fn), group) for group in _groups(items, weights, grain, workers)[0]]


def _each(fn: Callable[[T], R]) -> Callable[[list[T]], list[R]]:
    """One task's work: ``fn`` of each item of its group, in order."""
    return lambda group: [fn(item) for item in group]


os.register_at_fork(after_in_child=_forget_pools)
