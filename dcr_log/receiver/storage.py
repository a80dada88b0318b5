"""Receiver storage: where a receiver's weights live, seen as flat little-endian words.

Three backends share one small interface (spec/RECEIVER.md, "Storage"):
- ``NumpyStorage``: a dict of numpy arrays (or TensorBits), updated in place;
- ``TorchStorage``: a dict of torch tensors on any device, updated in place through
  same-width signed integer views; positions and values go to the device, never whole tensors
  to the host;
- ``CheckpointStorage``: a safetensors checkpoint directory (one file or the sharded layout)
  updated in place through writable memory maps; durable.

A ``where`` is what ``dcr_log.delta.flat_positions`` returns: int64 flat indices or a slice.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import stat
import struct
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping

import numpy as np

from dcr_log.checkpoint import INDEX_NAME, TensorLocation, read_header, save_safetensors
from dcr_log import buffers
from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.delta import gather_words, scatter_words
from dcr_log.errors import IntegrityError, NotFoundError, StoreError, UsageError, os_error
from dcr_log.digest import XXH3, DigestScheme
from dcr_log.state import _NUMPY_TO_DTYPE, _TORCH_TO_DTYPE, TensorBits, TensorInfo, is_torch_tensor, state_digest

Layout = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)
Where = np.ndarray | slice
FaultHook = Callable[..., None]

_MISSING = object()


class Storage(ABC):
    """A receiver's tensors as flat words. ``durable`` storage survives the process."""

    durable = False
    # Whether the receiver may follow a version that changes the tensor table here (create,
    # drop, reshape, retype tensors). Mappings of the caller's own tensors (a model's
    # parameters) are not the receiver's to change unless it is opened with
    # ``layout_changes="own"``; such a version is then refused with LayoutError.
    owns_layout = True
    # The directory a version's files (feature files) are written to; None: the storage
    # holds tensors only and ignores files (memory storage).
    files_dir: Path | None = None
    # Set by the Receiver: called at named points so tests can inject faults.
    fault: FaultHook | None = None

    @abstractmethod
    def layout(self) -> Layout:
        """Every tensor's safetensors dtype and shape."""

    @abstractmethod
    def locate(self, name: str, where: Where) -> Any:
        """A handle on some words of a tensor, reused by gather and write."""

    @abstractmethod
    def gather(self, place: Any) -> np.ndarray:
        """A host copy of the words at ``place`` (unsigned words of the tensor's width)."""

    @abstractmethod
    def write(self, place: Any, values: np.ndarray) -> None:
        """Store ``values`` (unsigned words) at ``place``."""

    @abstractmethod
    def set_layout(self, layout: Layout) -> Any:
        """Create (zero-filled) or reshape tensors to match ``layout`` and drop the others;
        tensors whose dtype and shape already match keep their bits and identity.
        Returns what ``restore_layout`` needs to undo it (memory storage) or None."""

    def restore_layout(self, undo: Any) -> None:
        """Undo ``set_layout`` (memory storage only)."""
        raise UsageError(f"{type(self).__name__} cannot undo a layout change")

    def prepare_layout(self, layout: Layout, extra_bytes: int = 0) -> None:
        """Before the first write of an apply: make sure ``set_layout(layout)`` (and about
        ``extra_bytes`` more, the journal's) can be done, or raise StoreError. Memory storage
        allocates the new tensors here (kept for set_layout); durable storage checks free
        space. Writes nothing."""

    @abstractmethod
    def tensor_words(self, name: str) -> np.ndarray:
        """The tensor's flat words on the host (a view where the storage allows it)."""

    def tensor_digest(self, name: str, digests: DigestScheme = XXH3) -> int:
        """The tensor's digest under the log's scheme."""
        return digests.tensor(self.tensor_words(name), self.layout()[name][1])

    def flush(self) -> None:
        """Make every write so far durable (no-op in memory)."""

    def weight_names(self) -> set[str]:
        """Names in ``files_dir`` that hold tensors (never written as a version's files)."""
        return set()

    def close(self) -> None:
        pass

    # Storages that hold part of a tensor (engine layouts, tensor-parallel ranks) override
    # these three; a plain storage holds every element of every tensor.

    def holds(self, name: str) -> bool:
        """Whether the storage (with its group) holds the tensor at all."""
        return True

    def select(self, place: Any, values: np.ndarray) -> np.ndarray:
        """The record values for the positions ``place`` holds here."""
        return values

    def owned(self, place: Any, where: Where) -> tuple[Where, np.ndarray | None]:
        """The positions whose digest this storage adds to its group's sum, and their indices
        among the held words (None: all)."""
        return where, None

    def digest_at(self, place: Any, owned: Where, words: Any, digests: DigestScheme) -> int:
        """The digest of ``words`` (what gather gave, or targets computed from it) at the
        flat positions ``owned``."""
        return digests.at(owned, words)

    def _fault(self, point: str, **info) -> None:
        if self.fault is not None:
            self.fault(point, **info)


