"""The ulp-rans encoding (spec/FORMAT.md section 11): the C coder against the plain-Python
coder written from the spec (tools/rans_spec.py), byte for byte and check for check.

- every word width, 1 to thousands of changes, gaps up to 2^40, distances from 1 unit to
  the whole word (NaN payloads, -0.0 and +0.0, infinities): the same payload from both
  coders, and both decode it to the positions and distances that went in;
- damaged payloads (a bit flipped, bytes cut, added or replaced): the C decoder accepts
  exactly those the spec's decoder accepts, with the same values; it never writes outside
  its outputs (the outputs are guarded);
- one test per reader check, each on a payload that breaks only that rule;
- every one of these on each path of the C coder that the CPU can take (scalar, AVX2,
  AVX-512: dcr_log._rans.CODER_PATHS), which write the same payloads and read the same
  values.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dcr_log import _rans
from dcr_log.codec import ChangeSet, decode_changes
from dcr_log.codec.ulp import step_from, ulp_distance
from dcr_log.codec.ulp_rans import UlpRansEncoding
from dcr_log.errors import IntegrityError
from helpers.cpu import x86_flags

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import rans_spec  # noqa: E402

WIDTHS = (1, 2, 4, 8)
PATHS = _rans.CODER_PATHS  # 0 scalar, 1 AVX2, 2 AVX-512: those this CPU has


def word(width: int) -> np.dtype:
    return np.dtype(f"<u{width}")


def c_encode(positions: np.ndarray, base: np.ndarray, new: np.ndarray, path: int | None = PATHS[-1]) -> bytes:
    """The payload on ``path``, or on every path (None), checked to be the same on each."""
    k = positions.size
    out = np.empty(_rans.bound(k), np.uint8)
    scratch = np.empty(_rans.scratch(k), np.uint8)
    payloads = set()
    for p in PATHS if path is None else (path,):
        payloads.add(out[:_rans.encode(positions.astype(np.int64), base, new, base.itemsize, out, scratch,
                                       p)].tobytes())
    assert len(payloads) == 1
    return payloads.pop()


# An origin (a row block's flat start) the decoder adds to every position it writes.
ORIGIN = (3 << 40) + 17


def c_decode_path(payload: bytes, n: int, k: int, width: int, path: int, origin: int = 0):
    """(code, positions, distances); the outputs sit between guard words that must survive.
    Decoded again with an origin (where the result still fits in 64 bits): the same code,
    and on success the same distances and each position plus the origin."""
    guard = 0x5A
    pos = np.full(k + 2, guard, np.int64)
    dist = np.full(k + 16, guard, word(width))
    code = _rans.decode(payload, n, k, width, pos[1:-1], dist[8:-8], path, origin=origin)
    assert (pos[[0, -1]] == guard).all() and (dist[:8] == guard).all() and (dist[-8:] == guard).all()
    if origin == 0 and n <= np.iinfo(np.int64).max - ORIGIN:
        far_code, far_pos, far_dist = c_decode_path(payload, n, k, width, path, ORIGIN)
        assert far_code == code
        if code == 0:
            assert np.array_equal(far_pos, pos[1:-1] + ORIGIN) and np.array_equal(far_dist, dist[8:-8])
    return code, pos[1:-1], dist[8:-8]


def c_decode(payload: bytes, n: int, k: int, width: int):
    """c_decode_path on every path: the same code, and on success the same values."""
    results = [c_decode_path(payload, n, k, width, path) for path in PATHS]
    code, pos, dist = results[-1]
    for other_code, other_pos, other_dist in results[:-1]:
        assert other_code == code
        if code == 0:
            assert np.array_equal(other_pos, pos) and np.array_equal(other_dist, dist)
    return code, pos, dist


def spec_decode(payload: bytes, n: int, k: int, width: int):
    try:
        return rans_spec.decode(payload, n, k, width)
    except rans_spec.SpecError:
        return None


# -- inputs ---------------------------------------------------------------------------------


@st.composite
def records(draw, max_k: int = 200):
    """(n, positions, base words, new words, width): every change a real change."""
    width = draw(st.sampled_from(WIDTHS))
    bits = 8 * width
    k = draw(st.integers(1, max_k))
    spread = draw(st.sampled_from(["dense", "sparse", "huge"]))
    if spread == "dense":
        n = draw(st.integers(k, k + 10))
    elif spread == "sparse":
        n = draw(st.integers(k, 100 * k + 1000))
    else:  # gaps beyond 2^32
        n = draw(st.integers(k << 33, (k << 33) + (1 << 40)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if n <= 1 << 24:
        positions = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    else:
        positions = np.unique(rng.integers(0, n, k, dtype=np.int64))
        k = positions.size
    mask = (1 << bits) - 1
    base = rng.integers(0, mask, k, dtype=np.uint64, endpoint=True).astype(word(width))
    special = np.array([0, 1 << (bits - 1), mask, (1 << (bits - 1)) - 1, mask >> 1, 1], np.uint64)
    pick = rng.random(k) < 0.2
    base[pick] = special[rng.integers(0, special.size, int(pick.sum()))].astype(word(width))
    # Distances: mostly a unit or two, some far, some the extremes of the word.
    kinds = rng.choice(4, k, p=[0.7, 0.15, 0.1, 0.05])
    small = rng.choice([-3, -2, -1, 1, 2, 3], k)
    far = rng.integers(-(1 << min(bits - 2, 40)), 1 << min(bits - 2, 40), k)
    far[far == 0] = 5
    extreme = rng.choice([-(1 << (bits - 1)), (1 << (bits - 1)) - 1, -(1 << (bits - 1)) + 1], k)
    d = np.where(kinds == 0, small, np.where(kinds == 1, far, np.where(kinds == 2, small * 1000 + 1, extreme)))
    d_words = (d.astype(object) % (1 << bits)).astype(np.uint64).astype(word(width))
    new = step_from(base, d_words)
    assume(bool((new != base).all()))
    return n, positions, base, new, width


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_c_and_spec_coders_agree_byte_for_byte(record):
    n, positions, base, new, width = record
    payload = c_encode(positions, base, new, None)
    spec = rans_spec.encode(positions.tolist(), base.astype(np.uint64).tolist(), new.astype(np.uint64).tolist(),
                            width)
    assert payload == spec
    code, pos, dist = c_decode(payload, n, positions.size, width)
    assert code == 0
    assert np.array_equal(pos, positions)
    assert np.array_equal(dist, ulp_distance(base, new))
    got = rans_spec.decode(payload, n, positions.size, width)
    assert got == (positions.tolist(), ulp_distance(base, new).astype(np.uint64).tolist())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records(max_k=4000), st.integers(0, 5), st.integers(0, 1 << 30), st.integers(0, 1 << 30))
def test_long_records_agree_intact_and_damaged(record, how, where, value):
    """Records of thousands of changes: the C coder's vector passes (those the CPU has; their
    blocks of 4 or 8 changes, and the scalar blocks beside them) against the spec's."""
    n, positions, base, new, width = record
    payload = c_encode(positions, base, new, None)
    spec = rans_spec.encode(positions.tolist(), base.astype(np.uint64).tolist(), new.astype(np.uint64).tolist(),
                            width)
    assert payload == spec
    k = positions.size
    code, pos, dist = c_decode(payload, n, k, width)
    assert code == 0 and np.array_equal(pos, positions) and np.array_equal(dist, ulp_distance(base, new))
    damaged = _mutate(payload, how, where, value)
    code, pos, dist = c_decode(damaged, n, k, width)
    got = spec_decode(damaged, n, k, width)
    assert (code == 0) == (got is not None)
    if got is not None:
        assert pos.tolist() == got[0] and dist.astype(np.uint64).tolist() == got[1]


