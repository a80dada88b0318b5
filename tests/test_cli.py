"""The ``dcr`` command in a subprocess: every command, its output and its exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog
from dcr_log.checkpoint import save_safetensors
from dcr_log.state import TensorBits
from helpers import assert_file_holds, assert_one_line, change_words, copy_state, make_state, run_cli, snapshot_files

# A name with ":fire:" checks that the output prints names as written (no emoji codes).
SPEC = {
    "model.embed_tokens.weight": ("BF16", (64, 16)),
    "model.layers.0.attn:fire:.weight": ("F32", (9, 7)),
    "model.norm.weight": ("F16", (16,)),
    "step": ("I64", ()),
    "mask": ("BOOL", (5, 3)),
    "fp8.scale": ("F8_E5M2", (33,)),
    "empty": ("U16", (0, 4)),
}


def _states() -> list[dict[str, TensorBits]]:
    rng = np.random.default_rng(42)
    s0 = make_state(rng, SPEC)
    s1 = copy_state(s0)
    s1["model.embed_tokens.weight"] = change_words(rng, s0["model.embed_tokens.weight"], 0.05)
    s1["model.norm.weight"] = change_words(rng, s0["model.norm.weight"], 1.0)
    s1["step"] = TensorBits("I64", (), np.array([1], np.uint64))
    s2 = copy_state(s1)
    s2["model.embed_tokens.weight"] = change_words(rng, s1["model.embed_tokens.weight"], 0.01)
    del s2["mask"]
    s2["fp8.scale"] = make_state(rng, {"x": ("F8_E4M3", (3, 11))})["x"]  # retyped and reshaped
    s2["lm_head.weight"] = make_state(rng, {"x": ("BF16", (8, 16))})["x"]
    return [s0, s1, s2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A log of three versions built with ``dcr init`` and ``dcr append``."""
    tmp = tmp_path_factory.mktemp("cli")
    states = _states()
    for v, s in enumerate(states):
        save_safetensors(s, tmp / f"s{v}.safetensors")
    outputs = [run_cli("init", tmp / "log", "--from", tmp / "s0.safetensors")]
    outputs.append(run_cli("append", tmp / "log", "--from", tmp / "s1.safetensors"))
    # Version 2 drops, retypes and adds tensors: refused without the flag, the log unchanged.
    before = snapshot_files(tmp / "log")
    refused = run_cli("append", tmp / "log", "--from", tmp / "s2.safetensors")
    assert refused[0] == 2 and "would change the tensor table" in refused[2], refused
    assert snapshot_files(tmp / "log") == before
    outputs.append(run_cli("append", tmp / "log", "--from", tmp / "s2.safetensors", "--allow-layout-change"))
    return tmp, states, outputs


def test_init_and_append(built):
    tmp, states, outputs = built
    for v, (rc, out, err) in enumerate(outputs):
        assert rc == 0, err
        assert err == ""
        assert out.startswith(f"version {v}:") and out.count("\n") == 1
    assert f"{len(SPEC)} tensors" in outputs[0][1]
    log = DeltaLog.open(tmp / "log")
    assert log.versions() == [0, 1, 2]
    for v, s in enumerate(states):
        assert {t.name for t in log.commit(v).tensors} == set(s)
    assert f"{log.commit(1).stats.changed_elements} changed" in outputs[1][1]


def test_log_json(built):
    tmp, states, _ = built
    rc, out, err = run_cli("log", tmp / "log", "--json")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 3
    log = DeltaLog.open(tmp / "log")
    for v, line in enumerate(lines):
        row = json.loads(line)
        commit = log.commit(v)
        assert row["version"] == v
        assert row["parent"] == (None if v == 0 else v - 1)
        assert row["bytes"] == commit.delta_bytes == sum(s.size for s in commit.segments)
        assert row["changed_elements"] == commit.stats.changed_elements
        assert row["changed_pct"] == pytest.approx(100 * commit.stats.changed_elements / commit.stats.total_elements,
                                                   rel=1e-12)
    total1 = sum(b.words.size for b in states[1].values())
    changed1 = sum(int(np.count_nonzero(states[0][k].words != states[1][k].words)) for k in states[1])
    assert json.loads(lines[1])["changed_elements"] == changed1
    assert json.loads(lines[1])["changed_pct"] == pytest.approx(100 * changed1 / total1, rel=1e-12)
    assert json.loads(lines[0])["changed_pct"] == 100.0


