"""Test engines that place checkpoint tensors the way vLLM does (vLLM itself does not install here).

``TestEngine`` is one tensor-parallel rank of a small Llama/Mixtral-like model: parameter names,
shapes, ``weight_loader`` attributes and ``load_weights`` follow vLLM's, in a compact form. The
vLLM code it imitates (vllm-project/vllm, read for this file):

- vllm/model_executor/layers/linear.py: ``QKVParallelLinear.__init__`` (KV heads partitioned when
  ``num_kv_heads >= tp_size``, else each rank holds one head and ``num_kv_head_replicas =
  tp_size // num_kv_heads`` ranks share it) and ``.weight_loader``; ``MergedColumnParallelLinear``,
  ``RowParallelLinear`` and ``ReplicatedLinear`` ``.weight_loader``;
  vllm/model_executor/parameter.py ``_ColumnvLLMParameter.load_qkv_weight`` (the v2 path, same map);
- vllm/model_executor/layers/vocab_parallel_embedding.py: ``pad_vocab_size`` (the *global* vocab
  is padded to a multiple of 64, then divided by tp_size), ``_get_indices``, ``weight_loader``
  (rows past the real vocab are zero-filled), ``ParallelLMHead.tie_weights`` (the head *is* the
  embedding Parameter);
- vllm/model_executor/layers/fused_moe/layer.py: ``FusedMoE.weight_loader`` / ``_load_w13`` /
  ``_load_w2`` and ``make_expert_params_mapping``;
- vllm/model_executor/models/llama.py and mixtral.py: ``load_weights`` (``stacked_params_mapping``,
  skipping ``rotary_emb.inv_freq``; lm_head skipped when tied, as ``AutoWeightsLoader(...,
  skip_prefixes=["lm_head."])`` does); vllm/model_executor/model_loader/weight_utils.py
  ``default_weight_loader`` and ``composed_weight_loader``.

Deliberate differences: every loader checks the *whole* checkpoint tensor's shape before it
writes anything (vLLM's vocab and FusedMoE loaders check one dimension or none, and ``copy_``
broadcasts, so e.g. an ``[I, 1]`` expert weight would be written silently); checks raise
ValueError (not ``assert``, which ``python -O`` drops). Unknown names are skipped by default
(``unknown_names="raise"`` gives vLLM's KeyError). Within one ``load_weights`` call, tensors
before a failing one stay loaded, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")  # llama.py
# (param_name, shard_name, shard_id), LlamaForCausalLM.load_weights
STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
]


@dataclass(frozen=True)
class EngineConfig:
    vocab_size: int = 1000          # not a multiple of 64: exercises vocab padding
    hidden: int = 64
    num_heads: int = 8
    num_kv_heads: int = 2           # grouped-query; tp_size=4 replicates each KV head on 2 ranks
    head_dim: int = 8
    intermediate: int = 96
    num_layers: int = 2
    moe_layers: tuple[int, ...] = (1,)
    num_experts: int = 4
    moe_intermediate: int = 32
    tie_word_embeddings: bool = True
    tie_mode: str = "shared"        # "shared": lm_head IS the embedding Parameter; "copy": its own
    dtype: torch.dtype = torch.bfloat16
    fp32_final_norm: bool = True    # model.norm.weight kept in float32 (loader casts)
    scaled_param: bool = True       # layer 0 post_attention_layernorm stored as loaded * 2
    rope_cache: bool = True         # one cos_sin_cache buffer shared by all layers, as vLLM's get_rope
    max_position: int = 32
    vocab_padding: int = 64         # DEFAULT_VOCAB_PADDING_SIZE
    unknown_names: str = "skip"     # or "raise" (KeyError, as vLLM)
    device: str | None = None
    # Block FP8 (vLLM's Fp8LinearMethod with weight_block_size): the linear layers' weights are
    # float8_e4m3fn with fp32 ``weight_scale_inv`` [ceil(out/b0), ceil(in/b1)] per rank; None: off.
    fp8_block: tuple[int, int] | None = None


def fp8_config(**overrides: Any) -> EngineConfig:
    """A dense model for block FP8 (128x128): the fused and split output dims are multiples of
    128 (vLLM's ``validate_fp8_block_shape`` requires it), the hidden size (the input of the
    column-parallel and the output of the row-parallel layers, never split) is not, so the
    last block row or column of every linear weight is partial."""
    base: dict[str, Any] = dict(vocab_size=1000, hidden=320, num_heads=4, num_kv_heads=2, head_dim=128,
                                intermediate=256, num_layers=2, moe_layers=(), fp8_block=(128, 128))
    return EngineConfig(**{**base, **overrides})


def pad_vocab_size(vocab_size: int, pad_to: int = 64) -> int:
    """vocab_parallel_embedding.pad_vocab_size."""
    return (vocab_size + pad_to - 1) // pad_to * pad_to


def canonical_shapes(cfg: EngineConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The Hugging Face checkpoint (Llama / Mixtral names): name -> (dtype, shape)."""
    d, H = cfg.dtype, cfg.hidden
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"model.embed_tokens.weight": (d, (cfg.vocab_size, H))}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (d, (cfg.num_heads * cfg.head_dim, H))
        out[p + "self_attn.k_proj.weight"] = (d, (cfg.num_kv_heads * cfg.head_dim, H))
        out[p + "self_attn.v_proj.weight"] = (d, (cfg.num_kv_heads * cfg.head_dim, H))
        out[p + "self_attn.o_proj.weight"] = (d, (H, cfg.num_heads * cfg.head_dim))
        if i == 0:  # a tensor every engine ignores (llama.py skips it)
            out[p + "self_attn.rotary_emb.inv_freq"] = (torch.float32, (cfg.head_dim // 2,))
        out[p + "input_layernorm.weight"] = (d, (H,))
        out[p + "post_attention_layernorm.weight"] = (d, (H,))
        if i in cfg.moe_layers:
            inter = cfg.moe_intermediate
            out[p + "block_sparse_moe.gate.weight"] = (d, (cfg.num_experts, H))
            for e in range(cfg.num_experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                out[q + "w1.weight"], out[q + "w3.weight"] = (d, (inter, H)), (d, (inter, H))
                out[q + "w2.weight"] = (d, (H, inter))
        else:
            inter = cfg.intermediate
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = (d, (inter, H)), (d, (inter, H))
            out[p + "mlp.down_proj.weight"] = (d, (H, inter))
    out["model.norm.weight"] = (d, (H,))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (d, (cfg.vocab_size, H))
    if cfg.fp8_block is not None:  # the FP8 checkpoint: e4m3 linear weights and their block scales
        b0, b1 = cfg.fp8_block
        for name, (_, shape) in list(out.items()):
            if _fp8_linear(name):
                out[name] = (torch.float8_e4m3fn, shape)
                out[name + "_scale_inv"] = (torch.float32, (-(-shape[0] // b0), -(-shape[1] // b1)))
    return out


def _fp8_linear(name: str) -> bool:
    """The linear layers vLLM's Fp8LinearMethod quantizes in this model (attention and dense MLP
    projections); embeddings, norms and the head stay in the model dtype."""
    return name.endswith(("_proj.weight",))


def random_canonical(cfg: EngineConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic N(0, 1) values of every canonical tensor, contiguous, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).contiguous()
            for name, (dtype, shape) in canonical_shapes(cfg).items()}


def _div_ceil(a: int, b: int) -> int:
    return -(-a // b)


def make_expert_params_mapping(gate: str, down: str, up: str, num_experts: int) -> list[tuple[str, str, int, str]]:
    """FusedMoE.make_expert_params_mapping: (param_name, weight_name, expert_id, shard_id)."""
    return [("experts.w13_" if w in (gate, up) else "experts.w2_", f"experts.{e}.{w}.", e, s)
            for e in range(num_experts) for s, w in (("w1", gate), ("w2", down), ("w3", up))]


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _check_shape(loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    _check(tuple(loaded.shape) == tuple(shape), f"{what}: checkpoint tensor of shape "
           f"{tuple(loaded.shape)}, expected {tuple(shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """weight_utils.default_weight_loader: whole tensor, same shape; copy_ casts the dtype."""
    _check_shape(loaded, tuple(param.shape), "default_weight_loader")
    param.data.copy_(loaded)


def composed_weight_loader(loader: Callable, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """weight_utils.composed_weight_loader: load, then rewrite the parameter as fn(parameter)."""
    def composed(param: torch.Tensor, loaded: torch.Tensor) -> None:
        loader(param, loaded)
        param.data.copy_(fn(param.data))
    return composed


class TestEngine(torch.nn.Module):
    """Rank ``tp_rank`` of ``tp_size`` of a small vLLM-style model; parameters start at zero.

    Parameters (``engine_params``): ``model.embed_tokens.weight`` [padded_vocab/tp, H]; per layer
    ``model.layers.{i}.`` + ``input_layernorm.weight`` [H], ``post_attention_layernorm.weight``
    [H], ``self_attn.qkv_proj.weight`` [(heads/tp + 2 * kv_heads_per_rank) * head_dim, H],
    ``self_attn.o_proj.weight`` [H, heads/tp * head_dim]; dense layers ``mlp.gate_up_proj.weight``
    [2 * I/tp, H] and ``mlp.down_proj.weight`` [H, I/tp]; MoE layers
    ``block_sparse_moe.gate.weight`` [E, H] (replicated), ``block_sparse_moe.experts.w13_weight``
    [E, 2 * I_moe/tp, H] and ``...experts.w2_weight`` [E, H, I_moe/tp]; ``model.norm.weight`` [H];
    ``lm_head.weight`` [padded_vocab/tp, H] unless shared with the embedding; the buffer
    ``model.layers.0.self_attn.rotary_emb.cos_sin_cache`` [max_position, head_dim].
    """

    __test__ = False  # not a pytest test class

    def __init__(self, cfg: EngineConfig = EngineConfig(), tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        c, tp = cfg, tp_size
        self.cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        _check(0 <= tp_rank < tp_size, f"tp_rank {tp_rank} outside tp_size {tp_size}")
        _check(c.num_heads % tp == 0 and c.intermediate % tp == 0 and c.moe_intermediate % tp == 0,
               "heads and intermediate sizes must divide by tp_size")
        _check(c.tie_mode in ("shared", "copy") and c.unknown_names in ("skip", "raise"),
               f"tie_mode {c.tie_mode!r} / unknown_names {c.unknown_names!r}")
        if tp >= c.num_kv_heads:  # QKVParallelLinear.__init__: replicate KV heads
            _check(tp % c.num_kv_heads == 0, "tp_size must be a multiple of num_kv_heads")
            self.kv_heads, self.kv_replicas = 1, tp // c.num_kv_heads
        else:                     # partition KV heads
            _check(c.num_kv_heads % tp == 0, "num_kv_heads must divide by tp_size")
            self.kv_heads, self.kv_replicas = c.num_kv_heads // tp, 1
        self.q_heads = c.num_heads // tp
        self.padded_vocab = pad_vocab_size(c.vocab_size, c.vocab_padding)
        _check(self.padded_vocab % tp == 0, "padded vocab must divide by tp_size")  # divide()
        per = self.padded_vocab // tp  # VocabParallelEmbedding._get_indices (no added vocab)
        self.vocab_start, self.vocab_end = min(tp_rank * per, c.vocab_size), min((tp_rank + 1) * per, c.vocab_size)
        self._device = torch.device(c.device) if c.device else torch.device("cpu")
        H, d = c.hidden, c.dtype
        qkv_rows = (self.q_heads + 2 * self.kv_heads) * c.head_dim
        if c.fp8_block is not None:
            _check(not c.moe_layers, "the FP8 engine is dense (moe_layers=())")
            b0, b1 = c.fp8_block
            # fp8_utils.validate_fp8_block_shape: split or fused output partitions whole blocks,
            # a split input partition whole blocks.
            parts = [self.q_heads * c.head_dim, self.kv_heads * c.head_dim, c.intermediate // tp]
            _check(all(n % b0 == 0 for n in parts), f"output partitions {parts} must be multiples of {b0}")
            _check(tp == 1 or all(n % b1 == 0 for n in (self.q_heads * c.head_dim, c.intermediate // tp)),
                   f"row-parallel input partitions must be multiples of {b1}")

        embed = self._param("model.embed_tokens.weight", (per, H), d, self._load_vocab)
        rope = self._rope_module() if c.rope_cache else None
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self._param(p + "input_layernorm.weight", (H,), d, default_weight_loader)
            scaled = c.scaled_param and i == 0
            self._param(p + "post_attention_layernorm.weight", (H,), d,
                        composed_weight_loader(default_weight_loader, lambda t: t * 2) if scaled
                        else default_weight_loader)
            self._linear(p + "self_attn.qkv_proj", (qkv_rows, H), self._load_qkv, self._load_qkv_scale)
            self._linear(p + "self_attn.o_proj", (H, self.q_heads * c.head_dim), self._load_row, self._load_row)
            if rope is not None:
                self._module(p + "self_attn").add_module("rotary_emb", rope)  # one module, many names
            if i in c.moe_layers:
                Ir = c.moe_intermediate // tp
                self._param(p + "block_sparse_moe.gate.weight", (c.num_experts, H), d, default_weight_loader)
                self._param(p + "block_sparse_moe.experts.w13_weight", (c.num_experts, 2 * Ir, H), d, self._load_moe)
                self._param(p + "block_sparse_moe.experts.w2_weight", (c.num_experts, H, Ir), d, self._load_moe)
            else:
                Ir = c.intermediate // tp
                self._linear(p + "mlp.gate_up_proj", (2 * Ir, H), self._load_merged, self._load_merged_scale)
                self._linear(p + "mlp.down_proj", (H, Ir), self._load_row, self._load_row)
        self._param("model.norm.weight", (H,), torch.float32 if c.fp32_final_norm else d, default_weight_loader)
        if c.tie_word_embeddings and c.tie_mode == "shared":
            self._module("lm_head").weight = embed  # ParallelLMHead.tie_weights
        else:
            self._param("lm_head.weight", (per, H), d, self._load_vocab)
        self.expert_params_mapping = make_expert_params_mapping("w1", "w2", "w3", c.num_experts)

    # -- construction -------------------------------------------------------------------------
    def _module(self, path: str) -> torch.nn.Module:
        m: torch.nn.Module = self
        for part in path.split(".") if path else ():
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        return m

    def _param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader: Callable) -> torch.nn.Parameter:
        path, _, attr = name.rpartition(".")
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=self._device), requires_grad=False)
        p.weight_loader = loader  # set_weight_attrs(param, {"weight_loader": ...})
        self._module(path).register_parameter(attr, p)
        return p

    def _linear(self, prefix: str, shape: tuple[int, int], loader: Callable, scale_loader: Callable) -> None:
        """A linear layer's ``weight`` (model dtype, or e4m3 with FP8) and, with FP8, its fp32
        ``weight_scale_inv`` of one entry per block (Fp8LinearMethod.create_weights with
        weight_block_size: ModelWeightParameter + BlockQuantScaleParameter)."""
        block = self.cfg.fp8_block
        if block is None:
            self._param(prefix + ".weight", shape, self.cfg.dtype, loader)
            return
        self._param(prefix + ".weight", shape, torch.float8_e4m3fn, loader)
        self._param(prefix + ".weight_scale_inv", (_div_ceil(shape[0], block[0]), _div_ceil(shape[1], block[1])),
                    torch.float32, scale_loader)

    def _rope_module(self) -> torch.nn.Module:
        """RotaryEmbedding's cos_sin_cache (non-persistent buffer, model dtype), fed by no tensor."""
        c, m = self.cfg, torch.nn.Module()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(c.dtype).to(self._device)
        m.register_buffer("cos_sin_cache", cache, persistent=False)
        return m

    # -- weight loaders (bound methods, stored as param.weight_loader) -------------------------
    def _load_qkv(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        """QKVParallelLinear.weight_loader: q by tp_rank, k/v by tp_rank // num_kv_head_replicas."""
        c, hd = self.cfg, self.cfg.head_dim
        q, kv = self.q_heads * hd, self.kv_heads * hd
        offset, size, total = {"q": (0, q, c.num_heads * hd), "k": (q, kv, c.num_kv_heads * hd),
                               "v": (q + kv, kv, c.num_kv_heads * hd)}[shard_id]
        _check_shape(loaded, (total, c.hidden), f"qkv_proj shard {shard_id}")
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def _load_qkv_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        """QKVParallelLinear.weight_loader_v2 for a BlockQuantScaleParameter: the shard's row
        offset and size in weight rows become ceil(offset / b0) and ceil(size / b0) block rows
        (linear.adjust_block_scale_shard), then _ColumnvLLMParameter.load_qkv_weight narrows
        the checkpoint scale at shard rank * size block rows."""
        c, hd = self.cfg, self.cfg.head_dim
        assert c.fp8_block is not None
        b0, b1 = c.fp8_block
        q, kv = self.q_heads * hd, self.kv_heads * hd
        offset, size, total = {"q": (0, q, c.num_heads * hd), "k": (q, kv, c.num_kv_heads * hd),
                               "v": (q + kv, kv, c.num_kv_heads * hd)}[shard_id]
        offset, size = _div_ceil(offset, b0), _div_ceil(size, b0)
        _check_shape(loaded, (_div_ceil(total, b0), _div_ceil(c.hidden, b1)), f"qkv_proj scale shard {shard_id}")
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def _load_merged_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        """MergedColumnParallelLinear.weight_loader_v2 for a BlockQuantScaleParameter: shard
        offset and size in block rows (adjust_block_scale_shard), then
        _ColumnvLLMParameter.load_merged_column_weight narrows at tp_rank * size block rows."""
        assert self.cfg.fp8_block is not None
        b0 = self.cfg.fp8_block[0]
        rows = self.cfg.intermediate // self.tp_size
        offset, size = _div_ceil(shard_id * rows, b0), _div_ceil(rows, b0)
        _check(shard_id in (0, 1), f"shard id {shard_id}")
        _check_shape(loaded, (_div_ceil(self.cfg.intermediate, b0), param.shape[1]),
                     f"gate_up_proj scale shard {shard_id}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))

    def _load_merged(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        """MergedColumnParallelLinear.weight_loader: shard shard_id of [gate; up], rows by tp_rank."""
        size = param.shape[0] // 2
        _check(shard_id in (0, 1), f"shard id {shard_id}")
        _check_shape(loaded, (size * self.tp_size, param.shape[1]), f"gate_up_proj shard {shard_id}")
        param.data.narrow(0, shard_id * size, size).copy_(loaded.narrow(0, self.tp_rank * size, size))

    def _load_row(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """RowParallelLinear.weight_loader: input dim (1) split by tp_rank. The same for a block
        scale (RowvLLMParameter.load_row_parallel_weight: the parameter's input_dim size, in
        blocks, times tp_rank)."""
        size = param.shape[1]
        _check_shape(loaded, (param.shape[0], size * self.tp_size), "row-parallel weight")
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def _load_vocab(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """VocabParallelEmbedding.weight_loader: this rank's vocab rows, padding rows zero-filled."""
        _check_shape(loaded, (self.cfg.vocab_size, param.shape[1]), "vocab-parallel weight")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))
        param.data[n:].fill_(0)

    def _load_moe(self, param: torch.Tensor, loaded: torch.Tensor, weight_name: str, shard_id: str,
                  expert_id: int) -> None:
        """FusedMoE.weight_loader (_load_w13 / _load_w2) for one expert's 2-D checkpoint tensor."""
        _check(shard_id in ("w1", "w2", "w3"), f"shard_id must be w1, w2 or w3, got {shard_id}")
        _check(0 <= expert_id < param.shape[0], f"expert {expert_id} not on this rank")
        expert = param.data[expert_id]
        if shard_id == "w2":  # down_proj: RowParallel, input dim split
            size = expert.shape[1]
            _check_shape(loaded, (expert.shape[0], size * self.tp_size), f"{weight_name} w2")
            expert.copy_(loaded.narrow(1, size * self.tp_rank, size))
        else:                 # w1 (gate) -> first half of w13, w3 (up) -> second half
            size = expert.shape[0] // 2
            _check_shape(loaded, (size * self.tp_size, expert.shape[1]), f"{weight_name} {shard_id}")
            dst = expert.narrow(0, 0 if shard_id == "w1" else size, size)
            dst.copy_(loaded.narrow(0, size * self.tp_rank, size))

    # -- the model's load_weights --------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama/MixtralModel.load_weights: any subset of the checkpoint, any number of calls.

        Returns the names of the parameters written (vLLM's ``loaded_params``)."""
        params = dict(self.named_parameters())
        loaded_params: set[str] = set()
        for name, w in weights:
            if any(s in name for s in SKIPPED):
                continue
            if self.cfg.tie_word_embeddings and name.startswith("lm_head."):
                continue  # AutoWeightsLoader(skip_prefixes=["lm_head."]) when tied
            call: tuple[Any, ...] = ()
            for param_name, shard_name, shard_id in STACKED_PARAMS_MAPPING:
                if shard_name in name:
                    target, call = name.replace(shard_name, param_name), (shard_id,)
                    break
            else:
                for param_name, weight_name, expert_id, shard_id in self.expert_params_mapping:
                    if weight_name in name:
                        target = name.replace(weight_name, param_name)
                        call = (target, shard_id, expert_id)
                        break
                else:
                    target = name
            if target not in params:
                if self.cfg.unknown_names == "raise":
                    raise KeyError(f"no parameter for checkpoint tensor {name!r}")
                continue
            param = params[target]
            with torch.no_grad():
                param.weight_loader(param, w, *call)
                loaded_params.add(target)
                if (target == "model.embed_tokens.weight" and "lm_head.weight" in params
                        and self.cfg.tie_word_embeddings):
                    head = params["lm_head.weight"]  # tie_mode "copy": the same tensor feeds the head
                    head.weight_loader(head, w)
                    loaded_params.add("lm_head.weight")
        return loaded_params


def fp8_param_words(params: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Every parameter's bytes (the e4m3 and fp32 words as they are), for bit-exact comparison."""
    return {n: t.detach().contiguous().view(torch.uint8).numpy().tobytes() for n, t in params.items()}


def fresh_engine(cfg: EngineConfig, canonical: dict[str, torch.Tensor], tp_rank: int = 0,
                 tp_size: int = 1) -> TestEngine:
    """A new engine with ``load_weights(canonical.items())`` called once: the reference."""
    engine = TestEngine(cfg, tp_rank, tp_size)
    engine.load_weights(canonical.items())
    return engine


def engine_params(engine: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``dict(engine.named_parameters())`` plus ``named_buffers()``: the engine's state, by name.

    Parameters and modules are deduplicated by identity, as torch does: with ``tie_mode="shared"``
    the dict holds ``model.embed_tokens.weight`` and no ``lm_head.weight`` (the head is the same
    Parameter); with ``"copy"`` or untied embeddings it holds both, separate tensors. The rotary
    cache, one module shared by all layers, appears once, as
    ``model.layers.0.self_attn.rotary_emb.cos_sin_cache``."""
    return {**dict(engine.named_parameters()), **dict(engine.named_buffers())}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


class NumpyEngine:
    """TestEngine placement with numpy storage: ``params`` are numpy arrays sharing memory with
    the torch parameters (bf16 as ``uint16`` words), ``dtypes`` their safetensors dtype names.
    ``load_weights`` takes numpy arrays (bf16 as uint16 words) or torch tensors."""

    def __init__(self, cfg: EngineConfig = EngineConfig(), tp_rank: int = 0, tp_size: int = 1):
        _check(cfg.device in (None, "cpu"), "NumpyEngine lives on the CPU")
        self.cfg, self.engine = cfg, TestEngine(cfg, tp_rank, tp_size)
        tensors = engine_params(self.engine)
        self.params = {name: _as_numpy(t) for name, t in tensors.items()}
        self.dtypes = {name: DTYPE_NAMES[t.dtype] for name, t in tensors.items()}
        self._canonical = canonical_shapes(cfg)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        def torched(name: str, w: Any) -> torch.Tensor:
            if isinstance(w, torch.Tensor):
                return w
            w = np.asarray(w)
            if any(s < 0 for s in w.strides):
                w = np.ascontiguousarray(w)
            t = torch.from_numpy(w)
            want = self._canonical.get(name, (None,))[0]
            return t.view(torch.bfloat16) if want == torch.bfloat16 and w.dtype == np.uint16 else t
        return self.engine.load_weights((name, torched(name, w)) for name, w in weights)


def fuse_bert_qkv(model: Any
                  ) -> tuple[dict[str, torch.Tensor], Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]]]:
    """Fuse each layer's query/key/value of a ``transformers.BertModel`` into one parameter.

    For layer i, ``encoder.layer.{i}.attention.self.qkv.weight`` [3H, H] and ``...qkv.bias`` [3H]
    hold [query; key; value]; the Linear modules' weight and bias become Parameters that are
    views of them, so the model's forward reads the fused storage. The fused Parameters are not
    registered in the model (its ``state_dict`` keeps the canonical names); the returned dict
    keeps them. Do not move the model (``.to``) afterwards: that would break the sharing.

    Returns ``(params, load_weights)``. ``params``: the fused tensors instead of query/key/value,
    and every other parameter and buffer of the model (including the non-persistent
    ``embeddings.position_ids`` / ``token_type_ids``), under the model's own names.
    ``load_weights(iterable of (BertModel state_dict name, tensor))`` copies query/key/value
    into their fused slices and any other name that is in ``params`` (buffers too) into that
    tensor, checking shapes first; names it does not know are skipped. It returns the
    ``params`` names written."""
    params: dict[str, torch.Tensor] = {}
    slices: dict[str, tuple[torch.Tensor, str]] = {}  # query/key/value name -> (fused slice, fused name)
    for i, layer in enumerate(model.encoder.layer):
        attn, prefix = layer.attention.self, f"encoder.layer.{i}.attention.self."
        linears = [getattr(attn, k) for k in ("query", "key", "value")]
        for kind in ("weight", "bias"):
            parts = [getattr(lin, kind) for lin in linears]
            fused = torch.nn.Parameter(torch.cat([p.detach() for p in parts]).contiguous(),
                                       requires_grad=parts[0].requires_grad)
            params[f"{prefix}qkv.{kind}"] = fused
            offset = 0
            for key, lin, part in zip(("query", "key", "value"), linears, parts):
                view = fused.data.narrow(0, offset, part.shape[0])
                setattr(lin, kind, torch.nn.Parameter(view, requires_grad=part.requires_grad))
                slices[f"{prefix}{key}.{kind}"] = (view, f"{prefix}qkv.{kind}")
                offset += part.shape[0]
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in slices:
            params[name] = t

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        written: set[str] = set()
        for name, w in weights:
            dst, target = slices.get(name, (params.get(name), name))
            if dst is None:
                continue
            _check_shape(w, tuple(dst.shape), name)
            with torch.no_grad():
                dst.data.copy_(w)
            written.add(target)
        return written

    return params, load_weights