def _mutate(payload: bytes, how: int, where: int, value: int) -> bytes:
    data = bytearray(payload)
    at = where % len(data)
    if how == 0:
        data[at] ^= 1 << (value % 8)
    elif how == 1:
        data[at] = value % 256
    elif how == 2:
        del data[at:]
    elif how == 3:
        data[at:at] = bytes([value % 256]) * (1 + value % 3)
    elif how == 4:
        del data[at:at + 1 + value % 4]
    else:  # one of the stream lengths or the bit stream's length moved by a little
        field = value % 4
        blen = int.from_bytes(data[:8], "little")
        if field == 0:
            data[:8] = (blen + (value % 5) - 2).to_bytes(8, "little", signed=True)
        else:
            data[at] ^= 0x80
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records(max_k=60), st.integers(0, 5), st.integers(0, 1 << 30), st.integers(0, 1 << 30))
def test_damaged_payloads_are_refused_exactly_as_the_spec_says(record, how, where, value):
    """The C decoder and the spec's agree on every damaged payload: both refuse it, or both
    read the same positions and distances from it (a flipped extra bit is still a valid
    payload: the record's digests catch it, as for every encoding)."""
    n, positions, base, new, width = record
    damaged = _mutate(c_encode(positions, base, new, None), how, where, value)
    k = positions.size
    code, pos, dist = c_decode(damaged, n, k, width)
    spec = spec_decode(damaged, n, k, width)
    assert (code == 0) == (spec is not None), (code, how)
    if spec is not None:
        assert pos.tolist() == spec[0] and dist.astype(np.uint64).tolist() == spec[1]


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=300), st.integers(1, 40), st.sampled_from(WIDTHS))
def test_arbitrary_bytes_never_crash_and_agree(data, k, width):
    n = 1000
    code, _, _ = c_decode(data, n, k, width)
    assert (code == 0) == (spec_decode(data, n, k, width) is not None)


