"""A model of what a power loss leaves of a checkpoint directory's safetensors files.

The model tracks, per file, its bytes as last made durable: after an msync of a map of it
(which writes every dirty page of the file, whoever dirtied it), and when a storage opens a
file it has not seen under that inode (written and fsynced, then renamed into place: a
layout change or a fresh checkpoint). A power loss then leaves each 4 KiB page of a file at
its durable bytes or at its current ones, chosen at random per page (a page written back by
the kernel or not).
The journal is LMDB, synced by each transaction: it is left as it is. ``boot`` is the id
the receiver reads for this boot; a power loss changes it, as a reboot does."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dcr_log.receiver.storage import checkpoint as ckpt_module

PAGE = 4096


class PowerLossModel:
    def __init__(self, monkeypatch, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.durable: dict[Path, tuple[int, bytes]] = {}  # path -> (inode, bytes on disk)
        self.boot = b"boot-0"
        self.losses = 0
        model = self
        real_msync, real_open = np.memmap.flush, ckpt_module.CheckpointStorage._open

        def msync(mapped) -> None:  # every page of the file is on disk after it
            real_msync(mapped)
            if mapped.filename is not None:
                model._record(Path(mapped.filename))

        def _open(storage) -> None:
            real_open(storage)
            for path in storage.files:
                known = model.durable.get(path)
                if known is None or known[0] != os.stat(path).st_ino:
                    model._record(path)

        monkeypatch.setattr(np.memmap, "flush", msync)
        monkeypatch.setattr(ckpt_module.CheckpointStorage, "_open", _open)
        monkeypatch.setattr("dcr_log.receiver.receiver.boot_id", lambda: model.boot)

    def _record(self, path: Path) -> None:
        self.durable[path] = (os.stat(path).st_ino, path.read_bytes())

    def unsynced_pages(self, directory: Path) -> int:
        """Pages whose current bytes differ from their durable ones."""
        n = 0
        for path, (_, disk) in self.durable.items():
            if path.parent == directory and path.exists():
                cur = path.read_bytes()
                n += sum(cur[i:i + PAGE] != disk[i:i + PAGE] for i in range(0, len(cur), PAGE))
        return n

    def lose_power(self, directory: Path) -> int:
        """Every file of ``directory`` left as a power loss may leave it (no receiver may be
        open on it); returns how many pages went back to their durable bytes."""
        lost = 0
        for path, (inode, disk) in list(self.durable.items()):
            if path.parent != directory or not path.exists() or os.stat(path).st_ino != inode:
                continue
            cur = bytearray(path.read_bytes())
            assert len(cur) == len(disk), "in-place writes never change a file's size"
            for i in range(0, len(cur), PAGE):
                if cur[i:i + PAGE] != disk[i:i + PAGE] and self.rng.random() < 0.5:
                    cur[i:i + PAGE] = disk[i:i + PAGE]
                    lost += 1
            path.write_bytes(bytes(cur))
            self._record(path)  # what is on disk now
        self.losses += 1
        self.boot = b"boot-%d" % self.losses
        return lost
