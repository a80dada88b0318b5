#!/usr/bin/env python
"""Run the test suite several times in a row with a CPU load beside it, as ``stress --cpu N``
would (busy processes started and stopped here, so nothing needs installing); stop at the first
failing run.

    python tools/stress_suite.py [--load 4] [--runs 5] [--nice 0] [-- PYTEST ARGS]

PYTEST ARGS default to ``-q -n 2 -p no:cacheprovider tests`` (what ``make test`` runs). Each
run's wall time, exit status and pytest's summary line are printed, then the total. ``--nice``
lowers the priority of both the load and the suite together (their share against each other
stays the same) when the machine has other work to do.

Exit status: 0 when every run passed, else the first failing run's pytest status.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUSY = "while True: pass"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, default=4, help="busy processes beside the suite")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nice", type=int, default=0, help="niceness of the load and the suite")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    pytest_args = args.pytest_args or ["-q", "-n", "2", "-p", "no:cacheprovider", "tests"]

    def lowered() -> None:
        os.nice(args.nice)

    load = [subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=lowered) for _ in range(args.load)]
    started = time.monotonic()
    status = 0
    try:
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT,
                                  capture_output=True, text=True, preexec_fn=lowered)
            lines = [line for line in proc.stdout.splitlines() if line.strip()]
            summary = lines[-1] if lines else "(no output)"
            print(f"run {run}/{args.runs}: exit {proc.returncode} in {time.monotonic() - t0:.0f} s: {summary}",
                  flush=True)
            if proc.returncode != 0:
                sys.stdout.write(proc.stdout[-20000:])
                sys.stderr.write(proc.stderr[-5000:])
                status = proc.returncode
                break
    finally:
        for p in load:
            p.send_signal(signal.SIGKILL)
            p.wait()
    print(f"{run} run(s) with {args.load} busy processes beside them in {time.monotonic() - started:.0f} s",
          flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
