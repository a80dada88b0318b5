"""Device-agnostic torch versions of the word operations of dcr_log.delta and dcr_log.codec.ulp.

Every function works on torch tensors on any device (CPU, CUDA, ...) without moving data to
the host and without a Python loop per element: tensors are handled as flat, same-width
*signed* integer words (torch.int8/int16/int32/int64), the views that support comparison,
bitwise operations, indexing and index_put on every device. Signed words are the two's
complement images of the format's unsigned words (spec/FORMAT.md section 6), so equality,
xor, and addition and subtraction modulo 2^W give the same bits as on the unsigned words;
the ``ulp`` key (section 11) is computed on them with the masks written as signed constants.

Nothing in dcr_log imports this module when dcr_log is imported: it is imported on use, by
callers that hold torch tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "FIND_CHUNK_ELEMENTS", "SIGNED_WORDS", "word_view", "signed_words", "find_changes",
    "to_key", "from_key", "ulp_distance", "step_from", "apply_changes", "to_device_changes",
]

# find_changes compares at most this many words at a time: the temporary bool mask stays
# at 16 MiB whatever the tensor's size.
FIND_CHUNK_ELEMENTS = 1 << 24

# Word width in bytes -> the signed torch integer dtype of that width.
SIGNED_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SIGNED_SET = frozenset(SIGNED_WORDS.values())

# The dtypes word_view accepts: the safetensors dtypes (spec/FORMAT.md section 6) that torch
# has. The unsigned 16/32/64-bit dtypes are "shell" dtypes in torch (few operations on some
# devices), which is why every operation here works on the signed view.
_WORD_SOURCE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
)
WORD_SOURCE_DTYPES = frozenset(getattr(torch, n) for n in _WORD_SOURCE_NAMES if hasattr(torch, n))


def _width(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bool else dtype.itemsize


def word_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the contiguous tensor ``t`` as signed integer words of its element width
    (bool and the 8-bit types as torch.int8). Writing through the view writes ``t``.

    A non-contiguous tensor is a ValueError (a view cannot be made without a copy); so is a
    dtype without a safetensors word (complex, quantized, other fp8 variants).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"word_view needs a torch tensor, got {type(t).__name__}")
    if t.dtype not in WORD_SOURCE_DTYPES:
        raise ValueError(f"no word view for torch dtype {t.dtype}")
    if not t.is_contiguous():
        raise ValueError("word_view needs a contiguous tensor (call .contiguous() first)")
    signed = SIGNED_WORDS[_width(t.dtype)]
    if t.numel() == 0:
        # An empty tensor may carry strides that view() refuses; nothing to alias.
        return torch.empty(0, dtype=signed, device=t.device)
    flat = t.view(-1)
    return flat if flat.dtype == signed else flat.view(signed)


def signed_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is already a 1-D signed word tensor, else its word view."""
    if t.dtype in _SIGNED_SET and t.dim() == 1:
        return t
    return word_view(t)


# --- finding changes ------------------------------------------------------------------------

def find_changes(base: torch.Tensor, new: torch.Tensor, chunk: int = FIND_CHUNK_ELEMENTS
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, base words, new words) where the words of ``base`` and ``new`` differ, on
    their device: positions as increasing torch.int64 flat indices, words as signed words.

    The same result, bit for bit, as dcr_log.delta.find_changes on the unsigned numpy words.
    The tensors are compared ``chunk`` words at a time, so the temporary mask is bounded.
    """
    b = signed_words(base)
    n = signed_words(new)
    if b.dtype != n.dtype or b.numel() != n.numel():
        raise ValueError(f"find_changes: {b.numel()} words of {b.dtype} against "
                         f"{n.numel()} of {n.dtype}")
    if b.device != n.device:
        raise ValueError(f"find_changes: tensors on {b.device} and {n.device}")
    if chunk < 1:
        raise ValueError("find_changes: chunk must be positive")
    total = b.numel()
    device = b.device
    if total == 0:
        empty = torch.empty(0, dtype=b.dtype, device=device)
        return torch.empty(0, dtype=torch.int64, device=device), empty, empty.clone()
    mask = torch.empty(min(chunk, total), dtype=torch.bool, device=device)
    parts_p, parts_b, parts_n = [], [], []
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        bs, ns = b[start:stop], n[start:stop]
        m = torch.ne(bs, ns, out=mask[:stop - start])
        idx = torch.nonzero(m).view(-1)
        parts_b.append(bs.index_select(0, idx))
        parts_n.append(ns.index_select(0, idx))
        if start:
            idx += start
        parts_p.append(idx)
    if len(parts_p) == 1:
        return parts_p[0], parts_b[0], parts_n[0]
    return torch.cat(parts_p), torch.cat(parts_b), torch.cat(parts_n)


# --- the ulp key on signed words --------------------------------------------------------------

def _top_bit(dtype: torch.dtype) -> int:
    # 2^(W-1) as a W-bit two's-complement integer: the most negative value.
    return -(1 << (8 * dtype.itemsize - 1))


def to_key(words: torch.Tensor) -> torch.Tensor:
    """dcr_log.codec.ulp.to_key on signed words: ``x XOR (2^W - 1)`` (all ones, -1) where the
    top bit is set (x < 0), else ``x XOR 2^(W-1)`` (the most negative value)."""
    w = signed_words(words)
    # The arithmetic shift spreads the sign bit: -1 for negative words, 0 otherwise.
    flip = torch.bitwise_or(w >> (8 * w.element_size() - 1), _top_bit(w.dtype))
    return torch.bitwise_xor(w, flip)


def from_key(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of to_key: keys with the top bit set came from words with it clear."""
    k = signed_words(keys)
    flip = torch.bitwise_or(torch.bitwise_not(k >> (8 * k.element_size() - 1)), _top_bit(k.dtype))
    return torch.bitwise_xor(k, flip)


