"""The collectives a sharded writer needs (all_gather, gather, broadcast of picklable objects),
behind one small interface: ``LocalGroup`` (one process, no torch) or ``TorchGroup`` (a
torch.distributed process group; a failure or the group's timeout becomes CollectiveFailed)."""

from __future__ import annotations

from typing import Any

from dcr_log.errors import CollectiveFailed, DcrError, UsageError


class Group:
    """The collectives a sharded writer needs. Rank 0 is the coordinator."""

    rank: int = 0
    size: int = 1

    def all_gather(self, obj: Any) -> list[Any]:
        raise NotImplementedError

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's object at the coordinator (None elsewhere)."""
        raise NotImplementedError

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's object on every rank."""
        raise NotImplementedError


class LocalGroup(Group):
    """One process: collectives are identities (no torch needed)."""

    def all_gather(self, obj):
        return [obj]

    def gather(self, obj):
        return [obj]

    def broadcast(self, obj):
        return obj


class TorchGroup(Group):
    """A torch.distributed process group (default: the world). Object collectives: every
    failure (a rank that died, the group's timeout) becomes CollectiveFailed."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("torch.distributed is not initialised: call init_process_group first")
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0

    def _call(self, what: str, fn):
        try:
            return fn()
        except DcrError:
            raise
        except Exception as exc:  # gloo/nccl raise RuntimeError subclasses on a lost peer or timeout
            raise CollectiveFailed(f"{what} failed on rank {self.rank}: {' '.join(str(exc).split())[:300]}") from exc

    def all_gather(self, obj):
        out = [None] * self.size
        self._call("all_gather", lambda: self._dist.all_gather_object(out, obj, group=self._group))
        return out

    def gather(self, obj):
        out = [None] * self.size if self.rank == 0 else None
        self._call("gather", lambda: self._dist.gather_object(obj, out, dst=self._root, group=self._group))
        return out

    def broadcast(self, obj):
        box = [obj]
        self._call("broadcast", lambda: self._dist.broadcast_object_list(box, src=self._root, group=self._group))
        return box[0]


def as_group(group: Any) -> Group:
    """A Group: given one, a torch process group, or None (the world when torch.distributed is
    initialised, else this process alone)."""
    if isinstance(group, Group):
        return group
    if group is None:
        try:
            import torch.distributed as dist
        except ImportError:
            return LocalGroup()
        if not dist.is_available() or not dist.is_initialized():
            return LocalGroup()
    return TorchGroup(group)
