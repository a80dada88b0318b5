"""A first end-to-end check: create, append, materialize every version bit-exactly."""

import numpy as np

from dcr_log import DeltaLog, create_log, state_equal, to_state


def test_versions_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    s = {
        "a": rng.integers(0, 2**16, (100, 33), dtype=np.uint16).view(np.float16),
        "b": np.float32(3.0),
        "e": np.zeros((0, 3), np.int8),
    }
    states = [{k: np.array(v, copy=True) for k, v in s.items()}]
    writer = create_log(tmp_path / "log", s)
    for i in range(4):
        s = {k: np.array(v, copy=True) for k, v in s.items()}
        flat = s["a"].view(np.uint16).reshape(-1)
        flat[rng.choice(flat.size, 50, replace=False)] ^= 1
        if i == 2:
            s["c"] = np.arange(10, dtype=np.int64)
            s["b"] = np.float64(2)
            del s["e"]
        writer.append(s, kind="overwrite" if i == 1 else "xor", allow_layout_change=i == 2)
        states.append(s)
    log = DeltaLog.open(tmp_path / "log")
    assert log.versions() == list(range(5))
    for v, expected in enumerate(states):
        assert state_equal(log.materialize(v), to_state(expected))
    log.verify(deep=True)


def test_writer_baseline_follows_each_append_and_owns_its_words(tmp_path):
    """The writer's baseline is advanced by scatter: appending the same state again finds no
    change, and changing the caller's arrays after an append does not reach the baseline."""
    rng = np.random.default_rng(1)
    s = {"w": rng.integers(0, 2**16, (64, 70), dtype=np.uint16), "v": rng.integers(0, 255, 9, dtype=np.uint8)}
    writer = create_log(tmp_path / "log", s)
    for step in range(3):
        s = {k: v.copy() for k, v in s.items()}
        flat = s["w"].reshape(-1)
        flat[rng.choice(flat.size, 200, replace=False)] ^= np.uint16(1 + step)
        assert writer.append(s).stats.changed_elements == 200
        assert writer.append(s).stats.changed_elements == 0
        expected = {k: v.copy() for k, v in s.items()}
        s["w"][:] = 0  # the caller reuses its buffer
        s = expected
    log = DeltaLog.open(tmp_path / "log")
    assert state_equal(log.materialize(), to_state(s))


def test_append_returns_the_record_it_wrote_without_parsing_it_again(tmp_path, monkeypatch):
    """A one-rank writer keeps the commit record it serialized and wrote (tensors inserted out
    of order, files, a reopened log reading it back): the record append returns equals the one
    a reader parses from the store, and the writer parses none of its own."""
    from dcr_log import TensorBits
    from dcr_log.format.commit import CommitRecord
    from dcr_log.write import LogWriter

    rng = np.random.default_rng(2)
    names = ["z.w", "a.w", "m.w", "é", "B", "b"]
    state = {n: TensorBits("BF16", (16, 8), rng.integers(0, 1 << 16, 128, dtype=np.uint16)) for n in names}
    writer = LogWriter.create(tmp_path / "log", state, cache_dir=False, files={"config.json": b"{}"})
    parsed = []
    real = CommitRecord.from_bytes

    def from_bytes(data, expect_version=None):
        parsed.append(expect_version)
        return real(data, expect_version)

    monkeypatch.setattr(CommitRecord, "from_bytes", staticmethod(from_bytes))
    for v in (1, 2):
        state = {n: TensorBits(b.dtype, b.shape, b.words ^ v) for n, b in state.items()}
        record = writer.append(state, files={"z.json": b"%d" % v, "config.json": b"{}"})
        assert parsed == [], parsed
        assert record == DeltaLog.open(tmp_path / "log").commit(v)
        assert parsed == [v]
        parsed.clear()
    writer.close()
