"""Replica checks of a sharded append: ranks that hold the same box of a tensor (data-parallel
copies, DTensor ``Replicate`` placements, HSDP's replicate dimension) must hold the same bits.

Only the lowest rank's copy is written, so a diverged replica would be lost silently. Every
holder hashes its copy (xxh3 of its words: one pass over the box, no extra collective: the
digests travel in the rank reports), and the coordinator refuses the version before its commit
when they differ."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from dcr_log.coords import Box
from dcr_log.write.baseline import PieceKey, piece_key
from dcr_log.write.outcomes import RankReport
from dcr_log.write.pieces import ShardPiece


def replicated_keys(summaries: Sequence[dict[str, Any]]) -> set[PieceKey]:
    """The boxes that more than one rank holds, from the ranks' layout summaries; none when
    every rank passed check_replicas=False."""
    if not any(s.get("check_replicas", True) for s in summaries):
        return set()
    holders: dict[PieceKey, int] = {}
    for s in summaries:
        for name, _dtype, offset, shape in s["pieces"]:
            key = piece_key(name, Box(tuple(offset), tuple(shape)))
            holders[key] = holders.get(key, 0) + 1
    return {k for k, n in holders.items() if n > 1}


class ReplicaHasher:
    """The xxh3 digests of this rank's replicated boxes, fed in row order."""

    def __init__(self, keys: Iterable[PieceKey]) -> None:
        self._hash = {k: xxhash.xxh3_64() for k in keys}

    def wants(self, key: PieceKey) -> bool:
        return key in self._hash

    def update(self, key: PieceKey, words: np.ndarray) -> None:
        self._hash[key].update(np.ascontiguousarray(words).data.cast("B"))

    def hash_pieces(self, pieces: Iterable[ShardPiece], chunk_elements: int) -> None:
        """Hash pieces this rank holds but does not write (a lower rank owns them)."""
        for p in pieces:
            for r0, r1 in p.chunks(chunk_elements):
                self.update(p.key, p.words(r0, r1))

    def digests(self) -> dict[PieceKey, int]:
        return {k: h.intdigest() for k, h in self._hash.items()}


def replica_mismatch(version: int, reports: Sequence[RankReport]) -> str | None:
    """The first replicated box whose holders' digests differ (in name and offset order), as
    the refusal's message; None when they all agree."""
    by_key: dict[PieceKey, dict[int, list[int]]] = {}
    for rank, rep in enumerate(reports):
        for key, digest in rep.replicas.items():
            by_key.setdefault(key, {}).setdefault(digest, []).append(rank)
    for key in sorted(by_key, key=lambda k: (k[0].encode(), k[1])):
        groups = by_key[key]
        if len(groups) < 2:
            continue
        name, offset, shape = key
        sides = sorted(groups.values())
        said = " vs ".join(_ranks(ranks) for ranks in sides[:4]) + (" vs ..." if len(sides) > 4 else "")
        return (f"version {version} not committed: tensor {name!r}: the replicas of box offset {list(offset)} "
                f"shape {list(shape)} differ ({said} hold different values); replicas must be equal (has a "
                "data-parallel rank diverged?). Pass check_replicas=False to log the lowest rank's copy")
    return None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
