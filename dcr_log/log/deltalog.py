"""DeltaLog: a log on one store, the one object readers need. It owns opening a log, its
identity and features, its commit records (read, cached, written), retention's log start, the
segments and file objects a version names, and the caches those reads fill.

Route planning (``routes``), signatures (``signatures``), replay (``replay``) and whole-log
verification (``verify``) live in their own modules; the methods of the same names here
delegate to them, so a ``DeltaLog`` is still all a reader holds."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Collection, Generator, Iterator
from concurrent.futures import Executor, Future, wait

from dcr_log.codec.registry import required_feature
from dcr_log.digest import DigestScheme, scheme_for
from dcr_log.errors import CommitConflict, CommitStateUnknown, ExpiredError, IntegrityError, NotFoundError, UsageError
from dcr_log.format import (
    FILES,
    IDENTITY_KEY,
    CommitRecord,
    FileEntry,
    LogIdentity,
    Record,
    SegmentRef,
    iter_segment,
    limits,
    parse_version_key,
    version_key,
)
from dcr_log.format.commit import ULP_ENCODING
from dcr_log.format.keys import VERSIONS_PREFIX
from dcr_log.format.lifecycle import (
    LOG_START_PREFIX,
    MANIFEST,
    MAX_MARKER_BYTES,
    SNAPSHOTS_PREFIX,
    SQUASHES_PREFIX,
    CatchUp,
    Marker,
    parse_log_start_key,
    snapshot_prefix,
    squash_prefix,
)
from dcr_log.format.signature import SignatureRecord
from dcr_log.log import replay, routes, segments, signatures, verify
from dcr_log.log.replay import Progress
from dcr_log.log.routes import Step
from dcr_log.log.segments import SegmentFile
from dcr_log.log.verify import VerifyReport
from dcr_log.parallel import side_thread
from dcr_log.signing import as_trust
from dcr_log.state import TensorBits
from dcr_log.store import AlreadyExists, Store

__all__ = ["DeltaLog", "Progress", "Step", "VerifyReport"]


def nothing_to_check() -> None:
    """The check of segment records that were checked already (read_segment_records)."""


class DeltaLog:
    """A versioned log of delta segments on one store. Readers need nothing but this."""

    def __init__(self, store: Store, identity: LogIdentity, trust=None):
        self.store = store
        self.identity = identity
        # Under a trust policy (dcr_log.signing), a version is read only with a valid signature.
        self.trust = as_trust(trust)
        self._commit_sha: dict[int, str] = {}
        # The trusted key found per (version, trust policy fingerprint): signatures are immutable.
        self.signers: dict[tuple[int, tuple], str] = {}
        # The log's tensor and record digests: xxh3, or sums of element hashes (sum-digests).
        self.digests: DigestScheme = scheme_for(identity.features)
        self._commits: dict[int, CommitRecord] = {}
        # Snapshot and squash manifests checked so far: key -> (manifest, its sha256).
        self.manifests: dict[str, tuple[CatchUp, str]] = {}
        self._start: int | None = None  # the log start as of the last listing
        # Snapshots and squashes found damaged: routes avoid them (the chain is always there).
        self.excluded: dict[str, str] = {}
        # Segments fetched before their commit record existed (follow mode), by key.
        self._prefetched: dict[str, bytes] = {}
        self._prefetched_bytes = 0

    def close(self) -> None:
        """Drop what this reader caches (commit records, manifests, prefetched segments). A
        DeltaLog holds no file or connection of its own: it stays usable, reading anew."""
        self._commits.clear()
        self._commit_sha.clear()
        self.manifests.clear()
        self._prefetched.clear()
        self._prefetched_bytes = 0

    def __enter__(self) -> DeltaLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log_id(self) -> str:
        return self.identity.log_id

    @property
    def ulp_encoding(self) -> bool:
        """Whether records may use the ``ulp`` encoding (feature ``ulp-encoding``)."""
        return ULP_ENCODING in self.identity.features

    @property
    def has_files(self) -> bool:
        """Whether the log carries its versions' non-tensor files (feature ``files``)."""
        return FILES in self.identity.features

    @staticmethod
    def open(location: str | os.PathLike | Store, trust=None) -> DeltaLog:
        """Open a log. ``trust`` (a TrustPolicy, trust file or public keys): every version read
        needs a valid signature by one of its keys (TrustError otherwise)."""
        store = location if isinstance(location, Store) else Store.open(location)
        try:
            data = store.get(IDENTITY_KEY, max_size=limits.MAX_IDENTITY_BYTES)
        except NotFoundError:
            raise NotFoundError(f"{store.url} is not a dcr log (no {IDENTITY_KEY})") from None
        return DeltaLog(store, LogIdentity.from_bytes(bytes(data)), trust)

    # -- versions -------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Readable versions, start..latest (start is 0 unless retention expired versions, section
        25). A gap means a damaged log and raises IntegrityError."""
        found = sorted(
            v for v in (parse_version_key(o.key) for o in self.store.list(VERSIONS_PREFIX)) if v is not None
        )
        # Markers after the listing of versions: a marker is written only above committed versions.
        start = self.start()
        kept = [v for v in found if v >= start]
        if start > 0 and (not kept or kept[0] != start):
            raise IntegrityError(f"{self.store.url}: the log starts at version {start}, which is missing")
        if kept != list(range(start, start + len(kept))):
            raise IntegrityError(f"{self.store.url}: version records are not contiguous from {start}")
        return kept

    # -- retention (spec/FORMAT.md section 25) ------------------------------------------------

    def start(self) -> int:
        """The first readable version: the newest log-start marker's, else 0 (listed anew)."""
        keys = [(v, o.key) for o in self.store.list(LOG_START_PREFIX)
                if (v := parse_log_start_key(o.key)) is not None]
        start = 0
        if keys:
            start, key = max(keys)
            self.marker(key)  # checked: a damaged or foreign marker is refused
        self._start = start
        return start

    def known_start(self) -> int:
        """The log start as of the last listing (listed now if never)."""
        return self.start() if self._start is None else self._start

    def marker(self, key: str) -> Marker:
        try:
            data = self.store.get(key, max_size=MAX_MARKER_BYTES)
        except NotFoundError:
            raise NotFoundError(f"{self.store.url}: no marker {key}") from None
        marker = Marker.from_bytes(bytes(data), key)
        if marker.log_id != self.log_id:
            raise IntegrityError(f"{key} belongs to log {marker.log_id}")
        return marker

    def expired(self, version: int, what: str) -> ExpiredError:
        """The ExpiredError for ``what`` (``version``), naming the log start it now has."""
        start = self.known_start()
        return ExpiredError(f"{self.store.url}: {what} has expired: the log now starts at version "
                            f"{start} (its snapshot)", start)

    def latest_version(self) -> int:
        versions = self.versions()
        if not versions:
            raise NotFoundError(f"{self.store.url}: log has no versions (its creation was interrupted: "
                                "run dcr init again with the same options to finish it)")
        return versions[-1]

    def kept_commit(self, version: int) -> CommitRecord | None:
        """The commit record of ``version``, or None where retention expired it: below the log
        start as of the last listing, or deleted since (by a gc whose grace period ended while
        this reader waited). For checks a reader makes only while the record is kept."""
        if version < self.known_start():
            return None
        try:
            return self.commit(version)
        except ExpiredError:
            return None

    def commit(self, version: int) -> CommitRecord:
        """The verified commit record of ``version`` (cached: commit records are immutable)."""
        cached = self._commits.get(version)
        if cached is not None:
            if self.trust is not None:
                self.check_signed(version)
            return cached
        if version < 0:
            raise UsageError(f"no version {version}")
        if version < self.known_start():
            raise self.expired(version, f"version {version}")
        try:
            data = self.store.get(version_key(version), max_size=limits.MAX_COMMIT_BYTES)
        except NotFoundError:
            if version < self.start():
                raise self.expired(version, f"version {version}") from None
            raise NotFoundError(f"{self.store.url}: no version {version}") from None
        record = CommitRecord.from_bytes(bytes(data), expect_version=version)
        if record.log_id != self.log_id:
            raise IntegrityError(f"commit record {version} belongs to log {record.log_id}")
        if record.features != self.identity.features:
            raise IntegrityError(f"commit record {version}: features {list(record.features)} differ "
                                 f"from dcr.json's {list(self.identity.features)}")
        self._commit_sha[version] = hashlib.sha256(data).hexdigest()
        self._commits[version] = record
        if self.trust is not None:
            self.check_signed(version)
        return record

    def commit_sha256(self, version: int) -> str:
        """SHA-256 of the commit record's bytes (what a signature covers)."""
        sha = self._commit_sha.get(version)
        if sha is None:
            record = self._commits.get(version)
            if record is None:
                saved, self.trust = self.trust, None
                try:
                    self.commit(version)
                finally:
                    self.trust = saved
                return self._commit_sha[version]
            sha = self._commit_sha[version] = hashlib.sha256(record.to_bytes()).hexdigest()
        return sha

    def find_state_digest(self, digest: int, upto: int | None = None) -> int | None:
        """The newest version (at most ``upto``) whose state digest is ``digest``, or None."""
        for v in reversed(self.versions()):
            if (upto is None or v <= upto) and self.commit(v).state_digest == digest:
                return v
        return None

    def remember_commit(self, record: CommitRecord) -> None:
        """Cache a commit record this process read or wrote elsewhere (checked like a read)."""
        if record.log_id != self.log_id or record.features != self.identity.features:
            raise IntegrityError(f"commit record {record.version} does not belong to this log")
        self._commits.setdefault(record.version, record)

    def write_commit(self, record: CommitRecord) -> bytes:
        """Create the commit record with put-if-absent: exactly one writer wins a version.
        Returns the bytes written."""
        if record.log_id != self.log_id:
            raise UsageError("commit record of another log")
        key = version_key(record.version)
        data = record.to_bytes()
        try:
            self.store.put_new(key, data)
        except AlreadyExists:
            raise CommitConflict(f"version {record.version} already exists in {self.store.url}") from None
        except Exception as exc:
            # The request may have reached the store (a time-out, a lost reply): read back to
            # learn whether this writer's record is the one that exists.
            try:
                stored = bytes(self.store.get(key))
            except NotFoundError:
                raise exc from None
            except Exception:
                raise CommitStateUnknown(
                    f"version {record.version}: commit outcome unknown ({exc})") from exc
            if stored != data:
                raise CommitConflict(f"version {record.version} already exists in {self.store.url}") from None
        self._commits[record.version] = record
        return data

    # -- files (feature files, spec/FORMAT.md section 22) ------------------------------------

    def files(self, version: int) -> list[FileEntry]:
        """Every file of ``version``, sorted by name ([] in a log without the feature)."""
        return list(self.commit(version).files or ())

    def read_file(self, entry: FileEntry) -> bytes:
        """A file's bytes, checked against its entry: the object's size (from its metadata,
        before its bytes are read), then its SHA-256. IntegrityError otherwise, a missing
        object included (a committed version's files never go away)."""
        try:
            data = self.store.get(entry.key, size=entry.size)
        except NotFoundError:
            raise IntegrityError(f"file {entry.name!r}: object {entry.key} is missing") from None
        except IntegrityError as exc:
            raise IntegrityError(f"file {entry.name!r}: {exc}") from None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise IntegrityError(f"file {entry.name!r}: object {entry.key} fails its sha256")
        return bytes(data)

    def read_files(self, version: int) -> dict[str, bytes]:
        """name -> bytes of every file of ``version``, each checked (read_file)."""
        return {e.name: self.read_file(e) for e in self.files(version)}

    def write_files(self, files: list[tuple[FileEntry, bytes]], known: Collection[str] = frozenset()) -> None:
        """Create the objects of a version's files (create-if-absent), before its commit record.
        Objects are content-addressed and shared by versions: one that exists already is left
        as it is (after its size is checked; readers check its sha256), and ``known`` (the
        sha256s a committed version lists) are not uploaded at all. File objects are never
        deleted: a lost or failed commit leaves only orphans."""
        for entry, data in files:
            if entry.sha256 in known:
                continue
            try:
                self.store.put_new(entry.key, data)
            except AlreadyExists:
                info = self.store.head(entry.key)
                if info is not None and info.size != entry.size:
                    raise IntegrityError(f"file {entry.name!r}: the store holds {entry.key} with "
                                         f"{info.size} bytes, not {entry.size}: a damaged object") from None

    # -- segments -------------------------------------------------------------------------

    def has_version(self, version: int) -> bool:
        """Whether the commit record of ``version`` exists (one head request; it is read and
        checked by ``commit``)."""
        return self.store.head(version_key(version)) is not None

    def prefetch(self, version: int, budget: int = 1 << 30) -> int:
        """Fetch the segments already written under ``segments/<version>/`` (a version being
        committed), within ``budget`` bytes; ``read_segment`` uses them once a commit record lists
        them, after the same size and sha256 checks. Returns the bytes fetched now."""
        fetched = 0
        for o in self.store.list(f"segments/{version}/"):
            if (o.key in self._prefetched or self._prefetched_bytes + o.size > budget
                    or o.size > segments.SEGMENT_MEMORY_BYTES):  # read from a file when it is listed
                continue
            try:
                data = bytes(self.store.get(o.key, size=o.size))
            except (NotFoundError, IntegrityError):
                continue  # gone (an orphan removed) or still changing size: read it later
            self._prefetched[o.key] = data
            self._prefetched_bytes += len(data)
            fetched += len(data)
        return fetched

    def forget_prefetched(self, upto: int) -> None:
        """Drop prefetched segments of versions up to ``upto`` (applied, or orphans of them)."""
        for key in list(self._prefetched):
            v = key.split("/")[1]
            if v.isdigit() and int(v) <= upto:
                self._prefetched_bytes -= len(self._prefetched.pop(key))

    def read_segment(self, ref: SegmentRef, version: int | None = None) -> memoryview | SegmentFile:
        """Segment bytes, checked against the commit record's size (from the object's metadata,
        before its bytes are read) and sha256. A missing segment is damage (IntegrityError),
        unless retention removed it while it was being read (ExpiredError)."""
        early = self._prefetched.pop(ref.key, None)
        if early is not None:
            self._prefetched_bytes -= len(early)
            if len(early) == ref.size and hashlib.sha256(early).hexdigest() == ref.sha256:
                return memoryview(early)
        data: memoryview | SegmentFile
        try:
            if ref.size > segments.SEGMENT_MEMORY_BYTES:
                f, sha = self.store.get_file(ref.key, ref.size)
                data = SegmentFile(f, ref.size, sha)
            else:
                data = self.store.get(ref.key, size=ref.size)
                sha = hashlib.sha256(data).hexdigest()
        except NotFoundError:
            raise self._missing(ref, version) from None
        if sha != ref.sha256:
            if isinstance(data, SegmentFile):
                data.close()
            raise IntegrityError(f"segment {ref.key}: sha256 mismatch")
        return data

    def read_segment_records(self, ref: SegmentRef, version: int
                             ) -> tuple[memoryview | SegmentFile, list[Record], Callable[[], None]]:
        """read_segment, the segment's records (segment_records), and ``check``, which the
        caller calls before anything it took from them is written or reported. A segment read
        into memory is parsed while its sha256 is computed on the side thread, and the hash
        may still be running when this returns (the records can be decoded meanwhile):
        ``check`` waits for it and raises its mismatch first, then the parse's error, if any
        (the records are then empty). For the other segments it has nothing left to check.
        (The hash, then the parse, held the first record's decoding back: it began 3.6-3.8 ms
        into an apply of a 3.2 MiB segment of 89 records, now 2.1 ms, by timelines of
        tools/bench_apply.py --gib 0.5 --verify sample --phases.)"""
        fetched, checked = self._fetch_segment(ref, version)
        if checked:
            return fetched, list(self.segment_records(version, ref, fetched)), nothing_to_check
        check_hash = self._hash_beside(ref, fetched)
        parse_error: Exception | None = None
        try:
            records = list(self.segment_records(version, ref, fetched))
        except Exception as exc:  # raised by check, after the hash
            records, parse_error = [], exc

        def check() -> None:
            check_hash()
            if parse_error is not None:
                raise parse_error
        return fetched, records, check

    def _fetch_segment(self, ref: SegmentRef, version: int | None) -> tuple[memoryview | SegmentFile, bool]:
        """(the segment, checked): read_segment's result where it is prefetched or held in a
        file (hashed as it was read), checked; else its bytes read into memory, their size
        checked but not their sha256 (``_hash_beside``)."""
        if ref.key in self._prefetched or ref.size > segments.SEGMENT_MEMORY_BYTES:
            return self.read_segment(ref, version), True
        try:
            return self.store.get(ref.key, size=ref.size), False
        except NotFoundError:
            raise self._missing(ref, version) from None

    @staticmethod
    def _hash_beside(ref: SegmentRef, data, threads: Executor | None = None) -> Callable[[], None]:
        """Start the sha256 of a segment's bytes on ``threads`` (the side thread by default);
        the returned ``check`` waits for it and raises IntegrityError if it is not the commit
        record's."""
        hashing = (threads or side_thread()).submit(lambda: hashlib.sha256(data).hexdigest())

        def check() -> None:
            wait([hashing])
            if hashing.result() != ref.sha256:
                raise IntegrityError(f"segment {ref.key}: sha256 mismatch")
        return check

    def segment_records(self, version: int, ref: SegmentRef, data=None) -> Iterator[Record]:
        """The records of one segment; ``data``, if given, is its bytes or a SegmentFile, as
        read_segment (checked) or _fetch_segment (its hash then checked by the caller before it
        uses what it made of the records) returned them. The record count is checked against
        the commit record. The records of a SegmentFile lie in a memory map whose pages are
        given back as their payloads are decoded, and all of them once the last is read."""
        data = self.read_segment(ref, version) if data is None else data
        mapping = data.map() if isinstance(data, SegmentFile) else None
        count = 0
        features = self.identity.features
        try:
            for rec in iter_segment(data if mapping is None else mapping.mm, self.log_id, version):
                count += 1
                feature = required_feature(rec.encoding)
                if feature is not None and feature not in features:
                    raise IntegrityError(f"segment {ref.key}: a record uses the encoding {rec.encoding!r} in a "
                                         f"log without the feature {feature!r}")
                if mapping is not None:
                    rec = dataclasses.replace(rec, done=mapping.hook(rec.payload))
                yield rec
        finally:
            if mapping is not None:
                mapping.drop_all()
        if count != ref.records:
            raise IntegrityError(f"segment {ref.key}: {count} records, commit says {ref.records}")

    def records(self, version: int | Step, hashing: Executor | None = None) -> Generator[Record, None, None]:
        """The records of a version (or step), segment after segment. The next segment is
        read on the side thread while this one's records are taken, and a segment read into
        memory is hashed meanwhile on ``hashing`` (default: the side thread, after that read;
        a caller that decodes on the shared pool passes the pool, whose threads then share
        the hashes with the decoding instead of waiting for a third thread). Its sha256
        mismatch is raised after its last record at the latest, before any record of the next
        segment, so a caller must not report or keep what it made of a version's records
        until the generator has ended. One whose work on a record fails throws its error
        into the generator (``throw``): where the record's segment is damaged, its mismatch is
        raised in place of that error."""
        step = version if isinstance(version, Step) else self.version_step(version)
        refs = step.segments
        ahead: Future | None = None
        try:
            for i, ref in enumerate(refs):
                data, checked = (ahead.result() if ahead is not None
                                 else self._fetch_segment(ref, step.version))
                ahead = (side_thread().submit(self._fetch_segment, refs[i + 1], step.version)
                         if i + 1 < len(refs) else None)
                check = nothing_to_check if checked else self._hash_beside(ref, data, hashing)
                try:
                    yield from self.segment_records(step.version, ref, data)
                except Exception:
                    check()  # a damaged segment is the cause of what its records did
                    raise
                check()
        finally:
            if ahead is not None and not ahead.cancel():
                wait([ahead])  # nothing reads on after the caller stopped
                if ahead.exception() is None and isinstance(ahead.result()[0], SegmentFile):
                    ahead.result()[0].close()

    def _missing(self, ref: SegmentRef, version: int | None) -> IntegrityError:
        """What a segment not found means: ExpiredError (raised) if retention removed what
        ``ref`` belongs to while it was read, else damage, the IntegrityError returned."""
        if ref.key.startswith((SNAPSHOTS_PREFIX, SQUASHES_PREFIX)):
            manifest = ref.key.rsplit("/", 1)[0] + "/" + MANIFEST
            if self.store.head(manifest) is None:
                kind = "snapshot" if ref.key.startswith(SNAPSHOTS_PREFIX) else "squash"
                raise ExpiredError(f"{self.store.url}: {kind} {manifest.split('/')[1]} was removed by "
                                   "retention while it was read: plan the route again", self.start())
        elif version is not None and version < self.start():
            raise self.expired(version, f"version {version}") from None
        return IntegrityError(f"segment {ref.key} is missing")

    # -- signatures (spec/FORMAT.md section 21; dcr_log.log.signatures) -----------------------

    def check_signed(self, version: int, trust=None) -> str:
        """The id of a trusted key with a valid signature of ``version``, else TrustError."""
        return signatures.check_signed(self, version, trust)

    def write_signature(self, record: CommitRecord, key) -> SignatureRecord:
        """Sign a commit record's bytes and create the signature object (create-if-absent)."""
        return signatures.write_signature(self, record, key)

    def sign(self, version: int, key) -> SignatureRecord:
        """Sign an existing version (a new key of a rotation, or a log written unsigned)."""
        return signatures.sign(self, version, key)

    # -- snapshots, squashes and routes (sections 23, 24; dcr_log.log.routes) ---------------

    def catchup(self, key: str) -> tuple[CatchUp, str]:
        """A snapshot's or squash's manifest and its sha256, checked (routes.catchup)."""
        return routes.catchup(self, key)

    def snapshot(self, version: int) -> CatchUp:
        return self.catchup(snapshot_prefix(version) + MANIFEST)[0]

    def squash(self, start: int, end: int) -> CatchUp:
        return self.catchup(squash_prefix(start, end) + MANIFEST)[0]

    def snapshots(self, retired: bool = False) -> dict[int, CatchUp]:
        """The snapshots readers may start from, by version (routes.snapshots)."""
        return routes.snapshots(self, retired)

    def squashes(self) -> list[CatchUp]:
        """The squashes whose end is readable, by start then end (damaged ones left out)."""
        return routes.squashes(self)

    def exclude(self, step: Step, reason: str) -> bool:
        """Leave a catch-up step out of later routes (routes.exclude)."""
        return routes.exclude(self, step, reason)

    def start_snapshot(self) -> CatchUp | None:
        """The snapshot readers start from when the log starts above 0, checked against the
        newest log-start marker."""
        return routes.start_snapshot(self)

    def version_step(self, version: int) -> Step:
        return routes.version_step(self, version)

    def catchup_step(self, cu: CatchUp) -> Step:
        return routes.catchup_step(self, cu)

    def step(self, kind: str, version: int, parent: int | None = None) -> Step:
        """The step a journal names (kind, version, and a squash's start)."""
        return routes.named_step(self, kind, version, parent)

    def plan(self, target: int | None = None, holding: int | None = None,
             holding_digest: int | None = None) -> list[Step]:
        """The route to ``target`` (default latest) that reads the fewest bytes, from version
        ``holding`` (state digest ``holding_digest``) or from nothing (routes.plan)."""
        return routes.plan(self, target, holding, holding_digest)

    # -- replay (dcr_log.log.replay) ------------------------------------------------------

    def apply_version(self, state: dict[str, TensorBits], version: int, check_all: bool = False,
                      tensors: set[str] | None = None) -> None:
        """Advance ``state`` (the parent's state, mutated in place) to ``version``."""
        self.apply_step(state, self.version_step(version), check_all, tensors)

    def apply_step(self, state: dict[str, TensorBits], step: Step, check_all: bool = False,
                   tensors: set[str] | None = None) -> None:
        """Advance ``state`` by one step, every record checked (replay.apply_step)."""
        replay.apply_step(self, state, step, check_all, tensors)

    def replay(self, upto: int | None = None, check_all: bool = False,
               progress: Progress | None = None,
               tensors: set[str] | None = None) -> Iterator[tuple[int, dict[str, TensorBits]]]:
        """Yield (version, state) for start..upto; the same state dict is advanced in place."""
        return replay.replay(self, upto, check_all, progress, tensors)

    def materialize(self, version: int | None = None, progress: Progress | None = None,
                    tensors: set[str] | None = None) -> dict[str, TensorBits]:
        """The bit-exact state of ``version`` (default latest), every tensor digest checked;
        with ``tensors``, only those tensors (replay.materialize)."""
        return replay.materialize(self, version, progress, tensors)

    # -- verification (dcr_log.log.verify) ------------------------------------------------

    def verify(self, deep: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every commit record, segment, file object, snapshot and squash; ``deep``
        also replays every version (verify.verify)."""
        return verify.verify(self, deep, progress)
