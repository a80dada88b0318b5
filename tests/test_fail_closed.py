"""Receivers fail closed: a version the log cannot back is refused before the first write (the
in-flight marker included) at every verification level but none, and never committed with
other bits than the log's (spec/RECEIVER.md sections 5.2 and 6)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog
from dcr_log.codec import ChangeSet, decode_changes, get_encoding
from dcr_log.coords import Box, tiles, word_dtype
from dcr_log.errors import IntegrityError
from dcr_log.format import version_key
from dcr_log.format.canonical import seal
from dcr_log.format.segment import encode_segment, iter_segment
from dcr_log.receiver import Receiver, open_directory
from dcr_log.receiver.checks import sampled as _sampled
from helpers import assert_one_line, copy_state, snapshot_files
from test_hardening import dcr, log_dir, reseal_commit
from test_receiver import LAYOUT_VERSION, build_log


def reencode_value(root: Path, version: int, kind: str) -> str:
    """Change one value of the first ``kind`` record of ``version`` that verify=sample does not
    sample (so that only the every-record check finds it), encoded again with its own
    encoding; the segment's sha256 and the commit record re-sealed (a valid log, except for
    that record's digests). Returns the record's tensor."""
    log_id = json.loads((root / "dcr.json").read_bytes())["log_id"]
    path = root / version_key(version)
    commit = json.loads(path.read_bytes())
    dtypes = {t["name"]: t["dtype"] for t in commit["tensors"]}
    for index, ref in enumerate(commit["segments"]):
        seg = root / ref["key"]
        records = list(iter_segment(seg.read_bytes(), log_id, version))
        for j, rec in enumerate(records):
            if rec.kind != kind or rec.n_changed == 0 or _sampled(version, index, j):
                continue
            changes = decode_changes(rec.kind, rec.encoding, rec.params, bytes(rec.payload),
                                     rec.box.size, rec.n_changed, word_dtype(dtypes[rec.tensor]))
            values = np.array(changes.values, copy=True)
            values[0] = values[0] + 1 if changes.relative and values[0] != -1 else values[0] ^ 2
            if values[0] == 0:
                values[0] = 4
            params, payload = get_encoding(rec.encoding).encode(
                rec.kind, ChangeSet(changes.n, changes.positions, values, changes.relative))
            records[j] = replace(rec, params=params, payload=payload)
            data = encode_segment(records, log_id, version)
            seg.write_bytes(data)
            obj = json.loads(path.read_bytes())
            del obj["checksum"]
            for r in obj["segments"]:
                if r["key"] == ref["key"]:
                    r.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
            path.write_bytes(seal(obj))
            return rec.tensor
    raise AssertionError(f"version {version} has no {kind} record")


@pytest.mark.parametrize("verify", ["sample", "full"])
@pytest.mark.parametrize("kind", ["tensor", "xor", "overwrite"])
def test_a_reencoded_record_is_refused_before_any_write(tmp_path, capsys, kind, verify):
    """Every record's target is checked in pass 1 at sample too (it was only sampled, so a
    tensor record with one wrong value was committed at the default level)."""
    log, states = build_log(tmp_path / "log", versions=5)
    root = log_dir(log)
    version = {"tensor": LAYOUT_VERSION, "xor": 4, "overwrite": 2}[kind]
    rx = tmp_path / "rx"
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--to", version - 1)
    assert rc == 0, err
    reencode_value(root, version, kind)
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", verify)
    assert rc == IntegrityError.exit_code, err
    assert_one_line(err)
    assert "target digest" in err
    after = snapshot_files(rx)
    assert {k for k in after if after.get(k) != before.get(k)} <= {".dcr/lock.mdb"}
    rc, out, _ = dcr(capsys, "status", "--receiver", rx, "--json")
    row = json.loads(out)
    assert row["version"] == version - 1 and row["inflight"] is None


def test_a_tensor_added_without_records_is_refused_before_any_write(tmp_path):
    """A new tensor's digest is checked before the first write: its tensor records' targets
    plus the zeros of the elements they leave uncovered (it used to pass pass 1 even at full,
    rewrite the layout, fail its final check and stay in flight for good)."""
    log, states = build_log(tmp_path / "log", versions=3)
    root = log_dir(log)
    reseal_commit(root, 3, lambda o: o["tensors"].append(
        {"name": "zz.added", "dtype": "BF16", "shape": [4, 4], "digest": "0123456789abcdef"}))
    rx = tmp_path / "rx"
    open_directory(DeltaLog.open(root), rx, to=2).close()
    before = snapshot_files(rx)
    for verify in ("sample", "full"):
        with open_directory(DeltaLog.open(root), rx) as receiver:
            with pytest.raises(IntegrityError, match="digest of 'zz.added' to version 3's"):
                receiver.apply(DeltaLog.open(root), verify=verify)
            assert receiver.inflight is None and receiver.version == 2
        after = snapshot_files(rx)
        assert {k for k in after if after.get(k) != before.get(k)} <= {".dcr/lock.mdb"}


def test_a_table_digest_the_records_do_not_lead_to_is_refused_before_any_write(tmp_path):
    """With sum digests, the records must lead from the parent's tensor digests to the
    version's (composition, O(records)): a kept tensor whose table digest is wrong is found
    in pass 1, not by the sampled whole-tensor check after the writes."""
    log, states = build_log(tmp_path / "log", versions=4)
    root = log_dir(log)

    def edit(o):
        t = next(t for t in o["tensors"] if t["name"] == "w.a")
        t["digest"] = f"{int(t['digest'], 16) ^ 1:016x}"

    reseal_commit(root, 4, edit)
    tensors = copy_state(states[3])
    rx = Receiver.open(tensors, tmp_path / "j")
    rx.bind(DeltaLog.open(root), 3)
    journal = snapshot_files(tmp_path / "j")
    for verify in ("sample", "full"):
        with pytest.raises(IntegrityError, match="do not lead from version 3's digest of 'w.a'"):
            rx.apply(DeltaLog.open(root), verify=verify)
        assert snapshot_files(tmp_path / "j") == journal
        assert all(np.array_equal(tensors[n].words, b.words) for n, b in states[3].items())
    rx.close()


def test_a_broken_parent_chain_is_damage_in_the_log(tmp_path, capsys):
    """A commit whose parent digest is not its parent's state digest: exit 3 (integrity),
    not 4 (the receiver's lineage)."""
    log, _ = build_log(tmp_path / "log", versions=3)
    root = log_dir(log)
    rx = tmp_path / "rx"
    assert dcr(capsys, "apply", root, "--receiver", rx, "--to", 2)[0] == 0
    reseal_commit(root, 3, lambda o: o.update(parent_state_digest="0" * 16))
    before = snapshot_files(rx)
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx)
    assert rc == IntegrityError.exit_code, err
    assert "parent digest does not match version 2" in err
    assert snapshot_files(rx) == before


