"""Shared test helper (it holds no tests): ``megafleet operator`` processes a test starts, kills and
restarts, each with its own log, and the engine agents' view of a fleet's pods.

Used by the operator-restart e2e tests and the chaos drills (``tests/chaos/``). Every process it
started is stopped by :meth:`Operators.close`, by PID.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from megafleet_dev import kube
from megafleet_protocol import ports


class Operators:
    """Operator processes watching ``namespaces`` (a glob), logging to ``folder``, with ``env`` added
    to their environment (settings overrides, :mod:`helpers.operator_env`)."""

    def __init__(self, kubeconfig: Path, folder: Path, namespaces: str, env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.folder = folder
        self.namespaces = namespaces
        self.env = dict(env or {})
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def start(self, *, peering: str | None = None, priority: int | None = None) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "megafleet.cli", "operator", "--namespace", self.namespaces]
        if peering is not None:
            command += ["--peering", peering]
        if priority is not None:
            command += ["--priority", str(priority)]
        log = self.folder / f"operator-{len(self.processes)}.log"
        with log.open("wb") as sink:
            process = subprocess.Popen(
                command,
                env=dict(os.environ, KUBECONFIG=str(self.kubeconfig), **self.env),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        self.logs.append(log)
        return process

    @staticmethod
    def kill(process: subprocess.Popen[bytes]) -> None:
        """SIGKILL: the operator dies without a chance to tidy anything (as an OOM kill or node loss)."""
        process.send_signal(signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def agent_states(kube_admin: kube.Kube, namespace: str, fleet: str) -> dict[str, str | None]:
    """Each of the fleet's pods' engine state as its agent reports it (``GET /v1/state``); ``None``
    where the agent does not answer."""
    secret = kube_admin.get(f"/api/v1/namespaces/{namespace}/secrets/{fleet}-agent-token")
    assert secret is not None
    token = base64.b64decode(secret["data"]["token"]).decode()
    pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods", label_selector=f"megafleet.dev/fleet={fleet}")
    states: dict[str, str | None] = {}
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=10) as agent:
        for pod in pods["items"]:
            address = pod["status"].get("podIP")
            try:
                answer = agent.get(f"http://{address}:{ports.AGENT_PORT}/v1/state") if address else None
            except httpx.HTTPError:
                answer = None
            ok = answer is not None and answer.status_code == 200
            states[pod["metadata"]["name"]] = str(answer.json()["state"]) if ok and answer is not None else None
    return states
