"""What crosses ranks in a sharded append: each rank's report to the coordinator, and the
coordinator's outcome of creating a log and of committing a version, broadcast to every rank.

Frozen dataclasses (pickled by the Group's object collectives). A failed outcome names its kind
(``failure``), which chooses the exception every rank raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dcr_log.errors import (
    AppendAborted,
    CommitConflict,
    CommitStateUnknown,
    DcrError,
    ReplicaMismatch,
    StoreError,
    UsageError,
)
from dcr_log.format.commit import SegmentRef
from dcr_log.write.baseline import PieceKey

# Why a create or a commit failed: another log or version is there ("conflict"), the caller's
# request ("usage"), replicas of a box differ ("replica"), the store refused with the state known
# ("store"), the commit may or may not exist ("unknown"), anything else ("failed").
Failure = Literal["conflict", "usage", "replica", "store", "unknown", "failed"]


@dataclass(frozen=True, slots=True)
class CreateOutcome:
    """The coordinator's outcome of creating the log's identity (dcr.json)."""

    identity: bytes | None = None   # the log's dcr.json, when created or resumed
    failure: Failure | None = None
    error: str = ""
    resumed: bool = False           # an incomplete log of the same features is finished

    @property
    def ok(self) -> bool:
        return self.failure is None

    def exception(self) -> DcrError:
        error = {"conflict": CommitConflict, "usage": UsageError}.get(self.failure or "", DcrError)
        return error(self.error)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """The coordinator's outcome of committing a version."""

    commit: bytes | None = None     # the commit record, when written
    failure: Failure | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None

    def exception(self) -> DcrError:
        error = {"store": StoreError, "conflict": CommitConflict,
                 "unknown": CommitStateUnknown, "replica": ReplicaMismatch}.get(self.failure or "", AppendAborted)
        return error(self.error)


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's part of a version, gathered at the coordinator."""

    ok: bool
    error: str = ""
    segments: list[SegmentRef] = field(default_factory=list)
    contrib: dict[str, int] = field(default_factory=dict)  # sum-digests: per tensor, its digest change
    whole: dict[str, int] = field(default_factory=dict)    # xxh3 logs: per tensor, the new tensor digest
    replicas: dict[PieceKey, int] = field(default_factory=dict)  # replicated boxes held: xxh3 of their words
    changed: int = 0
    records: int = 0


def describe(exc: BaseException) -> str:
    """An exception in one bounded line, for another rank's message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
