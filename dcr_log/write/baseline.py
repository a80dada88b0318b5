"""A writer rank's baseline: the words of the pieces it owns at the version it last committed.

Kept in memory, or memory-mapped from a local cache directory so that a writer that restarts
resumes without replaying the log. The cache is used only when every piece's words hash to
the digest recorded with it (or, below, a seal of this boot vouches for them), and those
digests add up (across the ranks) to the commit record's tensor digests; anything else is
rebuilt from the log.

Cache layout, per log (dcr_log.write.cache: the per-log directory, its cap and eviction) and
per rank: ``<cache>/<log dir>/r<rank>-<16 hex of the piece set>/`` holding ``meta.json`` and
``words-<version>.bin`` (the pieces' words, 64-byte aligned).
An append advances it in place. The changed words of the chunks encoded as changed positions
go into the map as each chunk is encoded (the words they replace are kept in memory and put
back if the version is not committed: write.pending.Pending); once the version is
committed, ``meta.json`` records it as "pending" with the pieces' digests after it, the
remaining changes (whole-box records) are scattered, and ``meta.json`` records the new
version. A kill leaves words that match one of the two digest lists, or neither (then the
pieces are rebuilt: a writer killed while encoding rebuilds its baseline from the log).
Nothing is fsynced: a SIGKILL loses no page-cache write, and a power loss is caught by the
digest check.

Hashing every cached word at open costs a new process (each ``dcr append``) a pass over the
whole baseline. So once an append has advanced the cache and recorded it, the rank, still
holding its lock, leaves a seal (``seal.json``): this boot's id, the hash of ``meta.json`` and
the words file's device, inode, size, mtime and ctime. Every append removes the seal before it
writes a word of the slot (Baseline.unseal: the first thing it does there, under the lock). A
writer that opens the cache trusts sealed words without hashing them when all of that still
holds; anything else (another boot, so a power loss; a write, a truncate or a copy of the
file; a kill in the middle of an append, which leaves no seal) gets the digest check. That is
the trust a writer process already places in its own map between appends, extended to the
next process of the same boot: a change of the file's bytes that leaves no trace in its
metadata (damage at rest, a write in the same timestamp tick as the seal) is not seen, and
``check_cache=True`` (``dcr append --check-cache``) hashes every word anyway. An append that
is not committed, once it has put its early writes back, seals the slot again.

A writer keeps no lock between appends, and another process may append meanwhile through
the same cache (and be killed half-way, leaving the words torn). So each append, holding the
lock, first checks that the slot is as this process last verified or wrote it
(Baseline.untouched: the seal it wrote or trusted still there, ``meta.json`` and the words
file's metadata unchanged), and loads the baseline again where it is not.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

from dcr_log import buffers, pages
from dcr_log.coords import (
    DTYPE_WIDTH,
    Box,
    box_to_tensor_flat,
    box_view,
    boxes_intersect,
    flat_inside,
    numel,
    tensor_flat_to_box,
    word_dtype,
)
from dcr_log.digest import MASK64, box_digests
from dcr_log.errors import CacheWarning, IntegrityError, UsageError
from dcr_log.log.records import decode_record, record_targets, scatter_words
from dcr_log.log.steps import StepRules
from dcr_log.parallel import DEFAULT_WORKERS, map_ordered
from dcr_log.write.cache import cache_root, evict, log_dir_name, mark_used

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.state import TableLayout

PieceKey = tuple  # (name, offset tuple, shape tuple)
CACHE_FORMAT = "dcr-baseline/1"
ALIGN = 64


def piece_key(name: str, box: Box) -> PieceKey:
    return (name, tuple(int(o) for o in box.offset), tuple(int(s) for s in box.shape))


def _key_json(key: PieceKey) -> list:
    return [key[0], list(key[1]), list(key[2])]


def _key_of(obj: list) -> PieceKey:
    return (obj[0], tuple(obj[1]), tuple(obj[2]))


class BaselineCache:
    """Where one rank keeps its baseline files for one log (dcr_log.write.cache: the layout,
    the cap, what ``dcr cache`` does)."""

    def __init__(self, root: Path, log_id: str, url: str = "", local: Path | None = None, check: bool = False):
        self.root = Path(root)
        self.log_id, self.url, self.local = log_id, url, local
        self.dir = self.root / log_dir_name(url, log_id)
        self.check = check  # hash every cached word at open, sealed or not

    @staticmethod
    def resolve(cache_dir: Any, store, log_id: str, check: bool = False) -> BaselineCache | None:
        """None (no cache) for ``cache_dir=False`` and for logs in memory; else the given
        directory or the default one."""
        if cache_dir is False:
            return None
        if cache_dir is None and store.url.startswith("memory://"):
            return None
        return BaselineCache(cache_root(cache_dir), log_id, store.url, getattr(store, "local_root", None), check)

    def mark_used(self) -> None:
        mark_used(self.dir, self.url, self.log_id, self.local)

    def hold(self, rank: int) -> IO[bytes] | None:
        """This rank's hold on the log's cache, kept until the returned file is closed (an
        exclusive flock on ``r<rank>.lock``), or None where another writer holds it, or the
        directory cannot be made. Only the holder reads or writes the rank's baseline files:
        an append writes changed words into them as it encodes, before its version is
        committed (Pending), which another writer must not take for a version's words."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            f = open(self.dir / f"r{rank}.lock", "ab")
        except OSError as exc:
            # Said, not raised: the append goes on, but every one replays its baseline.
            warnings.warn(CacheWarning(f"baseline cache {self.dir} cannot be used "
                                       f"({exc.strerror or exc}): appends read their baseline from the log"),
                          stacklevel=3)
            return None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            return None
        return f

    def slot(self, rank: int, keys: list[PieceKey]) -> Path:
        sig = xxhash.xxh3_64_hexdigest(json.dumps(sorted(_key_json(k) for k in keys)).encode())
        return self.dir / f"r{rank}-{sig}"

    def drop_other_slots(self, rank: int, keep: Path) -> None:
        if not self.dir.is_dir():
            return
        for p in self.dir.glob(f"r{rank}-*"):
            if p != keep and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


