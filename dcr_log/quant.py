"""Trainer-side quantization for FP8 rollout engines: a bf16 or fp32 state to the block-scaled
FP8 checkpoint form an engine loads as pre-quantized weights (DeepSeek-V3 style: e4m3 weights,
fp32 ``weight_scale_inv`` per 128x128 block, ``quantization_config`` with ``weight_block_size``).

The log itself only carries the FP8 and fp32 words; this module decides them, deterministically:
the same input gives the same bits on every device (IEEE fp32 multiply, reciprocal and divide,
round-to-nearest-even into e4m3, no fused or fast-math paths, every division a true one). The
rules (FORMAT.md section 27, informative):

- a block is ``block[0]`` rows by ``block[1]`` columns of a 2-D weight; the last blocks of a
  row or column may be partial and their amax is over their own elements only;
- ``amax`` = max |w| over the block in fp32; ``scale = 448 / amax`` (fp32; 1 when amax is 0);
- ``q = e4m3(clamp(w * scale, -448, 448))``, rounding to nearest, ties to even (torch's cast);
- ``weight_scale_inv = 1 / scale`` (fp32): the engine dequantizes ``q * weight_scale_inv``.
- non-finite weights are refused (a NaN or inf amax has no scale).

Scale policies. ``fresh`` recomputes every block's scale each step: a block whose amax moves
re-rounds all its words, so a small training step rewrites whole blocks of FP8. ``keep`` keeps
the previous version's scale of a block while the block still fits it (amax <= 448 / scale, no
word saturates) and its amax has not fallen below ``1 / 2**keep_octaves`` of the range the scale
covers; otherwise the block takes a fresh scale. e4m3 is a floating-point format, so a kept scale
loses precision only for values that fall to its subnormal range.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dcr_log.errors import UsageError

E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
POLICIES = ("fresh", "keep")

# The linear layers' weights an FP8 engine quantizes: 2-D ``.weight`` tensors that are not
# embeddings, norms or the output head (vLLM's Fp8LinearMethod covers LinearBase layers; the
# embedding, lm_head and norms stay in the checkpoint's dtype). NeMo RL's refit uses the same rule.
# MoE routers are linear layers built without a quant_config in vLLM's MoE models (Mixtral's
# ``block_sparse_moe.gate``, DeepSeek's and Qwen's ``mlp.gate``, Qwen's ``shared_expert_gate``),
# and block-FP8 checkpoints keep them in bf16: they are not quantized either.
_NOT_QUANTIZED = re.compile(r"norm|embed|lm_head|\.gate\.weight$|shared_expert_gate\.weight$", re.IGNORECASE)


def quantized_by_default(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and not _NOT_QUANTIZED.search(name)


@dataclass(frozen=True)
class Fp8BlockQuantizer:
    """Quantizes a state's linear weights to block-scaled e4m3 (see the module docstring).

    ``select(name, shape)`` picks the tensors to quantize; the others pass through unchanged.
    ``policy`` is ``fresh`` or ``keep``; with ``keep``, ``quantize_state(..., previous=...)``
    takes the previous version's quantized state (its ``*_scale_inv`` tensors are what is kept).
    """

    block: tuple[int, int] = DEFAULT_BLOCK
    policy: str = "fresh"
    keep_octaves: int = 4
    select: Callable[[str, tuple[int, ...]], bool] = quantized_by_default

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise UsageError(f"scale policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if len(self.block) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block):
            raise UsageError(f"block must be two positive ints, not {self.block!r}")
        if not 0 <= self.keep_octaves <= 100:
            raise UsageError("keep_octaves must be between 0 and 100")

    def quantization_config(self) -> dict[str, Any]:
        """The checkpoint's ``quantization_config`` (config.json) for an engine loading it."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block)}

    def quantize(self, weight: Any, previous_scale_inv: Any = None) -> tuple[Any, Any]:
        """One 2-D weight (torch tensor, any float dtype and device) to ``(q, scale_inv)``:
        q float8_e4m3fn of the weight's shape, scale_inv fp32 of shape (ceil(rows/b0),
        ceil(cols/b1)), both on the weight's device."""
        import torch

        w = _as_torch(weight)
        if w.dim() != 2:
            raise UsageError(f"block quantization needs a 2-D weight, not shape {tuple(w.shape)}")
        if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UsageError(f"block quantization needs a bf16, fp16 or fp32 weight, not {w.dtype}")
        rows, cols = (int(s) for s in w.shape)
        b0, b1 = self.block
        nb0, nb1 = -(-rows // b0), -(-cols // b1)
        if rows == 0 or cols == 0:
            return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device),
                    torch.ones((nb0, nb1), dtype=torch.float32, device=w.device))
        w32 = w.detach().to(torch.float32)
        amax = _block_amax(w32, b0, b1, nb0, nb1)
        if not bool(torch.isfinite(amax).all()):  # a block max is NaN or inf iff the block holds one
            raise UsageError("block quantization refuses non-finite weights (NaN or inf has no scale)")
        scale = torch.where(amax > 0, _over(E4M3_MAX, torch.where(amax > 0, amax, 1.0)), 1.0)
        if previous_scale_inv is not None and self.policy == "keep":
            prev_inv = _as_torch(previous_scale_inv).to(device=w.device, dtype=torch.float32)
            if tuple(prev_inv.shape) != (nb0, nb1):
                raise UsageError(f"previous scale_inv has shape {tuple(prev_inv.shape)}, not {(nb0, nb1)}")
            prev = torch.reciprocal(prev_inv)
            covers = _over(E4M3_MAX, prev)  # the largest |w| the kept scale takes without saturating
            fits = (amax * prev <= E4M3_MAX) & (amax >= covers * 2.0 ** -self.keep_octaves)
            scale = torch.where(fits, prev, scale)
        q = _per_block(w32, scale, b0, b1, nb0, nb1).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, torch.reciprocal(scale)

    def quantize_state(self, state: Mapping[str, Any], previous: Mapping[str, Any] | None = None
                       ) -> dict[str, Any]:
        """The FP8 checkpoint form of ``state``: each selected weight ``W`` as e4m3 with
        ``W_scale_inv`` beside it, the other tensors as given. ``previous`` (policy ``keep``): the
        previous version's result, whose scales are kept where they still fit."""
        out: dict[str, Any] = {}
        for name, t in state.items():
            t = _as_torch(t)
            shape = tuple(int(s) for s in t.shape)
            if not self.select(name, shape):
                out[name] = t
                continue
            scale_name = name + SCALE_SUFFIX
            if scale_name in state:
                raise UsageError(f"{scale_name!r} is in the state already: is it quantized already?")
            prev = None if previous is None else previous.get(scale_name)
            out[name], out[scale_name] = self.quantize(t, prev)
        return out


