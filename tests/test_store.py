"""The store boundary against real stores: a local directory and memory://."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import threading
import types
import uuid

import numpy as np
import pytest

from dcr_log.errors import NotFoundError, StoreError, UsageError
from dcr_log.store import HASH_PIECE_BYTES, AlreadyExists, Store, _HashingWriter


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        return Store.open(tmp_path / "root", create=True)
    return Store.open(f"memory://store-test-{uuid.uuid4().hex}")


def test_put_new_then_get(store):
    store.put_new("versions/00000000000000000000.json", b"first")
    assert bytes(store.get("versions/00000000000000000000.json")) == b"first"
    info = store.head("versions/00000000000000000000.json")
    assert info is not None and info.size == 5 and info.key == "versions/00000000000000000000.json"


def test_put_new_twice_keeps_the_first_bytes(store):
    store.put_new("k/a", b"first")
    with pytest.raises(AlreadyExists):
        store.put_new("k/a", b"second, longer")
    with pytest.raises(AlreadyExists):
        store.put_new("k/a", b"")
    assert bytes(store.get("k/a")) == b"first"
    assert [o.key for o in store.list("k/")] == ["k/a"]


def test_put_new_accepts_buffers(store):
    store.put_new("a", memoryview(b"xyz"))
    store.put_new("b", bytearray(b"\x00\xff"))
    store.put_new("empty", b"")
    assert bytes(store.get("a")) == b"xyz"
    assert bytes(store.get("b")) == b"\x00\xff"
    assert bytes(store.get("empty")) == b""


def test_missing_keys(store):
    with pytest.raises(NotFoundError):
        store.get("nope")
    with pytest.raises(NotFoundError):
        store.get_range("nope", 0, 1)
    assert store.head("nope") is None
    store.delete("nope")  # deleting what is not there is not an error


def test_list_by_prefix(store):
    keys = ["versions/00000000000000000001.json", "versions/00000000000000000000.json",
            "segments/1/w-a.arrow", "segments/10/w-b.arrow", "segments/1/w-c.arrow", "dcr.json"]
    for i, key in enumerate(keys):
        store.put_new(key, bytes(i + 1))
    listed = {o.key: o.size for o in store.list("versions/")}
    assert listed == {"versions/00000000000000000000.json": 2, "versions/00000000000000000001.json": 1}
    assert sorted(o.key for o in store.list("segments/1/")) == ["segments/1/w-a.arrow", "segments/1/w-c.arrow"]
    assert sorted(o.key for o in store.list("")) == sorted(keys)
    assert store.list("snapshots/") == []


def test_ranged_get(store):
    data = bytes(range(256)) * 4
    store.put_new("blob", data)
    assert bytes(store.get_range("blob", 0, 1)) == data[:1]
    assert bytes(store.get_range("blob", 10, 300)) == data[10:300]
    assert bytes(store.get_range("blob", 1000, 1024)) == data[1000:]


def test_delete(store):
    store.put_new("x/y", b"1")
    store.delete("x/y")
    with pytest.raises(NotFoundError):
        store.get("x/y")
    store.put_new("x/y", b"2")  # a deleted key can be created again
    assert bytes(store.get("x/y")) == b"2"


def test_put_new_race_has_one_winner(store):
    """Threads create one key at once: exactly one succeeds and its bytes are what is stored."""
    n = 8
    barrier = threading.Barrier(n)
    outcome: dict[int, str] = {}

    def create(i: int) -> None:
        barrier.wait()
        try:
            store.put_new("race", f"writer {i}".encode() * 1000)
            outcome[i] = "won"
        except AlreadyExists:
            outcome[i] = "lost"

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(outcome) == n and len(winners) == 1
    assert bytes(store.get("race")) == f"writer {winners[0]}".encode() * 1000


def test_local_store_leaves_no_staging_files(tmp_path):
    store = Store.open(tmp_path / "root", create=True)
    store.put_new("a/b", b"1")
    with pytest.raises(AlreadyExists):
        store.put_new("a/b", b"2")
    files = sorted(str(p.relative_to(tmp_path / "root")) for p in (tmp_path / "root").rglob("*") if p.is_file())
    assert files == ["a/b"]


def _directories(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir())


def test_deletes_remove_the_directories_they_leave_empty(tmp_path):
    """As gc deletes a version's segments, its segments/<v>/ goes with the last of them (an
    empty directory means nothing, FORMAT.md section 15); the root stays."""
    root = tmp_path / "root"
    store = Store.open(root, create=True)
    for key in ("a/b/c", "a/d", "e/f"):
        store.put_new(key, b"1")
    store.delete("a/b/c")
    assert _directories(root) == ["a", "e"]
    store.delete("a/d")
    store.delete("e/f")
    assert root.is_dir() and _directories(root) == [] and list(root.iterdir()) == []


def test_a_failed_create_leaves_no_directory_it_made(tmp_path):
    """A create that fails (a full disk, an abandoned segment) removes its temporary file and
    the directories only it needed; a directory holding another object stays."""
    root = tmp_path / "root"
    store = Store.open(root, create=True)

    def fail(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StoreError, match="no space left"):
        store.create_file("segments/7/x", fail)
    assert list(root.iterdir()) == []
    store.put_new("segments/7/y", b"kept")
    with pytest.raises(StoreError, match="no space left"):
        store.create_file("segments/7/x", fail)
    assert [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()] == ["segments/7/y"]


def test_a_directory_that_keeps_vanishing_is_not_an_existing_key(tmp_path, monkeypatch):
    """A create whose directory is removed between its mkdir and its open tries again; one
    that loses every try is a StoreError, never AlreadyExists (which says the key is taken)."""
    import pathlib

    from dcr_log import store as store_module

    root = tmp_path / "root"
    store = Store.open(root, create=True)
    real_mkdir = pathlib.Path.mkdir
    lost: list[int] = [0]

    def vanishing(self, *args, **kwargs):
        # What mkdir(exist_ok=True) raises when the directory it found is gone when it looks again.
        if self.name == "5" and lost[0] < limit[0]:
            lost[0] += 1
            raise FileExistsError(errno.EEXIST, "File exists", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", vanishing)
    limit = [store_module.CREATE_TRIES - 1]  # every try but the last lost: created
    store.put_new("segments/5/a", b"x")
    assert bytes(store.get("segments/5/a")) == b"x" and lost[0] == store_module.CREATE_TRIES - 1
    lost[0], limit[0] = 0, store_module.CREATE_TRIES  # every try lost
    with pytest.raises(StoreError) as raised:
        store.put_new("segments/5/b", b"y")
    assert not isinstance(raised.value, AlreadyExists)
    assert sorted(p.name for p in (root / "segments" / "5").iterdir()) == ["a"]


def test_creates_and_deletes_in_one_directory_race_without_errors(tmp_path):
    """Writers create objects in a directory while deletes empty it and remove it (as gc
    does to a version's orphan segments while a writer retries that version): a create
    whose directory vanished between its mkdir and its open makes it again."""
    root = tmp_path / "root"
    store = Store.open(root, create=True)
    errors: list[BaseException] = []

    def churn(name: str) -> None:
        try:
            for i in range(400):
                key = f"segments/3/{name}-{i}"
                store.put_new(key, b"x")
                assert bytes(store.get(key)) == b"x"
                store.delete(key)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(f"w{n}",)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list(root.iterdir()) == []


def test_memory_stores_are_shared_by_name():
    name = f"memory://shared-{uuid.uuid4().hex}"
    Store.open(name).put_new("k", b"v")
    assert bytes(Store.open(name).get("k")) == b"v"
    with pytest.raises(NotFoundError):
        Store.open(f"memory://other-{uuid.uuid4().hex}").get("k")


def test_open_locations(tmp_path):
    with pytest.raises(NotFoundError):
        Store.open(tmp_path / "absent")
    store = Store.open(f"file://{tmp_path / 'made'}", create=True)
    assert (tmp_path / "made").is_dir()
    store.put_new("k", b"v")
    assert bytes(Store.open(tmp_path / "made").get("k")) == b"v"
    with pytest.raises(UsageError):
        Store.open("ftp://host/path")


def test_create_file_hashes_large_and_small_writes_in_order(tmp_path):
    """Writes larger than HASH_PIECE_BYTES are written and hashed piece by piece: the size
    and sha256 are still those of the bytes in order, mixed with small writes, and each
    write's buffer may be reused by the caller as soon as it returns."""
    store = Store.open(tmp_path / "root", create=True)
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in
              (10, HASH_PIECE_BYTES, 7, 3 * HASH_PIECE_BYTES + 5, HASH_PIECE_BYTES - 1, 0, HASH_PIECE_BYTES + 1)]
    scratch = np.empty(max(p.size for p in pieces), dtype=np.uint8)

    def write(f):
        for p in pieces:
            scratch[:p.size] = p
            f.write(scratch[:p.size])
            scratch[:p.size] = 0  # the caller reuses its buffer: the hash has ended

    size, sha = store.create_file("k", write)
    whole = b"".join(p.tobytes() for p in pieces)
    assert size == len(whole) and sha == hashlib.sha256(whole).hexdigest()
    assert (tmp_path / "root" / "k").read_bytes() == whole


