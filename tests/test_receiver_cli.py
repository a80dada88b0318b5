"""``dcr apply`` and ``dcr status`` on checkpoint directories: materialize, bind, catch up,
--to, sharded checkpoints, and wrong lineages refused with exit 4 and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog
from dcr_log.checkpoint import INDEX_NAME, checkpoint_files, load_checkpoint, read_header
from dcr_log.cli import main
from dcr_log.receiver import Journal, write_checkpoint
from dcr_log.receiver import directory as receiver_directory
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import (
    assert_file_holds,
    assert_one_line,
    assert_same_bits,
    change_words,
    make_state,
    run_cli,
    snapshot_files,
)
from test_receiver import LAYOUT_VERSION, build_log


@pytest.fixture
def logged(tmp_path):
    return build_log(tmp_path / "log")


def dcr(capsys, *args) -> tuple[int, str, str]:
    """The CLI in this process (fast); returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def status(capsys, receiver: Path) -> dict:
    rc, out, _ = dcr(capsys, "status", "--receiver", receiver, "--json")
    assert rc == 0
    return json.loads(out)


def log_dir(log: DeltaLog) -> Path:
    return Path(log.store.url.removeprefix("file://"))


def test_apply_materializes_a_missing_directory_then_catches_up(tmp_path, logged, capsys):
    log, states = logged
    rx = tmp_path / "serving" / "model"
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 2)
    assert rc == 0, err
    assert out.startswith("materialized version 2 into model.safetensors") and out.count("\n") == 1
    assert sorted(p.name for p in rx.iterdir()) == [".dcr", "model.safetensors"]
    assert_file_holds(rx / "model.safetensors", states[2])
    assert read_header(rx / "model.safetensors")  # a plain safetensors file
    row = status(capsys, rx)
    assert row == {"receiver": str(rx), "log_id": log.log_id, "version": 2,
                   "state_digest": f"{log.commit(2).state_digest:016x}", "inflight": None,
                   "inflight_kind": None, "inflight_from": None, "materializing": None, "unsynced": None}

    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 4, "--verify", "full")
    assert rc == 0, err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["applied version 3", "applied version 4"]
    assert_file_holds(rx / "model.safetensors", states[4])
    rc, out, _ = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--verify", "none")
    assert rc == 0 and out.startswith("applied version 5") and out.count("\n") == 1
    assert_file_holds(rx / "model.safetensors", states[5])
    rc, out, _ = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 0 and out == "receiver at version 5\n"
    rc, out, _ = dcr(capsys, "status", "--receiver", rx)
    assert rc == 0 and "version        5" in out and "inflight       -" in out
    # Versions 3-5 are in the journal until the files are synced; this boot wrote them.
    assert "unsynced       in the page cache" in out
    assert status(capsys, rx)["unsynced"] == "in the page cache"


def test_apply_binds_an_existing_checkpoint(tmp_path, logged, capsys):
    log, states = logged
    rx = tmp_path / "hf"
    rx.mkdir()
    (rx / "config.json").write_text("{}")
    write_checkpoint(states[3], rx)
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 4)
    assert rc == 0, err
    assert out.splitlines()[0] == f"bound {rx} to version 3 of log {log.log_id}"
    assert out.splitlines()[1].startswith("applied version 4")
    assert_file_holds(rx / "model.safetensors", states[4])
    assert (rx / "config.json").read_text() == "{}"


