"""Where one operation's wall time goes: a timeline of named functions.

``Phases(targets)`` wraps each ``(owner, attribute)`` (a class or module and the name of a
function on it) while the context is open, and records every call's thread, start and end.
``report(t0, t1)`` prints, per function and per thread kind (the calling thread, or the
pool's threads), the calls, their summed seconds and the span from the first start to the
last end, relative to ``t0``: serial stretches of the calling thread show as spans where no
pool row is busy. Benchmarks only (the wrappers cost about a microsecond a call).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterable
from typing import Any


class Phases:
    def __init__(self, targets: Iterable[tuple[Any, str]]):
        self.targets = list(targets)
        self.events: list[tuple[str, str, float, float]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Phases:
        for owner, name in self.targets:
            real = getattr(owner, name)
            self._saved.append((owner, name, real))
            setattr(owner, name, self._wrap(real, name))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    def _wrap(self, real, name: str):
        events = self.events

        @functools.wraps(real)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                events.append((threading.current_thread().name, name, t0, time.perf_counter()))
        return timed

    def report(self, t0: float, t1: float, title: str) -> None:
        rows: dict[tuple[str, str], list[float]] = {}
        for thread, name, a, b in self.events:
            if a < t0 or b > t1:
                continue
            where = "caller" if thread == threading.main_thread().name else "pool"
            row = rows.setdefault((where, name), [0, 0.0, a, b])
            row[0] += 1
            row[1] += b - a
            row[2], row[3] = min(row[2], a), max(row[3], b)
        print(f"{title}: {1e3 * (t1 - t0):.1f} ms wall")
        for (where, name), (calls, total, first, last) in sorted(rows.items(), key=lambda kv: kv[1][2]):
            print(f"  {where:6s} {name:20s} calls {calls:4d}  total {1e3 * total:7.1f} ms  "
                  f"span {1e3 * (first - t0):7.1f} .. {1e3 * (last - t0):7.1f} ms")
