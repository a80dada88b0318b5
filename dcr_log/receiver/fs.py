"""Local file-system helpers of the receiver: refuse what is not a plain regular file, check
free space before writing, write files atomically (tmp + fsync + rename + directory fsync)
keeping their mode."""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from dcr_log.errors import IntegrityError, StoreError, UsageError, os_error


def _file_metadata(path: Path) -> dict[str, str] | None:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise IntegrityError(f"{path}: header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else None


def check_regular(path: Path, what: str = "file", in_place: bool = False) -> bool:
    """Whether ``path`` exists, refusing anything but a regular file (or a directory, for
    ``what="directory"``): a receiver writes its files in place and must never follow a
    symbolic link out of its directory. A file written ``in_place`` must have no other hard
    link, which would be written through too (possibly outside the directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise os_error(exc, f"cannot inspect {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{path} is a symbolic link: a receiver writes in place and never "
                         "outside its directory (copy the files in instead)")
    ok = stat.S_ISDIR(st.st_mode) if what == "directory" else stat.S_ISREG(st.st_mode)
    if not ok:
        raise UsageError(f"{path} is not a regular {what}")
    if in_place and st.st_nlink > 1:
        raise UsageError(f"{path} has {st.st_nlink} hard links: a receiver writes it in place, "
                         "which would change every other name of it too (copy the file instead "
                         "of linking it)")
    return True


def plain_file_name(name, where: Path) -> str:
    """An index entry must name a file directly inside the directory."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\x00" in name or len(name.encode("utf-8", "replace")) > 255):
        raise IntegrityError(f"{where}: file name {str(name)[:80]!r} is not a file of this directory")
    return name


def boot_id() -> bytes:
    """This boot's id (Linux: it changes at every boot, so a power loss changes it); empty
    where the system does not say, which makes every open restore deferred-sync images."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


def free_bytes(directory: Path) -> int:
    """Bytes this process may still allocate on ``directory``'s file system."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 1 << 62  # unknown: do not refuse on its account
    # root may use the blocks a file system reserves for it
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


# Kept free beyond what a write needs: file-system metadata and the journal's first pages.
SPACE_SLACK = 1 << 20


def check_space(directory: Path, needed: int, what: str) -> None:
    available = free_bytes(directory)
    if needed + SPACE_SLACK > available:
        raise StoreError(f"cannot {what} in {directory}: no space left on device "
                         f"({needed} bytes needed, {available} available)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replaced_mode(path: Path) -> int:
    """The permission bits a file written over ``path`` gets: the old file's, else 0644
    (mkstemp's 0600 would hide a checkpoint from a serving process of another user)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o644


def write_file_atomic(path: Path, data: bytes, prefix: str | None = None,
                      before_rename: Callable[[Path], None] | None = None) -> None:
    """tmp (created exclusively: never through a planted link; named ``.<name>.<random>.tmp``
    unless ``prefix`` is given) + fsync + rename + fsync of the directory."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}." if prefix is None else prefix, suffix=".tmp",
                                dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, replaced_mode(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
