"""Placement discovery through the engine's own loader: probe tensors whose bits encode each
element's index are fed to ``load_weights`` and read back from the engine's parameters, giving
the affine map (a ``Placement``) from canonical coordinates to engine storage; elements the
loader did not preserve are residual (DESIGN.md section 5, "Placement through the engine's
own loader")."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dcr_log.coords import DTYPE_WIDTH, numel, word_dtype
from dcr_log.digest import GOLDEN, mix64_into
from dcr_log.errors import LayoutError, PlacementError, UsageError  # noqa: F401 (re-exported)
from dcr_log.receiver.storage.placement import Loader, Placement, PlacementPiece, _block_ok, _norm, _pieces_from_runs


class _ParamWords:
    """Host access to one engine parameter's flat words: zero it, read it."""

    def __init__(self, name: str, value: Any, dtype: str | None):
        self.name = name
        self.value = value
        from dcr_log.state import is_torch_tensor
        self.torch = is_torch_tensor(value)
        if self.torch:
            from dcr_log.state import _TORCH_TO_DTYPE
            found = _TORCH_TO_DTYPE.get(str(value.dtype))
            self.shape = tuple(int(s) for s in value.shape)
            self.key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.numel())
        else:
            from dcr_log.state import _NUMPY_TO_DTYPE
            arr = value
            if not isinstance(arr, np.ndarray):
                raise PlacementError(f"parameter {name!r}: expected a torch tensor or numpy array")
            found = dtype or _NUMPY_TO_DTYPE.get(arr.dtype.name)
            self.shape = tuple(int(s) for s in arr.shape)
            self.key = (arr.__array_interface__["data"][0], 0, arr.size)
        if found is None:
            raise PlacementError(f"parameter {name!r}: unsupported dtype {value.dtype}")
        self.dtype: str = found
        self.width = DTYPE_WIDTH[self.dtype]
        self.size = numel(self.shape)

    def zero(self) -> None:
        if self.torch:
            import torch
            with torch.no_grad():
                self.value.zero_()
        else:
            self.value[...] = 0

    def restore(self, words: np.ndarray) -> None:
        if self.size == 0:
            return
        if self.torch:
            import torch
            with torch.no_grad():
                src = torch.from_numpy(words.view(np.uint8)).view(self.value.dtype).reshape(self.value.shape)
                self.value.copy_(src)
        else:
            if not self.value.flags.c_contiguous:
                raise PlacementError(f"parameter {self.name!r}: arrays must be C-contiguous")
            self.value.reshape(-1).view(words.dtype)[...] = words

    def read(self) -> np.ndarray:
        if self.torch:
            import torch
            t = self.value.detach()
            if t.numel() == 0:
                return np.empty(0, dtype=word_dtype(self.dtype))
            raw = t.reshape(-1).view(torch.uint8)
            if raw.device.type != "cpu":
                raw = raw.cpu()
            return raw.numpy().copy().view(word_dtype(self.dtype))
        return np.ascontiguousarray(self.value).reshape(-1).view(word_dtype(self.dtype)).copy()


_FLOATS = {"F64": (11, 52), "F32": (8, 23), "F16": (5, 10), "BF16": (8, 7), "F8_E4M3": (4, 3), "F8_E5M2": (5, 2)}


def check_words(g: np.ndarray, dtype: str, seed: int) -> np.ndarray:
    """The check round's word for global ids ``g``: pseudo-random, with NaN payloads and
    -0.0 planted for float dtypes (a loader that canonicalises them is not bit-exact)."""
    width = DTYPE_WIDTH[dtype]
    h = g.astype(np.uint64) * np.uint64(GOLDEN) + np.uint64(seed)
    mix64_into(h, np.empty_like(h))
    bits = 8 * width
    if bits < 64:
        h &= np.uint64((1 << bits) - 1)
    if dtype in _FLOATS:
        exp, man = _FLOATS[dtype]
        nan = (g % 97) == 0
        neg0 = (g % 89) == 0
        sign = np.uint64(1 << (bits - 1))
        expmask = np.uint64(((1 << exp) - 1) << man)
        if dtype == "F8_E4M3":
            # e4m3fn has one NaN per sign, S.1111.111 (S.1111.xxx else is a number): plant the
            # negative one, which a loader casting through another float type turns into 0x7F.
            h[nan] = sign | expmask | np.uint64((1 << man) - 1)
        else:
            h[nan] = (h[nan] | expmask) | np.uint64(1)  # exponent all ones, payload nonzero
        h[neg0] = sign
    return h.astype(word_dtype(dtype))


