#!/usr/bin/env python
"""Receiver apply throughput: GB/s of model bytes for numpy, torch (CPU) and
checkpoint-directory receivers at ~1% and ~3% changed bf16 values (``--rates``), next to
``np.copyto`` of the whole model in the same process, and the journal's share of the apply
time (LMDB transactions, synced, over the whole apply).

    python tools/bench_apply.py [--gib 0.25] [--reps 3] [--layers 4] [--verify none,sample,full] [--dir DIR]
                                [--receivers numpy,torch,ckpt] [--phases] [--task-changes N]
                                [--rates 0.01,0.03] [--ckpt-writes MIB]

The steps come from dcr_log.synthetic (Adam on an fp32 master, stored as bf16): one log per
rate holding version 0 (the base) and version 1 (one step). Each timed apply takes a receiver
holding version 0 to version 1 (reading and checking the segments, decoding, gathering,
writing, flushing and journaling); the receiver is reset between repetitions, untimed (a
checkpoint directory is written anew, bound and synced: on disk and clean, as between steps).
Each apply is paired with one ``np.copyto`` of the whole model right after it
(tools/timing.py): seconds (wall, and "CPU s": the process's CPU time, every thread) are the
medians of ``--reps``, "x copyto" the median pair's speed ratio. ``--phases``: after the
timed applies of a numpy or torch receiver, one more, untimed, whose timeline is printed
(tools/phases.py): pass 1's reads (the first segment's fetch, parse and hash in
read_segment_records), decoding and classification, the writes, verify's tensor digests and
the commit.
``--task-changes N``: the changes a task on the pool gathers (1: a task per record, as before
parallel.map_grouped). ``--rates``: the fractions of changed words, one log each; a tiny rate
(0.0001: 27 thousand changes in 512 MiB) shows what an apply costs whatever it changes (the
lineage checks, the segment's read, each record's decode and classification, the journal's
transactions, verify's tensor digests) beside copyto's time.
``--ckpt-writes MIB``: each checkpoint file, once written, is written again in writes of MIB
MiB and synced, as a download or a copy tool writes it: the size of the page-cache folios the
kernel keeps its pages in follows the writes, and with them what faulting the pages in for
writing costs (tools/bench_pagecache.py).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pagecache import rewrite_in_pieces  # noqa: E402
from dcr_log import DeltaLog, TensorBits  # noqa: E402
from dcr_log.format.segment import iter_segment  # noqa: E402
from dcr_log.receiver import Receiver, batch, checks, write_checkpoint  # noqa: E402
from dcr_log.receiver import receiver as receiver_module  # noqa: E402
from dcr_log.receiver.batch import BatchWriter  # noqa: E402
from dcr_log.receiver.checks import PassOne  # noqa: E402
from dcr_log.receiver.journal import Journal  # noqa: E402
from dcr_log.receiver.segments import SegmentCache  # noqa: E402
from dcr_log.state import to_torch  # noqa: E402
from dcr_log.synthetic import adam_step_pair, carve, lr_for_rate, rate_of, specs_for_params  # noqa: E402
from dcr_log.write import LogWriter  # noqa: E402
from phases import Phases  # noqa: E402
from timing import Pairing, fastest, machine_line, paired  # noqa: E402

# The functions whose calls make an apply's timeline (--phases).
APPLY_PHASES = [(SegmentCache, "records"), (DeltaLog, "read_segment_records"), (PassOne, "_decode_ahead"),
                (PassOne, "_classify_ahead"), (BatchWriter, "apply_batch"), (BatchWriter, "_write"),
                (Journal, "begin"), (receiver_module, "tensor_digests"), (Journal, "commit")]


def copy_state(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    return {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in state.items()}


def reset(target: dict[str, TensorBits], base: dict[str, TensorBits]) -> None:
    for k, v in base.items():
        np.copyto(target[k].words, v.words)


def paired_apply(rx: Receiver, log: DeltaLog, verify: str, copyto, journal: list[float]) -> Pairing:
    """One apply to version 1 paired with one ``copyto``; the apply's journal seconds go to ``journal``."""
    applied: list[int] = []

    def apply() -> None:
        j0 = rx.journal.txn_seconds
        applied.extend(rx.apply(log, to=1, verify=verify))
        journal.append(rx.journal.txn_seconds - j0)

    pairing = paired(apply, copyto, 1)
    assert applied == [1], applied
    return pairing


