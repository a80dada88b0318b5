"""Typed errors. Each maps to one CLI exit code (see cli.py and spec/FORMAT.md, section 16)."""


class DcrError(Exception):
    """Base of every error raised by dcr-log."""

    exit_code = 1


class UsageError(DcrError):
    """The caller asked for something that cannot be done (bad argument, missing version)."""

    exit_code = 2


class PlacementError(UsageError):
    """A placement does not fit the engine or the log's tensor table, or the engine's loader
    places tensors in a way receivers cannot follow."""


class LayoutError(PlacementError):
    """A version changes the tensor table in a way this receiver cannot or may not follow
    (an engine's layout; a caller's own tensors); refused before any write."""


class ReplicaMismatch(UsageError):
    """Ranks that hold the same box of a tensor (replicas: data-parallel copies, Replicate
    placements) hold different values; the version is refused before its commit. The message
    names the tensor, the box and the ranks."""


class IntegrityError(DcrError):
    """Stored bytes fail a hash, digest, length or format check."""

    exit_code = 3


class LineageError(DcrError):
    """Data belongs to another log, another parent or another baseline."""

    exit_code = 4


class CommitConflict(DcrError):
    """The version being committed already exists (another writer won it)."""

    exit_code = 5


class NotFoundError(DcrError):
    """A log, version or object does not exist."""

    exit_code = 2


class ExpiredError(NotFoundError):
    """A version retention has expired: the log now starts at a later version (its snapshot).
    ``start`` is that version."""

    def __init__(self, message: str, start: int):
        super().__init__(message)
        self.start = start


class CommitStateUnknown(DcrError):
    """A commit request failed in a way that leaves unknown whether the version was created.

    Its segments are kept: the commit record, if it exists, may reference them.
    """

    exit_code = 1


class AppendAborted(DcrError):
    """A sharded append was aborted on every rank (another rank failed or died): the version
    was not committed by this call; the next append can try again."""

    exit_code = 1


class StoreError(DcrError):
    """A store (the log's object store, or a receiver's directory or memory) could not do what
    was asked: no space left, read-only, permission denied, unreachable, out of memory. The
    message names the operation and its cause; nothing about the data is implied."""

    exit_code = 6


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (raised by the ``dcr`` command's signal handlers). A
    KeyboardInterrupt, so every rollback path that handles Ctrl-C handles SIGTERM too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def os_error(exc: OSError, what: str) -> StoreError:
    """A StoreError for an OSError, saying what was being done and why it failed."""
    import errno
    import os

    code = exc.errno or 0
    reason = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
              errno.EPERM: "operation not permitted", errno.EIO: "input/output error"}.get(
        code, os.strerror(code) if code else str(exc))
    return StoreError(f"{what}: {reason}")


class TrustError(DcrError):
    """Under a trust policy, a version has no valid signature by a trusted key: unsigned, signed
    only by unknown keys, or with a forged signature (spec/FORMAT.md, section 21)."""

    exit_code = 7


class CollectiveFailed(AppendAborted):
    """A collective operation failed: a rank died, timed out or left the group."""


class AlreadyExists(DcrError):
    """put_if_absent found the key already there."""


class WrongSize(IntegrityError):
    """An object is not of the size its reader was told (a commit record's segment size) or
    exceeds the reader's limit; found from the object's metadata, before its bytes are read."""


class CacheWarning(UserWarning):
    """The writers' baseline cache cannot be used (its directory cannot be made or opened):
    appends go on without it, each reading its baseline from the log (a replay)."""
