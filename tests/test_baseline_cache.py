"""The writer's baseline cache: open resumes without replay when the cache matches the
commit's digests, and rebuilds from the log (still bit-exact) whenever it does not."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog, IntegrityError, LogWriter
from dcr_log.digest import SUM
from dcr_log.format import version_key
from dcr_log.format.tensors import state_digest
from dcr_log.state import TensorBits
from dcr_log.store import Store
from helpers import DirtyCount, assert_same_bits, change_words, cli_env, copy_state, make_state, run_cli

SPEC = {"w": ("BF16", (64, 33)), "b": ("F32", (17,)), "s": ("I64", ()), "e": ("U8", (0, 4))}


def _step(rng, state, rate=0.05):
    out = copy_state(state)
    for name in ("w", "b"):
        out[name] = change_words(rng, state[name], rate)
    return out


def _no_replay(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("the log was replayed")
    monkeypatch.setattr(DeltaLog, "materialize", refuse)


def _replays(monkeypatch) -> list:
    """The ``tensors`` asked of each replay (DeltaLog.materialize) from now on."""
    calls: list = []
    real = DeltaLog.materialize

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("tensors"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DeltaLog, "materialize", counted)
    return calls


def _slot_files(cache: Path) -> list[Path]:
    return sorted(cache.rglob("words-*.bin"))


@pytest.mark.parametrize("features", [("sum-digests",), ()])
def test_open_resumes_from_the_cache_without_replay(tmp_path, monkeypatch, features):
    rng = np.random.default_rng(0)
    cache = tmp_path / "cache"
    states = [make_state(rng, SPEC)]
    LogWriter.create(tmp_path / "log", states[0], cache_dir=cache, features=features)
    for _ in range(3):
        states.append(_step(rng, states[-1]))
        with monkeypatch.context() as m:
            _no_replay(m)
            writer = LogWriter.open(tmp_path / "log", cache_dir=cache)
            commit = writer.append(states[-1])
        assert commit.features == tuple(features)
    log = DeltaLog.open(tmp_path / "log")
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)
    log.verify(deep=True)
    assert len(_slot_files(cache)) == 1  # one generation kept, older ones removed


def test_a_damaged_cache_is_rebuilt_from_the_log(tmp_path, monkeypatch):
    """A flipped bit: the baseline is rebuilt from the log, the append is right, and the cache
    it writes records the rebuilt pieces' digests (the next writer resumes without a replay,
    sealed or checked)."""
    rng = np.random.default_rng(1)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    (words,) = _slot_files(cache)
    data = bytearray(words.read_bytes())
    data[5] ^= 0x40  # one bit of the cached baseline flipped behind the writer's back
    time.sleep(0.01)  # (by a later write: a coarse clock gives it a later mtime than the seal's)
    words.write_bytes(bytes(data))
    s1 = _step(rng, s0)
    with monkeypatch.context() as m:
        calls = _replays(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s1)
    assert calls, "the damaged cache was trusted"
    states = [s0, s1]
    for check in (False, True):
        states.append(_step(rng, states[-1]))
        with monkeypatch.context() as m:
            _no_replay(m)
            LogWriter.open(tmp_path / "log", cache_dir=cache, check_cache=check).append(states[-1])
    log = DeltaLog.open(tmp_path / "log")
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)
    log.verify(deep=True)


def test_a_stale_cache_is_not_trusted(tmp_path):
    """Another writer appended without this cache: the cache is a version behind."""
    rng = np.random.default_rng(2)
    cache, other = tmp_path / "cache", tmp_path / "other"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1, s2 = _step(rng, s0), None
    LogWriter.open(tmp_path / "log", cache_dir=other).append(s1)
    s2 = _step(rng, s1)
    LogWriter.open(tmp_path / "log", cache_dir=cache).append(s2)
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(2), s2)
    log.verify(deep=True)


def test_an_append_killed_while_advancing_the_cache(tmp_path, monkeypatch):
    """The cache records the version being written before scattering into its map: words of
    either version are recognised, a mix of both is rebuilt."""
    rng = np.random.default_rng(3)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1 = _step(rng, s0)
    writer.append(s1)
    meta_path = next(cache.rglob("meta.json"))
    meta = json.loads(meta_path.read_text())
    assert meta["version"] == 1 and meta["pending"] is None
    # As if killed between the scatter and the final record: the record still says version 0
    # (with version 0's digests) and names version 1 as pending; the words are version 1's.
    v0 = DeltaLog.open(tmp_path / "log").commit(0).tensor_map()
    pieces = [[key, dtype, at, f"{v0[key[0]].digest:016x}"] for key, dtype, at, _ in meta["pieces"]]
    meta_pending = dict(meta, version=0, pieces=pieces,
                        pending={"version": 1, "digests": [p[3] for p in meta["pieces"]]})
    meta_path.write_text(json.dumps(meta_pending))
    s2 = _step(rng, s1)
    with monkeypatch.context() as m:
        _no_replay(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s2)
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(2), s2)


def test_layout_changes_write_a_new_generation(tmp_path, monkeypatch):
    rng = np.random.default_rng(4)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1 = _step(rng, s0)
    s1["new"] = TensorBits("F16", (5, 3), rng.integers(0, 2**16, 15, dtype=np.uint16))
    s1["w"] = TensorBits("BF16", (33, 64), s1["w"].words.copy())  # reshaped
    del s1["b"]
    s2 = copy_state(s1)
    s2["w"] = change_words(rng, s1["w"], 0.1)
    for s in (s1, s2):
        with monkeypatch.context() as m:
            _no_replay(m)
            LogWriter.open(tmp_path / "log", cache_dir=cache).append(s, allow_layout_change=s is s1)
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    assert_same_bits(log.materialize(2), s2)
    log.verify(deep=True)
    assert len(_slot_files(cache)) == 1


def test_cache_digests_are_the_pieces_sum_digests(tmp_path):
    rng = np.random.default_rng(5)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1 = _step(rng, s0)
    writer.append(s1)
    meta = json.loads(next(cache.rglob("meta.json")).read_text())
    table = DeltaLog.open(tmp_path / "log").commit(1).tensor_map()
    for (name, _offset, _shape), _dtype, _, digest in meta["pieces"]:
        assert int(digest, 16) == table[name].digest == SUM.tensor(s1[name].words, s1[name].shape)


def test_no_cache_means_replay(tmp_path):
    rng = np.random.default_rng(6)
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=False)
    s1 = _step(rng, s0)
    LogWriter.open(tmp_path / "log", cache_dir=False).append(s1)
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(1), s1)
    assert not any(Path(os.environ["DCR_CACHE_DIR"]).rglob("*.bin"))


def test_cli_append_uses_the_cache(tmp_path):
    """dcr init then dcr append: the second append finds its baseline in the cache."""
    from dcr_log.checkpoint import save_safetensors

    rng = np.random.default_rng(7)
    s0 = make_state(rng, {"w": ("BF16", (40, 50)), "b": ("F32", (9,))})
    save_safetensors(s0, tmp_path / "v0.safetensors")
    cache = tmp_path / "cache"
    assert run_cli("init", tmp_path / "log", "--from", tmp_path / "v0.safetensors", "--cache", cache)[0] == 0
    s = s0
    for v, check in ((1, []), (2, []), (3, ["--check-cache"])):
        s = _step(rng, s)
        save_safetensors(s, tmp_path / f"v{v}.safetensors")
        rc, out, err = run_cli("append", tmp_path / "log", "--from", tmp_path / f"v{v}.safetensors",
                               "--cache", cache, *check)
        assert rc == 0, err
        assert f"version {v}:" in out
    assert len(_slot_files(cache)) == 1
    meta = json.loads(next(cache.rglob("meta.json")).read_text())
    assert meta["version"] == 3
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(3), s)


def test_a_cache_some_versions_behind_rolls_forward(tmp_path, monkeypatch):
    """Another writer appended three versions (one of them reshaping a tensor) without this
    cache: the cached pieces are brought forward by those deltas, not by a replay, except the
    reshaped tensor, which is rebuilt alone."""
    rng = np.random.default_rng(8)
    cache, other = tmp_path / "cache", tmp_path / "other"
    states = [make_state(rng, SPEC)]
    LogWriter.create(tmp_path / "log", states[0], cache_dir=cache)
    elsewhere = LogWriter.open(tmp_path / "log", cache_dir=other)
    for v in range(3):
        s = _step(rng, states[-1])
        if v == 1:
            s["b"] = TensorBits("F32", (1, 17), s["b"].words.copy())
        elif v == 2:
            s["b"] = change_words(rng, s["b"], 0.3)
        elsewhere.append(s, allow_layout_change=v == 1)
        states.append(s)
    s4 = _step(rng, states[-1])
    with monkeypatch.context() as m:
        rebuilt = _replays(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s4)
    assert rebuilt == [{"b"}]  # only the reshaped tensor was rebuilt from the log
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(4), s4)
    log.verify(deep=True)


def test_roll_forward_holds_each_version_to_the_step_rules(tmp_path):
    """A cache some versions behind rolls forward under the rules replay applies: a version
    whose records name a tensor missing from its table is refused with replay's error (the
    rank holds no piece of that tensor, so the record used to be skipped)."""
    rng = np.random.default_rng(9)
    cache, other = tmp_path / "cache", tmp_path / "other"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1 = _step(rng, s0, rate=0.5)
    LogWriter.open(tmp_path / "log", cache_dir=other).append(s1)
    store = Store.open(tmp_path / "log")
    record = DeltaLog.open(store).commit(1)
    assert any(rec.tensor == "b" for rec in DeltaLog.open(store).records(1))
    # Version 1 re-sealed without "b" in its tensor table; its segments still hold b's records.
    tensors = tuple(t for t in record.tensors if t.name != "b")
    stats = dataclasses.replace(record.stats, total_elements=record.stats.total_elements - 17)
    forged = dataclasses.replace(record, tensors=tensors, state_digest=state_digest(list(tensors)), stats=stats)
    store.delete(version_key(1))
    store.put_new(version_key(1), forged.to_bytes())
    s2 = {name: bits for name, bits in s1.items() if name != "b"}
    s2["w"] = change_words(rng, s1["w"], 0.05)
    message = r"^version 1: record for unknown tensor 'b'$"
    with pytest.raises(IntegrityError, match=message):
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s2)
    with pytest.raises(IntegrityError, match=message):
        DeltaLog.open(tmp_path / "log").materialize(1)  # replay refuses it in the same words


# A state of several chunks per tensor (_early_policy), large enough for the pool's threads:
# an append writes changed words into the baseline chunk by chunk, as each is encoded.
EARLY_SPEC = {"w": ("BF16", (1024, 1024)), "v": ("F32", (40, 50)), "b": ("BF16", (33,))}


def _early_policy():
    from dcr_log.write.differ import EncodePolicy

    return EncodePolicy(chunk_elements=1 << 16, workers=2)  # two threads on any machine


# How the early writes are undone: xor records from their own payloads, ulp distances
# (stepped back) or xor masks; overwrite records from the words they kept.
UNDONE = {"ulp": ({}, "xor"), "plain-xor": ({"features": ()}, "xor"), "overwrite": ({}, "overwrite")}


def _early_writes(monkeypatch, interrupt_after: int | None = None) -> list[bool]:
    """Per chunk encoded (Differ.diff_box), whether its changed words went into the baseline
    early; with ``interrupt_after``, KeyboardInterrupt once that many did."""
    from dcr_log.write import differ

    early_writes: list[bool] = []
    real_diff = differ.Differ.diff_box

    def counted(self, *args, **kwargs):
        if interrupt_after is not None and sum(early_writes) >= interrupt_after:
            raise KeyboardInterrupt
        delta = real_diff(self, *args, **kwargs)
        early_writes.append(delta is not None and delta.advanced)
        return delta

    monkeypatch.setattr(differ.Differ, "diff_box", counted)
    return early_writes


@pytest.mark.parametrize("undone", sorted(UNDONE))
@pytest.mark.parametrize("how", ["segment-write", "interrupt-encoding", "record-refused", "conflict"])
def test_a_failed_append_leaves_the_baseline_as_it_was(tmp_path, monkeypatch, how, undone):
    """An append fails after some of its chunks' changed words went into the baseline (a
    segment write that fails once every chunk is encoded, an interrupt in the middle of the
    encoding, another writer's commit of the version): the baseline holds version 0's words
    again, so the retry of the same state commits version 1 with that state's bits, and the
    cache is trusted (no replay) when the log is opened again."""
    from dcr_log.errors import CommitConflict, StoreError
    from dcr_log.write import uploader

    create_args, kind = UNDONE[undone]
    rng = np.random.default_rng(11)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    s1 = _step(rng, s0, rate=0.2)
    s1["v"] = change_words(rng, s0["v"], 0.2)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy(), **create_args)
    with monkeypatch.context() as m:
        early_writes = _early_writes(m, 6 if how == "interrupt-encoding" else None)
        if how == "segment-write":
            def fail(self, key, builder):
                raise StoreError("no space left")
            m.setattr(uploader.SegmentUploader, "put", fail)
            expected = StoreError
        elif how == "interrupt-encoding":
            expected = KeyboardInterrupt
        elif how == "record-refused":
            # The caller stops taking records while later chunks are encoded (and advanced)
            # on the pool: those are undone too.
            from dcr_log.format.segment import SegmentBuilder

            taken: list[int] = []

            def refuse(self, record):
                taken.append(1)
                if len(taken) == 4:
                    time.sleep(0.2)  # the chunks in flight finish
                    raise StoreError("refused")
            m.setattr(SegmentBuilder, "add", refuse)
            expected = StoreError
        else:
            # Another writer commits version 1 while this one encodes it.
            other = LogWriter.open(tmp_path / "log")
            other.append(s0)
            other.close()
            expected = CommitConflict
        with pytest.raises(expected):
            writer.append(s1, kind=kind)
    assert sum(early_writes) >= 6  # the failure came after words went into the baseline
    baseline = writer._writer._baseline
    assert baseline.version == 0 and sorted(k[0] for k in baseline.arrays) == sorted(s0)
    for key, words in baseline.arrays.items():
        assert np.array_equal(words, s0[key[0]].words.reshape(-1)), key
    if how == "conflict":
        return  # the log moved on: this writer would have to open it again
    commit = writer.append(s1, kind=kind)
    assert commit.version == 1
    writer.close()
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)
    with monkeypatch.context() as m:
        _no_replay(m)
        s2 = _step(rng, s1)
        LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()).append(s2)
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(2), s2)


def test_an_append_killed_while_encoding_rebuilds_the_baseline(tmp_path, monkeypatch):
    """Killed in the middle of an append (here: the encoding interrupted, and the undo of its
    early writes and the seal after it skipped, as a killed process skips them), the cache
    holds words of neither version: the next writer does not trust it, rebuilds the baseline
    from the log, and appends the right bits."""
    rng = np.random.default_rng(12)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    s1 = _step(rng, s0, rate=0.2)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy())
    _killed_append(monkeypatch, writer, s1)
    with monkeypatch.context() as m:
        replays = _replays(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()).append(s1)
    assert replays  # the torn cache was not trusted
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)


def test_an_interrupt_after_the_commit_moves_the_writer_to_the_version(tmp_path, monkeypatch):
    """Interrupted once the commit record is written (while the baseline is advanced), the
    append raises, but the version is the log's: the writer moves to it, loads its baseline
    again at the next append (its words may be between versions), and that append is right."""
    from dcr_log.write import baseline as baseline_module

    rng = np.random.default_rng(13)
    s0 = make_state(rng, EARLY_SPEC)
    s1 = _step(rng, s0, rate=0.2)
    s2 = _step(rng, s1, rate=0.2)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=tmp_path / "cache", policy=_early_policy())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(baseline_module.Baseline, "advance", interrupted)
        with pytest.raises(KeyboardInterrupt):
            writer.append(s1)
    assert writer.version == 1 and DeltaLog.open(tmp_path / "log").versions() == [0, 1]
    assert writer.append(s2).version == 2
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    assert_same_bits(log.materialize(2), s2)


def test_an_append_does_not_read_baseline_files_another_append_is_writing(tmp_path, monkeypatch):
    """Two writers of one log on one machine, one cache. Writer A created the log and keeps
    its baseline mapped from the cache; writer B's append has written some of its changed
    words into those files (and waits). A's append meanwhile does not read them: it rebuilds
    its baseline from the log and commits version 1 with its own state's bits. B then
    conflicts and puts its words back, and a third writer resumes from the cache."""
    import threading

    from dcr_log.errors import CommitConflict
    from dcr_log.write import differ

    rng = np.random.default_rng(14)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    sa, sb = _step(rng, s0, rate=0.2), _step(rng, s0, rate=0.2)
    a = LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy())
    b = LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy())
    real_diff = differ.Differ.diff_box
    advanced = threading.Event()
    go_on = threading.Event()
    b_writes: list[bool] = []
    in_b = threading.Event()  # set while only B encodes
    in_b.set()

    def paused(self, *args, **kwargs):
        delta = real_diff(self, *args, **kwargs)
        if in_b.is_set() and delta is not None and delta.advanced:
            b_writes.append(True)
            if len(b_writes) == 3:
                advanced.set()
                go_on.wait(30)
        return delta

    monkeypatch.setattr(differ.Differ, "diff_box", paused)
    outcome: list[BaseException | None] = []

    def append_b():
        try:
            b.append(sb)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            outcome.append(exc)

    thread = threading.Thread(target=append_b)
    thread.start()
    try:
        assert advanced.wait(30)
        in_b.clear()  # A's encoding does not pause
        with monkeypatch.context() as m:
            replays = _replays(m)
            assert a.append(sa).version == 1
        assert replays  # A rebuilt its baseline from the log
    finally:
        go_on.set()
        thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], CommitConflict), outcome
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), sa)
    log.verify(deep=True)
    a.close()
    b.close()
    s2 = _step(rng, sa)
    LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()).append(s2)
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(2), s2)


@pytest.mark.parametrize("how", ["segment-write", "interrupt-encoding"])
def test_an_append_that_is_not_committed_seals_the_cache_again(tmp_path, monkeypatch, how):
    """An append that fails once some of its changed words are in the cache puts them back
    and seals the cache again: the next writer takes the words without hashing them, and
    appends the right bits."""
    from dcr_log.errors import StoreError
    from dcr_log.write import uploader

    rng = np.random.default_rng(17)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy())

    def fail(self, key, builder):
        raise StoreError("no space left")

    with monkeypatch.context() as m:
        early_writes = _early_writes(m, 6 if how == "interrupt-encoding" else None)
        if how == "segment-write":
            m.setattr(uploader.SegmentUploader, "put", fail)
        with pytest.raises(StoreError if how == "segment-write" else KeyboardInterrupt):
            writer.append(_step(rng, s0, rate=0.2))
    assert sum(early_writes) >= 6
    writer.close()
    assert _seal(cache).exists()
    s1 = _step(rng, s0, rate=0.2)
    with monkeypatch.context() as m:
        _no_replay(m)
        hashed = _hashed_words(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()).append(s1)
    assert sum(hashed) == 0
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)


def _killed_append(monkeypatch, writer, state, after: int = 4) -> None:
    """``writer.append(state)`` killed while it encodes, once ``after`` chunks went into the
    baseline: neither the undo of its early writes nor the seal after it runs, as in a
    killed process."""
    from dcr_log.write import sharded

    with monkeypatch.context() as m:
        _early_writes(m, after)
        m.setattr(sharded.ShardedWriter, "_abandon", lambda self, pending: None)
        with pytest.raises(KeyboardInterrupt):
            writer.append(state)


@pytest.mark.parametrize("timestamps", ["kept", "frozen", "unsealed"])
def test_a_writer_loads_its_baseline_again_after_another_process_tore_the_cache(tmp_path, monkeypatch,
                                                                                timestamps):
    """Two writers of one log, one cache. B appends version 1 and keeps its baseline mapped
    from the cache; A opens the log and is killed in the middle of its append of version 2,
    its early writes left in the cache's words. B's append of version 2 does not take those
    words for version 1's: it loads its baseline again (from the log, the cache being torn)
    and commits its own state's bits. ``frozen``: the words file's metadata is made to look
    unchanged, as a write within one timestamp tick would; the seal A removed still tells.
    ``unsealed``: no boot id, so no seal is written or trusted; the words file's metadata
    alone tells."""
    from dcr_log.write import baseline as baseline_module

    rng = np.random.default_rng(15)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy()).close()
    if timestamps == "frozen":
        monkeypatch.setattr(baseline_module, "_file_identity", lambda path: [0, 0, 0, 0, 0])
    elif timestamps == "unsealed":
        monkeypatch.setattr(baseline_module, "boot_id", lambda: None)
    b = LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy())
    s1 = _step(rng, s0, rate=0.2)
    b.append(s1)
    a = LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy())
    _killed_append(monkeypatch, a, _step(rng, s1, rate=0.2))
    s2 = _step(rng, s1, rate=0.2)
    with monkeypatch.context() as m:
        replays = _replays(m)
        assert b.append(s2).version == 2
    assert replays  # B did not trust the words A tore
    if timestamps == "unsealed":  # no seal vouched for anything: the metadata told
        assert not list(cache.rglob("seal.json"))
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(2), s2)
    log.verify(deep=True)


def test_a_stale_writer_conflicts_without_loading_its_baseline_again(tmp_path, monkeypatch):
    """B holds version 1 mapped from the cache; A, another writer, commits version 2 through
    the same cache. B's next append cannot commit: it conflicts without a replay, puts its
    early writes back, and leaves no seal on words it had not checked; the next writer
    resumes from A's version 2."""
    from dcr_log.errors import CommitConflict

    rng = np.random.default_rng(16)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy()).close()
    b = LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy())
    s1 = _step(rng, s0, rate=0.2)
    b.append(s1)
    s2 = _step(rng, s1, rate=0.2)
    a = LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy())
    a.append(s2)
    a.close()
    with monkeypatch.context() as m:
        _no_replay(m)
        with pytest.raises(CommitConflict):
            b.append(_step(rng, s1, rate=0.2))
    assert not list(cache.rglob("seal.json"))
    s3 = _step(rng, s2, rate=0.2)
    with monkeypatch.context() as m:
        _no_replay(m)
        hashed = _hashed_words(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()).append(s3)
    assert sum(hashed) == len(EARLY_SPEC)  # unsealed: checked, and found to be version 2's
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(3), s3)
    log.verify(deep=True)


