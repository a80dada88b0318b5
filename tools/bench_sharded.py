#!/usr/bin/env python
"""Sharded-writer benchmark: per-rank create/append GB/s at 1 and 2 gloo ranks, `dcr append`
at log length 2 and 50, and peak RSS per rank, each next to a baseline measured in the same run.

    python tools/bench_sharded.py [--mib 256] [--append-mib 64] [--rate 0.01] [--repeats 3] [--quick]

The model is Llama-shaped (dcr_log.synthetic.specs_for_params: embeddings, q/k/v/o, gate/up/
down, RMSNorms, lm_head) with bf16 words from one Adam step of an fp32 master
(dcr_log.synthetic.adam_step_pair), at a learning rate calibrated so that ``--rate`` of the
words change. Every rank runs in its own process (gloo over 127.0.0.1; the 1-rank case too)
and holds its tensor-parallel shards as local contiguous torch bf16 tensors in one flat buffer:
rows of embed/q/k/v/gate/up/lm_head (column parallel, vocab parallel), column blocks of o/down
(row parallel), the norms on rank 0. A rank's bytes are the bytes of its shards.

- xor: ``np.bitwise_xor(base, new, out=prealloc)`` over the rank's flat buffer (one thread),
  timed on all ranks at once, like the writer;
- create: ``ShardedWriter.create`` (dense version 0, baseline cache written) into a new log;
- append: ``writer.append`` of the next step (alternating new, base, ...: the same changes);
  every rank's time is that of its whole collective call;
- peak RSS: VmHWM of each rank over create and appends (reset after the data is loaded), next
  to its RSS before (interpreter + its two local states) and its shard bytes;
- `dcr append` (the CLI in a subprocess, wall clock, its ru_maxrss from wait4) on a
  ``--append-mib`` checkpoint, onto a log of 2 versions and one of ``--versions`` versions
  (built in process by LogWriter, which leaves the baseline cache the CLI resumes from), and the
  same without the cache (``--cache none``: a replay), next to ``python -m dcr_log.cli.app`` (the imports alone).

The ranks' figures are medians of ``--repeats``, each create and append paired with one xor
right after it (tools/timing.py), and their ratios to xor the median pair's; the `dcr append`
figures are the best of ``--repeats``, the two log lengths run alternately. Ratios are taken
within the run (shared, noisy machines). The 2-rank log's last version is replayed and checked bit-exact at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import Pairing, paired  # noqa: E402

SPLIT_ROWS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
SPLIT_COLS = ("o_proj", "down_proj")


# -- the model and its shards ---------------------------------------------------------------


def tp_plan(specs: list[dict], rank: int, world: int) -> list[dict]:
    """This rank's pieces: name, canonical shape, offset and the local (contiguous) shape."""
    plan = []
    for s in specs:
        name, shape = s["name"], tuple(s["shape"])
        module = name.rsplit(".", 2)[-2]
        if world > 1 and module in SPLIT_ROWS:
            n = shape[0] // world
            plan.append({"name": name, "shape": shape, "offset": (rank * n, 0), "local": (n, shape[1])})
        elif world > 1 and module in SPLIT_COLS:
            n = shape[1] // world
            plan.append({"name": name, "shape": shape, "offset": (0, rank * n), "local": (shape[0], n)})
        elif rank == 0:  # norms (and everything at 1 rank): whole, on rank 0
            plan.append({"name": name, "shape": shape, "offset": (0,) * len(shape), "local": shape})
    return plan


