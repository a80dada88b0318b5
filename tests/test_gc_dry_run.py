"""gc is planned once and the plan executed (FORMAT.md section 25): a dry run reports exactly what
the same gc then does and changes nothing; the same gc run twice does nothing the second time."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.format.lifecycle import Marker
from dcr_log.lifecycle import gc, write_snapshot
from dcr_log.log import DeltaLog
from dcr_log.write import LogWriter
from dcr_log.write.sharded import utc_now
from helpers import run_cli

ORPHAN = "segments/8/ghost-" + "0" * 32 + ".arrow"  # a lost commit's segment of a kept version


def _log(root: Path, versions: int = 10, snapshots: tuple[int, ...] = (), orphan: bool = True) -> None:
    rng = np.random.default_rng(7)
    w = rng.integers(0, 1 << 16, size=4096, dtype=np.uint16)
    writer = LogWriter.create(root, {"w": w}, cache_dir=False)
    for _ in range(versions - 1):
        w = w.copy()
        w[rng.integers(0, w.size, 64)] += 1
        writer.append({"w": w})
    log = DeltaLog.open(root)
    for v in snapshots:
        write_snapshot(log, v)
    if orphan:
        log.store.put_new(ORPHAN, b"lost")


def _listing(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under the log (dot files too) with its size and bytes."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _retire_marker(root: Path, before: dict, key: str) -> bytes:
    """The bytes of the retire marker ``key`` (snapshots/<w>/retired.json) as any gc writes it."""
    w = int(key.split("/")[1])
    sha = hashlib.sha256(before[f"snapshots/{w}/manifest.json"][1]).hexdigest()
    return Marker(DeltaLog.open(root).log_id, "retired", w, sha, utc_now()).to_bytes()


def _facts(report) -> dict:
    out = report.to_json()
    del out["dry_run"]
    return out


SCENARIOS = {
    "no snapshot": dict(snapshots=()),
    "an older snapshot": dict(snapshots=(4,)),
    "the snapshot wanted": dict(snapshots=(7,)),
    "snapshots to retire": dict(snapshots=(2, 5, 8, 9), keep_snapshots=1),
    "older snapshot, no snapshot written": dict(snapshots=(2, 5), snapshot=False),
}


def _scenario(tmp_path, name: str, grace: float):
    """The scenario's log, written under tmp_path, and the gc arguments it runs with."""
    scenario = SCENARIOS[name]
    root = tmp_path / "log"
    _log(root, snapshots=scenario["snapshots"])
    return root, dict(keep_snapshots=scenario.get("keep_snapshots", 2), grace=grace,
                      snapshot=scenario.get("snapshot", True))


def each_scenario(test):
    """Run ``test`` for every scenario, with no grace period and with an hour's."""
    return pytest.mark.parametrize("grace", [0, 3600])(pytest.mark.parametrize("name", list(SCENARIOS))(test))


@each_scenario
def test_a_dry_run_reports_what_the_run_then_does(tmp_path, name, grace):
    root, args = _scenario(tmp_path, name, grace)
    now = time.time()
    before = _listing(root)
    dry = gc(DeltaLog.open(root), 3, now=now, dry_run=True, **args)
    assert _listing(root) == before  # not one object written, changed or deleted
    assert dry.dry_run
    real = gc(DeltaLog.open(root), 3, now=now, **args)
    assert not real.dry_run
    assert _facts(dry) == _facts(real)
    after = _listing(root)
    removed = set(before) - set(after)
    # What the report says was deleted is what went (a retire marker written and deleted in
    # the same run counts in the report: it is no longer there either).
    written_and_gone = {f"snapshots/{w}/retired.json" for w in real.retired} - set(after)
    assert len(removed) + len(written_and_gone) == real.deleted_objects
    marker_bytes = sum(len(_retire_marker(root, before, key)) for key in written_and_gone)
    assert sum(before[k][0] for k in removed) + marker_bytes == real.deleted_bytes
    assert all(before[k] == after[k] for k in set(before) & set(after))  # nothing rewritten
    added = set(after) - set(before)
    expect = set()
    if real.snapshot_written is not None:
        assert f"snapshots/{real.snapshot_written}/manifest.json" in added
        expect |= {k for k in added if k.startswith(f"snapshots/{real.snapshot_written}/")}
    if real.log_start_written is not None:
        expect.add(f"log-start/{real.log_start_written:020d}.json")
    expect |= {f"snapshots/{w}/retired.json" for w in real.retired} & set(after)
    assert added == expect
    assert DeltaLog.open(root).versions()[0] == real.start
    if grace == 0:
        assert real.expired_start == real.start and not (root / ORPHAN).exists()
    else:
        assert real.deleted_objects == 0 and (root / ORPHAN).exists()


