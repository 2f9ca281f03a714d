"""Operator lifecycle against the real control plane with real engine processes: rolling template
changes, bounded restarts, and an operator killed mid-reconcile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megafleet.objects import Object
from megafleet_dev import kube, runner

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def tiny(replicas: int = 2) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    return manifest


def wait_for_line(log: Path, text: str, timeout: float = 30) -> str:
    """The log once it holds ``text`` (a log offers no watch: read it until a deadline)."""
    deadline = time.monotonic() + timeout
    while text not in (content := log.read_text()):
        assert time.monotonic() < deadline, f"{text!r} not in {log}:\n{content[-2000:]}"
        time.sleep(0.2)
    return content


def ready(obj: Object | None) -> bool:
    return (kube.condition(obj, "Ready") or {}).get("status") == "True"


def test_a_template_change_rolls_one_shard_at_a_time(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    kube_admin.create(fleets(namespace), tiny())
    path = f"{fleets(namespace)}/tiny"
    before = kube_admin.wait(path, ready, timeout=WAIT)
    assert before is not None
    old_hash = {
        p["metadata"]["name"]: p["metadata"]["annotations"]["megafleet.dev/template-hash"]
        for p in kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
    }

    patched = kube_admin.patch(path, {"spec": {"engine": {"maxBatchSize": 4}}})

    def rolled(obj: Object | None) -> bool:
        pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
        hashes = {p["metadata"]["annotations"]["megafleet.dev/template-hash"] for p in pods}
        return ready(obj) and len(pods) == 2 and not hashes & set(old_hash.values())

    after = kube_admin.wait(path, rolled, timeout=WAIT, what="both shards rolled and Ready")
    assert after is not None
    assert after["status"]["endpoints"] == before["status"]["endpoints"]
    assert [shard["restarts"] for shard in after["status"]["shards"]] == [0, 0]  # a roll is not a restart
    events = kube_admin.history(f"/api/v1/namespaces/{namespace}/pods", since=patched["metadata"]["resourceVersion"])
    order = [(e["type"], e["object"]["metadata"]["name"]) for e in events if e["type"] in ("ADDED", "DELETED")]
    # Shard 0 is replaced (deleted, re-added) before shard 1's pod is touched.
    assert order == [
        ("DELETED", "tiny-s0-p0"),
        ("ADDED", "tiny-s0-p0"),
        ("DELETED", "tiny-s1-p0"),
        ("ADDED", "tiny-s1-p0"),
    ]


def test_a_shard_that_keeps_crashing_ends_failed(operator: Path, kube_admin: kube.Kube, namespace: str) -> None:
    manifest = tiny(replicas=1)
    manifest["spec"]["model"]["source"] = "tiny://llama?bogus=1"  # the engine refuses it and exits

    kube_admin.create(fleets(namespace), manifest)

    def failed(obj: Object | None) -> bool:
        shards = (obj or {}).get("status", {}).get("shards", [])
        return bool(shards) and shards[0]["phase"] == "Failed"

    status = kube_admin.wait(f"{fleets(namespace)}/tiny", failed, timeout=240, what="shard 0 Failed")
    assert status is not None
    shard = status["status"]["shards"][0]
    assert shard["restarts"] == 6 and "gave up after 5 restarts" in shard["lastError"]
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []  # no more re-placing
    assert not ready(status)


@pytest.fixture
def restartable_operator(crds: None, pod_runner: runner.Runner, kubeconfig: Path, tmp_path: Path) -> Iterator[Any]:
    """An operator of its own, watching ``r-*`` namespaces, that the test can kill and restart."""
    processes: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / f"operator-{len(processes)}.log").open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "megafleet.cli", "operator", "--namespace", "r-*"],
                env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=20)


def test_operator_killed_mid_reconcile_converges_without_duplicates_or_orphans(
    restartable_operator: Any, kube_admin: kube.Kube
) -> None:
    namespace = kube_admin.create_namespace("r")
    try:
        first = restartable_operator()
        created = kube_admin.create(fleets(namespace), tiny(replicas=3))
        kube_admin.wait_items(f"/api/v1/namespaces/{namespace}/pods", bool, timeout=WAIT, what="the first pod")
        first.send_signal(signal.SIGKILL)  # mid-reconcile: some shards are placed, others are not
        first.wait()
        restartable_operator()

        status = kube_admin.wait(f"{fleets(namespace)}/tiny", ready, timeout=WAIT, what="Ready after restart")

        assert status is not None and status["status"]["readyReplicas"] == 3
        owned = {"pods": 3, "services": 1, "configmaps": 1, "secrets": 1}  # one-pod shards: one frontends Service
        for kind, expected in owned.items():
            items = kube_admin.list(f"/api/v1/namespaces/{namespace}/{kind}", label_selector="megafleet.dev/fleet=tiny")
            assert len(items["items"]) == expected, kind
            for item in items["items"]:
                assert item["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        all_pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"]
        assert sorted(p["metadata"]["name"] for p in all_pods) == ["tiny-s0-p0", "tiny-s1-p0", "tiny-s2-p0"]
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)


def test_two_replicas_with_peering_never_both_act_and_the_standby_takes_over(
    crds: None, pod_runner: runner.Runner, kubeconfig: Path, kube_admin: kube.Kube, tmp_path: Path
) -> None:
    peering = f"peering-{tmp_path.name[-12:].lower().replace('_', '-')}"
    kube_admin.create(
        "/apis/kopf.dev/v1/clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}},
    )
    # Kopf runs peering per watched namespace: the namespace exists before the replicas start.
    namespace = kube_admin.create_namespace("p")
    logs = {priority: tmp_path / f"operator-{priority}.log" for priority in (10, 20)}
    processes = {}
    try:
        # As in a rolling deployment: the leader is up and registered before the standby starts.
        for priority in (20, 10):
            with logs[priority].open("wb") as sink:
                processes[priority] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "megafleet.cli",
                        "operator",
                        "--namespace",
                        "p-*",
                        "--peering",
                        peering,
                        "--priority",
                        str(priority),
                    ],
                    env=dict(os.environ, KUBECONFIG=str(kubeconfig)),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            registered = len(processes)

            def all_registered(obj: Object | None, n: int = registered) -> bool:
                return len((obj or {}).get("status") or {}) == n

            kube_admin.wait(
                f"/apis/kopf.dev/v1/clusterkopfpeerings/{peering}",
                all_registered,
                timeout=WAIT,
                what=f"{registered} replicas registered",
            )
        kube_admin.wait(
            f"/apis/kopf.dev/v1/clusterkopfpeerings/{peering}",
            lambda obj: len((obj or {}).get("status") or {}) == 2,
            timeout=WAIT,
            what="both replicas",
        )
        kube_admin.create(fleets(namespace), tiny(replicas=1))
        kube_admin.wait(f"{fleets(namespace)}/tiny", ready, timeout=WAIT)

        # A standby starts paused (it may never log a pause); what matters is that it never acts.
        standby_log = logs[10].read_text()
        assert "on_fleet_change" not in standby_log and "observe" not in standby_log  # it never reconciled
        assert "Handler 'on_fleet_change' succeeded" in logs[20].read_text()

        processes[20].send_signal(signal.SIGKILL)  # the active replica dies without saying goodbye
        processes[20].wait()
        kube_admin.patch(f"{fleets(namespace)}/tiny/scale", {"spec": {"replicas": 2}})

        grown = kube_admin.wait(
            f"{fleets(namespace)}/tiny",
            lambda o: ready(o) and o is not None and o["status"]["readyReplicas"] == 2,
            timeout=WAIT,
            what="the standby scaled the fleet",
        )
        assert grown is not None
        wait_for_line(logs[10], "Resuming operations after the pause")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=20)
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