def storage_state_digest(storage: Storage, digests: DigestScheme = XXH3) -> int:
    """The state digest of what the storage holds, every tensor hashed."""
    return state_digest([TensorInfo(n, d, s, storage.tensor_digest(n, digests))
                         for n, (d, s) in storage.layout().items()])


def _signed(width: int) -> np.dtype:
    return np.dtype(f"<i{width}")


def _zeros(name: str, count: int, dtype: np.dtype) -> np.ndarray:
    try:
        return buffers.zeros(count, dtype)
    except (MemoryError, ValueError, OSError):
        raise StoreError(f"cannot allocate tensor {name!r} ({count} words): out of memory") from None


# -- numpy ---------------------------------------------------------------------------------

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

    def layout(self) -> Layout:
        return {name: (b.dtype, b.shape) for name, b in self._bits.items()}

    def locate(self, name: str, where: Where) -> Any:
        return self._bits[name].words, where

    def gather(self, place) -> np.ndarray:
        words, where = place
        return gather_words(words, where)

    def write(self, place, values: np.ndarray) -> None:
        words, where = place
        scatter_words(words, where, values)

    def prepare_layout(self, layout: Layout, extra_bytes: int = 0) -> None:
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

    def set_layout(self, layout: Layout) -> Any:
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


# -- torch ---------------------------------------------------------------------------------

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

    def layout(self) -> Layout:
        return dict(self._meta)

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

    def prepare_layout(self, layout: Layout, extra_bytes: int = 0) -> None:
        self._prepared = {name: (dtype, shape, self._zeros(name, dtype, shape))
                          for name, (dtype, shape) in layout.items()
                          if self._meta.get(name) != (dtype, shape)}

    def set_layout(self, layout: Layout) -> Any:
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


# -- safetensors checkpoint directory ------------------------------------------------------

