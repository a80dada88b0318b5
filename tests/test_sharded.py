"""Sharded writers (dcr_log.shard): ranks of a gloo group log a transformer-shaped state in
canonical coordinates, and the log replays bit-exactly to the dense state of every step.

The ranks run as subprocesses of tests/sharded_job.py (the model, its schedule and every rank's
layout live there); each writes result-<rank>.json. The dense reference is computed here from
the same schedule, independently of any sharding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import sharded_job as job
from dcr_log import DeltaLog, LogWriter, TensorBits, UsageError
from dcr_log.coords import numel
from dcr_log.write.pieces import Shard
from dcr_log.write.sharded import ShardedWriter
from helpers import assert_file_holds, assert_same_bits, free_port, run_cli

JOB = Path(__file__).with_name("sharded_job.py")
PG_TIMEOUT = 15      # seconds: the process group's timeout bounds a wait on a dead rank
RUN_TIMEOUT = 120    # seconds for one launch of all ranks


# -- launching ranks ------------------------------------------------------------------------


@dataclass
class Ranks:
    """The outcome of one launch: every rank's exit code, result (None if it wrote none) and
    output."""

    returncodes: list
    results: list
    outputs: list
    out: Path  # the launch's output folder

    def describe(self) -> str:
        parts = []
        for r, (rc, res, out) in enumerate(zip(self.returncodes, self.results, self.outputs)):
            res = {k: v for k, v in (res or {}).items() if k != "listing"}
            parts.append(f"--- rank {r}: exit {rc}, result {json.dumps(res)[:3000]}\n{out[-3000:]}")
        return "\n".join(parts)

    def assert_all_ok(self) -> None:
        assert all(r is not None and r["ok"] for r in self.results), self.describe()


def launch(tmp: Path, world: int, cfg: dict, timeout: float = RUN_TIMEOUT,
           kill_when_done: int | None = None) -> Ranks:
    """Run ``world`` ranks of sharded_job.py with ``cfg`` and wait for all of them. Ranks still
    running after ``timeout`` are killed and fail the test; with ``kill_when_done``, the other
    ranks are killed (expectedly) once that rank has written its result."""
    out = tmp / f"run-{time.monotonic_ns()}"
    out.mkdir()
    cfg = {"timeout": PG_TIMEOUT, **cfg, "world": world, "port": free_port(), "out": str(out)}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 cores shared by up to 4 ranks
    procs, files, hung = [], [], []
    try:
        for rank in range(world):
            f = open(out / f"rank-{rank}.out", "w+")
            files.append(f)
            procs.append(subprocess.Popen([sys.executable, str(JOB), json.dumps(cfg), str(rank)],
                                          stdout=f, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if kill_when_done is not None and (out / f"result-{kill_when_done}.json").exists():
                procs[kill_when_done].wait(timeout=30)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    results = []
    for rank in range(world):
        path = out / f"result-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    ranks = Ranks([p.returncode for p in procs], results, outputs, out)
    assert not hung, f"ranks {hung} still running after {timeout} s (killed)\n{ranks.describe()}"
    return ranks


# -- checks on a log ------------------------------------------------------------------------


def true_changes(prev: dict[str, TensorBits], cur: dict[str, TensorBits]) -> int:
    """Elements a version must record: changed words of kept tensors, every element of new,
    reshaped or retyped ones."""
    n = 0
    for name, b in cur.items():
        p = prev.get(name)
        if p is not None and (p.dtype, p.shape) == (b.dtype, b.shape):
            n += int(np.count_nonzero(p.words != b.words))
        else:
            n += b.words.size
    return n


def record_coverage(log: DeltaLog, v: int) -> dict[str, np.ndarray]:
    """Per tensor, how many records of version ``v`` cover each element."""
    shapes = {t.name: t.shape for t in log.commit(v).tensors}
    hits = {n: np.zeros(numel(s), dtype=np.int64) for n, s in shapes.items()}
    for rec in log.records(v):
        shape = shapes[rec.tensor]
        index = np.arange(numel(shape)).reshape(shape)
        box = tuple(slice(o, o + s) for o, s in zip(rec.box.offset, rec.box.shape))
        hits[rec.tensor][index[box].reshape(-1)] += 1  # distinct indices within one box
    return hits


def check_log(path: Path, steps: range, reference: dict[int, int] | None = None) -> DeltaLog:
    """Every version of the log equals the dense state of its step, bit for bit; each element
    is written by one record at most (replicas once); the commit's counts are the true ones."""
    log = DeltaLog.open(path)
    assert log.versions() == list(steps)
    for v in steps:
        dense = job.dense_state(v)
        assert_same_bits(log.materialize(v), dense)
        commit = log.commit(v)
        hits = record_coverage(log, v)
        for name, h in hits.items():
            assert h.max(initial=0) <= 1, f"version {v}: {name} has elements written by {h.max()} records"
            if v == 0:
                assert h.min(initial=1) == 1, f"version 0: {name} has elements no record wrote"
        expected = true_changes(job.dense_state(v - 1) if v else {}, dense)
        assert commit.stats.changed_elements == expected, f"version {v}: changed elements"
        assert sum(r.n_changed for r in log.records(v)) == expected
        assert commit.stats.records == sum(1 for _ in log.records(v))
        if reference is not None:
            assert commit.state_digest == reference[v], f"version {v}: state digest differs from the dense log's"
    log.verify(deep=True)
    return log


