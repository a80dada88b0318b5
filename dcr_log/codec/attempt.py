"""What the writer offers each encoding for one box (an Attempt) and what an encoding offers
back (a Candidate). The registry (dcr_log.codec.registry) walks the encodings over one
Attempt and keeps the smallest Candidate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dcr_log.codec.base import ChangeSet

if TYPE_CHECKING:
    from dcr_log.codec.base import Encoding


def _fresh_buffer(tag: str, dtype: np.dtype, n: int) -> np.ndarray:
    return np.empty(n, dtype=dtype)


@dataclass(slots=True)
class Attempt:
    """One box's changes, offered to every encoding in turn.

    ``base_values`` and ``new_values`` are the words at the changed positions (``base_values``
    None for ``tensor`` records). ``policy`` is the writer's EncodePolicy
    (dcr_log.write.differ; typed loosely because codec sits below write): each encoding reads
    its own fields. ``size_to_beat`` is the smallest candidate so far (None before the first).

    Earlier encodings may steer later ones: ``skip`` names encodings not worth trying any
    more, ``whole_box_min_rate`` raises the change rate from which an encoding of the whole
    box (dense) is worth trying.
    """

    kind: str
    changes: ChangeSet
    base_values: np.ndarray | None
    new_values: np.ndarray
    policy: Any
    full_xor_source: Callable[[], np.ndarray] | None = None
    buffer: Callable[[str, np.dtype, int], np.ndarray] = _fresh_buffer
    size_to_beat: int | None = None
    skip: set[str] = field(default_factory=set)
    whole_box_min_rate: float = 0.0
    _full_xor: np.ndarray | None = None

    @property
    def rate(self) -> float:
        """The fraction of the box's elements that changed."""
        n = self.changes.n
        return self.changes.k / n if n else 1.0

    @property
    def word_size(self) -> int:
        return int(self.changes.values.dtype.itemsize)

    def full_xor(self) -> np.ndarray:
        """The box's whole xor array (base xor new), computed on first use only."""
        if self._full_xor is None:
            if self.full_xor_source is None:
                raise ValueError("this attempt has no whole-box xor")
            self._full_xor = self.full_xor_source()
        return self._full_xor


@dataclass(frozen=True, slots=True)
class Candidate:
    """One encoding's result for an Attempt: ``size`` payload bytes.

    ``payload`` None: the size is known without encoding (raw); ``deferred`` encodes it
    only if this candidate is chosen."""

    encoding: str
    size: int
    params: dict | None = None
    payload: bytes | None = None
    deferred: Encoding | None = None

    @staticmethod
    def encoded(encoding: str, params: dict, payload: bytes) -> Candidate:
        return Candidate(encoding, len(payload), params, payload)

    def result(self, attempt: Attempt) -> tuple[dict, bytes]:
        """(params, payload), encoding now if the candidate was deferred."""
        if self.payload is not None and self.params is not None:
            return self.params, self.payload
        if self.deferred is None:
            raise ValueError(f"candidate {self.encoding!r} has neither a payload nor an encoder")
        return self.deferred.encode(attempt.kind, attempt.changes)
