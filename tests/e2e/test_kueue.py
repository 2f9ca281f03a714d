"""Kueue admits whole shards, end to end against the real Kueue (docs/kueue.md): its controller
manager built from its pinned Go module, its pod webhook gating the operator's pods, its scheduler
admitting each shard's pod group against a ClusterQueue's quota.

One story on one ClusterQueue whose quota first holds one shard of the tiny CPU fleet (one pod per
shard: 1 CPU, 1 GiB):

1. a fleet of two shards: one shard is admitted and serves, the other waits, gated, with the fleet's
   ``Admitted`` condition False naming the LocalQueue and Kueue's reason (the quota);
2. the quota raised to two shards: the waiting shard is admitted, the fleet is Ready with both;
3. a fleet of a higher PriorityClass in the same queue: Kueue preempts one shard of the first
   fleet, which the operator reports (``ShardPreempted``), and the higher fleet is Ready;
4. the preempted shard is placed again as a new pod group, which waits for quota (no restart);
5. the higher fleet scaled in to no shard: its quota returns, the waiting shard is admitted and the
   first fleet is Ready with both shards again;
6. both fleets deleted: no pod is left terminating under Kueue's finalizer, no Workload is left.

Its own tier (marker ``kueue``; ``pytest -m kueue tests/e2e/test_kueue.py``): Kueue is built on first
use (docs/development.md gives the cold build time).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import refit_e2e as base
from megafleet.objects import Object
from megafleet_dev import cluster, kube, kueue

pytestmark = [pytest.mark.kueue, pytest.mark.timeout(600)]

WAIT = 180
LOW, HIGH = "low", "high"
QUEUE = "shards"


@pytest.fixture(scope="module")
def running_kueue(local_cluster: cluster.LocalCluster, operator: Path) -> Iterator[kueue.Kueue]:
    started = kueue.start(local_cluster)
    try:
        yield started
    finally:
        kueue.stop(local_cluster, started)


def cluster_queue(name: str, flavor: str, shards: int) -> Object:
    """A ClusterQueue whose quota holds ``shards`` shards of the tiny fleet; lower priorities are preempted."""
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": "cpu", "nominalQuota": str(shards)},
                                {"name": "memory", "nominalQuota": f"{shards}Gi"},
                            ],
                        }
                    ],
                }
            ],
        },
    }


def fleet(name: str, replicas: int, priority: str | None = None) -> Object:
    manifest: dict[str, Any] = base.tiny_fleet(replicas=replicas)
    manifest["metadata"]["name"] = name
    manifest["spec"]["placement"]["gang"] = {"scheduler": "Kueue", "queue": QUEUE}
    if priority is not None:
        manifest["spec"]["pod"] = {"priorityClassName": priority}
    return manifest


def admitted(obj: Object | None) -> Object:
    return kube.condition(obj or {}, "Admitted") or {}


def ready_shards(obj: Object | None) -> int:
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


def engine_pods(kube_admin: kube.Kube, namespace: str, name: str) -> list[Object]:
    found = kube_admin.list(f"/api/v1/namespaces/{namespace}/pods", label_selector=f"megafleet.dev/fleet={name}")
    return [pod for pod in found["items"] if not pod["metadata"].get("deletionTimestamp")]


def gated(pod: Object) -> bool:
    return any(gate.get("name") == "kueue.x-k8s.io/admission" for gate in pod["spec"].get("schedulingGates") or [])


def reasons(kube_admin: kube.Kube, events: str) -> list[tuple[str, str, str]]:
    """The namespace's Events, oldest first: what a failed assertion shows."""
    found = sorted(kube_admin.list(events)["items"], key=lambda event: event.get("lastTimestamp") or "")
    return [(event["involvedObject"]["name"], event["reason"], event.get("message", "")) for event in found]


