"""Follow mode: a receiver that applies each version as soon as its commit record appears
(Receiver.follow, dcr apply --follow), with segments prefetched while their writer writes."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import threading
import time

import numpy as np
import pytest

from dcr_log.checkpoint import save_safetensors
from dcr_log.log import DeltaLog
from dcr_log.receiver import Receiver
from dcr_log.write import LogWriter
from helpers import assert_file_holds, assert_same_bits, change_words, copy_state, make_state, run_cli, start_cli

SPEC = {"w": ("BF16", (128, 64)), "b": ("F32", (64,))}


def test_follow_applies_every_version_as_it_lands(tmp_path):
    rng = np.random.default_rng(0)
    state = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False)
    states = [copy_state(state)]
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in state.items()})
    log = DeltaLog.open(root)
    rx.bind(log, 0)
    seen: list[tuple[int, float]] = []
    committed_at: dict[int, float] = {}

    def write() -> None:
        nonlocal state
        for _ in range(5):
            time.sleep(0.15)
            state = {n: change_words(rng, b, 0.05) for n, b in state.items()}
            commit = writer.append(state)
            committed_at[commit.version] = time.monotonic()
            states.append(copy_state(state))

    t = threading.Thread(target=write)
    t.start()
    applied = rx.follow(log, interval=0.02, until=5,
                        on_version=lambda r: seen.append((r.version, time.monotonic())))
    t.join(60)
    assert applied == [1, 2, 3, 4, 5] and rx.version == 5
    for name, bits in states[5].items():
        assert arrays[name].tobytes() == bits.words.tobytes()
    # Each version was applied soon after its commit, not at the end.
    assert all(when - committed_at[v] < 5.0 for v, when in seen)


def test_follow_stops_between_versions_when_asked(tmp_path):
    rng = np.random.default_rng(1)
    state = make_state(rng, SPEC)
    root = tmp_path / "log"
    LogWriter.create(root, state, cache_dir=False)
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in state.items()})
    log = DeltaLog.open(root)
    rx.bind(log, 0)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    assert rx.follow(log, interval=0.05, stop=stop.is_set) == []
    assert time.monotonic() - t0 < 5 and rx.version == 0 and rx.inflight is None


def test_prefetched_segments_are_used_only_after_their_checks(tmp_path):
    rng = np.random.default_rng(2)
    state = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False)
    new = {n: change_words(rng, b, 0.1) for n, b in state.items()}
    writer.append(new)
    log = DeltaLog.open(root)
    assert log.prefetch(1) > 0
    refs = log.commit(1).segments
    saved = {ref.key: (root / ref.key).read_bytes() for ref in refs}
    for ref in refs:  # gone from the store: the prefetched bytes serve the read
        (root / ref.key).unlink()
    assert_same_bits(log.materialize(1), new)
    # A prefetched object that does not match the commit record is not used.
    for key, data in saved.items():
        (root / key).write_bytes(data)
    log = DeltaLog.open(root)
    log.prefetch(1)
    for key in list(log._prefetched):
        log._prefetched[key] = log._prefetched[key][:-1] + bytes([log._prefetched[key][-1] ^ 1])
    assert_same_bits(log.materialize(1), new)  # read again from the store, checked
    log.forget_prefetched(1)
    assert log._prefetched == {}


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_cli_follow_applies_new_versions_and_stops_on_a_signal(tmp_path, sig, code):
    rng = np.random.default_rng(3)
    states = [make_state(rng, SPEC)]
    for _ in range(3):
        states.append({n: change_words(rng, b, 0.05) for n, b in states[-1].items()})
    for i, st in enumerate(states):
        save_safetensors(st, tmp_path / f"ck{i}.safetensors")
    root = tmp_path / "log"
    assert run_cli("init", root, "--from", tmp_path / "ck0.safetensors")[0] == 0
    rx = tmp_path / "rx"
    proc = start_cli("apply", root, "--receiver", rx, "--follow", "--interval", "0.05")

    def wait_for(version: int) -> None:
        """Until the receiver's journal says it holds ``version`` (not a time: under load
        the follower may start late, and must materialize version 0 first)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rc, out, _ = run_cli("status", "--receiver", rx, "--json")
            if rc == 0 and json.loads(out)["version"] == version:
                return
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        raise AssertionError(f"the follower did not reach version {version}")

    try:
        for i in range(1, 4):
            wait_for(i - 1)
            assert run_cli("append", root, "--from", tmp_path / f"ck{i}.safetensors")[0] == 0
        wait_for(3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert err.strip() == f"dcr: interrupted ({signal.Signals(sig).name}): receiver at version 3"
    assert "waiting" not in out + err  # on a pipe: no status line while it waited
    assert [line.split(":")[0] for line in out.splitlines()] == [
        "materialized version 0 into model.safetensors", "applied version 1", "applied version 2",
        "applied version 3"]
    assert_file_holds(rx / "model.safetensors", states[3])
    code2, out2, err2 = run_cli("apply", root, "--receiver", rx, "--follow", "--to", "2")
    assert code2 == 2 and "--follow and --to" in err2


def test_follow_holds_on_wait_while_it_waits_and_only_then(tmp_path):
    """``on_wait(v)`` is entered when the receiver starts waiting for version v and left as soon
    as v is committed, before v is applied; a version that is already there is never waited for."""
    rng = np.random.default_rng(4)
    state = make_state(rng, SPEC)
    root = tmp_path / "log"
    writer = LogWriter.create(root, state, cache_dir=False)
    writer.append({n: change_words(rng, b, 0.05) for n, b in state.items()})  # version 1: no wait
    arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
    rx = Receiver.open(arrays, tmp_path / "j", dtypes={n: b.dtype for n, b in state.items()})
    log = DeltaLog.open(root)
    rx.bind(log, 0)
    events: list[tuple[str, int]] = []
    waited = {2: threading.Event(), 3: threading.Event()}

    @contextlib.contextmanager
    def on_wait(version: int):
        events.append(("wait", version))
        waited[version].set()
        yield
        events.append(("done", version))

    def write() -> None:  # each version only once the follower waits for it: the order is fixed
        current = state
        for v in (2, 3):
            assert waited[v].wait(60)
            current = {n: change_words(rng, b, 0.05) for n, b in current.items()}
            writer.append(current)

    t = threading.Thread(target=write)
    t.start()
    applied = rx.follow(log, interval=0.02, until=3, on_wait=on_wait,
                        on_version=lambda r: events.append(("applied", r.version)))
    t.join(60)
    assert applied == [1, 2, 3]
    assert events == [("applied", 1), ("wait", 2), ("done", 2), ("applied", 2), ("wait", 3), ("done", 3),
                      ("applied", 3)]


def test_waiting_line_only_on_a_terminal_and_never_with_json():
    """dcr apply --follow's status line: shown on a terminal console, with the version awaited,
    the one held and the polling interval; no line at all on a pipe or with --json."""
    from rich.console import Console

    from dcr_log.cli.receive_commands import waiting_line

    assert waiting_line(Console(file=io.StringIO()), False, 1.0) is None  # a pipe
    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=120)
    assert waiting_line(console, True, 1.0) is None  # --json: results only
    waiting = waiting_line(console, False, 0.5)
    assert waiting is not None
    with waiting(7):
        pass
    assert "waiting for version 7 after 6 (checking every 0.5s)" in terminal.getvalue()