def test_log_table(built):
    tmp, _, _ = built
    rc, out, err = run_cli("log", tmp / "log")
    assert rc == 0, err
    assert "version" in out and "parent" in out
    rows = [line.split() for line in out.splitlines()]
    log = DeltaLog.open(tmp / "log")
    for v in range(3):
        # The row of version v shows its parent and byte count.
        expected = [str(v), "-" if v == 0 else str(v - 1), str(log.commit(v).delta_bytes)]
        assert any(expected == [c for c in row if c not in "│┃|"][:3] for row in rows), (v, out)


def test_show_json(built):
    tmp, states, _ = built
    log = DeltaLog.open(tmp / "log")
    for v in range(3):
        rc, out, err = run_cli("show", tmp / "log", v, "--json")
        assert rc == 0, err
        rows = [json.loads(line) for line in out.splitlines()]
        assert sorted(r["tensor"] for r in rows) == sorted(states[v])  # ":fire:" printed as written
        for r in rows:
            bits = states[v][r["tensor"]]
            assert (r["dtype"], tuple(r["shape"])) == (bits.dtype, bits.shape)
            records = [rec for rec in log.records(v) if rec.tensor == r["tensor"]]
            assert r["records"] == len(records)
            assert r["changed_elements"] == sum(rec.n_changed for rec in records)
            assert r["bytes"] == sum(len(rec.payload) for rec in records)
            assert sum(r["encodings"].values()) == sum(r["kinds"].values()) == r["records"]
        assert sum(r["changed_elements"] for r in rows) == log.commit(v).stats.changed_elements
    # The tensor unchanged between 1 and 2 has no records in version 2.
    rc, out, _ = run_cli("show", tmp / "log", 2, "--json")
    row = next(json.loads(line) for line in out.splitlines() if json.loads(line)["tensor"] == "model.norm.weight")
    assert row["records"] == 0 and row["changed_elements"] == 0


def test_show_table(built):
    tmp, _, _ = built
    rc, out, err = run_cli("show", tmp / "log", 1)
    assert rc == 0, err
    assert "model.layers.0.attn:fire:.weight" in out
    assert "model.norm.weight" in out and "F16" in out


def test_verify(built):
    tmp, _, _ = built
    rc, out, err = run_cli("verify", tmp / "log")
    assert (rc, err) == (0, "")
    assert out.startswith("ok: 3 versions") and "(deep)" not in out
    rc, out, err = run_cli("verify", tmp / "log", "--deep")
    assert (rc, err) == (0, "")
    assert out.startswith("ok: 3 versions") and "(deep)" in out


def test_replay_every_version(built, tmp_path):
    tmp, states, _ = built
    for v, s in enumerate(states):
        rc, out, err = run_cli("replay", tmp / "log", "--version", v, "--out", tmp_path / f"v{v}.safetensors")
        assert rc == 0, err
        assert_file_holds(tmp_path / f"v{v}.safetensors", s)
    rc, out, err = run_cli("replay", tmp / "log", "--out", tmp_path / "latest.safetensors")
    assert rc == 0, err
    assert "version 2" in out
    assert (tmp_path / "latest.safetensors").read_bytes() == (tmp_path / "v2.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.safetensors", "v0.safetensors",
                                                          "v1.safetensors", "v2.safetensors"]


@pytest.mark.parametrize("args", [
    [],
    ["bogus"],
    ["init"],
    ["init", "{log}"],
    ["append", "{log}"],
    ["replay", "{log}"],
    ["show", "{log}"],
    ["show", "{log}", "one"],
    ["log", "{log}", "--nope"],
    ["replay", "{log}", "--version", "x", "--out", "{tmp}/o.safetensors"],
    ["replay", "{log}", "--out", "{tmp}/no/such/dir/o.safetensors"],
], ids=lambda a: " ".join(a) or "no-args")
def test_usage_errors_exit_2(built, tmp_path, args):
    tmp, _, _ = built
    rc, out, err = run_cli(*[a.format(log=tmp / "log", tmp=tmp_path) for a in args])
    assert rc == 2, (out, err)
    assert_one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_init_on_existing_log_exits_5_and_changes_nothing(built):
    tmp, _, _ = built
    before = snapshot_files(tmp / "log")
    rc, out, err = run_cli("init", tmp / "log", "--from", tmp / "s1.safetensors")
    assert rc == 5
    assert_one_line(err)
    assert snapshot_files(tmp / "log") == before


