"""DTensor trainers: FSDP2 (``fully_shard``), tensor parallelism (``parallelize_module``) and
their 2-D meshes (HSDP, FSDP2 + TP) logged with ShardedWriter in one call.

``shard_from_dtensor`` (``Shard.from_dtensor``) turns a DTensor into this rank's Shard: its
local tensor at the global offset its placements give; ``shards_from_module`` does it for every
parameter and persistent buffer of a module. Ranks that hold the same box (``Replicate``
placements, the replicate dimension of HSDP) are replicas: ShardedWriter compares them.

The offsets are computed here, from public DTensor API (``placements``, ``device_mesh.shape``,
``device_mesh.get_coordinate()``, ``to_local()``): torch has no public function for them (its
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` is private; the tests
check this module against it). ``_StridedShard`` (FSDP2 over a TP-sharded dimension) is
recognised by its ``split_factor``. Tested with torch 2.13.0; torch >= 2.5 is needed (the public
``torch.distributed.tensor`` module). torch is imported only by these functions' callers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dcr_log.errors import UsageError
from dcr_log.state import _DTYPE_TO_TORCH, is_dtensor, is_torch_tensor
from dcr_log.write.pieces import Shard

__all__ = ["shard_from_dtensor", "shards_from_module", "local_indices", "local_box"]


def _chunk(size: int, n: int, r: int) -> range:
    """Rank ``r``'s part of ``size`` elements split in ``n`` (torch.chunk's sizes; the last
    parts may be short or empty)."""
    step = -(-size // n)
    return range(min(step * r, size), min(step * (r + 1), size))


def _strided(size: int, n: int, r: int, split_factor: int) -> list[int]:
    """Rank ``r``'s indices under _StridedShard: ``size`` is first cut in ``split_factor``
    parts (as a later mesh dimension shards it), each part is cut in ``n``, and the rank
    holds its part of each, in order."""
    out: list[int] = []
    for part in _chunk_all(size, split_factor):
        out.extend(part[i] for i in _chunk(len(part), n, r))
    return out


def _chunk_all(size: int, n: int) -> list[range]:
    return [_chunk(size, n, r) for r in range(n)]


def local_indices(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                  placements: Sequence[Any]) -> list[np.ndarray]:
    """Per dimension of the global tensor, the global indices this mesh coordinate holds, in
    the order of its local tensor (placements applied left to right, as DTensor does).
    ``Partial`` placements are refused (UsageError)."""
    shape = [int(s) for s in global_shape]
    indices = [np.arange(s, dtype=np.int64) for s in shape]
    for mesh_dim, p in enumerate(placements):
        if p.is_replicate():
            continue
        if p.is_partial():
            raise UsageError(f"a DTensor with a Partial placement ({p}) holds partial sums, not values: "
                             "reduce it first (dt.redistribute(placements=[Replicate()] * mesh.ndim), or "
                             "dt.full_tensor()), then log it")
        dim = getattr(p, "dim", None)
        if dim is None:
            raise UsageError(f"a DTensor placement {p!r} is not supported (Shard, Replicate and FSDP2's "
                             "_StridedShard are)")
        dim = int(dim) % len(shape) if shape else int(dim)
        n, r = int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        current = indices[dim]
        split_factor = getattr(p, "split_factor", None)
        if split_factor is not None:
            take = np.asarray(_strided(current.size, n, r, int(split_factor)), dtype=np.int64)
        else:
            part = _chunk(current.size, n, r)
            take = np.arange(part.start, part.stop, dtype=np.int64)
        indices[dim] = current[take]
    return indices


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
              placements: Sequence[Any], what: str = "a DTensor") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offset, shape) of the one box a mesh coordinate holds; UsageError when its local
    tensor is not one box of the global tensor (a 1-D _StridedShard). An empty local tensor
    sits at the end of its dimension (as torch reports it)."""
    offset, local = [], []
    for dim, idx in enumerate(local_indices(global_shape, mesh_shape, coordinate, placements)):
        if idx.size == 0:
            offset.append(int(global_shape[dim]))
            local.append(0)
            continue
        start = int(idx[0])
        if not np.array_equal(idx, np.arange(start, start + idx.size)):
            raise UsageError(
                f"{what} with placements {tuple(placements)} holds rows of dimension {dim} that are not "
                f"contiguous in the global tensor (global indices {_some(idx)}): its local tensor is not one "
                "box, so it cannot be one Shard. Shard that dimension with Shard(dim) placements (or give "
                "fully_shard a mesh whose strided shards form one box), or log dt.full_tensor() from one rank")
        offset.append(start)
        local.append(int(idx.size))
    return tuple(offset), tuple(local)


