"""``dcr log``, ``dcr stats``, ``dcr show``, ``dcr verify``, ``dcr replay`` and ``dcr demo``: reading a log."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dcr_log.cli.app import (
    TRUST_HELP,
    json_option,
    open_log,
    out,
    progress_bar,
    say_left,
    say_result,
    version_progress,
)
from dcr_log.errors import IntegrityError, NotFoundError, UsageError

if TYPE_CHECKING:  # imported by open_log when a command runs
    from dcr_log.log.deltalog import DeltaLog


def _log_rows(dlog: DeltaLog) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for v in dlog.versions():
        c = dlog.commit(v)
        rows.append({
            "version": v, "parent": c.parent, "bytes": c.delta_bytes,
            "changed_elements": c.stats.changed_elements, "total_elements": c.stats.total_elements,
            "changed_pct": 100.0 * c.stats.changed_elements / max(c.stats.total_elements, 1),
            "records": c.stats.records, "tensors": len(c.tensors), "created_at": c.created_at,
            "writer_id": c.writer_id, "state_digest": f"{c.state_digest:016x}",
        })
        if c.files is not None:
            rows[-1]["files"] = [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in c.files]
    return rows


def log_cmd(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
            as_json: bool = json_option(),
            trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP)) -> None:
    """One line per version: version, parent, bytes, changed elements and %, and in a log that
    carries files their count and bytes (--json: each file's name, size and sha256)."""
    from dcr_log.lifecycle.stats import catchup_rows

    dlog = open_log(log, trust)
    rows = _log_rows(dlog)
    if not rows:
        raise NotFoundError(f"{dlog.store.url}: log has no versions (its creation was interrupted: "
                            "run dcr init again with the same options to finish it)")
    catchups = catchup_rows(dlog)
    if as_json:
        for r in rows:
            out.print(json.dumps(r), markup=False)
        for c in catchups:
            out.print(json.dumps(c), markup=False)
        return
    from rich.table import Table

    columns = ["version", "parent", "bytes", "changed", "%", "records", "created"]
    if dlog.has_files:
        columns.append("files")
    table = Table(*columns)
    for r in rows:
        cells = [str(r["version"]), "-" if r["parent"] is None else str(r["parent"]),
                 str(r["bytes"]), str(r["changed_elements"]), f"{r['changed_pct']:.3f}",
                 str(r["records"]), r["created_at"]]
        if dlog.has_files:
            cells.append(f"{len(r['files'])} files, {sum(f['size'] for f in r['files'])} B")
        table.add_row(*cells)
    out.print(table)
    if rows and rows[0]["version"] > 0:
        out.print(f"log starts at version {rows[0]['version']} (retention: earlier versions expired)",
                  markup=False)
    if catchups:
        table = Table("catch-up", "version", "from", "bytes", "chain bytes", "records", "created")
        for c in catchups:
            chain = "-" if c.get("chain_bytes") is None else str(c["chain_bytes"])
            table.add_row(c["kind"], str(c["version"]), "-" if c["from"] is None else str(c["from"]),
                          str(c["bytes"]), chain, str(c["records"]), c["created_at"])
        out.print(table)


def stats(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
          as_json: bool = json_option(),
          plot_path: Path | None = typer.Option(
              None, "--plot", metavar="FILE.png", help="write a PNG plot of bytes and change rate"),
          trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP)) -> None:
    """Per version: changed %, bytes, ratio to dense, records by kind and encoding, seconds
    since the parent; then snapshots and squashes."""
    from dcr_log.lifecycle.stats import catchup_rows, plot, version_stats

    if plot_path is not None and not plot_path.parent.is_dir():
        raise UsageError(f"no directory {plot_path.parent} for --plot")
    dlog = open_log(log, trust)
    rows = version_stats(dlog)
    catchups = catchup_rows(dlog)
    if plot_path is not None:
        plot(rows, catchups, plot_path, f"dcr log {dlog.log_id[:8]}")
    if as_json:
        for r in rows + catchups:
            out.print(json.dumps(r), markup=False)
        return
    from rich.table import Table

    table = Table("version", "changed %", "bytes", "dense/delta", "records", "encodings", "s since parent")
    for r in rows:
        table.add_row(str(r["version"]), f"{r['changed_pct']:.3f}", str(r["bytes"]),
                      "-" if r["ratio"] is None else f"{r['ratio']:.1f}", str(r["records"]),
                      " ".join(f"{k}:{n}" for k, n in r["encodings"].items()),
                      "-" if r["seconds_since_parent"] is None else f"{r['seconds_since_parent']:.1f}")
    out.print(table)
    total = sum(r["bytes"] for r in rows)
    out.print(f"{len(rows)} versions, {total} bytes of deltas; {len(catchups)} snapshots and squashes"
              + (f"; plot written to {plot_path}" if plot_path else ""), markup=False)