SEAL = "seal.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot's id (Linux), or None where there is none: then nothing is sealed."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def _file_identity(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class SlotMark(NamedTuple):
    """What says that a slot is as a writer last left it: its path and words file, the hash
    of its ``meta.json`` and the words file's identity (_file_identity); None in the last
    two where they cannot be read (then no later mark equals it)."""
    slot: Path
    file: str
    meta: str | None
    identity: list[int] | None

    @staticmethod
    def take(slot: Path, file: str, meta: bytes | None = None) -> SlotMark:
        """The slot's mark now; ``meta``: its ``meta.json`` bytes, already read."""
        try:
            if meta is None:
                meta = (slot / "meta.json").read_bytes()
            return SlotMark(slot, file, xxhash.xxh3_64_hexdigest(meta), _file_identity(slot / file))
        except OSError:
            return SlotMark(slot, file, None, None)

    def seal(self, boot: str) -> dict:
        """The seal this mark makes in this boot."""
        return {"boot": boot, "file": self.file, "meta": self.meta, "stat": self.identity}


def _holding_seal(mark: SlotMark) -> bytes | None:
    """The seal of the slot ``mark`` was just taken of, where it vouches for its words (same
    boot, same ``meta.json``, the words file unchanged in its metadata: the module's
    docstring), else None."""
    boot = boot_id()
    if boot is None or mark.meta is None:
        return None
    try:
        data = (mark.slot / SEAL).read_bytes()
        holds = json.loads(data) == mark.seal(boot)
    except (OSError, ValueError):
        return None
    return data if holds else None


def _write_json_atomic(path: Path, obj: dict) -> bytes:
    """``obj`` as the file's whole content (a rename into place); the bytes written."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique per writer thread
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return data


@dataclass
class Baseline:
    """ShardPiece words (flat, box row-major) and their digests at ``version``."""

    version: int
    arrays: dict
    dtypes: dict
    digests: dict
    slot: Path | None = None  # the cache slot whose file maps ``arrays``, if any
    _file: str = ""
    _layout: list = field(default_factory=list)  # (key, byte offset) in the slot's file
    _written_at: float | None = None  # when an append last scattered into the map (monotonic)
    # Where ``arrays`` are mapped from a cache slot: that slot as this process last verified or
    # wrote it, and the seal it wrote or trusted there, if any, which ``untouched`` compares
    # with the slot now.
    _mark: SlotMark | None = None
    _seal: bytes | None = None

    @staticmethod
    def empty(version: int) -> Baseline:
        return Baseline(version, {}, {}, {})

    def seal(self) -> None:
        """Vouch for the slot's words as ``meta.json`` records them: for the next writer of
        this boot (the module's docstring), and for this one's next append (``untouched``).
        Called with the rank's lock held, once the words and ``meta.json`` are final for the
        version."""
        if self.slot is None:
            return
        mark = self._mark = SlotMark.take(self.slot, self._file)
        self._seal = None
        boot = boot_id()
        if boot is None or mark.meta is None:
            return
        try:
            self._seal = _write_json_atomic(self.slot / SEAL, mark.seal(boot))
        except OSError:
            pass  # (a full disk, say) no seal: the next writer hashes the words, as before seals

    def untouched(self) -> bool:
        """Whether the cache slot these words are mapped from, if any, is as this process
        last verified or wrote it: False where another writer's append changed it since (a
        process killed in the middle of one leaves its words torn), and where that cannot be
        told. Checked at each append, holding the rank's lock: a writer keeps no lock between
        appends."""
        if self._mark is None:
            return self.slot is None  # (every mapped baseline gets a mark)
        mark = self._mark
        if self._seal is not None:
            # Every append removes the seal before it writes a word there: seen whatever
            # the file system's timestamps are.
            try:
                if (mark.slot / SEAL).read_bytes() != self._seal:
                    return False
            except OSError:
                return False
        return mark.meta is not None and SlotMark.take(mark.slot, mark.file) == mark

    def unseal(self) -> None:
        """Before an append writes a word of the slot: its seal removed."""
        if self.slot is not None:
            (self.slot / SEAL).unlink(missing_ok=True)

    def pieces_to_remap(self, density: float) -> set[PieceKey]:
        """The pieces whose pages an append drops from the page table and faults in again for
        writing before it scatters its changes into the mapped cache (pages.RemapAhead, ahead
        of the encoding tasks: ShardedWriter._write_rank). The find pass reads
        every page first, and once writeback has cleaned them (in a new process, as ``dcr
        append`` is, or after the dirty expiry or a sync) each page a scatter reached took a
        write-protect fault of its own. None where this process's last append wrote the map
        and its pages are still dirty (pages.still_writable), nor pieces where ``density``
        (the changed fraction of the last version) puts fewer than one change on eight
        pages: the prefault dirties every page, and most of those would have stayed clean."""
        if self.slot is None:
            return set()
        if self._written_at is not None and self._layout:
            first = min(at for _, at in self._layout)
            end = max(at + self.arrays[key].nbytes for key, at in self._layout)
            if pages.still_writable(self.slot / self._file, first, end - first, self._written_at):
                return set()
        return {key for key, words in self.arrays.items()
                if density * (pages.PAGE_BYTES // words.itemsize) * 8 >= 1}

    def has(self, key: PieceKey) -> bool:
        return key in self.arrays

    def words(self, key: PieceKey) -> np.ndarray:
        return self.arrays[key]

    def advance(self, version: int, commit, pending, mine: list) -> Baseline:
        """The baseline after ``commit``: changed words scattered into kept pieces, new words
        for new pieces (already in ``pending.generation`` when there is a cache), pieces no
        longer owned dropped."""
        table = commit.tensor_map()
        digests = {}
        for p in mine:
            old = self.digests.get(p.key, 0) if p.key in pending.kept else 0
            digests[p.key] = (old + pending.contrib.get(p.key, 0)) & MASK64
            if not pending.composable:  # whole tensors: the tensor digest is the piece's
                digests[p.key] = table[p.name].digest
        dtypes = {p.key: p.dtype for p in mine}
        gen = pending.generation
        if gen is None and set(self.arrays) == set(dtypes) == pending.kept:
            if self.slot is not None:  # (its seal is gone: _write_rank removed it before the early writes)
                _write_meta(self.slot, self, digests, pending_version=version)
            scatter_changes(self.arrays, pending.scatters)
            out = Baseline(version, self.arrays, dtypes, digests, self.slot, self._file, self._layout,
                           time.monotonic() if self.slot is not None else None)
            if self.slot is not None:
                _write_meta(self.slot, out, digests)
                out.seal()
            return out
        if gen is not None:
            for p in mine:
                if p.key in pending.kept:
                    gen.write(p.key, 0, self.arrays[p.key])
            out = gen.finish(dtypes, digests)
            scatter_changes(out.arrays, pending.scatters)
            _write_meta(out.slot, out, digests)
            out.seal()
            return out
        arrays = {}
        for p in mine:
            if p.key in pending.kept:
                arrays[p.key] = self.arrays[p.key]
            else:
                arr = pending.fresh.get(p.key)
                arrays[p.key] = buffers.zeros(p.box.size, word_dtype(p.dtype)) if arr is None else arr
        scatter_changes(arrays, pending.scatters)
        return Baseline(version, arrays, dtypes, digests)

    def _map(self, file: str, layout: list) -> None:
        if self.slot is None:
            raise UsageError("a baseline without a cache slot has no file to map")
        self._file = file
        self._layout = layout
        mm = np.memmap(self.slot / file, dtype=np.uint8, mode="r+")
        for key, at in layout:
            n = numel(key[2]) * DTYPE_WIDTH[self.dtypes[key]]
            self.arrays[key] = mm[at:at + n].view(word_dtype(self.dtypes[key]))


# A record with at least this many changes is scattered as a task of its own.
SCATTER_TASK_MIN = 1 << 16


def scatter_changes(arrays: dict, scatters: Mapping) -> None:
    """The committed changes into the baseline's pieces on the shared pool's threads (the C
    scatter releases the GIL). A piece's records cover disjoint boxes, so its large records
    are tasks of their own (one large tensor does not leave the other threads idle); its
    small ones go together."""
    def scatter(item) -> None:
        key, parts = item
        arr = arrays[key]
        for start, pos, values in parts:
            scatter_words(arr[start:], pos, values)

    items: list = []
    for key, parts in scatters.items():
        small = [part for part in parts if part[1].size < SCATTER_TASK_MIN]
        items.extend((key, [part]) for part in parts if part[1].size >= SCATTER_TASK_MIN)
        if small:
            items.append((key, small))
    big = sum(pos.size for _, parts in items for _, pos, _ in parts) >= 1 << 16
    for _ in map_ordered(scatter, items, DEFAULT_WORKERS, parallel=big):
        pass


class Generation:
    """A new cache file for one version's pieces, written piece by piece (pwrite: no
    anonymous copy of the words), then renamed into its slot and mapped."""

    def __init__(self, cache: BaselineCache, rank: int, version: int, dtypes: Mapping):
        self.cache, self.rank, self.version = cache, rank, version
        keys = sorted(dtypes, key=lambda k: (k[0].encode(), k[1]))
        self.slot = cache.slot(rank, keys)
        cache.mark_used()
        self.slot.mkdir(parents=True, exist_ok=True)
        (self.slot / SEAL).unlink(missing_ok=True)  # its words file and meta.json are replaced
        self.name = f"words-{version}.bin"
        self.tmp = self.slot / f".{self.name}.{uuid.uuid4().hex}.tmp"
        self.layout, at = [], 0
        for key in keys:
            self.layout.append((key, at))
            at += -(-numel(key[2]) * DTYPE_WIDTH[dtypes[key]] // ALIGN) * ALIGN
        self.offsets = dict(self.layout)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, max(at, 1))

    def write(self, key: PieceKey, start: int, words: np.ndarray) -> None:
        """Words ``start ..`` of a piece."""
        words = np.ascontiguousarray(words)
        if words.size:
            os.pwrite(self.fd, words.data.cast("B"), self.offsets[key] + start * words.itemsize)

    def finish(self, dtypes: Mapping, digests: Mapping) -> Baseline:
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.slot / self.name)
        out = Baseline(self.version, {}, dict(dtypes), dict(digests), self.slot)
        out._map(self.name, self.layout)
        for old in self.slot.glob("words-*.bin"):
            if old.name != self.name:
                old.unlink(missing_ok=True)
        self.cache.drop_other_slots(self.rank, self.slot)
        evict(self.cache.root, keep=self.cache.dir)  # within the cap: other logs' caches, oldest first
        return out

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


def _write_meta(slot: Path, base: Baseline, digests: Mapping, file: str | None = None,
                pending_version: int | None = None) -> None:
    file = file or base._file
    meta = {
        "format": CACHE_FORMAT,
        "version": base.version,
        "file": file,
        "pieces": [[_key_json(k), base.dtypes[k], at, f"{base.digests.get(k, 0):016x}"]
                   for k, at in base._layout],
        "pending": None if pending_version is None else {
            "version": pending_version,
            "digests": [f"{digests[k]:016x}" for k, _ in base._layout],
        },
    }
    _write_json_atomic(slot / "meta.json", meta)


def open_cached(cache: BaselineCache, rank: int, keys: list[PieceKey], digest_boxes) -> Baseline | None:
    """A cached baseline of this rank holding some of these pieces (the newest slot that has
    any), if their words match the digests recorded for one version (``digest_boxes([(key,
    words), ...]) -> [int, ...]``), or the slot's seal vouches for the recorded ones (unless
    ``cache.check``); else None."""
    want_all = set(keys)
    if cache.dir.is_dir():
        cache.mark_used()
    slots = sorted(cache.dir.glob(f"r{rank}-*"), key=lambda p: -p.stat().st_mtime) if cache.dir.is_dir() else []
    for slot in slots:
        try:
            meta_bytes = (slot / "meta.json").read_bytes()
            meta = json.loads(meta_bytes)
            if meta.get("format") != CACHE_FORMAT:
                continue
            layout = [(_key_of(k), int(at)) for k, _, at, _ in meta["pieces"]]
            want = want_all & {k for k, _ in layout}
            if not want:
                continue
            dtypes = {_key_of(k): dt for k, dt, _, _ in meta["pieces"]}
            recorded = {_key_of(k): int(d, 16) for k, _, _, d in meta["pieces"]}
            pend = meta.get("pending")
            pending = None if not pend else dict(zip((k for k, _ in layout), (int(d, 16) for d in pend["digests"])))
            base = Baseline(int(meta["version"]), {}, dtypes, {}, slot)
            base._map(meta["file"], layout)
            # Before the words are hashed: a write meanwhile makes the next append load them again.
            base._mark = SlotMark.take(slot, meta["file"], meta_bytes)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        sealed = None if pending is not None or cache.check else _holding_seal(base._mark)
        if sealed is not None:
            actual = {k: recorded[k] for k in want}
            base._seal = sealed  # (an append by another process removes it: ``untouched``)
        else:
            ordered = list(want)
            actual = dict(zip(ordered, digest_boxes([(k, base.arrays[k]) for k in ordered])))
        if all(actual[k] == recorded[k] for k in want):
            base.digests = actual
        elif pending is not None and all(actual[k] == pending[k] for k in want):
            base.version = int(pend["version"])
            base.digests = actual
        else:
            continue
        if want != set(base.arrays):  # a superset: only the wanted pieces, not this slot's file
            base = Baseline(base.version, {k: base.arrays[k] for k in want},
                            {k: dtypes[k] for k in want}, actual, _mark=base._mark, _seal=base._seal)
        return base
    return None


def roll_forward(log: DeltaLog, base: Baseline, version: int, needed: list, shapes: Mapping,
                 digest_boxes) -> Baseline:
    """``base`` (cached at an older version) brought to ``version`` by applying the records of
    the versions in between to its pieces: O(those deltas), not a replay from version 0.

    Every version's records are held to the rules of a valid step (``StepRules``, as replay
    does: IntegrityError otherwise), the records of tensors this rank does not hold included.
    Pieces of a tensor whose dtype or shape changed on the way are left out (rebuilt by the
    caller). The words are copied first (the cache file keeps its own version); the caller
    compares the pieces' digests with the commit's.
    """
    start = log.commit(base.version).tensor_map()
    keep = [p for p in needed if p.key in base.arrays and start.get(p.name) is not None
            and (start[p.name].dtype, start[p.name].shape) == (p.dtype, shapes[p.key])]
    arrays = {p.key: np.array(base.arrays[p.key], copy=True) for p in keep}
    by_name: dict[str, list] = {}
    for p in keep:
        by_name.setdefault(p.name, []).append(p)
    before: TableLayout = {n: (t.dtype, t.shape) for n, t in start.items()}
    for v in range(base.version + 1, version + 1):
        step = log.version_step(v)
        table = step.tensor_map()
        rules = StepRules(step.kind, step.describe(), table, before)
        for name in list(by_name):
            info = table.get(name)
            if info is None or (info.dtype, info.shape) != (start[name].dtype, start[name].shape):
                for p in by_name.pop(name):
                    arrays.pop(p.key)
        records = log.records(step)
        for rec in records:
            try:
                info = rules.record(rec)
                pieces = by_name.get(rec.tensor)
                if not pieces:
                    continue
                hit = [p for p in pieces if boxes_intersect(rec.box, p.box)]
                if not hit:
                    continue
                changes = decode_record(rec, info)
                positions = np.arange(rec.box.size) if changes.positions is None else changes.positions
                flat = box_to_tensor_flat(rec.box, info.shape, positions)
                for p in hit:
                    inside = flat_inside(p.box, info.shape, flat)
                    local = tensor_flat_to_box(p.box, info.shape, flat[inside])
                    words = arrays[p.key]
                    words[local] = record_targets(rec.kind, changes, words[local], changes.values[inside])
            except IntegrityError as exc:
                records.throw(exc)  # its segment's sha256 mismatch instead, where that is the cause
                raise
        rules.finish(step.stats)
        before = {n: (t.dtype, t.shape) for n, t in table.items()}
    kept = {k: arrays[k] for k in arrays}
    return Baseline(version, kept, {k: base.dtypes[k] for k in kept},
                    dict(zip(kept, digest_boxes(list(kept.items())))))


def load_baseline(log: DeltaLog, version: int, needed: list, cache: BaselineCache | None, group,
                  layout, current: Baseline | None = None) -> Baseline:
    """This rank's baseline of ``needed`` pieces at ``version`` (collective).

    Each rank offers what it has (its current in-memory baseline, else its cache) with the
    pieces' digests; the ranks exchange per-tensor sums, and a tensor is trusted only when
    every owner has all its pieces and the sums equal the commit's tensor digest. Everything
    else is rebuilt from the log by the ranks that own pieces of it.
    """
    digests = log.digests
    commit = log.commit(version)
    table = commit.tensor_map()
    keys = [p.key for p in needed]
    dtypes = {p.key: p.dtype for p in needed}
    shapes = {p.key: layout.tensors[p.name][1] for p in needed}

    def digest_box(key, words):
        return digests.box(Box(key[1], key[2]), shapes.get(key, key[2]), words)

    def digest_boxes(items: list) -> list[int]:
        # On the pool's threads, large pieces in spans: a new process's first append checks
        # every cached word against its digest before it trusts them (unless sealed), and a
        # rebuilt piece gets its digest.
        return box_digests(digests, [(Box(k[1], k[2]), shapes.get(k, k[2]), w) for k, w in items], DEFAULT_WORKERS)

    have: Baseline | None = None
    if current is not None and all(current.has(k) for k in keys):
        have = current
    elif cache is not None and keys:
        cached = open_cached(cache, group.rank, keys, digest_boxes)
        if cached is not None and cached.version < version:
            cached = roll_forward(log, cached, version, needed, shapes, digest_boxes)
        if cached is not None and cached.version == version:
            have = cached
    offer: dict[str, int | None] = {}
    for p in needed:
        if have is None or not have.has(p.key):
            offer[p.name] = None
            continue
        d = have.digests.get(p.key)
        if d is None:
            d = digest_box(p.key, have.words(p.key))
        if p.name in offer and offer[p.name] is None:
            continue
        offer[p.name] = (offer.get(p.name, 0) + d) & MASK64 if digests.composable else d
    offers = group.all_gather(offer)
    rebuild: set[str] = set()
    names = {n for o in offers for n in o}
    for name in names:
        parts = [o[name] for o in offers if name in o]
        if any(v is None for v in parts):
            rebuild.add(name)
        elif digests.composable:
            if sum(parts) & MASK64 != table[name].digest:
                rebuild.add(name)
        elif any(v != table[name].digest for v in parts):
            rebuild.add(name)
    arrays, pdigests = {}, {}
    mine_rebuild = sorted({p.name for p in needed if p.name in rebuild}, key=str.encode)
    state = log.materialize(version, tensors=set(mine_rebuild)) if mine_rebuild else {}
    unknown = []  # pieces whose digest is computed below, together
    for p in needed:
        if p.name in rebuild:
            bits = state[p.name]
            arrays[p.key] = np.array(box_view(bits.words, bits.shape, p.box), copy=True)
            unknown.append(p.key)
        else:
            assert have is not None  # not rebuilt: every owner offered it, this rank from ``have``
            arrays[p.key] = have.words(p.key)
            d = have.digests.get(p.key)
            if d is None:
                unknown.append(p.key)
            else:
                pdigests[p.key] = d
    del state
    pdigests.update(zip(unknown, digest_boxes([(k, arrays[k]) for k in unknown])))
    # Reuse the cache slot in place only when it holds exactly these pieces, all trusted; any
    # other baseline is written to a new cache generation by the next append.
    # (Words not rebuilt may still be mapped from ``have``'s slot: its mark goes with them.)
    mark, sealed = (None, None) if have is None else (have._mark, have._seal)
    if have is not None and have.slot is not None and not mine_rebuild and set(have.arrays) == set(keys):
        return Baseline(version, arrays, dtypes, pdigests, have.slot, have._file, have._layout,
                        _mark=mark, _seal=sealed)
    return Baseline(version, arrays, dtypes, pdigests, _mark=mark, _seal=sealed)
