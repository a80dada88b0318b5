"""What a sharded append keeps on a rank until its version is committed: the changes to apply
to the rank's baseline (scatters, fresh words, a new cache generation), the pieces' digest
changes, and the segments it wrote (deleted again when nothing references them)."""

from __future__ import annotations

import numpy as np

from dcr_log.codec.registry import decode_changes
from dcr_log.digest import MASK64
from dcr_log.format import Record
from dcr_log.log.records import gather_words, record_bases
from dcr_log.parallel import DEFAULT_WORKERS, map_ordered
from dcr_log.write.baseline import Generation, PieceKey, scatter_changes
from dcr_log.write.differ import BoxDelta
from dcr_log.write.pieces import ShardPiece


class Pending:
    """What a successful commit does to this rank's baseline: scatters of changed words into
    kept pieces, new words for pieces of new, reshaped or retyped tensors (into a new cache
    generation when there is a cache), and each piece's digest change (sum-digests).

    ``early``: the baseline's arrays when the encoding threads write the changed words into
    them as each chunk is encoded (Differ.diff_box's ``advance``); ``abort`` puts the words
    they replaced back: a version that is not committed leaves the baseline as it was. An xor
    record is undone from its own payload (decoded again: its positions, and the words before
    it from the words after it); other records keep copies of the words they replaced."""

    def __init__(self, composable: bool, kept: set[PieceKey], generation: Generation | None,
                 early: dict[PieceKey, np.ndarray] | None = None) -> None:
        self.composable = composable
        self.kept = kept
        self.generation = generation
        self.early = early
        # Per early write: (piece, start, its xor record, or the positions from start and the
        # words it replaced, with the record None).
        self.undo: list[tuple[PieceKey, int, Record | None, np.ndarray | None, np.ndarray | None]] = []
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
        if delta.positions is None:  # an xor record: its payload undoes it
            self.undo.append((piece.key, start, delta.record, None, None))
        else:
            self.undo.append((piece.key, start, None, delta.positions, delta.new_values))

    def add(self, piece: ShardPiece, start: int, delta: BoxDelta) -> None:
        key = piece.key
        if delta.digest_delta is not None:
            self.contrib[key] = (self.contrib.get(key, 0) + delta.digest_delta) & MASK64
        if delta.advanced:  # in the baseline already (and in ``undo``)
            return
        assert delta.new_values is not None  # (only an advanced delta lacks them)
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
            early = self.early

            def replaced(entry):
                key, start, record, positions, words = entry
                if record is None:
                    return key, start, positions, words
                words_after = early[key][start:]
                changes = decode_changes(record.kind, record.encoding, record.params, record.payload,
                                         record.box.size, record.n_changed, words_after.dtype)
                assert changes.positions is not None  # (an xor record)
                before = record_bases("xor", changes, gather_words(words_after, changes.positions), changes.values)
                return key, start, changes.positions, before

            scatters: dict[PieceKey, list] = {}
            for key, start, positions, words in map_ordered(replaced, undo, DEFAULT_WORKERS):
                scatters.setdefault(key, []).append((start, positions, words))
            scatter_changes(early, scatters)
        if self.generation is not None:
            self.generation.abort()
