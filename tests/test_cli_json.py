"""``--json`` on every command: each line of stdout is one JSON object with the facts the prose
gives, and a failure is one JSON object ``{"error", "exit"}`` on stderr whose ``exit`` is the
process's exit code, for every exit code."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.checkpoint import save_safetensors
from dcr_log.cli import main
from dcr_log.errors import CommitConflict, IntegrityError, LineageError, StoreError, TrustError, UsageError
from helpers import change_words, make_state, start_cli

SPEC = {"w": ("BF16", (64, 33)), "b": ("F32", (17,)), "s": ("I8", ())}


def dcr(capsys, *args) -> tuple[int, list[dict], str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    c = capsys.readouterr()
    return rc, [json.loads(line) for line in c.out.splitlines()], c.err


def failure(err: str, rc: int) -> dict:
    """The one stderr line of a failed --json command, checked against the exit code."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    body = json.loads(lines[0])
    assert set(body) == {"error", "exit"} and body["exit"] == rc and body["error"].startswith("dcr: "), body
    return body


@pytest.fixture()
def ckpts(tmp_path):
    rng = np.random.default_rng(7)
    states = [make_state(rng, SPEC)]
    for _ in range(3):
        states.append({n: change_words(rng, b, 0.05) for n, b in states[-1].items()})
    paths = []
    for v, s in enumerate(states):
        paths.append(tmp_path / f"s{v}.safetensors")
        save_safetensors(s, paths[-1])
    return paths


def test_every_command_says_its_result_as_json(tmp_path, ckpts, capsys, monkeypatch):
    log, rx = tmp_path / "log", tmp_path / "rx"
    rc, rows, err = dcr(capsys, "keygen", tmp_path / "k", "--json")
    assert rc == 0 and rows[0]["key_id"] and rows[0]["public_key"].startswith("ed25519:"), err
    rc, rows, err = dcr(capsys, "init", log, "--from", ckpts[0], "--cache", "none", "--json")
    assert rc == 0 and rows == [{"version": 0, "tensors": 3, "bytes": rows[0]["bytes"],
                                 "state_digest": rows[0]["state_digest"]}], err
    for v in (1, 2, 3):
        rc, rows, err = dcr(capsys, "append", log, "--from", ckpts[v], "--cache", "none", "--json")
        assert rc == 0 and len(rows) == 1 and rows[0]["version"] == v and rows[0]["parent"] == v - 1, err
        assert 0 < rows[0]["changed_elements"] < rows[0]["total_elements"]
    rc, rows, err = dcr(capsys, "sign", log, "--key", tmp_path / "k", "--json")
    assert rc == 0 and rows[0]["signed"] == [0, 1, 2, 3], err
    rc, rows, err = dcr(capsys, "log", log, "--json")
    assert rc == 0 and [r["version"] for r in rows] == [0, 1, 2, 3], err
    rc, rows, err = dcr(capsys, "show", log, "2", "--json")
    assert rc == 0 and sorted(r["tensor"] for r in rows) == ["b", "s", "w"], err
    rc, rows, err = dcr(capsys, "stats", log, "--json")
    assert rc == 0 and [r["version"] for r in rows] == [0, 1, 2, 3], err
    rc, rows, err = dcr(capsys, "snapshot", log, "--version", "2", "--json")
    assert rc == 0 and rows[0]["snapshot"] == 2 and rows[0]["bytes"] > 0, err
    rc, rows, err = dcr(capsys, "squash", log, "1", "3", "--json")
    assert rc == 0 and rows[0]["squash"] == [1, 3] and rows[0]["chain_bytes"] > 0, err
    rc, rows, err = dcr(capsys, "verify", log, "--deep", "--json")
    assert rc == 0 and rows[0]["ok"] is True and rows[0]["versions"] == 4 and rows[0]["catchups"] == 2, err
    rc, rows, err = dcr(capsys, "replay", log, "--version", "1", "--out", tmp_path / "r.safetensors", "--json")
    assert rc == 0 and rows == [{"out": str(tmp_path / "r.safetensors"), "version": 1, "tensors": 3}], err
    rc, rows, err = dcr(capsys, "apply", log, "--receiver", rx, "--to", "1", "--json")
    assert rc == 0 and len(rows) == 1 and "materialized version 1" in rows[0]["said"], err
    rc, rows, err = dcr(capsys, "apply", log, "--receiver", rx, "--json")
    # From version 1 the squash 1-3 reads fewer bytes than the chain: one step.
    assert rc == 0 and [(r["applied"], r["route"], r["start"]) for r in rows] == [(3, "squash", 1)], err
    assert rows[0]["written"] > 0 and rows[0]["changed_elements"] > 0
    rc, rows, err = dcr(capsys, "apply", log, "--receiver", rx, "--json")
    assert rc == 0 and rows == [{"receiver": str(rx), "version": 3}], err
    rc, rows, err = dcr(capsys, "status", "--receiver", rx, "--json")
    assert rc == 0 and rows[0]["version"] == 3, err
    rc, rows, err = dcr(capsys, "mirror", log, tmp_path / "m", "--json")
    assert rc == 0 and rows[0]["latest"] == 3 and rows[0]["versions"] == 4, err
    rc, rows, err = dcr(capsys, "mirror", log, tmp_path / "m", "--json")
    assert rc == 0 and rows[0]["versions"] == 0 and rows[0]["latest"] == 3, err
    rc, rows, err = dcr(capsys, "gc", log, "--keep-last", "2", "--grace", "0s", "--json")
    assert rc == 0 and len(rows) == 1 and rows[0]["start"] == 2, err
    import dcr_log.demo as demo_mod

    monkeypatch.setattr(demo_mod, "run_demo", functools.partial(demo_mod.run_demo, params=5000, versions=3))
    rc, rows, err = dcr(capsys, "demo", "--json")
    assert rc == 0 and [r.get("version") for r in rows[:-1]] == [0, 1, 2], err
    assert all(r["bit_exact"] for r in rows[:-1]) and rows[-1]["all_bit_exact"] is True