def _some(idx: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:6])
    return f"[{shown}{', ...' if idx.size > 6 else ''}]"


def _torch_dtype(dtype: Any) -> Any:
    """A torch dtype, from a torch dtype or a safetensors name ("BF16")."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_TO_TORCH.get(str(dtype))
    if name is None:
        raise UsageError(f"dtype {dtype!r}: give a torch dtype or a safetensors dtype name such as 'BF16'")
    return getattr(torch, name)


def shard_from_dtensor(dt: Any, dtype: Any = None) -> Shard:
    """This rank's Shard of a DTensor: its local tensor, at the global offset its placements
    give, with the global shape (so ``shapes=`` is not needed). The local tensor is read at
    every append (converted to ``dtype`` first when given: a torch dtype or "BF16"), so one
    Shard serves every step while the parameter is updated in place.

    Refused (UsageError): a Partial placement, a rank outside the DTensor's mesh, a local
    tensor that is not one box of the global tensor. A plain tensor is a whole tensor."""
    cast = _torch_dtype(dtype)
    if not is_dtensor(dt):
        if not is_torch_tensor(dt):
            raise UsageError(f"Shard.from_dtensor takes a torch DTensor, not {type(dt).__name__}")
        return _lazy(dt, cast, (0,) * dt.dim(), tuple(int(s) for s in dt.shape))
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UsageError("this rank is not in the DTensor's device mesh: it holds no shard of it "
                         "(give only the DTensors of meshes this rank belongs to)")
    global_shape = tuple(int(s) for s in dt.shape)
    offset, shape = local_box(global_shape, tuple(mesh.shape), coordinate, dt.placements)
    local = dt.to_local()
    if tuple(int(s) for s in local.shape) != shape:
        raise UsageError(f"a DTensor of shape {global_shape} with placements {tuple(dt.placements)}: its "
                         f"local tensor has shape {tuple(local.shape)}, its placements give {shape} "
                         "(an uneven DTensor made with from_local(shape=...) is not supported)")
    return _lazy(dt, cast, offset, global_shape)


def _lazy(tensor: Any, cast: Any, offset: tuple[int, ...], global_shape: tuple[int, ...]) -> Shard:
    """A box shard whose local tensor is taken at each append (logged as xor records)."""
    def local() -> Any:
        t = tensor.to_local() if is_dtensor(tensor) else tensor
        return t if cast is None else t.to(cast)

    shard = Shard.lazy(local, offset)
    shard.global_shape = global_shape
    return shard


def shards_from_module(module: Any, dtype: Any = None) -> dict[str, list[Shard]]:
    """Every parameter and persistent buffer of ``module`` (its ``state_dict`` names, tied
    weights under each of their names), DTensor or plain, as ``{name: [Shard]}`` for
    ShardedWriter.create / append. Floating-point tensors are converted to ``dtype`` when given
    (integer and bool buffers keep theirs). A plain tensor is whole on every rank: the ranks
    hold replicas of it, and ShardedWriter checks that they agree."""
    cast = _torch_dtype(dtype)
    out: dict[str, list[Shard]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not is_torch_tensor(tensor):
            continue  # extra state objects are not tensors
        floating = tensor.is_floating_point()
        out[name] = [shard_from_dtensor(tensor, cast if floating else None)]
    return out
