"""Writing snapshots and squashes: segment files under their prefix, then the manifest with
create-if-absent (spec/FORMAT.md sections 23 and 24)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable

from dcr_log.errors import IntegrityError, NotFoundError, UsageError
from dcr_log.format import CommitStats, Record, SegmentBuilder
from dcr_log.format.keys import check_writer_id
from dcr_log.format.lifecycle import CatchUp
from dcr_log.log.deltalog import DeltaLog
from dcr_log.state import TensorBits
from dcr_log.store import AlreadyExists
from dcr_log.write.differ import Differ, EncodePolicy
from dcr_log.write.sharded import DEFAULT_SEGMENT_BYTES, default_writer_id, utc_now
from dcr_log.write.uploader import SegmentUploader


def _write_segments(log: DeltaLog, version: int, prefix: str, records: Iterable[Record], writer_id: str,
                    segment_bytes: int) -> tuple[list, int, int, list[str]]:
    """Encode ``records`` into segment files under ``prefix``; returns (refs, records, changed
    elements, every key tried)."""
    uploads = SegmentUploader(log.store)
    builder = SegmentBuilder(log.log_id, version)
    count = changed = 0

    def flush() -> None:
        nonlocal builder
        if builder.records:
            uploads.put(f"{prefix}{writer_id}-{uuid.uuid4().hex}.arrow", builder)
            builder = SegmentBuilder(log.log_id, version)

    try:
        for rec in records:
            builder.add(rec)
            count += 1
            changed += rec.n_changed
            if builder.payload_bytes >= segment_bytes:
                flush()
        flush()
        uploads.finish()
    except BaseException:
        uploads.finish(raise_errors=False)
        _delete(log, uploads.keys)
        raise
    return uploads.refs, count, changed, uploads.keys


def _delete(log: DeltaLog, keys: list[str]) -> None:
    for key in keys:
        try:
            log.store.delete(key)
        except Exception:
            pass  # an orphan for retention to remove


def _publish(log: DeltaLog, cu: CatchUp, keys: list[str], check: Callable[[CatchUp], None] | None) -> CatchUp:
    """Check the written object, then create its manifest (create-if-absent). The loser of a
    race deletes its own segments and returns the winner's manifest."""
    try:
        for ref in cu.segments:  # retention removes orphans older than its grace: still there?
            if log.store.head(ref.key) is None:
                raise IntegrityError(f"{ref.key} disappeared before {cu.key} was written")
        if check is not None:
            check(cu)
        log.store.put_new(cu.key, cu.to_bytes())
    except AlreadyExists:
        _delete(log, keys)
        return log.catchup(cu.key)[0]
    except BaseException:
        _delete(log, keys)
        raise
    return log.catchup(cu.key)[0]


def _existing(log: DeltaLog, key: str) -> CatchUp | None:
    try:
        return log.catchup(key)[0]
    except NotFoundError:
        return None


def write_snapshot(log: DeltaLog, version: int | None = None, *, writer_id: str | None = None,
                   policy: EncodePolicy | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   check: bool = True) -> CatchUp:
    """Write the full state of ``version`` (default latest) as a snapshot: ``tensor`` records
    in segments of about ``segment_bytes`` under ``snapshots/<version>/``, then its manifest.
    The state comes from the log by the cheapest route (every tensor digest checked). With
    ``check``, the written segments are read back and applied before the manifest is created.
    An existing snapshot is returned as it is."""
    writer_id = check_writer_id(writer_id or default_writer_id())
    version = log.latest_version() if version is None else version
    commit = log.commit(version)
    prefix = f"snapshots/{version}/"
    found = _existing(log, prefix + "manifest.json")
    if found is not None:
        return found
    state = log.materialize(version)
    differ = Differ(policy, log.digests, features=log.identity.features)
    records = (rec for name in sorted(state, key=str.encode) for rec in differ.diff(name, None, state[name]))
    refs, count, changed, keys = _write_segments(log, version, prefix, records, writer_id, segment_bytes)
    del state
    cu = CatchUp(log.log_id, version, None, None, commit.state_digest, log.commit_sha256(version),
                 tuple(refs), CommitStats(changed, commit.stats.total_elements, count), utc_now(), writer_id)
    return _publish(log, cu, keys, _check_apply(log, None) if check else None)


def write_squash(log: DeltaLog, start: int, end: int | None = None, *, writer_id: str | None = None,
                 policy: EncodePolicy | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 check: bool = True) -> CatchUp:
    """Write one delta taking version ``start``'s state to version ``end``'s (default latest)
    under ``squashes/<start>-<end>/``, then its manifest. It is the delta between the two
    states (what xor records composed by xor, and the last of the overwrite and tensor
    records, give), encoded as the writer encodes a version. With ``check``, it is read back
    and applied to ``start``'s state first. An existing squash is returned as it is."""
    writer_id = check_writer_id(writer_id or default_writer_id())
    end = log.latest_version() if end is None else end
    if not 0 <= start < end:
        raise UsageError(f"a squash goes from an earlier version to a later one, not {start} to {end}")
    base_commit, commit = log.commit(start), log.commit(end)
    prefix = f"squashes/{start}-{end}/"
    found = _existing(log, prefix + "manifest.json")
    if found is not None:
        return found
    base = log.materialize(start)
    new = log.materialize(end)
    differ = Differ(policy, log.digests, features=log.identity.features)
    records = (rec for name in sorted(new, key=str.encode)
               for rec in differ.diff(name, base.get(name), new[name], "xor"))
    refs, count, changed, keys = _write_segments(log, end, prefix, records, writer_id, segment_bytes)
    del new
    cu = CatchUp(log.log_id, end, start, base_commit.state_digest, commit.state_digest,
                 log.commit_sha256(end), tuple(refs), CommitStats(changed, commit.stats.total_elements, count),
                 utc_now(), writer_id)
    return _publish(log, cu, keys, _check_apply(log, base) if check else None)


def _check_apply(log: DeltaLog, base: dict[str, TensorBits] | None) -> Callable[[CatchUp], None]:
    """Read the object back and apply it (to ``base``, consumed): every tensor digest of its
    version must hold (DeltaLog.apply_step)."""
    def check(cu: CatchUp) -> None:
        state = {} if base is None else base
        log.apply_step(state, log.catchup_step(cu))
    return check
