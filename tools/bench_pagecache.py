#!/usr/bin/env python3
"""What a checkpoint receiver's write faults cost, by how its file entered the page cache.

    python tools/bench_pagecache.py [--mib 512] [--repeats 3] [--json]

A checkpoint-directory receiver writes through memory maps. At 1% changed, every 4 KiB page
of a bf16 tensor is written, and before the writes the receiver faults the pages of each
record's span in for writing in one call (``MADV_POPULATE_WRITE``, CheckpointStorage's
prepare_write, on the pool while the journal syncs). With the pages clean, as between steps,
that is one ``page_mkwrite`` per page in the kernel, and what it costs depends on the size of
the page-cache folios the file's pages lie in, which depends on how the file was written or
read. This times that call over one file's tensor bytes, the same bytes each time, reached
five ways:

- ``write_checkpoint``: as dcr writes a checkpoint (safetensors' serialize_file: a header,
  then one write per tensor);
- ``one write``: the same bytes written by one ``os.write``;
- ``1 MiB writes``: the same bytes in 1 MiB writes (as a download or a copy tool may write);
- ``copied``: the file copied by ``shutil.copyfile`` (sendfile, in the kernel, as ``cp``);
- ``read back``: written by write_checkpoint, dropped from the page cache
  (``POSIX_FADV_DONTNEED`` after ``fsync``), then read back in 16 MiB reads (as after a
  reboot).

Each is mapped, read once (the receiver's pass one gathers from every page), synced
(``os.sync``: the pages clean) and then faulted in for writing, two ways, each on a fresh
checkpoint: ``populate``, the one call on the pages as the reads left them mapped (read-only),
and ``drop + populate``, the same call after ``MADV_DONTNEED`` drops the range's page-table
entries (``drop_pages``, as CheckpointStorage.begin_writes does before the prefault), both
timed; medians of ``--repeats``.
Linux only (``MADV_POPULATE_WRITE``, 5.14 or later); the figures depend on the kernel and the
file system.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcr_log import native  # noqa: E402
from dcr_log.checkpoint import checkpoint_files  # noqa: E402
from dcr_log.receiver import write_checkpoint  # noqa: E402
from dcr_log.state import TensorBits  # noqa: E402

COLUMNS = 4096
# Llama-shaped rows of one layer (q, k, v, o, gate, up, down), repeated as the size needs.
LAYER_ROWS = (4096, 1024, 1024, 4096, 14336, 14336, 14336)


def state_of(mib: int, seed: int = 1) -> dict[str, TensorBits]:
    """About ``mib`` MiB of random bf16 words in Llama-shaped matrices of 4096 columns."""
    rng = np.random.default_rng(seed)
    rows_left = max(1, (mib << 20) // (2 * COLUMNS))
    state: dict[str, TensorBits] = {}
    i = 0
    while rows_left:
        rows = min(LAYER_ROWS[i % len(LAYER_ROWS)], rows_left)
        state[f"t{i:03d}"] = TensorBits("BF16", (rows, COLUMNS),
                                        rng.integers(0, 1 << 16, rows * COLUMNS, dtype=np.uint16))
        rows_left -= rows
        i += 1
    return state


def rewrite_in_pieces(path: Path, piece: int | None) -> None:
    """The file's bytes written again into a new file at ``path``: in one write, or in
    writes of ``piece`` bytes."""
    data = path.read_bytes()
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        step = len(view) if piece is None else piece
        for at in range(0, len(view), max(step, 1)):
            os.write(fd, view[at:at + step])
        os.fsync(fd)
    finally:
        os.close(fd)


def _copied(path: Path) -> None:
    """The file copied by ``shutil.copyfile`` (sendfile on Linux, as ``cp`` copies in the
    kernel too) over itself, its pages then the copy's."""
    copy = path.with_name(path.name + ".copy")
    shutil.copyfile(path, copy)
    with open(copy, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(copy, path)


def _read_back(path: Path) -> None:
    """Drop the file's pages from the page cache, then read it back in 16 MiB reads."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while os.read(fd, 16 << 20):
            pass
    finally:
        os.close(fd)


WAYS: dict[str, Callable[[Path], None]] = {
    "write_checkpoint": lambda path: None,
    "one write": lambda path: rewrite_in_pieces(path, None),
    "1 MiB writes": lambda path: rewrite_in_pieces(path, 1 << 20),
    "copied": _copied,
    "read back": _read_back,
}


def populate_seconds(path: Path, start: int, end: int, fresh: bool) -> float:
    """Map the file, read a byte of every page, ``os.sync``, then time one
    MADV_POPULATE_WRITE of bytes ``start`` to ``end`` (the tensors), after MADV_DONTNEED of
    the same range where ``fresh`` (timed with it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
        try:
            words = np.frombuffer(mm, dtype=np.uint8)
            int(words[start:end:4096].sum())  # every page read, as pass one's gathers read them
            os.sync()
            t0 = time.perf_counter()
            if fresh:
                native.changes.drop_pages(words, start, end - start)
            done = native.changes.populate_write(words, start, end - start)
            seconds = time.perf_counter() - t0
            del words
        finally:
            mm.close()
    finally:
        os.close(fd)
    if not done:
        raise SystemExit("MADV_POPULATE_WRITE is not available here (Linux 5.14 or later)")
    return seconds


def run(mib: int, repeats: int, work: Path) -> dict:
    state = state_of(mib)
    rows: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for way, prepare in WAYS.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(repeats):
            for fresh in (False, True):  # alternating, each on a checkpoint of its own
                directory = work / f"ckpt-{len(rows)}-{r}-{int(fresh)}"
                directory.mkdir()
                write_checkpoint(state, directory)
                locations = checkpoint_files(directory)
                (path,) = {loc.file for loc in locations.values()}
                start = min(loc.start for loc in locations.values())
                end = max(loc.end for loc in locations.values())
                prepare(path)
                times[fresh].append(populate_seconds(path, start, end, fresh))
                shutil.rmtree(directory)
        rows[way] = statistics.median(times[False])
        dropped[way] = statistics.median(times[True])
    nbytes = sum(b.words.nbytes for b in state.values())
    return {"mib": nbytes / (1 << 20), "tensors": len(state), "repeats": repeats,
            "populate_ms": {k: 1e3 * v for k, v in rows.items()},
            "drop_populate_ms": {k: 1e3 * v for k, v in dropped.items()},
            "to_one_write": {k: v / rows["one write"] for k, v in rows.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB of bf16 (default 512)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if native.changes is None:
        raise SystemExit("dcr_log._changes is not built (pip install -e . compiles it)")
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-pagecache-", dir=args.dir))
    try:
        result = run(args.mib, args.repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['mib']:.0f} MiB of bf16 in {result['tensors']} tensors; medians of {result['repeats']}: "
          "MADV_POPULATE_WRITE of the tensors' pages after os.sync")
    print(f"  {'':18s} {'populate':>11s}  {'(x one write)':>13s}  {'drop + populate':>15s}")
    for way, ms in result["populate_ms"].items():
        print(f"  {way:18s} {ms:8.1f} ms  {result['to_one_write'][way]:13.2f}  "
              f"{result['drop_populate_ms'][way]:12.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
