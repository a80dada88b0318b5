"""tools/timing.py: op and baseline run alternately (ABAB), the report is the median of the
per-pair ratios, and a pairing of no repeats is refused. Clocks are fake: no sleeps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import timing  # noqa: E402


class FakeClock:
    """Time moves only when a timed function says so: ``advance(wall, cpu)``."""

    def __init__(self) -> None:
        self.now_wall = 100.0
        self.now_cpu = 10.0

    def advance(self, wall: float, cpu: float) -> None:
        self.now_wall += wall
        self.now_cpu += cpu

    def clock(self) -> timing.Clock:
        return timing.Clock(wall=lambda: self.now_wall, cpu=lambda: self.now_cpu)


def test_op_and_baseline_alternate():
    calls: list[str] = []
    fake = FakeClock()
    pairing = timing.paired(lambda: calls.append("A"), lambda: calls.append("B"), 4, clock=fake.clock())
    assert calls == ["A", "B", "A", "B", "A", "B", "A", "B"]
    assert pairing.repeats == 4 and len(pairing.op) == len(pairing.baseline) == 4


def test_before_runs_untimed_ahead_of_every_call():
    calls: list[str] = []
    fake = FakeClock()

    def barrier():
        calls.append("|")
        fake.advance(50.0, 50.0)  # waiting at a barrier is not the op's time

    def op():
        calls.append("A")
        fake.advance(2.0, 1.0)

    def baseline():
        calls.append("B")
        fake.advance(1.0, 1.0)

    pairing = timing.paired(op, baseline, 2, clock=fake.clock(), before=barrier)
    assert calls == ["|", "A", "|", "B", "|", "A", "|", "B"]
    assert pairing.ratios == (2.0, 2.0) and pairing.op_cpu == 1.0


def test_median_ratio_medians_and_spread_on_a_fake_clock():
    fake = FakeClock()
    op_walls = iter([2.0, 9.0, 3.0])        # pair ratios: 2.0/1.0, 9.0/1.0, 3.0/2.0
    base_walls = iter([1.0, 1.0, 2.0])

    def op():
        fake.advance(next(op_walls), 0.5)

    def baseline():
        fake.advance(next(base_walls), 0.25)

    pairing = timing.paired(op, baseline, 3, clock=fake.clock())
    assert [s.wall for s in pairing.op] == [2.0, 9.0, 3.0]
    assert [s.wall for s in pairing.baseline] == [1.0, 1.0, 2.0]
    assert pairing.ratios == (2.0, 9.0, 1.5)
    assert pairing.ratio == 2.0  # the median pair, not the ratio of the medians (3.0 / 1.0)
    assert pairing.spread == (1.5, 9.0)
    assert (pairing.op_wall, pairing.baseline_wall) == (3.0, 1.0)
    assert (pairing.op_cpu, pairing.baseline_cpu) == (0.5, 0.25)
    summary = pairing.summary()
    assert summary["ratio"] == 2.0 and summary["ratio_low"] == 1.5 and summary["ratio_high"] == 9.0
    assert summary["repeats"] == 3


def test_join_keeps_the_pairs_in_order():
    fake = FakeClock()
    walls = iter([4.0, 1.0, 6.0, 2.0])
    step = lambda: fake.advance(next(walls), 0.0)
    joined = timing.Pairing.join(timing.paired(step, step, 1, clock=fake.clock()) for _ in range(2))
    assert joined.ratios == (4.0, 3.0)
    assert joined.ratio == 3.5


def test_timed_returns_the_result_and_both_times():
    fake = FakeClock()

    def work():
        fake.advance(0.75, 1.5)  # two threads busy: CPU time beyond wall time
        return "done"

    t = timing.timed(work, clock=fake.clock())
    assert (t.wall, t.cpu, t.result) == (0.75, 1.5, "done")


@pytest.mark.parametrize("repeats", [0, -1])
def test_refuses_fewer_than_one_repeat(repeats):
    calls: list[str] = []
    with pytest.raises(ValueError, match="at least 1"):
        timing.paired(lambda: calls.append("A"), lambda: calls.append("B"), repeats)
    assert calls == []


def test_a_pairing_needs_matching_samples():
    one = timing.Sample(1.0, 1.0)
    with pytest.raises(ValueError):
        timing.Pairing((one, one), (one,))
    with pytest.raises(ValueError):
        timing.Pairing((), ())


def test_fastest_keeps_the_fastest_call():
    fake = FakeClock()
    walls = iter([3.0, 1.0, 2.0])
    sample = timing.fastest(lambda: fake.advance(next(walls), 0.5), 3, clock=fake.clock())
    assert (sample.wall, sample.cpu) == (1.0, 0.5)
    with pytest.raises(ValueError, match="at least 1"):
        timing.fastest(lambda: None, 0)


def test_load_scaled_walls_take_out_what_the_baseline_felt():
    fake = FakeClock()
    op_walls = iter([2.0, 6.0, 3.0])        # the second pair ran under 3x load, the third 1.5x
    base_walls = iter([1.0, 3.0, 1.5])

    def op():
        fake.advance(next(op_walls), 0.0)

    def baseline():
        fake.advance(next(base_walls), 0.0)

    pairing = timing.paired(op, baseline, 3, clock=fake.clock())
    assert pairing.baseline_wall == 1.5
    assert pairing.load_scaled_op_walls == (3.0, 3.0, 3.0)


def test_phases_records_each_call_by_thread_and_puts_the_functions_back(capsys):
    """tools/phases.py: calls of the wrapped functions on the calling thread and on a pool are
    counted apart, the report names both, and leaving the context restores the originals."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import phases

    owner = SimpleNamespace(work=lambda x: x + 1)
    real = owner.work
    with phases.Phases([(owner, "work")]) as timeline:
        t0 = time.perf_counter()
        assert owner.work(1) == 2
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(owner.work, range(3))) == [1, 2, 3]
        t1 = time.perf_counter()
    assert owner.work is real
    where = sorted(thread == "MainThread" for thread, _, _, _ in timeline.events)
    assert where == [False, False, False, True]
    timeline.report(t0, t1, "probe")
    out = capsys.readouterr().out
    assert "caller work" in out and "calls    1" in out and "pool   work" in out and "calls    3" in out


def test_reports_name_the_machine_and_its_vector_paths():
    """Speeds per change differ 2-4x between an AVX-512 and an AVX2-only machine: reports say
    which ran, and which paths the change pass and the rANS coder took there."""
    from dcr_log import _rans, native

    info = timing.machine()
    assert isinstance(info["cpu"], str) and info["cpu"] and info["cpus"] >= 1
    assert set(info["vector_flags"]) <= set(timing.VECTOR_FLAGS)
    paths = {0: "scalar", 1: "AVX2", 2: "AVX-512"}
    assert info["change_pass"] == paths[max(native.changes.FIND_PATHS)]
    assert info["rans_coder"] == paths[max(_rans.CODER_PATHS)]
    if info["change_pass"] == "AVX-512":
        assert "avx512_vbmi2" in info["vector_flags"]
    line = timing.machine_line(info)
    assert info["cpu"] in line and f"change pass {info['change_pass']}" in line
    assert f"rANS coder {info['rans_coder']}" in line
