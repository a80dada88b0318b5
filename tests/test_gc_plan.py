"""gc: a dry run reports exactly what the same gc does, and the same gc run twice does
nothing the second time (spec/FORMAT.md section 25)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from dcr_log import DeltaLog
from dcr_log.lifecycle import gc, write_snapshot
from dcr_log.writer import LogWriter


def _log(root: Path, versions: int = 10, snapshots: tuple[int, ...] = ()) -> Path:
    rng = np.random.default_rng(7)
    words = rng.integers(0, 1 << 16, 1000, dtype=np.uint16)
    w = LogWriter.create(root, {"w": words}, cache_dir=False)
    for _ in range(versions):
        words = words.copy()
        words[rng.integers(0, words.size, 20)] ^= 1
        w.append({"w": words})
    for v in snapshots:
        write_snapshot(DeltaLog.open(root), v)
    return root


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("grace", [0.0, 3600.0])
@pytest.mark.parametrize("snapshots", [(), (4, 5), (8,)])
def test_dry_run_says_exactly_what_gc_does_and_a_second_gc_does_nothing(tmp_path, grace, snapshots):
    root = _log(tmp_path / "log", snapshots=snapshots)
    before = _listing(root)
    dry = gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace, dry_run=True).to_json()
    assert _listing(root) == before  # a dry run writes nothing
    real = gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace).to_json()
    assert real == dry
    assert real["start"] == 8  # latest 10, keep 3: versions 8, 9, 10 stay
    after = _listing(root)
    assert after != before
    again = gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace)
    assert _listing(root) == after  # the same gc again changes nothing
    assert again.snapshot_written is None and not again.retired and again.deleted_objects == 0
    assert again.to_json() == gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace, dry_run=True).to_json()
    if grace == 0:
        assert real["deleted_versions"] == 8 and DeltaLog.open(root).versions() == [8, 9, 10]
    else:
        assert real["deleted_objects"] == 0 and real["waiting"] == 1
        # Once the grace has passed, the deletions the markers allow, and then nothing more.
        later = gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace, now=_now() + 2 * grace)
        assert later.deleted_versions == 8
        assert gc(DeltaLog.open(root), 3, keep_snapshots=1, grace=grace,
                  now=_now() + 2 * grace).deleted_objects == 0


def test_retired_snapshots_are_reported_alike(tmp_path):
    root = _log(tmp_path / "log", versions=12, snapshots=(9, 10, 11))
    dry = gc(DeltaLog.open(root), 4, keep_snapshots=1, grace=0, dry_run=True).to_json()
    real = gc(DeltaLog.open(root), 4, keep_snapshots=1, grace=0).to_json()
    assert dry == real and real["retired"] == [10]  # start 9 kept, 11 the newest
    assert gc(DeltaLog.open(root), 4, keep_snapshots=1, grace=0).deleted_objects == 0


def test_cli_dry_run_json_equals_the_following_run(tmp_path):
    root = _log(tmp_path / "log", snapshots=(4,))
    rc, dry, err = run_cli("gc", root, "--keep-last", "3", "--grace", "0s", "--dry-run", "--json")
    assert rc == 0, err
    rc, real, err = run_cli("gc", root, "--keep-last", "3", "--grace", "0s", "--json")
    assert rc == 0, err
    drop = lambda row: {k: v for k, v in row.items() if k != "dry_run"}  # noqa: E731
    assert drop(json.loads(dry)) == drop(json.loads(real))
    rc, again, _ = run_cli("gc", root, "--keep-last", "3", "--grace", "0s", "--json")
    assert json.loads(again)["deleted_objects"] == 0 and json.loads(again)["snapshot_written"] is None


def _now() -> float:
    import time

    return time.time()