# -- one test per reader check ---------------------------------------------------------------


def _sample(width: int = 2, k: int = 50, n: int = 4000, seed: int = 1):
    rng = np.random.default_rng(seed)
    positions = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    base = rng.integers(0x3C00, 0x3E00, k).astype(word(width))
    d = rng.choice([-2, -1, 1, 1, 2, 700], k).astype(np.int64)
    new = step_from(base, (d.astype(object) % (1 << (8 * width))).astype(np.uint64).astype(word(width)))
    return n, positions, base, new


def _parts(payload: bytes) -> dict:
    """Offsets of the payload's parts (FORMAT.md section 11)."""
    blen = int.from_bytes(payload[:8], "little")
    at = 8 + blen
    tables = []
    for _ in range(2):
        count = sum(bin(b).count("1") for b in payload[at:at + 32])
        tables.append(at)
        at += 32 + 2 * count
    lengths = [int.from_bytes(payload[at + 4 * j:at + 4 * j + 4], "little") for j in range(3)]
    return {"blen": blen, "tables": tables, "lengths_at": at, "streams_at": at + 12, "lengths": lengths}


def _refused(payload: bytes, n: int, k: int, width: int = 2, match: str | None = None) -> None:
    with pytest.raises(IntegrityError, match=match):
        decode_changes("xor", "ulp-rans", {}, payload, n, k, word(width))
    assert spec_decode(payload, n, k, width) is None
    assert c_decode(payload, n, k, width)[0] != 0  # on every path


def test_a_valid_sample_reads_back():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    got = decode_changes("xor", "ulp-rans", {}, payload, n, positions.size, word(2))
    assert got.relative and np.array_equal(got.positions, positions)
    assert np.array_equal(step_from(base, got.values), new)
    # With an origin, the C decoder writes each position plus it (no second array).
    at = decode_changes("xor", "ulp-rans", {}, payload, n, positions.size, word(2), origin=n)
    assert at.origin == n and np.array_equal(at.positions, positions + n)
    assert np.array_equal(at.values, got.values)


def test_refuses_a_bit_stream_length_past_the_payload():
    n, positions, base, new = _sample()
    payload = bytearray(c_encode(positions, base, new))
    payload[:8] = (len(payload)).to_bytes(8, "little")
    _refused(bytes(payload), n, positions.size, match="bit stream's length")


def test_refuses_nonzero_padding_and_extra_bit_stream_bytes():
    n, positions, base, new = _sample(k=7)
    payload = c_encode(positions, base, new)
    parts = _parts(payload)
    gaps = np.diff(positions, prepend=-1) - 1
    us = [rans_spec.zigzag(rans_spec.distance(int(b), int(t), 16)) - 1 for b, t in zip(base, new)]
    used = sum(rans_spec.to_bin(v)[1] for v in [*gaps, *us])
    assert parts["blen"] == (used + 7) // 8 and used % 8, "the sample must leave padding bits"
    padded = bytearray(payload)
    padded[8 + parts["blen"] - 1] |= 0x80
    _refused(bytes(padded), n, positions.size, match="zero-padded")
    longer = payload[:8 + parts["blen"]] + b"\x00" + payload[8 + parts["blen"]:]
    longer = (parts["blen"] + 1).to_bytes(8, "little") + longer[8:]
    _refused(longer, n, positions.size, match="zero-padded")


