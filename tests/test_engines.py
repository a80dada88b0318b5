"""The vLLM-like test engines (tests/helpers/engines.py) place checkpoint tensors where vLLM would.

Expected placements are written out here from vLLM's rules, independently of the engine code,
and compared as integer words (``bits``), never as floats."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers.engines import (  # noqa: E402
    EngineConfig,
    NumpyEngine,
    TestEngine,
    canonical_shapes,
    engine_params,
    fresh_engine,
    fuse_bert_qkv,
    random_canonical,
)

CFG = EngineConfig()
WORD = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(WORD[t.dtype])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: bits(t).clone() for n, t in engine_params(engine).items()}


@pytest.mark.parametrize("tie_mode", ["shared", "copy"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_union_of_ranks_is_the_checkpoint(tp, tie_mode):
    cfg = dataclasses.replace(CFG, tie_mode=tie_mode)
    canon = random_canonical(cfg, seed=1)
    ranks = [engine_params(fresh_engine(cfg, canon, r, tp)) for r in range(tp)]
    hd, H = cfg.head_dim, cfg.hidden
    q_rows = cfg.num_heads // tp * hd
    kv_heads, rep = max(1, cfg.num_kv_heads // tp), max(1, tp // cfg.num_kv_heads)
    kv_rows = kv_heads * hd
    assert rep == (2 if tp == 4 else 1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = [P[p + "self_attn.qkv_proj.weight"] for P in ranks]
        assert all(t.shape == (q_rows + 2 * kv_rows, H) for t in qkv)
        q = [t[:q_rows] for t in qkv]
        k = [t[q_rows:q_rows + kv_rows] for t in qkv]
        v = [t[q_rows + kv_rows:] for t in qkv]
        assert same(torch.cat(q), canon[p + "self_attn.q_proj.weight"])
        for part, ck in ((k, canon[p + "self_attn.k_proj.weight"]), (v, canon[p + "self_attn.v_proj.weight"])):
            assert same(torch.cat(part[::rep]), ck)  # each group of `rep` ranks holds the same heads
            for r in range(tp):
                assert same(part[r], ck[(r // rep) * kv_rows:(r // rep + 1) * kv_rows])
        o_proj = p + "self_attn.o_proj.weight"
        assert same(torch.cat([P[o_proj] for P in ranks], 1), canon[o_proj])
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            want = canon[p + norm] * 2 if (i == 0 and norm.startswith("post")) else canon[p + norm]
            assert all(same(P[p + norm], want) for P in ranks)
        if i in cfg.moe_layers:
            E, Ir = cfg.num_experts, cfg.moe_intermediate // tp
            ex = p + "block_sparse_moe.experts."
            gate = p + "block_sparse_moe.gate.weight"
            assert all(same(P[gate], canon[gate]) for P in ranks)
            w13 = [P[ex + "w13_weight"] for P in ranks]
            assert all(t.shape == (E, 2 * Ir, H) for t in w13)
            for e in range(E):
                assert same(torch.cat([t[e, :Ir] for t in w13]), canon[f"{ex}{e}.w1.weight"])
                assert same(torch.cat([t[e, Ir:] for t in w13]), canon[f"{ex}{e}.w3.weight"])
                assert same(torch.cat([P[ex + "w2_weight"][e] for P in ranks], 1), canon[f"{ex}{e}.w2.weight"])
        else:
            Ir = cfg.intermediate // tp
            gu = [P[p + "mlp.gate_up_proj.weight"] for P in ranks]
            assert same(torch.cat([t[:Ir] for t in gu]), canon[p + "mlp.gate_proj.weight"])
            assert same(torch.cat([t[Ir:] for t in gu]), canon[p + "mlp.up_proj.weight"])
            assert same(torch.cat([P[p + "mlp.down_proj.weight"] for P in ranks], 1), canon[p + "mlp.down_proj.weight"])
    # vocab: 1000 padded to 1024 globally, split in rank order; padding rows are zero
    for P in ranks:
        assert P["model.embed_tokens.weight"].shape == (1024 // tp, H)
    embed = torch.cat([P["model.embed_tokens.weight"] for P in ranks])
    assert same(embed[:1000], canon["model.embed_tokens.weight"])
    assert not bits(embed[1000:]).any()
    # the final norm is float32, the exact widening of the bf16 checkpoint value
    assert all(same(P["model.norm.weight"], canon["model.norm.weight"].float()) for P in ranks)
    for _r, P in enumerate(ranks):
        if tie_mode == "shared":
            assert "lm_head.weight" not in P
        else:
            assert same(P["lm_head.weight"], P["model.embed_tokens.weight"])
            assert P["lm_head.weight"].data_ptr() != P["model.embed_tokens.weight"].data_ptr()


def test_tie_modes_and_untied_head():
    canon = random_canonical(CFG, 3)
    shared = fresh_engine(CFG, canon, 1, 2)
    assert shared.lm_head.weight is shared.model.embed_tokens.weight
    untied = dataclasses.replace(CFG, tie_word_embeddings=False)
    canon_u = random_canonical(untied, 3)
    assert "lm_head.weight" in canon_u and "lm_head.weight" not in canon
    e = fresh_engine(untied, canon_u, 1, 2)
    assert same(e.lm_head.weight[:488], canon_u["lm_head.weight"][512:])
    assert same(e.model.embed_tokens.weight[:488], canon_u["model.embed_tokens.weight"][512:])
    assert not same(e.lm_head.weight, e.model.embed_tokens.weight)
    # a tied engine ignores a stray lm_head.weight, as vLLM's AutoWeightsLoader does
    before = snapshot(shared)
    assert shared.load_weights([("lm_head.weight", canon_u["lm_head.weight"])]) == set()
    assert all(torch.equal(before[n], bits(t)) for n, t in engine_params(shared).items())


@pytest.mark.parametrize("tp", [1, 4])
def test_fresh_engine_storage(tp):
    engine = TestEngine(CFG, tp - 1, tp)
    tensors = engine_params(engine)
    assert not any(bits(t).any() for n, t in tensors.items() if "cos_sin_cache" not in n)
    for name, t in tensors.items():
        assert type(t) in (torch.nn.Parameter, torch.Tensor) and t.is_contiguous() and t.device.type == "cpu"
        assert t.dtype == (torch.float32 if name == "model.norm.weight" else torch.bfloat16), name
    assert all(callable(p.weight_loader) for p in engine.parameters())
    assert [n for n in tensors if "cos_sin_cache" in n] == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]
    assert torch.equal(bits(tensors["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]),
                       bits(engine_params(TestEngine(CFG, tp - 1, tp))[
                           "model.layers.0.self_attn.rotary_emb.cos_sin_cache"]))


@pytest.mark.parametrize("tie_mode", ["shared", "copy"])
def test_subset_changes_only_what_it_feeds(tie_mode):
    cfg = dataclasses.replace(CFG, tie_mode=tie_mode)
    a, b = random_canonical(cfg, 10), random_canonical(cfg, 11)
    engine = fresh_engine(cfg, a, 1, 2)
    before = snapshot(engine)
    subset = ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.block_sparse_moe.experts.2.w3.weight",
              "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.post_attention_layernorm.weight",
              "model.layers.0.self_attn.rotary_emb.inv_freq"]
    fed = {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.block_sparse_moe.experts.w13_weight",
           "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.post_attention_layernorm.weight"}
    if tie_mode == "copy":
        fed.add("lm_head.weight")
    assert engine.load_weights((n, b[n]) for n in subset) == fed
    changed = {n for n, t in engine_params(engine).items() if not torch.equal(before[n], bits(t))}
    assert changed == fed
    ref = engine_params(fresh_engine(cfg, {**a, **{n: b[n] for n in subset}}, 1, 2))
    assert all(same(t, ref[n]) for n, t in engine_params(engine).items())
    # one tensor per call, in reverse order, gives the same state as one call with all of them
    one_by_one = TestEngine(cfg, 1, 2)
    for name in reversed(list(b)):
        one_by_one.load_weights([(name, b[name])])
    ref = engine_params(fresh_engine(cfg, b, 1, 2))
    assert all(same(t, ref[n]) for n, t in engine_params(one_by_one).items())


def test_views_and_non_contiguous_inputs():
    canon = random_canonical(CFG, 5)
    odd = {}
    for i, (name, t) in enumerate(canon.items()):
        if t.ndim == 2 and i % 2:
            odd[name] = t.t().contiguous().t()  # same values, column-major strides
        else:  # a strided view into a larger buffer
            big = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            big[1::2] = t
            odd[name] = big[1::2]
        assert odd[name].data_ptr() != t.data_ptr() and (t.ndim < 2 or not odd[name].is_contiguous())
    ref = engine_params(fresh_engine(CFG, canon, 3, 4))
    got = engine_params(fresh_engine(CFG, odd, 3, 4))
    assert all(same(t, ref[n]) for n, t in got.items())


def _wrong_shapes(t: torch.Tensor) -> list[torch.Tensor]:
    out = [t[:-1], t.unsqueeze(0), torch.cat([t, t[:1]])]
    if t.ndim == 2:
        out += [t[:, :-1], t[:, :1], t.reshape(-1),
                t.reshape(t.shape[1], t.shape[0]) if t.shape[0] != t.shape[1] else t[:, :2]]
    return out


@pytest.mark.parametrize("tp", [1, 4])
def test_wrong_shapes_raise_before_any_write(tp):
    cfg = dataclasses.replace(CFG, tie_mode="copy")
    canon = random_canonical(cfg, 7)
    engine = fresh_engine(cfg, random_canonical(cfg, 8), tp - 1, tp)
    before = snapshot(engine)
    names = [n for n in canon if "inv_freq" not in n]
    for name in names:
        for bad in _wrong_shapes(canon[name]):
            with pytest.raises((AssertionError, ValueError)):
                engine.load_weights([(name, bad)])
    after = snapshot(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_unknown_names():
    canon = random_canonical(CFG, 9)
    engine = TestEngine(CFG, 0, 2)
    junk = [("model.layers.7.self_attn.q_proj.weight", canon["model.layers.0.self_attn.q_proj.weight"]),
            ("model.layers.0.mlp.experts.0.w1.weight", canon["model.layers.1.block_sparse_moe.experts.0.w1.weight"]),
            ("model.layers.1.mlp.gate_proj.weight", canon["model.layers.0.mlp.gate_proj.weight"]),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", canon["model.layers.0.self_attn.rotary_emb.inv_freq"])]
    before = snapshot(engine)
    assert engine.load_weights(junk) == set()
    assert all(torch.equal(before[n], bits(t)) for n, t in engine_params(engine).items())
    strict = TestEngine(dataclasses.replace(CFG, unknown_names="raise"), 0, 2)
    assert strict.load_weights(junk[3:]) == set()  # inv_freq is always skipped
    for item in junk[:3]:
        with pytest.raises(KeyError):
            strict.load_weights([item])


def test_numpy_engine_shares_memory_and_matches_torch():
    canon = random_canonical(CFG, 12)
    ref = engine_params(fresh_engine(CFG, canon, 1, 4))
    ne = NumpyEngine(CFG, 1, 4)
    assert set(ne.params) == set(ref) == set(ne.dtypes)
    assert ne.dtypes["model.norm.weight"] == "F32" and ne.dtypes["model.embed_tokens.weight"] == "BF16"
    as_np = {n: (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy())
             for n, t in canon.items()}
    as_np = {n: (a.T.copy().T if a.ndim == 2 else a[::-1].copy()[::-1]) for n, a in as_np.items()}  # strided
    loaded = ne.load_weights(as_np.items())
    assert "model.layers.1.block_sparse_moe.experts.w2_weight" in loaded
    for name, t in ref.items():
        a = ne.params[name]
        assert a.dtype == (np.uint16 if t.dtype == torch.bfloat16 else np.float32)
        assert np.array_equal(a.view(np.uint8), bits(t).numpy().view(np.uint8)), name
    # the arrays are the engine's storage: a torch tensor loaded later shows through them
    other = random_canonical(CFG, 13)
    ne.load_weights([("model.layers.0.self_attn.o_proj.weight", other["model.layers.0.self_attn.o_proj.weight"])])
    want = other["model.layers.0.self_attn.o_proj.weight"][:, 16:32]
    assert np.array_equal(ne.params["model.layers.0.self_attn.o_proj.weight"], bits(want).numpy().view(np.uint16))


def test_fuse_bert_qkv_matches_unfused_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg).eval()
    torch.manual_seed(1)
    fused_model = transformers.BertModel(cfg).eval()
    params, load_weights = fuse_bert_qkv(fused_model)
    state = {n: t.clone() for n, t in ref.state_dict().items()}
    assert "encoder.layer.1.attention.self.qkv.weight" in params
    assert params["encoder.layer.1.attention.self.qkv.bias"].shape == (96,)
    assert not any(".query." in n or ".key." in n or ".value." in n for n in params)
    assert "embeddings.position_ids" in params
    written = load_weights([*state.items(), ("embeddings.unknown", torch.zeros(1))])
    fused = {n for n in state if any(f".self.{part}." in n for part in ("query", "key", "value"))}
    assert written == (set(state) - fused
                       | {f"encoder.layer.{i}.attention.self.qkv.{k}" for i in range(2) for k in ("weight", "bias")})
    qkv = params["encoder.layer.0.attention.self.qkv.weight"]
    assert torch.equal(qkv[32:64], state["encoder.layer.0.attention.self.key.weight"])
    assert fused_model.encoder.layer[0].attention.self.value.weight.data_ptr() == qkv[64:].data_ptr()
    inputs = {"input_ids": torch.tensor([[1, 5, 17, 99, 3, 42]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]])}
    with torch.no_grad():
        want = ref(**inputs).last_hidden_state
        got = fused_model(**inputs).last_hidden_state
    assert torch.equal(bits(got), bits(want))
    # the forward reads the fused storage: change it there and the output changes
    with torch.no_grad():
        qkv[64:].mul_(2)
        assert not torch.equal(fused_model(**inputs).last_hidden_state, want)
    with pytest.raises(ValueError):
        query = "encoder.layer.0.attention.self.query.weight"
        load_weights([(query, state[query].t()[:, :-1])])


def test_canonical_shapes_cover_the_engine():
    shapes = canonical_shapes(CFG)
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (torch.bfloat16, (64, 32))
    assert shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] == (torch.float32, (4,))
    assert "lm_head.weight" not in shapes and "model.layers.1.mlp.gate_proj.weight" not in shapes
    a, b = random_canonical(CFG, 4), random_canonical(CFG, 4)
    assert all(same(a[n], b[n]) and a[n].is_contiguous() for n in a)
    assert not same(a["model.norm.weight"], random_canonical(CFG, 5)["model.norm.weight"])
