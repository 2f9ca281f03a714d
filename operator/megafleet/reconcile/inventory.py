"""Node inventory for placement, from raw Node and Pod JSON: free GPUs, taints, cordons.

Pure; called by :mod:`megafleet.reconcile.shards` (placement). GPUs count as taken on a pod's
bound node, else on the node its affinity pins it to (:func:`megafleet.fleet_state.pods.pinned_node`),
so GPUs promised to pods the scheduler has not bound yet are not handed out twice; and GPUs Kueue's
TAS assigned a group it admitted, whose pods it has not pinned yet, count on the nodes its Workload
names (:func:`assigned_gpus`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from megafleet import kueue, planner
from megafleet.api import v1alpha1
from megafleet.fleet_state import pods
from megafleet.objects import Object


def nodes(
    node_objects: list[Object],
    pod_objects: list[Object],
    *,
    resource: str,
    tolerations: list[v1alpha1.Toleration],
    assigned: Mapping[str, int] | None = None,
) -> list[planner.NodeInfo]:
    """What the planner knows of each node: its labels, GPUs offered and taken, whether the fleet's
    pods may go there (not cordoned, every hard taint tolerated). ``pod_objects``: live pods only;
    ``assigned``: GPUs per node Kueue assigned pods it has not pinned yet (:func:`assigned_gpus`)."""
    used = allocated_gpus(pod_objects, resource)
    for host, gpus in (assigned or {}).items():
        used[host] = used.get(host, 0) + gpus
    verdicts: dict[tuple[tuple[Any, Any, Any], ...], bool] = {}  # most nodes share their taints
    found = []
    for node in node_objects:
        spec = node.get("spec", {})
        name = node["metadata"]["name"]
        taints = spec.get("taints") or []
        kind = tuple((t.get("key"), t.get("value"), t.get("effect")) for t in taints)
        if kind not in verdicts:
            verdicts[kind] = tolerates(tolerations, taints)
        found.append(
            planner.NodeInfo(
                name=name,
                labels=node["metadata"].get("labels", {}),
                allocatable_gpus=int(str(node.get("status", {}).get("allocatable", {}).get(resource, "0"))),
                allocated_gpus=used.get(name, 0),
                schedulable=not spec.get("unschedulable", False) and verdicts[kind],
            )
        )
    return found


def allocated_gpus(pod_objects: list[Object], resource: str) -> dict[str, int]:
    """GPUs requested per node, by each pod's bound node, else its pinned node."""
    used: dict[str, int] = {}
    for pod in pod_objects:
        node = pod.get("spec", {}).get("nodeName") or pods.pinned_node(pod)
        if node:
            used[node] = used.get(node, 0) + requested_gpus(pod, resource)
    return used


def awaiting_groups(pod_objects: list[Object]) -> list[tuple[str, str]]:
    """The Kueue groups (namespace, name) Kueue admitted whose pods it has not all pinned to a node yet."""
    found = set()
    for pod in pod_objects:
        group = kueue.awaiting_node(pod)
        if group:
            found.add((pod["metadata"].get("namespace") or "default", group))
    return sorted(found)


def assigned_gpus(
    pod_objects: list[Object], workloads: Mapping[tuple[str, str], Object | None], resource: str
) -> dict[str, int]:
    """GPUs per node of the groups in ``workloads`` (:func:`awaiting_groups`, their Workloads) not yet
    on their pods: the pods Kueue's topology assignment puts on each node, less the group's pods
    already bound or pinned there (those count themselves), times a pod's GPUs."""
    used: dict[str, int] = {}
    for (namespace, group), workload in workloads.items():
        members = [
            pod
            for pod in pod_objects
            if (pod["metadata"].get("namespace") or "default") == namespace and kueue.group_of(pod) == group
        ]
        if not members:
            continue
        gpus = requested_gpus(members[0], resource)
        there = collections.Counter(pod.get("spec", {}).get("nodeName") or pods.pinned_node(pod) for pod in members)
        for node, count in kueue.assigned_pods(workload).items():
            missing = max(0, count - there[node])
            if missing and gpus:
                used[node] = used.get(node, 0) + missing * gpus
    return used


def requested_gpus(pod: Object, resource: str) -> int:
    """The ``resource`` requests of all the pod's containers."""
    total = 0
    for container in pod.get("spec", {}).get("containers", []):
        requests = container.get("resources", {}).get("requests", {}) or {}
        total += int(str(requests.get(resource, "0")))
    return total


def tolerates(tolerations: list[v1alpha1.Toleration], taints: list[Object]) -> bool:
    """Whether pods with ``tolerations`` may be scheduled onto a node with ``taints``, as the
    scheduler decides it (only NoSchedule and NoExecute taints keep pods away)."""
    for taint in taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_matches(toleration, taint) for toleration in tolerations):
            return False
    return True


def _matches(toleration: v1alpha1.Toleration, taint: Object) -> bool:
    """The core API's rule: an empty effect matches every effect, an empty key (``None`` or ``""``,
    with Exists) every taint; Equal compares values, an unset one as ``""``."""
    if toleration.effect is not None and toleration.effect != taint.get("effect"):
        return False
    if not toleration.key:
        return toleration.operator == "Exists"
    if toleration.key != taint.get("key"):
        return False
    return toleration.operator == "Exists" or (toleration.value or "") == (taint.get("value") or "")
