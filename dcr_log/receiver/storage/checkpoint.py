"""A receiver's storage on a safetensors checkpoint directory: tensors are updated in place
through memory maps (msync before each journal marker), the layout is rewritten file by file
(tmp + fsync + rename) and the index last."""

from __future__ import annotations

import glob
import json
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dcr_log import native, pages
from dcr_log.checkpoint import INDEX_NAME, TensorLocation, read_header, save_safetensors
from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.errors import IntegrityError, NotFoundError, os_error
from dcr_log.log.records import gather_words, scatter_words
from dcr_log.receiver.fs import (
    _file_metadata,
    check_regular,
    check_space,
    fsync_dir,
    plain_file_name,
    write_file_atomic,
)
from dcr_log.receiver.storage.base import Storage, Where
from dcr_log.state import TableLayout, TensorBits

# A safetensors index of a few million tensor names stays far below this.
MAX_INDEX_BYTES = 1 << 30


def checkpoint_file_names(directory: Path) -> tuple[list[str], bool]:
    """The .safetensors files of a checkpoint directory and whether it has an index."""
    index = directory / INDEX_NAME
    if check_regular(index):
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise IntegrityError(f"{index}: more than {MAX_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise IntegrityError(f"{index}: not a safetensors index") from None
        for name in files:
            plain_file_name(name, index)
        return files, True
    names = sorted(p.name for p in directory.glob("*.safetensors"))
    return [n for n in names if check_regular(directory / n)], False


def has_checkpoint(directory: Path) -> bool:
    return directory.is_dir() and bool(checkpoint_file_names(directory)[0])


_PAGE = mmap.PAGESIZE


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


class CheckpointStorage(Storage):
    """A safetensors checkpoint directory updated in place through memory maps.

    The tensor locations come from the files' headers (the union over the files the index
    names, or every ``*.safetensors`` file without an index), so a directory caught between
    the rewrite of a file and of the index by a crash still opens. A layout change rewrites
    the affected files whole (tmp + fsync + rename) and then the index; tensors never move
    between files, and new tensors go to the file with the fewest bytes.
    """

    durable = True
    parallel_reads = True  # reads of the memory maps
    can_defer_sync = True

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise NotFoundError(f"no checkpoint directory at {self.directory}")
        self.files_dir = self.directory
        self._maps: dict[Path, np.memmap] = {}
        self._dirty: set[Path] = set()
        self._writing: set[tuple[Path, int]] = set()  # (file, tensor start) written since flush
        self._written_at: dict[tuple[Path, int], float] = {}  # ... by earlier applies, until synced
        self._prepared: set[tuple[Path, tuple[int, int]]] = set()  # spans prepare_write faulted in, this batch
        self._open()

    def _open(self) -> None:
        files, self.sharded = checkpoint_file_names(self.directory)
        if not files:
            raise NotFoundError(f"{self.directory} holds no .safetensors file")
        self.files = [self.directory / f for f in files]
        self.locations: dict[str, TensorLocation] = {}
        for path in self.files:
            if not check_regular(path, in_place=True):
                raise NotFoundError(f"{path} is missing")
            for name, loc in read_header(path).items():
                if name in self.locations:
                    raise IntegrityError(f"{self.directory}: tensor {name!r} appears in two files")
                self.locations[name] = loc
        # In-place writes need each byte to belong to one tensor (read_header allows overlaps).
        spans = sorted((loc.file, loc.start, loc.end, name) for name, loc in self.locations.items()
                       if loc.end > loc.start)
        for (f1, _, end1, n1), (f2, start2, _, n2) in zip(spans, spans[1:]):
            if f1 == f2 and start2 < end1:
                raise IntegrityError(f"{f1}: tensors {n1!r} and {n2!r} share bytes")
        self._written_at = {}  # new maps: nothing mapped yet
        try:
            # Shared maps (r+): begin_writes' drop of page-table entries relies on it.
            self._maps = {p: np.memmap(p, dtype=np.uint8, mode="r+") for p in self.files}
        except OSError as exc:
            raise os_error(exc, f"cannot open {self.directory} for writing") from None
        self._words = {
            name: self._maps[loc.file][loc.start:loc.end].view(word_dtype(loc.dtype))
            for name, loc in self.locations.items()
        }

    def weight_names(self) -> set[str]:
        """The directory entries that hold weights: never written as a version's files."""
        return {p.name for p in self.files} | {INDEX_NAME}

    def close(self) -> None:
        # Views keep the maps alive; dropping every reference unmaps them.
        self._words = {}
        self._maps = {}

    def layout(self) -> TableLayout:
        return {name: (loc.dtype, loc.shape) for name, loc in self.locations.items()}

    def words(self, name: str) -> np.ndarray:
        return self._words[name]

    def locate(self, name: str, where: Where) -> Any:
        loc = self.locations[name]
        return self._words[name], where, loc.file, loc.start

    def host_words(self, place) -> tuple[np.ndarray, np.ndarray] | None:
        words, where, _, _ = place
        return None if isinstance(where, slice) else (words, where)

    def gather(self, place) -> np.ndarray:
        words, where, _, _ = place
        return np.array(words[where]) if isinstance(where, slice) else gather_words(words, where)

    @staticmethod
    def _dense_span(start: int, where, count: int, width: int) -> tuple[int, int] | None:
        """The pages (a byte range of the file, from a page's start) that a scatter of
        ``count`` words at ``where`` into the tensor at ``start`` dirties, where it dirties
        most of them; None for a slice, nothing, or a sparse scatter (most pages stay clean:
        the faults pick the few it writes)."""
        if isinstance(where, slice) or count == 0:
            return None
        lo = start + int(where[0]) * width
        hi = start + (int(where[-1]) + 1) * width
        lo -= lo % _PAGE
        return None if count * 8 < (hi - lo) // _PAGE else (lo, hi)

    def _populate(self, file: Path, span: tuple[int, int]) -> None:
        """Fault the pages of ``span`` in for writing in one call (MADV_POPULATE_WRITE)
        instead of one write fault per page: at 1% changed every page of a bf16 tensor
        is written, and the faults cost more than the scatter itself. No byte changes."""
        lo, hi = span
        kernels = native.changes
        if kernels is not None:  # the GIL released: the write pass's threads fault side by side
            kernels.populate_write(self._maps[file], lo, hi - lo)
            return
        try:
            self._maps[file]._mmap.madvise(  # type: ignore[attr-defined]  # numpy's private mmap; AttributeError handled
                _MADV_POPULATE_WRITE, lo, hi - lo)
        except (AttributeError, OSError, ValueError):
            pass  # an older kernel (before 5.14) or another platform: the faults do it

    def begin_writes(self, places: Sequence[Any]) -> None:
        """Drop the page-table entries of the tensors these places write (MADV_DONTNEED, one
        call a tensor; the maps are shared file maps, so no byte is lost), unless an earlier
        apply left them writable (_fresh). Pass one's reads mapped their clean pages
        read-only, and upgrading those costs the kernel one write-protect fault a 4 KiB page;
        unmapped, the prefault maps them a folio at a time. 512 MiB read, synced and then
        faulted in, by tools/bench_pagecache.py --repeats 3: 12.1 ms against 36.7 as
        write_checkpoint wrote it, 34.9 against 713.8 written in 1 MiB writes (as a download
        writes), 52.7 against 214.1 copied. A tensor at a time, first, not each record's range
        just before its prefault: an apply of 1% of 512 MiB on a file written in 1 MiB writes
        took 0.125-0.146 s against 0.172-0.183 s (tools/bench_apply.py --gib 0.5 --reps 5
        --receivers ckpt --verify sample --rates 0.01,0.03 --ckpt-writes 1, the two paired)."""
        kernels = native.changes
        self._prepared.clear()
        tensors = {(file, start): words.nbytes for words, _, file, start in places}
        for (file, start), nbytes in tensors.items():
            if not nbytes or not self._fresh(file, start, nbytes):
                continue
            if kernels is not None:
                kernels.drop_pages(self._maps[file], start, nbytes)
                continue
            try:
                lo = start - start % _PAGE
                self._maps[file]._mmap.madvise(  # type: ignore[attr-defined]  # as in _populate
                    mmap.MADV_DONTNEED, lo, start + nbytes - lo)
            except (AttributeError, OSError, ValueError):
                pass  # the writes upgrade the pages one fault at a time instead

    def _fresh(self, file: Path, start: int, nbytes: int) -> bool:
        """Whether begin_writes drops the page-table entries of the tensor at ``start`` of
        ``file``: unless an earlier apply wrote it, its file was not synced since, and its
        pages are still dirty (pages.still_writable: writeback has not cleaned them, which
        write-protects them). Those pages are still mapped for writing; dropped, they would
        be mapped again for nothing. So a receiver following versions back to back is as
        fast as without any drop (tools/bench_side.py --gib 0.5 --rates 0.01 --repeats 3
        --no-minilm, its checkpoint following column: 0.353 and 0.366 of copyto's speed
        against 0.358 and 0.326)."""
        written = self._written_at.get((file, start))
        return written is None or not pages.still_writable(file, start, nbytes, written)

    def prepare_write(self, place, count: int) -> None:
        words, where, file, start = place
        span = self._dense_span(start, where, count, words.itemsize)
        if span is not None:
            self._populate(file, span)
            self._prepared.add((file, span))

    def write(self, place, values: np.ndarray) -> None:
        words, where, file, start = place
        self._dirty.add(file)
        self._writing.add((file, start))
        span = self._dense_span(start, where, values.size, words.itemsize)
        # Not again where prepare_write faulted the span in for this batch: a second call
        # walks the page table entry of every page of the span once more (at 1% of 512 MiB in
        # 219 tensors, tools/bench_apply.py --gib 0.5 --layers 24 --reps 9 --receivers ckpt
        # --verify sample --rates 0.01, four runs each way, alternating: 0.092-0.107 s and
        # 0.144-0.166 s of CPU against 0.099-0.107 s and 0.154-0.177 s).
        if span is not None and (file, span) not in self._prepared:
            self._populate(file, span)
        if self.fault is not None and values.size > 1:
            # Fault injection: the "torn" point lies between the two halves of one write.
            half = values.size // 2
            if isinstance(where, slice):
                words[where.start:where.start + half] = values[:half]
                self._fault("torn", file=file.name)
                words[where.start + half:where.stop] = values[half:]
            else:
                words[where[:half]] = values[:half]
                self._fault("torn", file=file.name)
                words[where[half:]] = values[half:]
            return
        scatter_words(words, where, values)

    def flush(self) -> None:
        now = time.monotonic()
        self._written_at.update(dict.fromkeys(self._writing, now))
        self._writing.clear()
        # msync(MS_SYNC) of each file written since: its data is on disk before any journal
        # marker (under deferred sync the journal holds the words instead).
        if not self.deferred_sync:
            self._msync(sorted(self._dirty))

    def sync(self) -> None:
        # Every file: an earlier process's writes under deferred sync may be in the page
        # cache only (an msync writes a file's dirty pages, whoever dirtied them).
        self._msync(sorted(self._maps))

    def _msync(self, paths: list[Path]) -> None:
        for path in paths:
            try:
                self._maps[path].flush()
            except OSError as exc:
                if self.on_sync_error is not None:
                    self.on_sync_error()
                raise os_error(exc, f"cannot sync {path}") from None
        self._dirty.difference_update(paths)
        synced = set(paths)  # clean now: their pages are mapped read-only again
        self._written_at = {k: t for k, t in self._written_at.items() if k[0] not in synced}

    def tensor_words(self, name: str) -> np.ndarray:
        return self._words[name]

    def _plan(self, layout: TableLayout) -> dict[Path, list[str]]:
        """Which tensors each file holds after the change (deterministic, tensors never move)."""
        plan: dict[Path, list[str]] = {p: [] for p in self.files}
        sizes = dict.fromkeys(self.files, 0)
        new = []
        for name in sorted(layout, key=str.encode):
            loc = self.locations.get(name)
            if loc is None:
                new.append(name)
                continue
            plan[loc.file].append(name)
            sizes[loc.file] += numel(layout[name][1]) * DTYPE_WIDTH[layout[name][0]]
        for name in new:
            target = min(self.files, key=lambda p: (sizes[p], p.name))
            plan[target].append(name)
            sizes[target] += numel(layout[name][1]) * DTYPE_WIDTH[layout[name][0]]
        return plan

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of rewrites a crash interrupted (``.<file>.<random>.tmp``)."""
        for name in [p.name for p in self.files] + [INDEX_NAME]:
            for stale in self.directory.glob(f".{glob.escape(name)}.*.tmp"):
                stale.unlink(missing_ok=True)

    def _rewrites(self, layout: TableLayout, plan: dict[Path, list[str]]) -> dict[Path, int]:
        """The files a layout change rewrites, with the tensor bytes each will hold."""
        out = {}
        for path, names in plan.items():
            current = {n: (loc.dtype, loc.shape) for n, loc in self.locations.items() if loc.file == path}
            if current != {n: layout[n] for n in names}:
                out[path] = sum(numel(layout[n][1]) * DTYPE_WIDTH[layout[n][0]] for n in names)
        return out

    def prepare_layout(self, layout: TableLayout, extra_bytes: int = 0) -> None:
        # Every rewritten file is whole on disk next to the old one (whose map stays open
        # until the change is done).
        needed = sum(self._rewrites(layout, self._plan(layout)).values())
        check_space(self.directory, needed + extra_bytes, "apply the version")

    def set_layout(self, layout: TableLayout) -> None:
        plan = self._plan(layout)
        self._remove_stale_temporaries()
        rewritten = False
        for path, names in plan.items():
            current = {n: (loc.dtype, loc.shape) for n, loc in self.locations.items() if loc.file == path}
            wanted = {n: layout[n] for n in names}
            if current == wanted:
                continue
            self.sync()  # bytes carried into the new file are copied from the maps
            state = {}
            for n in names:
                dtype, shape = layout[n]
                keep = current.get(n) == (dtype, shape)
                state[n] = TensorBits(dtype, shape, self._words[n] if keep
                                      else np.zeros(numel(shape), dtype=word_dtype(dtype)))
            save_safetensors(state, path, metadata=_file_metadata(path))
            rewritten = True
            self._fault("layout_file", file=path.name)
        if rewritten:
            fsync_dir(self.directory)
        if self.sharded:
            self._write_index({n: p.name for p, names in plan.items() for n in names}, layout)
        if rewritten:
            self.close()
            self._open()

    def _write_index(self, weight_map: dict[str, str], layout: TableLayout) -> None:
        index_path = self.directory / INDEX_NAME
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        meta = dict(index.get("metadata") or {})
        meta["total_size"] = sum(numel(s) * DTYPE_WIDTH[d] for d, s in layout.values())
        new = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        if index.get("weight_map") == new["weight_map"] and index.get("metadata") == meta:
            return
        write_file_atomic(index_path, (json.dumps(new, indent=2) + "\n").encode())
