"""Codec and kernel benchmark: the figures the ulp encoding, its pcodec level and the C kernels
are chosen by (dcr_log/codec/ulp.py, dcr_log/_changes.c, spec/FORMAT.md section 11).

On one bf16 Adam-step pair per rate (dcr_log.synthetic.adam_step_pair, ``--elements`` per
pair, default 4 Mi, one record's box), in one process:

- entropy in bits per change of the xor words and of the ulp distances, and the share of
  distances that are +1 or -1;
- bits per change: the zeroth-order bound (log2 C(n, k) / k + the xor entropy), ``sparse``,
  ``ulp-rans``, and ``ulp`` at each of ``--levels`` (pcodec levels), with the encode and
  decode speed of both ulp encodings in M changes/s (one thread, the fastest of
  ``--repeats``: no baseline);
- the ulp-rans C coder alone on each vector path this CPU has (dcr_log._rans.CODER_PATHS:
  AVX2, AVX-512), each call paired with one on the scalar path: ns per change of both and
  the median pair's speed-up, after checking that every path writes the same payload and
  reads the same changes back;
- the pcodec files against the empirical entropy of what they hold (gaps, distances);
- where the ``constriction`` package is installed (it is not a dependency), a static rANS
  coder of ulp's symbols (gap and zigzagged distance, each as one categorical), for
  comparison: bits per change and decode M symbols/s;
- the C change pass and ulp step against their numpy references; C gather and scatter
  against numpy's at 1% of a ``--gather-mib`` MiB array (default 256); the C unplanes (byte
  planes back into words, as a dense record's decode) against numpy's shifts and ors on that
  many MiB of 2- and 4-byte words; a new buffer of that
  size filled once, dcr_log.buffers' huge pages against numpy's. Each C (or huge-page) call is
  paired with one call of its numpy baseline right after it (tools/timing.py): milliseconds are
  medians of ``--repeats`` and the ratio C / numpy is the median pair's.

Usage: python tools/bench_codec.py [--rates 0.01 0.03 0.10] [--elements N] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcr_log import _rans, buffers  # noqa: E402
from dcr_log.codec.base import ChangeSet, from_planes, to_planes, unplanes_numpy  # noqa: E402
from dcr_log.codec.sparse import SparseEncoding  # noqa: E402
from dcr_log.codec.ulp import UlpEncoding, step_from, step_from_numpy, ulp_distance  # noqa: E402
from dcr_log.codec.ulp_rans import UlpRansEncoding  # noqa: E402
from dcr_log.log.records import gather_words, scatter_words  # noqa: E402
from dcr_log.synthetic import adam_step_pair, lr_for_rate  # noqa: E402
from dcr_log.write.differ import _Scratch, find_changes, find_changes_numpy  # noqa: E402
from timing import Pairing, fastest, paired  # noqa: E402


def entropy_bits(values: np.ndarray) -> float:
    """Empirical entropy (bits per value) of the values' histogram."""
    if values.size == 0:
        return 0.0
    _, counts = np.unique(values, return_counts=True)
    p = counts / values.size
    return float(-(p * np.log2(p)).sum())


def versus(pairing: Pairing, c_key: str, numpy_key: str) -> dict:
    """A C kernel (op) against numpy (baseline): median milliseconds and the median pair's ratio."""
    return {c_key: pairing.op_wall * 1e3, numpy_key: pairing.baseline_wall * 1e3, "c_to_numpy": pairing.ratio}


def rans_row(gaps: np.ndarray, distances: np.ndarray, k: int, repeats: int) -> dict | None:
    """constriction's stack rANS on one categorical per stream (tables not counted)."""
    try:
        import constriction
    except ImportError:
        return None
    zigzag = ((distances << 1) ^ (distances >> 63)).astype(np.int64)
    streams = []
    for symbols in (np.minimum(gaps, 1 << 16).astype(np.int32), np.minimum(zigzag, 1 << 16).astype(np.int32)):
        counts = np.bincount(symbols).astype(np.float64)
        streams.append((symbols, constriction.stream.model.Categorical(counts / counts.sum(), perfect=False)))
    coder = constriction.stream.stack.AnsCoder()
    for symbols, model in reversed(streams):
        coder.encode_reverse(symbols, model)
    words = coder.get_compressed()

    def decode():
        d = constriction.stream.stack.AnsCoder(words)
        for symbols, model in streams:
            d.decode(model, symbols.size)

    seconds = fastest(decode, repeats).wall
    return {"bits_per_change": words.nbytes * 8 / k, "decode_msym_s": 2 * k / seconds / 1e6}


