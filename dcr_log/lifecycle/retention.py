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

from ..errors import UsageError
from ..format.keys import SEGMENTS_PREFIX, VERSIONS_PREFIX, parse_version_key
from ..format.lifecycle import (
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
from ..log import DeltaLog
from ..shard import utc_now
from ..store import AlreadyExists, ObjectInfo
from .catchup import write_snapshot

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
    retired: list[int] = field(default_factory=list)
    deleted_versions: int = 0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    orphans: int = 0
    waiting: int = 0                # objects kept until their grace period has passed

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _age_ok(info: ObjectInfo, now: float, grace: float) -> bool:
    return info.modified is not None and info.modified + grace <= now


def _orphans(objs: list[ObjectInfo], listed: set[str], now: float, grace: float,
             doomed: list[ObjectInfo], report: GcReport) -> None:
    """Objects of a prefix that nothing lists: doomed once older than the grace period."""
    for o in objs:
        if o.key in listed:
            continue
        if _age_ok(o, now, grace):
            doomed.append(o)
            report.orphans += 1
        else:
            report.waiting += 1


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
    """
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    if keep_snapshots < 1:
        raise UsageError("--keep-snapshots must be at least 1")
    if grace < 0:
        raise UsageError("the grace period cannot be negative")
    versions = log.versions()
    if not versions:
        raise UsageError(f"{log.store.url}: log has no versions")
    start, latest = versions[0], versions[-1]
    report = GcReport(start=start, expired_start=0)
    wanted = latest - keep_last + 1
    # 1. The new start.
    # Log-start markers a dry run would write (aged from ``now``, as a real run's are).
    added: list[tuple[int, str]] = []
    snapshots = log.snapshots()
    if wanted > start:
        below = [w for w in snapshots if start < w <= wanted]
        if wanted in snapshots or not snapshot:
            new_start = max(below, default=start)
        else:
            if not dry_run:
                write_snapshot(log, wanted)
            report.snapshot_written = new_start = wanted
        if new_start > start:
            if dry_run:
                key = log_start_key(new_start)
                if log.store.head(key) is None:
                    added.append((new_start, key))
            else:
                _, sha = log.catchup(f"{SNAPSHOTS_PREFIX}{new_start}/{MANIFEST}")
                marker = Marker(log.log_id, "log-start", new_start, sha, utc_now())
                try:
                    log.store.put_new(marker.key, marker.to_bytes())
                except AlreadyExists:
                    pass  # another gc chose the same start
        report.start = log.start() if not dry_run else max(new_start, start)
    start = report.start
    # 2. Retire snapshots beyond the newest keep_snapshots (never the start's).
    usable = sorted(w for w in set(log.snapshots()) | {report.snapshot_written or start} if w >= start)
    keep = set(usable[-keep_snapshots:]) | {start}
    retiring: dict[int, int] = {}  # a dry run's retire markers: version -> their size
    for w in usable:
        if w in keep:
            continue
        report.retired.append(w)
        marker = Marker(log.log_id, "retired", w, log.catchup(f"{SNAPSHOTS_PREFIX}{w}/{MANIFEST}")[1], utc_now())
        retiring[w] = len(marker.to_bytes())
        if not dry_run:
            try:
                log.store.put_new(marker.key, marker.to_bytes())
            except AlreadyExists:
                pass
    # 3. Deletions, each past its marker's grace period (aged from now: after this run's
    # writes, so that with no grace what it marked goes at once).
    now = time.time() if now is None else now
    doomed: list[ObjectInfo] = []
    markers = [(v, o) for o in log.store.list(LOG_START_PREFIX) if (v := parse_log_start_key(o.key)) is not None]
    markers += [(v, ObjectInfo(key, 0, now)) for v, key in added]
    ripe = [v for v, o in markers if _age_ok(o, now, grace)]
    expired = max(ripe, default=0)
    report.expired_start = expired
    report.waiting += sum(1 for v, o in markers if v > expired)
    doomed += [o for v, o in markers if v < expired]
    named = {v for v, _ in markers}  # snapshots a marker names are never removed as retired
    by_prefix: dict[str, list[ObjectInfo]] = {}
    for prefix in (SNAPSHOTS_PREFIX, SQUASHES_PREFIX):
        for o in log.store.list(prefix):
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
        if retired is None and dry_run and end in retiring:  # as this run would write it
            retired = keys[prefix + RETIRED] = ObjectInfo(prefix + RETIRED, retiring[end], now)
        gone = end < expired or (retired is not None and end not in named and end != start
                                 and _age_ok(retired, now, grace))
        if gone:
            # The manifest first: a reader that finds a segment missing then learns it was
            # removed (not damaged).
            doomed += ([manifest] if manifest else []) + [o for k, o in keys.items() if o is not manifest]
            continue
        if manifest is None:
            if all(_age_ok(o, now, grace) for o in objs):  # an abandoned write
                doomed += objs
                report.orphans += len(objs)
            continue
        if end < start:
            continue  # below the log start: deleted with its versions once the marker is ripe
        listed = {ref.key for ref in log.catchup(manifest.key)[0].segments}
        listed |= {prefix + MANIFEST, prefix + RETIRED}
        _orphans(objs, listed, now, grace, doomed, report)
    # Versions below the expired start: commit records first (a reader missing a segment of a
    # version below the start is told it expired), then segments and signatures.
    if expired > 0:
        for o in log.store.list(VERSIONS_PREFIX):
            v = parse_version_key(o.key)
            if v is not None and v < expired:
                doomed.append(o)
                report.deleted_versions += 1
    committed = versions[-1]
    segs: dict[int, list[ObjectInfo]] = {}
    for o in log.store.list(SEGMENTS_PREFIX):
        parts = o.key.split("/")
        if len(parts) == 3 and parts[1].isdigit():
            segs.setdefault(int(parts[1]), []).append(o)
    for v, objs in sorted(segs.items()):
        if v < expired:
            doomed += objs
        elif v <= committed and v >= start:
            # Orphans of a committed version: the losers of its commit, never to be referenced.
            _orphans(objs, {ref.key for ref in log.commit(v).segments}, now, grace, doomed, report)
    if expired > 0:
        for o in log.store.list("signatures/"):
            parts = o.key.split("/")
            if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < expired:
                doomed.append(o)
    # Temporary files a killed writer left in a local directory (dot files ending in .tmp,
    # FORMAT.md section 15): no key of the format, removed once older than the grace period.
    seen = {o.key for o in doomed}
    for prefix in (VERSIONS_PREFIX, SEGMENTS_PREFIX, SNAPSHOTS_PREFIX, SQUASHES_PREFIX, LOG_START_PREFIX,
                   "signatures/", "files/"):
        for o in log.store.list(prefix):
            name = o.key.rsplit("/", 1)[-1]
            if name.startswith(".") and name.endswith(".tmp") and o.key not in seen and _age_ok(o, now, grace):
                doomed.append(o)
                report.orphans += 1
    report.deleted_objects = len(doomed)
    report.deleted_bytes = sum(o.size for o in doomed)
    if not dry_run:
        for o in doomed:
            log.store.delete(o.key)
    return report

