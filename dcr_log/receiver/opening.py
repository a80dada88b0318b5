"""What ``Receiver.open`` picks before there is a receiver: the journal (and its path) and the
storage, a plain one or an engine's layout behind a placement with its shadow copies."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcr_log.errors import UsageError
from dcr_log.receiver.journal import Journal
from dcr_log.receiver.storage import Storage, open_storage
from dcr_log.receiver.storage.memory import TorchStorage
from dcr_log.receiver.storage.placed import PlacedStorage

# A checkpoint directory's journal: DIR/.dcr.
JOURNAL_DIR = ".dcr"

LAYOUT_CHANGES = ("refuse", "own")


def check_layout_changes(layout_changes: str) -> str:
    if layout_changes not in LAYOUT_CHANGES:
        raise UsageError(f"layout_changes must be 'refuse' or 'own', not {layout_changes!r}")
    return layout_changes


def open_journal(storage: Any, journal_path: str | os.PathLike | None) -> Journal:
    """The receiver's journal (taking the receiver lock, which comes before the storage): at
    ``journal_path``, by default DIR/.dcr for a checkpoint directory."""
    if journal_path is None:
        if not isinstance(storage, (str, os.PathLike)):
            raise UsageError("a journal path is needed for in-memory storage")
        journal_path = Path(storage) / JOURNAL_DIR
    return Journal.open(journal_path)


def open_receiver_storage(storage: Any, journal_path: Path, device: Any = None, placement: Any = None,
                          loader: Callable | None = None, group: Any = None, rediscover: Callable | None = None,
                          loader_params: Any = None, shadow: Any = None, dtypes: Any = None,
                          layout_changes: str = "refuse") -> Storage:
    """The Storage a receiver writes (see Receiver.open for the arguments)."""
    base: Storage
    if dtypes is not None:
        from dcr_log.receiver.storage.memory import NumpyStorage
        base = NumpyStorage(storage, dtypes)
    else:
        base = open_storage(storage, device=device)
    if not isinstance(storage, (Storage, str, os.PathLike)):
        base.owns_layout = layout_changes == "own"
        if isinstance(base, TorchStorage) and placement is None and base.device.type != "cpu":
            base.device_words = True  # (an engine layout reads its parameters on the host)
    if placement is not None:
        from dcr_log.receiver.storage.placement import Placement
        if isinstance(placement, (str, os.PathLike)):
            placement = Placement.load(placement)
        if shadow is None and base.durable:
            shadow = journal_path / "shadow"
        shadow_storage = open_shadow(shadow) if shadow is not None else None
        return PlacedStorage(base, placement, group=group, shadow=shadow_storage, loader=loader,
                             loader_params=loader_params, rediscover=rediscover)
    if group is not None or loader is not None or rediscover is not None:
        raise UsageError("group=, loader= and rediscover= go with placement=")
    return base


def open_shadow(shadow: Any) -> Storage:
    """The canonical copies of residual sources: a Storage, a dict, or a directory (durable;
    created empty when missing, filled at bind)."""
    if isinstance(shadow, Storage):
        return shadow
    if isinstance(shadow, (str, os.PathLike)):
        from dcr_log.checkpoint import save_safetensors
        from dcr_log.receiver.storage.checkpoint import CheckpointStorage, has_checkpoint
        path = Path(shadow)
        if not has_checkpoint(path):
            path.mkdir(parents=True, exist_ok=True)
            save_safetensors({}, path / "model.safetensors", metadata={"format": "pt"})
        return CheckpointStorage(path)
    return open_storage(shadow)
