"""dcr-log: delta-compressed refit, an append-only versioned log of bit-exact tensor deltas."""

from .errors import CommitConflict, CommitStateUnknown, DcrError, IntegrityError, LineageError, NotFoundError, UsageError
from .log import DeltaLog, as_numpy, state_equal
from .state import TensorBits, to_bits, to_state
from .writer import LogWriter, create_log

__version__ = "0.1.0"

__all__ = [
    "CommitConflict", "CommitStateUnknown", "DcrError", "IntegrityError", "LineageError", "NotFoundError", "UsageError",
    "DeltaLog", "LogWriter", "TensorBits", "as_numpy", "create_log", "state_equal", "to_bits",
    "to_state",
]
