"""``dcr apply`` and ``dcr status``: a checkpoint-directory receiver."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dcr_log.cli.app import FOLLOW, TRUST_HELP, err, json_option, open_log, out, progress_bar, say_left, say_result
from dcr_log.errors import DcrError, UsageError

if TYPE_CHECKING:
    from rich.console import Console


def apply_cmd(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
              receiver: Path = typer.Option(
                  ..., "--receiver", metavar="DIR", help="checkpoint directory updated in place"),
              to: int | None = typer.Option(None, "--to", metavar="V", help="stop at this version (default latest)"),
              verify: str = typer.Option("sample", "--verify", metavar="none|sample|full",
                                         help="how much of each record to check against its digests"),
              trust: list[Path] | None = typer.Option(None, "--trust", metavar="FILE", help=TRUST_HELP),
              follow: bool = typer.Option(
                  False, "--follow", help="keep running: apply each new version as soon as it is committed"),
              interval: float = typer.Option(
                  1.0, "--interval", metavar="SECONDS",
                  help="with --follow: seconds between polls for the next version"),
              deferred_sync: bool = typer.Option(
                  True, "--deferred-sync/--sync-each-batch",
                  help="keep written words in the journal and sync the files later (the default), or "
                       "sync them before each journal marker, for programs that read DIR without dcr "
                       "after a power loss"),
              as_json: bool = json_option()) -> None:
    """Bring a checkpoint directory to a version, in place and crash-safely.

    Without a journal (DIR/.dcr), a checkpoint in DIR is bound to the version with its state
    digest; an empty or missing DIR gets the version written out whole.
    With --follow it keeps running; SIGINT or SIGTERM stops it between versions (exit 130 or 143).
    """
    from dcr_log.receiver import VERIFY_LEVELS, open_directory

    if verify not in VERIFY_LEVELS:
        raise UsageError(f"--verify must be one of {', '.join(VERIFY_LEVELS)}")
    if follow and to is not None:
        raise UsageError("--follow and --to do not go together")
    if not interval > 0:
        raise UsageError("--interval must be positive")
    dlog = open_log(log, trust)
    say_left(lambda: _receiver_left(receiver))
    said = []

    def say(text: str, row: dict | None = None) -> None:
        said.append(text)
        if as_json:  # what the receiver says as it opens (binding, writing out) is a result too
            row = {"receiver": str(receiver), "said": text} if row is None else row
        say_result(as_json, row or {}, text)

    with open_directory(dlog, receiver, to=to, say=say, deferred_sync=deferred_sync) as rx:
        def line(r) -> None:
            files = (f", {r.files_written} files written, {r.files_removed} removed"
                     if r.files_written or r.files_removed else "")
            via = {"squash": f" (squash from {r.start})", "snapshot": " (snapshot)"}.get(r.route, "")
            say(f"applied version {r.version}{via}: {r.written} records written, {r.skipped} already applied, "
                f"{r.repaired} repaired, {r.changed_elements} changed elements{files}, {r.seconds:.3f} s",
                {"receiver": str(receiver), "applied": r.version, "route": r.route, "start": r.start,
                 "written": r.written, "skipped": r.skipped, "repaired": r.repaired,
                 "changed_elements": r.changed_elements, "files_written": r.files_written,
                 "files_removed": r.files_removed, "seconds": r.seconds})
        if follow:
            FOLLOW.active = True  # a signal now stops between versions (a second one at once)
            try:
                rx.follow(dlog, interval=interval, verify=verify, on_version=line, stop=FOLLOW.stop.is_set,
                          on_wait=waiting_line(err.get(), as_json, interval))
            finally:
                FOLLOW.active = False
            return
        with progress_bar("apply", len(rx.route(dlog, to)), unit="versions") as advance:
            def applied(r) -> None:
                line(r)
                advance()
            rx.apply(dlog, to=to, verify=verify, on_version=applied)
        if not said:
            say(f"receiver at version {rx.version}", {"receiver": str(receiver), "version": rx.version})


def waiting_line(console: Console, as_json: bool, interval: float) -> Callable[[int], AbstractContextManager] | None:
    """What ``dcr apply --follow`` shows while it waits for version N: one transient status
    line on a terminal; nothing on a pipe or with --json (their output is results only)."""
    if as_json or not console.is_terminal:
        return None
    from rich.text import Text

    def waiting(version: int) -> AbstractContextManager:
        return console.status(Text(f"waiting for version {version} after {version - 1} "
                                   f"(checking every {interval:g}s)"))

    return waiting


def status_cmd(receiver: Path = typer.Option(..., "--receiver", metavar="DIR", help="checkpoint directory"),
               as_json: bool = json_option()) -> None:
    """A receiver's log, current version and digest, and the version in flight if any."""
    from dcr_log.receiver import JOURNAL_DIR, Journal
    from dcr_log.receiver.fs import boot_id

    st = Journal.peek(receiver / JOURNAL_DIR)
    row = {"receiver": str(receiver), **st.to_json()}
    # Deferred sync: words the journal holds that the files may not (RECEIVER.md 5.6).
    if st.wal_boot is None:
        row["unsynced"] = None
    elif st.restore_needed(boot_id()):
        row["unsynced"] = "restore needed: run dcr apply (with --to at the current version to apply nothing)"
    else:
        row["unsynced"] = "in the page cache"
    if as_json:
        out.print(json.dumps(row), markup=False)
        return
    for key in ("receiver", "log_id", "version", "state_digest", "inflight", "inflight_kind", "materializing",
                "unsynced"):
        value = row[key]
        out.print(f"{key:<14} {'-' if value is None else value}", markup=False)


def _receiver_left(receiver: Path) -> str:
    """What an interrupted ``dcr apply`` left, from the journal (closed by then)."""
    from dcr_log.receiver import JOURNAL_DIR, Journal

    try:
        st = Journal.peek(receiver / JOURNAL_DIR)
    except DcrError:
        return "receiver not written"
    if st.inflight is not None:
        return f"receiver in flight at {st.inflight}: run dcr apply again"
    if st.materializing is not None:
        return f"receiver materializing version {st.materializing}: run dcr apply again"
    if st.version is None:
        return "receiver not written"
    return f"receiver at version {st.version}"