def test_kueue_admits_whole_shards_preempts_readmits_and_returns_quota(
    running_kueue: kueue.Kueue, kube_admin: kube.Kube, namespace: str
) -> None:
    suffix = uuid.uuid4().hex[:6]
    flavor, queue_name, priority = f"flavor-{suffix}", f"cq-{suffix}", f"high-{suffix}"
    kube_admin.create(
        "/apis/scheduling.k8s.io/v1/priorityclasses",
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority}, "value": 1000},
    )
    kube_admin.create(
        f"{kueue.API}/resourceflavors",
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
    )
    kube_admin.create(f"{kueue.API}/clusterqueues", cluster_queue(queue_name, flavor, shards=1))
    kube_admin.create(
        f"{kueue.API}/namespaces/{namespace}/localqueues",
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": queue_name},
        },
    )
    low = f"{base.fleets(namespace)}/{LOW}"
    events = f"/api/v1/namespaces/{namespace}/events"
    try:
        # 1. One shard fits the quota: it serves; the other waits, gated, and the condition says why.
        kube_admin.create(base.fleets(namespace), fleet(LOW, replicas=2))
        waiting = kube_admin.wait(
            low,
            lambda o: ready_shards(o) == 1 and admitted(o).get("reason") == "WaitingForQuota",
            timeout=WAIT,
            what="one shard serving, the other waiting for quota",
        )
        assert waiting is not None
        message = admitted(waiting)["message"]
        assert f"LocalQueue {QUEUE}" in message and "quota" in message, message
        pods = engine_pods(kube_admin, namespace, LOW)
        assert len(pods) == 2
        held = [pod for pod in pods if gated(pod)]
        assert len(held) == 1 and not held[0]["spec"].get("nodeName"), "a waiting shard's pod is never bound"
        groups = {pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for pod in pods}
        assert len(groups) == 2, "each shard is its own pod group"

        # 2. The quota raised: the waiting shard is admitted whole and the fleet is Ready.
        kube_admin.patch(f"{kueue.API}/clusterqueues/{queue_name}", cluster_queue(queue_name, flavor, shards=2))
        both = kube_admin.wait(
            low,
            lambda o: base.ready(o) and ready_shards(o) == 2 and admitted(o).get("status") == "True",
            timeout=WAIT,
            what="both shards admitted and Ready",
        )
        assert both is not None

        # 3. A higher priority fleet in the same queue: Kueue preempts one shard of the first, which
        # is reported.
        kube_admin.create(base.fleets(namespace), fleet(HIGH, replicas=1, priority=priority))
        preempted = kube_admin.wait_items(
            events, bool, field_selector="reason=ShardPreempted", timeout=WAIT, what="a ShardPreempted Event"
        )
        assert "stopped by Kueue" in preempted[0]["message"] and preempted[0]["involvedObject"]["name"] == LOW
        high = f"{base.fleets(namespace)}/{HIGH}"
        assert kube_admin.wait(high, base.ready, timeout=WAIT, what="the higher priority fleet Ready")

        # 4. The preempted shard is placed again as a new group, which waits in the queue.
        kube_admin.wait(
            low,
            lambda o: ready_shards(o) == 1 and admitted(o).get("reason") == "WaitingForQuota",
            timeout=WAIT,
            what="the preempted shard waiting for quota again",
        )
        pods = engine_pods(kube_admin, namespace, LOW)
        regrouped = {pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for pod in pods if gated(pod)}
        assert len(pods) == 2 and len(regrouped) == 1 and not regrouped & groups, "a new group, gated"

        # 5. The higher fleet scaled in: its quota returns and the waiting shard is admitted.
        kube_admin.patch(high, {"spec": {"replicas": 0}})
        healed = kube_admin.wait(
            low,
            lambda o: base.ready(o) and ready_shards(o) == 2 and admitted(o).get("status") == "True",
            timeout=WAIT,
            what="the preempted shard admitted again and Ready",
        )
        assert healed is not None
        restarts = [entry.get("restarts", 0) for entry in healed["status"]["shards"]]
        assert restarts == [0, 0], (healed["status"]["shards"], reasons(kube_admin, events))

        # 6. Both fleets deleted: Kueue's finalizer held no pod back, no Workload is left.
        for name in (LOW, HIGH):
            kube_admin.delete(f"{base.fleets(namespace)}/{name}")
        for collection in (f"/api/v1/namespaces/{namespace}/pods", f"{kueue.API}/namespaces/{namespace}/workloads"):
            kube_admin.wait_items(collection, lambda items: not items, timeout=WAIT, what=f"{collection} empty")
    finally:
        for name in (LOW, HIGH):
            kube_admin.delete(f"{base.fleets(namespace)}/{name}", missing_ok=True)
        kube_admin.delete(f"{kueue.API}/clusterqueues/{queue_name}", missing_ok=True)
        kube_admin.delete(f"{kueue.API}/resourceflavors/{flavor}", missing_ok=True)
        kube_admin.delete(f"/apis/scheduling.k8s.io/v1/priorityclasses/{priority}", missing_ok=True)