@pytest.mark.parametrize("which", [0, 1])
def test_refuses_tables_that_break_the_rules(which):
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    at = _parts(payload)["tables"][which]
    what = "gap" if which == 0 else "distance"
    sum_off = bytearray(payload)
    sum_off[at + 32] ^= 1  # the first frequency, so that they no longer sum to 4096
    _refused(bytes(sum_off), n, positions.size, match=f"{what} table")
    zero = bytearray(payload)
    first = int.from_bytes(zero[at + 32:at + 34], "little")
    zero[at + 32:at + 34] = b"\x00\x00"
    second = int.from_bytes(zero[at + 34:at + 36], "little")
    zero[at + 34:at + 36] = (second + first).to_bytes(2, "little")  # the sum holds, one is 0
    _refused(bytes(zero), n, positions.size, match=f"{what} table")
    high = bytearray(payload)
    high[at + 31] |= 0x20  # symbol 253
    _refused(bytes(high), n, positions.size, match=f"{what} table")


def test_refuses_a_state_below_the_interval_and_a_wrong_final_state():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    at = _parts(payload)["streams_at"]
    low = bytearray(payload)
    low[at:at + 4] = (0xFFFF).to_bytes(4, "little")
    _refused(bytes(low), n, positions.size, match="initial states")
    moved = bytearray(payload)
    state = int.from_bytes(moved[at:at + 4], "little")
    moved[at:at + 4] = (state ^ 1).to_bytes(4, "little")
    _refused(bytes(moved), n, positions.size)


def test_refuses_a_word_left_over_and_an_odd_stream():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    _refused(payload + b"\x00\x00", n, positions.size, match="final state")
    _refused(payload + b"\x00", n, positions.size, match="lengths")
    parts = _parts(payload)
    shifted = bytearray(payload)
    shifted[parts["lengths_at"]:parts["lengths_at"] + 4] = (parts["lengths"][0] + 2).to_bytes(4, "little")
    _refused(bytes(shifted), n, positions.size)


def test_refuses_gaps_past_the_box():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    last = int(positions[-1])
    _refused(payload, last, positions.size, match="beyond the box")  # the last position is n
    assert decode_changes("xor", "ulp-rans", {}, payload, last + 1, positions.size, word(2)).k == positions.size
    # A record of thousands: the first position past the box lies in a vector block (the
    # blocks near the stream's end take the scalar pass), its gap still within the box.
    n, positions, base, new = _sample(k=3000, n=40000)
    payload = c_encode(positions, base, new)
    for cut in (1000, 1001, 1002, 1003):
        _refused(payload, int(positions[cut]), positions.size, match="beyond the box")


def test_refuses_a_distance_wider_than_the_word():
    rng = np.random.default_rng(3)
    positions = np.arange(0, 40, 4, dtype=np.int64)
    base = rng.integers(0, 1 << 16, positions.size).astype(np.uint16)
    new = step_from(base, np.full(positions.size, 300, np.uint16))  # 300 units: past an I8 word
    payload = c_encode(positions, base, new)
    _refused(payload, 40, positions.size, width=1, match="does not fit the word")
    one = c_encode(positions, base.astype(np.uint8), step_from(base.astype(np.uint8), np.full(positions.size, 0x80,
                                                                                          np.uint8)))
    got = decode_changes("xor", "ulp-rans", {}, one, 40, positions.size, word(1))
    assert (got.values == 0x80).all()  # -128: the widest 1-byte distance reads back
    # One distance past a 2-byte word among thousands (in a vector block: the blocks near the
    # stream's end take the scalar pass).
    n, positions, base, new = _sample(width=4, k=3000, n=40000)
    new[1000] = step_from(base[1000:1001], np.array([1 << 20], np.uint32))[0]
    _refused(c_encode(positions, base, new), n, positions.size, width=2, match="does not fit the word")


def test_refuses_a_position_past_the_box_whose_sum_wraps_back():
    """Positions past the box (each gap within it) in vector blocks, after which the sums wrap
    past 2^64 back into the box: only those blocks' position checks can refuse them. (The
    vector passes take gaps of up to 53 extra bits: 257 gaps of 2^56 - 1 go past 2^64.)"""
    n = (1 << 63) - 1  # the largest box a reader takes
    positions = [10 * i for i in range(1000)]
    for _ in range(257):
        positions.append(positions[-1] + (1 << 56))
    assert positions[-1] % (1 << 64) < n < max(positions[:-1])
    positions += [positions[-1] + 10 * (i + 1) for i in range(2000)]
    k = len(positions)
    rng = np.random.default_rng(5)
    base = rng.integers(0x3C00, 0x3E00, k).astype(np.uint16)
    new = step_from(base, np.full(k, 1, np.uint16))
    payload = rans_spec.encode(positions, base.tolist(), new.tolist(), 2)
    _refused(payload, n, k, match="beyond the box")


