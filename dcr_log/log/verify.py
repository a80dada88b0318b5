"""Whole-log verification: every commit record, the parent chain, every segment's and file
object's size and sha256, every snapshot and squash routes may use, and (``deep``) every
version replayed with all its tensor digests checked. ``DeltaLog.verify`` delegates here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcr_log.errors import IntegrityError
from dcr_log.format.lifecycle import SNAPSHOTS_PREFIX, SQUASHES_PREFIX, parse_snapshot_key, parse_squash_key
from dcr_log.format.tensors import state_digest
from dcr_log.state import TensorBits

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.log.replay import Progress


@dataclass(frozen=True)
class VerifyReport:
    versions: int
    segments: int
    bytes_checked: int
    deep: bool
    files: int = 0  # distinct file objects checked (feature files)
    start: int = 0  # the first version (retention, section 25)
    catchups: int = 0  # snapshots and squashes checked


def verify(log: DeltaLog, deep: bool = False, progress: Progress | None = None) -> VerifyReport:
    """Check every commit record, the parent chain, every segment's size and sha256 and
    every file object's size and sha256 (feature files).

    ``deep`` also replays every version and checks every tensor digest of every version.
    """
    versions = log.versions()
    if not versions:
        raise IntegrityError(f"{log.store.url}: log has no versions")
    if versions[0] > 0:
        log.start_snapshot()  # the marker names the snapshot readers start from
    nbytes = 0
    nsegments = 0
    checked_files: set[tuple[str, int]] = set()
    previous = None
    for v in versions:
        commit = log.commit(v)
        if previous is not None and commit.parent_state_digest != previous.state_digest:
            raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
        if state_digest(list(commit.tensors)) != commit.state_digest:
            raise IntegrityError(f"version {v}: state digest does not match its tensor table")
        # Deep verification reads segments by replaying; a log start's own version (S > 0) is
        # replayed from snapshot S, so its segments (a delta from the expired S - 1) are read here.
        if not deep or (v == versions[0] and v > 0):
            for ref in commit.segments:
                for _ in log.segment_records(v, ref):
                    pass
                nbytes += ref.size
        else:
            nbytes += commit.delta_bytes
        for entry in commit.files or ():  # shared objects are checked once
            if (entry.key, entry.size) not in checked_files:
                log.read_file(entry)
                checked_files.add((entry.key, entry.size))
                nbytes += entry.size
        nsegments += len(commit.segments)
        previous = commit
        if progress and not deep:
            progress(v)
    # Every snapshot and squash routes may use, strictly: a damaged one is reported here
    # (routes merely avoid it).
    keys = [o.key for o in log.store.list(SNAPSHOTS_PREFIX)
            if (s := parse_snapshot_key(o.key)) and s[1] == "manifest" and s[0] >= versions[0]]
    keys += [o.key for o in log.store.list(SQUASHES_PREFIX)
             if (q := parse_squash_key(o.key)) and q[1] >= versions[0]]
    catchups = [log.catchup(key)[0] for key in sorted(keys)]
    for cu in catchups:
        for ref in cu.segments:
            for _ in log.segment_records(cu.version, ref):
                pass
            nbytes += ref.size
    if deep:
        for _ in log.replay(versions[-1], check_all=True, progress=progress):
            pass
        for cu in catchups:  # each one leads to its version's tensor digests
            if cu.start is not None and cu.start < versions[0]:
                continue  # its start has expired: only its bytes can be checked
            state: dict[str, TensorBits] = {} if cu.start is None else log.materialize(cu.start)
            log.apply_step(state, log.catchup_step(cu))
    return VerifyReport(len(versions), nsegments, nbytes, deep, len(checked_files),
                        start=versions[0], catchups=len(catchups))
