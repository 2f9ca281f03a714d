"""Catch-up from a peer end to end, against the real control plane with real engine processes and gloo
on CPU: after a refit from a trainer's rendezvous (no checkpoint holds the version), a shard added by
``replicas: 2 -> 3`` and a shard killed and healed each copy the current version from a Ready peer
(``CaughtUp`` names it) and serve its greedy tokens, Stale only while they copy, never serving
another version; a client asks every frontend throughout, and the peers answer it during the copies.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import kube, runner

pytestmark = pytest.mark.timeout(900)  # a fleet, a refit, a scale-out and a heal, each waiting on engine starts

WAIT = 240  # engine starts on a shared 2-core machine
FLEET = "tiny"
STALE_SECONDS = 60
"""The longest a new or healed shard may stay Stale (started, without the current version) before it
serves: the copy of the tiny model and a reconcile or two, on the shared 2-core CI machine."""


def fleet_path(namespace: str) -> str:
    return f"{base.fleets(namespace)}/{FLEET}"


def shard(obj: Object | None, index: int) -> Object:
    return next((s for s in (obj or {}).get("status", {}).get("shards", []) if s["index"] == index), {})


class Client:
    """Greedy requests to every frontend pod of the fleet, round after round, on a thread; keeps
    (pod, status, version, tokens) of every answer."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.namespace = namespace
        self.answers: list[tuple[str, int, str | None, list[int]]] = []
        self._kube = kube.Kube.from_kubeconfig(kubeconfig)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="client", daemon=True)

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._kube.close()

    def _run(self) -> None:
        body = {"model": FLEET, "prompt": base.PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                for pod in self._kube.list(f"/api/v1/namespaces/{self.namespace}/pods")["items"]:
                    ip = pod["status"].get("podIP")
                    if not ip:
                        continue
                    try:
                        answer = client.post(f"http://{ip}:8000/v1/completions", json=body)
                    except httpx.HTTPError:
                        continue  # not started yet, or killed
                    tokens = answer.json()["choices"][0]["token_ids"] if answer.status_code == 200 else []
                    version = answer.headers.get("X-Megafleet-Weight-Version")
                    self.answers.append((pod["metadata"]["name"], answer.status_code, version, tokens))
                self._stop.wait(0.1)  # pacing of the load, not synchronisation


def wait_caught_up(kube_admin: kube.Kube, namespace: str, index: int, restarts: int) -> tuple[Object, list[str], float]:
    """Wait until shard ``index`` (placed ``restarts`` times) is Ready at version 1 and the fleet Ready;
    returns the fleet, the phases the shard went through and the seconds it was Stale."""
    phases: list[str] = []
    stale: list[float] = []

    def caught_up(obj: Object | None) -> bool:
        entry = shard(obj, index)
        if entry and entry.get("restarts", 0) == restarts:
            if entry.get("phase") == "Stale" and not stale:
                stale.append(time.monotonic())
            if not phases or phases[-1] != entry.get("phase"):
                phases.append(entry.get("phase", ""))
        return base.ready(obj) and entry.get("restarts") == restarts and entry.get("weightVersion") == 1

    fleet = kube_admin.wait(fleet_path(namespace), caught_up, timeout=WAIT, what=f"shard {index} Ready at version 1")
    assert fleet is not None
    return fleet, phases, time.monotonic() - stale[0] if stale else 0.0


def events(kube_admin: kube.Kube, namespace: str, reason: str) -> list[str]:
    return [
        e["message"]
        for e in kube_admin.list(f"/api/v1/namespaces/{namespace}/events")["items"]
        if e["reason"] == reason
    ]


def test_a_scaled_out_and_a_healed_shard_copy_the_current_version_from_a_peer(
    operator: Path, pod_runner: runner.Runner, kubeconfig: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    kube_admin.create(base.fleets(namespace), base.tiny_fleet(replicas=2, refit={"timeoutSeconds": 60}))
    assert kube_admin.wait(fleet_path(namespace), base.ready, timeout=WAIT) is not None
    trainer = base.TrainerModel()
    done = trainer.refit(kube_admin, namespace, FLEET, 1)
    assert done["status"]["phase"] == "Succeeded", done["status"]
    expected = trainer.greedy(12)

    with Client(kubeconfig, namespace) as client:
        kube_admin.patch(fleet_path(namespace), {"spec": {"replicas": 3}})
        fleet, phases, seconds = wait_caught_up(kube_admin, namespace, 2, restarts=0)
        assert fleet["status"]["refit"].get("currentCheckpoint") is None  # no checkpoint holds version 1
        assert "Ready" not in phases[:-1] and seconds < STALE_SECONDS, (phases, seconds)
        copies = [m for m in events(kube_admin, namespace, "CaughtUp") if m.startswith("shard 2 ")]
        assert copies and "caught up from peer shard" in copies[0] and "verified (mf64)" in copies[0], copies
        new = shard(fleet, 2)["pods"][0]
        assert base.served(kube_admin, namespace, new) == (expected, "1")

        killed = shard(fleet, 1)["pods"][0]
        folder = pod_runner.workdir / namespace / killed
        engine = next(p for p in list(pod_runner.processes.values()) if p.log.parent == folder)
        os.killpg(engine.popen.pid, signal.SIGKILL)
        fleet, phases, seconds = wait_caught_up(kube_admin, namespace, 1, restarts=1)
        assert "Ready" not in phases[:-1] and seconds < STALE_SECONDS, (phases, seconds)
        healed = [m for m in events(kube_admin, namespace, "CaughtUp") if m.startswith("shard 1 ")]
        assert healed and "caught up from peer shard" in healed[0], healed
        for entry in fleet["status"]["shards"]:
            assert base.served(kube_admin, namespace, entry["pods"][0]) == (expected, "1"), entry

    served = [answer for answer in client.answers if answer[1] == 200]
    assert served and all((version, tokens) == ("1", expected) for _, _, version, tokens in served), served[:5]
    assert {status for _, status, _, _ in client.answers} <= {200, 503}
    peers = {shard(fleet, 0)["pods"][0]}
    assert all(status == 200 for pod, status, _, _ in client.answers if pod in peers)  # it served on
    assert {pod for pod, status, _, _ in served} >= {shard(fleet, i)["pods"][0] for i in range(3)}
