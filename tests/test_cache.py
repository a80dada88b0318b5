"""The baseline cache on disk: one directory per log location and id, bounded with
least-recently-used eviction, and ``dcr cache ls|prune|rm``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dcr_log import CacheWarning, DeltaLog, LogWriter
from dcr_log.cli import main
from dcr_log.write.baseline import BaselineCache
from dcr_log.write.cache import cached_logs
from helpers import assert_same_bits, change_words, make_state

SPEC = {"w": ("BF16", (32, 17)), "b": ("F32", (9,))}


def dcr(capsys, *args) -> tuple[int, list[dict], str]:
    capsys.readouterr()
    rc = main([str(a) for a in args] + ["--json"])
    c = capsys.readouterr()
    return rc, [json.loads(line) for line in c.out.splitlines()], c.err


def test_a_copied_log_gets_its_own_cache(tmp_path):
    rng = np.random.default_rng(0)
    s0 = make_state(rng, SPEC)
    s1 = {n: change_words(rng, b, 0.1) for n, b in s0.items()}
    cache = tmp_path / "cache"
    LogWriter.create(tmp_path / "a", s0, cache_dir=cache).close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same log id at another location
    with LogWriter.open(tmp_path / "b", cache_dir=cache) as writer:
        writer.append(s1)
    logs = {c.local: c for c in cached_logs(cache)}
    assert set(logs) == {str(tmp_path / "a"), str(tmp_path / "b")}
    assert logs[str(tmp_path / "a")].log_id == logs[str(tmp_path / "b")].log_id
    assert logs[str(tmp_path / "a")].dir != logs[str(tmp_path / "b")].dir


@pytest.mark.parametrize("cap", [None, "1"])
def test_fifty_logs_leave_at_most_the_cap_and_prune_empties_it(tmp_path, capsys, monkeypatch, cap):
    if cap is not None:
        monkeypatch.setenv("DCR_CACHE_MAX_BYTES", cap)
    rng = np.random.default_rng(1)
    cache = tmp_path / "cache"
    for i in range(50):
        LogWriter.create(tmp_path / f"log{i}", make_state(rng, SPEC), cache_dir=cache).close()
        logs = cached_logs(cache)
        largest = max(c.bytes for c in logs)
        limit = largest if cap is not None else 2 * largest  # the cache in use is never evicted
        assert sum(c.bytes for c in logs) <= limit, i
    assert cached_logs(cache)[-1].local == str(tmp_path / "log49")  # the newest stays
    rc, rows, err = dcr(capsys, "cache", "ls", "--cache", cache)
    assert rc == 0 and rows[-1]["caches"] == len(rows) - 1 <= (1 if cap else 2), err
    rc, rows, err = dcr(capsys, "cache", "prune", "--cache", cache)  # every log still exists
    assert rc == 0 and rows[0]["removed"] == [], err
    for i in range(50):
        shutil.rmtree(tmp_path / f"log{i}")
    rc, rows, err = dcr(capsys, "cache", "prune", "--cache", cache)
    assert rc == 0 and rows[0]["removed"] and rows[0]["bytes"] > 0, err
    assert list(cache.iterdir()) == []


def test_cache_rm_and_prune_all(tmp_path, capsys):
    rng = np.random.default_rng(2)
    cache = tmp_path / "cache"
    for name in ("x", "y"):
        LogWriter.create(tmp_path / name, make_state(rng, SPEC), cache_dir=cache).close()
    (cache / "0123456789abcdef0123456789abcdef").mkdir()  # an older layout's directory: prunable
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "x", "--cache", cache)
    assert rc == 0 and len(rows[0]["removed"]) == 1, err
    assert {c.local for c in cached_logs(cache)} == {None, str(tmp_path / "y")}
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "x", "--cache", cache)
    assert rc == 2 and json.loads(err)["exit"] == 2
    rc, rows, err = dcr(capsys, "cache", "prune", "--cache", cache)
    assert rc == 0 and len(rows[0]["removed"]) == 1 and (tmp_path / "y").exists(), err
    rc, rows, err = dcr(capsys, "cache", "prune", "--all", "--cache", cache)
    assert rc == 0 and len(rows[0]["removed"]) == 1 and list(cache.iterdir()) == [], err


def test_a_cache_a_writer_holds_is_never_removed(tmp_path, capsys, monkeypatch):
    """An append holds its log's cache (it reads and writes the baseline files): eviction by
    another writer, ``prune --all`` and ``rm`` leave that cache whole, and remove it once
    the hold is gone."""
    rng = np.random.default_rng(3)
    cache = tmp_path / "cache"
    for name in ("x", "y"):
        LogWriter.create(tmp_path / name, make_state(rng, SPEC), cache_dir=cache).close()
    x, y = (next(c for c in cached_logs(cache) if c.local == str(tmp_path / name)) for name in ("x", "y"))
    files = {p: p.read_bytes() for p in y.dir.rglob("*") if p.is_file()}
    hold = BaselineCache(cache, y.log_id, y.url, tmp_path / "y").hold(0)
    assert hold is not None
    rc, rows, err = dcr(capsys, "cache", "prune", "--all", "--cache", cache)
    assert rc == 0 and rows[0]["removed"] == [str(x.dir)] and rows[0]["in_use"] == [str(y.dir)], err
    assert [c.dir for c in cached_logs(cache)] == [y.dir]
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "y", "--cache", cache)
    assert rc == 2 and "in use" in json.loads(err)["error"], err
    monkeypatch.setenv("DCR_CACHE_MAX_BYTES", "1")  # z's create evicts every other cache it may
    LogWriter.create(tmp_path / "z", make_state(rng, SPEC), cache_dir=cache).close()
    assert {c.local for c in cached_logs(cache)} == {str(tmp_path / "y"), str(tmp_path / "z")}
    assert {p: p.read_bytes() for p in y.dir.rglob("*") if p.is_file()} == files
    hold.close()
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "y", "--cache", cache)
    assert rc == 0 and rows[0]["removed"] == [str(y.dir)], err
    assert [c.local for c in cached_logs(cache)] == [str(tmp_path / "z")]
    assert [p.name for p in cache.iterdir()] == [c.dir.name for c in cached_logs(cache)]  # nothing left aside


def test_a_cache_that_cannot_be_removed_is_not_called_in_use(tmp_path, capsys, monkeypatch):
    """A cache whose lock file cannot be opened (here a directory in its place, which stops
    root too) or whose directory cannot be moved aside is reported with its cause and exit 6,
    not as a writer's hold; prune removes the others; eviction warns and leaves it."""
    rng = np.random.default_rng(5)
    cache = tmp_path / "cache"
    for name in ("x", "y"):
        LogWriter.create(tmp_path / name, make_state(rng, SPEC), cache_dir=cache).close()
    x, y = (next(c for c in cached_logs(cache) if c.local == str(tmp_path / name)) for name in ("x", "y"))
    lock = y.dir / "r0.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "y", "--cache", cache)
    error = json.loads(err)["error"]
    assert rc == 6 and "r0.lock" in error and "in use" not in error, err
    rc, rows, err = dcr(capsys, "cache", "prune", "--all", "--cache", cache)
    assert rc == 6 and rows[0]["removed"] == [str(x.dir)] and rows[0]["in_use"] == [], (rows, err)
    assert [f["directory"] for f in rows[0]["failed"]] == [str(y.dir)]
    assert "error: 1 cache could not be removed: cache " in json.loads(err)["error"]
    assert [c.dir for c in cached_logs(cache)] == [y.dir]

    lock.rmdir()  # now the rename fails (injected: root may rename anything here)
    import dcr_log.write.cache as cache_module

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(cache_module.os, "rename", refuse)
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "y", "--cache", cache)
    error = json.loads(err)["error"]
    assert rc == 6 and "moving it aside" in error and "permission denied" in error, err
    monkeypatch.setenv("DCR_CACHE_MAX_BYTES", "1")  # z's create would evict y
    with pytest.warns(CacheWarning, match="permission denied"):
        LogWriter.create(tmp_path / "z", make_state(rng, SPEC), cache_dir=cache).close()
    assert {c.local for c in cached_logs(cache)} == {str(tmp_path / "y"), str(tmp_path / "z")}
    monkeypatch.undo()
    rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "y", "--cache", cache)
    assert rc == 0 and rows[0]["removed"] == [str(y.dir)], err


