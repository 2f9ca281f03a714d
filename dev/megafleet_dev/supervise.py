"""Keep one control-plane program running, as a kubelet keeps a static pod (``restartPolicy: Always``).

Started by :mod:`megafleet_dev.cluster` as ``python -m megafleet_dev.supervise PROGRAM [ARGS...]`` for
kube-scheduler and kube-controller-manager. Both may exit on purpose and count on being restarted:
kube-scheduler exits (``klog.FlushAndExit``) when an event contradicts its cache ("Scheduler cache is
corrupted"), which a watch gap across an etcd or API-server restart causes when a pod is deleted and
re-created under the same name on another node (``docs/incidents.md#scheduler-cache-exit``); the restarted program
rebuilds its cache from a fresh LIST. Without a supervisor the local cluster lost its scheduler for
good and new pods stayed Pending.

The program runs as this process's child, in its process group, and is killed with it
(``PR_SET_PDEATHSIG``), so stopping the recorded PID stops both. SIGTERM or SIGINT is passed on and
ends the supervision. An exit is restarted after a delay that doubles from :data:`FIRST_DELAY_SECONDS`
up to :data:`MOST_DELAY_SECONDS` (the kubelet's back-off, shortened), back to the first after
:data:`RESET_AFTER_SECONDS` of running. Each restart is logged to the program's own output.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

FIRST_DELAY_SECONDS = 1.0
MOST_DELAY_SECONDS = 30.0
RESET_AFTER_SECONDS = 60.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the supervisor dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def next_delay(previous: float | None, ran_seconds: float) -> float:
    """The wait before the next start: the first after a long run (or the first exit), else doubled."""
    if previous is None or ran_seconds >= RESET_AFTER_SECONDS:
        return FIRST_DELAY_SECONDS
    return min(previous * 2, MOST_DELAY_SECONDS)


def main(argv: list[str]) -> int:
    """Run ``argv`` until told to stop; returns the program's last exit status."""
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    name, delay, code = Path(argv[0]).name, None, 0
    while not stopping.is_set():
        started = time.monotonic()
        child = subprocess.Popen(argv, preexec_fn=_die_with_parent)
        if stopping.is_set():  # told to stop while it was starting
            child.terminate()
        code = child.wait()
        if stopping.is_set():
            break
        delay = next_delay(delay, time.monotonic() - started)
        sys.stdout.write(f"[supervise] {name} exited with status {code}; restarting it in {delay:.0f} s\n")
        sys.stdout.flush()
        stopping.wait(delay)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
