"""Python habits: writers and readers close and work as context managers; every error class
and the public names the README uses import from ``dcr_log``."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_same_bits, change_words, make_state

import dcr_log
from dcr_log import DeltaLog, LogWriter, ShardedWriter
from dcr_log.errors import UsageError

SPEC = {"w": ("BF16", (16, 9)), "b": ("F32", (5,))}


def test_writers_and_readers_are_context_managers(tmp_path):
    rng = np.random.default_rng(0)
    s0 = make_state(rng, SPEC)
    s1 = {n: change_words(rng, b, 0.2) for n, b in s0.items()}
    with LogWriter.create(tmp_path / "log", s0, cache_dir=tmp_path / "cache") as writer:
        writer.append(s1)
    with pytest.raises(UsageError, match="closed"):
        writer.append(s1)
    with LogWriter.open(tmp_path / "log", cache_dir=tmp_path / "cache") as again:  # resumes after close
        assert again.version == 1
        again.append(s0)
    with DeltaLog.open(tmp_path / "log") as log:
        assert_same_bits(log.materialize(1), s1)
        assert_same_bits(log.materialize(2), s0)
    assert log.latest_version() == 2  # closed: caches dropped, still readable
    with ShardedWriter.open(tmp_path / "log", cache_dir=tmp_path / "cache") as sharded:
        assert sharded.version == 2


def test_every_error_class_imports_from_dcr_log():
    import dcr_log.errors as errors

    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__}
    assert {"TrustError", "StoreError", "ExpiredError", "LayoutError", "AppendAborted", "ReplicaMismatch"} <= classes
    for name in classes:
        assert getattr(dcr_log, name) is getattr(errors, name), name
