"""Relay mirrors (dcr_log.mirror, dcr mirror): a tree of mirrors with follow-mode receivers at
the leaves, a mirror killed mid-copy and restarted, damage and foreign logs refused."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.errors import IntegrityError, LineageError
from dcr_log.lifecycle import gc, write_snapshot, write_squash
from dcr_log.lifecycle.mirror import Mirror, mirror
from dcr_log.log import DeltaLog
from dcr_log.receiver import Receiver
from dcr_log.store import Store
from dcr_log.write import LogWriter
from helpers import change_words, cli_env, copy_state, make_state, run_cli, snapshot_files

SPEC = {"w": ("BF16", (192, 64)), "b": ("F32", (64,)), "s": ("I64", ())}


def _log(root: Path, versions: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    state = make_state(rng, SPEC)
    writer = LogWriter.create(root, state, cache_dir=False, segment_bytes=4096)
    states = [copy_state(state)]
    for _ in range(versions - 1):
        state = {n: change_words(rng, b, 0.05) for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    return states


def test_a_mirror_tree_feeds_follow_mode_receivers(tmp_path):
    """Depth 2, 3 leaves (root -> a -> {a1, a2}, root -> b -> {b1}), each leaf with a
    follow-mode receiver, while a writer appends 5 versions."""
    root = tmp_path / "root"
    states = _log(root, 1)
    tree = {"a": root, "b": root, "a1": "a", "a2": "a", "b1": "b"}
    paths = {name: tmp_path / name for name in tree}
    for name in ("a", "b", "a1", "a2", "b1"):  # the first pass, parents first
        src = tree[name] if name in ("a", "b") else paths[tree[name]]
        mirror(src, paths[name])
    stop = threading.Event()
    errors: list[str] = []

    def run_mirror(name: str) -> None:
        src = tree[name] if name in ("a", "b") else paths[tree[name]]
        try:
            Mirror(DeltaLog.open(src), Store.open(paths[name], create=True)).follow(0.02, stop.is_set)
        except Exception as exc:  # reported below
            errors.append(f"mirror {name}: {type(exc).__name__}: {exc}")

    receivers = {}
    for leaf in ("a1", "a2", "b1"):
        log = DeltaLog.open(paths[leaf])
        arrays = {n: b.words.reshape(b.shape).copy() for n, b in states[0].items()}
        rx = Receiver.open(arrays, tmp_path / f"j-{leaf}", dtypes={n: b.dtype for n, b in states[0].items()})
        rx.bind(log, 0)
        receivers[leaf] = (rx, arrays)

    def run_receiver(leaf: str) -> None:
        rx, _ = receivers[leaf]
        try:
            rx.follow(DeltaLog.open(paths[leaf]), interval=0.02, until=5, stop=stop.is_set)
        except Exception as exc:
            errors.append(f"receiver {leaf}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run_mirror, args=(n,)) for n in tree]
    threads += [threading.Thread(target=run_receiver, args=(leaf,)) for leaf in receivers]
    for t in threads:
        t.start()
    rng = np.random.default_rng(1)
    writer = LogWriter.open(root, cache_dir=False)
    state = states[0]
    for _ in range(5):
        time.sleep(0.05)
        state = {n: change_words(rng, b, 0.05) for n, b in state.items()}
        writer.append(state)
        states.append(copy_state(state))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(rx.version < 5 for rx, _ in receivers.values()) and not errors:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for leaf, (rx, arrays) in receivers.items():
        assert rx.version == 5, leaf
        for name, bits in states[5].items():
            assert arrays[name].tobytes() == bits.words.tobytes(), (leaf, name)
    for name in tree:  # each mirror is a valid log with the same id, every object as the source's
        log = DeltaLog.open(paths[name])
        assert log.log_id == DeltaLog.open(root).log_id and log.latest_version() == 5
        log.verify(deep=True)
    assert snapshot_files(paths["a1"]) == {k: v for k, v in snapshot_files(root).items() if not k.startswith(".")}


# The dcr CLI, which SIGKILLs itself once it has published its n-th object at the mirror (argv[1]):
# a crash at a chosen point of a copy that takes tens of milliseconds, where watching the mirror
# from outside can miss it on a busy machine.
KILLED_AFTER_PUBLISHING = """
import os, signal, sys
import dcr_log.lifecycle.mirror as mirror
limit, publish, published = int(sys.argv.pop(1)), mirror._publish, []
def killing_publish(*args):
    publish(*args)
    published.append(args[1])
    if len(published) == limit:
        os.kill(os.getpid(), signal.SIGKILL)
