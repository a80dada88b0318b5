#!/usr/bin/env python
"""Log lifecycle benchmark: what a long log costs writers and receivers, with and without
snapshots, squashes and retention. One process; every ratio is taken within the run.

    python tools/bench_lifecycle.py [--mib 16] [--versions 200] [--rate 0.03] [--behind 20] [--repeats 3]

On a bf16 Llama-shaped model (dcr_log.synthetic) trained by Adam steps that change about
``--rate`` of the stored words:

- `LogWriter.open` + `append` at log length 2 and ``--versions``: with the baseline cache, and
  without it (``cache_dir=False``: the baseline is materialized, by the route of fewest bytes:
  the chain from version 0, or a snapshot and the versions after it); the long log's call is
  paired with the short one's right after it (tools/timing.py), ``--repeats`` pairs, reported
  as medians and the median pair's ratio long / short (goal: at most 1.2);
- `dcr append` (a subprocess, wall clock) at the same two lengths, paired the same way, with
  the cache and with ``--cache none`` after a snapshot at the latest version;
- a new receiver (a directory materialized from the log) after ``gc --keep-last 20``: the bytes
  it reads against the snapshot plus the deltas after it (goal: at most 1.1);
- a receiver ``--behind`` versions behind: the bytes of the squash against the sum of the
  deltas it replaces (goal: at most 0.6), at 1% and at ``--rate``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcr_log.checkpoint import save_safetensors  # noqa: E402
from dcr_log.lifecycle import gc, write_snapshot, write_squash  # noqa: E402
from dcr_log.log import DeltaLog  # noqa: E402
from dcr_log.receiver import open_directory  # noqa: E402
from dcr_log.store import Store  # noqa: E402
from dcr_log.synthetic import SyntheticTrainer, lr_for_rate, specs_for_params  # noqa: E402
from dcr_log.write import LogWriter  # noqa: E402
from timing import Pairing, paired  # noqa: E402


class CountingStore(Store):
    def __init__(self, url: str):
        inner = Store.open(url)
        super().__init__(inner._inner, inner.url, inner.local_root)
        self.bytes_read = 0

    def get(self, key, size=None, max_size=None):
        data = super().get(key, size=size, max_size=max_size)
        self.bytes_read += len(data)
        return data


def build(root: Path, cache: Path, versions: int, mib: int, rate: float, seed: int = 0) -> SyntheticTrainer:
    trainer = SyntheticTrainer(specs_for_params((mib << 20) // 2, layers=2), seed=seed)
    lr = lr_for_rate(rate)
    writer = LogWriter.create(root, trainer.state(), cache_dir=cache)
    for _ in range(versions - 1):
        trainer.step(lr)
        writer.append(trainer.state())
    trainer.lr = lr
    return trainer


def fresh_copy(root: Path, cache, dest: Path, no_cache):
    """A copy of the log ``root`` at ``dest`` and of its cache beside it (``no_cache`` when
    ``cache`` is ``no_cache``): the log and cache an untimed call works on. Returns the cache."""
    shutil.copytree(root, dest)
    if cache is no_cache:
        return no_cache
    cache_copy = dest.with_name(dest.name + "-cache")
    shutil.copytree(cache, cache_copy)
    return cache_copy


def remove_copy(dest: Path, cache_copy, no_cache) -> None:
    shutil.rmtree(dest)
    if cache_copy is not no_cache:
        shutil.rmtree(cache_copy)


def open_append(root: Path, cache, state) -> None:
    LogWriter.open(root, cache_dir=cache).append(state)


def open_and_append(long_: tuple, short: tuple, work: Path, repeats: int) -> Pairing:
    """LogWriter.open + append of the next step on the long log (op) and on the short one
    (baseline), alternately, each on a fresh copy of its log (the copies are not timed).
    ``long_`` and ``short`` are (root, cache or False, trainer)."""
    states = []
    for _, _, trainer in (long_, short):
        trainer.step(trainer.lr)
        states.append(trainer.state())
    pairings = []
    for i in range(repeats):
        (lcopy, scopy) = (work / f"copy-long{i}", work / f"copy-short{i}")
        lcache = fresh_copy(long_[0], long_[1], lcopy, False)
        scache = fresh_copy(short[0], short[1], scopy, False)
        pairings.append(paired(functools.partial(open_append, lcopy, lcache, states[0]),
                               functools.partial(open_append, scopy, scache, states[1]), 1))
        remove_copy(lcopy, lcache, False)
        remove_copy(scopy, scache, False)
    return Pairing.join(pairings)


def cli_append(long_: tuple, short: tuple, work: Path, repeats: int) -> Pairing:
    """``dcr append`` of the next step onto a fresh copy of the long log (op) and of the short
    one (baseline), alternately, wall clock. ``long_`` and ``short`` are (root, cache or None,
    trainer)."""
    dcr = Path(sys.executable).with_name("dcr")
    ckpts = []
    for which, (_, _, trainer) in (("long", long_), ("short", short)):
        trainer.step(trainer.lr)
        ckpts.append(work / f"next-{which}.safetensors")
        save_safetensors(trainer.state(), ckpts[-1])

    def append(copy: Path, cache, ckpt: Path) -> None:
        subprocess.run([str(dcr), "append", str(copy), "--from", str(ckpt), "--cache",
                        "none" if cache is None else str(cache)], check=True, capture_output=True)

    pairings = []
    for i in range(repeats):
        (lcopy, scopy) = (work / f"cli-long{i}", work / f"cli-short{i}")
        lcache = fresh_copy(long_[0], long_[1], lcopy, None)
        scache = fresh_copy(short[0], short[1], scopy, None)
        pairings.append(paired(functools.partial(append, lcopy, lcache, ckpts[0]),
                               functools.partial(append, scopy, scache, ckpts[1]), 1))
        remove_copy(lcopy, lcache, None)
        remove_copy(scopy, scache, None)
    return Pairing.join(pairings)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--versions", type=int, default=200)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--behind", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-lifecycle-"))
    try:
        print(f"model: {args.mib} MiB bf16, {args.rate:.0%} changed per step, log of {args.versions} versions")
        short, long_ = work / "short", work / "long"
        t_short = build(short, work / "cache-short", 2, args.mib, args.rate)
        t0 = time.perf_counter()
        t_long = build(long_, work / "cache-long", args.versions, args.mib, args.rate)
        print(f"built {args.versions} versions in {time.perf_counter() - t0:.1f} s")
        rows = []
        for label, cache_s, cache_l in (("with the baseline cache", work / "cache-short", work / "cache-long"),
                                        ("without the cache (materialize)", False, False)):
            rows.append((label, open_and_append((long_, cache_l, t_long), (short, cache_s, t_short), work,
                                                args.repeats)))
        write_snapshot(DeltaLog.open(long_), args.versions - 1)
        rows.append(("without the cache, snapshot at the latest",
                     open_and_append((long_, False, t_long), (short, False, t_short), work, args.repeats)))
        print(f"\nLogWriter.open + append, medians of {args.repeats}, each long call timed beside a short one; "
              "ratio: the median pair's (goal: long/short <= 1.2)")
        for label, p in rows:
            print(f"  {label:<44} length 2: {p.baseline_wall:.3f} s  length {args.versions}: {p.op_wall:.3f} s  "
                  f"ratio {p.ratio:.2f}")
        cli = [(label, cli_append((long_, cache_l, t_long), (short, cache_s, t_short), work, args.repeats))
               for label, cache_s, cache_l in (("with the baseline cache", work / "cache-short", work / "cache-long"),
                                               ("--cache none, snapshot at the latest", None, None))]
        print(f"`dcr append` in a subprocess (wall clock, process start included), medians of {args.repeats}, "
              "paired the same way")
        for label, p in cli:
            print(f"  {label:<44} length 2: {p.baseline_wall:.3f} s  length {args.versions}: {p.op_wall:.3f} s  "
                  f"ratio {p.ratio:.2f}")

        log = DeltaLog.open(long_)
        report = gc(log, keep_last=20, grace=0)
        counting = CountingStore(str(long_))
        fresh = DeltaLog.open(counting)
        latest = fresh.latest_version()
        # The snapshot at the log start and the deltas after it (the snapshot at the latest,
        # written above, is left out of the routes for this figure by removing it).
        shutil.rmtree(long_ / "snapshots" / str(latest))
        fresh = DeltaLog.open(counting)
        need = fresh.snapshot(report.start).delta_bytes + sum(
            fresh.commit(v).delta_bytes for v in range(report.start + 1, latest + 1))
        counting.bytes_read = 0
        with open_directory(fresh, work / "receiver"):
            pass
        print(f"\nnew receiver after gc --keep-last 20 (start {report.start}): read {counting.bytes_read} bytes, "
              f"snapshot + deltas {need}: ratio {counting.bytes_read / need:.3f} (goal <= 1.1)")

        print(f"\nsquash of {args.behind} versions (goal: squash / chain <= 0.6)")
        for rate in sorted({0.01, args.rate}):
            root = work / f"squash-{rate}"
            build(root, False, args.behind + 2, args.mib, rate, seed=7)
            log = DeltaLog.open(root)
            t0 = time.perf_counter()
            cu = write_squash(log, 1, args.behind + 1)
            seconds = time.perf_counter() - t0
            chain = sum(log.commit(v).delta_bytes for v in range(2, args.behind + 2))
            print(f"  {rate:.0%} per step: squash {cu.delta_bytes} bytes, chain {chain} bytes, ratio "
                  f"{cu.delta_bytes / chain:.3f}; {cu.stats.changed_elements / cu.stats.total_elements:.1%} "
                  f"of the words differ; written in {seconds:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