@each_scenario
def test_the_same_gc_twice_does_nothing_the_second_time(tmp_path, name, grace):
    root, args = _scenario(tmp_path, name, grace)
    first = gc(DeltaLog.open(root), 3, **args)
    assert not first.nothing_to_do
    between = _listing(root)
    second = gc(DeltaLog.open(root), 3, **args)
    assert second.nothing_to_do, second
    assert second.snapshot_written is None and second.log_start_written is None and second.retired == []
    assert second.deleted_objects == second.deleted_bytes == second.deleted_versions == second.orphans == 0
    assert second.start == first.start
    assert _listing(root) == between
    if grace:
        # Once the grace period has passed, a run deletes what the first run's markers (and the
        # orphan's age) made deletable, and writes nothing; the run after it has nothing to do.
        later = time.time() + grace + 1
        third = gc(DeltaLog.open(root), 3, now=later, **args)
        assert third.snapshot_written is None and third.log_start_written is None and third.retired == []
        assert third.expired_start == first.start and third.deleted_objects > 0
        assert not (root / ORPHAN).exists()
        fourth = gc(DeltaLog.open(root), 3, now=later, **args)
        assert fourth.nothing_to_do and fourth.deleted_objects == 0
    assert DeltaLog.open(root).versions() == list(range(first.start, 10))


def test_keep_snapshots_retirements_are_planned_and_kept_to(tmp_path):
    root = tmp_path / "log"
    _log(root, versions=12, snapshots=(2, 4, 6, 8, 10), orphan=False)
    now = time.time()
    dry = gc(DeltaLog.open(root), 10, keep_snapshots=2, grace=3600, now=now, dry_run=True)
    assert dry.start == 2 and dry.retired == [4, 6] and dry.log_start_written == 2
    assert not (root / "snapshots" / "4" / "retired.json").exists()
    real = gc(DeltaLog.open(root), 10, keep_snapshots=2, grace=3600, now=now)
    assert _facts(real) == _facts(dry)
    assert sorted(DeltaLog.open(root).snapshots()) == [2, 8, 10]
    assert gc(DeltaLog.open(root), 10, keep_snapshots=2, grace=3600).nothing_to_do
    # Past the grace period the retired snapshots go: the dry run says so, to the byte.
    later = time.time() + 3601
    dry = gc(DeltaLog.open(root), 10, keep_snapshots=2, grace=3600, now=later, dry_run=True)
    assert dry.retired == [] and dry.deleted_objects > 0
    before = _listing(root)
    real = gc(DeltaLog.open(root), 10, keep_snapshots=2, grace=3600, now=later)
    assert _facts(real) == _facts(dry)
    gone = set(before) - set(_listing(root))
    # The retired snapshots 4 and 6, and versions 0 and 1, below the log-start marker at 2.
    assert {k for k in gone if k.startswith("snapshots/")} == {
        k for k in before if k.startswith(("snapshots/4/", "snapshots/6/"))}
    versions = {f"versions/{v:020d}.json" for v in (0, 1)}
    assert {k for k in gone if not k.startswith("snapshots/")} == versions | {
        k for k in before if k.startswith(("segments/0/", "segments/1/"))}
    assert real.deleted_versions == 2 and real.expired_start == 2
    assert len(gone) == real.deleted_objects and sum(before[k][0] for k in gone) == real.deleted_bytes


def test_with_no_grace_a_store_clock_ahead_changes_nothing(tmp_path):
    """A marker whose modification time is after the gc's clock (the store's clock ahead) is as
    old as one just written: with no grace period the outcome never depends on the clocks."""
    root = tmp_path / "log"
    _log(root, snapshots=(7,))
    first = gc(DeltaLog.open(root), 3, grace=0, now=time.time() - 60)
    assert first.expired_start == 7 and first.deleted_versions == 7
    assert gc(DeltaLog.open(root), 3, grace=0).nothing_to_do


@pytest.mark.parametrize("grace", ["0", "1h"])
def test_cli_dry_run_json_equals_the_run_that_follows(tmp_path, grace):
    root = tmp_path / "log"
    _log(root, snapshots=(2, 5, 8, 9))
    args = ("gc", root, "--keep-last", "3", "--keep-snapshots", "1", "--grace", grace, "--json")
    before = _listing(root)
    code, out, err = run_cli(*args, "--dry-run")
    assert code == 0, err
    assert _listing(root) == before
    dry = json.loads(out)
    code, out, err = run_cli(*args)
    assert code == 0, err
    real = json.loads(out)
    assert dry.pop("dry_run") is True and real.pop("dry_run") is False
    assert dry == real
    assert real["snapshot_written"] == 7 and real["log_start_written"] == 7 and real["retired"] == [8]
    code, out, err = run_cli(*args[:-1])
    assert code == 0 and out.startswith("nothing to do; log starts at version 7;"), out
    code, out, err = run_cli(*args[:-1], "--dry-run")
    assert code == 0 and out.startswith("dry run: nothing to do;"), out
