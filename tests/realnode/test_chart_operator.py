"""The operator as a user installs it: ``helm install`` of ``charts/megafleet`` on the real-node
cluster, the operator image of ``megafleet dev images`` running as the chart's Deployment (its
ServiceAccount, ClusterRole and Kopf peering between two replicas), reconciling the tiny fleet in a
namespace that enforces the restricted Pod Security Standard, from inside the cluster (through the
``kubernetes`` Service, whose endpoint the real node publishes: :func:`realnode.apiserver_slice`).

The fleet uses the pod template (``spec.pod``) the way a GPU fleet does, proven in real containers
where a CPU can prove it: the checkpoint comes from a PersistentVolumeClaim the test writes (not the
built-in ``tiny://``), ``/dev/shm`` is a tmpfs of ``shmSize``, the cache directories are writable on
the read-only root filesystem, and ``envFrom`` reaches the engine.

Nothing else reconciles here: the host operator of ``conftest.py`` watches ``t-*`` only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import chart_release, real_node_fleet
from megafleet_dev import kube, realnode

pytestmark = [pytest.mark.realnode, pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
RELEASE = chart_release.RELEASE
WAIT = 300  # operator pods start, then the engine imports torch on two shared cores
SHM_BYTES = 128 << 20

# Run inside the engine container (``ctr tasks exec``): what the pod template promises.
PROBE = """
import json, os
shm = os.statvfs("/dev/shm")
cache = os.environ["TRITON_CACHE_DIR"]
os.makedirs(cache, exist_ok=True)
open(os.path.join(cache, "probe"), "w").write("ok")
try:
    open("/models/tiny/probe", "w")
    models_writable = True
except OSError:
    models_writable = False
print(json.dumps({
    "shm_bytes": shm.f_blocks * shm.f_frsize,
    "cache": cache,
    "models": sorted(os.listdir("/models/tiny")),
    "models_writable": models_writable,
    "tuned": os.environ.get("TUNED_LEVEL"),
    "home": os.environ["HOME"],
}))
"""


def fleets(namespace: str) -> str:
    return f"/apis/megafleet.dev/v1alpha1/namespaces/{namespace}/megatrongenerations"


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[Path]:
    """The tiny model saved as a Hugging Face checkpoint folder, readable by the engine's user."""
    from megafleet_engine.models import tiny

    folder = Path(tempfile.mkdtemp(prefix="megafleet-checkpoint-"))
    try:
        model, tokenizer = tiny.build_tiny("tiny://llama")
        model.save_pretrained(folder / "tiny")
        tokenizer.save_pretrained(folder / "tiny")
        for path in [folder, *folder.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_chart_installed_operator_runs_two_peered_replicas_under_its_service_account(
    chart_namespace: str, kube_admin: kube.Kube
) -> None:
    namespace = chart_namespace
    deployment = kube_admin.wait(
        f"/apis/apps/v1/namespaces/{namespace}/deployments/{RELEASE}",
        lambda obj: (obj or {}).get("status", {}).get("availableReplicas") == 2,
        timeout=WAIT,
        what="both operator replicas available",
    )
    assert deployment is not None
    pods = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods", label_selector=chart_release.OPERATOR_SELECTOR)[
        "items"
    ]
    assert len(pods) == 2
    assert {pod["spec"]["serviceAccountName"] for pod in pods} == {RELEASE}
    assert {pod["spec"]["nodeName"] for pod in pods} == {realnode.NODE_NAME}  # real containers
    # Both replicas reached the API server from inside the cluster with the chart's token and RBAC:
    # each keeps a heartbeat in the release's peering object (one of them acts).
    peering = kube_admin.wait(
        f"/apis/kopf.dev/v1/clusterkopfpeerings/{RELEASE}",
        lambda obj: len((obj or {}).get("status") or {}) >= 2,
        timeout=WAIT,
        what="both replicas' peering heartbeats",
    )
    assert peering is not None


def test_the_in_cluster_operator_serves_the_tiny_fleet_from_a_checkpoint_volume(
    chart_namespace: str, checkpoint: Path, kube_admin: kube.Kube, real_node: realnode.RealNode
) -> None:
    namespace = chart_namespace
    volume = f"{namespace}-tiny"
    kube_admin.create(
        "/api/v1/persistentvolumes",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(checkpoint), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": "tiny-checkpoint"},
            },
        },
    )
    core = f"/api/v1/namespaces/{namespace}"
    try:
        kube_admin.create(
            f"{core}/persistentvolumeclaims",
            {
                "metadata": {"name": "tiny-checkpoint"},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "storageClassName": "",
                    "volumeName": volume,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
        )
        kube_admin.create(f"{core}/configmaps", {"metadata": {"name": "tuning"}, "data": {"LEVEL": "3"}})
        manifest = real_node_fleet.tiny(replicas=1)
        spec = manifest["spec"]
        spec["model"]["source"] = "/models/tiny"
        spec["engine"]["envFrom"] = [{"configMapRef": {"name": "tuning"}, "prefix": "TUNED_"}]
        spec["pod"] = {
            "labels": {"team": "rl"},
            "shmSize": "128Mi",
            "volumes": [
                {"name": "models", "persistentVolumeClaim": {"claimName": "tiny-checkpoint", "readOnly": True}}
            ],
            "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        }
        kube_admin.create(fleets(namespace), manifest)

        ready = kube_admin.wait(
            f"{fleets(namespace)}/tiny",
            lambda obj: (kube.condition(obj or {}, "Ready") or {}).get("status") == "True",
            timeout=WAIT,
            what="the tiny fleet Ready, reconciled by the in-cluster operator",
        )

        assert ready is not None
        pod = kube_admin.get(f"{core}/pods/{ready['status']['shards'][0]['pods'][0]}")
        assert pod is not None
        assert pod["spec"]["nodeName"] == realnode.NODE_NAME and pod["metadata"]["labels"]["team"] == "rl"
        response = httpx.post(
            f"http://{pod['status']['podIP']}:8000/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
        container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
        probe = real_node.ctr("tasks", "exec", "--exec-id", "probe", container_id, "python", "-c", PROBE)
        seen = json.loads(probe.stdout)
        assert seen["shm_bytes"] == SHM_BYTES  # the memory-backed /dev/shm of shmSize, not the runtime's 64 MiB
        assert seen["cache"].startswith("/var/cache/megafleet/")  # writable, though the root filesystem is not
        assert "config.json" in seen["models"] and "model.safetensors" in seen["models"]
        assert seen["models_writable"] is False  # the checkpoint volume is mounted read-only
        assert seen["tuned"] == "3" and seen["home"] == "/tmp"
        kube_admin.delete(f"{fleets(namespace)}/tiny")
        kube_admin.wait_items(
            f"{core}/pods",
            lambda items: not [item for item in items if item["metadata"]["name"].startswith("tiny-")],
            timeout=WAIT,
            what="the fleet's pods gone",
        )
    finally:
        kube_admin.delete(f"/api/v1/persistentvolumes/{volume}", missing_ok=True)
