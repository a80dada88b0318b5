"""One ``apply`` of a durable engine-layout receiver, SIGKILLed by itself at a chosen hook.

Run as ``python tests/engine_crash_job.py LOG DIR PLACEMENT KILL_AT VERIFY``: open the
checkpoint directory DIR (every tensor-parallel rank's parameters under ``tp<r>.`` prefixes)
through PLACEMENT, bind it to version 0 if new, and apply the log to its latest version,
sending itself SIGKILL at the KILL_AT-th fault-hook point (0: never). No torch here: the
placement has no residual parameters, so the receiver needs only numpy and the journal.
"""

import os
import signal
import sys

from dcr_log import DeltaLog
from dcr_log.receiver import Receiver


def main() -> None:
    log_path, directory, placement, kill_at, verify = sys.argv[1:6]
    kill_at = int(kill_at)
    calls = [0]

    def hook(point, **info):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    log = DeltaLog.open(log_path)
    with Receiver.open(directory, placement=placement) as rx:
        if rx.version is None:
            rx.bind(log, 0)
        rx.fault = hook
        if rx.inflight is not None:
            rx.recover(log, verify=verify)
        rx.apply(log, verify=verify)
    print(calls[0])


if __name__ == "__main__":
    main()
