"""Hostile and edge-case specs against the real control plane: names the fleet does not own, a spec
near the object size limit (docs/incidents.md#kopf-last-handled-size), a malformed Kopf annotation
(docs/incidents.md#kopf-malformed-record), and deletion while no operator runs
(docs/incidents.md#kopf-timer-finalizers). Bad specs the API server refuses at admission are
tests/e2e/invalid/ (test_admission.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megafleet.objects import Object
from megafleet_dev import kube, runner

ROOT = Path(__file__).resolve().parents[2]
WAIT = 120
DIFF_BASE = "megafleet.dev/last-handled-configuration"


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


def tiny(replicas: int) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    manifest["spec"]["replicas"] = replicas
    return manifest


def condition_is(kind: str, status: str) -> Callable[[Object | None], bool]:
    return lambda obj: (kube.condition(obj, kind) or {}).get("status") == status


def reconciled(generation: int) -> Callable[[Object | None], bool]:
    return lambda obj: (obj or {}).get("status", {}).get("observedGeneration") == generation


def gone(obj: Object | None) -> bool:
    return obj is None


def test_a_service_squatting_on_a_derived_name_is_a_name_conflict_never_published(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    squatter = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny-f0", "labels": {"megafleet.dev/fleet": "tiny"}},
        "spec": {"ports": [{"port": 80}]},
    }
    created = kube_admin.create(f"/api/v1/namespaces/{namespace}/services", squatter)

    kube_admin.create(fleets(namespace), tiny(replicas=1))
    fleet = kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("NameConflict", "True"), timeout=WAIT)

    assert fleet is not None
    assert "Service 'tiny-f0'" in (kube.condition(fleet, "NameConflict") or {})["message"]
    assert created["spec"]["clusterIP"] not in str(fleet["status"].get("endpoints", []))
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/pods")["items"] == []
    assert kube_admin.get(f"/api/v1/namespaces/{namespace}/configmaps/tiny-endpoints") is None
    left = kube_admin.get(f"/api/v1/namespaces/{namespace}/services/tiny-f0")
    assert left is not None and "ownerReferences" not in left["metadata"]  # never adopted


def test_a_secret_squatting_on_the_token_name_is_a_name_conflict(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    squatter = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tiny-agent-token"}, "data": {}}
    kube_admin.create(f"/api/v1/namespaces/{namespace}/secrets", squatter)

    kube_admin.create(fleets(namespace), tiny(replicas=1))
    fleet = kube_admin.wait(f"{fleets(namespace)}/tiny", condition_is("NameConflict", "True"), timeout=WAIT)

    assert "Secret 'tiny-agent-token'" in (kube.condition(fleet, "NameConflict") or {})["message"]
    assert kube_admin.list(f"/api/v1/namespaces/{namespace}/services")["items"] == []


def test_a_spec_near_the_size_limit_is_handled_and_deleted(
    operator: Path, kube_admin: kube.Kube, namespace: str
) -> None:
    """Kopf kept the whole spec in an annotation: past 256 KiB the fleet could never be deleted."""
    manifest = tiny(replicas=0)
    manifest["spec"]["engine"]["env"] = [{"name": f"PAD_{i}", "value": "x" * 32000} for i in range(10)]
    assert len(yaml.safe_dump(manifest["spec"])) > 320_000
    kube_admin.create(fleets(namespace), manifest)
    path = f"{fleets(namespace)}/tiny"

    handled = kube_admin.wait(
        path, lambda obj: DIFF_BASE in (obj or {}).get("metadata", {}).get("annotations", {}), timeout=WAIT
    )

    assert handled is not None and not handled["metadata"].get("finalizers")
    assert len(handled["metadata"]["annotations"][DIFF_BASE]) < 1024
    kube_admin.delete(path)
    kube_admin.wait(path, gone, timeout=30, what="the big fleet deleted")


@pytest.fixture
def own_operator(crds: None, pod_runner: runner.Runner, kubeconfig: Path, tmp_path: Path) -> Iterator[Any]:
    """An operator of its own, watching ``h-*`` namespaces, that the test starts and stops."""
    processes: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        with (tmp_path / f"operator-{len(processes)}.log").open("wb") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "megafleet.cli", "operator", "--namespace", "h-*"],
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


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def test_a_fleet_and_its_namespace_are_deleted_while_no_operator_runs(own_operator: Any, kube_admin: kube.Kube) -> None:
    """Kopf put a finalizer on every object with a timer: with the operator down, deletion hung."""
    namespace = kube_admin.create_namespace("h")
    operator = own_operator()
    try:
        for name in ("tiny", "other"):
            kube_admin.create(fleets(namespace), {**tiny(replicas=0), "metadata": {"name": name}})
        for name in ("tiny", "other"):
            fleet = kube_admin.wait(f"{fleets(namespace)}/{name}", condition_is("Placed", "True"), timeout=WAIT)
            assert fleet is not None and not fleet["metadata"].get("finalizers")
        stop(operator)

        kube_admin.delete(f"{fleets(namespace)}/tiny")
        kube_admin.wait(f"{fleets(namespace)}/tiny", gone, timeout=30, what="the fleet deleted without an operator")
        kube_admin.delete(f"/api/v1/namespaces/{namespace}")
        kube_admin.wait(f"/api/v1/namespaces/{namespace}", gone, timeout=WAIT, what="the namespace deleted")
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)


def test_a_malformed_kopf_annotation_does_not_stop_reconciliation(own_operator: Any, kube_admin: kube.Kube) -> None:
    """A malformed last-handled configuration raised JSONDecodeError at every event, for good."""
    namespace = kube_admin.create_namespace("h")
    path = f"{fleets(namespace)}/tiny"
    try:
        operator = own_operator()
        created = kube_admin.create(fleets(namespace), tiny(replicas=0))
        kube_admin.wait(path, reconciled(created["metadata"]["generation"]), timeout=WAIT)
        stop(operator)
        kube_admin.patch(path, {"metadata": {"annotations": {DIFF_BASE: "{not json"}}})
        changed = kube_admin.patch(path, {"spec": {"model": {"servedName": "renamed"}}})

        own_operator()
        fleet = kube_admin.wait(path, reconciled(changed["metadata"]["generation"]), timeout=WAIT)

        assert fleet is not None
        kube_admin.wait(
            path,
            lambda obj: (obj or {}).get("metadata", {}).get("annotations", {}).get(DIFF_BASE, "").startswith('{"'),
            timeout=WAIT,
            what="the annotation rewritten",
        )
    finally:
        kube_admin.delete(f"/api/v1/namespaces/{namespace}", missing_ok=True)
