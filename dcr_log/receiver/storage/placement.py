"""Placement: where a serving engine keeps each canonical tensor element, found through the
engine's own loader (spec/RECEIVER.md section 12). The model lives here, beside the placed
storage that writes through it; finding it (``dcr_log.engines.discovery``) sits above, with the
engines.

Engines do not hold the checkpoint's tensors: they fuse q, k and v (and gate and up) into one
parameter, keep a tensor-parallel slice per rank, pad the vocabulary, stack MoE experts and
sometimes transform values. Their ``load_weights(iterable of (name, tensor))`` knows all that.
``discover`` feeds it probe tensors whose words encode each element's global index (a few
rounds when indices are wider than a word), reads the parameters back and derives:

- **pieces**: per canonical tensor, affine maps from canonical flat indices to a parameter's
  flat indices where the loader copied bits unchanged. A piece is ``count`` runs of ``length``
  elements: run ``i`` covers canonical ``c0 + i*cstride ..`` and parameter ``p0 + i*pstride ..``
  (a row slice, a column slice of every row, a stacked expert, ...);
- **residual** parameters: written by the loader but not bit for bit (a cast, a scale), with
  the canonical tensors they are made from. Receivers rebuild them by calling the loader on
  the new canonical tensors.

A last round of pseudo-random words (NaN payloads, -0.0 and every other pattern included)
checks every piece: a loader that canonicalises NaNs or rounds makes its parameter residual.
Discovery overwrites the parameters: run it on a fresh engine instance (or before the engine
loads its weights). Pure computation plus the loader calls; no store I/O."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel
from dcr_log.errors import LayoutError, PlacementError, UsageError  # noqa: F401 (re-exported)
from dcr_log.state import TableLayout

PLACEMENT_FORMAT = "dcr-placement/1"       # run pieces only (written when it suffices)


PLACEMENT_FORMAT_BLOCKS = "dcr-placement/2"  # run pieces and blocks (PlacementPiece.dims)


PLACEMENT_FORMATS = (PLACEMENT_FORMAT, PLACEMENT_FORMAT_BLOCKS)


Loader = Callable[[Iterable[tuple[str, Any]]], Any]


@dataclass(frozen=True)
class PlacementPiece:
    """Elements of one canonical tensor copied bit for bit into ``param``.

    A *run piece* (``dims`` empty): ``count`` runs of ``length`` elements, run i is canonical
    [c0 + i*cstride, +length) -> param [p0 + i*pstride, +length) (a row slice, a column slice
    of every row, a stacked expert, ...).

    A *block* (``dims`` given; ``cstride``, ``pstride``, ``length`` and ``count`` are 0): the
    multi-dimensional affine map of a permuted or blocked layout. ``dims`` lists (size,
    canonical stride, parameter stride) by decreasing canonical stride, each stride larger
    than the span of the dimensions after it, so that a canonical offset has one digit per
    dimension: element (d_1 .. d_k) is canonical c0 + sum d_j cstride_j and parameter
    p0 + sum d_j pstride_j (a parameter stride may be negative)."""

    param: str
    c0: int
    cstride: int
    p0: int
    pstride: int
    length: int
    count: int
    dims: tuple[tuple[int, int, int], ...] = ()

    @staticmethod
    def block(param: str, c0: int, p0: int, dims) -> PlacementPiece:
        return PlacementPiece(param, int(c0), 0, int(p0), 0, 0, 0,
                     tuple((int(n), int(cs), int(ps)) for n, cs, ps in dims))

    @property
    def size(self) -> int:
        if self.dims:
            return math.prod(n for n, _, _ in self.dims)
        return self.length * self.count

    def map(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For canonical flat indices: which lie in the piece, and their parameter indices."""
        rel = flat - self.c0
        if self.dims:
            inside = rel >= 0
            pos = np.full(rel.shape, self.p0, dtype=np.int64)
            for n, cs, ps in self.dims:
                d = np.floor_divide(rel, cs)
                inside &= (d >= 0) & (d < n)
                rel = rel - d * cs
                pos += d * ps
            return inside & (rel == 0), pos
        if self.count == 1:
            inside = (rel >= 0) & (rel < self.length)
            return inside, rel + self.p0
        run = np.floor_divide(rel, self.cstride)
        col = rel - run * self.cstride
        inside = (rel >= 0) & (run < self.count) & (col < self.length)
        return inside, self.p0 + run * self.pstride + col

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Canonical starts and parameter starts of the runs (a run piece)."""
        i = np.arange(self.count, dtype=np.int64)
        return self.c0 + i * self.cstride, self.p0 + i * self.pstride

    def elements(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (canonical, parameter) index pair of the piece, in canonical order."""
        if not self.dims:
            c, p = self.runs()
            off = np.arange(self.length, dtype=np.int64)
            return (c[:, None] + off).reshape(-1), (p[:, None] + off).reshape(-1)
        c = np.array([self.c0], dtype=np.int64)
        p = np.array([self.p0], dtype=np.int64)
        for n, cs, ps in self.dims:
            d = np.arange(n, dtype=np.int64)
            c = (c[:, None] + d * cs).reshape(-1)
            p = (p[:, None] + d * ps).reshape(-1)
        return c, p

    def intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """The canonical elements of the piece as sorted disjoint [start, end) intervals."""
        if not self.dims:
            starts, _ = self.runs()
            return starts, starts + self.length
        if _dense(self.dims):
            return np.array([self.c0], np.int64), np.array([self.c0 + self.size], np.int64)
        c, _ = self.elements()
        brk = np.flatnonzero(np.diff(c) != 1) + 1
        starts = np.concatenate([c[:1], c[brk]])
        ends = np.concatenate([c[brk - 1] + 1, c[-1:] + 1])
        return starts, ends

    def with_param(self, param: str) -> PlacementPiece:
        return dataclasses.replace(self, param=param)

    def to_json(self) -> list:
        if self.dims:
            return [self.param, self.c0, self.p0, [list(d) for d in self.dims]]
        return [self.param, self.c0, self.cstride, self.p0, self.pstride, self.length, self.count]

    @staticmethod
    def from_json(obj) -> PlacementPiece:
        if isinstance(obj, list) and len(obj) == 4 and isinstance(obj[0], str):
            dims = obj[3]
            if (type(obj[1]) is int and type(obj[2]) is int and obj[1] >= 0 and obj[2] >= 0
                    and isinstance(dims, list) and dims
                    and all(isinstance(d, list) and len(d) == 3 and all(type(v) is int for v in d)
                            for d in dims)):
                return PlacementPiece.block(obj[0], obj[1], obj[2], dims)
        elif (isinstance(obj, list) and len(obj) == 7 and isinstance(obj[0], str)
                and all(type(v) is int and v >= 0 for v in obj[1:])):
            return PlacementPiece(*obj)
        raise PlacementError(f"placement: malformed piece {str(obj)[:80]}")


