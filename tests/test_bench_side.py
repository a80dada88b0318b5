"""tools/bench_side.py: the side-by-side benchmark runs end to end on a tiny state and its numbers
hold together; the NeMo-like reference codec round-trips; the MiniLM trace builder yields real
(partly changed) pairs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_side  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_a_transformer_layout_and_a_verify_level_reach_every_child_process(capsys, monkeypatch):
    """--layout transformer: the state is the transformer's tensors (two norms and seven
    matrices a layer, the embeddings, the final norm and the head) in the run and in each
    child: the peak-memory writer and receiver (each reports its tensors), the first applies
    (which check their bits against the log's) and the checkpoints of the CLI's peak.
    --verify none: every timed receiver's apply in this process and the first-apply children
    take that level; the peak-memory children keep the library's default."""
    monkeypatch.setattr(bench_side, "IDLE_SECONDS", 0.05)
    levels: list[str | None] = []
    real_apply = bench_side.Receiver.apply

    def apply(self, log=None, to=None, verify=None, **kwargs):
        levels.append(verify)
        return real_apply(self, log, to=to, verify=verify, **kwargs)

    monkeypatch.setattr(bench_side.Receiver, "apply", apply)
    children: list[list[str]] = []
    real_run = bench_side.subprocess.run

    def run(cmd, *args, **kwargs):
        children.append([str(c) for c in cmd])
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(bench_side.subprocess, "run", run)
    assert bench_side.main(["--gib", "0.01", "--rates", "0.01", "--repeats", "1", "--json", "--no-minilm",
                            "--layout", "transformer", "--layers", "2", "--verify", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verify"] == "none"
    # numpy, numpy after a pause, torch, the checkpoint directory (deferred and synced) and
    # the following checkpoint receiver's versions: all at none
    assert len(levels) >= 6 and set(levels) == {"none"}, levels
    first = [c for c in children if "--first-child" in c]
    assert first and all(c[c.index("--verify") + 1] == "none" for c in first)
    assert not any("--verify" in c for c in children if "--peak-child" in c)
    assert (report["layout"], report["layers"], report["tensors"]) == ("transformer", 2, 2 * 9 + 3)
    assert report["elements"] == sum(np.prod(s.shape) for s in bench_side.specs_for_params(int(0.01 * 2**30) // 2, 2))
    assert report["pairs"][0]["spread"]["tensors"] >= 2 * 7 + 2  # the matrices and more: changes everywhere
    peak = report["peak_memory"]
    assert peak["writer_api"]["tensors"] == peak["receiver_numpy"]["tensors"] == 2 * 9 + 3
    assert peak["receiver_numpy"]["peak_mib"] > 0
    assert report["pairs"][0]["throughput"]["seconds"]["rx_numpy_first"] > 0


def test_tiny_run_json_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench_side, "IDLE_SECONDS", 0.05)  # rx_numpy_idle's pause, shortened
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
        for op in ("xor", "copyto", "append", "append_synced", "append_reopened", "replay", "rx_numpy", "rx_numpy_idle",
                   "rx_numpy_first", "rx_torch", "rx_ckpt", "rx_ckpt_follow", "rx_ckpt_sync", "nemo_encode"):
            assert t["seconds"][op] > 0 and t["to_xor"][op] > 0, op
        assert t["to_xor"]["xor"] == 1
        # The following receiver's journal fills with images first (a version's images lie
        # well within the budget here), then is timed past its first drop of them.
        assert t["seconds"]["rx_ckpt_fill"] > 0 and t["to_xor"]["rx_ckpt_fill"] > 0
        # Speed ratios, not time ratios: copyto (one read, one write) is faster than xor (two
        # reads, one write), and each ratio follows from the medians' direction.
        assert (t["to_xor"]["copyto"] > 1) == (t["seconds"]["copyto"] < t["seconds"]["xor"])
        for op in ("append", "append_synced", "append_reopened", "replay"):
            assert abs(t["to_copyto"][op] * t["to_xor"]["copyto"] - t["to_xor"][op]) < 1e-9 * t["to_xor"][op]
        # The changes of an optimizer step are spread over every tensor, not clustered.
        sp = pair["spread"]
        assert sp["tensors"] >= 1
        assert 0.08 < sp["tenth_share_min"] <= 0.1 <= sp["tenth_share_max"] < 0.12, sp
        assert sp["first_change_max"] < 0.01 and sp["last_change_min"] > 0.99, sp
        assert sp["rows_with_change_min"] > 0.5, sp
    d = report["dense_create"]
    assert d["seconds"] > 0 and 0 < d["to_xor"] and 0 < d["to_copyto"]
    assert d["spread_to_xor"][0] <= d["to_xor"] <= d["spread_to_xor"][1]
    peak = report["peak_memory"]
    model_mib = peak["model_mib"]
    assert peak["model_bytes"] == 2 * report["elements"]
    w = peak["writer_api"]
    # Totals: the writer holds its base and new states, the receiver its weights, the CLI maps
    # the checkpoint; each peak is at least what it holds.
    assert w["peak_mib"] >= w["imports_mib"] + 2 * model_mib * 0.99, w
    assert w["peak_to_model"] == w["peak_mib"] * 2**20 / peak["model_bytes"]
    assert w["append_increase_mib"] is not None and 0 <= w["append_increase_mib"] <= w["peak_mib"]
    assert w["ru_maxrss_mib"] >= w["peak_mib"] * 0.99
    rx = peak["receiver_numpy"]
    assert rx["peak_mib"] >= rx["imports_mib"] + model_mib * 0.99, rx
    imports = peak["cli_imports"]["peak_mib"]
    for key in ("cli_init", "cli_append", "cli_apply_dense", "cli_apply"):
        e = peak[key]
        assert e["peak_mib"] > imports and e["peak_to_model"] > 0, (key, e)
    # Measured apart from this process: a direct child's peak would start at this process's.
    assert imports < bench_side._vm("VmHWM") / 2**20
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_follow_versions_cover_the_journals_first_fill():
    from dcr_log.receiver.batch import wal_budget, wal_image_min_bytes

    n = 1 << 28  # 512 MiB of bf16
    budget = wal_budget(2 * n)
    for changed in (n // 100, n // 33, n // 20, n // 10):
        count, fill = bench_side.follow_versions(n, changed, 5)
        per_version = wal_image_min_bytes(changed, 2)  # the smallest a version's images can be
        # The fill ends at the first version whose images do not fit beside the earlier ones.
        assert (fill - 1) * per_version > budget >= (fill - 2) * per_version, changed
        assert count == fill + 5
    # Images above the budget are never kept: nothing to fill (at 20% changed, 1-byte gaps
    # and the words take 30% of the model's bytes; the budget is a quarter).
    assert bench_side.follow_versions(n, n // 5, 5) == (5, 0)


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


def test_small_receiver_timing_applies_and_checks_each_version(tmp_path):
    """The MiniLM rows' numpy receiver: every timed apply takes the pair's base to its new
    words (checked bit for bit by the tool), is paired with one copyto, and leaves no journal."""
    n = 64 * bench_side.ROW
    base, new = bench_side.adam_step_pair(n, 3, (2e-6,))
    layout = bench_side.tensor_rows(n)
    pair = bench_side.Pair("small", "minilm", None, 2e-6, base, new, bench_side.as_state(base, layout),
                           bench_side.as_state(new, layout))
    writer = bench_side.LogWriter.create(tmp_path / "log", pair.base_state, cache_dir=False)
    version = writer.append(pair.new_state).version
    (tmp_path / "work").mkdir()
    timed = bench_side.time_small_receiver(bench_side.DeltaLog.open(tmp_path / "log"), version, pair, 3,
                                           tmp_path / "work")
    assert len(timed.op) == len(timed.baseline) == 3
    assert all(s.wall > 0 for s in timed.op + timed.baseline)
    assert list((tmp_path / "work").iterdir()) == []
    # A pair whose new words the log does not hold is refused, not timed.
    wrong = bench_side.Pair("wrong", "minilm", None, 2e-6, base, base, pair.base_state, pair.base_state)
    with pytest.raises(SystemExit, match="not bit-exact"):
        bench_side.time_small_receiver(bench_side.DeltaLog.open(tmp_path / "log"), version, wrong, 1,
                                       tmp_path / "work")


def test_bench_codec_reports_what_the_codec_comments_quote(capsys):
    """tools/bench_codec.py on a small pair: ulp below sparse and below the bound at 1%, level 8
    below level 2, distances of lower entropy than xor words, a row for each of the coder's
    vector paths, every timing positive."""
    import bench_codec

    assert bench_codec.main(["--rates", "0.01", "--elements", str(1 << 20), "--levels", "2", "8",
                             "--gather-mib", "8", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["codecs"]
    ulp = row["ulp"]
    assert ulp["8"]["bits_per_change"] < row["sparse_bits"]
    assert ulp["8"]["bits_per_change"] < row["bound_bits"]
    assert ulp["8"]["bits_per_change"] < ulp["2"]["bits_per_change"]
    rans = row["ulp_rans"]
    assert rans["bits_per_change"] < row["sparse_bits"] and rans["bits_per_change"] < row["bound_bits"]
    assert rans["encode_mchg_s"] > 0 and rans["decode_mchg_s"] > 0
    # the coder's vector paths against the scalar one, one row per vector path this CPU has
    from dcr_log import _rans

    paths = row["ulp_rans_paths"]
    assert sorted(paths) == sorted(bench_codec.RANS_PATH_NAMES[p] for p in _rans.CODER_PATHS[1:])
    assert all(t > 0 for p in paths.values() for t in p.values())
    assert row["distance_entropy"] < row["xor_entropy"] and row["unit_steps"] > 0.5
    kernels = report["kernels"]
    timings = [kernels["xor_ms"], *kernels["ulp_step_1pct"].values(), *kernels["fresh_fill"].values()]
    timings += [t for f in kernels["find_changes"].values() for t in f.values()]
    assert all(t > 0 for t in timings)


def test_percost_fit_separates_the_pass_from_the_per_change_cost():
    import bench_percost

    ks = [1_000, 5_000, 30_000, 100_000]
    model = 1 << 20
    seconds = [model * 0.5e-9 + k * 40e-9 for k in ks]  # 0.5 ns per byte, 40 ns per change
    f = bench_percost.fit([model] * len(ks), ks, seconds)
    assert abs(f["ns_per_change"] - 40) < 1e-6 and abs(f["ns_per_byte"] - 0.5) < 1e-9
    assert abs(f["fixed_ms"] - model * 0.5e-6) < 1e-9 and f["r2"] > 0.999999 and f["points"] == 4


def test_percost_tiny_run_json(capsys):
    import bench_percost

    assert bench_percost.main(["--gib", "0.01", "--rates", "0.01", "0.05", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["modes"]) == {"one-core", "default"}
    assert len(report["modes"]["one-core"]["cpus"]) == 1  # pinned before the child started
    for mode, m in report["modes"].items():
        low, high = m["changes"]
        assert 0.008 * m["elements"] < low < high < 0.06 * m["elements"], m["changes"]
        for op in ("encode", "apply_numpy", "replay"):
            samples = m["samples"][op]
            assert len(samples) == 4 and all(s["cpu"] > 0 and s["wall"] > 0 and s["xor"] > 0 for s in samples)
            for kind in ("cpu", "wall", "wall_load_scaled"):
                f = m["fits"][op][kind]
                assert f["points"] == 4 and np.isfinite(f["ns_per_change"]), (mode, op, kind, f)
    # The fits are slopes of measured times: their sign and order depend on the
    # machine's load, so only their shape is checked here (the fit itself is
    # checked on exact data above).
    stages = report["modes"]["one-core"]["stages"]
    assert set(stages) == set(bench_percost.STAGES)
    for name in ("find_changes", "rans", "pcodec", "choose", "diff_box"):
        f = stages[name]
        assert f["points"] >= 2 and np.isfinite(f["ns_per_change"]) and np.isfinite(f["fixed_ms"]), (name, f)
    assert report["modes"]["one-core"]["stage_seconds"][0]["encodings"] == ["ulp-rans"]
    apply_stages = report["modes"]["one-core"]["apply_stages"]
    assert set(apply_stages) == set(bench_percost.APPLY_STAGES)
    for name, f in apply_stages.items():
        assert f["points"] == 2 and np.isfinite(f["ns_per_change"]) and np.isfinite(f["fixed_ms"]), (name, f)
    assert all(s[name] > 0 for s in report["modes"]["one-core"]["apply_stage_seconds"]
               for name in ("read", "decode", "classify", "scatter"))


def test_bench_pagecache_ways_keep_the_checkpoints_bytes(tmp_path):
    """tools/bench_pagecache.py times the same bytes reached five ways: each way leaves the
    checkpoint's file byte for byte as write_checkpoint wrote it, and a tiny run times each."""
    import bench_pagecache
    from dcr_log.receiver import write_checkpoint

    state = bench_pagecache.state_of(2)
    assert sum(b.words.nbytes for b in state.values()) == 2 << 20
    for n, (way, prepare) in enumerate(bench_pagecache.WAYS.items()):
        directory = tmp_path / f"ckpt-{n}"
        directory.mkdir()
        write_checkpoint(state, directory)
        (path,) = directory.glob("*.safetensors")
        written = path.read_bytes()
        prepare(path)
        assert path.read_bytes() == written, way
        assert sorted(p.name for p in directory.iterdir()) == [path.name], way
    (tmp_path / "run").mkdir()
    result = bench_pagecache.run(2, 1, tmp_path / "run")
    assert list(result["populate_ms"]) == list(bench_pagecache.WAYS)
    assert all(ms > 0 for ms in result["populate_ms"].values())
    assert list(result["drop_populate_ms"]) == list(bench_pagecache.WAYS)
    assert all(ms > 0 for ms in result["drop_populate_ms"].values())
    assert list((tmp_path / "run").iterdir()) == []


def test_bench_apply_rates(capsys):
    """tools/bench_apply.py --rates: a log per rate, each near its rate, every receiver's apply
    checked bit for bit by the tool (it asserts the words it applied) and reported."""
    import bench_apply

    assert bench_apply.main(["--gib", "0.01", "--reps", "1", "--receivers", "numpy", "--verify", "sample",
                             "--rates", "0.001,0.05"]) == 0
    out = capsys.readouterr().out
    changed = [float(line.split(": ")[1].split("%")[0]) for line in out.splitlines() if line.startswith("log ")]
    assert len(changed) == 2 and 0.05 < changed[0] < 0.2 and 4 < changed[1] < 6, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["numpy"]]
    assert [r[1] for r in rows] == ["0.1%", "5%"] and all(float(r[3]) > 0 for r in rows), out


def test_bench_apply_checkpoint_written_in_pieces(tmp_path, capsys):
    """tools/bench_apply.py --ckpt-writes: the checkpoint written again in pieces holds the same
    bytes, and the checkpoint receiver's applies on it are checked by the tool and reported."""
    import bench_apply
    import bench_pagecache

    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    bench_pagecache.rewrite_in_pieces(path, 3000)
    assert path.read_bytes() == data
    assert bench_apply.main(["--gib", "0.01", "--reps", "1", "--receivers", "ckpt", "--verify", "sample",
                             "--rates", "0.01", "--ckpt-writes", "0.25"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["ckpt"]]
    assert [r[1] for r in rows] == ["1%"] and float(rows[0][3]) > 0, out


def test_bench_encode_synced_appends_on_both_layouts(capsys):
    """tools/bench_encode.py --sync --layout: appends timed after a sync on the transformer
    layout and the Llama-shaped one, each near its rate and with its CPU per change."""
    import bench_encode

    for layout in ("transformer", "rows"):
        assert bench_encode.main(["--mib", "8", "--rates", "0.01", "--repeats", "2", "--sync", "--no-create",
                                  "--layout", layout, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        (append,) = report["appends"]
        assert 0.005 * report["elements"] < append["changed"] < 0.02 * report["elements"], append
        assert append["op_s"] > 0 and append["cpu_ns_per_change"] > 0, append
    base, _, to_state = bench_encode.build(8, [0.01], 0, "transformer")
    state = to_state(base)
    assert sum(v.words.size for v in state.values()) == base.size
    assert any(v.shape[-1] * 2 % 4096 for v in state.values() if len(v.shape) == 2)  # rows across pages


def test_bench_encode_reopens_the_writer_for_each_append(capsys, monkeypatch):
    """tools/bench_encode.py --reopen: each timed append by a writer opened for it (its
    baseline from the cache), closed after; the changes are the rate's."""
    import bench_encode
    from dcr_log import LogWriter

    opened = []
    real_open = LogWriter.open

    def open_(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(LogWriter, "open", open_)
    assert bench_encode.main(["--mib", "8", "--rates", "0.01", "--repeats", "3", "--reopen", "--no-create",
                              "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (append,) = report["appends"]
    assert 0.005 * report["elements"] < append["changed"] < 0.02 * report["elements"], append
    assert len(opened) == 4  # three timed appends, and one more back to the base


def test_bench_tensors_times_each_fixed_cost_a_tensor(capsys):
    """tools/bench_tensors.py: the commit parse, an append, a replay and a receiver's apply of
    a state of many tiny tensors, each per tensor (the replay and the receiver end bit-exact:
    the tool checks them)."""
    import bench_tensors

    assert bench_tensors.main(["--tensors", "40", "--elements", "64", "--repeats", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["tensors"], report["elements"]) == (40, 64)
    assert set(report["ops"]) == {"commit parse", "append", "replay", "rx numpy"}
    for op in report["ops"].values():
        assert op["us_per_tensor"] > 0 and op["copyto_seconds"] > 0
    assert report["commit_bytes"] > 40 * 60  # a row a tensor


def test_bench_tensors_refuses_a_receiver_that_ends_at_other_bits(monkeypatch, capsys):
    """The tool times only a correct apply: a receiver whose apply writes nothing fails it."""
    import bench_tensors
    from dcr_log.receiver import Receiver

    monkeypatch.setattr(Receiver, "apply", lambda self, log, to=None, **kw: [to])
    with pytest.raises(AssertionError, match="receiver"):
        bench_tensors.main(["--tensors", "20", "--elements", "64", "--repeats", "1", "--json"])
