"""Engine-layout storage: a receiver's view of an engine's parameters through a Placement
(spec/RECEIVER.md section 12).

``PlacedStorage`` presents the log's canonical tensors to the Receiver while the words live
in the engine's parameters (any Storage: numpy, torch, a checkpoint directory in the engine's
layout). A changed canonical element goes straight to its parameter position(s), a tied
weight's to each copy. Residual parameters (the loader transforms values) are rebuilt by
calling the engine's loader on a canonical copy of their source tensors (the *shadow*), which
the log's records update like any other storage.

In a tensor-parallel group each rank holds part of a tensor. Digests (sum scheme) are summed
over the elements a rank *owns* (those it holds that no lower rank holds) and added across
the group, so pre- and postconditions are checked without gathering a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dcr_log.coords import numel, word_dtype
from dcr_log.digest import MASK64, XXH3, DigestScheme, sum_at, sum_range, sum_runs
from dcr_log.errors import UsageError
from dcr_log.receiver.storage import Storage, Where
from dcr_log.receiver.storage.memory import NumpyStorage
from dcr_log.receiver.storage.placement import (
    LayoutError,
    Loader,
    Placement,
    PlacementError,
    PlacementPiece,
    table_layout,
)
from dcr_log.state import TableLayout, TensorBits

Rediscover = Callable[[TableLayout], Placement]


# -- interval sets of canonical flat indices (sorted, disjoint, as start and end arrays) -----

def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if starts.size == 0:
        return starts.astype(np.int64), ends.astype(np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return s[first].astype(np.int64), np.maximum.reduceat(e, first).astype(np.int64)


def _covered(s: np.ndarray, e: np.ndarray, points: np.ndarray) -> np.ndarray:
    i = np.searchsorted(s, points, side="right") - 1
    return (i >= 0) & (points < e[np.maximum(i, 0)]) if s.size else np.zeros(points.shape, dtype=bool)


def _subtract(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]):
    """Set difference a - b of two merged interval sets."""
    if b[0].size == 0 or a[0].size == 0:
        return a
    cuts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    lo, hi = cuts[:-1], cuts[1:]
    keep = _covered(*a, lo) & ~_covered(*b, lo)
    return _merge(lo[keep], hi[keep])


def _equal(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _size(a) -> int:
    return int((a[1] - a[0]).sum())


def _arange_of(intervals) -> np.ndarray:
    s, e = intervals
    if s.size == 0:
        return np.empty(0, dtype=np.int64)
    lens = e - s
    offs = np.repeat(s - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return np.arange(int(lens.sum()), dtype=np.int64) + offs


@dataclass
class _Target:
    storage: Storage
    param: str
    piece: PlacementPiece
    runs: tuple[np.ndarray, np.ndarray]   # its canonical intervals
    primary: tuple[np.ndarray, np.ndarray] | None = None  # what it digests (owned, not earlier)


@dataclass
class PlacedPlace:
    name: str
    where: np.ndarray            # canonical flat indices held here, in record order
    held: np.ndarray | None      # their indices among the record's positions (None: all)
    gather_plan: list            # (storage, handle, indices into held or None)
    write_plan: list
    owned: np.ndarray | None     # indices into held of the owned ones (None: all)


class PlacedStorage(Storage):
    """The canonical tensors of ``placement.table`` seen through an engine's parameters."""

    def __init__(self, engine: Storage, placement: Placement, group: Any = None,
                 shadow: Storage | None = None, loader: Loader | None = None,
                 loader_params: Mapping[str, Any] | None = None, rediscover: Rediscover | None = None,
                 to_loader: Callable[[TensorBits], Any] | None = None):
        from dcr_log.collective import LocalGroup, as_group

        self.engine = engine
        # No group: this process alone (without importing torch.distributed).
        self.group = LocalGroup() if group is None else as_group(group)
        self.durable = engine.durable
        if self.durable and self.group.size > 1:
            raise UsageError("durable engine-layout receivers hold every rank's parameters in one "
                             "process (Placement.merge); a tensor-parallel group needs memory storage")
        self.loader = loader
        self.loader_params = loader_params
        self.rediscover = rediscover
        self.to_loader = to_loader or _torch_tensor
        self.shadow = shadow
        self._residual_undo: dict[str, np.ndarray] | None = None
        self._install(placement)

    # -- placement -------------------------------------------------------------------------

    def _install(self, placement: Placement) -> None:
        engine_layout = self.engine.layout()
        for name, meta in placement.params.items():
            if engine_layout.get(name) != meta:
                got = engine_layout.get(name)
                raise PlacementError(f"placement was discovered for another engine layout: parameter "
                                     f"{name!r} is {'missing' if got is None else f'{got[0]} {list(got[1])}'}, "
                                     f"expected {meta[0]} {list(meta[1])}")
        if placement.residual and self.loader is None:
            raise UsageError("the placement has residual parameters "
                             f"({', '.join(sorted(placement.residual)[:3])}): pass the engine's loader")
        sources = placement.residual_sources()
        if sources:
            if self.shadow is None:
                self.shadow = NumpyStorage({})
            have = self.shadow.layout()
            missing = {s: placement.table[s] for s in sources if have.get(s) != placement.table[s]}
            self._shadow_pending = missing  # filled at bind (or a layout change delivers them)
        else:
            self._shadow_pending = {}
        self.placement = placement
        targets: dict[str, list[_Target]] = {}
        for t, pieces in placement.pieces.items():
            for p in pieces:
                targets.setdefault(t, []).append(_Target(self.engine, p.param, p, _merge(*p.intervals())))
        for s in sorted(sources):
            n = numel(placement.table[s][1])
            if n:
                assert self.shadow is not None  # made above when there are sources
                targets.setdefault(s, []).append(
                    _Target(self.shadow, s, PlacementPiece(s, 0, n, 0, n, n, 1),
                            (np.array([0], np.int64), np.array([n], np.int64))))
        self._targets = targets
        self._ownership()

    def _ownership(self) -> None:
        """Which canonical elements this rank owns, and that the group covers every tensor it
        holds (collective)."""
        table = self.placement.table
        mine = {}
        for t, targets in self._targets.items():
            s = np.concatenate([tg.runs[0] for tg in targets])
            e = np.concatenate([tg.runs[1] for tg in targets])
            mine[t] = _merge(s, e)
        every = self.group.all_gather(mine) if self.group.size > 1 else [mine]
        rank = self.group.rank
        self._held: set[str] = set()
        self._owned: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, (_dtype, shape) in table.items():
            n = numel(shape)
            parts = [ranks.get(t) for ranks in every]
            if all(p is None or p[0].size == 0 for p in parts):
                continue  # no rank holds it: the engine does not use this tensor
            union = _merge(np.concatenate([p[0] for p in parts if p is not None]),
                           np.concatenate([p[1] for p in parts if p is not None]))
            if not _equal(union, (np.array([0]), np.array([n]))):
                gap = _subtract((np.array([0]), np.array([n])), union)
                raise PlacementError(f"tensor {t!r}: elements {int(gap[0][0])}..{int(gap[1][0])} of {n} "
                                     f"are held by no rank of the group, so its digests cannot be "
                                     "checked (every rank of the tensor-parallel group must take part)")
            self._held.add(t)
            m = mine.get(t, (np.empty(0, np.int64), np.empty(0, np.int64)))
            lower = [p for p in parts[:rank] if p is not None]
            if lower:
                below = _merge(np.concatenate([p[0] for p in lower]), np.concatenate([p[1] for p in lower]))
                m = _subtract(m, below)
            self._owned[t] = m
            done = (np.empty(0, np.int64), np.empty(0, np.int64))
            for tg in self._targets.get(t, []):
                prim = _subtract(_intersect(tg.runs, m), done)
                tg.primary = prim
                done = _merge(np.concatenate([done[0], prim[0]]), np.concatenate([done[1], prim[1]]))

    def whole(self) -> bool:
        """Whether this process holds every element of every tensor it holds (no group)."""
        return self.group.size == 1

    def holds(self, name: str) -> bool:
        """Whether the group holds the tensor (every rank answers alike)."""
        return name in self._held

    # -- Storage ---------------------------------------------------------------------------

    def layout(self) -> TableLayout:
        return dict(self.placement.table)

    def locate(self, name: str, where: Where) -> PlacedPlace:
        if isinstance(where, slice):
            f = np.arange(where.start or 0, where.stop, dtype=np.int64)
        else:
            f = np.asarray(where, dtype=np.int64)
        targets = self._targets.get(name, [])
        if len(targets) == 1:
            inside, p = targets[0].piece.map(f)
            if inside.all():
                tg = targets[0]
                owned = None if _size(self._owned[name]) == _size(tg.runs) else \
                    np.flatnonzero(_covered(*self._owned[name], f))
                handle = tg.storage.locate(tg.param, p)
                return PlacedPlace(name, f, None, [(tg.storage, handle, None)],
                                   [(tg.storage, handle, None)], owned)
        held = np.zeros(f.size, dtype=bool)
        maps = []
        for tg in targets:
            inside, p = tg.piece.map(f)
            maps.append((tg, inside, p))
            held |= inside
        held_idx = np.flatnonzero(held)
        rank_of = np.cumsum(held) - 1
        gplan, wplan = [], []
        first = np.zeros(f.size, dtype=bool)
        for tg, inside, p in maps:
            if not inside.any():
                continue
            new = inside & ~first
            first |= inside
            wplan.append((tg.storage, tg.storage.locate(tg.param, p[inside]), rank_of[inside]))
            if new.any():
                gplan.append((tg.storage, tg.storage.locate(tg.param, p[new]), rank_of[new]))
        fh = f[held_idx]
        owned_mask = _covered(*self._owned.get(name, (np.empty(0, np.int64),) * 2), fh)
        owned = None if owned_mask.all() else np.flatnonzero(owned_mask)
        return PlacedPlace(name, fh, held_idx, gplan, wplan, owned)

    def gather(self, place: PlacedPlace) -> np.ndarray:
        dtype = word_dtype(self.placement.table[place.name][0])
        if len(place.gather_plan) == 1 and place.gather_plan[0][2] is None:
            st, h, _ = place.gather_plan[0]
            return np.asarray(st.gather(h), dtype=dtype)
        out = np.empty(place.where.size, dtype=dtype)
        for st, h, idx in place.gather_plan:
            out[idx] = st.gather(h)
        return out

    def write(self, place: PlacedPlace, values: np.ndarray) -> None:
        for st, h, idx in place.write_plan:
            st.write(h, values if idx is None else values[idx])

    def select(self, place: PlacedPlace, values: np.ndarray) -> np.ndarray:
        return values if place.held is None else values[place.held]

    def owned(self, place: PlacedPlace, where: Where) -> tuple[np.ndarray, np.ndarray | None]:
        return (place.where if place.owned is None else place.where[place.owned]), place.owned

    def tensor_words(self, name: str) -> np.ndarray:
        if self.group.size > 1 or _size(self._owned.get(name, (np.zeros(0), np.zeros(0)))) != numel(
                self.placement.table[name][1]):
            raise UsageError(f"tensor {name!r} is not held whole by this rank")
        return self.gather(self.locate(name, slice(0, numel(self.placement.table[name][1]))))

    def tensor_digest(self, name: str, digests: DigestScheme = XXH3) -> int:
        """This rank's part of the tensor's digest: the sum over the elements it owns (the
        whole tensor's digest for a scheme that does not compose)."""
        if not digests.composable:
            return digests.tensor(self.tensor_words(name), self.placement.table[name][1])
        total = 0
        for tg in self._targets.get(name, []):
            prim = tg.primary
            if prim is None or prim[0].size == 0:
                continue
            p = tg.piece
            if _equal(prim, tg.runs) and p.dims:
                c, pos = p.elements()
                total += sum_at(c, tg.storage.gather(tg.storage.locate(tg.param, pos)))
            elif _equal(prim, tg.runs):
                words = tg.storage.tensor_words(tg.param)
                if p.count == 1:
                    total += sum_range(p.c0, words[p.p0:p.p0 + p.length])
                else:
                    w = words.itemsize
                    view = np.lib.stride_tricks.as_strided(words[p.p0:], (p.count, p.length),
                                                           (p.pstride * w, w))
                    total += sum_runs(p.runs()[0], p.length, view)
            else:
                f = _arange_of(prim)
                inside, pos = p.map(f)
                total += sum_at(f, tg.storage.gather(tg.storage.locate(tg.param, pos)))
        return total & MASK64

    def set_layout(self, layout: TableLayout) -> Any:
        if table_layout(layout) == self.placement.table:
            return None
        new = self._next
        old = (self.placement, self._targets, self._held, self._owned)
        self._adopt(new)
        return old

    def restore_layout(self, undo: Any) -> None:
        if undo is not None:
            self.placement, self._targets, self._held, self._owned = undo

    def prepare_layout(self, layout: TableLayout, extra_bytes: int = 0) -> None:
        layout = table_layout(layout)
        if layout == self.placement.table:
            self.engine.prepare_layout(self.engine.layout(), extra_bytes)
            return
        old = self.placement.table
        what = _describe_change(old, layout)
        if self.rediscover is None:
            raise LayoutError(f"the version changes the tensor table ({what}): this engine receiver "
                              "follows it only with rediscover= (a placement for the new table)")
        if self.durable:
            raise LayoutError(f"the version changes the tensor table ({what}): a durable engine-layout "
                              "receiver does not follow layout changes; discover and bind again")
        try:
            new = self.rediscover(layout)
        except PlacementError as exc:
            raise LayoutError(f"the version changes the tensor table ({what}) and the engine's loader "
                              f"cannot place it: {exc}") from None
        new.check(table=layout)
        used = self.placement.used()
        for name in sorted(used):
            if name not in layout:
                raise LayoutError(f"the version drops tensor {name!r}, which the engine's parameters "
                                  "hold: they would keep a stale value")
        changed = {n for n in layout if old.get(n) != layout[n]}
        for s in new.residual_sources():
            if s not in changed and s not in self.placement.residual_sources():
                raise LayoutError(f"the new placement rebuilds parameters from {s!r}, which this "
                                  "receiver holds no canonical copy of; bind again")
        self._next = new

    def _adopt(self, new: Placement) -> None:
        shadow_layout = dict(self.shadow.layout()) if self.shadow is not None else {}
        want = {s: new.table[s] for s in new.residual_sources()}
        if self.shadow is None and want:
            self.shadow = NumpyStorage({})
        if want or shadow_layout:
            # Reshaped or new sources start zero-filled; their tensor records fill them.
            assert self.shadow is not None
            self.shadow.set_layout(want)
        self._install(new)

    def flush(self) -> None:
        self.engine.flush()
        if self.shadow is not None:
            self.shadow.flush()

    def close(self) -> None:
        self.engine.close()
        if self.shadow is not None:
            self.shadow.close()

    # -- the shadow and residual parameters ------------------------------------------------

    def shadow_needs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Residual sources the shadow does not hold yet (filled by ``fill_shadow`` at bind)."""
        return dict(self._shadow_pending)

    def fill_shadow(self, state: Mapping[str, TensorBits]) -> None:
        need = self.shadow_needs()
        if not need:
            return
        assert self.shadow is not None  # residual sources exist only with a shadow
        self.shadow.set_layout({**self.shadow.layout(), **need})
        for name in need:
            n = numel(need[name][1])
            if n:
                self.shadow.write(self.shadow.locate(name, slice(0, n)), state[name].words)
        self.shadow.flush()
        self._shadow_pending = {}
        self._install(self.placement)

    def rebuild_residuals(self, tensors: set[str] | None) -> list[str]:
        """Call the engine's loader on the shadow copies of the sources of every residual
        parameter fed by ``tensors`` (None: all of them). Memory storage keeps the old words
        for ``abort``."""
        todo = {p: srcs for p, srcs in self.placement.residual.items()
                if tensors is None or tensors.intersection(srcs)}
        if not todo:
            return []
        if not self.durable:
            self._residual_undo = {p: np.array(self.engine.tensor_words(p)) for p in todo}
        sources = sorted({s for srcs in todo.values() for s in srcs})
        table = self.placement.table

        def feed():
            for s in sources:
                dtype, shape = table[s]
                words = self.shadow.tensor_words(s)
                yield s, self.to_loader(TensorBits(dtype, shape, np.asarray(words)))
        assert self.loader is not None  # a placement with residuals needs one (checked at install)
        self.loader(feed())
        if self.loader_params is not None:
            # The loader wrote another engine's parameters (a scratch instance): copy them.
            from dcr_log.state import to_bits
            for p in sorted(todo):
                n = numel(self.placement.params[p][1])
                if n:
                    self.engine.write(self.engine.locate(p, slice(0, n)), to_bits(self.loader_params[p]).words)
        return sorted(todo)

    def abort(self) -> None:
        """Memory storage: take rebuilt residual parameters back to their old words."""
        if self._residual_undo:
            for p, words in self._residual_undo.items():
                if words.size:
                    self.engine.write(self.engine.locate(p, slice(0, words.size)), words)
        self._residual_undo = None

    def forget_undo(self) -> None:
        self._residual_undo = None


def _intersect(a, b):
    """a ∩ b of two merged interval sets."""
    return _subtract(a, _subtract(a, b))


def _torch_tensor(bits: TensorBits):
    from dcr_log.state import to_torch
    return to_torch(bits)


def _describe_change(old: TableLayout, new: TableLayout) -> str:
    added = sorted(set(new) - set(old))
    dropped = sorted(set(old) - set(new))
    changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
    parts = []
    for label, names in (("adds", added), ("drops", dropped), ("reshapes or retypes", changed)):
        if names:
            parts.append(f"{label} {', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''}")
    return "; ".join(parts) or "no change"
