"""Registry of payload encodings. A record names its encoding and params; readers never guess."""

from __future__ import annotations

from dcr_log.codec.base import ChangeSet, Encoding
from dcr_log.codec.dense import DenseEncoding
from dcr_log.codec.raw import RawEncoding
from dcr_log.codec.sparse import SparseEncoding
from dcr_log.codec.ulp import UlpEncoding
from dcr_log.errors import IntegrityError
from dcr_log.format.segment import KINDS

ENCODINGS: dict[str, type[Encoding]] = {
    RawEncoding.name: RawEncoding,
    SparseEncoding.name: SparseEncoding,
    DenseEncoding.name: DenseEncoding,
    UlpEncoding.name: UlpEncoding,
}


def get_encoding(name: str) -> Encoding:
    cls = ENCODINGS.get(name)
    if cls is None:
        raise IntegrityError(f"unknown encoding {name!r}")
    return cls()


def decode_changes(kind, encoding, params, payload, n, k, word) -> ChangeSet:
    if kind not in KINDS:
        raise IntegrityError(f"unknown record kind {kind!r}")
    if not 0 <= k <= n or (kind == "tensor" and k != n):
        raise IntegrityError(f"{kind} record declares {k} changes in a box of {n}")
    return get_encoding(encoding).decode(kind, params, payload, n, k, word)


__all__ = ["ENCODINGS", "KINDS", "ChangeSet", "Encoding", "get_encoding", "decode_changes"]
