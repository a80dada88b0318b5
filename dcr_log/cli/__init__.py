"""The ``dcr`` command. Exit codes: 0 ok, 1 other, 2 usage, 3 integrity, 4 lineage, 5 conflict,
6 store (no space, read-only, permission, unreachable), 7 trust (no valid signature by a
trusted key), 130 SIGINT, 143 SIGTERM.

Thin: each command parses its options, calls the library and prints what it did. ``app`` holds
the typer app and what commands share; the commands live by concern in ``write_commands``,
``read_commands``, ``lifecycle_commands``, ``receive_commands`` and ``cache_commands``, and are registered below in
the order ``dcr --help`` lists them.
"""

from __future__ import annotations

from collections.abc import Callable

from dcr_log.cli import cache_commands as _cache
from dcr_log.cli import lifecycle_commands as _lifecycle
from dcr_log.cli import read_commands as _read
from dcr_log.cli import receive_commands as _receive
from dcr_log.cli import write_commands as _write
from dcr_log.cli.app import app, command, entry, err, main, out, signal_outcome

_COMMANDS: list[tuple[str | None, Callable[..., None]]] = [
    (None, _write.keygen), (None, _write.sign), (None, _write.init), (None, _write.append),
    ("log", _read.log_cmd),
    (None, _lifecycle.snapshot), (None, _lifecycle.squash), ("gc", _lifecycle.gc_cmd),
    ("mirror", _lifecycle.mirror_cmd),
    (None, _read.stats), (None, _read.show), (None, _read.verify), (None, _read.replay), (None, _read.demo),
    ("apply", _receive.apply_cmd), ("status", _receive.status_cmd),
]
for _name, _fn in _COMMANDS:
    command(app, _name)(_fn)
app.add_typer(_cache.cache_app, name="cache")

__all__ = ["app", "entry", "err", "main", "out", "signal_outcome"]
