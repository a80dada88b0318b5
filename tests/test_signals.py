"""SIGINT and SIGTERM at any instant of a real ``dcr`` process (python -m dcr_log): during the
imports, before a command started, while it works, after its work landed and during
interpreter shutdown. Always exit 130 or 143 (or 0 when the command finished before the
signal), exactly one line on stderr, never a traceback, and a log and receiver left
consistent."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dcr_log.checkpoint import save_safetensors
from dcr_log.cli import main
from dcr_log.errors import DcrError
from dcr_log.log import DeltaLog
from dcr_log.receiver import JOURNAL_DIR, Journal
from dcr_log.write import LogWriter
from helpers import assert_file_holds, change_words, cli_env, make_state

SPEC = {"w": ("BF16", (512, 256)), "b": ("F32", (256,))}
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A log at version 2, the checkpoint of a version 3, and a receiver at version 0."""
    root = tmp_path_factory.mktemp("signals")
    rng = np.random.default_rng(7)
    states = [make_state(rng, SPEC)]
    for _ in range(3):
        states.append({n: change_words(rng, b, 0.05) for n, b in states[-1].items()})
    writer = LogWriter.create(root / "log", states[0], cache_dir=False)
    for st in states[1:3]:
        writer.append(st)
    save_safetensors(states[3], root / "ck3.safetensors")
    assert main(["apply", str(root / "log"), "--receiver", str(root / "rx"), "--to", "0"]) == 0
    return root, states


@pytest.fixture
def case(template, tmp_path):
    """A copy of the template to spoil."""
    root, states = template
    for name in ("log", "rx"):
        shutil.copytree(root / name, tmp_path / name)
    shutil.copy(root / "ck3.safetensors", tmp_path / "ck3.safetensors")
    return tmp_path, states


def _env(tmp_path: Path) -> dict[str, str]:
    env = cli_env()
    env["DCR_CACHE_DIR"] = str(tmp_path / "cache")  # never the user's cache
    return env


def handlers_installed(pid: int) -> bool:
    """Whether the process catches SIGTERM (Linux: /proc/PID/status), i.e. dcr's entry point
    installed its handlers. Before that the interpreter is starting (tens of milliseconds, more
    on a loaded machine), and no code of dcr has run that could handle a signal."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # no /proc (or the process is gone): count from the start
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def signalled(tmp_path: Path, args, delay: float, sig: int, until=None) -> tuple[int, str, str, bool]:
    """Start ``python -m dcr_log ARGS``, send SIG DELAY seconds after dcr installed its
    handlers (and, given UNTIL, once UNTIL() holds: a state to reach, not a time, so that load
    cannot change what is tested) unless it exited by then; returns (exit code, stdout, stderr,
    whether the signal was sent). A delay of 0.1 s lands in the imports of numpy, pyarrow,
    typer and rich."""
    proc = subprocess.Popen([sys.executable, "-m", "dcr_log", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not handlers_installed(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        while until is not None and not until() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        sent = proc.poll() is None
        if sent:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, sent


def interrupted_line(rc: int, err: str, sig: int) -> str:
    """The one line an interrupted process says: what it left."""
    assert "Traceback" not in err, err
    assert rc == CODES[sig], (rc, err)
    prefix = f"dcr: interrupted ({signal.Signals(sig).name}): "
    assert err.startswith(prefix) and err.endswith("\n") and err.count("\n") == 1, repr(err)
    return err[len(prefix):-1]


def status(receiver: Path, capsys) -> dict:
    capsys.readouterr()
    rc = main(["status", "--receiver", str(receiver), "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def assert_log_verifies(root: Path, latest: int) -> None:
    log = DeltaLog.open(root)
    assert log.latest_version() == latest
    assert log.verify().versions == latest + 1


SIGS = [pytest.param(signal.SIGINT, id="INT"), pytest.param(signal.SIGTERM, id="TERM")]


@pytest.mark.parametrize("delay", [0.1, 0.3, 1.0])
@pytest.mark.parametrize("sig", SIGS)
def test_append(case, sig, delay):
    tmp, states = case
    rc, out, err, sent = signalled(tmp, ["append", tmp / "log", "--from", tmp / "ck3.safetensors"], delay, sig)
    if rc == 0:  # finished before the signal (or the signal landed after nothing was left to say)
        assert err == "" and out.startswith("version 3: "), (out, err)
        assert_log_verifies(tmp / "log", 3)
        return
    assert sent
    left = interrupted_line(rc, err, sig)
    assert left in ("nothing done", "version 3 not committed", "version 3 committed"), left
    assert_log_verifies(tmp / "log", 3 if left == "version 3 committed" else 2)


def _receiver_consistent(tmp: Path, states, left: str, capsys, latest: int = 2) -> None:
    """The receiver is where the line says; `dcr apply` again brings it to the latest version."""
    rx = tmp / "rx"
    row = status(rx, capsys)
    if left.startswith("receiver at version "):
        v = int(left.rsplit(" ", 1)[1])
        assert row["version"] == v and row["inflight"] is None
        assert_file_holds(rx / "model.safetensors", states[v])
    elif left == "nothing done":
        assert row["version"] in (0, latest) and row["inflight"] is None  # 0: as the template left it
        assert_file_holds(rx / "model.safetensors", states[row["version"]])
    else:
        assert left.endswith(": run dcr apply again"), left
    assert main(["apply", str(tmp / "log"), "--receiver", str(rx)]) == 0
    assert status(rx, capsys)["version"] == latest
    assert_file_holds(rx / "model.safetensors", states[latest])


@pytest.mark.parametrize("delay", [0.1, 0.3, 1.0])
@pytest.mark.parametrize("sig", SIGS)
def test_apply(case, sig, delay, capsys):
    tmp, states = case
    rc, out, err, sent = signalled(tmp, ["apply", tmp / "log", "--receiver", tmp / "rx"], delay, sig)
    if rc == 0:  # finished before the signal
        assert err == "" and "applied version 2" in out, (out, err)
        _receiver_consistent(tmp, states, "receiver at version 2", capsys)
        return
    assert sent
    left = interrupted_line(rc, err, sig)
    _receiver_consistent(tmp, states, left, capsys)


@pytest.mark.parametrize("delay", [0.1, 0.3, 1.0, 3.0])
@pytest.mark.parametrize("sig", SIGS)
def test_apply_follow(case, sig, delay, capsys):
    tmp, states = case
    caught_up = None
    if delay >= 3.0:  # signalled once it caught up and follows
        def caught_up() -> bool:
            try:
                return Journal.peek(tmp / "rx" / JOURNAL_DIR).version == 2
            except DcrError:
                return False
    rc, out, err, sent = signalled(tmp, ["apply", tmp / "log", "--receiver", tmp / "rx", "--follow",
                                         "--interval", "0.05"], delay, sig, until=caught_up)
    assert sent  # --follow runs until a signal stops it
    left = interrupted_line(rc, err, sig)
    if caught_up is not None:  # caught up and following: stopped between versions
        assert left == "receiver at version 2", (left, out)
    _receiver_consistent(tmp, states, left, capsys)


# -- signals at chosen instants: a patched process, run through the entry point ------------------

def run_entry(tmp: Path, setup: str, args) -> tuple[int, str, str]:
    """Run dcr's entry point (dcr_log._entry.entry) in a subprocess after SETUP, python code
    that may patch the library to send the process a signal at a chosen instant."""
    code = "import os, signal, sys\n" + textwrap.dedent(setup) + textwrap.dedent(f"""
        sys.argv = ["dcr", *{[str(a) for a in args]!r}]
        from dcr_log._entry import entry
        entry()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env(tmp))
    return proc.returncode, proc.stdout, proc.stderr


