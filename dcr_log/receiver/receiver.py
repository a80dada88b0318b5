"""The receiver: applies a log's versions in place, idempotently and crash-safely.

The protocol is normative in spec/RECEIVER.md; in short, applying version v+1:
  1. lineage: the journal's log id, version and state digest must be the commit's parent,
     else LineageError before any write (with verify=full, the storage's state digest too);
  2. pass 1 (verify sample/full): the records' preconditions, before any write;
  3. journal: v+1 in flight;  4. layout change (create/reshape/drop tensors);
  5. per batch of records of a segment: one transaction with the redo images, the writes
     (overwrites of target values, so a torn batch is finished by writing them again and an
     xor is never applied twice), flush, one transaction marking the batch applied;
  6. the version's files (checkpoint directories, feature files: fetched and checked in
     pass 1), each written atomically;
  7. checks, then the joint commit: one transaction binding v+1 to its state digest."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from dcr_log.coords import DTYPE_WIDTH, numel, tiles, word_dtype
from dcr_log.digest import MASK64, XXH3, DigestScheme, zeros_outside
from dcr_log.errors import IntegrityError, LayoutError, LineageError, NotFoundError, StoreError, UsageError
from dcr_log.format import CommitRecord, Record
from dcr_log.format.tensors import TensorInfo, digest_hex, state_digest
from dcr_log.log.deltalog import DeltaLog, Step
from dcr_log.log.records import decode_record, flat_positions, record_bases, record_targets
from dcr_log.log.steps import StepRules
from dcr_log.parallel import DEFAULT_WORKERS, map_ordered
from dcr_log.receiver.files import FilePlan, plan_files, write_files
from dcr_log.receiver.journal import Journal, JournalState, SegmentProgress
from dcr_log.receiver.segments import SegmentCache
from dcr_log.receiver.storage import FaultHook, Storage, open_storage, storage_state_digest
from dcr_log.receiver.storage.memory import TorchStorage
from dcr_log.receiver.storage.placed import PlacedStorage
from dcr_log.signing import as_trust
from dcr_log.state import TableLayout, describe_layout_change

VERIFY_LEVELS = ("none", "sample", "full")


# verify=sample checks one record in SAMPLE_DIVISOR (and the first of each version), and the
# digests of tensors totalling at most 1/SAMPLE_DIVISOR of the model's bytes.
SAMPLE_DIVISOR = 16


# A batch holds records up to about this many decoded bytes (positions, values, targets).
BATCH_BYTES = 256 << 20


# Batches with at least this many changes are gathered, checked and written by records on
# the shared pool's threads; smaller ones on the calling thread (a hop costs more).
PARALLEL_MIN_CHANGES = 1 << 16


APPLY_WORKERS = DEFAULT_WORKERS


JOURNAL_DIR = ".dcr"


def _check_verify(verify: str) -> str:
    if verify not in VERIFY_LEVELS:
        raise UsageError(f"verify must be one of {', '.join(VERIFY_LEVELS)}, not {verify!r}")
    return verify


def commit_layout(commit: CommitRecord) -> TableLayout:
    return {t.name: (t.dtype, t.shape) for t in commit.tensors}


def _sampled(version: int, segment: int, record: int) -> bool:
    if segment == 0 and record == 0:
        return True
    return xxhash.xxh3_64_intdigest(b"%d/%d/%d" % (version, segment, record)) % SAMPLE_DIVISOR == 0


def sample_tensors(tensors: tuple[TensorInfo, ...], version: int) -> list[str]:
    """A deterministic sample of tensors holding at most 1/SAMPLE_DIVISOR of the bytes."""
    sizes = {t.name: numel(t.shape) * DTYPE_WIDTH[t.dtype] for t in tensors}
    budget = sum(sizes.values()) // SAMPLE_DIVISOR
    order = sorted(sizes, key=lambda n: xxhash.xxh3_64_intdigest(b"%d\x00" % version + n.encode()))
    picked, used = [], 0
    for name in order:
        if used + sizes[name] <= budget:
            picked.append(name)
            used += sizes[name]
    if not picked and order:
        picked.append(min(order, key=lambda n: (sizes[n], n)))
    return picked


@dataclass
class ApplyReport:
    """What one version's apply did."""

    version: int
    route: str = "version"    # how it was reached: "version", "squash" (from ``start``) or "snapshot"
    start: int | None = None
    records: int = 0          # records of the version looked at in the write pass
    written: int = 0          # records written
    skipped: int = 0          # records found already at their target
    repaired: int = 0         # torn records finished (redo image or rewrite)
    changed_elements: int = 0
    segments: int = 0
    delta_bytes: int = 0
    recovered: bool = False   # the version was in flight when this apply started
    unheld: int = 0           # records of tensors the (engine) storage does not hold
    rebuilt: list = field(default_factory=list)  # residual parameters rebuilt by the loader
    files_written: int = 0    # files of the version written (feature files, directories)
    files_removed: int = 0    # files the log had written that the version drops
    seconds: float = 0.0
    journal_seconds: float = 0.0


