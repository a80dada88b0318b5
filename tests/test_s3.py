"""Logs on S3 (a real SeaweedFS server started by the tests): commit races, the CLI end to end
with receivers and retention, an interrupted init finished by running it again, and a server
that dies, hangs, or is killed by PID in the middle of applies and appends."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.checkpoint import save_safetensors
from dcr_log.errors import CommitConflict
from dcr_log.log import DeltaLog
from dcr_log.write import LogWriter
from helpers import assert_file_holds, assert_one_line, assert_same_bits, change_words, cli_env, make_state, run_cli
from helpers.seaweed import SeaweedServer

SPEC = {"w": ("BF16", (256, 96)), "b": ("F32", (96,)), "e": ("F16", (64, 33))}


def _states(n: int, seed: int = 0, rate: float = 0.05) -> list[dict]:
    rng = np.random.default_rng(seed)
    states = [make_state(rng, SPEC)]
    for _ in range(n - 1):
        states.append({k: change_words(rng, b, rate) for k, b in states[-1].items()})
    return states


def test_commit_race_on_s3_has_one_winner(s3_server):
    url = s3_server.url()
    states = _states(2)
    LogWriter.create(url, states[0], cache_dir=False)
    outcomes: list = []
    barrier = threading.Barrier(4)

    def race(i: int) -> None:
        writer = LogWriter.open(url, cache_dir=False, writer_id=f"racer{i}")
        rng = np.random.default_rng(100 + i)
        mine = {k: change_words(rng, b, 0.1) for k, b in states[0].items()}
        barrier.wait()
        try:
            writer.append(mine)
            outcomes.append(("won", i, mine))
        except CommitConflict:
            outcomes.append(("lost", i, None))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [o for o in outcomes if o[0] == "won"]
    assert len(outcomes) == 4 and len(winners) == 1
    log = DeltaLog.open(url)
    assert log.versions() == [0, 1]
    assert_same_bits(log.materialize(1), winners[0][2])
    assert log.commit(1).writer_id == f"racer{winners[0][1]}"
    log.verify(deep=True)


def test_cli_end_to_end_on_s3_with_receivers_and_retention(s3_server, tmp_path):
    url = s3_server.url()
    states = _states(8)
    for i, st in enumerate(states):
        save_safetensors(st, tmp_path / f"ck{i}.safetensors")
    code, out, err = run_cli("init", url, "--from", tmp_path / "ck0.safetensors", "--cache", "none")
    assert code == 0, err
    for i in range(1, 5):
        code, out, err = run_cli("append", url, "--from", tmp_path / f"ck{i}.safetensors", "--cache", "none")
        assert code == 0, err
    rx = tmp_path / "rx"
    code, out, err = run_cli("apply", url, "--receiver", rx, "--to", "1")
    assert code == 0, err
    for i in range(5, 8):
        code, out, err = run_cli("append", url, "--from", tmp_path / f"ck{i}.safetensors", "--cache", "none")
        assert code == 0, err
    assert run_cli("squash", url, "1", "6")[0] == 0
    code, out, err = run_cli("gc", url, "--keep-last", "2", "--grace", "0")
    assert code == 0 and "log starts at version 6" in out, (out, err)
    code, out, err = run_cli("apply", url, "--receiver", rx)
    assert code == 0, err
    assert out.splitlines()[0].startswith("applied version 6 (squash from 1)")
    assert_file_holds(rx / "model.safetensors", states[7])
    code, out, err = run_cli("verify", url, "--deep")
    assert code == 0 and "from version 6" in out, err
    fresh = tmp_path / "fresh"
    code, out, err = run_cli("apply", url, "--receiver", fresh)
    assert code == 0, err
    assert_file_holds(fresh / "model.safetensors", states[7])


def test_an_interrupted_init_is_finished_by_running_it_again(s3_server, tmp_path):
    url = s3_server.url()
    rng = np.random.default_rng(5)
    big = make_state(rng, {"w": ("F32", (2048, 1024)), "b": ("F32", (1024,))})
    ckpt = tmp_path / "big.safetensors"
    save_safetensors(big, ckpt)
    # Killed once dcr.json exists and before version 0 does (SIGKILL: nothing runs after it).
    proc = subprocess.Popen([sys.executable, "-m", "dcr_log", "init", url, "--from", str(ckpt), "--cache", "none"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env())
    log_key_seen = False
    deadline = time.monotonic() + 60
    from dcr_log.store import Store
    store = Store.open(url)
    while time.monotonic() < deadline and proc.poll() is None:
        if store.head("dcr.json") is not None:
            log_key_seen = True
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(30)
    proc.stderr.close()
    assert log_key_seen, "init finished before it could be killed"
    assert store.head("versions/00000000000000000000.json") is None
    code, out, err = run_cli("log", url)
    assert code == 2 and "no versions" in err
    assert_one_line(err)
    code, out, err = run_cli("init", url, "--from", ckpt, "--cache", "none")
    assert code == 0 and out.startswith("version 0:"), err
    log = DeltaLog.open(url)
    assert log.versions() == [0]
    assert_same_bits(log.materialize(0), big)
    # A complete log is never taken over; an incomplete one with other features is refused.
    code, out, err = run_cli("init", url, "--from", ckpt)
    assert code == 5 and "already holds a log" in err
    other = s3_server.url()
    Store.open(other).put_new("dcr.json", log.identity.__class__(log_id="a" * 32, created_at="x",
                                                                 features=()).to_bytes())
    code, out, err = run_cli("init", other, "--from", ckpt, "--cache", "none")
    assert code == 5 and "incomplete log" in err and "same options" in err
    assert_one_line(err)


@pytest.fixture
def own_server(tmp_path, monkeypatch):
    """A SeaweedFS server of this test alone (it gets killed), and the environment for it (in
    this process too)."""
    server = SeaweedServer(tmp_path / "seaweedfs")
    server.start()
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    # Commands the server dies under fail within 3 s; the ones after a restart get the default
    # deadline (a restarted server may take a few seconds to take writes again).
    env = {**cli_env(), **server.env, "DCR_STORE_DEADLINE": "3"}
    try:
        yield server, env
    finally:
        server.stop()


def _dcr(env, *args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "dcr_log", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_dead_or_hung_server_is_one_line_and_exit_6(own_server):
    server, env = own_server
    url = server.url()
    server.pause()  # accepts connections, never answers
    t0 = time.monotonic()
    code, out, err = _dcr(env, "log", url)
    waited = time.monotonic() - t0
    server.resume()
    assert code == 6 and "cannot read" in err and "dcr.json" in err and "no answer after" in err, err
    assert_one_line(err)
    assert waited < 3 + 15  # the deadline, plus the interpreter's start and one backoff
    server.kill()
    code, out, err = _dcr(env, "log", url)
    assert code == 6 and "connection refused" in err and f"{url}/dcr.json" in err, err
    assert_one_line(err)


def test_server_killed_in_the_middle_of_applies_and_appends(own_server, tmp_path):
    """5 kills of the server by PID during `dcr apply` and 5 during `dcr append`, each followed
    by a restart: the apply then finishes bit-exact, the log verifies, the next append works."""
    server, env = own_server
    url = server.url()
    rng = np.random.default_rng(7)
    state = make_state(rng, {"w": ("BF16", (1024, 512)), "b": ("F32", (512,))})
    ckpts = []
    for i in range(12):
        ckpts.append(tmp_path / f"ck{i}.safetensors")
        save_safetensors(state, ckpts[-1])
        state = {k: change_words(rng, b, 0.05) for k, b in state.items()}
    code, out, err = _dcr(env, "init", url, "--from", ckpts[0], "--cache", "none")
    assert code == 0, err
    # How long each command takes here: the kills land within that (a fixed delay would land
    # after the command on a fast machine, and test nothing).
    took = {"append": [], "apply": []}
    for i in range(1, 6):
        t0 = time.perf_counter()
        assert _dcr(env, "append", url, "--from", ckpts[i], "--cache", "none")[0] == 0
        took["append"].append(time.perf_counter() - t0)
    assert _dcr(env, "apply", url, "--receiver", tmp_path / "timed", "--to", "0")[0] == 0
    t0 = time.perf_counter()
    assert _dcr(env, "apply", url, "--receiver", tmp_path / "timed")[0] == 0
    took["apply"].append(time.perf_counter() - t0)
    after = {k: v for k, v in env.items() if k != "DCR_STORE_DEADLINE"}
    rand = random.Random(7)
    kills = {"apply": 0, "append": 0}
    outcomes = []

    def kill_during(what: str, *args, codes: tuple[int, ...]) -> None:
        """Run ``dcr WHAT ARGS``, SIGKILL the server under it, wait for it, restart the server."""
        proc = subprocess.Popen([sys.executable, "-m", "dcr_log", what, *map(str, args)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(rand.uniform(0.3, 0.9) * min(took[what]))
        server.kill()
        kills[what] += 1
        proc.wait(60)
        outcomes.append((what, proc.returncode, proc.stderr.read().strip()))
        proc.stderr.close()
        assert proc.returncode in codes, outcomes[-1]
        server.start()

    for round_ in range(5):
        rx = tmp_path / f"rx{round_}"
        assert _dcr(env, "apply", url, "--receiver", rx, "--to", "0")[0] == 0
        kill_during("apply", url, "--receiver", rx, codes=(0, 6))
        code, out, err = _dcr(after, "apply", url, "--receiver", rx)
        assert code == 0, err
        latest = DeltaLog.open(url).latest_version()
        assert_file_holds(rx / "model.safetensors", DeltaLog.open(url).materialize(latest))
        nxt = 6 + round_
        kill_during("append", url, "--from", ckpts[nxt], "--cache", "none", codes=(0, 1, 6))
        code, out, err = _dcr(after, "verify", url)
        assert code == 0, err
        before = DeltaLog.open(url).latest_version()
        code, out, err = _dcr(after, "append", url, "--from", ckpts[nxt], "--cache", "none")
        assert code == 0, err
        assert DeltaLog.open(url).latest_version() == before + 1
    assert kills == {"apply": 5, "append": 5}
    # Some kills must have landed inside the commands (not all after they finished).
    assert any(code != 0 for _, code, _ in outcomes), outcomes
    for _, code, err in outcomes:
        if code:
            assert err.count("\n") == 0 and err.startswith("dcr: "), err
    log = DeltaLog.open(url)
    log.verify(deep=True)
    # Every version the appends committed holds one of the checkpoints, in order.
    from dcr_log.checkpoint import load_checkpoint
    wanted = [load_checkpoint(c) for c in ckpts]
    got = [log.materialize(v) for v in log.versions()]
    assert_same_bits(got[0], wanted[0])
    assert all(any(_same(g, w) for w in wanted) for g in got)


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(a[k].same_bits(b[k]) for k in a)


def test_a_first_start_that_loses_a_port_draws_new_ones(tmp_path):
    """Ports are drawn free, then bound by weed a moment later: another process can take one in
    between (seen once in a full run). The first start then draws new ports and serves, and
    leaves no socket named by the ports it gave up (weed names its gRPC sockets in /tmp by
    port: one bound before the lost port was found stayed behind)."""
    import socket

    server = SeaweedServer(tmp_path / "seaweedfs")
    taken = server.ports["s3.port"]
    # As a socket weed bound before it found s3.port taken would be.
    stale = Path(f"/tmp/seaweedfs-filer-grpc-{server.ports['filer.port.grpc']}.sock")
    stale.touch()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        try:
            server.start()
            assert server.ports["s3.port"] != taken
            assert server.env["AWS_ENDPOINT_URL"] == server.endpoint == f"http://127.0.0.1:{server.ports['s3.port']}"
            assert not stale.exists()
        finally:
            server.stop()
            stale.unlink(missing_ok=True)
