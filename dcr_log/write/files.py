"""A version's non-tensor files (feature ``files``, spec/FORMAT.md section 22), writer side:
resolved from a mapping of names to bytes or paths, or collected from a checkpoint directory
(config.json, tokenizer files, generation_config.json, ...). The objects are written by
DeltaLog.write_files; receivers write them into checkpoint directories (dcr_log.receiver)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dcr_log.errors import UsageError, os_error
from dcr_log.format import FILES, FileEntry, file_name_problem
from dcr_log.format import limits as L
from dcr_log.format.files import check_writer_files, is_weights_name

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog

FileSource = bytes | bytearray | memoryview | str | os.PathLike
Files = Mapping[str, FileSource]


def _read(name: str, path: Path) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"file {name!r}: no file at {path}") from None
    except OSError as exc:
        raise os_error(exc, f"cannot read {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"file {name!r}: {path} is not a regular file")
    if st.st_size > L.MAX_FILE_BYTES:
        raise UsageError(f"file {name!r}: {path} has {st.st_size} bytes: at most {L.MAX_FILE_BYTES} per file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise os_error(exc, f"cannot read {path}") from None
    if len(data) > L.MAX_FILE_BYTES:  # grew while being read
        raise UsageError(f"file {name!r}: {path} has more than {L.MAX_FILE_BYTES} bytes")
    return data


def resolve_files(files: Files) -> list[tuple[FileEntry, bytes]]:
    """(entry, bytes) of every file, sorted by name: each value is the file's bytes or a path
    to read them from. Names are checked (FORMAT.md section 22) and the limits applied:
    UsageError, before anything is written."""
    if not isinstance(files, Mapping):
        raise UsageError(f"files must map file names to bytes or paths, not {type(files).__name__}")
    out = []
    for name, source in files.items():
        problem = file_name_problem(name)
        if problem is not None:
            shown = repr(name[:80]) if isinstance(name, str) else type(name).__name__
            raise UsageError(f"file name {shown} cannot be logged: {problem}")
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
        elif isinstance(source, (str, os.PathLike)):
            data = _read(name, Path(source))
        else:
            raise UsageError(f"file {name!r}: expected bytes or a path, not {type(source).__name__}")
        out.append((FileEntry.of(name, data), data))
    by_name = {e.name: (e, d) for e, d in out}
    return [by_name[e.name] for e in check_writer_files(e for e, _ in out)]


def collect_files(directory: str | os.PathLike, skipped: list[str] | None = None) -> dict[str, Path]:
    """The files ``dcr init`` and ``dcr append`` carry from a checkpoint directory: every
    regular file at its top level except the weights (``*.safetensors``, the index) and dot
    files; directories are skipped (their names, but dot directories', appended to
    ``skipped``: a file name has no ``/``). A symbolic link (or any other special file) is
    refused (UsageError) rather than followed; so is a name the format cannot carry."""
    directory = Path(directory)
    out: dict[str, Path] = {}
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise os_error(exc, f"cannot list {directory}") from None
    for entry in entries:
        name = entry.name
        if name.startswith(".") or is_weights_name(name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            raise os_error(exc, f"cannot inspect {entry.path}") from None
        if stat.S_ISDIR(st.st_mode):
            if skipped is not None:
                skipped.append(name)
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(f"{entry.path} is a symbolic link: files are carried only as regular "
                             "files (copy it in, or use --no-files)")
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{entry.path} is not a regular file (use --no-files to carry none)")
        problem = file_name_problem(name)
        if problem is not None:
            raise UsageError(f"{entry.path}: the name cannot be carried: {problem} (rename it, or "
                             "use --no-files)")
        out[name] = Path(entry.path)
    return out


def new_file_set(log: DeltaLog, files: Files | None) -> list[tuple[FileEntry, bytes]] | None:
    """The coordinator's view of a version's new file set, read and checked (UsageError), or
    None for the parent's files."""
    if files is None:
        return None
    if not log.has_files:
        if not isinstance(files, Mapping) or len(files):
            raise UsageError(f"{log.store.url} was created without the feature {FILES!r}: its "
                             "versions carry no files (the feature is chosen when a log is created)")
        return None
    return resolve_files(files)


def write_version_files(log: DeltaLog, version: int, file_set) -> tuple[FileEntry, ...]:
    """The coordinator: the version's file entries; new objects created (the parent's are known)."""
    parent = () if version == 0 else log.commit(version - 1).files or ()
    if file_set is None:
        return tuple(parent)
    log.write_files(file_set, known={e.sha256 for e in parent})
    return tuple(e for e, _ in file_set)
