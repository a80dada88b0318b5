"""Blocked and permuted engine layouts (placement blocks) and engine tensor subclasses.

An engine keeps a weight in a blocked layout (tiles of the transposed matrix, as vLLM CPU's
MoE prepack does) inside a torch.Tensor subclass from a module that is not torch's; its
loader writes that layout. Discovery must describe it in a few blocks, and a receiver must
apply versions into it bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dcr_log import LogWriter  # noqa: E402
from dcr_log.engines.discovery import discover  # noqa: E402
from dcr_log.receiver import Receiver  # noqa: E402
from dcr_log.receiver.storage.placement import Placement, PlacementPiece  # noqa: E402
from dcr_log.state import is_torch_tensor  # noqa: E402

ROWS, COLS, TILE = 48, 64, 16


class EngineParameter(torch.nn.Parameter):
    """An engine's own parameter class (vLLM's ModelWeightParameter is one)."""


def blocked(w: torch.Tensor) -> torch.Tensor:
    """[R, C] -> tiles [C/T][R][T] transposed inside: a layout no run piece describes briefly."""
    r, c = w.shape
    return w.reshape(r, c // TILE, TILE).permute(1, 2, 0).contiguous().reshape(r, c)


class BlockedEngine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = EngineParameter(torch.zeros(ROWS, COLS, dtype=torch.bfloat16), requires_grad=False)
        self.norm = EngineParameter(torch.zeros(COLS, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        with torch.no_grad():
            for name, t in weights:
                if name == "w":
                    self.w.copy_(blocked(t))
                elif name == "norm":
                    self.norm.copy_(t)


def state(seed: int, base=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if base is None:
        return {"w": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
                "norm": torch.randn(COLS, generator=g).to(torch.bfloat16)}
    out = {}
    for n, t in base.items():
        words = t.view(torch.int16).clone().reshape(-1)
        pos = torch.randperm(words.numel(), generator=g)[: max(1, words.numel() // 30)]
        words[pos] += 1
        out[n] = words.view(torch.bfloat16).reshape(t.shape)
    return out


def test_subclass_is_a_torch_tensor():
    p = EngineParameter(torch.zeros(3))
    assert type(p).__module__ != "torch" and is_torch_tensor(p)
    assert not is_torch_tensor(np.zeros(3))


def test_blocked_layout_found_as_blocks_and_applied_bit_exact(tmp_path):
    states = [state(0)]
    for v in range(1, 4):
        states.append(state(v, states[-1]))
    writer = LogWriter.create(tmp_path / "log", states[0])
    for s in states[1:]:
        writer.append(s)
    log = writer.log
    scratch = BlockedEngine()
    placement = discover(scratch.load_weights, log.commit(0), dict(scratch.named_parameters()), restore=False)
    blocks = placement.pieces["w"]
    assert len(blocks) <= 2 and all(p.dims for p in blocks), [p.to_json() for p in blocks]
    assert sum(p.size for p in blocks) == ROWS * COLS
    again = Placement.from_json(placement.to_json())
    assert again.digest == placement.digest and again.to_json()["format"] == "dcr-placement/2"

    engine = BlockedEngine()
    engine.load_weights(states[0].items())
    with Receiver.open(dict(engine.named_parameters()), journal_path=tmp_path / "j", placement=placement) as rx:
        rx.bind(log, 0)
        for v in range(1, 4):
            rx.apply(log, to=v)
            fresh = BlockedEngine()
            fresh.load_weights(states[v].items())
            for n, p in fresh.named_parameters():
                assert torch.equal(p.view(torch.int16), getattr(engine, n).view(torch.int16)), (v, n)
            assert not torch.equal(fresh.w.view(torch.int16), blocked(states[v - 1]["w"]).view(torch.int16))


def test_block_map_matches_its_elements():
    p = PlacementPiece.block("x", 3, 5, [(4, 100, -1), (6, 10, 4), (3, 1, 24)])
    c, q = p.elements()
    probe = np.arange(0, 500)
    inside, pos = p.map(probe)
    assert np.array_equal(probe[inside], np.sort(c))
    assert np.array_equal(pos[inside], q[np.argsort(c)])
    s, e = p.intervals()
    assert int((e - s).sum()) == p.size == 72


@pytest.mark.parametrize("bad", [
    ["x", 0, 0, [[4, 10, 1], [3, 10, 4]]],     # canonical strides not decreasing
    ["x", 0, 0, [[4, 5, 1], [6, 1, 4]]],       # a stride inside the span of the next dimension
    ["x", 0, 0, [[4, 100, 1]]],                # outside the tensor
    ["x", 0, 0, [[3, 1, -1]]],                 # before the parameter's first element
])
def test_malformed_blocks_are_refused(bad):
    from dcr_log.errors import PlacementError
    obj = {"format": "dcr-placement/2", "table": [["t", "BF16", [64]]], "params": [["x", "BF16", [64]]],
           "pieces": {"t": [bad]}, "residual": {}}
    with pytest.raises(PlacementError):
        Placement.from_json(obj)
