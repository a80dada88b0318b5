#!/usr/bin/env python
"""What writing a squash and a snapshot costs in memory and time, against the model's bytes.

    python tools/bench_catchup.py [--gib 1.0] [--versions 21] [--rate 0.01] [--dir DIR]

A bf16 Llama-shaped model (dcr_log.synthetic, Adam steps changing about ``--rate`` of the words,
spread over every tensor) is logged for ``--versions`` versions. Then, each in a fresh child
process (this file, ``--child``), so that nothing the parent built counts:

- ``write_squash(log, 0, versions - 1)`` (every record checked as it is encoded, the default);
- ``write_snapshot(log, versions - 1)`` (every record checked as it is encoded, the default).

Each child reports its peak RSS during the call (VmHWM, reset through /proc/self/clear_refs
just before it) above its RSS before it, as a multiple of the model's bytes, and the wall and
CPU seconds; ``materialize`` of the same version is measured the same way beside them, as the
floor a squash or snapshot cannot go below (it holds one whole state). ``--json`` prints the
report as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dcr_log.lifecycle import write_snapshot, write_squash  # noqa: E402
from dcr_log.log import DeltaLog  # noqa: E402
from dcr_log.synthetic import SyntheticTrainer, lr_for_rate, specs_for_params  # noqa: E402
from dcr_log.write import LogWriter  # noqa: E402


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(root: Path, what: str) -> dict:
    log = DeltaLog.open(root)
    end = log.latest_version()
    calls = {"squash": lambda: write_squash(log, 0, end),
             "snapshot": lambda: write_snapshot(log, end),
             "materialize": lambda: log.materialize(end)}
    before = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    t0, c0 = time.perf_counter(), time.process_time()
    calls[what]()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"what": what, "peak_above_start": _vm("VmHWM") - before, "wall_s": wall, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--versions", type=int, default=21)
    parser.add_argument("--rate", type=float, default=0.01)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("LOG", "WHAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1])))
        return
    with tempfile.TemporaryDirectory(prefix="dcr-bench-catchup-", dir=args.dir) as tmp:
        root = Path(tmp) / "log"
        trainer = SyntheticTrainer(specs_for_params(int(args.gib * (1 << 30)) // 2, layers=4), seed=0)
        model = sum(b.words.nbytes for b in trainer.state().values())
        lr = lr_for_rate(args.rate)
        t0 = time.perf_counter()
        with LogWriter.create(root, trainer.state(), cache_dir=Path(tmp) / "cache") as writer:
            for _ in range(args.versions - 1):
                trainer.step(lr)
                writer.append(trainer.state())
        del trainer
        print(f"logged {args.versions} versions of {model / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        rows = []
        for what in ("materialize", "squash", "snapshot"):
            proc = subprocess.run([sys.executable, __file__, "--child", str(root), what],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"{what} child failed: {proc.stderr.strip()[-2000:]}")
            row = json.loads(proc.stdout)
            row["peak_to_model"] = row["peak_above_start"] / model
            rows.append(row)
            print(f"{what:12s} peak {row['peak_to_model']:.2f}x the model, {row['wall_s']:.1f} s wall, "
                  f"{row['cpu_s']:.1f} s CPU", file=sys.stderr)
    report = {"model_bytes": model, "versions": args.versions, "rate": args.rate, "rows": rows}
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