def _same_width(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``b`` as words of ``a``'s dtype: a view if the width is the same, else a modular cast
    (distances of 1-byte words are stored as int16; their low byte is the distance)."""
    b = signed_words(b)
    if b.dtype == a.dtype:
        return b
    if b.element_size() == a.element_size():  # pragma: no cover - signed_words gives one dtype per width
        return b.view(a.dtype)
    return b.to(a.dtype)  # integer narrowing keeps the low bits (two's complement)


def ulp_distance(base_words: torch.Tensor, new_words: torch.Tensor) -> torch.Tensor:
    """``key(new) - key(base)`` modulo 2^W as signed words of the same width: the bits of
    dcr_log.codec.ulp.ulp_distance (which returns them as unsigned words)."""
    b = signed_words(base_words)
    n = _same_width(b, new_words)
    if b.shape != n.shape:
        raise ValueError(f"ulp_distance: {b.numel()} base words, {n.numel()} new words")
    # Two's-complement subtraction wraps like the unsigned one.
    return torch.sub(to_key(n), to_key(b))


def step_from(base_words: torch.Tensor, distance: torch.Tensor, backwards: bool = False) -> torch.Tensor:
    """The words ``distance`` ulps from ``base_words`` (back from them with ``backwards``), as
    signed words of the base's width: dcr_log.codec.ulp.step_from on signed words."""
    b = signed_words(base_words)
    d = _same_width(b, distance)
    if b.shape != d.shape:
        raise ValueError(f"step_from: {b.numel()} base words, {d.numel()} distances")
    key = to_key(b)
    moved = torch.sub(key, d) if backwards else torch.add(key, d)
    return from_key(moved)


# --- applying changes -----------------------------------------------------------------------

_KINDS = ("xor", "overwrite", "tensor")


def apply_changes(flat: torch.Tensor, positions: torch.Tensor | slice | None, values: torch.Tensor,
                  kind: str, relative: bool = False) -> torch.Tensor:
    """Apply one decoded record's changes in place to ``flat`` (1-D signed words, any device).

    ``positions``: torch.int64 flat indices on ``flat``'s device (what
    dcr_log.delta.flat_positions gives, moved there by to_device_changes), or a slice (a whole
    row-block box), or None for all of ``flat``. ``values``: one word per position on the same
    device. ``xor``: ``flat[p] ^= v``, or with ``relative`` (the ``ulp`` encoding's distances)
    ``flat[p] = step_from(flat[p], v)``; ``overwrite`` and ``tensor``: ``flat[p] = v``.
    One gather (xor only) and one scatter. Returns ``flat``.

    No digest is checked here: a receiver checks the record's base and target digests.
    """
    if kind not in _KINDS:
        raise ValueError(f"apply_changes: unknown kind {kind!r}")
    if relative and kind != "xor":
        raise ValueError(f"apply_changes: relative values are for xor records, not {kind!r}")
    if not isinstance(flat, torch.Tensor) or flat.dtype not in _SIGNED_SET or flat.dim() != 1:
        raise ValueError("apply_changes: flat must be a 1-D signed word tensor (see word_view)")
    vals = _same_width(flat, values)
    if vals.device != flat.device:
        raise ValueError(f"apply_changes: values on {vals.device}, words on {flat.device}")
    if positions is None:
        positions = slice(0, flat.numel())
    if isinstance(positions, slice):
        region = flat[positions]
        if region.numel() != vals.numel():
            raise ValueError(f"apply_changes: {vals.numel()} values for {region.numel()} positions")
        if kind != "xor":
            region.copy_(vals)
        elif relative:
            region.copy_(step_from(region, vals))
        else:
            region.bitwise_xor_(vals)
        return flat
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError("apply_changes: positions must be a 1-D torch.int64 tensor")
    if positions.device != flat.device:
        raise ValueError(f"apply_changes: positions on {positions.device}, words on {flat.device}")
    if positions.numel() != vals.numel():
        raise ValueError(f"apply_changes: {vals.numel()} values for {positions.numel()} positions")
    if kind == "xor":
        current = flat.index_select(0, positions)  # the gather
        target = step_from(current, vals) if relative else torch.bitwise_xor(current, vals)
    else:
        target = vals
    flat.index_put_((positions,), target)  # the scatter
    return flat


# --- host to device -------------------------------------------------------------------------

def _signed_numpy(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype == np.bool_:
        values = values.view(np.uint8)
    if values.dtype.kind not in "ui" or values.dtype.itemsize not in SIGNED_WORDS:
        raise ValueError(f"to_device_changes: values must be integer words, got {values.dtype}")
    if values.dtype.byteorder == ">":
        raise ValueError("to_device_changes: values must be little-endian words")
    return values.reshape(-1).view(np.dtype(f"<i{values.dtype.itemsize}"))


def _int64_positions(positions: np.ndarray) -> np.ndarray:
    positions = np.asarray(positions).reshape(-1)
    if positions.dtype.kind not in "ui":
        raise ValueError(f"to_device_changes: positions must be integers, got {positions.dtype}")
    if positions.dtype == np.uint64:
        if positions.size and int(positions.max()) >= 1 << 63:
            raise ValueError("to_device_changes: a position does not fit int64")
        return positions.view(np.int64)
    return positions.astype(np.int64, copy=False)


def _upload(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    # torch.from_numpy needs a writable, contiguous array (it aliases its memory).
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, copy=True)
    host = torch.from_numpy(arr)
    if device.type == "cpu":
        return host
    if device.type == "cuda" and torch.cuda.is_available() and host.numel():
        try:
            pinned = host.pin_memory()  # one host copy into page-locked memory
        except RuntimeError:  # pragma: no cover - no pinned memory to be had
            pinned = None
        if pinned is not None:
            # The caching host allocator keeps the pinned block until the copy has run.
            return pinned.to(device, non_blocking=True)
    return host.to(device)


def to_device_changes(positions_np: np.ndarray, values_np: np.ndarray, device: Any
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Numpy positions and unsigned words to ``device``: (torch.int64 positions, signed words),
    one host-to-device copy each (through pinned memory on CUDA). On the CPU the tensors
    share memory with writable contiguous arrays (no copy at all)."""
    device = torch.device(device)
    pos = _int64_positions(positions_np)
    vals = _signed_numpy(values_np)
    if pos.size != vals.size:
        raise ValueError(f"to_device_changes: {pos.size} positions and {vals.size} values")
    return _upload(pos, device), _upload(vals, device)


# --- sum digests (spec/FORMAT.md section 7.1) on the device ------------------------------------

_G = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# A sum digest works through this many words at a time (bounded int64 temporaries).
DIGEST_CHUNK_ELEMENTS = 1 << 22


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _logical_shift(z: torch.Tensor, shift: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return torch.bitwise_and(torch.bitwise_right_shift(z, shift), (1 << (64 - shift)) - 1)


def sum_digest(words: torch.Tensor, flat: torch.Tensor | None = None, start: int = 0) -> int:
    """The sum digest of section 7.1: the sum mod 2^64 of mix64(((f + 1) G) XOR w) over the
    words ``words`` (a signed word tensor) at flat indices ``flat`` (int64, same device), or at
    start, start + 1, ... without ``flat``. int64 products and sums wrap as the unsigned ones
    do, so the result equals dcr_log.digest's bit for bit."""
    words = signed_words(words)
    bits = 8 * words.element_size()
    total = 0
    n = words.numel()
    for lo in range(0, n, DIGEST_CHUNK_ELEMENTS):
        hi = min(n, lo + DIGEST_CHUNK_ELEMENTS)
        w = words[lo:hi].to(torch.int64)
        if bits < 64:
            w = torch.bitwise_and(w, (1 << bits) - 1)  # the unsigned word, zero-extended
        if flat is None:
            f = torch.arange(start + lo + 1, start + hi + 1, dtype=torch.int64, device=words.device)
        else:
            f = flat[lo:hi].to(torch.int64) + 1
        z = torch.bitwise_xor(f * _signed64(_G), w)
        z = torch.bitwise_xor(z, _logical_shift(z, 30)) * _signed64(_M1)
        z = torch.bitwise_xor(z, _logical_shift(z, 27)) * _signed64(_M2)
        z = torch.bitwise_xor(z, _logical_shift(z, 31))
        total += int(z.sum())
    return total & _MASK64
