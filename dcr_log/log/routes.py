"""Routes to a version (spec/FORMAT.md sections 23 and 24): the ``Step`` a reader applies, the
snapshots and squashes a log holds (their manifests read and checked), and the route of fewest
bytes over versions, squashes and snapshots (``plan``).

Functions take the ``DeltaLog`` they read; its methods of the same names delegate here. What
they cache (checked manifests, damaged catch-ups to avoid) lives on the log."""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcr_log.errors import IntegrityError, NotFoundError, UsageError
from dcr_log.format import CommitRecord, CommitStats, SegmentRef
from dcr_log.format.lifecycle import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    RETIRED,
    SNAPSHOTS_PREFIX,
    SQUASHES_PREFIX,
    CatchUp,
    log_start_key,
    parse_snapshot_key,
    parse_squash_key,
    snapshot_prefix,
    squash_prefix,
)

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog


@dataclass(frozen=True)
class Step:
    """One step of a route to a version (spec/FORMAT.md section 24): a version of the chain
    (``kind`` "version"), a squash (from ``parent``) or a snapshot (``parent`` None: applies to
    any state, or none). It reads like the target's commit record where appliers need one;
    ``segments`` and ``stats`` are the step's own."""

    kind: str
    target: CommitRecord
    parent: int | None
    parent_state_digest: int | None
    segments: tuple[SegmentRef, ...]
    stats: CommitStats
    catchup: CatchUp | None = None

    @property
    def version(self) -> int:
        return self.target.version

    @property
    def state_digest(self) -> int:
        return self.target.state_digest

    @property
    def tensors(self):
        return self.target.tensors

    @property
    def files(self):
        return self.target.files

    @property
    def delta_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def tensor_map(self):
        return self.target.tensor_map()

    def describe(self) -> str:
        if self.kind == "version":
            return f"version {self.version}"
        if self.kind == "squash":
            return f"squash {self.parent}-{self.version}"
        return f"snapshot {self.version}"


# -- snapshots and squashes (spec/FORMAT.md sections 23, 24) ----------------------------------

def catchup(log: DeltaLog, key: str) -> tuple[CatchUp, str]:
    """A snapshot's or squash's manifest and its sha256, checked against the commit record
    of its version (and of its start, for a squash still readable)."""
    cached = log.manifests.get(key)
    if cached is not None:
        return cached
    try:
        data = bytes(log.store.get(key, max_size=MAX_MANIFEST_BYTES))
    except NotFoundError:
        raise NotFoundError(f"{log.store.url}: no {key}") from None
    cu = CatchUp.from_bytes(data, key)
    what = key
    if cu.log_id != log.log_id:
        raise IntegrityError(f"{what}: belongs to log {cu.log_id}")
    target = log.commit(cu.version)
    if cu.commit_sha256 != log.commit_sha256(cu.version) or cu.state_digest != target.state_digest:
        raise IntegrityError(f"{what}: does not match the commit record of version {cu.version}")
    if cu.stats.total_elements != target.stats.total_elements:
        raise IntegrityError(f"{what}: stats.total_elements differs from version {cu.version}'s")
    start_record = None if cu.start is None else log.kept_commit(cu.start)
    if start_record is not None:
        if cu.start_state_digest != start_record.state_digest:
            raise IntegrityError(f"{what}: does not start from version {cu.start}'s state")
    if cu.start is None and cu.stats.changed_elements != cu.stats.total_elements:
        raise IntegrityError(f"{what}: a snapshot changes every element")
    sha256 = hashlib.sha256(data).hexdigest()
    if cu.start is None:
        _check_retire_marker(log, cu.version, sha256)
    result = log.manifests[key] = (cu, sha256)
    return result


def _check_retire_marker(log: DeltaLog, version: int, manifest_sha256: str) -> None:
    """A retired snapshot is still read (by routes until it is deleted, and by verification):
    its retire marker, if any, must be sound and name this manifest (FORMAT.md section 25)."""
    key = snapshot_prefix(version) + RETIRED
    try:
        marker = log.marker(key)
    except NotFoundError:
        return
    if marker.kind != "retired" or marker.snapshot_sha256 != manifest_sha256:
        raise IntegrityError(f"{key}: does not name snapshot {version}'s manifest")


def snapshots(log: DeltaLog, retired: bool = False) -> dict[int, CatchUp]:
    """The snapshots readers may start from, by version: at or above the log start and not
    retired (the start's own snapshot always). With ``retired``, retired ones too."""
    start = log.start()
    manifests: set[int] = set()
    retiring: set[int] = set()
    for o in log.store.list(SNAPSHOTS_PREFIX):
        parsed = parse_snapshot_key(o.key)
        if parsed is not None:
            (manifests if parsed[1] == "manifest" else retiring).add(parsed[0])
    out = {}
    for v in sorted(manifests):
        if v < start:
            continue
        if v in retiring and v != start and not retired:
            log.marker(f"{snapshot_prefix(v)}retired.json")  # checked like any marker
            continue
        cu = usable(log, snapshot_prefix(v) + MANIFEST, required=v == start and start > 0)
        if cu is not None:
            out[v] = cu
    return out


def squashes(log: DeltaLog) -> list[CatchUp]:
    """The squashes whose end is readable, by start then end (damaged ones left out)."""
    start = log.start()
    found = sorted(p for o in log.store.list(SQUASHES_PREFIX) if (p := parse_squash_key(o.key)))
    return [cu for a, b in found if b >= start
            and (cu := usable(log, squash_prefix(a, b) + MANIFEST)) is not None]


