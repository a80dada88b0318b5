"""``dcr demo``: log a few synthetic training steps, replay every version, check it bit-exact.

Offline and self-contained: a transformer-shaped bf16 model is trained by an Adam-like rule
(dcr_log.synthetic), each step is appended to a local log as a delta, and every version is
rebuilt from the log by DeltaLog.materialize and compared word for word with the state that
was written. Only one dense state is held at a time.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format import IDENTITY_KEY
from dcr_log.log.deltalog import DeltaLog
from dcr_log.state import TensorBits
from dcr_log.synthetic import SyntheticTrainer, specs_for_params
from dcr_log.write.writer import LogWriter

DEFAULT_PARAMS = 64_000_000
DEFAULT_VERSIONS = 10


@dataclass(frozen=True)
class VersionRow:
    version: int
    changed_elements: int
    total_elements: int
    delta_bytes: int
    dense_bytes: int
    encode_s: float
    replay_s: float
    bit_exact: bool

    @property
    def changed_pct(self) -> float:
        return 100.0 * self.changed_elements / max(self.total_elements, 1)

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.delta_bytes, 1)


@dataclass(frozen=True)
class DemoReport:
    log_path: Path | None  # None when the log was in a temporary directory, now removed
    params: int
    rows: tuple[VersionRow, ...]

    @property
    def all_bit_exact(self) -> bool:
        return all(r.bit_exact for r in self.rows)


def _same_bits(replayed: dict[str, TensorBits], written: dict[str, TensorBits]) -> bool:
    """Word-for-word equality of two states (names, dtypes, shapes and every word)."""
    if replayed.keys() != written.keys():
        return False
    for name, bits in written.items():
        got = replayed[name]
        if got.dtype != bits.dtype or got.shape != bits.shape or not np.array_equal(got.words, bits.words):
            return False
    return True


def _gb_per_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f}"


def run_demo(dir: Path | None, console: Console, params: int = DEFAULT_PARAMS,
             versions: int = DEFAULT_VERSIONS, seed: int = 0) -> DemoReport:
    """Write ``versions`` versions of a ~``params``-parameter bf16 model to a log in ``dir``
    (a temporary directory if None), replay and check each; raise IntegrityError unless every
    version replays bit-exact.
    """
    if versions < 1:
        raise UsageError("versions must be at least 1")
    if dir is not None and (Path(dir) / IDENTITY_KEY).exists():
        raise UsageError(f"{dir} already holds a log; give --dir a new directory")
    temp = tempfile.TemporaryDirectory(prefix="dcr-demo-") if dir is None else nullcontext()
    with temp as temp_root:
        path = Path(str(temp_root)) / "log" if dir is None else Path(dir)
        trainer = SyntheticTrainer(specs_for_params(params), seed=seed)
        dense = trainer.nbytes
        console.print(
            f"model: {len(trainer.specs)} tensors, {trainer.params:,} bf16 parameters "
            f"({dense / 1e6:.1f} MB); fp32 master weights, Adam lr {trainer.config.lr:g}",
            markup=False,
        )
        console.print(f"log: {path if dir is not None else 'a temporary directory'}", markup=False)
        rows: list[VersionRow] = []
        writer: LogWriter | None = None
        reader: DeltaLog | None = None
        for v in range(versions):
            with console.status(f"version {v}: training step, append, replay"):
                if v:
                    trainer.step()
                state = trainer.state()
                t0 = time.perf_counter()
                if writer is None:
                    writer = LogWriter.create(path, state, cache_dir=False)  # one process keeps its writer: no cache
                    commit = writer.log.commit(0)
                else:
                    commit = writer.append(state)
                encode_s = time.perf_counter() - t0
                if reader is None:
                    reader = DeltaLog.open(path)  # a reader of its own, sharing nothing with the writer
                t0 = time.perf_counter()
                replayed = reader.materialize(v)
                replay_s = time.perf_counter() - t0
                exact = _same_bits(replayed, state)
                del replayed
            rows.append(VersionRow(v, commit.stats.changed_elements, commit.stats.total_elements,
                                   commit.delta_bytes, dense, encode_s, replay_s, exact))
        report = DemoReport(path if dir is not None else None, trainer.params, tuple(rows))
        _print_report(console, report)
    if not report.all_bit_exact:
        bad = [r.version for r in report.rows if not r.bit_exact]
        raise IntegrityError(f"demo: versions {bad} did not replay bit-exact")
    return report


def _print_report(console: Console, report: DemoReport) -> None:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for header in ("version", "changed", "delta bytes", "dense bytes", "ratio", "encode s",
                   "replay s", "exact"):
        table.add_column(header, justify="left" if header == "version" else "right", no_wrap=True)
    for r in report.rows:
        table.add_row(
            str(r.version),
            "full" if r.version == 0 else f"{r.changed_pct:.2f}%",
            f"{r.delta_bytes:,}",
            f"{r.dense_bytes:,}",
            f"{r.ratio:.1f}x",
            f"{r.encode_s:.3f}",
            f"{r.replay_s:.3f}",
            "yes" if r.bit_exact else "[bold red]NO[/]",
        )
    console.print(table)
    steps = [r for r in report.rows if r.version > 0]
    last = report.rows[-1]
    verdict = (f"all {len(report.rows)} versions replayed bit-exact" if report.all_bit_exact
               else f"[bold red]{sum(not r.bit_exact for r in report.rows)} of {len(report.rows)} "
                    "versions NOT bit-exact[/]")
    if not steps:
        console.print(verdict)
        return
    delta = sum(r.delta_bytes for r in steps)
    dense = sum(r.dense_bytes for r in steps)
    encode = sum(r.encode_s for r in steps)
    console.print(
        f"{verdict}. {len(steps)} steps: {delta / 1e6:.2f} MB of deltas instead of "
        f"{dense / 1e6:.1f} MB dense ({dense / max(delta, 1):.1f}x smaller); append "
        f"{_gb_per_s(dense, encode)} GB/s; replay of version {last.version} from version 0: "
        f"{last.replay_s:.3f} s."
    )
