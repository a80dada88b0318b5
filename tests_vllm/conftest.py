import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def engine_env(tmp_path_factory):
    """The engine jobs (child processes) get a TMPDIR under pytest's own: vLLM names its
    distributed-init file after tempfile.gettempdir() (vllm_dist_<uuid>) and leaves it there.
    Writers keep their baseline caches there too, never in the home directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("engine-tmp")))
        mp.setenv("DCR_CACHE_DIR", str(tmp_path_factory.mktemp("dcr-cache")))
        yield
