"""The ``dcr`` command's entry point (``dcr = "dcr_log._entry:entry"``, ``python -m dcr_log``).

It imports only the standard library, and so does ``dcr_log/__init__.py``: SIGINT and SIGTERM
are handled from before the heavy imports (typer, rich, numpy, pyarrow: up to seconds) to the
process's exit. A signal at any instant ends dcr with 130 (SIGINT) or 143 (SIGTERM) and one
line on stderr: never a traceback, never death by the default disposition.

While a command runs, dcr_log.cli's handlers are installed instead (they interrupt the command,
which rolls back or journals what it was doing); before and after, ``exit_on_signal`` is: it
says what the process left (``nothing done`` before a command started; after one finished, what
the command recorded, e.g. ``version 7 committed``) and exits at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable

from dcr_log import __version__

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class _State:
    active = False  # entry() is running this process: dcr_log.cli hands signals back here
    # dcr_log.cli's, once imported: signum -> (exit code, line or None)
    hook: Callable[[int], tuple[int, str | None]] | None = None
    busy = False    # a signal's outcome is being worked out
    json = False    # the command line asked for --json: the line is a JSON object


def exit_on_signal(signum, frame=None, _state=_State, _names=_NAMES, _sys=sys, _write=os.write,
                   _exit=os._exit, _dumps=json.dumps) -> None:
    """The handler outside a command's run: one line on stderr, then exit 128 + signum (or the
    finished command's own code when it has reported a failure or an interrupt already).

    Everything it uses is bound as a default argument: during interpreter shutdown module
    globals may already be gone."""
    name = _names.get(signum, f"signal {signum}")
    code, line = 128 + signum, f"dcr: interrupted ({name}): nothing done"
    if _state.busy:  # a second signal while the first one's line is worked out: exit now
        line = f"dcr: interrupted ({name}): interrupted"
    else:
        _state.busy = True
        hook = _state.hook
        if hook is not None:
            try:
                code, line = hook(signum)
            except BaseException:
                line = f"dcr: interrupted ({name}): interrupted"
    try:
        _sys.stdout.flush()  # what the command printed (a reentrant flush may fail: then lost)
    except BaseException:
        pass
    if line:
        try:
            if _state.json and not line.startswith("{"):  # the hook's line is JSON already
                line = _dumps({"error": line, "exit": code})
            _write(2, (line + "\n").encode("utf-8", "replace"))
        except BaseException:
            pass
    _exit(code)


def version_line() -> str:
    return f"dcr {__version__}"


def entry() -> None:
    """Run the ``dcr`` command: handlers first, then the imports, the command, and the exit."""
    _State.active = True
    _State.json = "--json" in sys.argv[1:]
    for sig in SIGNALS:
        signal.signal(sig, exit_on_signal)
    if sys.argv[1:] == ["--version"]:  # what scripts and health checks ask: no command to import for it
        print(version_line())
        finish(0)
    # dcr calls no BLAS, and numpy's OpenBLAS starts a thread per core at import that spins
    # for about 0.1 s of CPU waiting for work: a core taken from the start of every command
    # (tools/bench_startup.py). One thread starts none; a caller's own setting is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from dcr_log import cli  # the heavy imports; a signal meanwhile exits in exit_on_signal

    _State.hook = cli.signal_outcome
    try:
        code = cli.main()
    except KeyboardInterrupt as exc:  # a signal that slipped between main's guards
        exit_on_signal(getattr(exc, "signum", signal.SIGINT))
    # From here until the process is gone a signal lands in exit_on_signal (main restored it).
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        # Interrupted: everything that matters was undone or journaled on the main thread.
        # Exit now: a worker thread whose start the signal interrupted was never registered
        # with its pool, and the interpreter would wait for it forever (measured: dcr init
        # hung after SIGTERM). Segments a worker is still writing are orphans (harmless).
        _flush()
        os._exit(code)
    finish(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass


def finish(code: int) -> None:
    """Exit with CODE as the interpreter would (non-daemon threads joined, atexit functions
    run, the standard streams flushed) but without its finalization: that resets SIGINT and
    SIGTERM to their default dispositions before it tears the modules down (measured: a SIGTERM
    then killed dcr with -15, silently, after its version had committed). Nothing is lost by
    skipping it: what a command wrote is durable when it returns (dcr is crash-safe)."""
    import atexit
    import threading

    _flush()
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit runs first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)