RANS_PATH_NAMES = {0: "scalar", 1: "AVX2", 2: "AVX-512"}


def rans_path_rows(positions: np.ndarray, base: np.ndarray, new: np.ndarray, n: int, repeats: int) -> dict:
    """The C coder's vector paths against its scalar one on one record (tables included)."""
    k, width = positions.size, base.itemsize
    out = np.empty(_rans.bound(k), np.uint8)
    scratch = np.empty(_rans.scratch(k), np.uint8)
    pos, dist = np.empty(k, np.int64), np.empty(k, base.dtype)
    payloads = {}
    for path in _rans.CODER_PATHS:
        payloads[path] = out[:_rans.encode(positions, base, new, width, out, scratch, path)].tobytes()
        if _rans.decode(payloads[path], n, k, width, pos, dist, path) != 0 or not np.array_equal(pos, positions):
            raise SystemExit(f"the {RANS_PATH_NAMES[path]} path does not read its payload back")
    if len(set(payloads.values())) != 1:
        raise SystemExit("the coder's paths wrote different payloads")
    payload = payloads[0]
    rows = {}
    for path in _rans.CODER_PATHS[1:]:
        enc = paired(lambda path=path: _rans.encode(positions, base, new, width, out, scratch, path),
                     lambda: _rans.encode(positions, base, new, width, out, scratch, 0), repeats)
        dec = paired(lambda path=path: _rans.decode(payload, n, k, width, pos, dist, path),
                     lambda: _rans.decode(payload, n, k, width, pos, dist, 0), repeats)
        rows[RANS_PATH_NAMES[path]] = {
            "encode_ns": enc.op_wall / k * 1e9, "scalar_encode_ns": enc.baseline_wall / k * 1e9,
            "encode_speedup": 1 / enc.ratio, "decode_ns": dec.op_wall / k * 1e9,
            "scalar_decode_ns": dec.baseline_wall / k * 1e9, "decode_speedup": 1 / dec.ratio}
    return rows


def codec_rows(rates: list[float], n: int, levels: list[int], repeats: int, seed: int) -> list[dict]:
    pair = adam_step_pair(n, seed, tuple(lr_for_rate(r) for r in rates))
    base, rows = pair[0], []
    for rate, new in zip(rates, pair[1:]):
        positions, b, v = find_changes(base, new)
        k = positions.size
        xor = b ^ v
        distances = ulp_distance(b, v).view(np.int16).astype(np.int64)
        changes = ChangeSet(n, positions, xor)
        log2_binom = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
        gaps = np.diff(positions, prepend=-1) - 1
        row = {"target_rate": rate, "changed_rate": k / n, "changes": k,
               "xor_entropy": entropy_bits(xor), "distance_entropy": entropy_bits(distances),
               "unit_steps": float(np.mean(np.abs(distances) == 1)),
               "bound_bits": log2_binom / k + entropy_bits(xor),
               "sparse_bits": len(SparseEncoding().encode("xor", changes)[1]) * 8 / k,
               "gap_entropy": entropy_bits(gaps), "ulp": {}}
        for level in levels:
            enc = UlpEncoding(level)
            params, payload = enc.encode("xor", changes, base=b, new=v)
            encode_s = fastest(lambda: enc.encode("xor", changes, base=b, new=v), repeats).wall
            decode_s = fastest(lambda: enc.decode("xor", params, payload, n, k, np.dtype("<u2")), repeats).wall
            gap_file = int.from_bytes(payload[:8], "little")
            row["ulp"][level] = {
                "bits_per_change": len(payload) * 8 / k,
                "gap_file_bits": gap_file * 8 / k,
                "distance_file_bits": (len(payload) - 8 - gap_file) * 8 / k,
                "encode_mchg_s": k / encode_s / 1e6, "decode_mchg_s": k / decode_s / 1e6}
        rans = UlpRansEncoding()
        params, payload = rans.encode("xor", changes, base=b, new=v)
        encode_s = fastest(lambda: rans.encode("xor", changes, base=b, new=v), repeats).wall
        decode_s = fastest(lambda: rans.decode("xor", params, payload, n, k, np.dtype("<u2")), repeats).wall
        row["ulp_rans"] = {"bits_per_change": len(payload) * 8 / k,
                           "encode_mchg_s": k / encode_s / 1e6, "decode_mchg_s": k / decode_s / 1e6}
        row["ulp_rans_paths"] = rans_path_rows(positions, b, v, n, repeats)
        row["constriction"] = rans_row(gaps, distances, k, repeats)
        rows.append(row)
    return rows


