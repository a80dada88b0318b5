"""Payload encodings on bytes: round trips, exact layouts and every rejection a decoder owes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_log.codec import ENCODINGS, ChangeSet, decode_changes, get_encoding
from dcr_log.errors import IntegrityError

WORDS = (np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8"))
ENCODING_KINDS = [("raw", "xor"), ("raw", "overwrite"), ("raw", "tensor"), ("sparse", "xor"),
                  ("sparse", "overwrite"), ("dense", "xor"), ("dense", "tensor")]


def _words(rng, word: np.dtype, count: int, nonzero: bool) -> np.ndarray:
    values = rng.integers(0, np.iinfo(word).max, count, dtype=word, endpoint=True)
    if nonzero:
        values[values == 0] = 1  # xor values of changed positions are never zero
    return values


def _changes(rng, kind: str, word: np.dtype, n: int, rate: float, edges: tuple[bool, bool]) -> ChangeSet:
    if kind == "tensor":
        return ChangeSet(n, None, _words(rng, word, n, nonzero=False))
    mask = rng.random(n) < rate
    if n:
        mask[0] |= edges[0]
        mask[-1] |= edges[1]
    positions = np.flatnonzero(mask)
    return ChangeSet(n, positions, _words(rng, word, positions.size, nonzero=kind == "xor"))


def _roundtrip(name: str, kind: str, changes: ChangeSet, word: np.dtype, origin: int = 0) -> ChangeSet:
    params, payload = get_encoding(name).encode(kind, changes)
    # Params are stored as canonical JSON: they must survive it unchanged.
    assert json.loads(json.dumps(params)) == params
    got = decode_changes(kind, name, params, memoryview(bytes(payload)), changes.n, changes.k, word)
    # Decoded with an origin (a row block's flat start): the same values, each position
    # moved by it as int64, and the origin recorded.
    at = decode_changes(kind, name, params, memoryview(bytes(payload)), changes.n, changes.k, word,
                        origin=(1 << 40) + 3)
    assert np.array_equal(at.values, got.values) and at.values.dtype == got.values.dtype
    if got.positions is None:
        assert at.positions is None
    else:
        assert at.positions.dtype == np.int64 and at.origin == (1 << 40) + 3
        assert np.array_equal(at.positions - at.origin, np.asarray(got.positions, dtype=np.int64))
    return got


def _assert_same_changes(got: ChangeSet, expected: ChangeSet, word: np.dtype) -> None:
    assert got.n == expected.n and got.k == expected.k
    if expected.positions is None:
        assert got.positions is None
    else:
        assert np.array_equal(np.asarray(got.positions, dtype=np.int64), expected.positions)
    assert got.values.dtype == word
    assert np.array_equal(got.values, expected.values)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    enc_kind=st.sampled_from(ENCODING_KINDS),
    word=st.sampled_from(WORDS),
    n=st.one_of(st.integers(0, 16), st.integers(0, 5000)),
    rate=st.one_of(st.sampled_from([0.0, 0.001, 0.5, 1.0]), st.floats(0, 1)),
    edges=st.tuples(st.booleans(), st.booleans()),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip(enc_kind, word, n, rate, edges, seed):
    name, kind = enc_kind
    changes = _changes(np.random.default_rng(seed), kind, word, n, rate, edges)
    _assert_same_changes(_roundtrip(name, kind, changes, word), changes, word)


@pytest.mark.parametrize("name,kind", ENCODING_KINDS)
@pytest.mark.parametrize("word", WORDS, ids=lambda w: w.str)
def test_roundtrip_every_width_and_kind(name, kind, word):
    rng = np.random.default_rng(7)
    for n, rate in [(0, 0.0), (1, 1.0), (2, 0.5), (257, 0.0), (257, 0.02), (300, 0.3), (300, 1.0)]:
        changes = _changes(rng, kind, word, n, rate, (True, True))
        _assert_same_changes(_roundtrip(name, kind, changes, word), changes, word)


@pytest.mark.parametrize("name", ["raw", "sparse"])
def test_positions_far_apart(name):
    """Gaps of every stored width, up to a box far larger than memory (only k is allocated)."""
    word = np.dtype("<u2")
    n = 1 << 40
    positions = np.array([0, 255, 256 + 255 + 1, 1 << 20, (1 << 20) + (1 << 32) + 1, n - 1], dtype=np.int64)
    changes = ChangeSet(n, positions, np.arange(1, positions.size + 1, dtype=word))
    _assert_same_changes(_roundtrip(name, "xor", changes, word), changes, word)


@pytest.mark.parametrize("max_gap,width", [(0, 1), (255, 1), (256, 2), (65535, 2), (65536, 4),
                                           ((1 << 32) - 1, 4), (1 << 32, 8)])
def test_sparse_gap_width(max_gap, width):
    positions = np.array([3, 3 + max_gap + 1], dtype=np.int64)
    changes = ChangeSet(int(positions[-1]) + 1, positions, np.array([1, 2], dtype=np.uint8))
    params, payload = get_encoding("sparse").encode("xor", changes)
    assert params["gap_bytes"] == width
    _assert_same_changes(
        decode_changes("xor", "sparse", params, payload, changes.n, 2, np.dtype("u1")), changes, np.dtype("u1")
    )


# -- exact layouts ----------------------------------------------------------------------------

def _frame_body(payload: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(payload)


def test_raw_layout_exact():
    changes = ChangeSet(10, np.array([1, 9]), np.array([0x0102, 0xA0B0], dtype="<u2"))
    params, payload = get_encoding("raw").encode("xor", changes)
    assert params == {}
    assert bytes(payload) == bytes([1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x01, 0xB0, 0xA0])
    _, payload = get_encoding("raw").encode("tensor", ChangeSet(2, None, np.array([0x0102, 0x0304], "<u2")))
    assert bytes(payload) == bytes([0x02, 0x01, 0x04, 0x03])


def test_sparse_layout_exact():
    """Gaps 1, 2, 0 as one byte each, then the values' low bytes, then their high bytes."""
    changes = ChangeSet(6, np.array([1, 4, 5]), np.array([0x0102, 0x0304, 0x0506], dtype="<u2"))
    params, payload = get_encoding("sparse").encode("overwrite", changes)
    assert params["gap_bytes"] == 1
    assert _frame_body(payload) == bytes([1, 2, 0, 0x02, 0x04, 0x06, 0x01, 0x03, 0x05])


