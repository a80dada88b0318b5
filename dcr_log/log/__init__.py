"""Reading a log: open it (``DeltaLog``), read its commit records and segments, choose a route
to a version (versions, squashes, snapshots), replay it into memory and verify it.

``deltalog`` opens a log and reads what it holds; ``segments`` holds large segments in local
files; ``records`` is the read half of a record (decode, targets, apply to words, pure);
``steps`` is the one set of rules a valid step obeys, shared by replay, receivers and the
baseline's roll-forward; ``replay`` applies steps to in-memory states."""

from __future__ import annotations

from dcr_log.log.deltalog import DeltaLog, Step, VerifyReport
from dcr_log.log.replay import as_numpy, state_equal
from dcr_log.log.segments import SegmentFile

__all__ = ["DeltaLog", "Step", "VerifyReport", "SegmentFile", "as_numpy", "state_equal"]
