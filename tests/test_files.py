"""Feature files (spec/FORMAT.md section 22, spec/RECEIVER.md section 9): a version's non-tensor
files travel in the log, hashed in the commit record, and reach receiver directories.

The format's names and limits; the API round trip (LogWriter, DeltaLog.files/read_file, verify);
the CLI carrying a checkpoint directory's files; receiver directories written, updated, bound
and refused byte for byte on a damaged file object; SIGKILL at the file writes followed by a
rerun; and the end-to-end acceptance on MiniLM: `dcr init` from a save_pretrained directory,
`dcr apply` into an empty one, which transformers' AutoModel and AutoTokenizer load bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog, IntegrityError, LogWriter, TensorBits, UsageError
from dcr_log.checkpoint import save_safetensors
from dcr_log.format import CommitRecord, FileEntry, file_name_problem
from dcr_log.format import limits as L
from dcr_log.format.files import parse_files
from dcr_log.receiver import Journal, Receiver, open_directory, write_checkpoint
from dcr_log.receiver.files import TMP_PREFIX
from helpers import (
    assert_file_holds,
    assert_one_line,
    change_words,
    cli_env,
    copy_state,
    make_state,
    minilm_dir,
    run_cli,
    snapshot_files,
)

SPEC = {"w.a": ("BF16", (32, 16)), "w.b": ("F32", (10, 7)), "step": ("I64", ())}

# Each version's files: config.json changes in 1, generation_config.json comes in 1, notes.txt
# goes in 1, vocab.txt changes in 2, tokenizer.json goes in 2; special_tokens_map.json and
# added_tokens.json (same bytes: one object) never change.
FILE_SETS = [
    {"config.json": b'{"hidden_size": 16}\n', "tokenizer.json": b'{"model": {"type": "WordPiece"}}\n',
     "vocab.txt": b"[PAD]\n[UNK]\nthe\n", "notes.txt": b"version 0 only\n",
     "special_tokens_map.json": b"{}\n", "added_tokens.json": b"{}\n"},
    {"config.json": b'{"hidden_size": 16, "vocab_size": 3}\n',
     "tokenizer.json": b'{"model": {"type": "WordPiece"}}\n', "vocab.txt": b"[PAD]\n[UNK]\nthe\n",
     "generation_config.json": b'{"max_length": 20}\n', "special_tokens_map.json": b"{}\n",
     "added_tokens.json": b"{}\n"},
    {"config.json": b'{"hidden_size": 16, "vocab_size": 3}\n', "vocab.txt": b"[PAD]\n[UNK]\nthe\na\n",
     "generation_config.json": b'{"max_length": 20}\n', "special_tokens_map.json": b"{}\n",
     "added_tokens.json": b"{}\n"},
]
EVER_LISTED = set().union(*FILE_SETS)


def _states() -> list[dict[str, TensorBits]]:
    rng = np.random.default_rng(7)
    states = [make_state(rng, SPEC)]
    for v in (1, 2):
        s = {n: change_words(rng, b, 0.05) for n, b in states[-1].items()}
        s["step"] = TensorBits("I64", (), np.array([v], np.uint64))
        states.append(s)
    return states


def build(root: Path) -> tuple[DeltaLog, list[dict[str, TensorBits]]]:
    states = _states()
    writer = LogWriter.create(root, states[0], files=FILE_SETS[0], cache_dir=False)
    for v in (1, 2):
        writer.append(states[v], files=FILE_SETS[v])
    return DeltaLog.open(root), states


@pytest.fixture
def logged(tmp_path):
    return build(tmp_path / "log")


def log_dir(log: DeltaLog) -> Path:
    return Path(log.store.url.removeprefix("file://"))


def object_path(log: DeltaLog, data: bytes) -> Path:
    return log_dir(log) / "files" / hashlib.sha256(data).hexdigest()


def assert_directory_files(rx: Path, version: int, user: dict[str, bytes] | None = None) -> None:
    """``rx`` holds exactly version ``version``'s files, none the log dropped, and the user's."""
    want = FILE_SETS[version]
    for name, data in want.items():
        assert (rx / name).read_bytes() == data, name
    for name in EVER_LISTED - set(want):
        assert not (rx / name).exists(), name
    for name, data in (user or {}).items():
        assert (rx / name).read_bytes() == data, name
    assert not list(rx.glob(f"{TMP_PREFIX}*")), "a temporary file was left behind"


# -- the format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "", "a/b", "a\\b", "../x", ".", "..", ".dcr", ".gitattributes", "model.safetensors",
    "model-00001-of-00002.safetensors", "Model.SafeTensors", "x.SAFETENSORS", "model.safetensors.index.json",
    "MODEL.safetensors.INDEX.json", "tab\tname", "line\nbreak", "nul\x00", "del\x7f", "\ud800",
    "x" * 256, "\u00e9" * 128,
])
def test_refused_file_names(name):
    assert file_name_problem(name) is not None
    with pytest.raises(UsageError):
        FileEntry.of(name, b"")


@pytest.mark.parametrize("name", [
    "config.json", "tokenizer.json", "vocab.txt", "x" * 255, "\u00e9" * 127, "caf\u00e9 notes.md",
    "model.safetensors.bak", "safetensors", "a..b", "-dash", "\U0001f600.txt",
])
def test_accepted_file_names(name):
    assert file_name_problem(name) is None
    assert FileEntry.of(name, b"x").key == "files/" + hashlib.sha256(b"x").hexdigest()


def _entry(fname="config.json", data=b"{}", **over) -> dict:
    e = FileEntry.of(fname, data).to_json()
    e.update(over)
    return e


@pytest.mark.parametrize("value, match", [
    ("config.json", "must be a list"),
    ([{"name": "a", "size": 0}], "exactly key, name, sha256 and size"),
    ([_entry(extra=1)], "exactly key"),
    ([_entry(size=True)], "size must be an integer"),
    ([_entry(size=-1)], "size must be an integer"),
    ([_entry(size=L.MAX_FILE_BYTES + 1)], "limit exceeded"),
    ([_entry(sha256="AB" * 32, key="files/" + "AB" * 32)], "bad sha256"),
    ([_entry(key="files/" + "0" * 64)], "key is not"),
    ([_entry(name="../x")], "refused"),
    ([_entry(), _entry()], "unique and sorted"),
    ([_entry("vocab.txt"), _entry("config.json")], "unique and sorted"),
    ([_entry(f"f{i}", size=0) for i in range(L.MAX_FILES + 1)], "limit exceeded"),
    ([_entry(f"f{i}", size=L.MAX_FILE_BYTES) for i in range(5)], "limit exceeded"),
])
def test_files_member_is_checked(value, match):
    with pytest.raises(IntegrityError, match=match):
        parse_files(value, "commit record 1")


def test_commit_records_carry_files_only_with_the_feature(logged, tmp_path):
    log, _ = logged
    commit = log.commit(1)
    data = commit.to_bytes()
    assert CommitRecord.from_bytes(data, 1) == commit
    obj = json.loads(data)
    assert obj["features"] == ["files", "rans-encoding", "sum-digests"]
    assert [f["name"] for f in obj["files"]] == sorted(FILE_SETS[1], key=str.encode)
    assert all(f["key"] == "files/" + f["sha256"] for f in obj["files"])
    # A log without the feature: commit records as they always were, no files member.
    plain = LogWriter.create(tmp_path / "plain", _states()[0], cache_dir=False)
    record = json.loads(plain.log.commit(0).to_bytes())
    assert "files" not in record and record["features"] == ["rans-encoding", "sum-digests"]
    assert plain.log.files(0) == [] and not plain.log.has_files
    assert not (tmp_path / "plain" / "files").exists()


# -- the API ------------------------------------------------------------------------------------


def test_round_trip_through_the_api(tmp_path):
    states = _states()
    src = tmp_path / "src"
    src.mkdir()
    (src / "vocab.txt").write_bytes(FILE_SETS[0]["vocab.txt"])
    given = {**FILE_SETS[0], "vocab.txt": src / "vocab.txt"}  # bytes or paths
    writer = LogWriter.create(tmp_path / "log", states[0], files=given, cache_dir=False)
    writer.append(states[1], files=FILE_SETS[1])
    objects = sorted(p.name for p in (tmp_path / "log" / "files").iterdir())
    writer.append(states[2])  # None: the parent's files, nothing uploaded
    assert sorted(p.name for p in (tmp_path / "log" / "files").iterdir()) == objects
    log = DeltaLog.open(tmp_path / "log")
    assert log.has_files and log.identity.features == ("files", "rans-encoding", "sum-digests")
    for v, want in enumerate([FILE_SETS[0], FILE_SETS[1], FILE_SETS[1]]):
        entries = log.files(v)
        assert [e.name for e in entries] == sorted(want, key=str.encode)
        assert log.read_files(v) == want
        assert all(e.size == len(want[e.name]) and e.sha256 == hashlib.sha256(want[e.name]).hexdigest()
                   for e in entries)
    # Content-addressed: the same bytes under two names (and in several versions) are one object.
    assert len(objects) == len({d for s in FILE_SETS[:2] for d in s.values()})
    report = log.verify(deep=True)
    assert report.files == len(objects)
    writer.append(states[2], files={})  # a version without files
    assert DeltaLog.open(tmp_path / "log").files(3) == []


def test_damaged_file_objects_are_integrity_errors(logged):
    log, _ = logged
    entry = next(e for e in log.files(1) if e.name == "config.json")
    path = object_path(log, FILE_SETS[1]["config.json"])
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[0] ^= 1
    path.write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match="sha256"):
        log.read_file(entry)
    with pytest.raises(IntegrityError):
        DeltaLog.open(log_dir(log)).verify()
    path.write_bytes(good + b"\n")
    with pytest.raises(IntegrityError, match="bytes"):
        log.read_file(entry)
    path.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        log.read_file(entry)
    path.write_bytes(good)
    assert log.read_file(entry) == good
    DeltaLog.open(log_dir(log)).materialize(1)  # tensors alone do not read files


def test_files_for_a_log_without_the_feature_are_refused_before_any_write(tmp_path):
    states = _states()
    writer = LogWriter.create(tmp_path / "log", states[0], cache_dir=False)  # an older kind of log
    before = snapshot_files(tmp_path / "log")
    with pytest.raises(UsageError, match="without the feature"):
        writer.append(states[1], files={"config.json": b"{}"})
    assert snapshot_files(tmp_path / "log") == before
    writer.append(states[1], files={})  # no files at all is what such a log has
    writer.append(states[2])
    log = DeltaLog.open(tmp_path / "log")
    assert log.versions() == [0, 1, 2] and log.commit(2).files is None


@pytest.mark.parametrize("files, match", [
    ({"../x": b""}, "cannot be logged"),
    ({"model.safetensors": b""}, "cannot be logged"),
    ({".dcr": b""}, "cannot be logged"),
    ({"a.txt": 3}, "expected bytes or a path"),
    ({"a.txt": "/no/such/file"}, "no file"),
])
def test_bad_files_are_refused_before_any_write(tmp_path, files, match):
    states = _states()
    writer = LogWriter.create(tmp_path / "log", states[0], files={}, cache_dir=False)
    before = snapshot_files(tmp_path / "log")
    with pytest.raises(UsageError, match=match):
        writer.append(states[1], files=files)
    assert snapshot_files(tmp_path / "log") == before
    with pytest.raises(UsageError):
        LogWriter.create(tmp_path / "new", states[0], files=files, cache_dir=False)
    assert not (tmp_path / "new" / "dcr.json").exists()  # refused before the log exists


# Two gloo ranks: only the coordinator's files are used (rank 1 passes names that would be
# refused); every rank gets the same commit record.
RANKS = r"""
import json, sys
import numpy as np
import torch.distributed as dist
from dcr_log import TensorBits
from dcr_log.write import Shard, ShardedWriter
rank, port, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
words = np.arange(8, dtype=np.uint32) + rank
shards = {f"w{rank}": [Shard(TensorBits("F32", (8,), words))]}
shapes = {"w0": (8,), "w1": (8,)}
files = {"config.json": b"{}\n"} if rank == 0 else {"../not used": b"x"}
w = ShardedWriter.create(log, shards, shapes, cache_dir=False, files=files)
c = w.append({f"w{rank}": [Shard(TensorBits("F32", (8,), words + 1))]},
             files={"config.json": b"{}\n", "vocab.txt": b"a\n"} if rank == 0 else {"model.safetensors": b""})
