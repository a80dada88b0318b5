"""Delta benchmark: compression against the entropy bound, append and replay speed against xor.

A bf16 state pair (default 1 GiB: 512 Mi elements, in Llama-shaped tensors) is built by one
Adam-like step from warm moments (dcr_log.synthetic.adam_step_pair), with learning rates
calibrated so that ~1% and ~3% of the words change. For each rate it reports:

- delta bytes (the committed segment files) and the compression ratio to the dense state;
- the zeroth-order entropy bound: log2 C(n, k) bits for the positions plus k * H(xor values),
  H the empirical entropy of the xor value histogram, and achieved ratio / bound ratio;
- append GB/s (LogWriter.append into a local log) and replay GB/s (DeltaLog.apply_version of
  that version onto the parent state): model bytes per second of the median call;
- ``np.bitwise_xor(a, b, out=prealloc)`` GB/s on the same arrays, and the ratios to it: each
  append and each apply is paired with one xor right after it (tools/timing.py), and the
  ratio is the median pair's of ``--repeats``.

Appends alternate new, base, new, ... so that every timed append and apply moves the same
changes (forwards or backwards). Usage: python tools/bench_delta.py [--gib 0.25] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcr_log import DeltaLog, LogWriter, TensorBits  # noqa: E402
from dcr_log.synthetic import adam_step_pair, lr_for_rate, rate_of  # noqa: E402
from timing import Pairing, paired  # noqa: E402

ROW = 4096
# One Llama-8B decoder layer's weight matrices, in rows of 4096: q, k, v, o, gate, up, down.
LAYER_ROWS = (4096, 1024, 1024, 4096, 14336, 14336, 14336)


def tensor_rows(n: int) -> list[tuple[str, int]]:
    """(name, rows) covering n elements with Llama-shaped matrices of 4096 columns."""
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    rows_left = n // ROW
    out: list[tuple[str, int]] = []
    layer = 0
    while rows_left:
        for name, rows in zip(names, LAYER_ROWS):
            take = min(rows, rows_left)
            out.append((f"model.layers.{layer}.{name}.weight", take))
            rows_left -= take
            if not rows_left:
                break
        layer += 1
    return out


def as_state(words: np.ndarray, layout: list[tuple[str, int]]) -> dict[str, TensorBits]:
    """Views of one flat word array as the named bf16 tensors (no copy)."""
    state, start = {}, 0
    for name, rows in layout:
        n = rows * ROW
        state[name] = TensorBits("BF16", (rows, ROW), words[start:start + n])
        start += n
    return state


def entropy_bound_bits(base: np.ndarray, new: np.ndarray, xor_buf: np.ndarray) -> tuple[int, float]:
    """(k, bits): log2 C(n, k) + k * H(xor values), H the empirical entropy of their histogram."""
    np.bitwise_xor(base, new, out=xor_buf)
    counts = np.bincount(xor_buf, minlength=1 << 16)[1:]  # value 0 means unchanged
    n = base.size
    k = int(counts.sum())
    if k == 0:
        return 0, 0.0
    p = counts[counts > 0] / k
    h = float(-(p * np.log2(p)).sum())
    log2_binom = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    return k, log2_binom + k * h


def run(gib: float, rates: list[float], repeats: int, seed: int, log_dir: Path, say) -> dict:
    n = max(ROW, int(gib * (1 << 30)) // 2 // ROW * ROW)
    layout = tensor_rows(n)
    dense_bytes = 2 * n
    say(f"state: {n:,} bf16 elements ({dense_bytes / 2**30:.3f} GiB) in {len(layout)} tensors")
    t0 = time.perf_counter()
    lrs = tuple(lr_for_rate(r) for r in rates)
    pair = adam_step_pair(n, seed, lrs)
    base, news = pair[0], pair[1:]
    say(f"generated the pair in {time.perf_counter() - t0:.1f} s (lrs {', '.join(f'{lr:.3g}' for lr in lrs)})")

    xor_out = np.empty(n, dtype=np.uint16)
    base_state = as_state(base, layout)
    t0 = time.perf_counter()
    writer = LogWriter.create(log_dir, base_state, cache_dir=False)
    say(f"version 0 (dense) written in {time.perf_counter() - t0:.1f} s")
    reader = DeltaLog.open(log_dir)
    replay_state = reader.materialize(0)

    results = []
    for rate, new in zip(rates, news):
        measured_rate = rate_of(base, new)
        k, bound_bits = entropy_bound_bits(base, new, xor_out)
        xor = functools.partial(np.bitwise_xor, base, new, out=xor_out)

        new_state = as_state(new, layout)
        append_times, apply_times, delta_sizes = [], [], []
        # Versions alternate new, base, new, ...: each moves the same k changes.
        for i in range(repeats):
            target = new_state if i % 2 == 0 else base_state
            commits = []
            append_times.append(paired(lambda: commits.append(writer.append(target)), xor, 1))
            commit = commits[0]
            if commit.stats.changed_elements != k:
                raise SystemExit(f"append recorded {commit.stats.changed_elements} changes, expected {k}")
            delta_sizes.append(commit.delta_bytes)
            apply_times.append(paired(lambda: reader.apply_version(replay_state, commit.version), xor, 1))
            for name, bits in replay_state.items():
                if not np.array_equal(bits.words, target[name].words):
                    raise SystemExit(f"version {commit.version}: {name} not bit-exact after replay")
        delta_bytes = delta_sizes[0]
        ratio = dense_bytes / delta_bytes
        bound_ratio = 16 * n / bound_bits
        appends, applies = Pairing.join(append_times), Pairing.join(apply_times)
        # Seconds are medians; xor's are those of all its calls (two per version).
        xors = Pairing.join([appends, applies]).baseline
        xor_s = float(np.median([x.wall for x in xors]))
        xor_cpu = float(np.median([x.cpu for x in xors]))
        append_s, append_cpu, apply_s, apply_cpu = appends.op_wall, appends.op_cpu, applies.op_wall, applies.op_cpu
        results.append({
            "target_rate": rate,
            "changed_rate": measured_rate,
            "changed_elements": k,
            "delta_bytes": delta_bytes,
            "ratio": ratio,
            "bound_bytes": bound_bits / 8,
            "bound_ratio": bound_ratio,
            "ratio_to_bound": ratio / bound_ratio,
            "xor_gbps": dense_bytes / xor_s / 1e9,
            "append_gbps": dense_bytes / append_s / 1e9,
            "replay_gbps": dense_bytes / apply_s / 1e9,
            "append_to_xor": 1 / appends.ratio,  # the median pair's
            "replay_to_xor": 1 / applies.ratio,
            "xor_s": xor_s,
            "append_s": append_s,
            "replay_s": apply_s,
            # CPU seconds (all threads): on a shared machine these vary less than wall time.
            "xor_cpu_s": xor_cpu,
            "append_cpu_s": append_cpu,
            "replay_cpu_s": apply_cpu,
        })
        # Leave the writer's baseline and the replayed state at base for the next rate.
        if repeats % 2 == 1:
            writer.append(base_state)
            reader.apply_version(replay_state, writer.version)
    return {"gib": dense_bytes / 2**30, "elements": n, "tensors": len(layout), "repeats": repeats,
            "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "results": results}


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("changed", "delta bytes", "ratio", "bound", "ratio/bound", "xor GB/s",
                  "append GB/s", "/xor", "replay GB/s", "/xor",
                  title=f"{report['gib']:.3f} GiB bf16, {report['tensors']} tensors, median of {report['repeats']} "
                        "(/xor: the median pair, each call timed beside one xor)",
                  title_justify="left")
    for r in report["results"]:
        table.add_row(f"{100 * r['changed_rate']:.2f}%", f"{r['delta_bytes']:,}", f"{r['ratio']:.1f}",
                      f"{r['bound_ratio']:.1f}", f"{r['ratio_to_bound']:.3f}", f"{r['xor_gbps']:.2f}",
                      f"{r['append_gbps']:.2f}", f"{r['append_to_xor']:.2f}", f"{r['replay_gbps']:.2f}",
                      f"{r['replay_to_xor']:.2f}")
    console = Console(width=120)
    console.print(table)
    for r in report["results"]:
        console.print(f"{100 * r['changed_rate']:.2f}%: CPU seconds (all threads) xor {r['xor_cpu_s']:.3f}, "
                      f"append {r['append_cpu_s']:.3f}, replay {r['replay_cpu_s']:.3f}; "
                      f"wall xor {r['xor_s']:.3f}, append {r['append_s']:.3f}, replay {r['replay_s']:.3f}")
    console.print(f"{report['cpus']} CPUs, load average {report['load_average']:.2f} at the end")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of the bf16 state in GiB (default 1)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.03], help="changed fractions")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed appends and applies per rate (each paired with one xor)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="log directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    say = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    with tempfile.TemporaryDirectory(prefix="dcr-bench-") as tmp:
        log_dir = args.dir if args.dir is not None else Path(tmp) / "log"
        report = run(args.gib, args.rates, args.repeats, args.seed, log_dir, say)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