def test_sparse_layout_exact_wide_gaps():
    changes = ChangeSet(1000, np.array([0x0102, 0x0304 + 0x0102 + 1]), np.array([0x0A0B0C0D, 0x01020304], "<u4"))
    params, payload = get_encoding("sparse").encode("xor", changes)
    assert params["gap_bytes"] == 2
    assert _frame_body(payload) == bytes([0x02, 0x04, 0x01, 0x03,
                                          0x0D, 0x04, 0x0C, 0x03, 0x0B, 0x02, 0x0A, 0x01])


def test_dense_layout_exact():
    changes = ChangeSet(4, np.array([1, 3]), np.array([0x0102, 0x0304], dtype="<u2"))
    params, payload = get_encoding("dense").encode("xor", changes)
    assert _frame_body(payload) == bytes([0, 0x02, 0, 0x04, 0, 0x01, 0, 0x03])
    words8 = np.array([0x0102030405060708], dtype="<u8")
    _, payload = get_encoding("dense").encode("tensor", ChangeSet(1, None, words8))
    assert _frame_body(payload) == bytes([8, 7, 6, 5, 4, 3, 2, 1])


def test_decoders_read_little_endian_planes():
    """A hand-built sparse frame decodes to the words it spells (independent of the encoder)."""
    body = bytes([0, 1, 0xEF, 0x34, 0xBE, 0x12])  # gaps 0,1; values 0xBEEF, 0x1234
    payload = zstandard.ZstdCompressor(write_content_size=True).compress(body)
    got = decode_changes("xor", "sparse", {"level": 3, "gap_bytes": 1}, payload, 3, 2, np.dtype("<u2"))
    assert got.positions.tolist() == [0, 2]
    assert got.values.tolist() == [0xBEEF, 0x1234]


# -- rejections -------------------------------------------------------------------------------

U2 = np.dtype("<u2")


def _sample(name: str, kind: str):
    rng = np.random.default_rng(3)
    changes = _changes(rng, kind, U2, 200, 0.2, (True, True))
    params, payload = get_encoding(name).encode(kind, changes)
    return changes, params, bytes(payload)


