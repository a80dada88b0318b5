"""Typed errors. Each maps to one CLI exit code (see cli.py and spec/FORMAT.md)."""


class DcrError(Exception):
    """Base of every error raised by dcr-log."""

    exit_code = 1


class UsageError(DcrError):
    """The caller asked for something that cannot be done (bad argument, missing version)."""

    exit_code = 2


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


class CommitStateUnknown(DcrError):
    """A commit request failed in a way that leaves unknown whether the version was created.

    Its segments are kept: the commit record, if it exists, may reference them.
    """

    exit_code = 1


class AppendAborted(DcrError):
    """A sharded append was aborted on every rank (another rank failed or died): the version
    was not committed by this call; the next append can try again."""

    exit_code = 1