def test_a_cache_directory_that_cannot_be_made_is_said(tmp_path):
    """A cache root under a file: the writer goes on without a cache (each append replays its
    baseline, to the right bits) and says so with a CacheWarning; dcr says it on one line."""
    from dcr_log import CacheWarning
    from dcr_log.checkpoint import save_safetensors

    rng = np.random.default_rng(8)
    s0 = make_state(rng, SPEC)
    (tmp_path / "file").write_bytes(b"")
    cache = tmp_path / "file" / "cache"
    with pytest.warns(CacheWarning, match="cannot be used"):
        LogWriter.create(tmp_path / "log", s0, cache_dir=cache).close()
    s1 = _step(rng, s0)
    with pytest.warns(CacheWarning, match="read their baseline from the log"):
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s1)
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(1), s1)
    save_safetensors(s1, tmp_path / "v1.safetensors")
    rc, out, err = run_cli("init", tmp_path / "cli", "--from", tmp_path / "v1.safetensors", "--cache", cache)
    assert rc == 0 and "version 0" in out, err
    assert err.splitlines() == [err.strip()] and err.startswith("dcr: warning: baseline cache "), err



@pytest.mark.parametrize("dirty_count", ["kernel", "counted", "none"])
def test_an_append_maps_its_cache_for_writing_once_writeback_cleaned_it(tmp_path, monkeypatch, dirty_count):
    """Before its find pass an append drops each piece's page-table entries and faults them
    in again for writing (pages.RemapAhead) where writeback may have cleaned the cache: in a
    new process (LogWriter.open), and once the pages are clean (helpers.DirtyCount: the
    kernel's count, a count the test sets, or the dirty expiry). Not right after another
    append of the same writer (its pages still dirty and mapped for writing), and not after
    a version that changed fewer than one word on eight pages. Every piece dropped is
    faulted in again. Every version replays bit-exact: the words under the map stay the
    cache's."""
    from dcr_log import pages

    count = DirtyCount(monkeypatch, dirty_count, tmp_path)
    dropped: list[int] = []
    faulted: list[int] = []
    real_drop, real_fault = pages.drop_page_entries, pages.fault_in_for_writing

    def drop(words):
        dropped.append(words.nbytes)
        return real_drop(words)

    def fault(words):
        faulted.append(words.nbytes)
        return real_fault(words)

    monkeypatch.setattr(pages, "drop_page_entries", drop)
    monkeypatch.setattr(pages, "fault_in_for_writing", fault)
    rng = np.random.default_rng(5)
    states = [make_state(rng, {"a": ("BF16", (1024, 1024)), "b": ("F32", (256, 1024))})]  # 512 and 256 pages
    step = lambda: {name: change_words(rng, bits, 0.01) for name, bits in states[0].items()}  # noqa: E731
    one_word = copy_state(states[0])
    one_word["a"].words.reshape(-1)[12345] ^= 1
    cache = tmp_path / "cache"
    LogWriter.create(tmp_path / "log", states[0], cache_dir=cache).close()
    remaps = []
    with LogWriter.open(tmp_path / "log", cache_dir=cache) as writer:
        for state, clean in ((step(), False), (states[0], False), (step(), True), (states[0], False),
                             (one_word, True), (states[0], True)):
            if clean:
                count.clean()
            dropped.clear()
            faulted.clear()
            writer.append(state)
            count.written()
            states.append(state)
            assert sorted(faulted) == sorted(dropped), (faulted, dropped)  # (the append waited for them)
            remaps.append(sorted(dropped))
    pieces = sorted(v.words.nbytes for v in states[0].values())
    # A new process; back to back; cleaned; back to back; cleaned; cleaned, after a version
    # one word away from its parent.
    if dirty_count == "kernel":  # (another test's sync may clean the pages at any time)
        assert remaps[0] == remaps[2] == remaps[4] == pieces and remaps[5] == [], remaps
    else:
        assert remaps == [pieces, [], pieces, [], pieces, []], remaps
    log = DeltaLog.open(tmp_path / "log")
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)