def dequantize(q: Any, scale_inv: Any, block: tuple[int, int] = DEFAULT_BLOCK) -> Any:
    """fp32 weights from e4m3 words and their block scales (as the engine computes them)."""
    import torch

    q, s = _as_torch(q), _as_torch(scale_inv).to(torch.float32)
    rows, cols = (int(x) for x in q.shape)
    full = s.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return q.to(torch.float32) * full


def _over(numerator: float, t: Any) -> Any:
    """``numerator / t`` divided once, correctly rounded: torch computes ``float / tensor`` as
    ``t.reciprocal() * float``, two roundings (measured: the last bit differs for some values)."""
    import torch

    return torch.full_like(t, numerator).div(t)


def _per_block(w32: Any, scale: Any, b0: int, b1: int, nb0: int, nb1: int) -> Any:
    """``w32`` times its block's scale, as a new (rows, cols) fp32 tensor: the whole blocks
    through a broadcasting view (no scale tensor of the weight's size), the edges apart."""
    import torch

    rows, cols = w32.shape
    out = torch.empty_like(w32)
    r0, c0 = (rows // b0) * b0, (cols // b1) * b1
    if r0 and c0:
        torch.mul(w32[:r0, :c0].reshape(r0 // b0, b0, c0 // b1, b1), scale[:r0 // b0, None, :c0 // b1, None],
                  out=out[:r0, :c0].view(r0 // b0, b0, c0 // b1, b1))
    if c0 < cols:  # the last block column, every block row
        out[:, c0:] = w32[:, c0:] * scale[:, -1:].repeat_interleave(b0, dim=0)[:rows]
    if r0 < rows and c0:  # the last block row, whole block columns
        out[r0:, :c0] = w32[r0:, :c0] * scale[-1:, :c0 // b1].repeat_interleave(b1, dim=1)
    return out


def _block_amax(w32: Any, b0: int, b1: int, nb0: int, nb1: int) -> Any:
    """Per block max |w|, partial edge blocks over their own elements (padded with zeros, which
    never raise a max of absolute values)."""
    import torch

    rows, cols = w32.shape
    a = w32.abs()
    if rows != nb0 * b0 or cols != nb1 * b1:
        a = torch.nn.functional.pad(a, (0, nb1 * b1 - cols, 0, nb0 * b0 - rows))
    return a.reshape(nb0, b0, nb1, b1).amax(dim=(1, 3))


def _as_torch(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x
    from dcr_log.state import TensorBits, to_bits, to_torch

    return to_torch(x if isinstance(x, TensorBits) else to_bits(x))
