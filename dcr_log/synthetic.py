"""Synthetic training steps: a small transformer-shaped model trained by an Adam-like rule.

The trainer holds fp32 master weights and stores them as bf16 (round to nearest even), the
way mixed-precision training publishes weights. Only the bf16 values whose fp32 master crossed
a rounding boundary change in a step, so a few percent of the stored values change and most of
those move by one unit in the last place: the workload dcr-log is built for.

Everything is vectorised numpy and deterministic from a seed. Used by ``dcr demo``, the tests
and the benchmarks in tools/.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dcr_log.errors import UsageError
from dcr_log.state import TensorBits

# Every NaN becomes this word, as torch's CPU float32 -> bfloat16 tensor conversion does.
BF16_NAN = 0xFFFF


def bf16_round(f32: np.ndarray, out: np.ndarray | None = None,
               scratch: np.ndarray | None = None) -> np.ndarray:
    """Round float32 values to bfloat16 words (uint16), round to nearest, ties to even.

    Integer arithmetic on the float32 bits: add 0x7FFF plus the lowest kept bit, keep the
    high half. Infinities, subnormals and -0.0 come out exactly; every NaN becomes
    ``BF16_NAN``. ``out`` (uint16) and ``scratch`` (uint32) of the same size are reused if given.
    """
    f32 = np.ascontiguousarray(f32, dtype=np.float32).reshape(-1)
    bits = f32.view(np.uint32)
    if out is None:
        out = np.empty(f32.size, dtype=np.uint16)
    if scratch is None:
        scratch = np.empty(f32.size, dtype=np.uint32)
    t = scratch[: f32.size]
    np.right_shift(bits, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, bits, out=t)  # cannot wrap: the largest non-NaN word is 0xFF800000 (-inf)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    nan = np.isnan(f32)
    if nan.any():
        out[nan] = BF16_NAN
    return out


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 words (exact: bf16 is float32's upper half)."""
    return (np.asarray(words, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # "matrix": N(0, init_std) weights; "norm": around 1.0, like a trained RMSNorm gain.
    role: str


def transformer_specs(hidden: int, layers: int, vocab: int) -> list[TensorSpec]:
    """Llama-like tensor names and shapes: grouped-query attention, gated MLP, RMSNorms."""
    if hidden < 4 or hidden % 4 or layers < 1 or vocab < 1:
        raise UsageError("hidden must be a positive multiple of 4; layers and vocab positive")
    kv = hidden // 4
    ff = max(4, (8 * hidden // 3 + 15) // 16 * 16)
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "matrix")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (hidden,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (hidden, hidden), "matrix"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, hidden), "matrix"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, hidden), "matrix"),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, hidden), "matrix"),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "norm"),
            TensorSpec(p + "mlp.gate_proj.weight", (ff, hidden), "matrix"),
            TensorSpec(p + "mlp.up_proj.weight", (ff, hidden), "matrix"),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, ff), "matrix"),
        ]
    specs += [
        TensorSpec("model.norm.weight", (hidden,), "norm"),
        TensorSpec("lm_head.weight", (vocab, hidden), "matrix"),
    ]
    return specs


def specs_for_params(params: int, layers: int = 4) -> list[TensorSpec]:
    """A transformer of about ``params`` parameters (vocab = 16 x hidden, hidden a multiple of 16)."""
    if params < 1:
        raise UsageError("params must be positive")
    # Per layer ~2.5 h^2 (attention) + 8 h^2 (gated MLP); embeddings and head 2 x 16 h^2.
    hidden = max(16, int(round(math.sqrt(params / (10.5 * layers + 32)) / 16)) * 16)
    return transformer_specs(hidden, layers, 16 * hidden)


@dataclass(frozen=True)
class AdamConfig:
    """Adam-like update rule. ``lr`` mostly sets the changed fraction: 1e-6..3e-6 (an RL
    fine-tuning rate) changes ~1-3% of the bf16 weights of std ``init_std`` per step."""

    lr: float = 1.5e-6
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.1
    # Persistent gradient signal relative to the per-step noise (std of a per-element mean).
    signal: float = 0.3
    init_std: float = 0.02
    norm_std: float = 0.05


class _Scratch:
    """fp32/uint32 work buffers sized for the largest tensor, reused by every step."""

    def __init__(self, size: int):
        self.a = np.empty(size, dtype=np.float32)
        self.b = np.empty(size, dtype=np.float32)
        self.u32 = np.empty(size, dtype=np.uint32)


