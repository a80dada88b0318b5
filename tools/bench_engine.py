#!/usr/bin/env python
"""Engine receivers (placement through the engine's loader): discovery, stage, pause and apply
times at 0.1%, 1% and 3% changed, as ratios to ``np.copyto`` of the engine's parameters.

    python tools/bench_engine.py [--scale tiny|small|medium|large] [--hidden H] [--intermediate I]
                                 [--layers L] [--vocab V] [--rates 0.001,0.01,0.03] [--reps 3]
                                 [--engines torch,numpy] [--threads 1] [--json FILE] [--dir DIR]

The engines are the test engines of ``tests/helpers/engines.py`` (vLLM-style placement: fused qkv and
gate/up, MoE experts stacked, vocabulary padded, tied head, a scaled and an fp32 parameter
rebuilt by the loader), one rank (tp 1). The tests directory is put on ``sys.path`` to import
them. ``torch``: a ``TestEngine`` (torch parameters); ``numpy``: a ``NumpyEngine`` (numpy
arrays sharing the torch storage, bf16 as uint16 words, opened with ``Receiver.open(dtypes=)``
giving the engine's dtypes). The default scale, ``medium`` (hidden 1024, intermediate 2816, 4 layers,
one of them MoE, vocab 32000, bf16), holds about 156 MB of parameters per engine.

Each step is Adam-like: in every canonical tensor a random fraction ``rate`` of the elements
moves by one ulp (sometimes two or three), done on integer views of the words. Every step is
appended to one log (``LogWriter``) and applied by every engine receiver; each measurement uses
its own version (``--reps`` repetitions per rate and mode, interleaved; medians are reported).
Torch runs one intra-op thread by default (``--threads``): on shared cores torch's parallel
indexing (the receiver's gathers and ``index_put_``) was seen 5-10x slower with 2 threads.
After every apply each engine's parameters are compared, as integer words (``torch.equal``),
with a fresh engine loaded with the dense canonical state; any difference exits with status 1.

The baseline: ``np.copyto`` of all the engine's parameters (numpy views of the same tensors)
into a preallocated buffer, timed once right after every stage/apply it is compared with
(tools/timing.py). Every time is printed as the median pair's ratio to it (x copy); absolute
seconds drift on shared machines, ratios less. Discovery, timed once, is compared with the
best of 3 copies at the start and 3 at the end (the minimum).

Columns: ``changed`` the elements the version changed (commit stats, % of all); ``delta`` the
version's segment bytes; ``staged`` ``StageReport.staged_bytes`` (verify=sample);
``stage:V`` ``rx.stage(log, v, verify=V)``; ``pause:V`` the following ``rx.apply()``, the only
part that writes; ``apply:V`` a whole ``rx.apply(log, verify=V)``. Below the table: the apply
time ratio 1% / 0.1% per column (the target: at least 5x, i.e. apply at 0.1% five times
faster than at 1%).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dcr_log import DeltaLog, LogWriter  # noqa: E402
from dcr_log.engines.discovery import discover  # noqa: E402
from dcr_log.receiver import Receiver  # noqa: E402
from dcr_log.receiver.storage.placement import Placement
from helpers.engines import EngineConfig, NumpyEngine, TestEngine, engine_params, fresh_engine, random_canonical  # noqa: E402
from timing import Pairing, Sample, fastest, paired, timed  # noqa: E402

SCALES = {
    "tiny": dict(vocab_size=1000, hidden=64, num_heads=8, num_kv_heads=2, head_dim=8, intermediate=96,
                 num_layers=2, moe_intermediate=32),
    "small": dict(vocab_size=8000, hidden=512, num_heads=4, num_kv_heads=2, head_dim=128, intermediate=1408,
                  num_layers=2, moe_intermediate=352),
    "medium": dict(vocab_size=32000, hidden=1024, num_heads=8, num_kv_heads=2, head_dim=128, intermediate=2816,
                   num_layers=4, moe_intermediate=704),
    "large": dict(vocab_size=32000, hidden=1536, num_heads=12, num_kv_heads=4, head_dim=128, intermediate=4096,
                  num_layers=4, moe_intermediate=1024),
}
MODES = (("stage", "none"), ("stage", "sample"), ("apply", "none"), ("apply", "sample"))
WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(WORD[t.element_size()])


def make_config(args) -> EngineConfig:
    kw = dict(SCALES[args.scale])
    for key, attr in (("hidden", "hidden"), ("intermediate", "intermediate"), ("num_layers", "layers"),
                      ("vocab_size", "vocab")):
        if getattr(args, attr) is not None:
            kw[key] = getattr(args, attr)
    if args.hidden is not None:
        kw["num_heads"] = max(1, kw["hidden"] // kw["head_dim"])
        kw["num_kv_heads"] = min(kw["num_kv_heads"], kw["num_heads"])
    return EngineConfig(**kw)


# -- engines ---------------------------------------------------------------------------------

@dataclass
class Engine:
    kind: str
    tensors: dict[str, torch.Tensor]       # the engine's parameters and buffers, as torch views
    rx: Receiver | None = None
    placement: Placement | None = None
    discover_s: float = 0.0
    # (rate, column, verify) -> [Pairing of one call with one copy, ...]; column: stage, pause, apply
    pairings: dict = field(default_factory=dict)
    staged: dict = field(default_factory=dict)  # (rate, verify) -> [bytes, ...]
    owner: Any = None                           # the engine object (kept alive)


def build_engine(kind: str, cfg: EngineConfig, commit0, canon, work: Path, log: DeltaLog) -> Engine:
    if kind == "torch":
        scratch = TestEngine(cfg)
        found = timed(lambda: discover(scratch.load_weights, commit0, engine_params(scratch), restore=False))
        placement, seconds = found.result, found.wall
        del scratch
        engine = TestEngine(cfg)
        engine.load_weights(canon.items())
        tensors = engine_params(engine)
        storage, loader, dtypes = tensors, engine.load_weights, None
    elif kind == "numpy":
        scratch = NumpyEngine(cfg)
        found = timed(lambda: discover(scratch.load_weights, commit0, scratch.params, dtypes=scratch.dtypes,
                                       restore=False))
        placement, seconds = found.result, found.wall
        del scratch
        engine = NumpyEngine(cfg)
        engine.load_weights(canon.items())
        tensors = engine_params(engine.engine)  # the torch tensors the arrays share memory with
        # A dict of uint16 arrays would be read as U16: the engine's dtypes say BF16.
        storage, loader, dtypes = engine.params, engine.load_weights, engine.dtypes
    else:
        raise SystemExit(f"unknown engine kind {kind!r}")
    rx = Receiver.open(storage, journal_path=work / f"journal-{kind}", placement=placement, loader=loader,
                       dtypes=dtypes)
    rx.bind(log, 0)
    return Engine(kind, tensors, rx, placement, seconds, owner=engine)


# -- the baseline ----------------------------------------------------------------------------

def parameter_copy(tensors: dict[str, torch.Tensor]):
    """The baseline call: np.copyto of every parameter (numpy views) into one preallocated buffer."""
    views = [words(t).numpy().reshape(-1).view(np.uint8) for t in tensors.values() if t.numel()]
    total = sum(v.size for v in views)
    buf = np.empty(total, dtype=np.uint8)
    buf.fill(1)  # touch every page before timing
    offs = np.concatenate([[0], np.cumsum([v.size for v in views])])
    dst = [buf[offs[i]:offs[i + 1]] for i in range(len(views))]

    def copy() -> None:
        for d, v in zip(dst, views):
            np.copyto(d, v)

    return copy


# -- steps -----------------------------------------------------------------------------------

def adam_like_step(canon: dict[str, torch.Tensor], rate: float, rng: np.random.Generator) -> None:
    """In place: in every float tensor a random ``rate`` of its words move by +-1 ulp (1 in 8 by
    +-2 or +-3), on the integer view of the words."""
    steps = np.array([1, 1, 1, 1, 1, 1, 2, 3])
    for t in canon.values():
        if not t.dtype.is_floating_point or t.numel() == 0:
            continue
        w = t.view(WORD[t.element_size()]).numpy().reshape(-1)  # a view: changed in place
        k = int(rng.binomial(w.size, rate))
        if k == 0:
            continue
        pos = rng.integers(0, w.size, k)
        delta = (steps[rng.integers(0, steps.size, k)] * rng.choice(np.array([-1, 1]), k)).astype(w.dtype)
        w[pos] += delta


def bit_exact(engines: list[Engine], cfg: EngineConfig, canon) -> list[str]:
    ref = engine_params(fresh_engine(cfg, canon))
    bad = []
    for e in engines:
        if set(e.tensors) != set(ref):
            bad.append(f"{e.kind}: parameter names differ")
            continue
        bad += [f"{e.kind}: {n}" for n, t in ref.items() if not torch.equal(words(e.tensors[n]), words(t))]
    return bad


# -- the run ---------------------------------------------------------------------------------

def measure(e: Engine, log: DeltaLog, version: int, rate: float, mode: str, verify: str, copy) -> None:
    """Apply ``version`` to the engine's receiver: stage then apply(), or one apply(log); then one
    ``copy`` (the baseline), timed right after."""
    if mode == "stage":
        staged = timed(lambda: e.rx.stage(log, version, verify=verify))
        paused = timed(e.rx.apply)
        c = timed(copy)
        baseline = (Sample(c.wall, c.cpu),)
        for column, t in (("stage", staged), ("pause", paused)):
            e.pairings.setdefault((rate, column, verify), []).append(Pairing((Sample(t.wall, t.cpu),), baseline))
        e.staged.setdefault((rate, verify), []).append(staged.result.staged_bytes)
        got = paused.result
    else:
        applied: list[int] = []
        e.pairings.setdefault((rate, "apply", verify), []).append(
            paired(lambda: applied.extend(e.rx.apply(log, verify=verify)), copy, 1))
        got = applied
    if got != [version]:
        raise RuntimeError(f"{e.kind}: applied {got}, expected [{version}]")


def run(args) -> int:
    cfg = make_config(args)
    rates = [float(r) for r in args.rates.split(",")]
    kinds = [k for k in args.engines.split(",") if k]
    work = Path(tempfile.mkdtemp(prefix="bench-engine-", dir=args.dir))
    torch.set_num_threads(args.threads)
    try:
        canon = random_canonical(cfg, 0)
        writer = LogWriter.create(work / "log", canon)
        log = DeltaLog.open(work / "log")
        commit0 = log.commit(0)
        engines = [build_engine(k, cfg, commit0, canon, work, log) for k in kinds]
        param_bytes = sum(t.numel() * t.element_size() for t in engines[0].tensors.values())
        copy = parameter_copy(engines[0].tensors)
        copy_start = fastest(copy, 3).wall
        rng = np.random.default_rng(1)
        failures: list[str] = []
        deltas: dict[float, list] = {r: [] for r in rates}
        try:
            for _rep in range(args.reps):
                for rate in rates:
                    for mode, verify in MODES:
                        adam_like_step(canon, rate, rng)
                        commit = writer.append(canon)
                        deltas[rate].append((commit.stats.changed_elements, commit.stats.total_elements,
                                             commit.delta_bytes))
                        log = DeltaLog.open(work / "log")
                        for e in engines:
                            measure(e, log, commit.version, rate, mode, verify, copy)
                        bad = bit_exact(engines, cfg, canon)
                        if bad:
                            failures.append(f"version {commit.version} ({rate:.2%}, {mode}:{verify}): "
                                            f"{len(bad)} parameters differ: {', '.join(bad[:4])}")
        except Exception as exc:  # a receiver refused or failed a version: report it, exit 1
            failures.append(f"{type(exc).__name__}: {exc}")
            print("FAILED:\n  " + "\n  ".join(failures))
            return 1
        copy_end = fastest(copy, 3).wall
        copy_s = min(copy_start, copy_end)
        result = report_table(cfg, engines, rates, deltas, param_bytes, copy_s, copy_start, copy_end)
        result["failures"] = failures
        result["bit_exact"] = not failures
        for e in engines:
            e.rx.close()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if failures:
            print("\nNOT BIT-EXACT:")
            for f in failures:
                print("  " + f)
            return 1
        print(f"\nbit-exact: every engine parameter equals a fresh engine's after each of "
              f"{writer.version} applies")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report_table(cfg, engines, rates, deltas, param_bytes, copy_s, copy_start, copy_end) -> dict[str, Any]:
    mb = 1e6
    print(f"engine: hidden {cfg.hidden}, intermediate {cfg.intermediate}, layers {cfg.num_layers} "
          f"(MoE {list(cfg.moe_layers)}, {cfg.num_experts} experts x {cfg.moe_intermediate}), vocab "
          f"{cfg.vocab_size}, {str(cfg.dtype).replace('torch.', '')}, tp 1: {param_bytes / mb:.1f} MB of parameters")
    print(f"baseline np.copyto of the parameters: {copy_s * 1e3:.1f} ms ({param_bytes / copy_s / 1e9:.2f} GB/s; "
          f"best of 3 at start {copy_start * 1e3:.1f} ms, at end {copy_end * 1e3:.1f} ms); times below in x copy: "
          "the median pair's, each call timed beside one copy right after it")
    out: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.__dict__.items()},
        "param_bytes": param_bytes, "copy_seconds": copy_s, "copy_seconds_start": copy_start,
        "copy_seconds_end": copy_end, "engines": {}, "rows": [], "ratio_1pct_over_0_1pct": {},
    }
    for e in engines:
        d = e.placement.describe()
        print(f"discovery {e.kind:5s}: {e.discover_s:7.2f} s = {e.discover_s / copy_s:8.0f} x copy  "
              f"({d['pieces']} pieces, residual {len(d['residual_params'])}: {', '.join(d['residual_params'])})")
        out["engines"][e.kind] = {"discover_seconds": e.discover_s, "discover_x_copy": e.discover_s / copy_s,
                                  "placement": d}
    cols = [("stage", "none"), ("pause", "none"), ("apply", "none"), ("stage", "sample"), ("pause", "sample"),
            ("apply", "sample")]
    head = (f"{'engine':6s} {'rate':>5s} {'changed':>14s} {'delta MB':>8s} {'staged MB':>9s} "
            + " ".join(f"{c + ':' + v:>12s}" for c, v in cols))
    print()
    print(head)
    print("-" * len(head))
    median_s: dict[tuple, float] = {}
    for e in engines:
        for rate in rates:
            changed, total, dbytes = (int(np.median([x[i] for x in deltas[rate]])) for i in range(3))
            row = {"engine": e.kind, "rate": rate, "changed_elements": changed, "total_elements": total,
                   "delta_bytes": dbytes, "staged_bytes": min(e.staged[(rate, "sample")]),
                   "staged_bytes_none": min(e.staged[(rate, "none")])}
            cells = []
            for c, v in cols:
                pairing = Pairing.join(e.pairings[(rate, c, v)])
                s = pairing.op_wall  # the median
                median_s[(e.kind, rate, c, v)] = s
                row[f"{c}_{v}_seconds"] = s
                row[f"{c}_{v}_x_copy"] = pairing.ratio
                cells.append(f"{pairing.ratio:12.3f}")
            out["rows"].append(row)
            print(f"{e.kind:6s} {rate:5.1%} {changed:>8d} {changed / total:5.2%} {dbytes / mb:8.2f} "
                  f"{row['staged_bytes'] / mb:9.2f} " + " ".join(cells))
    if 0.001 in rates and 0.01 in rates:
        print("\napply time at 1% / at 0.1% (target: >= 5x):")
        for e in engines:
            parts = []
            for c, v in cols[1:3] + cols[4:6]:
                r = median_s[(e.kind, 0.01, c, v)] / median_s[(e.kind, 0.001, c, v)]
                out["ratio_1pct_over_0_1pct"][f"{e.kind}_{c}_{v}"] = r
                parts.append(f"{c}:{v} {r:5.1f}x {'holds' if r >= 5 else 'FAILS'}")
            print(f"  {e.kind:6s} " + "; ".join(parts))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="medium")
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--rates", default="0.001,0.01,0.03")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default="torch,numpy")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on shared cores)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dir", help="where the log and journals go (a temporary directory under it)")
    p.add_argument("--keep", action="store_true", help="keep the log and journals")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
