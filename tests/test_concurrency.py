"""Several writers append to one log at once: one wins each version, the others get a conflict,
and the log stays whole."""

from __future__ import annotations

import re
import threading
import uuid

import numpy as np
import pytest

from dcr_log import CommitConflict, DeltaLog, LogWriter, create_log
from dcr_log.checkpoint import save_safetensors
from dcr_log.store import Store
from dcr_log.write.differ import EncodePolicy
from helpers import assert_one_line, assert_same_bits, change_words, copy_state, make_state, run_cli, start_cli

SPEC = {"w": ("BF16", (64, 32)), "b": ("F32", (32,)), "k": ("I64", ())}


def _candidates(n: int, seed: int):
    """A base state and ``n`` distinct successors of it."""
    rng = np.random.default_rng(seed)
    base = make_state(rng, SPEC)
    successors = []
    for _ in range(n):
        s = copy_state(base)
        s["w"] = change_words(rng, base["w"], 0.03)
        s["b"] = change_words(rng, base["b"], 0.5)
        successors.append(s)
    return base, successors


def _assert_no_orphan_segments(store: Store, log: DeltaLog) -> None:
    """Losers remove their segments: every stored segment belongs to a commit."""
    referenced = {ref.key for v in log.versions() for ref in log.commit(v).segments}
    assert {o.key for o in store.list("segments/")} == referenced


def test_concurrent_cli_appends(tmp_path):
    base, successors = _candidates(4, seed=1)
    create_log(tmp_path / "log", base)
    for i, s in enumerate(successors):
        save_safetensors(s, tmp_path / f"c{i}.safetensors")
    procs = [start_cli("append", tmp_path / "log", "--from", tmp_path / f"c{i}.safetensors")
             for i in range(len(successors))]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    won: dict[int, int] = {}  # version -> index of the state that won it
    for i, (rc, out, err) in enumerate(results):
        assert rc in (0, 5), (rc, out, err)
        if rc == 0:
            version = int(re.match(r"version (\d+):", out).group(1))
            assert version not in won
            won[version] = i
        else:
            assert_one_line(err)
            assert "already exists" in err
    log = DeltaLog.open(tmp_path / "log")
    assert won and sorted(won) == list(range(1, len(won) + 1))
    assert log.versions() == [0, *sorted(won)]
    for version, i in won.items():
        assert_same_bits(log.materialize(version), successors[i])
    rc, out, err = run_cli("verify", tmp_path / "log", "--deep")
    assert rc == 0, err
    _assert_no_orphan_segments(Store.open(tmp_path / "log"), log)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_concurrent_thread_writers(where, tmp_path):
    """Each thread appends its own state, reopening on conflict until it has committed once."""
    n = 6
    base, successors = _candidates(n, seed=2)
    location = str(tmp_path / "log") if where == "local" else f"memory://threads-{uuid.uuid4().hex}"
    # Small segments: every append writes several objects before it tries to commit.
    kwargs = dict(policy=EncodePolicy(chunk_elements=512), segment_bytes=64)
    create_log(location, base, **kwargs)
    barrier = threading.Barrier(n)
    won: dict[int, int] = {}
    conflicts = [0] * n
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            writer = LogWriter.open(location, writer_id=f"thread-{i}", **kwargs)
            barrier.wait()
            for _ in range(n):
                try:
                    commit = writer.append(successors[i], kind="xor" if i % 2 else "overwrite")
                except CommitConflict:
                    conflicts[i] += 1
                    writer = LogWriter.open(location, writer_id=f"thread-{i}", **kwargs)
                    continue
                with lock:
                    assert commit.version not in won
                    won[commit.version] = i
                return
            raise AssertionError(f"thread {i} never committed")
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert sorted(won) == list(range(1, n + 1))
    assert sorted(won.values()) == list(range(n))
    assert sum(conflicts) >= 1  # they did race: all started from version 0
    log = DeltaLog.open(location)
    assert log.versions() == list(range(n + 1))
    for version, i in won.items():
        assert log.commit(version).writer_id == f"thread-{i}"
        assert_same_bits(log.materialize(version), successors[i])
    log.verify(deep=True)
    _assert_no_orphan_segments(Store.open(location), log)
