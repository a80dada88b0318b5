"""Reading a log: open it (``DeltaLog``), read its commit records and segments, choose a route
to a version (versions, squashes, snapshots), replay it into memory and verify it.

``deltalog`` opens a log and reads what it holds (commits, segments, files); ``routes`` is
the ``Step`` and the route of fewest bytes over versions, snapshots and squashes;
``signatures`` checks and writes commit records' signatures; ``verify`` checks a whole log
(``VerifyReport``); ``segments`` holds large segments in local files; ``records`` is the read
half of a record (decode, targets, apply to words, pure); ``steps`` is the one set of rules a
valid step obeys, shared by replay, receivers and the baseline's roll-forward; ``replay``
applies steps to in-memory states. ``DeltaLog``'s methods delegate to these modules."""

from __future__ import annotations

from dcr_log.log.deltalog import DeltaLog
from dcr_log.log.replay import as_numpy, state_equal
from dcr_log.log.routes import Step
from dcr_log.log.segments import SegmentFile
from dcr_log.log.verify import VerifyReport

__all__ = ["DeltaLog", "Step", "VerifyReport", "SegmentFile", "as_numpy", "state_equal"]
