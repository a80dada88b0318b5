"""DTensor trainers for tests/test_dtensor.py: one rank of a gloo group on CPU that trains a tiny
Llama-shaped model sharded with FSDP2 (``fully_shard``), tensor parallelism
(``parallelize_module``) or both, and logs its bf16 DTensor shards with ShardedWriter.

Run as ``python tests/dtensor_job.py CONFIG_JSON RANK``. ``case`` chooses the scenario:

- ``fsdp2``: FSDP2 on 2 ranks, uneven rows (257 -> 129/128) and an empty local shard;
- ``tp``: Colwise/Rowwise tensor parallelism on 2 ranks (Shard(0), Shard(1)), the rest
  replicated (plain tensors on every rank: replicas, compared);
- ``mesh2d``: 4 ranks: HSDP (Replicate, Shard(0)) and FSDP2 + TP (_StridedShard, Shard(0)),
  one log each;
- ``refusals``: DTensors passed where dcr-log cannot take them, each refused with a UsageError;
- ``replicas``: replicas that diverge (plain tensors and Replicate DTensors) are refused.

Rank 0 saves every version's reference (``full_tensor()`` of each tensor, as bf16 bits) to
``<out>/<log name>-<version>.npz``; every rank writes ``<out>/result-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

from helpers.ranks import finish_rank, rank_watchdog

STEPS = 3           # versions 0..STEPS (AdamW steps between them)
VOCAB, HIDDEN = 37, 16
INTER = 257      # FSDP2: 129/128 rows on 2 ranks
INTER_TP = 258   # tensor parallel needs even halves (129 each; FSDP2 then splits them 65/64)


def _error(exc: BaseException) -> dict:
    return {"error_type": type(exc).__name__, "message": str(exc)}


def build_model(inter: int = INTER):
    """A tiny Llama-shaped block: embedding, attention-like q/o, an MLP of ``inter`` rows, a
    norm, a 1-row head, a persistent and a non-persistent buffer."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.up_proj = nn.Linear(HIDDEN, inter, bias=False)
            self.down_proj = nn.Linear(inter, HIDDEN, bias=False)

        def forward(self, x):
            x = x + self.o_proj(torch.tanh(self.q_proj(x)))
            return x + self.down_proj(torch.relu(self.up_proj(x)))

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.Parameter(torch.ones(HIDDEN))
            self.score = nn.Linear(HIDDEN, 1)  # bias of 1 row: an empty local shard on rank 1
            self.register_buffer("inv_freq", torch.arange(HIDDEN, dtype=torch.float32) / HIDDEN)
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.score(x * self.norm + self.inv_freq).float()

    torch.manual_seed(0)
    return Tiny()