KILL = "lambda: os.kill(os.getpid(), signal.{sig})"


@pytest.mark.parametrize("sig", SIGS)
def test_signal_after_the_commit_record_landed_says_committed(case, sig):
    """Between the commit record's write and the writer's return, append has not recorded
    the commit itself: the store says it landed."""
    tmp, _ = case
    setup = f"""
        import time
        from dcr_log.log import DeltaLog
        real = DeltaLog.write_commit
        def write_commit(self, record):
            real(self, record)
            os.kill(os.getpid(), signal.{signal.Signals(sig).name})
            time.sleep(5)
            raise AssertionError("signal not delivered")
        DeltaLog.write_commit = write_commit
    """
    rc, out, err = run_entry(tmp, setup, ["append", tmp / "log", "--from", tmp / "ck3.safetensors"])
    assert interrupted_line(rc, err, sig) == "version 3 committed"
    assert out == ""
    assert_log_verifies(tmp / "log", 3)


@pytest.mark.parametrize("sig", SIGS)
def test_signal_while_append_prints_its_result_says_committed(case, sig):
    tmp, _ = case
    name = signal.Signals(sig).name
    setup = f"""
        import time
        from dcr_log import cli
        real = cli.out.print
        def say(*args, **kwargs):
            os.kill(os.getpid(), signal.{name})
            time.sleep(5)
            raise AssertionError("signal not delivered")
        cli.out.print = say
    """
    rc, out, err = run_entry(tmp, setup, ["append", tmp / "log", "--from", tmp / "ck3.safetensors"])
    assert interrupted_line(rc, err, sig) == "version 3 committed"
    assert_log_verifies(tmp / "log", 3)


@pytest.mark.parametrize("sig", SIGS)
def test_signal_during_interpreter_shutdown_says_committed(case, sig):
    """After the command returned and said its result: the handler is still there, at exit."""
    tmp, _ = case
    setup = f"""
        import atexit, time
        def late():
            os.kill(os.getpid(), signal.{signal.Signals(sig).name})
            time.sleep(5)
            print("signal not delivered", file=sys.stderr)
        atexit.register(late)
    """
    rc, out, err = run_entry(tmp, setup, ["append", tmp / "log", "--from", tmp / "ck3.safetensors"])
    assert interrupted_line(rc, err, sig) == "version 3 committed"
    assert out.startswith("version 3: ")  # said before the signal, and not lost
    assert_log_verifies(tmp / "log", 3)