def _dense(dims) -> bool:
    """Whether a block's canonical elements are one contiguous range (a permutation of it)."""
    span = 1
    for n, cs, _ in reversed(dims):
        if cs != span:
            return False
        span *= n
    return True


def _block_ok(dims, csize: int, c0: int) -> bool:
    """Canonical strides decreasing, each larger than the span of the dimensions after it."""
    span = 0
    for n, cs, _ in reversed(dims):
        if n < 1 or cs < 1 or cs <= span:
            return False
        span += (n - 1) * cs
    return c0 + span < csize


def _pieces_from_runs(param: str, c: np.ndarray, p: np.ndarray, n: np.ndarray) -> list[PlacementPiece]:
    """Runs (canonical start, parameter start, length) in parameter order -> pieces, merging
    runs of one length whose canonical and parameter starts advance by constant strides."""
    out: list[PlacementPiece] = []
    i, total = 0, c.size
    while i < total:
        j = i + 1
        if j < total and n[j] == n[i]:
            dc, dp = c[j] - c[i], p[j] - p[i]
            if dc >= n[i] and dp >= n[i]:
                # extend while the strides hold (vectorised scan of the rest)
                k = np.arange(j, total)
                ok = (n[j:] == n[i]) & (c[j:] - c[i] == (k - i) * dc) & (p[j:] - p[i] == (k - i) * dp)
                bad = np.flatnonzero(~ok)
                j = total if bad.size == 0 else j + int(bad[0])
                out.append(PlacementPiece(param, int(c[i]), int(dc), int(p[i]), int(dp), int(n[i]), j - i))
                i = j
                continue
        out.append(PlacementPiece(param, int(c[i]), int(n[i]), int(p[i]), int(n[i]), int(n[i]), 1))
        i += 1
    return out


