"""Multi-process runs: a free rendezvous port and one process per rank, with one deadline for all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn


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


def rank_watchdog(seconds: float) -> None:
    """Make a rank that is still running after ``seconds`` print every thread's stack and exit
    (status 1): a rank stuck where no process-group timeout reaches then says where, before
    run_ranks' own timeout kills it silently."""
    import faulthandler

    faulthandler.dump_traceback_later(seconds, exit=True)


def finish_rank(out: str | Path, rank: int, result: dict, status: int = 0) -> NoReturn:
    """End a rank script: write ``out/result-<rank>.json`` (whole or not at all), flush, and
    exit with ``status`` without interpreter teardown. A gloo group's destructor can block when
    a peer died, and in clean-clone runs it aborted ranks whose result was written ('terminate
    called without an active exception', exit -6), in three of the rank scripts: the result
    file, not teardown, says how the rank went."""
    path = Path(out, f"result-{rank}.json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