@pytest.mark.parametrize("name,kind", ENCODING_KINDS)
def test_truncated_payload_rejected(name, kind):
    changes, params, payload = _sample(name, kind)
    for cut in sorted({0, 1, 4, len(payload) // 2, len(payload) - 1}):
        with pytest.raises(IntegrityError):
            decode_changes(kind, name, params, payload[:cut], changes.n, changes.k, U2)


def test_raw_payload_with_extra_bytes_rejected():
    changes, params, payload = _sample("raw", "xor")
    with pytest.raises(IntegrityError):
        decode_changes("xor", "raw", params, payload + b"\x00", changes.n, changes.k, U2)


@pytest.mark.parametrize("name,kind", [("sparse", "xor"), ("dense", "xor"), ("dense", "tensor")])
@pytest.mark.parametrize("delta", [-1, 1])
def test_zstd_frame_declaring_wrong_size_rejected(name, kind, delta):
    changes, params, payload = _sample(name, kind)
    body = bytearray(_frame_body(payload))
    body = body[:delta] if delta < 0 else body + b"\x00" * delta
    bad = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(body))
    with pytest.raises(IntegrityError, match="declares"):
        decode_changes(kind, name, params, bad, changes.n, changes.k, U2)


@pytest.mark.parametrize("name,kind", [("sparse", "xor"), ("dense", "tensor")])
def test_zstd_frame_without_declared_size_rejected(name, kind):
    changes, params, payload = _sample(name, kind)
    bad = zstandard.ZstdCompressor(write_content_size=False).compress(_frame_body(payload))
    with pytest.raises(IntegrityError):
        decode_changes(kind, name, params, bad, changes.n, changes.k, U2)


def _raw_payload(positions, values, word=U2) -> bytes:
    return np.asarray(positions, "<u8").tobytes() + np.asarray(values, word).tobytes()


@pytest.mark.parametrize("positions,n", [([3, 3], 10), ([5, 2], 10), ([0, 10], 10), ([2**63, 1], 10),
                                         ([2**64 - 1], 10)])
def test_raw_positions_not_increasing_or_outside_rejected(positions, n):
    with pytest.raises(IntegrityError):
        decode_changes("xor", "raw", {}, _raw_payload(positions, [1] * len(positions)), n, len(positions), U2)


def _sparse_payload(gaps, values, gap_word="<u1", word=U2) -> bytes:
    gaps = np.asarray(gaps, gap_word)
    values = np.asarray(values, word)
    planes = lambda a: np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.itemsize).T).tobytes()
    return zstandard.ZstdCompressor(write_content_size=True).compress(planes(gaps) + planes(values))


def test_sparse_hand_payload_accepted():
    got = decode_changes("xor", "sparse", {"level": 3, "gap_bytes": 1}, _sparse_payload([2, 3], [7, 8]), 7, 2, U2)
    assert got.positions.tolist() == [2, 6]


@pytest.mark.parametrize("gaps,gap_word,gw,n", [
    ([10], "<u1", 1, 10),              # one gap beyond the box
    ([2, 3], "<u1", 1, 6),             # cumulative position == n
    ([0, 200], "<u1", 1, 100),         # second gap beyond the box
    ([2**63, 2**63], "<u8", 8, 2**64 + 5),  # cumulative sum wraps around 2**64
])
def test_sparse_gaps_beyond_box_rejected(gaps, gap_word, gw, n):
    payload = _sparse_payload(gaps, [1] * len(gaps), gap_word)
    with pytest.raises(IntegrityError):
        decode_changes("xor", "sparse", {"level": 3, "gap_bytes": gw}, payload, n, len(gaps), U2)


def test_k_greater_than_n_rejected():
    with pytest.raises(IntegrityError):
        decode_changes("xor", "raw", {}, _raw_payload([0, 1, 2], [1, 1, 1]), 2, 3, U2)
    with pytest.raises(IntegrityError):
        decode_changes("xor", "raw", {}, b"", 2, -1, U2)


@pytest.mark.parametrize("name", ["raw", "dense"])
def test_tensor_kind_needs_k_equal_n(name):
    changes, params, payload = _sample(name, "tensor")
    with pytest.raises(IntegrityError):
        decode_changes("tensor", name, params, payload, changes.n, changes.n - 1, U2)
    with pytest.raises(IntegrityError):  # the encoding checks it too, not only the registry
        get_encoding(name).decode("tensor", params, payload, changes.n, changes.n - 1, U2)