def test_an_append_reads_no_piece_before_it_is_mapped_for_writing(tmp_path, monkeypatch):
    """The pieces are faulted in for writing on the side thread, in the encoding tasks'
    order, while the tasks encode the pieces before them: no task reads a piece's words
    before its fault-in has ended, and the append does not end while one is running."""
    import threading

    from dcr_log import pages
    from dcr_log.write import differ

    rng = np.random.default_rng(31)
    spec = {f"t{i}": ("BF16", (256, 1024)) for i in range(4)}
    s0 = make_state(rng, spec)
    cache = tmp_path / "cache"
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache).close()
    events: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    real_fault, real_diff = pages.fault_in_for_writing, differ.Differ.diff_box

    def slow_fault(words):
        time.sleep(0.05)  # slower than a task's encoding: a task that did not wait would run ahead
        done = real_fault(words)
        with lock:
            events.append(("mapped", words.ctypes.data, time.monotonic()))
        return done

    def diff_box(self, name, box, shape, old, new, *args, **kwargs):
        with lock:
            events.append(("read", old.ctypes.data - box.offset[0] * old.itemsize * 1024, time.monotonic()))
        return real_diff(self, name, box, shape, old, new, *args, **kwargs)

    monkeypatch.setattr(pages, "fault_in_for_writing", slow_fault)
    monkeypatch.setattr(differ.Differ, "diff_box", diff_box)
    s1 = {name: change_words(rng, bits, 0.01) for name, bits in s0.items()}
    with LogWriter.open(tmp_path / "log", cache_dir=cache, policy=_early_policy()) as writer:
        writer.append(s1)
        ended = time.monotonic()
    mapped = {at: t for kind, at, t in events if kind == "mapped"}
    reads = [(at, t) for kind, at, t in events if kind == "read"]
    assert len(mapped) == len(spec) and len(reads) == 4 * len(spec), events
    assert all(at in mapped and t >= mapped[at] for at, t in reads), events
    assert max(mapped.values()) <= ended
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(1), s1)


