"""Smoke tests of the local control plane: real scheduler, controller-manager and KWOK nodes."""

from __future__ import annotations

import ipaddress
from typing import Any

from megafleet.objects import Object
from megafleet_dev import kube, nodes, toolchain

LOOPBACK = ipaddress.IPv4Network("127.0.0.0/8")
WAIT_SECONDS = 60


def gpu_pod(name: str, gpus: int, *, affinity: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "engine",
                "image": "megafleet/engine:test",
                "resources": {"limits": {nodes.GPU_RESOURCE: str(gpus)}, "requests": {nodes.GPU_RESOURCE: str(gpus)}},
            }
        ],
        "tolerations": [{"key": nodes.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if affinity is not None:
        spec["affinity"] = affinity
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def clique_affinity(clique: str) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": nodes.CLIQUE_LABEL, "operator": "In", "values": [clique]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def is_running(pod: Object | None) -> bool:
    return pod is not None and pod["status"].get("phase") == "Running" and bool(pod["status"].get("podIP"))


def test_version_is_stamped(kube_admin: kube.Kube) -> None:
    version = kube_admin.get("/version")
    assert version is not None
    assert version["gitVersion"] == toolchain.KUBERNETES_VERSION
    assert version["minor"] == toolchain.KUBERNETES_VERSION.split(".")[1]


def test_simulated_nodes_publish_gpus_and_cliques(kube_admin: kube.Kube) -> None:
    items = kube_admin.list("/api/v1/nodes", label_selector=f"{nodes.POOL_LABEL}=gb200")["items"]
    cliques: dict[str, int] = {}
    for node in items:
        labels = node["metadata"]["labels"]
        assert node["status"]["allocatable"][nodes.GPU_RESOURCE] == "4"
        assert labels[nodes.COUNT_LABEL] == "4"
        assert labels[nodes.PRODUCT_LABEL] == "NVIDIA-GB200"
        cluster_uuid, clique_id = labels[nodes.CLIQUE_LABEL].rsplit(".", 1)
        assert cluster_uuid and clique_id.isdigit()
        cliques[labels[nodes.CLIQUE_LABEL]] = cliques.get(labels[nodes.CLIQUE_LABEL], 0) + 1
        assert ipaddress.IPv4Network(node["spec"]["podCIDR"]).subnet_of(LOOPBACK)
        assert (kube.condition(node, "Ready") or {}).get("status") == "True"
    assert sorted(cliques.values()) == [18, 18]


def test_scheduler_places_gpu_pod_by_clique_affinity(kube_admin: kube.Kube, namespace: str) -> None:
    gb200 = kube_admin.list("/api/v1/nodes", label_selector=f"{nodes.POOL_LABEL}=gb200")["items"]
    target = sorted({node["metadata"]["labels"][nodes.CLIQUE_LABEL] for node in gb200})[1]
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube_admin.create(pods, gpu_pod("placed", 4, affinity=clique_affinity(target)))

    pod = kube_admin.wait(f"{pods}/placed", is_running, timeout=WAIT_SECONDS, what="pod placed to Running")

    assert pod is not None
    node = kube_admin.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    assert node is not None
    assert node["metadata"]["labels"][nodes.CLIQUE_LABEL] == target
    pod_ip = ipaddress.IPv4Address(pod["status"]["podIP"])
    assert pod_ip in LOOPBACK
    assert pod_ip in ipaddress.IPv4Network(node["spec"]["podCIDR"])


def test_pod_asking_more_gpus_than_any_node_stays_pending(kube_admin: kube.Kube, namespace: str) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube_admin.create(pods, gpu_pod("too-big", 9))

    def unschedulable(pod: Object | None) -> bool:
        return (kube.condition(pod, "PodScheduled") or {}).get("reason") == "Unschedulable"

    pod = kube_admin.wait(f"{pods}/too-big", unschedulable, timeout=WAIT_SECONDS, what="scheduler verdict")

    assert pod is not None
    scheduled = kube.condition(pod, "PodScheduled")
    assert scheduled is not None and scheduled["status"] == "False"
    assert f"Insufficient {nodes.GPU_RESOURCE}" in scheduled["message"]
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


def test_deleting_owner_garbage_collects_dependents(kube_admin: kube.Kube, namespace: str) -> None:
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    pods = f"/api/v1/namespaces/{namespace}/pods"
    owner = kube_admin.create(configmaps, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    dependent_cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "dependent", "ownerReferences": [reference]},
    }
    kube_admin.create(configmaps, dependent_cm)
    pod = gpu_pod("dependent", 1)
    pod["metadata"]["ownerReferences"] = [reference]
    kube_admin.create(pods, pod)
    kube_admin.wait(f"{pods}/dependent", is_running, timeout=WAIT_SECONDS)

    kube_admin.delete(f"{configmaps}/owner", propagation="Background")

    kube_admin.wait(f"{configmaps}/dependent", lambda obj: obj is None, timeout=WAIT_SECONDS, what="GC of ConfigMap")
    kube_admin.wait(f"{pods}/dependent", lambda obj: obj is None, timeout=WAIT_SECONDS, what="GC of Pod")


def test_namespace_with_running_pod_finishes_deleting(kube_admin: kube.Kube) -> None:
    name = "t-delete-me"
    kube_admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    kube_admin.wait(
        f"/api/v1/namespaces/{name}/serviceaccounts/default", lambda sa: sa is not None, timeout=WAIT_SECONDS
    )
    pods = f"/api/v1/namespaces/{name}/pods"
    kube_admin.create(pods, gpu_pod("worker", 2))
    kube_admin.wait(f"{pods}/worker", is_running, timeout=WAIT_SECONDS)

    kube_admin.delete(f"/api/v1/namespaces/{name}")

    kube_admin.wait(
        f"/api/v1/namespaces/{name}", lambda ns: ns is None, timeout=WAIT_SECONDS, what="namespace deletion"
    )