def test_dense_nonzero_count_must_equal_k():
    changes, params, payload = _sample("dense", "xor")
    for k in (changes.k - 1, changes.k + 1):
        with pytest.raises(IntegrityError):
            decode_changes("xor", "dense", params, payload, changes.n, k, U2)


@pytest.mark.parametrize("name,kind,params", [
    ("raw", "xor", {"level": 3}),
    ("sparse", "xor", {"level": 3, "gap_bytes": 1, "order": "C"}),
    ("dense", "xor", {"level": 3, "shuffle": 1}),
])
def test_unknown_params_rejected(name, kind, params):
    changes, _, payload = _sample(name, kind)
    with pytest.raises(IntegrityError, match="unknown parameter"):
        decode_changes(kind, name, params, payload, changes.n, changes.k, U2)


@pytest.mark.parametrize("name,params", [("sparse", {"level": 3}), ("sparse", {"gap_bytes": 1}),
                                         ("dense", {})])
def test_missing_params_rejected(name, params):
    changes, real, payload = _sample(name, "xor")
    assert set(params) < set(real)
    with pytest.raises(IntegrityError, match="missing"):
        decode_changes("xor", name, params, payload, changes.n, changes.k, U2)


@pytest.mark.parametrize("name,bad", [("sparse", {"gap_bytes": 3}), ("sparse", {"gap_bytes": "1"}),
                                      ("sparse", {"level": 0}), ("dense", {"level": "3"}),
                                      ("dense", {"level": 23})])
def test_bad_param_values_rejected(name, bad):
    changes, params, payload = _sample(name, "xor")
    with pytest.raises(IntegrityError):
        decode_changes("xor", name, {**params, **bad}, payload, changes.n, changes.k, U2)


@pytest.mark.parametrize("params", [None, [], "level=3"])
def test_params_not_an_object_rejected(params):
    changes, _, payload = _sample("dense", "xor")
    with pytest.raises(IntegrityError):
        decode_changes("xor", "dense", params, payload, changes.n, changes.k, U2)


def test_unknown_encoding_and_kind_rejected():
    changes, params, payload = _sample("raw", "xor")
    with pytest.raises(IntegrityError, match="unknown encoding"):
        decode_changes("xor", "rle", params, payload, changes.n, changes.k, U2)
    with pytest.raises(IntegrityError, match="unknown encoding"):
        get_encoding("")
    with pytest.raises(IntegrityError, match="kind"):
        decode_changes("and", "raw", params, payload, changes.n, changes.k, U2)


@pytest.mark.parametrize("name,kind", [("sparse", "tensor"), ("dense", "overwrite")])
def test_encoding_refuses_kinds_it_cannot_carry(name, kind):
    assert kind not in ENCODINGS[name].kinds
    with pytest.raises(IntegrityError):
        decode_changes(kind, name, {"level": 3, "gap_bytes": 1} if name == "sparse" else {"level": 3},
                       b"", 4, 4 if kind == "tensor" else 1, U2)
    changes = ChangeSet(4, None if kind == "tensor" else np.array([1]), np.ones(4 if kind == "tensor" else 1, U2))
    with pytest.raises(IntegrityError):
        get_encoding(name).encode(kind, changes)


@pytest.mark.parametrize("name,kind", ENCODING_KINDS)
def test_garbage_payload_never_escapes_as_another_error(name, kind):
    """Random bytes fail with IntegrityError, never with a crash or another exception type."""
    changes, params, payload = _sample(name, kind)
    rng = np.random.default_rng(11)
    for size in (1, 8, 17, len(payload)):
        junk = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for candidate in (junk, payload[:4] + junk):  # with and without a valid zstd magic
            try:
                got = decode_changes(kind, name, params, candidate, changes.n, changes.k, U2)
            except IntegrityError:
                continue
            # Accepted bytes must at least describe a consistent change set.
            assert got.k == changes.k and got.values.dtype == U2


def test_bytes_after_the_zstd_frame_are_rejected():
    changes = ChangeSet(100, np.array([1, 5, 99]), np.array([1, 2, 3], np.uint16))
    params, payload = get_encoding("sparse").encode("xor", changes)
    decode_changes("xor", "sparse", params, payload, 100, 3, np.dtype("<u2"))
    with pytest.raises(IntegrityError):
        decode_changes("xor", "sparse", params, payload + b"\x00", 100, 3, np.dtype("<u2"))