def test_a_failed_large_write_raises_and_counts_nothing():
    """The error of a write's second piece reaches the caller, and none of its bytes are
    counted (create_file then removes the file: its hash is never asked for)."""
    class FullAfterOne(io.RawIOBase):
        calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(data)

    raw = FullAfterOne()
    sink = _HashingWriter(raw)
    with pytest.raises(OSError, match="No space"):
        sink.write(bytes(2 * HASH_PIECE_BYTES))
    assert raw.calls == 2 and sink.size == 0


def test_large_local_objects_are_read_into_huge_pages_with_every_check(tmp_path, monkeypatch):
    """A local directory's object whose size the caller gives, from HUGE_MIN_BYTES on, is read
    into a buffer of its own (not obstore's): the same bytes, the same size checks before any
    byte is read, the same answers for a missing key and a directory, a file that grew
    refused, and the answer of obstore's read (NotFoundError) below that size."""
    from dcr_log import buffers
    from dcr_log.errors import WrongSize

    store = Store.open(tmp_path / "root", create=True)
    big = np.random.default_rng(5).integers(0, 256, buffers.HUGE_MIN_BYTES + 12345, dtype=np.uint8).tobytes()
    store.put_new("segments/1/a.arrow", big)
    got = store.get("segments/1/a.arrow", size=len(big))
    assert isinstance(got.obj, np.ndarray) and got.nbytes == len(big) and bytes(got) == big  # its own buffer
    assert got.readonly
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(big).hexdigest()
    small = store.get("segments/1/a.arrow", max_size=len(big))  # no size given: obstore's read
    assert not isinstance(small.obj, np.ndarray) and bytes(small) == big
    with pytest.raises(WrongSize):
        store.get("segments/1/a.arrow", size=len(big) + 1)
    with pytest.raises(NotFoundError):
        store.get("segments/1/missing.arrow", size=len(big))
    (tmp_path / "root" / "segments" / "1" / "dir.arrow").mkdir()
    with pytest.raises(NotFoundError):
        store.get("segments/1/dir.arrow", size=len(big))

    # A file that grew after its size was taken (os.fstat): the bytes past it are refused.
    import dcr_log.store as store_module

    path = tmp_path / "root" / "segments" / "1" / "a.arrow"
    path.write_bytes(big + b"more")
    real_fstat = os.fstat
    monkeypatch.setattr(store_module.os, "fstat", lambda fd: types.SimpleNamespace(st_size=len(big))
                        if real_fstat(fd).st_size == len(big) + 4 else real_fstat(fd))
    with pytest.raises(WrongSize):
        store.get("segments/1/a.arrow", size=len(big))
