"""Local safetensors checkpoints: memory-mapped reading (single file or the Hugging Face
sharded layout) and atomic writing. The safetensors library writes; the header is parsed
here only to memory-map each tensor's bytes in place, which the library does not expose.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors

from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.errors import IntegrityError, NotFoundError, StoreError, UsageError, os_error
from dcr_log.state import TensorBits

INDEX_NAME = "model.safetensors.index.json"
_SPEC_DTYPE = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "U8": "uint8", "BOOL": "bool",
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Tensor locations of one .safetensors file, every bound checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise IntegrityError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise IntegrityError(f"{path}: header length {n} is over {_MAX_HEADER} bytes: not a safetensors file")
        if n > size - 8:
            raise IntegrityError(f"{path}: truncated: its header needs {8 + n} bytes, the file has {size} "
                                 "(copy it again)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise IntegrityError(f"{path}: header is not JSON") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: header is not a JSON object")
    out = {}
    base = 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise IntegrityError(f"{path}: bad header entry for {name!r}") from None
        if (not isinstance(dtype, str) or len(shape) > 64
                or not all(type(d) is int and 0 <= d < 1 << 63 for d in shape)
                or not all(type(x) is int for x in (begin, end))):
            raise IntegrityError(f"{path}: bad header entry for {name[:80]!r}")
        if dtype not in DTYPE_WIDTH:
            raise UsageError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if not (0 <= begin <= end and end - begin == numel(shape) * DTYPE_WIDTH[dtype]):
            raise IntegrityError(f"{path}: tensor {name!r} has inconsistent offsets")
        if base + end > size:
            raise IntegrityError(f"{path}: truncated: tensor {name!r} ends at byte {base + end}, the file has "
                                 f"{size} (copy it again)")
        out[name] = TensorLocation(path, dtype, shape, base + begin, base + end)
    spans = sorted((loc.start, loc.end) for loc in out.values() if loc.end > loc.start)
    if any(prev_end > start for (_, prev_end), (start, _) in zip(spans, spans[1:])):
        raise IntegrityError(f"{path}: tensors share bytes")
    return out


def checkpoint_files(path: str | os.PathLike) -> dict[str, TensorLocation]:
    """Locations of every tensor of a .safetensors file or a checkpoint directory."""
    p = Path(path)
    if p.is_file():
        return read_header(p)
    if not p.is_dir():
        raise NotFoundError(f"no checkpoint at {p}")
    index = p / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise IntegrityError(f"{index}: not a safetensors index") from None
    else:
        files = sorted(f.name for f in p.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise NotFoundError(f"{p} holds no .safetensors file")
    out: dict[str, TensorLocation] = {}
    for name in files:
        for tensor, loc in read_header(p / name).items():
            if weight_map is not None and weight_map.get(tensor) != name:
                continue
            if tensor in out:
                raise IntegrityError(f"{p}: tensor {tensor!r} appears in two files")
            out[tensor] = loc
    if weight_map is not None and set(weight_map) != set(out):
        raise IntegrityError(f"{index}: weight map does not match the files' tensors")
    return out


def map_checkpoint(locations: Mapping[str, TensorLocation], writable: bool = False) -> dict[str, TensorBits]:
    """Memory-map each tensor's words; with ``writable`` the maps write through to the files."""
    maps: dict[Path, np.ndarray] = {}
    state = {}
    for name, loc in locations.items():
        mm = maps.get(loc.file)
        if mm is None:
            mm = maps[loc.file] = np.memmap(loc.file, dtype=np.uint8, mode="r+" if writable else "r")
        state[name] = TensorBits(loc.dtype, loc.shape, mm[loc.start : loc.end].view(word_dtype(loc.dtype)))
    return state


def load_checkpoint(path: str | os.PathLike) -> dict[str, TensorBits]:
    """Read-only, zero-copy words of every tensor of a checkpoint."""
    return map_checkpoint(checkpoint_files(path))


def save_safetensors(state: Mapping[str, TensorBits], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None,
                     before_rename: Callable[[Path], None] | None = None) -> None:
    """Write one .safetensors file atomically: a temporary file in the same directory,
    fsync, then rename, so ``path`` either holds the whole file or is untouched."""
    path = Path(path)
    specs = {}
    keep = []  # the arrays behind the raw pointers stay alive until serialize_file returns
    for name, bits in state.items():
        words = np.ascontiguousarray(bits.words)
        keep.append(words)
        specs[name] = safetensors.TensorSpec(
            dtype=_SPEC_DTYPE[bits.dtype], shape=list(bits.shape),
            data_ptr=words.ctypes.data if words.size else 0, data_len=words.nbytes,
        )
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise os_error(exc, f"cannot write {path}") from None
    try:  # the old file's permission bits, else 0644 (not mkstemp's 0600)
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = 0o644
    os.close(fd)
    try:
        try:
            safetensors.serialize_file(specs, tmp, metadata=metadata)
            os.chmod(tmp, mode)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            if before_rename:
                before_rename(Path(tmp))
            os.replace(tmp, path)
        except OSError as exc:
            raise os_error(exc, f"cannot write {path}") from None
        except safetensors.SafetensorError as exc:
            text = str(exc)
            cause = ("no space left on device" if "No space left" in text else
                     "disk quota exceeded" if "quota" in text.lower() else text.split("\n")[0][:200])
            raise StoreError(f"cannot write {path}: {cause}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        del keep
