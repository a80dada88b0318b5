"""The encoding interface shared by every codec, and the checked zstd and byte-plane helpers.

An encoding turns one record's change set into payload bytes and back. A change set is
``positions`` (strictly increasing box-local row-major indices, or ``None`` meaning every
position of the box, for records of kind ``tensor``) and ``values`` (one word per position).
Decoders check every declared length and bound before they allocate or write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import IntegrityError

KINDS = ("xor", "overwrite", "tensor")


@dataclass(frozen=True)
class ChangeSet:
    """Box-local changes: ``positions is None`` means all ``n`` positions in order."""

    n: int
    positions: np.ndarray | None
    values: np.ndarray

    @property
    def k(self) -> int:
        return self.n if self.positions is None else int(self.positions.size)


class Encoding(ABC):
    name: str
    kinds: tuple[str, ...]

    @abstractmethod
    def encode(self, kind: str, changes: ChangeSet) -> tuple[dict, bytes]:
        """Return (params, payload)."""

    @abstractmethod
    def decode(
        self, kind: str, params: dict, payload: bytes, n: int, k: int, word: np.dtype
    ) -> ChangeSet:
        """Inverse of encode; raises IntegrityError on any inconsistency."""

    def check_kind(self, kind: str) -> None:
        if kind not in self.kinds:
            raise IntegrityError(f"encoding {self.name!r} cannot carry records of kind {kind!r}")


def check_params(name: str, params: dict, allowed: dict[str, tuple]) -> None:
    """Every key known and every value one of the allowed ones (or of the allowed type)."""
    if not isinstance(params, dict):
        raise IntegrityError(f"{name}: params must be an object")
    for key, value in params.items():
        if key not in allowed:
            raise IntegrityError(f"{name}: unknown parameter {key!r}")
        ok = allowed[key]
        if isinstance(ok, type):
            if not isinstance(value, ok) or isinstance(value, bool):
                raise IntegrityError(f"{name}: parameter {key!r} must be {ok.__name__}")
        elif value not in ok:
            raise IntegrityError(f"{name}: parameter {key!r}={value!r} not in {ok}")
    missing = set(allowed) - set(params)
    if missing:
        raise IntegrityError(f"{name}: missing parameters {sorted(missing)}")


def to_planes(words: np.ndarray) -> np.ndarray:
    """Byte planes: all least significant bytes first, then the next byte of each word, ..."""
    w = words.dtype.itemsize
    if w == 1:
        return words.view(np.uint8)
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, w).T).reshape(-1)


def from_planes(buf: np.ndarray, count: int, word: np.dtype) -> np.ndarray:
    w = word.itemsize
    if buf.size != count * w:
        raise IntegrityError(f"byte planes hold {buf.size} bytes, expected {count * w}")
    if w == 1:
        return buf.view(word)
    return np.ascontiguousarray(buf.reshape(w, count).T).reshape(-1).view(word)


ZSTD_LEVELS = tuple(range(1, 23))


def zstd_compress(data: np.ndarray | bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(
        memoryview(data).cast("B") if isinstance(data, np.ndarray) else data
    )


def zstd_decompress_exact(payload: bytes, expected: int) -> np.ndarray:
    """Decompress one zstd frame that must declare and hold exactly ``expected`` bytes."""
    try:
        declared = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"not a zstd frame: {exc}") from None
    if declared != expected:
        raise IntegrityError(f"zstd frame declares {declared} bytes, expected {expected}")
    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"corrupt zstd frame: {exc}") from None
    if len(out) != expected:
        raise IntegrityError(f"zstd frame held {len(out)} bytes, expected {expected}")
    return np.frombuffer(out, dtype=np.uint8)


def check_positions(positions: np.ndarray, n: int) -> None:
    """Strictly increasing and below n (also catches uint64 wrap-around of a cumulative sum)."""
    if positions.size == 0:
        return
    if int(positions[-1]) >= n or (positions.size > 1 and not np.all(positions[1:] > positions[:-1])):
        raise IntegrityError("positions are not strictly increasing inside the box")
