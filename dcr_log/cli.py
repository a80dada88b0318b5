"""The ``dcr`` command. Exit codes: 0 ok, 1 other, 2 usage, 3 integrity, 4 lineage, 5 conflict,
6 store (no space, read-only, permission, unreachable), 7 trust (no valid signature by a
trusted key), 130 SIGINT, 143 SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dcr_log import _entry
from dcr_log.checkpoint import load_checkpoint, save_safetensors
from dcr_log.errors import DcrError, IntegrityError, Interrupted, NotFoundError, StoreError, UsageError, os_error
from dcr_log.log.deltalog import DeltaLog
from dcr_log.write.files import collect_files
from dcr_log.write.writer import LogWriter, default_writer_id

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="dcr-log: bit-exact delta logs for refitting model weights.")
# emoji=False: ":name:" in a tensor name or path must print as written (JSON output included).
out = Console(highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


@contextmanager
def progress_bar(label: str, total: int | None) -> Iterator:
    """A rich progress bar on a terminal; a no-op otherwise. Yields advance(n)."""
    if not err.is_terminal:
        yield lambda n=1: None
        return
    with Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)


def _version_progress(log: DeltaLog, label: str, upto: int | None = None):
    total = (log.latest_version() if upto is None else upto) + 1
    return progress_bar(label, total)


# What an interrupted command leaves behind, said in one line: the newest callable registered
# by the running command (see main); none registered: "nothing done".
_LEFT: list = []


def _left(say) -> None:
    _LEFT.append(say)


def _version_left(location, version: int, writer_id: str) -> str:
    """What an interrupted init or append left of VERSION, read from the store: the signal may
    have landed after the commit record was written and before the writer returned."""
    try:
        commit = DeltaLog.open(location).commit(version)
    except NotFoundError:
        return f"version {version} not committed"
    except Exception as exc:
        return f"version {version}: commit state unknown ({type(exc).__name__}: run dcr log to see)"
    if commit.writer_id != writer_id:
        return f"version {version} not committed (another writer committed version {version})"
    return f"version {version} committed"


CACHE_HELP = ("baseline cache directory (default $DCR_CACHE_DIR or ~/.cache/dcr-log); "
              "'none' keeps no cache")


def _cache_dir(cache: str | None):
    if cache is None:
        return None
    return False if cache == "none" else Path(cache)


SIGN_HELP = "sign the version with this ed25519 key file (dcr keygen)"
TRUST_HELP = ("accept only versions signed by a key of this file (public keys, one per line; "
              "repeat for several files)")


def _signing_key(path: Path | None):
    from dcr_log.signing import SigningKey

    return None if path is None else SigningKey.load(path)


def _open_log(log: str, trust: list[Path] | None) -> DeltaLog:
    from dcr_log.signing import TrustPolicy

    return DeltaLog.open(log, trust=TrustPolicy.load(trust) if trust else None)


@app.command()
def keygen(key: Path = typer.Argument(..., help="private key file to create (and KEY.pub)")) -> None:
    """Create an ed25519 signing key: KEY (private, mode 0600) and KEY.pub (its public key)."""
    from dcr_log.signing import SigningKey, public_text

    k = SigningKey.generate()
    _left(lambda: _keygen_left(key))
    pub = k.save(key)
    out.print(f"{public_text(k.public)}  key id {k.key_id}; public key in {pub}", markup=False)


def _keygen_left(key: Path) -> str:
    pub = Path(f"{key}.pub")
    if not key.exists():
        return "no key written"
    if not pub.exists():
        return f"{key} written without {pub}: delete {key} and run dcr keygen again"
    return f"key {key} and {pub} written"


@app.command()
def sign(log: str = typer.Argument(..., help="log directory or URL"),
         key: Path = typer.Option(..., "--key", help="ed25519 private key file"),
         version: int | None = typer.Option(None, "--version", help="only this version (default every version)")) -> None:
    """Sign existing versions with KEY (a new key of a rotation, or a log written unsigned)."""
    k = _signing_key(key)
    dlog = DeltaLog.open(log)
    versions = dlog.versions() if version is None else [version]
    signed = []
    _left(lambda: f"{len(signed)} of {len(versions)} versions signed: run dcr sign again "
                  "(signing a version again is harmless)")
    for v in versions:
        dlog.sign(v, k)
        signed.append(v)
    out.print(f"signed {len(versions)} versions with key {k.key_id}", markup=False)


FILES_HELP = ("carry the checkpoint directory's other files (config, tokenizer, ...: every regular "
              "file at its top level but the weights and dot files); default: when there are any. "
              "--no-files carries none (append: the previous version's are kept)")


def _checkpoint_files(from_: Path, wanted: bool | None) -> dict[str, Path] | None:
    """The files ``--from`` carries: None when none are to be carried (not a directory, or
    --no-files), else the directory's files (possibly none)."""
    if wanted is False:
        return None
    if not from_.is_dir():
        if wanted:
            raise UsageError(f"--files needs a checkpoint directory; {from_} is a file")
        return None
    return collect_files(from_)


