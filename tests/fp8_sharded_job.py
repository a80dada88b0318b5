"""Two ranks of an FP8 trainer logging with ShardedWriter (run by tests/test_fp8_engine.py):
``python fp8_sharded_job.py '<json>' <rank>``. Each rank holds a tensor-parallel half of every
linear weight (rows where they split into whole 128-row blocks, else columns), quantizes its own
half with Fp8BlockQuantizer (blocks never straddle the split, so the halves are the global
quantization's) and logs the e4m3 words and fp32 scales as Shards; the other tensors are
replicated bf16."""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from fp8_engine_job import bf16_states  # noqa: E402
from helpers.ranks import finish_rank  # noqa: E402


def split_axis(shape: tuple[int, ...], world: int, block: int = 128) -> int:
    return 0 if shape[0] % (world * block) == 0 else 1


def local_state(state: dict[str, torch.Tensor], rank: int, world: int, select) -> dict[str, tuple[torch.Tensor, tuple]]:
    """This rank's part of ``state``: name -> (local tensor, offset)."""
    out = {}
    for name, t in state.items():
        shape = tuple(t.shape)
        if not select(name, shape):
            out[name] = (t, (0,) * t.dim())
            continue
        axis = split_axis(shape, world)
        n = shape[axis] // world
        off = [0, 0]
        off[axis] = rank * n
        out[name] = (t.narrow(axis, rank * n, n).contiguous(), tuple(off))
    return out


def main() -> None:
    conf = json.loads(sys.argv[1])
    rank, world = int(sys.argv[2]), conf["world"]
    out = Path(conf["out"])
    try:
        from dcr_log.quant import Fp8BlockQuantizer, quantized_by_default
        from dcr_log.write.pieces import Shard
        from dcr_log.write.sharded import ShardedWriter

        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{conf['port']}",
                                             rank=rank, world_size=world, timeout=timedelta(seconds=60))
        quant = Fp8BlockQuantizer(policy=conf["policy"])
        writer = None
        previous: dict[str, torch.Tensor] | None = None
        for state in bf16_states():
            local = local_state(state, rank, world, quantized_by_default)
            shards, q_local = {}, {}
            for name, (t, off) in local.items():
                if quantized_by_default(name, tuple(state[name].shape)):
                    prev = None if previous is None else previous[name + "_scale_inv"]
                    q, s = quant.quantize(t, prev)
                    q_local[name + "_scale_inv"] = s
                    shards[name] = [Shard(q, off)]
                    shards[name + "_scale_inv"] = [Shard(s, (off[0] // 128, off[1] // 128))]
                else:
                    shards[name] = [Shard(t, off)]
            shapes = {n: tuple(state[n].shape) for n in state}
            for n in list(shards):
                if n.endswith("_scale_inv"):
                    r, c = shapes[n[:-len("_scale_inv")]]
                    shapes[n] = (-(-r // 128), -(-c // 128))
            if writer is None:
                writer = ShardedWriter.create(conf["log"], shards, shapes, group=torch.distributed.group.WORLD,
                                              cache_dir=False)
            else:
                writer.append(shards, shapes)
            previous = q_local
        result = {"ok": True}
    except BaseException as exc:  # reported to the test, which fails on it
        result = {"ok": False, "error_type": type(exc).__name__, "message": str(exc),
                  "trace": traceback.format_exc()}
    finish_rank(out, rank, result)


if __name__ == "__main__":
    main()
