#!/usr/bin/env python
"""Exactness and throughput of dcr_log.torch_ops on one device, against torch.bitwise_xor.

    python tools/gpu_check.py [--device cuda|cpu|cuda:1] [--gib 1] [--reps 5] [--json]

Meant to be run once on a machine with a CUDA GPU (it runs on the CPU too, with
``--device cpu``; it says which device it used). It installs nothing.

It builds a bf16 pair of ``--gib`` GiB on the device: ``base`` = normal weights * 0.02 (fp32
rounded to bf16), and for 1% and 3% a ``new`` in which a random subset of that rate moved by
one unit in the last place (step_from with distances of +-1: every chosen word changes, so
the changed positions are known exactly). Then, timed (after a warm-up, synchronized on
CUDA, each call paired with one torch.bitwise_xor right after it, ``--reps`` pairs:
tools/timing.py): torch.bitwise_xor of the word views (the yardstick: one pass reading two
models and writing one), find_changes, ulp_distance of the changed words, the apply of the
changes to a copy of base (xor words, relative ulp distances, overwrite), and
to_device_changes of host numpy arrays of the 1% changes. One line per measurement: name,
median seconds, GB/s of model bytes (2 bytes per element of one model), time as a multiple of
the xor's (the median pair's).

Checked bit for bit (every check compares integer views, never floats):
- find_changes on the whole device tensor finds exactly the chosen positions, and on a
  prefix (``--prefix`` elements, default 64 Mi) equals dcr_log.write.differ.find_changes (and
  find_changes_numpy where the library has it) run on host copies;
- ulp_distance of the found words equals dcr_log.codec.ulp.ulp_distance on the prefix, and
  the +-1 distances the pair was built with;
- applying the xor words, the relative distances and the overwrite values to a copy of base
  gives exactly new (torch.equal of the int16 views);
- to_device_changes carries positions and words exactly;
- sum_digest on the device (a sum digest of the whole model is also timed) equals the host's
  sum digest (dcr_log.digest) on the prefix;
- a round trip through the library: a small dcr-log log (version 0 a slice of base, version 1
  the same slice of new) applied by a torch Receiver holding device tensors, and the log's
  decoded records applied on the device with apply_changes, both give exactly new (off the
  CPU the receiver keeps words and digests on the device: device_words).

Ends with ``exact: yes`` or ``exact: no``; exits 1 if any check failed (3 if dcr_log could not
be imported, so the library checks could not run). ``--json`` also prints a JSON report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import paired  # noqa: E402

LIBRARY_ERROR: str | None = None
try:
    import dcr_log
    from dcr_log import torch_ops as T
except Exception as exc:  # pragma: no cover - a device machine without the library's deps
    LIBRARY_ERROR = f"{type(exc).__name__}: {exc}"
    dcr_log = None
    # torch_ops needs only torch and numpy: load it by path so the device checks still run.
    spec = importlib.util.spec_from_file_location("dcr_torch_ops", ROOT / "dcr_log" / "torch_ops.py")
    T = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(T)

RATES = (0.01, 0.03)
GEN_CHUNK = 1 << 26  # elements generated at a time (bounds the fp32 temporaries)
ROUNDTRIP_ELEMENTS = 1 << 20  # elements of the slice that goes through a real log


class Checker:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def check(self, name: str, fn) -> bool:
        """Run one check: fn() returns True, False or (bool, detail); an exception fails it."""
        try:
            out = fn()
            ok, detail = out if isinstance(out, tuple) else (out, "")
            ok = bool(ok)
        except Exception as exc:  # a check that cannot run has failed
            ok, detail = False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        self.results.append({"name": name, "ok": ok, "detail": detail})
        print(f"check {name:<54} {'ok' if ok else 'FAILED'}{'  ' + detail if detail else ''}", flush=True)
        return ok

    def skip(self, name: str, why: str) -> None:
        self.results.append({"name": name, "ok": None, "detail": why})
        print(f"check {name:<54} NOT RUN  {why}", flush=True)

    @property
    def exact(self) -> bool:
        return all(r["ok"] is True for r in self.results)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn, device: torch.device):
    """``fn`` and a wait for the device to finish it: what a timed call must include on CUDA."""

    def call() -> None:
        fn()
        sync(device)

    return call


def make_base(n: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    base = torch.empty(n, dtype=torch.bfloat16, device=device)
    for s in range(0, n, GEN_CHUNK):
        e = min(s + GEN_CHUNK, n)
        base[s:e] = (torch.randn(e - s, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    return base


def make_new(base: torch.Tensor, rate: float, gen: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``base`` with a random ``rate`` of its words moved by +-1 ulp: (new, the positions,
    the distances), positions increasing."""
    device = base.device
    bw = T.word_view(base)
    new = base.clone()
    nw = T.word_view(new)
    chosen, steps = [], []
    n = bw.numel()
    for s in range(0, n, GEN_CHUNK):
        e = min(s + GEN_CHUNK, n)
        idx = torch.nonzero(torch.rand(e - s, generator=gen, device=device) < rate).view(-1) + s
        d = torch.randint(0, 2, (idx.numel(),), generator=gen, device=device, dtype=torch.int16) * 2 - 1
        nw[idx] = T.step_from(bw[idx], d)
        chosen.append(idx)
        steps.append(d)
    return new, torch.cat(chosen), torch.cat(steps)