def test_a_failure_mapping_the_cache_for_writing_fails_the_append_and_loses_nothing(tmp_path, monkeypatch):
    """A failure deciding what to map for writing (before any word is encoded), or faulting
    a piece in on the side thread, is the append's error, reported like an encoding
    failure: nothing is committed, and the next append of the same state, by the same
    writer, commits it bit-exact from the cache (no replay)."""
    from dcr_log import pages
    from dcr_log.errors import StoreError
    from dcr_log.write.baseline import Baseline

    def refuse(*args):
        raise StoreError("madvise refused")

    for patched in ((Baseline, "pieces_to_remap"), (pages, "fault_in_for_writing")):
        rng = np.random.default_rng(13)
        cache = tmp_path / patched[1] / "cache"
        log_path = tmp_path / patched[1] / "log"
        s0 = make_state(rng, {"a": ("BF16", (512, 1024))})
        s1 = {"a": change_words(rng, s0["a"], 0.01)}
        LogWriter.create(log_path, s0, cache_dir=cache).close()
        with LogWriter.open(log_path, cache_dir=cache) as writer:
            with monkeypatch.context() as m:
                m.setattr(*patched, refuse)
                with pytest.raises(StoreError, match="madvise refused"):
                    writer.append(s1)
            assert DeltaLog.open(log_path).latest_version() == 0
            with monkeypatch.context() as m:
                _no_replay(m)
                assert writer.append(s1).version == 1
        assert_same_bits(DeltaLog.open(log_path).materialize(1), s1)