mirror._publish = killing_publish
from dcr_log._entry import entry
entry()
"""


def test_a_mirror_killed_mid_copy_converges_when_run_again(tmp_path):
    src = tmp_path / "src"
    _log(src, 40)
    log = DeltaLog.open(src)
    write_squash(log, 2, 30)
    write_snapshot(log, 30)
    gc(log, keep_last=8, grace=0)
    start = DeltaLog.open(src).versions()[0]
    dst = tmp_path / "dst"
    # 20 objects in all; a run again publishes only what is missing. Killed with the log start's
    # snapshot copied and no version yet, then after version 33's commit record, then between
    # version 36's segment and its commit record.
    for limit in (3, 5, 5):
        proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_PUBLISHING, str(limit), "mirror", str(src),
                               str(dst)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env(),
                              timeout=120)
        assert proc.returncode == -signal.SIGKILL, (limit, proc.stderr.decode())
    assert len(list((dst / "versions").glob("*.json"))) == 4  # 32..35: mid-copy
    code, out, err = run_cli("mirror", src, dst)
    assert code == 0, err
    theirs = {k: v for k, v in snapshot_files(src).items()}
    ours = snapshot_files(dst)
    assert {k: v for k, v in ours.items() if not Path(k).name.startswith(".")} == theirs
    mirrored = DeltaLog.open(dst)
    assert mirrored.versions() == list(range(start, 40))
    mirrored.verify(deep=True)
    code, out, err = run_cli("mirror", src, dst)
    assert code == 0 and "up to date at version 39" in out


def test_a_mirror_refuses_damage_and_another_log(tmp_path):
    src = tmp_path / "src"
    _log(src, 4)
    dst = tmp_path / "dst"
    mirror(src, dst)
    other = tmp_path / "other"
    _log(other, 2, seed=5)
    with pytest.raises(LineageError):
        mirror(other, dst)
    # A damaged segment at the source: version 4 is not published at the mirror.
    rng = np.random.default_rng(9)
    w = LogWriter.open(src, cache_dir=False)
    w.append({n: change_words(rng, b, 0.3) for n, b in DeltaLog.open(src).materialize(3).items()})
    ref = DeltaLog.open(src).commit(4).segments[0]
    data = bytearray((src / ref.key).read_bytes())
    data[len(data) // 2] ^= 1
    (src / ref.key).write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        mirror(src, dst)
    assert DeltaLog.open(dst).latest_version() == 3
    assert not (dst / ref.key).exists()
    code, out, err = run_cli("mirror", src, dst)
    assert code == 3 and "sha256" in err


def test_mirror_to_s3_and_back(s3_server, tmp_path):
    src = tmp_path / "src"
    states = _log(src, 5)
    url = s3_server.url()
    code, out, err = run_cli("mirror", src, url)
    assert code == 0, err
    back = tmp_path / "back"
    code, out, err = run_cli("mirror", url, back)
    assert code == 0, err
    assert snapshot_files(back) == snapshot_files(src)
    from helpers import assert_same_bits
    assert_same_bits(DeltaLog.open(url).materialize(4), states[4])


def test_cli_mirror_follow_copies_new_versions_and_stops_on_sigterm(tmp_path):
    src = tmp_path / "src"
    states = _log(src, 2)
    dst = tmp_path / "dst"
    from helpers import start_cli
    proc = start_cli("mirror", src, dst, "--follow", "--interval", "0.05")
    try:
        rng = np.random.default_rng(3)
        writer = LogWriter.open(src, cache_dir=False)
        state = states[-1]
        for _ in range(2):
            state = {n: change_words(rng, b, 0.05) for n, b in state.items()}
            writer.append(state)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (dst / "versions" / f"{3:020d}.json").exists():
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.startswith("dcr: interrupted (SIGTERM): mirror ") and err.count("\n") == 1
    assert "at version 3: run dcr mirror again" in err
    assert DeltaLog.open(dst).latest_version() == 3
    assert snapshot_files(dst) == snapshot_files(src)


def test_mirror_reports_each_version_it_holds(tmp_path):
    _log(tmp_path / "src", 4)
    seen: list[int] = []
    mirror(tmp_path / "src", tmp_path / "dst", progress=seen.append)
    assert seen == [0, 1, 2, 3]
    LogWriter.open(tmp_path / "src", cache_dir=False).append(DeltaLog.open(tmp_path / "src").materialize(3))
    seen.clear()
    report = mirror(tmp_path / "src", tmp_path / "dst", progress=seen.append)
    assert seen == [0, 1, 2, 3, 4] and report.versions == 1