def _file_metadata(path: Path) -> dict[str, str] | None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise IntegrityError(f"{path}: header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else None


def check_regular(path: Path, what: str = "file", in_place: bool = False) -> bool:
    """Whether ``path`` exists, refusing anything but a regular file (or a directory, for
    ``what="directory"``): a receiver writes its files in place and must never follow a
    symbolic link out of its directory. A file written ``in_place`` must have no other hard
    link, which would be written through too (possibly outside the directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise os_error(exc, f"cannot inspect {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{path} is a symbolic link: a receiver writes in place and never "
                         "outside its directory (copy the files in instead)")
    ok = stat.S_ISDIR(st.st_mode) if what == "directory" else stat.S_ISREG(st.st_mode)
    if not ok:
        raise UsageError(f"{path} is not a regular {what}")
    if in_place and st.st_nlink > 1:
        raise UsageError(f"{path} has {st.st_nlink} hard links: a receiver writes it in place, "
                         "which would change every other name of it too (copy the file instead "
                         "of linking it)")
    return True


def plain_file_name(name, where: Path) -> str:
    """An index entry must name a file directly inside the directory."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or len(name.encode("utf-8", "replace")) > 255):
        raise IntegrityError(f"{where}: file name {str(name)[:80]!r} is not a file of this directory")
    return name


def free_bytes(directory: Path) -> int:
    """Bytes this process may still allocate on ``directory``'s file system."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 1 << 62  # unknown: do not refuse on its account
    # root may use the blocks a file system reserves for it
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


# Kept free beyond what a write needs: file-system metadata and the journal's first pages.
SPACE_SLACK = 1 << 20


def check_space(directory: Path, needed: int, what: str) -> None:
    available = free_bytes(directory)
    if needed + SPACE_SLACK > available:
        raise StoreError(f"cannot {what} in {directory}: no space left on device "
                         f"({needed} bytes needed, {available} available)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replaced_mode(path: Path) -> int:
    """The permission bits a file written over ``path`` gets: the old file's, else 0644
    (mkstemp's 0600 would hide a checkpoint from a serving process of another user)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o644


def write_file_atomic(path: Path, data: bytes, prefix: str | None = None,
                      before_rename: Callable[[Path], None] | None = None) -> None:
    """tmp (created exclusively: never through a planted link; named ``.<name>.<random>.tmp``
    unless ``prefix`` is given) + fsync + rename + fsync of the directory."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}." if prefix is None else prefix, suffix=".tmp",
                                dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, replaced_mode(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# A safetensors index of a few million tensor names stays far below this.
MAX_INDEX_BYTES = 1 << 30


def checkpoint_file_names(directory: Path) -> tuple[list[str], bool]:
    """The .safetensors files of a checkpoint directory and whether it has an index."""
    index = directory / INDEX_NAME
    if check_regular(index):
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise IntegrityError(f"{index}: more than {MAX_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise IntegrityError(f"{index}: not a safetensors index") from None
        for name in files:
            plain_file_name(name, index)
        return files, True
    names = sorted(p.name for p in directory.glob("*.safetensors"))
    return [n for n in names if check_regular(directory / n)], False


def has_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and bool(checkpoint_file_names(directory)[0])


_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


class CheckpointStorage(Storage):
    """A safetensors checkpoint directory updated in place through memory maps.

    The tensor locations come from the files' headers (the union over the files the index
    names, or every ``*.safetensors`` file without an index), so a directory caught between
    the rewrite of a file and of the index by a crash still opens. A layout change rewrites
    the affected files whole (tmp + fsync + rename) and then the index; tensors never move
    between files, and new tensors go to the file with the fewest bytes.
    """

    durable = True

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise NotFoundError(f"no checkpoint directory at {self.directory}")
        self.files_dir = self.directory
        self._maps: dict[Path, np.memmap] = {}
        self._dirty: set[Path] = set()
        self._open()

    def _open(self) -> None:
        files, self.sharded = checkpoint_file_names(self.directory)
        if not files:
            raise NotFoundError(f"{self.directory} holds no .safetensors file")
        self.files = [self.directory / f for f in files]
        self.locations: dict[str, TensorLocation] = {}
        for path in self.files:
            if not check_regular(path, in_place=True):
                raise NotFoundError(f"{path} is missing")
            for name, loc in read_header(path).items():
                if name in self.locations:
                    raise IntegrityError(f"{self.directory}: tensor {name!r} appears in two files")
                self.locations[name] = loc
        # In-place writes need each byte to belong to one tensor (read_header allows overlaps).
        spans = sorted((loc.file, loc.start, loc.end, name) for name, loc in self.locations.items()
                       if loc.end > loc.start)
        for (f1, _, end1, n1), (f2, start2, _, n2) in zip(spans, spans[1:]):
            if f1 == f2 and start2 < end1:
                raise IntegrityError(f"{f1}: tensors {n1!r} and {n2!r} share bytes")
        try:
            self._maps = {p: np.memmap(p, dtype=np.uint8, mode="r+") for p in self.files}
        except OSError as exc:
            raise os_error(exc, f"cannot open {self.directory} for writing") from None
        self._words = {
            name: self._maps[loc.file][loc.start:loc.end].view(word_dtype(loc.dtype))
            for name, loc in self.locations.items()
        }

    def weight_names(self) -> set[str]:
        """The directory entries that hold weights: never written as a version's files."""
        return {p.name for p in self.files} | {INDEX_NAME}

    def close(self) -> None:
        # Views keep the maps alive; dropping every reference unmaps them.
        self._words = {}
        self._maps = {}

    def layout(self) -> Layout:
        return {name: (loc.dtype, loc.shape) for name, loc in self.locations.items()}

    def words(self, name: str) -> np.ndarray:
        return self._words[name]

    def locate(self, name: str, where: Where) -> Any:
        loc = self.locations[name]
        return self._words[name], where, loc.file, loc.start

    def gather(self, place) -> np.ndarray:
        words, where, _, _ = place
        return np.array(words[where]) if isinstance(where, slice) else gather_words(words, where)

    def _populate(self, file: Path, start: int, where, count: int, width: int) -> None:
        """Fault the pages a dense scatter will dirty in one call (MADV_POPULATE_WRITE)
        instead of one write fault per page: at 1% changed every page of a bf16 tensor
        is written, and the faults cost more than the scatter itself."""
        if isinstance(where, slice) or count == 0:
            return
        lo = start + int(where[0]) * width
        hi = start + (int(where[-1]) + 1) * width
        lo -= lo % _PAGE
        if count * 8 < (hi - lo) // _PAGE:
            return  # sparse: most pages stay clean, let the faults pick them
        try:
            self._maps[file]._mmap.madvise(_MADV_POPULATE_WRITE, lo, hi - lo)
        except (AttributeError, OSError, ValueError):
            pass  # an older kernel (before 5.14) or another platform: the faults do it

    def write(self, place, values: np.ndarray) -> None:
        words, where, file, start = place
        self._dirty.add(file)
        self._populate(file, start, where, values.size, words.itemsize)
        if self.fault is not None and values.size > 1:
            # Fault injection: the "torn" point lies between the two halves of one write.
            half = values.size // 2
            if isinstance(where, slice):
                words[where.start:where.start + half] = values[:half]
                self._fault("torn", file=file.name)
                words[where.start + half:where.stop] = values[half:]
            else:
                words[where[:half]] = values[:half]
                self._fault("torn", file=file.name)
                words[where[half:]] = values[half:]
            return
        scatter_words(words, where, values)

    def flush(self) -> None:
        # msync(MS_SYNC) of each written file: its data is on disk before any journal marker.
        for path in sorted(self._dirty):
            self._maps[path].flush()
        self._dirty.clear()

    def tensor_words(self, name: str) -> np.ndarray:
        return self._words[name]

    def _plan(self, layout: Layout) -> dict[Path, list[str]]:
        """Which tensors each file holds after the change (deterministic, tensors never move)."""
        plan: dict[Path, list[str]] = {p: [] for p in self.files}
        sizes = dict.fromkeys(self.files, 0)
        new = []
        for name in sorted(layout, key=str.encode):
            loc = self.locations.get(name)
            if loc is None:
                new.append(name)
                continue
            plan[loc.file].append(name)
            sizes[loc.file] += numel(layout[name][1]) * DTYPE_WIDTH[layout[name][0]]
        for name in new:
            target = min(self.files, key=lambda p: (sizes[p], p.name))
            plan[target].append(name)
            sizes[target] += numel(layout[name][1]) * DTYPE_WIDTH[layout[name][0]]
        return plan

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of rewrites a crash interrupted (``.<file>.<random>.tmp``)."""
        for name in [p.name for p in self.files] + [INDEX_NAME]:
            for stale in self.directory.glob(f".{glob.escape(name)}.*.tmp"):
                stale.unlink(missing_ok=True)

    def _rewrites(self, layout: Layout, plan: dict[Path, list[str]]) -> dict[Path, int]:
        """The files a layout change rewrites, with the tensor bytes each will hold."""
        out = {}
        for path, names in plan.items():
            current = {n: (loc.dtype, loc.shape) for n, loc in self.locations.items() if loc.file == path}
            if current != {n: layout[n] for n in names}:
                out[path] = sum(numel(layout[n][1]) * DTYPE_WIDTH[layout[n][0]] for n in names)
        return out

    def prepare_layout(self, layout: Layout, extra_bytes: int = 0) -> None:
        # Every rewritten file is whole on disk next to the old one (whose map stays open
        # until the change is done).
        needed = sum(self._rewrites(layout, self._plan(layout)).values())
        check_space(self.directory, needed + extra_bytes, "apply the version")

    def set_layout(self, layout: Layout) -> None:
        plan = self._plan(layout)
        self._remove_stale_temporaries()
        rewritten = False
        for path, names in plan.items():
            current = {n: (loc.dtype, loc.shape) for n, loc in self.locations.items() if loc.file == path}
            wanted = {n: layout[n] for n in names}
            if current == wanted:
                continue
            self.flush()  # bytes carried into the new file are copied from the maps
            state = {}
            for n in names:
                dtype, shape = layout[n]
                keep = current.get(n) == (dtype, shape)
                state[n] = TensorBits(dtype, shape, self._words[n] if keep
                                      else np.zeros(numel(shape), dtype=word_dtype(dtype)))
            save_safetensors(state, path, metadata=_file_metadata(path))
            rewritten = True
            self._fault("layout_file", file=path.name)
        if rewritten:
            fsync_dir(self.directory)
        if self.sharded:
            self._write_index({n: p.name for p, names in plan.items() for n in names}, layout)
        if rewritten:
            self.close()
            self._open()

    def _write_index(self, weight_map: dict[str, str], layout: Layout) -> None:
        index_path = self.directory / INDEX_NAME
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        meta = dict(index.get("metadata") or {})
        meta["total_size"] = sum(numel(s) * DTYPE_WIDTH[d] for d, s in layout.values())
        new = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        if index.get("weight_map") == new["weight_map"] and index.get("metadata") == meta:
            return
        write_file_atomic(index_path, (json.dumps(new, indent=2) + "\n").encode())


def open_storage(storage: Any, device: Any = None) -> Storage:
    """A Storage for a Storage, a checkpoint directory path, or a dict of numpy / torch tensors."""
    if isinstance(storage, Storage):
        return storage
    if isinstance(storage, (str, os.PathLike)):
        return CheckpointStorage(storage)
    if isinstance(storage, MutableMapping):
        if any(is_torch_tensor(v) for v in storage.values()):
            return TorchStorage(storage, device=device)
        return NumpyStorage(storage)
    raise UsageError(f"cannot use a {type(storage).__name__} as receiver storage")