print(json.dumps([[e.name for e in w.log.commit(v).files] for v in (0, 1)]))
dist.destroy_process_group()
"""


def test_sharded_writer_uses_the_coordinators_files(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", RANKS, str(r), str(port), str(tmp_path / "log")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out, _ in outs:
        assert json.loads(out.splitlines()[-1]) == [["config.json"], ["config.json", "vocab.txt"]]
    log = DeltaLog.open(tmp_path / "log")
    assert log.read_files(1) == {"config.json": b"{}\n", "vocab.txt": b"a\n"}


# -- the command line ---------------------------------------------------------------------------


def _checkpoint(folder: Path, state, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True)
    save_safetensors(state, folder / "model.safetensors")
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_cli_carries_a_checkpoint_directorys_files(tmp_path):
    states = _states()
    ck0 = _checkpoint(tmp_path / "ck0", states[0], FILE_SETS[0])
    (ck0 / ".hidden").write_text("not carried")
    (ck0 / "1_Pooling").mkdir()
    (ck0 / "1_Pooling" / "config.json").write_text("{}")
    (ck0 / ".git").mkdir()
    rc, out, err = run_cli("init", tmp_path / "log", "--from", ck0)
    # A directory is not carried (a file name has no "/"), and the user is told which.
    assert (rc, err.strip()) == (0, f"dcr: note: directories in {ck0} are not carried (only its top-level "
                                    "files are): 1_Pooling"), err
    assert out.startswith("version 0: 3 tensors") and f"{len(FILE_SETS[0])} files" in out
    ck1 = _checkpoint(tmp_path / "ck1", states[1], FILE_SETS[1])
    rc, out, err = run_cli("append", tmp_path / "log", "--from", ck1)
    assert (rc, err) == (0, ""), err
    save_safetensors(states[2], tmp_path / "s2.safetensors")
    rc, out, err = run_cli("append", tmp_path / "log", "--from", tmp_path / "s2.safetensors")
    assert rc == 0, err  # a single file: the previous version's files are kept
    rc, out, err = run_cli("append", tmp_path / "log", "--from", ck1, "--no-files")
    assert rc == 0, err
    log = DeltaLog.open(tmp_path / "log")
    assert [log.read_files(v) for v in range(4)] == [FILE_SETS[0], FILE_SETS[1], FILE_SETS[1], FILE_SETS[1]]
    for v, state in enumerate([states[0], states[1], states[2], states[1]]):
        got = log.materialize(v)
        assert sorted(got) == sorted(state) and all(got[k].same_bits(state[k]) for k in state)

    rc, out, err = run_cli("show", tmp_path / "log", 1, "--json")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    files = [r for r in rows if "file" in r]
    assert [r["file"] for r in files] == sorted(FILE_SETS[1], key=str.encode)
    assert all(r["size"] == len(FILE_SETS[1][r["file"]]) for r in files)
    rc, out, err = run_cli("show", tmp_path / "log", 1)
    assert rc == 0 and "generation_config.json" in out
    rc, out, err = run_cli("log", tmp_path / "log", "--json")
    assert rc == 0, err
    assert [[f["name"] for f in json.loads(line)["files"]] for line in out.splitlines()][:2] == [
        sorted(FILE_SETS[0], key=str.encode), sorted(FILE_SETS[1], key=str.encode)]
    rc, out, err = run_cli("log", tmp_path / "log")
    assert rc == 0 and "files" in out
    rc, out, err = run_cli("verify", tmp_path / "log")
    assert rc == 0 and "files" in out, (out, err)


def test_cli_feature_switches_and_refusals(tmp_path):
    states = _states()
    ck = _checkpoint(tmp_path / "ck", states[0], {"config.json": b"{}"})
    rc, _, err = run_cli("init", tmp_path / "nofiles", "--from", ck, "--no-files")
    assert rc == 0, err
    assert DeltaLog.open(tmp_path / "nofiles").identity.features == ("rans-encoding", "sum-digests")
    weights = _checkpoint(tmp_path / "weights", states[0], {})
    rc, _, err = run_cli("init", tmp_path / "plain", "--from", weights)
    assert rc == 0, err  # a directory of weights only: no feature, as before
    assert DeltaLog.open(tmp_path / "plain").identity.features == ("rans-encoding", "sum-digests")
    rc, _, err = run_cli("init", tmp_path / "forced", "--from", weights, "--files")
    assert rc == 0, err
    forced = DeltaLog.open(tmp_path / "forced")
    assert forced.has_files and forced.files(0) == []

    # A log without the feature stays appendable from a directory with files (a note says so);
    # asking for files is a usage error that writes nothing.
    ck1 = _checkpoint(tmp_path / "ck1", states[1], {"config.json": b"{}"})
    before = snapshot_files(tmp_path / "plain")
    rc, out, err = run_cli("append", tmp_path / "plain", "--from", ck1, "--files")
    assert rc == 2
    assert_one_line(err)
    assert snapshot_files(tmp_path / "plain") == before
    rc, out, err = run_cli("append", tmp_path / "plain", "--from", ck1)
    assert rc == 0 and out.startswith("version 1:") and "carries no files" in err
    assert DeltaLog.open(tmp_path / "plain").commit(1).files is None

    # A symbolic link among the files is refused, not followed; so is a name the format refuses.
    (tmp_path / "outside.json").write_text("{}")
    (ck1 / "tokenizer.json").symlink_to(tmp_path / "outside.json")
    before = snapshot_files(tmp_path / "forced")
    rc, _, err = run_cli("append", tmp_path / "forced", "--from", ck1)
    assert rc == 2 and "symbolic link" in err
    assert_one_line(err)
    rc, _, err = run_cli("init", tmp_path / "linked", "--from", ck1)
    assert rc == 2 and "symbolic link" in err
    assert not (tmp_path / "linked" / "dcr.json").exists()
    (ck1 / "tokenizer.json").unlink()
    (ck1 / "bad\x01name").write_text("x")
    rc, _, err = run_cli("append", tmp_path / "forced", "--from", ck1)
    assert rc == 2 and "cannot be carried" in err
    assert snapshot_files(tmp_path / "forced") == before
    rc, _, err = run_cli("append", tmp_path / "forced", "--from", ck1, "--no-files")
    assert rc == 0, err


# -- receiver directories -----------------------------------------------------------------------


def test_apply_writes_updates_and_removes_files(tmp_path, logged):
    log, states = logged
    rx = tmp_path / "rx"
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", 0)
    assert rc == 0, err
    assert out.startswith("materialized version 0 into model.safetensors") and "6 files" in out
    assert_directory_files(rx, 0)
    assert Journal.peek(rx / ".dcr").version == 0
    user = {"mine.txt": b"the user's own\n", "README.md": b"local notes\n"}
    for name, data in user.items():
        (rx / name).write_bytes(data)
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", 1)
    assert rc == 0, err
    assert "applied version 1" in out and "2 files written, 1 removed" in out
    assert_directory_files(rx, 1, user)
    assert_file_holds(rx / "model.safetensors", states[1])
    (rx / "vocab.txt").write_bytes(b"edited by hand\n")  # written back: the log's bytes win
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx)
    assert rc == 0, err
    assert_directory_files(rx, 2, user)
    assert_file_holds(rx / "model.safetensors", states[2])
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx)
    assert (rc, out) == (0, "receiver at version 2\n")


def test_binding_a_checkpoint_writes_its_files(tmp_path, logged):
    log, states = logged
    rx = tmp_path / "hf"
    rx.mkdir()
    write_checkpoint(states[1], rx)
    user = {"config.json": b'{"local": true}\n', "notes.txt": b"mine, not the log's\n"}
    for name, data in user.items():
        (rx / name).write_bytes(data)
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", 1)
    assert rc == 0, err
    assert out.startswith(f"bound {rx} to version 1") and "files written" in out
    # Version 1's files are written (its config.json replaces the local one); notes.txt, which
    # the log never wrote here, stays, also when later versions leave it out.
    for name, data in FILE_SETS[1].items():
        assert (rx / name).read_bytes() == data
    assert (rx / "notes.txt").read_bytes() == user["notes.txt"]
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx)
    assert rc == 0, err
    for name, data in FILE_SETS[2].items():
        assert (rx / name).read_bytes() == data
    assert not (rx / "tokenizer.json").exists()  # the log wrote it here, version 2 drops it
    assert (rx / "notes.txt").read_bytes() == user["notes.txt"]


@pytest.mark.parametrize("damage", ["flip", "missing", "longer"])
def test_a_damaged_file_object_is_refused_before_any_write(tmp_path, logged, damage):
    log, _ = logged
    rx = tmp_path / "rx"
    rc, _, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", 0)
    assert rc == 0, err
    path = object_path(log, FILE_SETS[1]["config.json"])  # listed by versions 1 and 2
    good = path.read_bytes()
    if damage == "flip":
        path.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    elif damage == "missing":
        path.unlink()
    else:
        path.write_bytes(good + b" ")
    before = snapshot_files(rx)
    for target in ("1", "2"):
        rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", target)
        assert rc == 3, (out, err)
        assert_one_line(err)
        assert "config.json" in err
        assert snapshot_files(rx) == before  # byte for byte, the journal's files included
    fresh = tmp_path / "fresh"
    rc, _, err = run_cli("apply", log_dir(log), "--receiver", fresh)
    assert rc == 3
    assert not fresh.exists()
    rc, _, _ = run_cli("verify", log_dir(log))
    assert rc == 3


def test_a_link_at_a_files_name_is_refused(tmp_path, logged):
    log, _ = logged
    rx = tmp_path / "rx"
    rc, _, err = run_cli("apply", log_dir(log), "--receiver", rx, "--to", 0)
    assert rc == 0, err
    outside = tmp_path / "outside.json"
    outside.write_bytes(b"keep me\n")
    (rx / "config.json").unlink()
    (rx / "config.json").symlink_to(outside)
    before = {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in rx.iterdir()}
    rc, _, err = run_cli("apply", log_dir(log), "--receiver", rx)
    assert rc == 2 and "symbolic link" in err
    assert_one_line(err)
    assert outside.read_bytes() == b"keep me\n"
    assert {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in rx.iterdir()} == before


def test_memory_receivers_ignore_files(tmp_path, logged):
    log, states = logged
    tensors = copy_state(states[0])
    rx = Receiver.open(tensors, tmp_path / "journal")
    rx.bind(log, 0)
    assert rx.apply(log) == [1, 2]
    assert all(tensors[k].same_bits(states[2][k]) for k in states[2])
    assert rx.journal.files() == []
    rx.close()


def test_a_damaged_journal_file_list_is_refused(tmp_path, logged):
    import lmdb

    log, _ = logged
    rx = tmp_path / "rx"
    with open_directory(log, rx, to=0):
        pass
    env = lmdb.open(str(rx / ".dcr"), subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"files", json.dumps(["../../outside"]).encode())
    env.close()
    before = snapshot_files(rx)
    rc, _, err = run_cli("apply", log_dir(log), "--receiver", rx)
    # The journal's checksum finds the rewritten entry before its file list is parsed.
    assert rc == 3 and "is damaged: its entries do not match their checksum" in err, err
    assert snapshot_files(rx) == before


# SIGKILL at a named point of the file writes (the receiver's fault hook), then `dcr apply` again.
KILL = r"""
import os, signal, sys
from dcr_log import DeltaLog
from dcr_log.receiver import open_directory
log_dir, rx, point, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
seen = [0]
def hook(p, **info):
    if p == point:
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
log = DeltaLog.open(log_dir)
with open_directory(log, rx, fault=hook) as r:
    r.apply(log)
