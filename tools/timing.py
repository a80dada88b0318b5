"""How the benchmarks time things: an operation paired with its baseline, measured alternately.

``paired(op, baseline, repeats)`` runs op, baseline, op, baseline, ... (ABAB) so each
measurement has its baseline beside it, within the same second, on a machine whose load
drifts; each pair gives a ratio (op wall time / baseline wall time) and the report is the
median ratio with the medians of both and the spread of the ratios. ``timed(fn)`` measures
one call; ``fastest(fn, repeats)`` is for an absolute speed with no baseline. All record wall
time and CPU time (the whole process, every thread), read from an injectable ``Clock``
(tests/test_timing.py uses a fake one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Clock:
    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time


CLOCK = Clock()


@dataclass(frozen=True, slots=True)
class Sample:
    """One call: wall seconds, CPU seconds (all threads of the process)."""

    wall: float
    cpu: float


@dataclass(frozen=True, slots=True)
class Timed:
    """One call's sample and what it returned."""

    wall: float
    cpu: float
    result: Any


def timed(fn: Callable[[], Any], clock: Clock = CLOCK) -> Timed:
    """Run ``fn()`` once and time it."""
    w0, c0 = clock.wall(), clock.cpu()
    result = fn()
    w1, c1 = clock.wall(), clock.cpu()
    return Timed(w1 - w0, c1 - c0, result)


@dataclass(frozen=True, slots=True)
class Pairing:
    """Samples of an operation and of its baseline, pair by pair (``op[i]`` ran just before
    ``baseline[i]``)."""

    op: tuple[Sample, ...]
    baseline: tuple[Sample, ...]

    def __post_init__(self) -> None:
        if not self.op or len(self.op) != len(self.baseline):
            raise ValueError(f"a pairing needs as many baseline samples as op samples, at least one "
                             f"(got {len(self.op)} and {len(self.baseline)})")

    @staticmethod
    def join(pairings: Iterable[Pairing]) -> Pairing:
        """One pairing of several, in order (pairs measured one at a time between other work)."""
        parts = list(pairings)
        return Pairing(tuple(s for p in parts for s in p.op), tuple(s for p in parts for s in p.baseline))

    @property
    def repeats(self) -> int:
        return len(self.op)

    @property
    def ratios(self) -> tuple[float, ...]:
        """op wall / baseline wall, per pair."""
        return tuple(o.wall / b.wall for o, b in zip(self.op, self.baseline))

    @property
    def ratio(self) -> float:
        """The median of the per-pair ratios op / baseline (wall time)."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """The lowest and highest per-pair ratio."""
        return min(self.ratios), max(self.ratios)

    @property
    def op_wall(self) -> float:
        return statistics.median(s.wall for s in self.op)

    @property
    def op_cpu(self) -> float:
        return statistics.median(s.cpu for s in self.op)

    @property
    def baseline_wall(self) -> float:
        return statistics.median(s.wall for s in self.baseline)

    @property
    def baseline_cpu(self) -> float:
        return statistics.median(s.cpu for s in self.baseline)

    @property
    def load_scaled_op_walls(self) -> tuple[float, ...]:
        """Each op wall time times median(baseline) / its own pair's baseline: the load that pair
        felt taken out, as far as the baseline feels it (for fits over many measurements)."""
        mid = self.baseline_wall
        return tuple(o.wall * mid / b.wall for o, b in zip(self.op, self.baseline))

    def summary(self) -> dict[str, float]:
        """The numbers a report keeps (JSON-ready)."""
        low, high = self.spread
        return {"ratio": self.ratio, "ratio_low": low, "ratio_high": high, "repeats": self.repeats,
                "op_s": self.op_wall, "op_cpu_s": self.op_cpu,
                "baseline_s": self.baseline_wall, "baseline_cpu_s": self.baseline_cpu}


def paired(op: Callable[[], Any], baseline: Callable[[], Any], repeats: int, clock: Clock = CLOCK,
           before: Callable[[], Any] | None = None) -> Pairing:
    """Run ``op`` and ``baseline`` alternately, ``repeats`` times each (op first), and time each
    call. ``before``, if given, runs untimed before every timed call (a barrier, so that the
    ranks of a group start each call together)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    ops: list[Sample] = []
    baselines: list[Sample] = []
    for _ in range(repeats):
        for fn, samples in ((op, ops), (baseline, baselines)):
            if before is not None:
                before()
            t = timed(fn, clock)
            samples.append(Sample(t.wall, t.cpu))
    return Pairing(tuple(ops), tuple(baselines))


def fastest(fn: Callable[[], Any], repeats: int, clock: Clock = CLOCK) -> Sample:
    """The fastest of ``repeats`` calls (wall time, with that call's CPU time): for an absolute
    speed that has no baseline beside it (a codec's changes per second)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    samples = [timed(fn, clock) for _ in range(repeats)]
    best = min(samples, key=lambda t: t.wall)
    return Sample(best.wall, best.cpu)


# The vector loops the C kernels pick at run time by the CPU: the change pass, the rANS
# coder's passes and the digests have AVX2 and AVX-512 loops. Speeds differ by 2-4x per
# change between such machines (an AVX-512 Xeon against an AVX2-only EPYC), so every report
# names the machine it ran on.
VECTOR_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vbmi2", "sha_ni")


def machine() -> dict:
    """The CPU's model, its count, its vector flags that the kernels use, and the paths of the
    change pass and the rANS coder (dcr_log._changes.FIND_PATHS, dcr_log._rans.CODER_PATHS:
    0 scalar, 1 AVX2, 2 AVX-512)."""
    import os
    import platform

    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    try:
        from dcr_log import native

        path = None if native.changes is None else max(native.changes.FIND_PATHS)
    except (ImportError, AttributeError):
        path = None
    try:
        from dcr_log import _rans

        coder = max(_rans.CODER_PATHS)
    except (ImportError, AttributeError):
        coder = None
    names = {None: "not built", 0: "scalar", 1: "AVX2", 2: "AVX-512"}
    return {"cpu": model, "cpus": os.cpu_count(), "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
            "change_pass": names[path], "rans_coder": names[coder]}


def machine_line(info: dict | None = None) -> str:
    info = info or machine()
    flags = info["vector_flags"]
    return (f"machine: {info['cpu']}, {info['cpus']} CPUs; vector flags {' '.join(flags) or 'none'}; "
            f"change pass {info['change_pass']}, rANS coder {info.get('rans_coder', 'not reported')}")