def check_cli_replay(tmp: Path, path: Path, version: int) -> None:
    out = tmp / f"replay-{version}.safetensors"
    rc, _, err = run_cli("replay", path, "--version", version, "--out", out)
    assert rc == 0, err
    assert_file_holds(out, job.dense_state(version))


@pytest.fixture(scope="module")
def dense_digests(tmp_path_factory) -> dict[int, int]:
    """State digests of the schedule logged densely by LogWriter (whole tensors, one process):
    a sharded log's commits must carry the very same."""
    path = tmp_path_factory.mktemp("dense") / "log"
    writer = LogWriter.create(path, job.dense_state(0), cache_dir=False)
    for step in range(1, job.STEPS):
        writer.append(job.dense_state(step), allow_layout_change=job.relaid(step))
    log = DeltaLog.open(path)
    return {v: log.commit(v).state_digest for v in log.versions()}


def run_in_process(path: Path, steps: range, model: job.RankModel | None = None) -> ShardedWriter:
    """The schedule on one rank in this process (group=None: no torch.distributed)."""
    model = model or job.RankModel(1, 1, 0)
    writer = None
    for step in steps:
        model.load(step)
        shards, shapes = model.shards(step)
        if writer is None:
            writer = ShardedWriter.create(path, shards, shapes) if step == 0 else ShardedWriter.open(path)
            if step == 0:
                continue
        writer.append(shards, shapes, allow_layout_change=job.relaid(step))
    return writer


# -- 1. the transformer over 1, 2 and 4 ranks -----------------------------------------------


def test_schedule_covers_every_case():
    """The schedule itself: structural changes happen, FSDP boundaries fall mid-row, the vocab
    leaves padding, tp 4 replicates kv heads (guards against a test that silently tests less)."""
    names = [set(job.schema(s)) for s in range(job.STEPS)]
    assert job.EXTRA in names[3] and job.EXTRA not in names[2] and job.EXTRA not in names[6]
    assert job.schema(3)[job.EXTRA][1] != job.schema(4)[job.EXTRA][1]
    assert job.schema(4)[job.PROJ][1] != job.schema(5)[job.PROJ][1]
    for world in (2, 4):
        spec = job.schema(0)
        bounds = job.flat_bounds(world, sum(numel(spec[n][1]) for n in job.FLAT))
        start = sum(numel(spec[n][1]) for n in job.FLAT[:5])  # PROJ's first flat index
        size, row = numel(spec[job.PROJ][1]), spec[job.PROJ][1][-1]
        assert any(0 < b - start < size and (b - start) % row for b in bounds), "no mid-row boundary in PROJ"
        for tp in {2, world}:
            models = [job.RankModel(world, tp, r) for r in range(world)]
            assert any(m.vocab_rows > m.vocab[1] - m.vocab[0] for m in models), "no padded vocab rows"
    assert job.RankModel(4, 4, 0).kv == job.RankModel(4, 4, 1).kv  # replicated kv head
    assert [s for s in range(job.STEPS) if job.relaid(s)] == [3, 4, 5, 6]  # appended with the flag


def test_in_process_schedule(tmp_path, dense_digests):
    """One rank, no torch.distributed: every shard kind through the same API."""
    path = tmp_path / "log"
    run_in_process(path, range(job.STEPS))
    check_log(path, range(job.STEPS), dense_digests)


@pytest.mark.parametrize("world, tp", [(1, 1), (2, 2), (4, 2), (4, 4)],
                         ids=["1rank", "2rank-tp2", "4rank-tp2xdp2", "4rank-tp4"])
