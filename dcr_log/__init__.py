"""dcr-log: delta-compressed refit, an append-only versioned log of bit-exact tensor deltas.

The public API, in one place. A user imports from two modules:

- ``dcr_log``: writing and reading logs (``LogWriter``, ``create_log``, ``ShardedWriter``,
  ``Shard``, ``shards_from_module`` for DTensor trainers, ``SegmentUploader``, ``DeltaLog``),
  tensor bits (``TensorBits``, ``to_bits``, ``to_state``, ``state_equal``, ``as_numpy``), the
  collectives (``Group``, ``LocalGroup``, ``TorchGroup``) and every error class (``DcrError`` and its subclasses, from
  ``dcr_log.errors``);
- ``dcr_log.receiver``: applying a log in place (``Receiver``, ``ApplyReport``, the storages
  ``NumpyStorage``, ``TorchStorage``, ``CheckpointStorage``, ``open_storage``, ``Journal``).

Engine integrations live in ``dcr_log.engines`` (``dcr_log.engines.vllm``), log lifecycle in
``dcr_log.lifecycle``, the store contract for third-party stores in ``dcr_log.testing``.
Everything else is internal and may move.

The names below are imported on first use (PEP 562): ``import dcr_log`` and the ``dcr``
command's entry point (dcr_log._entry) stay light, so the command handles SIGINT and SIGTERM
before numpy, pyarrow and the rest are imported."""

from __future__ import annotations

__version__ = "0.1.0"

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing; type checkers take it as True
if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ imports each name on first use
    from dcr_log.collective import Group, LocalGroup, TorchGroup
    from dcr_log.dtensor import shards_from_module
    from dcr_log.errors import (
        AlreadyExists,
        AppendAborted,
        CacheWarning,
        CollectiveFailed,
        CommitConflict,
        CommitStateUnknown,
        DcrError,
        ExpiredError,
        IntegrityError,
        Interrupted,
        LayoutError,
        LineageError,
        NotFoundError,
        PlacementError,
        ReplicaMismatch,
        StoreError,
        TrustError,
        UsageError,
        WrongSize,
    )
    from dcr_log.log import DeltaLog, as_numpy, state_equal
    from dcr_log.state import TensorBits, to_bits, to_state
    from dcr_log.write import LogWriter, SegmentUploader, Shard, ShardedWriter, create_log

_ERRORS = (
    "DcrError", "UsageError", "PlacementError", "LayoutError", "IntegrityError", "WrongSize", "LineageError",
    "CommitConflict", "NotFoundError", "ExpiredError", "CommitStateUnknown", "AppendAborted", "CollectiveFailed",
    "StoreError", "AlreadyExists", "TrustError", "ReplicaMismatch", "Interrupted", "CacheWarning",
)

# name -> the submodule that defines it
_LAZY = {
    **{name: "errors" for name in _ERRORS},
    "DeltaLog": "log", "as_numpy": "log", "state_equal": "log",
    "TensorBits": "state", "to_bits": "state", "to_state": "state",
    "LogWriter": "write", "create_log": "write", "ShardedWriter": "write", "Shard": "write",
    "SegmentUploader": "write", "shards_from_module": "dtensor",
    "Group": "collective", "LocalGroup": "collective", "TorchGroup": "collective",
}

__all__ = [  # sorted; the names of _LAZY (tests/test_api_habits.py checks both ways)
    "AlreadyExists", "AppendAborted", "CacheWarning", "CollectiveFailed", "CommitConflict", "CommitStateUnknown",
    "DcrError", "DeltaLog", "ExpiredError", "Group", "IntegrityError", "Interrupted", "LayoutError", "LineageError",
    "LocalGroup", "LogWriter", "NotFoundError", "PlacementError", "ReplicaMismatch", "SegmentUploader", "Shard",
    "ShardedWriter", "StoreError", "TensorBits", "TorchGroup", "TrustError", "UsageError", "WrongSize", "as_numpy",
    "create_log", "shards_from_module", "state_equal", "to_bits", "to_state",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
