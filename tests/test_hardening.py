"""Hardening (issue #10): every bad input is refused with a typed error before any write,
interrupts say what they left, receivers never write outside their directory, store failures
are one readable line, and the journal's map grows on demand.

Each test here failed on the code before the fix it names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from dcr_log import DeltaLog
from dcr_log.checkpoint import INDEX_NAME
from dcr_log.cli import main
from dcr_log.errors import IntegrityError, StoreError, UsageError
from dcr_log.format import version_key
from dcr_log.format.canonical import seal
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.receiver import Journal, Receiver
from dcr_log.receiver import fs as storage_mod
from dcr_log.receiver import journal as journal_mod
from dcr_log.receiver.batch import BatchWriter
from dcr_log.store import Store
from helpers import assert_file_holds, assert_one_line, cli_env, copy_state, snapshot_files
from test_receiver import build_log


def dcr(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def log_dir(log: DeltaLog) -> Path:
    return Path(log.store.url.removeprefix("file://"))


@pytest.fixture
def receiver_at_2(tmp_path, capsys):
    """A log of 5 versions and a checkpoint-directory receiver at version 2."""
    log, states = build_log(tmp_path / "log")
    rx = tmp_path / "rx"
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 2)
    assert rc == 0, err
    return log, states, rx


def reseal_commit(root: Path, version: int, edit) -> None:
    """Replace a commit record by a validly sealed, edited copy (a forger's or a buggy
    writer's record: it passes the checksum). The state digest follows the edited table."""
    path = root / version_key(version)
    obj = json.loads(path.read_bytes())
    del obj["checksum"]
    edit(obj)
    try:
        table = [TensorInfo(t["name"], t["dtype"], tuple(t["shape"]), int(t["digest"], 16))
                 for t in obj["tensors"]]
        obj["state_digest"] = f"{state_digest(table):016x}"
        obj["stats"]["total_elements"] = sum(int(np.prod(t.shape, dtype=object)) for t in table)
    except Exception:
        pass  # a malformed table: left as the edit made it
    path.write_bytes(seal(obj))


# -- defect 1: every level reads and checks the version before its first write ----------------

def _damage(kind: str, log: DeltaLog, root: Path) -> None:
    ref = log.commit(3).segments[1]
    seg = root / ref.key
    if kind == "missing":
        seg.unlink()
    elif kind == "corrupt":
        data = bytearray(seg.read_bytes())
        data[len(data) // 2] ^= 0x40
        seg.write_bytes(bytes(data))
    elif kind == "foreign":  # a segment of version 4, re-sealed into version 3's record
        other = log.commit(4).segments[0]
        data = (root / other.key).read_bytes()
        seg.write_bytes(data)
        import hashlib

        def edit(obj):
            obj["segments"][1].update(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                      records=other.records)
        reseal_commit(root, 3, edit)


@pytest.mark.parametrize("verify", ["none", "sample", "full"])
@pytest.mark.parametrize("kind", ["missing", "corrupt", "foreign"])
def test_bad_segment_refused_before_any_write_at_every_level(receiver_at_2, capsys, verify, kind):
    log, states, rx = receiver_at_2
    root = log_dir(log)
    _damage(kind, log, root)
    before = snapshot_files(rx)
    rc, out, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", verify)
    assert rc == 3, err
    assert_one_line(err)
    assert snapshot_files(rx) == before  # journal and checkpoint byte for byte
    assert Journal.peek(rx / ".dcr").inflight is None


def test_bad_record_payload_refused_before_any_write(receiver_at_2, capsys):
    """A record whose payload fails to decode (its segment re-hashed into a re-sealed commit
    record) is found by pass 1, at verify none too."""
    import hashlib

    import pyarrow as pa

    log, states, rx = receiver_at_2
    root = log_dir(log)
    ref = log.commit(3).segments[-1]
    table = pa.ipc.open_file(pa.py_buffer((root / ref.key).read_bytes())).read_all()
    payloads = table.column("payload").to_pylist()
    payloads[-1] = payloads[-1][:-1]  # one byte short
    table = table.set_column(table.schema.get_field_index("payload"), table.schema.field("payload"),
                             pa.chunked_array([pa.array(payloads, pa.large_binary())]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    (root / ref.key).write_bytes(data)
    index = len(log.commit(3).segments) - 1
    reseal_commit(root, 3, lambda o: o["segments"][index].update(
        size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", "none")
    assert rc == 3, err
    assert snapshot_files(rx) == before


def test_stats_mismatch_refused_before_any_write(receiver_at_2, capsys):
    log, _, rx = receiver_at_2
    root = log_dir(log)
    reseal_commit(root, 3, lambda o: o["stats"].update(changed_elements=o["stats"]["changed_elements"] + 1))
    before = snapshot_files(rx)
    for verify in ("none", "full"):
        rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", verify)
        assert rc == 3, err
        assert snapshot_files(rx) == before


# -- defect 2: sizes checked before bytes are read ---------------------------------------------

def test_oversized_object_in_place_of_a_segment_is_not_read(tmp_path):
    log, _ = build_log(tmp_path / "log", versions=2)
    ref = log.commit(1).segments[0]
    path = log_dir(log) / ref.key
    with open(path, "r+b") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: reading it whole would take 8 GiB of memory
    t0 = time.perf_counter()
    with pytest.raises(IntegrityError, match="commit says"):
        log.read_segment(ref)
    assert time.perf_counter() - t0 < 2.0


def test_oversized_commit_record_is_not_read(tmp_path):
    store = Store.open(f"memory://big-{os.getpid()}")
    store.put_new("x", b"0123456789")
    with pytest.raises(IntegrityError):
        store.get("x", max_size=4)
    with pytest.raises(IntegrityError):
        store.get("x", size=11)
    assert bytes(store.get("x", size=10)) == b"0123456789"


# -- defect 3: huge shapes ------------------------------------------------------------------------

def test_huge_shape_refused_by_plain_verify_and_apply(receiver_at_2, capsys):
    log, _, rx = receiver_at_2
    root = log_dir(log)
    reseal_commit(root, 3, lambda o: o["tensors"].append(
        {"name": "zz.huge", "dtype": "BF16", "shape": [1 << 40, 1 << 20], "digest": "0" * 16}))
    rc, _, err = dcr(capsys, "verify", root)
    assert rc == 3 and "limit" in err, err
    assert_one_line(err)
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", "none")
    assert rc == 3, err
    assert snapshot_files(rx) == before


def test_shape_larger_than_the_disk_refused_before_any_write(receiver_at_2, capsys):
    """Within the format's limits (2 TiB) but not on this disk: a StoreError, nothing written."""
    log, _, rx = receiver_at_2
    root = log_dir(log)
    reseal_commit(root, 3, lambda o: o["tensors"].append(
        {"name": "zz.big", "dtype": "BF16", "shape": [1 << 30, 1 << 10], "digest": "0" * 16}))
    before = snapshot_files(rx)
    for verify in ("none", "sample", "full"):
        rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", verify)
        assert rc == StoreError.exit_code == 6, err
        assert "no space left" in err
        assert_one_line(err)
        assert snapshot_files(rx) == before


def test_huge_tensor_in_memory_receiver_refused_before_any_write(tmp_path):
    log, states = build_log(tmp_path / "log", versions=3)
    root = log_dir(log)
    reseal_commit(root, 3, lambda o: o["tensors"].append(
        {"name": "zz.big", "dtype": "F64", "shape": [1 << 40, 1 << 4], "digest": "0" * 16}))
    tensors = copy_state(states[2])
    rx = Receiver.open(tensors, tmp_path / "j", layout_changes="own")
    rx.bind(DeltaLog.open(root), 2)
    journal_before = snapshot_files(tmp_path / "j")
    with pytest.raises(StoreError, match="out of memory"):
        rx.apply(DeltaLog.open(root), verify="none")
    rx.close()
    assert snapshot_files(tmp_path / "j") == journal_before
    for name, bits in states[2].items():
        assert np.array_equal(tensors[name].words, bits.words)


# -- defect 4: malformed JSON, wrong types, bad keys --------------------------------------------

@pytest.mark.parametrize("case", ["deep", "list-dtype", "dict-name", "nul-key", "newline-key",
                                  "long-key", "backslash-key", "bool-version"])
def test_malformed_commit_records_are_integrity_errors(tmp_path, capsys, case):
    log, _ = build_log(tmp_path / "log", versions=2)
    root = log_dir(log)
    edits = {
        "deep": lambda o: o.update(writer_id=json.loads("[" * 50000 + "]" * 50000)),
        "list-dtype": lambda o: o["tensors"][0].update(dtype=["BF16"]),
        "dict-name": lambda o: o["tensors"][0].update(name={"a": 1}),
        "nul-key": lambda o: o["segments"][0].update(key="segments/1/a\x00b.arrow"),
        "newline-key": lambda o: o["segments"][0].update(key="segments/1/a\nb.arrow"),
        "long-key": lambda o: o["segments"][0].update(key="segments/1/" + "a" * 5000 + ".arrow"),
        "backslash-key": lambda o: o["segments"][0].update(key="segments/1/a\\b.arrow"),
        "bool-version": lambda o: o.update(format_version=True),
    }
    if case == "deep":  # json.dumps itself recurses: write the bytes by hand
        path = root / version_key(1)
        path.write_bytes(path.read_bytes()[:-1] + b',"x":' + b"[" * 100000 + b"]" * 100000 + b"}")
    else:
        reseal_commit(root, 1, edits[case])
    for args in (("verify", root), ("log", root), ("replay", root, "--out", tmp_path / "o.safetensors")):
        rc, _, err = dcr(capsys, *args)
        assert rc == 3, (args, err)
        assert_one_line(err)
        assert "Error:" not in err and "Traceback" not in err


def test_informative_strings_are_accepted(tmp_path, capsys):
    """created_at and writer_id are informative (section 4, 5): any string within the limit."""
    log, states = build_log(tmp_path / "log", versions=2)
    root = log_dir(log)
    reseal_commit(root, 2, lambda o: o.update(created_at="yesterday", writer_id="trainer #3 (ü)"))
    rc, _, err = dcr(capsys, "verify", root, "--deep")
    assert rc == 0, err
    reseal_commit(root, 2, lambda o: o.update(writer_id="x" * 2000))
    rc, _, err = dcr(capsys, "verify", root)
    assert rc == 3 and "limit" in err


def test_verify_of_a_log_without_versions_is_an_integrity_error(tmp_path, capsys):
    log, _ = build_log(tmp_path / "log", versions=1)
    root = log_dir(log)
    for p in (root / "versions").iterdir():
        p.unlink()
    rc, _, err = dcr(capsys, "verify", root)
    assert rc == 3, err


# -- defect 5: interrupts -------------------------------------------------------------------------

def _kill_self(sig):
    def hook(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises here
        raise AssertionError("signal not delivered")
    return hook


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_append_says_what_is_left(tmp_path, capsys, monkeypatch, sig, code):
    from dcr_log.checkpoint import save_safetensors
    from dcr_log.write import LogWriter

    log, states = build_log(tmp_path / "log", versions=2)
    ckpt = tmp_path / "next.safetensors"
    save_safetensors(states[1], ckpt)
    monkeypatch.setattr(LogWriter, "append", _kill_self(sig))
    rc, out, err = dcr(capsys, "append", log_dir(log), "--from", ckpt, "--cache", "none")
    assert rc == code
    assert err == f"dcr: interrupted ({signal.Signals(sig).name}): version 3 not committed\n"
    assert DeltaLog.open(log_dir(log)).latest_version() == 2


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_apply_says_what_is_left(receiver_at_2, capsys, monkeypatch, sig, code):
    log, states, rx = receiver_at_2
    real = BatchWriter.apply_segment
    calls = []

    def once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            _kill_self(sig)()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(BatchWriter, "apply_segment", once)
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == code
    assert err == f"dcr: interrupted ({signal.Signals(sig).name}): receiver in flight at 3: run dcr apply again\n"
    monkeypatch.setattr(BatchWriter, "apply_segment", real)
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 0, err
    assert_file_holds(rx / "model.safetensors", states[5])


def test_sigterm_of_a_real_process_exits_143(tmp_path):
    """The real path: a subprocess under SIGTERM, waiting in a long command."""
    log, states = build_log(tmp_path / "log", versions=1)
    env = cli_env()
    # A checkpoint big enough that init is still running when the signal comes.
    from dcr_log.checkpoint import save_safetensors
    from dcr_log.state import TensorBits

    rng = np.random.default_rng(0)
    n = 1 << 25
    save_safetensors({"w": TensorBits("BF16", (n // 1024, 1024), rng.integers(0, 1 << 16, n, dtype=np.uint16))},
                     tmp_path / "big.safetensors")
    proc = subprocess.Popen([sys.executable, "-m", "dcr_log", "init", str(tmp_path / "new"), "--from",
                             str(tmp_path / "big.safetensors"), "--cache", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    t0 = time.perf_counter()
    while not (tmp_path / "new" / "dcr.json").exists() and time.perf_counter() - t0 < 60:
        time.sleep(0.005)  # dcr.json is created before version 0 is encoded
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=180)  # generous: the suite shares two cores
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"dcr init did not exit within 180 s of SIGTERM: {err.decode()[-500:]}")
    if proc.returncode == 0:
        pytest.skip("init finished before the signal")
    assert proc.returncode == 143, err
    assert err.decode() == "dcr: interrupted (SIGTERM): version 0 not committed\n"


# -- defect 6: never outside the receiver directory ----------------------------------------------

def test_symlinked_model_file_refused(receiver_at_2, tmp_path, capsys):
    log, states, rx = receiver_at_2
    outside = tmp_path / "outside.safetensors"
    os.replace(rx / "model.safetensors", outside)
    os.symlink(outside, rx / "model.safetensors")
    before, outside_bytes = snapshot_files(rx), outside.read_bytes()
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == UsageError.exit_code, err
    assert "symbolic link" in err
    assert outside.read_bytes() == outside_bytes and snapshot_files(rx) == before


def test_symlinked_model_file_in_a_new_directory_refused(tmp_path, capsys):
    log, states = build_log(tmp_path / "log", versions=1)
    rx = tmp_path / "rx"
    rx.mkdir()
    os.symlink(tmp_path / "elsewhere.safetensors", rx / "model.safetensors")  # dangling
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 2 and "symbolic link" in err, err
    assert not (tmp_path / "elsewhere.safetensors").exists()
    assert sorted(p.name for p in rx.iterdir()) == ["model.safetensors"]


def test_symlinked_journal_refused(receiver_at_2, tmp_path, capsys):
    log, states, rx = receiver_at_2
    os.replace(rx / ".dcr", tmp_path / "journal-outside")
    os.symlink(tmp_path / "journal-outside", rx / ".dcr")
    before = snapshot_files(tmp_path / "journal-outside")
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 2 and "symbolic link" in err, err
    assert snapshot_files(tmp_path / "journal-outside") == before


def test_index_entry_escaping_the_directory_refused(tmp_path, capsys):
    from dcr_log.receiver import write_checkpoint

    log, states = build_log(tmp_path / "log", versions=3)
    rx = tmp_path / "serving" / "rx"
    rx.mkdir(parents=True)
    write_checkpoint(states[2], rx, shard_bytes=500)
    index = json.loads((rx / INDEX_NAME).read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    os.replace(rx / victim, tmp_path / "serving" / "outside.safetensors")
    index["weight_map"] = {k: ("../outside.safetensors" if v == victim else v)
                           for k, v in index["weight_map"].items()}
    (rx / INDEX_NAME).write_text(json.dumps(index))
    outside = (tmp_path / "serving" / "outside.safetensors").read_bytes()
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 3, err
    assert (tmp_path / "serving" / "outside.safetensors").read_bytes() == outside
    assert snapshot_files(rx) == before


# -- defect 7: store failures are typed, one line, before any write where possible ---------------

def test_full_disk_refused_before_materializing(tmp_path, capsys, monkeypatch):
    log, states = build_log(tmp_path / "log", versions=2)
    monkeypatch.setattr(storage_mod, "free_bytes", lambda d: 1000)
    rx = tmp_path / "new" / "rx"
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 6 and "no space left on device" in err, err
    assert_one_line(err)
    assert not (tmp_path / "new").exists()


def test_read_only_store_is_one_readable_line(tmp_path, capsys, monkeypatch):
    from obstore.exceptions import GenericError

    from dcr_log.checkpoint import save_safetensors

    log, states = build_log(tmp_path / "log", versions=1)
    save_safetensors(states[0], tmp_path / "c.safetensors")  # a change: segments are written

    # A local directory: the store's own temporary file and link (Store.create_file).
    import errno
    import os as os_mod

    def link(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(os_mod, "link", link)
    rc, _, err = dcr(capsys, "append", log_dir(log), "--from", tmp_path / "c.safetensors", "--cache", "none")
    assert rc == 6, err
    assert_one_line(err)
    assert "read-only file system" in err and "Debug" not in err
    monkeypatch.undo()
    # Any other store: obstore's error, with its debug dump, becomes one line too.
    from dcr_log.store import _failed
    exc = GenericError("Generic LocalFileSystem error: Unable to open file /x/y#1: Read-only "
                       "file system (os error 30)\n\nDebug source:\nGeneric {\n    store: \"LocalFileSystem\" }")
    message = str(_failed(exc, "write", "s3://b/log", "segments/1/x.arrow"))
    assert "read-only file system" in message and "Debug" not in message and "\n" not in message


def test_journal_errors_are_store_errors(tmp_path):
    exc = journal_mod._lmdb_error(lmdb.DiskError("mdb_txn_commit: No space left on device"), tmp_path, "write")
    assert isinstance(exc, StoreError) and "no space left on device" in str(exc)
    exc = journal_mod._lmdb_error(lmdb.ReadonlyError("mdb_txn_begin: Read-only"), tmp_path, "write")
    assert isinstance(exc, StoreError) and "read-only" in str(exc)


def test_full_disk_during_layout_change_refused_before_any_write(receiver_at_2, capsys, monkeypatch):
    log, states, rx = receiver_at_2
    # Version 3 changes the layout (test_receiver.LAYOUT_VERSION): its files are rewritten.
    monkeypatch.setattr(storage_mod, "free_bytes", lambda d: 2000)
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 3)
    assert rc == 6, err
    assert snapshot_files(rx) == before


# -- defect 8: the journal's map grows on demand ---------------------------------------------------

def test_journal_map_starts_small_and_grows(tmp_path):
    assert journal_mod.MAP_SIZE <= 1 << 26
    j = Journal.open(tmp_path / "j")
    try:
        j.bind("0" * 32, 0, 0)
        image = bytes(range(256)) * ((100 << 20) // 256)  # 100 MiB: more than the first map
        j.stage(0, 0, 1, {0: image})
        assert j.redo_images(0)[0] == image
        assert j._env.info()["map_size"] > journal_mod.MAP_SIZE
    finally:
        j.close()


def test_apply_runs_under_an_address_space_limit(tmp_path):
    log, states = build_log(tmp_path / "log", versions=3)
    rx = tmp_path / "rx"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from dcr_log.cli import main; sys.exit(main(sys.argv[1:]))")
    for to in ("1", "3"):
        proc = subprocess.run([sys.executable, "-c", code, "apply", str(log_dir(log)), "--receiver", str(rx),
                               "--to", to], capture_output=True, env=cli_env(), timeout=120)
        assert proc.returncode == 0, proc.stderr.decode()
    assert_file_holds(rx / "model.safetensors", states[3])


# -- spec gaps (item 10): zstd frame rules, integers, journal progress --------------------------

def test_zstd_frame_rules():
    import zstandard

    from dcr_log.codec.base import zstd_decompress_exact

    body = bytes(range(200))
    good = zstandard.ZstdCompressor(write_content_size=True).compress(body)
    assert zstd_decompress_exact(good, 200).tobytes() == body
    checked = zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(body)
    assert zstd_decompress_exact(checked, 200).tobytes() == body  # a checksum is allowed ...
    bad = bytearray(checked)
    bad[-1] ^= 1
    with pytest.raises(IntegrityError):  # ... and checked
        zstd_decompress_exact(bytes(bad), 200)
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"skip"
    with pytest.raises(IntegrityError, match="magic"):
        zstd_decompress_exact(skippable + good, 200)
    with_dict_id = bytearray(good)
    with_dict_id[4] |= 0x01  # Dictionary_ID_flag 1: a one-byte dictionary id field
    with pytest.raises(IntegrityError, match="dictionary"):
        zstd_decompress_exact(bytes(with_dict_id[:5]) + b"\x00" + bytes(with_dict_id[5:]), 200)
    # A multi-segment frame declaring a 2^28-byte window (exponent 18), content size 200.
    header = b"\x28\xb5\x2f\xfd" + bytes([0x80, 18 << 3]) + (200).to_bytes(4, "little")
    with pytest.raises(IntegrityError, match="window"):
        zstd_decompress_exact(header + good[6:], 200)


def test_integers_of_2_64_and_more_are_refused(tmp_path, capsys):
    log, _ = build_log(tmp_path / "log", versions=1)
    root = log_dir(log)
    reseal_commit(root, 1, lambda o: o["stats"].update(changed_elements=1 << 64))
    rc, _, err = dcr(capsys, "verify", root)
    assert rc == 3 and "2^64" in err, err


def test_journal_progress_outside_the_version_refused(receiver_at_2, capsys):
    log, states, rx = receiver_at_2
    j = Journal.open(rx / ".dcr")
    j.begin(3)
    j.stage(0, 10 ** 6, 10 ** 6, {})
    j.close()
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 3 and "progress" in err, err
    assert snapshot_files(rx) == before


def test_written_checkpoint_files_are_readable_by_others(tmp_path, capsys):
    """Files written atomically keep the old file's mode, else 0644 (not mkstemp's 0600): a
    serving process of another user must be able to load the receiver's checkpoint."""
    from dcr_log.receiver import write_checkpoint

    log, states = build_log(tmp_path / "log", versions=3)
    rx = tmp_path / "rx"
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 1)
    assert rc == 0, err
    assert (rx / "model.safetensors").stat().st_mode & 0o777 == 0o644
    os.chmod(rx / "model.safetensors", 0o640)
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)  # version 3 rewrites the file
    assert rc == 0, err
    assert (rx / "model.safetensors").stat().st_mode & 0o777 == 0o640
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    write_checkpoint(states[1], sharded, shard_bytes=500)
    assert {p.stat().st_mode & 0o777 for p in sharded.iterdir()} == {0o644}


@pytest.mark.parametrize("header", [
    b"[" * 100000 + b"]" * 100000,
    b'{"w":{"dtype":["BF16"],"shape":[2],"data_offsets":[0,4]}}',
    b'{"w":{"dtype":"BF16","shape":["2"],"data_offsets":[0,4]}}',
    b'{"w":{"dtype":"BF16","shape":[2],"data_offsets":["0",4]}}',
    b'{"w":{"dtype":"BF16","shape":[-2],"data_offsets":[0,4]}}',
    b"[1,2]",
])
def test_malformed_safetensors_headers_are_integrity_errors(tmp_path, capsys, header):
    from dcr_log.checkpoint import read_header

    path = tmp_path / "x.safetensors"
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(IntegrityError):
        read_header(path)
    rc, _, err = dcr(capsys, "init", tmp_path / "log", "--from", path, "--cache", "none")
    assert rc == 3, err


@pytest.mark.parametrize("keep", ["half the header", "half the data", "all but one byte"])
def test_a_truncated_safetensors_file_says_it_is_truncated(tmp_path, capsys, keep):
    from dcr_log.checkpoint import read_header, save_safetensors
    from helpers import make_state

    rng = np.random.default_rng(5)
    whole = tmp_path / "whole.safetensors"
    save_safetensors(make_state(rng, {"a": ("BF16", (64,)), "b": ("F32", (33,))}), whole)
    blob = whole.read_bytes()
    n = 8 + int.from_bytes(blob[:8], "little")
    cut = {"half the header": n // 2, "half the data": (n + len(blob)) // 2, "all but one byte": len(blob) - 1}[keep]
    path = tmp_path / "cut.safetensors"
    path.write_bytes(blob[:cut])
    with pytest.raises(IntegrityError, match=f"truncated: .* the file has {cut} "):
        read_header(path)
    rc, _, err = dcr(capsys, "init", tmp_path / "log", "--from", path, "--cache", "none")
    assert rc == 3 and "truncated" in err, err
    assert_one_line(err)


def _misaligned_safetensors(path: Path, a: np.ndarray, b: np.ndarray) -> None:
    """A BF16 tensor of 3 elements, then an F32 one at byte 6 of the data: valid safetensors
    (the format asks no alignment of a tensor's offset) that no writer we use produces."""
    header = json.dumps({"a": {"dtype": "BF16", "shape": [a.size], "data_offsets": [0, a.nbytes]},
                         "b": {"dtype": "F32", "shape": [b.size],
                               "data_offsets": [a.nbytes, a.nbytes + b.nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + a.tobytes() + b.tobytes())


@pytest.mark.parametrize("verify", ["none", "sample", "full"])
def test_a_checkpoint_whose_tensors_are_not_aligned_is_applied_into(tmp_path, capsys, verify):
    """A tensor at an offset that is not a multiple of its width (the C gather and scatter
    take aligned words only: such a file failed with an untyped ValueError) is read, appended
    from and applied into bit for bit."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 1 << 16, 3, dtype=np.uint16)
    b0 = rng.integers(0, 1 << 32, 4000, dtype=np.uint32)
    b1 = b0.copy()
    b1[::40] ^= rng.integers(1, 1 << 32, b1[::40].size, dtype=np.uint32)
    (tmp_path / "v0").mkdir()
    (tmp_path / "v1").mkdir()
    (tmp_path / "rx").mkdir()
    _misaligned_safetensors(tmp_path / "v0" / "model.safetensors", a, b0)
    _misaligned_safetensors(tmp_path / "v1" / "model.safetensors", a, b1)
    _misaligned_safetensors(tmp_path / "rx" / "model.safetensors", a, b0)
    log = tmp_path / "log"
    assert dcr(capsys, "init", log, "--from", tmp_path / "v0", "--cache", "none")[0] == 0
    assert dcr(capsys, "append", log, "--from", tmp_path / "v1", "--cache", "none")[0] == 0
    rc, _, err = dcr(capsys, "apply", log, "--receiver", tmp_path / "rx", "--verify", verify)
    assert rc == 0, err
    assert (tmp_path / "rx" / "model.safetensors").read_bytes() == (tmp_path / "v1" / "model.safetensors").read_bytes()