def _hashed_words(monkeypatch) -> list[int]:
    """Counts the cached pieces a writer hashes as it loads its baseline."""
    from dcr_log.write import baseline as baseline_module

    hashed: list[int] = []
    real = baseline_module.box_digests

    def counted(scheme, boxes, *args, **kwargs):
        hashed.append(len(boxes))
        return real(scheme, boxes, *args, **kwargs)

    monkeypatch.setattr(baseline_module, "box_digests", counted)
    return hashed


def _seal(cache: Path) -> Path:
    (seal,) = cache.rglob("seal.json")
    return seal


@pytest.mark.parametrize("features", [("sum-digests",), ()])
def test_a_sealed_cache_is_taken_without_hashing_its_words(tmp_path, monkeypatch, features):
    """Each append leaves the cache sealed; the next writer of this boot takes the sealed
    words without hashing them (or hashes every one, asked to), and appends the right bits."""
    from dcr_log.write.baseline import boot_id

    rng = np.random.default_rng(21)
    cache = tmp_path / "cache"
    states = [make_state(rng, SPEC)]
    LogWriter.create(tmp_path / "log", states[0], cache_dir=cache, features=features)
    assert json.loads(_seal(cache).read_text())["boot"] == boot_id()
    for check in (False, True, False):
        states.append(_step(rng, states[-1]))
        with monkeypatch.context() as m:
            _no_replay(m)
            hashed = _hashed_words(m)
            LogWriter.open(tmp_path / "log", cache_dir=cache, check_cache=check).append(states[-1])
        assert sum(hashed) == (len(SPEC) if check else 0), hashed
        assert _seal(cache).exists()
    log = DeltaLog.open(tmp_path / "log")
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)
    log.verify(deep=True)


