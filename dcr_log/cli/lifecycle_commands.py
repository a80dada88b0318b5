"""``dcr snapshot``, ``dcr squash``, ``dcr gc`` and ``dcr mirror``: a long log's lifecycle and its copies."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dcr_log.cli.app import FOLLOW, TRUST_HELP, json_option, open_log, out, progress_bar, say_left, say_result
from dcr_log.errors import DcrError, UsageError


def _state_bytes(commit) -> int:
    """The bytes of a version's tensors: what a snapshot or squash encodes, for its progress bar."""
    from dcr_log.coords import DTYPE_WIDTH, numel

    return sum(numel(t.shape) * DTYPE_WIDTH[t.dtype] for t in commit.tensors)


def snapshot(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
             version: int | None = typer.Option(None, "--version", metavar="V", help="version (default latest)"),
             as_json: bool = json_option()) -> None:
    """Write the full state of a version under snapshots/V/ (checked against the commit's
    digests): new receivers and readers start from it."""
    from dcr_log.lifecycle import write_snapshot
    from dcr_log.log.deltalog import DeltaLog

    dlog = DeltaLog.open(log)
    v = dlog.latest_version() if version is None else version
    say_left(lambda: f"snapshot {v} not written")
    with progress_bar("snapshot", _state_bytes(dlog.commit(v))) as advance:
        cu = write_snapshot(dlog, v, progress=advance)
    say_result(as_json, {"snapshot": cu.version, "segments": len(cu.segments), "bytes": cu.delta_bytes},
               f"snapshot {cu.version}: {len(cu.segments)} segments, {cu.delta_bytes} bytes")


def squash(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           start: int = typer.Argument(..., metavar="START", help="from this version"),
           end: int = typer.Argument(..., metavar="END", help="to this version"),
           as_json: bool = json_option()) -> None:
    """Write one delta from version START to END, stored beside the versions: a receiver at
    START catches up through it when that reads fewer bytes than the chain."""
    from dcr_log.lifecycle import write_squash
    from dcr_log.log.deltalog import DeltaLog

    dlog = DeltaLog.open(log)
    say_left(lambda: f"squash {start}-{end} not written")
    with progress_bar("squash", _state_bytes(dlog.commit(end))) as advance:
        cu = write_squash(dlog, start, end, progress=advance)
    chain = sum(dlog.commit(u).delta_bytes for u in range(max(start + 1, dlog.known_start()), end + 1))
    say_result(as_json, {"squash": [start, end], "bytes": cu.delta_bytes, "chain_bytes": chain,
                         "changed_elements": cu.stats.changed_elements},
               f"squash {start}-{end}: {cu.delta_bytes} bytes ({chain} bytes through the versions), "
               f"{cu.stats.changed_elements} changed elements")


def gc_cmd(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           keep_last: int = typer.Option(
               ..., "--keep-last", metavar="N", help="versions kept replayable (the newest N)"),
           keep_snapshots: int = typer.Option(
               2, "--keep-snapshots", metavar="M", help="snapshots kept (the newest M, and the log start's)"),
           grace: str = typer.Option(
               "1h", "--grace", metavar="DURATION",
               help="how long a marker stands before what it expires is deleted (90s, 15m, 1h, 7d)"),
           no_snapshot: bool = typer.Option(
               False, "--no-snapshot", help="expire only up to an existing snapshot; never write one"),
           dry_run: bool = typer.Option(
               False, "--dry-run", help="say exactly what the same gc would write and delete now; change nothing"),
           as_json: bool = json_option()) -> None:
    """Expire versions before latest-N+1 (its snapshot written if missing; with --no-snapshot, the
    newest snapshot at or below it), safely with concurrent writers, readers and receivers
    (FORMAT.md section 25); delete what expired markers and retired snapshots make unneeded, and
    orphan segments, once older than the grace period."""
    from dcr_log.lifecycle import gc, parse_duration
    from dcr_log.log.deltalog import DeltaLog

    dlog = DeltaLog.open(log)
    seconds = parse_duration(grace)
    say_left(lambda: "gc interrupted: run it again (every step is safe to repeat)")
    report = gc(dlog, keep_last, keep_snapshots=keep_snapshots, grace=seconds, snapshot=not no_snapshot,
                dry_run=dry_run)
    if as_json:
        out.print(json.dumps(report.to_json()), markup=False)
        return
    if dry_run:
        write, start, retire, delete = "would write", "would start", "would retire", "would delete"
    else:
        write, start, retire, delete = "wrote", "starts", "retired", "deleted"
    wrote = f"{write} snapshot {report.snapshot_written}; " if report.snapshot_written is not None else ""
    moved = f"log {start} at version {report.start}" if report.log_start_written is not None \
        else f"log starts at version {report.start}"
    retired = f"{retire} snapshots {report.retired}; " if report.retired else ""
    nothing = "nothing to do; " if report.nothing_to_do else ""
    out.print(f"{'dry run: ' if dry_run else ''}{nothing}{wrote}{moved}; {retired}"
              f"{delete} {report.deleted_objects} objects ({report.deleted_bytes} bytes: "
              f"{report.deleted_versions} versions below {report.expired_start}, {report.orphans} orphans); "
              f"{report.waiting} waiting for the grace period", markup=False)


def mirror_cmd(src: str = typer.Argument(..., metavar="SRC", help="the log to copy (directory or URL)"),
               dst: str = typer.Argument(..., metavar="DST", help="where the mirror lives (directory or URL)"),
               follow: bool = typer.Option(False, "--follow", help="keep copying new versions"),
               interval: float = typer.Option(
                   1.0, "--interval", metavar="SECONDS", help="with --follow: seconds between passes"),
               trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP),
               as_json: bool = json_option()) -> None:
    """Copy a log to another store, every object checked before it is published and each commit
    record after all it names: the mirror is a valid log with the same log id (FORMAT.md
    section 26). Run again (or --follow) to bring it up to date; SIGINT or SIGTERM stops
    --follow between passes."""
    from dcr_log.lifecycle.mirror import Mirror
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.store import Store

    if not interval > 0:
        raise UsageError("--interval must be positive")
    source = open_log(src, trust)
    target = Store.open(dst, create=True)
    m = Mirror(source, target)

    def row(r) -> dict:
        return {"mirror": target.url, "versions": r.versions, "objects": r.objects, "bytes": r.bytes,
                "latest": r.latest}

    def said(r) -> None:
        if r.versions or r.objects:
            say_result(as_json, row(r), f"mirrored {r.versions} versions, {r.objects} objects ({r.bytes} bytes); "
                                        f"{target.url} at version {r.latest}")

    def left() -> str:
        try:
            at = f"at version {DeltaLog.open(target).latest_version()}"
        except DcrError:
            at = "without a version yet"
        return f"mirror {target.url} {at}: run dcr mirror again to bring it up to date"

    say_left(left)
    if follow:
        FOLLOW.active = True
        try:
            m.follow(interval, FOLLOW.stop.is_set, on_pass=said)
        finally:
            FOLLOW.active = False
        return
    with progress_bar("mirror", len(source.versions()), unit="versions") as advance:
        m.progress = lambda v: advance()
        r = m.run_once()
    said(r)
    if not (r.versions or r.objects):
        say_result(as_json, row(r), f"{target.url} is up to date at version {r.latest}")
