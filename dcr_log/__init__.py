"""dcr-log: delta-compressed refit, an append-only versioned log of bit-exact tensor deltas.

The names below are imported on first use (PEP 562): ``import dcr_log`` and the ``dcr``
command's entry point (dcr_log._entry) stay light, so the command handles SIGINT and SIGTERM
before numpy, pyarrow and the rest are imported."""

from __future__ import annotations

__version__ = "0.1.0"

# name -> the submodule that defines it
_LAZY = {
    "CommitConflict": "errors", "CommitStateUnknown": "errors", "DcrError": "errors",
    "IntegrityError": "errors", "LineageError": "errors", "NotFoundError": "errors", "UsageError": "errors",
    "StoreError": "errors", "TrustError": "errors", "ExpiredError": "errors", "LayoutError": "errors",
    "PlacementError": "errors", "AppendAborted": "errors", "CollectiveFailed": "errors",
    "DeltaLog": "log", "as_numpy": "log", "state_equal": "log",
    "TensorBits": "state", "to_bits": "state", "to_state": "state",
    "LogWriter": "write.writer", "create_log": "write.writer",
}

__all__ = [
    "CommitConflict", "CommitStateUnknown", "DcrError", "IntegrityError", "LineageError", "NotFoundError", "UsageError",
    "StoreError", "TrustError", "ExpiredError", "LayoutError", "PlacementError", "AppendAborted", "CollectiveFailed",
    "DeltaLog", "LogWriter", "TensorBits", "as_numpy", "create_log", "state_equal", "to_bits",
    "to_state",
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