def usable(log: DeltaLog, key: str, required: bool = False) -> CatchUp | None:
    """A catch-up object routes may use: None if it is damaged (remembered in ``excluded``:
    the chain of versions is always a route), unless ``required`` (the log start's)."""
    if key in log.excluded and not required:
        return None
    try:
        return log.catchup(key)[0]
    except IntegrityError as exc:
        if required:
            raise
        log.excluded[key] = str(exc)
        return None


def exclude(log: DeltaLog, step: Step, reason: str) -> bool:
    """Leave a catch-up step out of later routes (it failed a check); False for a version
    or the log start's snapshot, which no route can avoid."""
    if step.catchup is None or (step.kind == "snapshot" and step.version == log.known_start() > 0):
        return False
    log.excluded[step.catchup.key] = reason
    return True


def start_snapshot(log: DeltaLog) -> CatchUp | None:
    """The snapshot readers start from when the log starts above 0, checked against the
    newest log-start marker."""
    start = log.start()
    if start == 0:
        return None
    marker = log.marker(log_start_key(start))
    try:
        cu, sha = log.catchup(snapshot_prefix(start) + MANIFEST)
    except NotFoundError:
        raise IntegrityError(f"{log.store.url}: the log starts at {start} but its snapshot is missing") from None
    if sha != marker.snapshot_sha256:
        raise IntegrityError(f"{log_start_key(start)}: names another snapshot of version {start}")
    return cu


# -- steps and routes ---------------------------------------------------------------------

def version_step(log: DeltaLog, version: int) -> Step:
    c = log.commit(version)
    return Step("version", c, c.parent, c.parent_state_digest, c.segments, c.stats)


def catchup_step(log: DeltaLog, cu: CatchUp) -> Step:
    return Step(cu.kind, log.commit(cu.version), cu.start, cu.start_state_digest, cu.segments,
                cu.stats, cu)


def named_step(log: DeltaLog, kind: str, version: int, parent: int | None = None) -> Step:
    """The step a journal names (kind, version, and a squash's start)."""
    if kind == "version":
        return log.version_step(version)
    if kind == "snapshot":
        return log.catchup_step(log.snapshot(version))
    if kind == "squash" and parent is not None:
        return log.catchup_step(log.squash(parent, version))
    raise UsageError(f"unknown step {kind!r}")


# A route's cost: (bytes read, steps), compared in that order.
_Cost = tuple[int, int]


def plan(log: DeltaLog, target: int | None = None, holding: int | None = None,
         holding_digest: int | None = None) -> list[Step]:
    """The route to ``target`` (default latest) that reads the fewest bytes, from version
    ``holding`` (state digest ``holding_digest``) or from nothing: versions of the chain,
    squashes and snapshots (section 24). Raises ExpiredError when ``target`` has expired."""
    versions = log.versions()
    if not versions:
        raise NotFoundError(f"{log.store.url}: log has no versions")
    start, latest = versions[0], versions[-1]
    target = latest if target is None else target
    if target > latest:
        raise NotFoundError(f"{log.store.url}: no version {target} (latest is {latest})")
    if target < start:
        raise log.expired(target, f"version {target}")
    if holding is not None and holding > target:
        raise UsageError(f"version {holding} is past {target}")
    if holding is not None and holding >= start - 1 and target - holding <= 1:
        return [log.version_step(v) for v in range(holding + 1, target + 1)]
    # Dijkstra over versions, by (bytes, steps): commit records are read only for the
    # versions a route cheaper than the best found so far reaches (a long log with a recent
    # snapshot costs a few reads, not one per version).
    best: dict[int, tuple[_Cost, Step | None, int | None]] = {}
    heap: list[tuple[_Cost, int]] = []

    def offer(v: int, cost: _Cost, step: Step | None, prev: int | None) -> None:
        if v not in best or cost < best[v][0]:
            best[v] = (cost, step, prev)
            heapq.heappush(heap, (cost, v))

    if holding is not None:
        offer(holding, (0, 0), None, None)
    elif start == 0:
        offer(0, (log.commit(0).delta_bytes, 1), log.version_step(0), None)
    else:
        log.start_snapshot()  # the marker's snapshot, checked
    for w, snap in log.snapshots().items():
        if w <= target:
            offer(w, (snap.delta_bytes, 1), log.catchup_step(snap), None)
    by_start: dict[int, list[CatchUp]] = {}
    for cu in log.squashes():
        # A squash key's manifest always has a start (CatchUp.from_bytes): this only narrows it.
        if cu.start is None:
            continue
        if cu.version <= target and (cu.start >= start or cu.start == holding):
            if cu.start == holding and holding_digest is not None and cu.start_state_digest != holding_digest:
                continue
            by_start.setdefault(cu.start, []).append(cu)
    # The listings of snapshots and squashes read the log start again: a gc may have moved it
    # since ``versions()``, and versions below it are no longer read (DeltaLog.commit).
    start = max(start, log.known_start())
    done: set[int] = set()
    while heap:
        cost, v = heapq.heappop(heap)
        if v in done or cost != best[v][0]:
            continue
        done.add(v)
        if v == target:
            break
        nbytes, nsteps = cost
        if v + 1 <= target and v + 1 >= start:
            step = log.version_step(v + 1)
            offer(v + 1, (nbytes + step.delta_bytes, nsteps + 1), step, v)
        for cu in by_start.get(v, ()):
            offer(cu.version, (nbytes + cu.delta_bytes, nsteps + 1), log.catchup_step(cu), v)
    if target not in best:
        raise log.expired(holding if holding is not None else target,
                          f"version {holding}" if holding is not None else f"version {target}")
    route: list[Step] = []
    v = target
    while True:
        _, found, prev = best[v]
        if found is None:
            break
        route.append(found)
        if prev is None:
            break
        v = prev
    return route[::-1]