@pytest.mark.parametrize("bad", [{"level": 1.0}, {"level": True}, {"gap_bytes": True}, {"gap_bytes": 1.0}])
def test_params_must_be_json_integers(bad):
    changes = ChangeSet(100, np.array([1, 5, 99]), np.array([1, 2, 3], np.uint16))
    params, payload = get_encoding("sparse").encode("xor", changes)
    with pytest.raises(IntegrityError):
        decode_changes("xor", "sparse", {**params, **bad}, payload, 100, 3, np.dtype("<u2"))


# -- ulp: distances from the base (feature ulp-encoding) ----------------------------------------

from dcr_log.codec.ulp import UlpEncoding, from_key, step_from, to_key, xor_from_distance  # noqa: E402


def _ulp_pair(rng, word: np.dtype, n: int, rate: float, far: float):
    """Base words (NaN payloads, signed zeros and infinities mixed in) and new words where a
    ``rate`` of them moved: mostly by a few units in key order, a ``far`` share anywhere."""
    base = _words(rng, word, n, nonzero=False)
    bits = 8 * word.itemsize
    specials = np.array([0, 1 << (bits - 1), (1 << bits) - 1, (1 << (bits - 1)) - 1], dtype=np.uint64)
    if n:
        base[rng.random(n) < 0.1] = specials.astype(word)[rng.integers(0, 4)]
    moved = rng.random(n) < rate
    d = rng.choice(np.array([1, -1, 1, -1, 2, -2, 3, -5], dtype=np.int64), n)
    new = step_from(base, d.astype(np.dtype(f"<i{word.itemsize}")).view(word))
    anywhere = _words(rng, word, n, nonzero=False)
    far_mask = rng.random(n) < far
    new = np.where(moved & far_mask, anywhere, np.where(moved, new, base))
    return base, new.astype(word)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(word=st.sampled_from(WORDS), n=st.one_of(st.integers(1, 16), st.integers(1, 5000)),
       rate=st.one_of(st.sampled_from([0.001, 0.5, 1.0]), st.floats(0, 1)),
       far=st.sampled_from([0.0, 0.1, 1.0]), seed=st.integers(0, 2**32 - 1))
def test_ulp_roundtrip(word, n, rate, far, seed):
    """Every change set of any width and rate, NaN payloads and signed zeros included, comes
    back as the exact xor words once the distances meet the base words."""
    base, new = _ulp_pair(np.random.default_rng(seed), word, n, rate, far)
    positions = np.flatnonzero(base != new)
    if positions.size == 0:
        return
    changes = ChangeSet(n, positions, base[positions] ^ new[positions])
    params, payload = UlpEncoding().encode("xor", changes, base=base[positions], new=new[positions])
    assert json.loads(json.dumps(params)) == params
    got = decode_changes("xor", "ulp", params, memoryview(payload), n, positions.size, word)
    assert got.relative and got.values.dtype == word
    assert np.array_equal(got.positions, positions)
    at = decode_changes("xor", "ulp", params, memoryview(payload), n, positions.size, word, origin=n + 5)
    assert at.origin == n + 5 and np.array_equal(at.positions, positions + n + 5)
    assert np.array_equal(at.values, got.values)
    assert np.array_equal(xor_from_distance(base[positions], got.values), changes.values)
    # Element by element: any subset of positions resolves against its own base words.
    some = np.arange(0, positions.size, 3)
    assert np.array_equal(xor_from_distance(base[positions][some], got.values[some]), changes.values[some])
    assert np.array_equal(step_from(new[positions], got.values, backwards=True), base[positions])