def show(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
         version: int = typer.Argument(..., metavar="VERSION", help="version number"),
         as_json: bool = json_option(),
         trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP)) -> None:
    """Per tensor: records, encodings, changed elements and payload bytes of one version; then
    its files (name, size, sha256), in a log that carries files."""
    dlog = open_log(log, trust)
    commit = dlog.commit(version)
    per: dict[str, dict[str, Any]] = {t.name: {"tensor": t.name, "dtype": t.dtype, "shape": list(t.shape), "records": 0,
                    "kinds": defaultdict(int), "encodings": defaultdict(int),
                    "changed_elements": 0, "elements": 0, "bytes": 0} for t in commit.tensors}
    for t in commit.tensors:
        n = 1
        for s in t.shape:
            n *= s
        per[t.name]["elements"] = n
    for rec in dlog.records(version):
        row = per[rec.tensor]
        row["records"] += 1
        row["kinds"][rec.kind] += 1
        row["encodings"][rec.encoding] += 1
        row["changed_elements"] += rec.n_changed
        row["bytes"] += len(rec.payload)
    if as_json:
        for row in per.values():
            out.print(json.dumps({**row, "kinds": dict(row["kinds"]), "encodings": dict(row["encodings"])}),
                      markup=False)
        for f in commit.files or ():
            out.print(json.dumps({"file": f.name, "size": f.size, "sha256": f.sha256}), markup=False)
        return
    from rich.table import Table

    table = Table("tensor", "dtype", "shape", "records", "kinds", "encodings", "changed", "%", "bytes")
    for row in per.values():
        pct = 100.0 * row["changed_elements"] / max(row["elements"], 1)
        table.add_row(row["tensor"], row["dtype"], "x".join(map(str, row["shape"])) or "()",
                      str(row["records"]), ",".join(f"{k}:{v}" for k, v in row["kinds"].items()),
                      ",".join(f"{k}:{v}" for k, v in row["encodings"].items()),
                      str(row["changed_elements"]), f"{pct:.3f}", str(row["bytes"]))
    out.print(table)
    if commit.files is not None:
        from rich.text import Text

        files = Table("file", "size", "sha256")
        for f in commit.files:
            files.add_row(Text(f.name), str(f.size), f.sha256)  # a name is never markup
        out.print(files)


def verify(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           deep: bool = typer.Option(False, "--deep", help="also replay every version and check every digest"),
           trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP),
           as_json: bool = json_option()) -> None:
    """Check every commit record, the parent chain and every segment's hash (and, with
    --trust, every version's signature)."""
    dlog = open_log(log, trust)
    versions = dlog.versions()
    if not versions:  # section 13: verifying a log without versions is an integrity error
        raise IntegrityError(f"{dlog.store.url}: log has no versions")
    with progress_bar("verify", len(versions), unit="versions") as advance:
        report = dlog.verify(deep=deep, progress=lambda v: advance())
    files = f", {report.files} files" if dlog.has_files else ""
    start = f" from version {report.start}" if report.start else ""
    catchups = f", {report.catchups} snapshots and squashes" if report.catchups else ""
    say_result(as_json, {"ok": True, "versions": report.versions, "start": report.start,
                         "segments": report.segments, "files": report.files if dlog.has_files else None,
                         "catchups": report.catchups, "bytes_checked": report.bytes_checked, "deep": deep,
                         "signed": bool(trust)},
               f"ok: {report.versions} versions{start}, {report.segments} segments{files}{catchups}, "
               f"{report.bytes_checked} bytes{' (deep)' if deep else ''}{', signed' if trust else ''}")


def replay(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           version: int | None = typer.Option(None, "--version", metavar="V", help="version (default latest)"),
           out_path: Path = typer.Option(..., "--out", metavar="FILE.safetensors", help="output .safetensors file"),
           trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP),
           as_json: bool = json_option()) -> None:
    """Rebuild a version bit-exactly and write it as one .safetensors file."""
    from dcr_log.checkpoint import save_safetensors

    if not out_path.parent.is_dir():
        raise UsageError(f"no directory {out_path.parent} for --out")
    dlog = open_log(log, trust)
    say_left(lambda: f"{out_path} not written")
    with version_progress(dlog, "replay", version) as advance:
        state = dlog.materialize(version, progress=lambda v: advance())
    save_safetensors(state, out_path)  # whole or not at all
    say_left(lambda: f"{out_path} written")
    v = dlog.latest_version() if version is None else version
    say_result(as_json, {"out": str(out_path), "version": v, "tensors": len(state)},
               f"wrote {out_path}: version {v}, {len(state)} tensors")


def demo(dir: Path | None = typer.Option(
        None, "--dir", metavar="DIR", help="where to write the log (default: a temporary directory)"),
        as_json: bool = json_option()) -> None:
    """Build a small bf16 model, log ~10 training steps, replay and check every version."""
    from rich.console import Console

    from dcr_log.demo import run_demo

    say_left(lambda: "demo not finished" + (f" (its log under {dir} may be incomplete)" if dir else ""))
    if not as_json:
        run_demo(dir, out.get())
        return
    report = run_demo(dir, Console(file=io.StringIO()))  # the narrative goes nowhere; the rows are the result
    for r in report.rows:
        say_result(True, {"version": r.version, "changed_elements": r.changed_elements,
                          "total_elements": r.total_elements, "bytes": r.delta_bytes, "dense_bytes": r.dense_bytes,
                          "encode_s": r.encode_s, "replay_s": r.replay_s, "bit_exact": r.bit_exact}, "")
    say_result(True, {"log": None if report.log_path is None else str(report.log_path), "params": report.params,
                      "versions": len(report.rows), "all_bit_exact": report.all_bit_exact}, "")