def bench_memory(kind: str, log: DeltaLog, base, expected, verify: str, reps: int, work: Path, copyto,
                 phases: bool = False):
    if kind == "numpy":
        tensors = copy_state(base)
        words = {k: v.words for k, v in tensors.items()}
    else:
        import torch

        tensors = {k: to_torch(TensorBits(v.dtype, v.shape, v.words.copy())) for k, v in base.items()}
        words = {k: t.view(torch.int16).numpy().reshape(-1).view(np.uint16) for k, t in tensors.items()}
    pairings: list[Pairing] = []
    journal: list[float] = []
    for r in range(reps):
        for k, v in base.items():
            np.copyto(words[k], v.words)
        with Receiver.open(tensors, work / f"journal-{log.log_id}-{kind}-{verify}-{r}") as rx:
            rx.bind(log, 0, verify="none")
            pairings.append(paired_apply(rx, log, verify, copyto, journal))
    for k, v in expected.items():  # the benchmark measured a correct apply
        assert np.array_equal(words[k], v.words), k
    if phases:
        for k, v in base.items():
            np.copyto(words[k], v.words)
        with Receiver.open(tensors, work / f"journal-{log.log_id}-{kind}-{verify}-phases") as rx:
            rx.bind(log, 0, verify="none")
            with Phases(APPLY_PHASES) as timeline:
                t0 = time.perf_counter()
                rx.apply(log, to=1, verify=verify)
                t1 = time.perf_counter()
        timeline.report(t0, t1, f"{kind} receiver, verify {verify}: one more apply")
    return Pairing.join(pairings), float(np.median(journal))


def bench_checkpoint(log: DeltaLog, base, expected, verify: str, reps: int, work: Path, copyto,
                     writes_mib: float | None = None):
    pairings: list[Pairing] = []
    journal: list[float] = []
    for r in range(reps):
        directory = work / f"ckpt-{verify}-{r}"
        directory.mkdir()
        write_checkpoint(base, directory)
        if writes_mib is not None:
            for path in directory.glob("*.safetensors"):
                rewrite_in_pieces(path, max(1, int(writes_mib * (1 << 20))))
        with Receiver.open(directory) as rx:
            rx.bind(log, 0, verify="none")
            # On disk and clean, as a receiver's checkpoint is between steps: pages dirty from
            # write_checkpoint would make the kernel's work of dirtying them cheaper.
            os.sync()
            pairings.append(paired_apply(rx, log, verify, copyto, journal))
            if r == reps - 1:
                for k, v in expected.items():
                    assert np.array_equal(rx.storage.words(k), v.words), k
        shutil.rmtree(directory)
    return Pairing.join(pairings), float(np.median(journal))


