"""Log lifecycle: snapshots, squashed catch-up deltas, retention (spec/FORMAT.md sections
23-25) and per-version statistics."""

from dcr_log.lifecycle.catchup import write_snapshot, write_squash
from dcr_log.lifecycle.retention import GcReport, gc, parse_duration

__all__ = ["write_snapshot", "write_squash", "GcReport", "gc", "parse_duration"]
