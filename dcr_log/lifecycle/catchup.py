"""Writing snapshots and squashes: segment files under their prefix, then the manifest with
create-if-absent (spec/FORMAT.md sections 23 and 24)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel
from dcr_log.digest import DigestScheme
from dcr_log.errors import IntegrityError, NotFoundError, UsageError
from dcr_log.format import CommitStats, Record
from dcr_log.format.keys import check_writer_id
from dcr_log.format.lifecycle import CatchUp
from dcr_log.format.tensors import TensorInfo
from dcr_log.log.deltalog import DeltaLog
from dcr_log.log.records import apply_to_words, decode_record, flat_positions, gather_words
from dcr_log.log.replay import Progress
from dcr_log.state import TensorBits
from dcr_log.store import AlreadyExists
from dcr_log.write.differ import Differ, EncodePolicy
from dcr_log.write.sharded import DEFAULT_SEGMENT_BYTES, default_writer_id, utc_now
from dcr_log.write.uploader import SegmentSeries, SegmentUploader


def _write_segments(log: DeltaLog, version: int, prefix: str, records: Iterable[Record], writer_id: str,
                    segment_bytes: int) -> tuple[list, int, int, list[str]]:
    """Encode ``records`` into segment files under ``prefix``; returns (refs, records, changed
    elements, every key tried)."""
    uploads = SegmentUploader(log.store)
    segments = SegmentSeries(uploads, log.log_id, version, lambda: f"{prefix}{writer_id}-{uuid.uuid4().hex}.arrow",
                             segment_bytes)
    count = changed = 0
    try:
        for rec in records:
            segments.add(rec)
            count += 1
            changed += rec.n_changed
        segments.flush()
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


def _publish(log: DeltaLog, cu: CatchUp, keys: list[str]) -> CatchUp:
    """Create the written object's manifest (create-if-absent). The loser of a
    race deletes its own segments and returns the winner's manifest."""
    try:
        for ref in cu.segments:  # retention removes orphans older than its grace: still there?
            if log.store.head(ref.key) is None:
                raise IntegrityError(f"{ref.key} disappeared before {cu.key} was written")
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


# A squash is built in this many groups of tensors, one at a time: each group's start state
# is materialized alone, advanced through the versions' records for it and diffed, so a squash
# holds about two sixteenths of the model (the group's start and end), not the whole start
# state. Each group reads the start's route and the versions' segments.
SQUASH_GROUPS = 16


def write_snapshot(log: DeltaLog, version: int | None = None, *, writer_id: str | None = None,
                   policy: EncodePolicy | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                   check: bool = True, progress: Progress | None = None) -> CatchUp:
    """Write the full state of ``version`` (default latest) as a snapshot: ``tensor`` records
    in segments of about ``segment_bytes`` under ``snapshots/<version>/``, then its manifest.
    The state comes from the log by the cheapest route (every tensor digest checked). With
    ``check``, every record is decoded as a reader decodes it, before it is written, and must
    give the state's words bit for bit (so the state is not read back from the store: the
    segments' SHA-256 in the manifest covers the bytes as written). ``progress(n)`` is called
    with each tensor's bytes once its records are written. An existing snapshot is returned as
    it is."""
    writer_id = check_writer_id(writer_id or default_writer_id())
    version = log.latest_version() if version is None else version
    commit = log.commit(version)
    prefix = f"snapshots/{version}/"
    found = _existing(log, prefix + "manifest.json")
    if found is not None:
        return found
    state = log.materialize(version)
    differ = Differ(policy, log.digests, features=log.identity.features)
    table = commit.tensor_map()

    def records() -> Iterator[Record]:
        for name in sorted(state, key=str.encode):
            bits = state[name]
            for rec in differ.diff(name, None, bits):
                if check:
                    _check_tensor_record(rec, table[name], bits, log.digests)
                yield rec
            if progress:
                progress(bits.nbytes)

    refs, count, changed, keys = _write_segments(log, version, prefix, records(), writer_id, segment_bytes)
    state.clear()
    cu = CatchUp(log.log_id, version, None, None, commit.state_digest, log.commit_sha256(version),
                 tuple(refs), CommitStats(changed, commit.stats.total_elements, count), utc_now(), writer_id)
    return _publish(log, cu, keys)


def _check_tensor_record(rec: Record, info: TensorInfo, bits: TensorBits, digests: DigestScheme) -> None:
    """A snapshot's record, decoded as a reader decodes it, holds the state's words of its box
    and its target digest."""
    changes = decode_record(rec, info)
    where = flat_positions(rec, info.shape, changes)
    if (rec.kind != "tensor" or not np.array_equal(changes.values, gather_words(bits.words.reshape(-1), where))
            or digests.at(where, changes.values) != rec.target_digest):
        raise IntegrityError(f"snapshot: the record of {rec.tensor!r} at {rec.box} does not decode to the "
                             "state's words")


