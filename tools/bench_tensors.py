#!/usr/bin/env python
"""What each tensor costs whatever it changes: the fixed costs a model of many tensors pays per
version, measured on a state of ``--tensors`` tiny bf16 tensors (``--elements`` each, 1024 by
default: a norm's size) with three changed words a tensor per version.

- ``commit parse``: ``CommitRecord.from_bytes`` of a version's commit record (every reader and
  writer parses each version's once: its tensor table has a row per tensor);
- ``append``: ``LogWriter.append`` of the next state (a record a tensor), its cache on;
- ``replay``: ``DeltaLog.apply_version`` of that version onto a state at its parent;
- ``rx numpy``: a numpy ``Receiver.apply`` of it (default verification), the receiver bound
  before the first, one version an apply.

Each is reported as microseconds a tensor (the median call's wall time over the tensor count)
with its CPU time, beside ``np.copyto`` of the whole state (paired, tools/timing.py), which at
these sizes costs almost nothing: what is left is per-tensor overhead. A model of a couple of
hundred tensors pays these per version on top of its per-change costs
(tools/bench_percost.py); one of tens of thousands (a mixture of experts stored expert by
expert) pays them a hundred times over.

    python tools/bench_tensors.py [--tensors 2000] [--elements 1024] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcr_log import DeltaLog, TensorBits  # noqa: E402
from dcr_log.format.commit import CommitRecord  # noqa: E402
from dcr_log.format.keys import version_key  # noqa: E402
from dcr_log.receiver import Receiver  # noqa: E402
from dcr_log.write import LogWriter  # noqa: E402
from timing import Pairing, machine_line, paired  # noqa: E402

CHANGES_PER_TENSOR = 3


def states(tensors: int, elements: int, versions: int, seed: int) -> list[dict[str, TensorBits]]:
    """Version 0 and ``versions`` more, each CHANGES_PER_TENSOR words of every tensor flipped
    in one bit from its parent."""
    rng = np.random.default_rng(seed)
    # Names as a model's: layers of nine, sorted as the log sorts them (by UTF-8 bytes).
    names = [f"model.layers.{i // 9}.part{i % 9}.weight" for i in range(tensors)]
    state = {name: TensorBits("BF16", (elements,), rng.integers(0, 1 << 16, elements, dtype=np.uint16))
             for name in names}
    out = [state]
    for v in range(versions):
        state = {name: TensorBits(b.dtype, b.shape, b.words.copy()) for name, b in state.items()}
        for b in state.values():
            at = rng.choice(elements, min(CHANGES_PER_TENSOR, elements), replace=False)
            b.words[at] ^= np.uint16(1 << (v % 7))
        out.append(state)
    return out


def run(tensors: int, elements: int, repeats: int, seed: int, work: Path) -> dict:
    steps = states(tensors, elements, 2 * repeats, seed)
    flat = np.concatenate([b.words for b in steps[0].values()])
    dst = np.empty_like(flat)
    copyto = lambda: np.copyto(dst, flat)  # noqa: E731

    writer = LogWriter.create(work / "log", steps[0], cache_dir=work / "cache")
    appends = [paired(lambda s=s: writer.append(s), copyto, 1) for s in steps[1:repeats + 1]]
    for s in steps[repeats + 1:]:  # versions for the receiver to apply, untimed
        writer.append(s)
    writer.close()
    log = DeltaLog.open(work / "log")
    data = bytes(log.store.get(version_key(1)))
    parses = paired(lambda: CommitRecord.from_bytes(data, expect_version=1), copyto, repeats)

    replayed = {name: TensorBits(b.dtype, b.shape, b.words.copy()) for name, b in steps[0].items()}
    replays = [paired(lambda v=v: log.apply_version(replayed, v), copyto, 1) for v in range(1, repeats + 1)]
    for name, b in steps[repeats].items():
        assert np.array_equal(replayed[name].words, b.words), f"replay: {name}"

    held = {name: TensorBits(b.dtype, b.shape, b.words.copy()) for name, b in steps[repeats].items()}
    with Receiver.open(held, work / "journal") as rx:
        rx.bind(log, repeats, verify="none")
        applies = [paired(lambda v=v: rx.apply(log, to=v), copyto, 1)
                   for v in range(repeats + 1, 2 * repeats + 1)]
    for name, b in steps[-1].items():
        assert np.array_equal(held[name].words, b.words), f"receiver: {name}"

    def row(pairing: Pairing) -> dict:
        return {"us_per_tensor": pairing.op_wall / tensors * 1e6, "cpu_us_per_tensor": pairing.op_cpu / tensors * 1e6,
                "seconds": pairing.op_wall, "copyto_seconds": pairing.baseline_wall}

    return {"tensors": tensors, "elements": elements, "changes_per_tensor": CHANGES_PER_TENSOR,
            "commit_bytes": len(data), "repeats": repeats,
            "ops": {"commit parse": row(parses), "append": row(Pairing.join(appends)),
                    "replay": row(Pairing.join(replays)), "rx numpy": row(Pairing.join(applies))}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--elements", type=int, default=1024, help="bf16 elements a tensor")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls of each operation (medians)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if args.tensors < 1 or args.elements < 1 or args.repeats < 1:
        ap.error("--tensors, --elements and --repeats must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="dcr-bench-tensors-"))
    try:
        report = run(args.tensors, args.elements, args.repeats, args.seed, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
        return 0
    print(machine_line())
    print(f"{report['tensors']} bf16 tensors of {report['elements']} elements, {CHANGES_PER_TENSOR} changes "
          f"a tensor a version; commit record {report['commit_bytes']:,} bytes; medians of {args.repeats}")
    for op, r in report["ops"].items():
        print(f"{op:>13}: {r['us_per_tensor']:7.2f} us a tensor ({r['cpu_us_per_tensor']:7.2f} us CPU), "
              f"{r['seconds'] * 1e3:8.2f} ms a call; copyto of the state beside it {r['copyto_seconds'] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
