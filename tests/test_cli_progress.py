"""Progress on long work: on a terminal, one transient rich bar per command (bytes with units,
rate and time left; or versions done of all) that reaches its total; on a pipe, nothing on
stderr at all."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import numpy as np
import pytest

from dcr_log.checkpoint import save_safetensors
from helpers import change_words, cli_env, make_state

SPEC = {"w": ("BF16", (256, 512)), "b": ("F32", (300,))}


def run_on(terminal: bool, *args) -> tuple[int, str, str]:
    """``python -m dcr_log ARGS`` with stderr on a pseudo-terminal or on a pipe."""
    env = cli_env() | {"TERM": "xterm", "COLUMNS": "160"}
    if not terminal:
        proc = subprocess.run([sys.executable, "-m", "dcr_log", *map(str, args)], capture_output=True,
                              text=True, env=env, timeout=120)
        return proc.returncode, proc.stdout, proc.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dcr_log", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 1 << 16)
        except OSError:  # the follower side closed: the command ended
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    out = proc.stdout.read().decode()
    proc.stdout.close()
    return proc.wait(timeout=120), out, b"".join(chunks).decode(errors="replace")


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    rng = np.random.default_rng(3)
    state = make_state(rng, SPEC)
    save_safetensors(state, root / "s0.safetensors")
    save_safetensors({n: change_words(rng, b, 0.05) for n, b in state.items()}, root / "s1.safetensors")
    return root


STEPS = [
    ("init", ("init", "{log}", "--from", "{root}/s0.safetensors", "--cache", "none"), r"init .*/\d+\.\d+ kB"),
    ("append", ("append", "{log}", "--from", "{root}/s1.safetensors", "--cache", "none"), r"append .*/\d+\.\d+ kB"),
    ("replay", ("replay", "{log}", "--out", "{root}/out-{t}.safetensors"), r"replay .*2/2 versions"),
    ("verify", ("verify", "{log}", "--deep"), r"verify .*2/2 versions"),
    ("snapshot", ("snapshot", "{log}"), r"snapshot .*/\d+\.\d+ kB"),
    ("squash", ("squash", "{log}", "0", "1"), r"squash .*/\d+\.\d+ kB"),
    ("mirror", ("mirror", "{log}", "{root}/mirror-{t}"), r"mirror .*2/2 versions"),
    ("apply --to 0", ("apply", "{log}", "--receiver", "{root}/rx-{t}", "--to", "0"), None),  # written out whole
    ("apply", ("apply", "{log}", "--receiver", "{root}/rx-{t}"), r"apply .*1/1 versions"),
]


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_long_commands_show_progress_only_on_a_terminal(log, terminal):
    t = "tty" if terminal else "pipe"
    root = log
    target = root / f"log-{t}"
    for what, args, bar in STEPS:
        rc, out, err = run_on(terminal, *(a.format(log=target, root=root, t=t) for a in args))
        assert rc == 0, (what, out, err)
        if terminal and bar is not None:
            # The bar reached its total (the last frame names done == total), in units.
            assert re.search(bar, plain(err)), (what, plain(err))
            frames = re.findall(r"(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) (?:kB|versions)", plain(err))
            assert frames and frames[-1][0] == frames[-1][1], (what, frames)
        elif not terminal:
            assert err == "", (what, err)
