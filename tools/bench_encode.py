"""Encode throughput, paired with xor: ``LogWriter.append`` at each changed rate and dense
``LogWriter.create`` (the default path: baseline cache on), each call timed right beside one
``np.bitwise_xor(base, new, out=prealloc)`` on the same flat arrays (tools/timing.py).

The state is a ``--mib`` MiB bf16 Adam-like step (dcr_log.synthetic.adam_step_pair) cut into
Llama-shaped tensors (tools/bench_delta.py; ``--layout transformer``: dcr_log.synthetic's
transformer, whose rows are not whole pages; ``--layers`` sets its depth, and with it how many
tensors, norms among them, the state has), one new state per ``--rates`` target rate. Appends
alternate new, base, new, ... so every timed append moves the same changes. Reported per
operation: its speed as a fraction of xor's (the median of xor wall / op wall over the pairs),
op seconds and CPU seconds (all threads), and for appends the CPU nanoseconds per changed
element and the changed count.

Usage:

    python tools/bench_encode.py [--mib 256] [--rates 0.01 0.10] [--repeats 1] [--workers N]
                                 [--json] [--profile RATE] [--phases RATE] [--breakdown RATE] [--gil]
                                 [--find-path N] [--sync] [--layout rows|transformer] [--layers 4]
                                 [--reopen]

``--profile RATE`` runs one append at that rate under cProfile and prints the top entries
(cumulative and own time) instead of timing. ``--phases RATE`` runs ``--repeats`` appends at
that rate (to new and back; with ``--sync``, each after an os.sync) and prints the last one's
timeline (tools/phases.py): the cache's pages dropped and faulted in for writing (the faults
on the side thread, shown with the pool's), the encoding on the pool's threads, the segment's
finish, the commit and the baseline's advance.
``--breakdown RATE`` runs the stages of one append's encoding one after another on the
calling thread, chunk by chunk as the writer cuts them, and prints each stage's CPU
nanoseconds per change and per byte of the model: where the CPU goes per change (the
ulp-rans payload of new logs, and for comparison the ulp encoding's keys, gaps and pcodec
files). ``--gil`` runs each heavy call of the write path (change finding, the ulp-rans
coder, the ulp pass, pcodec, digests, byte planes, zstd, pwrite, sha256) on the main thread
while a probe thread counts Python loop iterations, and prints how much of its idle-time
rate the probe kept: near 0 means the call holds the GIL (a pure Python loop is shown for
reference). ``--sync`` runs an untimed ``os.sync`` before each timed append and each xor: the
writer then meets its baseline cache's pages clean, and write-protected by the writeback that
cleaned them, as a trainer does whose steps are farther apart than the kernel's dirty expiry
(30 s by default); back to back, an append finds them still dirty. ``--reopen`` times each
append together with the ``LogWriter.open`` before it and the close after it, as each new
``dcr append`` process opens the log: the baseline mapped anew from the cache, and every cached
word checked against its digest unless the last append sealed the cache
(dcr_log.write.baseline).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import math
import os
import pstats
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_delta import ROW, as_state, tensor_rows  # noqa: E402
from dcr_log import LogWriter  # noqa: E402
from dcr_log.synthetic import adam_step_pair, carve, lr_for_rate, specs_for_params  # noqa: E402
from dcr_log.write.differ import EncodePolicy  # noqa: E402
from timing import Pairing, machine, machine_line, paired  # noqa: E402


def append_phases(writer, base_state, new_state, repeats: int, sync: bool = False) -> None:
    """Appends alternating new and base (each after an untimed ``os.sync`` with ``sync``); the
    last one's timeline."""
    import time

    from dcr_log import pages
    from dcr_log.write import baseline, differ, sharded, uploader
    from phases import Phases

    targets = [(pages, "drop_page_entries"), (pages, "fault_in_for_writing"), (differ.Differ, "diff_box"),
               (uploader.SegmentUploader, "put"),
               (uploader.SegmentUploader, "finish"), (sharded.ShardedWriter, "_decide"),
               (baseline.Baseline, "advance"), (baseline, "scatter_changes")]
    for i in range(repeats):
        if sync:
            os.sync()
        with Phases(targets) as phases:
            t0 = time.perf_counter()
            writer.append(new_state if i % 2 == 0 else base_state)
            t1 = time.perf_counter()
    phases.report(t0, t1, f"append {i + 1} of {repeats}")


