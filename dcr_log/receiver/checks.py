"""Pass one: everything checked before any byte of the receiver or its journal is written
(spec/RECEIVER.md section 5, step 2).

``PassOne`` reads every segment of a step still to apply, feeds each record to the step's
rules (log.steps.StepRules), decodes it and, with verification, checks its precondition and
target against the storage; then the composition of sum digests shows that the records lead
from the start's tensor digests to the commit's. ``sampled`` and ``sample_tensors`` say what
verify=sample checks, here and after the writes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from dcr_log.codec import ChangeSet
from dcr_log.coords import DTYPE_WIDTH, flat_span, numel, tiles
from dcr_log.digest import MASK64, zeros_outside
from dcr_log.errors import IntegrityError, LineageError, StoreError
from dcr_log.format import Record
from dcr_log.format.tensors import TensorInfo
from dcr_log.log.deltalog import Step
from dcr_log.log.records import decode_record, flat_positions
from dcr_log.log.steps import StepRules
from dcr_log.parallel import TASK_CHANGES, map_grouped
from dcr_log.receiver.context import APPLY_WORKERS, GroupDigests, pool_pays
from dcr_log.receiver.journal import SegmentProgress
from dcr_log.receiver.segments import SegmentCache
from dcr_log.receiver.storage import Storage
from dcr_log.state import TableLayout

# verify=sample checks one record in SAMPLE_DIVISOR (and the first of each version), and the
# digests of tensors totalling at most 1/SAMPLE_DIVISOR of the model's bytes.
SAMPLE_DIVISOR = 16


def sampled(version: int, segment: int, record: int) -> bool:
    """Whether verify=sample checks this record after writing it."""
    if segment == 0 and record == 0:
        return True
    return xxhash.xxh3_64_intdigest(b"%d/%d/%d" % (version, segment, record)) % SAMPLE_DIVISOR == 0


def sample_tensors(tensors: Sequence[TensorInfo], version: int) -> list[str]:
    """A deterministic sample of tensors holding at most 1/SAMPLE_DIVISOR of the bytes."""
    sizes = {t.name: numel(t.shape) * DTYPE_WIDTH[t.dtype] for t in tensors}
    budget = sum(sizes.values()) // SAMPLE_DIVISOR
    order = sorted(sizes, key=lambda n: xxhash.xxh3_64_intdigest(b"%d\x00" % version + n.encode()))
    picked: list[str] = []
    used = 0
    for name in order:
        if used + sizes[name] <= budget:
            picked.append(name)
            used += sizes[name]
    if not picked and order:
        picked.append(min(order, key=lambda n: (sizes[n], n)))
    return picked


@dataclass(frozen=True, slots=True)
class _Classified:
    """An xor record's classification, made on a pool thread as it is decoded: its flat
    positions, its place in the storage, the words there, its target, and the digest parts of
    both."""

    where: np.ndarray | slice
    place: object
    current: np.ndarray
    target: np.ndarray
    current_part: int
    target_part: int


@dataclass(frozen=True, slots=True)
class Composition:
    """What ``PassOne.check_composition`` needs: the created tensors, the boxes of their
    tensor records, and per tensor the sum of its records' digest moves (target minus base)."""

    created: set[str]
    boxes: dict[str, list]
    moves: dict[str, int]


@dataclass(frozen=True, slots=True)
class PassOneResult:
    """What pass one found. ``composition`` is None where it cannot be checked (xxh3 digests,
    verify none, recovering, a start retention expired); ``neither`` is the first "holds
    neither" LineageError, raised by the caller once the composition shows the log consistent."""

    redo_bytes: int            # the target bytes of the xor records still to write
    composition: Composition | None
    neither: LineageError | None


@dataclass(frozen=True, slots=True)
class _Precondition:
    """A record's digest parts over the storage: of its current words and of its target (for
    a tensor record on a kept tensor: of the words it replaces, and 0)."""

    index: int
    record: Record
    current: int
    target: int


