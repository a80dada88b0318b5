"""Receiver storage: where a receiver's weights live, seen as flat little-endian words.

Three backends share one small interface (``base.Storage``; spec/RECEIVER.md, "Storage"):
``memory.NumpyStorage`` and ``memory.TorchStorage`` (dicts of arrays or tensors on any device,
updated in place), ``checkpoint.CheckpointStorage`` (a safetensors checkpoint directory updated
in place through writable memory maps; durable), and ``placed.PlacedStorage`` (an engine's own
tensors, reached through a placement)."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from dcr_log.errors import UsageError
from dcr_log.receiver.storage.base import FaultHook, Storage, Where, storage_state_digest, tensor_digests
from dcr_log.receiver.storage.checkpoint import CheckpointStorage, has_checkpoint
from dcr_log.receiver.storage.memory import NumpyStorage, TorchStorage
from dcr_log.state import is_torch_tensor

__all__ = ["FaultHook", "Storage", "Where", "storage_state_digest", "tensor_digests", "CheckpointStorage",
           "has_checkpoint", "NumpyStorage", "TorchStorage", "open_storage"]


def open_storage(storage: Any, device: Any = None) -> Storage:
    """A Storage for a Storage, a checkpoint directory path, or a dict of numpy / torch tensors."""
    if isinstance(storage, Storage):
        return storage
    if isinstance(storage, (str, os.PathLike)):
        return CheckpointStorage(storage)
    if isinstance(storage, MutableMapping):
        if any(is_torch_tensor(v) for v in storage.values()):
            return TorchStorage(storage, device=device)
        return NumpyStorage(storage)
    raise UsageError(f"cannot use a {type(storage).__name__} as receiver storage")
