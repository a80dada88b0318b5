"""What a rank says it holds: ``Shard`` (a box, a flat range or a converter's output of one
canonical tensor), and the ``ShardPiece`` boxes they resolve to, checked against the canonical
shapes this rank knows."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dcr_log.coords import Box, flat_range_boxes, numel
from dcr_log.errors import UsageError
from dcr_log.state import TensorBits, check_name, dtype_of, is_dtensor, to_bits
from dcr_log.write.baseline import PieceKey, piece_key


class Shard:
    """Part of one canonical tensor held by this rank.

    ``Shard(tensor, offset)``: ``tensor`` (numpy, torch on any device, or TensorBits; possibly a
    view into a larger local buffer) is the box of the canonical tensor that starts at
    ``offset`` (default: the origin) and has ``tensor.shape``.
    """

    __slots__ = ("tensor", "offset", "start", "convert", "kind", "global_shape")

    def __init__(self, tensor: Any, offset: Sequence[int] | None = None):
        if is_dtensor(tensor):
            raise UsageError(DTENSOR_SHARD)
        rank = len(tuple(tensor.shape))
        self.tensor = tensor
        at = (0,) * rank if offset is None else tuple(int(o) for o in offset)
        if len(at) != rank:
            raise UsageError(f"shard offset {at} has rank {len(at)}, its tensor {rank}")
        # None for a flat shard, and for a converter's box at the origin.
        self.offset: tuple[int, ...] | None = at
        self.start: int | None = None
        self.convert: Callable[[], Any] | None = None
        self.kind = "xor"
        # The canonical tensor's shape when the shard knows it (a DTensor's): shapes= not needed.
        self.global_shape: tuple[int, ...] | None = None

    @staticmethod
    def from_dtensor(dt: Any, dtype: Any = None) -> Shard:
        """This rank's shard of a torch DTensor (FSDP2, tensor parallel, HSDP): its local tensor
        at the global offset its placements give, read at every append (converted to ``dtype``
        first when given). See dcr_log.dtensor."""
        from dcr_log.dtensor import shard_from_dtensor

        return shard_from_dtensor(dt, dtype)

    @staticmethod
    def lazy(fn: Callable[[], Any], offset: Sequence[int] | None = None) -> Shard:
        """A box whose local tensor ``fn()`` returns at every append (a cast of a parameter,
        a DTensor's local tensor), logged like any box: xor records (or the append's kind)."""
        shard = Shard.converted(fn, offset)
        shard.kind = "xor"
        return shard

    @staticmethod
    def flat(tensor1d: Any, start: int) -> Shard:
        """Elements ``start .. start + numel`` of the canonical tensor's row-major order (an
        FSDP flat shard): ``tensor1d`` is one-dimensional."""
        if len(tuple(tensor1d.shape)) != 1:
            raise UsageError("Shard.flat takes a one-dimensional tensor")
        shard = Shard(tensor1d, (0,))
        shard.offset = None
        shard.start = int(start)
        return shard

    @staticmethod
    def converted(fn: Callable[[], Any], offset: Sequence[int] | None = None) -> Shard:
        """A residual: ``fn()`` returns, at every append, the canonical box (a tensor) that
        starts at ``offset``: a rotary permutation, a transposed or requantised export, a
        tensor that exists only after a conversion. Its changes are logged as ``overwrite``
        records (the path from local state does not preserve bits), or ``tensor`` records
        when its dtype or shape changes."""
        shard = Shard.__new__(Shard)
        shard.tensor = None
        shard.offset = None if offset is None else tuple(int(o) for o in offset)
        shard.start = None
        shard.convert = fn
        shard.kind = "overwrite"
        shard.global_shape = None
        return shard

    def __repr__(self) -> str:
        if getattr(self, "convert", None) is not None:
            how = "lazy" if self.kind == "xor" else "converted"
            return f"Shard.{how}({self.convert!r}, offset={self.offset})"
        if getattr(self, "start", None) is not None:
            return f"Shard.flat(<{tuple(self.tensor.shape)}>, start={self.start})"
        return f"Shard(<{tuple(self.tensor.shape)}>, offset={self.offset})"


@dataclass
class ShardPiece:
    """One box of a canonical tensor with the local tensor that holds it (shape == box.shape)."""

    name: str
    box: Box
    dtype: str
    source: Any
    kind: str

    @functools.cached_property
    def key(self) -> PieceKey:
        # Asked for many times a piece in each append (the layout, the cache, the digests): built once.
        return piece_key(self.name, self.box)

    @property
    def row(self) -> int:
        return numel(self.box.shape[1:]) if self.box.shape else 1

    def chunks(self, chunk_elements: int) -> list[tuple[int, int]]:
        """Row ranges [r0, r1) of at most ``chunk_elements`` elements (a row is never split)."""
        if self.box.size == 0:
            return []
        if not self.box.shape:
            return [(0, 1)]
        rows = max(1, chunk_elements // max(self.row, 1))
        return [(r, min(r + rows, self.box.shape[0])) for r in range(0, self.box.shape[0], rows)]

    def words(self, r0: int, r1: int) -> np.ndarray:
        """Host words of rows [r0, r1) in row-major order (copied only when the source is not
        a contiguous host array: a strided view, a torch tensor on a device)."""
        if isinstance(self.source, _TypedWords):
            bits = self.source.rows(r0, r1)
        else:
            bits = to_bits(self.source if not self.box.shape else self.source[r0:r1])
        if bits.dtype != self.dtype:
            raise UsageError(f"{self.name}: a shard changed dtype from {self.dtype} to {bits.dtype}")
        return bits.words

    def sub_box(self, r0: int, r1: int) -> Box:
        if not self.box.shape:
            return self.box
        return Box((self.box.offset[0] + r0,) + self.box.offset[1:], (r1 - r0,) + self.box.shape[1:])


def _pieces(name: str, shard: Shard, shape: tuple[int, ...] | None) -> list[ShardPiece]:
    tensor, kind = shard.tensor, shard.kind
    if shard.convert is not None:
        tensor = shard.convert()
        if tensor is None or not hasattr(tensor, "shape"):
            raise UsageError(f"{name}: the converter returned {type(tensor).__name__}, not a tensor")
        if is_dtensor(tensor):
            raise UsageError(f"{name}: the converter returned a DTensor, not this rank's box of the tensor: "
                             "return its local tensor (Shard.from_dtensor(dt) gives it with its offset)")
    dtype = dtype_of(tensor)
    local_shape = tuple(int(s) for s in tensor.shape)
    if isinstance(tensor, TensorBits):  # words with a dtype: sliced like an array below
        tensor = _TypedWords(tensor.words.reshape(local_shape), dtype)
    if shard.start is not None:
        if shape is None:
            raise UsageError(f"{name}: a flat shard needs the tensor's canonical shape (shapes=)")
        n = local_shape[0]
        pieces, at = [], 0
        for box in flat_range_boxes(shape, shard.start, shard.start + n):
            part = tensor[at:at + box.size].reshape(box.shape)
            pieces.append(ShardPiece(name, box, dtype, part, kind))
            at += box.size
        return pieces
    offset = shard.offset if shard.offset is not None else (0,) * len(local_shape)
    if len(offset) != len(local_shape):
        raise UsageError(f"{name}: offset {offset} does not match a tensor of rank {len(local_shape)}")
    return [ShardPiece(name, Box(offset, local_shape), dtype, tensor, kind)]


class _TypedWords:
    """TensorBits' words with their dtype, sliceable by rows like an array."""

    def __init__(self, words: np.ndarray, dtype: str):
        self.words, self.dtype, self.shape = words, dtype, words.shape

    def __getitem__(self, item) -> _TypedWords:
        return _TypedWords(self.words[item], self.dtype)

    def reshape(self, shape) -> _TypedWords:
        return _TypedWords(self.words.reshape(shape), self.dtype)

    def rows(self, r0: int, r1: int) -> TensorBits:
        w = self.words[r0:r1] if self.words.ndim else self.words
        return TensorBits(self.dtype, tuple(w.shape), np.ascontiguousarray(w).reshape(-1))