@pytest.mark.parametrize("float_type,word", [(np.float16, "<u2"), (np.float32, "<u4"), (np.float64, "<u8")])
def test_ulp_key_is_the_order_of_floats(float_type, word):
    """key orders IEEE words as their numbers (-0 just below +0), and one step is nextafter."""
    rng = np.random.default_rng(3)
    raw = _words(rng, np.dtype(word), 4000, nonzero=False)
    values = raw.view(float_type)
    finite = raw[np.isfinite(values)]
    order = np.argsort(to_key(finite), kind="stable")
    as_float = finite.view(float_type)[order].astype(np.float64)
    assert np.all(np.diff(as_float) >= 0)
    signed_zeros = np.array([1 << (8 * np.dtype(word).itemsize - 1), 0], dtype=word)  # -0, +0
    assert int(to_key(signed_zeros)[1]) == int(to_key(signed_zeros)[0]) + 1
    assert np.array_equal(from_key(to_key(raw)), raw)
    up = step_from(finite, np.ones(finite.size, dtype=word))
    big = np.abs(finite.view(float_type)) < np.finfo(float_type).max
    with np.errstate(over="ignore"):
        expected = np.nextafter(finite.view(float_type), float_type(np.inf))
    # -0 steps up to +0, where nextafter(-0, inf) gives the smallest subnormal.
    negzero = finite == signed_zeros[0]
    assert np.array_equal(up[big & ~negzero], expected[big & ~negzero].view(word))
    assert np.array_equal(up[negzero], np.zeros(int(negzero.sum()), dtype=word))


def _ulp_sample():
    rng = np.random.default_rng(5)
    base, new = _ulp_pair(rng, U2, 3000, 0.05, 0.05)
    positions = np.flatnonzero(base != new)
    changes = ChangeSet(3000, positions, base[positions] ^ new[positions])
    params, payload = UlpEncoding().encode("xor", changes, base=base[positions], new=new[positions])
    return changes, params, payload


def _pco(numbers) -> bytes:
    import pcodec

    return pcodec.standalone.simple_compress(np.ascontiguousarray(numbers), pcodec.ChunkConfig())


ULP_PARAMS = {"gap_bytes": 4, "level": 8}  # the params of a hand-made ulp payload


def _ulp_hand(gaps, distances) -> bytes:
    g = _pco(gaps)
    return len(g).to_bytes(8, "little") + g + _pco(distances)


def test_ulp_hand_payload_accepted():
    got = decode_changes("xor", "ulp", {"gap_bytes": 4, "level": 8},
                         _ulp_hand(np.array([2, 0, 5], "<u4"), np.array([1, -1, 300], "<i2")), 10, 3, U2)
    assert got.positions.tolist() == [2, 3, 9] and got.values.view("<i2").tolist() == [1, -1, 300]


@pytest.mark.parametrize("why,params,payload,n,k,word", [
    ("zero distance", ULP_PARAMS, _ulp_hand(np.array([1, 1], "<u4"), np.array([1, 0], "<i2")), 10, 2, U2),
    ("too few numbers", ULP_PARAMS, _ulp_hand(np.array([1, 1], "<u4"), np.array([1], "<i2")), 10, 2, U2),
    ("too many numbers", ULP_PARAMS, _ulp_hand(np.array([1], "<u4"), np.array([1, 2], "<i2")), 10, 1, U2),
    ("gap type", ULP_PARAMS, _ulp_hand(np.array([1], "<u8"), np.array([1], "<i2")), 10, 1, U2),
    ("distance type", ULP_PARAMS, _ulp_hand(np.array([1], "<u4"), np.array([1], "<i4")), 10, 1, U2),
    ("gap beyond box", ULP_PARAMS, _ulp_hand(np.array([10], "<u4"), np.array([1], "<i2")), 10, 1, U2),
    ("positions beyond box", ULP_PARAMS, _ulp_hand(np.array([5, 4], "<u4"), np.array([1, 1], "<i2")), 10, 2, U2),
    ("1-byte distance", ULP_PARAMS, _ulp_hand(np.array([1], "<u4"), np.array([200], "<i2")), 10, 1, np.dtype("<u1")),
    ("no changes", ULP_PARAMS, _ulp_hand(np.zeros(0, "<u4"), np.zeros(0, "<i2")), 10, 0, U2),
    ("length past the end", ULP_PARAMS, (10**6).to_bytes(8, "little") + _pco(np.array([1], "<u4")), 10, 1, U2),
    ("not a pcodec file", ULP_PARAMS, (4).to_bytes(8, "little") + b"abcd" + b"efgh", 10, 1, U2),
    ("bad gap_bytes", {"gap_bytes": 2, "level": 8}, _ulp_hand(np.array([1], "<u2"), np.array([1], "<i2")), 10, 1, U2),
    ("bad level", {"gap_bytes": 4, "level": 13}, _ulp_hand(np.array([1], "<u4"), np.array([1], "<i2")), 10, 1, U2),
])
def test_ulp_decoder_rejects(why, params, payload, n, k, word):
    with pytest.raises(IntegrityError):
        decode_changes("xor", "ulp", params, payload, n, k, word)


