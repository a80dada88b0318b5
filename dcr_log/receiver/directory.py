"""Checkpoint-directory receivers as ``dcr apply`` opens them: bind an existing checkpoint
to the log version whose state digest it has, or write a version out whole into an empty
directory, then hand over to the Receiver (spec/RECEIVER.md, "Checkpoint directories")."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path

from dcr_log.checkpoint import INDEX_NAME, save_safetensors
from dcr_log.errors import LineageError, NotFoundError, UsageError
from dcr_log.log.deltalog import DeltaLog
from dcr_log.receiver.files import FilePlan, plan_files, write_files
from dcr_log.receiver.fs import check_regular, check_space, fsync_dir, write_file_atomic
from dcr_log.receiver.journal import Journal, JournalState
from dcr_log.receiver.opening import JOURNAL_DIR
from dcr_log.receiver.receiver import Receiver
from dcr_log.receiver.storage import FaultHook, storage_state_digest
from dcr_log.receiver.storage.checkpoint import CheckpointStorage, has_checkpoint
from dcr_log.state import TensorBits

MODEL_NAME = "model.safetensors"
# A materialized checkpoint is split into shards only above this many bytes (Hugging Face's
# usual shard size).
SHARD_BYTES = 5 * 10**9
_OURS = re.compile(r"^(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                   + re.escape(INDEX_NAME) + r")$")
_OUR_TMP = re.compile(r"^\.(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                      + re.escape(INDEX_NAME) + r")\..*\.tmp$")

Say = Callable[[str], None]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [MODEL_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_checkpoint(state: Mapping[str, TensorBits], directory: str | Path,
                     shard_bytes: int | None = None) -> list[Path]:
    """Write ``state`` as model.safetensors, or as Hugging Face shards plus an index when it
    holds more than ``shard_bytes``; every file atomically, the index last."""
    directory = Path(directory)
    limit = SHARD_BYTES if shard_bytes is None else shard_bytes
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(state, key=str.encode):
        nbytes = state[name].nbytes
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    names = shard_names(len(groups))
    paths = []
    for group, fname in zip(groups, names):
        path = directory / fname
        save_safetensors({n: state[n] for n in group}, path, metadata={"format": "pt"})
        paths.append(path)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(b.nbytes for b in state.values())},
            "weight_map": {n: fname for group, fname in zip(groups, names) for n in group},
        }
        write_file_atomic(directory / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
        paths.append(directory / INDEX_NAME)
    fsync_dir(directory)
    return paths


def _remove_ours(directory: Path, keep: AbstractSet[str] = frozenset()) -> None:
    """Remove files an interrupted materialization of ours may have left behind."""
    for p in directory.iterdir():
        if p.is_file() and p.name not in keep and (_OURS.match(p.name) or _OUR_TMP.match(p.name)):
            p.unlink()


def _state_bytes(log: DeltaLog, version: int) -> int:
    """The bytes writing ``version`` out takes: its tensors and its files."""
    from dcr_log.coords import DTYPE_WIDTH, numel

    commit = log.commit(version)
    return (sum(numel(t.shape) * DTYPE_WIDTH[t.dtype] for t in commit.tensors)
            + sum(f.size for f in commit.files or ()))


def _files_said(plan: FilePlan) -> str:
    return f", {len(plan.writes)} files written" if plan.writes or plan.removes else ""


def _materialize(log: DeltaLog, directory: Path, version: int, journal: Journal, say: Say,
                 state=None, plan: FilePlan | None = None, fault: FaultHook | None = None) -> None:
    commit = log.commit(version)
    if state is None:
        check_space(directory, _state_bytes(log, version), f"write version {version} out")
        state = log.materialize(version)
    if plan is None:
        plan = plan_files(log, commit, directory, journal.files())
    _remove_ours(directory)
    paths = write_checkpoint(state, directory)
    # The version's files, after the weights and before the bind (a run killed in between
    # finds the materialization in flight and writes it out again).
    write_files(plan, log, directory, fault)
    journal.bind(log.log_id, version, commit.state_digest, files=plan.names)
    nbytes = sum(b.nbytes for b in state.values())
    files = f", {len(plan.entries)} files" if plan.entries else ""
    say(f"materialized version {version} into {', '.join(p.name for p in paths)}: "
        f"{len(state)} tensors, {nbytes} bytes{files}")


def _bound_version(log: DeltaLog, digest: int, to: int | None) -> int:
    version = log.find_state_digest(digest, upto=to)
    if version is not None:
        return version
    later = log.find_state_digest(digest) if to is not None else None
    if later is not None:
        raise UsageError(f"the checkpoint holds version {later}, past --to {to}")
    start = log.known_start()
    expired = f" (versions below {start} have expired: it may hold one of them)" if start else ""
    raise LineageError(f"the checkpoint's state digest {digest:016x} is no version of log {log.log_id}{expired}")


def open_directory(log: DeltaLog, directory: str | Path, to: int | None = None,
                   say: Say = lambda line: None, fault: FaultHook | None = None,
                   deferred_sync: bool = True) -> Receiver:
    """A Receiver for a checkpoint directory, bound to a version of ``log``.

    With a journal (DIR/.dcr) it is opened as is. Without one, a checkpoint in DIR is bound
    to the newest version (at most ``to``) with its state digest (LineageError if none
    has it); an empty or missing DIR gets version ``to`` (default latest) written out whole.
    Binding and writing out also write the version's files (feature files). Nothing is
    written before these checks pass, the files' SHA-256s included. ``deferred_sync``: as
    for ``Receiver.open``.
    """
    directory = Path(directory)
    jpath = directory / JOURNAL_DIR
    if to is not None:  # before anything is created in DIR
        if to < 0:
            raise UsageError(f"no version {to}")
        latest = log.latest_version()
        if to > latest:
            raise NotFoundError(f"no version {to} (latest is {latest})")
    if directory.is_dir():
        check_regular(directory / MODEL_NAME, in_place=True)  # a link would be written through
        check_regular(directory / INDEX_NAME)
    journal = Journal.open(jpath) if Journal.exists(jpath) else None
    try:
        st = journal.state() if journal is not None else JournalState(None, None, None, None, None)
        if st.log_id is not None and st.log_id != log.log_id:
            raise LineageError(f"receiver {directory} belongs to log {st.log_id}, not {log.log_id}")
        if journal is not None and st.bound:
            return Receiver(CheckpointStorage(directory), journal, fault, deferred_sync=deferred_sync)
        if journal is not None and st.materializing is not None:
            _materialize(log, directory, st.materializing, journal, say, fault=fault)
            return Receiver(CheckpointStorage(directory), journal, fault, deferred_sync=deferred_sync)
        if has_checkpoint(directory):
            storage = CheckpointStorage(directory)
            digest = storage_state_digest(storage, log.digests)
            version = _bound_version(log, digest, to)
            # The version's files: fetched and checked, with room for them, before any write.
            plan = plan_files(log, log.commit(version), directory,
                              journal.files() if journal is not None else (), storage.weight_names())
            if plan.writes:
                check_space(directory, plan.nbytes, f"write the files of version {version}")
            if journal is None:
                journal = Journal.open(jpath)
            if journal.state().log_id is not None:
                raise UsageError(f"receiver {directory} was bound by another process meanwhile")
            write_files(plan, log, directory, fault)
            journal.bind(log.log_id, version, digest, files=plan.names)
            say(f"bound {directory} to version {version} of log {log.log_id}{_files_said(plan)}")
            return Receiver(storage, journal, fault, deferred_sync=deferred_sync)
        latest = log.latest_version()
        version = latest if to is None else to
        if not 0 <= version <= latest:
            raise NotFoundError(f"no version {version} (latest is {latest})")
        # Everything that can fail before the first write: room for the files, then the
        # replay itself (every digest checked), in memory.
        check_space(directory, _state_bytes(log, version), f"write version {version} out")
        state = log.materialize(version)
        plan = plan_files(log, log.commit(version), directory)  # fetched and checked
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from dcr_log.errors import os_error

            raise os_error(exc, f"cannot create {directory}") from None
        if journal is None:
            journal = Journal.open(jpath)
        if journal.state().log_id is not None:
            raise UsageError(f"receiver {directory} was bound by another process meanwhile")
        journal.begin_materialize(log.log_id, version)
        _materialize(log, directory, version, journal, say, state, plan, fault)
        return Receiver(CheckpointStorage(directory), journal, fault, deferred_sync=deferred_sync)
    except BaseException:
        if journal is not None:
            journal.close()
        raise
