"""Per-change costs of encode and apply: nanoseconds of CPU (and of wall time) per changed
element, separated from the pass over the model's bytes, on one core and on every core.

Data: an Adam-like bf16 state (dcr_log.synthetic.adam_step_pair: warm moments, fp32 master
stored as bf16; changed positions spread evenly over every tensor) of ``--gib`` GiB cut into
Llama-shaped tensors (tools/bench_delta.py), one new state per ``--rates`` target changed
fraction (default 0.5, 1, 3, 5 and 10%).

Operations, each timed beside one ``np.bitwise_xor(base, new, out=prealloc)`` (tools/timing.py
``paired``, ABAB), with every library default (the writer's baseline cache built and advanced
under the run's temporary directory through ``$DCR_CACHE_DIR``, default verification):

- ``encode``: ``LogWriter.append``; the versions alternate new, base, new, ... so every append
  moves the same changes;
- ``apply_numpy``: a numpy ``Receiver`` following the log (``apply(log, to=v)``);
- ``replay``: ``DeltaLog.apply_version`` of each version onto the state holding its parent.

Every applied state is checked bit-exact (integer views) against the state the writer logged.

The fit: ``time = a * bytes + b * changes``, least squares over every measurement of every rate
(the model's bytes are the same at every rate, so ``a * bytes`` is the rate-independent part:
the full passes over the model and the per-call costs; ``b`` is the cost of one more change).
Three fits per operation: process CPU time (every thread), wall time, and wall time scaled by
its paired xor (``t * median(xor) / xor``: the load that the machine's other users put on
each measurement, taken out as far as xor feels it).

Modes, each in its own child process: ``one-core`` (the process pinned to one CPU before it
starts, so that wall time is CPU time on one core and every thread shares that core) and
``default`` (every CPU this process may use).

Encode stages (one core, on the same boxes the writer encodes: each tensor in row blocks of
the writer's chunk size), each stage's function timed directly, inputs prepared untimed:
``find_changes`` (change detection), ``rans`` (the ``ulp-rans`` payload of new logs: keys,
gaps, bins and the rANS coder in one C call), for comparison the older ``ulp`` encoding's
``ulp keys`` (the order-preserving keys and signed distances), ``gaps`` (positions to gaps) and
``pcodec`` (its two pcodec files), ``choose`` (the registry trying every encoding the log
allows: the ulp-rans payload, plus any sparse or dense (zstd) attempt and the registry's own
cost), ``digests`` (the records' base and target sum digests), ``diff_box`` (the whole record:
detection, encoding, digests), and ``segment`` (records into an Arrow IPC segment file, and
its sha256). Each is fitted the same way.

Apply stages (one core, on the records of the rate's first version, whose parent is the base
state, as a numpy receiver's pass one and write pass take them): ``read`` (the segments read,
hashed and parsed, as read_segment_records), ``decode`` (each record's payload into positions
and values; a row block's as the tensor's flat positions, its flat start the decoder's
origin, as the receiver decodes them), ``positions`` (the records' flat positions: the
decoded array itself for a row block, a mapped copy for other boxes), ``classify`` (the
words at those positions, the words the records lead to, and both digest parts: one C call a
record, as the receiver makes it: GroupDigests.classify) and ``scatter`` (the targets written
into a copy of the base words). "rest of apply" is the receiver's apply less the stages: the
journal, the undo images a memory storage keeps, verify's tensor digests, the pool's hops and
the Python between them.

    python tools/bench_percost.py [--gib 0.25] [--rates 0.005 0.01 0.03 0.05 0.10] [--repeats 3] [--json]

``--json`` prints the report as JSON on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_delta import as_state, tensor_rows  # noqa: E402
from bench_side import default_cache, elements_for  # noqa: E402
from dcr_log import DeltaLog, LogWriter  # noqa: E402
from dcr_log.codec import Attempt, ChangeSet, choose  # noqa: E402
from dcr_log.codec.base import delta_positions  # noqa: E402
from dcr_log.codec.ulp import _compress, distance_dtype, ulp_distance  # noqa: E402
from dcr_log.codec.ulp_rans import UlpRansEncoding  # noqa: E402
from dcr_log.collective import LocalGroup  # noqa: E402
from dcr_log.coords import box_view, row_blocks  # noqa: E402
from dcr_log.digest import scheme_for  # noqa: E402
from dcr_log.format import Record  # noqa: E402
from dcr_log.format.segment import SegmentBuilder  # noqa: E402
from dcr_log.log.records import (  # noqa: E402
    decode_record,
    flat_positions,
    scatter_words,
)
from dcr_log.receiver import NumpyStorage, Receiver  # noqa: E402
from dcr_log.receiver.context import GroupDigests  # noqa: E402
from dcr_log.synthetic import adam_step_pair, lr_for_rate  # noqa: E402
from dcr_log.write.differ import DEFAULT_CHUNK_ELEMENTS, Differ, EncodePolicy, _Scratch, find_changes  # noqa: E402
from dcr_log.write.sharded import DEFAULT_FEATURES  # noqa: E402
from timing import Pairing, machine, machine_line, paired  # noqa: E402

RATES = (0.005, 0.01, 0.03, 0.05, 0.10)
MODES = ("one-core", "default")
OPS = ("encode", "apply_numpy", "replay")
STAGES = ("find_changes", "rans", "ulp_keys", "gaps", "pcodec", "choose", "digests", "diff_box", "segment")
APPLY_STAGES = ("read", "decode", "positions", "classify", "scatter")


def fit(model_bytes: list[int], changes: list[int], seconds: list[float]) -> dict:
    """Least squares ``seconds = a * bytes + b * changes``: a in ns per byte, b in ns per change,
    and how well the line holds (r2; the largest residual relative to the measurement)."""
    x = np.column_stack([np.asarray(model_bytes, float), np.asarray(changes, float)])
    y = np.asarray(seconds, float)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"ns_per_byte": float(coef[0]) * 1e9, "ns_per_change": float(coef[1]) * 1e9,
            "fixed_ms": float(coef[0]) * model_bytes[0] * 1e3,  # a * bytes: the rate-independent part
            "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "max_residual": float(np.max(np.abs(y - pred) / y)), "points": int(y.size)}


def fits_of(samples: list[dict], pairings: list[Pairing], model_bytes: int) -> dict:
    """The three fits of one operation's measurements (``samples[i]`` holds the changes of
    ``pairings[i]``, one op call beside one xor)."""
    ks = [s["k"] for s in samples]
    nb = [model_bytes] * len(samples)
    joined = Pairing.join(pairings)
    return {"cpu": fit(nb, ks, [o.cpu for o in joined.op]),
            "wall": fit(nb, ks, [o.wall for o in joined.op]),
            "wall_load_scaled": fit(nb, ks, list(joined.load_scaled_op_walls))}


def check_flat(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    if not np.array_equal(got, expected):
        raise SystemExit(f"{what}: not bit-exact")


def flat_words(state: dict, names: list[str]) -> np.ndarray:
    return np.concatenate([state[k].words.reshape(-1) for k in names])


# -- the stages of encode ------------------------------------------------------------------------

def stage_costs(base_state, new_state, k: int, repeats: int) -> dict[str, float]:
    """CPU seconds (median of ``repeats``) of each encode stage over every box of the pair."""
    features = frozenset(DEFAULT_FEATURES)
    policy = EncodePolicy()
    digests = scheme_for(features)
    differ = Differ(policy, digests, features=features)
    scratch = _Scratch()
    boxes = []
    for name, b in base_state.items():
        for box in row_blocks(b.shape, DEFAULT_CHUNK_ELEMENTS):
            boxes.append((name, b.shape, box, box_view(b.words, b.shape, box),
                          box_view(new_state[name].words, b.shape, box)))
    found = [find_changes(bb, nb, scratch) for *_, bb, nb in boxes]
    if sum(p.size for p, _, _ in found) != k:
        raise SystemExit("stage inputs: find_changes found another number of changes than the pair holds")
    signed = [ulp_distance(bv, nv).view(np.int16).astype(distance_dtype(bv.dtype), copy=False)
              for _, bv, nv in found]

    def gaps_of(positions: np.ndarray) -> np.ndarray:  # as UlpEncoding.encode does
        g = np.empty(positions.size, dtype=np.int64)
        g[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=g[1:])
        g[1:] -= 1
        return g.astype("<u4")

    gaps = [gaps_of(p) for p, _, _ in found if p.size]

    def do_find():
        for *_, bb, nb in boxes:
            find_changes(bb, nb, scratch)

    def do_keys():
        for _, bv, nv in found:
            ulp_distance(bv, nv).view(np.int16).astype(distance_dtype(bv.dtype), copy=False)

    def do_gaps():
        for p, _, _ in found:
            if p.size:
                gaps_of(delta_positions(ChangeSet(p.size, p, p)).astype(np.int64, copy=False))

    def do_pcodec():
        for g, s in zip(gaps, (s for (p, _, _), s in zip(found, signed) if p.size)):
            _compress(g, policy.ulp_level)
            _compress(s, policy.ulp_level)

    rans = UlpRansEncoding()

    def do_rans():
        for (*_, nb), (p, bv, nv) in zip(boxes, found):
            if p.size:
                rans.encode("xor", ChangeSet(nb.size, p, bv), base=bv, new=nv, buffer=scratch.get)

    xors = [np.bitwise_xor(bv, nv) for _, bv, nv in found]  # the record's values, made by diff_box

    def do_choose():
        for (*_, bb, nb), (p, bv, nv), x in zip(boxes, found, xors):
            if p.size:
                full = functools.partial(np.bitwise_xor, bb, nb, out=scratch.get("xor", nb.dtype, nb.size))
                choose(Attempt("xor", ChangeSet(nb.size, p, x), bv, nv, policy, full, buffer=scratch.get), features)

    def do_digests():  # as diff_box computes them (one pass for a row block's pair)
        for (_, shape, box, _, _), (p, bv, nv) in zip(boxes, found):
            digests.record(box, shape, p, bv, nv)

    records: list[Record] = []

    def do_diff():
        records.clear()
        for name, shape, box, bb, nb in boxes:
            delta = differ.diff_box(name, box, shape, bb, nb, "xor")
            if delta is not None:
                records.append(delta.record)

    def do_segment():
        builder = SegmentBuilder("bench-percost", 1)
        for r in records:
            builder.add(r)
        sink = io.BytesIO()
        builder.write_to(sink)
        hashlib.sha256(sink.getbuffer()).hexdigest()

    out: dict = stage_seconds(STAGES, (do_find, do_rans, do_keys, do_gaps, do_pcodec, do_choose, do_digests,
                                       do_diff, do_segment), repeats)
    out["encodings"] = sorted({r.encoding for r in records})
    return out


def stage_seconds(stages, fns, repeats: int) -> dict[str, float]:
    """Per stage, the median CPU seconds of ``repeats`` calls of its function, after one
    untimed call (buffers sized, pages touched)."""
    out = {}
    for stage, fn in zip(stages, fns):
        fn()
        cpu = []
        for _ in range(repeats):
            c0 = time.process_time()
            fn()
            cpu.append(time.process_time() - c0)
        out[stage] = statistics.median(cpu)
    return out


# -- the stages of apply -------------------------------------------------------------------------

def apply_stage_costs(reader: DeltaLog, version: int, base_state, repeats: int) -> dict[str, float]:
    """CPU seconds (median of ``repeats``) of each apply stage over every record of ``version``,
    whose parent state is ``base_state``; each stage's inputs are made by the stages before it,
    untimed, and checked against the records' digests (the classification's digest parts)."""
    commit = reader.commit(version)
    table = {t.name: t for t in commit.tensors}
    digests = reader.digests
    written = {name: b.words.reshape(-1).copy() for name, b in base_state.items()}  # the scatter's storage

    def do_read():
        out = []
        for ref in commit.segments:
            _, recs, check = reader.read_segment_records(ref, version)
            check()
            out.extend(recs)
        return out

    records = do_read()
    decoded = [decode_record(r, table[r.tensor], flat=True) for r in records]
    where = [flat_positions(r, table[r.tensor].shape, c) for r, c in zip(records, decoded)]

    # The receiver's classification over a numpy storage of the base words (one C call a
    # record where it takes it, the calls in turn otherwise).
    storage = NumpyStorage(dict(base_state))
    parts = GroupDigests(storage, LocalGroup(), digests)

    def classify(r: Record, c, w):
        place = storage.locate(r.tensor, w)
        return parts.classify(place, w, r.kind, c, storage.select(place, c.values))

    classified = [classify(r, c, w) for r, c, w in zip(records, decoded, where)]
    targets = [t for _, t, _, _ in classified]
    for r, (_, _, d, d_target) in zip(records, classified):
        if d != r.base_digest or d_target != r.target_digest:
            raise SystemExit(f"apply stages: a record of {r.tensor!r} does not lead from its base to its target")

    def do_decode():
        for r in records:
            decode_record(r, table[r.tensor], flat=True)

    def do_positions():
        for r, c in zip(records, decoded):
            flat_positions(r, table[r.tensor].shape, c)

    def do_classify():
        for r, c, w in zip(records, decoded, where):
            classify(r, c, w)

    def do_scatter():
        for r, w, t in zip(records, where, targets):
            scatter_words(written[r.tensor], w, t)

    return stage_seconds(APPLY_STAGES, (do_read, do_decode, do_positions, do_classify, do_scatter), repeats)


# -- one mode, in a child process ----------------------------------------------------------------

def run_mode(mode: str, gib: float, rates: list[float], lrs: list[float], repeats: int, seed: int,
             work: Path, say) -> dict:
    n = elements_for(gib)
    layout = tensor_rows(n)
    names = [name for name, _ in layout]
    t0 = time.perf_counter()
    flat = adam_step_pair(n, seed, tuple(lrs))
    base, news = flat[0], flat[1:]
    base_state = as_state(base, layout)
    say(f"[{mode}] generated {len(news)} pairs of {2 * n / 2**30:.3f} GiB in {time.perf_counter() - t0:.1f} s")
    model_bytes = 2 * n
    scratch = np.empty(n, dtype=np.uint16)

    with default_cache(work / "cache"):
        writer = LogWriter.create(work / "log", base_state)
        reader = DeltaLog.open(work / "log")
        replay_state = reader.materialize(0)
        rx_words = base.copy()
        rx_tensors = as_state(rx_words, layout)
        samples: dict[str, list[dict]] = {op: [] for op in OPS}
        pairings: dict[str, list[Pairing]] = {op: [] for op in OPS}
        stages: list[dict] = []
        apply_stages: list[dict] = []
        changes = []
        with Receiver.open(rx_tensors, work / "journal") as rx:
            rx.bind(reader, 0, verify="none")
            for rate, new in zip(rates, news):
                new_state = as_state(new, layout)
                k = int(np.count_nonzero(base != new))
                changes.append(k)
                xor = functools.partial(np.bitwise_xor, base, new, out=scratch)
                for i in range(2 * repeats):  # new, base, new, ...: every version moves the same k changes
                    target, target_state = (new, new_state) if i % 2 == 0 else (base, base_state)
                    commits: list = []
                    p = paired(lambda c=commits, t=target_state: c.append(writer.append(t)), xor, 1)
                    commit = commits[0]
                    if commit.stats.changed_elements != k:
                        raise SystemExit(f"append recorded {commit.stats.changed_elements} changes, expected {k}")
                    version = commit.version
                    if i == 0:
                        first_version = version  # its parent holds the base state
                    timings = {"encode": p}
                    timings["replay"] = paired(lambda v=version: reader.apply_version(replay_state, v), xor, 1)
                    applied: list[int] = []
                    timings["apply_numpy"] = paired(lambda a=applied, v=version: a.extend(rx.apply(reader, to=v)),
                                                    xor, 1)
                    if applied != [version]:
                        raise SystemExit(f"the receiver applied {applied}, expected [{version}]")
                    check_flat(flat_words(replay_state, names), target, f"replay of version {version}")
                    check_flat(rx_words, target, f"numpy receiver at version {version}")
                    for op, pairing in timings.items():
                        pairings[op].append(pairing)
                        samples[op].append({"rate": rate, "k": k, "wall": pairing.op[0].wall,
                                            "cpu": pairing.op[0].cpu, "xor": pairing.baseline[0].wall})
                say(f"[{mode}] {100 * k / n:.2f}% changed: encode "
                    f"{statistics.median(s['cpu'] for s in samples['encode'] if s['k'] == k):.3f} s CPU")
                if mode == "one-core":
                    stages.append(stage_costs(base_state, new_state, k, repeats))
                    apply_stages.append(apply_stage_costs(reader, first_version, base_state, repeats))
        writer.close()
    out: dict = {"mode": mode, "cpus": sorted(os.sched_getaffinity(0)), "elements": n, "model_bytes": model_bytes,
                 "changes": changes, "fits": {op: fits_of(samples[op], pairings[op], model_bytes) for op in OPS},
                 "samples": samples}
    if stages:
        out["stages"] = {st: fit([model_bytes] * len(changes), changes, [s[st] for s in stages]) for st in STAGES}
        out["stage_seconds"] = stages
        out["apply_stages"] = {st: fit([model_bytes] * len(changes), changes, [s[st] for s in apply_stages])
                               for st in APPLY_STAGES}
        out["apply_stage_seconds"] = apply_stages
    return out


def run(args, say) -> dict:
    n = elements_for(args.gib)
    t0 = time.perf_counter()
    lrs = [lr_for_rate(r) for r in args.rates]
    say(f"learning rates for {args.rates}: {', '.join(f'{lr:.3g}' for lr in lrs)} ({time.perf_counter() - t0:.1f} s)")
    cpus = sorted(os.sched_getaffinity(0))
    modes = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix=f"dcr-bench-percost-{mode}-") as tmp:
            pin = (lambda: os.sched_setaffinity(0, {cpus[-1]})) if mode == "one-core" else None
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--work", tmp,
                   "--gib", repr(args.gib), "--repeats", str(args.repeats), "--seed", str(args.seed),
                   "--rates", *map(repr, args.rates), "--lrs", *map(repr, lrs)]
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=pin)
            if proc.returncode != 0:
                raise SystemExit(f"the {mode} child failed (exit {proc.returncode})")
            modes[mode] = json.loads(proc.stdout)
    return {"gib": 2 * n / 2**30, "elements": n, "rates": list(args.rates), "lrs": lrs, "repeats": args.repeats,
            "seed": args.seed, "cpus": len(cpus), "load_average": os.getloadavg()[0], "machine": machine(),
            "modes": modes}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    changes = report["modes"]["one-core"]["changes"]
    rates = ", ".join(f"{100 * r:g}%" for r in report["rates"])
    table = Table("operation", "mode", "CPU ns/change", "CPU fixed ms", "CPU r2", "wall ns/change", "wall fixed ms",
                  "wall (load-scaled) ns/change", "wall r2",
                  title=f"{report['gib']:.3f} GiB bf16, {len(changes)} rates ({rates}), "
                        f"{2 * report['repeats']} timed calls per rate; time = a * bytes + b * changes "
                        "(fixed = a * bytes: the passes over the model and per-call costs)",
                  title_justify="left")
    for op in OPS:
        for mode in MODES:
            f = report["modes"][mode]["fits"][op]
            table.add_row(op, mode, f"{f['cpu']['ns_per_change']:.1f}", f"{f['cpu']['fixed_ms']:.1f}",
                          f"{f['cpu']['r2']:.3f}", f"{f['wall']['ns_per_change']:.1f}", f"{f['wall']['fixed_ms']:.1f}",
                          f"{f['wall_load_scaled']['ns_per_change']:.1f}", f"{f['wall']['r2']:.3f}")
    console.print(table)
    one = report["modes"]["one-core"]
    if "stages" in one:
        st = Table("encode stage", "CPU ns/change", "CPU fixed ms", "r2",
                   title="encode by stage, one core (each stage's functions timed directly on the writer's boxes)",
                   title_justify="left")
        for stage in STAGES:
            f = one["stages"][stage]
            st.add_row(stage, f"{f['ns_per_change']:.1f}", f"{f['fixed_ms']:.1f}", f"{f['r2']:.3f}")
        enc = one["fits"]["encode"]["cpu"]
        parts = (one["stages"]["diff_box"], one["stages"]["segment"])
        rest_ns = enc["ns_per_change"] - sum(p["ns_per_change"] for p in parts)
        rest_ms = enc["fixed_ms"] - sum(p["fixed_ms"] for p in parts)
        st.add_row("rest of append", f"{rest_ns:.1f}", f"{rest_ms:.1f}", "-")
        console.print(st)
        console.print("rest of append = LogWriter.append (one core, CPU) minus diff_box and segment: the baseline "
                      "and its cache advanced, the store's writes, the commit, Python. choose includes the rans "
                      "stage (ulp keys, gaps and pcodec are the older ulp encoding's, not on the default path); "
                      f"encodings chosen: {one['stage_seconds'][0]['encodings']}")
    if "apply_stages" in one:
        at = Table("apply stage", "CPU ns/change", "CPU fixed ms", "r2",
                   title="apply by stage, one core (each stage's functions timed directly on the records of a "
                         "version whose parent is the base state)", title_justify="left")
        for stage in APPLY_STAGES:
            f = one["apply_stages"][stage]
            at.add_row(stage, f"{f['ns_per_change']:.1f}", f"{f['fixed_ms']:.1f}", f"{f['r2']:.3f}")
        app = one["fits"]["apply_numpy"]["cpu"]
        parts = [one["apply_stages"][s] for s in APPLY_STAGES]
        at.add_row("rest of apply", f"{app['ns_per_change'] - sum(p['ns_per_change'] for p in parts):.1f}",
                   f"{app['fixed_ms'] - sum(p['fixed_ms'] for p in parts):.1f}", "-")
        console.print(at)
        console.print("rest of apply = the numpy receiver's apply (one core, CPU) minus the stages: the journal, "
                      "the undo images, verify's tensor digests, the pool's hops and the Python between them")
    console.print(f"{report['cpus']} CPUs, load average {report['load_average']:.2f} at the end")
    console.print(machine_line(report["machine"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.25, help="size of the bf16 state in GiB (default 0.25)")
    ap.add_argument("--rates", type=float, nargs="+", default=list(RATES), help="target changed fractions")
    ap.add_argument("--repeats", type=int, default=3,
                    help="per rate: pairs of appends (new, then base), and timings of each stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lrs", type=float, nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if len(set(args.rates)) < 2:
        ap.error("the fit needs at least two different rates")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)
    if args.child is not None:
        result = run_mode(args.child, args.gib, args.rates, args.lrs, args.repeats, args.seed, args.work, say)
        shutil.rmtree(args.work / "log", ignore_errors=True)
        print(json.dumps(result))
        return 0
    report = run(args, say if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