sys.exit(7)  # the point was not reached
"""


@pytest.mark.parametrize("start, point, nth", [
    ("empty", "file_tmp", 2),        # writing version 2 out: a temporary file, not yet renamed
    ("empty", "file", 3),            # writing version 2 out: some files in place
    ("v0", "file_tmp", 1),           # applying version 1
    ("v0", "file", 1),
    ("v0", "file_removed", 1),
    ("v0", "before_commit", 1),      # every file of version 1 written, no joint commit
    ("v0", "file", 3),               # applying version 2: its first file
])
def test_sigkill_during_file_writes_then_rerun(tmp_path, logged, start, point, nth):
    log, states = logged
    rx = tmp_path / "rx"
    user = {"mine.txt": b"the user's own\n"}
    if start == "v0":
        with open_directory(log, rx, to=0):
            pass
        (rx / "mine.txt").write_bytes(user["mine.txt"])
    proc = subprocess.run([sys.executable, "-c", KILL, str(log_dir(log)), str(rx), point, str(nth)],
                          capture_output=True, text=True, env=cli_env(), timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    st = Journal.peek(rx / ".dcr")
    if st.version is not None and st.inflight is None:  # the journal never claims what is not there
        for name, data in FILE_SETS[st.version].items():
            assert (rx / name).read_bytes() == data
        assert_file_holds(rx / "model.safetensors", states[st.version])
    else:
        assert st.inflight is not None or st.materializing is not None
    rc, out, err = run_cli("apply", log_dir(log), "--receiver", rx)
    assert rc == 0, (out, err)
    assert_directory_files(rx, 2, user if start == "v0" else None)
    assert_file_holds(rx / "model.safetensors", states[2])
    st = Journal.peek(rx / ".dcr")
    assert (st.version, st.inflight, st.materializing) == (2, None, None)


# -- MiniLM end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """A MiniLM checkpoint directory written by save_pretrained (model and tokenizer), plus the
    classic vocab.txt and special_tokens_map.json, and the loaded model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch  # noqa: F401
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:  # test dependencies: a missing one is an error, never a skip
        raise ImportError(f"test_files needs torch and transformers: {exc}") from exc
    source = minilm_dir()
    root = tmp_path_factory.mktemp("minilm")
    ckpt = root / "ckpt"
    model = AutoModel.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    for name in ("vocab.txt", "special_tokens_map.json"):
        if not (ckpt / name).exists():
            shutil.copyfile(source / name, ckpt / name)
    return root, ckpt, model, tokenizer