@pytest.mark.parametrize("command", ["show", "replay"])
@pytest.mark.parametrize("version", [3, 99, -1])
def test_missing_version(built, tmp_path, command, version):
    tmp, _, _ = built
    if command == "show":
        rc, out, err = run_cli("show", tmp / "log", "--", version)  # "--": -1 is not an option
    else:
        rc, out, err = run_cli("replay", tmp / "log", "--version", version, "--out", tmp_path / "o.safetensors")
    assert rc != 0 and rc in (2, 3)
    assert_one_line(err)
    assert "version" in err
    assert list(tmp_path.iterdir()) == []


def test_missing_log_and_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    save_safetensors({"x": TensorBits("U8", (2,), np.zeros(2, np.uint8))}, tmp_path / "x.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    cases = [
        (("log", tmp_path / "nowhere"), 2),
        (("verify", tmp_path / "empty"), 2),
        (("append", tmp_path / "empty", "--from", tmp_path / "x.safetensors"), 2),
        (("init", tmp_path / "new", "--from", tmp_path / "missing.safetensors"), 2),
        (("init", tmp_path / "new", "--from", tmp_path / "junk.safetensors"), 3),
        (("init", tmp_path / "new", "--from", tmp_path / "empty"), 2),
    ]
    for args, code in cases:
        rc, out, err = run_cli(*args)
        assert rc == code, (args, out, err)
        assert_one_line(err)
    assert not (tmp_path / "new" / "dcr.json").exists()


def _save_sharded(state: dict[str, TensorBits], folder: Path, shards: list[list[str]]) -> None:
    """A Hugging Face sharded checkpoint: several files and model.safetensors.index.json."""
    folder.mkdir()
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors({n: state[n] for n in names}, folder / fname)
        weight_map.update({n: fname for n in names})
    index = {"metadata": {"total_size": sum(b.nbytes for b in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_checkpoint_directories(tmp_path):
    states = _states()
    names0, names1 = sorted(states[0]), sorted(states[1])
    _save_sharded(states[0], tmp_path / "ckpt0", [names0[:3], names0[3:]])
    _save_sharded(states[1], tmp_path / "ckpt1", [names1[4:], names1[:4]])  # tensors moved between files
    # A directory of .safetensors files without an index is read too.
    (tmp_path / "ckpt2").mkdir()
    names2 = sorted(states[2])
    save_safetensors({n: states[2][n] for n in names2[:2]}, tmp_path / "ckpt2" / "a.safetensors")
    save_safetensors({n: states[2][n] for n in names2[2:]}, tmp_path / "ckpt2" / "b.safetensors")
    rc, _, err = run_cli("init", tmp_path / "log", "--from", tmp_path / "ckpt0")
    assert rc == 0, err
    for v in (1, 2):
        rc, out, err = run_cli("append", tmp_path / "log", "--from", tmp_path / f"ckpt{v}",
                               *(["--allow-layout-change"] if v == 2 else []))
        assert rc == 0, err
    log = DeltaLog.open(tmp_path / "log")
    for v, s in enumerate(states):
        got = log.materialize(v)
        assert sorted(got) == sorted(s)
        assert all(got[k].same_bits(s[k]) for k in s)
    rc, _, err = run_cli("replay", tmp_path / "log", "--version", 1, "--out", tmp_path / "r1.safetensors")
    assert rc == 0, err
    assert_file_holds(tmp_path / "r1.safetensors", states[1])


def test_sharded_index_must_match_files(tmp_path):
    state = _states()[0]
    names = sorted(state)
    _save_sharded(state, tmp_path / "ckpt", [names[:3], names[3:]])
    index_path = tmp_path / "ckpt" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    rc, _, err = run_cli("init", tmp_path / "log", "--from", tmp_path / "ckpt")
    assert rc == 3
    assert_one_line(err)
    shutil.rmtree(tmp_path / "log", ignore_errors=True)
    index_path.write_text("{not json")
    rc, _, err = run_cli("init", tmp_path / "log2", "--from", tmp_path / "ckpt")
    assert rc == 3
    assert_one_line(err)


def test_checkpoint_with_overlapping_tensors_is_refused(tmp_path):
    import json as _json
    import struct

    from dcr_log.checkpoint import load_checkpoint
    from dcr_log.errors import IntegrityError

    header = _json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                          "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}).encode()
    path = tmp_path / "overlap.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04")
    with pytest.raises(IntegrityError, match="share bytes"):
        load_checkpoint(path)