def test_tiles():
    shape = (6, 4)
    rows = [Box((0, 0), (2, 4)), Box((2, 0), (4, 4))]
    assert tiles(rows, shape)
    assert not tiles(rows[:1], shape)
    assert not tiles([rows[0], rows[0], Box((2, 0), (2, 4))], shape)  # sizes add up, overlap
    quads = [Box((0, 0), (3, 2)), Box((0, 2), (3, 2)), Box((3, 0), (3, 2)), Box((3, 2), (3, 2))]
    assert tiles(quads, shape)
    assert not tiles(quads[:3] + [Box((2, 2), (3, 2))], shape)  # a gap and an overlap
    assert tiles([], (0, 3)) and not tiles([], (1,))
    assert tiles([Box((), ())], ()) and tiles([Box((0, 0), (0, 4)), *rows], shape)


def test_a_live_model_is_never_half_changed_by_a_table_change(tmp_path):
    """A torch receiver on ``dict(model.named_parameters())`` over a version that changes the
    tensor table (another model appended by mistake): LayoutError before any write; the
    caller's dict keeps its keys and every parameter its object, dtype, shape and bits."""
    torch = pytest.importorskip("torch")
    from dcr_log.errors import LayoutError
    from dcr_log.state import to_bits
    from dcr_log.write import LogWriter

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    first = {n: to_bits(p.detach()) for n, p in model.named_parameters()}
    other = torch.nn.Sequential(torch.nn.Linear(8, 6)).to(torch.float32)
    writer = LogWriter.create(tmp_path / "log", first, cache_dir=False)
    writer.append({n: to_bits(p.detach()) for n, p in other.named_parameters()}, allow_layout_change=True)
    params = dict(model.named_parameters())
    before = {n: (p, p.dtype, tuple(p.shape), p.detach().view(torch.int16).clone()) for n, p in params.items()}
    log = DeltaLog.open(tmp_path / "log")
    with Receiver.open(params, tmp_path / "j") as rx:
        rx.bind(log, 0)
        journal = snapshot_files(tmp_path / "j")
        for verify in ("none", "sample", "full"):
            with pytest.raises(LayoutError, match="changes the tensor table .*layout_changes='own'"):
                rx.apply(log, verify=verify)
            assert rx.version == 0 and rx.inflight is None
            assert snapshot_files(tmp_path / "j") == journal
    assert params.keys() == before.keys()
    for name, (obj, dtype, shape, words) in before.items():
        assert params[name] is obj and obj.dtype == dtype and tuple(obj.shape) == shape
        assert torch.equal(obj.detach().view(torch.int16), words)
    model(torch.zeros(2, 8, dtype=torch.bfloat16))  # still a working model
    # Opened as the owner of the mapping, the same receiver follows the change.
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}
    with Receiver.open(mine, tmp_path / "j2", layout_changes="own") as rx:
        rx.bind(log, 0)
        rx.apply(log)
        assert rx.version == 1 and set(mine) == {n for n, _ in other.named_parameters()}