def test_every_failure_is_one_json_line_with_its_exit_code(tmp_path, ckpts, capsys, monkeypatch):
    log, rx = tmp_path / "log", tmp_path / "rx"
    assert dcr(capsys, "init", log, "--from", ckpts[0], "--cache", "none", "--json")[0] == 0
    assert dcr(capsys, "append", log, "--from", ckpts[1], "--cache", "none", "--json")[0] == 0
    assert dcr(capsys, "apply", log, "--receiver", rx, "--json")[0] == 0

    def refused(code: int, *args) -> dict:
        rc, rows, err = dcr(capsys, *args, "--json")
        assert rc == code and rows == [], (rc, rows, err)
        return failure(err, rc)

    refused(UsageError.exit_code, "log", log, "--nope")                       # 2: click's usage error
    refused(UsageError.exit_code, "frob")                                      # 2: no such command
    refused(UsageError.exit_code, "apply", log, "--receiver", rx, "--to", "9")  # 2: the library's
    refused(CommitConflict.exit_code, "init", log, "--from", ckpts[0])          # 5: the log exists
    other = tmp_path / "other"
    assert dcr(capsys, "init", other, "--from", ckpts[2], "--cache", "none", "--json")[0] == 0
    refused(LineageError.exit_code, "apply", other, "--receiver", rx)          # 4: another log's receiver
    assert dcr(capsys, "keygen", tmp_path / "k", "--json")[0] == 0
    (tmp_path / "trust").write_text(Path(f"{tmp_path / 'k'}.pub").read_text())
    body = refused(TrustError.exit_code, "verify", log, "--trust", tmp_path / "trust")  # 7: unsigned
    assert "signature" in body["error"]
    segments = sorted((log / "segments").rglob("*.arrow"), key=lambda p: p.stat().st_size)
    blob = bytearray(segments[-1].read_bytes())
    blob[len(blob) // 2] ^= 0x10
    segments[-1].write_bytes(bytes(blob))
    refused(IntegrityError.exit_code, "verify", log)                           # 3: a flipped bit

    import errno
    import os as os_mod

    def link(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(os_mod, "link", link)
    body = refused(StoreError.exit_code, "append", other, "--from", ckpts[3], "--cache", "none")  # 6
    assert "read-only" in body["error"]
    monkeypatch.undo()

    import dcr_log.log.deltalog as deltalog_mod

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(deltalog_mod.DeltaLog, "versions", broken)
    body = refused(1, "log", log)                                              # 1: anything else
    assert "RuntimeError" in body["error"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_is_one_json_line(tmp_path, ckpts, sig):
    log = tmp_path / "log"
    assert dcr_subprocess_ok("init", log, "--from", ckpts[0], "--cache", "none")
    proc = start_cli("apply", log, "--receiver", tmp_path / "rx", "--follow", "--interval", "0.05", "--json")
    deadline = time.monotonic() + 60
    while not (tmp_path / "rx" / ".dcr").exists():  # the follower is up once its journal is
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    assert all(json.loads(line) for line in out.splitlines())
    body = failure(err, proc.returncode)
    assert signal.Signals(sig).name in body["error"]


def dcr_subprocess_ok(*args) -> bool:
    proc = start_cli(*args)
    proc.communicate(timeout=120)
    return proc.returncode == 0


def test_tables_are_whole_without_a_terminal(tmp_path, ckpts):
    """Through a pipe (no terminal) every cell is printed whole, not cut to 80 columns."""
    from helpers import cli_env, run_cli

    log = tmp_path / "log"
    assert run_cli("init", log, "--from", ckpts[0], "--cache", "none")[0] == 0
    assert run_cli("append", log, "--from", ckpts[1], "--cache", "none")[0] == 0
    rc, out, err = run_cli("log", log, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    env = cli_env()
    env.pop("COLUMNS")  # as in a CI log: no terminal, no width given
    proc = subprocess.run([sys.executable, "-m", "dcr_log", "log", str(log)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    for r in rows:
        line = next(t for t in table.splitlines() if r["created_at"] in t)  # the timestamp whole
        assert str(r["bytes"]) in line and str(r["changed_elements"]) in line
    assert "…" not in table


@pytest.mark.parametrize("features,expected", [("sum-digests", ["sum-digests"]), ("none", []),
                                               ("ulp-encoding,sum-digests", ["sum-digests", "ulp-encoding"]),
                                               (None, ["rans-encoding", "sum-digests"])])
def test_init_features(tmp_path, ckpts, capsys, features, expected):
    """``dcr init --features``: the default (ulp-rans records), logs as before rans-encoding
    (ulp records, coded by pcodec), and logs without either (no ulp records in any version)."""
    from dcr_log.log.deltalog import DeltaLog

    log = tmp_path / "log"
    chosen = [] if features is None else ["--features", features]
    assert dcr(capsys, "init", log, "--from", ckpts[0], "--cache", "none", *chosen, "--json")[0] == 0
    assert dcr(capsys, "append", log, "--from", ckpts[1], "--cache", "none", "--json")[0] == 0
    dlog = DeltaLog.open(log)
    assert list(dlog.identity.features) == expected
    encodings = {rec.encoding for rec in dlog.records(1)}
    assert encodings
    assert ("ulp" in encodings) == ("ulp-encoding" in expected), encodings
    assert ("ulp-rans" in encodings) == ("rans-encoding" in expected), encodings


def test_init_refuses_unknown_features_before_writing(tmp_path, ckpts, capsys):
    rc, rows, err = dcr(capsys, "init", tmp_path / "log", "--from", ckpts[0], "--features", "ulp", "--json")
    assert rc == 2 and rows == [] and "unknown 'ulp'" in failure(err, rc)["error"]
    assert not (tmp_path / "log").exists()