def write_squash(log: DeltaLog, start: int, end: int | None = None, *, writer_id: str | None = None,
                 policy: EncodePolicy | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 check: bool = True, progress: Progress | None = None) -> CatchUp:
    """Write one delta taking version ``start``'s state to version ``end``'s (default latest)
    under ``squashes/<start>-<end>/``, then its manifest. It is the delta between the two
    states (what xor records composed by xor, and the last of the overwrite and tensor
    records, give), encoded as the writer encodes a version.

    Memory: one group of tensors at a time (about 1/SQUASH_GROUPS of the model, or the largest
    tensor), its start and its end state: the group's start is materialized alone (the start's
    route is read once per group), advanced through the versions' records for it (their
    segments are read once per group) and every tensor checked against ``end``'s digest. With
    ``check``, every record is decoded as a reader decodes it and applied to the group's start
    words, before it is written, and the result must be ``end``'s words bit for bit (as a
    snapshot is checked: the bytes written are covered by the segments' SHA-256 in the
    manifest, so the squash is not read back). ``progress(n)`` is called with each tensor's
    bytes once its records are written. An existing squash is returned as it is."""
    writer_id = check_writer_id(writer_id or default_writer_id())
    end = log.latest_version() if end is None else end
    if not 0 <= start < end:
        raise UsageError(f"a squash goes from an earlier version to a later one, not {start} to {end}")
    base_commit, commit = log.commit(start), log.commit(end)
    prefix = f"squashes/{start}-{end}/"
    found = _existing(log, prefix + "manifest.json")
    if found is not None:
        return found
    previous = base_commit
    for v in range(start + 1, end + 1):
        step_commit = log.commit(v)
        if step_commit.parent_state_digest != previous.state_digest:
            raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
        previous = step_commit
    table = commit.tensor_map()
    differ = Differ(policy, log.digests, features=log.identity.features)

    def records() -> Iterator[Record]:
        for group in _tensor_groups(table, SQUASH_GROUPS):
            base = log.materialize(start, tensors=group)
            held = {n: TensorBits(b.dtype, b.shape, b.words.copy()) for n, b in base.items()}
            for v in range(start + 1, end + 1):
                log.apply_version(held, v, tensors=group)
            for name in sorted(group, key=str.encode):
                new, old = held.pop(name), base.pop(name, None)
                info = table[name]
                if log.digests.tensor(new.words, new.shape) != info.digest:
                    raise IntegrityError(f"version {end}: tensor {name!r} does not match its digest")
                if not check:
                    yield from differ.diff(name, old, new, "xor")
                else:
                    # The records are applied, as a reader applies them, to the start's words
                    # (the boxes are disjoint, so the encoder, still reading later boxes, never
                    # sees a box written), or to a zeroed tensor when the records are whole.
                    if old is not None and (old.dtype, old.shape) == (new.dtype, new.shape):
                        words = old.words
                    else:
                        words = np.zeros_like(new.words)
                    for rec in differ.diff(name, old, new, "xor"):
                        try:
                            apply_to_words(rec, decode_record(rec, info), words, info.shape, log.digests)
                        except IntegrityError as exc:
                            raise IntegrityError(f"squash {start}-{end}: the record of {name!r} at {rec.box} "
                                                 f"does not decode as written: {exc}") from None
                        yield rec
                    if not TensorBits(new.dtype, new.shape, words).same_bits(new):
                        raise IntegrityError(f"squash {start}-{end}: the records of {name!r} do not lead "
                                             f"to version {end}'s words")
                if progress:
                    progress(new.nbytes)

    refs, count, changed, keys = _write_segments(log, end, prefix, records(), writer_id, segment_bytes)
    cu = CatchUp(log.log_id, end, start, base_commit.state_digest, commit.state_digest,
                 log.commit_sha256(end), tuple(refs), CommitStats(changed, commit.stats.total_elements, count),
                 utc_now(), writer_id)
    return _publish(log, cu, keys)


def _tensor_groups(table: dict[str, TensorInfo], groups: int) -> list[set[str]]:
    """The tensors in byte order of their names, cut into runs of about 1/``groups`` of their
    bytes each (a tensor larger than that is a run of its own)."""
    sizes = {n: numel(i.shape) * DTYPE_WIDTH[i.dtype] for n, i in table.items()}
    budget = max(sum(sizes.values()) // groups, max(sizes.values(), default=0), 1)
    out: list[set[str]] = []
    current: set[str] = set()
    held = 0
    for name in sorted(table, key=str.encode):
        if current and held + sizes[name] > budget:
            out.append(current)
            current, held = set(), 0
        current.add(name)
        held += sizes[name]
    if current:
        out.append(current)
    return out