def host_words(t: torch.Tensor) -> np.ndarray:
    """Unsigned numpy words of a device tensor (a copy on the host)."""
    arr = T.word_view(t).cpu().numpy()
    return arr.view(arr.dtype.str.replace("i", "u"))


def host_u(words: torch.Tensor) -> np.ndarray:
    """Unsigned numpy words of signed device words (a copy on the host)."""
    arr = words.cpu().numpy()
    return arr.view(arr.dtype.str.replace("i", "u"))


def library_checks(ck: Checker, base: torch.Tensor, new: torch.Tensor, device: torch.device) -> None:
    from dcr_log import DeltaLog, LogWriter
    from dcr_log.log.records import decode_record, flat_positions
    from dcr_log.receiver import Receiver
    from dcr_log.write.differ import EncodePolicy

    m = min(base.numel(), ROUNDTRIP_ELEMENTS)
    cols = 1024 if m % 1024 == 0 else 1
    shape = (m // cols, cols) if cols > 1 else (m,)
    base_cpu = base[:m].cpu().reshape(shape).clone()
    new_cpu = new[:m].cpu().reshape(shape).clone()
    new_dev = new[:m].reshape(shape)
    encodings: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dcr-gpu-check-") as tmp:
        tmp = Path(tmp)
        # Several boxes (records), so that the receiver applies more than one record per tensor.
        policy = EncodePolicy(chunk_elements=max(cols, m // 4))
        writer = LogWriter.create(tmp / "log", {"w": base_cpu}, cache_dir=False, policy=policy)
        writer.append({"w": new_cpu})
        log = DeltaLog.open(tmp / "log")
        records = list(log.records(1))
        encodings = sorted({f"{r.kind}/{r.encoding}" for r in records})

        def receiver() -> tuple[bool, str]:
            tensors = {"w": base_cpu.to(device).clone()}
            with Receiver.open(tensors, tmp / "journal", device=device) as rx:
                on_device = rx.storage.device_words  # words and digests on the device off the CPU
                rx.bind(log, 0)
                applied = rx.apply(log, verify="full")
            got = tensors["w"]
            ok = (applied == [1] and got.device.type == device.type
                  and on_device == (device.type != "cpu")
                  and torch.equal(T.word_view(got), T.word_view(new_dev.contiguous())))
            return ok, f"applied {applied} on {got.device}, device_words {on_device}, records {encodings}"

        ck.check("library: torch Receiver on device == new", receiver)

        def decoded() -> tuple[bool, str]:
            info = log.commit(1).tensor_map()["w"]
            flat = T.word_view(base_cpu.to(device).clone())
            for rec in records:
                changes = decode_record(rec, info)
                where = flat_positions(rec, info.shape, changes)
                if isinstance(where, slice):
                    vals = torch.from_numpy(changes.values.view(np.int16).copy()).to(device)
                    T.apply_changes(flat, where, vals, rec.kind, changes.relative)
                else:
                    pos, vals = T.to_device_changes(where, changes.values, device)
                    T.apply_changes(flat, pos, vals, rec.kind, changes.relative)
            ok = torch.equal(flat, T.word_view(new_dev.contiguous()))
            return ok, f"{len(records)} records"

        ck.check("library: decoded records + apply_changes == new", decoded)


def run(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(f"gpu_check: device {device} asked for, but torch.cuda.is_available() is False "
                  f"(torch {torch.__version__})", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    print(f"device: {device} ({name}); torch {torch.__version__}; numpy {np.__version__}", flush=True)
    if LIBRARY_ERROR:
        print(f"dcr_log not importable ({LIBRARY_ERROR}): torch_ops loaded by path, library checks not run",
              flush=True)

    n = max(1024, int(args.gib * (1 << 30)) // 2)
    model_bytes = 2 * n
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    t0 = time.perf_counter()
    base = make_base(n, device, gen)
    pairs = {r: make_new(base, r, gen) for r in RATES}
    sync(device)
    print(f"built bf16 pair: {n} elements ({model_bytes / 2**30:.3f} GiB per model) in "
          f"{time.perf_counter() - t0:.1f} s; changed: "
          + ", ".join(f"{100 * r:g}% -> {pairs[r][1].numel()} ({100 * pairs[r][1].numel() / n:.3f}%)"
                      for r in RATES), flush=True)

    ck = Checker()
    measurements: list[dict] = []
    bw = T.word_view(base)

    nw1 = T.word_view(pairs[RATES[0]][0])
    out = torch.empty_like(bw)
    xor = synced(lambda: torch.bitwise_xor(bw, nw1, out=out), device)

    def measure(label: str, fn) -> float:
        call = synced(fn, device)
        call()  # warm-up (allocator, kernels)
        pairing = paired(call, xor, args.reps, before=lambda: sync(device))
        sec = pairing.op_wall
        row = {"name": label, "seconds": sec, "gb_per_s": model_bytes / sec / 1e9,
               "x_xor_time": pairing.ratio if measurements else 1.0, "spread": list(pairing.spread)}
        measurements.append(row)
        print(f"{label:<34} {sec:11.6f} s {row['gb_per_s']:9.2f} GB/s {row['x_xor_time']:8.3f} x xor",
              flush=True)
        return sec

    measure("bitwise_xor (full model)", lambda: torch.bitwise_xor(bw, nw1, out=out))
    measure("sum_digest (full model)", lambda: T.sum_digest(bw))

    scratch = base.clone()
    sw = T.word_view(scratch)
    found = {}
    for r in RATES:
        new, chosen, steps = pairs[r]
        nw = T.word_view(new)
        tag = f"{100 * r:g}%"
        measure(f"find_changes {tag}", lambda: T.find_changes(bw, nw))
        pos, bv, nv = T.find_changes(bw, nw)
        found[r] = (pos, bv, nv)
        xv = torch.bitwise_xor(bv, nv)
        measure(f"ulp_distance {tag}", lambda: T.ulp_distance(bv, nv))
        dist = T.ulp_distance(bv, nv)
        measure(f"apply_changes xor {tag}", lambda: T.apply_changes(sw, pos, xv, "xor"))
        measure(f"apply_changes ulp (relative) {tag}", lambda: T.apply_changes(sw, pos, dist, "xor", True))
        measure(f"apply_changes overwrite {tag}", lambda: T.apply_changes(sw, pos, nv, "overwrite"))
        if r == RATES[0]:
            pos_np = pos.cpu().numpy()
            vals_np = host_u(xv)
            measure(f"to_device_changes {tag}", lambda: T.to_device_changes(pos_np, vals_np, device))
    scratch = sw = None  # freed (closures above refer to them)

    # --- exactness ---------------------------------------------------------------------------
    prefix = min(n, args.prefix)
    if LIBRARY_ERROR is None:
        from dcr_log.digest import SUM

        ck.check("sum_digest == digest.SUM on the host (prefix)",
                 lambda: T.sum_digest(bw[:prefix]) == SUM.tensor(host_u(bw[:prefix]), (prefix,)))
    for r in RATES:
        new, chosen, steps = pairs[r]
        nw = T.word_view(new)
        pos, bv, nv = found[r]
        tag = f"{100 * r:g}%"

        ck.check(f"find_changes {tag}: exactly the changed positions",
                 lambda: (torch.equal(pos, chosen) and torch.equal(bv, bw[chosen]) and torch.equal(nv, nw[chosen]),
                          f"{pos.numel()} found, {chosen.numel()} changed"))

        hb, hn = host_words(base[:prefix]), host_words(new[:prefix])
        dp, db, dn = T.find_changes(base[:prefix], new[:prefix])
        got = (dp.cpu().numpy(), host_u(db), host_u(dn))
        if dcr_log is None:
            ck.skip(f"find_changes {tag} == dcr_log.write.differ on prefix", LIBRARY_ERROR)
        else:
            from dcr_log.codec import ulp
            from dcr_log.write import differ as delta

            def same_as(fn):
                p, b, v = fn(hb, hn)
                ok = (np.array_equal(got[0], p) and got[0].dtype == np.int64
                      and np.array_equal(got[1], b.view(np.uint16)) and np.array_equal(got[2], v.view(np.uint16)))
                return ok, f"{p.size} changes in {prefix} elements"

            ck.check(f"find_changes {tag} == delta.find_changes (prefix)", lambda: same_as(delta.find_changes))
            if hasattr(delta, "find_changes_numpy"):
                ck.check(f"find_changes {tag} == delta.find_changes_numpy", lambda: same_as(delta.find_changes_numpy))
            ck.check(f"ulp_distance {tag} == codec.ulp.ulp_distance (prefix)",
                     lambda: np.array_equal(host_u(T.ulp_distance(db, dn)), ulp.ulp_distance(got[1], got[2])))
            ck.check(f"step_from {tag} == codec.ulp.step_from (prefix)",
                     lambda: np.array_equal(host_u(T.step_from(db, T.ulp_distance(db, dn))),
                                            ulp.step_from(got[1], ulp.ulp_distance(got[1], got[2]))))
        dist = T.ulp_distance(bv, nv)
        ck.check(f"ulp_distance {tag} == the +-1 steps built", lambda: torch.equal(dist, steps))

        def applied(kind, values, relative=False):
            copy = base.clone()
            T.apply_changes(T.word_view(copy), pos, values, kind, relative)
            return torch.equal(T.word_view(copy), nw)

        ck.check(f"apply xor {tag} == new", lambda: applied("xor", torch.bitwise_xor(bv, nv)))
        ck.check(f"apply ulp (relative) {tag} == new", lambda: applied("xor", dist, True))
        ck.check(f"apply overwrite {tag} == new", lambda: applied("overwrite", nv))

        def backwards():
            return torch.equal(T.step_from(nv, dist, backwards=True), bv)

        ck.check(f"step_from backwards {tag} == base", backwards)
        if r == RATES[0]:
            def upload():
                pos_np, vals_np = pos.cpu().numpy(), host_u(nv)
                p, v = T.to_device_changes(pos_np, vals_np, device)
                sync(device)
                return (p.device.type == device.type and p.dtype == torch.int64 and v.dtype == torch.int16
                        and torch.equal(p, pos) and torch.equal(v, nv))

            ck.check(f"to_device_changes {tag} exact", upload)

    if dcr_log is None:
        ck.skip("library round trip", LIBRARY_ERROR)
    else:
        try:
            library_checks(ck, base, pairs[RATES[0]][0], device)
        except Exception as exc:  # the log could not be written or read: a failed check
            traceback.print_exc(file=sys.stderr)
            failure = f"{type(exc).__name__}: {exc}"
            ck.check("library: write and read the round-trip log", lambda: (False, failure))

    exact = ck.exact
    if device.type == "cuda":
        print(f"peak device memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    print(f"exact: {'yes' if exact else 'no'}", flush=True)
    if args.json:
        print(json.dumps({
            "device": str(device), "device_name": name, "torch": torch.__version__,
            "elements": n, "model_bytes": model_bytes, "reps": args.reps,
            "changed": {str(r): int(pairs[r][1].numel()) for r in RATES},
            "measurements": measurements, "checks": ck.results, "exact": exact,
            "library_error": LIBRARY_ERROR,
        }, indent=2))
    if not exact:
        return 3 if LIBRARY_ERROR and all(r["ok"] is not False for r in ck.results) else 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--gib", type=float, default=1.0, help="size of one bf16 model in GiB (default 1)")
    ap.add_argument("--reps", type=int, default=5, help="timed pairs of each op and one xor; medians kept (default 5)")
    ap.add_argument("--prefix", type=int, default=64 << 20,
                    help="elements compared against the numpy find_changes (default 64 Mi)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="also print a JSON report")
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.reps < 1 or args.prefix < 1:
        ap.error("--gib, --reps and --prefix must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
