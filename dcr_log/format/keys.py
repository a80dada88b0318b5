"""Object keys of a log, relative to its root."""

from __future__ import annotations

import re

from dcr_log.errors import IntegrityError, UsageError

IDENTITY_KEY = "dcr.json"
VERSIONS_PREFIX = "versions/"
SEGMENTS_PREFIX = "segments/"
_VERSION_KEY = re.compile(r"versions/([0-9]{20})\.json")
_WRITER_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def version_key(version: int) -> str:
    return f"{VERSIONS_PREFIX}{version:020d}.json"


def parse_version_key(key: str) -> int | None:
    m = _VERSION_KEY.fullmatch(key)  # not .match: ``$`` accepts a trailing newline
    return int(m.group(1)) if m else None


def segment_key(version: int, writer_id: str, unique: str) -> str:
    return f"{SEGMENTS_PREFIX}{version}/{writer_id}-{unique}.arrow"


# The file name of a segment key (after ``segments/<v>/``): 1 to 255 characters of
# A-Z a-z 0-9 . _ - ending in ``.arrow`` (spec/FORMAT.md, section 2); the same on every store
# and file system.
_SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{0,249}\.arrow")


def check_segment_key(key: str, version: int) -> None:
    prefix = f"{SEGMENTS_PREFIX}{version}/"
    if not key.startswith(prefix) or not _SEGMENT_NAME.fullmatch(key[len(prefix):]):
        raise IntegrityError(f"segment key {key[:300]!r} does not belong to version {version}")


def check_writer_id(writer_id: str) -> str:
    if not _WRITER_ID.fullmatch(writer_id):
        raise UsageError(f"writer id {writer_id!r}: 1-64 of [A-Za-z0-9._-]")
    return writer_id
