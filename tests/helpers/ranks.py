"""Multi-process runs: a free rendezvous port and one process per rank, with one deadline for all."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a gloo group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argvs: list[list[str]], out: Path, timeout: float, env: dict | None = None,
              name: str = "rank") -> list[tuple[int | None, str]]:
    """Run one process per argv (stdout and stderr to ``out/<name>-<r>.out``), wait for all of
    them up to ``timeout`` seconds in total and kill what is left. Returns each rank's
    (exit status, None if it had to be killed; output)."""
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # 2 cores shared by the ranks
    procs, files, killed = [], [], set()
    try:
        for rank, argv in enumerate(argvs):
            f = open(out / f"{name}-{rank}.out", "w+")
            files.append(f)
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                killed.add(r)
            p.wait()
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    return [(None if r in killed else p.returncode, o) for r, (p, o) in enumerate(zip(procs, outputs))]
