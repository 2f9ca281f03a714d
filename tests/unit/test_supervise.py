"""The local cluster's supervisor (megafleet_dev.supervise): a program that exits is started again (as
kube-scheduler must be after it exits on a corrupted cache), and stopping the supervisor stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megafleet_dev import supervise


def test_the_delay_doubles_up_to_the_most_and_resets_after_a_long_run() -> None:
    delays: list[float | None] = [None]
    for _ in range(7):
        delays.append(supervise.next_delay(delays[-1], ran_seconds=1))
    assert delays[1:] == [1, 2, 4, 8, 16, 30, 30]
    assert supervise.next_delay(30, ran_seconds=supervise.RESET_AFTER_SECONDS) == supervise.FIRST_DELAY_SECONDS


def _wait_for(path: Path, lines: int, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = path.read_text().split() if path.exists() else []
        if len(found) >= lines:
            return found
        time.sleep(0.05)  # polling a file the child writes, with a deadline
    raise AssertionError(f"{path} has fewer than {lines} lines")


def test_an_exited_program_is_restarted_and_stopping_the_supervisor_stops_it(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    # Exits with 1 on its first start (a scheduler finding its cache corrupted), then runs.
    script = f'echo $$ >> {starts}; [ "$(wc -l < {starts})" -gt 1 ] && exec sleep 60; exit 1'
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "megafleet_dev.supervise", "/bin/sh", "-c", script],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
    )
    try:
        first, second = (int(pid) for pid in _wait_for(starts, 2))
        assert first != second
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=20)
        assert supervisor.stdout is not None
        assert b"sh exited with status 1; restarting it in 1 s" in supervisor.stdout.read()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{second}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the program ends with the supervisor
        assert not Path(f"/proc/{second}").exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if supervisor.stdout is not None:
            supervisor.stdout.close()
