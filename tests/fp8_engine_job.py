"""One tensor-parallel rank of the FP8 test engine following a block-FP8 log (run by
tests/test_fp8_engine.py in a gloo group): ``python fp8_engine_job.py '<json>' <rank>``.

The trainer's bf16 states and their FP8 checkpoints are defined here so that the test and the
ranks compute the same ones."""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers.engines import TestEngine, engine_params, fp8_config, fp8_param_words, fresh_engine, random_canonical  # noqa: E402
from helpers.ranks import finish_rank  # noqa: E402

CFG = fp8_config()
DENSE = dataclasses.replace(CFG, fp8_block=None)  # the trainer's bf16 state: same names, same shapes
VERSIONS = 5


def bf16_states(versions: int = VERSIONS) -> list[dict[str, torch.Tensor]]:
    """The trainer's bf16 states: step s moves a fraction 0.01 * s (1-4%) of every tensor's
    elements by a relative N(0, 1e-2) (some block maxima move, so ``fresh`` rescales those
    blocks and ``keep`` keeps most scales)."""
    states = [random_canonical(DENSE, 0)]
    for step in range(1, versions):
        g = torch.Generator().manual_seed(100 + step)
        nxt = {}
        for name, t in states[-1].items():
            hit = torch.rand(t.shape, generator=g) < 0.01 * step
            bump = 1 + 0.01 * torch.randn(t.shape, generator=g)
            nxt[name] = torch.where(hit, t.float() * bump, t.float()).to(t.dtype)
        states.append(nxt)
    return states


def quantized(policy: str, states: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The FP8 checkpoint of every state (``keep``: each from the previous one's scales)."""
    from dcr_log.quant import Fp8BlockQuantizer

    quant = Fp8BlockQuantizer(policy=policy)
    out = [quant.quantize_state(states[0])]
    for st in states[1:]:
        out.append(quant.quantize_state(st, previous=out[-1]))
    return out


def follow(log, versions, rank: int, tp: int, journal: Path, group=None) -> dict:
    """Place, bind at 0, apply every version in place; after each, the names of the parameters
    whose bytes differ from a fresh engine loading that version's FP8 checkpoint."""
    from dcr_log.engines.discovery import discover
    from dcr_log.receiver import Receiver

    scratch = TestEngine(CFG, rank, tp)
    placement = discover(scratch.load_weights, log.commit(0), engine_params(scratch), restore=False)
    engine = fresh_engine(CFG, versions[0], rank, tp)
    params = engine_params(engine)
    identity = {n: id(t) for n, t in params.items()}
    result: dict = {"ok": True, "applied": [], "mismatch": {}, "changed": 0,
                    "residual": placement.describe()["residual_params"]}
    with Receiver.open(params, journal, placement=placement, loader=engine.load_weights, group=group) as rx:
        rx.bind(log, 0)
        for v in range(1, log.latest_version() + 1):
            before = fp8_param_words(engine_params(engine))
            rx.apply(log, to=v, verify=["full", "sample"][v % 2])
            got = fp8_param_words(engine_params(engine))
            want = fp8_param_words(engine_params(fresh_engine(CFG, versions[v], rank, tp)))
            bad = sorted(n for n in want.keys() | got.keys() if got.get(n) != want.get(n))
            bad += ["a parameter was replaced, not updated in place"] * any(
                id(t) != identity[n] for n, t in engine_params(engine).items())
            if bad:
                result["mismatch"][v] = bad
            result["applied"].append(v)
            result["changed"] += sum(got[n] != before[n] for n in got)
        result["version"] = rx.version
    return result


def main() -> None:
    conf = json.loads(sys.argv[1])
    rank, tp = int(sys.argv[2]), conf["tp"]
    out = Path(conf["out"])
    try:
        from dcr_log import DeltaLog

        group = None
        if tp > 1:
            torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{conf['port']}",
                                                 rank=rank, world_size=tp, timeout=timedelta(seconds=60))
            group = torch.distributed.group.WORLD
        versions = quantized(conf["policy"], bf16_states())
        result = follow(DeltaLog.open(conf["log"]), versions, rank, tp, out / f"journal-{rank}", group)
    except BaseException as exc:  # reported to the test, which fails on it
        result = {"ok": False, "error_type": type(exc).__name__, "message": str(exc),
                  "trace": traceback.format_exc()}
    finish_rank(out, rank, result)


if __name__ == "__main__":
    main()
