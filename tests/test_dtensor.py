"""DTensor trainers (dcr_log.dtensor): FSDP2, tensor parallelism and 2-D meshes logged with
ShardedWriter straight from the model's DTensors replay bit-exactly against ``full_tensor()``;
a DTensor passed where it cannot go is refused with a dcr-log UsageError on every rank (no log
half-created); diverged replicas refuse the version. The offsets are checked against torch's own
(private) function.

The ranks run as subprocesses of tests/dtensor_job.py on gloo (CPU), spawned with a timeout.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

import dtensor_job as job
from dcr_log import DeltaLog, ReplicaMismatch, UsageError
from helpers import free_port, run_ranks

JOB = Path(__file__).with_name("dtensor_job.py")
PG_TIMEOUT = 20     # seconds: the process group's timeout
RUN_TIMEOUT = 90    # seconds for one launch of all ranks
WATCHDOG = 80       # seconds: a rank still running prints its stacks and exits (6 s is usual)


def launch(tmp: Path, world: int, case: str) -> tuple[list[dict], Path, str]:
    """Run ``world`` ranks of the job's ``case``; every rank must exit 0 with a result."""
    out = tmp / f"{case}-{time.monotonic_ns()}"
    out.mkdir()
    cfg = {"case": case, "world": world, "port": free_port(), "out": str(out), "timeout": PG_TIMEOUT,
           "watchdog": WATCHDOG}
    ranks = run_ranks([[sys.executable, str(JOB), json.dumps(cfg), str(r)] for r in range(world)], out, RUN_TIMEOUT)
    said = "\n".join(f"--- rank {r}: exit {rc}\n{o[-3000:]}" for r, (rc, o) in enumerate(ranks))
    results = []
    for r in range(world):
        f = out / f"result-{r}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    assert all(rc == 0 for rc, _ in ranks), said
    assert all(res is not None and res["ok"] for res in results), said + json.dumps(results)[:4000]
    return results, out, said


def check_replays(out: Path, name: str) -> None:
    """Every version of the log equals rank 0's full_tensor() of that step, bit for bit."""
    log = DeltaLog.open(out / name)
    assert log.versions() == list(range(job.STEPS + 1))
    changed = 0
    for v in log.versions():
        got = log.materialize(v)
        with np.load(out / f"{name}-{v}.npz") as ref:
            assert sorted(got) == sorted(ref.files)
            for t in ref.files:
                exp = ref[t]
                assert got[t].shape == exp.shape, (v, t)
                assert got[t].words.tobytes() == exp.tobytes(), f"version {v}: {t} differs"
        if v:
            changed += log.commit(v).stats.changed_elements
    assert changed > 0  # training changed something
    log.verify(deep=True)


def test_fsdp2_uneven_rows_and_empty_shards_replay_bit_exact(tmp_path):
    results, out, _ = launch(tmp_path, 2, "fsdp2")
    held = [r["held"]["fsdp2"] for r in results]
    up = "layers.0.up_proj.weight"
    assert held[0][up] == [[0, 0], [257, 16]] and held[1][up] == [[129, 0], [257, 16]]
    assert held[1]["score.bias"][0] == [1]  # empty local shard, at the end of its dimension
    assert "scratch" not in held[0]         # a non-persistent buffer is not logged
    check_replays(out, "fsdp2")


def test_tensor_parallel_colwise_rowwise_replays_bit_exact(tmp_path):
    results, out, _ = launch(tmp_path, 2, "tp")
    held = [r["held"]["tp"] for r in results]
    assert held[1]["layers.0.up_proj.weight"][0] == [129, 0]    # Colwise: Shard(0)
    assert held[1]["layers.0.down_proj.weight"][0] == [0, 129]  # Rowwise: Shard(1)
    assert held[1]["embed_tokens.weight"][0] == [0, 0]          # replicated: checked replicas
    check_replays(out, "tp")


def test_hsdp_and_fsdp_with_tp_on_a_2d_mesh_replay_bit_exact(tmp_path):
    results, out, _ = launch(tmp_path, 4, "mesh2d")
    assert "_StridedShard" in results[0]["fsdp_tp_placements"]["layers.0.up_proj.weight"]
    # FSDP2 + TP: rank (dp, tp) holds the dp-th part (65/64 rows) of the tp-th half (129
    # rows) of the 258 rows: one box.
    offsets = [r["held"]["fsdp_tp"]["layers.0.up_proj.weight"][0][0] for r in results]
    assert offsets == [0, 129, 65, 129 + 65]
    # HSDP: ranks 0 and 2 are replicas.
    assert results[0]["held"]["hsdp"] == results[2]["held"]["hsdp"]
    check_replays(out, "hsdp")
    check_replays(out, "fsdp_tp")


