"""One contract every store backend passes (spec/FORMAT.md section 15): a local directory,
memory, and S3 (a real SeaweedFS server started by the tests)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from dcr_log.errors import NotFoundError, UsageError
from dcr_log.store import AlreadyExists, Store, WrongSize


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store.open(tmp_path / "root", create=True)
    if request.param == "memory":
        return Store.open(f"memory://contract-{uuid.uuid4().hex}")
    server = request.getfixturevalue("s3_server")
    return Store.open(server.url())


def test_created_objects_read_back_whole(store):
    payloads = {"a/empty": b"", "a/small": b"dcr", "a/binary": bytes(range(256)) * 3,
                "b/large": bytes(1 << 20) + b"end"}
    for key, data in payloads.items():
        store.put_new(key, data)
    for key, data in payloads.items():
        assert bytes(store.get(key)) == data
        assert store.head(key).size == len(data)
        assert bytes(store.get(key, size=len(data))) == data
    assert bytes(store.get_range("a/binary", 10, 20)) == payloads["a/binary"][10:20]


def test_create_if_absent_never_overwrites(store):
    store.put_new("k", b"first")
    with pytest.raises(AlreadyExists):
        store.put_new("k", b"second")
    assert bytes(store.get("k")) == b"first"


def test_concurrent_creates_have_exactly_one_winner(store):
    results: list = []
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


def test_missing_objects(store):
    with pytest.raises(NotFoundError):
        store.get("nothing/here")
    with pytest.raises(NotFoundError):
        store.get_range("nothing/here", 0, 1)
    assert store.head("nothing/here") is None
    store.delete("nothing/here")  # deleting what is not there is no error
    assert store.list("nothing/") == []


def test_list_sees_every_created_key_with_its_size_and_time(store):
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
    assert store.head("versions/other").modified is not None


def test_sizes_are_checked_before_the_bytes(store):
    store.put_new("seg", b"0123456789")
    with pytest.raises(WrongSize):
        store.get("seg", size=9)
    with pytest.raises(WrongSize):
        store.get("seg", max_size=4)


def test_delete_removes(store):
    store.put_new("orphan/a", b"1")
    store.put_new("orphan/b", b"2")
    store.delete("orphan/a")
    assert [o.key for o in store.list("orphan/")] == ["orphan/b"]
    with pytest.raises(NotFoundError):
        store.get("orphan/a")
    store.put_new("orphan/a", b"again")  # a deleted key can be created again
    assert bytes(store.get("orphan/a")) == b"again"


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a\\b", "a\nb", "é", "x" * 2000])
def test_invalid_keys_are_refused_before_the_store(store, key):
    with pytest.raises(UsageError):
        store.put_new(key, b"x")
    with pytest.raises(UsageError):
        store.get(key)
