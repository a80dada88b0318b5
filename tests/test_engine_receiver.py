"""Engine receivers: a placement discovered through the engine's own loader, then every
version applied in place into fused, tensor-parallel, padded, stacked and transformed
parameters, bit for bit what the engine's loader gives a fresh engine from the dense version.

The engines are tests/helpers/engines.py (vLLM's loaders in small); the tensor-parallel ranks run as
subprocesses of tests/engine_job.py in a gloo group, the SIGKILLed durable receiver as
subprocesses of tests/engine_crash_job.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine_job as job
from dcr_log import DeltaLog, LineageError, LogWriter
from dcr_log.checkpoint import load_checkpoint
from dcr_log.engines.discovery import discover
from dcr_log.receiver import Receiver, write_checkpoint
from dcr_log.receiver.journal import Journal
from dcr_log.receiver.storage.placement import LayoutError, Placement, PlacementError
from dcr_log.state import to_bits
from helpers import free_port, run_ranks
from helpers.engines import EngineConfig, NumpyEngine, TestEngine, engine_params, fresh_engine, random_canonical

HERE = Path(__file__).parent
CFG = EngineConfig()


def words(t) -> bytes:
    return to_bits(t).words.tobytes()


def snapshot(params: dict) -> dict[str, bytes]:
    return {n: words(t) for n, t in params.items()}


def write_schedule(path: Path, cfg: EngineConfig, versions: int = job.VERSIONS) -> DeltaLog:
    w = LogWriter.create(path, job.canonical_at(cfg, 0))
    for v in range(1, versions):
        w.append(job.canonical_at(cfg, v), allow_layout_change=v in job.LAYOUT_CHANGES)
    return DeltaLog.open(path)


def rediscover_on(scratch: TestEngine):
    return lambda table: discover(scratch.load_weights, table, engine_params(scratch), restore=False)


def open_engine(tmp_path, log: DeltaLog, version: int = 0):
    """A tp-1 engine holding ``version`` of the schedule and a receiver opened on its
    parameters, with the placement discovered on a scratch engine (not yet bound)."""
    engine = fresh_engine(CFG, job.canonical_at(CFG, version))
    params = engine_params(engine)
    rx = Receiver.open(params, tmp_path / "j", loader=engine.load_weights,
                       placement=rediscover_on(TestEngine(CFG))(log.commit(version)))
    return engine, params, rx


@pytest.fixture(scope="module")
def schedule_log(tmp_path_factory):
    return write_schedule(tmp_path_factory.mktemp("schedule") / "log", CFG)


# -- tensor parallelism 1, 2, 4 (one engine instance per rank, gloo) -----------------------

@pytest.mark.parametrize("tp,tie_mode", [(1, "copy"), (2, "shared"), (4, "copy")])
def test_tensor_parallel_engines_follow_every_version(tmp_path, tp, tie_mode):
    cfg = EngineConfig(tie_mode=tie_mode)
    log = write_schedule(tmp_path / "log", cfg)
    conf = {"out": str(tmp_path), "log": str(tmp_path / "log"), "tp": tp, "port": free_port(),
            "tie_mode": tie_mode}
    ranks = run_ranks([[sys.executable, str(HERE / "engine_job.py"), json.dumps(conf), str(r)]
                       for r in range(tp)], tmp_path, timeout=240)
    assert all(rc == 0 for rc, _ in ranks), "\n".join(f"--- rank {r} (rc {rc})\n{out[-3000:]}"
                                                    for r, (rc, out) in enumerate(ranks))
    model_bytes = sum(to_bits(t).nbytes for t in job.canonical_at(cfg, 0).values())
    for r in range(tp):
        res = json.loads((tmp_path / f"result-{r}.json").read_text())
        assert res["ok"], res.get("trace")
        assert res["applied"] == list(range(1, log.latest_version() + 1))
        assert res["version"] == log.latest_version()
        assert res["mismatch"] == {}, res["mismatch"]
        assert res["unheld"] > 0  # rotary inv_freq and the extra tensor are not the engine's
        # The scaled layernorm is residual: rebuilt through the loader whenever it changed.
        assert "model.layers.0.post_attention_layernorm.weight" in res["rebuilt"]
        # Staging holds the delta, not the model (version 1 changes 2% of it).
        assert 0 < res["staged_bytes"][0] < model_bytes / 4


# -- one process --------------------------------------------------------------------------

def test_placement_of_a_vllm_like_engine(schedule_log):
    scratch = TestEngine(CFG, 1, 2)
    placement = discover(scratch.load_weights, schedule_log.commit(0), engine_params(scratch), restore=False)
    desc = placement.describe()
    assert desc["residual_params"] == ["model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    assert desc["unused_tensors"] == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    # q of rank 1 (heads 4..7) lands at the start of the fused qkv, k after it (GQA: 1 kv head).
    q = placement.pieces["model.layers.0.self_attn.q_proj.weight"]
    assert [(p.param, p.c0, p.p0, p.size) for p in q] == [
        ("model.layers.0.self_attn.qkv_proj.weight", 32 * 64, 0, 32 * 64)]
    k = placement.pieces["model.layers.0.self_attn.k_proj.weight"]
    assert [(p.c0, p.p0, p.size) for p in k] == [(8 * 64, 32 * 64, 8 * 64)]
    # o_proj is row-parallel: a column slice of every row, one piece of 64 runs.
    (o,) = placement.pieces["model.layers.0.self_attn.o_proj.weight"]
    assert (o.count, o.length, o.cstride, o.pstride, o.c0) == (64, 32, 64, 32, 32)
    # Stacked experts: expert 2's w3 (up) goes to the second half of w13[2].
    (up,) = placement.pieces["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    assert up.param.endswith("experts.w13_weight") and up.p0 == 2 * 32 * 64 + 16 * 64
    # Vocab-parallel: rank 1 holds rows 512..999 and not the padding.
    (emb,) = placement.pieces["model.embed_tokens.weight"]
    assert (emb.c0, emb.p0, emb.size) == (512 * 64, 0, 488 * 64)
    again = Placement.from_json(json.loads(json.dumps(placement.to_json())))
    assert again.to_bytes() == placement.to_bytes() and again.digest == placement.digest


def test_discovery_gives_the_parameters_back():
    engine = fresh_engine(CFG, random_canonical(CFG, 3))
    before = snapshot(engine_params(engine))
    discover(engine.load_weights, {n: (job_dtype(t), tuple(t.shape)) for n, t in random_canonical(CFG, 3).items()},
             engine_params(engine))
    assert snapshot(engine_params(engine)) == before


def job_dtype(t: torch.Tensor) -> str:
    return {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype]


def test_numpy_engine_follows_versions_with_layout_changes(tmp_path, schedule_log):
    log = schedule_log
    scratch = NumpyEngine(CFG)

    def rediscover(table):
        return discover(scratch.load_weights, table, scratch.params, dtypes=scratch.dtypes, restore=False)

    engine = NumpyEngine(CFG)
    engine.load_weights(job.canonical_at(CFG, 0).items())
    with Receiver.open(engine.params, tmp_path / "j", dtypes=engine.dtypes, placement=rediscover(log.commit(0)),
                       loader=engine.load_weights, rediscover=rediscover) as rx:
        rx.bind(log, 0)
        for v in range(1, log.latest_version() + 1):
            rx.apply(log, to=v, verify="full")
            ref = snapshot(engine_params(fresh_engine(CFG, job.canonical_at(CFG, v))))
            assert {n: a.tobytes() for n, a in engine.params.items()} == ref, v


def test_xxh3_log_into_an_engine(tmp_path):
    """A format-1 log (xxh3 digests) reaches an engine that holds whole tensors."""
    w = LogWriter.create(tmp_path / "log", job.canonical_at(CFG, 0), features=())
    w.append(job.canonical_at(CFG, 1))
    log = DeltaLog.open(tmp_path / "log")
    scratch = TestEngine(CFG)
    engine = fresh_engine(CFG, job.canonical_at(CFG, 0))
    with Receiver.open(engine_params(engine), tmp_path / "j", loader=engine.load_weights,
                       placement=rediscover_on(scratch)(log.commit(0))) as rx:
        rx.bind(log, 0)
        rx.apply(log, verify="full")
    assert snapshot(engine_params(engine)) == snapshot(engine_params(fresh_engine(CFG, job.canonical_at(CFG, 1))))


def _one_step_log(tmp_path, change) -> DeltaLog:
    state = job.canonical_at(CFG, 0)
    w = LogWriter.create(tmp_path / "log", state)
    w.append(change(dict(state)), allow_layout_change=True)
    return DeltaLog.open(tmp_path / "log")


@pytest.mark.parametrize("change,rediscover", [
    # reshaped so that the loader's shape check refuses it
    (lambda s: {**s, "model.layers.0.self_attn.q_proj.weight": s["model.layers.0.self_attn.q_proj.weight"][:32]}, True),
    # drops a tensor the engine holds
    (lambda s: {n: t for n, t in s.items() if n != "model.layers.1.input_layernorm.weight"}, True),
    # adds a tensor: without rediscover the receiver cannot know whether the engine needs it
    (lambda s: {**s, "model.new.weight": torch.ones(4, dtype=torch.bfloat16)}, False),
])
def test_layout_changes_the_engine_cannot_follow_are_refused_before_any_write(tmp_path, change, rediscover):
    log = _one_step_log(tmp_path, change)
    engine = fresh_engine(CFG, job.canonical_at(CFG, 0))
    params = engine_params(engine)
    scratch = TestEngine(CFG)
    placement = rediscover_on(scratch)(log.commit(0))
    before = snapshot(params)
    with Receiver.open(params, tmp_path / "j", placement=placement, loader=engine.load_weights,
                       rediscover=rediscover_on(scratch) if rediscover else None) as rx:
        rx.bind(log, 0)
        with pytest.raises(LayoutError):
            rx.apply(log, verify="none")
        assert rx.version == 0 and rx.inflight is None
    assert snapshot(params) == before


def test_placement_for_another_engine_or_table_is_refused(tmp_path, schedule_log):
    log = schedule_log
    other = TestEngine(CFG, 0, 2)
    placement = rediscover_on(other)(log.commit(0))
    placement.save(tmp_path / "p.json")
    engine = fresh_engine(CFG, job.canonical_at(CFG, 0))
    with pytest.raises(PlacementError, match="another engine layout"):
        Receiver.open(engine_params(engine), tmp_path / "j1", placement=tmp_path / "p.json",
                      loader=engine.load_weights)
    # A rank's slice alone: its digests cannot be checked without the rest of the group.
    half = fresh_engine(CFG, job.canonical_at(CFG, 0), 0, 2)
    with pytest.raises(PlacementError, match="held by no rank"):
        Receiver.open(engine_params(half), tmp_path / "j2", placement=placement, loader=half.load_weights)
    # The placement of version 0's table does not fit version 3's (the final norm is f32 there).
    mine = rediscover_on(TestEngine(CFG))(log.commit(0))
    with Receiver.open(engine_params(engine), tmp_path / "j3", placement=mine, loader=engine.load_weights) as rx:
        with pytest.raises(PlacementError, match="another tensor table"):
            rx.bind(log, 3)
        assert rx.version is None


def bumped(state: dict) -> dict:
    """Every element of every tensor one ulp up."""
    return {n: (t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) + 1).view(t.dtype)
            for n, t in state.items()}


@pytest.mark.parametrize("point", ["record", "residual", "before_commit"])
def test_memory_engine_rolls_back_on_error(tmp_path, point):
    state0 = job.canonical_at(CFG, 0)
    w = LogWriter.create(tmp_path / "log", state0)
    w.append(bumped(state0))
    log = DeltaLog.open(tmp_path / "log")
    _, params, rx = open_engine(tmp_path, log)
    before = snapshot(params)
    calls = []

    def fault(p, **info):
        if p == point:
            calls.append(p)
            if len(calls) == 3 or p != "record":
                raise RuntimeError(f"injected at {p}")

    with rx:
        rx.bind(log, 0)
        rx.fault = fault
        with pytest.raises(RuntimeError, match="injected"):
            rx.apply(log, verify="sample")
        assert calls and rx.version == 0 and rx.inflight is None
        assert snapshot(params) == before
        rx.fault = None
        report = []
        rx.apply(log, verify="full", on_version=report.append)
        assert sorted(report[0].rebuilt) == ["model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
    assert snapshot(params) == snapshot(engine_params(fresh_engine(CFG, bumped(state0))))


def test_engine_changed_behind_the_journal_is_refused(tmp_path, schedule_log):
    log = schedule_log
    _, params, rx = open_engine(tmp_path, log)
    with rx:
        rx.bind(log, 0)
        qkv = params["model.layers.1.self_attn.qkv_proj.weight"]
        with torch.no_grad():
            qkv.view(torch.int16)[3, 5] += 1
        before = snapshot(params)
        with pytest.raises(LineageError):
            rx.apply(log, to=1, verify="full")
        assert snapshot(params) == before and rx.version == 0


def test_staging_then_apply_only_writes(tmp_path, schedule_log):
    log = schedule_log
    _, params, rx = open_engine(tmp_path, log)
    with rx:
        rx.bind(log, 0)
        before = snapshot(params)
        staged = rx.stage(log, 1, verify="sample")
        assert snapshot(params) == before  # staging reads, never writes
        assert staged.version == 1 and staged.staged_bytes > 0
        reports = []
        assert rx.apply(on_version=reports.append) == [1]
        assert reports[0].written > 0
        with pytest.raises(Exception, match="nothing is staged"):
            rx.apply()
    assert snapshot(params) == snapshot(engine_params(fresh_engine(CFG, job.canonical_at(CFG, 1))))


def test_torch_dict_receiver_follows_a_reshape_in_place(tmp_path):
    """A dict of a model's own parameters: a reshaped or retyped tensor is changed in place,
    so the model sees it (no detached tensor left in the dict)."""
    model = torch.nn.Linear(4, 3)
    state0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = LogWriter.create(tmp_path / "log", state0)
    state1 = {"weight": torch.arange(10, dtype=torch.float64).reshape(5, 2), "bias": state0["bias"] + 1}
    w.append(state1, allow_layout_change=True)
    log = DeltaLog.open(tmp_path / "log")
    params = dict(model.named_parameters())
    with Receiver.open(params, tmp_path / "j", layout_changes="own") as rx:
        rx.bind(log, 0)
        rx.apply(log, verify="full")
    assert params["weight"] is model.weight and model.weight.shape == (5, 2)
    assert model.weight.dtype == torch.float64 and torch.equal(model.weight.detach(), state1["weight"])
    assert torch.equal(model.bias.detach().view(torch.int32), state1["bias"].view(torch.int32))


# -- durable: every rank's parameters in one checkpoint directory --------------------------

NO_RESIDUAL = EngineConfig(fp32_final_norm=False, scaled_param=False, tie_mode="copy")


def merged_engines(cfg: EngineConfig, tp: int, state: dict):
    """Every rank's fresh engine, their parameters under tp<r>. prefixes, and the merged
    placement (each rank's discovered on a scratch engine)."""
    engines = [fresh_engine(cfg, state, r, tp) for r in range(tp)]
    table = {n: (job_dtype(t), tuple(t.shape)) for n, t in state.items()}
    placement = Placement.merge({
        f"tp{r}.": discover((s := TestEngine(cfg, r, tp)).load_weights, table, engine_params(s), restore=False)
        for r in range(tp)})
    params = {f"tp{r}.{n}": t for r, e in enumerate(engines) for n, t in engine_params(e).items()}
    return engines, placement, params


_STEPS: dict = {}


def steps_state(cfg, v):
    """Version ``v`` of a run without layout changes: 3% of every tensor one ulp up per step
    (computed incrementally and cached)."""
    if (cfg, v) not in _STEPS:
        if v == 0:
            _STEPS[(cfg, 0)] = random_canonical(cfg, 0)
        else:
            prev = steps_state(cfg, v - 1)
            g = torch.Generator().manual_seed(v)
            out = {}
            for name in sorted(prev):
                t = prev[name]
                iv = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
                hit = torch.rand(t.shape, generator=g) < 0.03
                out[name] = torch.where(hit, iv + 1, iv).view(t.dtype)
            _STEPS[(cfg, v)] = out
    return _STEPS[(cfg, v)]


def test_sigkill_during_apply_into_a_tensor_parallel_checkpoint(tmp_path):
    """At least 50 SIGKILLs at hook points spread over whole applies (between the halves of
    a torn write, between redo images and writes, before the joint commit, ...) of a checkpoint
    directory holding 4 tensor-parallel ranks' fused parameters: after every kill the journal
    claims only what the directory holds, and every recovery ends bit-exact."""
    tp, versions = 4, 60
    w = LogWriter.create(tmp_path / "log", steps_state(NO_RESIDUAL, 0))
    for v in range(1, versions + 1):
        w.append(steps_state(NO_RESIDUAL, v))
    _, placement, params = merged_engines(NO_RESIDUAL, tp, steps_state(NO_RESIDUAL, 0))
    assert not placement.residual
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint({n: to_bits(t) for n, t in params.items()}, directory)
    placement.save(tmp_path / "placement.json")
    expected_cache: dict[int, dict[str, bytes]] = {}

    def expected(v: int) -> dict[str, bytes]:
        if v not in expected_cache:
            state = steps_state(NO_RESIDUAL, v)
            expected_cache[v] = {f"tp{r}.{n}": words(t) for r in range(tp)
                                 for n, t in engine_params(fresh_engine(NO_RESIDUAL, state, r, tp)).items()}
        return expected_cache[v]

    def held() -> dict[str, bytes]:
        return {n: b.words.tobytes() for n, b in load_checkpoint(directory).items()}

    rng = random.Random(7)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    kills = rounds = mid_apply = 0
    hooks_per_version = 45  # about 37 hook points per version
    while kills < 50:
        kill_at = rng.randint(1, hooks_per_version)
        proc = subprocess.run([sys.executable, str(HERE / "engine_crash_job.py"), str(tmp_path / "log"),
                               str(directory), str(tmp_path / "placement.json"), str(kill_at),
                               rng.choice(["none", "sample", "full"])],
                              env=env, capture_output=True, text=True, timeout=120)
        rounds += 1
        st = Journal.peek(directory / ".dcr")
        if proc.returncode == -9:
            kills += 1
            mid_apply += st.inflight is not None
        else:
            assert proc.returncode == 0, proc.stderr[-2000:]
            assert st.version == versions
            break
        if st.version is not None and st.inflight is None:
            assert held() == expected(st.version), f"journal claims {st.version} after a kill"
    assert kills >= 50 and mid_apply >= 10, (kills, mid_apply)
    proc = subprocess.run([sys.executable, str(HERE / "engine_crash_job.py"), str(tmp_path / "log"),
                           str(directory), str(tmp_path / "placement.json"), "0", "full"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Journal.peek(directory / ".dcr").version == versions
    assert held() == expected(versions)


def test_durable_engine_with_residual_parameters_recovers(tmp_path):
    """Residual parameters of a durable receiver: rebuilt by a scratch engine's loader from
    canonical copies kept in the journal directory, also after an interrupted apply."""
    tp = 2
    cfg = EngineConfig()
    w = LogWriter.create(tmp_path / "log", steps_state(cfg, 0))
    for v in (1, 2):
        w.append(steps_state(cfg, v))
    log = DeltaLog.open(tmp_path / "log")
    _, placement, params = merged_engines(cfg, tp, steps_state(cfg, 0))
    assert len(placement.residual) == 2 * tp
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint({n: to_bits(t) for n, t in params.items()}, directory)
    scratch = [TestEngine(cfg, r, tp) for r in range(tp)]
    scratch_params = {f"tp{r}.{n}": t for r, e in enumerate(scratch) for n, t in engine_params(e).items()}

    def loader(weights):
        weights = list(weights)
        for e in scratch:
            e.load_weights(weights)

    def fault(point, **info):
        if point == "residual":
            raise RuntimeError("killed after the residual rebuild")

    with Receiver.open(directory, placement=placement, loader=loader, loader_params=scratch_params) as rx:
        rx.bind(log, 0)
        assert (directory / ".dcr" / "shadow" / "model.safetensors").is_file()
        rx.apply(log, to=1, verify="full")
        rx.fault = fault
        with pytest.raises(RuntimeError):
            rx.apply(log, verify="sample")
        assert rx.inflight == 2
    with Receiver.open(directory, placement=placement, loader=loader, loader_params=scratch_params) as rx:
        report = rx.recover(log, verify="full")
        assert report.recovered and report.rebuilt
        assert rx.version == 2
    state = steps_state(cfg, 2)
    expected = {f"tp{r}.{n}": words(t) for r in range(tp)
                for n, t in engine_params(fresh_engine(cfg, state, r, tp)).items()}
    assert {n: b.words.tobytes() for n, b in load_checkpoint(directory).items()} == expected
    # Another placement is refused by the journal it was not bound with.
    other = Placement.from_json({**placement.to_json(), "residual": {}})
    with pytest.raises(Exception, match="another placement"):
        with Receiver.open(directory, placement=other, loader=loader, loader_params=scratch_params) as rx:
            rx.apply(log)


def test_apply_of_a_staged_version_keeps_its_level(tmp_path, schedule_log):
    _, _, rx = open_engine(tmp_path, schedule_log)
    with rx:
        rx.bind(schedule_log, 0)
        rx.stage(schedule_log, 1, verify="none")
        with pytest.raises(Exception, match="staged with verify='none'"):
            rx.apply(verify="full")
        with pytest.raises(Exception, match="staged"):
            rx.apply(to=2)
        assert rx.apply(verify="none") == [1]


def test_a_loader_of_another_engine_places_nothing_and_is_refused(schedule_log):
    one, other = NumpyEngine(CFG), NumpyEngine(CFG)
    with pytest.raises(PlacementError, match="placed no element"):
        discover(one.load_weights, schedule_log.commit(0), other.params, dtypes=other.dtypes)