def adam_update(master: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                cfg: AdamConfig, lr: float, tmp: np.ndarray) -> None:
    """One Adam(W) step in place, moments already warm (no bias correction). ``grad`` is consumed."""
    b1, b2 = np.float32(cfg.beta1), np.float32(cfg.beta2)
    # m = b1 m + (1 - b1) g
    np.multiply(m, b1, out=m)
    np.multiply(grad, np.float32(1 - cfg.beta1), out=tmp)
    np.add(m, tmp, out=m)
    # v = b2 v + (1 - b2) g^2
    np.multiply(v, b2, out=v)
    np.multiply(grad, grad, out=tmp)
    np.multiply(tmp, np.float32(1 - cfg.beta2), out=tmp)
    np.add(v, tmp, out=v)
    # master -= lr (m / (sqrt(v) + eps) + wd master)
    np.sqrt(v, out=tmp)
    np.add(tmp, np.float32(cfg.eps), out=tmp)
    np.divide(m, tmp, out=tmp)
    np.multiply(master, np.float32(cfg.weight_decay), out=grad)
    np.add(tmp, grad, out=tmp)
    np.multiply(tmp, np.float32(lr), out=tmp)
    np.subtract(master, tmp, out=master)


def _init_tensor(rng: np.random.Generator, spec: TensorSpec, cfg: AdamConfig, master: np.ndarray,
                 m: np.ndarray, v: np.ndarray, signal: np.ndarray, scale: float) -> None:
    """Weights, a persistent gradient signal and Adam moments as they are deep into training."""
    n = master.size
    rng.standard_normal(n, dtype=np.float32, out=master)
    if spec.role == "norm":
        np.multiply(master, np.float32(cfg.norm_std), out=master)
        np.add(master, np.float32(1.0), out=master)
    else:
        np.multiply(master, np.float32(cfg.init_std), out=master)
    rng.standard_normal(n, dtype=np.float32, out=signal)
    np.multiply(signal, np.float32(cfg.signal), out=signal)
    # Stationary moments of g = scale (signal + N(0, 1)): m ~ N(scale signal, scale^2 (1-b1)/(1+b1)),
    # v ~ E[g^2] = scale^2 (signal^2 + 1).
    rng.standard_normal(n, dtype=np.float32, out=m)
    np.multiply(m, np.float32(math.sqrt((1 - cfg.beta1) / (1 + cfg.beta1))), out=m)
    np.add(m, signal, out=m)
    np.multiply(m, np.float32(scale), out=m)
    np.multiply(signal, signal, out=v)
    np.add(v, np.float32(1.0), out=v)
    np.multiply(v, np.float32(scale * scale), out=v)


