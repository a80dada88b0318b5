"""dcr_log.torch_ops on the CPU, bit for bit against the numpy implementations.

Every comparison is of integer words (unsigned numpy words against the signed torch words
viewed as unsigned), never of floats, so NaN payloads and -0.0 count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_log import torch_ops as T
from dcr_log.codec import ChangeSet, ulp
from dcr_log.log.records import record_targets
from dcr_log.state import to_bits
from dcr_log.write import differ
from helpers import SPECIAL_WORDS, random_words

ROOT = Path(__file__).resolve().parent.parent

# torch dtype -> safetensors dtype name (for helpers.random_words and its special words).
DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
}
# The dtypes the brief names first; the others are exercised as well.
MAIN_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.int8, torch.int32, torch.uint8, torch.bool]
ALL_DTYPES = list(DTYPES)
SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

PROPS = settings(max_examples=120, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

shapes = st.one_of(
    st.just(()), st.just((0,)), st.just((0, 3)), st.just((1,)), st.just((7,)), st.just((63,)),
    st.just((65,)), st.just((3, 5, 7)), st.lists(st.integers(0, 37), min_size=1, max_size=3).map(tuple),
)


def width(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bool else dtype.itemsize


def uword(dtype: torch.dtype) -> np.dtype:
    return np.dtype(f"<u{width(dtype)}")


def to_tensor(words: np.ndarray, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """A torch tensor of ``dtype`` holding the unsigned numpy ``words`` (copied)."""
    signed = torch.from_numpy(np.ascontiguousarray(words).view(SIGNED[width(dtype)]).copy())
    t = signed.view(dtype) if dtype != T.SIGNED_WORDS[width(dtype)] else signed
    return t.reshape(shape if shape is not None else (words.size,))


def as_u(t: torch.Tensor) -> np.ndarray:
    """Signed torch words as unsigned numpy words."""
    arr = t.numpy()
    assert arr.dtype.kind == "i"
    return arr.view(arr.dtype.str.replace("i", "u"))


def changed_copy(rng: np.random.Generator, words: np.ndarray, rate: float, dtype_name: str) -> np.ndarray:
    """``words`` with about ``rate`` of them changed: half by +-1..3 ulps, half to random
    words (specials included). Every chosen word really changes."""
    new = words.copy()
    where = np.flatnonzero(rng.random(words.size) < rate)
    if where.size:
        steps = rng.integers(1, 4, where.size) * rng.choice([-1, 1], where.size)
        dist = steps.astype(SIGNED[words.itemsize]).view(words.dtype)
        moved = ulp.step_from(words[where], dist)
        other = random_words(rng, dtype_name, where.size, special_rate=0.3)
        pick = rng.random(where.size) < 0.5
        moved[pick] = other[pick]
        if dtype_name == "BOOL":
            moved = 1 - words[where]
        same = moved == words[where]
        moved[same] ^= words.dtype.type(1)
        new[where] = moved
    return new


# --- word_view ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (3, 4)])
def test_word_view_width_bits_and_aliasing(dtype, shape):
    rng = np.random.default_rng(1)
    n = int(np.prod(shape, dtype=np.int64))
    words = random_words(rng, DTYPES[dtype], n)
    t = to_tensor(words, dtype, shape)
    assert t.dtype == dtype and tuple(t.shape) == shape
    v = T.word_view(t)
    assert v.dim() == 1 and v.numel() == n and v.dtype == T.SIGNED_WORDS[width(dtype)]
    assert np.array_equal(as_u(v), words)
    # The library's own host view of the same tensor (uint8 reinterpretation) agrees.
    assert np.array_equal(to_bits(t).words, words)
    if n:
        assert v.data_ptr() == t.data_ptr()
        v[0] = v[0] ^ 1  # writes go through to the tensor
        assert int(T.word_view(t)[0]) == int(np.array(words[0] ^ 1).view(SIGNED[width(dtype)]))


def test_word_view_refuses_non_contiguous_and_unknown_dtypes():
    t = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        T.word_view(t.t())
    with pytest.raises(ValueError, match="contiguous"):
        T.word_view(torch.zeros(10, dtype=torch.int8)[::2])
    with pytest.raises(ValueError, match="dtype"):
        T.word_view(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(TypeError):
        T.word_view(np.zeros(3, dtype=np.uint16))
    assert T.word_view(t.t().contiguous()).numel() == 24


# --- find_changes ---------------------------------------------------------------------------

@PROPS
@given(dtype=st.sampled_from(ALL_DTYPES), shape=shapes, rate=st.floats(0, 1),
       seed=st.integers(0, 2**32 - 1), chunk=st.one_of(st.none(), st.integers(1, 70)))
def test_find_changes_equals_numpy(dtype, shape, rate, seed, chunk):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    name = DTYPES[dtype]
    base = random_words(rng, name, n, special_rate=0.3)
    new = changed_copy(rng, base, rate, name)
    tb, tn = to_tensor(base, dtype, shape), to_tensor(new, dtype, shape)
    args = {} if chunk is None else {"chunk": chunk}
    pos, bv, nv = T.find_changes(tb, tn, **args)
    assert pos.dtype == torch.int64 and bv.dtype == nv.dtype == T.SIGNED_WORDS[width(dtype)]
    expect = np.flatnonzero(base != new)
    for impl in (differ.find_changes, getattr(differ, "find_changes_numpy", differ.find_changes)):
        p, b, v = impl(base, new)
        assert np.array_equal(pos.numpy(), p) and p.dtype == np.int64
        assert np.array_equal(as_u(bv), b) and np.array_equal(as_u(nv), v)
    assert np.array_equal(pos.numpy(), expect)
    # Words are the ones at those positions, positions strictly increase.
    assert np.array_equal(as_u(bv), base[expect]) and np.array_equal(as_u(nv), new[expect])
    assert bool(torch.all(pos[1:] > pos[:-1]))


@pytest.mark.parametrize("chunk", [1, 2, 8, 9, 1000])
def test_find_changes_chunk_boundaries(chunk):
    # Changes on both sides of every chunk boundary, and in the last, partial chunk.
    n = 1000
    base = np.zeros(n, dtype=np.uint16)
    new = base.copy()
    marks = sorted({i for k in range(0, n, chunk) for i in (k - 1, k) if 0 <= i < n} | {n - 1})
    new[marks] = np.arange(1, len(marks) + 1, dtype=np.uint16)
    pos, bv, nv = T.find_changes(to_tensor(base, torch.bfloat16), to_tensor(new, torch.bfloat16), chunk=chunk)
    assert pos.tolist() == marks
    assert as_u(nv).tolist() == list(range(1, len(marks) + 1)) and not bv.any()


def test_find_changes_bounds_its_mask(monkeypatch):
    seen = []
    real_ne = torch.ne

    def ne(a, b, *, out=None):
        seen.append(a.numel())
        return real_ne(a, b, out=out)

    monkeypatch.setattr(torch, "ne", ne)
    base = torch.zeros(10_000, dtype=torch.int16)
    new = base.clone()
    new[[0, 4095, 4096, 9999]] = 7
    pos, _, _ = T.find_changes(base, new, chunk=4096)
    assert pos.tolist() == [0, 4095, 4096, 9999]
    assert seen == [4096, 4096, 10_000 - 8192]
    assert T.FIND_CHUNK_ELEMENTS == 1 << 24


def test_find_changes_refuses_mismatches():
    with pytest.raises(ValueError):
        T.find_changes(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        T.find_changes(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float32))
    p, b, v = T.find_changes(torch.zeros(0, 3), torch.zeros(0, 3))
    assert p.numel() == b.numel() == v.numel() == 0 and b.dtype == torch.int32


def test_find_changes_sees_nan_payloads_and_signed_zero():
    # Float comparison would miss these (NaN != NaN everywhere, -0.0 == +0.0): words must not.
    base = np.array([0x0000, 0x7FC1, 0x7FC1, 0x8000, 0x3F80], dtype=np.uint16)
    new = np.array([0x8000, 0x7FC1, 0x7FC3, 0x8000, 0x3F80], dtype=np.uint16)
    pos, bv, nv = T.find_changes(to_tensor(base, torch.bfloat16), to_tensor(new, torch.bfloat16))
    assert pos.tolist() == [0, 2]
    assert as_u(bv).tolist() == [0x0000, 0x7FC1] and as_u(nv).tolist() == [0x8000, 0x7FC3]


# --- the ulp key ----------------------------------------------------------------------------

def edge_words(w: int) -> np.ndarray:
    """Words at the ends of the key range and around the sign change, of width ``w``."""
    u = np.dtype(f"<u{w}")
    top = 1 << (8 * w - 1)
    ones = (1 << (8 * w)) - 1
    vals = {0, 1, 2, top, top + 1, top - 1, top - 2, ones, ones - 1}
    widths = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
    for name, special in SPECIAL_WORDS.items():
        if widths[name] == w:
            vals |= set(special)  # NaN payloads, -0.0, infinities, subnormals
    return np.array(sorted(vals), dtype=u)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_key_order_wrap_and_inverse_at_the_edges(w):
    u = np.dtype(f"<u{w}")
    words = edge_words(w)
    t = torch.from_numpy(words.view(SIGNED[w]).copy())
    key = T.to_key(t)
    assert np.array_equal(as_u(key), ulp.to_key(words))
    assert torch.equal(T.from_key(key), t)
    # key(+0) is just above key(-0); the ends of the key range are the all-ones word (key 0)
    # and the top-bit-clear all-ones word (key 2^W - 1).
    top, ones = 1 << (8 * w - 1), (1 << (8 * w)) - 1
    k = dict(zip(words.tolist(), as_u(key).tolist()))
    assert k[0] == top and k[top] == top - 1 and k[ones] == 0 and k[top - 1] == ones
    # Distances that wrap: from the largest key one step up is the smallest key, and back.
    big = torch.from_numpy(np.array([top - 1], dtype=u).view(SIGNED[w]).copy())
    small = torch.from_numpy(np.array([ones], dtype=u).view(SIGNED[w]).copy())
    one = torch.ones(1, dtype=T.SIGNED_WORDS[w])
    assert torch.equal(T.step_from(big, one), small)
    assert torch.equal(T.step_from(small, one, backwards=True), big)
    assert int(T.ulp_distance(big, small)) == 1 and int(T.ulp_distance(small, big)) == -1
    # Every pair of edge words, both functions, against numpy.
    b = np.repeat(words, words.size)
    n = np.tile(words, words.size)
    tb, tn = (torch.from_numpy(x.view(SIGNED[w]).copy()) for x in (b, n))
    d = T.ulp_distance(tb, tn)
    assert np.array_equal(as_u(d), ulp.ulp_distance(b, n))
    assert np.array_equal(as_u(T.step_from(tb, d)), n)
    assert np.array_equal(as_u(T.step_from(tb, tn)), ulp.step_from(b, n))
    assert np.array_equal(as_u(T.step_from(tb, tn, backwards=True)), ulp.step_from(b, n, backwards=True))


@PROPS
@given(dtype=st.sampled_from(ALL_DTYPES), n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1),
       small=st.booleans())
def test_ulp_distance_and_step_from_equal_numpy(dtype, n, seed, small):
    rng = np.random.default_rng(seed)
    name = DTYPES[dtype]
    w = width(dtype)
    u = uword(dtype)
    base = random_words(rng, name, n, special_rate=0.3)
    if name == "BOOL":
        base = rng.integers(0, 256, n, dtype=np.uint8)  # any byte: the key does not care
    if small:  # training-like distances: a few ulps either way
        dist = rng.integers(-3, 4, n).astype(SIGNED[w]).view(u)
    else:
        dist = rng.integers(0, np.iinfo(u).max, n, dtype=u, endpoint=True)
    new = ulp.step_from(base, dist)
    tb = torch.from_numpy(base.view(SIGNED[w]).copy())
    tn = torch.from_numpy(new.view(SIGNED[w]).copy())
    td = torch.from_numpy(dist.view(SIGNED[w]).copy())
    d = T.ulp_distance(tb, tn)
    assert d.dtype == tb.dtype
    assert np.array_equal(as_u(d), ulp.ulp_distance(base, new))
    assert np.array_equal(as_u(d), dist)
    assert np.array_equal(as_u(T.step_from(tb, td)), new)
    back = ulp.step_from(base, dist, backwards=True)
    assert np.array_equal(as_u(T.step_from(tb, td, backwards=True)), back)
    assert torch.equal(T.step_from(tn, d, backwards=True), tb)
    # Word views of the dtype itself are accepted as well as signed words.
    if n and dtype not in (torch.bool,) and dtype != tb.dtype:
        typed_b, typed_n = tb.view(dtype), tn.view(dtype)
        assert torch.equal(T.ulp_distance(typed_b, typed_n), d)


def test_step_from_takes_int16_distances_of_byte_words():
    # ulp stores 1-byte words' distances as int16 (codec.ulp.distance_dtype): the low byte counts.
    base = torch.tensor([0x00, 0x7F, -1, -128], dtype=torch.int8)
    dist16 = torch.tensor([1, -1, 127, -128], dtype=torch.int16)
    dist8 = dist16.to(torch.int8)
    assert torch.equal(T.step_from(base, dist16), T.step_from(base, dist8))
    b = base.numpy().view(np.uint8)
    assert np.array_equal(as_u(T.step_from(base, dist16)), ulp.step_from(b, dist8.numpy().view(np.uint8)))


# --- apply_changes --------------------------------------------------------------------------

def numpy_apply(words: np.ndarray, where, values: np.ndarray, kind: str, relative: bool) -> np.ndarray:
    out = words.copy()
    changes = ChangeSet(words.size, None, values, relative=relative)
    out[where] = record_targets(kind, changes, out[where], values)
    return out


@PROPS
@given(dtype=st.sampled_from(MAIN_DTYPES), n=st.integers(0, 400), rate=st.floats(0, 1),
       kind=st.sampled_from(["xor", "xor-relative", "overwrite", "tensor"]),
       seed=st.integers(0, 2**32 - 1), as_slice=st.booleans())
def test_apply_changes_equals_numpy(dtype, n, rate, kind, seed, as_slice):
    rng = np.random.default_rng(seed)
    name = DTYPES[dtype]
    u = uword(dtype)
    w = width(dtype)
    relative = kind == "xor-relative"
    kind = "xor" if relative else kind
    words = random_words(rng, name, n, special_rate=0.3)
    if as_slice or kind == "tensor":
        a = int(rng.integers(0, n + 1))
        b = int(rng.integers(a, n + 1))
        if kind == "tensor":
            a, b = 0, n
        where = slice(a, b)
        k = b - a
    else:
        where = np.flatnonzero(rng.random(n) < rate).astype(np.int64)
        k = where.size
    values = rng.integers(0, np.iinfo(u).max, k, dtype=u, endpoint=True)
    if name == "BOOL" and not relative:
        values &= 1  # bool words stay 0/1 (a relative step may leave any byte: words are words)
    expect = numpy_apply(words, where, values, kind, relative)
    t = to_tensor(words, dtype)
    flat = T.word_view(t)
    vals = torch.from_numpy(values.view(SIGNED[w]).copy())
    positions = where if isinstance(where, slice) else torch.from_numpy(where)
    if kind == "tensor" and seed % 2:
        positions = None
    out = T.apply_changes(flat, positions, vals, kind, relative)
    assert out is flat
    assert np.array_equal(as_u(T.word_view(t)), expect)  # in place, through the view


def test_apply_changes_relative_record_roundtrip_from_the_codec():
    # A real ulp record: encode with the codec, decode, apply with torch, compare with numpy.
    rng = np.random.default_rng(7)
    base = random_words(rng, "BF16", 5000, special_rate=0.05)
    new = changed_copy(rng, base, 0.05, "BF16")
    p, b, v = differ.find_changes(base, new)
    enc = ulp.UlpEncoding()
    params, payload = enc.encode("xor", ChangeSet(base.size, p, np.bitwise_xor(b, v)), base=b, new=v)
    changes = enc.decode("xor", params, payload, base.size, p.size, np.dtype("<u2"))
    assert changes.relative
    t = to_tensor(base, torch.bfloat16)
    pos, vals = T.to_device_changes(changes.positions, changes.values, "cpu")
    T.apply_changes(T.word_view(t), pos, vals, "xor", relative=True)
    assert np.array_equal(as_u(T.word_view(t)), new)
    # Applying the same distances as xor words would not give new: the flag matters.
    t2 = to_tensor(base, torch.bfloat16)
    T.apply_changes(T.word_view(t2), pos, vals, "xor", relative=False)
    assert not np.array_equal(as_u(T.word_view(t2)), new)


def test_apply_changes_refuses_bad_arguments():
    flat = torch.zeros(10, dtype=torch.int16)
    pos = torch.tensor([1, 3])
    vals = torch.tensor([5, 6], dtype=torch.int16)
    with pytest.raises(ValueError, match="kind"):
        T.apply_changes(flat, pos, vals, "add")
    with pytest.raises(ValueError, match="relative"):
        T.apply_changes(flat, pos, vals, "overwrite", relative=True)
    with pytest.raises(ValueError, match="int64"):
        T.apply_changes(flat, pos.to(torch.int32), vals, "xor")
    with pytest.raises(ValueError, match="values"):
        T.apply_changes(flat, pos, vals[:1], "xor")
    with pytest.raises(ValueError, match="values"):
        T.apply_changes(flat, slice(0, 3), vals, "overwrite")
    with pytest.raises(ValueError, match="signed word"):
        T.apply_changes(flat.view(torch.bfloat16), pos, vals, "xor")
    assert not flat.any()  # nothing was written by a refused call


# --- to_device_changes ----------------------------------------------------------------------

@pytest.mark.parametrize("word", [np.uint8, np.uint16, np.uint32, np.uint64, np.bool_])
def test_to_device_changes_cpu(word):
    rng = np.random.default_rng(3)
    pos = np.sort(rng.choice(1000, 50, replace=False)).astype(np.int64)
    if word is np.bool_:
        vals = rng.integers(0, 2, 50).astype(np.bool_)
        expect = vals.view(np.uint8)
    else:
        vals = rng.integers(0, np.iinfo(word).max, 50, dtype=word, endpoint=True)
        expect = vals
    p, v = T.to_device_changes(pos, vals, torch.device("cpu"))
    assert p.dtype == torch.int64 and p.device.type == "cpu" and np.array_equal(p.numpy(), pos)
    assert v.dtype == T.SIGNED_WORDS[np.dtype(word).itemsize]
    assert np.array_equal(as_u(v), expect)
    # uint64 positions (what the ulp and sparse decoders compute with) and read-only arrays.
    ro = vals.copy()
    ro.flags.writeable = False
    p2, v2 = T.to_device_changes(pos.astype(np.uint64), ro, "cpu")
    assert torch.equal(p2, p) and torch.equal(v2, v)


def test_to_device_changes_uses_pinned_memory_for_cuda(monkeypatch):
    # No GPU here: pretend CUDA is available and record what _upload asks of torch.
    calls = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin", self.dtype, self.numel()))
        return self.clone()

    def to(self, *args, **kwargs):
        dev = args[0] if args else kwargs.get("device")
        if isinstance(dev, torch.device) and dev.type == "cuda":
            calls.append(("to", str(dev), kwargs.get("non_blocking")))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    pos = np.array([2, 5, 9], dtype=np.int64)
    vals = np.array([1, 0xFFFF, 0x8000], dtype=np.uint16)
    p, v = T.to_device_changes(pos, vals, "cuda:0")
    assert calls == [("pin", torch.int64, 3), ("to", "cuda:0", True),
                     ("pin", torch.int16, 3), ("to", "cuda:0", True)]
    assert p.tolist() == [2, 5, 9] and as_u(v).tolist() == [1, 0xFFFF, 0x8000]


def test_to_device_changes_refuses_bad_input():
    with pytest.raises(ValueError):
        T.to_device_changes(np.arange(3), np.zeros(2, np.uint16), "cpu")
    with pytest.raises(ValueError):
        T.to_device_changes(np.arange(3), np.zeros(3, np.float32), "cpu")
    with pytest.raises(ValueError):
        T.to_device_changes(np.arange(3), np.zeros(3, ">u2"), "cpu")
    with pytest.raises(ValueError):
        T.to_device_changes(np.array([1 << 63], np.uint64), np.zeros(1, np.uint16), "cpu")


# --- the module is imported only on use -----------------------------------------------------

def test_dcr_log_does_not_import_torch_ops():
    code = ("import sys, dcr_log, dcr_log.write.differ, dcr_log.receiver, dcr_log.cli, dcr_log.log, "
            "dcr_log.write\n"
            "assert 'dcr_log.torch_ops' not in sys.modules, 'imported at import time'\n"
            "import dcr_log.torch_ops\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- tools/gpu_check.py ---------------------------------------------------------------------

def test_gpu_check_on_cpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--gib", "0.01", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("device: cpu")
    assert "exact: yes" in lines
    report = json.loads(out.stdout[out.stdout.index("\n{") + 1:])
    assert report["exact"] is True and report["device"] == "cpu"
    assert report["checks"] and all(c["ok"] is True for c in report["checks"])
    names = {m["name"] for m in report["measurements"]}
    assert {"bitwise_xor (full model)", "find_changes 1%", "apply_changes xor 1%",
            "apply_changes ulp (relative) 1%", "to_device_changes 1%"} <= names
    assert any(c["name"].startswith("library: torch Receiver") for c in report["checks"])
    assert all(m["seconds"] > 0 for m in report["measurements"])


def test_gpu_check_reports_a_wrong_apply(monkeypatch, capsys):
    # The script must fail when the thing it checks is wrong: break apply_changes (one word
    # flipped after every apply) and expect "exact: no" and exit code 1.
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tools"))
    real = T.apply_changes

    def broken(flat, positions, values, kind, relative=False):
        real(flat, positions, values, kind, relative)
        if flat.numel():
            flat[-1] ^= 1
        return flat

    monkeypatch.setattr(gpu_check.T, "apply_changes", broken)
    rc = gpu_check.main(["--device", "cpu", "--gib", "0.002", "--reps", "1"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "exact: no" in text and "FAILED" in text
    assert "exact: yes" not in text


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_sum_digest_equals_the_host_digest(width):
    """torch_ops.sum_digest (int64 products and sums that wrap) against dcr_log.digest, at flat
    indices up to 2^40, over a range start, and across its chunk boundary."""
    from dcr_log.digest import SUM

    rng = np.random.default_rng(width)
    word = np.dtype(f"<u{width}")
    for n in (0, 1, 7, 5000):
        words = rng.integers(0, 256, n * width, dtype=np.uint8).view(word)
        flat = np.sort(rng.choice(1 << 40, n, replace=False)).astype(np.int64)
        signed = torch.from_numpy(words.view(f"<i{width}").copy())
        assert T.sum_digest(signed, torch.from_numpy(flat)) == SUM.at(flat, words)
        assert T.sum_digest(signed, start=(1 << 33) + 5) == SUM.at(slice((1 << 33) + 5, (1 << 33) + 5 + n), words)
    words = rng.integers(0, 256, 3 * width * 1000 + width, dtype=np.uint8).view(word)
    signed = torch.from_numpy(words.view(f"<i{width}").copy())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "DIGEST_CHUNK_ELEMENTS", 1000)  # several chunks, the last one partial
        assert T.sum_digest(signed) == SUM.tensor(words, (words.size,))
