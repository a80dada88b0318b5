"""The ``dcr`` application: the typer app and its consoles, what every command shares (opening a
log, progress bars, signing and trust options, the one-line "left behind" messages), and the
process around a command: signals, the outcome of an interrupted command, and errors mapped to
exit codes (see dcr_log.cli).
"""

from __future__ import annotations

import inspect
import json
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from dcr_log import _entry
from dcr_log.errors import DcrError, Interrupted, NotFoundError, StoreError, UsageError, os_error

if TYPE_CHECKING:  # the library is imported by the commands that use it: `dcr --help` stays fast
    from dcr_log.log.deltalog import DeltaLog

class _FlagsWithoutPlaceholder:
    """A flag takes no value: its help shows no value placeholder (typer writes ``<bool>``)."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
                param.metavar = ""
        return params


_HYPHEN_HELD = "\u2011"  # a non-breaking hyphen: no line is wrapped after it


class _HelpFormatter(typer.Context.formatter_class):  # type: ignore[valid-type,misc]
    """click's help formatter (whichever click typer uses), but a line never ends at a hyphen:
    a flag (``--allow-layout-change``) or a path (``~/.cache/dcr-log``) stays whole on its
    line. Its hyphens are held as non-breaking ones while click wraps, and given back after."""

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        super().write_usage(prog.replace("-", _HYPHEN_HELD), args.replace("-", _HYPHEN_HELD), prefix)

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _HYPHEN_HELD))

    def write_dl(self, rows: Any, *args: Any, **kwargs: Any) -> None:
        super().write_dl([(first.replace("-", _HYPHEN_HELD), second.replace("-", _HYPHEN_HELD))
                          for first, second in rows], *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(_HYPHEN_HELD, "-")


class _HelpContext(typer.Context):
    formatter_class = _HelpFormatter


class DcrGroup(_FlagsWithoutPlaceholder, TyperGroup):
    """dcr's command groups (``dcr``, ``dcr cache``)."""

    context_class = _HelpContext

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # The help on stdout, then the one line of a usage error (click would make the
            # whole help the error's message, which that line would run together).
            typer.echo(ctx.get_help())
            ctx.fail("missing command (see --help)")
        return super().parse_args(ctx, args)


class DcrCommand(_FlagsWithoutPlaceholder, TyperCommand):
    """A command as its help should read: the usage line names arguments by their
    placeholders (``LOG``, ``[VERSION]``; typer writes ``{log}``), flags show no placeholder."""

    context_class = _HelpContext

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or (param.name or "").upper()
                pieces.append(name if param.required else f"[{name}]")
            else:
                pieces += param.get_usage_pieces(ctx)
        return pieces


# The help as click writes it (plain text, wrapped to the terminal), not typer's rich panels:
# typer.rich_utils imports rich's markdown, syntax and traceback renderers for boxes around the
# same lines (tools/bench_startup.py, back to back: `dcr --help` 0.146 s with them, 0.083 s
# without). A pipe or a file gets no box-drawing characters to grep through either.
HELP_MARKUP = None
# The help fills a terminal up to this width (click's own limit is 80 columns).
HELP_WIDTH = 120

app = typer.Typer(cls=DcrGroup, add_completion=False, no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                  context_settings={"max_content_width": HELP_WIDTH},
                  help="dcr-log: bit-exact delta logs for refitting model weights.")