def segment_parse_seconds(log: DeltaLog, commit, repeats: int = 15) -> float:
    """The median seconds to parse a version's segments (read once, parsed ``repeats`` times):
    the part of an apply's fixed cost that grows with its records."""
    datas = [log.store.get(ref.key) for ref in commit.segments]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for data in datas:
            for _rec in iter_segment(data, log.log_id, commit.version):
                pass
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25, help="model size in GiB of bf16 (default 0.25)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4,
                    help="transformer layers the model is cut into (default 4; 24: 219 tensors at 0.5 GiB)")
    ap.add_argument("--verify", default="none,sample", help="comma-separated verify levels")
    ap.add_argument("--receivers", default="numpy,torch,ckpt")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--phases", action="store_true", help="one more apply's timeline (numpy and torch)")
    ap.add_argument("--rates", default="0.01,0.03",
                    help="comma-separated fractions of changed words, a log each (default 0.01,0.03)")
    ap.add_argument("--task-changes", type=int, default=None, metavar="N",
                    help="changes a pool task gathers (default parallel.TASK_CHANGES; 1: a task per record)")
    ap.add_argument("--ckpt-writes", type=float, default=None, metavar="MIB",
                    help="write each checkpoint file again in writes of MIB MiB (as a download writes it)")
    args = ap.parse_args(argv)
    if args.task_changes is not None:  # the receivers' modules took the default at import
        batch.TASK_CHANGES = checks.TASK_CHANGES = args.task_changes
    work = args.dir or Path(tempfile.mkdtemp(prefix="dcr-bench-apply-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> int:
    specs = specs_for_params(int(args.gib * (1 << 30) / 2), args.layers)
    n = sum(math.prod(s.shape) for s in specs)
    model_bytes = 2 * n
    print(machine_line())
    print(f"model: {len(specs)} bf16 tensors, {model_bytes / (1 << 20):.0f} MiB; "
          f"verify levels {args.verify}; medians of {args.reps}, each apply timed beside one np.copyto")
    rates = [float(r) for r in args.rates.split(",")]
    base_flat, *news = adam_step_pair(n, seed=7, lrs=tuple(lr_for_rate(r) for r in rates))
    base = carve(base_flat, specs)

    # Baseline: copying the whole model once, in this process (beside every apply, too).
    dst = np.empty_like(base_flat)
    copyto = lambda: np.copyto(dst, base_flat)
    copy_s = fastest(copyto, 3).wall
    copy_gbs = model_bytes / copy_s / 1e9
    print(f"np.copyto of the whole model: {copy_s * 1e3:.1f} ms, {copy_gbs:.2f} GB/s")

    rows = []
    for index, (target_rate, new) in enumerate(zip(rates, news)):
        label = f"{target_rate * 100:g}%"
        root = work / f"log-{index}"
        writer = LogWriter.create(root, base, cache_dir=False)
        commit = writer.append(carve(new, specs))
        log = DeltaLog.open(root)
        expected = carve(new, specs)
        rate = rate_of(base_flat, new)
        print(f"log {label}: {rate * 100:.2f}% changed, delta {commit.delta_bytes / (1 << 20):.2f} MiB, "
              f"{len(commit.segments)} segments, {commit.stats.records} records")
        parse_s = segment_parse_seconds(log, commit)
        print(f"  parsing its segments (iter_segment, median of 15): {parse_s * 1e3:.2f} ms, "
              f"{parse_s / max(commit.stats.records, 1) * 1e6:.1f} us per record")
        for verify in args.verify.split(","):
            for kind in args.receivers.split(","):
                if kind == "ckpt":
                    pairing, journal = bench_checkpoint(log, base, expected, verify, args.reps, work, copyto,
                                                        args.ckpt_writes)
                else:
                    pairing, journal = bench_memory(kind, log, base, expected, verify, args.reps, work, copyto,
                                                    args.phases)
                seconds = pairing.op_wall
                gbs = model_bytes / seconds / 1e9
                rows.append((kind, label, verify, seconds, pairing.op_cpu, gbs, 1 / pairing.ratio,
                             journal / seconds))
        shutil.rmtree(root)

    header = ("receiver", "changed", "verify", "apply s", "CPU s", "GB/s", "x copyto", "journal %")
    print()
    print("  ".join(f"{h:>9}" for h in header))
    for kind, label, verify, seconds, cpu, gbs, ratio, share in rows:
        print("  ".join(f"{c:>9}" for c in (kind, label, verify, f"{seconds:.3f}", f"{cpu:.3f}", f"{gbs:.2f}",
                                             f"{ratio:.2f}", f"{share * 100:.1f}")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
