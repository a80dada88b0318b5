"""Fixtures and hooks only; the helpers the tests import live in tests/helpers/."""

from __future__ import annotations

import os

import pytest

# The helpers' asserts (assert_same_bits, assert_one_line, ...) and the store contract's report
# their operands as the tests' own do; registered before anything imports them.
pytest.register_assert_rewrite("helpers", "dcr_log.testing")

from helpers.seaweed import SeaweedServer  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _session_baseline_cache_dir(tmp_path_factory):
    """The same for the module- and session-scoped fixtures, which are set up before any
    function-scoped one: without it, the logs they write left caches in the home directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DCR_CACHE_DIR", str(tmp_path_factory.mktemp("dcr-cache-shared")))
        yield


@pytest.fixture(autouse=True)
def _baseline_cache_dir(tmp_path_factory, monkeypatch):
    """Writers keep their baseline cache in a temporary directory, never in the home directory
    (subprocesses inherit the variable)."""
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path_factory.mktemp("dcr-cache")))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server per test process (tests/helpers/seaweed.py), with the AWS_* variables
    that point the library (and CLI subprocesses) at it. Tests that kill a server start their
    own (``SeaweedServer``) instead."""
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
