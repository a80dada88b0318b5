"""The receiver's segment pipeline: segments fetched ahead on threads while earlier ones are
checked and applied, each fetched once, spooled to local disk beyond the memory budget."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import counting_store, change_words, copy_state, make_state
from dcr_log.log import DeltaLog
from dcr_log.receiver import Receiver
from dcr_log.receiver import apply as apply_module
from dcr_log.writer import LogWriter


@pytest.mark.parametrize("budget", [1 << 30, 4096])  # all in memory; most spooled
@pytest.mark.parametrize("verify", ["none", "sample", "full"])
def test_each_segment_is_fetched_once_and_the_spool_is_removed(tmp_path, monkeypatch, budget, verify):
    rng = np.random.default_rng(4)
    spec = {f"t{i}": ("BF16", (64, 48)) for i in range(12)}
    state = make_state(rng, spec)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=1024)
    states = [copy_state(state)]
    for _ in range(2):
        state = {n: change_words(rng, b, 0.3) for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    store = counting_store(str(root))
    log = DeltaLog.open(store)
    assert all(len(log.commit(v).segments) >= 8 for v in (1, 2))
    spools = tmp_path / "tmp"
    spools.mkdir()
    monkeypatch.setattr(apply_module.tempfile, "gettempdir", lambda: str(spools))
    monkeypatch.setattr(apply_module, "SEGMENT_CACHE_BYTES", budget)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in states[0].items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in states[0].items()})
    rx.bind(log, 0)
    store.gets.clear()
    spooled = []
    real_write = apply_module.Path.write_bytes

    def spy(self, data):
        spooled.append(self)
        return real_write(self, data)

    monkeypatch.setattr(apply_module.Path, "write_bytes", spy)
    assert rx.apply(log, verify=verify) == [1, 2]
    for name, bits in states[2].items():
        assert arrays[name].tobytes() == bits.words.tobytes()
    segment_gets = {k: n for k, n in store.gets.items() if k.startswith("segments/")}
    assert set(segment_gets) == {ref.key for v in (1, 2) for ref in log.commit(v).segments}
    assert set(segment_gets.values()) == {1}  # fetched once, however small the budget
    assert (len(spooled) > 0) == (budget == 4096)
    assert list(spools.iterdir()) == []  # the spool is gone


def test_a_spooled_segment_changed_on_disk_is_refused(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    state = make_state(rng, {f"t{i}": ("F32", (32, 32)) for i in range(6)})
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=1024)
    writer.append({n: change_words(rng, b, 0.5) for n, b in state.items()})
    log = DeltaLog.open(root)
    cache = apply_module.SegmentCache(log, log.commit(1), budget=0, spool=tmp_path / "spool")
    first = bytes(cache.data(0))
    path = tmp_path / "spool" / "00000000.arrow"
    assert path.read_bytes() == first
    path.write_bytes(first[:-1] + bytes([first[-1] ^ 1]))
    from dcr_log.errors import IntegrityError
    with pytest.raises(IntegrityError, match="changed on local disk"):
        cache.data(0)
    cache.close()
    assert not (tmp_path / "spool").exists()
