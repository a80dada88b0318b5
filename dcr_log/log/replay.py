"""Replay: applying steps to in-memory states (``apply_step``), the chain of versions one by
one (``replay``) and the state of one version by its cheapest route (``materialize``).

Each step's records are checked by ``StepRules`` before they are applied; large records are
decoded and applied on a few threads with the result of applying them in order. Functions
take the ``DeltaLog`` they read; its methods of the same names delegate here."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from dcr_log.codec.dense import DenseEncoding
from dcr_log.coords import flat_span, numel
from dcr_log.digest import MASK64, DigestScheme
from dcr_log.errors import IntegrityError, NotFoundError
from dcr_log.format import Record
from dcr_log.format.tensors import state_digest
from dcr_log.log.records import apply_to_words, decode_dense_tensor_into, decode_record, empty_words
from dcr_log.log.routes import Step
from dcr_log.log.steps import StepRules
from dcr_log.parallel import DEFAULT_WORKERS, TASK_CHANGES, records_large_enough, shared_pool, take_oldest, task_grain
from dcr_log.state import TensorBits

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog

# Called with each version once it is applied (or checked).
Progress = Callable[[int], None]


def _covers_exactly(pieces: list | None, count: int) -> bool:
    """Whether (flat start, size, ...) spans cover 0..count-1 once each, without gaps."""
    if pieces is None or (not pieces and count):
        return False
    end = 0
    for start, size, *_ in sorted(pieces):
        if start != end:
            return False
        end = start + size
    return end == count


# Records of boxes smaller than this are applied on the calling thread: a hop costs more.
PARALLEL_MIN_ELEMENTS = 1 << 16
# ... and none of a version's whose records average too few changes
# (parallel.records_large_enough).


def _decode_and_apply(rec: Record, info, bits: TensorBits, digests: DigestScheme, created: bool) -> None:
    if created and rec.kind == "tensor" and rec.encoding == DenseEncoding.name and rec.box.is_row_block(info.shape):
        _decode_in_place(rec, info, bits, digests)
        return
    apply_to_words(rec, decode_record(rec, info), bits.words, bits.shape, digests)


def _decode_in_place(rec: Record, info, bits: TensorBits, digests: DigestScheme) -> None:
    """A dense tensor record of a tensor this step created, decoded straight into its words
    (a dense version's every record): no array of values in new memory to copy from
    (tools/bench_read.py --mib 512 --rates 0.01 --repeats 7, its materialize, three runs each
    way alternating: 0.425-0.496 s and 0.66-0.83 s of CPU against 0.457-0.526 s and
    0.74-0.85 s). Its target digest is checked on the words written; on a mismatch the new
    tensor holds other words, and the step fails, as apply_step says."""
    where = decode_dense_tensor_into(rec, info, bits.words)
    if digests.at(where, bits.words[where]) != rec.target_digest:
        raise IntegrityError(f"{rec.tensor}: values to write differ from the record's target")


def _apply_group(group: list[tuple[Record, Any, TensorBits, bool]], digests: DigestScheme) -> None:
    for rec, info, bits, created in group:
        _decode_and_apply(rec, info, bits, digests, created)


class _ParallelApply:
    """Decodes and applies the records of one version on a few threads, as if in order.

    Records of one version never overlap, but a reader does not take that on trust: a record
    whose flat span may meet an earlier record's span in the same tensor waits until every
    earlier record is applied, so the result is always that of applying them in order.
    Consecutive records go to the pool together until they hold ``grain`` changes (a task
    each costs two thread hand-offs; see parallel.map_grouped). A bounded number of tasks is
    in flight; on the first error the rest are drained and the error is raised.
    """

    def __init__(self, digests: DigestScheme, grain: int = TASK_CHANGES, window: int = 2 * DEFAULT_WORKERS,
                 pooled: bool = True):
        self._digests = digests
        self._pooled = pooled  # else every record on the calling thread
        self._grain = grain
        self._window = window
        self._pending: deque[Future] = deque()
        self._group: list[tuple[Record, Any, TensorBits, bool]] = []
        self._group_changes = 0
        self._span_end: dict[str, int] = {}  # per tensor: end of the flat spans submitted

    def __enter__(self) -> _ParallelApply:
        return self

    def submit(self, rec: Record, info, bits: TensorBits, created: bool = False) -> None:
        """``created``: the tensor is new in this step (its words zeros until its records)."""
        start, end = flat_span(rec.box, info.shape)
        if start < self._span_end.get(rec.tensor, 0):
            self._drain()  # may overlap an earlier record: let everything before it land first
            self._span_end.clear()
        self._span_end[rec.tensor] = max(end, self._span_end.get(rec.tensor, 0))
        if not self._pooled or rec.box.size < PARALLEL_MIN_ELEMENTS:
            _decode_and_apply(rec, info, bits, self._digests, created)
            return
        self._group.append((rec, info, bits, created))
        self._group_changes += rec.n_changed
        if self._group_changes >= self._grain:
            self._flush()

    def _flush(self) -> None:
        if not self._group:
            return
        group, self._group, self._group_changes = self._group, [], 0
        self._pending.append(shared_pool(DEFAULT_WORKERS).submit(_apply_group, group, self._digests))
        while len(self._pending) > self._window:
            take_oldest(self._pending)  # an interrupted wait leaves it for __exit__

    def _drain(self) -> None:
        self._flush()
        while self._pending:
            take_oldest(self._pending)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._drain()
        finally:
            # On any error let the records in flight finish (nothing may write to the state
            # after apply_version returns); the first error is the one raised.
            wait(self._pending)
            self._pending.clear()


def state_equal(a: dict[str, TensorBits], b: dict[str, TensorBits]) -> bool:
    """Bit-exact equality of two states (same names, dtypes, shapes and words)."""
    return a.keys() == b.keys() and all(a[k].same_bits(b[k]) for k in a)


def as_numpy(state: dict[str, TensorBits]) -> dict[str, np.ndarray]:
    """Shaped word arrays (bf16 as uint16 and so on): the bits, in numpy."""
    return {name: bits.words.reshape(bits.shape) for name, bits in state.items()}


def apply_step(log: DeltaLog, state: dict[str, TensorBits], step: Step, check_all: bool = False,
               tensors: set[str] | None = None) -> None:
    """Advance ``state`` by one step: a version (from its parent's state), a squash (from
    its start's state) or a snapshot (from any state).

    Records are checked against their pre/postconditions; tensors created whole and, with
    ``check_all`` or after a squash or snapshot, every tensor are checked against the
    target's tensor digests. Large records are decoded and applied on a few threads, with
    the result of applying them in order. After an error ``state`` is partly advanced and
    must be discarded. With ``tensors``, only those tensors are built (the others' records
    are read and counted).
    """
    commit = step.target
    version = step.version
    what = step.describe()
    table = commit.tensor_map()
    wanted = table if tensors is None else {n: i for n, i in table.items() if n in tensors}
    if state_digest(list(commit.tensors)) != commit.state_digest:
        raise IntegrityError(f"version {version}: state digest does not match its tensor table")
    before = None if step.kind == "snapshot" else {n: (b.dtype, b.shape) for n, b in state.items()}
    rules = StepRules(step.kind, what, table, before, unknown=set(table) - set(wanted))
    for name in list(state):
        if name not in wanted or step.kind == "snapshot":
            del state[name]
    created = rules.created & set(wanted)
    for name in created:
        info = table[name]
        state[name] = TensorBits(info.dtype, info.shape, empty_words(info))
    # Per created tensor, the (flat start, size, target digest) of its row-block tensor
    # records, or None once a record is anything else: with sum digests, records that
    # cover the tensor exactly once compose to its digest (each one's target digest was
    # checked against the words it wrote), so no second pass hashes the tensor.
    spans: dict[str, list | None] = {n: [] for n in created} if log.digests.composable else {}
    stats = step.stats
    pooled = records_large_enough(stats.changed_elements, stats.records)
    records = log.records(step, hashing=shared_pool(DEFAULT_WORKERS) if pooled else None)
    with _ParallelApply(log.digests, task_grain(stats.changed_elements, DEFAULT_WORKERS), pooled=pooled) as applier:
        for rec in records:
            try:
                info = rules.record(rec)
                if rec.tensor in wanted:
                    applier.submit(rec, info, state[rec.tensor], rec.tensor in created)
                    pieces = spans.get(rec.tensor)
                    if pieces is not None:
                        if rec.kind == "tensor" and rec.box.is_row_block(info.shape):
                            pieces.append((rec.box.flat_start(info.shape), rec.box.size, rec.target_digest))
                        else:
                            spans[rec.tensor] = None
            except IntegrityError as exc:
                records.throw(exc)  # its segment's sha256 mismatch instead, where that is the cause
                raise
    rules.finish(step.stats)
    for name in (wanted if check_all or step.kind != "version" else created):
        covering = spans.get(name)
        if not check_all and covering is not None and _covers_exactly(covering, numel(table[name].shape)):
            d = sum(p[2] for p in covering) & MASK64
        else:
            d = log.digests.tensor(state[name].words, state[name].shape)
        if d != table[name].digest:
            raise IntegrityError(f"{what}: tensor {name!r} does not match its digest")


def replay(log: DeltaLog, upto: int | None = None, check_all: bool = False,
           progress: Progress | None = None,
           tensors: set[str] | None = None) -> Iterator[tuple[int, dict[str, TensorBits]]]:
    """Yield (version, state) for start..upto (start is 0, or the log start's snapshot after
    retention); the same state dict is advanced in place."""
    versions = log.versions()
    if not versions:
        raise NotFoundError(f"{log.store.url}: log has no versions")
    start, latest = versions[0], versions[-1]
    upto = latest if upto is None else upto
    if upto < start:
        raise log.expired(upto, f"version {upto}")
    if not upto <= latest:
        raise NotFoundError(f"{log.store.url}: no version {upto} (latest is {latest})")
    state: dict[str, TensorBits] = {}
    previous = None
    for v in range(start, upto + 1):
        commit = log.commit(v)
        if previous is not None and commit.parent_state_digest != previous.state_digest:
            raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
        if v == start and start > 0:
            snapshot = log.start_snapshot()
            assert snapshot is not None  # the log starts above 0: start_snapshot found it or raised
            log.apply_step(state, log.catchup_step(snapshot), tensors=tensors)
        else:
            log.apply_version(state, v, check_all=check_all, tensors=tensors)
        previous = commit
        if progress:
            progress(v)
        yield v, state


def materialize(log: DeltaLog, version: int | None = None, progress: Progress | None = None,
                tensors: set[str] | None = None) -> dict[str, TensorBits]:
    """The bit-exact state of ``version`` (default latest), every tensor digest checked;
    with ``tensors``, only those tensors. Read by the route of fewest bytes: from version 0
    or a snapshot, through versions and squashes (``plan``)."""
    while True:
        route = log.plan(version)
        target = route[-1].version
        state: dict[str, TensorBits] = {}
        held = None
        try:
            for step in route:
                if step.parent is not None and step.parent_state_digest != held:
                    raise IntegrityError(f"{step.describe()}: parent digest does not match version {step.parent}")
                log.apply_step(state, step, tensors=tensors)
                held = step.state_digest
                if progress:
                    progress(step.version)
        except IntegrityError as exc:
            # A damaged snapshot or squash: another route (the chain is always one).
            if not log.exclude(step, str(exc)):
                raise
            continue
        break
    last = route[-1]
    if last.kind != "version" or (len(route) == 1 and last.parent is None):
        # apply_step already checked every wanted tensor against the target's digests (all
        # of them are created by a first step, all are checked after a squash or snapshot):
        # a second pass would only hash the whole state again.
        return state
    commit = log.commit(target)
    for info in commit.tensors:
        if tensors is not None and info.name not in tensors:
            continue
        if log.digests.tensor(state[info.name].words, info.shape) != info.digest:
            raise IntegrityError(f"version {target}: tensor {info.name!r} does not match its digest")
    return state
