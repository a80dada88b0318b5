"""Python habits: writers and readers close and work as context managers; every error class
and the public names the README uses import from ``dcr_log``; importing the package or the
command (and ``dcr --help``) stays light."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dcr_log
from dcr_log import DeltaLog, LogWriter, ShardedWriter
from dcr_log.errors import UsageError
from dcr_log.receiver import Receiver, write_checkpoint
from helpers import assert_same_bits, change_words, make_state

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


def test_every_public_name_resolves():
    """``__all__`` names exactly the lazily exported names, each resolves (attribute and
    ``from dcr_log import X``), and ``dir(dcr_log)`` lists them."""
    assert dcr_log.__all__ == sorted(dcr_log.__all__)
    assert set(dcr_log.__all__) == set(dcr_log._LAZY)
    for name in dcr_log.__all__:
        value = getattr(dcr_log, name)
        namespace: dict = {}
        exec(f"from dcr_log import {name}", namespace)
        assert namespace[name] is value, name
        assert getattr(value, "__name__", name) == name
    assert set(dcr_log.__all__) <= set(dir(dcr_log))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        dcr_log.NoSuchName  # noqa: B018


HEAVY = ("torch", "pyarrow", "numpy", "zstandard", "pcodec", "safetensors", "lmdb", "cryptography",
         "dcr_log.log", "dcr_log.receiver", "dcr_log.write", "dcr_log.format", "dcr_log.codec")


def _imported_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running CODE."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_import_dcr_log_and_the_cli_import_no_heavy_module():
    assert _imported_after("import dcr_log") == []
    assert _imported_after("import dcr_log.cli") == []


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["apply", "--help"], ["init", "--help"]])
def test_help_and_version_import_no_heavy_module(argv):
    """Through the entry point, as ``dcr`` runs them (entry exits: the report is printed at exit)."""
    code = textwrap.dedent(f"""
        import atexit, json, sys
        atexit.register(lambda: print(json.dumps([m for m in {HEAVY!r} if m in sys.modules])))
        sys.argv = ["dcr", *{argv!r}]
        from dcr_log._entry import entry
        entry()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_readers_of_unsigned_logs_import_no_cryptography():
    """Signatures are checked only under a trust policy: the receiver and the log reader import
    cryptography when a key is made, read or checked, not before."""
    heavy = _imported_after("import dcr_log.receiver, dcr_log.log")
    assert "numpy" in heavy and "cryptography" not in heavy



def test_pyarrow_is_imported_by_the_first_segment_read_not_before(tmp_path):
    """Opening a log, reading its commit records and applying a version with no records to a
    checkpoint directory as ``dcr apply`` does (``open_directory``) read no segment, so they
    import no pyarrow (``dcr apply`` of an empty delta starts faster); the first segment read
    imports it. ``Receiver.open`` imports it ahead (a receiver kept open for the versions to
    come does not pay for the import in its first apply)."""
    state = make_state(np.random.default_rng(3), SPEC)
    with LogWriter.create(tmp_path / "log", state, cache_dir=False) as writer:
        writer.append(state)  # no change: a version with no records
    assert DeltaLog.open(tmp_path / "log").commit(1).stats.records == 0
    (tmp_path / "rx").mkdir()
    write_checkpoint(state, tmp_path / "rx")
    with Receiver.open(tmp_path / "rx") as rx:  # a checkpoint directory at version 0
        rx.bind(DeltaLog.open(tmp_path / "log"), 0)
    probe = textwrap.dedent(f"""
        import sys
        from dcr_log import DeltaLog
        from dcr_log.receiver import Receiver, open_directory
        log = DeltaLog.open({str(tmp_path / "log")!r})
        with open_directory(log, {str(tmp_path / "rx")!r}) as rx:
            applied = rx.apply(log)
        empty = "pyarrow" in sys.modules
        log.materialize(0)
        print(applied, empty, "pyarrow" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[1]", "False", "True"]
    opened = textwrap.dedent(f"""
        import sys
        from dcr_log.receiver import Receiver
        with Receiver.open({str(tmp_path / "rx")!r}) as rx:
            print("pyarrow.ipc" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", opened], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True"]


def test_reading_segments_imports_no_pyarrow_compute(tmp_path):
    """Parsing a segment uses no pyarrow.compute (ListArray.flatten, say, imports it: about
    20 ms of a fresh process's first apply)."""
    rng = np.random.default_rng(4)
    state = make_state(rng, SPEC)
    with LogWriter.create(tmp_path / "log", state, cache_dir=False) as writer:
        writer.append(make_state(rng, SPEC))
    probe = textwrap.dedent(f"""
        import sys
        from dcr_log import DeltaLog
        log = DeltaLog.open({str(tmp_path / "log")!r})
        log.materialize(1)
        print("pyarrow.ipc" in sys.modules, "pyarrow.compute" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False"]