def _constant_word(dtype: str, which: int) -> int:
    """Two distinct ordinary values per dtype (1 and 2) as words, for the residual rounds."""
    if dtype == "BOOL":
        return which - 1  # False, True
    if dtype in _FLOATS:
        exp, man = _FLOATS[dtype]
        bias = (1 << (exp - 1)) - 1
        if dtype == "F8_E4M3":
            bias = 7
        return (bias + which - 1) << man
    return which


def _probe_tensor(words: np.ndarray, dtype: str, shape: tuple[int, ...], torch_probes: bool, device=None):
    if torch_probes:
        import torch

        from dcr_log.state import _DTYPE_TO_TORCH
        t = torch.from_numpy(words.view(np.uint8)).view(getattr(torch, _DTYPE_TO_TORCH[dtype]))
        t = t.reshape(shape)
        return t if device is None else t.to(device)
    from dcr_log.state import _NUMPY_TO_DTYPE
    native = {v: k for k, v in _NUMPY_TO_DTYPE.items()}.get(dtype)
    if native in (None, "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return words.reshape(shape)
    return words.view(np.dtype(native)).reshape(shape)


def discover(load_weights: Loader, table: Any, params: Mapping[str, Any],
             dtypes: Mapping[str, str] | None = None, seed: int = 0x5EED,
             device: Any = None, restore: bool = True) -> Placement:
    """Find where ``load_weights`` puts every element of ``table``'s tensors in ``params``.

    ``table``: the log's tensor table (a CommitRecord, TensorInfos, or name -> (dtype, shape));
    ``params``: the engine's tensors (``dict(model.named_parameters())`` plus buffers), torch
    tensors or numpy arrays (``dtypes`` names the safetensors dtype of arrays holding raw words,
    e.g. bf16 as uint16). The loader receives torch tensors when the parameters are torch
    tensors (on ``device``, default CPU), else numpy arrays. The parameters are overwritten by
    the probes and, with ``restore`` (default), given back their words at the end (a copy of
    the engine's parameters is held meanwhile; pass ``restore=False`` on a scratch engine).
    Loader calls: ``ceil(bits / word bits)`` index rounds plus one check round, and, when some
    parameter is residual, ``2 + ceil(log2(tensors + 1))`` rounds finding its sources."""
    layout = _norm(table)
    words_of = {}
    seen: dict[tuple, str] = {}
    for name, value in params.items():
        pw = _ParamWords(name, value, (dtypes or {}).get(name))
        if pw.key in seen and pw.size:
            continue  # the same storage under two names (a tied weight): one parameter
        seen[pw.key] = name
        words_of[name] = pw
    param_layout = {n: (pw.dtype, pw.shape) for n, pw in words_of.items()}
    saved = {n: pw.read() for n, pw in words_of.items()} if restore else None
    try:
        return _discover(load_weights, layout, words_of, param_layout, seed, device)
    finally:
        if saved is not None:
            for n, pw in words_of.items():
                pw.restore(saved[n])


def _discover(load_weights, layout, words_of, param_layout, seed, device) -> Placement:
    torch_probes = any(pw.torch for pw in words_of.values())
    names = list(layout)
    sizes = np.array([numel(layout[n][1]) for n in names], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # global id = base + f + 1
    total = int(base[-1])
    bits = max(1, (total + 1).bit_length())
    widths = [DTYPE_WIDTH[layout[n][0]] for n in names]
    rounds = max([math.ceil(bits / (8 * w)) for w in widths] or [1])

    def feed(make_words: Callable[[int], np.ndarray | None]) -> dict[str, np.ndarray]:
        for pw in words_of.values():
            pw.zero()

        def probes():
            for k, name in enumerate(names):
                dtype, shape = layout[name]
                w = make_words(k)
                if w is not None:
                    yield name, _probe_tensor(w, dtype, shape, torch_probes, device)
        try:
            load_weights(probes())
        except Exception as exc:
            raise PlacementError(f"the engine's loader refused the probe tensors: "
                                 f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        return {n: pw.read() for n, pw in words_of.items()}

    def gids(k: int) -> np.ndarray:
        return np.arange(base[k] + 1, base[k + 1] + 1, dtype=np.uint64)

    # Index rounds: round r carries bits [8w r, 8w (r+1)) of each element's global id.
    acc = {n: np.zeros(pw.size, dtype=np.uint64) for n, pw in words_of.items()}
    touched = {n: np.zeros(pw.size, dtype=bool) for n, pw in words_of.items()}
    bad = {n: np.zeros(pw.size, dtype=bool) for n, pw in words_of.items()}
    for r in range(rounds):
        def index_words(k: int, r=r) -> np.ndarray | None:
            dtype = layout[names[k]][0]
            if dtype == "BOOL":
                return np.zeros(sizes[k], dtype=np.uint8)
            w = widths[k]
            shift = 8 * w * r
            g = gids(k)
            part = (g >> np.uint64(shift)) if shift < 64 else np.zeros_like(g)
            if w < 8:
                part &= np.uint64((1 << (8 * w)) - 1)
            return part.astype(word_dtype(dtype))
        got = feed(index_words)
        for n, pw in words_of.items():
            v = got[n].astype(np.uint64)
            touched[n] |= v != 0
            shift = 8 * pw.width * r
            if shift < 64 and r < math.ceil(bits / (8 * pw.width)):
                acc[n] |= v << np.uint64(shift)
            else:
                bad[n] |= v != 0  # bits beyond the id: not a copy of a word this wide
    # Check round: every candidate must hold exactly the check word of its source element.
    got = feed(lambda k: None if layout[names[k]][0] == "BOOL"
               else check_words(gids(k), layout[names[k]][0], seed))
    pieces: dict[str, list[PlacementPiece]] = {}
    residual_params: list[str] = []
    for n, pw in words_of.items():
        v = got[n]
        touched[n] |= v.astype(np.uint64) != 0
        g = acc[n]
        cand = (g > 0) & (g <= total) & ~bad[n]
        idx = np.flatnonzero(cand)
        k = np.searchsorted(base, g[idx].astype(np.int64) - 1, side="right") - 1
        ok = np.zeros(idx.size, dtype=bool)
        for kk in np.unique(k):
            sel = k == kk
            dtype = layout[names[kk]][0]
            if DTYPE_WIDTH[dtype] != pw.width or dtype == "BOOL":
                continue
            expect = check_words(g[idx[sel]], dtype, seed)
            ok[sel] = v[idx[sel]] == expect
        if not np.array_equal(idx[ok], np.flatnonzero(touched[n])):
            residual_params.append(n)  # written, but not (only) as bit copies
            continue
        idx, k = idx[ok], k[ok]
        if idx.size == 0:
            continue
        f = g[idx].astype(np.int64) - 1 - base[k]
        # Runs: consecutive parameter elements from consecutive elements of one tensor.
        brk = np.ones(idx.size, dtype=bool)
        brk[1:] = (idx[1:] != idx[:-1] + 1) | (k[1:] != k[:-1]) | (f[1:] != f[:-1] + 1)
        starts = np.flatnonzero(brk)
        lengths = np.diff(np.append(starts, idx.size))
        run_k = k[starts]
        for kk in np.unique(run_k):
            sel = run_k == kk
            found = _pieces_from_runs(n, f[starts[sel]], idx[starts[sel]], lengths[sel])
            if len(found) > _BLOCKS_FROM:
                # A permuted or blocked layout: its runs are short and many; a few blocks
                # describe it (apply maps a record through every piece of its tensor).
                mine = k == kk
                blocks = _blocks(n, idx[mine], f[mine], limit=len(found) // 4)
                if blocks is not None:
                    found = blocks
            pieces.setdefault(names[kk], []).extend(found)
    residual = _residual_sources(feed, names, layout, sizes, residual_params, touched) if residual_params else {}
    if not pieces and not residual:
        raise PlacementError("the loader placed no element of the table in these parameters "
                             "(a loader bound to another engine instance?)")
    for t in pieces:
        pieces[t].sort(key=lambda p: (p.c0, p.param))
    placement = Placement(layout, dict(sorted(param_layout.items())), pieces, residual)
    placement.validate()
    return placement


_BLOCKS_FROM = 8        # run pieces of one tensor in one parameter before blocks are tried


def _blocks(param: str, p: np.ndarray, c: np.ndarray, limit: int) -> list[PlacementPiece] | None:
    """Cover (parameter index, canonical index) pairs, in parameter order, with blocks: from
    the first pair, each level takes every S-th pair (S: the size of the levels found so far)
    and extends while the step holds; the block is checked against the pairs it claims, and
    the next block starts after it. None when more than ``limit`` blocks are needed."""
    out: list[PlacementPiece] = []
    i, total = 0, p.size
    while i < total:
        if len(out) >= limit:
            return None
        P, C = p[i:], c[i:]
        dims: list[tuple[int, int, int]] = []   # innermost first
        size = 1
        while size < P.size:
            sp, sc = P[::size], C[::size]
            if sp.size < 2:
                break
            dp, dc = int(sp[1] - sp[0]), int(sc[1] - sc[0])
            if dc <= 0:
                break
            ok = (np.diff(sp) == dp) & (np.diff(sc) == dc)
            bad = np.flatnonzero(~ok)
            run = int(bad[0]) + 1 if bad.size else sp.size
            if run < 2:
                break
            trial = [(run, dc, dp)] + dims[::-1]   # outermost first, for the check
            cand = PlacementPiece.block(param, C[0], P[0], sorted(trial, key=lambda d: -d[1]))
            if not _block_ok(cand.dims, 1 << 62, 0):
                break
            ce, pe = cand.elements()
            n = run * size
            order = np.argsort(pe, kind="stable")
            if ce.size != n or not (np.array_equal(pe[order], P[:n]) and np.array_equal(ce[order], C[:n])):
                break
            dims.append((run, dc, dp))
            size = n
        block = PlacementPiece.block(param, C[0], P[0], sorted(dims[::-1], key=lambda d: -d[1]) or [(1, 1, 1)])
        out.append(block)
        i += size
    return out


def _residual_sources(feed, names, layout, sizes, residual_params, touched) -> dict[str, list[str]]:
    """Which canonical tensors each residual parameter is built from: tensor k gets value 2
    in round j when bit j of k+1 is set, else 1; an element that differs from the all-1 round
    in round j depends on a tensor with that bit."""
    def constant(k: int, which: int) -> np.ndarray:
        dtype = layout[names[k]][0]
        return np.full(sizes[k], _constant_word(dtype, which), dtype=word_dtype(dtype))

    ref = feed(lambda k: constant(k, 1))
    bits_needed = max(1, len(names).bit_length())
    code = {n: np.zeros(ref[n].size, dtype=np.int64) for n in residual_params}
    for j in range(bits_needed):
        got = feed(lambda k, j=j: constant(k, 2 if ((k + 1) >> j) & 1 else 1))
        for n in residual_params:
            code[n] |= (got[n] != ref[n]).astype(np.int64) << j
    out = {}
    for n in residual_params:
        c = np.unique(code[n][touched[n]])
        c = c[c > 0]
        if np.any(c > len(names)):
            raise PlacementError(f"parameter {n!r}: built from several tensors per element; "
                                 "the probes cannot tell which")
        srcs = sorted(names[i - 1] for i in c.tolist())
        if srcs:  # (written with values no tensor changes, an engine constant: not residual)
            out[n] = srcs
    # Changing every other tensor must leave the residual parameters alone.
    sources = {s for srcs in out.values() for s in srcs}
    got = feed(lambda k: constant(k, 1 if names[k] in sources else 2))
    for n in out:
        if not np.array_equal(got[n], ref[n]):
            raise PlacementError(f"parameter {n!r} depends on tensors the probes could not "
                                 "single out (values combined across tensors)")
    return out
