"""The feature ``files`` (spec/FORMAT.md, section 22): a version's non-tensor files.

A commit record of a log with the feature lists every file of its version (the whole set,
sorted by name) as ``{"key", "name", "sha256", "size"}``; the bytes are a content-addressed
object ``files/<sha256>``. Pure: names and entries are checked here, bytes are moved by
dcr_log.store.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format import limits as L

FILES = "files"
FILES_PREFIX = "files/"

# Names a receiver directory uses for itself (spec/RECEIVER.md section 9): its weights and
# their index, and its journal (a dot name, refused anyway).
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"

_HEX64 = re.compile(r"[0-9a-f]{64}")
# C0 controls and DEL: never in a file name of this format.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def file_key(sha256: str) -> str:
    return f"{FILES_PREFIX}{sha256}"


def is_weights_name(name: str) -> bool:
    """A name a receiver directory keeps its weights under: ``*.safetensors`` or the index,
    ASCII letters compared case-insensitively (as a case-insensitive file system does)."""
    lowered = name.encode("utf-8", "surrogatepass").lower()  # bytes.lower: ASCII letters only
    return lowered.endswith(WEIGHTS_SUFFIX.encode()) or lowered == INDEX_NAME.encode()


def file_name_problem(name) -> str | None:
    """Why ``name`` is not a file name of this format (FORMAT.md section 22), or None."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "not a sequence of Unicode scalar values"
    if len(encoded) > L.MAX_FILE_NAME_BYTES:
        return f"longer than {L.MAX_FILE_NAME_BYTES} bytes of UTF-8"
    if "/" in name or "\\" in name:
        return "not a plain file name (it holds a / or \\)"
    if _CONTROL.search(name):
        return "it holds a control character"
    if name.startswith("."):
        return "it starts with '.' (., .., hidden files and the receiver's .dcr journal)"
    if is_weights_name(name):
        return "a receiver keeps its weights under that name"
    return None


def check_file_name(name, what: str) -> str:
    problem = file_name_problem(name)
    if problem is not None:
        shown = repr(name[:80]) if isinstance(name, str) else type(name).__name__
        raise IntegrityError(f"{what}: file name {shown} is refused: {problem}")
    return name


@dataclass(frozen=True)
class FileEntry:
    """One file of a version: its name in a directory, its size and SHA-256 (which name its
    object, ``files/<sha256>``)."""

    name: str
    size: int
    sha256: str

    @property
    def key(self) -> str:
        return file_key(self.sha256)

    def to_json(self) -> dict:
        return {"key": self.key, "name": self.name, "sha256": self.sha256, "size": self.size}

    @staticmethod
    def of(name: str, data) -> FileEntry:
        """The entry of ``data`` under ``name`` (a writer's; the name is checked)."""
        problem = file_name_problem(name)
        if problem is not None:
            shown = repr(name[:80]) if isinstance(name, str) else type(name).__name__
            raise UsageError(f"file name {shown} cannot be logged: {problem}")
        view = memoryview(data).cast("B")
        return FileEntry(name, view.nbytes, hashlib.sha256(view).hexdigest())


def parse_files(value, what: str) -> tuple[FileEntry, ...]:
    """The ``files`` member of a commit record: checked, every limit before anything else."""
    if not isinstance(value, list):
        raise IntegrityError(f"{what}: files must be a list")
    L.check(len(value) <= L.MAX_FILES, what, f"more than {L.MAX_FILES} files")
    out = []
    total = 0
    for f in value:
        if not isinstance(f, dict) or set(f) != {"key", "name", "sha256", "size"}:
            raise IntegrityError(f"{what}: a file object must have exactly key, name, sha256 and size")
        name = check_file_name(f["name"], what)
        sha = f["sha256"]
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise IntegrityError(f"{what}: file {name[:80]!r}: bad sha256")
        if f["key"] != file_key(sha):
            raise IntegrityError(f"{what}: file {name[:80]!r}: key is not {file_key(sha)}")
        size = f["size"]
        if type(size) is not int or not 0 <= size < 1 << 64:
            raise IntegrityError(f"{what}: file {name[:80]!r}: size must be an integer >= 0 and below 2^64")
        L.check(size <= L.MAX_FILE_BYTES, what, f"file {name[:80]!r} of {size} bytes")
        total += size
        out.append(FileEntry(name, size, sha))
    L.check(total <= L.MAX_VERSION_FILE_BYTES, what, f"files of {total} bytes in all")
    names = [e.name.encode() for e in out]
    if names != sorted(set(names)):
        raise IntegrityError(f"{what}: file names must be unique and sorted by their UTF-8 bytes")
    return tuple(out)


def check_writer_files(entries) -> tuple[FileEntry, ...]:
    """A writer's file set, as a commit record lists it: sorted, unique, within the limits
    (UsageError: writers MUST NOT write what readers refuse)."""
    entries = sorted(entries, key=lambda e: e.name.encode())
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"file {dup!r} is given twice")
    if len(entries) > L.MAX_FILES:
        raise UsageError(f"{len(entries)} files: a version holds at most {L.MAX_FILES}")
    for e in entries:
        if e.size > L.MAX_FILE_BYTES:
            raise UsageError(f"file {e.name!r} has {e.size} bytes: at most {L.MAX_FILE_BYTES} per file")
    total = sum(e.size for e in entries)
    if total > L.MAX_VERSION_FILE_BYTES:
        raise UsageError(f"the files hold {total} bytes: at most {L.MAX_VERSION_FILE_BYTES} per version")
    return tuple(entries)