def test_sharded_checkpoint_materialized_and_updated(tmp_path, logged, capsys, monkeypatch):
    log, states = logged
    monkeypatch.setattr(receiver_directory, "SHARD_BYTES", 2000)
    rx = tmp_path / "sharded"
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 1)
    assert rc == 0, err
    index = json.loads((rx / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    home = dict(index["weight_map"])
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--verify", "full")
    assert rc == 0, err
    assert len(out.splitlines()) == 4
    assert_same_bits(load_checkpoint(rx), states[5])  # the index agrees with the files
    index = json.loads((rx / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(states[5])
    assert index["metadata"]["total_size"] == sum(b.nbytes for b in states[5].values())
    for name, file in index["weight_map"].items():
        if name in home:
            assert file == home[name]  # tensors never move between files
        assert checkpoint_files(rx)[name].file.name == file


def test_interrupted_materialization_is_redone(tmp_path, logged, capsys):
    log, states = logged
    rx = tmp_path / "rx"
    rx.mkdir()
    journal = Journal.open(rx / ".dcr")
    journal.begin_materialize(log.log_id, 2)
    journal.close()
    (rx / "model.safetensors").write_bytes(b"\x10\x00\x00\x00")  # a torn write of ours
    (rx / ".model.safetensors.abc.tmp").write_bytes(b"junk")
    rc, out, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx)
    assert rc == 0, err
    assert out.splitlines()[0].startswith("materialized version 2")
    assert [line.split(":")[0] for line in out.splitlines()[1:]] == [f"applied version {v}" for v in (3, 4, 5)]
    assert sorted(p.name for p in rx.iterdir()) == [".dcr", "model.safetensors"]
    assert_file_holds(rx / "model.safetensors", states[5])


# -- wrong lineage: exit 4, nothing written ------------------------------------------------

def _fork(log: DeltaLog, states, root: Path, keep: int) -> DeltaLog:
    """A copy of ``log`` (same id) with versions after ``keep`` replaced by other states."""
    shutil.copytree(log_dir(log), root)
    for v in log.versions():
        if v > keep:
            (root / "versions" / f"{v:020d}.json").unlink()
            shutil.rmtree(root / "segments" / str(v), ignore_errors=True)
    writer = LogWriter.open(root, policy=EncodePolicy(chunk_elements=64))
    rng = np.random.default_rng(77)
    for _ in range(2):
        writer.append({k: change_words(rng, b, 0.1) for k, b in states[keep].items()})
    return DeltaLog.open(root)


def _flip_tensor_bytes(directory: Path, every: bool) -> None:
    """Change the checkpoint behind the journal's back: one bit, or every tensor byte."""
    locations = checkpoint_files(directory)
    for _name, loc in sorted(locations.items()):
        if loc.end == loc.start:
            continue
        with open(loc.file, "r+b") as f:
            f.seek(loc.start)
            data = bytearray(f.read(loc.end - loc.start))
            if every:
                data = bytearray(b ^ 0xFF for b in data)
            else:
                data[len(data) // 2] ^= 0x01
            f.seek(loc.start)
            f.write(data)
        if not every:
            return


@pytest.mark.parametrize("case", ["foreign", "fork", "ahead", "no_version", "tampered_full", "tampered_sample"])
def test_wrong_lineage_exits_4_and_writes_nothing(tmp_path, logged, capsys, case):
    log, states = logged
    rx = tmp_path / "rx"
    target = log
    verify = "sample"
    if case == "no_version":
        rx.mkdir()
        write_checkpoint(make_state(np.random.default_rng(5), {"w.a": ("BF16", (64, 48))}), rx)
    else:
        assert dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 3)[0] == 0
    if case == "foreign":
        target = build_log(tmp_path / "foreign")[0]
    elif case == "fork":
        target = _fork(log, states, tmp_path / "fork", keep=2)
        assert target.log_id == log.log_id and target.latest_version() == 4
    elif case == "ahead":
        shutil.copytree(log_dir(log), tmp_path / "short")  # the same log, seen before version 3
        for v in (3, 4, 5):
            (tmp_path / "short" / "versions" / f"{v:020d}.json").unlink()
        target = DeltaLog.open(tmp_path / "short")
    elif case.startswith("tampered"):
        _flip_tensor_bytes(rx, every=case == "tampered_sample")
        verify = "full" if case == "tampered_full" else "sample"
    before = snapshot_files(rx)
    rc, out, err = run_cli("apply", log_dir(target), "--receiver", rx, "--verify", verify)
    assert rc == 4, (out, err)
    assert_one_line(err)
    assert snapshot_files(rx) == before
    if case == "no_version":
        assert not (rx / ".dcr").exists()


def test_usage_errors(tmp_path, logged, capsys):
    log, _ = logged
    rx = tmp_path / "rx"
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--verify", "most")
    assert rc == 2 and not rx.exists()
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 9)
    assert rc == 2 and not (rx / "model.safetensors").exists()
    assert dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 3)[0] == 0
    rc, _, err = dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", 2)
    assert rc == 2 and "cannot go back" in err
    rc, _, err = dcr(capsys, "status", "--receiver", tmp_path / "nothing")
    assert rc == 2 and "no receiver journal" in err


def test_layout_changes_keep_the_directory_loadable(tmp_path, logged, capsys):
    log, states = logged
    rx = tmp_path / "rx"
    assert dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", LAYOUT_VERSION - 1)[0] == 0
    assert dcr(capsys, "apply", log_dir(log), "--receiver", rx, "--to", LAYOUT_VERSION)[0] == 0
    assert_file_holds(rx / "model.safetensors", states[LAYOUT_VERSION])
    import torch  # noqa: F401  (safetensors' torch loader: what a serving process uses)
    from safetensors.torch import load_file

    loaded = load_file(rx / "model.safetensors")
    assert sorted(loaded) == sorted(states[LAYOUT_VERSION])