def help_text(doc: str | None) -> str:
    """A docstring as help: each paragraph on one line, paragraphs apart by a blank line. The
    renderer wraps to the terminal; typer would keep the docstring's line breaks as they are."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def first_paragraph(text: str) -> str:
    """A command's line in its group's list: the first paragraph of its help, whole (click would
    cut it at the first sentence that fits 45 columns, ending it with "...")."""
    return text.split("\n\n", 1)[0]


def command(group: typer.Typer, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``group.command(name)`` with dcr's help: its docstring as help_text, rendered by DcrCommand."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        text = help_text(fn.__doc__)
        return group.command(name, cls=DcrCommand, help=text, short_help=first_paragraph(text))(fn)

    return register


def _version_callback(value: bool) -> None:
    if value:
        out.print(_entry.version_line(), markup=False)
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                          help="print the version and exit")) -> None:
    """dcr-log: bit-exact delta logs for refitting model weights."""


class _Console:
    """A rich Console made at its first use: the help prints nothing through it, and rich's
    import stays out of ``dcr --help`` (tools/bench_startup.py lists each command's imports).
    (No lock: two threads that print first at once make a console each, which write to the
    same stream alike; a lock could be held by the thread a signal's handler interrupts to
    print.)"""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def get(self) -> Any:
        """The rich Console itself (what rich's own objects are given: they take no stand-in)."""
        console = self._console
        if console is None:
            from rich.console import Console

            # emoji=False: ":name:" in a tensor name or path must print as written (JSON too).
            console = Console(stderr=self._stderr, highlight=False, soft_wrap=True, emoji=False)
            if not console.is_terminal:
                # Without a terminal rich renders tables at 80 columns and cuts cells
                # ("304943…"): a pipe or a CI log gets every number whole instead (a table is
                # only as wide as its cells).
                console.width = 1 << 16
            self._console = console
        return console


out: Any = _Console(stderr=False)
err: Any = _Console(stderr=True)


JSON_HELP = "one JSON object per result line; failures as {\"error\", \"exit\"} on stderr"


def json_option() -> Any:
    return typer.Option(False, "--json", help=JSON_HELP)


def say_result(as_json: bool, row: Mapping[str, Any], prose: str) -> None:
    """A command's result: one JSON object (--json) or its one line of prose, with the same facts."""
    out.print(json.dumps(dict(row)) if as_json else prose, markup=False)


@contextmanager
def progress_bar(label: str, total: int | None, unit: str = "bytes") -> Iterator:
    """A rich progress bar on a terminal (bytes with units, rate and time left; or versions
    done of all); nothing on a pipe. Yields advance(n)."""
    if not err.is_terminal:
        yield lambda n=1: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    if unit == "bytes":
        columns: tuple = (TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          TimeRemainingColumn())
    else:
        columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                   TimeRemainingColumn())
    with Progress(*columns, console=err.get(), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)


def version_progress(log: DeltaLog, label: str, upto: int | None = None):
    total = (log.latest_version() if upto is None else upto) + 1
    return progress_bar(label, total, unit="versions")


# What an interrupted command leaves behind, said in one line: the newest callable registered
# by the running command (see main); none registered: "nothing done".
_LEFT: list = []


def say_left(say) -> None:
    _LEFT.append(say)


def version_left(location, version: int, writer_id: str) -> str:
    """What an interrupted init or append left of VERSION, read from the store: the signal may
    have landed after the commit record was written and before the writer returned."""
    from dcr_log.log.deltalog import DeltaLog

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


def cache_dir_option(cache: str | None):
    if cache is None:
        return None
    return False if cache == "none" else Path(cache)


SIGN_HELP = "sign the version with this ed25519 key file (dcr keygen)"


TRUST_HELP = ("accept only versions signed by a key of this file (public keys, one per line; "
              "repeat for several files)")


def signing_key_option(path: Path | None):
    from dcr_log.signing import SigningKey

    return None if path is None else SigningKey.load(path)


def open_log(log: str, trust: list[Path] | None) -> DeltaLog:
    from dcr_log.log.deltalog import DeltaLog

    if not trust:
        return DeltaLog.open(log)
    from dcr_log.signing import TrustPolicy

    return DeltaLog.open(log, trust=TrustPolicy.load(trust))


def one_line(text: str) -> str:
    """A failure is reported on exactly one stderr line, even when a library's message is not."""
    return " ".join(text.split())


class _Follow:
    """While ``dcr apply --follow`` runs, the first SIGINT or SIGTERM asks it to stop between
    versions instead of interrupting one."""

    def __init__(self) -> None:
        self.active = False
        self.stop = threading.Event()


FOLLOW = _Follow()


class _Signals:
    """SIGINT and SIGTERM raise Interrupted (a KeyboardInterrupt: rollbacks run) while a
    command runs; remembers the first one. Once the run is over (``raising`` False) a signal is
    only remembered, for main to report; under dcr's entry point (dcr_log._entry) one that
    comes when none was taken ends the process there and then, saying what the command left."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raising = True
        self._old: dict = {}
        self._old_hook: Callable[[Any], object] | None = None

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
            # A follow, running or still to start, stops: the Interrupted below can be lost
            # where Python cannot raise it (_unraisable), and a follow would never end.
            FOLLOW.stop.set()
        if first and FOLLOW.active:
            return
        raise Interrupted(signum)

    def _unraisable(self, info: Any) -> None:
        """A signal's Interrupted raised where Python cannot raise (a weakref callback, as an
        import's module lock is dropped) is lost there, and Python would print its traceback.
        The signal is remembered: main says its one line once the command is over (a second
        signal interrupts the command)."""
        if isinstance(info.exc_value, Interrupted) and self.signum is not None:
            return
        assert self._old_hook is not None
        self._old_hook(info)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
            self._old_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if self._old_hook is not None:
            sys.unraisablehook = self._old_hook


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
    return failure_line(128 + signum, f"dcr: interrupted ({signal.Signals(signum).name}): {left}")


def signal_outcome(signum: int) -> tuple[int, str | None]:
    """For dcr's entry point, a signal outside a command's run: the exit code and the line to
    say. Before a command started: nothing done; after it finished: what it left (e.g.
    "version 7 committed"); after a failure or an interrupt, reported already: that code, no
    second line."""
    if _Outcome.code not in (None, 0):
        return _Outcome.code, None
    return 128 + signum, _interrupted_line(signum)


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """A library's warning (a baseline cache that cannot be used) on one stderr line."""
    text = one_line(str(message))
    err.print(json.dumps({"warning": text}) if _Json.wanted else f"dcr: warning: {text}", markup=False)


def main(argv: list[str] | None = None) -> int:
    _LEFT.clear()
    FOLLOW.stop.clear()
    _Outcome.code = None
    _Json.wanted = "--json" in (sys.argv[1:] if argv is None else argv)
    with warnings.catch_warnings(), _Signals() as signals:
        warnings.showwarning = _warning_line
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


class _Json:
    """Whether the command line asked for --json: failures are then said as JSON too."""

    wanted = False


def failure_line(code: int, line: str) -> str:
    line = one_line(line)
    return json.dumps({"error": line, "exit": code}) if _Json.wanted else line


def _failed(code: int, line: str) -> int:
    _Outcome.code = code  # set first: a signal while the line is said adds no second line
    err.print(failure_line(code, line), markup=False)
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
