"""Sharded trainers: every rank diffs and logs its own shards, in canonical coordinates, and
the ranks commit one version per step together (spec/FORMAT.md section 12, "Sharded writers").

A rank describes what it holds as ``{canonical_name: [Shard, ...]}``: each Shard is a box of a
canonical tensor (a tensor-parallel slice, one of the views of a fused local buffer, an
expert of a stacked MoE parameter), a contiguous range of its row-major order (an FSDP flat
shard), or the output of a converter (a canonical tensor the local layout cannot reach by a
box map). Nothing is gathered: each rank compares its shards with its own baseline of them,
writes the records of the changed boxes to segments of its own, and adds up its part of each
tensor digest (composable ``sum-digests``). One coordinator writes the commit record only after
every rank reported success, and only when the ranks holding the same box (replicas) hold the
same bits (write/replicas.py); every rank learns the outcome (write/outcomes.py).

The collectives go through a small ``Group`` interface: ``LocalGroup`` (one process, no torch)
or ``TorchGroup`` (any ``torch.distributed`` process group: gloo in the tests, nccl on GPUs;
object collectives, so the group's timeout turns a dead rank into an error, not a hang)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from dcr_log import buffers, pages
from dcr_log.collective import Group, as_group
from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.digest import MASK64, SUM_DIGESTS
from dcr_log.errors import (
    AppendAborted,
    CollectiveFailed,
    CommitConflict,
    CommitStateUnknown,
    DcrError,
    StoreError,
    UsageError,
)
from dcr_log.format import (
    FILES,
    CommitRecord,
    CommitStats,
    FileEntry,
    LogIdentity,
    segment_key,
)
from dcr_log.format.commit import RANS_ENCODING
from dcr_log.format.keys import check_writer_id
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.log.deltalog import DeltaLog
from dcr_log.parallel import map_grouped
from dcr_log.signing import as_signing_key
from dcr_log.store import Store
from dcr_log.write.baseline import Baseline, BaselineCache, Generation, PieceKey, load_baseline
from dcr_log.write.differ import Differ, EncodePolicy
from dcr_log.write.files import Files, new_file_set, write_version_files
from dcr_log.write.identity import create_identity, default_writer_id, utc_now
from dcr_log.write.layout import ShardLayout, _check_whole, _kept, _summary, check_layout_change, validate_layout
from dcr_log.write.outcomes import CommitOutcome, CreateOutcome, RankReport, describe
from dcr_log.write.pending import Pending
from dcr_log.write.pieces import Shard, ShardPiece, carried_shapes, resolve_pieces, shard_lists
from dcr_log.write.replicas import ReplicaHasher, replica_mismatch, replicated_keys
from dcr_log.write.uploader import SegmentSeries, SegmentUploader

# A segment file is closed and uploaded once it holds this many payload bytes.
DEFAULT_SEGMENT_BYTES = 64 << 20


# The features of a new log: the ulp-rans encoding and digests that update in O(changes).
DEFAULT_FEATURES = (RANS_ENCODING, SUM_DIGESTS)


# Chunks of the write pass go to the pool in tasks of at least this many elements
# (parallel.map_grouped): a model's norms and other small tensors, a task each, cost more in
# the hand-offs between threads than in their encoding.
WRITE_GRAIN = 1 << 18
# The write pass goes to the pool only where its C passes, which release the GIL, average
# at least what finding the changes in this many unchanged elements costs a piece. Each piece
# also costs the encoding thread about 100 us of Python (the encodings tried, the digests, the
# record); two threads running that at once take turns at the GIL and run slower than one, so
# a model of small pieces at a low rate is encoded on the calling thread. A changed element
# costs about CHANGE_ELEMENTS unchanged ones (tools/bench_encode.py --mib 512 --breakdown 0.10:
# finding 1.9 ns a change at 10%, 0.19 a word; the coder, copies and digests 7.9 a change).
PARALLEL_MIN_PIECE_ELEMENTS = 1 << 19
CHANGE_ELEMENTS = 40


class ShardedWriter:
    """Appends versions to one log from every rank of a process group (collectively).

    Each rank keeps a baseline of the pieces it owns: in memory, or memory-mapped from a local
    cache directory (``cache_dir``, default ``$DCR_CACHE_DIR`` or ``~/.cache/dcr-log``;
    ``False`` for none) so that ``open`` resumes without replaying the log.
    """

    def __init__(self, log: DeltaLog, group: Group, version: int, cache: BaselineCache | None,
                 writer_id: str | None = None, policy: EncodePolicy | None = None,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, signing_key: Any = None):
        self.log = log
        # Signs each commit record (the coordinator, before creating it): dcr_log.signing.
        self.signing_key = as_signing_key(signing_key) if group.rank == 0 else None
        self.group = group
        self.writer_id = check_writer_id(writer_id or default_writer_id())
        self.segment_bytes = segment_bytes
        self._differ = Differ(policy, log.digests, features=log.identity.features)
        self._version = version
        self._cache = cache
        self._baseline: Baseline | None = None
        self._words_trusted = True  # this append's baseline words as this process left them
        self._closed = False

    def close(self) -> None:
        """Let go of the baseline (its memory and its cache file's mapping). The log and the
        cache stay as they are: ``open`` resumes from them. Appending after close is refused."""
        self._baseline = None
        self._closed = True

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> int:
        """The last version this writer committed or started from."""
        return self._version

    @property
    def rank(self) -> int:
        return self.group.rank

    # -- create / open ----------------------------------------------------------------------

    @staticmethod
    def create(location: str | os.PathLike | Store, shards: Mapping[str, Sequence[Shard]],
               shapes: Mapping[str, Sequence[int]] | None = None, group: Any = None, *, cache_dir: Any = None,
               features: Sequence[str] = DEFAULT_FEATURES, writer_id: str | None = None,
               policy: EncodePolicy | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
               progress: Callable[[int], None] | None = None, signing_key: Any = None,
               files: Files | None = None, check_replicas: bool = True) -> ShardedWriter:
        """Create a new log whose version 0 is the ranks' shards (collective; ``shapes`` and
        ``check_replicas`` as in ``append``). With
        ``signing_key`` (a dcr_log.signing.SigningKey, an ed25519 private key or a key file)
        every version is signed (spec/FORMAT.md, section 21). ``files`` (rank 0's; see
        ``append``) are version 0's non-tensor files: given, they turn the feature ``files``
        on (as does ``files`` in ``features``), fixed for the log's life."""
        g = as_group(group)
        if files is not None:
            features = tuple(features) + (FILES,)
        features = tuple(sorted(set(features)))
        store = location if isinstance(location, Store) else Store.open(location, create=True)
        # What is not a Shard (a DTensor given as one) is refused on every rank before dcr.json.
        try:
            shard_lists(shards)
            problem = ""
        except UsageError as exc:
            problem = str(exc)
        for r, said in enumerate(g.all_gather(problem)):
            if said:
                raise UsageError(f"rank {r}: {said}")
        outcome: CreateOutcome | None = None
        if g.rank == 0:
            outcome, files = create_identity(store, features, files)
        created: CreateOutcome = g.broadcast(outcome)
        if not created.ok or created.identity is None:
            raise created.exception()
        identity = LogIdentity.from_bytes(created.identity)
        log = DeltaLog(store, identity)
        writer = ShardedWriter(log, g, -1, BaselineCache.resolve(cache_dir, store, identity.log_id),
                               writer_id, policy, segment_bytes, signing_key)
        writer._baseline = Baseline.empty(-1)
        writer.append(shards, shapes, progress=progress, files=files, check_replicas=check_replicas)
        return writer

    @staticmethod
    def open(location: str | os.PathLike | Store | DeltaLog, group: Any = None, *, cache_dir: Any = None,
             writer_id: str | None = None, policy: EncodePolicy | None = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES, signing_key: Any = None,
             check_cache: bool = False) -> ShardedWriter:
        """Resume writing a log (collective). The baseline is loaded at the first append, when
        the shards are known: from the local cache, checked against the commit's digests, or
        else rebuilt from the log. Cached words that the last append of this boot sealed are
        taken without hashing them, unless ``check_cache`` (dcr_log.write.baseline)."""
        g = as_group(group)
        log = location if isinstance(location, DeltaLog) else DeltaLog.open(location)
        # Agree on the version to build on: the coordinator's view of the latest.
        latest = g.broadcast(_try(log.latest_version) if g.rank == 0 else None)
        if isinstance(latest, Exception):
            raise latest
        return ShardedWriter(log, g, latest, BaselineCache.resolve(cache_dir, log.store, log.log_id, check_cache),
                             writer_id, policy, segment_bytes, signing_key)

    # -- append -----------------------------------------------------------------------------

    def append(self, shards: Mapping[str, Sequence[Shard]], shapes: Mapping[str, Sequence[int]] | None = None,
               kind: str = "xor", progress: Callable[[int], None] | None = None,
               files: Files | None = None, *, allow_layout_change: bool = False,
               check_replicas: bool = True) -> CommitRecord:
        """Commit this step as the next version (collective; every rank gets the same commit
        record). ``shapes`` gives the canonical shapes of new or reshaped tensors (and of
        tensors held by flat shards; a DTensor's Shard carries its own); ``kind`` is ``xor`` or
        ``overwrite`` for the box shards.

        ``files`` (feature ``files``): the version's non-tensor files, the whole set, as a
        mapping of file names to bytes or paths; None keeps the parent version's files. The
        coordinator (rank 0) writes the commit record, so only rank 0's ``files`` is used; the
        other ranks' argument is ignored. Files in a log without the feature: UsageError.

        A version whose tensor table differs from the parent's (a tensor added, removed,
        renamed, reshaped or retyped) is refused with UsageError on every rank, before anything
        is written, unless every rank passes ``allow_layout_change=True``.

        Ranks holding the same box (replicas) compare digests of it; when they differ the
        version is refused with ReplicaMismatch on every rank, naming the tensor and the ranks,
        unless every rank passes ``check_replicas=False`` (the lowest rank's copy is logged).

        A rank's exception, a conflict or a dead rank aborts the step on every rank: nothing is
        committed and the baselines stay as they were.
        """
        # Only one append at a time uses this rank's baseline files on this machine (it writes
        # changed words into them as it encodes, before the version is committed): an append
        # that finds another writer's append holding them does not read them, and rebuilds
        # its baseline from the log instead.
        hold = None if self._cache is None else self._cache.hold(self.group.rank)
        if self._cache is not None and hold is None and self._baseline is not None \
                and self._baseline.slot is not None:
            self._baseline = None  # mapped from those files
        try:
            return self._append(shards, shapes, kind, progress, files, allow_layout_change, check_replicas,
                                None if hold is None else self._cache)
        finally:
            if hold is not None:
                hold.close()

    def _append(self, shards: Mapping[str, Sequence[Shard]], shapes: Mapping[str, Sequence[int]] | None,
                kind: str, progress: Callable[[int], None] | None, files: Files | None,
                allow_layout_change: bool, check_replicas: bool, cache: BaselineCache | None) -> CommitRecord:
        """append's work; ``cache``: the rank's cache, which this append holds (None: not used)."""
        if self._closed:
            raise UsageError("this writer is closed: open the log again to append")
        if kind not in ("xor", "overwrite"):
            raise UsageError(f"append kind must be xor or overwrite, not {kind!r}")
        g = self.group
        version = self._version + 1
        previous = {} if version == 0 else self.log.commit(self._version).tensor_map()
        prev_layout = {n: (t.dtype, t.shape) for n, t in previous.items()}
        canonical: dict[str, tuple[int, ...]] = {} if shapes is None else {
            n: tuple(int(d) for d in s) for n, s in shapes.items()}

        # Phase 0: the layout, validated identically on every rank before anything is written.
        # A bad description (UsageError) fails everywhere as such; any other exception (a
        # converter that raised) is that rank's failure, and aborts the others.
        local_error: BaseException | None = None
        file_set = None
        try:
            file_set = new_file_set(self.log, files) if self.group.rank == 0 else None
            shard_map = shard_lists(shards)
            canonical = carried_shapes(shard_map, canonical)
            known = {**{n: s for n, (_, s) in prev_layout.items()}, **canonical}
            pieces = resolve_pieces(shard_map, known)
            for p in pieces:
                if p.kind == "xor":
                    p.kind = kind
            summary = _summary(pieces, canonical, list(shard_map))
            summary["allow_layout_change"] = bool(allow_layout_change)
            summary["check_replicas"] = bool(check_replicas)
        except UsageError as exc:
            pieces, summary = [], {"error": str(exc)}
        except Exception as exc:
            local_error, pieces = exc, []
            summary = {"failure": describe(exc)}
        try:
            summaries = g.all_gather(summary)
        except CollectiveFailed as exc:
            raise AppendAborted(f"version {version} not committed: {exc}") from exc
        failed = [(r, s["failure"]) for r, s in enumerate(summaries) if s.get("failure")]
        if failed:
            if local_error is not None:
                raise local_error
            raise AppendAborted(f"version {version} not committed: rank {failed[0][0]} failed: {failed[0][1]}")
        layout = validate_layout(summaries, prev_layout)  # UsageError everywhere
        # The agreed table against the parent's, on every rank alike, before any baseline load.
        check_layout_change(version, layout.tensors, prev_layout,
                            [bool(s.get("allow_layout_change")) for s in summaries])
        if not self.log.digests.composable:
            _check_whole(layout)
        owned = layout.owned(g.rank)  # replicas of lower ranks' boxes are not written here
        mine = [p for p in pieces if p.key in owned]
        mine.sort(key=lambda p: (p.name.encode(), p.box.offset))
        replicated = replicated_keys(summaries)
        copies = [p for p in pieces if p.key in replicated and p.key not in owned]  # hashed, not written
        try:
            self._ensure_baseline(layout, previous, mine, cache)
            baseline_error = None
        except CollectiveFailed as exc:
            raise AppendAborted(f"version {version} not committed: {exc}") from exc
        except Exception as exc:  # reported like an encoding failure: the others must not wait
            baseline_error = exc

        # Phase 1: every rank diffs its pieces and writes its segments.
        if baseline_error is None:
            report, pending, error = self._write_rank(version, layout, previous, mine, progress,
                                                      replicated, copies, cache)
        else:
            report, pending, error = (RankReport(ok=False, error=describe(baseline_error)),
                                      Pending(True, set(), None), baseline_error)
        committed = False
        try:
            # The coordinator's files: their objects are created after the segments and before
            # the commit record (content-addressed: a failed commit leaves only orphans).
            file_entries = None
            if g.rank == 0 and self.log.has_files and report.ok:
                try:
                    file_entries = write_version_files(self.log, version, file_set)
                except Exception as exc:
                    error = error or exc
                    report = RankReport(ok=False, error=describe(exc))
            local_error = local_error or error

            # Phase 2: the coordinator commits only if every rank succeeded.
            built: CommitRecord | None = None  # the coordinator's record, as it wrote it
            try:
                reports = g.gather(report)
                decided = None
                if reports is not None:
                    decided, built = self._decide(version, layout, previous, reports, file_entries)
                outcome: CommitOutcome = g.broadcast(decided)
            except CollectiveFailed as exc:
                # Another rank may have died after reporting: the commit may exist. Keep our
                # segments (a commit record may list them) and let the caller reopen.
                raise AppendAborted(f"version {version} not committed by this group ({exc}); "
                                    "reopen the writer to learn the log's state") from exc
            if not outcome.ok or outcome.commit is None:
                if outcome.failure != "unknown":
                    for key in pending.segment_keys:
                        try:
                            self.log.store.delete(key)  # referenced by no commit record
                        except StoreError:
                            break  # an orphan is harmless (section 12); the cause is raised below
                if local_error is not None:
                    raise local_error
                raise outcome.exception()
            # The other ranks parse the bytes; the coordinator keeps the record it serialized
            # (its log holds that one already) rather than serializing it again and parsing its
            # own bytes (the parse alone 10 ms an append of 2000 tensors: tools/bench_tensors.py
            # --tensors 2000 --repeats 5, its commit parse).
            commit = built if built is not None else CommitRecord.from_bytes(outcome.commit, expect_version=version)
            self.log.remember_commit(commit)
            committed = True
            self._baseline = self._ready_baseline().advance(version, commit, pending, mine)
        except BaseException:
            if committed:
                # In the log, but the baseline may be between versions: loaded again (and
                # checked against the log) at the next append.
                self._baseline = None
                self._version = version
            else:
                self._abandon(pending)
            raise
        self._version = version
        return commit

    def _ready_baseline(self) -> Baseline:
        """The baseline, loaded by _ensure_baseline before any rank writes."""
        if self._baseline is None:
            raise AssertionError("the baseline is loaded before a version is written")
        return self._baseline

    def _ensure_baseline(self, layout: ShardLayout, previous: Mapping[str, TensorInfo], mine: list[ShardPiece],
                         cache: BaselineCache | None) -> None:
        """Make sure this rank's baseline holds every owned piece of a tensor that keeps its
        dtype and shape, at the current version (collective when it has to load)."""
        version = self._version
        needed = [p for p in mine if _kept(p.name, layout, previous)]
        base = self._baseline
        self._words_trusted = base is None or base.untouched()
        if not self._words_trusted and not self._next_version_exists(version + 1):
            # Another process wrote the cache files these words are mapped from since this one
            # last left them (its append, or one killed half-way, which leaves them torn):
            # loaded again, checked against the log. (Where the next version is there already,
            # this append can only conflict: nothing is loaded for it.)
            self._baseline = base = None
            self._words_trusted = True
        ready = base is not None and base.version == version and all(base.has(p.key) for p in needed)
        # Every rank must take the same branch: agree on whether anyone needs to load.
        if all(self.group.all_gather(ready)):
            return
        self._baseline = load_baseline(self.log, version, needed, cache, self.group, layout,
                                       current=base if base is not None and base.version == version else None)

    def _next_version_exists(self, version: int) -> bool:
        try:
            return self.log.has_version(version)
        except DcrError:  # (unknown: loaded again, and the commit finds any conflict)
            return False

    def _write_rank(self, version: int, layout: ShardLayout, previous: Mapping[str, TensorInfo],
                    mine: list[ShardPiece], progress: Callable[[int], None] | None,
                    replicated: set[PieceKey], copies: list[ShardPiece], cache: BaselineCache | None,
                    ) -> tuple[RankReport, Pending, Exception | None]:
        """Diff this rank's pieces, write its segments; never raises (the error is reported)."""
        kept = {p.key for p in mine if _kept(p.name, layout, previous)}
        base = self._ready_baseline()
        generation = None
        if cache is not None and (base.slot is None or not set(base.arrays) == {p.key for p in mine} == kept):
            generation = Generation(cache, self.group.rank, version, {p.key: p.dtype for p in mine})
        # The baseline's own pieces, unchanged in layout: each chunk's changed words go into
        # them as soon as it is encoded, on the thread that just read those lines (a pass of
        # its own after the commit took 15.9 ms of a 116 ms append at 10% changed of 512 MiB:
        # tools/bench_encode.py --mib 512 --rates 0.10 --phases 0.10 --repeats 6 --no-create),
        # and come out again if the version is not committed (Pending.abort). A writer killed
        # meanwhile finds its cache between versions at the next open, and loads the baseline
        # again.
        early = base.arrays if generation is None and set(base.arrays) == {p.key for p in mine} == kept else None
        pending = Pending(self.log.digests.composable, kept, generation, early)
        error = None
        changed = records = 0
        contrib: dict[str, int] = {}
        whole_digests: dict[str, int] = {}
        replicas = ReplicaHasher(p.key for p in mine + copies if p.key in replicated)
        writer_id = self.writer_id if self.group.size == 1 else f"{self.writer_id}-r{self.group.rank}"[-64:]
        digests = self.log.digests
        policy = self._differ.policy
        uploads = SegmentUploader(self.log.store)
        segments = SegmentSeries(uploads, self.log.log_id, version,
                                 lambda: segment_key(version, writer_id, uuid.uuid4().hex), self.segment_bytes)

        remapping = pages.RemapAhead([])
        try:
            remap: set[PieceKey] = set()
            if early is not None:  # (in the try: a failure here is reported too)
                base.unseal()  # before any word of the cache is written
                if self._version >= 0:
                    stats = self.log.commit(self._version).stats
                    remap = base.pieces_to_remap(stats.changed_elements / max(stats.total_elements, 1))
            # Every chunk of every piece in one ordered stream, so the encoding threads never
            # wait at a tensor boundary.
            infos = [(p, _kept(p.name, layout, previous), layout.tensors[p.name][1]) for p in mine]
            bases = [base.words(p.key) if kept else None for p, kept, _ in infos]
            # The pieces mapped for writing on the side thread, in the order the tasks take
            # them, while the encoding threads work on those before: mapped all on this thread
            # first, they held every task back (after a sync, the first task of an append of
            # 512 MiB in 219 tensors began 40-65 ms into it, now 11-15 ms: tools/bench_encode.py
            # --mib 512 --rates 0.01 --repeats 5 --no-create --layout transformer --layers 24
            # --sync --phases 0.01). A task waits for its piece before it reads a word of it.
            remapping = pages.RemapAhead([(i, words) for i, ((p, _, _), words) in enumerate(zip(infos, bases))
                                          if words is not None and p.key in remap])
            tasks = [(i, chunk) for i, (p, _, _) in enumerate(infos) for chunk in p.chunks(policy.chunk_elements)]
            if generation is None:
                # The baseline's words of new pieces, filled by the encoding threads (their
                # page faults in parallel, not on this thread after each chunk).
                for p, is_kept, _ in infos:
                    if not is_kept:
                        pending.fresh[p.key] = buffers.zeros(p.box.size, word_dtype(p.dtype))

            def one(task):
                i, (r0, r1) = task
                piece, kept, shape = infos[i]
                row, base = piece.row, bases[i]
                new = piece.words(r0, r1)
                old = None if base is None else base[r0 * row:r1 * row]
                remapping.wait(i)
                delta = self._differ.diff_box(piece.name, piece.sub_box(r0, r1), shape, old, new, piece.kind,
                                              advance=early is not None and kept)
                if delta is not None and delta.advanced:
                    pending.advanced(piece, r0 * row, delta)
                if generation is not None and not kept:
                    generation.write(piece.key, r0 * row, new)  # on the worker: overlaps encoding
                elif not kept:
                    pending.fresh[piece.key][r0 * row:r0 * row + new.size] = new
                return task, new, delta

            wholes = {} if digests.composable else {i: xxhash.xxh3_64() for i in range(len(infos))}
            parallel = _parallel_pays(mine, kept, self._last_rate())
            # A chunk's result holds at most its elements' worth (positions, words, payload):
            # in flight, what workers + 1 whole chunks hold, however small the chunks (a
            # model's norms and small matrices keep every thread busy between its large ones).
            weights = [(r1 - r0) * infos[i][0].row for i, (r0, r1) in tasks]
            budget = (policy.workers + 1) * policy.chunk_elements
            grouped = map_grouped(one, tasks, weights, WRITE_GRAIN, policy.workers, parallel, budget)
            for (i, (r0, r1)), new, delta in grouped:
                piece = infos[i][0]
                if wholes:
                    wholes[i].update(np.ascontiguousarray(new).data.cast("B"))
                if replicas.wants(piece.key):
                    replicas.update(piece.key, new)
                if progress:
                    progress((r1 - r0) * piece.row * DTYPE_WIDTH[piece.dtype])
                if delta is None:
                    continue
                pending.add(piece, r0 * piece.row, delta)
                segments.add(delta.record)
                changed += delta.record.n_changed
                records += 1
            remapping.close()
            for i, whole in wholes.items():
                whole_digests[infos[i][0].name] = whole.intdigest()
            for (name, _, _), d in pending.contrib.items():  # the pieces' digest changes, per tensor
                contrib[name] = (contrib.get(name, 0) + d) & MASK64
            segments.flush()
            replicas.hash_pieces(copies, policy.chunk_elements)
            uploads.finish()
            report = RankReport(ok=True, segments=list(uploads.refs), contrib=contrib, whole=whole_digests,
                                replicas=replicas.digests(), changed=changed, records=records)
        except Exception as exc:  # reported to the coordinator, re-raised on this rank after
            remapping.close()  # (before the early writes are undone and the cache sealed again)
            uploads.finish(raise_errors=False)
            error = exc
            report = RankReport(ok=False, error=describe(exc))
        except BaseException:  # an interrupt: the baseline as it was
            remapping.close()
            uploads.abort()  # (a segment being written is not created; its thread ends)
            self._abandon(pending)
            raise
        pending.segment_keys = uploads.keys
        return report, pending, error

    def _last_rate(self) -> float:
        """The fraction of elements the last version changed (1 before the first: a create
        writes every element)."""
        if self._version < 0:
            return 1.0
        stats = self.log.commit(self._version).stats
        return stats.changed_elements / max(stats.total_elements, 1)

    def _abandon(self, pending: Pending) -> None:
        """A version not committed: its early writes undone, and the cache sealed again where
        its words were trusted before them (they are those words again); where the undo fails
        (an interrupt while undoing), the baseline is dropped, to be loaded again at the next
        append."""
        try:
            pending.abort()
        except BaseException:
            self._baseline = None
            raise
        if pending.early is not None and self._words_trusted and self._baseline is not None:
            self._baseline.seal()

    def _decide(self, version: int, layout: ShardLayout, previous: Mapping[str, TensorInfo],
                reports: list[RankReport], files: tuple[FileEntry, ...] | None = None
                ) -> tuple[CommitOutcome, CommitRecord | None]:
        """The coordinator: write the commit record if every rank succeeded; the outcome, and
        the record it wrote (None if it wrote none)."""
        failed = [(r, rep) for r, rep in enumerate(reports) if not rep.ok]
        if failed:
            r, rep = failed[0]
            return CommitOutcome(failure="failed",
                                 error=f"version {version} not committed: rank {r} failed: {rep.error}"), None
        mismatch = replica_mismatch(version, reports)
        if mismatch is not None:
            return CommitOutcome(failure="replica", error=mismatch), None
        digests = self.log.digests
        table = []
        for name, (dtype, shape) in layout.tensors.items():
            kept = _kept(name, layout, previous)
            if digests.composable:
                d = previous[name].digest if kept else digests.empty()
                for rep in reports:
                    d = (d + rep.contrib.get(name, 0)) & MASK64
            else:
                owners = [rep.whole[name] for rep in reports if name in rep.whole]
                d = owners[0] if owners else digests.empty()
            table.append(TensorInfo(name, dtype, shape, d))
        parent = version - 1 if version > 0 else None
        commit = CommitRecord(
            log_id=self.log.log_id, version=version, parent=parent,
            parent_state_digest=None if parent is None else self.log.commit(parent).state_digest,
            state_digest=state_digest(table),
            segments=tuple(ref for rep in reports for ref in rep.segments),
            tensors=tuple(table),
            stats=CommitStats(sum(rep.changed for rep in reports), sum(numel(s) for _, s in layout.tensors.values()),
                              sum(rep.records for rep in reports)),
            created_at=utc_now(), writer_id=self.writer_id, features=self.log.identity.features,
            files=(files or ()) if self.log.has_files else None,
        )
        try:
            if self.signing_key is not None:
                # Before the commit record, under a key naming the record's SHA-256: a lost
                # race or a crash leaves an orphan signature that matches no record.
                self.log.write_signature(commit, self.signing_key)
            data = self.log.write_commit(commit)
        except CommitConflict as exc:
            return CommitOutcome(failure="conflict", error=str(exc)), None
        except CommitStateUnknown as exc:
            return CommitOutcome(failure="unknown", error=str(exc)), None
        except StoreError as exc:
            # The record was read back and is not there: not committed, for a known reason.
            return CommitOutcome(failure="store", error=f"version {version} not committed: {exc}"), None
        except Exception as exc:
            return CommitOutcome(failure="unknown",
                                 error=f"version {version}: commit failed ({type(exc).__name__}: {exc})"), None
        return CommitOutcome(commit=data), commit


def _parallel_pays(mine: list[ShardPiece], kept: set[PieceKey], rate: float) -> bool:
    """Whether a write pass over ``mine`` goes to the pool (PARALLEL_MIN_PIECE_ELEMENTS): kept
    pieces expected to change at ``rate`` (the last version's), new ones whole."""
    total = sum(p.box.size for p in mine)
    work = sum(p.box.size * (1 + CHANGE_ELEMENTS * (rate if p.key in kept else 1.0)) for p in mine)
    return total >= (1 << 20) and work >= PARALLEL_MIN_PIECE_ELEMENTS * len(mine)


def _try(fn):
    try:
        return fn()
    except DcrError as exc:
        return exc
