#!/usr/bin/env python
"""Refit over a shaped link: a dense download against a dcr refit, on a real S3 server.

    sudo python tools/bench_link.py [--mib 256] [--rate-mbit 200] [--rates 0.01,0.03,0.05] [--interval 0.02]

Makes a network namespace with a veth pair, starts SeaweedFS (S3) inside it, and shapes both
directions of the link with ``tc qdisc ... tbf rate <rate>mbit``. On a bf16 Llama-shaped model
(``--mib``, Adam steps that change the given fractions of the stored words):

- dense refit: the upload (PUT) of the whole checkpoint (model.safetensors), then its GET and
  its write to a local file, fsynced (the trainer's new weights to the receiver's disk, as the
  dcr refit is timed); the GET + write + fsync alone is printed beside it;
- dcr refit (segments of ``--segment-mib``): a follow-mode receiver (``Receiver.follow``: a checkpoint
  directory, written in place and flushed, or with ``--receiver memory`` numpy arrays) while a
  writer in the same process appends the version to the log on the server; timed from the
  writer's start to the receiver's joint commit, and from the commit record's creation to the
  joint commit (the receiver's side: it prefetched the segments while the writer wrote them).

Prints, per change rate, both times, the speed-ups over dense (whole, and over its GET + write +
fsync alone), the receiver's time against that GET + write + fsync, the bytes, and the receiver's
time over (delta bytes / link rate). Needs root (network namespaces, tc); says so and exits
otherwise. Everything it creates (the namespace, the veth pair, the server, its files) is
removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

NS = "dcr-bench-link"
HOST_IF, NS_IF = "dcrbl0", "dcrbl1"
HOST_IP, NS_IP = "10.213.77.1", "10.213.77.2"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def make_link(rate_mbit: float) -> None:
    teardown()
    sh("ip", "netns", "add", NS)
    sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
    sh("ip", "link", "set", NS_IF, "netns", NS)
    sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
    sh("ip", "link", "set", HOST_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
    sh("ip", "netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
    sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
    shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "256kbit", "latency", "100ms"]
    sh("tc", "qdisc", "add", "dev", HOST_IF, "root", *shape)  # uploads
    sh("ip", "netns", "exec", NS, "tc", "qdisc", "add", "dev", NS_IF, "root", *shape)  # downloads


def teardown() -> None:
    subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def dense_refit(url: str, key: str, out: Path) -> float:
    import obstore

    from dcr_log.store import Store

    store = Store.open(url)
    t0 = time.perf_counter()
    result = obstore.get(store._inner, key)
    with open(out, "wb") as f:
        for chunk in result.stream(min_chunk_size=8 << 20):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--rates", default="0.01,0.03,0.05")
    ap.add_argument("--interval", type=float, default=0.02, help="the follow receiver's poll interval")
    ap.add_argument("--receiver", choices=("directory", "memory"), default="directory",
                    help="a checkpoint directory (written in place, flushed) or numpy arrays in memory")
    ap.add_argument("--segment-mib", type=float, default=4.0,
                    help="the writer's segment size: smaller segments reach the receiver while later ones are encoded")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_link needs root (it makes a network namespace and shapes it with tc): run it as root")
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"bench_link needs the {tool} command (iproute2)")
            return 2
    from dcr_log.checkpoint import save_safetensors
    from dcr_log.log import DeltaLog
    from dcr_log.receiver import open_directory, write_checkpoint
    from dcr_log.synthetic import SyntheticTrainer, lr_for_rate, specs_for_params
    from dcr_log.write import LogWriter
    from helpers.seaweed import SeaweedServer

    rates = [float(r) for r in args.rates.split(",")]
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-link-"))
    server = None
    try:
        make_link(args.rate_mbit)
        server = SeaweedServer(work / "seaweedfs", ip=NS_IP, prefix=("ip", "netns", "exec", NS))
        server.start()
        os.environ.update(server.env)
        link = args.rate_mbit * 1e6 / 8  # bytes per second
        trainer = SyntheticTrainer(specs_for_params((args.mib << 20) // 2, layers=4), seed=0)
        state = trainer.state()
        nbytes = sum(b.words.nbytes for b in state.values())
        print(f"model {nbytes / 2**20:.0f} MiB bf16; link {args.rate_mbit:g} Mbit/s each way "
              f"(tc tbf, network namespace), S3: SeaweedFS at {server.endpoint}")
        url = server.url("bench")
        t0 = time.perf_counter()
        writer = LogWriter.create(url, state, cache_dir=work / "cache",
                                  segment_bytes=int(args.segment_mib * 2**20))
        print(f"version 0 uploaded in {time.perf_counter() - t0:.1f} s")
        ckpt = work / "model.safetensors"
        save_safetensors(state, ckpt)
        from dcr_log.store import Store
        dense_store = Store.open(url + "-dense")
        blob = ckpt.read_bytes()
        uploads = []
        for i in range(2):
            t0 = time.perf_counter()
            dense_store.put_new(f"model-{i}.safetensors", blob)
            uploads.append(time.perf_counter() - t0)
        del blob
        upload = min(uploads)
        download = min(dense_refit(url + "-dense", f"model-{i}.safetensors", work / "dense.safetensors")
                       for i in range(2))
        dense = upload + download
        print(f"dense refit (upload {nbytes / 2**20:.0f} MiB + GET + write + fsync): {dense:.2f} s "
              f"(upload {upload:.2f} s, GET + write + fsync {download:.2f} s, {nbytes / download / 1e6:.1f} MB/s)")
        receiver = work / "receiver"
        log = DeltaLog.open(url)
        if args.receiver == "directory":
            receiver.mkdir()
            write_checkpoint(state, receiver)
            rx = open_directory(log, receiver)  # bound to version 0 by its state digest
        else:
            from dcr_log.receiver import Receiver
            arrays = {n: b.words.reshape(b.shape).copy() for n, b in state.items()}
            rx = Receiver.open(arrays, work / "journal", dtypes={n: b.dtype for n, b in state.items()})
            rx.bind(log, 0, verify="none")
        applied: dict[int, float] = {}
        writes: dict[int, float] = {}  # the write phase of each version (after fetch and checks)
        stop = threading.Event()

        def follow() -> None:
            rx.follow(DeltaLog.open(url), interval=args.interval, verify="sample", stop=stop.is_set,
                      on_version=lambda r: (writes.__setitem__(r.version, r.seconds),
                                            applied.__setitem__(r.version, time.perf_counter())))

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        rows = []
        for rate in rates:
            trainer.step(lr_for_rate(rate))
            new = trainer.state()
            t_start = time.perf_counter()
            commit = writer.append(new)
            t_commit = time.perf_counter()
            while commit.version not in applied:
                time.sleep(0.005)
                if time.perf_counter() - t_commit > 300:
                    raise RuntimeError("the receiver did not apply the version")
            t_done = applied[commit.version]
            changed = commit.stats.changed_elements / commit.stats.total_elements
            rows.append((rate, changed, commit.delta_bytes, t_done - t_start, t_done - t_commit,
                         writes[commit.version]))
        stop.set()
        thread.join(60)
        rx.close()
        check = DeltaLog.open(url).materialize()
        from dcr_log.checkpoint import load_checkpoint
        from dcr_log.log import state_equal
        from dcr_log.state import TensorBits
        held = load_checkpoint(receiver) if args.receiver == "directory" else {
            n: TensorBits(check[n].dtype, check[n].shape, a.reshape(-1)) for n, a in arrays.items()}
        assert state_equal(held, check), "the receiver differs from the log"
        print(f"\n{'changed':>8} {'delta':>10} {'bytes x':>8} {'writer->commit':>15} {'commit->commit':>15} "
              f"{'(writes)':>9} {'speed-up':>9} {'(GET only)':>10} {'(recv)':>7} {'recv / link time':>17}")
        for _rate, changed, delta, whole, recv, wrote in rows:
            link_time = delta / link
            print(f"{changed:8.2%} {delta:10d} {nbytes / delta:8.0f} {whole:14.2f}s {recv:14.3f}s {wrote:8.3f}s "
                  f"{dense / whole:8.1f}x {download / whole:9.1f}x {download / recv:6.1f}x "
                  f"{recv / (link_time + 0.2):9.2f} of (delta/link + 0.2 s)")
        print(f"the receiver ({args.receiver}) holds the log's latest version, bit for bit")
        return 0
    finally:
        if server is not None:
            server.stop()
        teardown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
