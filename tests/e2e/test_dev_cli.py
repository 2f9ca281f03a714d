"""``megafleet dev up|status|down`` as a user runs it (the README's first command): a second local
cluster with the operator, the pod runner and the tiny fleet, answering a chat completion."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from megafleet_dev import cluster, toolchain

CLI = [sys.executable, "-m", "megafleet.cli", "dev"]


def run_cli(*args: str, state_dir: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "--state-dir", str(state_dir), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_up_serves_the_tiny_fleet_and_down_leaves_nothing_running(tmp_path: Path) -> None:
    state_dir = tmp_path / "dev"

    # Its own pod network: a developer's `make up` cluster (127.64.0.0/12) may be running beside it.
    up = run_cli("up", "--pod-network", "127.192.0.0/12", state_dir=state_dir)
    assert up.returncode == 0, up.stderr
    state = cluster.ClusterState.load(state_dir)
    assert state is not None
    assert f"kubeconfig:  {state.kubeconfig}" in up.stdout
    assert "starting kube-apiserver" in up.stderr and "waiting for the fleet" in up.stderr  # progress shown
    assert "fleet default/tiny is Ready: 2 shards" in up.stdout
    try:
        status = run_cli("status", state_dir=state_dir)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("running") == len(state.processes) == 7  # 5 + operator + pod runner

        match = re.search(r"curl -s (\S+) -H 'Content-Type: application/json' -d '(.+)'", up.stdout)
        assert match is not None, up.stdout
        url = match.group(1)
        reply = httpx.post(url, json=json.loads(match.group(2)), timeout=60)
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
        assert reply.headers["x-megafleet-weight-version"] == "0"

        env = dict(os.environ, KUBECONFIG=state.kubeconfig)
        got = subprocess.run(
            [str(toolchain.kubectl_path()), "get", "mgen", "tiny", "-o", "json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert json.loads(got.stdout)["status"]["readyReplicas"] == 2

        again = run_cli("up", state_dir=state_dir)
        assert again.returncode == 0 and "already running" in again.stdout
    finally:
        down = run_cli("down", state_dir=state_dir)

    assert down.returncode == 0, down.stderr
    assert not any(record.alive() for record in state.processes)
    assert not state_dir.exists()
    assert run_cli("status", state_dir=state_dir).returncode == 3
    try:
        httpx.post(url, json={}, timeout=5)
        raise AssertionError("an engine still answers after 'dev down'")
    except httpx.ConnectError:
        pass
