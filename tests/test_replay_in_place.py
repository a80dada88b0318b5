"""Replay decodes a dense tensor record of a tensor its step creates straight into the tensor's
words (replay._decode_in_place: a dense version's every record, a snapshot's, a new tensor's),
and checks its target digest on the words written; every other record goes through
apply_to_words as before."""

from __future__ import annotations

import numpy as np
import pytest

from dcr_log.codec.dense import DenseEncoding
from dcr_log.errors import IntegrityError
from dcr_log.log import DeltaLog
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import assert_same_bits, change_words, copy_state, make_state

SPEC = {"a": ("BF16", (300, 257)), "b": ("F32", (1000,)), "c": ("U8", (7, 5)), "d": ("I64", ()),
        "e": ("F16", (0, 4)), "f": ("F64", (3, 4, 5))}


def _spy(monkeypatch) -> list[int]:
    """The sizes of the boxes decode_tensor_into decoded in place, in order."""
    seen: list[int] = []
    real = DenseEncoding.decode_tensor_into

    def decode_tensor_into(self, params, payload, out):
        seen.append(out.size)
        return real(self, params, payload, out)

    monkeypatch.setattr(DenseEncoding, "decode_tensor_into", decode_tensor_into)
    return seen


def _state(seed: int) -> dict:
    """SPEC's tensors, words of few values (so zstd wins: dense records) but for "a", whose
    first half is random (raw records beside dense ones)."""
    state = make_state(np.random.default_rng(seed), SPEC)
    rng = np.random.default_rng(seed + 100)
    for name, bits in state.items():
        small = rng.integers(0, 3, bits.words.size).astype(bits.words.dtype)
        if name == "a":
            small[: small.size // 2] = bits.words[: small.size // 2]
        bits.words[:] = small
    return state


def _dense_tensor_records(log: DeltaLog, version: int) -> list:
    return [r for r in log.records(version) if r.kind == "tensor" and r.encoding == DenseEncoding.name]


def test_a_dense_version_is_decoded_in_place(tmp_path, monkeypatch):
    """Every dense tensor record of version 0 is decoded into its tensor's words, none into an
    array of values first; the state is the logged one, bit for bit (every dtype width, a 0-d
    tensor, an empty one, records of part of a tensor)."""
    state = _state(3)
    LogWriter.create(tmp_path / "log", state, cache_dir=False, policy=EncodePolicy(chunk_elements=4096)).close()
    log = DeltaLog.open(tmp_path / "log")
    records = _dense_tensor_records(log, 0)
    # (The tiny tensors' records are raw, as is the random half of "a"'s: zstd does not win.)
    assert {r.tensor for r in records} >= {"a", "b", "f"}
    assert any(r.tensor == "a" and r.encoding != DenseEncoding.name for r in log.records(0))
    seen = _spy(monkeypatch)
    decoded: list[str] = []
    real_decode = DenseEncoding.decode

    def decode(self, kind, *args):
        decoded.append(kind)
        return real_decode(self, kind, *args)

    monkeypatch.setattr(DenseEncoding, "decode", decode)
    assert_same_bits(log.materialize(0), state)
    assert sorted(seen) == sorted(r.box.size for r in records)
    assert "tensor" not in decoded


def test_a_version_that_adds_a_tensor_decodes_its_record_in_place(tmp_path, monkeypatch):
    """A version that adds a tensor (and changes a kept one whole): the new tensor's dense
    record is decoded in place, the kept one's records as before; both end as logged."""
    rng = np.random.default_rng(4)
    state = _state(4)
    writer = LogWriter.create(tmp_path / "log", state, cache_dir=False)
    new = copy_state(state)
    new["b"] = change_words(rng, state["b"], 1.0)
    new["g"] = make_state(rng, {"g": ("BF16", (64, 64))})["g"]
    new["g"].words[:] = rng.integers(0, 3, 64 * 64).astype(np.uint16)
    writer.append(new, allow_layout_change=True)
    writer.close()
    log = DeltaLog.open(tmp_path / "log")
    replayed = log.materialize(0)
    seen = _spy(monkeypatch)
    log.apply_version(replayed, 1)
    assert_same_bits(replayed, new)
    assert seen == [64 * 64]


def test_a_tensor_the_step_keeps_is_not_written_before_its_record_is_checked(tmp_path, monkeypatch):
    """A dense tensor record of a tensor the step did not create (its words are the caller's)
    goes through apply_to_words: a record whose values miss its target digest leaves the words
    as they were. Of a created tensor it is decoded in place."""
    from dcr_log.digest import scheme_for
    from dcr_log.log import replay

    state = _state(6)
    LogWriter.create(tmp_path / "log", state, cache_dir=False).close()
    log = DeltaLog.open(tmp_path / "log")
    rec = next(r for r in _dense_tensor_records(log, 0) if r.tensor == "b")
    info = log.commit(0).tensor_map()["b"]
    digests = scheme_for(log.identity.features)
    real_decode = DenseEncoding.decode

    def damaged(self, kind, *args):
        changes = real_decode(self, kind, *args)
        changes.values[3] ^= 1
        return changes

    monkeypatch.setattr(DenseEncoding, "decode", damaged)
    seen = _spy(monkeypatch)
    kept = copy_state(state)["b"]
    kept.words[:] = 7
    with pytest.raises(IntegrityError, match="values to write differ"):
        replay._decode_and_apply(rec, info, kept, digests, created=False)
    assert (kept.words == 7).all() and seen == []
    replay._decode_and_apply(rec, info, kept, digests, created=True)
    assert seen == [rec.box.size]
    assert_same_bits({"b": kept}, {"b": state["b"]})


def test_a_record_decoded_in_place_is_checked_against_its_target_digest(tmp_path, monkeypatch):
    """Words that decode but differ from the record's target (one bit flipped after decoding)
    are refused; the same log replays when they do not differ."""
    state = _state(5)
    LogWriter.create(tmp_path / "log", state, cache_dir=False).close()
    log = DeltaLog.open(tmp_path / "log")
    real = DenseEncoding.decode_tensor_into

    def decode_tensor_into(self, params, payload, out):
        real(self, params, payload, out)
        if out.size:
            out.reshape(-1)[out.size // 2] ^= 1

    monkeypatch.setattr(DenseEncoding, "decode_tensor_into", decode_tensor_into)
    with pytest.raises(IntegrityError, match="values to write differ from the record's target"):
        log.materialize(0)
    monkeypatch.setattr(DenseEncoding, "decode_tensor_into", real)
    assert_same_bits(log.materialize(0), state)
