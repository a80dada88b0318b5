"""The synthetic trainer: bf16 rounding equals torch's, steps change the intended fraction."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log.synthetic import (
    AdamConfig,
    SyntheticTrainer,
    adam_step_pair,
    bf16_round,
    bf16_to_f32,
    lr_for_rate,
    rate_of,
    specs_for_params,
)


def torch_bf16_words(f32: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(f32, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


SPECIAL_BITS = np.array([
    0x00000000, 0x80000000,  # +-0.0
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FBFFFFF,  # NaNs, quiet and signalling
    0x00000001, 0x00008000, 0x00018000, 0x00010000, 0x007FFFFF, 0x807FFFFF,  # subnormals and ties
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F817FFF,  # ties to even, just above/below ties
    0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF, 0x00800000,  # rounds to inf, largest finite, smallest normal
], dtype=np.uint32)


def test_bf16_round_matches_torch_on_special_values():
    f32 = SPECIAL_BITS.view(np.float32)
    assert np.array_equal(bf16_round(f32), torch_bf16_words(f32))


def test_bf16_round_matches_torch_on_every_bit_pattern_class():
    # 2^22 random float32 bit patterns cover every exponent (NaN, inf, subnormal included)
    # and every rounding case; the comparison is on the integer words.
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    bits[:SPECIAL_BITS.size] = SPECIAL_BITS
    f32 = bits.view(np.float32)
    ours = bf16_round(f32)
    assert np.isnan(f32).sum() > 1000 and (np.abs(f32) < np.finfo(np.float32).tiny).sum() > 1000
    assert np.array_equal(ours, torch_bf16_words(f32))


@settings(deadline=None, max_examples=40)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_bf16_round_matches_torch_hypothesis(words):
    f32 = np.array(words, dtype=np.uint32).view(np.float32)
    out = np.full(f32.size, 0x1234, dtype=np.uint16)
    scratch = np.empty(f32.size + 5, dtype=np.uint32)
    assert np.array_equal(bf16_round(f32, out=out, scratch=scratch), torch_bf16_words(f32))


def test_bf16_round_is_exact_on_bf16_values():
    rng = np.random.default_rng(1)
    words = rng.integers(0, 2**16, 1 << 16, dtype=np.uint16)
    words = words[~np.isnan(bf16_to_f32(words))]
    assert np.array_equal(bf16_round(bf16_to_f32(words)), words)


def _rates(trainer: SyntheticTrainer, steps: int) -> list[float]:
    prev = {k: v.words.copy() for k, v in trainer.state().items()}
    rates = []
    for _ in range(steps):
        trainer.step()
        state = trainer.state()
        changed = sum(int(np.count_nonzero(prev[k] != state[k].words)) for k in state)
        rates.append(changed / trainer.params)
        for k in state:
            np.copyto(prev[k], state[k].words)
    return rates


def test_default_step_changes_one_to_three_percent():
    trainer = SyntheticTrainer(specs_for_params(300_000), seed=3)
    rates = _rates(trainer, 4)
    assert all(0.01 <= r <= 0.03 for r in rates), rates


def test_changes_are_mostly_one_ulp():
    trainer = SyntheticTrainer(specs_for_params(300_000), seed=4)
    before = {k: v.words.copy() for k, v in trainer.state().items()}
    trainer.step()
    after = trainer.state()
    xor = np.concatenate([before[k] ^ after[k].words for k in before])
    xor = xor[xor != 0]
    # new = base +- 1 ulp gives xor 2^j - 1: 0x1, 0x3, 0x7, ...
    carries = np.isin(xor, (1 << np.arange(1, 17)) - 1)
    assert carries.mean() > 0.85
    assert (xor == 1).mean() > 0.35


def test_learning_rate_controls_the_rate():
    low = _rates(SyntheticTrainer(specs_for_params(100_000), seed=5, config=AdamConfig(lr=0.5e-6)), 1)[0]
    high = _rates(SyntheticTrainer(specs_for_params(100_000), seed=5, config=AdamConfig(lr=4e-6)), 1)[0]
    assert low < 0.01 < 0.03 < high


def test_trainer_is_deterministic():
    a = SyntheticTrainer(specs_for_params(50_000), seed=9)
    b = SyntheticTrainer(specs_for_params(50_000), seed=9)
    c = SyntheticTrainer(specs_for_params(50_000), seed=10)
    for t in (a, b, c):
        t.step()
        t.step()
    sa, sb, sc = a.state(), b.state(), c.state()
    assert all(np.array_equal(sa[k].words, sb[k].words) for k in sa)
    assert not all(np.array_equal(sa[k].words, sc[k].words) for k in sa)


def test_specs_look_like_a_transformer():
    specs = specs_for_params(1_000_000)
    names = {s.name for s in specs}
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert any(s.name.endswith("mlp.down_proj.weight") for s in specs)
    assert all(len(s.shape) == 1 for s in specs if s.role == "norm")
    params = sum(int(np.prod(s.shape)) for s in specs)
    assert 0.5e6 < params < 2e6


@pytest.mark.parametrize("rate_lr", [(0.01, 0.66e-6), (0.03, 2.45e-6)])
def test_step_pair_rate_and_independence_of_workers(rate_lr):
    rate, lr = rate_lr
    one = adam_step_pair(1 << 20, 2, (lr,), chunk=1 << 17, workers=1)
    two = adam_step_pair(1 << 20, 2, (lr,), chunk=1 << 17, workers=2)
    assert all(np.array_equal(x, y) for x, y in zip(one, two))
    assert abs(rate_of(*one) - rate) < 0.2 * rate


@pytest.mark.parametrize("rate", [1e-4, 1e-3, 0.05])
def test_lr_for_rate_finds_rates_below_and_above_its_first_bracket(rate):
    # Its first bracket (lr 1e-7 .. 1e-5) changes about 0.2% .. 9% of the words; a rate below
    # it used to end in an OverflowError.
    lr = lr_for_rate(rate, sample=1 << 20)
    assert abs(rate_of(*adam_step_pair(1 << 20, 12345, (lr,))) - rate) < 0.05 * rate