def kernel_rows(n: int, gather_mib: int, repeats: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    out = np.empty_like(base)
    xor_s = fastest(lambda: np.bitwise_xor(base, base, out=out), repeats).wall
    found = {}
    for rate in (0.01, 0.03, 0.10):
        new = base.copy()
        new[rng.random(n) < rate] ^= 1
        scratch = _Scratch()
        found[rate] = versus(paired(lambda: find_changes(base, new, scratch),
                                    lambda: find_changes_numpy(base, new, scratch), repeats), "c_ms", "numpy_ms")
    d = rng.choice(np.array([1, -1, 2], dtype=np.int16), n // 100).view(np.uint16)
    some = base[: d.size]
    step = versus(paired(lambda: step_from(some, d), lambda: step_from_numpy(some, d), repeats), "c_ms", "numpy_ms")
    big = np.zeros(gather_mib << 19, dtype=np.uint16)  # gather_mib MiB of bf16
    big[:] = 1
    where = np.sort(rng.choice(big.size, big.size // 100, replace=False)).astype(np.int64)
    values = gather_words(big, where)

    def numpy_scatter():
        big[where] = values

    gather = paired(lambda: gather_words(big, where), lambda: big[where], repeats)
    scatter = paired(lambda: scatter_words(big, where, values), numpy_scatter, repeats)
    moves = {"gather_c_ms": gather.op_wall * 1e3, "gather_numpy_ms": gather.baseline_wall * 1e3,
             "gather_c_to_numpy": gather.ratio, "scatter_c_ms": scatter.op_wall * 1e3,
             "scatter_numpy_ms": scatter.baseline_wall * 1e3, "scatter_c_to_numpy": scatter.ratio}
    big = where = values = None  # freed (the closures above refer to them)
    # Byte planes back into words (a dense record's decode, from_planes), bf16 and fp32.
    unplanes = {}
    for dtype in (np.dtype(np.uint16), np.dtype(np.uint32)):
        words = rng.integers(0, np.iinfo(dtype).max, (gather_mib << 20) // dtype.itemsize, dtype=dtype)
        planes = to_planes(words)
        into_c, into_numpy = np.empty_like(words), np.empty_like(words)
        pairing = paired(lambda p=planes, o=into_c: from_planes(p, o.size, o.dtype, out=o),
                         lambda p=planes, o=into_numpy: unplanes_numpy(p, o.size, o), repeats)
        if not (np.array_equal(into_c, words) and np.array_equal(into_numpy, words)):
            raise SystemExit(f"unplanes: the words of width {dtype.itemsize} did not come back")
        unplanes[dtype.itemsize] = versus(pairing, "c_ms", "numpy_ms")
    words = planes = into_c = into_numpy = None
    # A new buffer of gather_mib MiB filled once (the pages are faulted in on first write),
    # dcr_log.buffers' huge pages against numpy's own; none is freed before the last pair.
    source = np.ones(gather_mib << 19, dtype=np.uint16)
    kept = []

    def fill_new(make) -> None:
        buf = make()
        np.copyto(buf, source)
        kept.append(buf)

    filled = paired(lambda: fill_new(lambda: buffers.zeros(source.size, np.uint16)),
                    lambda: fill_new(lambda: np.empty(source.size, np.uint16)), repeats)
    kept.clear()
    fill = {"numpy_ms": filled.baseline_wall * 1e3, "huge_pages_ms": filled.op_wall * 1e3,
            "huge_pages_to_numpy": filled.ratio}
    return {"elements": n, "xor_ms": xor_s * 1e3, "find_changes": found, "ulp_step_1pct": step,
            "moves_1pct": {"mib": gather_mib, **moves}, "unplanes": {"mib": gather_mib, "by_width": unplanes},
            "fresh_fill": {"mib": gather_mib, **fill}}


def print_report(report: dict) -> None:
    for r in report["codecs"]:
        print(f"{100 * r['changed_rate']:.2f}% changed ({r['changes']:,} changes): entropy xor "
              f"{r['xor_entropy']:.2f}, distances {r['distance_entropy']:.2f} bits "
              f"({100 * r['unit_steps']:.0f}% are +-1), gaps {r['gap_entropy']:.2f}")
        print(f"  bits/change: bound {r['bound_bits']:.2f}, sparse {r['sparse_bits']:.2f}")
        for level, u in r["ulp"].items():
            print(f"  ulp level {level}: {u['bits_per_change']:.2f} (gaps {u['gap_file_bits']:.2f}, "
                  f"distances {u['distance_file_bits']:.2f}); encode {u['encode_mchg_s']:.0f}, "
                  f"decode {u['decode_mchg_s']:.0f} M changes/s")
        u = r["ulp_rans"]
        print(f"  ulp-rans: {u['bits_per_change']:.2f}; encode {u['encode_mchg_s']:.0f}, decode "
              f"{u['decode_mchg_s']:.0f} M changes/s")
        for name, p in r["ulp_rans_paths"].items():
            print(f"  ulp-rans C coder, {name} against scalar: encode {p['encode_ns']:.2f} against "
                  f"{p['scalar_encode_ns']:.2f} ns a change ({p['encode_speedup']:.2f} x), decode "
                  f"{p['decode_ns']:.2f} against {p['scalar_decode_ns']:.2f} ({p['decode_speedup']:.2f} x)")
        if r["constriction"]:
            print(f"  rANS (constriction): {r['constriction']['bits_per_change']:.2f} bits/change, decode "
                  f"{r['constriction']['decode_msym_s']:.0f} M symbols/s")
        else:
            print("  rANS (constriction): not installed")
    k = report["kernels"]
    print(f"kernels on {k['elements']:,} bf16 words (one xor pass {k['xor_ms']:.2f} ms; medians, each C call "
          "timed beside one numpy call, x: the median pair's C / numpy):")
    for rate, f in k["find_changes"].items():
        print(f"  find_changes {100 * float(rate):g}%: C {f['c_ms']:.2f} ms, numpy {f['numpy_ms']:.2f} ms "
              f"({f['c_to_numpy']:.2f} x)")
    s = k["ulp_step_1pct"]
    print(f"  ulp step of 1%: C {s['c_ms']:.3f} ms, numpy {s['numpy_ms']:.3f} ms ({s['c_to_numpy']:.2f} x)")
    m = k["moves_1pct"]
    print(f"  1% of {m['mib']} MiB: gather C {m['gather_c_ms']:.1f} ms, numpy {m['gather_numpy_ms']:.1f} ms "
          f"({m['gather_c_to_numpy']:.2f} x); scatter C {m['scatter_c_ms']:.1f} ms, numpy "
          f"{m['scatter_numpy_ms']:.1f} ms ({m['scatter_c_to_numpy']:.2f} x)")
    u = k["unplanes"]
    for width, p in u["by_width"].items():
        print(f"  unplanes, {u['mib']} MiB of {width}-byte words: C {p['c_ms']:.1f} ms, numpy {p['numpy_ms']:.1f} ms "
              f"({p['c_to_numpy']:.2f} x)")
    f = k["fresh_fill"]
    print(f"  a new {f['mib']} MiB buffer filled: numpy {f['numpy_ms']:.0f} ms, "
          f"huge pages {f['huge_pages_ms']:.0f} ms ({f['huge_pages_to_numpy']:.2f} x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.03, 0.10])
    ap.add_argument("--elements", type=int, default=1 << 22, help="elements of each pair (default 4 Mi)")
    ap.add_argument("--levels", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--gather-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    report = {"codecs": codec_rows(args.rates, args.elements, args.levels, args.repeats, args.seed),
              "kernels": kernel_rows(args.elements, args.gather_mib, args.repeats, args.seed)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
