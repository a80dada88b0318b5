"""Retention: expire old versions behind a log-start marker, thin out snapshots, remove orphans
(spec/FORMAT.md section 25).

Nothing a reader may still need is deleted: an object goes only after a marker that makes it
unneeded (a log-start marker, a retire marker, or the commit record of the version an orphan
lost) has existed for the grace period, by the store's modification times.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from dcr_log.errors import UsageError
from dcr_log.format.keys import SEGMENTS_PREFIX, VERSIONS_PREFIX, parse_version_key
from dcr_log.format.lifecycle import (
    LOG_START_PREFIX,
    MANIFEST,
    RETIRED,
    SNAPSHOTS_PREFIX,
    SQUASHES_PREFIX,
    Marker,
    log_start_key,
    parse_log_start_key,
    parse_snapshot_key,
    parse_squash_key,
)
from dcr_log.lifecycle.catchup import write_snapshot
from dcr_log.log.deltalog import DeltaLog
from dcr_log.store import AlreadyExists, ObjectInfo
from dcr_log.write.sharded import utc_now

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?")
_UNIT = {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``2h``, ``7d`` or ``500ms``."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise UsageError(f"bad duration {text!r}: a number with s, m, h, d or ms")
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass
class GcReport:
    start: int                      # the log start after this run (the newest marker)
    expired_start: int              # versions below this were deleted (the newest marker past its grace)
    snapshot_written: int | None = None
    log_start_written: int | None = None  # the log-start marker this run created
    retired: list[int] = field(default_factory=list)  # snapshots this run gave a retire marker
    deleted_versions: int = 0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    orphans: int = 0
    waiting: int = 0                # objects kept until their grace period has passed
    dry_run: bool = False           # a prediction: what the same gc would do, nothing done

    @property
    def nothing_to_do(self) -> bool:
        """Nothing written and nothing deleted (objects may still wait for their grace)."""
        return (self.snapshot_written is None and self.log_start_written is None and not self.retired
                and self.deleted_objects == 0)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class GcPlan:
    """Everything one gc does, computed before it does any of it (plan_gc): the dry run reports
    it, the real run executes it (execute_gc), and both report the same."""
    start: int                          # the log start once the plan is done
    expired_start: int                  # the largest marker past its grace (D of FORMAT.md 25)
    snapshot: int | None                # the snapshot to write first, if any
    log_start: int | None               # the log-start marker to create, if any
    retire: list[tuple[int, bytes]]     # (snapshot, its retire marker's bytes), to create
    delete: list[ObjectInfo]            # deleted in this order
    deleted_versions: int
    orphans: int
    waiting: int

    def report(self, dry_run: bool) -> GcReport:
        return GcReport(start=self.start, expired_start=self.expired_start, snapshot_written=self.snapshot,
                        log_start_written=self.log_start, retired=[w for w, _ in self.retire],
                        deleted_versions=self.deleted_versions, deleted_objects=len(self.delete),
                        deleted_bytes=sum(o.size for o in self.delete), orphans=self.orphans,
                        waiting=self.waiting, dry_run=dry_run)


def _age_ok(info: ObjectInfo, now: float, grace: float) -> bool:
    """Whether ``info`` is at least ``grace`` old. A modification time after ``now`` (the store's
    clock ahead of ours) counts as age 0: with no grace period everything is old enough, so
    the outcome never depends on the clocks."""
    return info.modified is not None and max(0.0, now - info.modified) >= grace


def _check_options(keep_last: int, keep_snapshots: int, grace: float) -> None:
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    if keep_snapshots < 1:
        raise UsageError("--keep-snapshots must be at least 1")
    if grace < 0:
        raise UsageError("the grace period cannot be negative")


def plan_gc(log: DeltaLog, keep_last: int, *, keep_snapshots: int = 2, grace: float = 3600.0,
            snapshot: bool = True, now: float | None = None) -> GcPlan:
    """What ``gc`` with these arguments does now, from one look at the store; writes nothing.

    The markers the plan creates count as created at ``now`` (age 0): with ``grace`` 0 what they
    make unneeded is deleted in the same run, otherwise a later run deletes it."""
    _check_options(keep_last, keep_snapshots, grace)
    now = time.time() if now is None else now
    # Versions first, then the other prefixes: a segment listed below belongs to a version
    # committed by then or to a commit in flight (above ``committed``), never touched.
    versions = log.versions()
    if not versions:
        raise UsageError(f"{log.store.url}: log has no versions")
    start, committed = versions[0], versions[-1]
    usable = log.snapshots()  # at or above the current start, not retired, not damaged
    listing = {prefix: log.store.list(prefix) for prefix in
               (LOG_START_PREFIX, SNAPSHOTS_PREFIX, SQUASHES_PREFIX, VERSIONS_PREFIX, SEGMENTS_PREFIX,
                "signatures/", "files/")}
    # 1. The new start: latest - keep_last + 1 itself when a snapshot may be written there, so
    # that the next run finds the start where it wants it (a start moved only to an older
    # snapshot below it would have the next run write one and move it again).
    write_at = None
    wanted = committed - keep_last + 1
    new_start = start
    if wanted > start:
        if snapshot:
            manifest_key = f"{SNAPSHOTS_PREFIX}{wanted}/{MANIFEST}"
            if wanted not in usable and not any(o.key == manifest_key for o in listing[SNAPSHOTS_PREFIX]):
                write_at = wanted
            elif wanted not in usable:
                log.catchup(manifest_key)  # there but retired (a damaged one is refused here)
            new_start = wanted
        else:
            new_start = max((w for w in usable if start < w <= wanted), default=start)
    new_marker = new_start if new_start > start else None
    markers = [(v, o) for o in listing[LOG_START_PREFIX] if (v := parse_log_start_key(o.key)) is not None]
    if new_marker is not None:
        markers.append((new_marker, ObjectInfo(log_start_key(new_marker), 0, now)))
    start = new_start
    # 2. Retire snapshots beyond the newest keep_snapshots (never the start's).
    kept = {w for w in usable if w >= start} | {start}
    keep = set(sorted(kept)[-keep_snapshots:]) | {start}
    retire = []
    created = utc_now()
    for w in sorted(kept - keep):
        sha = log.catchup(f"{SNAPSHOTS_PREFIX}{w}/{MANIFEST}")[1]
        retire.append((w, Marker(log.log_id, "retired", w, sha, created).to_bytes()))
    # 3. Deletions, each past its marker's grace period.
    doomed: list[ObjectInfo] = []
    counts = {"orphans": 0, "waiting": 0, "versions": 0}

    def orphans(objs: list[ObjectInfo], listed: set[str]) -> None:
        """Objects of a prefix that nothing lists: doomed once older than the grace period."""
        for o in objs:
            if o.key in listed:
                continue
            if _age_ok(o, now, grace):
                doomed.append(o)
                counts["orphans"] += 1
            else:
                counts["waiting"] += 1

    ripe = [v for v, o in markers if _age_ok(o, now, grace)]
    expired = max(ripe, default=0)
    counts["waiting"] += sum(1 for v, o in markers if v > expired)
    doomed += [o for v, o in markers if v < expired]
    named = {v for v, _ in markers}  # snapshots a marker names are never removed as retired
    new_retired = {f"{SNAPSHOTS_PREFIX}{w}/{RETIRED}": ObjectInfo(f"{SNAPSHOTS_PREFIX}{w}/{RETIRED}", len(data), now)
                   for w, data in retire}
    by_prefix: dict[str, list[ObjectInfo]] = {}
    for o in [*listing[SNAPSHOTS_PREFIX], *new_retired.values(), *listing[SQUASHES_PREFIX]]:
        parts = o.key.split("/")
        if len(parts) == 3:
            by_prefix.setdefault(f"{parts[0]}/{parts[1]}/", []).append(o)
    for prefix, objs in sorted(by_prefix.items()):
        keys = {o.key: o for o in objs}
        manifest = keys.get(prefix + MANIFEST)
        snap = parse_snapshot_key(prefix + MANIFEST)
        squash = parse_squash_key(prefix + MANIFEST)
        end = snap[0] if snap else squash[1] if squash else None
        if end is None:
            continue  # not a key of this format: left alone
        retired = keys.get(prefix + RETIRED)
        gone = end < expired or (retired is not None and end not in named and end != start
                                 and _age_ok(retired, now, grace))
        if gone:
            # The manifest first (a reader that finds a segment missing then learns it was
            # removed, not damaged), a retire marker last.
            doomed += ([manifest] if manifest else []) + [o for o in objs if o is not manifest and o is not retired]
            doomed += [retired] if retired else []
            continue
        if manifest is None:
            if all(_age_ok(o, now, grace) for o in objs):  # an abandoned write
                doomed += objs
                counts["orphans"] += len(objs)
            continue
        if end < start:
            continue  # below the log start: deleted with its versions once the marker is ripe
        listed = {ref.key for ref in log.catchup(manifest.key)[0].segments}
        listed |= {prefix + MANIFEST, prefix + RETIRED}
        orphans(objs, listed)
    # Versions below the expired start: commit records first (a reader missing a segment of a
    # version below the start is told it expired), then segments and signatures.
    if expired > 0:
        for o in listing[VERSIONS_PREFIX]:
            v = parse_version_key(o.key)
            if v is not None and v < expired:
                doomed.append(o)
                counts["versions"] += 1
    segs: dict[int, list[ObjectInfo]] = {}
    for o in listing[SEGMENTS_PREFIX]:
        parts = o.key.split("/")
        if len(parts) == 3 and parts[1].isdigit():
            segs.setdefault(int(parts[1]), []).append(o)
    for v, objs in sorted(segs.items()):
        if v < expired:
            doomed += objs
        elif start <= v <= committed:
            # Orphans of a committed version: the losers of its commit, never to be referenced.
            orphans(objs, {ref.key for ref in log.commit(v).segments})
    if expired > 0:
        for o in listing["signatures/"]:
            parts = o.key.split("/")
            if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < expired:
                doomed.append(o)
    # Temporary files a killed writer left in a local directory (dot files ending in .tmp,
    # FORMAT.md section 15): no key of the format, removed once older than the grace period.
    seen = {o.key for o in doomed}
    for objs in listing.values():
        for o in objs:
            name = o.key.rsplit("/", 1)[-1]
            if name.startswith(".") and name.endswith(".tmp") and o.key not in seen and _age_ok(o, now, grace):
                doomed.append(o)
                counts["orphans"] += 1
    return GcPlan(start=start, expired_start=expired, snapshot=write_at, log_start=new_marker, retire=retire,
                  delete=doomed, deleted_versions=counts["versions"], orphans=counts["orphans"],
                  waiting=counts["waiting"])


def execute_gc(log: DeltaLog, plan: GcPlan) -> None:
    """Do what ``plan`` says, in its order: the snapshot, the log-start marker, the retire
    markers, then the deletions. Every step is safe to repeat (create-if-absent; an object
    already deleted is no error)."""
    if plan.snapshot is not None:
        write_snapshot(log, plan.snapshot)
    if plan.log_start is not None:
        sha = log.catchup(f"{SNAPSHOTS_PREFIX}{plan.log_start}/{MANIFEST}")[1]
        marker = Marker(log.log_id, "log-start", plan.log_start, sha, utc_now())
        try:
            log.store.put_new(marker.key, marker.to_bytes())
        except AlreadyExists:
            pass  # another gc chose the same start
    for w, data in plan.retire:
        try:
            log.store.put_new(f"{SNAPSHOTS_PREFIX}{w}/{RETIRED}", data)
        except AlreadyExists:
            pass  # another gc retired it
    for o in plan.delete:
        log.store.delete(o.key)


def gc(log: DeltaLog, keep_last: int, *, keep_snapshots: int = 2, grace: float = 3600.0,
       snapshot: bool = True, now: float | None = None, dry_run: bool = False) -> GcReport:
    """Keep the last ``keep_last`` versions replayable and expire the ones before them.

    1. The new start is ``latest - keep_last + 1``, its snapshot written first when missing
       (without ``snapshot``: the newest snapshot at or below it); a log-start marker names it.
       The start so depends only on the log, never on an earlier gc's choice: the same gc run
       again does nothing more, and ``dry_run`` reports exactly what the run would do.
    2. Snapshots above the start other than the ``keep_snapshots`` newest get a retire marker.
    3. Deleted, each only once the marker that makes it unneeded is ``grace`` seconds old:
       versions (commit records, segments, signatures), snapshots and squashes below the
       newest such log-start marker, older log-start markers, retired snapshots, and orphan
       segments (of committed versions, and of snapshots and squashes).
    File objects (feature files) are never deleted: they are small and shared by versions.

    The run is planned first (plan_gc) and then executed; ``dry_run`` stops after the plan and
    reports it: the same report the real run would give at the same ``now``. A second run
    right after the first has nothing to do, unless a grace period ended in between.
    """
    plan = plan_gc(log, keep_last, keep_snapshots=keep_snapshots, grace=grace, snapshot=snapshot, now=now)
    if not dry_run:
        execute_gc(log, plan)
    return plan.report(dry_run)
