"""What one version's writes carry (``ApplyContext``), and the digest parts that pass one and
the batch writer both compute (``GroupDigests``): the shared ground of checks.py and batch.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dcr_log.codec import ChangeSet
from dcr_log.digest import MASK64, DigestScheme
from dcr_log.errors import IntegrityError
from dcr_log.format.tensors import TensorInfo
from dcr_log.log.deltalog import Step
from dcr_log.log.records import classify_at, record_targets
from dcr_log.parallel import DEFAULT_WORKERS, records_large_enough
from dcr_log.receiver.reports import ApplyReport
from dcr_log.receiver.segments import SegmentCache
from dcr_log.receiver.storage import Storage, Where

if TYPE_CHECKING:
    from dcr_log.collective import Group
    from dcr_log.receiver.batch import Undo

# Threads of the shared pool that decode, gather, check and write records.
APPLY_WORKERS = DEFAULT_WORKERS


# Batches (and pass one's segments) with at least this many changes are gathered, checked and
# written by records on the shared pool's threads; smaller ones on the calling thread (a hop
# costs more), and only where their records average enough changes (parallel.records_large_enough).
PARALLEL_MIN_CHANGES = 1 << 16


def pool_pays(changes: int, records: int) -> bool:
    """Whether ``records`` holding ``changes`` in all go to the pool's threads."""
    return changes >= PARALLEL_MIN_CHANGES and records_large_enough(changes, records)


@dataclass(frozen=True, slots=True)
class GroupDigests:
    """Digests of some words of the storage under the log's scheme: a rank's part (``part``)
    and, in a tensor-parallel group, the parts summed across it (``sums``)."""

    storage: Storage
    group: Group
    scheme: DigestScheme

    def sums(self, parts: list[int]) -> list[int]:
        """Digests summed across the group (each rank gave the part it owns)."""
        if self.group.size == 1 or not self.scheme.composable:
            return parts
        every = self.group.all_gather(parts)
        if any(len(p) != len(parts) for p in every):
            raise IntegrityError("ranks of the group disagree on what they are checking")
        return [sum(col) & MASK64 for col in zip(*every)]

    def classify(self, place: Any, where: Where, kind: str, changes: ChangeSet, values: Any
                 ) -> tuple[Any, Any, int, int]:
        """A record's words at ``place`` (its base, if the storage is at it), the words it
        writes there (``values``: the record's values that the storage selected) and this
        rank's digest parts of both. An xor record on host words under sum digests (a
        receiver's usual record) takes one C call (records.classify_at) where the calls in
        turn cost twice its Python and walk the record's arrays four times."""
        if kind == "xor" and self.scheme.composable:
            host = self.storage.host_words(place)
            if host is not None:
                fused = classify_at(host[0], host[1], values, changes.relative)
                if fused is not None:
                    return fused
        current = self.storage.gather(place)
        target = record_targets(kind, changes, current, values)
        return current, target, self.part(place, where, current), self.part(place, where, target)

    def part(self, place: Any, where: Where, words: np.ndarray) -> int:
        """This rank's part of the digest of ``words`` (gathered at ``place``, or targets)."""
        owned, idx = self.storage.owned(place, where)
        return self.storage.digest_at(place, owned, words if idx is None else words[idx], self.scheme)


@dataclass(slots=True)
class ApplyContext:
    """One version's write pass, as every segment and batch of it sees it."""

    commit: Step
    table: dict[str, TensorInfo]
    cache: SegmentCache
    verify: str
    report: ApplyReport
    # Memory storage: how to take the storage back to the journal's version (None: durable).
    undo: Undo | None
    # Tensors the layout change created (memory storage): no base words to keep for rollback.
    created: set[str] = field(default_factory=set)
    # Tensors the records wrote (an engine's residual parameters are rebuilt from them).
    touched: set[str] = field(default_factory=set)

    @property
    def version(self) -> int:
        return self.commit.version