@dataclass
class Placement:
    """Where an engine keeps each canonical tensor, for one tensor table and one engine
    layout. ``params`` is the engine's layout (name -> (dtype, shape)); ``pieces`` maps a
    canonical tensor to its bit-exact pieces; ``residual`` a parameter to the canonical
    tensors its loader builds it from."""

    table: TableLayout
    params: TableLayout
    pieces: dict[str, list[PlacementPiece]] = field(default_factory=dict)
    residual: dict[str, list[str]] = field(default_factory=dict)

    # -- queries ---------------------------------------------------------------------------

    def residual_sources(self) -> set[str]:
        return {s for srcs in self.residual.values() for s in srcs}

    def used(self) -> set[str]:
        """Canonical tensors the engine holds (in pieces) or builds residuals from."""
        return {t for t, ps in self.pieces.items() if ps} | self.residual_sources()

    def check(self, table: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
              params: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> None:
        """Refuse (PlacementError) a table or engine layout this placement was not found for."""
        if table is not None and _norm(table) != self.table:
            diff = _diff(self.table, _norm(table))
            raise PlacementError(f"placement was discovered for another tensor table ({diff}): "
                                 "discover it again")
        if params is not None and _norm(params) != self.params:
            diff = _diff(self.params, _norm(params))
            raise PlacementError(f"placement was discovered for another engine layout ({diff}): "
                                 "discover it again")

    def describe(self) -> dict:
        exact = sum(p.size for ps in self.pieces.values() for p in ps)
        return {"tensors": len(self.table), "params": len(self.params),
                "pieces": sum(len(ps) for ps in self.pieces.values()), "exact_elements": exact,
                "residual_params": sorted(self.residual),
                "unused_tensors": sorted(set(self.table) - self.used())}

    # -- JSON ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": PLACEMENT_FORMAT_BLOCKS if any(p.dims for ps in self.pieces.values() for p in ps)
            else PLACEMENT_FORMAT,
            "table": [[n, d, list(s)] for n, (d, s) in sorted(self.table.items())],
            "params": [[n, d, list(s)] for n, (d, s) in sorted(self.params.items())],
            "pieces": {t: [p.to_json() for p in ps] for t, ps in sorted(self.pieces.items())},
            "residual": {p: sorted(s) for p, s in sorted(self.residual.items())},
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON: what a journal records to refuse another placement."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @staticmethod
    def from_json(obj: Any) -> Placement:
        if not isinstance(obj, dict) or obj.get("format") not in PLACEMENT_FORMATS:
            raise PlacementError(f"not a placement (expected format {' or '.join(map(repr, PLACEMENT_FORMATS))})")
        if obj["format"] == PLACEMENT_FORMAT and any(
                isinstance(p, list) and len(p) == 4 for ps in (obj.get("pieces") or {}).values()
                if isinstance(ps, list) for p in ps):
            raise PlacementError(f"placement: blocks in a {PLACEMENT_FORMAT} placement")
        try:
            table = {n: (d, tuple(s)) for n, d, s in obj["table"]}
            params = {n: (d, tuple(s)) for n, d, s in obj["params"]}
            pieces = {t: [PlacementPiece.from_json(p) for p in ps] for t, ps in obj["pieces"].items()}
            residual = {p: list(s) for p, s in obj["residual"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PlacementError("placement: malformed JSON") from None
        placement = Placement(table, params, pieces, residual)
        placement.validate()
        return placement

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: str | os.PathLike) -> Placement:
        try:
            return Placement.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise PlacementError(f"cannot read placement {path}: {exc}") from None

    def validate(self) -> None:
        """Every piece inside its tensor and parameter, of equal width; sources known."""
        for name, (dtype, shape) in list(self.table.items()) + list(self.params.items()):
            if dtype not in DTYPE_WIDTH or any(type(s) is not int or s < 0 for s in shape):
                raise PlacementError(f"placement: bad dtype or shape for {name!r}")
        for t, ps in self.pieces.items():
            if t not in self.table:
                raise PlacementError(f"placement: pieces for unknown tensor {t!r}")
            tn = numel(self.table[t][1])
            for p in ps:
                if p.param not in self.params:
                    raise PlacementError(f"placement: piece of {t!r} in unknown parameter {p.param!r}")
                pd, pshape = self.params[p.param]
                if DTYPE_WIDTH[pd] != DTYPE_WIDTH[self.table[t][0]]:
                    raise PlacementError(f"placement: {t!r} -> {p.param!r} changes the word width")
                if p.dims:
                    if not _block_ok(p.dims, tn, p.c0):
                        raise PlacementError(f"placement: malformed block of {t!r} (or outside it)")
                    lo = p.p0 + sum((n - 1) * ps for n, _, ps in p.dims if ps < 0)
                    hi = p.p0 + sum((n - 1) * ps for n, _, ps in p.dims if ps > 0)
                    if lo < 0 or hi >= numel(pshape):
                        raise PlacementError(f"placement: block of {t!r} lies outside {p.param!r}")
                    continue
                last = p.count - 1
                if p.length == 0 or p.count == 0 or (p.count > 1 and (p.cstride < p.length or p.pstride < p.length)):
                    raise PlacementError(f"placement: degenerate piece of {t!r}")
                if p.c0 + last * p.cstride + p.length > tn or p.p0 + last * p.pstride + p.length > numel(pshape):
                    raise PlacementError(f"placement: piece of {t!r} lies outside {t!r} or {p.param!r}")
        for param, srcs in self.residual.items():
            if param not in self.params or any(s not in self.table for s in srcs):
                raise PlacementError(f"placement: residual {param!r} names an unknown tensor")

    # -- combining -------------------------------------------------------------------------

    @staticmethod
    def merge(parts: Mapping[str, Placement]) -> Placement:
        """One placement for several engines kept side by side under name prefixes (for
        instance every tensor-parallel rank's parameters in one checkpoint directory)."""
        tables = {tuple(sorted(p.table.items())) for p in parts.values()}
        if len(tables) != 1:
            raise PlacementError("placements to merge were found for different tensor tables")
        first = next(iter(parts.values()))
        out = Placement(dict(first.table), {}, {}, {})
        for prefix, part in parts.items():
            out.params.update({prefix + n: v for n, v in part.params.items()})
            for t, ps in part.pieces.items():
                out.pieces.setdefault(t, []).extend(p.with_param(prefix + p.param) for p in ps)
            out.residual.update({prefix + n: list(s) for n, s in part.residual.items()})
        return out


def _norm(layout: Any) -> TableLayout:
    """A tensor table as name -> (dtype, shape): from a mapping of (dtype, shape), TensorInfos,
    a CommitRecord or a Placement's table."""
    if hasattr(layout, "tensors") and not isinstance(layout, Mapping):
        layout = layout.tensors
    items: Iterable[tuple[Any, Any]]
    if isinstance(layout, Mapping):
        items = layout.items()
    else:
        items = ((t.name, (t.dtype, t.shape)) for t in layout)
    out = {}
    for name, v in items:
        if hasattr(v, "dtype") and hasattr(v, "shape") and not isinstance(v, tuple):
            v = (v.dtype, v.shape)
        dtype, shape = v
        out[name] = (str(dtype), tuple(int(s) for s in shape))
    return dict(sorted(out.items(), key=lambda kv: kv[0].encode()))


def table_layout(table: Any) -> TableLayout:
    return _norm(table)


def _diff(a: TableLayout, b: TableLayout) -> str:
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"{name!r} missing"
        if name not in a:
            return f"{name!r} not expected"
        if a[name] != b[name]:
            return f"{name!r} is {b[name][0]} {list(b[name][1])}, expected {a[name][0]} {list(a[name][1])}"
    return "same"
