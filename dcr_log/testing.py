"""The store contract (spec/FORMAT.md section 15) as pytest tests a store backend's suite inherits.

A backend's tests subclass ``StoreTests`` and say how to open an empty store, by overriding
``open_store`` or, when opening needs other fixtures (a server, credentials), the ``store``
fixture itself::

    import pytest
    from dcr_log.store import Store
    from dcr_log.testing import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, my_server):
            return Store.open(my_server.fresh_url())

Every test method then runs against that store. This module imports pytest (a test extra);
``import dcr_log`` never imports this module. Register it for pytest's assertion rewriting
(``pytest.register_assert_rewrite("dcr_log.testing")`` in a conftest.py) to see the operands of
a failing check.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dcr_log.errors import NotFoundError, UsageError
from dcr_log.store import AlreadyExists, Store, WrongSize

__all__ = ["INVALID_KEYS", "StoreTests"]

# Keys the store layer refuses before any backend sees them (FORMAT.md section 15): empty,
# absolute, empty/./.. segments, a backslash, a control character, non-ASCII, too long.
INVALID_KEYS = ("", "/abs", "a//b", "a/../b", "./a", "a\\b", "a\nb", "é", "x" * 2000)


class StoreTests:
    """The contract every store passes. Not collected itself (its name does not start with
    ``Test``); a subclass named ``Test...`` is, with each test method run on its ``store``."""

    def open_store(self, tmp_path: Path) -> Store:
        """A new, empty store; ``tmp_path`` is this test's own temporary directory."""
        raise NotImplementedError(f"{type(self).__name__} overrides open_store or the store fixture")

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return self.open_store(tmp_path)

    def test_created_objects_read_back_whole(self, store: Store) -> None:
        payloads = {"a/empty": b"", "a/small": b"dcr", "a/binary": bytes(range(256)) * 3,
                    "b/large": bytes(1 << 20) + b"end"}
        for key, data in payloads.items():
            store.put_new(key, data)
        for key, data in payloads.items():
            assert bytes(store.get(key)) == data
            info = store.head(key)
            assert info is not None and info.size == len(data)
            assert bytes(store.get(key, size=len(data))) == data
        assert bytes(store.get_range("a/binary", 10, 20)) == payloads["a/binary"][10:20]

    def test_create_if_absent_never_overwrites(self, store: Store) -> None:
        store.put_new("k", b"first")
        with pytest.raises(AlreadyExists):
            store.put_new("k", b"second")
        assert bytes(store.get("k")) == b"first"

    def test_concurrent_creates_have_exactly_one_winner(self, store: Store) -> None:
        results: list[int] = []
        barrier = threading.Barrier(8)

        def create(i: int) -> None:
            barrier.wait()
            try:
                store.put_new("race/commit.json", f"writer {i}".encode())
                results.append(i)
            except AlreadyExists:
                pass

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 1
        assert bytes(store.get("race/commit.json")) == f"writer {results[0]}".encode()

    def test_missing_objects(self, store: Store) -> None:
        with pytest.raises(NotFoundError):
            store.get("nothing/here")
        with pytest.raises(NotFoundError):
            store.get_range("nothing/here", 0, 1)
        assert store.head("nothing/here") is None
        store.delete("nothing/here")  # deleting what is not there is no error
        assert store.list("nothing/") == []

    def test_list_sees_every_created_key_with_its_size_and_time(self, store: Store) -> None:
        before = time.time()
        keys = {f"versions/{i:020d}.json": b"x" * i for i in range(5)}
        keys["versions/other"] = b"y"
        keys["versionsX/not-under"] = b"z"
        for key, data in keys.items():
            store.put_new(key, data)  # listed at once: list-after-write
        listed = {o.key: o for o in store.list("versions/")}
        assert set(listed) == {k for k in keys if k.startswith("versions/")}
        assert all(listed[k].size == len(keys[k]) for k in listed)
        for o in listed.values():  # retention ages objects by these
            assert o.modified is not None and before - 5 <= o.modified <= time.time() + 5
        info = store.head("versions/other")
        assert info is not None and info.modified is not None

    def test_sizes_are_checked_before_the_bytes(self, store: Store) -> None:
        store.put_new("seg", b"0123456789")
        with pytest.raises(WrongSize):
            store.get("seg", size=9)
        with pytest.raises(WrongSize):
            store.get("seg", max_size=4)

    def test_delete_removes(self, store: Store) -> None:
        store.put_new("orphan/a", b"1")
        store.put_new("orphan/b", b"2")
        store.delete("orphan/a")
        assert [o.key for o in store.list("orphan/")] == ["orphan/b"]
        with pytest.raises(NotFoundError):
            store.get("orphan/a")
        store.put_new("orphan/a", b"again")  # a deleted key can be created again
        assert bytes(store.get("orphan/a")) == b"again"

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_are_refused_before_the_store(self, store: Store, key: str) -> None:
        with pytest.raises(UsageError):
            store.put_new(key, b"x")
        with pytest.raises(UsageError):
            store.get(key)
