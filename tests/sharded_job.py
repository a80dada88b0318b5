"""A sharded trainer for tests/test_sharded.py: the model, its training schedule and one rank's
local layout, plus the worker that runs one rank of a gloo group.

Run as ``python tests/sharded_job.py CONFIG_JSON RANK``: the rank joins a gloo group, logs its
shards with ShardedWriter and writes ``<out>/result-<rank>.json`` (ok, error_type, message,
commits, ...). Imported by the tests for the dense reference (``dense_state``) and the same
layout (``RankModel``) in-process.

The canonical state is a small Llama-like model in bf16 (words as uint16). Every rank derives
the dense canonical state of a step itself (deterministic, seeded by step and name) and copies
its slices into persistent local buffers in place, the way a trainer updates its parameters,
then describes those buffers to the writer as Shards:

- tensor-parallel q/k/v (grouped-query: fewer kv heads than q heads; with tp > kv heads the kv
  rows are replicated) in one fused local QKV buffer per layer; layer 0's q rows are held in
  Meta's rotary layout and reach HF's canonical order only through a converter
  (Shard.converted);
- o_proj stored transposed (the shard is a non-contiguous ``.t()`` view) and down_proj as a
  column slice of a wider padded buffer (non-contiguous);
- gate/up fused in one local buffer;
- a vocab-parallel embedding with padded rows (vocab 37 is not divisible by any tp > 1; the
  padding holds garbage that changes every step and must never be logged), tied to lm_head
  (both names logged from the same local view);
- MoE experts stacked in one local tensor per projection, each expert its own canonical tensor;
- an FSDP flat buffer (norms, a 3-D and a 2-D tensor concatenated) split unevenly over all
  ranks, with boundaries in the middle of rows;
- data-parallel replicas (rank = dp_rank * tp + tp_rank), a replicated router and 0-d scalar,
  an empty tensor;
- a tensor added at step 3, reshaped at step 4 and removed at step 6, and an FSDP tensor
  reshaped at step 5.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import numpy as np

from dcr_log.coords import numel, word_dtype
from dcr_log.state import TensorBits
from helpers.ranks import finish_rank

SEED = 20240611
STEPS = 8  # versions 0..7

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 37, 16, 4, 2, 4
INTER, EXPERTS, EXPERT_INTER = 24, 4, 8
BF16, F32 = "BF16", "F32"

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
L0, L1 = "model.layers.0.", "model.layers.1."
ROUTER = L1 + "mlp.gate.weight"
PROJ = "model.multi_modal_projector.weight"   # 3-D, FSDP flat, reshaped at step 5
POS = "model.pos_embed.weight"                # 2-D, FSDP flat
SCALE = "model.logit_scale"                   # 0-d F32, replicated
SINKS = L0 + "self_attn.sinks"                # empty, held by tp rank 0 of every dp group
EXTRA = "model.extra_head.weight"             # new at 3, reshaped at 4, removed at 6
FLAT = [L0 + "input_layernorm.weight", L0 + "post_attention_layernorm.weight",
        L1 + "input_layernorm.weight", L1 + "post_attention_layernorm.weight",
        "model.norm.weight", PROJ, POS]
FLAT_WEIGHTS = {1: [1], 2: [3, 2], 4: [3, 1, 4, 2]}  # uneven FSDP split, by world size


def expert(e: int, w: str) -> str:
    return f"{L1}mlp.experts.{e}.{w}.weight"


def schema(step: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The canonical tensors of a step: name -> (dtype, shape)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    s: dict[str, tuple[str, tuple[int, ...]]] = {EMBED: (BF16, (VOCAB, HIDDEN)), LM_HEAD: (BF16, (VOCAB, HIDDEN))}
    for p in (L0, L1):
        s[p + "self_attn.q_proj.weight"] = (BF16, (q, HIDDEN))
        s[p + "self_attn.k_proj.weight"] = (BF16, (kv, HIDDEN))
        s[p + "self_attn.v_proj.weight"] = (BF16, (kv, HIDDEN))
        s[p + "self_attn.o_proj.weight"] = (BF16, (HIDDEN, q))
    s[L0 + "mlp.gate_proj.weight"] = (BF16, (INTER, HIDDEN))
    s[L0 + "mlp.up_proj.weight"] = (BF16, (INTER, HIDDEN))
    s[L0 + "mlp.down_proj.weight"] = (BF16, (HIDDEN, INTER))
    s[ROUTER] = (BF16, (EXPERTS, HIDDEN))
    for e in range(EXPERTS):
        s[expert(e, "w1")] = (BF16, (EXPERT_INTER, HIDDEN))
        s[expert(e, "w2")] = (BF16, (HIDDEN, EXPERT_INTER))
        s[expert(e, "w3")] = (BF16, (EXPERT_INTER, HIDDEN))
    for name in FLAT[:5]:
        s[name] = (BF16, (HIDDEN,))
    s[PROJ] = (BF16, (3, 5, 7) if step < 5 else (5, 21))
    s[POS] = (BF16, (9, 11))
    s[SCALE] = (F32, ())
    s[SINKS] = (BF16, (0, HIDDEN))
    if 3 <= step < 6:
        s[EXTRA] = (BF16, (6, HIDDEN) if step == 3 else (12, 8))
    return s


def relaid(step: int) -> bool:
    """Whether the tensor table of ``step`` differs from the previous step's (the writer is
    then told allow_layout_change=True)."""
    return step > 0 and schema(step) != schema(step - 1)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([SEED, *key])


def _initial_words(name: str, dtype: str, n: int) -> np.ndarray:
    """Weight-like values (normal * 0.02): bf16 as the top half of float32 bits."""
    f = (_rng(zlib.crc32(name.encode())).standard_normal(n) * 0.02).astype(np.float32)
    bits = f.view(np.uint32)
    return (bits >> 16).astype(np.uint16) if dtype == BF16 else bits.copy()


@functools.cache
def dense_state(step: int) -> dict[str, TensorBits]:
    """The canonical state after ``step``: step 0 initialises; every later step flips low bits
    of about 2% of every tensor's words (at least one), seeded by step and name. A reshaped
    tensor keeps its words; lm_head is tied to the embedding. Do not modify the result."""
    prev = dense_state(step - 1) if step else {}
    out = {}
    for name, (dtype, shape) in schema(step).items():
        if name == LM_HEAD:
            continue
        n = numel(shape)
        words = prev[name].words.copy() if name in prev else _initial_words(name, dtype, n)
        if step and n:
            rng = _rng(step, zlib.crc32(name.encode()))
            k = max(1, round(0.02 * n))
            where = rng.choice(n, k, replace=False)
            words[where] ^= rng.integers(1, 8, k).astype(word_dtype(dtype))
        out[name] = TensorBits(dtype, shape, words)
    out[LM_HEAD] = TensorBits(BF16, out[EMBED].shape, out[EMBED].words.copy())
    return out


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [a, b) of part ``i`` of ``n`` rows split as evenly as possible."""
    return n * i // parts, n * (i + 1) // parts