def train_step(model, opt, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(100 + step)  # the same batch on every rank
    ids = torch.randint(0, VOCAB, (4, 5), generator=g)
    loss = model(ids).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():  # a buffer that changes too
        model.inv_freq.add_(0.5)


def reference(model) -> dict[str, np.ndarray]:
    """Every logged tensor in full (collective: full_tensor), as bf16 bits or int words."""
    import torch
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        full = full.detach().to(torch.bfloat16) if full.is_floating_point() else full.detach()
        out[name] = full.contiguous().view(torch.uint16 if full.dtype == torch.bfloat16 else full.dtype).numpy()
    return out


def log_training(cfg: dict, rank: int, model, name: str, result: dict) -> None:
    """Create a log from the model's shards, train STEPS steps, append after each."""
    import torch
    import torch.distributed as dist

    from dcr_log import ShardedWriter, shards_from_module

    path = str(Path(cfg["out"], name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shards = shards_from_module(model, dtype=torch.bfloat16)  # one mapping for every step
    result.setdefault("held", {})[name] = {n: [list(s.offset), list(s.global_shape)] for n, (s,) in shards.items()}
    for v in range(STEPS + 1):
        if v == 0:
            writer = ShardedWriter.create(path, shards, cache_dir=False)
        else:
            train_step(model, opt, v)
            writer.append(shards)
        ref = reference(model)
        if rank == 0:
            np.savez(Path(cfg["out"], f"{name}-{v}.npz"), **ref)
    dist.barrier()
    result.setdefault("versions", {})[name] = writer.version


def case_fsdp2(cfg: dict, rank: int, result: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (cfg["world"],))
    model = build_model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log_training(cfg, rank, model, "fsdp2", result)


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan[f"layers.{i}.q_proj"] = ColwiseParallel()
        plan[f"layers.{i}.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.up_proj"] = ColwiseParallel()
        plan[f"layers.{i}.down_proj"] = RowwiseParallel()
    return plan


def case_tp(cfg: dict, rank: int, result: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (cfg["world"],))
    model = parallelize_module(build_model(INTER_TP), mesh, _tp_plan())
    log_training(cfg, rank, model, "tp", result)


def case_mesh2d(cfg: dict, rank: int, result: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model()
    for layer in model.layers:
        fully_shard(layer, mesh=hsdp)
    fully_shard(model, mesh=hsdp)
    log_training(cfg, rank, model, "hsdp", result)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(build_model(INTER_TP), mesh["tp"], _tp_plan())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    result["fsdp_tp_placements"] = placements
    log_training(cfg, rank, model, "fsdp_tp", result)


def _attempt(result: dict, what: str, fn) -> None:
    try:
        fn()
        result["attempts"][what] = {"ok": True}
    except Exception as exc:
        result["attempts"][what] = {"ok": False, **_error(exc)}


def case_refusals(cfg: dict, rank: int, result: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dcr_log import LogWriter, Shard, ShardedWriter, to_state
    from dcr_log.receiver import TorchStorage

    mesh = init_device_mesh("cpu", (cfg["world"],))
    dt = distribute_tensor(torch.arange(24, dtype=torch.float32).reshape(6, 4), mesh, [TorchShard(0)])
    out = Path(cfg["out"])
    result["attempts"] = {}
    _attempt(result, "Shard(dt)", lambda: ShardedWriter.create(str(out / "direct"), {"w": [Shard(dt)]},
                                                                 {"w": (6, 4)}, cache_dir=False))
    _attempt(result, "dict value", lambda: ShardedWriter.create(str(out / "value"), {"w": dt}, {"w": (6, 4)},
                                                                  cache_dir=False))
    _attempt(result, "list value", lambda: ShardedWriter.create(str(out / "listed"), {"w": [dt]},
                                                                  {"w": (6, 4)}, cache_dir=False))
    _attempt(result, "converter", lambda: ShardedWriter.create(str(out / "converter"),
                                                                 {"w": [Shard.converted(lambda: dt)]},
                                                                 {"w": (6, 4)}, cache_dir=False))
    _attempt(result, "LogWriter", lambda: LogWriter.create(str(out / f"whole-{rank}"), {"w": dt}, cache_dir=False))
    _attempt(result, "to_state", lambda: to_state({"w": dt}))
    _attempt(result, "receiver", lambda: TorchStorage({"w": dt}))
    strided = DTensor.from_local(torch.zeros(4, 4), mesh, [_StridedShard(0, split_factor=2)], run_check=False,
                                 shape=torch.Size((8, 4)), stride=(4, 1))
    _attempt(result, "strided", lambda: Shard.from_dtensor(strided))
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
    _attempt(result, "partial", lambda: Shard.from_dtensor(partial))
    dist.barrier()
    if rank == 0:
        result["listing"] = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()
                                   and not p.name.startswith(("rank-", "result-")))


def case_replicas(cfg: dict, rank: int, result: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from dcr_log import Shard, ShardedWriter

    mesh = init_device_mesh("cpu", (cfg["world"],))
    path = str(Path(cfg["out"], "replicas"))
    same = torch.full((4,), 1.0)
    writer = ShardedWriter.create(path, {"w": [Shard(same)]}, {"w": (4,)}, cache_dir=False)
    result["attempts"] = {}
    mine = torch.full((4,), 1.0 + rank)  # [1.0]*4 on rank 0, [2.0]*4 on rank 1
    _attempt(result, "plain", lambda: writer.append({"w": [Shard(mine)]}))
    rep = DTensor.from_local(torch.full((4,), 3.0 + rank), mesh, [Replicate()], run_check=False)
    _attempt(result, "replicate", lambda: writer.append({"w": [Shard.from_dtensor(rep)]}))
    dist.barrier()
    result["versions_after_refusals"] = writer.log.versions()
    _attempt(result, "opted out", lambda: writer.append({"w": [Shard(mine)]}, check_replicas=False))
    result["versions"] = writer.log.versions()


CASES = {"fsdp2": case_fsdp2, "tp": case_tp, "mesh2d": case_mesh2d, "refusals": case_refusals,
         "replicas": case_replicas}


def main() -> None:
    cfg, rank = json.loads(sys.argv[1]), int(sys.argv[2])
    result: dict = {"rank": rank, "ok": False}
    if cfg.get("watchdog"):
        rank_watchdog(cfg["watchdog"])
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                                world_size=cfg["world"], timeout=timedelta(seconds=cfg["timeout"]))
        CASES[cfg["case"]](cfg, rank, result)
        result["ok"] = True
        dist.barrier()
        dist.destroy_process_group()  # a clean exit: no abort in the group's destructor
    except BaseException as exc:
        result.update(ok=False, unexpected=True, **_error(exc), traceback=traceback.format_exc())
        traceback.print_exc()
    finish_rank(cfg["out"], rank, result, 0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
