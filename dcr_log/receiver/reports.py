"""What a receiver reports: ``ApplyReport`` for each version it applied, ``StageReport`` for
the version ``Receiver.stage`` prepared (public: re-exported by dcr_log.receiver)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ApplyReport:
    """What one version's apply did."""

    version: int
    route: str = "version"    # how it was reached: "version", "squash" (from ``start``) or "snapshot"
    start: int | None = None
    records: int = 0          # records of the version looked at in the write pass
    written: int = 0          # records written
    skipped: int = 0          # records found already at their target
    repaired: int = 0         # torn records finished (redo image or rewrite)
    changed_elements: int = 0
    segments: int = 0
    delta_bytes: int = 0
    recovered: bool = False   # the version was in flight when this apply started
    unheld: int = 0           # records of tensors the (engine) storage does not hold
    rebuilt: list[str] = field(default_factory=list)  # residual parameters rebuilt by the loader
    files_written: int = 0    # files of the version written (feature files, directories)
    files_removed: int = 0    # files the log had written that the version drops
    seconds: float = 0.0
    journal_seconds: float = 0.0


@dataclass
class StageReport:
    """What ``Receiver.stage`` prepared: one version fetched, checked and decoded."""

    version: int
    records: int = 0
    staged_bytes: int = 0     # decoded positions, values and mapped positions kept in memory
    delta_bytes: int = 0
    seconds: float = 0.0
