"""``megafleet dev up|status|down`` as a user runs it: a second, separate local cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megafleet_dev import cluster, toolchain

CLI = [sys.executable, "-m", "megafleet.cli", "dev"]


def run_cli(*args: str, state_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "--state-dir", str(state_dir), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_up_status_down_leaves_nothing_running(tmp_path: Path) -> None:
    state_dir = tmp_path / "dev"

    up = run_cli("up", "--pool", "small:1x2:8", state_dir=state_dir)
    assert up.returncode == 0, up.stderr
    state = cluster.ClusterState.load(state_dir)
    assert state is not None
    assert f"kubeconfig:  {state.kubeconfig}" in up.stdout
    assert "starting kube-apiserver" in up.stderr  # progress is shown
    try:
        status = run_cli("status", state_dir=state_dir)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("running") == len(state.processes) == 5

        # kubectl from the wheel works against it with the printed kubeconfig.
        env = dict(os.environ, KUBECONFIG=state.kubeconfig)
        got = subprocess.run(
            [str(toolchain.kubectl_path()), "get", "nodes", "-o", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        names = sorted(item["metadata"]["name"] for item in json.loads(got.stdout)["items"])
        assert names == ["small-c0-n0", "small-c0-n1"]

        again = run_cli("up", state_dir=state_dir)
        assert again.returncode == 0 and "already running" in again.stdout
    finally:
        down = run_cli("down", state_dir=state_dir)

    assert down.returncode == 0, down.stderr
    assert not any(record.alive() for record in state.processes)
    assert not state_dir.exists()
    assert run_cli("status", state_dir=state_dir).returncode == 3