@dataclass
class _Work:
    index: int
    record: Record
    place: Any
    where: Any               # flat indices or a slice: what the record digests are keyed by
    target: np.ndarray
    base: np.ndarray | None  # gathered words before the write (memory rollback)
    redo: bool               # an xor whose target goes to the journal as a redo image
    repaired: bool


@dataclass
class _Undo:
    """Memory storage only: how to take the storage back to the journal's version."""

    layout: Any = None
    # (segment, record, base words or None); None means an xor, undone by xor-ing again.
    records: list[tuple[int, int, np.ndarray | None]] = field(default_factory=list)


@dataclass
class StageReport:
    """What ``Receiver.stage`` prepared: one version fetched, checked and decoded."""

    version: int
    records: int = 0
    staged_bytes: int = 0     # decoded positions, values and mapped positions kept in memory
    delta_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Staged:
    log: DeltaLog
    version: int
    verify: str
    commit: CommitRecord
    cache: SegmentCache
    progress: dict
    journal_bytes: int
    recovering: bool
    report: StageReport
    file_plan: Any = None
    # Check every tensor digest before the joint commit (a snapshot; a squash whose records'
    # digests could not be composed from its start's).
    whole_check: bool = False


class Receiver:
    """One receiver: a storage and its journal. Not thread-safe; one apply at a time."""

    def __init__(self, storage: Storage, journal: Journal, fault: FaultHook | None = None,
                 trust: Any = None):
        from dcr_log.collective import LocalGroup

        self.storage = storage
        self.journal = journal
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
             shadow: Any = None, dtypes: Any = None, layout_changes: str = "refuse") -> Receiver:
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
        receivers follow them through ``rediscover``."""
        if layout_changes not in ("refuse", "own"):
            raise UsageError(f"layout_changes must be 'refuse' or 'own', not {layout_changes!r}")
        if journal_path is None:
            if not isinstance(storage, (str, os.PathLike)):
                raise UsageError("a journal path is needed for in-memory storage")
            journal_path = Path(storage) / JOURNAL_DIR
        journal = Journal.open(journal_path)  # the receiver lock comes before the storage
        try:
            if dtypes is not None:
                from dcr_log.receiver.storage.memory import NumpyStorage
                base = NumpyStorage(storage, dtypes)
            else:
                base = open_storage(storage, device=device)
            if not isinstance(storage, (Storage, str, os.PathLike)):
                base.owns_layout = layout_changes == "own"
                if isinstance(base, TorchStorage) and placement is None and base.device.type != "cpu":
                    base.device_words = True  # (an engine layout reads its parameters on the host)
            if placement is not None:
                from dcr_log.engines.placement import Placement
                if isinstance(placement, (str, os.PathLike)):
                    placement = Placement.load(placement)
                if shadow is None and base.durable:
                    shadow = Path(journal_path) / "shadow"
                shadow_storage = _open_shadow(shadow) if shadow is not None else None
                base = PlacedStorage(base, placement, group=group, shadow=shadow_storage, loader=loader,
                                     loader_params=loader_params, rediscover=rediscover)
            elif group is not None or loader is not None or rediscover is not None:
                raise UsageError("group=, loader= and rediscover= go with placement=")
            return Receiver(base, journal, fault, trust)
        except BaseException:
            journal.close()
            raise

    def close(self) -> None:
        self.storage.close()
        self.journal.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
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

    def _sums(self, parts: list[int]) -> list[int]:
        """Digests summed across the group (each rank gave the part it owns)."""
        if self.group.size == 1 or not self.digests.composable:
            return parts
        every = self.group.all_gather(parts)
        if any(len(p) != len(parts) for p in every):
            raise IntegrityError("ranks of the group disagree on what they are checking")
        return [sum(col) & MASK64 for col in zip(*every)]

    def _part(self, place, where, words: np.ndarray) -> int:
        owned, idx = self.storage.owned(place, where)
        return self.storage.digest_at(place, owned, words if idx is None else words[idx], self.digests)

    def _holds_state(self, commit: CommitRecord) -> bool:
        """Whether the storage holds ``commit``'s state: its state digest, or for an engine
        layout, the digest of every tensor the group holds (summed across the group)."""
        if not self.placed:
            return self.storage_digest() == commit.state_digest
        names = [t for t in commit.tensors if self.storage.holds(t.name)]
        sums = self._sums([self.storage.tensor_digest(t.name, self.digests) for t in names])
        return all(d == t.digest for d, t in zip(sums, names))

    def _check_scheme(self) -> None:
        if self.placed and not self.digests.composable and not self.storage.whole():
            raise UsageError("this log's xxh3 digests need whole tensors: an engine receiver that "
                             "holds slices needs a log with the sum-digests feature")

    def _hook(self, point: str, **info) -> None:
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
        commit = log.commit(version)
        if self.trust is not None:
            log.check_signed(version, self.trust)
        placement = None
        if self.placed:
            self._check_scheme()
            self.storage.placement.check(table=commit_layout(commit))
            placement = self.storage.placement.digest
            need = self.storage.shadow_needs()
            if need:
                self.storage.fill_shadow(log.materialize(version, tensors=set(need)))
        if self.storage.layout() != commit_layout(commit):
            raise LineageError(f"storage tensors (names, dtypes, shapes) differ from version {version}'s")
        if verify != "none" and not self._holds_state(commit):
            raise LineageError(f"storage does not hold version {version} (state digest differs)")
        plan = self.plan_files(log, commit)
        if plan is not None:
            write_files(plan, log, self.storage.files_dir, self._fault_hook)
        self.journal.bind(log.log_id, version, commit.state_digest, placement=placement,
                          files=None if plan is None else plan.names)

    def plan_files(self, log: DeltaLog, commit: CommitRecord) -> FilePlan | None:
        """Storage with a directory (a checkpoint directory): what writing the version's files
        takes, fetched and checked (no writes); None for storage that ignores files."""
        directory = getattr(self.storage, "files_dir", None)
        if directory is None:
            return None
        return plan_files(log, commit, directory, self.journal.files(), self.storage.weight_names())

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
        latest = log.latest_version()
        if st.version > latest:
            raise LineageError(f"receiver holds version {st.version} but the log ends at {latest}")
        target = latest if to is None else to
        if target > latest:
            raise NotFoundError(f"no version {target} (latest is {latest})")
        if target < st.version:
            raise UsageError(f"receiver holds version {st.version}; it cannot go back to {target}")
        if st.inflight is not None and target < st.inflight:
            raise UsageError(f"receiver is applying version {st.inflight}; apply at least to it")
        applied = []
        verified_digest = None
        route = self.route(log, target)
        while route:
            if stop is not None and stop() and self.journal.state().inflight is None:
                break
            step = route.pop(0)
            try:
                report, verified_digest = self._apply_step(log, step, verify, verified_digest)
            except IntegrityError as exc:
                # A damaged snapshot or squash found before the step was in flight (memory
                # storage rolls back; durable storage refuses before its first write): take
                # another route. The chain of versions, and a step in flight, are never avoided.
                if self.journal.state().inflight is not None or not log.exclude(step, str(exc)):
                    raise
                route = self.route(log, target)
                continue
            applied.append(step.version)
            if on_version is not None:
                on_version(report)
        return applied

    def follow(self, log: DeltaLog, interval: float = 1.0, verify: str | None = None,
               on_version: Callable[[ApplyReport], None] | None = None,
               stop: Callable[[], bool] | None = None, until: int | None = None,
               prefetch: bool = True) -> list[int]:
        """Keep applying: every version as soon as its commit record appears (polled every
        ``interval`` seconds), until ``stop()`` is true (checked between versions and while
        waiting) or the receiver reaches ``until``. While waiting for version v+1, the
        segments its writer has already written are fetched (``DeltaLog.prefetch``); they are
        used once the commit record lands and lists them, after the usual size and sha256
        checks. Returns the versions applied."""
        stop = stop or (lambda: False)
        applied: list[int] = []
        while not stop():
            applied += self.apply(log, verify=verify, on_version=on_version, stop=stop)
            log.forget_prefetched(self.version)
            if until is not None and self.version >= until:
                break
            waiting = self.version + 1
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
        holding, digest = st.version, st.state_digest
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
            step = log.version_step(st.version + 1 if version is None else version)
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
        if st.version is None:
            raise UsageError("receiver is not bound to a version yet (bind it first)")
        self.digests = log.digests
        if self.placed:
            self._check_scheme()
            bound = self.journal.placement_digest()
            if self.storage.durable and bound is not None and bound != self.storage.placement.digest:
                raise UsageError("the receiver was bound with another placement: open it with the "
                                 "placement it was bound with, or bind it again")
        return st

    def _apply_step(self, log: DeltaLog, step: Step, verify: str,
                    verified_digest: int | None) -> tuple[ApplyReport, int | None]:
        if self.trust is not None and step.kind != "version":
            # A catch-up object is not signed: under a trust policy every record is checked,
            # so that the result is the trusted version's (its tensor digests).
            verify = "full"
        staged = self._prepare(log, step, verify, verified_digest)
        return self._write_version(staged), (staged.commit.state_digest if verify == "full" else None)

    def _prepare(self, log: DeltaLog, step: int | Step, verify: str, verified_digest: int | None) -> _Staged:
        """Everything before the first write: lineage, pass 1 (decoding, preconditions)."""
        t0 = time.perf_counter()
        storage = self.storage
        st = self._lineage_state(log)
        if not isinstance(step, Step):
            step = log.version_step(step)
        commit, version = step, step.version
        if self.trust is not None:
            log.check_signed(version, self.trust)
        if step.kind != "snapshot" and commit.parent is not None and commit.parent >= log.known_start():
            # The log's own chain first: a commit whose parent digest is not its parent's state
            # digest is damage in the log (IntegrityError), whatever the receiver holds.
            if log.commit(commit.parent).state_digest != commit.parent_state_digest:
                raise IntegrityError(f"{step.describe()}: parent digest does not match version "
                                     f"{commit.parent}'s state digest")
        if step.kind != "snapshot" and (commit.parent != st.version or commit.parent_state_digest != st.state_digest):
            parent = "none" if commit.parent is None else f"{commit.parent} ({digest_hex(commit.parent_state_digest)})"
            raise LineageError(f"{step.describe()} follows version {parent}; the receiver holds "
                               f"version {st.version} ({digest_hex(st.state_digest)})")
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
        readable = st.version >= log.known_start()
        if step.kind == "snapshot":
            parent_layout = {}
        elif readable:
            parent_layout = commit_layout(log.commit(st.version))
        else:
            parent_layout = storage.layout()
        if not recovering and step.kind != "snapshot" and readable:
            # Cheap, so at every level: the layout the journal's version implies.
            if storage.layout() != parent_layout:
                raise LineageError(f"storage tensors differ from version {st.version}'s: "
                                   "changed behind the journal's back")
            if verify == "full":
                if verified_digest != st.state_digest and not self._holds_state(log.commit(st.version)):
                    raise LineageError(f"storage does not hold version {st.version} (state digest "
                                       "differs): changed behind the journal's back")
        if not self.placed and not storage.owns_layout and storage.layout() != commit_layout(commit):
            raise LayoutError(f"{step.describe()} changes the tensor table ("
                              f"{describe_layout_change(storage.layout(), commit_layout(commit))}); the "
                              "receiver's tensors are the caller's: open it with "
                              "layout_changes='own' to let it add, drop, reshape and retype them")
        progress = self.journal.progress() if recovering else {}
        for seg, prog in progress.items():
            if seg >= len(commit.segments) or prog.started_end > commit.segments[seg].records:
                raise IntegrityError(f"journal {self.journal.path}: progress of segment {seg} lies "
                                     f"outside version {version}'s segments")
        # A spool outside the receiver (a refused apply writes nothing there), used only for
        # segments beyond the memory budget.
        cache = SegmentCache(log, commit, spool=Path(tempfile.gettempdir()) / f"dcr-spool-{uuid.uuid4().hex}")
        try:
            # Pass 1, at every level: every segment still to apply is read and checked (size,
            # sha256, schema, record count) and every record decoded, so that nothing the
            # version needs can fail after the first write; with verification, (sampled)
            # preconditions.
            # The tensor digests the records start from, where the log has them: none for a
            # snapshot, the start's for a version or a squash (not after it expired).
            if step.kind == "snapshot":
                before: dict[str, TensorInfo] | None = {}
            else:
                before = log.commit(step.parent).tensor_map() if readable else None
            journal_bytes, composition, neither = self._precheck(
                commit, table, cache, progress, verify, recovering, parent_layout, before,
                classify=verify != "none")
            if neither is not None and composition is None:
                raise neither
            # The version's files (a checkpoint directory): fetched and checked before any write.
            file_plan = self.plan_files(log, commit)
            # A layout change is prepared here (allocations, space, an engine's new placement):
            # before the composition, which hashes the zeros of created tensors' uncovered
            # elements (a claimed tensor larger than the storage is refused at once).
            storage.prepare_layout(commit_layout(commit), extra_bytes=journal_bytes + (
                0 if file_plan is None else file_plan.nbytes))
            if composition is not None:
                self._check_composition(commit, before, *composition)
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
        # then fails here, before any byte of the storage is written.
        self.journal.begin(version, commit.kind, commit.parent if commit.kind == "squash" else None)
        undo = None if storage.durable else _Undo()
        touched: set[str] = set()
        try:
            self._hook("inflight", version=version)
            if storage.layout() != commit_layout(commit):
                cache.forget_places()  # handles located before a layout change may be stale
            layout_undo = storage.set_layout(commit_layout(commit))
            if undo is not None:
                undo.layout = layout_undo
            # New tensors have no base to keep (an engine's parameters always exist).
            created = set() if undo is None or self.placed else {n for n in (layout_undo or {}) if n in table}
            self._hook("layout", version=version)
            for seg in range(len(commit.segments)):
                self._apply_segment(commit, table, cache, seg, progress.get(seg, SegmentProgress()),
                                    verify, created, undo, report, touched)
            if self.placed:
                # Residual parameters from the canonical copies, now at the new version
                # (all of them when recovering: the interrupted run may have changed any).
                report.rebuilt = self.storage.rebuild_residuals(None if staged.recovering else touched)
                if report.rebuilt:
                    self._hook("residual", version=version)
            file_plan = staged.file_plan
            if file_plan is not None:  # before the joint commit; idempotent when run again
                write_files(file_plan, staged.log, storage.files_dir, self._fault_hook)
                report.files_written = len(file_plan.writes)
                report.files_removed = len(file_plan.removes)
            # A snapshot is checked whole (it wrote every tensor); so is a squash whose digests
            # could not be composed: nothing smaller shows that it reached its version.
            if verify == "full" or staged.whole_check:
                if not self._holds_state(commit):
                    raise IntegrityError(f"{commit.describe()}: storage state digest differs after apply")
            elif verify == "sample":
                names = [n for n in sample_tensors(commit.tensors, version) if storage.holds(n)]
                # Whole-tensor digests release the GIL: tensors on the pool (an engine's may
                # talk to its group, so those stay on this thread).
                sums = self._sums(list(map_ordered(lambda n: storage.tensor_digest(n, self.digests),
                                                   names, APPLY_WORKERS, not self.placed)))
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
                self._rollback(table, cache, undo)
            raise
        finally:
            cache.close()
        if self.placed:
            self.storage.forget_undo()
        self._hook("committed", version=version)
        report.seconds = time.perf_counter() - t0
        report.journal_seconds = self.journal.txn_seconds - j0
        return report

    # -- pass 1 ----------------------------------------------------------------------------

    def _precheck(self, commit: CommitRecord, table: dict[str, TensorInfo], cache: SegmentCache,
                  progress: dict[int, SegmentProgress], verify: str, recovering: bool,
                  parent_layout: TableLayout, before: dict[str, TensorInfo] | None,
                  classify: bool) -> tuple[int, tuple | None, LineageError | None]:
        """Everything checked before the first write: each segment not yet done is read and
        parsed, each of its records (from ``done`` on) checked against the tensor table (known
        tensor, box inside, only ``tensor`` records for created tensors) and decoded; when the
        whole version is read, the record counts and changed elements against the commit's
        stats and, for a snapshot or squash, every created tensor covered exactly once by its
        ``tensor`` records (at every level: structure). With ``classify``, every record's
        precondition and target (one sum across the group per segment). Returns about how
        many journal bytes the redo images of the largest batch will take, and what
        _check_composition needs (None where it cannot be checked: xxh3 digests, verify none,
        recovering, a start retention expired), and the first "holds neither" LineageError,
        raised by the caller once the composition shows the log consistent."""
        version = commit.version
        storage = self.storage
        whole = True
        redo_bytes = 0
        neither: LineageError | None = None
        rules = StepRules(commit.kind, commit.describe(), table, parent_layout)
        # Per tensor, the sum of its records' digest moves (target minus base).
        moves: dict[str, int] = {}
        for seg, ref in enumerate(commit.segments):
            prog = progress.get(seg, SegmentProgress())
            if prog.done >= ref.records:
                whole = False
                continue
            recs = cache.records(seg)
            whole = whole and prog.done == 0
            pending: list[tuple[int, Record, int, int]] = []
            decoded = map_ordered(
                lambda i, recs=recs, done=prog.done: self._decode_ahead(table, recs[i], i >= done),
                range(len(recs)), APPLY_WORKERS, sum(r.n_changed for r in recs) >= PARALLEL_MIN_CHANGES)
            with contextlib.closing(decoded):
                self._precheck_segment(commit, rules, cache, seg, recs, prog, recovering,
                                       classify, decoded, pending)
            for rec in recs:
                if rec.kind == "tensor":
                    if rec.tensor in rules.created:
                        moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest) & MASK64
                else:
                    moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest - rec.base_digest) & MASK64
            for rec in recs[prog.done:]:
                if rec.kind == "xor" and storage.holds(rec.tensor):
                    redo_bytes += rec.n_changed * DTYPE_WIDTH[table[rec.tensor].dtype]
            sums = self._sums([d for p in pending for d in p[2:]])
            for n, (i, rec, _, _) in enumerate(pending):
                d, d_target = sums[2 * n], sums[2 * n + 1]
                if rec.kind == "tensor":  # on a kept tensor: the box's old words are replaced
                    moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest - d) & MASK64
                    continue
                if d == rec.target_digest:
                    continue
                if d == rec.base_digest:
                    if d_target != rec.target_digest:
                        raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not "
                                             "lead to its target digest")
                    continue
                if recovering and prog.done <= i < prog.started_end:
                    continue  # torn by the interrupted apply; the redo images finish it
                # Raised once the log is shown consistent (the composition): a base digest
                # that the log's own tables contradict is damage in the log, not the storage's.
                neither = neither or LineageError(
                    f"version {version}: tensor {rec.tensor!r} holds neither the record's base nor "
                    "its target: changed behind the journal's back")
        journal_bytes = 2 * min(redo_bytes, BATCH_BYTES)
        if not whole:
            return journal_bytes, None, neither
        rules.finish(commit.stats)
        # Not when recovering (the words a tensor record replaced may be written already),
        # and at verify none only for a squash (whose tensor records replace nothing: the
        # composition is all that binds it to its version before the writes).
        if (recovering or before is None or not self.digests.composable
                or not (classify or commit.kind == "squash")):
            return journal_bytes, None, neither
        created = rules.created
        return journal_bytes, (created, {n: rules.created_boxes(n) for n in created}, moves), neither

    def _check_composition(self, commit: CommitRecord, before: dict[str, TensorInfo],
                           created: set[str], boxes: dict[str, list], moves: dict[str, int]) -> None:
        """Sum digests: the records lead from the start's tensor digests (``before``) to the
        commit's, for every tensor the storage holds or creates (RECEIVER.md 5.2): the start's
        digest (a created tensor's: the zeros its tensor records leave uncovered) plus the
        records' moves. O(records), and O(elements) only for a created tensor that its records
        do not cover whole."""
        for info in commit.tensors:
            name = info.name
            if name in created:
                start = 0 if tiles(boxes[name], info.shape) else zeros_outside(boxes[name], info.shape)
            elif self.storage.holds(name):  # (a tensor record's old box was read from the storage)
                start = before[name].digest
            else:
                continue
            if (start + moves.get(name, 0)) & MASK64 != info.digest:
                raise IntegrityError(f"{commit.describe()}: its records do not lead from version "
                                     f"{commit.parent}'s digest of {name!r} to version "
                                     f"{commit.version}'s")

    def _decode_ahead(self, table: dict[str, TensorInfo], rec: Record, wanted: bool):
        """A record's decoded changes for pass 1 (None when it is not needed), or the error
        decoding it raised, raised in turn when pass 1 reaches it: decoding runs ahead on the
        shared pool while the records before it are checked, in order."""
        info = table.get(rec.tensor)
        if not wanted or info is None or not (rec.kind == "tensor" or self.storage.holds(rec.tensor)):
            return None
        try:
            return decode_record(rec, info)
        except Exception as exc:
            return exc

    def _precheck_segment(self, commit, rules: StepRules, cache, seg, recs, prog, recovering,
                          classify, decoded, pending) -> None:
        """Pass 1 over one segment's records, in order (see _precheck)."""
        version = commit.version
        storage = self.storage
        for (i, rec), changes in zip(enumerate(recs), decoded):
            if i < prog.done:
                continue
            # (The squash rule was checked before the step went in flight: when recovering,
            # the storage may already hold the new layout, which is all a squash from an
            # expired version can be compared with.)
            info = rules.record(rec, squash_keeps=not recovering)
            kept = rec.tensor not in rules.created
            held = rec.kind == "tensor" or storage.holds(rec.tensor)
            if not held:
                continue  # an engine that does not use the tensor: nothing to write or check
            if isinstance(changes, MemoryError):
                raise StoreError(f"version {version}: out of memory decoding a record of "
                                 f"{rec.tensor!r} ({rec.n_changed} changes)")
            if isinstance(changes, Exception):
                raise changes
            kept_changes = cache.keep_changes(seg, i, changes)
            if not classify:
                continue
            # Every record is checked here at sample and full (sample thins out only the
            # whole-tensor checks): nothing found after the first write can be the log's fault.
            where = flat_positions(rec, info.shape, changes)
            if rec.kind == "tensor":  # no precondition; its values must be its target
                if self.digests.at(where, changes.values) != rec.target_digest:
                    raise IntegrityError(f"version {version}: tensor record of {rec.tensor!r} "
                                         "does not match its target digest")
                if kept and not recovering and storage.holds(rec.tensor):
                    # The digest of the words it replaces, for the composition of digests.
                    place = storage.locate(rec.tensor, where)
                    pending.append((i, rec, self._part(place, where, storage.gather(place)), 0))
                continue
            place = storage.locate(rec.tensor, where)
            if kept_changes:
                cache.keep_place(seg, i, place)
            cur = storage.gather(place)
            values = storage.select(place, changes.values)
            target = record_targets(rec.kind, changes, cur, values)
            pending.append((i, rec, self._part(place, where, cur), self._part(place, where, target)))

    @staticmethod
    def _info(table: dict[str, TensorInfo], rec: Record, version: int) -> TensorInfo:
        info = table.get(rec.tensor)
        if info is None:
            raise IntegrityError(f"version {version}: record for unknown tensor {rec.tensor!r}")
        return info

    # -- pass 2 ----------------------------------------------------------------------------

    def _apply_segment(self, commit, table, cache, seg, prog: SegmentProgress, verify,
                       created, undo: _Undo | None, report: ApplyReport, touched: set) -> None:
        ref = commit.segments[seg]
        if prog.done >= ref.records:
            return
        records = cache.records(seg)
        # Records an interrupted apply may have left half written (redo images finish xors).
        torn = range(prog.done, prog.started_end)
        redo = self.journal.redo_images(seg) if len(torn) else {}
        start = prog.done
        while start < len(records):
            end, budget = start, 0
            while end < len(records) and (end == start or budget < BATCH_BYTES):
                rec = records[end]
                width = DTYPE_WIDTH[self._info(table, rec, commit.version).dtype]
                budget += rec.n_changed * (8 + 3 * width)
                end += 1
            self._apply_batch(commit, table, seg, records, start, end, torn, redo, verify,
                              created, undo, report, cache, touched)
            start = end

    def _apply_batch(self, commit, table, seg, records, start, end, torn: range, redo, verify,
                     created, undo: _Undo | None, report: ApplyReport, cache: SegmentCache,
                     touched: set) -> None:
        storage = self.storage
        version = commit.version
        work: list[_Work] = []
        classify = []
        items = []
        for i in range(start, end):
            rec = records[i]
            info = self._info(table, rec, version)
            report.records += 1
            if not storage.holds(rec.tensor):
                report.unheld += 1
                continue
            items.append((i, rec, info, cache.take_changes(seg, i), cache.take_place(seg, i)))
            report.changed_elements += rec.n_changed
            touched.add(rec.tensor)

        def prepare(item):
            """Gather, targets and digest parts of one record: reads only, so records run
            on the shared pool's threads (numpy, the digests and pcodec release the GIL)."""
            i, rec, info, changes, place = item
            changes = changes or decode_record(rec, info)
            where = flat_positions(rec, info.shape, changes)
            place = place or storage.locate(rec.tensor, where)
            values = storage.select(place, changes.values)
            if rec.kind == "tensor":
                # Whole values and no precondition: writing them again is harmless.
                base = None
                if undo is not None and rec.tensor not in created:
                    base = storage.gather(place)
                return _Work(i, rec, place, where, values, base, False, i in torn)
            cur = storage.gather(place)
            target = record_targets(rec.kind, changes, cur, values)
            parts = (self._part(place, where, cur), self._part(place, where, target))
            return (i, rec, info, place, where, cur, values, target, parts)

        parallel = sum(it[1].n_changed for it in items) >= PARALLEL_MIN_CHANGES
        for prepared in map_ordered(prepare, items, APPLY_WORKERS, parallel):
            if isinstance(prepared, _Work):
                work.append(prepared)
            else:
                classify.append(prepared)
        sums = self._sums([d for c in classify for d in c[8]])
        for n, (i, rec, info, place, where, cur, values, target, _) in enumerate(classify):
            d, d_target = sums[2 * n], sums[2 * n + 1]
            if d == rec.target_digest:
                report.skipped += 1
                continue
            repaired = False
            if d == rec.base_digest:
                if verify != "none" and d_target != rec.target_digest:
                    raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not lead to "
                                         "its target digest")
            elif i in torn:  # durable storage: a group of one, so digests are local
                repaired = True
                if rec.kind == "xor":
                    image = redo.get(i)
                    if image is None:
                        raise LineageError(f"version {version}: torn xor record of {rec.tensor!r} "
                                           "has no redo image: changed behind the journal's back")
                    target = np.frombuffer(image, dtype=word_dtype(info.dtype))
                    if target.size != cur.size:
                        raise IntegrityError(f"version {version}: redo image of {rec.tensor!r} has "
                                             f"{target.size} words, expected {cur.size}")
                else:
                    target = values
                if verify != "none" and self._part(place, where, target) != rec.target_digest:
                    raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not lead to "
                                         "its target digest")
            else:
                raise LineageError(f"version {version}: tensor {rec.tensor!r} holds neither the record's "
                                   "base nor its target: changed behind the journal's back")
            work.append(_Work(i, rec, place, where, target, cur, rec.kind == "xor", repaired))
        work.sort(key=lambda w: w.index)

        durable = storage.durable
        # A torn range left by an interrupted apply stays declared until passed, whatever
        # the batch boundaries of this run.
        started_end = max(end, torn.stop)
        if durable and work:
            self.journal.stage(seg, start, started_end,
                               {w.index: memoryview(np.ascontiguousarray(w.target)).cast("B")
                                for w in work if w.redo})
            self._hook("redo", version=version, segment=seg, start=start, end=end)
        if self._fault_hook is None and parallel and _disjoint(work):
            # Records that do not overlap are written in parallel. (Those of a version must
            # not, but a reader does not take it on trust: overlapping ones are written in
            # order. With a fault hook installed too, so that a test stops at a known record.)
            for _ in map_ordered(lambda w: self._write(w, seg, undo), work, APPLY_WORKERS):
                pass
            report.written += len(work)
            report.repaired += sum(w.repaired for w in work)
        else:
            for n, w in enumerate(work):
                self._write(w, seg, undo)
                report.written += 1
                report.repaired += w.repaired
                self._hook("record", version=version, segment=seg, record=w.index, written=n + 1)
        if durable:
            if work:
                storage.flush()
                self._hook("flushed", version=version, segment=seg, end=end)
            self.journal.mark_applied(seg, end, max(end, torn.stop), range(start, end))
            self._hook("applied", version=version, segment=seg, end=end)
        if verify != "none":
            checks = [w for w in work if verify == "full" or _sampled(version, seg, w.index)]
            sums = self._sums([self._part(w.place, w.where, storage.gather(w.place)) for w in checks])
            for w, d in zip(checks, sums):
                if d != w.record.target_digest:
                    raise IntegrityError(f"version {version}: tensor {w.record.tensor!r} differs from "
                                         "the record's target after writing")

    def _write(self, w: _Work, seg: int, undo: _Undo | None) -> None:
        if undo is None:
            self.storage.write(w.place, w.target)
            return
        try:
            self.storage.write(w.place, w.target)
        except BaseException:
            if w.base is not None:  # possibly half written: restore the gathered base
                undo.records.append((seg, w.index, w.base))
            raise
        if w.record.kind == "xor":
            undo.records.append((seg, w.index, None))
        elif w.base is not None:
            undo.records.append((seg, w.index, w.base))

    def _rollback(self, table, cache: SegmentCache, undo: _Undo) -> None:
        """Memory storage: undo the residual rebuild, the written records (newest first),
        then the layout change."""
        storage = self.storage
        if self.placed:
            storage.abort()
        records_by_seg: dict[int, list[Record]] = {}
        for seg, i, base in reversed(undo.records):
            recs = records_by_seg.get(seg)
            if recs is None:
                recs = records_by_seg[seg] = cache.records(seg)
            rec = recs[i]
            info = table[rec.tensor]
            changes = decode_record(rec, info)
            place = storage.locate(rec.tensor, flat_positions(rec, info.shape, changes))
            if base is None:  # an xor is its own inverse
                values = storage.select(place, changes.values)
                storage.write(place, record_bases(rec.kind, changes, storage.gather(place), values))
            else:
                storage.write(place, base)
        if undo.layout:
            storage.restore_layout(undo.layout)
        self.journal.abort()