def test_sharded_training_replays_bit_exact(tmp_path, dense_digests, world, tp):
    """Ranks log every step; each version equals the dense state (and the dense log's state
    digest), replicas are written once, the CLI replays the last version byte for byte."""
    path = tmp_path / "log"
    ranks = launch(tmp_path, world, {"log": str(path), "tp": tp, "steps": [0, job.STEPS], "timeout": 30})
    ranks.assert_all_ok()
    # Every rank got the same commit record of every version.
    digests = [[c["state_digest"] for c in r["commits"]] for r in ranks.results]
    assert all(d == digests[0] for d in digests), ranks.describe()
    assert digests[0] == [f"{dense_digests[v]:016x}" for v in range(job.STEPS)]
    log = check_log(path, range(job.STEPS), dense_digests)
    # The converter's residual is logged as overwrite records, everything else kept as xor.
    q0 = job.L0 + "self_attn.q_proj.weight"
    kinds = {(r.tensor == q0, r.kind) for v in range(1, job.STEPS) for r in log.records(v)}
    assert {(True, "overwrite"), (False, "xor")} <= kinds <= {(True, "overwrite"), (False, "xor"), (False, "tensor")}
    if world > 1:
        # Flat shards split PROJ mid-row: some record box is a partial innermost row.
        boxes = [r.box.shape for r in log.records(0) if r.tensor == job.PROJ]
        assert len(boxes) > 1 and any(s[-1] < 7 for s in boxes), boxes
    check_cli_replay(tmp_path, path, job.STEPS - 1)


# -- 2. failure atomicity -------------------------------------------------------------------

# How the append of version FAIL_STEP fails -> the rank that fails.
FAILURES = {
    "raise-tensor": 1,      # a meta-device tensor: to_bits raises while the rank encodes
    "raise-converter": 0,   # its converter raises (the coordinator's)
    "raise-remap": 1,       # mapping its baseline cache for writing fails, before it encodes
    "kill-encoding": 1,     # SIGKILL while reading its words, after some segments were written
    "kill-converter": 0,    # the coordinator, SIGKILLed inside its converter
    "hang-encoding": 1,     # stuck while reading its words; the test kills it afterwards
}
HANG_TIMEOUT = 5  # the process group's timeout in the hang scenario
FAIL_STEP = 2


@pytest.mark.parametrize("how", list(FAILURES))
def test_failed_append_commits_nothing_and_a_new_group_resumes(tmp_path, how):
    """Versions 0 and 1 commit; the append of version 2 fails on one rank. Nothing is
    committed, the log verifies, nobody hangs, a fresh group resumes; the survivor gets
    AppendAborted naming the failing rank, a rank that raised gets its own exception."""
    path = tmp_path / "log"
    bad = FAILURES[how]
    good = 1 - bad
    killed = not how.startswith("raise")
    hang = how.startswith("hang")
    timeout = HANG_TIMEOUT if hang else PG_TIMEOUT
    cfg = {"log": str(path), "tp": 2, "steps": [0, FAIL_STEP + 1], "segment_bytes": 1, "timeout": timeout,
           "fail": {"step": FAIL_STEP, "rank": bad, "how": how}}
    ranks = launch(tmp_path, 2, cfg, kill_when_done=good if hang else None)
    survivor, loser = ranks.results[good], ranks.results[bad]
    assert survivor is not None and not survivor.get("unexpected"), ranks.describe()
    failed = survivor.get("failed_append")
    assert failed and not failed.get("committed"), ranks.describe()
    assert failed["seconds"] < timeout + 10, ranks.describe()  # bounded by the group's timeout
    if hang:
        assert failed["seconds"] >= timeout - 1, ranks.describe()  # it did wait for the stuck rank
    if killed:
        assert loser is None and ranks.returncodes[bad] == -9, ranks.describe()
    else:
        assert loser is not None and loser.get("failed_append"), ranks.describe()
        assert not loser["failed_append"].get("committed"), ranks.describe()

    # Nothing committed; the log verifies; a raise leaves the store as it was (segments
    # deleted), a kill leaves at most orphan segments of the failed version.
    log = DeltaLog.open(path)
    assert log.versions() == list(range(FAIL_STEP))
    log.verify(deep=True)
    before = json.loads((ranks.out / "listing-before.json").read_text())
    after = job.store_listing(path)
    if not killed:
        assert after == before
    else:
        new = {p for p, _ in after} - {p for p, _ in before}
        assert all(p.startswith(f"segments/{FAIL_STEP}/") for p in new), new
        if how.endswith("-encoding"):
            assert new, "the survivor's segments of the failed version should be left as orphans"

    # A fresh group (new processes) opens the log and appends the next versions.
    resume = launch(tmp_path, 2, {"log": str(path), "tp": 2, "steps": [FAIL_STEP, FAIL_STEP + 2]})
    resume.assert_all_ok()
    check_log(path, range(FAIL_STEP + 2))

    # The error contract, checked last so that the checks above run in every scenario.
    assert failed["error_type"] == "AppendAborted", ranks.describe()
    if not killed:
        assert f"rank {bad}" in failed["message"], ranks.describe()
        own = loser["failed_append"]
        expected = {"raise-tensor": "NotImplementedError", "raise-converter": "ValueError",
                    "raise-remap": "OSError"}[how]
        assert own["error_type"] == expected, ranks.describe()  # its own exception, re-raised