def test_cache_rm_goes_through_each_of_a_logs_caches_and_says_what_became_of_each(tmp_path, capsys, monkeypatch):
    """A log created three times at one place has three caches: ``rm`` removes the one it can,
    leaves the one a writer holds, and reports the one whose lock cannot be opened with its
    cause and exit 6, each listed in its JSON line."""
    monkeypatch.setenv("DCR_CACHE_MAX_BYTES", str(1 << 30))  # no eviction
    rng = np.random.default_rng(6)
    cache = tmp_path / "cache"
    for _ in range(3):
        shutil.rmtree(tmp_path / "x", ignore_errors=True)
        LogWriter.create(tmp_path / "x", make_state(rng, SPEC), cache_dir=cache).close()
    held, broken, free = cached_logs(cache)
    assert len({held.log_id, broken.log_id, free.log_id}) == 3
    hold = BaselineCache(cache, held.log_id, held.url, tmp_path / "x").hold(0)
    assert hold is not None
    lock = broken.dir / "r0.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    try:
        rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "x", "--cache", cache)
    finally:
        hold.close()
    assert rc == 6, err
    assert rows[0]["removed"] == [str(free.dir)] and rows[0]["in_use"] == [str(held.dir)], rows
    assert [f["directory"] for f in rows[0]["failed"]] == [str(broken.dir)], rows
    assert "1 cache could not be removed" in json.loads(err)["error"] and "r0.lock" in json.loads(err)["error"]
    assert {c.dir for c in cached_logs(cache)} == {held.dir, broken.dir}


