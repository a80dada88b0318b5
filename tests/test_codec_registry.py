"""The codec registry: a toy encoding added from outside round-trips through a log and is
refused once removed; the default registry tries and chooses as EncodePolicy documents."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log import DeltaLog, create_log, state_equal
from dcr_log.codec import (
    ENCODINGS,
    Attempt,
    Candidate,
    ChangeSet,
    Encoding,
    register,
    registered,
    required_feature,
    unregister,
)
from dcr_log.codec.base import check_params
from dcr_log.codec.dense import DenseEncoding
from dcr_log.codec.raw import RawEncoding
from dcr_log.codec.sparse import SparseEncoding
from dcr_log.codec.ulp import UlpEncoding
from dcr_log.codec.ulp_rans import UlpRansEncoding
from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format.commit import RANS_ENCODING, ULP_ENCODING
from dcr_log.state import TensorBits
from dcr_log.write.differ import Differ, EncodePolicy


class StrideEncoding(Encoding):
    """Toy: ``k`` changes at start, start + stride, ... that all carry the same word. Params
    ``start`` and ``stride``; the payload is the one word. Smaller than any built-in encoding
    wherever it applies, so the writer picks it there."""

    name = "toy-stride"
    kinds = ("xor", "overwrite")

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        positions, values = attempt.changes.positions, attempt.changes.values
        if positions is None or positions.size < 2:
            return None
        stride = int(positions[1] - positions[0])
        if np.any(np.diff(positions) != stride) or np.any(values != values[0]):
            return None
        return Candidate.encoded(cls.name, *cls().encode(attempt.kind, attempt.changes))

    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        self.check_kind(kind)
        positions = changes.positions
        assert positions is not None
        params = {"start": int(positions[0]), "stride": int(positions[1] - positions[0])}
        return params, changes.values[:1].tobytes()

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        self.check_kind(kind)
        check_params(self.name, params, {"start": int, "stride": int})
        start, stride = params["start"], params["stride"]
        if len(payload) != word.itemsize or k < 2 or start < 0 or stride < 1 or start + stride * (k - 1) >= n:
            raise IntegrityError(f"{self.name}: inconsistent record")
        positions = start + stride * np.arange(k, dtype=np.int64)
        return ChangeSet(n, positions, np.full(k, np.frombuffer(payload, dtype=word)[0], dtype=word))


def _states(rng, steps: int) -> list[dict[str, TensorBits]]:
    """``w``: each step flips one bit at every 7th word from an offset (toy territory);
    ``v``: random changes (the built-in encodings' territory)."""
    state = {"w": TensorBits("BF16", (64, 64), rng.integers(0, 1 << 16, 4096, dtype=np.uint16)),
             "v": TensorBits("F32", (1000,), rng.integers(0, 1 << 32, 1000, dtype=np.uint32))}
    states = [state]
    for step in range(steps):
        w = state["w"].words.copy()
        w[step::7] ^= np.uint16(1 << step)
        v = state["v"].words.copy()
        where = rng.choice(v.size, 30, replace=False)
        v[where] ^= rng.integers(1, 1 << 32, where.size, dtype=np.uint32)
        state = {"w": TensorBits("BF16", (64, 64), w), "v": TensorBits("F32", (1000,), v)}
        states.append(state)
    return states


def _encodings(log: DeltaLog, version: int) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for rec in log.records(version):
        out.setdefault(rec.tensor, set()).add(rec.encoding)
    return out


def test_toy_encoding_round_trips_then_is_refused_once_unregistered(tmp_path):
    states = _states(np.random.default_rng(3), 3)
    with registered(StrideEncoding):
        assert list(ENCODINGS)[-1] == StrideEncoding.name
        writer = create_log(tmp_path / "log", states[0])
        for state in states[1:]:
            writer.append(state)
        log = DeltaLog.open(tmp_path / "log")
        for version in (1, 2, 3):
            assert _encodings(log, version)["w"] == {StrideEncoding.name}
            assert StrideEncoding.name not in _encodings(log, version)["v"]
        for version, expected in enumerate(states):
            assert state_equal(log.materialize(version), expected)
        log.verify(deep=True)
    assert StrideEncoding.name not in ENCODINGS
    log = DeltaLog.open(tmp_path / "log")
    assert state_equal(log.materialize(0), states[0])  # version 0 holds no toy records
    with pytest.raises(IntegrityError, match="unknown encoding 'toy-stride'"):
        log.materialize(1)


def test_reader_refuses_an_encoding_whose_feature_the_log_lacks(tmp_path):
    """The feature rule of segment_records is the registry's, for any encoding."""
    states = _states(np.random.default_rng(4), 1)
    with registered(StrideEncoding):
        writer = create_log(tmp_path / "log", states[0], features=())
        writer.append(states[1])

    class NeedsUlpFeature(StrideEncoding):
        feature = ULP_ENCODING

    with registered(NeedsUlpFeature):
        assert required_feature(StrideEncoding.name) == ULP_ENCODING
        log = DeltaLog.open(tmp_path / "log")
        with pytest.raises(IntegrityError, match="a record uses the encoding 'toy-stride' in a log "
                                                 "without the feature 'ulp-encoding'"):
            log.materialize(1)


def test_writer_skips_an_encoding_whose_feature_the_log_lacks():
    class NeedsUlpFeature(StrideEncoding):
        feature = ULP_ENCODING

    base, new = _states(np.random.default_rng(5), 1)
    with registered(NeedsUlpFeature):
        plain = list(Differ(EncodePolicy(workers=1)).diff("w", base["w"], new["w"]))
        ulp = list(Differ(EncodePolicy(workers=1), ulp=True).diff("w", base["w"], new["w"]))
    assert {r.encoding for r in plain} == {"sparse"}
    assert {r.encoding for r in ulp} == {StrideEncoding.name}


def test_register_rules():
    assert list(ENCODINGS) == ["raw", "ulp", "ulp-rans", "sparse", "dense"]
    assert [required_feature(name) for name in ENCODINGS] == [None, ULP_ENCODING, RANS_ENCODING, None, None]
    assert required_feature("no-such-encoding") is None
    with pytest.raises(UsageError):
        register(RawEncoding)
    with pytest.raises(UsageError):
        unregister("no-such-encoding")
    with pytest.raises(RuntimeError), registered(StrideEncoding):
        raise RuntimeError("the block fails")
    assert StrideEncoding.name not in ENCODINGS


def test_ties_go_to_the_encoding_registered_first():
    """An encoding that offers raw's exact bytes under another name never wins over raw."""

    class RawAgain(RawEncoding):
        name = "toy-raw-again"

        @classmethod
        def try_encode(cls, attempt: Attempt) -> Candidate:
            return Candidate.encoded(cls.name, *cls().encode(attempt.kind, attempt.changes))

    base = TensorBits("U8", (4096,), np.random.default_rng(6).integers(0, 256, 4096, dtype=np.uint8))
    new = TensorBits("U8", (4096,), base.words.copy())
    new.words[100] ^= 0x5A  # one change: raw's 9 bytes beat any zstd frame
    with registered(RawAgain):
        recs = list(Differ(EncodePolicy(workers=1)).diff("t", base, new))
        tensor = list(Differ(EncodePolicy(workers=1)).diff("t", None, base))
    assert [r.encoding for r in recs] == ["raw"]
    assert [r.encoding for r in tensor] == ["raw"]  # random bytes: dense's frame is no smaller


# --- the default registry: what is tried and chosen at EncodePolicy's thresholds ---------

N = 10_000


@pytest.fixture
def tried(monkeypatch):
    """The names of the encodings that offered a candidate for each box, in order."""
    calls: list[str] = []
    for cls in (RawEncoding, UlpEncoding, UlpRansEncoding, SparseEncoding, DenseEncoding):
        original = cls.try_encode

        def spy(cls, attempt, original=original):
            candidate = original(attempt)
            if candidate is not None:
                calls.append(cls.name)
            return candidate

        monkeypatch.setattr(cls, "try_encode", classmethod(spy))
    return calls


def _pair(rng, k: int, ulp_steps: bool) -> tuple[TensorBits, TensorBits]:
    """A bf16 tensor of N words and one with exactly ``k`` changed: by one unit in the last
    place (a training step) or by random bits."""
    floats = (rng.standard_normal(N).astype(np.float32) * 0.02).view(np.uint32)
    base = (floats >> 16).astype(np.uint16)
    new = base.copy()
    where = np.sort(rng.choice(N, k, replace=False))
    if ulp_steps:
        new[where] += np.uint16(1)
    else:
        new[where] ^= rng.integers(1, 1 << 16, k, dtype=np.uint16)
    return TensorBits("BF16", (N,), base), TensorBits("BF16", (N,), new)


def _wide_pair(rng, k: int) -> tuple[TensorBits, TensorBits]:
    """N random 8-byte integer words and the same with exactly ``k`` replaced by random ones:
    their distances take the whole word, so ulp's payload is above half of raw's."""
    base = rng.integers(0, 1 << 63, N, dtype=np.uint64)
    new = base.copy()
    where = rng.choice(N, k, replace=False)
    new[where] ^= rng.integers(1, 1 << 63, k, dtype=np.uint64)
    return TensorBits("I64", (N,), base), TensorBits("I64", (N,), new)


def _one(differ: Differ, base, new, kind: str = "xor") -> str:
    recs = list(differ.diff("t", base, new, kind))
    assert len(recs) == 1
    return recs[0].encoding


@pytest.mark.parametrize("rate, expect_tried", [
    (0.0001, ["raw", "sparse"]),
    (0.04, ["raw", "sparse"]),           # below dense_min_rate
    (0.05, ["raw", "sparse", "dense"]),  # dense_min_rate
    (0.6, ["raw", "sparse", "dense"]),   # sparse_max_rate
    (0.61, ["raw", "dense"]),
    (1.0, ["raw", "dense"]),
])
def test_without_ulp_the_rates_gate_sparse_and_dense(tried, rate, expect_tried):
    base, new = _pair(np.random.default_rng(7), int(round(rate * N)), ulp_steps=True)
    _one(Differ(EncodePolicy(workers=1)), base, new)
    assert tried == expect_tried


@pytest.mark.parametrize("rate, float_steps, expect_tried, chosen", [
    (0.01, True, ["raw", "ulp"], "ulp"),                     # ulp small: sparse not worth trying
    (0.29, True, ["raw", "ulp"], "ulp"),                     # below ulp_dense_min_rate: no dense
    (0.3, True, ["raw", "ulp", "dense"], "ulp"),             # ulp_dense_min_rate
    (0.6, True, ["raw", "ulp", "dense"], None),
    (0.61, True, ["raw", "dense"], "dense"),                 # above sparse_max_rate: no ulp
    (0.01, False, ["raw", "ulp", "sparse"], None),           # not floats: ulp above half of raw
    (0.3, False, ["raw", "ulp", "sparse", "dense"], None),
])
@pytest.mark.parametrize("feature, name", [(ULP_ENCODING, "ulp"), (RANS_ENCODING, "ulp-rans")])
def test_with_ulp_it_steers_sparse_and_dense(tried, rate, float_steps, expect_tried, chosen, feature, name):
    """The same steering with either coder of ulp distances (pcodec or rANS)."""
    rename = {"ulp": name}
    expect_tried = [rename.get(e, e) for e in expect_tried]
    chosen = rename.get(chosen, chosen)
    rng, k = np.random.default_rng(8), int(round(rate * N))
    base, new = _pair(rng, k, ulp_steps=True) if float_steps else _wide_pair(rng, k)
    encoding = _one(Differ(EncodePolicy(workers=1), features=(feature,)), base, new)
    assert tried == expect_tried
    assert encoding in expect_tried
    if chosen is not None:
        assert encoding == chosen


@pytest.mark.parametrize("rate, expect_tried", [(0.01, ["raw", "sparse"]), (0.6, ["raw", "sparse"]),
                                                (0.61, ["raw"])])
def test_overwrite_records_never_try_ulp_or_dense(tried, rate, expect_tried):
    base, new = _pair(np.random.default_rng(9), int(round(rate * N)), ulp_steps=True)
    encoding = _one(Differ(EncodePolicy(workers=1), ulp=True), base, new, kind="overwrite")
    assert tried == expect_tried
    assert encoding in expect_tried


def test_tensor_records_try_raw_then_dense(tried):
    zeros = TensorBits("BF16", (N,), np.zeros(N, dtype=np.uint16))
    noise = TensorBits("BF16", (N,), np.random.default_rng(10).integers(0, 1 << 16, N, dtype=np.uint16))
    differ = Differ(EncodePolicy(workers=1), ulp=True)
    assert _one(differ, None, zeros) == "dense"
    assert _one(differ, None, noise) == "raw"
    assert tried == ["raw", "dense", "raw", "dense"]


def test_small_changes_choose_as_before():
    """The choices at the documented rates on bf16 training steps."""
    rng = np.random.default_rng(11)
    plain, ulp = Differ(EncodePolicy(workers=1)), Differ(EncodePolicy(workers=1), ulp=True)
    rans = Differ(EncodePolicy(workers=1), features=(RANS_ENCODING,))
    base, new = _pair(rng, 1, ulp_steps=True)
    assert _one(plain, base, new) == "raw"  # one change: 10 bytes beat any frame
    assert _one(rans, base, new) == "raw"   # nor a rANS record's two frequency tables
    base, new = _pair(rng, 100, ulp_steps=True)
    assert (_one(plain, base, new), _one(ulp, base, new), _one(rans, base, new)) == ("sparse", "ulp", "ulp-rans")
    base, new = _pair(rng, 8000, ulp_steps=False)
    assert (_one(plain, base, new), _one(ulp, base, new), _one(rans, base, new)) == ("dense", "dense", "dense")


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 400), n=st.sampled_from([16, 64, 1000, N]), ulp_steps=st.booleans(),
       seed=st.integers(0, 2**32 - 1), width=st.sampled_from([2, 4]))
