"""The FP8 block quantizer (dcr_log.quant), checked bit by bit against a reference written here
from the rules alone: numpy fp32 arithmetic and an e4m3 rounding table built from the format's
definition (not torch's cast)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log.errors import UsageError
from dcr_log.quant import E4M3_MAX, Fp8BlockQuantizer, dequantize, quantized_by_default


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative e4m3fn value (1 sign, 4 exponent bits of bias 7, 3 mantissa
    bits; no infinities; S.1111.111 is NaN) with its code, in increasing order."""
    codes = np.arange(0x7F, dtype=np.uint8)  # 0x7F is NaN
    e, m = (codes >> 3).astype(np.int64), (codes & 7).astype(np.float64)
    values = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return values, codes


VALUES, CODES = _e4m3_table()


def ref_e4m3(x: np.ndarray) -> np.ndarray:
    """Round fp32 values in [-448, 448] to e4m3fn codes: nearest, ties to the even code."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(VALUES, a), 1, len(VALUES) - 1)
    lo = hi - 1
    d_lo, d_hi = a - VALUES[lo], VALUES[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(CODES[lo] % 2 == 0, lo, hi)))
    pick = np.where(a == VALUES[hi], hi, pick)
    return CODES[pick] | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def ref_quantize(w: np.ndarray, block=(128, 128), prev_inv=None, keep_octaves=4):
    rows, cols = w.shape
    b0, b1 = block
    nb0, nb1 = -(-rows // b0), -(-cols // b1)
    w = w.astype(np.float32)
    q = np.zeros((rows, cols), np.uint8)
    inv = np.ones((nb0, nb1), np.float32)
    for i in range(nb0):  # a loop per block: the reference is for small tests only
        for j in range(nb1):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            amax = np.float32(np.abs(blk).max())
            scale = np.float32(np.float32(E4M3_MAX) / amax) if amax > 0 else np.float32(1)
            if prev_inv is not None:
                prev = np.float32(np.float32(1) / prev_inv[i, j])
                covers = np.float32(np.float32(E4M3_MAX) / prev)
                if amax * prev <= E4M3_MAX and amax >= covers * np.float32(2.0 ** -keep_octaves):
                    scale = prev
            scaled = np.clip(blk * scale, -E4M3_MAX, E4M3_MAX).astype(np.float32)
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = ref_e4m3(scaled)
            inv[i, j] = np.float32(1) / scale
    return q, inv


def u8(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def u32(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


def weights(rng, shape, dtype=torch.bfloat16, scale=0.02) -> torch.Tensor:
    return torch.from_numpy(rng.normal(0, scale, shape).astype(np.float32)).to(dtype)


def test_the_reference_rounding_agrees_with_the_format():
    assert VALUES[-1] == 448 and VALUES[1] == 2.0 ** -9 and len(VALUES) == 127
    x = np.array([0.0, -0.0, 448.0, 1.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10], np.float32)
    # 1.0625 lies halfway between 1.0 (code 0x38) and 1.125 (0x39): the even code wins.
    assert ref_e4m3(x).tolist() == [0x00, 0x80, 0x7E, 0x38, 0x38, 0x3A, 0x00, 0x02]


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (128, 128), (129, 127), (256, 300), (0, 7), (7, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bits_equal_the_reference(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    w = weights(rng, shape, dtype)
    q, inv = Fp8BlockQuantizer().quantize(w)
    assert q.dtype == torch.float8_e4m3fn and inv.dtype == torch.float32
    rq, rinv = ref_quantize(w.float().numpy())
    assert np.array_equal(u8(q), rq) and np.array_equal(u32(inv), rinv.view(np.int32))


def test_edges_zero_blocks_signed_zeros_saturation_and_tiny_values():
    w = torch.zeros((130, 130), dtype=torch.float32)
    w[0, 0] = -0.0
    w[0:128, 128:] = 3.0e4              # a block whose values all equal its amax: 448 exactly
    w[128:, 0:128] = 2.0 ** -40          # a block far below bf16's usual range
    w[129, 129] = -1.0
    q, inv = Fp8BlockQuantizer().quantize(w)
    rq, rinv = ref_quantize(w.numpy())
    assert np.array_equal(u8(q), rq) and np.array_equal(u32(inv), rinv.view(np.int32))
    assert u8(q)[0, 0] == 0x80 and float(inv[0, 0]) == 1.0      # an all-zero block: scale 1, -0 kept
    assert set(u8(q)[0:128, 128:].ravel().tolist()) == {0x7E}   # 448, never NaN
    assert float(dequantize(q, inv)[129, 129]) == -1.0


def test_non_contiguous_and_repeated_inputs_give_the_same_bits():
    rng = np.random.default_rng(1)
    w = weights(rng, (300, 200))
    q1, s1 = Fp8BlockQuantizer().quantize(w)
    q2, s2 = Fp8BlockQuantizer().quantize(w.t().contiguous().t())
    assert np.array_equal(u8(q1), u8(q2)) and np.array_equal(u32(s1), u32(s2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(bad):
    w = torch.zeros((4, 4))
    w[1, 2] = bad
    with pytest.raises(UsageError, match="non-finite"):
        Fp8BlockQuantizer().quantize(w)


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError):
        Fp8BlockQuantizer(policy="sometimes")
    with pytest.raises(UsageError):
        Fp8BlockQuantizer(block=(0, 128))
    with pytest.raises(UsageError):
        Fp8BlockQuantizer().quantize(torch.zeros(4))
    with pytest.raises(UsageError):
        Fp8BlockQuantizer().quantize(torch.zeros((2, 2), dtype=torch.int32))
    with pytest.raises(UsageError, match="shape"):
        Fp8BlockQuantizer(policy="keep").quantize(torch.ones((4, 4)), torch.ones((2, 2)))


def test_keep_policy_keeps_scales_that_fit_and_refreshes_the_others():
    rng = np.random.default_rng(2)
    w0 = weights(rng, (256, 256), torch.float32)
    keep = Fp8BlockQuantizer(policy="keep")
    q0, s0 = keep.quantize(w0)  # no previous scales: fresh
    w1 = w0.clone()
    w1[:128, :128] *= 1.5        # block (0, 0) outgrows its scale: fresh
    w1[:128, 128:] *= 0.5        # block (0, 1) shrinks within 4 octaves: kept
    w1[128:, :128] *= 2.0 ** -6  # block (1, 0) shrinks past 4 octaves: fresh
    w1[128:, 128:] += 1e-5       # block (1, 1) a small step: kept (if it still fits)
    q1, s1 = keep.quantize(w1, s0)
    rq, rinv = ref_quantize(w1.numpy(), prev_inv=s0.numpy())
    assert np.array_equal(u8(q1), rq) and np.array_equal(u32(s1), rinv.view(np.int32))
    fresh = Fp8BlockQuantizer().quantize(w1)[1]
    kept = u32(s1) == u32(s0)
    assert kept.tolist() == [[False, True], [False, bool(w1[128:, 128:].abs().max() * (1 / s0[1, 1]) <= 448)]]
    assert np.array_equal(u32(s1)[~kept], u32(fresh)[~kept])
    assert float((q1.float().abs()).max()) <= E4M3_MAX


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), cols=st.integers(0, 40), b0=st.integers(1, 16), b1=st.integers(1, 16),
       rate=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), policy=st.sampled_from(["fresh", "keep"]))
def test_property_any_shape_block_and_step(rows, cols, b0, b1, rate, seed, policy):
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 1, (rows, cols)).astype(np.float32) * np.float32(10.0 ** rng.integers(-6, 3))
    w0[rng.random((rows, cols)) < 0.05] = -0.0
    w1 = w0.copy()
    mask = rng.random((rows, cols)) < rate
    w1[mask] += rng.normal(0, 1e-3, mask.sum()).astype(np.float32) * np.abs(w0[mask])
    quant = Fp8BlockQuantizer(block=(b0, b1), policy=policy)
    _, s0 = quant.quantize(torch.from_numpy(w0))
    q1, s1 = quant.quantize(torch.from_numpy(w1), s0 if policy == "keep" else None)
    rq, rinv = ref_quantize(w1, (b0, b1), s0.numpy() if policy == "keep" else None)
    assert np.array_equal(u8(q1), rq) and np.array_equal(u32(s1), rinv.view(np.int32))


def test_state_quantization_selects_linear_weights_and_logs_bit_exact(tmp_path):
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.state import to_bits
    from dcr_log.write.writer import LogWriter

    rng = np.random.default_rng(4)
    state = {"model.embed_tokens.weight": weights(rng, (64, 32)),
             "model.layers.0.self_attn.q_proj.weight": weights(rng, (200, 32)),
             "model.layers.0.mlp.down_proj.weight": weights(rng, (32, 130)),
             "model.layers.0.input_layernorm.weight": weights(rng, (32,)),
             "model.norm.weight": weights(rng, (32,)), "lm_head.weight": weights(rng, (64, 32))}
    quant = Fp8BlockQuantizer(policy="keep")
    versions = [quant.quantize_state(state)]
    for _ in range(3):
        state = {n: (t.float() + torch.from_numpy(rng.normal(0, 1e-4, tuple(t.shape)).astype(np.float32))
                     ).to(t.dtype) for n, t in state.items()}
        versions.append(quant.quantize_state(state, previous=versions[-1]))
    q = versions[0]
    assert sorted(n for n in q if n.endswith("_scale_inv")) == [
        "model.layers.0.mlp.down_proj.weight_scale_inv", "model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert q["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(q["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (1, 2)
    assert q["lm_head.weight"].dtype == torch.bfloat16 and q["model.norm.weight"].dtype == torch.bfloat16
    assert quantized_by_default("model.layers.3.mlp.experts.7.gate_proj.weight", (8, 8))
    # MoE routers stay as they are (vLLM builds them without a quant_config).
    for router in ("model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.gate.weight",
                   "model.layers.3.mlp.shared_expert_gate.weight"):
        assert not quantized_by_default(router, (8, 8)), router
    assert quantized_by_default("model.layers.3.mlp.shared_expert.gate_proj.weight", (8, 8))
    writer = LogWriter.create(tmp_path / "log", versions[0], cache_dir=False)
    for v in versions[1:]:
        writer.append(v)
    log = DeltaLog.open(tmp_path / "log")
    for i, v in enumerate(versions):
        got = log.materialize(i)
        assert got.keys() == v.keys()
        for name, t in v.items():
            want = to_bits(t)
            assert got[name].dtype == want.dtype and np.array_equal(got[name].words, want.words), name
    assert log.commit(0).tensors[0].dtype in {"BF16", "F8_E4M3", "F32"}
    assert {t.dtype for t in log.commit(0).tensors} == {"BF16", "F8_E4M3", "F32"}


def test_quantization_config_names_the_block():
    assert Fp8BlockQuantizer(block=(64, 128)).quantization_config() == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 128]}


def test_cli_init_append_and_apply_a_quantized_checkpoint(tmp_path, capsys):
    """``dcr init/append --quantize fp8-block``: the log holds the quantizer's bits (keep policy:
    the previous version's scales read back from the log), config.json carries the
    quantization_config, and ``dcr apply`` writes the FP8 checkpoint an engine loads."""
    import json

    from safetensors.torch import load_file, save_file

    from dcr_log.cli import main
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.state import to_bits

    rng = np.random.default_rng(6)
    names = {"model.layers.0.self_attn.q_proj.weight": (256, 130), "model.layers.0.mlp.up_proj.weight": (64, 256),
             "model.norm.weight": (130,)}
    states = [{n: weights(rng, s) for n, s in names.items()}]
    for _ in range(2):
        states.append({n: (t.float() + torch.from_numpy(rng.normal(0, 2e-4, tuple(t.shape)).astype(np.float32))
                           ).to(torch.bfloat16) for n, t in states[-1].items()})
    dirs = []
    for v, state in enumerate(states):
        d = tmp_path / f"ckpt{v}"
        d.mkdir()
        save_file(state, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
        dirs.append(d)
    log, rx = tmp_path / "log", tmp_path / "rx"
    assert main(["init", str(log), "--from", str(dirs[0]), "--quantize", "fp8-block", "--cache", "none"]) == 0
    for d in dirs[1:]:
        assert main(["append", str(log), "--from", str(d), "--quantize", "fp8-block", "--cache", "none"]) == 0
    quant = Fp8BlockQuantizer(policy="keep")
    expected = [quant.quantize_state(states[0])]
    for state in states[1:]:
        expected.append(quant.quantize_state(state, previous=expected[-1]))
    dlog = DeltaLog.open(log)
    for v, want in enumerate(expected):
        got = dlog.materialize(v)
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert np.array_equal(got[name].words, to_bits(t).words), (v, name)
        config = json.loads(dlog.read_files(v)["config.json"])
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert main(["apply", str(log), "--receiver", str(rx)]) == 0
    held = load_file(rx / "model.safetensors")
    assert held["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(held["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (2, 2)
    up = "model.layers.0.mlp.up_proj.weight"
    assert u8(held[up]).tobytes() == u8(expected[-1][up]).tobytes()
    assert json.loads((rx / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    capsys.readouterr()
    assert main(["init", str(tmp_path / "bad"), "--from", str(dirs[0]), "--quantize", "int4"]) == 2
    assert not (tmp_path / "bad").exists()