# -- 3. layout errors -----------------------------------------------------------------------


def test_layout_errors_on_every_rank_before_any_write(tmp_path):
    """A gap, an overlap, ranks disagreeing on a shape or a dtype: every rank raises the same
    UsageError and the store gains nothing; then the same group appends a good version."""
    path = tmp_path / "log"
    run_in_process(path, range(1))  # version 0 from one rank, resumed by two
    before = job.store_listing(path)
    cases = ["gap", "overlap", "shape", "dtype"]
    ranks = launch(tmp_path, 2, {"log": str(path), "tp": 2, "steps": [1, 2], "layout_errors": cases})
    ranks.assert_all_ok()
    expect = {"gap": "k_proj", "overlap": "overlap", "shape": "disagree", "dtype": "dtype"}
    for case in cases:
        got = [r["attempts"][case] for r in ranks.results]
        assert all(not a["ok"] and a["error_type"] == "UsageError" for a in got), (case, ranks.describe())
        assert got[0]["message"] == got[1]["message"], case  # the same verdict everywhere
        assert expect[case] in got[0]["message"], (case, got[0]["message"])
    assert ranks.results[0]["listing"] == before
    check_log(path, range(2))


def test_table_changes_refused_on_every_rank_unless_allowed(tmp_path):
    """A tensor added, removed, renamed, reshaped or retyped alike on both ranks (a valid
    layout): every rank raises the same UsageError before anything is written, also when only
    one rank passes allow_layout_change=True; with the flag on every rank each change commits
    and replays bit-exactly."""
    path = tmp_path / "log"
    run_in_process(path, range(2))  # versions 0 and 1 from one rank, resumed by two
    before = job.store_listing(path, digests=True)
    cases = job.TABLE_CHANGES
    ranks = launch(tmp_path, 2, {"log": str(path), "tp": 2, "steps": [1, 2], "table_changes": cases})
    ranks.assert_all_ok()
    expect = {"added": f"added {job.NEW!r} (BF16 [4, {job.HIDDEN}])", "removed": f"removed {job.ROUTER!r}",
              "renamed": f"removed {job.ROUTER!r}",
              "reshaped": f"reshaped {job.ROUTER!r} [{job.EXPERTS}, {job.HIDDEN}] -> "
                          f"[{job.EXPERTS * 2}, {job.HIDDEN // 2}]",
              "retyped": f"retyped {job.SCALE!r} F32 -> I32",
              "added, flag on rank 0 only": f"added {job.NEW!r}"}
    for case, text in expect.items():
        got = [r["attempts"][case] for r in ranks.results]
        assert all(not a["ok"] and a["error_type"] == "UsageError" for a in got), (case, ranks.describe())
        assert got[0]["message"] == got[1]["message"], case  # the same verdict everywhere
        message = got[0]["message"]
        assert message.startswith("version 2 would change the tensor table: "), message
        assert text in message and "allow_layout_change=True" in message, (case, message)
    assert f"added {job.RENAMED!r}" in ranks.results[0]["attempts"]["renamed"]["message"]
    assert "not passed on rank 1" in ranks.results[0]["attempts"]["added, flag on rank 0 only"]["message"]
    assert ranks.results[0]["listing"] == before, "a refused append wrote to the store"

    # Accepted with the flag: version 2 + 2i is case i, 3 + 2i the schedule's step 1 again.
    digests = [[c["state_digest"] for c in r["commits"]] for r in ranks.results]
    assert digests[0] == digests[1], ranks.describe()
    log = DeltaLog.open(path)
    assert log.versions() == list(range(2 + 2 * len(cases)))
    for i, case in enumerate(cases):
        expected = job.relayout_dense(case, job.dense_state(1))
        assert_same_bits(log.materialize(2 + 2 * i), expected)
        assert_same_bits(log.materialize(3 + 2 * i), job.dense_state(1))
    log.verify(deep=True)