def test_records_too_small_for_ulp_rans_choose_as_if_it_were_tried(k, n, ulp_steps, seed, width):
    """ulp-rans is not encoded where the smallest candidate so far is MIN_PAYLOAD bytes or
    less (its payload could not win, FORMAT.md section 11): the records (encoding, params,
    payload) are those of a writer that encodes it every time, at every size and rate."""
    from dcr_log.codec import ulp_rans

    rng = np.random.default_rng(seed)
    dtype, word = ("BF16", np.uint16) if width == 2 else ("F32", np.uint32)
    base = rng.integers(0, 1 << (8 * width - 2), n, dtype=np.uint64).astype(word)
    new = base.copy()
    where = np.sort(rng.choice(n, min(k, n), replace=False))
    new[where] = (new[where] + 1) if ulp_steps else new[where] ^ word(0b1011)
    a, b = TensorBits(dtype, (n,), base), TensorBits(dtype, (n,), new)
    differ = Differ(EncodePolicy(workers=1), features=(RANS_ENCODING,))
    shortcut = [(r.encoding, r.params, bytes(r.payload)) for r in differ.diff("t", a, b)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ulp_rans, "MIN_PAYLOAD", 0)  # every record encoded
        every = [(r.encoding, r.params, bytes(r.payload)) for r in differ.diff("t", a, b)]
    assert shortcut == every