def test_refuses_params_and_an_overwrite_record():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    with pytest.raises(IntegrityError, match="unknown parameter"):
        decode_changes("xor", "ulp-rans", {"level": 1}, payload, n, positions.size, word(2))
    with pytest.raises(IntegrityError, match="cannot carry records of kind 'overwrite'"):
        decode_changes("overwrite", "ulp-rans", {}, payload, n, positions.size, word(2))


def test_refuses_fewer_changes_than_the_payload_holds():
    n, positions, base, new = _sample()
    payload = c_encode(positions, base, new)
    _refused(payload, n, positions.size - 1)
    _refused(payload, n, positions.size + 1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("width", WIDTHS)
def test_writer_refuses_what_is_not_a_change_set(path, width):
    """On every path, wherever in a vector block the fault lies: positions out of order, one
    repeated, a negative first one, or a position whose words are equal."""
    n, positions, base, new = _sample(width)
    for at in (0, 1, 2, 3, 5, 8, 13, 47):
        wrong = positions.copy()
        wrong[at], wrong[at + 1] = wrong[at + 1], wrong[at]
        with pytest.raises(ValueError, match="increasing"):
            c_encode(wrong, base, new, path)
        wrong = positions.copy()
        wrong[at + 1] = wrong[at]
        with pytest.raises(ValueError, match="increasing"):
            c_encode(wrong, base, new, path)
        same = new.copy()
        same[at] = base[at]
        with pytest.raises(ValueError, match="equal"):
            c_encode(positions, base, same, path)
    wrong = positions.copy()
    wrong[0] = -1
    with pytest.raises(ValueError, match="increasing"):
        c_encode(wrong, base, new, path)
    with pytest.raises(ValueError, match="path"):
        c_encode(positions, base, new, -1)
    with pytest.raises(ValueError, match="path"):
        _rans.decode(c_encode(positions, base, new), n, positions.size, width, np.empty(positions.size, np.int64),
                     np.empty(positions.size, word(width)), -1)
    # An origin below 0, or one that a position could carry past 2^63 - 1, is refused; the
    # largest that cannot is taken.
    top = int(np.iinfo(np.int64).max) - n
    got = np.empty(positions.size, np.int64)
    assert _rans.decode(c_encode(positions, base, new), n, positions.size, width, got,
                        np.empty(positions.size, word(width)), origin=top) == 0
    assert np.array_equal(got - top, positions)
    for origin in (-1, np.iinfo(np.int64).max - n + 1):
        with pytest.raises(ValueError, match="origin"):
            _rans.decode(c_encode(positions, base, new), n, positions.size, width,
                         np.empty(positions.size, np.int64), np.empty(positions.size, word(width)), origin=origin)


@pytest.mark.parametrize("width", WIDTHS)
def test_far_gaps_and_long_extra_bits_agree_with_the_spec(width):
    """The blocks the AVX2 pass hands to the scalar steps: gaps of 2^52 and more (beyond what
    its bit lengths are exact for), and changes of more than 56 extra bits (a far gap and a
    far distance), each beside ordinary changes in the same block of 4."""
    rng = np.random.default_rng(width)
    bits = 8 * width
    gaps = rng.choice([0, 1, 5, 300, (1 << 40) + 7, (1 << 52) - 2, (1 << 52) - 1, 1 << 52, (1 << 53) + 3], 64)
    positions = np.cumsum(gaps + 1) - 1
    k = positions.size
    base = rng.integers(0, 1 << bits, k, dtype=np.uint64).astype(word(width))
    d = rng.choice([1, -1, 3, (1 << (bits - 2)) - 1, -(1 << (bits - 2))], k)
    new = step_from(base, (d.astype(object) % (1 << bits)).astype(np.uint64).astype(word(width)))
    payload = c_encode(positions, base, new, None)
    assert payload == rans_spec.encode(positions.tolist(), base.astype(np.uint64).tolist(),
                                       new.astype(np.uint64).tolist(), width)
    code, pos, dist = c_decode(payload, int(positions[-1]) + 1, k, width)
    assert code == 0 and np.array_equal(pos, positions) and np.array_equal(dist, ulp_distance(base, new))


def test_the_coder_paths_are_there_for_the_cpu():
    """On x86-64 the coder's vector passes are built, and picked for the CPU's flags: AVX2
    (with BMI2) 1, AVX-512 (F, BW, VL, DQ, CD) 2."""
    assert PATHS[0] == 0 and list(PATHS) == list(range(len(PATHS)))
    flags = x86_flags()
    if flags:
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "bmi2"} <= flags
        assert PATHS[-1] == (2 if avx512 else 1 if {"avx2", "bmi2"} <= flags else 0)