def flat_bounds(world: int, total: int) -> list[int]:
    w = np.cumsum([0] + FLAT_WEIGHTS[world])
    return [int(total * x // w[-1]) for x in w]


def hf_permute(w, n_heads: int):
    """Meta's rotary layout of q rows -> HF's (transformers' convert_llama_weights_to_hf)."""
    d1, d2 = w.shape
    return w.view(n_heads, d1 // n_heads // 2, 2, d2).transpose(1, 2).reshape(d1, d2)


def hf_unpermute(w, n_heads: int):
    d1, d2 = w.shape
    return w.view(n_heads, 2, d1 // n_heads // 2, d2).transpose(1, 2).reshape(d1, d2)


class RankModel:
    """One rank's local parameters (persistent torch buffers, updated in place each step) and
    the Shards that map them to canonical tensors. rank = dp_rank * tp + tp_rank."""

    def __init__(self, world: int, tp: int, rank: int):
        assert world % tp == 0 and HEADS % tp == 0 and EXPERTS % tp == 0
        self.world, self.tp, self.rank = world, tp, rank
        self.t = rank % tp
        self.local: dict = {}
        qh = HEADS // tp
        self.qh = qh
        self.q = (self.t * qh * HEAD_DIM, (self.t + 1) * qh * HEAD_DIM)
        kvh = max(1, KV_HEADS // tp)             # tp > kv heads: each kv head on tp // kv ranks
        k0 = (self.t * KV_HEADS // tp) * HEAD_DIM
        self.kv = (k0, k0 + kvh * HEAD_DIM)
        self.inter = split(INTER, tp, self.t)
        self.experts = range(self.t * EXPERTS // tp, (self.t + 1) * EXPERTS // tp)
        mult = 4 * tp                            # vocab padded to a multiple of 4 * tp
        per = -(-VOCAB // mult) * mult // tp
        self.vocab = (min(self.t * per, VOCAB), min((self.t + 1) * per, VOCAB))
        self.vocab_rows = per

    # -- local buffers ----------------------------------------------------------------------

    def _fresh(self, step: int) -> dict:
        import torch

        from dcr_log.state import to_torch

        c = {n: to_torch(b) for n, b in dense_state(step).items()}  # shares the dense words: read only
        (q0, q1), (k0, k1), (i0, i1) = self.q, self.kv, self.inter
        b = {}
        for p in (L0, L1):
            q = c[p + "self_attn.q_proj.weight"][q0:q1]
            if p == L0:
                q = hf_unpermute(q, self.qh)     # the trainer holds Meta's rotary layout
            b[p + "qkv"] = torch.cat([q, c[p + "self_attn.k_proj.weight"][k0:k1],
                                      c[p + "self_attn.v_proj.weight"][k0:k1]])
            b[p + "o_t"] = c[p + "self_attn.o_proj.weight"][:, q0:q1].t().contiguous()
        b["gate_up"] = torch.cat([c[L0 + "mlp.gate_proj.weight"][i0:i1], c[L0 + "mlp.up_proj.weight"][i0:i1]])
        down = torch.zeros(HIDDEN, i1 - i0 + 3, dtype=torch.bfloat16)
        down[:, : i1 - i0] = c[L0 + "mlp.down_proj.weight"][:, i0:i1]
        b["down"] = down
        for w in ("w1", "w2", "w3"):
            b[w] = torch.stack([c[expert(e, w)] for e in self.experts])
        b["router"] = c[ROUTER].clone()
        v0, v1 = self.vocab
        garbage = _rng(step, self.rank).integers(0, 1 << 16, (self.vocab_rows - (v1 - v0), HIDDEN), dtype=np.uint16)
        b["embed"] = torch.cat([c[EMBED][v0:v1], torch.from_numpy(garbage.view(np.int16)).view(torch.bfloat16)])
        lo, hi = self._flat_range(step)
        b["flat"] = torch.cat([c[n].reshape(-1) for n in FLAT])[lo:hi].clone()
        b["scale"] = c[SCALE].clone()
        if self.t == 0:
            b["sinks"] = c[SINKS].clone()
        if EXTRA in c:
            e0, e1 = split(c[EXTRA].shape[0], self.tp, self.t)
            b["extra"] = c[EXTRA][e0:e1].clone()
        return b

    def _flat_range(self, step: int) -> tuple[int, int]:
        spec = schema(step)
        bounds = flat_bounds(self.world, sum(numel(spec[n][1]) for n in FLAT))
        return bounds[self.rank], bounds[self.rank + 1]

    def load(self, step: int) -> None:
        """Bring the local buffers to ``step``: in place where a buffer keeps its shape."""
        fresh = self._fresh(step)
        for key, t in fresh.items():
            old = self.local.get(key)
            if old is not None and old.shape == t.shape:
                old.copy_(t)
            else:
                self.local[key] = t
        for key in set(self.local) - set(fresh):
            del self.local[key]

    # -- shards -----------------------------------------------------------------------------

    def shards(self, step: int) -> tuple[dict, dict]:
        """This rank's ``{name: [Shard]}`` for ``step`` and the ``shapes=`` the append needs:
        every shape at step 0, afterwards only those of new or reshaped tensors."""
        from dcr_log.write.pieces import Shard

        b = self.local
        (q0, q1), (k0, k1), (i0, i1) = self.q, self.kv, self.inter
        nq, nk = q1 - q0, k1 - k0
        s: dict[str, list] = {}
        for p in (L0, L1):
            qkv = b[p + "qkv"]
            if p == L0:
                s[p + "self_attn.q_proj.weight"] = [Shard.converted(
                    lambda qkv=qkv: hf_permute(qkv[:nq], self.qh), offset=(q0, 0))]
            else:
                s[p + "self_attn.q_proj.weight"] = [Shard(qkv[:nq], (q0, 0))]
            s[p + "self_attn.k_proj.weight"] = [Shard(qkv[nq:nq + nk], (k0, 0))]
            s[p + "self_attn.v_proj.weight"] = [Shard(qkv[nq + nk:], (k0, 0))]
            s[p + "self_attn.o_proj.weight"] = [Shard(b[p + "o_t"].t(), (0, q0))]
        n = i1 - i0
        s[L0 + "mlp.gate_proj.weight"] = [Shard(b["gate_up"][:n], (i0, 0))]
        s[L0 + "mlp.up_proj.weight"] = [Shard(b["gate_up"][n:], (i0, 0))]
        s[L0 + "mlp.down_proj.weight"] = [Shard(b["down"][:, :n], (0, i0))]
        for j, e in enumerate(self.experts):
            for w in ("w1", "w2", "w3"):
                s[expert(e, w)] = [Shard(b[w][j])]
        s[ROUTER] = [Shard(b["router"])]
        v0, v1 = self.vocab
        emb = b["embed"][: v1 - v0]              # the padding rows stay out of the log
        s[EMBED] = [Shard(emb, (v0, 0))]
        s[LM_HEAD] = [Shard(emb, (v0, 0))]       # tied: the same local view
        spec = schema(step)
        lo, hi = self._flat_range(step)
        at = 0
        for name in FLAT:
            size = numel(spec[name][1])
            a, z = max(lo, at), min(hi, at + size)
            if a < z:
                s[name] = [Shard.flat(b["flat"][a - lo:z - lo], a - at)]
            at += size
        s[SCALE] = [Shard(b["scale"])]
        if self.t == 0:
            s[SINKS] = [Shard(b["sinks"])]
        if EXTRA in spec:
            e0, _ = split(spec[EXTRA][1][0], self.tp, self.t)
            s[EXTRA] = [Shard(b["extra"], (e0, 0))]
        prev = schema(step - 1) if step else {}
        shapes = {name: shape for name, (dtype, shape) in spec.items() if prev.get(name) != (dtype, shape)}
        return s, shapes


# -- sabotage for the failure tests ---------------------------------------------------------


class KillOnRead(np.ndarray):
    """Words that SIGKILL their process when the writer reads them: a rank dying while it
    encodes (after the layout was agreed, possibly after some of its segments were written)."""

    def __getitem__(self, index):
        os.kill(os.getpid(), signal.SIGKILL)


class HangOnRead(np.ndarray):
    """Words whose reading never returns (a rank stuck in its encoding, until killed)."""

    def __getitem__(self, index):
        time.sleep(3600)


def sabotage(shards: dict, how: str, model: RankModel, step: int) -> None:
    import torch

    from dcr_log.write.pieces import Shard

    rank = model.rank
    if how == "raise-tensor":    # a parameter left on the meta device: to_bits cannot copy it
        name = L1 + "self_attn.k_proj.weight"
        k0, k1 = model.kv
        shards[name] = [Shard(torch.empty(k1 - k0, HIDDEN, dtype=torch.bfloat16, device="meta"), (k0, 0))]
    elif how == "raise-converter":
        def broken():
            raise ValueError(f"rotary conversion failed on rank {rank}")
        shards[L0 + "self_attn.q_proj.weight"] = [Shard.converted(broken, offset=(model.q[0], 0))]
    elif how in ("kill-encoding", "hang-encoding"):
        name = L1 + "self_attn.o_proj.weight"
        q0, q1 = model.q
        words = np.ascontiguousarray(dense_state(step)[name].words.reshape(HIDDEN, -1)[:, q0:q1]).reshape(-1)
        words = words.view(KillOnRead if how == "kill-encoding" else HangOnRead)
        shards[name] = [Shard(TensorBits(BF16, (HIDDEN, q1 - q0), words), (0, q0))]
    elif how == "raise-remap":  # mapping its baseline cache for writing fails, before any encoding
        from dcr_log.write.baseline import Baseline

        def refuse(self, density):
            raise OSError(f"madvise refused on rank {rank}")
        Baseline.pieces_to_remap = refuse  # (this process ends with the failed append)
    elif how == "kill-converter":
        shards[L0 + "self_attn.q_proj.weight"] = [Shard.converted(
            lambda: os.kill(os.getpid(), signal.SIGKILL), offset=(model.q[0], 0))]
    else:
        raise ValueError(how)


def bad_layout(case: str, model: RankModel, step: int) -> tuple[dict, dict]:
    """This rank's shards for ``step`` with one layout error (2 ranks, tp 2)."""
    import torch

    from dcr_log.state import to_torch
    from dcr_log.write.pieces import Shard

    s, shapes = model.shards(step)
    r = model.rank
    if case == "gap":            # nobody holds rank 1's rows of k_proj
        if r == 1:
            del s[L0 + "self_attn.k_proj.weight"]
    elif case == "overlap":      # rank 1's v_proj box starts one row inside rank 0's
        if r == 1:
            name = L1 + "self_attn.v_proj.weight"
            k0, k1 = model.kv
            s[name] = [Shard(to_torch(dense_state(step)[name])[k0 - 1:k1], (k0 - 1, 0))]
    elif case in ("shape", "dtype"):  # a new tensor, rows [2r, 2r + 2) of [4, 16]
        dtype = torch.float32 if case == "dtype" and r == 1 else torch.bfloat16
        s["model.new.weight"] = [Shard(torch.zeros(2, HIDDEN, dtype=dtype), (2 * r, 0))]
        shapes["model.new.weight"] = (4 + (case == "shape" and r == 1), HIDDEN)
    else:
        raise ValueError(case)
    return s, shapes


# Tensor table changes every rank makes alike (2 ranks, tp 2): refused without
# allow_layout_change=True, accepted with it.
NEW = "model.new.weight"
RENAMED = L1 + "mlp.router.weight"
TABLE_CHANGES = ["added", "removed", "renamed", "reshaped", "retyped"]


def _new_words() -> np.ndarray:
    return _initial_words(NEW, BF16, 4 * HIDDEN)


def relayout_dense(case: str, state: dict[str, TensorBits]) -> dict[str, TensorBits]:
    """The dense state ``state`` after the table change ``case`` (the reference)."""
    s = dict(state)
    if case == "added":
        s[NEW] = TensorBits(BF16, (4, HIDDEN), _new_words())
    elif case == "removed":
        del s[ROUTER]
    elif case == "renamed":
        s[RENAMED] = s.pop(ROUTER)
    elif case == "reshaped":
        s[ROUTER] = TensorBits(BF16, (EXPERTS * 2, HIDDEN // 2), s[ROUTER].words)
    elif case == "retyped":
        s[SCALE] = TensorBits("I32", (), s[SCALE].words)
    else:
        raise ValueError(case)
    return s


def relayout(case: str, model: RankModel, step: int) -> tuple[dict, dict]:
    """This rank's shards for ``step`` with the table change ``case`` (as relayout_dense)."""
    import torch

    from dcr_log.write.pieces import Shard

    s, shapes = model.shards(step)
    r = model.rank
    if case == "added":          # rows [2r, 2r + 2) of [4, HIDDEN] on each of the 2 ranks
        rows = _new_words().reshape(4, HIDDEN)[2 * r:2 * r + 2].reshape(-1).copy()
        s[NEW] = [Shard(TensorBits(BF16, (2, HIDDEN), rows), (2 * r, 0))]
        shapes[NEW] = (4, HIDDEN)
    elif case == "removed":
        del s[ROUTER]
    elif case == "renamed":
        s[RENAMED] = s.pop(ROUTER)
        shapes[RENAMED] = (EXPERTS, HIDDEN)
    elif case == "reshaped":
        s[ROUTER] = [Shard(model.local["router"].reshape(EXPERTS * 2, HIDDEN // 2))]
        shapes[ROUTER] = (EXPERTS * 2, HIDDEN // 2)
    elif case == "retyped":
        s[SCALE] = [Shard(model.local["scale"].view(torch.int32))]
    else:
        raise ValueError(case)
    return s, shapes


def store_listing(root: str | Path, digests: bool = False) -> list[list]:
    """Every file under a log directory: [relative path, size], sorted; with ``digests``,
    [relative path, SHA-256 of its bytes]."""
    import hashlib

    root = Path(root)
    return sorted([str(p.relative_to(root)),
                   hashlib.sha256(p.read_bytes()).hexdigest() if digests else p.stat().st_size]
                  for p in root.rglob("*") if p.is_file())


# -- the worker -----------------------------------------------------------------------------


def _error(exc: BaseException) -> dict:
    return {"error_type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}


def _commit_info(commit) -> dict:
    return {"version": commit.version, "state_digest": f"{commit.state_digest:016x}"}


def run(cfg: dict, rank: int, result: dict) -> None:
    import torch.distributed as dist

    from dcr_log.write.sharded import ShardedWriter

    world, log = cfg["world"], cfg["log"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
    model = RankModel(world, cfg["tp"], rank)
    seg = cfg.get("segment_bytes", 1 << 20)
    start, stop = cfg["steps"]
    result["commits"] = []

    if cfg.get("layout_errors"):
        writer = ShardedWriter.open(log, segment_bytes=seg)
        model.load(start)
        result["attempts"] = {}
        for case in cfg["layout_errors"]:
            shards, shapes = bad_layout(case, model, start)
            try:
                writer.append(shards, shapes)
                result["attempts"][case] = {"ok": True}
            except Exception as exc:
                result["attempts"][case] = {"ok": False, **_error(exc)}
        dist.barrier()
        if rank == 0:  # the store after the bad appends, before the good one
            result["listing"] = store_listing(log)
        dist.barrier()
        shards, shapes = model.shards(start)
        result["commits"].append(_commit_info(writer.append(shards, shapes)))  # still usable
        result["ok"] = True
        return

    if cfg.get("table_changes"):
        writer = ShardedWriter.open(log, segment_bytes=seg)
        model.load(start)
        result["attempts"] = {}
        tries = [(case, case, False) for case in cfg["table_changes"]]
        tries.append(("added, flag on rank 0 only", "added", rank == 0))
        for key, case, allow in tries:
            shards, shapes = relayout(case, model, start)
            try:
                writer.append(shards, shapes, allow_layout_change=allow)
                result["attempts"][key] = {"ok": True}
            except Exception as exc:
                result["attempts"][key] = {"ok": False, **_error(exc)}
        dist.barrier()
        if rank == 0:  # the store after the refused appends
            result["listing"] = store_listing(log, digests=True)
        dist.barrier()
        everything = {name: shape for name, (_, shape) in schema(start).items()}
        for case in cfg["table_changes"]:  # each change accepted with the flag, then undone
            shards, shapes = relayout(case, model, start)
            result["commits"].append(_commit_info(writer.append(shards, shapes, allow_layout_change=True)))
            shards, _ = model.shards(start)
            result["commits"].append(_commit_info(writer.append(shards, everything, allow_layout_change=True)))
        result["ok"] = True
        return

    fail = cfg.get("fail")
    writer = None if start == 0 else ShardedWriter.open(log, segment_bytes=seg)
    for step in range(start, stop):
        model.load(step)
        shards, shapes = model.shards(step)
        failing = fail is not None and step == fail["step"]
        if failing:
            dist.barrier()
            if rank == 0:  # the store just before the append that fails
                Path(cfg["out"], "listing-before.json").write_text(json.dumps(store_listing(log)))
            dist.barrier()
            if rank == fail["rank"]:
                sabotage(shards, fail["how"], model, step)
        t0 = time.monotonic()
        try:
            if writer is None:
                writer = ShardedWriter.create(log, shards, shapes, segment_bytes=seg)
                commit = writer.log.commit(writer.version)
            else:
                commit = writer.append(shards, shapes, allow_layout_change=relaid(step))
        except Exception as exc:
            if not failing:
                raise
            result["failed_append"] = {"step": step, "seconds": time.monotonic() - t0, **_error(exc)}
            result["ok"] = False
            return
        result["commits"].append(_commit_info(commit))
        if failing:  # the sabotage did not stop the append: the test reports it
            result["failed_append"] = {"step": step, "committed": True}
    result["ok"] = True


def main() -> None:
    cfg, rank = json.loads(sys.argv[1]), int(sys.argv[2])
    result: dict = {"rank": rank, "ok": False}
    try:
        run(cfg, rank, result)
    except BaseException as exc:
        result.update(ok=False, unexpected=True, **_error(exc))
        traceback.print_exc()
    finish_rank(cfg["out"], rank, result)


if __name__ == "__main__":
    main()