def test_a_hardlinked_weight_file_is_refused_before_any_write(tmp_path, capsys):
    log, states = build_log(tmp_path / "log", versions=3)
    root = log_dir(log)
    rx = tmp_path / "rx"
    assert dcr(capsys, "apply", root, "--receiver", rx, "--to", 1)[0] == 0
    outside = tmp_path / "elsewhere.safetensors"
    outside.hardlink_to(rx / "model.safetensors")
    before, kept = snapshot_files(rx), outside.read_bytes()
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx)
    assert rc == 2 and "2 hard links" in err, err
    assert_one_line(err)
    assert snapshot_files(rx) == before and outside.read_bytes() == kept
    # Without a journal (binding an existing checkpoint): refused before .dcr is created.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "model.safetensors").hardlink_to(outside)
    rc, _, err = dcr(capsys, "apply", root, "--receiver", fresh)
    assert rc == 2 and "hard links" in err, err
    assert not (fresh / ".dcr").exists()


def test_apply_to_a_missing_version_creates_nothing(tmp_path, capsys):
    log, states = build_log(tmp_path / "log", versions=2)
    root = log_dir(log)
    rx = tmp_path / "rx"
    assert dcr(capsys, "apply", root, "--receiver", rx, "--to", 1)[0] == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("model.safetensors",):
        (bare / name).write_bytes((rx / name).read_bytes())
    rc, _, err = dcr(capsys, "apply", root, "--receiver", bare, "--to", 999)
    assert rc == 2 and "no version 999 (latest is 2)" in err, err
    assert sorted(p.name for p in bare.iterdir()) == ["model.safetensors"]


def test_every_error_class_is_exported():
    """What the errors say to catch can be imported from dcr_log (the README names them)."""
    import inspect

    import dcr_log
    from dcr_log import errors

    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.DcrError)}
    assert classes <= set(dcr_log.__all__)
    assert all(getattr(dcr_log, n) is getattr(errors, n) for n in classes)


def test_a_wrong_base_digest_in_the_log_is_damage_in_the_log(tmp_path, capsys):
    """A record whose base digest the log's own tensor tables contradict: exit 3 (the log),
    not 4 ("changed behind the journal's back"), before any write."""
    log, _ = build_log(tmp_path / "log", versions=4)
    root = log_dir(log)
    rx = tmp_path / "rx"
    assert dcr(capsys, "apply", root, "--receiver", rx, "--to", 3)[0] == 0
    log_id = json.loads((root / "dcr.json").read_bytes())["log_id"]
    path = root / version_key(4)
    commit = json.loads(path.read_bytes())
    ref = commit["segments"][0]
    records = list(iter_segment((root / ref["key"]).read_bytes(), log_id, 4))
    j = next(j for j, r in enumerate(records) if r.kind == "xor")
    records[j] = replace(records[j], base_digest=records[j].base_digest ^ 1)
    data = encode_segment(records, log_id, 4)
    (root / ref["key"]).write_bytes(data)
    del commit["checksum"]
    commit["segments"][0].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_bytes(seal(commit))
    before = snapshot_files(rx)
    for verify in ("sample", "full"):
        rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--verify", verify)
        assert rc == IntegrityError.exit_code, err
        assert "do not lead from version 3's digest" in err
        assert snapshot_files(rx) == before
