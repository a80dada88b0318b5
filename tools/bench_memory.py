"""Peak memory of ``dcr verify``, ``dcr replay`` and ``dcr apply`` on inputs that a bounded
reader must not hold whole (spec/FORMAT.md section 20):

- ``commit``: a log whose commit record of version 1 a hostile writer padded to
  ``--commit-mib`` MiB (default 256; its ``writer_id``, re-sealed), which a reader must refuse
  from the object's size before reading it;
- ``at-limit``: the same padded to just under the commit-record limit (at most 64 MiB), with the padding a
  list of empty objects in ``segments`` (the text on which Python's json takes the most memory
  per byte), refused after parsing: the most a refused record can cost;
- ``segment``: a log whose version 0 is one bf16 tensor of ``--gib`` GiB (default 1.5; a single
  segment: ``segment_bytes`` above it) and whose version 1 changes every word of it (a second
  segment of the same size). verify reads both segments, replay materializes version 1 (the
  state itself is ``--gib`` GiB), apply takes a receiver from version 0 to 1.

Each command runs as ``python -m dcr_log ...`` under ``/usr/bin/time -v``; the script prints its
exit status and maximum resident set size. The inputs are built in a temporary directory
(``--dir`` to keep them; about 4.5 x ``--gib`` GiB of disk for ``segment``) and removed after.

    python tools/bench_memory.py                 # all cases
    python tools/bench_memory.py --case segment --gib 1.5
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dcr_log.format import limits  # noqa: E402
from dcr_log.format.canonical import seal  # noqa: E402
from dcr_log.state import TensorBits  # noqa: E402
from dcr_log.write import LogWriter  # noqa: E402


def _run(args: list[str], label: str) -> None:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "dcr_log", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", proc.stderr)
    errors = proc.stderr.split("\tCommand being timed", 1)[0].splitlines()
    last = [line for line in errors if line.strip() and not line.startswith("Command exited")]
    mib = int(rss.group(1)) / 1024 if rss else float("nan")
    said = (proc.stdout.strip().splitlines() or [""])[-1] or (last[-1] if last else "")
    print(f"{label:<28} exit {proc.returncode}  max RSS {mib:8.1f} MiB  {wall.group(1) if wall else ''}  "
          f"{said[:110]}", flush=True)


def _small_log(root: Path) -> None:
    rng = np.random.default_rng(1)
    words = rng.integers(0, 1 << 16, 4096, dtype=np.uint16)
    w = LogWriter.create(root, {"w": TensorBits("BF16", (64, 64), words)}, cache_dir=False)
    words = words.copy()
    words[::7] ^= 1
    w.append({"w": TensorBits("BF16", (64, 64), words)})


def _pad_commit(root: Path, version: int, pad) -> None:
    path = root / "versions" / f"{version:020d}.json"
    obj = json.loads(path.read_bytes())
    obj.pop("checksum")
    pad(obj)
    path.write_bytes(seal(obj))
    print(f"  {path.name}: {path.stat().st_size / 2**20:.1f} MiB", flush=True)


def case_commit(base: Path, mib: int) -> None:
    root = base / "commit"
    _small_log(root)

    def pad(obj):
        obj["writer_id"] = "x" * ((mib << 20) - len(seal(obj)))
    _pad_commit(root, 1, pad)
    _commands(base, root, f"commit {mib} MiB")


def case_at_limit(base: Path) -> None:
    root = base / "at-limit"
    _small_log(root)

    def pad(obj):
        room = min(limits.MAX_COMMIT_BYTES, 64 << 20) - len(seal(obj)) - 1024
        obj["segments"] = obj["segments"] + [{}] * (room // 3)
    _pad_commit(root, 1, pad)
    _commands(base, root, "commit at the limit")


def case_segment(base: Path, gib: float) -> None:
    root = base / "segment"
    n = int(gib * (1 << 30)) // 2 // 1024 * 1024
    rng = np.random.default_rng(2)
    words = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    shape = (n // 1024, 1024)
    seg = n * 2 + (256 << 20)
    w = LogWriter.create(root, {"w": TensorBits("BF16", shape, words)}, cache_dir=False, segment_bytes=seg)
    words ^= rng.integers(1, 1 << 16, n, dtype=np.uint16)  # every word changes
    w.append({"w": TensorBits("BF16", shape, words)})
    del w, words
    for p in sorted((root / "segments").rglob("*.arrow")):
        print(f"  {p.relative_to(root)}: {p.stat().st_size / 2**30:.2f} GiB", flush=True)
    rx = base / "segment-rx"
    subprocess.run([sys.executable, "-m", "dcr_log", "apply", str(root), "--receiver", str(rx), "--to", "0"],
                   cwd=ROOT, check=True, capture_output=True)
    _commands(base, root, f"segment {gib:g} GiB", receiver=rx)


def _commands(base: Path, root: Path, label: str, receiver: Path | None = None) -> None:
    _run(["verify", str(root)], f"{label}: verify")
    out = base / "out.safetensors"
    _run(["replay", str(root), "--out", str(out)], f"{label}: replay")
    out.unlink(missing_ok=True)
    rx = receiver if receiver is not None else base / f"{root.name}-rx"
    _run(["apply", str(root), "--receiver", str(rx)], f"{label}: apply")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("commit", "at-limit", "segment", "all"), default="all")
    ap.add_argument("--commit-mib", type=int, default=256)
    ap.add_argument("--gib", type=float, default=1.5)
    ap.add_argument("--dir", type=Path, default=None)
    args = ap.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="dcr-bench-memory-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"MAX_COMMIT_BYTES = {limits.MAX_COMMIT_BYTES} ({limits.MAX_COMMIT_BYTES >> 20} MiB); inputs in {base}")
    try:
        if args.case in ("commit", "all"):
            case_commit(base, args.commit_mib)
        if args.case in ("at-limit", "all"):
            case_at_limit(base)
        if args.case in ("segment", "all"):
            case_segment(base, args.gib)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
