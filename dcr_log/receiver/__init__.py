"""Receivers: apply a log's versions in place to numpy, torch or checkpoint-directory storage,
idempotently and crash-safely, with an LMDB journal (spec/RECEIVER.md)."""

from dcr_log.receiver.directory import open_directory, write_checkpoint
from dcr_log.receiver.journal import Journal, JournalState
from dcr_log.receiver.opening import JOURNAL_DIR
from dcr_log.receiver.receiver import VERIFY_LEVELS, Receiver
from dcr_log.receiver.reports import ApplyReport, StageReport
from dcr_log.receiver.storage import Storage, open_storage
from dcr_log.receiver.storage.checkpoint import CheckpointStorage
from dcr_log.receiver.storage.memory import NumpyStorage, TorchStorage

__all__ = [
    "JOURNAL_DIR", "VERIFY_LEVELS", "ApplyReport", "StageReport", "Receiver", "open_directory", "write_checkpoint",
    "Journal", "JournalState", "CheckpointStorage", "NumpyStorage", "Storage", "TorchStorage", "open_storage",
]
