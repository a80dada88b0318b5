"""Log lifecycle: snapshots, squashed catch-up deltas, retention (spec/FORMAT.md sections
23-25) and per-version statistics."""

from .catchup import write_snapshot, write_squash
from .retention import GcReport, gc, parse_duration

__all__ = ["write_snapshot", "write_squash", "GcReport", "gc", "parse_duration"]
