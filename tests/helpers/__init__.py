"""Helpers the tests import (``from helpers import ...``); fixtures and hooks stay in conftest.py.

The tests directory is on ``sys.path`` (pytest's ``pythonpath`` setting, and a script's own
folder for the rank and job scripts run as subprocesses), so ``helpers`` imports the same way
in a test module, in tests/conftest.py and in tests/sharded_job.py-style scripts.

- ``helpers.bits``: random states as words, special float bit patterns, bit-exact comparison;
- ``helpers.cli``: the dcr command in a subprocess;
- ``helpers.files``: an independent safetensors reader, file-tree snapshots;
- ``helpers.stores``: a Store that counts its reads;
- ``helpers.ranks``: free ports and one process per rank;
- ``helpers.models``: the offline MiniLM checkpoint;
- ``helpers.seaweed``: a real S3 server (SeaweedFS);
- ``helpers.pages``: whether a file's pages are still dirty, as a test sets it;
- ``helpers.engines``: vLLM-like test engines. Not re-exported here: it imports torch, which
  most tests do not need (import it as ``from helpers.engines import ...``).
"""

from helpers.bits import (
    ALL_DTYPES,
    FLOAT_DTYPES,
    NUMPY_DTYPE,
    SPECIAL_WORDS,
    assert_same_bits,
    change_words,
    copy_state,
    flip_log,
    make_bits,
    make_state,
    random_words,
)
from helpers.cli import assert_one_line, cli_env, run_cli, start_cli
from helpers.files import assert_file_holds, read_safetensors_raw, snapshot_files
from helpers.models import minilm_config, minilm_dir
from helpers.pages import DirtyCount
from helpers.ranks import free_port, run_ranks
from helpers.seaweed import SeaweedServer
from helpers.stores import counting_store

__all__ = [
    "ALL_DTYPES", "DirtyCount", "FLOAT_DTYPES", "NUMPY_DTYPE", "SPECIAL_WORDS", "SeaweedServer", "assert_file_holds",
    "assert_one_line", "assert_same_bits", "change_words", "cli_env", "copy_state", "counting_store", "flip_log",
    "free_port", "make_bits", "make_state", "minilm_config", "minilm_dir", "random_words", "read_safetensors_raw",
    "run_cli", "run_ranks", "snapshot_files", "start_cli",
]
