"""A commit record's tensor table: one row per tensor (``TensorInfo``) and the state digest
over the rows (spec/FORMAT.md section 7). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from dcr_log.digest import XXH3, DigestScheme

if TYPE_CHECKING:
    from dcr_log.state import TensorBits


def digest_hex(d: int) -> str:
    return f"{d:016x}"


@dataclass(frozen=True)
class TensorInfo:
    """One row of a commit record's tensor table."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: int

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "digest": digest_hex(self.digest),
        }

    @staticmethod
    def of(name: str, bits: TensorBits, scheme: DigestScheme = XXH3) -> TensorInfo:
        return TensorInfo(name, bits.dtype, bits.shape, bits.digest(scheme))


def state_digest(table: list[TensorInfo] | Mapping[str, TensorInfo]) -> int:
    """xxh3_64 over one line per tensor sorted by UTF-8 name: name NUL dtype NUL dims NUL hex LF."""
    rows = table.values() if isinstance(table, Mapping) else table
    lines = sorted(
        (
            t.name.encode()
            + b"\x00"
            + t.dtype.encode()
            + b"\x00"
            + ",".join(str(s) for s in t.shape).encode()
            + b"\x00"
            + digest_hex(t.digest).encode()
            + b"\n"
        )
        for t in rows
    )
    return xxhash.xxh3_64_intdigest(b"".join(lines))
