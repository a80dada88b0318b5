"""Tensor states as words, and their digests. Pure: no I/O.

A state is a mapping ``name -> TensorBits``. Numpy arrays and torch tensors (CPU or GPU) are
accepted wherever a state goes in; torch is imported only when a torch tensor is seen.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, check_dtype, numel, word_dtype
from dcr_log.digest import XXH3, DigestScheme, xxh3_words
from dcr_log.errors import UsageError

_NUMPY_TO_DTYPE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",  # ml_dtypes
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}

_TORCH_TO_DTYPE = {
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint64": "U64",
    "torch.uint32": "U32",
    "torch.uint16": "U16",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}


# A table's layout: per tensor name, its (safetensors dtype, shape).
TableLayout = dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class TensorBits:
    """A tensor's bits: safetensors dtype, shape and a flat array of little-endian words."""

    dtype: str
    shape: tuple[int, ...]
    words: np.ndarray

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if self.words.dtype != word_dtype(self.dtype) or self.words.ndim != 1:
            raise UsageError(f"words of a {self.dtype} tensor must be a flat {word_dtype(self.dtype)}")
        if self.words.size != numel(self.shape):
            raise UsageError(f"{self.words.size} words do not fill shape {self.shape}")

    @property
    def nbytes(self) -> int:
        return self.words.size * DTYPE_WIDTH[self.dtype]

    def digest(self, scheme: DigestScheme = XXH3) -> int:
        return scheme.tensor(self.words, self.shape)

    def same_bits(self, other: TensorBits) -> bool:
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and np.array_equal(self.words, other.words)
        )


State = Mapping[str, TensorBits]


def is_torch_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch.Tensor, subclasses included (nn.Parameter, an engine's own
    parameter classes), without importing torch when the caller never did."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a torch DTensor (one rank's part of a tensor sharded over a device
    mesh), without importing torch.distributed when the caller never did."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls is not None and isinstance(x, cls)


# Where a whole tensor goes, a DTensor is refused with this (never read as a whole tensor).
DTENSOR_NOT_WHOLE = ("a DTensor is one rank's part of a sharded tensor, not a whole tensor: log the ranks' "
                     "parts with ShardedWriter and Shard.from_dtensor(dt) (or shards_from_module), "
                     "or give dt.full_tensor()")


def to_bits(x: Any) -> TensorBits:
    """View a numpy array, a torch tensor (copied to host if needed) or TensorBits as words."""
    if isinstance(x, TensorBits):
        return x
    if is_torch_tensor(x):
        if is_dtensor(x):
            raise UsageError(DTENSOR_NOT_WHOLE)
        dtype = _TORCH_TO_DTYPE.get(str(x.dtype))
        if dtype is None:
            raise UsageError(f"unsupported torch dtype {x.dtype}")
        shape = tuple(int(s) for s in x.shape)
        if x.numel() == 0:
            # An empty tensor may carry stride 0 (torch.from_numpy does), which view() refuses.
            return TensorBits(dtype, shape, np.empty(0, dtype=word_dtype(dtype)))
        t = x.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        # Reinterpret as raw bytes: works for every dtype, bool and fp8 included.
        raw = t.reshape(-1).view(__import__("torch").uint8).numpy()
        return TensorBits(dtype, shape, raw.view(word_dtype(dtype)))
    arr = np.asarray(x)
    dtype = _NUMPY_TO_DTYPE.get(arr.dtype.name)
    if dtype is None:
        raise UsageError(f"unsupported numpy dtype {arr.dtype}")
    shape = tuple(int(s) for s in arr.shape)
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return TensorBits(dtype, shape, arr.reshape(-1).view(word_dtype(dtype)))


def dtype_of(x: Any) -> str:
    """The safetensors dtype of a numpy array, a torch tensor or TensorBits."""
    if isinstance(x, TensorBits):
        return x.dtype
    if is_torch_tensor(x):
        if is_dtensor(x):
            raise UsageError(DTENSOR_NOT_WHOLE)
        dtype = _TORCH_TO_DTYPE.get(str(x.dtype))
    else:
        dtype = _NUMPY_TO_DTYPE.get(np.asarray(x).dtype.name) if hasattr(x, "dtype") else None
    if dtype is None:
        raise UsageError(f"unsupported tensor dtype {getattr(x, 'dtype', type(x).__name__)}")
    return dtype


def to_state(tensors: Mapping[str, Any]) -> dict[str, TensorBits]:
    state = {}
    for name, x in tensors.items():
        check_name(name)
        if is_dtensor(x):
            raise UsageError(f"tensor {name!r}: {DTENSOR_NOT_WHOLE}")
        state[name] = to_bits(x)
    return state


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "\x00" in name or "\n" in name:
        raise UsageError(f"invalid tensor name {name!r}: non-empty, no NUL or newline")
    return name


words_digest = xxh3_words  # xxh3_64 (seed 0) of the words' little-endian bytes


_DTYPE_TO_TORCH = {v: k.removeprefix("torch.") for k, v in _TORCH_TO_DTYPE.items()}


def to_torch(bits: TensorBits, device: Any = None):
    """A torch tensor of the right dtype and shape holding exactly these bits (shares memory on CPU)."""
    import torch

    t = torch.from_numpy(bits.words).view(getattr(torch, _DTYPE_TO_TORCH[bits.dtype])).reshape(bits.shape)
    return t if device is None else t.to(device)


LAYOUT_CHANGES_SHOWN = 3


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _quoted(name: str) -> str:
    return repr(name if len(name) <= 80 else name[:77] + "...")


def layout_changes(tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                   previous: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """How a tensor table (name -> (dtype, shape)) differs from a previous one, one phrase per
    tensor added, removed, reshaped or retyped (a rename is a removal and an addition), in
    the names' byte order."""
    out = []
    for name in sorted(set(tensors) | set(previous), key=str.encode):
        new, old = tensors.get(name), previous.get(name)
        if new == old:
            continue
        q = _quoted(name)
        if old is None:
            assert new is not None
            out.append(f"added {q} ({new[0]} {_dims(new[1])})")
        elif new is None:
            out.append(f"removed {q}")
        elif new[0] == old[0]:
            out.append(f"reshaped {q} {_dims(old[1])} -> {_dims(new[1])}")
        elif new[1] == old[1]:
            out.append(f"retyped {q} {old[0]} -> {new[0]}")
        else:
            out.append(f"retyped and reshaped {q} {old[0]} {_dims(old[1])} -> {new[0]} {_dims(new[1])}")
    return out


def describe_layout_change(old: Mapping[str, tuple[str, tuple[int, ...]]],
                           new: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    """The first LAYOUT_CHANGES_SHOWN differences from ``old`` to ``new`` in one bounded line
    ("added 'x' (BF16 [4, 4]), removed 'y', reshaped 'z' [3] -> [4] (+61 more)"); "" if none."""
    changes = layout_changes(new, old)
    said = ", ".join(changes[:LAYOUT_CHANGES_SHOWN])
    if len(changes) > LAYOUT_CHANGES_SHOWN:
        said += f" (+{len(changes) - LAYOUT_CHANGES_SHOWN} more)"
    return said