class SyntheticTrainer:
    """Deterministic Adam-like training of a transformer-shaped model with bf16 stored weights.

    ``state()`` is the stored bf16 state (TensorBits over buffers reused by every step: copy
    it if you keep it); ``step()`` trains one optimizer step.
    """

    def __init__(self, specs: list[TensorSpec], seed: int = 0, config: AdamConfig | None = None):
        if len({s.name for s in specs}) != len(specs):
            raise UsageError("tensor names must be unique")
        self.specs = list(specs)
        self.config = config or AdamConfig()
        self.steps = 0
        self._rng = np.random.default_rng(seed)
        largest = max((math.prod(s.shape) for s in specs), default=1)
        self._scratch = _Scratch(max(largest, 1))
        self._master: dict[str, np.ndarray] = {}
        self._m: dict[str, np.ndarray] = {}
        self._v: dict[str, np.ndarray] = {}
        self._signal: dict[str, np.ndarray] = {}
        self._scale: dict[str, float] = {}
        self._bf16: dict[str, np.ndarray] = {}
        for spec in self.specs:
            n = math.prod(spec.shape)
            self._master[spec.name] = np.empty(n, dtype=np.float32)
            self._m[spec.name] = np.empty(n, dtype=np.float32)
            self._v[spec.name] = np.empty(n, dtype=np.float32)
            self._signal[spec.name] = np.empty(n, dtype=np.float32)
            # Gradient scales differ per tensor by orders of magnitude; Adam normalises them.
            self._scale[spec.name] = float(10.0 ** self._rng.uniform(-4, -1))
            _init_tensor(self._rng, spec, self.config, self._master[spec.name], self._m[spec.name],
                         self._v[spec.name], self._signal[spec.name], self._scale[spec.name])
            self._bf16[spec.name] = np.empty(n, dtype=np.uint16)
            self._round(spec.name)

    @property
    def params(self) -> int:
        return sum(w.size for w in self._master.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the stored bf16 state."""
        return 2 * self.params

    def _round(self, name: str) -> None:
        bf16_round(self._master[name], out=self._bf16[name], scratch=self._scratch.u32)

    def step(self, lr: float | None = None) -> None:
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        s = self._scratch
        for spec in self.specs:
            name = spec.name
            n = self._master[name].size
            grad, tmp = s.a[:n], s.b[:n]
            self._rng.standard_normal(n, dtype=np.float32, out=grad)
            np.add(grad, self._signal[name], out=grad)
            np.multiply(grad, np.float32(self._scale[name]), out=grad)
            adam_update(self._master[name], self._m[name], self._v[name], grad, cfg, lr, tmp)
            self._round(name)
        self.steps += 1

    def state(self) -> dict[str, TensorBits]:
        return {s.name: TensorBits("BF16", s.shape, self._bf16[s.name]) for s in self.specs}


def adam_step_pair(n: int, seed: int, lrs: tuple[float, ...] = (1.5e-6,),
                   config: AdamConfig | None = None, chunk: int = 1 << 22, workers: int = 2,
                   outs: tuple[np.ndarray, ...] | None = None) -> tuple[np.ndarray, ...]:
    """bf16 words of one flat weight tensor before and after one Adam step, for each lr.

    Returns ``(base, new_for_lrs[0], new_for_lrs[1], ...)``: the same weights, moments and
    gradient, stepped with each learning rate. Built chunk by chunk with warm (stationary)
    moments, so no optimizer state is held: a GiB-sized pair costs only its own bf16 words.
    Chunk ``i`` draws from its own stream ``(seed, i)``, so the result does not depend on
    ``workers``. ``outs`` (uint16 arrays of size n, 1 + len(lrs) of them) are filled if given.

    Every element draws its weight, moments and gradient independently, so the changed
    positions are spread over the whole array, as an optimizer step spreads them, not clustered
    at its start: cut into Llama-shaped tensors at 1% and 5% changed, each tenth of every
    tensor holds 0.096-0.103 of its changes and every row of 4096 has one (tools/bench_side.py
    reports this per pair as ``spread``).
    """
    cfg = config or AdamConfig()
    if outs is None:
        outs = tuple(np.empty(n, dtype=np.uint16) for _ in range(1 + len(lrs)))
    if len(outs) != 1 + len(lrs) or any(o.size != n or o.dtype != np.uint16 for o in outs):
        raise UsageError("outs must be 1 + len(lrs) uint16 arrays of size n")
    spec = TensorSpec("w", (n,), "matrix")
    c = min(chunk, max(n, 1))
    local = threading.local()

    def fill(index: int) -> None:
        # numpy's generators and ufuncs release the GIL, so chunks run in parallel.
        bufs = getattr(local, "bufs", None)
        if bufs is None:
            bufs = local.bufs = [np.empty(c, dtype=np.float32) for _ in range(8)] + [
                np.empty(c, dtype=np.uint32)]
        start = index * c
        k = min(c, n - start)
        sl = slice(start, start + k)
        master, m, v, signal, grad, w0, m0, v0, u32 = (b[:k] for b in bufs)
        rng = np.random.default_rng([seed, index])
        _init_tensor(rng, spec, cfg, w0, m0, v0, signal, 1.0)
        bf16_round(w0, out=outs[0][sl], scratch=u32)
        noise = u32.view(np.float32)  # the rounding scratch is free until the next rounding
        rng.standard_normal(k, dtype=np.float32, out=noise)
        np.add(noise, signal, out=signal)  # signal + noise: the gradient, the same for each lr
        for lr, out in zip(lrs, outs[1:]):
            np.copyto(master, w0)
            np.copyto(m, m0)
            np.copyto(v, v0)
            np.copyto(grad, signal)
            adam_update(master, m, v, grad, cfg, lr, noise)
            bf16_round(master, out=out[sl], scratch=u32)

    chunks = range(-(-n // c))
    if workers <= 1:
        for i in chunks:
            fill(i)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(fill, chunks):
                pass
    return outs


def carve(flat: np.ndarray, specs: list[TensorSpec]) -> dict[str, TensorBits]:
    """A state of bf16 tensors with these names and shapes, views into one flat word array."""
    out, start = {}, 0
    for spec in specs:
        n = math.prod(spec.shape)
        out[spec.name] = TensorBits("BF16", spec.shape, flat[start:start + n])
        start += n
    return out


def rate_of(base: np.ndarray, new: np.ndarray) -> float:
    """Fraction of words that differ."""
    return float(np.count_nonzero(base != new)) / max(base.size, 1)


def lr_for_rate(rate: float, config: AdamConfig | None = None, sample: int = 1 << 21,
                seed: int = 12345) -> float:
    """The learning rate at which one step of ``adam_step_pair`` changes about ``rate`` of the words.

    The changed fraction grows monotonically with lr (nearly linearly); a few secant steps on
    a sample find it.
    """
    if not 0 < rate < 0.5:
        raise UsageError("rate must be in (0, 0.5)")
    def measured(lr: float) -> float:
        base, new = adam_step_pair(sample, seed, (lr,), config)
        return rate_of(base, new)
    lo, hi = 1e-7, 1e-5
    r_lo, r_hi = measured(lo), measured(hi)
    for _ in range(30):
        if r_hi < rate:
            lo, r_lo, hi = hi, r_hi, hi * 4
            r_hi = measured(hi)
            continue
        if r_lo > rate:  # below the first bracket (under about 0.2% changed): widen it downwards
            hi, r_hi, lo = lo, r_lo, lo / 4
            r_lo = measured(lo)
            continue
        # Interpolate in log space, then bisect if the guess does not shrink the bracket.
        guess = math.exp(math.log(lo) + (math.log(hi) - math.log(lo))
                         * (rate - r_lo) / max(r_hi - r_lo, 1e-12))
        guess = min(max(guess, lo * 1.0001), hi / 1.0001)
        r = measured(guess)
        if abs(r - rate) <= 0.01 * rate:
            return guess
        if r < rate:
            lo, r_lo = guess, r
        else:
            hi, r_hi = guess, r
    return math.sqrt(lo * hi)
