"""LogWriter: create a log and append whole states as deltas: the one-rank case of
ShardedWriter (dcr_log.write.sharded), with no torch needed."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dcr_log.collective import LocalGroup
from dcr_log.format import CommitRecord
from dcr_log.log.deltalog import DeltaLog
from dcr_log.state import to_state
from dcr_log.store import Store
from dcr_log.write.differ import EncodePolicy
from dcr_log.write.files import Files
from dcr_log.write.pieces import Shard
from dcr_log.write.sharded import DEFAULT_FEATURES, DEFAULT_SEGMENT_BYTES, ShardedWriter, default_writer_id, utc_now

__all__ = ["DEFAULT_SEGMENT_BYTES", "LogWriter", "create_log", "default_writer_id", "utc_now"]


def _whole(state: Mapping[str, Any]):
    bits = to_state(state)
    return {n: [Shard(b)] for n, b in bits.items()}, {n: b.shape for n, b in bits.items()}


class LogWriter:
    """Appends whole states to one log. Keeps a baseline of the last committed state (in
    memory, and memory-mapped from a local cache so that ``open`` needs no replay), so an
    append costs one pass over the new state."""

    def __init__(self, sharded: ShardedWriter):
        self._writer = sharded

    def close(self) -> None:
        """Let go of the baseline; the log and its cache stay (``LogWriter.open`` resumes)."""
        self._writer.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log(self) -> DeltaLog:
        return self._writer.log

    @property
    def version(self) -> int:
        """The last version this writer committed or started from."""
        return self._writer.version

    @property
    def writer_id(self) -> str:
        return self._writer.writer_id

    @staticmethod
    def create(location: str | os.PathLike | Store, state: Mapping[str, Any],
               progress: Callable[[int], None] | None = None, *, cache_dir: Any = None,
               features: Sequence[str] = DEFAULT_FEATURES, writer_id: str | None = None,
               policy: EncodePolicy | None = None,
               segment_bytes: int = DEFAULT_SEGMENT_BYTES, signing_key: Any = None,
               files: Files | None = None) -> LogWriter:
        """Create a new log whose version 0 is the full ``state``. New logs use
        ``sum-digests`` and ``ulp-encoding``; ``features=()`` writes a plain format-1 log (xxh3 digests). With
        ``signing_key`` every version this writer commits is signed.

        ``files`` maps file names (config.json, tokenizer files, ...) to bytes or paths:
        version 0's non-tensor files. Given (even empty), the log gets the feature ``files``
        (so does ``"files"`` in ``features``) and every later version carries a file set;
        without it the log carries none, for good (spec/FORMAT.md section 22)."""
        shards, shapes = _whole(state)
        return LogWriter(ShardedWriter.create(
            location, shards, shapes, LocalGroup(), cache_dir=cache_dir, features=features,
            writer_id=writer_id, policy=policy, segment_bytes=segment_bytes, progress=progress,
            signing_key=signing_key, files=files))

    @staticmethod
    def open(location: str | os.PathLike | Store | DeltaLog, *, cache_dir: Any = None,
             writer_id: str | None = None, policy: EncodePolicy | None = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES, signing_key: Any = None,
             check_cache: bool = False) -> LogWriter:
        """Resume writing a log at its latest version: the baseline comes from the local cache
        (checked against the commit's digests) or, failing that, from a replay. Cached words
        sealed by the last append of this boot are not hashed again unless ``check_cache``."""
        return LogWriter(ShardedWriter.open(location, LocalGroup(), cache_dir=cache_dir,
                                            writer_id=writer_id, policy=policy, segment_bytes=segment_bytes,
                                            signing_key=signing_key, check_cache=check_cache))

    def append(self, state: Mapping[str, Any], kind: str = "xor",
               progress: Callable[[int], None] | None = None, files: Files | None = None, *,
               allow_layout_change: bool = False) -> CommitRecord:
        """Commit ``state`` as the next version. ``kind`` is ``xor`` or ``overwrite``.
        ``files``: the version's whole file set (names to bytes or paths; a file left out is
        dropped), or None for the parent version's files (nothing uploaded). A log created
        without the feature ``files`` takes none (UsageError).

        A state whose tensor table differs from the parent version's (a tensor added, removed,
        renamed, reshaped or retyped) is refused with UsageError, before anything is written,
        unless ``allow_layout_change=True``.

        Raises CommitConflict (and leaves the baseline as it was) if another writer already
        committed that version.
        """
        shards, shapes = _whole(state)
        return self._writer.append(shards, shapes, kind=kind, progress=progress, files=files,
                                   allow_layout_change=allow_layout_change)


def create_log(location, state, **kwargs) -> LogWriter:
    return LogWriter.create(location, state, **kwargs)
