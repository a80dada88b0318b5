"""``dcr cache ls|prune|rm``: the writers' baseline caches on this machine (dcr_log.write.cache)."""

from __future__ import annotations

import typer

from dcr_log.cli.app import HELP_MARKUP, DcrGroup, command, json_option, out, say_result
from dcr_log.errors import StoreError, UsageError

CACHE_HELP = "The writers' baseline caches on this machine: list, prune, remove."
cache_app = typer.Typer(cls=DcrGroup, no_args_is_help=True, rich_markup_mode=HELP_MARKUP, help=CACHE_HELP,
                        short_help=CACHE_HELP)

ROOT_HELP = "the cache directory (default $DCR_CACHE_DIR or ~/.cache/dcr-log)"


def _root(cache: str | None):
    from dcr_log.write.cache import cache_root

    return cache_root(cache)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@command(cache_app, "ls")
def ls_cmd(cache: str | None = typer.Option(None, "--cache", metavar="DIR", help=ROOT_HELP),
           as_json: bool = json_option()) -> None:
    """Every log's cache: its log (location and id), size and when it was last used, oldest
    first; then the total and the cap."""
    from dcr_log.write.cache import cached_logs, cap_bytes

    root = _root(cache)
    logs = cached_logs(root)
    total, cap = sum(c.bytes for c in logs), cap_bytes(logs)
    if as_json:
        for c in logs:
            say_result(True, c.to_json(), "")
        say_result(True, {"root": str(root), "caches": len(logs), "bytes": total, "cap_bytes": cap}, "")
        return
    from rich.table import Table

    table = Table("log", "log id", "bytes", "last used", "directory")
    for c in logs:
        row = c.to_json()
        table.add_row(c.url or "(unknown: prune removes it)", c.log_id or "-", str(c.bytes), row["last_used"],
                      c.dir.name)
    out.print(table)
    out.print(f"{len(logs)} caches, {total} bytes ({_gib(total)}) under {root}; cap {cap} bytes ({_gib(cap)})",
              markup=False)


def _caches(n: int) -> str:
    return f"{n} cache" if n == 1 else f"{n} caches"


@command(cache_app, "prune")
def prune_cmd(cache: str | None = typer.Option(None, "--cache", metavar="DIR", help=ROOT_HELP),
              everything: bool = typer.Option(False, "--all", help="remove every cache, not only those of logs gone"),
              as_json: bool = json_option()) -> None:
    """Remove the caches of logs that are gone (a local log deleted or replaced; a cache of an
    older layout), or with --all every cache. A cache only saves a replay: nothing is lost.
    One that a writer's append is using is left."""
    from dcr_log.write.cache import prune

    root = _root(cache)
    _report_removal(as_json, {"root": str(root)}, *prune(root, everything), f"under {root}")


def _report_removal(as_json: bool, report: dict, removed: list, held: list, failed: list, where: str) -> None:
    """One line (or JSON object) for caches removed, left in use and failed; exit 6 (StoreError)
    where any failed: what was removed stays removed."""
    freed = sum(c.bytes for c in removed)
    left = f"; {len(held)} in use by a writer's append, left" if held else ""
    report = {**report, "removed": [str(c.dir) for c in removed], "bytes": freed,
              "in_use": [str(c.dir) for c in held],
              "failed": [{"directory": str(c.dir), "error": str(e)} for c, e in failed]}
    say_result(as_json, report, f"removed {_caches(len(removed))} ({freed} bytes) {where}{left}")
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise StoreError(f"{_caches(len(failed))} could not be removed: {failed[0][1]}{more}")


@command(cache_app, "rm")
def rm_cmd(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           cache: str | None = typer.Option(None, "--cache", metavar="DIR", help=ROOT_HELP),
           as_json: bool = json_option()) -> None:
    """Remove LOG's caches (the log itself is not touched), but not while a writer's append
    uses one."""
    from dcr_log.store import Store
    from dcr_log.write.cache import caches_of, remove_caches

    root = _root(cache)
    url = Store.url_of(log)
    found = list(caches_of(root, url))
    if not found:
        raise UsageError(f"no cache of {url} under {root}")
    removed, held, failed = remove_caches(found)
    if held and not removed and not failed:
        raise UsageError(f"the cache of {url} under {root} is in use by a writer's append: not removed")
    _report_removal(as_json, {"log": url}, removed, held, failed, f"of {url}")