class PassOne:
    """Pass one of one step over a storage, built around the step's rules (StepRules).

    ``parent_layout`` is what the records may assume of the storage (the journal's version's
    tensors; nothing for a snapshot; the storage's own for a squash from a version retention
    expired). ``recovering``: the step is in flight, so the records before each segment's
    ``done`` are not read again and torn ones are not refused."""

    def __init__(self, storage: Storage, digests: GroupDigests, commit: Step, table: dict[str, TensorInfo],
                 parent_layout: TableLayout, recovering: bool, keep_gathered: bool = False):
        self.storage = storage
        self.digests = digests
        self.commit = commit
        self.table = table
        self.recovering = recovering
        # The writes follow in the same call, with nothing written in between: the words
        # gathered here and the targets computed from them serve the write pass for records
        # found at base (on one rank: a group classifies again, so its sums stay in step).
        self.keep_gathered = keep_gathered and not recovering and digests.group.size == 1
        # Per tensor, the end of the flat spans of the records seen: a record that may meet an
        # earlier one is classified again after that one is written (as 5.4 does in order).
        self._span_end: dict[str, int] = {}
        self.rules = StepRules(commit.kind, commit.describe(), table, parent_layout)

    def run(self, cache: SegmentCache, progress: Mapping[int, SegmentProgress],
            before: Mapping[str, TensorInfo] | None, classify: bool, check: bool = True) -> PassOneResult:
        """Each segment not yet done is read and parsed, each of its records (from ``done`` on)
        checked against the tensor table (known tensor, box inside, only ``tensor`` records for
        created tensors) and decoded; when the whole version is read, the record counts and
        changed elements against the commit's stats and, for a snapshot or squash, every
        created tensor covered exactly once by its ``tensor`` records (at every level:
        structure). With ``classify``, every record's precondition and target (one sum across
        the group per segment). ``before``: the tensor digests the records start from, where
        the log has them.

        Without ``check`` (verify none, where the writes follow: ``keep_gathered``), only the
        records classified on the pool as they are decoded are classified, for the write
        pass to keep, and none of the digest checks that none leaves out is made: no record's
        target, no tensor record's values, no composition. A record found at neither base nor
        target is still refused (RECEIVER.md 5.4 refuses it at every level), here before any
        write."""
        commit, table, storage, rules, recovering = self.commit, self.table, self.storage, self.rules, self.recovering
        version = commit.version
        whole = True
        redo_bytes = 0
        neither: LineageError | None = None
        # Per tensor, the sum of its records' digest moves (target minus base).
        moves: dict[str, int] = {}
        # Tensors whose xor and overwrite records are classified on the pool's threads as they
        # are decoded (the words gathered, the target and both digest parts computed), where
        # the storage's reads may run in parallel: kept tensors that the storage holds in the
        # table's layout. Nothing writes until pass one ends; the records are still taken in
        # order.
        ahead: set[str] = set()
        if classify and storage.parallel_reads:
            held = storage.layout()
            ahead = {name for name, info in table.items()
                     if name not in rules.created and storage.holds(name)
                     and held.get(name) == (info.dtype, tuple(info.shape))}
        for seg, ref in enumerate(commit.segments):
            prog = progress.get(seg, SegmentProgress())
            if prog.done >= ref.records:
                whole = False
                continue
            # Decoding may start while the segment's hash is still computed: ``checked`` gives
            # its verdict, first if anything here fails, and before anything is written (an
            # interrupt goes through as it is: nothing was written).
            recs, checked = cache.records_ahead(seg)
            whole = whole and prog.done == 0
            pending: list[_Precondition] = []

            def decode(i: int, recs: list[Record] = recs, done: int = prog.done
                       ) -> tuple[ChangeSet | Exception | None, _Classified | None]:
                changes = self._decode_ahead(recs[i], i >= done)
                return changes, self._classify_ahead(recs[i], changes, ahead)

            weights = [r.n_changed for r in recs]
            decoded = map_grouped(decode, range(len(recs)), weights, TASK_CHANGES, APPLY_WORKERS,
                                  pool_pays(sum(weights), len(recs)))
            try:
                with contextlib.closing(decoded):
                    self._segment(cache, seg, recs, prog, classify, check, decoded, pending)
            except Exception:
                checked()
                raise
            checked()
            for rec in recs:
                if rec.kind == "tensor":
                    if rec.tensor in rules.created:
                        moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest) & MASK64
                else:
                    moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest - rec.base_digest) & MASK64
            for rec in recs[prog.done:]:
                if rec.kind == "xor" and storage.holds(rec.tensor):
                    redo_bytes += rec.n_changed * DTYPE_WIDTH[table[rec.tensor].dtype]
            sums = self.digests.sums([d for p in pending for d in (p.current, p.target)])
            for n, p in enumerate(pending):
                rec = p.record
                d, d_target = sums[2 * n], sums[2 * n + 1]
                if rec.kind == "tensor":  # on a kept tensor: the box's old words are replaced
                    moves[rec.tensor] = (moves.get(rec.tensor, 0) + rec.target_digest - d) & MASK64
                    continue
                if d == rec.target_digest:
                    cache.drop_gathered(seg, p.index)
                    continue
                if d == rec.base_digest:
                    if check and d_target != rec.target_digest:
                        raise IntegrityError(f"version {version}: record of {rec.tensor!r} does not "
                                             "lead to its target digest")
                    continue
                cache.drop_gathered(seg, p.index)
                if recovering and prog.done <= p.index < prog.started_end:
                    continue  # torn by the interrupted apply; the redo images finish it
                # Raised once the log is shown consistent (the composition): a base digest
                # that the log's own tables contradict is damage in the log, not the storage's.
                neither = neither or LineageError(
                    f"version {version}: tensor {rec.tensor!r} holds neither the record's base nor "
                    "its target: changed behind the journal's back")
        if not whole:
            return PassOneResult(redo_bytes, None, neither)
        rules.finish(commit.stats)
        # Not when recovering (the words a tensor record replaced may be written already),
        # and at verify none only for a squash (whose tensor records replace nothing: the
        # composition is all that binds it to its version before the writes).
        if (recovering or before is None or not self.digests.scheme.composable
                or not ((classify and check) or commit.kind == "squash")):
            return PassOneResult(redo_bytes, None, neither)
        created = rules.created
        return PassOneResult(redo_bytes, Composition(created, {n: rules.created_boxes(n) for n in created}, moves),
                             neither)

    def check_composition(self, before: Mapping[str, TensorInfo], composition: Composition) -> None:
        """Sum digests: the records lead from the start's tensor digests (``before``) to the
        commit's, for every tensor the storage holds or creates (RECEIVER.md 5.2): the start's
        digest (a created tensor's: the zeros its tensor records leave uncovered) plus the
        records' moves. O(records), and O(elements) only for a created tensor that its records
        do not cover whole."""
        commit, boxes = self.commit, composition.boxes
        for info in commit.tensors:
            name = info.name
            if name in composition.created:
                start = 0 if tiles(boxes[name], info.shape) else zeros_outside(boxes[name], info.shape)
            elif self.storage.holds(name):  # (a tensor record's old box was read from the storage)
                start = before[name].digest
            else:
                continue
            if (start + composition.moves.get(name, 0)) & MASK64 != info.digest:
                raise IntegrityError(f"{commit.describe()}: its records do not lead from version "
                                     f"{commit.parent}'s digest of {name!r} to version "
                                     f"{commit.version}'s")

    def _decode_ahead(self, rec: Record, wanted: bool) -> ChangeSet | Exception | None:
        """A record's decoded changes for pass 1 (None when it is not needed), or the error
        decoding it raised, raised in turn when pass 1 reaches it: decoding runs ahead on the
        shared pool while the records before it are checked, in order."""
        info = self.table.get(rec.tensor)
        if not wanted or info is None or not (rec.kind == "tensor" or self.storage.holds(rec.tensor)):
            return None
        try:
            return decode_record(rec, info, flat=True)
        except Exception as exc:
            return exc

    def _classify_ahead(self, rec: Record, changes: ChangeSet | Exception | None,
                        ahead: set[str]) -> _Classified | None:
        """An xor or overwrite record of a tensor in ``ahead``, classified on the thread that
        decoded it; None for the others, and where anything fails (pass one classifies it
        again, in order, and raises there)."""
        if rec.kind == "tensor" or rec.tensor not in ahead or not isinstance(changes, ChangeSet):
            return None
        try:
            return self._classify(rec, changes)
        except Exception:
            return None

    def _classify(self, rec: Record, changes: ChangeSet) -> _Classified:
        """A record's words at its positions, its target from them, and both digest parts."""
        storage = self.storage
        where = flat_positions(rec, self.table[rec.tensor].shape, changes)
        place = storage.locate(rec.tensor, where)
        current, target, current_part, target_part = self.digests.classify(
            place, where, rec.kind, changes, storage.select(place, changes.values))
        return _Classified(where, place, current, target, current_part, target_part)

    def _segment(self, cache: SegmentCache, seg: int, recs: list[Record], prog: SegmentProgress,
                 classify: bool, check: bool,
                 decoded: Iterator[tuple[ChangeSet | Exception | None, _Classified | None]],
                 pending: list[_Precondition]) -> None:
        """Pass 1 over one segment's records, in order (see run)."""
        version, storage, rules = self.commit.version, self.storage, self.rules
        for (i, rec), (changes, made) in zip(enumerate(recs), decoded):
            if i < prog.done:
                continue
            # (The squash rule was checked before the step went in flight: when recovering,
            # the storage may already hold the new layout, which is all a squash from an
            # expired version can be compared with.)
            info = rules.record(rec, squash_keeps=not self.recovering)
            kept = rec.tensor not in rules.created
            held = rec.kind == "tensor" or storage.holds(rec.tensor)
            if not held:
                continue  # an engine that does not use the tensor: nothing to write or check
            if isinstance(changes, MemoryError):
                raise StoreError(f"version {version}: out of memory decoding a record of "
                                 f"{rec.tensor!r} ({rec.n_changed} changes)")
            if isinstance(changes, Exception):
                raise changes
            assert changes is not None  # decoded ahead: every held record from ``done`` on
            kept_changes = cache.keep_changes(seg, i, changes)
            if not classify:
                continue
            # Every record is checked here at sample and full (sample thins out only the
            # whole-tensor checks): nothing found after the first write can be the log's fault.
            first, end = flat_span(rec.box, info.shape)
            alone = first >= self._span_end.get(rec.tensor, 0)
            if end > first:
                self._span_end[rec.tensor] = max(end, self._span_end.get(rec.tensor, 0))
            if not check and made is None:
                continue  # without checks: classified on the pool, or left to the write pass
            if rec.kind == "tensor":  # no precondition; its values must be its target
                where = flat_positions(rec, info.shape, changes)
                if self.digests.scheme.at(where, changes.values) != rec.target_digest:
                    raise IntegrityError(f"version {version}: tensor record of {rec.tensor!r} "
                                         "does not match its target digest")
                if kept and not self.recovering and storage.holds(rec.tensor):
                    # The digest of the words it replaces, for the composition of digests.
                    place = storage.locate(rec.tensor, where)
                    pending.append(_Precondition(i, rec, self.digests.part(place, where, storage.gather(place)), 0))
                continue
            made = made or self._classify(rec, changes)
            if kept_changes:
                cache.keep_place(seg, i, made.place)
            if self.keep_gathered and kept_changes and alone:
                if cache.keep_gathered(seg, i, made.current, made.target, made.where):
                    cache.take_changes(seg, i)
            pending.append(_Precondition(i, rec, made.current_part, made.target_part))