def test_a_dtensor_passed_directly_is_refused_on_every_rank(tmp_path):
    results, out, _ = launch(tmp_path, 2, "refusals")
    for res in results:
        a = res["attempts"]
        for what in ("Shard(dt)", "dict value", "list value", "converter", "LogWriter", "to_state", "receiver"):
            assert not a[what]["ok"] and a[what]["error_type"] == "UsageError", (what, a[what])
            assert "DTensor" in a[what]["message"], (what, a[what])
        for what in ("Shard(dt)", "dict value", "list value", "converter"):
            assert "Shard.from_dtensor" in a[what]["message"], (what, a[what])
        assert a["strided"]["error_type"] == "UsageError" and "not one box" in a["strided"]["message"]
        assert "overlap" not in a["strided"]["message"]
        assert a["partial"]["error_type"] == "UsageError" and "Partial" in a["partial"]["message"]
    # Nothing half-created: no dcr.json for the refused creates (the converter is called by
    # append, after the identity: that log is incomplete, which the next create finishes).
    made = [p for p in results[0]["listing"] if p.endswith("dcr.json")]
    assert made == ["converter/dcr.json"], results[0]["listing"]
    assert issubclass(ReplicaMismatch, UsageError)


def test_diverged_replicas_refuse_the_version_naming_the_tensor(tmp_path):
    results, out, _ = launch(tmp_path, 2, "replicas")
    for res in results:
        a = res["attempts"]
        for what in ("plain", "replicate"):
            assert not a[what]["ok"] and a[what]["error_type"] == "ReplicaMismatch", (what, a[what])
            assert "'w'" in a[what]["message"] and "rank 0 vs rank 1" in a[what]["message"], a[what]
        assert res["versions_after_refusals"] == [0]
        assert a["opted out"]["ok"] and res["versions"] == [0, 1]
    log = DeltaLog.open(out / "replicas")
    assert log.materialize(1)["w"].words.view(np.float32).tolist() == [1.0] * 4  # rank 0's copy
    assert log.commit(1).stats.changed_elements == 0
    log.verify(deep=True)


def _placement_cases():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shapes = [(7,), (1,), (0, 3), (257, 16), (5, 9), (9, 2, 4)]
    meshes = [(2,), (3,), (4,), (2, 2), (2, 3), (3, 2, 2)]
    for shape, mesh in itertools.product(shapes, meshes):
        if len(shape) * len(mesh) > 6:
            continue  # enough: 3-D tensors on 1-D and 2-D meshes
        kinds = [Replicate()] + [Shard(d) for d in range(len(shape))] + [
            _StridedShard(d, split_factor=k) for d in range(len(shape)) for k in (2, 3)]
        for placements in itertools.product(kinds, repeat=len(mesh)):
            yield shape, mesh, placements


def test_offsets_match_torchs_own_function():
    """local_indices gives the local shape and first offset torch computes, for every
    coordinate of every mesh, uneven and strided shards included."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from dcr_log.dtensor import local_box, local_indices

    checked = boxes = 0
    for shape, mesh, placements in _placement_cases():
        for coord in itertools.product(*(range(n) for n in mesh)):
            want_shape, want_offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            idx = local_indices(shape, mesh, coord, placements)
            assert tuple(i.size for i in idx) == tuple(want_shape), (shape, mesh, placements, coord)
            first = tuple(int(i[0]) if i.size else shape[d] for d, i in enumerate(idx))
            assert first == tuple(want_offset), (shape, mesh, placements, coord)
            try:
                offset, local = local_box(shape, mesh, coord, placements)
            except UsageError:
                continue
            assert (offset, local) == (tuple(want_offset), tuple(want_shape))
            boxes += 1
            checked += 1
    assert checked > 1000 and boxes > 1000


def test_strided_indices_are_torchs():
    """The global indices of a _StridedShard are the ones torch's placement gives (not only
    the first)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from dcr_log.dtensor import local_indices

    for size, n, sf in itertools.product(range(0, 13), (2, 3), (2, 3)):
        p = _StridedShard(0, split_factor=sf)
        for r in range(n):
            _, offsets = p.local_shard_size_and_offset(size, n, r, offset_mode=1)  # ALL
            got = local_indices((size,), (n,), (r,), [p])[0].tolist()
            assert got == list(offsets), (size, n, sf, r)
