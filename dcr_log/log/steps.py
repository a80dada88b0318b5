"""The rules of a valid step, in one place (spec/FORMAT.md sections 13 and 24).

A step (a version from its parent, a squash from its start, a snapshot from nothing) is read
record by record; every reader that applies one (replay into memory, a receiver's pass 1, a
writer's baseline roll-forward) feeds each record to ``StepRules.record`` before using it and
calls ``finish`` once the whole step is read. The rules need only the step's tensor table and
the layout (dtype and shape per tensor) it starts from, so they are checked before any byte of
a receiver is written. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dcr_log.coords import tiles
from dcr_log.errors import IntegrityError
from dcr_log.format import CommitStats, Record
from dcr_log.format.tensors import TensorInfo
from dcr_log.state import TableLayout


class StepRules:
    """Checks one step's records against its tensor table, in the order they are read.

    ``before`` is the layout the step starts from (None for a snapshot: every tensor is
    created). A tensor is *created* when ``before`` does not hold it with the same dtype and
    shape: its records must all be ``tensor`` records and, in a snapshot or squash, cover it
    exactly once. A squash *keeps* the tensors ``before`` holds unchanged: only xor and
    overwrite records for those, so that its digests compose."""

    def __init__(self, kind: str, what: str, table: Mapping[str, TensorInfo], before: TableLayout | None,
                 unknown: Iterable[str] = ()):
        self.kind = kind
        self.what = what
        self.table = table
        same = set() if before is None else {
            n for n, t in table.items() if before.get(n) == (t.dtype, t.shape)}
        # ``unknown``: tensors whose starting layout the caller does not hold (a replay that
        # builds only some tensors); neither created nor kept, so only the table rules apply.
        skip = set() if before is None else set(unknown)
        self.created = set(table) - same - skip
        self.kept = same - skip if kind == "squash" else set()
        self.records = 0
        self.changed = 0
        self._boxes: dict[str, list] = {n: [] for n in self.created}

    def record(self, rec: Record, squash_keeps: bool = True) -> TensorInfo:
        """The record's tensor, once the record is allowed here. ``squash_keeps=False`` skips
        the rule that a squash does not replace a tensor it keeps (a receiver that recovers
        may hold the squash's layout already)."""
        info = self.table.get(rec.tensor)
        if info is None:
            raise IntegrityError(f"{self.what}: record for unknown tensor {rec.tensor!r}")
        if rec.tensor in self.created:
            if rec.kind != "tensor":
                raise IntegrityError(f"{self.what}: {rec.kind} record for the new or reshaped tensor "
                                     f"{rec.tensor!r}")
            self._boxes[rec.tensor].append(rec.box)
        elif rec.kind == "tensor" and rec.tensor in self.kept and squash_keeps:
            raise IntegrityError(f"{self.what}: tensor record for {rec.tensor!r}, which the squash keeps")
        self.records += 1
        self.changed += rec.n_changed
        return info

    def created_boxes(self, name: str) -> list:
        """The boxes of the ``tensor`` records read so far for a created tensor."""
        return self._boxes[name]

    def finish(self, stats: CommitStats) -> None:
        """Once the whole step is read: the counts equal the stats and, in a snapshot or
        squash, every created tensor is covered exactly once (a version's uncovered elements
        are zero: section 13)."""
        if self.records != stats.records or self.changed != stats.changed_elements:
            raise IntegrityError(f"{self.what}: record counts differ from the stats")
        if self.kind != "version":
            for name in sorted(self.created):
                if not tiles(self._boxes[name], self.table[name].shape):
                    raise IntegrityError(f"{self.what}: the tensor records of the new tensor {name!r} "
                                         "do not cover it exactly once")