def canonical_slices(piece: dict) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(piece["offset"], piece["local"]))


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rank_main(rank: int, world: int, port: int, work: Path, repeats: int, changed: int) -> None:
    """One rank: load its shards, time xor, create and append, record its peak RSS."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dcr_log.write.pieces import Shard
    from dcr_log.write.sharded import ShardedWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    rss_start = vm_kib("VmRSS") * 1024
    specs = json.loads((work / "model.json").read_text())
    plan = tp_plan(specs, rank, world)
    sizes = [math.prod(p["local"]) for p in plan]
    total = sum(sizes)
    flats = []
    for which in ("base", "new"):
        src = np.load(work / f"{which}.npy", mmap_mode="r")
        flat = np.empty(total, dtype=np.uint16)
        at, start = 0, {}
        for s in specs:
            start[s["name"]] = at
            at += math.prod(s["shape"])
        at = 0
        for p, n in zip(plan, sizes):
            canon = src[start[p["name"]]:start[p["name"]] + math.prod(p["shape"])].reshape(p["shape"])
            flat[at:at + n].reshape(p["local"])[...] = canon[canonical_slices(p)]
            at += n
        del src, canon
        flats.append(flat)
    base_flat, new_flat = flats

    def shards_of(flat: np.ndarray) -> dict:
        out, at = {}, 0
        for p, n in zip(plan, sizes):
            t = torch.from_numpy(flat[at:at + n]).view(torch.bfloat16).reshape(p["local"])
            out[p["name"]] = [Shard(t, p["offset"])]
            at += n
        return out

    base_shards, new_shards = shards_of(base_flat), shards_of(new_flat)
    shapes = {s["name"]: tuple(s["shape"]) for s in specs}
    nbytes = 2 * total
    reset_ok = reset_peak_rss()
    rss_data = vm_kib("VmRSS") * 1024

    # Each create and append is paired with one xor right after it (tools/timing.py), every
    # timed call started on all ranks together.
    xor_out = np.empty_like(base_flat)
    xor = functools.partial(np.bitwise_xor, base_flat, new_flat, out=xor_out)

    creates, writers = [], []
    for i in range(repeats):
        log_dir, cache = work / f"log-w{world}-{i}", work / f"cache-w{world}-{i}"
        creates.append(paired(lambda: writers.append(ShardedWriter.create(log_dir, base_shards, shapes,
                                                                          cache_dir=cache)),
                              xor, 1, before=dist.barrier))
        dist.barrier()
        if rank == 0 and i:  # keep the disk use of one log
            shutil.rmtree(work / f"log-w{world}-{i - 1}")
        shutil.rmtree(work / f"cache-w{world}-{i - 1}", ignore_errors=True)

    writer = writers[-1]
    del writers[:-1]
    peak_create = vm_kib("VmHWM") * 1024
    reset_peak_rss()
    rss_appends = vm_kib("VmRSS") * 1024
    appends, commits = [], []
    for i in range(repeats):
        target = new_shards if i % 2 == 0 else base_shards
        appends.append(paired(lambda: commits.append(writer.append(target)), xor, 1, before=dist.barrier))
        commit = commits.pop()
        if commit.stats.changed_elements != changed:
            raise SystemExit(f"rank {rank}: version {commit.version} recorded "
                             f"{commit.stats.changed_elements} changes, expected {changed}")
    create, append = Pairing.join(creates), Pairing.join(appends)
    xors = Pairing.join([create, append]).baseline  # two xors per repeat: their medians
    result = {
        "rank": rank, "world": world, "bytes": nbytes, "pieces": len(plan),
        "xor_s": float(np.median([x.wall for x in xors])), "xor_cpu_s": float(np.median([x.cpu for x in xors])),
        "create_s": create.op_wall, "create_cpu_s": create.op_cpu,
        "append_s": append.op_wall, "append_cpu_s": append.op_cpu,
        # speed as a ratio to xor (1 = as fast), the median pair's
        "create_to_xor": 1 / create.ratio, "append_to_xor": 1 / append.ratio,
        "rss_start": rss_start, "rss_data": rss_data, "rss_peak_create": peak_create,
        "rss_before_appends": rss_appends, "rss_peak_append": vm_kib("VmHWM") * 1024,
        "peak_reset": reset_ok, "log": str(work / f"log-w{world}-{repeats - 1}"), "version": writer.version,
    }
    (work / f"result-w{world}-r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world: int, work: Path, repeats: int, changed: int, timeout: float) -> list[dict]:
    port = free_port()
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["DCR_CACHE_DIR"] = str(work / "default-cache")  # unused: every create names its cache
    procs, logs = [], []
    try:
        for rank in range(world):
            f = open(work / f"rank-w{world}-r{rank}.log", "w+")
            logs.append(f)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "_rank", str(rank), str(world), str(port), str(work),
                 str(repeats), str(changed)], stdout=f, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        for r, f in enumerate(logs):
            f.seek(0)
            print(f"--- rank {r} of {world} (rc {procs[r].returncode}) ---\n{f.read()[-4000:]}", file=sys.stderr)
        raise SystemExit(f"rank processes failed: {bad}")
    for f in logs:
        f.close()
    return [json.loads((work / f"result-w{world}-r{r}.json").read_text()) for r in range(world)]


# Runs a module as `python -m` would and writes its own VmHWM to $BENCH_HWM at exit. (wait4's
# ru_maxrss of a child is no use here: it includes the RSS of the parent it was forked from.)
HWM_WRAPPER = """
import atexit, os, runpy, sys
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(os.environ["BENCH_HWM"], "w").write(line.split()[1])
atexit.register(hwm)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_cli(args: list[str], env: dict, work: Path, rss: bool = False) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes or 0) of one ``python ARGS`` run; raises on failure. With
    ``rss``, ``-m MODULE ...`` runs under HWM_WRAPPER (timed too, but not meant for timing)."""
    out, hwm = work / "cli.out", work / "cli.hwm"
    if rss:
        assert args[0] == "-m"
        args = ["-c", HWM_WRAPPER, *args[1:]]
        env = dict(env, BENCH_HWM=str(hwm))
    with open(out, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}): {out.read_text()[-2000:]}")
    return wall, (int(hwm.read_text()) * 1024 if rss else 0)


def cli_bench(mib: float, versions: int, lr: float, seed: int, repeats: int, work: Path, say) -> dict:
    from dcr_log import LogWriter
    from dcr_log.checkpoint import save_safetensors
    from dcr_log.synthetic import adam_step_pair, carve, specs_for_params

    specs = specs_for_params(int(mib * (1 << 20)) // 2)
    n = sum(math.prod(s.shape) for s in specs)
    base, new = adam_step_pair(n, seed + 1, (lr,))
    states = {"base": carve(base, specs), "new": carve(new, specs)}
    ckpt = {k: work / f"{k}.safetensors" for k in states}
    for k, st in states.items():
        save_safetensors(st, ckpt[k])
    cache = work / "cli-cache"
    env = dict(os.environ, DCR_CACHE_DIR=str(cache))
    say(f"dcr append: {n:,} bf16 elements ({2 * n / 2**20:.1f} MiB) in {len(specs)} tensors; "
        f"building logs of 2 and {versions} versions in process")
    logs = {2: work / "cli-log-2", versions: work / f"cli-log-{versions}"}
    inproc = []
    for length, path in logs.items():
        w = LogWriter.create(path, states["base"], cache_dir=cache)
        for v in range(1, length):
            t0 = time.perf_counter()
            w.append(states["new"] if v % 2 else states["base"])
            inproc.append(time.perf_counter() - t0)
    # Both logs end on "new" (odd latest version): each CLI append flips base <-> new.
    latest = {length: "new" for length in logs}
    times = {length: [] for length in logs}
    rss = {}
    floor = min(run_cli(["-m", "dcr_log.cli.app"], env, work)[0] for _ in range(repeats))
    floor_rss = run_cli(["-m", "dcr_log.cli.app"], env, work, rss=True)[1]  # imports only (no __main__ code)
    for i in range(repeats + 1):
        for length, path in logs.items():  # interleaved: the same machine noise for both
            target = "base" if latest[length] == "new" else "new"
            # The last round measures peak RSS (under the wrapper), the others time the CLI.
            wall, peak = run_cli(["-m", "dcr_log", "append", str(path), "--from", str(ckpt[target])], env, work,
                                 rss=i == repeats)
            if i < repeats:
                times[length].append(wall)
            else:
                rss[length] = peak
            latest[length] = target
    # Without the cache the baseline is replayed from the log (last: it leaves the cache behind).
    nocache = {length: [] for length in logs}
    for _ in range(repeats):
        for length, path in logs.items():
            target = "base" if latest[length] == "new" else "new"
            wall, _ = run_cli(["-m", "dcr_log", "append", str(path), "--from", str(ckpt[target]),
                               "--cache", "none"], env, work)
            nocache[length].append(wall)
            latest[length] = target
    short, long_ = sorted(logs)
    return {
        "bytes": 2 * n, "versions": versions, "import_s": floor, "import_rss": floor_rss,
        "inproc_append_s": min(inproc),
        "cli_s": {k: min(v) for k, v in times.items()}, "cli_rss": rss,
        "nocache_s": {k: min(v) for k, v in nocache.items()},
        "ratio": min(times[long_]) / min(times[short]),
        "nocache_ratio": min(nocache[long_]) / min(nocache[short]),
        "lengths": (short, long_), "ckpt_bytes": ckpt["base"].stat().st_size,
    }


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def print_report(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140, highlight=False)
    t = Table("ranks", "rank", "shard MiB", "xor GB/s", "create GB/s", "/xor", "append GB/s", "/xor",
              "CPU s: xor", "create", "append",
              title=f"ShardedWriter, {rep['mib']:.1f} MiB bf16 model, {rep['tensors']} tensors, "
                    f"{100 * rep['rate']:.2f}% changed, medians of {rep['repeats']}; /xor: the median pair, each "
                    "call timed beside one xor", title_justify="left")
    m = Table("ranks", "rank", "shard MiB", "RSS start", "RSS with data", "peak: create", "/shard", "extra/shard",
              "before appends", "peak: appends", "/shard", "extra/shard",
              title="RSS per rank, MiB (VmHWM per phase; extra = peak minus RSS with data)", title_justify="left")
    mib = 1 << 20
    for world in (1, 2):
        for r in rep["ranks"][str(world)]:
            t.add_row(str(world), str(r["rank"]), f"{r['bytes'] / mib:.1f}", f"{gbps(r['bytes'], r['xor_s']):.2f}",
                      f"{gbps(r['bytes'], r['create_s']):.3f}", f"{r['create_to_xor']:.3f}",
                      f"{gbps(r['bytes'], r['append_s']):.3f}", f"{r['append_to_xor']:.3f}",
                      f"{r['xor_cpu_s']:.3f}", f"{r['create_cpu_s']:.3f}", f"{r['append_cpu_s']:.3f}")
            sb = r["bytes"]
            m.add_row(str(world), str(r["rank"]), f"{sb / mib:.1f}", f"{r['rss_start'] / mib:.0f}",
                      f"{r['rss_data'] / mib:.0f}", f"{r['rss_peak_create'] / mib:.0f}",
                      f"{r['rss_peak_create'] / sb:.2f}", f"{(r['rss_peak_create'] - r['rss_data']) / sb:.2f}",
                      f"{r['rss_before_appends'] / mib:.0f}", f"{r['rss_peak_append'] / mib:.0f}",
                      f"{r['rss_peak_append'] / sb:.2f}", f"{(r['rss_peak_append'] - r['rss_data']) / sb:.2f}")
    console.print(t)
    console.print(m)
    one, two = rep["ranks"]["1"][0], rep["ranks"]["2"]
    per_rank_2 = min(gbps(r["bytes"], r["append_s"]) for r in two)
    aggregate = sum(r['bytes'] for r in two) / max(r['append_s'] for r in two) / 1e9
    console.print(f"append, 2 ranks vs 1: slowest rank {per_rank_2:.3f} GB/s vs "
                  f"{gbps(one['bytes'], one['append_s']):.3f} GB/s per rank; aggregate {aggregate:.3f} GB/s")
    c = rep["cli"]
    short, long_ = c["lengths"]
    t = Table("dcr append", f"log of {short}", f"log of {long_}", f"{long_}/{short}", "goal",
              title=f"`dcr append` (subprocess, wall), {c['bytes'] / mib:.1f} MiB checkpoint, best of {rep['repeats']}",
              title_justify="left")
    t.add_row("with the baseline cache", f"{c['cli_s'][short]:.3f} s", f"{c['cli_s'][long_]:.3f} s",
              f"{c['ratio']:.3f}", "<= 1.2 " + ("ok" if c["ratio"] <= 1.2 else "MISSED"))
    t.add_row("--cache none (replay)", f"{c['nocache_s'][short]:.3f} s", f"{c['nocache_s'][long_]:.3f} s",
              f"{c['nocache_ratio']:.3f}", "")
    t.add_row("peak RSS (cache)", f"{c['cli_rss'][short] / mib:.0f} MiB", f"{c['cli_rss'][long_] / mib:.0f} MiB",
              "", f"checkpoint {c['ckpt_bytes'] / mib:.0f} MiB, import alone {c['import_rss'] / mib:.0f} MiB")
    console.print(t)
    console.print(f"floor: python -c 'import dcr_log.cli' {c['import_s']:.3f} s; in-process LogWriter.append "
                  f"of the same step {c['inproc_append_s']:.3f} s; CLI minus floor: "
                  f"{c['cli_s'][short] - c['import_s']:.3f} s / {c['cli_s'][long_] - c['import_s']:.3f} s")
    console.print(f"replay of the 2-rank log's version {rep['checked_version']}: bit-exact")
    reset = all(r['peak_reset'] for w in ('1', '2') for r in rep['ranks'][w])
    console.print(f"{rep['cpus']} CPUs, load average {rep['load'][0]:.2f} at the start, {os.getloadavg()[0]:.2f} "
                  f"at the end; peak RSS reset per rank: {reset}; "
                  f"total {rep['seconds']:.0f} s")
    console.print(f"command: {rep['command']}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_rank":
        rank, world, port, work, repeats, changed = argv[1:7]
        rank_main(int(rank), int(world), int(port), Path(work), int(repeats), int(changed))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256, help="model size for create/append in MiB (default 256)")
    ap.add_argument("--append-mib", type=float, default=64, help="checkpoint size for `dcr append` (default 64)")
    ap.add_argument("--versions", type=int, default=50, help="length of the long log for `dcr append` (default 50)")
    ap.add_argument("--rate", type=float, default=0.01, help="changed fraction per step (default 0.01)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="medians (rank figures) and best (`dcr append`) of N (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per rank family before it is killed")
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="a fast smoke run: 16 MiB, 8 MiB, 2 repeats")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.append_mib, args.repeats = min(args.mib, 16), min(args.append_mib, 8), min(args.repeats, 2)
    command = " ".join(shlex.quote(a) for a in [sys.executable, sys.argv[0], *argv])
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    say(f"command: {command}")

    from dcr_log import DeltaLog
    from dcr_log.synthetic import adam_step_pair, lr_for_rate, rate_of, specs_for_params

    t_start, load = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dcr-bench-sharded-", dir=args.dir) as tmp:
        work = Path(tmp)
        specs = specs_for_params(int(args.mib * (1 << 20)) // 2)
        n = sum(math.prod(s.shape) for s in specs)
        lr = lr_for_rate(args.rate)
        t0 = time.perf_counter()
        base, new = adam_step_pair(n, args.seed, (lr,))
        changed = int(np.count_nonzero(base != new))
        np.save(work / "base.npy", base)
        np.save(work / "new.npy", new)
        (work / "model.json").write_text(json.dumps([{"name": s.name, "shape": list(s.shape)} for s in specs]))
        say(f"model: {n:,} bf16 elements ({2 * n / 2**20:.1f} MiB) in {len(specs)} tensors, "
            f"{100 * rate_of(base, new):.2f}% changed (lr {lr:.3g}), generated in {time.perf_counter() - t0:.1f} s")
        ranks = {}
        for world in (1, 2):
            t0 = time.perf_counter()
            ranks[str(world)] = run_ranks(world, work, args.repeats, changed, args.timeout)
            say(f"{world} rank(s): done in {time.perf_counter() - t0:.1f} s")
        # The 2-rank log's last version must replay bit-exact to the state appended last.
        last = ranks["2"][0]
        expected = new if args.repeats % 2 == 1 else base
        state = DeltaLog.open(last["log"]).materialize(last["version"])
        at = 0
        for s in specs:
            k = math.prod(s.shape)
            if not np.array_equal(state[s.name].words, expected[at:at + k]):
                raise SystemExit(f"replay of version {last['version']}: {s.name} is not bit-exact")
            at += k
        del state
        cli = cli_bench(args.append_mib, args.versions, lr, args.seed, args.repeats, work, say)
    report = {"mib": 2 * n / 2**20, "tensors": len(specs), "rate": changed / n, "repeats": args.repeats,
              "ranks": ranks, "cli": cli, "checked_version": last["version"], "cpus": os.cpu_count(),
              "load": load, "seconds": time.perf_counter() - t_start, "command": command}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
