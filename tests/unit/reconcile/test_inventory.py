"""Node inventory for placement: taints against tolerations, pinned nodes (the pod view's), GPUs offered and taken."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet import planner
from megafleet.api import v1alpha1
from megafleet.fleet_state import pods as pod_view
from megafleet.reconcile import inventory

GPU = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}


def toleration(**fields: Any) -> v1alpha1.Toleration:
    return v1alpha1.Toleration(**fields)


@pytest.mark.parametrize(
    ("tolerations", "taints", "expected"),
    [
        ([], [], True),
        ([], [GPU_TAINT], False),
        ([toleration(key=GPU, operator="Exists", effect="NoSchedule")], [GPU_TAINT], True),
        ([toleration(key=GPU, operator="Exists")], [GPU_TAINT], True),
        ([toleration(key=GPU, operator="Equal", value="present")], [GPU_TAINT], True),
        ([toleration(key=GPU, operator="Equal", value="absent")], [GPU_TAINT], False),
        ([toleration(key=GPU, operator="Exists", effect="NoExecute")], [GPU_TAINT], False),
        ([toleration(key="other", operator="Exists")], [GPU_TAINT], False),
        ([toleration(operator="Exists")], [GPU_TAINT], True),
        ([toleration(key="", operator="Exists")], [GPU_TAINT, {"key": "evict", "effect": "NoExecute"}], True),
        ([toleration(key="bare", operator="Equal")], [{"key": "bare", "effect": "NoSchedule"}], True),
        ([], [{"key": "soft", "effect": "PreferNoSchedule"}], True),
        ([], [{"key": "evict", "effect": "NoExecute"}], False),
        ([toleration(key=GPU, operator="Exists")], [GPU_TAINT, {"key": "evict", "effect": "NoExecute"}], False),
    ],
    ids=[
        "no-taints",
        "untolerated",
        "exists-same-effect",
        "exists-any-effect",
        "equal-same-value",
        "equal-other-value",
        "other-effect",
        "other-key",
        "wildcard-exists",
        "empty-key-exists-tolerates-everything",
        "equal-without-value-matches-empty-value",
        "prefer-no-schedule-ignored",
        "no-execute-counts",
        "one-of-two-tolerated",
    ],
)
def test_tolerates_as_the_scheduler_does(
    tolerations: list[v1alpha1.Toleration], taints: list[dict[str, Any]], expected: bool
) -> None:
    assert inventory.tolerates(tolerations, taints) is expected


def affinity(key: str, operator: str, values: list[str]) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": key, "operator": operator, "values": values}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def by_name(values: list[str]) -> dict[str, Any]:
    term = {
        "matchFields": [{"key": "metadata.name", "operator": "In", "values": values}],
        "matchExpressions": [{"key": "clique", "operator": "In", "values": ["c0"]}],
    }
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, None),
        ({"affinity": None}, None),
        ({"affinity": affinity("kubernetes.io/hostname", "In", ["n1"])}, "n1"),
        ({"affinity": affinity("kubernetes.io/hostname", "In", ["n1", "n2"])}, None),
        ({"affinity": affinity("kubernetes.io/hostname", "NotIn", ["n1"])}, None),
        ({"affinity": affinity("clique", "In", ["c0"])}, None),
        ({"affinity": by_name(["n3"])}, "n3"),
        ({"affinity": by_name(["n3", "n4"])}, None),
    ],
    ids=["no-spec", "null-affinity", "one-node", "two-nodes", "not-in", "other-key", "by-name", "by-two-names"],
)
def test_pinned_node_only_for_a_one_node_hostname_affinity(spec: dict[str, Any], expected: str | None) -> None:
    assert pod_view.pinned_node({"spec": spec}) == expected


def pod(node: str | None = None, gpus: list[str] | None = None, pinned: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"resources": {"requests": {GPU: count}}} for count in gpus or []] or [{"resources": {}}]
    }
    if node:
        spec["nodeName"] = node
    if pinned:
        spec["affinity"] = affinity("kubernetes.io/hostname", "In", [pinned])
    return {"spec": spec}


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        ([], {}),
        ([pod(node="n1", gpus=["4"])], {"n1": 4}),
        ([pod(node="n1", gpus=["2", "2"]), pod(node="n1", gpus=["1"])], {"n1": 5}),
        ([pod(pinned="n2", gpus=["4"])], {"n2": 4}),
        ([pod(node="n1", pinned="n2", gpus=["4"])], {"n1": 4}),
        ([pod(gpus=["4"])], {}),
        ([pod(node="n1")], {"n1": 0}),
    ],
    ids=["none", "bound", "containers-and-pods-add-up", "pinned", "bound-wins", "nowhere", "cpu-pod"],
)
def test_allocated_gpus_by_bound_else_pinned_node(pods: list[dict[str, Any]], expected: dict[str, int]) -> None:
    assert inventory.allocated_gpus(pods, GPU) == expected


def node(name: str, gpus: str | None = "8", **spec: Any) -> dict[str, Any]:
    allocatable = {GPU: gpus} if gpus is not None else {}
    return {
        "metadata": {"name": name, "labels": {"clique": "c0"}},
        "spec": spec,
        "status": {"allocatable": allocatable},
    }


@pytest.mark.parametrize(
    ("nodes", "tolerations", "expected"),
    [
        ([node("n1")], [], [("n1", 8, 3, True)]),
        ([node("n1", gpus=None)], [], [("n1", 0, 3, True)]),
        ([node("n1", unschedulable=True)], [], [("n1", 8, 3, False)]),
        ([node("n1", taints=[GPU_TAINT])], [], [("n1", 8, 3, False)]),
        ([node("n1", taints=[GPU_TAINT])], [toleration(key=GPU, operator="Exists")], [("n1", 8, 3, True)]),
        ([node("n1"), node("n2")], [], [("n1", 8, 3, True), ("n2", 8, 0, True)]),
    ],
    ids=["plain", "no-gpus", "cordoned", "tainted", "tolerated", "two-nodes"],
)
def test_nodes_report_gpus_offered_taken_and_schedulability(
    nodes: list[dict[str, Any]], tolerations: list[v1alpha1.Toleration], expected: list[tuple[str, int, int, bool]]
) -> None:
    found = inventory.nodes(nodes, [pod(node="n1", gpus=["3"])], resource=GPU, tolerations=tolerations)
    assert [(n.name, n.allocatable_gpus, n.allocated_gpus, n.schedulable) for n in found] == expected
    assert all(n.labels == {"clique": "c0"} for n in found)


def test_an_empty_key_exists_toleration_lets_placement_use_tainted_nodes() -> None:
    """Kubernetes reads ``key: "", operator: Exists`` as "tolerate every taint": the planner
    must see such nodes as schedulable and place the shard there."""
    tainted = {
        "metadata": {"name": "n0", "labels": {}},
        "spec": {"taints": [{"key": "dedicated", "value": "rl", "effect": "NoSchedule"}]},
        "status": {"allocatable": {GPU: "8"}},
    }
    tolerate_all = [toleration(key="", operator="Exists")]
    parallelism = planner.Parallelism(tensor=8)
    request = planner.PlacementRequest(
        fleet="rl/gen",
        shard_indices=[0],
        layout=planner.pod_layout(parallelism, 8),
        nvlink_span=parallelism.nvlink_span,
        gpus_per_node=8,
    )

    plan = planner.plan_placement(request, inventory.nodes([tainted], [], resource=GPU, tolerations=tolerate_all))
    refused = planner.plan_placement(request, inventory.nodes([tainted], [], resource=GPU, tolerations=[]))

    assert [pod.node for pod in plan.placed[0].pods] == ["n0"]
    assert refused.placed == {}