def _files_said(commit) -> str:
    if commit.files is None:
        return ""
    return f", {len(commit.files)} files ({sum(f.size for f in commit.files)} bytes)"


@app.command()
def init(log: str = typer.Argument(..., help="log directory or URL"),
         from_: Path = typer.Option(..., "--from", help="checkpoint: .safetensors or a directory"),
         files: bool | None = typer.Option(None, "--files/--no-files", help=FILES_HELP + "; "
                                              "--files makes a log that carries files even if there are none yet"),
         cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
         sign_key: Path | None = typer.Option(None, "--sign", help=SIGN_HELP)) -> None:
    """Create LOG; version 0 is the full state of the checkpoint (and its files: the log then
    carries every version's files)."""
    key = _signing_key(sign_key)
    state = load_checkpoint(from_)
    carried = _checkpoint_files(from_, files)
    if carried is not None and not carried and files is None:
        carried = None  # a directory of weights only: a log without files, unless --files
    if carried is None and files:
        carried = {}
    writer_id = default_writer_id()
    _left(lambda: _version_left(log, 0, writer_id))
    with progress_bar("init", sum(b.nbytes for b in state.values())) as advance:
        writer = LogWriter.create(log, state, progress=advance, cache_dir=_cache_dir(cache),
                                  signing_key=key, files=carried, writer_id=writer_id)
    _left(lambda: "version 0 committed")
    commit = writer.log.commit(0)
    out.print(f"version 0: {len(commit.tensors)} tensors, {commit.delta_bytes} bytes{_files_said(commit)}")


@app.command()
def append(log: str = typer.Argument(..., help="log directory or URL"),
           from_: Path = typer.Option(..., "--from", help="checkpoint: .safetensors or a directory"),
           files: bool | None = typer.Option(None, "--files/--no-files", help=FILES_HELP),
           cache: str | None = typer.Option(None, "--cache", help=CACHE_HELP),
           sign_key: Path | None = typer.Option(None, "--sign", help=SIGN_HELP),
           allow_layout_change: bool = typer.Option(
               False, "--allow-layout-change",
               help="accept a checkpoint whose tensor table differs from the latest version's "
                    "(a tensor added, removed, renamed, reshaped or retyped); refused without it")) -> None:
    """Append the checkpoint's state as the next version, stored as a delta (and, in a log
    that carries files, the directory's files: the whole set, a file left out is dropped).
    A checkpoint of another tensor table (another model) is refused unless
    --allow-layout-change.

    The baseline (the latest version's state) comes from the local cache that init and append
    keep, checked against the commit's digests; without one the log is replayed.
    """
    key = _signing_key(sign_key)
    dlog = DeltaLog.open(log)
    if files and not dlog.has_files:
        raise UsageError(f"{log} was created without the feature 'files': its versions carry no "
                         "files (the feature is chosen by dcr init)")
    state = load_checkpoint(from_)
    carried = _checkpoint_files(from_, files)
    if carried and not dlog.has_files:
        err.print(f"dcr: note: {log} carries no files (created without them): "
                  f"{len(carried)} files of {from_} not logged", markup=False)
        carried = None
    _left(lambda: f"version {dlog.latest_version() + 1} not committed")
    writer_id = default_writer_id()
    writer = LogWriter.open(dlog, cache_dir=_cache_dir(cache), signing_key=key, writer_id=writer_id)
    version = writer.version + 1
    _left(lambda: _version_left(log, version, writer_id))
    with progress_bar("append", sum(b.nbytes for b in state.values())) as advance:
        commit = writer.append(state, progress=advance, files=carried if dlog.has_files else None,
                               allow_layout_change=allow_layout_change)
    _left(lambda: f"version {commit.version} committed")
    pct = 100.0 * commit.stats.changed_elements / max(commit.stats.total_elements, 1)
    out.print(f"version {commit.version}: {commit.stats.changed_elements} changed ({pct:.3f}%), "
              f"{commit.delta_bytes} bytes{_files_said(commit)}")


