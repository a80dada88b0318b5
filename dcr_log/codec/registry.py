"""The registry of payload encodings: the one place that knows which encodings exist, the
order writers try them in, and which log feature a reader needs for each.

Registration order is trial order and tie order: the writer keeps the first of the smallest
candidates, so with the default registry (raw, ulp, ulp-rans, sparse, dense) the choice and
the bytes are those of every earlier release in a log without the feature rans-encoding. A
third-party or test encoding is added with ``register`` (or ``registered``, for a block) and
tried after the built-in ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import ChangeSet, Encoding
from dcr_log.codec.dense import DenseEncoding
from dcr_log.codec.raw import RawEncoding
from dcr_log.codec.sparse import SparseEncoding
from dcr_log.codec.ulp import UlpEncoding
from dcr_log.codec.ulp_rans import UlpRansEncoding
from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format.segment import KINDS

# Name -> class, in trial order. Readers look names up here; writers walk it in order.
ENCODINGS: dict[str, type[Encoding]] = {
    cls.name: cls for cls in (RawEncoding, UlpEncoding, UlpRansEncoding, SparseEncoding, DenseEncoding)
}


def register(cls: type[Encoding]) -> type[Encoding]:
    """Add an encoding after those registered; its name must be new. Returns ``cls``."""
    if not getattr(cls, "name", None) or cls.name in ENCODINGS:
        raise UsageError(f"an encoding named {getattr(cls, 'name', None)!r} is already registered or unnamed")
    ENCODINGS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove an encoding: writers stop trying it, readers refuse its records."""
    if ENCODINGS.pop(name, None) is None:
        raise UsageError(f"no encoding named {name!r} is registered")


@contextmanager
def registered(cls: type[Encoding]) -> Iterator[type[Encoding]]:
    """``cls`` registered for the block, unregistered after it."""
    register(cls)
    try:
        yield cls
    finally:
        unregister(cls.name)


def get_encoding(name: str) -> Encoding:
    cls = ENCODINGS.get(name)
    if cls is None:
        raise IntegrityError(f"unknown encoding {name!r}")
    return cls()


def required_feature(name: str) -> str | None:
    """The log feature a reader needs for records in encoding ``name`` (None: none, or the
    encoding is unknown, which decoding refuses on its own)."""
    cls = ENCODINGS.get(name)
    return None if cls is None else cls.feature


def allowed(cls: type[Encoding], features: Collection[str]) -> bool:
    """Whether a log with ``features`` may hold records in this encoding."""
    return cls.feature is None or cls.feature in features


def choose(attempt: Attempt, features: Collection[str]) -> tuple[str, dict, bytes]:
    """(encoding, params, payload) for one box: every registered encoding that carries the
    attempt's kind and that the log's ``features`` allow is tried in order; the first of the
    smallest candidates wins."""
    best: Candidate | None = None
    for cls in tuple(ENCODINGS.values()):  # a snapshot: registration may change under threads
        if attempt.kind not in cls.kinds or not allowed(cls, features):
            continue
        candidate = cls.try_encode(attempt)
        if candidate is not None and (best is None or candidate.size < best.size):
            best = candidate
            attempt.size_to_beat = candidate.size
    if best is None:
        raise UsageError(f"no registered encoding can carry records of kind {attempt.kind!r}")
    params, payload = best.result(attempt)
    return best.encoding, params, payload


def check_counts(kind: str, n: int, k: int) -> None:
    """A record's kind and its ``k`` changes in a box of ``n`` elements (a tensor record's all)."""
    if kind not in KINDS:
        raise IntegrityError(f"unknown record kind {kind!r}")
    if not 0 <= k <= n or (kind == "tensor" and k != n):
        raise IntegrityError(f"{kind} record declares {k} changes in a box of {n}")


def decode_changes(kind, encoding, params, payload, n, k, word, origin: int = 0) -> ChangeSet:
    """A record's change set; with ``origin``, every position offset by it (ChangeSet.origin)."""
    check_counts(kind, n, k)
    return get_encoding(encoding).decode_at(kind, params, payload, n, k, word, origin)
