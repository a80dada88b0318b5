"""`dcr demo` on a tiny model: every version replays bit-exact, and the report says so."""

import numpy as np
import pytest
from rich.console import Console

from dcr_log import DeltaLog, UsageError
from dcr_log.demo import _same_bits, run_demo
from dcr_log.state import TensorBits


def _console() -> Console:
    return Console(record=True, width=120, color_system=None)


def test_demo_reports_every_version_bit_exact(tmp_path):
    console = _console()
    report = run_demo(tmp_path / "log", console, params=60_000, versions=4, seed=1)
    text = console.export_text()
    assert [r.version for r in report.rows] == [0, 1, 2, 3]
    assert report.all_bit_exact and all(r.bit_exact for r in report.rows)
    assert "all 4 versions replayed bit-exact" in text
    for r in report.rows[1:]:
        assert 0.01 <= r.changed_elements / r.total_elements <= 0.03
        assert 0 < r.delta_bytes < r.dense_bytes / 10
    # The log it leaves is a complete, verifiable log of those versions.
    log = DeltaLog.open(tmp_path / "log")
    assert log.versions() == [0, 1, 2, 3]
    assert log.commit(3).delta_bytes == report.rows[3].delta_bytes
    log.verify(deep=True)


def test_demo_in_a_temporary_directory_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    report = run_demo(None, _console(), params=20_000, versions=2)
    assert report.log_path is None and report.all_bit_exact
    assert list(tmp_path.iterdir()) == []


def test_bit_comparison_sees_one_flipped_bit():
    words = np.arange(1000, dtype=np.uint16)
    written = {"w": TensorBits("BF16", (10, 100), words)}
    same = {"w": TensorBits("BF16", (10, 100), words.copy())}
    assert _same_bits(same, written)
    flipped = words.copy()
    flipped[637] ^= 0x0100
    assert not _same_bits({"w": TensorBits("BF16", (10, 100), flipped)}, written)
    assert not _same_bits({"w": TensorBits("F16", (10, 100), words.copy())}, written)
    assert not _same_bits({"w": TensorBits("BF16", (100, 10), words.copy())}, written)
    assert not _same_bits({}, written)


def test_demo_refuses_a_directory_that_holds_a_log(tmp_path):
    run_demo(tmp_path / "log", _console(), params=20_000, versions=1)
    with pytest.raises(UsageError, match="already holds a log"):
        run_demo(tmp_path / "log", _console(), params=20_000, versions=1)