def test_no_ulp_rans_payload_is_below_its_bound():
    """MIN_PAYLOAD is a lower bound: a record of one change, whose streams hold one symbol
    each, is at least that long, and one of a few changes of one bin meets it."""
    from dcr_log.codec.base import ChangeSet
    from dcr_log.codec.ulp_rans import MIN_PAYLOAD

    sizes = []
    for k in (1, 2, 3, 8):
        positions = np.arange(k, dtype=np.int64)
        distances = np.ones(k, dtype=np.uint16)
        _, payload = UlpRansEncoding().encode("xor", ChangeSet(1000, positions, distances, relative=True))
        sizes.append(len(payload))
    assert min(sizes) >= MIN_PAYLOAD and MIN_PAYLOAD in sizes, sizes


def test_a_norms_few_changes_are_not_rans_coded(monkeypatch):
    """A record of three changes: raw's 30 bytes are below MIN_PAYLOAD, so the coder is not run."""
    from dcr_log.codec import ulp_rans

    calls: list[int] = []
    real = UlpRansEncoding.encode
    monkeypatch.setattr(UlpRansEncoding, "encode", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    rng = np.random.default_rng(12)
    differ = Differ(EncodePolicy(workers=1), features=(RANS_ENCODING,))
    base, new = _pair(rng, 3, ulp_steps=True)
    assert _one(differ, base, new) in ("raw", "sparse") and calls == []
    base, new = _pair(rng, 200, ulp_steps=True)
    assert _one(differ, base, new) == "ulp-rans" and calls == [1]
    assert ulp_rans.MIN_PAYLOAD == 104


@pytest.mark.parametrize("n, k", [(64, 8), (100, 6), (N, 3)])
def test_a_record_too_small_for_ulp_rans_steers_the_rest_as_if_tried(tried, monkeypatch, n, k):
    """Not encoding ulp-rans leaves the other encodings tried as its payload would have: dense
    still waits for ulp_dense_min_rate (8 changes in 64 words, 12.5%, are above dense_min_rate
    and below it), and sparse is still tried."""
    from dcr_log.codec import ulp_rans

    rng = np.random.default_rng(13)
    base = rng.integers(0, 1 << 14, n, dtype=np.uint16)
    new = base.copy()
    new[np.sort(rng.choice(n, k, replace=False))] += np.uint16(1)
    a, b = TensorBits("BF16", (n,), base), TensorBits("BF16", (n,), new)
    differ = Differ(EncodePolicy(workers=1), features=(RANS_ENCODING,))
    list(differ.diff("t", a, b))
    shortcut = list(tried)
    tried.clear()
    monkeypatch.setattr(ulp_rans, "MIN_PAYLOAD", 0)
    list(differ.diff("t", a, b))
    assert "ulp-rans" in tried and shortcut == [name for name in tried if name != "ulp-rans"], (shortcut, tried)