def test_no_seal_while_an_append_writes_the_cache(tmp_path, monkeypatch):
    """Every write into a cache slot (the early writes as chunks are encoded, the remap for
    writing, the scatters after the commit, a new generation's words) happens while the slot
    has no seal; the seal is back once the version is in the cache."""
    from dcr_log import pages
    from dcr_log.write import baseline as baseline_module
    from dcr_log.write import differ
    from dcr_log.write import pending as pending_module

    rng = np.random.default_rng(22)
    cache = tmp_path / "cache"
    s0 = make_state(rng, EARLY_SPEC)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache, policy=_early_policy())
    seen: list[str] = []

    def unsealed(what: str, slot: Path | None) -> None:
        seen.append(what)
        seals = list(cache.rglob("seal.json")) if slot is None else [slot / "seal.json"]
        assert not any(s.exists() for s in seals), f"{what} wrote a sealed slot"

    def watched(what, real, when=lambda *a, **k: True):
        def call(*args, **kwargs):
            if when(*args, **kwargs):
                # A new generation's slot (another piece set) is checked alone: the slot it
                # replaces keeps its seal and its words until the new one is finished.
                unsealed(what, args[0].slot if what == "a generation" else None)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(differ.Differ, "diff_box", watched("an early write", differ.Differ.diff_box,
                                                           lambda *a, **k: k.get("advance")))
    monkeypatch.setattr(baseline_module, "scatter_changes", watched("a scatter", baseline_module.scatter_changes))
    monkeypatch.setattr(pending_module, "scatter_changes", watched("an undo", pending_module.scatter_changes))
    monkeypatch.setattr(pages, "drop_page_entries", watched("the remap", pages.drop_page_entries))
    monkeypatch.setattr(pages, "fault_in_for_writing", watched("the remap", pages.fault_in_for_writing))
    monkeypatch.setattr(baseline_module.Generation, "write",
                        watched("a generation", baseline_module.Generation.write))
    s1 = _step(rng, s0, rate=0.2)
    writer.append(s1)
    s2 = dict(_step(rng, s1, rate=0.2), extra=make_state(rng, {"x": ("F32", (7,))})["x"])
    writer.append(s2, allow_layout_change=True)  # a new generation
    assert {"an early write", "a scatter", "the remap", "a generation"} <= set(seen), set(seen)
    assert _seal(cache).exists()
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(2), s2)


