"""DeltaLog: open a log, read and verify its versions, replay (materialize) any of them."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dcr_log.codec.registry import required_feature
from dcr_log.coords import numel
from dcr_log.digest import MASK64, DigestScheme, scheme_for
from dcr_log.errors import CommitConflict, CommitStateUnknown, ExpiredError, IntegrityError, NotFoundError, UsageError
from dcr_log.format import (
    FILES,
    IDENTITY_KEY,
    CommitRecord,
    CommitStats,
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
    MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES,
    SNAPSHOTS_PREFIX,
    SQUASHES_PREFIX,
    CatchUp,
    Marker,
    log_start_key,
    parse_log_start_key,
    parse_snapshot_key,
    parse_squash_key,
    snapshot_prefix,
    squash_prefix,
)
from dcr_log.format.signature import (
    MAX_SIGNATURE_BYTES,
    MAX_SIGNATURES,
    SignatureRecord,
    parse_signature_key,
    signature_prefix,
)
from dcr_log.format.tensors import state_digest
from dcr_log.log import segments
from dcr_log.log.records import empty_words
from dcr_log.log.replay import _covers_exactly, _ParallelApply
from dcr_log.log.segments import SegmentFile
from dcr_log.log.steps import StepRules
from dcr_log.signing import as_signing_key, as_trust
from dcr_log.state import TensorBits
from dcr_log.store import AlreadyExists, Store


class _Skipped:
    """A signature object not fetched: an untrusted key, or one signing other bytes."""

    def __init__(self, trusted_key: bool):
        self.trusted_key = trusted_key

    def as_error(self) -> Exception:
        return IntegrityError("signs another record" if self.trusted_key else "key not trusted")


Progress = Callable[[int], None]


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


@dataclass(frozen=True)
class VerifyReport:
    versions: int
    segments: int
    bytes_checked: int
    deep: bool
    files: int = 0  # distinct file objects checked (feature files)
    start: int = 0  # the first version (retention, section 25)
    catchups: int = 0  # snapshots and squashes checked


class DeltaLog:
    """A versioned log of delta segments on one store. Readers need nothing but this."""

    def __init__(self, store: Store, identity: LogIdentity, trust=None):
        self.store = store
        self.identity = identity
        # Under a trust policy (dcr_log.signing), a version is read only with a valid signature.
        self.trust = as_trust(trust)
        self._commit_sha: dict[int, str] = {}
        self._trusted: dict[tuple[int, tuple], str] = {}
        # The log's tensor and record digests: xxh3, or sums of element hashes (sum-digests).
        self.digests: DigestScheme = scheme_for(identity.features)
        self._commits: dict[int, CommitRecord] = {}
        self._catchups: dict[str, tuple[CatchUp, str]] = {}  # manifest key -> (manifest, sha256)
        self._start: int | None = None  # the log start as of the last listing
        # Snapshots and squashes found damaged: routes avoid them (the chain is always there).
        self.excluded: dict[str, str] = {}
        # Segments fetched before their commit record existed (follow mode), by key.
        self._prefetched: dict[str, bytes] = {}
        self._prefetched_bytes = 0

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
        return DeltaLog(store, LogIdentity.from_bytes(data), trust)

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

    def _expired(self, version: int, what: str) -> ExpiredError:
        start = self.known_start()
        return ExpiredError(f"{self.store.url}: {what} has expired: the log now starts at version "
                            f"{start} (its snapshot)", start)

    def latest_version(self) -> int:
        versions = self.versions()
        if not versions:
            raise NotFoundError(f"{self.store.url}: log has no versions (its creation was interrupted: "
                                "run dcr init again with the same options to finish it)")
        return versions[-1]

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
            raise self._expired(version, f"version {version}")
        try:
            data = self.store.get(version_key(version), max_size=limits.MAX_COMMIT_BYTES)
        except NotFoundError:
            if version < self.start():
                raise self._expired(version, f"version {version}") from None
            raise NotFoundError(f"{self.store.url}: no version {version}") from None
        record = CommitRecord.from_bytes(data, expect_version=version)
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

    # -- signatures (spec/FORMAT.md, section 21) -------------------------------------------

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

    def check_signed(self, version: int, trust=None) -> str:
        """The id of a trusted key with a valid signature of ``version``, else TrustError."""
        policy = as_trust(trust) if trust is not None else self.trust
        if policy is None:
            raise UsageError("no trust policy to check signatures against")
        known = self._trusted.get((version, policy.fingerprint))
        if known is not None:
            return known
        sha = self.commit_sha256(version)
        found = []
        objects = [o.key for o in self.store.list(signature_prefix(version))]
        for key in sorted(objects):
            parsed = parse_signature_key(key)
            if parsed is None or parsed[0] != version:
                continue
            if parsed[1] not in policy.keys or parsed[2] != sha:
                # Not worth fetching; say why in the refusal.
                found.append((key, _Skipped(parsed[1] in policy.keys)))
                continue
            if len(found) >= MAX_SIGNATURES:
                break
            try:
                found.append((key, SignatureRecord.from_bytes(
                    bytes(self.store.get(key, max_size=MAX_SIGNATURE_BYTES)), key)))
            except (IntegrityError, NotFoundError) as exc:
                found.append((key, exc))
        kid = policy.check(self.log_id, version, sha, [(k, r) for k, r in found if not isinstance(r, _Skipped)]
                           + [(k, r.as_error()) for k, r in found if isinstance(r, _Skipped)])
        self._trusted[(version, policy.fingerprint)] = kid
        return kid

    def write_signature(self, record: CommitRecord, key) -> SignatureRecord:
        """Sign a commit record's bytes and create the signature object (create-if-absent; a
        second signature by the same key of the same bytes is the same object)."""
        key = as_signing_key(key)
        sig = key.sign(self.log_id, record.version, hashlib.sha256(record.to_bytes()).hexdigest())
        try:
            self.store.put_new(sig.key, sig.to_bytes())
        except AlreadyExists:
            pass  # ed25519 is deterministic: the same key signed the same record before
        return sig

    def sign(self, version: int, key) -> SignatureRecord:
        """Sign an existing version (a new key of a rotation, or a log written unsigned)."""
        saved, self.trust = self.trust, None
        try:
            record = self.commit(version)
        finally:
            self.trust = saved
        return self.write_signature(record, key)

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

    def write_commit(self, record: CommitRecord) -> None:
        """Create the commit record with put-if-absent: exactly one writer wins a version."""
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

    def write_files(self, files: list[tuple[FileEntry, bytes]], known: set[str] = frozenset()) -> None:
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

    def read_segment(self, ref: SegmentRef, version: int | None = None) -> memoryview:
        """Segment bytes, checked against the commit record's size (from the object's metadata,
        before its bytes are read) and sha256. A missing segment is damage (IntegrityError),
        unless retention removed it while it was being read (ExpiredError)."""
        early = self._prefetched.pop(ref.key, None)
        if early is not None:
            self._prefetched_bytes -= len(early)
            if len(early) == ref.size and hashlib.sha256(early).hexdigest() == ref.sha256:
                return memoryview(early)
        large = ref.size > segments.SEGMENT_MEMORY_BYTES
        try:
            if large:
                f, sha = self.store.get_file(ref.key, ref.size)
                data = SegmentFile(f, ref.size, sha)
            else:
                data = self.store.get(ref.key, size=ref.size)
                sha = hashlib.sha256(data).hexdigest()
        except NotFoundError:
            self._check_removed(ref, version)
            raise IntegrityError(f"segment {ref.key} is missing") from None
        if sha != ref.sha256:
            if large:
                data.close()
            raise IntegrityError(f"segment {ref.key}: sha256 mismatch")
        return data

    def segment_records(self, version: int, ref: SegmentRef, data=None) -> Iterator[Record]:
        """The records of one segment; ``data``, if given, is what read_segment returned for
        it (its bytes, or a SegmentFile), already checked. The record count is checked against
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

    def records(self, version: int | Step) -> Iterator[Record]:
        step = version if isinstance(version, Step) else self.version_step(version)
        for ref in step.segments:
            yield from self.segment_records(step.version, ref)

    def _check_removed(self, ref: SegmentRef, version: int | None) -> None:
        """Raise ExpiredError if retention removed what ``ref`` belongs to while it was read."""
        if ref.key.startswith((SNAPSHOTS_PREFIX, SQUASHES_PREFIX)):
            manifest = ref.key.rsplit("/", 1)[0] + "/" + MANIFEST
            if self.store.head(manifest) is None:
                kind = "snapshot" if ref.key.startswith(SNAPSHOTS_PREFIX) else "squash"
                raise ExpiredError(f"{self.store.url}: {kind} {manifest.split('/')[1]} was removed by "
                                   "retention while it was read: plan the route again", self.start())
        elif version is not None and version < self.start():
            raise self._expired(version, f"version {version}") from None

    # -- snapshots and squashes (spec/FORMAT.md sections 23, 24) ----------------------------------

    def catchup(self, key: str) -> tuple[CatchUp, str]:
        """A snapshot's or squash's manifest and its sha256, checked against the commit record
        of its version (and of its start, for a squash still readable)."""
        cached = self._catchups.get(key)
        if cached is not None:
            return cached
        try:
            data = bytes(self.store.get(key, max_size=MAX_MANIFEST_BYTES))
        except NotFoundError:
            raise NotFoundError(f"{self.store.url}: no {key}") from None
        cu = CatchUp.from_bytes(data, key)
        what = key
        if cu.log_id != self.log_id:
            raise IntegrityError(f"{what}: belongs to log {cu.log_id}")
        target = self.commit(cu.version)
        if cu.commit_sha256 != self.commit_sha256(cu.version) or cu.state_digest != target.state_digest:
            raise IntegrityError(f"{what}: does not match the commit record of version {cu.version}")
        if cu.stats.total_elements != target.stats.total_elements:
            raise IntegrityError(f"{what}: stats.total_elements differs from version {cu.version}'s")
        if cu.start is not None and cu.start >= self.known_start():
            if cu.start_state_digest != self.commit(cu.start).state_digest:
                raise IntegrityError(f"{what}: does not start from version {cu.start}'s state")
        if cu.start is None and cu.stats.changed_elements != cu.stats.total_elements:
            raise IntegrityError(f"{what}: a snapshot changes every element")
        result = self._catchups[key] = (cu, hashlib.sha256(data).hexdigest())
        return result

    def snapshot(self, version: int) -> CatchUp:
        return self.catchup(snapshot_prefix(version) + MANIFEST)[0]

    def squash(self, start: int, end: int) -> CatchUp:
        return self.catchup(squash_prefix(start, end) + MANIFEST)[0]

    def snapshots(self, retired: bool = False) -> dict[int, CatchUp]:
        """The snapshots readers may start from, by version: at or above the log start and not
        retired (the start's own snapshot always). With ``retired``, retired ones too."""
        start = self.start()
        manifests, retiring = set(), set()
        for o in self.store.list(SNAPSHOTS_PREFIX):
            parsed = parse_snapshot_key(o.key)
            if parsed is not None:
                (manifests if parsed[1] == "manifest" else retiring).add(parsed[0])
        out = {}
        for v in sorted(manifests):
            if v < start:
                continue
            if v in retiring and v != start and not retired:
                self.marker(f"{snapshot_prefix(v)}retired.json")  # checked like any marker
                continue
            cu = self._usable(snapshot_prefix(v) + MANIFEST, required=v == start and start > 0)
            if cu is not None:
                out[v] = cu
        return out

    def squashes(self) -> list[CatchUp]:
        """The squashes whose end is readable, by start then end (damaged ones left out)."""
        start = self.start()
        found = sorted(p for o in self.store.list(SQUASHES_PREFIX) if (p := parse_squash_key(o.key)))
        return [cu for a, b in found if b >= start
                and (cu := self._usable(squash_prefix(a, b) + MANIFEST)) is not None]

    def _usable(self, key: str, required: bool = False) -> CatchUp | None:
        """A catch-up object routes may use: None if it is damaged (remembered in ``excluded``:
        the chain of versions is always a route), unless ``required`` (the log start's)."""
        if key in self.excluded and not required:
            return None
        try:
            return self.catchup(key)[0]
        except IntegrityError as exc:
            if required:
                raise
            self.excluded[key] = str(exc)
            return None

    def exclude(self, step: Step, reason: str) -> bool:
        """Leave a catch-up step out of later routes (it failed a check); False for a version
        or the log start's snapshot, which no route can avoid."""
        if step.catchup is None or (step.kind == "snapshot" and step.version == self.known_start() > 0):
            return False
        self.excluded[step.catchup.key] = reason
        return True

    def start_snapshot(self) -> CatchUp | None:
        """The snapshot readers start from when the log starts above 0, checked against the
        newest log-start marker."""
        start = self.start()
        if start == 0:
            return None
        marker = self.marker(log_start_key(start))
        try:
            cu, sha = self.catchup(snapshot_prefix(start) + MANIFEST)
        except NotFoundError:
            raise IntegrityError(f"{self.store.url}: the log starts at {start} but its snapshot is missing") from None
        if sha != marker.snapshot_sha256:
            raise IntegrityError(f"{log_start_key(start)}: names another snapshot of version {start}")
        return cu

    def version_step(self, version: int) -> Step:
        c = self.commit(version)
        return Step("version", c, c.parent, c.parent_state_digest, c.segments, c.stats)

    def catchup_step(self, cu: CatchUp) -> Step:
        return Step(cu.kind, self.commit(cu.version), cu.start, cu.start_state_digest, cu.segments,
                    cu.stats, cu)

    def step(self, kind: str, version: int, parent: int | None = None) -> Step:
        """The step a journal names (kind, version, and a squash's start)."""
        if kind == "version":
            return self.version_step(version)
        if kind == "snapshot":
            return self.catchup_step(self.snapshot(version))
        if kind == "squash" and parent is not None:
            return self.catchup_step(self.squash(parent, version))
        raise UsageError(f"unknown step {kind!r}")

    def plan(self, target: int | None = None, holding: int | None = None,
             holding_digest: int | None = None) -> list[Step]:
        """The route to ``target`` (default latest) that reads the fewest bytes, from version
        ``holding`` (state digest ``holding_digest``) or from nothing: versions of the chain,
        squashes and snapshots (section 24). Raises ExpiredError when ``target`` has expired."""
        versions = self.versions()
        if not versions:
            raise NotFoundError(f"{self.store.url}: log has no versions")
        start, latest = versions[0], versions[-1]
        target = latest if target is None else target
        if target > latest:
            raise NotFoundError(f"{self.store.url}: no version {target} (latest is {latest})")
        if target < start:
            raise self._expired(target, f"version {target}")
        if holding is not None and holding > target:
            raise UsageError(f"version {holding} is past {target}")
        if holding is not None and holding >= start - 1 and target - holding <= 1:
            return [self.version_step(v) for v in range(holding + 1, target + 1)]
        # Dijkstra over versions, by (bytes, steps): commit records are read only for the
        # versions a route cheaper than the best found so far reaches (a long log with a recent
        # snapshot costs a few reads, not one per version).
        best: dict[int, tuple[tuple[int, int], Step | None, int | None]] = {}
        heap: list[tuple[tuple[int, int], int]] = []

        def offer(v: int, cost: tuple[int, int], step: Step | None, prev: int | None) -> None:
            if v not in best or cost < best[v][0]:
                best[v] = (cost, step, prev)
                heapq.heappush(heap, (cost, v))

        if holding is not None:
            offer(holding, (0, 0), None, None)
        elif start == 0:
            offer(0, (self.commit(0).delta_bytes, 1), self.version_step(0), None)
        else:
            self.start_snapshot()  # the marker's snapshot, checked
        for w, snap in self.snapshots().items():
            if w <= target:
                offer(w, (snap.delta_bytes, 1), self.catchup_step(snap), None)
        by_start: dict[int, list[CatchUp]] = {}
        for cu in self.squashes():
            if cu.version <= target and (cu.start >= start or cu.start == holding):
                if cu.start == holding and holding_digest is not None and cu.start_state_digest != holding_digest:
                    continue
                by_start.setdefault(cu.start, []).append(cu)
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
                step = self.version_step(v + 1)
                offer(v + 1, (nbytes + step.delta_bytes, nsteps + 1), step, v)
            for cu in by_start.get(v, ()):
                offer(cu.version, (nbytes + cu.delta_bytes, nsteps + 1), self.catchup_step(cu), v)
        if target not in best:
            raise self._expired(holding if holding is not None else target,
                                f"version {holding}" if holding is not None else f"version {target}")
        route = []
        v = target
        while best[v][1] is not None:
            _, step, prev = best[v]
            route.append(step)
            if prev is None:
                break
            v = prev
        return route[::-1]

    # -- replay ---------------------------------------------------------------------------

    def apply_version(self, state: dict[str, TensorBits], version: int, check_all: bool = False,
                      tensors: set[str] | None = None) -> None:
        """Advance ``state`` (the parent's state, mutated in place) to ``version``."""
        self.apply_step(state, self.version_step(version), check_all, tensors)

    def apply_step(self, state: dict[str, TensorBits], step: Step, check_all: bool = False,
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
        if state_digest(commit.tensors) != commit.state_digest:
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
        spans: dict[str, list | None] = {n: [] for n in created} if self.digests.composable else {}
        with _ParallelApply(self.digests) as applier:
            for rec in self.records(step):
                info = rules.record(rec)
                if rec.tensor in wanted:
                    applier.submit(rec, info, state[rec.tensor])
                    pieces = spans.get(rec.tensor)
                    if pieces is not None:
                        if rec.kind == "tensor" and rec.box.is_row_block(info.shape):
                            pieces.append((rec.box.flat_start(info.shape), rec.box.size, rec.target_digest))
                        else:
                            spans[rec.tensor] = None
        rules.finish(step.stats)
        for name in (wanted if check_all or step.kind != "version" else created):
            if not check_all and _covers_exactly(spans.get(name), numel(table[name].shape)):
                d = sum(p[2] for p in spans[name]) & MASK64
            else:
                d = self.digests.tensor(state[name].words, state[name].shape)
            if d != table[name].digest:
                raise IntegrityError(f"{what}: tensor {name!r} does not match its digest")

    def replay(self, upto: int | None = None, check_all: bool = False,
               progress: Progress | None = None,
               tensors: set[str] | None = None) -> Iterator[tuple[int, dict[str, TensorBits]]]:
        """Yield (version, state) for start..upto (start is 0, or the log start's snapshot after
        retention); the same state dict is advanced in place."""
        versions = self.versions()
        if not versions:
            raise NotFoundError(f"{self.store.url}: log has no versions")
        start, latest = versions[0], versions[-1]
        upto = latest if upto is None else upto
        if upto < start:
            raise self._expired(upto, f"version {upto}")
        if not upto <= latest:
            raise NotFoundError(f"{self.store.url}: no version {upto} (latest is {latest})")
        state: dict[str, TensorBits] = {}
        previous = None
        for v in range(start, upto + 1):
            commit = self.commit(v)
            if previous is not None and commit.parent_state_digest != previous.state_digest:
                raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
            if v == start and start > 0:
                self.apply_step(state, self.catchup_step(self.start_snapshot()), tensors=tensors)
            else:
                self.apply_version(state, v, check_all=check_all, tensors=tensors)
            previous = commit
            if progress:
                progress(v)
            yield v, state

    def materialize(self, version: int | None = None, progress: Progress | None = None,
                    tensors: set[str] | None = None) -> dict[str, TensorBits]:
        """The bit-exact state of ``version`` (default latest), every tensor digest checked;
        with ``tensors``, only those tensors. Read by the route of fewest bytes: from version 0
        or a snapshot, through versions and squashes (``plan``)."""
        while True:
            route = self.plan(version)
            target = route[-1].version
            state: dict[str, TensorBits] = {}
            held = None
            try:
                for step in route:
                    if step.parent is not None and step.parent_state_digest != held:
                        raise IntegrityError(f"{step.describe()}: parent digest does not match version {step.parent}")
                    self.apply_step(state, step, tensors=tensors)
                    held = step.state_digest
                    if progress:
                        progress(step.version)
            except IntegrityError as exc:
                # A damaged snapshot or squash: another route (the chain is always one).
                if not self.exclude(step, str(exc)):
                    raise
                continue
            break
        commit = self.commit(target)
        for info in commit.tensors:
            if tensors is not None and info.name not in tensors:
                continue
            if self.digests.tensor(state[info.name].words, info.shape) != info.digest:
                raise IntegrityError(f"version {target}: tensor {info.name!r} does not match its digest")
        return state

    def verify(self, deep: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Check every commit record, the parent chain, every segment's size and sha256 and
        every file object's size and sha256 (feature files).

        ``deep`` also replays every version and checks every tensor digest of every version.
        """
        versions = self.versions()
        if not versions:
            raise IntegrityError(f"{self.store.url}: log has no versions")
        if versions[0] > 0:
            self.start_snapshot()  # the marker names the snapshot readers start from
        nbytes = 0
        nsegments = 0
        checked_files: set[tuple[str, int]] = set()
        previous = None
        for v in versions:
            commit = self.commit(v)
            if previous is not None and commit.parent_state_digest != previous.state_digest:
                raise IntegrityError(f"version {v}: parent digest does not match version {v - 1}")
            if state_digest(commit.tensors) != commit.state_digest:
                raise IntegrityError(f"version {v}: state digest does not match its tensor table")
            if not deep:
                for ref in commit.segments:
                    for _ in self.segment_records(v, ref):
                        pass
                    nbytes += ref.size
            else:
                nbytes += commit.delta_bytes
            for entry in commit.files or ():  # shared objects are checked once
                if (entry.key, entry.size) not in checked_files:
                    self.read_file(entry)
                    checked_files.add((entry.key, entry.size))
                    nbytes += entry.size
            nsegments += len(commit.segments)
            previous = commit
            if progress and not deep:
                progress(v)
        # Every snapshot and squash routes may use, strictly: a damaged one is reported here
        # (routes merely avoid it).
        keys = [o.key for o in self.store.list(SNAPSHOTS_PREFIX)
                if (p := parse_snapshot_key(o.key)) and p[1] == "manifest" and p[0] >= versions[0]]
        keys += [o.key for o in self.store.list(SQUASHES_PREFIX)
                 if (p := parse_squash_key(o.key)) and p[1] >= versions[0]]
        catchups = [self.catchup(key)[0] for key in sorted(keys)]
        for cu in catchups:
            for ref in cu.segments:
                for _ in self.segment_records(cu.version, ref):
                    pass
                nbytes += ref.size
        if deep:
            for _ in self.replay(versions[-1], check_all=True, progress=progress):
                pass
            for cu in catchups:  # each one leads to its version's tensor digests
                if cu.start is not None and cu.start < versions[0]:
                    continue  # its start has expired: only its bytes can be checked
                state = {} if cu.start is None else self.materialize(cu.start)
                self.apply_step(state, self.catchup_step(cu))
        return VerifyReport(len(versions), nsegments, nbytes, deep, len(checked_files),
                            start=versions[0], catchups=len(catchups))
