"""Acceptance properties: every version of a log materializes to its dense state, bit for bit.

Random state sequences over every dtype, odd shapes, special float bit patterns, change rates
from 0 to 100%, tensors added, removed, reshaped and retyped, both append kinds, small chunks
and small segments, numpy / torch / word inputs, through the Python API and through the CLI.
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_log import DeltaLog, LogWriter, UsageError, create_log, state_equal, to_bits
from dcr_log.checkpoint import save_safetensors
from dcr_log.state import TensorBits, to_torch
from dcr_log.write.differ import EncodePolicy
from dcr_log.write.writer import DEFAULT_SEGMENT_BYTES
from helpers import (
    ALL_DTYPES,
    NUMPY_DTYPE,
    SPECIAL_WORDS,
    assert_file_holds,
    assert_same_bits,
    change_words,
    copy_state,
    make_bits,
    run_cli,
)

NAMES = ("a", "b.weight", "model.layers.0.mlp.up_proj.weight", "Z", "é", "名前", "x.y:z")
TORCH_DTYPE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}

shapes = st.one_of(
    st.sampled_from([(), (0,), (0, 3), (3, 0), (1,), (7,), (13, 5), (3, 1, 11), (2, 257), (600,)]),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
)
rates = st.one_of(st.sampled_from([0.0, 0.002, 0.01, 0.05, 0.3, 1.0]), st.floats(0, 1))
specs = st.tuples(st.sampled_from(ALL_DTYPES), shapes)


def _as_input(bits: TensorBits, form: str):
    """The same bits as a numpy array (C, Fortran or big-endian layout), a torch tensor or words."""
    if form == "torch":
        return torch.from_numpy(bits.words.copy()).view(TORCH_DTYPE[bits.dtype]).reshape(bits.shape)
    np_dtype = NUMPY_DTYPE.get(bits.dtype)
    if form == "bits" or np_dtype is None:
        return bits
    arr = bits.words.copy().view(np_dtype).reshape(bits.shape)
    if form == "fortran" and arr.ndim >= 2:  # asfortranarray would turn a 0-d array into 1-d
        return np.asfortranarray(arr)
    if form == "big-endian":  # built by swapping bytes, so no float operation touches the bits
        return arr.byteswap().view(arr.dtype.newbyteorder(">"))
    return arr


def _next_state(data, rng, state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    new = {}
    for name, bits in state.items():
        op = data.draw(st.sampled_from(["change", "change", "change", "remove", "reshape", "retype"]))
        if op == "change":
            new[name] = change_words(rng, bits, data.draw(rates))
        elif op == "reshape":
            new[name] = make_bits(rng, bits.dtype, data.draw(shapes))
        elif op == "retype":
            dtype = data.draw(st.sampled_from([d for d in ALL_DTYPES if d != bits.dtype]))
            # Sometimes the same number of elements and word width (F16 -> BF16, I32 -> U32 ...).
            new[name] = make_bits(rng, dtype, bits.shape if data.draw(st.booleans()) else data.draw(shapes))
    for name in data.draw(st.lists(st.sampled_from(NAMES), max_size=2, unique=True)):
        if name not in new:
            dtype, shape = data.draw(specs)
            new[name] = make_bits(rng, dtype, shape)
    return new


def _expected_stats(base: dict[str, TensorBits], new: dict[str, TensorBits]) -> tuple[int, int]:
    """(changed elements, total elements): a whole tensor counts as changed when it is new,
    reshaped or retyped; otherwise the words that differ."""
    changed = 0
    for name, bits in new.items():
        old = base.get(name)
        if old is None or (old.dtype, old.shape) != (bits.dtype, bits.shape):
            changed += bits.words.size
        else:
            changed += int(np.count_nonzero(old.words != bits.words))
    return changed, sum(b.words.size for b in new.values())


def _check_log(location, expected: list[dict[str, TensorBits]], rng) -> None:
    log = DeltaLog.open(location)
    assert log.versions() == list(range(len(expected)))
    for v, state in log.replay():
        assert_same_bits(state, expected[v])
        assert state_equal(state, expected[v])
    for v in {len(expected) - 1, int(rng.integers(0, len(expected)))}:
        assert_same_bits(DeltaLog.open(location).materialize(v), expected[v])
    report = log.verify(deep=True)
    assert report.versions == len(expected)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_every_version_materializes_bit_exactly(data):
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    policy = EncodePolicy(chunk_elements=data.draw(
        st.one_of(st.sampled_from([1, 16, 1 << 25]), st.integers(2, 300)), label="chunk_elements"))
    segment_bytes = data.draw(st.sampled_from([1, 200, 4096, DEFAULT_SEGMENT_BYTES]), label="segment_bytes")
    where = data.draw(st.sampled_from(["memory", "local"]), label="store")
    n_versions = data.draw(st.integers(1, 5), label="versions")

    first = {}
    for name in data.draw(st.lists(st.sampled_from(NAMES), min_size=0, max_size=4, unique=True)):
        dtype, shape = data.draw(specs)
        first[name] = make_bits(rng, dtype, shape)

    with tempfile.TemporaryDirectory() as tmp:
        location = f"memory://prop-{uuid.uuid4().hex}" if where == "memory" else str(Path(tmp) / "log")
        kwargs = dict(policy=policy, segment_bytes=segment_bytes)
        expected = [copy_state(first)]
        writer = create_log(location, {k: _as_input(v, "bits") for k, v in first.items()}, **kwargs)
        state = first
        for version in range(1, n_versions):
            new = _next_state(data, rng, state)
            form = data.draw(st.sampled_from(["bits", "numpy", "fortran", "big-endian", "torch"]), label="input")
            kind = data.draw(st.sampled_from(["xor", "overwrite"]), label="kind")
            if data.draw(st.booleans(), label="reopen writer"):
                writer = LogWriter.open(location, **kwargs)
            assert writer.version == version - 1
            # The drawn states add, drop, reshape and retype tensors: refused without the flag.
            table = lambda s: {k: (b.dtype, b.shape) for k, b in s.items()}
            relaid = table(new) != table(state)
            if relaid:
                with pytest.raises(UsageError, match=f"version {version} would change the tensor table"):
                    writer.append({k: _as_input(v, form) for k, v in new.items()}, kind=kind)
            commit = writer.append({k: _as_input(v, form) for k, v in new.items()}, kind=kind,
                                   allow_layout_change=relaid)
            assert commit.version == version and commit.parent == version - 1
            assert (commit.stats.changed_elements, commit.stats.total_elements) == _expected_stats(state, new)
            assert sum(s.records for s in commit.segments) == commit.stats.records
            if segment_bytes == 1:  # every record closes its segment
                assert all(s.records == 1 for s in commit.segments)
            kinds = {r.kind for r in DeltaLog.open(location).records(version)}
            assert kinds <= {kind, "tensor"}
            expected.append(copy_state(new))
            state = new
        _check_log(location, expected, rng)


@pytest.mark.parametrize("where", ["memory", "local"])
def test_special_float_patterns_survive_every_path(where, tmp_path):
    """Every special word of every float dtype, changed into every other one, in both kinds."""
    location = f"memory://special-{uuid.uuid4().hex}" if where == "memory" else tmp_path / "log"
    base, target = {}, {}
    for dtype, specials in SPECIAL_WORDS.items():
        word = make_bits(np.random.default_rng(0), dtype, (1,)).words.dtype
        s = np.array(specials, dtype=word)
        # All ordered pairs (a, b): position i goes from a to b.
        a, b = np.repeat(s, s.size), np.tile(s, s.size)
        base[dtype] = TensorBits(dtype, (a.size,), a)
        target[dtype] = TensorBits(dtype, (b.size,), b)
    writer = create_log(location, base, policy=EncodePolicy(chunk_elements=7), segment_bytes=64)
    writer.append(target, kind="xor")
    writer.append(base, kind="overwrite")
    writer.append({k: _as_input(v, "torch") for k, v in target.items()}, kind="overwrite")
    writer.append({k: _as_input(v, "numpy") for k, v in base.items()}, kind="xor")
    _check_log(location, [base, target, base, target, base], np.random.default_rng(1))


@pytest.mark.parametrize("features, delta_encoding", [(("rans-encoding", "sum-digests"), "ulp-rans"),
                                                      (("sum-digests", "ulp-encoding"), "ulp"),
                                                      (("sum-digests",), "sparse")])
def test_all_encodings_and_kinds_are_exercised(tmp_path, features, delta_encoding):
    """A designed sequence whose records use every encoding and kind, still bit-exact: in a
    new log (ulp-rans wins the sparse changes), in a log of the feature ulp-encoding (ulp
    does) and in one without either."""
    rng = np.random.default_rng(5)
    n = 20000
    base = {"w": TensorBits("BF16", (n,), rng.integers(0x3C00, 0x3D00, n, dtype=np.uint16)),
            "one": TensorBits("F32", (), np.array([1], np.uint32))}
    states = [base]
    s = copy_state(base)
    s["w"].words[rng.choice(n, n // 100, replace=False)] ^= 1       # 1%: ulp (or sparse) wins
    s["one"].words[0] ^= 0x80000000                                  # one word: raw wins
    states.append(copy_state(s))
    s["w"].words[rng.random(n) < 0.7] ^= 1                            # 70% +-1 ulp: dense wins
    states.append(copy_state(s))
    s["new"] = TensorBits("U8", (3000,), np.zeros(3000, np.uint8))     # compressible new tensor
    s["w2"] = make_bits(rng, "F16", (5,))                             # incompressible new tensor
    states.append(copy_state(s))
    s["w"].words[: n // 2] += 1
    states.append(copy_state(s))
    writer = create_log(tmp_path / "log", states[0], features=features)
    for i, state in enumerate(states[1:]):
        writer.append(state, kind="overwrite" if i == 3 else "xor", allow_layout_change=i == 2)
    log = DeltaLog.open(tmp_path / "log")
    used = {(r.kind, r.encoding) for v in log.versions() for r in log.records(v)}
    assert {("xor", delta_encoding), ("xor", "raw"), ("xor", "dense"), ("tensor", "raw"),
            ("tensor", "dense"), ("overwrite", "sparse")} <= used
    if delta_encoding == "sparse":
        assert all(enc not in ("ulp", "ulp-rans") for _, enc in used)
    assert any(kind == "overwrite" for kind, _ in used)
    _check_log(tmp_path / "log", states, rng)


# -- torch ------------------------------------------------------------------------------------

def _torch_words(t: torch.Tensor) -> np.ndarray:
    """The reference word view of a torch tensor: its bytes reinterpreted as unsigned words."""
    width = t.element_size()
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return raw.view(f"<u{width}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool,
                                   torch.float16, torch.float32, torch.uint16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "0-d", "empty"])
def test_torch_inputs_give_their_word_view(dtype, layout, tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen) * 300
    if dtype == torch.bool:
        x = x > 0
    elif dtype == torch.uint16:
        x = (x.abs() * 100).to(torch.int32).to(torch.uint16)
    else:
        x = x.to(dtype)
    x = {"contiguous": x, "transposed": x.T, "0-d": x[1, 2], "empty": x[:0]}[layout]
    bits = to_bits(x)
    assert bits.shape == tuple(x.shape)
    assert bits.words.dtype == np.dtype(f"<u{x.element_size()}")
    assert np.array_equal(bits.words, _torch_words(x))
    # The log stores and returns those very bits, and to_torch rebuilds an identical tensor.
    writer = create_log(tmp_path / "log", {"x": x})
    y = x.contiguous().clone()
    if y.numel():
        y.reshape(-1).view(torch.uint8)[0] ^= 1  # one bit of the first element
        assert not np.array_equal(_torch_words(y), _torch_words(x))
    writer.append({"x": y})
    for v, t in enumerate([x, y]):
        got = DeltaLog.open(tmp_path / "log").materialize(v)["x"]
        assert np.array_equal(got.words, _torch_words(t))
        back = to_torch(got)
        assert back.dtype == t.dtype and back.shape == t.shape
        as_bytes = lambda x: x.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(as_bytes(back), as_bytes(t))


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F8_E5M2", "F16", "F32", "F64"])
def test_torch_nan_payloads_and_signed_zero_preserved(dtype):
    specials = SPECIAL_WORDS[dtype]
    bits = TensorBits(dtype, (len(specials),), np.array(specials, dtype=make_bits(
        np.random.default_rng(0), dtype, (1,)).words.dtype))
    t = _as_input(bits, "torch")
    assert np.array_equal(to_bits(t).words, bits.words)
    assert np.array_equal(_torch_words(to_torch(bits)), bits.words)


# -- through the CLI --------------------------------------------------------------------------

@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_cli_versions_replay_bit_exactly(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    cli_shapes = st.sampled_from([(), (0,), (3, 0), (1,), (7,), (13, 5), (3, 1, 11), (700,)])
    state = {}
    for name in data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True)):
        state[name] = make_bits(rng, data.draw(st.sampled_from(ALL_DTYPES)), data.draw(cli_shapes))
    states = [state]
    for _ in range(2):
        new = {}
        for name, bits in states[-1].items():
            if data.draw(st.booleans()):
                new[name] = change_words(rng, bits, data.draw(rates))
            elif data.draw(st.booleans()):
                new[name] = make_bits(rng, data.draw(st.sampled_from(ALL_DTYPES)), data.draw(cli_shapes))
        if data.draw(st.booleans()) or not new:
            new[data.draw(st.sampled_from(NAMES))] = make_bits(
                rng, data.draw(st.sampled_from(ALL_DTYPES)), data.draw(cli_shapes))
        states.append(new)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for v, s in enumerate(states):
            save_safetensors(s, tmp / f"s{v}.safetensors")
        rc, out, err = run_cli("init", tmp / "log", "--from", tmp / "s0.safetensors")
        assert rc == 0, err
        for v in (1, 2):
            rc, out, err = run_cli("append", tmp / "log", "--from", tmp / f"s{v}.safetensors",
                                   "--allow-layout-change")  # the drawn states may change the table
            assert rc == 0, err
            assert out.startswith(f"version {v}:")
        for v, s in enumerate(states):
            rc, out, err = run_cli("replay", tmp / "log", "--version", v, "--out", tmp / f"r{v}.safetensors")
            assert rc == 0, err
            assert_file_holds(tmp / f"r{v}.safetensors", s)
