"""Random states as words and their comparison: every dtype's special float bit patterns,
random words, states built from a spec, changed copies, and bit-exact equality."""

from __future__ import annotations

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.state import TensorBits

ALL_DTYPES = tuple(DTYPE_WIDTH)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

# Bit patterns a float path could lose: NaNs with payload bits (quiet and signalling, both
# signs), -0.0, +-inf, the smallest and largest subnormals, the largest finite value.
SPECIAL_WORDS: dict[str, tuple[int, ...]] = {
    "F64": (0x7FF8000000000001, 0x7FF0000000000001, 0xFFF8DEADBEEF0001, 0x8000000000000000,
            0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF,
            0x7FEFFFFFFFFFFFFF),
    "F32": (0x7FC00001, 0x7F800001, 0xFFC0BEEF, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001,
            0x807FFFFF, 0x7F7FFFFF),
    "F16": (0x7E01, 0x7C01, 0xFE55, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x7BFF),
    "BF16": (0x7FC1, 0x7F81, 0xFFC5, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F),
    "F8_E4M3": (0x7F, 0xFF, 0x80, 0x01, 0x87, 0x7E),
    "F8_E5M2": (0x7D, 0x7E, 0xFF, 0x80, 0x7C, 0xFC, 0x01, 0x83, 0x7B),
}

# numpy dtypes whose arrays carry these bits directly (bf16 and fp8 need ml_dtypes: absent).
NUMPY_DTYPE = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_,
}


def random_words(rng: np.random.Generator, dtype: str, n: int, special_rate: float = 0.1) -> np.ndarray:
    """``n`` random words of ``dtype``: uniform bits (0/1 for BOOL) with special floats mixed in."""
    word = word_dtype(dtype)
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    words = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    specials = SPECIAL_WORDS.get(dtype)
    if specials and n:
        where = np.flatnonzero(rng.random(n) < special_rate)
        words[where] = np.array(specials, dtype=word)[rng.integers(0, len(specials), where.size)]
    return words


def make_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    return TensorBits(dtype, tuple(shape), random_words(rng, dtype, numel(shape)))


def make_state(rng: np.random.Generator, spec: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, TensorBits]:
    """A state from ``{name: (dtype, shape)}`` with random words."""
    return {name: make_bits(rng, dtype, shape) for name, (dtype, shape) in spec.items()}


def change_words(rng: np.random.Generator, bits: TensorBits, rate: float) -> TensorBits:
    """A copy of ``bits`` with about ``rate`` of its words replaced by different random words."""
    words = bits.words.copy()
    n = words.size
    k = int(round(rate * n))
    if k:
        where = rng.choice(n, k, replace=False)
        fresh = random_words(rng, bits.dtype, k, special_rate=0.2)
        same = fresh == words[where]
        # A changed word must differ: flip the low bit where the draw repeated the old word.
        fresh[same] ^= 1
        words[where] = fresh
    return TensorBits(bits.dtype, bits.shape, words)


def copy_state(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    return {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in state.items()}


def assert_same_bits(got: dict[str, TensorBits], expected: dict[str, TensorBits]) -> None:
    """Bit-exact state equality, with a message that names the first differing tensor."""
    assert sorted(got) == sorted(expected)
    for name, exp in expected.items():
        g = got[name]
        assert (g.dtype, g.shape) == (exp.dtype, exp.shape), name
        assert g.words.dtype == exp.words.dtype, name
        assert np.array_equal(g.words, exp.words), f"{name}: words differ"


def flip_log(root, tensors: int, n: int, rate: float, seed: int):
    """A log of ``tensors`` bf16 tensors of ``n`` random words (rows of 256) at version 0 and,
    at version 1, the low bit flipped in about ``rate`` of them; returns (log, base, new)."""
    from dcr_log.write import LogWriter

    rng = np.random.default_rng(seed)
    base = {f"w{i}": TensorBits("BF16", (n // 256, 256), rng.integers(0, 1 << 16, n, dtype=np.uint16))
            for i in range(tensors)}
    new = {}
    for k, b in base.items():
        words = b.words.copy()
        words[rng.random(n) < rate] ^= 1
        new[k] = TensorBits(b.dtype, b.shape, words)
    writer = LogWriter.create(root, base, cache_dir=False)
    writer.append(new)
    return writer.log, base, new
