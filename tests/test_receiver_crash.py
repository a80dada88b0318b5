"""SIGKILL ``dcr apply`` (a real subprocess) at random instants, at least 50 times, and check
that every run ends bit-exact, that after a kill the journal never claims a version the
checkpoint does not hold, and that ``dcr status --json`` reports the latest version.

The kill loop is tools/crash_apply.py (which runs 1000 kills by default); its checks are
listed in that file's docstring and counted here."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from dcr_log import DeltaLog, state_equal
from dcr_log.checkpoint import load_checkpoint
from dcr_log.receiver import batch, checks, open_directory

TOOL = Path(__file__).resolve().parents[1] / "tools" / "crash_apply.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("crash_apply", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["crash_apply"] = module
    spec.loader.exec_module(module)
    return module


def run_until(runner, kills: int, most: int, **at_least: int):
    """``runner.run(kills)``, then ten kills more at a time (up to ``most``) until every count
    named in ``at_least`` reaches its minimum. A kill's instant is drawn from the window the
    runner calibrated, so a fixed number of them sometimes lands too few inside applies (3 of
    30 in one run of four, on two cores, with the code of then and before)."""
    counts = runner.run(kills)
    while (any(getattr(counts, k) < v for k, v in at_least.items()) and counts.kills < most
           and not counts.failures):
        counts = runner.run(counts.kills + 10)
    return counts


def test_fixture_versions_span_many_segments_and_layout_changes(tmp_path):
    tool = load_tool()
    fx = tool.build_fixture(tmp_path / "fx", mb=1, versions=3, seed=2)
    log = DeltaLog.open(fx.log)
    assert all(len(log.commit(v).segments) >= 10 for v in (1, 2, 3))
    tables = [set(log.commit(v).tensor_map()) for v in (1, 2)]
    assert tables[0] != tables[1]  # version 2 adds and drops tensors
    assert sum(1 for r in log.records(3) if r.kind == "overwrite") > 0


def test_sigkill_at_random_instants_ends_bit_exact(tmp_path):
    tool = load_tool()
    fx = tool.build_fixture(tmp_path / "fx", mb=1, versions=3, seed=1)
    runner = tool.CrashRunner(fx, tmp_path, seed=1, kills_per_round=(2, 5))
    runner.calibrate()
    counts = run_until(runner, 50, 150, mid_apply=10, resumed=5)
    assert counts.failures == [], counts.failures
    assert counts.kills >= 50
    # Kills landed inside applies (a version or a materialization in flight afterwards) and
    # were recovered from; the single-file, sharded and empty-directory rounds all ran.
    assert counts.mid_apply >= 10 and counts.resumed >= 5
    assert counts.rounds >= 6


def test_sigkill_inside_catch_up_steps_ends_bit_exact(tmp_path):
    """The same kills while receivers catch up through a squash (from an expired version,
    adding, dropping and reshaping tensors) and a snapshot (tools/crash_apply.py --catchup)."""
    tool = load_tool()
    fx = tool.build_fixture(tmp_path / "fx", mb=1, versions=4, seed=3, catchup=True)
    assert DeltaLog.open(fx.log).versions()[0] == fx.start == 3
    runner = tool.CrashRunner(fx, tmp_path, seed=3, kills_per_round=(2, 5))
    runner.calibrate()
    counts = run_until(runner, 30, 90, mid_apply=5)
    assert counts.failures == [], counts.failures
    assert counts.kills >= 30 and counts.mid_apply >= 5 and counts.rounds >= 4


def test_sigkill_on_the_pools_paths_ends_bit_exact(tmp_path, monkeypatch):
    """The same kills with records large enough for the shared pool's paths (the other tests'
    records hold too few changes): pass one decodes and classifies on the pool, the
    checkpoint's redo images are laid there and its pages prefaulted beside the journal's
    sync, and the records are written in parallel (tools/crash_apply.py --mb 8
    --chunk-elements 262144 --segment-bytes 67108864 --rates 0.02 0.035)."""
    tool = load_tool()
    fx = tool.build_fixture(tmp_path / "fx", mb=8, versions=3, seed=5, segment_bytes=64 << 20,
                            chunk_elements=1 << 18, rates=(0.02, 0.035))
    log = DeltaLog.open(fx.log)
    # The fixture reaches those paths: an apply in this process, its pool calls seen.
    seen: set[tuple[str, bool]] = set()

    def spying(real):
        def spy(fn, items, weights, grain, workers, parallel=True, *rest):
            seen.add((fn.__name__, bool(parallel) and len(items) > 1))
            return real(fn, items, weights, grain, workers, parallel, *rest)
        return spy

    def spy_start(fn, items, weights, grain, workers):
        seen.add(("prefault", len(items) > 1))
        return real_start(fn, items, weights, grain, workers)

    real_start = batch.start_grouped
    monkeypatch.setattr(checks, "map_grouped", spying(checks.map_grouped))
    monkeypatch.setattr(batch, "map_grouped", spying(batch.map_grouped))
    monkeypatch.setattr(batch, "start_grouped", spy_start)
    probe = tmp_path / "probe"
    shutil.copytree(fx.pristine["single"], probe)
    with open_directory(log, probe) as rx:
        assert rx.apply(log) == [1, 2, 3]
    assert state_equal(load_checkpoint(probe), fx.expected[-1])
    assert {("decode", True), ("lay", True), ("prefault", True), ("write", True)} <= seen, seen
    monkeypatch.undo()

    runner = tool.CrashRunner(fx, tmp_path, seed=5, kills_per_round=(2, 5))
    runner.calibrate()
    counts = run_until(runner, 30, 90, mid_apply=5, resumed=3)
    assert counts.failures == [], counts.failures
    assert counts.kills >= 30 and counts.mid_apply >= 5 and counts.resumed >= 3
