"""Tensor-parallel engine receivers for tests/test_engine_receiver.py: the trainer's schedule
(dense canonical versions with layout changes) and one rank of a gloo group applying the log
into its own engine instance.

Run as ``python tests/engine_job.py CONFIG_JSON RANK``: the rank discovers its placement on a
scratch engine, loads version 0 through its loader, binds, applies every later version with
the group summing digests, and after each version compares every parameter bit for bit with a
fresh engine loaded with the dense version. It writes ``<out>/result-<rank>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers.engines import EngineConfig, TestEngine, engine_params, fresh_engine, random_canonical  # noqa: E402
from helpers.ranks import finish_rank  # noqa: E402

VERSIONS = 8
LAYOUT_CHANGES = (2, 3, 4, 5)  # the versions of canonical_at whose tensor table changes
EXTRA = "model.extra_bias"          # a tensor the engine does not know
NORM = "model.norm.weight"          # retyped bf16 -> f32 at step 3


def step_rate(step: int) -> float:
    return [0.0, 0.02, 0.01, 0.01, 0.03, 0.01, 0.005, 1.0][step]


def canonical_at(cfg: EngineConfig, version: int) -> dict[str, torch.Tensor]:
    """The trainer's dense state at ``version``: bf16 steps of a few ulps on a random fraction
    of every tensor, plus layout changes: a tensor the engine ignores is added (2), reshaped
    (4) and dropped (5); the final norm is retyped to float32 (3); step 7 changes everything."""
    state = random_canonical(cfg, 0)
    for step in range(1, version + 1):
        g = torch.Generator().manual_seed(1000 + step)
        for name in sorted(state):
            t = state[name]
            words = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()
            hit = torch.rand(t.shape, generator=g) < step_rate(step)
            delta = torch.randint(-2, 3, t.shape, generator=g, dtype=words.dtype)
            words = torch.where(hit, words + delta, words)
            state[name] = words.view(t.dtype)
        if step == 2:
            state[EXTRA] = torch.randn(cfg.hidden, generator=g).to(torch.bfloat16)
        if step == 3:
            state[NORM] = state[NORM].float()
        if step == 4:
            state[EXTRA] = torch.randn(cfg.hidden // 2, generator=g).to(torch.bfloat16)
        if step == 5:
            del state[EXTRA]
    return state


def bits_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    out = [n for n in set(a) ^ set(b)]
    for n in set(a) & set(b):
        x, y = a[n], b[n]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            out.append(n)
    return sorted(out)


def run_rank(cfg_json: dict, rank: int) -> dict:
    from dcr_log import DeltaLog
    from dcr_log.engines.discovery import discover
    from dcr_log.receiver import Receiver

    tp = cfg_json["tp"]
    cfg = EngineConfig(tie_mode=cfg_json.get("tie_mode", "shared"))
    out = Path(cfg_json["out"])
    group = None
    if tp > 1:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg_json['port']}",
                                             rank=rank, world_size=tp, timeout=timedelta(seconds=60))
        group = torch.distributed.group.WORLD
    log = DeltaLog.open(cfg_json["log"])
    scratch = TestEngine(cfg, rank, tp)

    def rediscover(table):
        return discover(scratch.load_weights, table, engine_params(scratch), restore=False)

    placement = rediscover(log.commit(0))
    engine = TestEngine(cfg, rank, tp)
    engine.load_weights(canonical_at(cfg, 0).items())
    params = engine_params(engine)
    identity = {n: id(t) for n, t in params.items()}
    rx = Receiver.open(params, journal_path=out / f"journal-{rank}", placement=placement,
                       loader=engine.load_weights, group=group, rediscover=rediscover)
    rx.bind(log, 0)
    result = {"ok": True, "applied": [], "mismatch": {}, "unheld": 0, "rebuilt": []}
    for v in range(1, log.latest_version() + 1):
        verify = ["full", "sample", "none"][v % 3]
        reports = []
        if v % 2:
            staged = rx.stage(log, v, verify=verify)
            result.setdefault("staged_bytes", []).append(staged.staged_bytes)
            rx.apply(on_version=reports.append)
        else:
            rx.apply(log, to=v, verify=verify, on_version=reports.append)
        result["applied"].append(v)
        result["unheld"] += reports[0].unheld
        result["rebuilt"] += reports[0].rebuilt
        ref = engine_params(fresh_engine(cfg, canonical_at(cfg, v), rank, tp))
        bad = bits_differ(ref, engine_params(engine))
        if bad:
            result["mismatch"][v] = bad
        if any(id(t) != identity[n] for n, t in engine_params(engine).items()):
            result["mismatch"].setdefault(v, []).append("a parameter was replaced, not updated in place")
    result["version"] = rx.version
    rx.close()
    return result


def main() -> None:
    cfg_json = json.loads(sys.argv[1])
    rank = int(sys.argv[2])
    out = Path(cfg_json["out"])
    try:
        result = run_rank(cfg_json, rank)
    except BaseException as exc:  # reported to the test, which fails on it
        result = {"ok": False, "error_type": type(exc).__name__, "message": str(exc),
                  "trace": traceback.format_exc()}
    finish_rank(out, rank, result)


if __name__ == "__main__":
    main()
