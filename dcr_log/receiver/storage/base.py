"""The Storage interface: where a receiver's weights live, seen as flat little-endian words.

Three backends share one small interface (spec/RECEIVER.md, "Storage"):
- ``NumpyStorage``: a dict of numpy arrays (or TensorBits), updated in place;
- ``TorchStorage``: a dict of torch tensors on any device, updated in place through
  same-width signed integer views; positions and values go to the device, never whole tensors
  to the host;
- ``CheckpointStorage``: a safetensors checkpoint directory (one file or the sharded layout)
  updated in place through writable memory maps; durable.

A ``where`` is what ``dcr_log.delta.flat_positions`` returns: int64 flat indices or a slice."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dcr_log.coords import Box
from dcr_log.digest import XXH3, DigestScheme, box_digests
from dcr_log.errors import UsageError
from dcr_log.format.tensors import TensorInfo, state_digest
from dcr_log.parallel import DEFAULT_WORKERS, map_ordered
from dcr_log.state import TableLayout

Where = np.ndarray | slice


FaultHook = Callable[..., None]


_MISSING = object()


class Storage(ABC):
    """A receiver's tensors as flat words. ``durable`` storage survives the process."""

    durable = False
    # Whether the receiver may follow a version that changes the tensor table here (create,
    # drop, reshape, retype tensors). Mappings of the caller's own tensors (a model's
    # parameters) are not the receiver's to change unless it is opened with
    # ``layout_changes="own"``; such a version is then refused with LayoutError.
    owns_layout = True
    # The directory a version's files (feature files) are written to; None: the storage
    # holds tensors only and ignores files (memory storage).
    files_dir: Path | None = None
    # Set by the Receiver: called at named points so tests can inject faults.
    fault: FaultHook | None = None
    # Whether locate, gather, select and digest_at may run on several threads at once while
    # nothing writes (pass one classifies records on the pool's threads): host memory does.
    # Such a storage's tensor_words is a view of its words in host memory.
    parallel_reads = False
    # Durable storage whose flush may be deferred (RECEIVER.md, "Deferred sync"): the
    # Receiver sets ``deferred_sync`` when it keeps the written words in its journal until
    # ``sync``; ``flush`` is then a no-op.
    can_defer_sync = False
    deferred_sync = False
    # Set by the Receiver where it can defer: called when a sync fails, before the error.
    on_sync_error: Callable[[], None] | None = None

    @abstractmethod
    def layout(self) -> TableLayout:
        """Every tensor's safetensors dtype and shape."""

    @abstractmethod
    def locate(self, name: str, where: Where) -> Any:
        """A handle on some words of a tensor, reused by gather and write."""

    @abstractmethod
    def gather(self, place: Any) -> np.ndarray:
        """A host copy of the words at ``place`` (unsigned words of the tensor's width)."""

    @abstractmethod
    def write(self, place: Any, values: np.ndarray) -> None:
        """Store ``values`` (unsigned words) at ``place``."""

    def begin_writes(self, places: Sequence[Any]) -> None:
        """Before a batch's writes to these places (and before prepare_write), on the calling
        thread, changing no byte (a checkpoint's page-table entries dropped, so that its pages
        are faulted in for writing a folio at a time). Nothing to do by default."""

    def prepare_write(self, place: Any, count: int) -> None:
        """Ready what a write of ``count`` words at ``place`` will touch, changing no byte
        (a checkpoint file's pages faulted in for writing): the batch writer runs it on the
        pool while the journal syncs the batch's redo images. Nothing to do by default."""

    @abstractmethod
    def set_layout(self, layout: TableLayout) -> Any:
        """Create (zero-filled) or reshape tensors to match ``layout`` and drop the others;
        tensors whose dtype and shape already match keep their bits and identity.
        Returns what ``restore_layout`` needs to undo it (memory storage) or None."""

    def restore_layout(self, undo: Any) -> None:
        """Undo ``set_layout`` (memory storage only)."""
        raise UsageError(f"{type(self).__name__} cannot undo a layout change")

    def prepare_layout(self, layout: TableLayout, extra_bytes: int = 0) -> None:
        """Before the first write of an apply: make sure ``set_layout(layout)`` (and about
        ``extra_bytes`` more, the journal's) can be done, or raise StoreError. Memory storage
        allocates the new tensors here (kept for set_layout); durable storage checks free
        space. Writes nothing."""

    @abstractmethod
    def tensor_words(self, name: str) -> np.ndarray:
        """The tensor's flat words on the host (a view where the storage allows it)."""

    def tensor_digest(self, name: str, digests: DigestScheme = XXH3) -> int:
        """The tensor's digest under the log's scheme."""
        return digests.tensor(self.tensor_words(name), self.layout()[name][1])

    def flush(self) -> None:
        """Make every write so far durable (no-op in memory, and under deferred sync)."""

    def sync(self) -> None:
        """Make every write so far durable, deferred sync or not."""
        self.flush()

    def weight_names(self) -> set[str]:
        """Names in ``files_dir`` that hold tensors (never written as a version's files)."""
        return set()

    def close(self) -> None:
        pass

    # Storages that hold part of a tensor (engine layouts, tensor-parallel ranks) override
    # these three; a plain storage holds every element of every tensor.

    def holds(self, name: str) -> bool:
        """Whether the storage (with its group) holds the tensor at all."""
        return True

    def select(self, place: Any, values: np.ndarray) -> np.ndarray:
        """The record values for the positions ``place`` holds here."""
        return values

    def owned(self, place: Any, where: Where) -> tuple[Where, np.ndarray | None]:
        """The positions whose digest this storage adds to its group's sum, and their indices
        among the held words (None: all)."""
        return where, None

    def digest_at(self, place: Any, owned: Where, words: Any, digests: DigestScheme) -> int:
        """The digest of ``words`` (what gather gave, or targets computed from it) at the
        flat positions ``owned``."""
        return digests.at(owned, words)

    def host_words(self, place: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """Where ``place`` (from locate) is words of a tensor in host memory at flat indices,
        all of them this storage's own (``owned`` all, ``digest_at`` the scheme's): the
        tensor's flat words and the int64 indices, which a record's gather, targets and digest
        parts take in one C pass (records.classify_at). None: they are taken in turn."""
        return None

    def _fault(self, point: str, **info) -> None:
        if self.fault is not None:
            self.fault(point, **info)


def storage_state_digest(storage: Storage, digests: DigestScheme = XXH3, parallel: bool = True) -> int:
    """The state digest of what the storage holds, every tensor hashed (tensor_digests)."""
    layout = storage.layout()
    return state_digest([TensorInfo(n, d, s, digest) for (n, (d, s)), digest
                         in zip(layout.items(), tensor_digests(storage, list(layout), digests, parallel=parallel))])


def tensor_digests(storage: Storage, names: list[str], digests: DigestScheme = XXH3,
                   workers: int = DEFAULT_WORKERS, parallel: bool = True) -> list[int]:
    """Each named tensor's digest, on ``workers`` threads of the shared pool (the digests
    release the GIL). Where the scheme composes and the storage's words are host views
    (``parallel_reads``), in spans whose digests add up to the tensor's (digest.box_digests):
    a few large tensors then take every thread, not one each. (verify=sample's 14 tensors
    after an apply of 512 MiB of bf16: 1.3 ms in spans by tools/bench_apply.py --gib 0.5
    --verify sample --phases; 2.1-2.3 ms a tensor per task before, by the same apply's
    tools/phases.py timeline of NumpyStorage.tensor_digest.) Not
    ``parallel``: in order on this thread (an engine's storage may talk to its group)."""
    if not (parallel and digests.composable and storage.parallel_reads):
        return list(map_ordered(lambda name: storage.tensor_digest(name, digests), names, workers, parallel))
    words = [storage.tensor_words(name).reshape(-1) for name in names]
    return box_digests(digests, [(Box((0,), (w.size,)), (w.size,), w) for w in words], workers)
