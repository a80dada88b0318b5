"""Tiny checkpoints built with transformers, and their versions: what a trainer would publish.

Every version changes 1-5% of the bf16 words of every tensor by one or two ulps (spread over
whole tensors, like an optimizer step); version 3 also changes one tensor whole; version 5
changes the tensor table (it adds a tensor vLLM's loader ignores), and version 6 goes on from it.
The block-FP8 family (``fp8_versions``) is versions 0..3 of such steps, quantized per version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

RATES = {1: 0.01, 2: 0.02, 3: 0.03, 4: 0.05, 5: 0.01, 6: 0.02}
VERSIONS = 6
WHOLE = "model.norm.weight"                                    # changed whole at version 3
ADDED = "model.layers.0.self_attn.rotary_emb.inv_freq"         # added at version 5 (vLLM drops it)


def build(kind: str, out: Path) -> Path:
    """A bf16 checkpoint: ``llama`` (grouped-query attention, untied), ``tied`` (tied
    embeddings, a vocabulary of 1001 that vLLM pads) or ``mixtral`` (stacked experts)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    torch.manual_seed({"llama": 1, "tied": 2, "mixtral": 3}[kind])
    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)  # head_dim 64 (vLLM's CPU attention needs >= 32)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(vocab_size=1000, intermediate_size=96, num_local_experts=4,
                                                 num_experts_per_tok=2, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1001 if kind == "tied" else 1000, intermediate_size=128,
                                             tie_word_embeddings=kind == "tied", **common))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def step(state: dict[str, torch.Tensor], version: int, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed * 1000 + version)
    new = {}
    for name, t in state.items():
        if t.dtype != torch.bfloat16:
            new[name] = t.clone()
            continue
        w = t.view(torch.int16).reshape(-1).numpy().copy()
        if version == 3 and name == WHOLE:
            pos = np.arange(w.size)
        else:
            pos = rng.choice(w.size, max(1, int(w.size * RATES[version])), replace=False)
        w[pos] += rng.choice(np.array([-2, -1, 1, 2], dtype=np.int16), pos.size)
        new[name] = torch.from_numpy(w).view(torch.bfloat16).reshape(t.shape)
    if version == 5:
        new[ADDED] = torch.arange(32, dtype=torch.float32) / 32
    return new


def versions(src: Path, root: Path, seed: int) -> list[Path]:
    """Dense checkpoint directories for versions 0..VERSIONS (config and all, as vLLM loads them)."""
    states = [load_file(src / "model.safetensors")]
    dirs = []
    for v in range(VERSIONS + 1):
        if v:
            states.append(step(states[-1], v, seed))
        d = root / f"v{v}"
        shutil.copytree(src, d)
        save_file(states[v], d / "model.safetensors")
        dirs.append(d)
    return dirs


FP8_VERSIONS = 3
DOUBLED = "model.layers.1.mlp.down_proj.weight"  # times 2 at FP8 version 2: every block a new scale


def build_fp8_source(out: Path) -> Path:
    """The bf16 Llama the FP8 family is quantized from: every linear dimension a multiple of
    128 (vLLM's block-FP8 kernels want whole 128-wide blocks on K and N)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def fp8_versions(src: Path, root: Path, seed: int, policy: str = "keep") -> list[Path]:
    """Block-FP8 checkpoint directories for versions 0..FP8_VERSIONS: the bf16 states stepped as
    above (1-3% of the words per version), each quantized with ``Fp8BlockQuantizer`` (e4m3
    weights, fp32 ``*_scale_inv`` per 128x128 block; ``keep``: the previous version's scales
    kept where they fit), with the quantizer's ``quantization_config`` in config.json. At version
    2 one weight doubles (exactly, in bf16): every one of its blocks outgrows its scale and takes
    a new one (small steps alone move no scale under ``keep``)."""
    import json

    from dcr_log.quant import Fp8BlockQuantizer
    quant = Fp8BlockQuantizer(policy=policy)
    bf16 = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant.quantization_config()
    dirs: list[Path] = []
    fp8: dict[str, torch.Tensor] | None = None
    for v in range(FP8_VERSIONS + 1):
        if v:
            bf16 = step(bf16, v, seed)
        if v == 2:
            bf16[DOUBLED] = bf16[DOUBLED] * 2
        fp8 = quant.quantize_state(bf16, previous=fp8)
        d = root / f"v{v}"
        shutil.copytree(src, d)
        (d / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: t.contiguous() for k, t in fp8.items()}, d / "model.safetensors")
        dirs.append(d)
    return dirs
