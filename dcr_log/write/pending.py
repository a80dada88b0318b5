"""What a sharded append keeps on a rank until its version is committed: the changes to apply
to the rank's baseline (scatters, fresh words, a new cache generation), the pieces' digest
changes, and the segments it wrote (deleted again when nothing references them)."""

from __future__ import annotations

import numpy as np

from dcr_log.digest import MASK64
from dcr_log.write.baseline import Generation, PieceKey, scatter_changes
from dcr_log.write.differ import BoxDelta
from dcr_log.write.pieces import ShardPiece


class Pending:
    """What a successful commit does to this rank's baseline: scatters of changed words into
    kept pieces, new words for pieces of new, reshaped or retyped tensors (into a new cache
    generation when there is a cache), and each piece's digest change (sum-digests).

    ``early``: the baseline's arrays when the encoding threads write the changed words into
    them as each chunk is encoded (Differ.diff_box's ``advance``); the words they replaced are
    kept, and ``abort`` puts them back: a version that is not committed leaves the baseline as
    it was."""

    def __init__(self, composable: bool, kept: set[PieceKey], generation: Generation | None,
                 early: dict[PieceKey, np.ndarray] | None = None) -> None:
        self.composable = composable
        self.kept = kept
        self.generation = generation
        self.early = early
        # Per piece: (start, positions from start, the words the early writes replaced).
        self.undo: list[tuple[PieceKey, int, np.ndarray, np.ndarray]] = []
        # Per piece: (start, positions from start, new words); the offset is applied by the
        # scatter (a view from start), not by a pass over the positions here.
        self.scatters: dict[PieceKey, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        self.fresh: dict[PieceKey, np.ndarray] = {}  # the whole new words of a fresh piece (no cache)
        self.contrib: dict[PieceKey, int] = {}
        self.segment_keys: list[str] = []  # every segment this rank tried to write

    def advanced(self, piece: ShardPiece, start: int, delta: BoxDelta) -> None:
        """On the encoding thread, as soon as diff_box returns: the words an advanced delta
        replaced, kept for ``abort`` (a delta encoded but never taken by the caller, when an
        error stops the append, is undone too)."""
        assert delta.positions is not None
        self.undo.append((piece.key, start, delta.positions, delta.new_values))

    def add(self, piece: ShardPiece, start: int, delta: BoxDelta) -> None:
        key = piece.key
        if delta.digest_delta is not None:
            self.contrib[key] = (self.contrib.get(key, 0) + delta.digest_delta) & MASK64
        if delta.advanced:  # in the baseline already (and in ``undo``)
            return
        if delta.positions is None:
            # A tensor record: the chunk's words replace the baseline's (copied: the caller's
            # buffers may change after append returns).
            values = delta.new_values
            if key in self.kept:
                pos = np.arange(values.size, dtype=np.int64)
                self.scatters.setdefault(key, []).append((start, pos, np.array(values, copy=True)))
            # Otherwise the worker that encoded the chunk wrote it to the new cache generation
            # or to the piece's fresh words.
            return
        self.scatters.setdefault(key, []).append((start, delta.positions, delta.new_values))

    def abort(self) -> None:
        """The version is not committed: the early writes undone (once), a new cache
        generation dropped."""
        undo, self.undo = self.undo, []
        if undo and self.early is not None:
            scatters: dict[PieceKey, list] = {}
            for key, start, positions, replaced in undo:
                scatters.setdefault(key, []).append((start, positions, replaced))
            scatter_changes(self.early, scatters)
        if self.generation is not None:
            self.generation.abort()