def build(mib: int, rates: list[float], seed: int, layout_kind: str = "rows", layers: int = 4):
    """The base, one new state per rate, and the function that cuts flat words into the
    layout's tensors (views, no copy): ``rows``, Llama-shaped matrices of 4096 columns
    (tools/bench_delta.py); ``transformer``, dcr_log.synthetic's transformer of that size,
    whose odd widths (a hidden size of 1904 at 512 MiB, 4 layers) put its rows across page
    boundaries, ``layers`` deep (nine tensors a layer, two of them norms)."""
    if layout_kind == "transformer":
        specs = specs_for_params(mib * (1 << 20) // 2, layers)
        n = sum(math.prod(spec.shape) for spec in specs)
        to_state = functools.partial(carve, specs=specs)
    else:
        n = max(ROW, mib * (1 << 20) // 2 // ROW * ROW)
        to_state = functools.partial(as_state, layout=tensor_rows(n))
    flat = adam_step_pair(n, seed, tuple(lr_for_rate(r) for r in rates))
    return flat[0], flat[1:], to_state


def gil_probe(n: int = 1 << 24) -> list[tuple[str, float, float]]:
    """(call, milliseconds, probe share) for each heavy call of the write path on n bf16
    words, 10% changed."""
    import hashlib
    import os
    import threading
    import time

    from dcr_log import native
    from dcr_log.codec.base import FAST_LITERALS, zstd_compress_planes
    from dcr_log.codec.ulp import _compress

    if native.changes is None or native.digest is None:
        raise SystemExit("the probe needs the C kernels")
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    b = a.copy()
    b[rng.choice(n, n // 10, replace=False)] ^= 1
    pos, bv, nv = np.empty(n, np.int64), np.empty(n, np.uint16), np.empty(n, np.uint16)
    k = native.changes.find(a, b, 2, pos, bv, nv)
    gaps, dist, planes = np.empty(k, np.uint32), np.empty(k, np.int16), np.empty(2 * n, np.uint8)
    native.changes.ulp_prepare(pos[:k], bv[:k], nv[:k], 2, gaps, dist)
    from dcr_log import _rans

    rans_out, rans_scratch = np.empty(_rans.bound(k), np.uint8), np.empty(_rans.scratch(k), np.uint8)
    with tempfile.TemporaryFile() as tmp:
        fd = tmp.fileno()
        calls = {
            "find": lambda: native.changes.find(a, b, 2, pos, bv, nv),
            "ulp-rans encode": lambda: _rans.encode(pos[:k], bv[:k], nv[:k], 2, rans_out, rans_scratch),
            "ulp_prepare": lambda: native.changes.ulp_prepare(pos[:k], bv[:k], nv[:k], 2, gaps, dist),
            "pcodec compress": lambda: _compress(gaps, 8),
            "sum_pair": lambda: native.digest.sum_pair(pos[:k], 0, bv[:k], nv[:k], 2),
            "sum_range": lambda: native.digest.sum_range(a, 2, 0),
            "planes": lambda: native.changes.planes(a, 2, planes),
            "zstd planes": lambda: zstd_compress_planes(planes, n, FAST_LITERALS),
            "pwrite": lambda: os.pwrite(fd, a.data.cast("B"), 0),
            "sha256": lambda: hashlib.sha256(a.data.cast("B")).digest(),
            "copy of positions": lambda: pos[:k].copy(),
            "a Python loop": lambda: sum(range(3_000_000)),
        }
        stop = threading.Event()
        count = [0]

        def probe() -> None:
            while not stop.is_set():
                count[0] += 1

        thread = threading.Thread(target=probe)
        thread.start()
        try:
            c0, t0 = count[0], time.perf_counter()
            time.sleep(0.2)
            idle_rate = (count[0] - c0) / (time.perf_counter() - t0)
            out = []
            for name, call in calls.items():
                call()
                c0, t0 = count[0], time.perf_counter()
                call()
                dt = time.perf_counter() - t0
                out.append((name, dt * 1e3, (count[0] - c0) / (idle_rate * dt)))
        finally:
            stop.set()
            thread.join()
    return out


def breakdown(base: np.ndarray, new: np.ndarray, chunk: int) -> dict:
    """CPU seconds of each encoding stage of one append (sum digests, ulp-rans; the ulp
    encoding's stages beside them), summed over the chunks; each stage is the writer's own
    call."""
    import time

    from dcr_log import native
    from dcr_log.codec.ulp import _compress, distance_dtype
    from dcr_log.digest import sum_pair

    if native.changes is None or native.digest is None:
        raise SystemExit("the breakdown needs the C kernels")
    from dcr_log import _rans

    stages = dict.fromkeys(("find", "copy", "xor values", "ulp-rans", "ulp_prepare", "pcodec gaps",
                            "pcodec distances", "digests"), 0.0)
    rans_out, rans_scratch = np.empty(_rans.bound(chunk), np.uint8), np.empty(_rans.scratch(chunk), np.uint8)
    from dcr_log.write.differ import FIND_SLACK  # the writer's buffers: room for the vector path

    pos = np.empty(chunk + FIND_SLACK, np.int64)
    bv, nv = np.empty(chunk + FIND_SLACK, np.uint16), np.empty(chunk + FIND_SLACK, np.uint16)
    gaps, dist = np.empty(chunk, np.uint32), np.empty(chunk, distance_dtype(np.dtype(np.uint16)))
    total = 0
    clock = time.process_time
    for start in range(0, base.size, chunk):
        b, n = base[start:start + chunk], new[start:start + chunk]
        t0 = clock()
        k = native.changes.find(b, n, 2, pos, bv, nv)
        t1 = clock()
        kept = pos[:k].copy(), nv[:k].copy()
        t2 = clock()
        np.bitwise_xor(bv[:k], nv[:k])
        t3 = clock()
        if k:
            _rans.encode(pos[:k], bv[:k], nv[:k], 2, rans_out, rans_scratch)
        t3r = clock()
        native.changes.ulp_prepare(pos[:k], bv[:k], nv[:k], 2, gaps, dist)
        t4 = clock()
        _compress(gaps[:k], 8)
        t5 = clock()
        _compress(dist[:k], 8)
        t6 = clock()
        sum_pair(pos[:k], start, bv[:k], nv[:k])
        t7 = clock()
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t3r - t3, t4 - t3r, t5 - t4, t6 - t5, t7 - t6)):
            stages[name] += dt
        total += k
        del kept
    return {"changed": total, "bytes": int(base.nbytes), "stages": {
        name: {"cpu_s": dt, "ns_per_change": dt / total * 1e9, "ns_per_byte": dt / base.nbytes * 1e9}
        for name, dt in stages.items()}}


def time_append(writer, base_state, new_state, base, new, xor_out, repeats: int, sync: bool = False,
                reopen=None) -> dict:
    """Appends alternating new, base, new, ... (each moves the same changes), each paired with
    one xor of the flat arrays; the writer is left at base. ``sync``: an untimed ``os.sync``
    before each append and before each xor. ``reopen``: each append by a writer it opens
    (timed with the append) and closes, not by ``writer``."""
    states = [new_state, base_state]
    turn = [0]

    def append():
        w = writer if reopen is None else reopen()
        try:
            w.append(states[turn[0] % 2])
        finally:
            if reopen is not None:
                w.close()
        turn[0] += 1

    def xor():
        np.bitwise_xor(base, new, out=xor_out)

    p = paired(append, xor, repeats, before=os.sync if sync else None)
    if turn[0] % 2:  # (states[1] is the base)
        append()
    return p.summary()


def cap_find_path(path: int) -> None:
    """Every later call of dcr_log._changes.find takes at most vector path ``path``."""
    from dcr_log import native

    real = native.changes
    if real is None:
        raise SystemExit("--find-path: the C change pass is not built")

    class Capped:
        def __getattr__(self, name):
            return getattr(real, name)

        def find(self, *args):
            return real.find(*args[:6], path)

    native.changes = Capped()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.10])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workers", type=int, default=None, help="EncodePolicy.workers (default: the default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", type=float, default=None, metavar="RATE")
    ap.add_argument("--phases", type=float, default=None, metavar="RATE", help="one append's timeline")
    ap.add_argument("--breakdown", type=float, default=None, metavar="RATE")
    ap.add_argument("--gil", action="store_true", help="which calls release the GIL")
    ap.add_argument("--no-create", action="store_true", help="skip timing dense create")
    ap.add_argument("--reopen", action="store_true",
                    help="each timed append by a LogWriter.open of the log, as a new dcr append process does")
    ap.add_argument("--layout", choices=("rows", "transformer"), default="rows",
                    help="how the state is cut into tensors (see build)")
    ap.add_argument("--layers", type=int, default=4,
                    help="--layout transformer: its layers (24 at 512 MiB: 219 tensors, as a 0.3B model has)")
    ap.add_argument("--sync", action="store_true",
                    help="os.sync before each timed append and xor (untimed): the baseline cache's pages clean")
    ap.add_argument("--find-path", type=int, default=None, metavar="N",
                    help="cap the change pass's vector path (0 scalar, 1 AVX2, 2 AVX-512; "
                         "default: the widest the CPU has), to compare them")
    args = ap.parse_args(argv)
    if args.find_path is not None:
        cap_find_path(args.find_path)
    if args.gil:
        for name, ms, share in gil_probe():
            print(f"{name:>22}: {ms:7.1f} ms, the probe thread ran {share:4.0%} of its idle rate")
        return 0
    single = next((r for r in (args.profile, args.breakdown, args.phases) if r is not None), None)
    rates = [single] if single is not None else args.rates
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    base, news, to_state = build(args.mib, rates, args.seed, args.layout, args.layers)
    if args.breakdown is not None:
        report = breakdown(base, news[0], EncodePolicy().chunk_elements)
        print(json.dumps(report) if args.json else "\n".join(
            f"{k:>14}: {v['ns_per_change']:6.1f} ns/change  {v['ns_per_byte']:.3f} ns/byte"
            for k, v in report["stages"].items()) + f"\n{report['changed']} changes")
        return 0
    base_state = to_state(base)
    policy = EncodePolicy() if args.workers is None else replace(EncodePolicy(), workers=args.workers)
    xor_out = np.zeros_like(base)  # pages faulted in before any timed xor
    work = Path(tempfile.mkdtemp(prefix="bench-encode-"))
    report: dict = {"mib": args.mib, "elements": int(base.size), "tensors": len(base_state),
                    "workers": policy.workers, "appends": [], "machine": machine()}
    say(machine_line(report["machine"]))
    say(f"state: {base.size * 2 / (1 << 20):.0f} MiB of bf16 in {len(base_state)} tensors ({args.layout} layout)")
    try:
        writer = LogWriter.create(work / "log", base_state, cache_dir=work / "cache", policy=policy)
        if args.profile is not None:
            new_state = to_state(news[0])
            prof = cProfile.Profile()
            prof.enable()
            writer.append(new_state)
            prof.disable()
            stats = pstats.Stats(prof).strip_dirs()
            stats.sort_stats("cumulative").print_stats(30)
            stats.sort_stats("tottime").print_stats(25)
            stats.print_callers("acquire")
            return 0
        if args.phases is not None:
            append_phases(writer, base_state, to_state(news[0]), max(1, args.repeats), args.sync)
            return 0
        reopen = None
        if args.reopen:  # a writer per append; the creating one lets go of its baseline
            writer.close()
            reopen = functools.partial(LogWriter.open, work / "log", cache_dir=work / "cache", policy=policy)
        for rate, new in zip(rates, news):
            k = int(np.count_nonzero(base != new))
            s = time_append(writer, base_state, to_state(new), base, new, xor_out, args.repeats, args.sync,
                            reopen)
            s.update(rate=rate, changed=k, cpu_ns_per_change=s["op_cpu_s"] / k * 1e9,
                     speed_vs_xor=1 / s["ratio"])
            report["appends"].append(s)
            say(f"append {rate:.0%}: {1 / s['ratio']:.3f}x xor's speed ({s['op_s']:.3f} s wall, "
                f"{s['op_cpu_s']:.3f} s cpu, {s['cpu_ns_per_change']:.1f} ns cpu/change, k={k}; "
                f"xor {s['baseline_s']:.4f} s)")
        writer.close()
        if not args.no_create:
            dirs = iter(range(1 << 30))

            def create():
                d = work / f"c{next(dirs)}"
                LogWriter.create(d / "log", base_state, cache_dir=d / "cache", policy=policy).close()

            def xor0():
                np.bitwise_xor(base, news[0], out=xor_out)

            pairs = []
            for _ in range(args.repeats):
                pairs.append(paired(create, xor0, 1))
                for d in work.glob("c*"):
                    shutil.rmtree(d)
            s = Pairing.join(pairs).summary()
            s["speed_vs_xor"] = 1 / s["ratio"]
            report["create"] = s
            say(f"dense create: {1 / s['ratio']:.3f}x xor's speed ({s['op_s']:.3f} s wall, "
                f"{s['op_cpu_s']:.3f} s cpu; xor {s['baseline_s']:.4f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
