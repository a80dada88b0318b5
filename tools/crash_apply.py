#!/usr/bin/env python
"""SIGKILL ``dcr apply`` at random instants, run it again, and check every run ends bit-exact.

    python tools/crash_apply.py [--kills 1000] [--mb 4] [--versions 6] [--seed 0] [--dir DIR] [--catchup]
                                [--segment-bytes 2048] [--chunk-elements 4096]

A log of a small bf16 model is built (versions with 1-5% changes, many segments, a tensor
added, one dropped, one reshaped, an overwrite version; its files, feature files: a config
changed at every version, a file added, one dropped, a large tokenizer file rewritten). Each
round starts a receiver
(a bound single-file checkpoint, a bound sharded one, or an empty directory that
``dcr apply`` materializes), kills ``dcr apply`` 1-4 times at random instants, then lets it
finish. After every kill that leaves no version in flight, the checkpoint must hold the
journal's version bit for bit, its files included; at the end of every round it must hold the
latest version (its files, none the log dropped, no temporary file left), load with the
safetensors library, and ``dcr status --json`` must say so.

Prints counts: kills, kills that landed mid-apply (a version or a materialization in flight
afterwards), kills after which the journal's version was checked bit for bit, runs that
resumed an interrupted version or materialization, final runs that recovered one, failures.

With ``--catchup`` the log then gets a squash from version 0 to the one before the latest and
a snapshot there, and retention expires every version before it (``gc --keep-last 2``): the
receivers bound at version 0 catch up through the squash (which adds, drops and reshapes
tensors), one bound at version 1 through the snapshot (an in-place step of tensor records), and
empty directories are written out from the snapshot; the kills land inside those steps.

Most kill instants are drawn after the child takes the receiver lock (watched through
/proc/locks where there is one), uniformly over the work left, so that they land inside
``dcr apply`` rather than in the interpreter's start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcr_log import DeltaLog, TensorBits, state_equal
from dcr_log.checkpoint import load_checkpoint
from dcr_log.receiver import JOURNAL_DIR, Journal, open_directory, write_checkpoint
from dcr_log.receiver.files import TMP_PREFIX
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy

MIB = 1 << 20


@dataclass
class Fixture:
    log: Path
    expected: list[dict[str, TensorBits]]  # the materialized state of every version
    pristine: dict[str, Path]              # receiver kind -> a bound receiver at version 0
    files: list[dict[str, bytes]] = field(default_factory=list)  # every version's files
    start: int = 0                         # the log start (after retention, --catchup)


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> TensorBits:
    # Plausible bf16 weights: sign, exponents around 2^-7 .. 2^-3, random mantissas.
    n = int(np.prod(shape))
    words = (rng.integers(0, 2, n, dtype=np.uint16) << 15) | (rng.integers(0x3C00, 0x3E80, n, dtype=np.uint16))
    return TensorBits("BF16", shape, words.astype(np.uint16))


def _step(rng: np.random.Generator, state: dict[str, TensorBits], rate: float) -> dict[str, TensorBits]:
    """Flip the last mantissa bits of ``rate`` of each bf16 tensor (about +-1 ulp)."""
    new = {}
    for name, bits in state.items():
        words = bits.words.copy()
        if bits.dtype == "BF16" and words.size:
            k = max(1, int(words.size * rate))
            pos = rng.choice(words.size, k, replace=False)
            words[pos] ^= rng.choice(np.array([1, 3, 7], dtype=np.uint16), k)
        new[name] = TensorBits(bits.dtype, bits.shape, words)
    return new


def _files(rng: np.random.Generator, version: int, previous: dict[str, bytes] | None) -> dict[str, bytes]:
    """The files of a version: config.json changes every time, notes.txt goes at version 2 and
    generation_config.json comes, tokenizer.json (256 KiB) is rewritten at version 4."""
    if previous is None:
        text = rng.integers(97, 123, 256 * 1024, dtype=np.uint8).tobytes()
        return {"tokenizer.json": text, "vocab.txt": b"[PAD]\n[UNK]\nthe\n", "notes.txt": b"v0\n",
                "config.json": b'{"step": 0}\n'}
    files = {**previous, "config.json": b'{"step": %d}\n' % version}
    if version == 2:
        del files["notes.txt"]
        files["generation_config.json"] = b'{"max_length": 32}\n'
    if version == 4:
        files["tokenizer.json"] = rng.integers(97, 123, 256 * 1024, dtype=np.uint8).tobytes()
    return files


def build_fixture(root: Path, mb: int = 4, versions: int = 6, seed: int = 0,
                  segment_bytes: int = 2048, chunk_elements: int = 4096, catchup: bool = False,
                  rates: tuple[float, float] = (0.01, 0.05)) -> Fixture:
    """A log under ``root/log`` and pristine receivers under ``root/pristine-*``; with
    ``catchup``, a squash, a snapshot and retention (module docstring). Each version changes
    a fraction of each tensor drawn from ``rates`` (low, high)."""
    rng = np.random.default_rng(seed)
    per_tensor = 128 * 1024  # elements: 256 KiB of bf16
    state = {f"layers.{i:02d}.weight": _bf16(rng, (256, per_tensor // 256)) for i in range(max(1, mb * 4))}
    state["norm.scale"] = TensorBits("F32", (64,), rng.integers(0, 2**32, 64, dtype=np.uint32))
    state["step"] = TensorBits("I64", (), np.array([0], dtype=np.uint64))
    log_path = root / "log"
    files = [_files(rng, 0, None)]
    writer = LogWriter.create(log_path, state, policy=EncodePolicy(chunk_elements=chunk_elements),
                              segment_bytes=segment_bytes, cache_dir=False, files=files[0])
    for v in range(1, versions + 1):
        state = _step(rng, state, rate=float(rng.uniform(*rates)))
        state["step"] = TensorBits("I64", (), np.array([v], dtype=np.uint64))
        if v == 2:
            state["extra.bias"] = TensorBits("F32", (1000,), rng.integers(0, 2**32, 1000, dtype=np.uint32))
            del state["norm.scale"]
            old = state["layers.00.weight"]
            state["layers.00.weight"] = TensorBits("BF16", (512, old.words.size // 512), old.words.copy())
        files.append(_files(rng, v, files[-1]))
        writer.append(state, kind="overwrite" if v == 3 else "xor", files=files[-1],
                      allow_layout_change=v == 2)  # version 2 adds, drops and reshapes
    log = DeltaLog.open(log_path)
    expected = [log.materialize(v) for v in log.versions()]
    pristine = {"single": root / "pristine-single", "sharded": root / "pristine-sharded"}
    with open_directory(log, pristine["single"], to=0):
        pass
    pristine["sharded"].mkdir()
    write_checkpoint(expected[0], pristine["sharded"], shard_bytes=max(1, mb * MIB // 3))
    with open_directory(log, pristine["sharded"], to=0):
        pass
    start = 0
    if catchup:
        from dcr_log.lifecycle import gc, write_snapshot, write_squash

        pristine["single-v1"] = root / "pristine-single-v1"
        with open_directory(log, pristine["single-v1"], to=1):
            pass
        start = versions - 1
        policy = EncodePolicy(chunk_elements=chunk_elements)
        write_squash(log, 0, start, policy=policy, segment_bytes=segment_bytes)
        write_snapshot(log, start, policy=policy, segment_bytes=segment_bytes)
        gc(log, keep_last=2, grace=0, snapshot=False)
        assert DeltaLog.open(log_path).versions()[0] == start
    return Fixture(log_path, expected, pristine, files, start)


@dataclass
class Counts:
    rounds: int = 0
    kills: int = 0
    mid_apply: int = 0        # a version or a materialization in flight after the kill
    exited_first: int = 0     # runs that finished before their kill instant (not kills)
    resumed: int = 0          # runs started with a version or materialization in flight
    recoveries: int = 0       # final runs that started with a version in flight and finished it
    checked_between: int = 0  # kills after which the journal's version was checked bit for bit
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"rounds {self.rounds}, kills {self.kills}, mid-apply {self.mid_apply}, "
                f"checked between versions {self.checked_between}, runs resuming {self.resumed}, "
                f"recoveries {self.recoveries}, "
                f"exited before the kill {self.exited_first}, failures {len(self.failures)}")


def _dcr(*args: str) -> list[str]:
    return [sys.executable, "-m", "dcr_log", *args]


def _peek(receiver: Path):
    jpath = receiver / JOURNAL_DIR
    return Journal.peek(jpath) if Journal.exists(jpath) else None


def _holds_flock(pid: int) -> bool | None:
    """Whether process ``pid`` holds a flock (Linux /proc/locks); None where unknown."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) > 4 and parts[1] == "FLOCK" and parts[4] == str(pid):
            return True
    return False


