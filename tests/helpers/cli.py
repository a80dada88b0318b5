"""The dcr command in a subprocess (``python -m dcr_log``), with a wide, colourless terminal,
and the one-line error report every failing command gives."""

from __future__ import annotations

import os
import subprocess
import sys


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["COLUMNS"] = "250"  # wide tables: no wrapped cells
    env.pop("FORCE_COLOR", None)
    return env


def run_cli(*args, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``python -m dcr_log ARGS`` in a subprocess; returns (rc, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dcr_log", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=cli_env(),
    )
    return proc.returncode, proc.stdout, proc.stderr


def start_cli(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dcr_log", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
    )


def assert_one_line(stderr: str) -> None:
    """A failing command reports exactly one line on stderr."""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, repr(stderr)
    assert stderr.startswith("dcr: "), repr(stderr)