# -- 4. the Shard API in-process ------------------------------------------------------------


def test_in_process_shards_and_validation(tmp_path):
    """group=None: views, a fused buffer, flat shards, a converter, 0-d and empty tensors, and
    every validation error raised before anything is written."""
    import torch

    rng = np.random.default_rng(7)
    words = lambda *shape: torch.from_numpy(rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.int16))
    fused = words(10, 6).view(torch.bfloat16)      # "a" (two boxes: rows 0..1, 2..3), then "b"
    wide = words(8, 12).view(torch.bfloat16)       # "c" is its column slice [:, 2:9]
    flat = words(30).view(torch.bfloat16)          # "d" [2, 3, 5] as two flat shards
    perm = torch.tensor([3, 1, 0, 2])

    def shards():
        return {
            "a": [Shard(fused[:2]), Shard(fused[2:4], (2, 0))],
            "b": [Shard(fused[4:])],
            "c": [Shard(wide[:, 2:9])],
            "d": [Shard.flat(flat[:13], 0), Shard.flat(flat[13:], 13)],
            "e": [Shard.converted(lambda: fused[:4][perm])],
            "s": [Shard(torch.tensor(1.5))],
            "z": [Shard(torch.empty(0, 3, dtype=torch.bfloat16))],
        }

    def dense():
        bits = lambda t: TensorBits("BF16", tuple(t.shape),
                                    t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).copy())
        return {"a": bits(fused[:4]), "b": bits(fused[4:]), "c": bits(wide[:, 2:9]),
                "d": bits(flat.reshape(2, 3, 5)), "e": bits(fused[:4][perm]),
                "s": TensorBits("F32", (), np.array([1.5], np.float32).view(np.uint32)),
                "z": TensorBits("BF16", (0, 3), np.empty(0, np.uint16))}

    path = tmp_path / "log"
    shapes = {"a": (4, 6), "b": (6, 6), "c": (8, 7), "d": (2, 3, 5), "e": (4, 6), "s": (), "z": (0, 3)}
    writer = ShardedWriter.create(path, shards(), shapes)
    expected = [dense()]
    for step in range(1, 4):
        # Change the local buffers in place (a trainer's step): the writer kept no views of them.
        for t in (fused, wide, flat):
            v = t.view(torch.int16).reshape(-1)
            where = np.union1d(rng.choice(v.numel(), 3, replace=False), [0])  # word 0 feeds "e"
            v[torch.from_numpy(where)] ^= step
        writer.append(shards())
        expected.append(dense())
    log = DeltaLog.open(path)
    for v, state in enumerate(expected):
        assert_same_bits(log.materialize(v), state)
    assert {r.kind for r in log.records(3) if r.tensor == "e"} <= {"overwrite"}
    assert any(r.tensor == "e" for r in log.records(3))

    before = job.store_listing(path)
    ok = shards()
    bad_cases = {
        "gap": ({**ok, "a": ok["a"][:1]}, None),
        "overlap": ({**ok, "b": [Shard(fused[4:8]), Shard(fused[5:], (1, 0))]}, None),
        "twice": ({**ok, "b": ok["b"] * 2}, None),
        "outside": ({**ok, "c": [Shard(wide[:, 2:10])]}, None),
        "new, no shape": ({**ok, "n": [Shard(fused[:1])]}, None),
        "flat, no shape": ({**ok, "n": [Shard.flat(flat[:4], 0)]}, None),
        "flat, past the end": ({**ok, "d": [Shard.flat(flat, 1)]}, None),
        "dtypes disagree": ({**ok, "a": [ok["a"][0], Shard(torch.zeros(2, 6), (2, 0))]}, None),
        "not a shard": ({**ok, "b": [fused[4:]]}, None),
        "converter returns no tensor": ({**ok, "e": [Shard.converted(lambda: None)]}, None),
        "reshape without shapes": ({**ok, "b": [Shard(fused[4:].reshape(3, 12))]}, None),
    }
    for case, (bad, bad_shapes) in bad_cases.items():
        with pytest.raises(UsageError):
            writer.append(bad, bad_shapes)
        assert job.store_listing(path) == before, f"{case}: the store changed"
    with pytest.raises(UsageError):
        Shard.flat(fused, 0)
    with pytest.raises(UsageError):
        Shard(fused, (0, 0, 0))
    # The writer is still at version 3 and appends version 4.
    assert writer.version == 3
    writer.append(shards())
    expected.append(dense())
    check_in = DeltaLog.open(path)
    assert_same_bits(check_in.materialize(4), expected[4])
    check_in.verify(deep=True)
