"""tools/bench_side.py: the side-by-side benchmark runs end to end on a tiny state and its numbers
hold together; the NeMo-like reference codec round-trips; the MiniLM trace builder yields real
(partly changed) pairs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_side  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_tiny_run_json_and_plot(tmp_path, capsys):
    png = tmp_path / "p.png"
    rates = (0.01, 0.05)
    assert bench_side.main(["--gib", "0.01", "--rates", *map(str, rates), "--repeats", "1", "--json",
                            "--plot", str(png), "--no-minilm"]) == 0
    report = json.loads(capsys.readouterr().out)

    pairs = report["pairs"]
    assert [p["kind"] for p in pairs] == ["adam-bf16", "adam-bf16"]
    assert report["zipnn"]["available"] in (True, False)
    for pair, target in zip(pairs, rates):
        b = pair["bytes"]
        for codec in ("dcr", "nemo_like", "xor_zstd", "bound"):
            assert b[codec] > 0, (pair["label"], codec)
        assert b["zipnn"] is None or b["zipnn"] > 0
        if not report["zipnn"]["available"]:
            assert b["zipnn"] is None
        assert b["dcr"] < b["nemo_like"], pair["label"]
        assert b["dcr"] < b["xor_zstd"], pair["label"]
        assert abs(pair["changed_rate"] - target) <= 0.2 * target, (pair["changed_rate"], target)
        assert pair["changed_elements"] == round(pair["changed_rate"] * pair["elements"])
        assert pair["nemo_to_dcr"] > 1
        t = pair["throughput"]
        for op in ("xor", "append", "dense_create", "replay", "rx_numpy", "rx_torch", "rx_ckpt", "nemo_encode"):
            assert t["seconds"][op] > 0 and t["to_xor"][op] > 0, op
        assert t["to_xor"]["xor"] == 1
    assert report["writer_peak"]["peak_increase_mib"] >= 0
    assert report["writer_peak"]["held_state_mib"] > 0
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_nemo_like_codec_round_trips():
    rng = np.random.default_rng(3)
    dctx = zstandard.ZstdDecompressor()
    cctx = zstandard.ZstdCompressor(level=1)
    for n, k in ((1000, 7), (70_000, 3), (300_000, 30_000), (10, 10)):
        base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        new = base.copy()
        where = rng.choice(n, k, replace=False)
        new[where] ^= rng.integers(1, 1 << 16, k, dtype=np.uint16)
        frame, width, got_k = bench_side.nemo_like_encode(base, new, np.empty(n, np.uint16), cctx)
        assert got_k == k
        gaps_max = np.diff(np.sort(where), prepend=0).max()
        assert width == bench_side._gap_dtype(int(gaps_max))
        assert np.array_equal(bench_side.nemo_like_decode(frame, width, k, base, dctx), new)
    same = np.arange(100, dtype=np.uint16)
    assert bench_side.nemo_like_encode(same, same.copy(), np.empty(100, np.uint16), cctx) is None


def test_minilm_trace_pairs_partly_changed():
    (pair,) = bench_side.minilm_pairs((1e-4,), steps=2)
    assert pair.label == "minilm lr=1e-04"
    assert pair.base.dtype == np.uint16 and pair.base.size == pair.new.size > 1_000_000
    assert all(v.dtype == "BF16" for v in pair.base_state.values())
    rate = np.count_nonzero(pair.base != pair.new) / pair.base.size
    assert 0 < rate < 1, rate
    # The states are views of the flat arrays.
    name, bits = next(iter(pair.new_state.items()))
    assert np.shares_memory(bits.words, pair.new)


def test_bench_codec_reports_what_the_codec_comments_quote(capsys):
    """tools/bench_codec.py on a small pair: ulp below sparse and below the bound at 1%, level 8
    below level 2, distances of lower entropy than xor words, every timing positive."""
    import bench_codec

    assert bench_codec.main(["--rates", "0.01", "--elements", str(1 << 20), "--levels", "2", "8",
                             "--gather-mib", "8", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["codecs"]
    ulp = row["ulp"]
    assert ulp["8"]["bits_per_change"] < row["sparse_bits"]
    assert ulp["8"]["bits_per_change"] < row["bound_bits"]
    assert ulp["8"]["bits_per_change"] < ulp["2"]["bits_per_change"]
    assert row["distance_entropy"] < row["xor_entropy"] and row["unit_steps"] > 0.5
    kernels = report["kernels"]
    timings = [kernels["xor_ms"], *kernels["ulp_step_1pct"].values(), *kernels["fresh_fill"].values()]
    timings += [t for f in kernels["find_changes"].values() for t in f.values()]
    assert all(t > 0 for t in timings)
