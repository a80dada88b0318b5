"""A version's shard layout, agreed by every rank: which rank writes each piece, that the
pieces cover each tensor exactly, and which layout changes a log allows between versions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dcr_log.coords import Box, numel
from dcr_log.digest import SUM_DIGESTS
from dcr_log.errors import UsageError
from dcr_log.format.tensors import TensorInfo
from dcr_log.state import describe_layout_change
from dcr_log.write.baseline import PieceKey, piece_key
from dcr_log.write.pieces import ShardPiece


@dataclass(frozen=True)
class ShardLayout:
    """The validated layout of one version: every tensor's dtype and shape, and which rank
    owns (writes) each piece. The same on every rank."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    owner: dict[PieceKey, int]

    def owned(self, rank: int) -> set[PieceKey]:
        return {k for k, r in self.owner.items() if r == rank}


def _summary(pieces: list[ShardPiece], shapes: Mapping[str, tuple[int, ...]], names: Sequence[str]) -> dict:
    named = set(names)  # (once: built per shape, it made the summary quadratic in the tensors)
    return {
        "names": sorted(names),
        "pieces": sorted((p.name, p.dtype, p.box.offset, p.box.shape) for p in pieces),
        "shapes": {k: tuple(int(s) for s in v) for k, v in shapes.items() if k in named},
    }


def validate_layout(summaries: list[dict], previous: Mapping[str, tuple[str, tuple[int, ...]]]) -> ShardLayout:
    """Check that the ranks' pieces cover every canonical element exactly once (identical
    boxes on several ranks are replicas, written by the lowest rank) with one dtype per
    tensor and shapes the ranks agree on. Deterministic: every rank reaches the same verdict."""
    for rank, s in enumerate(summaries):
        if s.get("error"):
            raise UsageError(f"rank {rank}: {s['error']}")
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, s in enumerate(summaries):
        for name, shape in s["shapes"].items():
            if shapes.setdefault(name, shape) != shape:
                raise UsageError(f"tensor {name!r}: ranks disagree on its shape ({shapes[name]} vs "
                                 f"{shape} on rank {rank})")
    names = sorted({n for s in summaries for n in s["names"]}, key=str.encode)
    dtypes: dict[str, str] = {}
    owner: dict[PieceKey, int] = {}
    boxes: dict[str, list[Box]] = {n: [] for n in names}
    for rank, s in enumerate(summaries):
        seen: set[PieceKey] = set()
        for name, dtype, offset, shape in s["pieces"]:
            if dtypes.setdefault(name, dtype) != dtype:
                raise UsageError(f"tensor {name!r}: shards of dtypes {dtypes[name]} and {dtype}")
            box = Box(tuple(offset), tuple(shape))
            key = piece_key(name, box)
            if key in seen:
                raise UsageError(f"tensor {name!r}: rank {rank} holds box {box} twice")
            seen.add(key)
            if key not in owner:
                owner[key] = rank
                boxes[name].append(box)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in names:
        shape = shapes.get(name)
        if shape is None and name in previous:
            shape = previous[name][1]
        if shape is None:
            raise UsageError(f"tensor {name!r} is new: give its canonical shape in shapes=")
        if name not in dtypes:
            if numel(shape):
                raise UsageError(f"tensor {name!r}: no rank holds any of its {numel(shape)} elements")
            if name not in previous:
                raise UsageError(f"tensor {name!r} is empty and new: give it as an empty shard")
            dtypes[name] = previous[name][0]
        check_cover(name, shape, boxes[name])
        tensors[name] = (dtypes[name], shape)
    return ShardLayout(tensors, owner)


def check_layout_change(version: int, tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                        previous: Mapping[str, tuple[str, tuple[int, ...]]], allowed: Sequence[bool]) -> None:
    """Refuse (UsageError) a version whose tensor table differs from its parent's unless every
    rank said so (``allowed``: each rank's allow_layout_change). One bounded line naming the
    first differences. Deterministic: every rank reaches the same verdict."""
    if version == 0 or all(allowed):
        return
    said = describe_layout_change(previous, tensors)
    if not said:
        return
    ranks = ""
    if any(allowed):
        missing = [r for r, a in enumerate(allowed) if not a]
        ranks = f" (not passed on rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}" \
                f"{', ...' if len(missing) > 8 else ''})"
    raise UsageError(f"version {version} would change the tensor table: {said}; pass "
                     f"allow_layout_change=True{ranks} (dcr append --allow-layout-change) if this is intended")


def check_cover(name: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The boxes lie inside ``shape``, do not overlap, and cover all of it (vectorised)."""
    for b in boxes:
        b.check_inside_or_usage(shape, name)
    live = [b for b in boxes if b.size]
    covered = sum(b.size for b in live)
    n = numel(shape)
    if len(live) > 1 and shape:
        lo = np.array([b.offset for b in live], dtype=np.int64)
        hi = lo + np.array([b.shape for b in live], dtype=np.int64)
        for i in range(0, len(live), 512):
            # box i overlaps box j when they overlap along every dimension
            meet = np.all((lo[i:i + 512, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[i:i + 512, None, :]),
                          axis=2)
            idx = np.arange(i, min(i + 512, len(live)))
            meet[np.arange(len(idx)), idx] = False
            if meet.any():
                a, b = np.argwhere(meet)[0]
                raise UsageError(f"tensor {name!r}: boxes {live[i + a]} and {live[b]} overlap")
    elif len(live) > 1:
        raise UsageError(f"tensor {name!r}: a 0-d tensor is held by two different boxes")
    if covered != n:
        raise UsageError(f"tensor {name!r}: shards cover {covered} of its {n} elements (a gap)")


def _kept(name: str, layout: ShardLayout, previous: Mapping[str, TensorInfo]) -> bool:
    """The tensor existed in the previous version with the same dtype and shape."""
    old = previous.get(name)
    return old is not None and (old.dtype, old.shape) == layout.tensors[name]


def _check_whole(layout: ShardLayout) -> None:
    """Logs without sum-digests need every tensor held whole by one rank (an xxh3 digest
    cannot be put together from parts)."""
    by_name: dict[str, list] = {}
    for (name, _offset, shape) in layout.owner:
        by_name.setdefault(name, []).append(shape)
    for name, (_dtype, shape) in layout.tensors.items():
        got = by_name.get(name, [])
        if numel(shape) and (len(got) != 1 or tuple(got[0]) != tuple(shape)):
            raise UsageError(f"tensor {name!r} is split over shards, but this log has xxh3 digests "
                             f"(no {SUM_DIGESTS} feature): only whole tensors can be written")
