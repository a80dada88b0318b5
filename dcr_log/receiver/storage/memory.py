"""A receiver's storage in process memory: NumPy arrays, or the caller's torch tensors (CPU
or GPU) written through word views; neither survives the process (not durable)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dcr_log import buffers
from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.digest import XXH3, DigestScheme
from dcr_log.errors import StoreError, UsageError
from dcr_log.log.records import gather_words, scatter_words
from dcr_log.receiver.storage.base import _MISSING, Storage, Where
from dcr_log.state import _NUMPY_TO_DTYPE, _TORCH_TO_DTYPE, TableLayout, TensorBits, is_dtensor


def _signed(width: int) -> np.dtype:
    return np.dtype(f"<i{width}")


def _zeros(name: str, count: int, dtype: np.dtype) -> np.ndarray:
    try:
        return buffers.zeros(count, dtype)
    except (MemoryError, ValueError, OSError):
        raise StoreError(f"cannot allocate tensor {name!r} ({count} words): out of memory") from None


_NUMPY_NATIVE = {v: k for k, v in _NUMPY_TO_DTYPE.items() if k != "bfloat16"}
_NUMPY_NATIVE.pop("F8_E4M3", None)
_NUMPY_NATIVE.pop("F8_E5M2", None)


class NumpyStorage(Storage):
    """A mutable mapping of numpy arrays or TensorBits, updated in place.

    Each value's safetensors dtype comes from ``dtypes`` when given, else from TensorBits or
    the array's numpy dtype (so uint16 arrays holding bf16 bits need ``dtypes`` or TensorBits).
    New tensors are created as the same kind of value as the others (TensorBits if the
    mapping holds TensorBits, else arrays; bf16 and fp8 arrays as unsigned words).
    """

    parallel_reads = True

    def __init__(self, tensors: MutableMapping[str, Any], dtypes: Mapping[str, str] | None = None,
                 owns_layout: bool = False):
        self.owns_layout = owns_layout
        self.tensors = tensors
        self.dtypes = dict(dtypes or {})
        self._as_bits = any(isinstance(v, TensorBits) for v in tensors.values())
        self._bits: dict[str, TensorBits] = {name: self._view(name, x) for name, x in tensors.items()}

    def _view(self, name: str, x: Any) -> TensorBits:
        if isinstance(x, TensorBits):
            if not x.words.flags.writeable:
                raise UsageError(f"tensor {name!r}: words are read-only")
            return x
        if not isinstance(x, np.ndarray):
            raise UsageError(f"tensor {name!r}: expected a numpy array, got {type(x).__name__}")
        if not x.flags.c_contiguous or not x.flags.writeable or x.dtype.byteorder == ">":
            raise UsageError(f"tensor {name!r}: arrays must be C-contiguous, writable and little-endian")
        dtype = self.dtypes.get(name) or _NUMPY_TO_DTYPE.get(x.dtype.name)
        if dtype is None:
            raise UsageError(f"tensor {name!r}: unsupported numpy dtype {x.dtype}")
        if DTYPE_WIDTH[dtype] != x.dtype.itemsize:
            raise UsageError(f"tensor {name!r}: {x.dtype} is not {DTYPE_WIDTH[dtype]} bytes wide")
        return TensorBits(dtype, tuple(int(s) for s in x.shape), x.reshape(-1).view(word_dtype(dtype)))

    def layout(self) -> TableLayout:
        return {name: (b.dtype, b.shape) for name, b in self._bits.items()}

    def locate(self, name: str, where: Where) -> Any:
        return self._bits[name].words, where

    def host_words(self, place) -> tuple[np.ndarray, np.ndarray] | None:
        words, where = place
        return None if isinstance(where, slice) else (words, where)

    def gather(self, place) -> np.ndarray:
        words, where = place
        return gather_words(words, where)

    def write(self, place, values: np.ndarray) -> None:
        words, where = place
        scatter_words(words, where, values)

    def prepare_layout(self, layout: TableLayout, extra_bytes: int = 0) -> None:
        self._prepared = {}
        for name, (dtype, shape) in layout.items():
            old = self._bits.get(name)
            if old is None or old.dtype != dtype or old.shape != shape:
                self._prepared[name] = (dtype, shape, _zeros(name, numel(shape), word_dtype(dtype)))

    def _new(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
        prepared = getattr(self, "_prepared", {}).pop(name, None)
        if prepared is not None and prepared[:2] == (dtype, shape):
            words = prepared[2]
        else:
            words = _zeros(name, numel(shape), word_dtype(dtype))
        if self._as_bits:
            return TensorBits(dtype, shape, words)
        native = _NUMPY_NATIVE.get(dtype)
        if native is None:
            self.dtypes[name] = dtype  # bf16/fp8 held as unsigned words
            return words.reshape(shape)
        self.dtypes.pop(name, None)
        return words.view(native).reshape(shape)

    def set_layout(self, layout: TableLayout) -> Any:
        undo: dict[str, Any] = {}
        for name in list(self._bits):
            if name not in layout:
                undo[name] = (self.tensors[name], self.dtypes.get(name))
                del self.tensors[name], self._bits[name]
        for name, (dtype, shape) in layout.items():
            old = self._bits.get(name)
            if old is not None and old.dtype == dtype and old.shape == shape:
                continue
            undo[name] = (_MISSING, None) if old is None else (self.tensors[name], self.dtypes.get(name))
            self.tensors[name] = self._new(name, dtype, shape)
            self._bits[name] = self._view(name, self.tensors[name])
        return undo

    def restore_layout(self, undo: Any) -> None:
        for name, (value, dtype) in undo.items():
            if value is _MISSING:
                self.tensors.pop(name, None)
                self._bits.pop(name, None)
                self.dtypes.pop(name, None)
                continue
            if dtype is None:
                self.dtypes.pop(name, None)
            else:
                self.dtypes[name] = dtype
            self.tensors[name] = value
            self._bits[name] = self._view(name, value)

    def tensor_words(self, name: str) -> np.ndarray:
        return self._bits[name].words


@dataclass
class _DevicePlace:
    flat: Any            # the tensor's signed words on its device
    where: Where         # the flat positions on the host (digest fallbacks)
    device_where: Any    # the same on the device (a slice stays a slice)


class TorchStorage(Storage):
    """A mutable mapping of torch tensors (CPU or any accelerator), updated in place.

    Each tensor is viewed as same-width signed integers, which support indexing and
    index_put on every device; tensors keep their identity unless their dtype or shape
    changes. New tensors go to ``device`` (default: the device of the existing tensors).
    """

    def __init__(self, tensors: MutableMapping[str, Any], device: Any = None,
                 device_words: bool = False, owns_layout: bool = False):
        import torch

        self.owns_layout = owns_layout
        self._torch = torch
        # With device_words (the receiver sets it for tensors off the CPU), gathered words,
        # targets and digests stay on the tensors' device: a record moves its positions and
        # values there once and two digests back, not its words both ways.
        self.device_words = device_words
        self.tensors = tensors
        self._signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        devices = {t.device for t in tensors.values()}
        if device is None:
            device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        self.device = torch.device(device)
        self._flat: dict[str, Any] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, t in tensors.items():
            self._register(name, t)

    def _register(self, name: str, t: Any) -> None:
        if is_dtensor(t):
            raise UsageError(f"tensor {name!r} is a DTensor (one rank's part of a sharded tensor): a receiver "
                             "updates whole tensors in place; give it plain tensors (dt.full_tensor()), and log "
                             "from DTensors with ShardedWriter and Shard.from_dtensor")
        dtype = _TORCH_TO_DTYPE.get(str(t.dtype))
        if dtype is None:
            raise UsageError(f"tensor {name!r}: unsupported torch dtype {t.dtype}")
        if not t.is_contiguous():
            raise UsageError(f"tensor {name!r}: torch receivers need contiguous tensors")
        signed = self._signed[DTYPE_WIDTH[dtype]]
        if t.numel() == 0:  # empty tensors may carry strides that view() refuses
            self._flat[name] = self._torch.empty(0, dtype=signed, device=t.device)
        else:
            self._flat[name] = t.detach().view(-1).view(signed)
        self._meta[name] = (dtype, tuple(int(s) for s in t.shape))

    def layout(self) -> TableLayout:
        return dict(self._meta)

    @property
    def parallel_reads(self) -> bool:  # type: ignore[override]
        # Host tensors are read as numpy views by the C gather; an accelerator's through its
        # streams, which stay on one thread.
        return not self.device_words and all(f.device.type == "cpu" for f in self._flat.values())

    def _host_to_device(self, arr: np.ndarray, device) -> Any:
        if not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, copy=True)
        t = self._torch.from_numpy(arr)
        return t if device.type == "cpu" else t.to(device, non_blocking=False)

    def locate(self, name: str, where: Where) -> Any:
        flat = self._flat[name]
        if self.device_words:
            device_where = where if isinstance(where, slice) else self._host_to_device(
                np.asarray(where, dtype=np.int64), flat.device)
            return _DevicePlace(flat, where, device_where)
        if isinstance(where, slice):
            return flat, where
        if flat.device.type == "cpu":
            # Host memory: the tensor's words as a numpy view, moved by the C gather/scatter.
            words = flat.numpy()
            return words.view(words.dtype.str.replace("i", "u")), np.asarray(where, dtype=np.int64)
        return flat, self._host_to_device(np.asarray(where, dtype=np.int64), flat.device)

    def host_words(self, place) -> tuple[np.ndarray, np.ndarray] | None:
        if isinstance(place, _DevicePlace):
            return None
        flat, where = place
        # (a CPU tensor's words as locate viewed them; a slice or a device keeps torch's indexing)
        return (flat, where) if isinstance(flat, np.ndarray) and isinstance(where, np.ndarray) else None

    def gather(self, place) -> np.ndarray:
        if isinstance(place, _DevicePlace):
            picked = place.flat[place.device_where]
            return picked.clone() if isinstance(place.device_where, slice) else picked
        flat, where = place
        if isinstance(flat, np.ndarray):
            return gather_words(flat, where)
        picked = flat[where]
        if picked.device.type == "cpu":
            picked = picked.clone() if isinstance(where, slice) else picked
        else:
            picked = picked.cpu()
        arr = picked.numpy()
        return arr.view(arr.dtype.str.replace("i", "u"))

    def select(self, place, values: np.ndarray):
        if isinstance(place, _DevicePlace) and isinstance(values, np.ndarray):
            return self._host_to_device(values.view(_signed(values.dtype.itemsize)), place.flat.device)
        return values

    def digest_at(self, place, owned, words, digests: DigestScheme) -> int:
        if isinstance(words, np.ndarray):
            return digests.at(owned, words)
        if digests.composable:  # sum digests: computed where the words are
            from dcr_log import torch_ops

            if isinstance(place.device_where, slice):
                return torch_ops.sum_digest(words, start=place.device_where.start or 0)
            return torch_ops.sum_digest(words, place.device_where)
        host = words.cpu().numpy()
        return digests.at(owned, host.view(host.dtype.str.replace("i", "u")))

    def tensor_digest(self, name: str, digests: DigestScheme = XXH3) -> int:
        flat = self._flat[name]
        if self.device_words and digests.composable:
            from dcr_log import torch_ops

            return torch_ops.sum_digest(flat)  # no copy of the tensor to the host
        return super().tensor_digest(name, digests)

    def write(self, place, values: np.ndarray) -> None:
        if isinstance(place, _DevicePlace):
            src = values if not isinstance(values, np.ndarray) else self._host_to_device(
                values.view(_signed(values.dtype.itemsize)), place.flat.device)
            if isinstance(place.device_where, slice):
                place.flat[place.device_where].copy_(src)
            else:
                place.flat.index_put_((place.device_where,), src)
            return
        flat, where = place
        if isinstance(flat, np.ndarray):
            scatter_words(flat, where, values.view(flat.dtype))
            return
        width = flat.element_size()
        src = self._host_to_device(values.view(_signed(width)), flat.device)
        if isinstance(where, slice):
            flat[where].copy_(src)
        else:
            flat.index_put_((where,), src)

    def _zeros(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
        torch = self._torch
        from dcr_log.state import _DTYPE_TO_TORCH

        try:
            return torch.zeros(shape, dtype=getattr(torch, _DTYPE_TO_TORCH[dtype]), device=self.device)
        except (MemoryError, RuntimeError, ValueError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise StoreError(f"cannot allocate tensor {name!r} on {self.device}: "
                             f"{str(exc).splitlines()[0][:120] if str(exc) else 'out of memory'}") from None

    def prepare_layout(self, layout: TableLayout, extra_bytes: int = 0) -> None:
        self._prepared = {name: (dtype, shape, self._zeros(name, dtype, shape))
                          for name, (dtype, shape) in layout.items()
                          if self._meta.get(name) != (dtype, shape)}

    def set_layout(self, layout: TableLayout) -> Any:
        """A reshaped or retyped tensor is changed in place (``tensor.data = new``): the mapping
        keeps the same object, so a model whose parameters the mapping holds sees the new
        tensor instead of keeping a detached old one."""
        undo: dict[str, Any] = {}
        for name in list(self._meta):
            if name not in layout:
                undo[name] = self.tensors[name]
                del self.tensors[name], self._meta[name], self._flat[name]
        prepared = getattr(self, "_prepared", {})
        for name, (dtype, shape) in layout.items():
            if self._meta.get(name) == (dtype, shape):
                continue
            ready = prepared.pop(name, None)
            t = ready[2] if ready is not None and ready[:2] == (dtype, shape) else self._zeros(name, dtype, shape)
            old = self.tensors.get(name, _MISSING)
            if old is _MISSING:
                undo[name] = _MISSING
                self.tensors[name] = t
            else:
                undo[name] = (old, old.data)
                old.data = t
            self._register(name, self.tensors[name])
        return undo

    def restore_layout(self, undo: Any) -> None:
        for name, value in undo.items():
            if value is _MISSING:
                self.tensors.pop(name, None)
                self._meta.pop(name, None)
                self._flat.pop(name, None)
            elif isinstance(value, tuple):
                obj, data = value
                obj.data = data
                self.tensors[name] = obj
                self._register(name, obj)
            else:
                self.tensors[name] = value
                self._register(name, value)

    def tensor_words(self, name: str) -> np.ndarray:
        flat = self._flat[name]
        host = flat if flat.device.type == "cpu" else flat.cpu()
        arr = host.numpy()
        return arr.view(arr.dtype.str.replace("i", "u"))