def _in_flight(st) -> bool:
    return st is not None and (st.inflight is not None or st.materializing is not None)


class CrashRunner:
    def __init__(self, fixture: Fixture, work: Path, seed: int = 0, kills_per_round: tuple[int, int] = (1, 4)):
        self.fx = fixture
        self.work = work
        self.rng = random.Random(seed)
        self.kills_per_round = kills_per_round
        self.latest = len(fixture.expected) - 1
        self.counts = Counts()
        self.window = (0.0, 1.0)  # (start-up, work of a whole run) in seconds
        self.track_lock = False

    def _spawn(self, args: list[str], watch: bool) -> tuple[subprocess.Popen, float | None]:
        """Start ``dcr ARGS``; with ``watch``, return once it holds the receiver lock (or has
        exited), with the time that took."""
        proc = subprocess.Popen(_dcr(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not watch:
            return proc, None
        t0 = time.perf_counter()
        while proc.poll() is None and not _holds_flock(proc.pid) and time.perf_counter() - t0 < 60:
            time.sleep(0.002)
        return proc, time.perf_counter() - t0

    def calibrate(self) -> tuple[float, float]:
        """Measure start-up (spawn to receiver lock) and the work of a whole run (lock to exit)."""
        probe = self.work / "calibrate"
        shutil.copytree(self.fx.pristine["single"], probe)
        self.track_lock = _holds_flock(-1) is not None
        t0 = time.perf_counter()
        proc, to_lock = self._spawn(["apply", str(self.fx.log), "--receiver", str(probe)], self.track_lock)
        t1 = time.perf_counter()
        if proc.wait() != 0:
            raise RuntimeError(f"calibration run failed: {proc.stderr.read().decode()}")
        proc.stderr.close()
        whole = time.perf_counter() - t0
        shutil.rmtree(probe)
        startup = to_lock if to_lock is not None else 0.4 * whole
        self.window = (startup, max(time.perf_counter() - t1, 0.05) if to_lock is not None else whole - startup)
        return self.window

    def _kill_delay(self, st, locked: bool) -> float:
        """A random instant of the run: after the receiver lock is taken (most kills, when the
        lock can be watched) or from the start, the window shrunk to the versions left."""
        startup, work = self.window
        start = st.version if st is not None and st.version is not None else 0
        left = max(self.latest - start, 1) / max(self.latest, 1)
        span = work * left
        return self.rng.uniform(0, span) if locked else self.rng.uniform(0, startup + span)

    def _status(self, receiver: Path, subprocess_too: bool) -> dict:
        """``dcr status --json``, in this process (and as a subprocess when asked)."""
        from dcr_log.cli import main as dcr_main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = dcr_main(["status", "--receiver", str(receiver), "--json"])
        row = json.loads(buf.getvalue()) if rc == 0 else {"rc": rc}
        if subprocess_too:
            proc = subprocess.run(_dcr("status", "--receiver", str(receiver), "--json"),
                                  capture_output=True, check=True)
            if json.loads(proc.stdout) != row:
                self.counts.failures.append(f"{receiver.name}: status differs between processes: "
                                            f"{json.loads(proc.stdout)} vs {row}")
        return row

    def _check_bits(self, receiver: Path, version: int, what: str) -> bool:
        try:
            ok = state_equal(load_checkpoint(receiver), self.fx.expected[version])
        except Exception as exc:  # a checkpoint that does not even load is a failure too
            self.counts.failures.append(f"{what}: checkpoint does not load: {exc}")
            return False
        if not ok:
            self.counts.failures.append(f"{what}: bits differ from version {version}")
        return self._check_files(receiver, version, what) and ok

    def _check_files(self, receiver: Path, version: int, what: str) -> bool:
        """The version's files, and none the log dropped (every name it ever listed)."""
        want = self.fx.files[version] if self.fx.files else {}
        ever = set().union(*self.fx.files) if self.fx.files else set()
        for name in sorted(ever):
            path = receiver / name
            if name in want and (not path.is_file() or path.read_bytes() != want[name]):
                self.counts.failures.append(f"{what}: file {name} differs from version {version}'s")
                return False
            if name not in want and path.exists():
                self.counts.failures.append(f"{what}: file {name}, dropped by version {version}, is there")
                return False
        return True

    def one_round(self, index: int, kills: int) -> int:
        kinds = ("single", "sharded", "empty") + (("single-v1",) if "single-v1" in self.fx.pristine else ())
        kind = kinds[index % len(kinds)]
        receiver = self.work / f"round-{index}"
        if kind != "empty":
            shutil.copytree(self.fx.pristine[kind], receiver)
        done = 0
        while done < kills:
            st = _peek(receiver)
            self.counts.resumed += _in_flight(st)
            args = ["apply", str(self.fx.log), "--receiver", str(receiver),
                    "--verify", self.rng.choice(["none", "sample", "full"])]
            if st is None or not (st.bound or st.materializing is not None):
                args += ["--to", str(max(2, self.fx.start))]  # materialize an early version, apply the rest later
            proc, to_lock = self._spawn(args, watch=self.track_lock and self.rng.random() < 0.8)
            try:
                proc.wait(timeout=self._kill_delay(st, locked=to_lock is not None))
                if proc.returncode != 0:
                    self.counts.failures.append(f"round {index}: {args} exited {proc.returncode}: "
                                                f"{proc.stderr.read().decode()[-500:]}")
                    return done
                self.counts.exited_first += 1
                st = _peek(receiver)
                if st is not None and st.version == self.latest:
                    break  # nothing left to interrupt in this round
                continue
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                proc.stderr.close()
            done += 1
            self.counts.kills += 1
            st = _peek(receiver)
            if _in_flight(st):
                self.counts.mid_apply += 1
            elif st is not None and st.bound:
                # The journal never claims a version the bits do not hold.
                self.counts.checked_between += 1
                self._check_bits(receiver, st.version, f"round {index} ({kind}) after kill {done}")
        before = _peek(receiver)
        self.counts.resumed += _in_flight(before)
        proc = subprocess.run(_dcr("apply", str(self.fx.log), "--receiver", str(receiver)),
                              capture_output=True)
        if proc.returncode != 0:
            self.counts.failures.append(f"round {index} ({kind}): final apply exited {proc.returncode}: "
                                        f"{proc.stderr.decode()[-500:]}")
            return done
        if before is not None and before.inflight is not None:
            self.counts.recoveries += 1
        self._check_bits(receiver, self.latest, f"round {index} ({kind}) final")
        if list(receiver.glob(f"{TMP_PREFIX}*")):
            self.counts.failures.append(f"round {index} ({kind}): a temporary file was left behind")
        self._check_loads(receiver, f"round {index} ({kind}) final")
        row = self._status(receiver, subprocess_too=index % 4 == 0)
        if row.get("version") != self.latest or row.get("inflight", 0) is not None:
            self.counts.failures.append(f"round {index} ({kind}): status says {row}")
        shutil.rmtree(receiver)
        self.counts.rounds += 1
        return done

    def _check_loads(self, receiver: Path, what: str) -> None:
        """The safetensors library itself loads the checkpoint, with the expected bits."""
        import torch
        from safetensors import safe_open

        expected = self.fx.expected[self.latest]
        seen = set()
        for path in sorted(receiver.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    seen.add(name)
                    t = f.get_tensor(name).reshape(-1)
                    words = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
                    if not np.array_equal(words.numpy().view(expected[name].words.dtype), expected[name].words):
                        self.counts.failures.append(f"{what}: safetensors reads other bits for {name}")
        if seen != set(expected):
            self.counts.failures.append(f"{what}: safetensors sees tensors {sorted(seen)}")

    def run(self, kills: int, progress=None) -> Counts:
        index = 0
        while self.counts.kills < kills:
            if self.counts.failures and len(self.counts.failures) > 20:
                break
            self.one_round(index, min(self.rng.randint(*self.kills_per_round), kills - self.counts.kills))
            index += 1
            if progress:
                progress(self.counts)
        return self.counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--mb", type=int, default=4, help="model size in MiB")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--segment-bytes", type=int, default=2048,
                    help="writer segment size (default 2048: many segments, kills between them; "
                         "64 MiB: one segment per version, whose records a receiver writes in parallel)")
    ap.add_argument("--chunk-elements", type=int, default=4096,
                    help="the writer's records cover at most this many elements (default 4096: about 50 "
                         "changes a record; 262144 with --segment-bytes 67108864 --rates 0.02 0.03: a record "
                         "a tensor, about 3000 changes, which a receiver decodes, checks and writes on the "
                         "pool's threads: dcr_log.receiver.context.pool_pays)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--catchup", action="store_true", help="receivers catch up through a squash and a snapshot")
    ap.add_argument("--rates", type=float, nargs=2, default=(0.01, 0.05), metavar=("LO", "HI"),
                    help="each version changes a fraction of each tensor drawn from [LO, HI) (default 0.01 0.05; "
                         "at most about 0.012 a checkpoint receiver faults its pages in beside the journal's stage)")
    args = ap.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="dcr-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        fx = build_fixture(work / "fixture", mb=args.mb, versions=args.versions, seed=args.seed,
                           catchup=args.catchup, segment_bytes=args.segment_bytes, rates=tuple(args.rates),
                           chunk_elements=args.chunk_elements)
        log = DeltaLog.open(fx.log)
        segs = [len(log.commit(v).segments) for v in log.versions()[1:]]
        print(f"log: {len(fx.expected)} versions, {sum(segs)} segments after version 0, "
              f"model {sum(b.nbytes for b in fx.expected[-1].values()) / MIB:.1f} MiB")
        runner = CrashRunner(fx, work, seed=args.seed)
        lo, hi = runner.calibrate()
        print(f"start-up {lo:.2f} s, a whole run's work {hi:.2f} s; kill instants drawn in them")
        # a terminal shows one line that counts up; a log file gets the final count alone
        live = sys.stdout.isatty()
        counts = runner.run(args.kills, progress=(lambda c: print(c.line(), end="\r", flush=True)) if live else None)
        if live:
            print()
        print(counts.line() + f" ({time.perf_counter() - t0:.0f} s)")
        for failure in counts.failures:
            print("FAILURE:", failure)
        return 1 if counts.failures else 0
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