def test_a_bin_of_frequency_one():
    """One change in 20000 with its own gap bin and distance bin: frequency 1 (the
    encoder's reciprocal is 2^64 - 1 there, made up by its bias), byte for byte the spec's."""
    k = 20000
    positions = np.arange(k, dtype=np.int64) * 3
    positions[-1] = positions[-2] + 100_000  # the one long gap
    base = np.full(k, 0x3F80, np.uint16)
    d = np.ones(k, np.uint16)
    d[k // 2] = 5000  # the one far distance
    new = step_from(base, d)
    payload = c_encode(positions, base, new)
    tables = _parts(payload)["tables"]
    for at in tables:
        count = sum(bin(b).count("1") for b in payload[at:at + 32])
        freqs = np.frombuffer(payload[at + 32:at + 32 + 2 * count], "<u2")
        assert 1 in freqs and freqs.sum() == 4096
    assert payload == rans_spec.encode(positions.tolist(), base.tolist(), new.tolist(), 2)
    code, pos, dist = c_decode(payload, int(positions[-1]) + 1, k, 2)
    assert code == 0 and np.array_equal(pos, positions) and np.array_equal(dist, d)


def test_a_record_too_large_for_its_length_fields_takes_another_encoding(monkeypatch):
    """Stream lengths are 32-bit: the writer does not offer ulp-rans for a record of 2^31
    changes or more (MAX_CHANGES, made small here), and the coder refuses such streams."""
    from dcr_log.codec import ulp_rans
    from dcr_log.state import TensorBits
    from dcr_log.write.differ import Differ, EncodePolicy

    rng = np.random.default_rng(5)
    base = rng.integers(0x3C00, 0x3E00, 4096).astype(np.uint16)
    new = base.copy()
    new[::20] += np.uint16(1)
    differ = Differ(EncodePolicy(workers=1), features=("rans-encoding",))
    (rec,) = differ.diff("w", TensorBits("BF16", (4096,), base), TensorBits("BF16", (4096,), new))
    assert rec.encoding == "ulp-rans"
    monkeypatch.setattr(ulp_rans, "MAX_CHANGES", rec.n_changed - 1)
    (rec,) = differ.diff("w", TensorBits("BF16", (4096,), base), TensorBits("BF16", (4096,), new))
    assert rec.encoding != "ulp-rans"


def test_encoding_takes_distances_without_the_words():
    """A relative change set (distances, as a squash composes them) encodes to the payload of
    the words it stands for."""
    n, positions, base, new = _sample()
    distances = ulp_distance(base, new)
    enc = UlpRansEncoding()
    from_words = enc.encode("xor", ChangeSet(n, positions, base ^ new), base=base, new=new)
    from_distances = enc.encode("xor", ChangeSet(n, positions, distances, relative=True))
    assert from_words == from_distances


def test_the_payload_is_no_larger_than_its_bound_in_the_worst_case():
    """Every change with a gap of 2^40 and the widest distance (2^63 - 1 units: 61 extra
    bits): the bound the writer allocates holds."""
    k = 64
    positions = np.array([(1 << 40) * (i + 1) - 1 for i in range(k)], dtype=np.int64)
    base = np.zeros(k, np.uint64)
    new = step_from(base, np.full(k, (1 << 63) - 1, np.uint64))
    payload = c_encode(positions, base, new)
    assert len(payload) <= _rans.bound(k)
    assert rans_spec.decode(payload, 1 << 47, k, 8)[0] == positions.tolist()
    assert struct.unpack("<Q", payload[:8])[0] > 0
