"""Per-version statistics of a log (``dcr stats``): changed %, bytes, ratio to dense, encodings,
time between versions; and a PNG plot of them (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from dcr_log.coords import DTYPE_WIDTH, numel
from dcr_log.errors import UsageError
from dcr_log.log.deltalog import DeltaLog


def _when(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None  # informative only (FORMAT.md section 4): any string is valid


def version_stats(log: DeltaLog, encodings: bool = True) -> list[dict]:
    """One row per readable version. With ``encodings``, each version's segments are read to
    count its records by kind and encoding."""
    rows = []
    previous = None
    for v in log.versions():
        c = log.commit(v)
        dense = sum(numel(t.shape) * DTYPE_WIDTH[t.dtype] for t in c.tensors)
        when = _when(c.created_at)
        row: dict[str, Any] = {
            "version": v,
            "bytes": c.delta_bytes,
            "dense_bytes": dense,
            "ratio": dense / c.delta_bytes if c.delta_bytes else None,
            "changed_elements": c.stats.changed_elements,
            "total_elements": c.stats.total_elements,
            "changed_pct": 100.0 * c.stats.changed_elements / max(c.stats.total_elements, 1),
            "records": c.stats.records,
            "created_at": c.created_at,
            "seconds_since_parent": None if when is None or previous is None else round(when - previous, 6),
        }
        if encodings:
            kinds: Counter = Counter()
            for rec in log.records(v):
                kinds[f"{rec.kind}/{rec.encoding}"] += 1
            row["encodings"] = dict(sorted(kinds.items()))
        rows.append(row)
        previous = when
    return rows


def catchup_rows(log: DeltaLog) -> list[dict]:
    """The log's snapshots and squashes, with their bytes."""
    rows: list[dict[str, Any]] = [{"kind": "snapshot", "version": v, "from": None, "bytes": cu.delta_bytes,
             "records": cu.stats.records, "created_at": cu.created_at}
            for v, cu in log.snapshots().items()]
    start = log.known_start()
    # The bytes of the versions a squash stands for (None once some of them have expired).
    rows += [{"kind": "squash", "version": cu.version, "from": cu.start, "bytes": cu.delta_bytes,
              "records": cu.stats.records, "created_at": cu.created_at,
              "chain_bytes": _chain_bytes(log, cu.start, cu.version, start)}
             for cu in log.squashes()]
    return rows


def _chain_bytes(log: DeltaLog, first: int | None, version: int, start: int) -> int | None:
    """The bytes of the versions a squash from ``first`` stands for; None once some expired."""
    if first is None or first + 1 < start:
        return None
    return sum(log.commit(u).delta_bytes for u in range(first + 1, version + 1))


def plot(rows: list[dict], catchups: list[dict], path: Path, title: str) -> None:
    """Bytes per version (with the dense size and the catch-up objects) and changed % as a PNG."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'dcr-log[plot]'") from None
    versions = [r["version"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    top.plot(versions, [max(r["bytes"], 1) for r in rows], marker=".", label="delta bytes")
    top.plot(versions, [r["dense_bytes"] for r in rows], linestyle="--", label="dense bytes")
    snaps = [c for c in catchups if c["kind"] == "snapshot"]
    if snaps:
        top.scatter([c["version"] for c in snaps], [c["bytes"] for c in snaps], marker="s", color="C2",
                    label="snapshots", zorder=3)
    squashes = [c for c in catchups if c["kind"] == "squash"]
    if squashes:
        top.scatter([c["version"] for c in squashes], [c["bytes"] for c in squashes], marker="^",
                    color="C3", label="squashes (at their end)", zorder=3)
    top.set_yscale("log")
    top.set_ylabel("bytes")
    top.legend(loc="best", fontsize="small")
    top.set_title(title)
    bottom.plot(versions, [r["changed_pct"] for r in rows], marker=".", color="C1")
    bottom.set_ylabel("changed %")
    bottom.set_xlabel("version")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.savefig(path, dpi=100)
    plt.close(fig)
