"""Read-side throughput: replay, the numpy Receiver and dense materialize, each paired with its
dense baseline (tools/timing.py ``paired``: op, baseline, op, baseline, ...; the median pair's
ratio is reported, with its spread and medians of wall and CPU seconds).

State: a ``--mib`` MiB bf16 Adam-like state (dcr_log.synthetic.adam_step_pair) cut into
Llama-shaped tensors (tools/bench_delta.py), one new state per ``--rates`` changed fraction.

- replay: ``DeltaLog.apply_version`` of a version onto a state holding its parent, versus
  ``np.bitwise_xor(base, new, out=prealloc)`` on the same flat arrays; versions alternate new,
  base, new, ... so every timed replay moves the same changes;
- rx_numpy: ``Receiver.apply`` of the rate's first version from its parent onto numpy
  tensors, default verification (bind and apply), versus ``np.copyto`` of the whole state; the
  tensors are reset and the journal recreated untimed between repetitions;
- materialize: ``DeltaLog.materialize(0)`` of a version-0-only log (dense), versus xor.

Every result is checked bit-exact. Ratios are op speed / baseline speed (1 = as fast).
``ns_cpu_per_change`` is the op's CPU seconds (every thread) less the baseline's, per changed
element.

Usage: python tools/bench_read.py [--mib 256] [--rates 0.01 0.10] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_delta import ROW, as_state, tensor_rows  # noqa: E402
from dcr_log import DeltaLog, LogWriter, TensorBits  # noqa: E402
from dcr_log.receiver import Receiver  # noqa: E402
from dcr_log.synthetic import adam_step_pair, lr_for_rate  # noqa: E402
from timing import Pairing, paired  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_words(got: dict[str, np.ndarray], expected: dict[str, TensorBits], what: str) -> None:
    for name, exp in expected.items():
        if not np.array_equal(got[name], exp.words):
            raise SystemExit(f"{what}: {name} is not bit-exact")


def speed(p: Pairing) -> dict[str, float]:
    """The pairing's numbers, with the ratio turned into a speed ratio (op speed / baseline's)."""
    s = p.summary()
    low, high = p.spread
    return {**s, "speed": 1 / p.ratio, "speed_low": 1 / high, "speed_high": 1 / low}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.10])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    n = max(ROW, int(args.mib * (1 << 20)) // 2 // ROW * ROW)
    layout = tensor_rows(n)
    say(f"state: {n:,} bf16 elements ({2 * n / 2**20:.0f} MiB) in {len(layout)} tensors")
    lrs = tuple(lr_for_rate(r) for r in args.rates)
    flat = adam_step_pair(n, args.seed, lrs)
    base, news = flat[0], flat[1:]
    base_state = as_state(base, layout)
    scratch = np.empty(n, dtype=np.uint16)
    copyto = functools.partial(np.copyto, scratch, base)
    report: dict = {"elements": n, "bytes": 2 * n, "rates": {}}

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dense_dir = work / "dense"
        LogWriter.create(dense_dir, base_state, cache_dir=False)
        dense = DeltaLog.open(dense_dir)
        xor0 = functools.partial(np.bitwise_xor, base, news[0], out=scratch)
        got: list[dict] = []

        def materialize() -> None:
            # Only the last state is kept (to be checked): holding every repetition's (a
            # model each) made each later materialize find its memory more slowly (0.54-0.58 s
            # against 0.42 s by --mib 512 --rates 0.01 --repeats 5).
            got.clear()
            got.append(dense.materialize(0))

        mat = paired(materialize, xor0, args.repeats)
        check_words({k: v.words for k, v in got[-1].items()}, base_state, "materialize")
        got.clear()
        report["materialize"] = speed(mat)
        say(f"materialize: {1 / mat.ratio:.3f} x xor ({mat.op_wall:.3f} s, cpu {mat.op_cpu:.3f} s)")

        log_dir = work / "log"
        writer = LogWriter.create(log_dir, base_state, cache_dir=False)
        reader = DeltaLog.open(log_dir)
        replay_state = reader.materialize(0)
        for rate, new in zip(args.rates, news):
            new_state = as_state(new, layout)
            k = int(np.count_nonzero(base != new))
            xor = functools.partial(np.bitwise_xor, base, new, out=scratch)
            replays, first = [], None
            for i in range(args.repeats):
                target = new_state if i % 2 == 0 else base_state
                commit = writer.append(target)
                first = first or commit.version
                replays.append(paired(lambda v=commit.version: reader.apply_version(replay_state, v), xor, 1))
                check_words({kk: v.words for kk, v in replay_state.items()}, target, f"replay {commit.version}")
            if args.repeats % 2 == 1:  # back to base for the next rate
                writer.append(base_state)
                reader.apply_version(replay_state, writer.version)
            replay = Pairing.join(replays)

            words = {kk: v.words.copy() for kk, v in base_state.items()}
            tensors = {kk: TensorBits(v.dtype, v.shape, words[kk]) for kk, v in base_state.items()}
            rx_pairs = []
            for r in range(args.repeats):
                for kk, v in base_state.items():
                    np.copyto(words[kk], v.words)
                journal = work / f"journal-{rate}-{r}"
                applied: list[int] = []
                with Receiver.open(tensors, journal) as rx:
                    rx.bind(reader, first - 1)
                    step = functools.partial(lambda a, r, to: a.extend(r.apply(reader, to=to)), applied, rx, first)
                    rx_pairs.append(paired(step, copyto, 1))
                if applied != [first]:
                    raise SystemExit(f"receiver applied {applied}, expected [{first}]")
                check_words(words, new_state, "numpy receiver")
                shutil.rmtree(journal)
            rx_np = Pairing.join(rx_pairs)
            del tensors, words
            row = {"changed": k, "replay_vs_xor": speed(replay), "rx_numpy_vs_copyto": speed(rx_np)}
            for name, p in (("replay_vs_xor", replay), ("rx_numpy_vs_copyto", rx_np)):
                row[name]["ns_cpu_per_change"] = (p.op_cpu - p.baseline_cpu) / k * 1e9
            report["rates"][str(rate)] = row
            say(f"{100 * rate:g}% ({k:,} changes): replay {1 / replay.ratio:.3f} x xor "
                f"(cpu {row['replay_vs_xor']['ns_cpu_per_change']:.1f} ns/change); numpy receiver "
                f"{1 / rx_np.ratio:.3f} x copyto (cpu {row['rx_numpy_vs_copyto']['ns_cpu_per_change']:.1f} ns/change)")
    if args.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
