"""Limits on every size, count and depth a reader takes from stored metadata
(spec/FORMAT.md, section 20). A value beyond a limit is an IntegrityError, raised before
anything is allocated or read on its account. Pure: no I/O."""

from __future__ import annotations

from dcr_log.errors import IntegrityError

MAX_IDENTITY_BYTES = 1 << 16          # dcr.json
# One commit record (and one snapshot or squash manifest): a stated ceiling, not a product of
# the counts below (2^22 tensors of 4096-byte names would need 100 GiB). A tensor object takes
# 100 to 200 bytes for names of 40 to 120 characters and a segment object about 200, so 64 MiB
# holds some 300 000 tensors and the 16 384 segments of a TiB of 64 MiB segments. Python's json
# takes about 7 times the text of a real record to parse and at most about 28 times for any
# text (empty objects or lists: ~90 bytes each for 3 bytes), so a record read whole and parsed
# costs at most ~1.8 GiB, ~0.5 GiB for a real one at the limit (tools/bench_memory.py).
MAX_COMMIT_BYTES = 1 << 26
MAX_SEGMENT_BYTES = 1 << 34           # one segment file (writers keep them near 64 MiB)
MAX_SEGMENTS = 1 << 20                # segments of one version
MAX_SEGMENT_RECORDS = 1 << 32         # records of one segment (`records`)
MAX_TENSORS = 1 << 22                 # tensors of one state
MAX_RANK = 32                         # dimensions of a tensor (and of a box)
MAX_DIM = 1 << 48                     # one dimension, box offsets and shapes included
MAX_TENSOR_BYTES = 1 << 48            # numel x width of one tensor (256 TiB)
MAX_STATE_BYTES = 1 << 52             # the bytes of one state (4 PiB)
MAX_NAME_BYTES = 4096                 # a tensor name, UTF-8
MAX_TEXT_CHARS = 1024                 # informative strings (created_at, writer_id)
MAX_PARAMS_BYTES = 4096               # a record's params text
MAX_FILES = 4096                      # files of one version (feature files)
MAX_FILE_NAME_BYTES = 255             # a file name, UTF-8 (one directory entry)
MAX_FILE_BYTES = 1 << 30              # one file (1 GiB)
MAX_VERSION_FILE_BYTES = 1 << 32      # the files of one version, in all (4 GiB)


def check(cond: bool, what: str, msg: str) -> None:
    if not cond:
        raise IntegrityError(f"{what}: {msg} (limit exceeded)")