def test_signal_after_a_failure_adds_no_line(case):
    """A command that failed said so in its line; a signal at exit keeps that line and code."""
    tmp, _ = case
    setup = """
        import atexit, time
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)))
    """
    rc, out, err = run_entry(tmp, setup, ["append", tmp / "log", "--from", tmp / "missing.safetensors"])
    assert rc != 0 and rc not in CODES.values()
    assert err.startswith("dcr: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("sig", SIGS)
def test_a_signal_lost_before_the_follow_starts_still_stops_it(case, sig, capsys):
    """A signal's Interrupted raised where Python cannot raise it (an import's weakref
    callback) is lost; a follow that starts after it stops at once, as if signalled while
    following, instead of running until a second signal."""
    tmp, states = case
    setup = f"""
        import time
        import dcr_log.receiver
        real = dcr_log.receiver.open_directory
        def opened(*args, **kwargs):
            try:
                os.kill(os.getpid(), signal.{signal.Signals(sig).name})
                time.sleep(5)
                raise AssertionError("signal not delivered")
            except KeyboardInterrupt:
                pass  # lost
            return real(*args, **kwargs)
        dcr_log.receiver.open_directory = opened
    """
    rc, out, err = run_entry(tmp, setup, ["apply", tmp / "log", "--receiver", tmp / "rx", "--follow",
                                          "--interval", "0.05"])
    _receiver_consistent(tmp, states, interrupted_line(rc, err, sig), capsys)


HEAVY = ("numpy", "pyarrow", "typer", "rich", "dcr_log.log", "dcr_log.cli")


@pytest.mark.parametrize("args,imported", [
    (["--help"], {"typer", "dcr_log.cli"}),  # the help needs no library, nor rich (plain text)
    (["log", "{tmp}/missing"], set(HEAVY) - {"pyarrow"}),  # opening a log: all but pyarrow (no segment read)
])
def test_handlers_come_before_the_heavy_imports(tmp_path, args, imported):
    """The first import of numpy, pyarrow, typer or rich finds dcr's handlers installed; and
    ``import dcr_log`` alone imports none of them."""
    argv = [a.format(tmp=tmp_path) for a in args]
    code = textwrap.dedent(f"""
        import json, signal, sys
        import dcr_log
        heavy = {HEAVY!r}
        light = [m for m in heavy if m in sys.modules]
        import dcr_log._entry as e
        light += [m for m in heavy if m in sys.modules]
        seen = {{}}

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name in heavy and name not in seen:
                    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
                    seen[name] = ["entry" if h is e.exit_on_signal else
                                  "none" if h in (signal.SIG_DFL, signal.default_int_handler) else "command"
                                  for h in handlers]
                return None

        sys.meta_path.insert(0, Watch())
        sys.argv = ["dcr", *{argv!r}]
        import atexit
        atexit.register(lambda: print(json.dumps({{"light": light, "seen": seen}})))  # entry exits
        e.entry()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env(tmp_path))
    assert (proc.returncode == 0) == (args == ["--help"]), proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["light"] == []
    assert set(got["seen"]) == imported
    # The command's own handlers are installed while it runs (dcr_log.cli's, not the entry's):
    # the imports before the command (typer, dcr_log.cli) find the entry's, the later ones
    # (rich when a line is printed, the library) the command's; none finds no handler.
    assert all(got["seen"][m] == ["entry", "entry"] for m in ("typer", "dcr_log.cli")), got["seen"]
    assert all("none" not in h for h in got["seen"].values()), got["seen"]


@pytest.mark.parametrize("sig", SIGS)
def test_signal_during_the_imports_says_nothing_done(tmp_path, sig):
    """Held in the middle of the heavy imports (a patched typer import): one line, 130 or 143."""
    name = signal.Signals(sig).name
    setup = f"""
        import time
        class Slow:
            def find_spec(self, name, path=None, target=None):
                if name == "typer":  # imported before the command runs
                    os.kill(os.getpid(), signal.{name})
                    time.sleep(5)
                    raise AssertionError("signal not delivered")
        sys.meta_path.insert(0, Slow())
    """
    rc, out, err = run_entry(tmp_path, setup, ["--help"])
    assert interrupted_line(rc, err, sig) == "nothing done"
    assert out == ""


@pytest.mark.parametrize("sig", SIGS)
def test_a_signal_in_a_weakref_callback_is_remembered_without_a_traceback(sig):
    """A signal can land while Python runs a weakref callback (importlib drops each module's
    lock so, as an import ends): the Interrupted its handler raises there cannot propagate,
    and Python would print its traceback. The command's signal handling remembers the signal
    (main then says its one line) and prints nothing."""
    code = textwrap.dedent(f"""
        import gc, signal, weakref
        from dcr_log.cli.app import _Signals

        class Held:
            pass

        with _Signals() as signals:
            held = Held()
            ref = weakref.ref(held, lambda _: signal.raise_signal({int(sig)}))
            del held
            gc.collect()
            print(signals.signum)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=cli_env())
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 0 and proc.stdout.strip() == str(int(sig)), (proc.returncode, proc.stdout)
