"""The writers' baseline cache on local disk: where each log's baselines live, how big the cache
may grow, and what ``dcr cache`` lists and removes.

Layout: ``<root>/<log id>-<16 hex of the log's location>/`` per log (a copied log, with the same
id at another location, gets its own), holding ``log.json`` (the location and id it was made
from; its modification time is when the cache was last used) and one slot per rank and piece
set (dcr_log.write.baseline). The root is ``cache_dir``, else ``$DCR_CACHE_DIR``, else
``~/.cache/dcr-log``.

Bounded: after a writer writes a new baseline file, the least recently used caches of other
logs are removed until the root holds at most the cap: ``$DCR_CACHE_MAX_BYTES``, else twice the
largest cache (each writer keeps one copy of its model, so the default holds the model in use
and one other). A cache never decides correctness (every word is checked against the log's
digests before use), so removing one costs only a replay. A cache a writer holds (an append
in progress reads and writes its files) is never removed: eviction, ``prune`` and ``rm`` pass it
by.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from dcr_log.errors import CacheWarning, StoreError, UsageError, os_error

LOG_FILE = "log.json"
MAX_BYTES_ENV = "DCR_CACHE_MAX_BYTES"


def default_cache_root() -> Path:
    env = os.environ.get("DCR_CACHE_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "dcr-log"


def cache_root(cache_dir: Any = None) -> Path:
    return default_cache_root() if cache_dir is None else Path(cache_dir)


def log_dir_name(url: str, log_id: str) -> str:
    return f"{log_id}-{xxhash.xxh3_64_hexdigest(url.encode())}"


@dataclass(frozen=True)
class CachedLog:
    """One log's cache: where it is, what it was made from, how big, when last used."""

    dir: Path
    url: str | None  # None: a directory of an older layout, or one whose log.json is unreadable
    log_id: str | None
    local: str | None  # a local log's directory
    bytes: int
    used: float  # seconds since the epoch

    def to_json(self) -> dict[str, Any]:
        return {"dir": str(self.dir), "url": self.url, "log_id": self.log_id, "bytes": self.bytes,
                "last_used": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.used))}


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def cached_logs(root: Path) -> list[CachedLog]:
    """Every log's cache under ``root``, least recently used first."""
    out: list[CachedLog] = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        if not d.is_dir() or d.is_symlink():
            continue
        url = log_id = local = None
        used = d.stat().st_mtime
        try:
            meta = json.loads((d / LOG_FILE).read_text())
            url, log_id = str(meta["url"]), str(meta["log_id"])
            local = None if meta.get("local") is None else str(meta["local"])
            used = (d / LOG_FILE).stat().st_mtime
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        out.append(CachedLog(d, url, log_id, local, _size(d), used))
    return sorted(out, key=lambda c: c.used)


def mark_used(log_dir: Path, url: str, log_id: str, local: Path | None) -> None:
    """Create the log's directory and ``log.json``, or touch it: it is in use now."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / LOG_FILE
    if path.exists():
        os.utime(path)
        return
    tmp = path.with_name(f".{LOG_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "log_id": log_id, "local": None if local is None else str(local)},
                              sort_keys=True))
    os.replace(tmp, path)


def cap_bytes(logs: list[CachedLog]) -> int:
    text = os.environ.get(MAX_BYTES_ENV)
    if text:
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"{MAX_BYTES_ENV}={text!r}: a number of bytes") from None
        if value < 0:
            raise UsageError(f"{MAX_BYTES_ENV} must not be negative")
        return value
    return 2 * max((c.bytes for c in logs), default=0)


def remove_unheld(log_dir: Path) -> bool:
    """Remove a log's cache unless a writer holds it (the flock on one of its ranks'
    ``r<rank>.lock``, BaselineCache.hold): True when it is gone, False when a writer holds it.
    Every rank's lock is taken while the directory is renamed aside, so a writer that asks for
    its hold meanwhile goes without the cache, and one that comes after makes a new directory;
    the renamed one (a dot name, which ``prune`` removes if this is interrupted) is removed
    after. Raises StoreError when it cannot be removed for another reason (a lock file that
    cannot be opened or locked, a directory that cannot be renamed), so that such a failure
    is not reported as a writer's hold."""
    locks = []
    try:
        for path in sorted(log_dir.glob("r*.lock")):
            try:
                lock = open(path, "ab")
            except OSError as e:
                raise os_error(e, f"cache {log_dir}: opening its lock {path.name}") from None
            locks.append(lock)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # held: an append is using it
            except OSError as e:
                raise os_error(e, f"cache {log_dir}: locking {path.name}") from None
        aside = log_dir.with_name(f".removed-{uuid.uuid4().hex}")
        try:
            os.rename(log_dir, aside)
        except FileNotFoundError:
            return True  # removed meanwhile (another prune)
        except OSError as e:
            raise os_error(e, f"cache {log_dir}: moving it aside to remove it") from None
    finally:
        for lock in locks:
            lock.close()
    shutil.rmtree(aside, ignore_errors=True)
    return True


def evict(root: Path, keep: Path) -> list[CachedLog]:
    """Remove the least recently used caches (never ``keep``, the one in use, nor one another
    writer holds) until the root holds at most the cap; returns what was removed."""
    logs = cached_logs(root)
    cap = cap_bytes(logs)
    total = sum(c.bytes for c in logs)
    removed: list[CachedLog] = []
    for c in logs:
        if total <= cap:
            break
        if c.dir == keep:
            continue
        try:
            if not remove_unheld(c.dir):
                continue
        except StoreError as e:  # eviction only keeps the cap: not the evicting write's error
            warnings.warn(CacheWarning(f"{e}; left in place"), stacklevel=2)
            continue
        total -= c.bytes
        removed.append(c)
    return removed


def _log_is_gone(c: CachedLog) -> bool:
    """Whether a cache's log no longer exists where it was: only local logs can be told (no
    ``dcr.json`` there, or another log's); a directory without ``log.json`` counts as gone."""
    if c.url is None:
        return True
    if c.local is None:
        return False
    from dcr_log.format.commit import LogIdentity
    from dcr_log.format.keys import IDENTITY_KEY

    path = Path(c.local) / IDENTITY_KEY
    try:
        return LogIdentity.from_bytes(path.read_bytes()).log_id != c.log_id
    except FileNotFoundError:
        return True
    except Exception:  # unreadable or damaged: not this cache's to judge
        return False


def prune(root: Path, everything: bool = False
          ) -> tuple[list[CachedLog], list[CachedLog], list[tuple[CachedLog, StoreError]]]:
    """Remove the caches of logs that are gone (or every cache) but those a writer holds:
    returns what was removed, what was left because a writer holds it, and what could not be
    removed, with why."""
    return remove_caches([c for c in cached_logs(root) if everything or _log_is_gone(c)])


def remove_caches(caches: list[CachedLog]
                  ) -> tuple[list[CachedLog], list[CachedLog], list[tuple[CachedLog, StoreError]]]:
    """Remove each cache a writer does not hold (remove_unheld), going on after one that cannot
    be: what was removed, what a writer holds, and what could not be removed, with why."""
    removed: list[CachedLog] = []
    held: list[CachedLog] = []
    failed: list[tuple[CachedLog, StoreError]] = []
    for c in caches:
        try:
            (removed if remove_unheld(c.dir) else held).append(c)
        except StoreError as e:
            failed.append((c, e))
    return removed, held, failed


def caches_of(root: Path, url: str) -> Iterator[CachedLog]:
    return (c for c in cached_logs(root) if c.url == url)
