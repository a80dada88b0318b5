"""Files on disk as the tests see them: an independent safetensors reader, byte comparison of a
checkpoint with a state, and snapshots of a file tree."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dcr_log.state import TensorBits


def read_safetensors_raw(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """An independent reader: ``name -> (dtype, shape, bytes)`` straight from the file layout."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], tuple(entry["shape"]), data[8 + n + begin : 8 + n + end])
    return out


def assert_file_holds(path: Path, expected: dict[str, TensorBits]) -> None:
    """The safetensors file holds exactly these tensors, bytes compared."""
    got = read_safetensors_raw(path)
    assert sorted(got) == sorted(expected)
    for name, exp in expected.items():
        dtype, shape, raw = got[name]
        assert (dtype, shape) == (exp.dtype, exp.shape), name
        assert raw == exp.words.astype(exp.words.dtype.newbyteorder("<")).tobytes(), name


def snapshot_files(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` (relative path -> bytes)."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