def _other_boot(tmp_path: Path, monkeypatch) -> None:
    from dcr_log.write import baseline as baseline_module

    other = tmp_path / "boot_id"
    other.write_text("00000000-0000-0000-0000-000000000000\n")
    monkeypatch.setattr(baseline_module, "BOOT_ID", other)


def _no_boot_id(tmp_path: Path, monkeypatch) -> None:
    from dcr_log.write import baseline as baseline_module

    monkeypatch.setattr(baseline_module, "BOOT_ID", tmp_path / "no-such-file")


def _meta_rewritten(tmp_path: Path, monkeypatch) -> None:
    meta = next((tmp_path / "cache").rglob("meta.json"))
    meta.write_text(json.dumps(json.loads(meta.read_text()), indent=1))  # same record, other bytes


def _words_rewritten(tmp_path: Path, monkeypatch) -> None:
    (words,) = _slot_files(tmp_path / "cache")
    data = words.read_bytes()
    time.sleep(0.01)  # (a later write: a coarse clock gives it a later mtime)
    with open(words, "r+b") as f:
        f.write(data[:64])  # the same bytes: only the file's times say it was written


def _words_replaced(tmp_path: Path, monkeypatch) -> None:
    (words,) = _slot_files(tmp_path / "cache")
    copy = words.with_name("copy")
    copy.write_bytes(words.read_bytes())
    os.replace(copy, words)


@pytest.mark.parametrize("spoil", [_other_boot, _no_boot_id, _meta_rewritten, _words_rewritten, _words_replaced],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_seal_vouches_only_for_its_boot_its_record_and_its_file(tmp_path, monkeypatch, spoil):
    """Another boot (a power loss between), no boot id at all, a meta.json with other bytes,
    a words file written or replaced since the seal: the writer hashes every cached word
    before it trusts them, and appends the right bits."""
    rng = np.random.default_rng(23)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    s1 = _step(rng, s0)
    with monkeypatch.context() as m:
        spoil(tmp_path, m)
        _no_replay(m)
        hashed = _hashed_words(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s1)
        assert sum(hashed) == len(SPEC), hashed
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)


def test_check_cache_finds_damage_a_seal_cannot_see(tmp_path, monkeypatch):
    """The seal's limit, and its way out: words damaged with no trace in the file's metadata
    (here the seal is written again after the damage) are taken as sealed; ``check_cache``
    hashes them, finds the damage and rebuilds the baseline from the log."""
    from dcr_log.write import baseline as baseline_module

    rng = np.random.default_rng(24)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    LogWriter.create(tmp_path / "log", s0, cache_dir=cache).close()
    (words,) = _slot_files(cache)
    data = bytearray(words.read_bytes())
    data[5] ^= 0x40
    words.write_bytes(bytes(data))
    slot = words.parent
    meta = json.loads((slot / "meta.json").read_text())
    dtypes = {baseline_module._key_of(k): dt for k, dt, _, _ in meta["pieces"]}
    forged = baseline_module.Baseline(meta["version"], {}, dtypes, {}, slot)
    forged._map(meta["file"], [(baseline_module._key_of(k), at) for k, _, at, _ in meta["pieces"]])
    forged.seal()
    keys = list(dtypes)
    hashed: list[int] = []

    def digest_boxes(items):
        hashed.append(len(items))
        return [0] * len(items)

    rank_cache = baseline_module.BaselineCache(cache, DeltaLog.open(tmp_path / "log").log_id,
                                               DeltaLog.open(tmp_path / "log").store.url)
    assert baseline_module.open_cached(rank_cache, 0, keys, digest_boxes) is not None and not hashed
    s1 = _step(rng, s0)
    with monkeypatch.context() as m:
        replays = _replays(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache, check_cache=True).append(s1)
    assert replays  # the damage was found and the baseline rebuilt
    log = DeltaLog.open(tmp_path / "log")
    assert_same_bits(log.materialize(1), s1)
    log.verify(deep=True)


