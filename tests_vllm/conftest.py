import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def engine_tmpdir(tmp_path_factory):
    """The engine jobs (child processes) get a TMPDIR under pytest's own: vLLM names its
    distributed-init file after tempfile.gettempdir() (vllm_dist_<uuid>) and leaves it there."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("engine-tmp"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session", autouse=True)
def baseline_cache_dir(tmp_path_factory):
    """Writers keep their baseline caches under pytest's temporary directory, never in the
    home directory (the engine jobs inherit the variable)."""
    old = os.environ.get("DCR_CACHE_DIR")
    os.environ["DCR_CACHE_DIR"] = str(tmp_path_factory.mktemp("dcr-cache"))
    yield
    if old is None:
        os.environ.pop("DCR_CACHE_DIR", None)
    else:
        os.environ["DCR_CACHE_DIR"] = old
