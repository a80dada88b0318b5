"""Signed versions (spec/FORMAT.md, section 21): ed25519 signatures over the SHA-256 of the
commit record's bytes, key rotation, trust policies, and refusal before any write of an
unsigned version, a forged signature, an unknown key or a history rewritten by another writer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog
from dcr_log.cli import main
from dcr_log.errors import TrustError
from dcr_log.format import version_key
from dcr_log.format.canonical import seal
from dcr_log.format.signature import SignatureRecord, parse_signature_key
from dcr_log.receiver import Receiver
from dcr_log.signing import SigningKey, TrustPolicy, public_text
from dcr_log.state import TensorBits
from dcr_log.write import LogWriter
from helpers import assert_one_line, copy_state, snapshot_files

KEY_A = SigningKey.from_seed(bytes(range(32)))
KEY_B = SigningKey.from_seed(bytes(range(32, 64)))
KEY_C = SigningKey.from_seed(bytes(range(64, 96)))


def states(n: int) -> list[dict[str, TensorBits]]:
    rng = np.random.default_rng(7)
    w = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)
    out = []
    for v in range(n):
        w = w.copy()
        w[rng.integers(0, w.size, 40)] ^= 1
        out.append({"w": TensorBits("BF16", (64, 64), w), "step": TensorBits("I64", (), np.array([v], np.uint64))})
    return out


def signed_log(root: Path, n: int = 4, rotate_at: int = 2) -> list[dict[str, TensorBits]]:
    """Versions < rotate_at signed by A, the rest by B (a key rotation)."""
    sts = states(n)
    LogWriter.create(root, sts[0], cache_dir=False, signing_key=KEY_A)
    for v in range(1, n):
        key = KEY_A if v < rotate_at else KEY_B
        LogWriter.open(root, cache_dir=False, signing_key=key).append(sts[v])
    return sts


def dcr(capsys, *args):
    capsys.readouterr()
    rc = main([str(a) for a in args])
    c = capsys.readouterr()
    return rc, c.out, c.err


def trust_file(path: Path, *keys: SigningKey) -> Path:
    path.write_text("".join(f"{public_text(k.public)}  # {k.key_id}\n" for k in keys))
    return path


def sig_objects(root: Path, version: int) -> list[Path]:
    return sorted((root / "signatures" / str(version)).glob("*.sig"))


def test_signed_log_with_rotation_reads_under_a_policy(tmp_path):
    root = tmp_path / "log"
    sts = signed_log(root)
    log = DeltaLog.open(root, trust=TrustPolicy.of([KEY_A, KEY_B]))
    assert log.verify(deep=True).versions == 4
    got = log.materialize(3)
    assert all(np.array_equal(got[n].words, sts[3][n].words) for n in sts[3])
    assert log.check_signed(0) and DeltaLog.open(root).check_signed(3, TrustPolicy.of([KEY_B])) == KEY_B.key_id
    # Each version has exactly one signature object, named by key id and the record's sha256.
    for v in range(4):
        (obj,) = sig_objects(root, v)
        _, kid, sha = parse_signature_key(f"signatures/{v}/{obj.name}")
        assert kid == (KEY_A if v < 2 else KEY_B).key_id
        assert sha == DeltaLog.open(root).commit_sha256(v)
    # Without a policy, signatures are ignored: old readers read signed logs.
    assert DeltaLog.open(root).verify().versions == 4


def test_policy_missing_the_new_key_refuses_rotated_versions(tmp_path):
    root = tmp_path / "log"
    signed_log(root)
    with pytest.raises(TrustError, match="version 2"):
        DeltaLog.open(root, trust=TrustPolicy.of([KEY_A])).verify()
    # Re-signing with A (dcr sign) makes them acceptable to A's policy.
    log = DeltaLog.open(root)
    for v in (2, 3):
        log.sign(v, KEY_A)
    assert DeltaLog.open(root, trust=TrustPolicy.of([KEY_A])).verify().versions == 4


def test_signatures_are_deterministic(tmp_path):
    signed_log(tmp_path / "a")
    sig = KEY_A.sign("0" * 32, 5, "ab" * 32)
    assert sig == KEY_A.sign("0" * 32, 5, "ab" * 32)
    assert SignatureRecord.from_bytes(sig.to_bytes(), sig.key) == sig


def _forge_signature(root: Path, version: int) -> None:
    (obj,) = sig_objects(root, version)
    body = json.loads(obj.read_bytes())
    del body["checksum"]
    sig = bytearray(bytes.fromhex(body["signature"]))
    sig[10] ^= 1
    body["signature"] = bytes(sig).hex()
    obj.write_bytes(seal(body))


def _replace_history(root: Path, tmp_path: Path) -> None:
    """Another writer (no key) rewrites version 3: a valid record, segments and all, which
    passes verify --deep; only the signature tells it apart."""
    sts = signed_log(tmp_path / "twin", n=3)  # the same versions 0..2
    other = tmp_path / "other"
    shutil.copytree(root, other)
    shutil.rmtree(other / "segments" / "3")
    (other / version_key(3)).unlink()
    forged = copy_state(sts[2])
    forged["w"].words[:100] ^= 0x55
    LogWriter.open(other, cache_dir=False).append(forged)
    shutil.rmtree(root / "segments" / "3")
    shutil.copytree(other / "segments" / "3", root / "segments" / "3")
    (root / version_key(3)).write_bytes((other / version_key(3)).read_bytes())
    assert DeltaLog.open(root).verify(deep=True).versions == 4  # the defect: nothing else catches it


@pytest.mark.parametrize("attack", ["unsigned", "forged", "unknown-key", "other-record", "replaced-history"])
def test_attacks_refused_before_any_write(tmp_path, capsys, attack):
    root = tmp_path / "log"
    signed_log(root)
    trust = trust_file(tmp_path / "trust", KEY_A, KEY_B)
    rx = tmp_path / "rx"
    rc, _, err = dcr(capsys, "apply", root, "--receiver", rx, "--to", 2, "--trust", trust)
    assert rc == 0, err
    if attack == "unsigned":
        for p in sig_objects(root, 3):
            p.unlink()
    elif attack == "forged":
        _forge_signature(root, 3)
    elif attack == "unknown-key":
        for p in sig_objects(root, 3):
            p.unlink()
        DeltaLog.open(root).sign(3, KEY_C)
    elif attack == "other-record":  # version 2's valid signature, renamed to sign version 3
        (src,) = sig_objects(root, 2)
        (dst,) = sig_objects(root, 3)
        dst.unlink()
        body = json.loads(src.read_bytes())
        sha3 = DeltaLog.open(root).commit_sha256(3)
        del body["checksum"]
        body.update(version=3, commit_sha256=sha3)
        (root / "signatures" / "3" / f"{body['key_id']}-{sha3}.sig").write_bytes(seal(body))
    elif attack == "replaced-history":
        _replace_history(root, tmp_path)
    before = snapshot_files(rx)
    for args in (("verify", root, "--deep"), ("replay", root, "--out", tmp_path / "o.safetensors"),
                 ("apply", root, "--receiver", rx)):
        rc, _, err = dcr(capsys, *args, "--trust", trust)
        assert rc == TrustError.exit_code == 7, (args, err)
        assert_one_line(err)
        assert "version 3" in err
    assert snapshot_files(rx) == before
    assert not (tmp_path / "o.safetensors").exists()


def test_receiver_api_trust_policy(tmp_path):
    root = tmp_path / "log"
    sts = signed_log(root)
    for p in sig_objects(root, 3):
        p.unlink()
    tensors = copy_state(sts[1])
    rx = Receiver.open(tensors, tmp_path / "j", trust=TrustPolicy.of([KEY_A, KEY_B]))
    log = DeltaLog.open(root)
    rx.bind(log, 1)
    assert rx.apply(log, to=2) == [2]
    with pytest.raises(TrustError):
        rx.apply(log)
    assert rx.version == 2 and rx.inflight is None
    assert np.array_equal(tensors["w"].words, sts[2]["w"].words)
    rx.close()


def test_lost_race_leaves_a_harmless_orphan_signature(tmp_path):
    """A writer signs before it creates the commit record; the loser's signature names bytes
    that are no commit record, and readers ignore it."""
    from dcr_log.errors import CommitConflict

    root = tmp_path / "log"
    sts = signed_log(root, n=2)
    w1 = LogWriter.open(root, cache_dir=False, signing_key=KEY_A)
    w2 = LogWriter.open(root, cache_dir=False, signing_key=KEY_A)
    w1.append(sts[0])
    with pytest.raises(CommitConflict):
        w2.append(sts[1] | {"step": TensorBits("I64", (), np.array([99], np.uint64))})
    assert len(sig_objects(root, 2)) == 2  # the winner's and the loser's
    assert DeltaLog.open(root, trust=TrustPolicy.of([KEY_A])).verify(deep=True).versions == 3


def test_cli_keygen_sign_and_trust(tmp_path, capsys):
    from dcr_log.checkpoint import save_safetensors

    sts = states(3)
    for v, st in enumerate(sts):
        save_safetensors(st, tmp_path / f"v{v}.safetensors")
    rc, out, err = dcr(capsys, "keygen", tmp_path / "k1")
    assert rc == 0 and out.startswith("ed25519:"), err
    assert (tmp_path / "k1").stat().st_mode & 0o777 == 0o600
    rc, _, err = dcr(capsys, "keygen", tmp_path / "k1")
    assert rc == 2  # never overwrites a key
    log = tmp_path / "log"
    assert dcr(capsys, "init", log, "--from", tmp_path / "v0.safetensors", "--cache", "none",
               "--sign", tmp_path / "k1")[0] == 0
    assert dcr(capsys, "append", log, "--from", tmp_path / "v1.safetensors", "--cache", "none")[0] == 0
    rc, _, err = dcr(capsys, "verify", log, "--trust", tmp_path / "k1.pub")
    assert rc == 7 and "version 1" in err
    assert dcr(capsys, "sign", log, "--key", tmp_path / "k1")[0] == 0
    rc, out, err = dcr(capsys, "verify", log, "--trust", tmp_path / "k1.pub")
    assert rc == 0 and "signed" in out, err
    rc, _, err = dcr(capsys, "verify", log, "--trust", tmp_path / "nope.pub")
    assert rc == 2


def test_a_signature_copied_from_another_version_says_so(tmp_path, capsys):
    """A signature file copied into another version's folder under that version's name: the
    same key, so the message names the version it was made for, not "another key"."""
    root = tmp_path / "log"
    signed_log(root, rotate_at=4)  # every version signed by A
    (src,) = sig_objects(root, 1)
    for p in sig_objects(root, 3):
        p.unlink()
    sha3 = DeltaLog.open(root).commit_sha256(3)
    (root / "signatures" / "3" / f"{KEY_A.key_id}-{sha3}.sig").write_bytes(src.read_bytes())
    rc, _, err = dcr(capsys, "verify", root, "--trust", trust_file(tmp_path / "trust", KEY_A))
    assert rc == TrustError.exit_code, err
    assert_one_line(err)
    assert "made for version 1, not 3" in err and "copied from another version" in err
    assert "another key" not in err and "by key" not in err