def _log_rows(dlog: DeltaLog) -> list[dict]:
    rows = []
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


@app.command("log")
def log_cmd(log: str = typer.Argument(..., help="log directory or URL"),
            as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
            trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """One line per version: version, parent, bytes, changed elements and %, and in a log that
    carries files their count and bytes (--json: each file's name, size and sha256)."""
    from dcr_log.lifecycle.stats import catchup_rows

    dlog = _open_log(log, trust)
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
            table.add_row(c["kind"], str(c["version"]), "-" if c["from"] is None else str(c["from"]),
                          str(c["bytes"]), "-" if c.get("chain_bytes") is None else str(c["chain_bytes"]), str(c["records"]), c["created_at"])
        out.print(table)


@app.command()
def snapshot(log: str = typer.Argument(..., help="log directory or URL"),
             version: int | None = typer.Option(None, "--version", help="version (default latest)")) -> None:
    """Write the full state of a version under snapshots/V/ (checked against the commit's
    digests): new receivers and readers start from it."""
    from dcr_log.lifecycle import write_snapshot

    dlog = DeltaLog.open(log)
    v = dlog.latest_version() if version is None else version
    _left(lambda: f"snapshot {v} not written")
    cu = write_snapshot(dlog, v)
    out.print(f"snapshot {cu.version}: {len(cu.segments)} segments, {cu.delta_bytes} bytes", markup=False)


@app.command()
def squash(log: str = typer.Argument(..., help="log directory or URL"),
           start: int = typer.Argument(..., help="from this version"),
           end: int = typer.Argument(..., help="to this version")) -> None:
    """Write one delta from version START to END, stored beside the versions: a receiver at
    START catches up through it when that reads fewer bytes than the chain."""
    from dcr_log.lifecycle import write_squash

    dlog = DeltaLog.open(log)
    _left(lambda: f"squash {start}-{end} not written")
    cu = write_squash(dlog, start, end)
    chain = sum(dlog.commit(u).delta_bytes for u in range(max(start + 1, dlog.known_start()), end + 1))
    out.print(f"squash {start}-{end}: {cu.delta_bytes} bytes ({chain} bytes through the versions), "
              f"{cu.stats.changed_elements} changed elements", markup=False)


@app.command("gc")
def gc_cmd(log: str = typer.Argument(..., help="log directory or URL"),
           keep_last: int = typer.Option(..., "--keep-last", help="versions kept replayable (the newest N)"),
           keep_snapshots: int = typer.Option(2, "--keep-snapshots", help="snapshots kept (the newest M, and the log start's)"),
           grace: str = typer.Option("1h", "--grace", help="how long a marker stands before what it expires is deleted (90s, 15m, 1h, 7d)"),
           no_snapshot: bool = typer.Option(False, "--no-snapshot", help="expire only up to an existing snapshot; never write one"),
           dry_run: bool = typer.Option(False, "--dry-run", help="say exactly what the same gc would write and delete now; change nothing"),
           as_json: bool = typer.Option(False, "--json", help="one JSON object")) -> None:
    """Expire versions before latest-N+1 (its snapshot written if missing; with --no-snapshot, the newest snapshot at or below it),
    safely with concurrent writers, readers and receivers (FORMAT.md section 25); delete what
    expired markers and retired snapshots make unneeded, and orphan segments, once older than
    the grace period."""
    from dcr_log.lifecycle import gc, parse_duration

    dlog = DeltaLog.open(log)
    seconds = parse_duration(grace)
    _left(lambda: "gc interrupted: run it again (every step is safe to repeat)")
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


@app.command("mirror")
def mirror_cmd(src: str = typer.Argument(..., help="the log to copy (directory or URL)"),
               dst: str = typer.Argument(..., help="where the mirror lives (directory or URL)"),
               follow: bool = typer.Option(False, "--follow", help="keep copying new versions"),
               interval: float = typer.Option(1.0, "--interval", help="with --follow: seconds between passes"),
               trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """Copy a log to another store, every object checked before it is published and each commit
    record after all it names: the mirror is a valid log with the same log id (FORMAT.md
    section 26). Run again (or --follow) to bring it up to date; SIGINT or SIGTERM stops
    --follow between passes."""
    from dcr_log.lifecycle.mirror import Mirror
    from dcr_log.store import Store

    if not interval > 0:
        raise UsageError("--interval must be positive")
    source = _open_log(src, trust)
    target = Store.open(dst, create=True)
    m = Mirror(source, target)

    def said(r) -> None:
        if r.versions or r.objects:
            out.print(f"mirrored {r.versions} versions, {r.objects} objects ({r.bytes} bytes); "
                      f"{target.url} at version {r.latest}", markup=False)

    def left() -> str:
        try:
            at = f"at version {DeltaLog.open(target).latest_version()}"
        except DcrError:
            at = "without a version yet"
        return f"mirror {target.url} {at}: run dcr mirror again to bring it up to date"

    _left(left)
    if follow:
        _FOLLOW.active = True
        try:
            m.follow(interval, _FOLLOW.stop.is_set, on_pass=said)
        finally:
            _FOLLOW.active = False
        return
    r = m.run_once()
    said(r)
    if not (r.versions or r.objects):
        out.print(f"{target.url} is up to date at version {r.latest}", markup=False)


@app.command()
def stats(log: str = typer.Argument(..., help="log directory or URL"),
          as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
          plot_path: Path | None = typer.Option(None, "--plot", help="write a PNG plot of bytes and change rate"),
          trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """Per version: changed %, bytes, ratio to dense, records by kind and encoding, seconds
    since the parent; then snapshots and squashes."""
    from dcr_log.lifecycle.stats import catchup_rows, plot, version_stats

    if plot_path is not None and not plot_path.parent.is_dir():
        raise UsageError(f"no directory {plot_path.parent} for --plot")
    dlog = _open_log(log, trust)
    rows = version_stats(dlog)
    catchups = catchup_rows(dlog)
    if plot_path is not None:
        plot(rows, catchups, plot_path, f"dcr log {dlog.log_id[:8]}")
    if as_json:
        for r in rows + catchups:
            out.print(json.dumps(r), markup=False)
        return
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


@app.command()
def show(log: str = typer.Argument(..., help="log directory or URL"),
         version: int = typer.Argument(..., help="version number"),
         as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
         trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """Per tensor: records, encodings, changed elements and payload bytes of one version; then
    its files (name, size, sha256), in a log that carries files."""
    dlog = _open_log(log, trust)
    commit = dlog.commit(version)
    per = {t.name: {"tensor": t.name, "dtype": t.dtype, "shape": list(t.shape), "records": 0,
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
    table = Table("tensor", "dtype", "shape", "records", "kinds", "encodings", "changed", "%", "bytes")
    for row in per.values():
        pct = 100.0 * row["changed_elements"] / max(row["elements"], 1)
        table.add_row(row["tensor"], row["dtype"], "x".join(map(str, row["shape"])) or "()",
                      str(row["records"]), ",".join(f"{k}:{v}" for k, v in row["kinds"].items()),
                      ",".join(f"{k}:{v}" for k, v in row["encodings"].items()),
                      str(row["changed_elements"]), f"{pct:.3f}", str(row["bytes"]))
    out.print(table)
    if commit.files is not None:
        files = Table("file", "size", "sha256")
        for f in commit.files:
            files.add_row(Text(f.name), str(f.size), f.sha256)  # a name is never markup
        out.print(files)


@app.command()
def verify(log: str = typer.Argument(..., help="log directory or URL"),
           deep: bool = typer.Option(False, "--deep", help="also replay every version and check every digest"),
           trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """Check every commit record, the parent chain and every segment's hash (and, with
    --trust, every version's signature)."""
    dlog = _open_log(log, trust)
    versions = dlog.versions()
    if not versions:  # section 13: verifying a log without versions is an integrity error
        raise IntegrityError(f"{dlog.store.url}: log has no versions")
    with progress_bar("verify", len(versions)) as advance:
        report = dlog.verify(deep=deep, progress=lambda v: advance())
    files = f", {report.files} files" if dlog.has_files else ""
    start = f" from version {report.start}" if report.start else ""
    catchups = f", {report.catchups} snapshots and squashes" if report.catchups else ""
    out.print(f"ok: {report.versions} versions{start}, {report.segments} segments{files}{catchups}, "
              f"{report.bytes_checked} bytes{' (deep)' if deep else ''}{', signed' if trust else ''}")


@app.command()
def replay(log: str = typer.Argument(..., help="log directory or URL"),
           version: int | None = typer.Option(None, "--version", help="version (default latest)"),
           out_path: Path = typer.Option(..., "--out", help="output .safetensors file"),
           trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP)) -> None:
    """Rebuild a version bit-exactly and write it as one .safetensors file."""
    if not out_path.parent.is_dir():
        raise UsageError(f"no directory {out_path.parent} for --out")
    dlog = _open_log(log, trust)
    _left(lambda: f"{out_path} not written")
    with _version_progress(dlog, "replay", version) as advance:
        state = dlog.materialize(version, progress=lambda v: advance())
    save_safetensors(state, out_path)  # whole or not at all
    _left(lambda: f"{out_path} written")
    out.print(f"wrote {out_path}: version {dlog.latest_version() if version is None else version}, "
              f"{len(state)} tensors")


@app.command()
def demo(dir: Path | None = typer.Option(None, "--dir", help="where to write the log (default: a temporary directory)")) -> None:
    """Build a small bf16 model, log ~10 training steps, replay and check every version."""
    from dcr_log.demo import run_demo

    _left(lambda: "demo not finished" + (f" (its log under {dir} may be incomplete)" if dir else ""))
    run_demo(dir, out)


def _one_line(text: str) -> str:
    """A failure is reported on exactly one stderr line, even when a library's message is not."""
    return " ".join(text.split())


@app.command("apply")
def apply_cmd(log: str = typer.Argument(..., help="log directory or URL"),
              receiver: Path = typer.Option(..., "--receiver", help="checkpoint directory updated in place"),
              to: int | None = typer.Option(None, "--to", help="stop at this version (default latest)"),
              verify: str = typer.Option("sample", "--verify", help="none, sample or full"),
              trust: list[Path] | None = typer.Option(None, "--trust", help=TRUST_HELP),
              follow: bool = typer.Option(False, "--follow", help="keep running: apply each new version as soon as it is committed"),
              interval: float = typer.Option(1.0, "--interval", help="with --follow: seconds between polls for the next version")) -> None:
    """Bring a checkpoint directory to a version, in place and crash-safely.

    Without a journal (DIR/.dcr), a checkpoint in DIR is bound to the version with its state digest; an empty or missing DIR gets the version written out whole.
    With --follow it keeps running; SIGINT or SIGTERM stops it between versions (exit 130 or 143).
    """
    from dcr_log.receiver import VERIFY_LEVELS, open_directory

    if verify not in VERIFY_LEVELS:
        raise UsageError(f"--verify must be one of {', '.join(VERIFY_LEVELS)}")
    if follow and to is not None:
        raise UsageError("--follow and --to do not go together")
    if not interval > 0:
        raise UsageError("--interval must be positive")
    dlog = _open_log(log, trust)
    _left(lambda: _receiver_left(receiver))
    said = []

    def say(text: str) -> None:
        said.append(text)
        out.print(text, markup=False)

    with open_directory(dlog, receiver, to=to, say=say) as rx:
        def line(r) -> None:
            files = (f", {r.files_written} files written, {r.files_removed} removed"
                     if r.files_written or r.files_removed else "")
            via = {"squash": f" (squash from {r.start})", "snapshot": " (snapshot)"}.get(r.route, "")
            say(f"applied version {r.version}{via}: {r.written} records written, {r.skipped} already applied, "
                f"{r.repaired} repaired, {r.changed_elements} changed elements{files}, {r.seconds:.3f} s")
        if follow:
            _FOLLOW.active = True  # a signal now stops between versions (a second one at once)
            try:
                rx.follow(dlog, interval=interval, verify=verify, on_version=line, stop=_FOLLOW.stop.is_set)
            finally:
                _FOLLOW.active = False
            return
        rx.apply(dlog, to=to, verify=verify, on_version=line)
        if not said:
            say(f"receiver at version {rx.version}")


@app.command("status")
def status_cmd(receiver: Path = typer.Option(..., "--receiver", help="checkpoint directory"),
               as_json: bool = typer.Option(False, "--json", help="one JSON object")) -> None:
    """A receiver's log, current version and digest, and the version in flight if any."""
    from dcr_log.receiver import JOURNAL_DIR, Journal

    st = Journal.peek(receiver / JOURNAL_DIR)
    row = {"receiver": str(receiver), **st.to_json()}
    if as_json:
        out.print(json.dumps(row), markup=False)
        return
    for key in ("receiver", "log_id", "version", "state_digest", "inflight", "inflight_kind", "materializing"):
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


class _Follow:
    """While ``dcr apply --follow`` runs, the first SIGINT or SIGTERM asks it to stop between
    versions instead of interrupting one."""

    def __init__(self) -> None:
        self.active = False
        self.stop = threading.Event()


_FOLLOW = _Follow()


class _Signals:
    """SIGINT and SIGTERM raise Interrupted (a KeyboardInterrupt: rollbacks run) while a
    command runs; remembers the first one. Once the run is over (``raising`` False) a signal is
    only remembered, for main to report; under dcr's entry point (dcr_log._entry) one that
    comes when none was taken ends the process there and then, saying what the command left."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raising = True
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        first = self.signum is None
        if not self.raising:
            if first and _entry._State.active:
                _entry.exit_on_signal(signum)
            if first:
                self.signum = signum
            return  # a second signal while the first one is reported: that report stands
        if first:
            self.signum = signum
        if first and _FOLLOW.active:
            _FOLLOW.stop.set()
            return
        raise Interrupted(signum)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Outcome:
    """The exit code of the command that ran (main's), once it is decided: a failure's or an
    interrupt's line has been said by then (see signal_outcome)."""

    code: int | None = None


def _interrupted_line(signum: int) -> str:
    left = "nothing done"
    try:
        if _LEFT:
            left = _LEFT[-1]()
    except (Exception, KeyboardInterrupt):
        left = "interrupted"
    return _one_line(f"dcr: interrupted ({signal.Signals(signum).name}): {left}")


def signal_outcome(signum: int) -> tuple[int, str | None]:
    """For dcr's entry point, a signal outside a command's run: the exit code and the line to
    say. Before a command started: nothing done; after it finished: what it left (e.g.
    "version 7 committed"); after a failure or an interrupt, reported already: that code, no
    second line."""
    if _Outcome.code not in (None, 0):
        return _Outcome.code, None
    return 128 + signum, _interrupted_line(signum)


def main(argv: list[str] | None = None) -> int:
    _LEFT.clear()
    _FOLLOW.stop.clear()
    _Outcome.code = None
    with _Signals() as signals:
        rc = 0
        try:
            rc = _run(argv)
        except KeyboardInterrupt as exc:
            if signals.signum is None:
                signals.signum = getattr(exc, "signum", signal.SIGINT)
        finally:
            signals.raising = False  # from here on a signal interrupts nothing
        if rc == 130 and signals.signum is None:  # typer turned a KeyboardInterrupt into 130
            signals.signum = signal.SIGINT
        if signals.signum is not None:
            err.print(_interrupted_line(signals.signum), markup=False)
            rc = 128 + signals.signum
        _Outcome.code = rc
    return rc


def _failed(code: int, line: str) -> int:
    _Outcome.code = code  # set first: a signal while the line is said adds no second line
    err.print(_one_line(line), markup=False)
    return code


def _run(argv: list[str] | None) -> int:
    try:
        rv = app(args=argv, standalone_mode=False)
    except DcrError as exc:
        return _failed(exc.exit_code, f"dcr: error: {exc}")
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        return _failed(1, "dcr: aborted")
    except OSError as exc:
        return _failed(StoreError.exit_code, f"dcr: error: {os_error(exc, 'I/O failed')}")
    except MemoryError:
        return _failed(StoreError.exit_code, "dcr: error: out of memory")
    except Exception as exc:  # command-line usage errors (typer's click) and anything unexpected
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):
            message = exc.format_message() or "missing command (see --help)"
            return _failed(UsageError.exit_code, f"dcr: usage: {message}")
        return _failed(1, f"dcr: error: {type(exc).__name__}: {exc}")
    return rv if isinstance(rv, int) else 0


def entry() -> None:
    """The ``dcr`` command (kept for callers of dcr_log.cli:entry): dcr_log._entry.entry, whose
    signal handling starts before this module's imports."""
    _entry.entry()
