"""A version's files in a checkpoint directory (feature ``files``; spec/RECEIVER.md section 9).

A receiver directory holds the files of its version next to the weights: after an apply (or a
materialization, or a bind) of version u, every file u lists is in the directory with u's
bytes, and every file the log had written there before and u no longer lists is gone. Files
the log never listed are never touched. The journal keeps the names the log wrote (``files``).

Two steps, so that bad input is refused before any write: ``plan_files`` (no writes) compares
the directory with the version's list, fetches every file to write and checks its size and
SHA-256; ``write_files`` then writes each (a temporary file, fsync, rename over the old one,
fsync of the directory) and removes the dropped ones. Both are idempotent: a run killed between
two files is finished by running them again.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dcr_log.errors import UsageError, os_error
from dcr_log.format import CommitRecord, FileEntry
from dcr_log.log.deltalog import DeltaLog, Step
from dcr_log.receiver.fs import check_regular, fsync_dir, write_file_atomic

# The bytes of a version's files kept in memory between the plan and the writes, beyond
# which they are fetched (and checked) again when written.
FILE_CACHE_BYTES = 1 << 30
# Temporary files of file writes: one pattern, whatever the name (a name may take all of a
# directory entry's 255 bytes), so that a crash's leftovers are found and removed.
TMP_PREFIX = ".dcr-file-"
TMP_SUFFIX = ".tmp"

Hook = Callable[..., None]


@dataclass
class FilePlan:
    """What making a directory hold a version's files takes."""

    version: int
    entries: tuple[FileEntry, ...]                  # the version's files
    writes: list[tuple[FileEntry, bytes | None]] = field(default_factory=list)  # None: fetch again
    removes: list[str] = field(default_factory=list)  # files the log wrote that the version drops

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def nbytes(self) -> int:
        """Bytes the writes add to the directory (each file is whole next to the old one)."""
        return sum(e.size for e, _ in self.writes)


def file_sha256(directory: Path, name: str, size: int | None = None) -> str | None:
    """SHA-256 of ``directory/name`` (None when there is no such file, "" when it has another
    size than ``size``). A symbolic link or anything but a regular file is refused
    (UsageError): a receiver never writes through a link."""
    path = directory / name
    if not check_regular(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise os_error(exc, f"cannot read {path}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is not a regular file")
        if size is not None and st.st_size != size:
            return ""
        try:
            return hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            raise os_error(exc, f"cannot read {path}") from None


def plan_files(log: DeltaLog, commit: CommitRecord | Step, directory: Path, owned: Iterable[str] = (),
               reserved: Iterable[str] = ()) -> FilePlan:
    """Before any write: the files of ``commit`` that ``directory`` lacks or holds with other
    bytes, fetched and checked (size, then SHA-256: IntegrityError), and the files of
    ``owned`` (the names the log wrote there) that the version no longer lists. ``reserved``
    are names the directory keeps its weights under (a file of the version there: UsageError)."""
    entries = tuple(commit.files or ())
    plan = FilePlan(commit.version, entries)
    reserved = set(reserved)
    for e in entries:
        if e.name in reserved:
            raise UsageError(f"version {commit.version} lists the file {e.name!r}, which the "
                             f"receiver {directory} holds weights in")
    kept = 0
    for e in entries:
        if file_sha256(directory, e.name, e.size) == e.sha256:
            continue
        data: bytes | None = log.read_file(e)
        if kept + e.size <= FILE_CACHE_BYTES:
            kept += e.size
        else:
            data = None  # checked now, fetched again when written
        plan.writes.append((e, data))
    listed = set(plan.names)
    plan.removes = [n for n in sorted(set(owned) - listed) if check_regular(directory / n)]
    return plan


def remove_stale_temporaries(directory: Path) -> None:
    """Temporary files of file writes a crash interrupted."""
    for stale in directory.glob(f"{TMP_PREFIX}*{TMP_SUFFIX}"):
        if stale.is_file() and not stale.is_symlink():
            stale.unlink(missing_ok=True)


def write_files(plan: FilePlan, log: DeltaLog, directory: Path, hook: Hook | None = None) -> None:
    """Carry out a plan: each file written atomically, then the dropped files removed.
    ``hook(point, **info)`` is called at ``file_tmp`` (a file's bytes are in its temporary
    file, not yet renamed), ``file`` (a file is in place) and ``file_removed``."""
    if not plan.writes and not plan.removes:
        return
    remove_stale_temporaries(directory)
    for e, data in plan.writes:
        if data is None:
            data = log.read_file(e)
        path = directory / e.name
        check_regular(path)  # never through a link planted since the plan

        def before_rename(tmp: Path, name=e.name) -> None:
            if hook is not None:
                hook("file_tmp", version=plan.version, name=name)
        try:
            write_file_atomic(path, data, prefix=TMP_PREFIX, before_rename=before_rename)
        except OSError as exc:
            raise os_error(exc, f"cannot write {path}") from None
        if hook is not None:
            hook("file", version=plan.version, name=e.name)
    for name in plan.removes:
        path = directory / name
        if check_regular(path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise os_error(exc, f"cannot remove {path}") from None
        if hook is not None:
            hook("file_removed", version=plan.version, name=name)
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise os_error(exc, f"cannot sync {directory}") from None