def _disjoint(work: list[_Work]) -> bool:
    """Whether the records' flat spans (first to last position, per tensor) are disjoint."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for w in work:
        where = w.where
        if isinstance(where, slice):
            span = (where.start, where.stop - 1)
        elif where.size:
            span = (int(where[0]), int(where[-1]))  # flat positions of a box increase
        else:
            continue
        spans.setdefault(w.record.tensor, []).append(span)
    for pieces in spans.values():
        pieces.sort()
        if any(start <= prev_end for (_, prev_end), (start, _) in zip(pieces, pieces[1:])):
            return False
    return True


def _open_shadow(shadow: Any) -> Storage:
    """The canonical copies of residual sources: a Storage, a dict, or a directory (durable;
    created empty when missing, filled at bind)."""
    if isinstance(shadow, Storage):
        return shadow
    if isinstance(shadow, (str, os.PathLike)):
        from dcr_log.checkpoint import save_safetensors
        from dcr_log.receiver.storage.checkpoint import CheckpointStorage, has_checkpoint
        path = Path(shadow)
        if not has_checkpoint(path):
            path.mkdir(parents=True, exist_ok=True)
            save_safetensors({}, path / "model.safetensors", metadata={"format": "pt"})
        return CheckpointStorage(path)
    return open_storage(shadow)
