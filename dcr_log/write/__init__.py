"""Writing a log: a trainer's state in, versions out.

``pieces`` turns what a rank holds (``Shard``: a box, a flat range or a converter's output of a
canonical tensor) into pieces; ``layout`` checks that the ranks' pieces cover every tensor;
``differ`` diffs each piece against its baseline into records (the encodings chosen by
``dcr_log.codec``); ``uploader`` puts the segments (``SegmentUploader``); ``sharded`` runs one
step across the ranks of a group and commits it (``ShardedWriter``); ``baseline`` keeps each
rank's copy of what it last logged; ``writer`` is the one-rank case (``LogWriter``); ``files``
collects the non-tensor files a version carries."""

from __future__ import annotations

from dcr_log.write.pieces import Shard
from dcr_log.write.sharded import ShardedWriter
from dcr_log.write.uploader import SegmentUploader
from dcr_log.write.writer import LogWriter, create_log

__all__ = ["Shard", "ShardedWriter", "SegmentUploader", "LogWriter", "create_log"]