@pytest.mark.parametrize("how", ["dcr cache rm", "evicted"])
def test_a_live_writer_appends_after_its_cache_was_removed(tmp_path, capsys, monkeypatch, how):
    """A writer keeps its baseline mapped between appends but holds no lock: ``dcr cache rm``
    or another log's eviction may remove its cache meanwhile. Its next append finds the cache
    gone, rebuilds its baseline from the log and commits the right bits (it raised after
    committing before: the cache's record could not be written)."""
    rng = np.random.default_rng(7)
    cache = tmp_path / "cache"
    states = [make_state(rng, SPEC)]
    writer = LogWriter.create(tmp_path / "x", states[0], cache_dir=cache)
    for _ in range(2):
        states.append({n: change_words(rng, b, 0.1) for n, b in states[-1].items()})
        writer.append(states[-1])
        if how == "dcr cache rm":
            rc, rows, err = dcr(capsys, "cache", "rm", tmp_path / "x", "--cache", cache)
            assert rc == 0 and len(rows[0]["removed"]) == 1, err
        else:
            monkeypatch.setenv("DCR_CACHE_MAX_BYTES", "1")  # y's create evicts x's cache
            LogWriter.create(tmp_path / f"y{len(states)}", make_state(rng, SPEC), cache_dir=cache).close()
            monkeypatch.delenv("DCR_CACHE_MAX_BYTES")
        assert str(tmp_path / "x") not in {c.local for c in cached_logs(cache)}
    states.append({n: change_words(rng, b, 0.1) for n, b in states[-1].items()})
    assert writer.append(states[-1]).version == len(states) - 1
    writer.close()
    log = DeltaLog.open(tmp_path / "x")
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)
    log.verify(deep=True)
