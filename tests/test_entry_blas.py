"""The dcr command keeps numpy's OpenBLAS to one thread: dcr calls no BLAS, and OpenBLAS starts
a thread per core at numpy's import that spins for about 0.1 s of CPU waiting for work (a core
taken from the start of every command). A setting of the caller's own is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dcr_log import LogWriter, TensorBits

REPORT = """
import atexit, ctypes, json, os, sys
def report():
    loaded = "numpy" in sys.modules
    paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.split()[-1]}
    threads = None
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                     "openblas_get_num_threads"):
            if hasattr(lib, name):
                threads = getattr(lib, name)()
    print(json.dumps({"numpy": loaded, "env": os.environ.get("OPENBLAS_NUM_THREADS"),
                      "threads": threads}), flush=True)
atexit.register(report)
sys.argv = ["dcr", "log", sys.argv[1]]
from dcr_log._entry import entry
entry()
"""


@pytest.mark.parametrize("setting", [None, "2"])
def test_dcr_runs_numpy_with_one_blas_thread_unless_told(tmp_path, setting):
    words = np.arange(64, dtype=np.uint16)
    LogWriter.create(tmp_path / "log", {"w": TensorBits("BF16", (64,), words)}, cache_dir=False)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if setting is not None:
        env["OPENBLAS_NUM_THREADS"] = setting
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(REPORT), str(tmp_path / "log")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["numpy"]  # the command imported numpy, with its OpenBLAS
    assert got["threads"] is not None
    if setting is None:
        assert got["env"] == "1" and got["threads"] == 1
    else:
        assert got["env"] == setting and got["threads"] == min(int(setting), os.cpu_count() or 1)