def _bits(state) -> dict:
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return {k: v.detach().contiguous().view(width[v.element_size()]) for k, v in state.items()}


def assert_model_equal(a, b) -> None:
    import torch

    sa, sb = _bits(a.state_dict()), _bits(b.state_dict())
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k


def test_minilm_checkpoint_round_trips_through_the_cli(minilm):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    root, ckpt, model, tokenizer = minilm
    carried = sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.suffix != ".safetensors")
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"} <= set(carried)
    log = root / "log"
    rc, out, err = run_cli("init", log, "--from", ckpt, timeout=600)
    assert rc == 0, err
    assert f"{len(carried)} files" in out
    assert [e.name for e in DeltaLog.open(log).files(0)] == carried

    rx = root / "serving"
    rc, out, err = run_cli("apply", log, "--receiver", rx, timeout=600)
    assert rc == 0, err
    assert sorted(p.name for p in rx.iterdir()) == sorted([".dcr", "model.safetensors", *carried])
    for name in carried:
        assert (rx / name).read_bytes() == (ckpt / name).read_bytes(), name
    loaded = AutoModel.from_pretrained(rx)
    assert_model_equal(loaded, model)
    tok = AutoTokenizer.from_pretrained(rx)
    text = "Delta-compressed refits reach every rollout server."
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]

    # Version 1: a changed config and tokenizer config, a new generation_config.json, a file
    # dropped, and one bias changed by one ulp.
    ckpt1 = root / "ckpt1"
    ckpt1.mkdir()
    weights = load_file(ckpt / "model.safetensors")
    name = sorted(k for k in weights if k.endswith("bias"))[0]
    weights[name] = (weights[name].view(torch.int32) ^ 1).view(torch.float32)
    save_file(weights, ckpt1 / "model.safetensors", metadata={"format": "pt"})
    for f in carried:
        if f != "special_tokens_map.json":
            shutil.copyfile(ckpt / f, ckpt1 / f)
    config = json.loads((ckpt / "config.json").read_text())
    config["layer_norm_eps"] = 1e-6
    (ckpt1 / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tconf = json.loads((ckpt / "tokenizer_config.json").read_text())
    tconf["model_max_length"] = 128
    (ckpt1 / "tokenizer_config.json").write_text(json.dumps(tconf, indent=2) + "\n")
    (ckpt1 / "generation_config.json").write_text('{"max_length": 64}\n')
    (rx / "local-notes.txt").write_text("the server's own file\n")
    rc, out, err = run_cli("append", log, "--from", ckpt1, timeout=600)
    assert rc == 0, err
    rc, out, err = run_cli("apply", log, "--receiver", rx, timeout=600)
    assert rc == 0, err
    assert "applied version 1" in out and "3 files written, 1 removed" in out
    for f in sorted(p.name for p in ckpt1.iterdir() if p.suffix != ".safetensors"):
        assert (rx / f).read_bytes() == (ckpt1 / f).read_bytes(), f
    assert not (rx / "special_tokens_map.json").exists()
    assert (rx / "local-notes.txt").read_text() == "the server's own file\n"
    assert AutoConfig.from_pretrained(rx).layer_norm_eps == 1e-6
    assert AutoTokenizer.from_pretrained(rx).model_max_length == 128
    loaded = AutoModel.from_pretrained(rx)
    expected = {k: v for k, v in load_file(ckpt1 / "model.safetensors").items()}
    got = _bits(loaded.state_dict())
    for k, v in _bits(expected).items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(got[name], _bits(model.state_dict())[name])
