"""The on-store format: commit records, log identity and segment files. Pure: no I/O."""

from dcr_log.format.commit import FORMAT_VERSION, KNOWN_FEATURES, CommitRecord, CommitStats, LogIdentity, SegmentRef
from dcr_log.format.files import FILES, FILES_PREFIX, FileEntry, check_file_name, file_key, file_name_problem
from dcr_log.format.keys import IDENTITY_KEY, parse_version_key, segment_key, version_key
from dcr_log.format.segment import Record, SegmentBuilder, encode_segment, iter_segment, segment_schema

__all__ = [
    "FORMAT_VERSION", "KNOWN_FEATURES", "CommitRecord", "CommitStats", "LogIdentity", "SegmentRef",
    "FILES", "FILES_PREFIX", "FileEntry", "check_file_name", "file_key", "file_name_problem",
    "IDENTITY_KEY", "parse_version_key", "segment_key", "version_key",
    "SEGMENT_SCHEMA", "Record", "SegmentBuilder", "encode_segment", "iter_segment", "segment_schema",
]


def __getattr__(name: str):
    if name == "SEGMENT_SCHEMA":  # built, and pyarrow imported, on first use (segment.py)
        return segment_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