@pytest.mark.parametrize("kind", ["overwrite", "tensor"])
def test_ulp_carries_only_xor(kind):
    changes, params, payload = _ulp_sample()
    with pytest.raises(IntegrityError):
        decode_changes(kind, "ulp", params, payload, changes.n, changes.n if kind == "tensor" else changes.k, U2)


def test_ulp_garbage_and_flipped_bytes_never_escape_as_another_error():
    """Random bytes and single flipped bits fail with IntegrityError or decode to a
    consistent change set (the record digests catch wrong values), never anything else."""
    changes, params, payload = _ulp_sample()
    rng = np.random.default_rng(13)
    candidates = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (1, 8, 17, 64)]
    for _ in range(300):
        b = bytearray(payload)
        b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        candidates.append(bytes(b))
        candidates.append(payload[:int(rng.integers(0, len(payload)))])
    for candidate in candidates:
        try:
            got = decode_changes("xor", "ulp", params, candidate, changes.n, changes.k, U2)
        except IntegrityError:
            continue
        assert got.k == changes.k and got.values.dtype == U2 and np.all(got.values != 0)
        assert np.all(np.diff(got.positions) > 0) and got.positions[-1] < changes.n


def _sparse_body(rng, k: int, n: int, gap_width: int, word, fault: str) -> bytes:
    """A sparse payload (zstd frame of gap planes, then value planes) of k changes in a box
    of n: valid, or with one gap of n or more (``gap``), or positions running past the box
    (``past``: every gap valid, their sum too large)."""
    top = min(n, 1 << (8 * gap_width)) - 1
    gaps = rng.integers(0, max(1, min(top, max(1, n // max(k, 1)))) + 1, k, dtype=np.uint64)
    if fault == "none":  # positions inside the box: rescale the gaps to fit
        room = n - k
        gaps = gaps * room // max(int(gaps.sum()), 1) if room >= 0 else gaps
    elif fault == "gap" and n < 1 << (8 * gap_width):
        gaps[rng.integers(k)] = rng.integers(n, 1 << (8 * gap_width), dtype=np.uint64)
    elif fault == "past":
        gaps[:] = top
    gap_planes = np.concatenate([((gaps >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.uint8)
                                 for j in range(gap_width)])
    values = rng.integers(0, np.iinfo(word).max, k, dtype=word, endpoint=True)
    value_planes = np.concatenate([((values.astype(np.uint64) >> np.uint64(8 * j)) & np.uint64(0xFF)).astype(np.uint8)
                                   for j in range(word.itemsize)])
    body = np.concatenate([gap_planes, value_planes]).tobytes()
    return zstandard.ZstdCompressor(write_content_size=True).compress(body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(word=st.sampled_from(WORDS), gap_width=st.sampled_from([1, 2, 4, 8]),
       k=st.one_of(st.integers(1, 5), st.integers(1, 3000)), extra=st.integers(0, 1 << 20),
       fault=st.sampled_from(["none", "gap", "past"]), seed=st.integers(0, 2**32 - 1))
def test_sparse_unpack_in_c_is_the_numpy_decode(word, gap_width, k, extra, fault, seed):
    """The C unpacking of a sparse record (positions from gaps, values from byte planes) gives
    the numpy decode's positions and values bit for bit, and refuses what it refuses with the
    same error: a gap of the box's size or more, or positions that run past the box."""
    from dcr_log import native

    if native.changes is None:
        pytest.skip("the C kernels are not built")
    n = k + extra
    payload = _sparse_body(np.random.default_rng(seed), k, n, gap_width, word, fault)
    params = {"level": 1, "gap_bytes": gap_width}
    outcomes = []
    for kernels in (native.changes, None):
        try:
            with pytest.MonkeyPatch.context() as m:
                m.setattr(native, "changes", kernels)
                got = decode_changes("xor", "sparse", params, payload, n, k, word)
        except IntegrityError as exc:
            outcomes.append(("refused", str(exc)))
        else:
            assert got.positions.dtype == np.int64 and got.values.dtype == word
            outcomes.append((got.positions.tobytes(), got.values.tobytes()))
    assert outcomes[0] == outcomes[1]
    if fault == "none":
        assert outcomes[0][0] != "refused"