DTENSOR_SHARD = ("Shard() was given a DTensor (a rank's part of a tensor sharded over a device mesh), whose "
                 "offset it cannot know: use Shard.from_dtensor(dt) (or dcr_log.dtensor.shards_from_module)")


def _dtensor_value(name: str) -> str:
    return (f"{name}: a DTensor where Shards go: give [Shard.from_dtensor(dt)] (its local tensor at its "
            "global offset), or dcr_log.dtensor.shards_from_module(model) for a whole module")


def shard_lists(shards: Mapping[str, Sequence[Shard] | Shard]) -> dict[str, list[Shard]]:
    """The shards by canonical name, checked for their types only (nothing is read or
    converted): UsageError for anything but Shards, a DTensor included."""
    if not isinstance(shards, Mapping):
        raise UsageError("shards must map canonical names to lists of Shard")
    out: dict[str, list[Shard]] = {}
    for name, lst in shards.items():
        check_name(name)
        if is_dtensor(lst):
            raise UsageError(_dtensor_value(name))
        items = [lst] if isinstance(lst, Shard) else lst
        for shard in items:
            if is_dtensor(shard):
                raise UsageError(_dtensor_value(name))
            if not isinstance(shard, Shard):
                raise UsageError(f"{name}: expected Shard objects, got {type(shard).__name__}")
        out[name] = list(items)
    return out


def carried_shapes(shards: Mapping[str, list[Shard]],
                   shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with the canonical shapes the shards carry (a DTensor's); UsageError when
    they disagree with each other or with ``shapes``."""
    out = dict(shapes)
    for name, lst in shards.items():
        for shard in lst:
            if shard.global_shape is None:
                continue
            if out.setdefault(name, shard.global_shape) != shard.global_shape:
                raise UsageError(f"tensor {name!r}: a shard of a tensor of shape {shard.global_shape}, but its "
                                 f"shape is given as {out[name]}")
    return out


def resolve_pieces(shards: Mapping[str, Sequence[Shard] | Shard],
                   shapes: Mapping[str, tuple[int, ...]]) -> list[ShardPiece]:
    """This rank's shards as pieces, checked against the canonical shapes it knows."""
    out: list[ShardPiece] = []
    for name, lst in shard_lists(shards).items():
        for shard in lst:
            shape = shapes.get(name)
            for piece in _pieces(name, shard, None if shape is None else tuple(shape)):
                if shape is not None:
                    piece.box.check_inside_or_usage(tuple(shape), name)
                out.append(piece)
    return out
