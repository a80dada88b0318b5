#!/usr/bin/env python
"""Start-up benchmark: the wall time of `dcr --help`, `dcr --version` and `dcr apply` of an empty
delta, each next to the bare interpreter's start-up, and the modules each one imports.

    python tools/bench_startup.py [--repeats 15] [--dcr "python -m dcr_log"] [--json]

Every figure is a subprocess's wall time (and its CPU time, user + system, from the children's
rusage), the median of ``--repeats``, each run paired with a ``python -c pass`` right after it
(tools/timing.py): the ratio to that floor holds on a loaded machine where the seconds drift.
The empty delta is a log whose latest version (1) changes nothing, applied to a receiver that
holds its parent (version 0; a fresh copy of one for every run, made before the run). Every
run reads compiled bytecode (one warm-up run each first), as an installed dcr does. The
imports are counted in one more run of each under ``python -X importtime``: how many modules,
which of the heavy ones (numpy, pyarrow, torch, ...), and the packages that cost the most.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import Clock, paired  # noqa: E402

HEAVY = ("numpy", "pyarrow", "torch", "zstandard", "pcodec", "safetensors", "lmdb", "cryptography", "pydantic",
         "obstore", "rich", "typer")
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+\d+ \| (\s*)(\S+)")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


CHILDREN = Clock(cpu=_children_cpu)  # a subprocess's CPU time is its parent's children's


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


PYCACHE: list[Path] = []  # where the runs keep their bytecode (set by main)


def _env() -> dict[str, str]:
    """The runs' environment: bytecode written and read as an installed package's is (a
    PYTHONDONTWRITEBYTECODE environment would compile every module on every run), under a
    temporary prefix (nothing is written beside the sources)."""
    env = dict(os.environ)
    env.setdefault("COLUMNS", "100")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if PYCACHE:
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE[0])
    return env


def make_empty_delta(work: Path, dcr: list[str]) -> tuple[Path, Path]:
    """A log of two versions, the second changing nothing, and a receiver at version 0."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    save_file({"w": rng.standard_normal((256, 256)).astype(np.float32),
               "b": rng.standard_normal(256).astype(np.float32)}, str(work / "ckpt.safetensors"))
    log, parent = work / "log", work / "rx-parent"
    run([*dcr, "init", str(log), "--from", str(work / "ckpt.safetensors"), "--cache", "none"], work)
    run([*dcr, "apply", str(log), "--receiver", str(parent)], work)
    out = run([*dcr, "append", str(log), "--from", str(work / "ckpt.safetensors"), "--cache", "none"], work).stdout
    if not out.startswith("version 1: 0 changed"):
        raise SystemExit(f"the second version is not empty: {out.strip()}")
    return log, parent


def imports(argv: list[str], cwd: Path) -> dict:
    """What ARGV imports (its python run under -X importtime): the module count, the heavy
    ones, and the top packages by their own import time."""
    proc = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=_env())
    own: collections.Counter[str] = collections.Counter()
    modules = set()
    for line in proc.stderr.splitlines():
        m = IMPORT_LINE.match(line)
        if m:
            modules.add(m.group(3))
            own[m.group(3).split(".")[0]] += int(m.group(1))
    top = [{"package": p, "ms": round(us / 1e3, 1)} for p, us in own.most_common(8)]
    return {"modules": len(modules), "heavy": [h for h in HEAVY if h in modules], "top": top}


def measure(name: str, op: Callable[[], object], floor: Callable[[], object], repeats: int) -> dict:
    p = paired(op, floor, repeats, clock=CHILDREN)
    return {"case": name, **p.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dcr", default=f"{shlex.quote(sys.executable)} -m dcr_log",
                    help="how to run dcr (default: this python -m dcr_log; e.g. .venv/bin/dcr)")
    ap.add_argument("--json", action="store_true", help="one JSON object per case")
    args = ap.parse_args()
    dcr = shlex.split(args.dcr)
    python = dcr[0] if "python" in Path(dcr[0]).name else sys.executable
    floor_argv = [python, "-c", "pass"]
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        PYCACHE.append(work / "pycache")
        log, parent = make_empty_delta(work, dcr)  # also the warm-up: every module's bytecode written
        receivers = []
        for i in range(args.repeats + 2):  # copies of the parent, made before any timing
            receivers.append(work / f"rx-{i}")
            shutil.copytree(parent, receivers[-1], symlinks=True)
        apply_argv = [*dcr, "apply", str(log), "--receiver"]
        fresh = iter(receivers)
        cases = {
            "dcr --help": lambda: run([*dcr, "--help"], work),
            "dcr --version": lambda: run([*dcr, "--version"], work),
            "dcr apply (empty delta)": lambda: run([*apply_argv, str(next(fresh))], work),
        }
        cases["dcr apply (empty delta)"]()  # warm-up
        floor = lambda: run(floor_argv, work)
        for warm in (cases["dcr --help"], cases["dcr --version"], floor):
            warm()
        rows = [measure(name, op, floor, args.repeats) for name, op in cases.items()]
        modules = {
            "dcr --help": imports([*dcr, "--help"], work),
            "dcr --version": imports([*dcr, "--version"], work),
            "dcr apply (empty delta)": imports([*apply_argv, str(next(fresh))], work),
        }
    load = os.getloadavg()[0]
    for row in rows:
        row.update(modules[row["case"]], load_1min=load)
        if args.json:
            print(json.dumps(row))
            continue
        print(f"{row['case']:<24} {row['op_s']:.3f} s wall (cpu {row['op_cpu_s']:.3f} s), "
              f"{row['ratio']:.2f}x the interpreter's {row['baseline_s']:.3f} s "
              f"[{row['ratio_low']:.2f}-{row['ratio_high']:.2f}], {row['repeats']} runs; "
              f"{row['modules']} modules, heavy: {', '.join(row['heavy']) or 'none'}")
        print(" " * 25 + "own import ms: " + ", ".join(f"{t['package']} {t['ms']}" for t in row["top"]))
    if not args.json:
        print(f"load average (1 min) {load:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
