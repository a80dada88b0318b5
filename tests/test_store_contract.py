"""One contract every store backend passes (spec/FORMAT.md section 15; dcr_log.testing.StoreTests):
a local directory, memory, and S3 (a real SeaweedFS server started by the tests). And the
contract catches a store that breaks it."""

from __future__ import annotations

import uuid

import obstore
import pytest

from dcr_log.store import Store, check_key
from dcr_log.testing import StoreTests


class TestLocalStore(StoreTests):
    def open_store(self, tmp_path):
        return Store.open(tmp_path / "root", create=True)


class TestMemoryStore(StoreTests):
    def open_store(self, tmp_path):
        return Store.open(f"memory://contract-{uuid.uuid4().hex}")


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3_server):
        return Store.open(s3_server.url())


class OverwritingStore(Store):
    """A broken backend: its put_new replaces what is there instead of refusing it."""

    def put_new(self, key, data):
        check_key(key)
        obstore.put(self._inner, key, bytes(data))


def overwriting_store() -> OverwritingStore:
    inner = Store.open(f"memory://broken-{uuid.uuid4().hex}")
    return OverwritingStore(inner._inner, inner.url)


def test_a_store_that_overwrites_fails_the_contract():
    contract = TestMemoryStore()
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        contract.test_create_if_absent_never_overwrites(overwriting_store())
    with pytest.raises(AssertionError):
        contract.test_concurrent_creates_have_exactly_one_winner(overwriting_store())
    # The same store passes the checks that do not create a key twice.
    contract.test_created_objects_read_back_whole(overwriting_store())
