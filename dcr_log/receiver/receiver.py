"""The receiver: applies a log's versions in place, idempotently and crash-safely.

The protocol is normative in spec/RECEIVER.md; in short, applying version v+1:
  1. lineage: the journal's log id, version and state digest must be the commit's parent,
     else LineageError before any write (with verify=full, the storage's state digest too);
  2. pass 1: every record read and decoded and (verify sample/full) its precondition and
     target checked, before any write (at none, records it can are classified unchecked);
  3. journal: v+1 in flight;  4. layout change (create/reshape/drop tensors);
  5. per batch of records of a segment: one transaction with the redo images, the writes
     (overwrites of target values, so a torn batch is finished by writing them again and an
     xor is never applied twice), flush, one transaction marking the batch applied;
  6. the version's files (checkpoint directories, feature files: fetched and checked in
     pass 1), each written atomically;
  7. checks, then the joint commit: one transaction binding v+1 to its state digest.

This module is the Receiver's state machine (bind, apply, follow, stage, recover and the
joint commit); pass one is checks.PassOne, the batches batch.BatchWriter, opening opening.py.
It stays above 500 lines: the lineage rules of ``_prepare`` and the joint commit of
``_write_version`` are the protocol's two halves and read best next to each other."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel
from dcr_log.digest import XXH3, DigestScheme
from dcr_log.errors import ExpiredError, IntegrityError, LayoutError, LineageError, NotFoundError, UsageError
from dcr_log.format import CommitRecord
from dcr_log.format.segment import load_reader
from dcr_log.format.tensors import TensorInfo, digest_hex, state_digest
from dcr_log.log.deltalog import DeltaLog, Step
from dcr_log.receiver.batch import (
    BatchWriter,
    Deferred,
    Undo,
    redo_journal_bytes,
    wal_budget,
    wal_image_bytes,
    wal_image_spread_bytes,
)
from dcr_log.receiver.checks import PassOne, sample_tensors
from dcr_log.receiver.context import APPLY_WORKERS, ApplyContext, GroupDigests
from dcr_log.receiver.files import FilePlan, plan_files, write_files
from dcr_log.receiver.fs import boot_id
from dcr_log.receiver.journal import Journal, JournalState, SegmentProgress
from dcr_log.receiver.journal_entries import WalImage
from dcr_log.receiver.opening import (
    JOURNAL_DIR,
    check_layout_changes,
    open_journal,
    open_receiver_storage,
)
from dcr_log.receiver.reports import ApplyReport, StageReport
from dcr_log.receiver.segments import SegmentCache
from dcr_log.receiver.storage import FaultHook, Storage, storage_state_digest, tensor_digests
from dcr_log.receiver.storage.placed import PlacedStorage
from dcr_log.signing import as_trust
from dcr_log.state import TableLayout, describe_layout_change

__all__ = ["JOURNAL_DIR", "VERIFY_LEVELS", "ApplyReport", "Receiver", "StageReport", "commit_layout"]

VERIFY_LEVELS = ("none", "sample", "full")
# Routes planned again in a row when retention removes what a step reads before it is in
# flight (a receiver slower than gc's grace period); past this the ExpiredError is raised.
MAX_REPLANS = 3


def _check_verify(verify: str) -> str:
    if verify not in VERIFY_LEVELS:
        raise UsageError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    return verify


def _held(st: JournalState) -> int:
    """The version a bound receiver holds."""
    if st.version is None:
        raise UsageError("receiver is not bound to a version yet (bind it first)")
    return st.version


def _hex(digest: int | None) -> str:
    return "none" if digest is None else digest_hex(digest)


def commit_layout(commit: CommitRecord | Step) -> TableLayout:
    return {t.name: (t.dtype, t.shape) for t in commit.tensors}


@dataclass
class _Staged:
    """A step through pass one: what its writes need."""

    log: DeltaLog
    version: int
    verify: str
    commit: Step
    cache: SegmentCache
    progress: dict[int, SegmentProgress]
    journal_bytes: int
    recovering: bool
    report: StageReport
    file_plan: FilePlan | None = None
    # Check every tensor digest before the joint commit (a snapshot; a squash whose records'
    # digests could not be composed from its start's).
    whole_check: bool = False


class Receiver:
    """One receiver: a storage and its journal. Not thread-safe; one apply at a time."""

    def __init__(self, storage: Storage, journal: Journal, fault: FaultHook | None = None,
                 trust: Any = None, deferred_sync: bool = True):
        from dcr_log.collective import LocalGroup

        self.storage = storage
        self.journal = journal
        # Deferred sync (RECEIVER.md): a checkpoint directory's written words stay in the
        # journal until the files are synced, instead of an msync of every file per batch.
        storage.deferred_sync = deferred_sync and storage.can_defer_sync
        if storage.can_defer_sync:
            storage.on_sync_error = self._sync_failed
        # This boot's id once the journal's images were restored (or found not needed).
        self._restored: bytes | None = None
        # Under a trust policy, a version is bound or applied only with a valid signature by
        # a trusted key (dcr_log.signing), checked before any write.
        self.trust = as_trust(trust)
        self.fault = fault
        # The digest scheme of the log being applied (set by bind and apply).
        self.digests: DigestScheme = XXH3
        # Engine storage in a tensor-parallel group: digests are summed across it.
        self.group = getattr(storage, "group", None) or LocalGroup()
        self._staged: _Staged | None = None

    @property
    def fault(self) -> FaultHook | None:
        return self._fault_hook

    @fault.setter
    def fault(self, hook: FaultHook | None) -> None:
        """A test hook called as ``hook(point, **info)`` at named points; it may raise."""
        self._fault_hook = hook
        self.storage.fault = hook

    @staticmethod
    def open(storage: Any, journal_path: str | os.PathLike | None = None,
             fault: FaultHook | None = None, device: Any = None, trust: Any = None,
             placement: Any = None, loader: Callable | None = None, group: Any = None,
             rediscover: Callable | None = None, loader_params: Any = None,
             shadow: Any = None, dtypes: Any = None, layout_changes: str = "refuse",
             deferred_sync: bool = True) -> Receiver:
        """Open a receiver: ``storage`` is a Storage, a dict of numpy arrays or torch tensors,
        or a checkpoint directory (whose journal defaults to DIR/.dcr).

        With ``placement`` (dcr_log.placement), ``storage`` holds an engine's parameters in
        the engine's own layout (fused, tensor-parallel, padded): records go to the parameter
        positions the placement gives, residual parameters are rebuilt by ``loader`` (the
        engine's ``load_weights``; with ``loader_params``, the tensors it writes, copied into
        ``storage``), ``group`` is the tensor-parallel group whose ranks share the digests,
        and ``rediscover(table)`` gives a placement for a version that changes the tensor
        table (run on a scratch engine), without which such a version is refused. ``dtypes``
        names the safetensors dtype of numpy arrays holding raw words (bf16 as uint16).

        ``layout_changes`` says what a version that changes the tensor table (adds, drops,
        renames, reshapes or retypes a tensor) may do to a mapping of tensors: ``"refuse"``
        (the default: the tensors are the caller's, a model's parameters say, and such a
        version is refused with LayoutError before any write; the mapping, its keys and every
        tensor's dtype and shape stay as they are) or ``"own"`` (the mapping is the
        receiver's: keys are added and removed, and a reshaped or retyped torch tensor gets
        new data in place). Checkpoint directories always follow table changes; engine
        receivers follow them through ``rediscover``.

        ``deferred_sync`` (checkpoint directories): keep each version's written words in the
        journal and sync the files only when those images outgrow their budget, instead of
        syncing every written file before each journal marker. After a power loss the
        files are right only once a receiver has used the directory (its first apply, bind,
        stage or route restores them; ``dcr status`` says when one is needed); False for a
        directory that other programs read without a receiver.

        It imports pyarrow's segment reader now (format.segment.load_reader), so that the
        first version applied does not wait for the import."""
        check_layout_changes(layout_changes)
        load_reader()
        journal = open_journal(storage, journal_path)
        try:
            base = open_receiver_storage(storage, journal.path, device=device, placement=placement,
                                         loader=loader, group=group, rediscover=rediscover,
                                         loader_params=loader_params, shadow=shadow, dtypes=dtypes,
                                         layout_changes=layout_changes)
            return Receiver(base, journal, fault, trust, deferred_sync)
        except BaseException:
            journal.close()
            raise

    def close(self) -> None:
        self.storage.close()
        self.journal.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------------

    @property
    def state(self) -> JournalState:
        return self.journal.state()

    @property
    def version(self) -> int | None:
        return self.journal.state().version

    @property
    def state_digest(self) -> int | None:
        return self.journal.state().state_digest

    @property
    def inflight(self) -> int | None:
        return self.journal.state().inflight

    @property
    def placed(self) -> bool:
        return isinstance(self.storage, PlacedStorage)

    def storage_digest(self) -> int:
        """The storage's state digest under the log's scheme, every tensor hashed."""
        return storage_state_digest(self.storage, self.digests)

    @property
    def _digest_parts(self) -> GroupDigests:
        return GroupDigests(self.storage, self.group, self.digests)

    def _holds_state(self, commit: CommitRecord | Step) -> bool:
        """Whether the storage holds ``commit``'s state: its state digest, or for an engine
        layout, the digest of every tensor the group holds (summed across the group)."""
        if not self.placed:
            return self.storage_digest() == commit.state_digest
        names = [t for t in commit.tensors if self.storage.holds(t.name)]
        sums = self._digest_parts.sums([self.storage.tensor_digest(t.name, self.digests) for t in names])
        return all(d == t.digest for d, t in zip(sums, names))

    def _check_scheme(self) -> None:
        storage = self.storage
        if isinstance(storage, PlacedStorage) and not self.digests.composable and not storage.whole():
            raise UsageError("this log's xxh3 digests need whole tensors: an engine receiver that "
                             "holds slices needs a log with the sum-digests feature")

    def _hook(self, point: str, **info: Any) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point, **info)

    # -- bind ------------------------------------------------------------------------------

    def bind(self, log: DeltaLog, version: int, verify: str = "full") -> None:
        """Declare that the storage holds ``version``. Checked by state digest unless verify
        is "none" (sample and full both hash every tensor here). An engine receiver's canonical
        copies of residual sources (if any) are materialized from the log here."""
        _check_verify(verify)
        st = self.journal.state()
        if st.log_id is not None and st.log_id != log.log_id:
            raise LineageError(f"receiver belongs to log {st.log_id}, not {log.log_id}")
        self.digests = log.digests
        if st.log_id is not None:
            self._restore_unsynced()
        commit = log.commit(version)
        if self.trust is not None:
            log.check_signed(version, self.trust)
        placement = None
        storage = self.storage
        if isinstance(storage, PlacedStorage):
            self._check_scheme()
            storage.placement.check(table=commit_layout(commit))
            placement = storage.placement.digest
            need = storage.shadow_needs()
            if need:
                storage.fill_shadow(log.materialize(version, tensors=set(need)))
        if self.storage.layout() != commit_layout(commit):
            raise LineageError(f"storage tensors (names, dtypes, shapes) differ from version {version}'s")
        if verify != "none" and not self._holds_state(commit):
            raise LineageError(f"storage does not hold version {version} (state digest differs)")
        plan = self.plan_files(log, commit)
        if plan is not None:
            self._write_files(plan, log)
        self.storage.sync()  # the bind drops deferred-sync images: the words are on disk
        self.journal.bind(log.log_id, version, commit.state_digest, placement=placement,
                          files=None if plan is None else plan.names)

    def plan_files(self, log: DeltaLog, commit: CommitRecord | Step) -> FilePlan | None:
        """Storage with a directory (a checkpoint directory): what writing the version's files
        takes, fetched and checked (no writes); None for storage that ignores files."""
        directory = getattr(self.storage, "files_dir", None)
        if directory is None:
            return None
        return plan_files(log, commit, directory, self.journal.files(), self.storage.weight_names())

    def _write_files(self, plan: FilePlan, log: DeltaLog) -> None:
        """Carry out a plan of plan_files (made only for storage with a directory)."""
        directory = self.storage.files_dir
        if directory is not None:
            write_files(plan, log, directory, self._fault_hook)

    # -- apply -----------------------------------------------------------------------------

    def apply(self, log: DeltaLog | None = None, to: int | None = None, verify: str | None = None,
              on_version: Callable[[ApplyReport], None] | None = None,
              stop: Callable[[], bool] | None = None) -> list[int]:
        """Apply versions current+1 .. ``to`` (default: the latest) in order; returns them.
        ``verify`` defaults to "sample". Without ``log``: apply the version ``stage`` prepared
        (only the writes remain), at the verification level it was staged with. ``stop()``,
        checked between versions, ends the apply early (after a joint commit)."""
        if log is None:
            if self._staged is None:
                raise UsageError("nothing is staged: call stage(log, version) first, or pass the log")
            if to not in (None, self._staged.version) or verify not in (None, self._staged.verify):
                raise UsageError(f"version {self._staged.version} was staged with verify="
                                 f"{self._staged.verify!r}: apply() applies exactly that (stage again "
                                 "to change it)")
            staged, self._staged = self._staged, None
            report = self._write_version(staged)
            if on_version is not None:
                on_version(report)
            return [staged.version]
        if self._staged is not None:  # staged, then not applied: drop it
            self._staged.cache.close()
        self._staged = None
        verify = _check_verify("sample" if verify is None else verify)
        st = self._lineage_state(log)
        held = _held(st)
        latest = log.latest_version()
        if held > latest:
            raise LineageError(f"receiver holds version {held} but the log ends at {latest}")
        target = latest if to is None else to
        if target > latest:
            raise NotFoundError(f"no version {target} (latest is {latest})")
        if target < held:
            raise UsageError(f"receiver holds version {held}; it cannot go back to {target}")
        if st.inflight is not None and target < st.inflight:
            raise UsageError(f"receiver is applying version {st.inflight}; apply at least to it")
        applied: list[int] = []
        verified_digest: int | None = None
        route = self.route(log, target)
        replans = 0
        while route:
            if stop is not None and stop() and self.journal.state().inflight is None:
                break
            step = route.pop(0)
            try:
                report, verified_digest = self._apply_step(log, step, verify, verified_digest)
            except ExpiredError:
                # Retention deleted what the step reads after the route was planned (this
                # receiver fell behind by more than gc's grace period). Pass 1 reads every
                # segment before the first write, so nothing was written: plan again from the
                # version held, through the log start's snapshot if need be. Not in a group,
                # whose ranks must take one route; not past a requested target that expired.
                if (self.journal.state().inflight is not None or self.group.size > 1
                        or replans >= MAX_REPLANS):
                    raise
                replans += 1
                target = log.latest_version() if to is None else target
                route = self.route(log, target)
                continue
            except IntegrityError as exc:
                # A damaged snapshot or squash found before the step was in flight (memory
                # storage rolls back; durable storage refuses before its first write): take
                # another route. The chain of versions, and a step in flight, are never avoided.
                if self.journal.state().inflight is not None or not log.exclude(step, str(exc)):
                    raise
                route = self.route(log, target)
                continue
            applied.append(step.version)
            replans = 0
            if on_version is not None:
                on_version(report)
        return applied

    def follow(self, log: DeltaLog, interval: float = 1.0, verify: str | None = None,
               on_version: Callable[[ApplyReport], None] | None = None,
               stop: Callable[[], bool] | None = None, until: int | None = None,
               prefetch: bool = True,
               on_wait: Callable[[int], AbstractContextManager[object]] | None = None) -> list[int]:
        """Keep applying: every version as soon as its commit record appears (polled every
        ``interval`` seconds), until ``stop()`` is true (checked between versions and while
        waiting) or the receiver reaches ``until``. While waiting for version v+1, the
        segments its writer has already written are fetched (``DeltaLog.prefetch``); they are
        used once the commit record lands and lists them, after the usual size and sha256
        checks. ``on_wait(v + 1)``, if given, returns a context held while it waits (a status
        line, say). Returns the versions applied."""
        stop = stop or (lambda: False)
        applied: list[int] = []
        while not stop():
            applied += self.apply(log, verify=verify, on_version=on_version, stop=stop)
            held = _held(self.journal.state())
            log.forget_prefetched(held)
            if until is not None and held >= until:
                break
            waiting = held + 1
            if stop() or log.has_version(waiting):
                continue
            with nullcontext() if on_wait is None else on_wait(waiting):
                while not stop() and not log.has_version(waiting):
                    if prefetch:
                        log.prefetch(waiting)
                    deadline = time.monotonic() + interval
                    while not stop() and time.monotonic() < deadline:
                        time.sleep(min(0.05, interval))
        return applied

    def route(self, log: DeltaLog, target: int | None = None) -> list[Step]:
        """The steps ``apply`` takes to ``target`` (default latest): the step in flight first,
        then the route of fewest bytes (versions, squashes, a snapshot: DeltaLog.plan). A
        receiver at a version retention expired is caught up by a squash or a snapshot."""
        st = self._lineage_state(log)
        steps: list[Step] = []
        holding, digest = _held(st), st.state_digest
        if st.inflight is not None:
            steps.append(log.step(st.inflight_kind, st.inflight, st.inflight_from))
            holding, digest = st.inflight, steps[0].state_digest
        target = log.latest_version() if target is None else target
        if target > holding:
            steps += log.plan(target, holding=holding, holding_digest=digest)
        return steps

    def stage(self, log: DeltaLog, version: int | None = None, verify: str = "sample") -> StageReport:
        """Fetch, check and decode ``version`` (default: the one after the receiver's) without
        writing anything, in memory proportional to the delta; ``apply()`` then only writes.
        The storage may keep serving meanwhile (it is only read)."""
        _check_verify(verify)
        st = self._lineage_state(log)
        if version is None and st.inflight is not None:  # the step in flight, whatever its kind
            step = log.step(st.inflight_kind, st.inflight, st.inflight_from)
        else:
            step = log.version_step(_held(st) + 1 if version is None else version)
        if self._staged is not None:
            self._staged.cache.close()
        self._staged = None
        self._staged = self._prepare(log, step, verify, None)
        return self._staged.report

    def apply_version(self, log: DeltaLog, version: int, verify: str = "sample") -> ApplyReport:
        """Apply exactly ``version``, which must follow the journal's current version."""
        return self._apply_step(log, log.version_step(version), _check_verify(verify), None)[0]

    def apply_step(self, log: DeltaLog, step: Step, verify: str = "sample") -> ApplyReport:
        """Apply one step of a route (a version, a squash from the receiver's version, or a
        snapshot): DeltaLog.plan, version_step, catchup_step."""
        return self._apply_step(log, step, _check_verify(verify), None)[0]

    def recover(self, log: DeltaLog, verify: str = "sample") -> ApplyReport | None:
        """Finish the step in flight, if any (durable storage)."""
        st = self._lineage_state(log)
        if st.inflight is None:
            return None
        step = log.step(st.inflight_kind, st.inflight, st.inflight_from)
        return self._apply_step(log, step, _check_verify(verify), None)[0]

    def _lineage_state(self, log: DeltaLog) -> JournalState:
        st = self.journal.state()
        if st.log_id is not None and st.log_id != log.log_id:
            raise LineageError(f"receiver belongs to log {st.log_id}, not {log.log_id}")
        _held(st)  # refuses a receiver not bound yet
        self.digests = log.digests
        storage = self.storage
        if isinstance(storage, PlacedStorage):
            self._check_scheme()
            bound = self.journal.placement_digest()
            if storage.durable and bound is not None and bound != storage.placement.digest:
                raise UsageError("the receiver was bound with another placement: open it with the "
                                 "placement it was bound with, or bind it again")
        self._restore_unsynced()
        return st

    def _sync_failed(self) -> None:
        """An msync failed: the kernel may have dropped written words from its page cache, so
        the journal's images are restored at the next start, in this boot too."""
        try:
            self.journal.forget_wal_boot()
        except Exception:  # the sync's own error is the one to report
            pass

    def _restore_unsynced(self) -> None:
        """Deferred sync: before the storage is read, put back the words of the journal's
        images if a restart since they were written may have lost them from the page cache
        (another boot, or one the system does not name), then sync (RECEIVER.md, "Deferred
        sync"). Only words that differ are written; the journal is not (the next begin
        records this boot)."""
        if self._restored is not None:
            return
        boot = boot_id()
        if self.journal.state().restore_needed(boot):
            storage, layout = self.storage, self.storage.layout()
            # Two passes over the journal, an image at a time: all checked before the first
            # write, then written.
            with contextlib.closing(self.journal.wal_images()) as images:
                self._check_images(images, layout)
            with contextlib.closing(self.journal.wal_images()) as images:
                for image in images:  # in order: a word's last image is its value
                    where = image.where
                    place = storage.locate(image.tensor, where if isinstance(where, slice)
                                           else where.astype(np.int64))
                    if not np.array_equal(storage.gather(place), image.words):
                        storage.write(place, image.words.copy())  # aligned, as the C scatter needs
            storage.sync()
        self._restored = boot

    def _check_images(self, images: Iterable[WalImage], layout: TableLayout) -> None:
        """Each image's tensor is in the storage, with its word width, its positions inside."""
        for image in images:
            if image.tensor not in layout:
                raise IntegrityError(f"journal image of version {image.version} is for tensor "
                                     f"{image.tensor!r}, which the storage lacks")
            words = self.storage.tensor_words(image.tensor)
            where = image.where
            end = where.stop if isinstance(where, slice) else int(where.max()) + 1 if where.size else 0
            if words.itemsize != image.words.itemsize or end > words.size:
                raise IntegrityError(f"journal image of version {image.version} does not fit "
                                     f"tensor {image.tensor!r}")

    def _image_bytes(self, commit: CommitRecord | Step) -> tuple[int, int, int]:
        """Deferred sync: the storage's image budget, the most bytes ``commit``'s images can
        take (4-byte positions and its widest word per change: the free-space check), and
        about the bytes they take with its changes spread evenly (1-byte gaps at 10%
        changed). A version whose images would outgrow the budget alone is synced batch by
        batch instead: at 20% of a bf16 model they are 30% of the file, which a sync writes
        anyway. (At 10% of 512 MiB, keeping them made a new receiver's apply 1.3-1.4x as
        fast: tools/bench_apply.py --gib 0.5 --reps 5 --receivers ckpt --verify sample
        --rates 0.10,0.07.)"""
        layout = self.storage.layout()
        budget = wal_budget(sum(numel(shape) * DTYPE_WIDTH[dtype] for dtype, shape in layout.values()))
        width = max((DTYPE_WIDTH[t.dtype] for t in commit.tensors), default=1)
        stats = commit.stats
        return (budget, wal_image_bytes(stats.changed_elements, width),
                wal_image_spread_bytes(stats.changed_elements, stats.total_elements, width))

    def _apply_step(self, log: DeltaLog, step: Step, verify: str,
                    verified_digest: int | None) -> tuple[ApplyReport, int | None]:
        if self.trust is not None and step.kind != "version":
            # A catch-up object is not signed: under a trust policy every record is checked,
            # so that the result is the trusted version's (its tensor digests).
            verify = "full"
        staged = self._prepare(log, step, verify, verified_digest, writes_follow=True)
        return self._write_version(staged), (staged.commit.state_digest if verify == "full" else None)

    def _prepare(self, log: DeltaLog, step: int | Step, verify: str, verified_digest: int | None,
                 writes_follow: bool = False) -> _Staged:
        """Everything before the first write: lineage, pass 1 (decoding, preconditions).
        ``writes_follow``: the writes run right after, in this call (not after ``stage``, while
        the storage may have served), so pass 1's classification carries over to them."""
        t0 = time.perf_counter()
        storage = self.storage
        st = self._lineage_state(log)
        held = _held(st)
        if not isinstance(step, Step):
            step = log.version_step(step)
        commit, version = step, step.version
        if self.trust is not None:
            log.check_signed(version, self.trust)
        parent_record = None if step.kind == "snapshot" or commit.parent is None else log.kept_commit(commit.parent)
        if parent_record is not None:
            # The log's own chain first: a commit whose parent digest is not its parent's state
            # digest is damage in the log (IntegrityError), whatever the receiver holds.
            if parent_record.state_digest != commit.parent_state_digest:
                raise IntegrityError(f"{step.describe()}: parent digest does not match version "
                                     f"{commit.parent}'s state digest")
        if step.kind != "snapshot" and (commit.parent != st.version or commit.parent_state_digest != st.state_digest):
            parent = "none" if commit.parent is None else f"{commit.parent} ({_hex(commit.parent_state_digest)})"
            raise LineageError(f"{step.describe()} follows version {parent}; the receiver holds "
                               f"version {held} ({_hex(st.state_digest)})")
        recovering = st.inflight is not None
        if recovering and (st.inflight, st.inflight_kind, st.inflight_from) != (
                version, step.kind, step.parent if step.kind == "squash" else None):
            raise IntegrityError(f"journal has version {st.inflight} ({st.inflight_kind}) in flight, "
                                 f"not {step.describe()}")
        if recovering and not storage.durable:
            raise LineageError(f"receiver was interrupted while applying version {version} and its "
                               "storage does not survive that; bind it again")
        if state_digest(commit.tensors) != commit.state_digest:
            raise IntegrityError(f"version {version}: state digest does not match its tensor table")
        if sum(ref.records for ref in commit.segments) != commit.stats.records:
            raise IntegrityError(f"version {version}: segment record counts differ from the commit's stats")
        table = commit.tensor_map()
        # What the records may assume of the storage: the journal's version's tensors; a
        # snapshot nothing (its records are all tensor records); a squash from a version
        # retention expired, the storage's own tensors (its records' preconditions check them).
        held_record = log.kept_commit(held)  # None: expired, by the last listing or since
        parent_layout: TableLayout
        if step.kind == "snapshot":
            parent_layout = {}
        elif held_record is not None:
            parent_layout = commit_layout(held_record)
        else:
            parent_layout = storage.layout()
        if not recovering and step.kind != "snapshot" and held_record is not None:
            # Cheap, so at every level: the layout the journal's version implies.
            if storage.layout() != parent_layout:
                raise LineageError(f"storage tensors differ from version {held}'s: "
                                   "changed behind the journal's back")
            if verify == "full":
                if verified_digest != st.state_digest and not self._holds_state(held_record):
                    raise LineageError(f"storage does not hold version {held} (state digest "
                                       "differs): changed behind the journal's back")
        if not self.placed and not storage.owns_layout and storage.layout() != commit_layout(commit):
            raise LayoutError(f"{step.describe()} changes the tensor table ("
                              f"{describe_layout_change(storage.layout(), commit_layout(commit))}); the "
                              "receiver's tensors are the caller's: open it with "
                              "layout_changes='own' to let it add, drop, reshape and retype them")
        progress: dict[int, SegmentProgress] = self.journal.progress() if recovering else {}
        for seg, prog in progress.items():
            if seg >= len(commit.segments) or prog.started_end > commit.segments[seg].records:
                raise IntegrityError(f"journal {self.journal.path}: progress of segment {seg} lies "
                                     f"outside version {version}'s segments")
        # A spool outside the receiver (a refused apply writes nothing there), used only for
        # segments beyond the memory budget. Its place is asked for only then: the first
        # tempfile.gettempdir() of a process creates and removes a file in the directory it
        # picks, which a process killed meanwhile leaves behind (tools/crash_apply.py's kills
        # left such files in /tmp).
        cache = SegmentCache(log, commit, spool=lambda: Path(tempfile.gettempdir()) / f"dcr-spool-{uuid.uuid4().hex}")
        try:
            # Pass 1, at every level: every segment still to apply is read and checked (size,
            # sha256, schema, record count) and every record decoded, so that nothing the
            # version needs can fail after the first write; with verification, (sampled)
            # preconditions.
            # The tensor digests the records start from, where the log has them: none for a
            # snapshot, the start's for a version or a squash (not after it expired).
            before: dict[str, TensorInfo] | None
            if step.kind == "snapshot":
                before = {}
            else:
                before = None if held_record is None else held_record.tensor_map()  # held: the step's parent
            pass_one = PassOne(storage, self._digest_parts, commit, table, parent_layout, recovering,
                               keep_gathered=writes_follow)
            # At none, where the writes follow, pass one still classifies the records it can
            # on the pool as it decodes them, without the checks none leaves out: the write
            # pass then finds them gathered, where classifying a whole batch before writing
            # any of it left its lines out of the cache by the writes (at 10% changed, none
            # was slower than sample).
            found = pass_one.run(cache, progress, before, classify=verify != "none" or pass_one.keep_gathered,
                                 check=verify != "none")
            composition, neither = found.composition, found.neither
            journal_bytes = redo_journal_bytes(found.redo_bytes)
            if storage.deferred_sync:  # the version's images, when it keeps them
                budget, most, spread = self._image_bytes(commit)
                journal_bytes += min(most, budget) if spread <= budget else 0
            if neither is not None and composition is None:
                raise neither
            # The version's files (a checkpoint directory): fetched and checked before any write.
            file_plan = self.plan_files(log, commit)
            # A layout change is prepared here (allocations, space, an engine's new placement):
            # before the composition, which hashes the zeros of created tensors' uncovered
            # elements (a claimed tensor larger than the storage is refused at once).
            storage.prepare_layout(commit_layout(commit), extra_bytes=journal_bytes + (
                0 if file_plan is None else file_plan.nbytes))
            if composition is not None and before is not None:
                pass_one.check_composition(before, composition)
            if neither is not None:
                raise neither
            whole_check = step.kind == "snapshot"
            if step.kind == "squash":
                whole_check = recovering or composition is None
        except BaseException:
            cache.close()
            raise
        report = StageReport(version, records=commit.stats.records, delta_bytes=commit.delta_bytes,
                             staged_bytes=cache.staged_bytes(), seconds=time.perf_counter() - t0)
        return _Staged(log, version, verify, commit, cache, progress, journal_bytes, recovering, report,
                       file_plan, whole_check)

    def _write_version(self, staged: _Staged) -> ApplyReport:
        t0 = time.perf_counter()
        j0 = self.journal.txn_seconds
        storage = self.storage
        commit, cache, verify, version = staged.commit, staged.cache, staged.verify, staged.version
        if self.journal.state().inflight not in (None, version) or (
                commit.kind != "snapshot" and self.journal.state().version != commit.parent):
            raise UsageError(f"the receiver moved since version {version} was staged: stage it again")
        table = commit.tensor_map()
        progress = staged.progress
        report = ApplyReport(version, route=commit.kind, start=commit.parent if commit.kind == "squash" else None,
                             segments=len(commit.segments), delta_bytes=commit.delta_bytes,
                             recovered=staged.recovering)
        # -- writes start here --
        # The first write is always a journal transaction, also when recovering (where it
        # rewrites the same in-flight entry): a damaged journal (LMDB has no page checksums)
        # then fails here, before any byte of the storage is written. (Under deferred sync a
        # restore after a restart, and syncs, may come first: they put back and flush the
        # journal's own version, RECEIVER.md 5.6.)
        deferred = None
        clear_wal = False
        # (_prepare restored the journal's images, where a restart required it.)
        if storage.deferred_sync:
            layout = storage.layout()
            budget, _, spread = self._image_bytes(commit)
            used = self.journal.wal_bytes()
            if spread <= budget:
                deferred = Deferred(budget, used, self._restored or b"")
            if used and (deferred is None or layout != commit_layout(commit)):
                # A layout change rewrites files from their maps and renames them: the images
                # are dropped first (their words synced), so none is ever put back into a
                # tensor of another shape. A version without images drops them likewise.
                storage.sync()
                clear_wal = True
                if deferred is not None:
                    deferred.used = 0
        elif storage.durable and self.journal.wal_boot() is not None:
            # Opened without deferred sync over images kept with it: restoring them after a
            # later power loss would put back words this apply overwrites. Synced, dropped.
            storage.sync()
            clear_wal = True
        self.journal.begin(version, commit.kind, commit.parent if commit.kind == "squash" else None,
                           clear_wal=clear_wal, wal_boot=None if deferred is None else deferred.boot)
        undo = None if storage.durable else Undo()
        ctx = ApplyContext(commit, table, cache, verify, report, undo)
        writer = BatchWriter(storage, self.journal, self._digest_parts, self._fault_hook, deferred)
        try:
            self._hook("inflight", version=version)
            if storage.layout() != commit_layout(commit):
                cache.forget_places()  # handles located before a layout change may be stale
            layout_undo = storage.set_layout(commit_layout(commit))
            if undo is not None:
                undo.layout = layout_undo
            # New tensors have no base to keep (an engine's parameters always exist).
            if undo is not None and not self.placed:
                ctx.created = {n for n in (layout_undo or {}) if n in table}
            self._hook("layout", version=version)
            for seg in range(len(commit.segments)):
                writer.apply_segment(ctx, seg, progress.get(seg, SegmentProgress()))
            if isinstance(storage, PlacedStorage):
                # Residual parameters from the canonical copies, now at the new version
                # (all of them when recovering: the interrupted run may have changed any).
                report.rebuilt = storage.rebuild_residuals(None if staged.recovering else ctx.touched)
                if report.rebuilt:
                    self._hook("residual", version=version)
            file_plan = staged.file_plan
            if file_plan is not None:  # before the joint commit; idempotent when run again
                self._write_files(file_plan, staged.log)
                report.files_written = len(file_plan.writes)
                report.files_removed = len(file_plan.removes)
            # A snapshot is checked whole (it wrote every tensor); so is a squash whose digests
            # could not be composed: nothing smaller shows that it reached its version.
            if verify == "full" or staged.whole_check:
                if not self._holds_state(commit):
                    raise IntegrityError(f"{commit.describe()}: storage state digest differs after apply")
            elif verify == "sample":
                names = [n for n in sample_tensors(commit.tensors, version) if storage.holds(n)]
                # On the pool's threads (an engine's tensors stay on this one: its storage may
                # talk to its group).
                sums = self._digest_parts.sums(tensor_digests(storage, names, self.digests, APPLY_WORKERS,
                                                              not self.placed))
                for name, d in zip(names, sums):
                    if d != table[name].digest:
                        raise IntegrityError(f"version {version}: tensor {name!r} differs from its digest")
            storage.flush()
            if self.group.size > 1:
                self.group.all_gather(True)  # every rank got here: none commits alone
            self._hook("before_commit", version=version)
            self.journal.commit(version, commit.state_digest,
                                files=None if file_plan is None else file_plan.names)
        except (Exception, KeyboardInterrupt):
            if undo is not None:
                writer.rollback(table, cache, undo)
            raise
        finally:
            cache.close()
        if isinstance(storage, PlacedStorage):
            storage.forget_undo()
        self._hook("committed", version=version)
        report.seconds = time.perf_counter() - t0
        report.journal_seconds = self.journal.txn_seconds - j0
        return report