def _dcr_append_killed(tmp_path: Path, cache: Path, checkpoint: Path, delay: float) -> tuple[bool, int, str]:
    """A real ``dcr append`` of ``checkpoint`` to ``tmp_path / "log"``, SIGKILLed ``delay``
    seconds after it removed the cache's seal (it is about to write the cache's words): whether
    it was killed (it may end first), its exit status and its stderr."""
    import signal
    import subprocess
    import sys

    seal = _seal(cache)
    proc = subprocess.Popen([sys.executable, "-m", "dcr_log", "append", str(tmp_path / "log"), "--from",
                             str(checkpoint), "--cache", str(cache)], env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = False
    try:
        deadline = time.monotonic() + 60
        while seal.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed = True
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return killed, proc.returncode, err


@pytest.mark.parametrize("then", ["a new dcr append", "a writer beside it"])
def test_a_dcr_append_killed_as_it_writes_the_cache_loses_nothing(tmp_path, then):
    """SIGKILL of real ``dcr append`` processes as soon as each removed its cache's seal (it is
    about to write the cache's words), each followed by an append of the next state: by a new
    ``dcr append`` process, or by a writer that lives beside them, its baseline mapped from the
    same cache (it loads it again). Every version the log holds is the state appended, and the
    log verifies."""
    import signal

    from dcr_log.checkpoint import save_safetensors

    rng = np.random.default_rng(25)
    spec = {"w": ("BF16", (2048, 1024)), "b": ("F32", (33,))}
    cache = tmp_path / "cache"
    checkpoint = tmp_path / "next.safetensors"
    states = [make_state(rng, spec)]
    LogWriter.create(tmp_path / "log", states[0], cache_dir=cache).close()
    writer = None
    if then == "a writer beside it":
        writer = LogWriter.open(tmp_path / "log", cache_dir=cache)
        states.append(_step(rng, states[-1], rate=0.05))
        writer.append(states[-1])
    killed = 0
    for delay in (0.0, 0.005, 0.02):
        new = _step(rng, states[-1], rate=0.05)
        save_safetensors(new, checkpoint)
        was_killed, returncode, err = _dcr_append_killed(tmp_path, cache, checkpoint, delay)
        killed += was_killed
        if DeltaLog.open(tmp_path / "log").latest_version() == len(states):
            states.append(new)  # committed before the kill
            if writer is not None:  # behind the log now: it opens it again
                writer.close()
                writer = LogWriter.open(tmp_path / "log", cache_dir=cache)
        else:
            assert returncode == -signal.SIGKILL, err
        new = _step(rng, states[-1], rate=0.05)
        if writer is None:
            save_safetensors(new, checkpoint)
            rc, _, err = run_cli("append", tmp_path / "log", "--from", checkpoint, "--cache", cache)
            assert rc == 0, err
        else:
            assert writer.append(new).version == len(states)
        states.append(new)
        assert _seal(cache).exists()
    if writer is not None:
        writer.close()
    assert killed >= 2
    log = DeltaLog.open(tmp_path / "log")
    assert log.latest_version() == len(states) - 1
    for v, s in enumerate(states):
        assert_same_bits(log.materialize(v), s)
    log.verify(deep=True)


def test_a_seal_that_cannot_be_written_fails_nothing(tmp_path, monkeypatch):
    """The seal is written after the commit: a full disk there leaves no seal and no temporary
    file, the append succeeds, and the next writer hashes the words."""
    rng = np.random.default_rng(26)
    cache = tmp_path / "cache"
    s0 = make_state(rng, SPEC)
    writer = LogWriter.create(tmp_path / "log", s0, cache_dir=cache)
    real_write = Path.write_bytes

    def full_disk(self, data):
        if self.name.startswith(".seal.json."):
            real_write(self, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real_write(self, data)

    s1 = _step(rng, s0)
    with monkeypatch.context() as m:
        m.setattr(Path, "write_bytes", full_disk)
        assert writer.append(s1).version == 1
    writer.close()
    (words,) = _slot_files(cache)
    assert sorted(p.name for p in words.parent.iterdir()) == ["meta.json", words.name]  # no seal, no .tmp
    s2 = _step(rng, s1)
    with monkeypatch.context() as m:
        _no_replay(m)
        hashed = _hashed_words(m)
        LogWriter.open(tmp_path / "log", cache_dir=cache).append(s2)
    assert sum(hashed) == len(SPEC)
    assert_same_bits(DeltaLog.open(tmp_path / "log").materialize(2), s2)
