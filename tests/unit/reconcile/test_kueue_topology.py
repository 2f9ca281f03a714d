"""Kueue's Topology Aware Scheduling chooses the clique (``gang.placedBy: Kueue``): the operator
creates each shard's pods unpinned, as one pod set asking for one clique, and counts their GPUs once
Kueue pinned them (megafleet.reconcile.admission, megafleet.kueue, megafleet.reconcile.inventory)."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

from helpers import agent_fakes, kube_fakes
from megafleet import compute_domain, desired, kueue, planner, reconcile, settings
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.reconcile import cache, context, inventory

GPU = "nvidia.com/gpu"
CLIQUE = "nvidia.com/gpu.clique"
QUEUE = "team-a"
NO_CLIQUE = 'couldn\'t assign flavors to pod set shard: topology "nvlink" allows to fit only 1 out of 2 pod(s)'


class Agents(agent_fakes.Agents):
    async def close(self) -> None:
        pass


def manifest(*, tensor: int, nvlink: str = "Required", placed_by: str = "Kueue") -> dict[str, Any]:
    spec = {
        "model": {"source": "/models/m"},
        "parallelism": {"tensor": tensor},
        "resources": {"gpusPerNode": 8},
        "replicas": 2,
        "placement": {"nvlink": nvlink, "gang": {"scheduler": "Kueue", "queue": QUEUE, "placedBy": placed_by}},
    }
    metadata = {"name": "gen", "namespace": "rl", "uid": "uid-gen", "generation": 1}
    return {"apiVersion": "megafleet.dev/v1alpha1", "kind": "MegatronGeneration", "metadata": metadata, "spec": spec}


def node(name: str, clique: str | None = None) -> Object:
    labels = {"kubernetes.io/hostname": name, **({CLIQUE: clique} if clique else {})}
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {},
        "status": {"allocatable": {GPU: "8"}},
    }


class Cluster:
    """Fleets on 8-GPU nodes, reconciled on demand, their Events kept."""

    def __init__(self, *objects: Object) -> None:
        self.api = kube_fakes.Api(*objects)
        self.runtime = context.Runtime.of(self.api, Agents(), settings.OperatorSettings())
        self.events: list[tuple[str, str]] = []

    def reconcile(self, name: str = "gen") -> Object:
        async def once() -> Object:
            body = await self.api.get("MegatronGeneration", name, "rl") or {}
            await reconcile.reconcile(
                self.runtime, body, notify=lambda _, reason, text: self.events.append((reason, text))
            )
            return await self.api.get("MegatronGeneration", name, "rl") or {}

        return asyncio.run(once())

    def pods(self, fleet: str = "gen") -> list[Object]:
        return [
            obj
            for (kind, _, _), obj in sorted(self.api.objects.items())
            if kind == "Pod" and obj["metadata"].get("labels", {}).get("megafleet.dev/fleet") == fleet
        ]


def admitted(body: Object) -> Object:
    return next(c for c in body["status"]["conditions"] if c["type"] == "Admitted")


def test_a_shard_kueue_places_is_one_unpinned_pod_set_asking_for_one_clique() -> None:
    # No node carries a clique label: the operator's planner would refuse a TP=16 shard; Kueue decides.
    cluster = Cluster(manifest(tensor=16), *(node(f"n{i}") for i in range(2)))
    body = cluster.reconcile()
    pods = cluster.pods()
    assert len(pods) == 4, "two shards of two pods, created though no clique is known to the operator"
    for pod in pods:
        annotations = pod["metadata"]["annotations"]
        assert "affinity" not in pod["spec"], "no pin of the operator's"
        assert annotations[kueue.REQUIRED_TOPOLOGY] == CLIQUE
        assert annotations[kueue.ROLE_ANNOTATION] == kueue.ROLE_SHARD, "one pod set: Kueue fits the whole shard"
        assert annotations[kueue.POD_INDEX_LABEL_ANNOTATION] == "megafleet.dev/pod-index"
        assert annotations[kueue.GROUP_TOTAL_ANNOTATION] == "2"
    assert len({pod["metadata"]["labels"][kueue.GROUP_LABEL] for pod in pods}) == 2, "one group per shard"
    assert ("ShardsPlaced", f"shards 0, 1 handed to Kueue to place (podset-required-topology={CLIQUE})") in (
        cluster.events
    )
    assert not [reason for reason, _ in cluster.events if reason == "Unschedulable"]
    placed = next(c for c in body["status"]["conditions"] if c["type"] == "Placed")
    assert placed["status"] == "True", placed


@pytest.mark.parametrize(
    ("tensor", "nvlink", "asked"),
    [
        (16, "Required", {kueue.REQUIRED_TOPOLOGY: CLIQUE}),
        (16, "Preferred", {kueue.PREFERRED_TOPOLOGY: CLIQUE}),
        (8, "Required", {kueue.UNCONSTRAINED_TOPOLOGY: "true"}),  # one node's NVLink is enough
    ],
)
def test_the_topology_asked_follows_the_nvlink_span_and_policy(tensor: int, nvlink: str, asked: dict[str, str]) -> None:
    cluster = Cluster(manifest(tensor=tensor, nvlink=nvlink), node("n0", "c0"))
    cluster.reconcile()
    for pod in cluster.pods():
        annotations = pod["metadata"]["annotations"]
        assert {key: annotations[key] for key in asked} == asked
        others = {kueue.REQUIRED_TOPOLOGY, kueue.PREFERRED_TOPOLOGY, kueue.UNCONSTRAINED_TOPOLOGY} - set(asked)
        assert not others & set(annotations), "one topology annotation (Kueue refuses two)"


def test_a_shard_no_clique_holds_waits_with_kueues_topology_reason() -> None:
    cluster = Cluster(manifest(tensor=16), node("n0", "c0"), node("n1", "c1"))
    cluster.reconcile()
    group = ""
    for pod in cluster.pods():
        if pod["metadata"]["labels"]["megafleet.dev/shard"] == "0":
            pod["spec"]["schedulingGates"] = [{"name": kueue.ADMISSION_GATE}]
            group = pod["metadata"]["labels"][kueue.GROUP_LABEL]
    condition = {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": NO_CLIQUE}
    cluster.api.objects[("Workload", "rl", group)] = {
        "kind": "Workload",
        "metadata": {"name": group, "namespace": "rl"},
        "status": {"conditions": [condition]},
    }
    waiting = admitted(cluster.reconcile())
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitingForTopology")
    assert f"wait in LocalQueue {QUEUE}" in waiting["message"] and NO_CLIQUE in waiting["message"]
    last = cluster.runtime.observed[("rl", "gen")]
    assert not last.settled and not last.starting, "reconciled on a timer: Kueue's reason changes without pods"


def test_quota_and_topology_reasons_are_told_apart() -> None:
    assert kueue.short_of_topology(NO_CLIQUE)
    assert kueue.short_of_topology('topology "nvlink" doesn\'t allow to fit any of 4 pod(s)')
    assert not kueue.short_of_topology("insufficient unused quota for nvidia.com/gpu in flavor h200, 8 more needed")


def test_gpus_of_a_pod_kueue_pinned_count_on_its_node_and_no_other_fleet_plans_on_them() -> None:
    pinned = {
        "metadata": {"name": "tas-0", "namespace": "rl"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "n0"},
            "containers": [{"resources": {"requests": {GPU: "8"}}}],
        },
    }
    slim = cache.slim_pod(pinned)
    assert slim is not None and slim["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n0"}
    assert inventory.allocated_gpus([slim], GPU) == {"n0": 8}
    # An Operator-placed fleet on the same two nodes plans around the GPUs Kueue holds.
    other = manifest(tensor=8, placed_by="Operator")
    other["metadata"] = {**other["metadata"], "name": "other", "uid": "uid-other"}
    other["spec"]["replicas"] = 1
    cluster = Cluster(other, node("n0", "c0"), node("n1", "c1"), {"kind": "Pod", **pinned})
    cluster.reconcile("other")
    (pod,) = cluster.pods("other")
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]


def test_placed_by_kueue_needs_scheduler_kueue_and_changing_it_rolls_the_fleet() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"placedBy Kueue .* needs scheduler Kueue"):
        v1alpha1.GangSpec.model_validate({"placedBy": "Kueue"})
    assert v1alpha1.GangSpec.model_validate({"scheduler": "Kueue", "queue": "q"}).placed_by == "Operator"
    hashes = {
        placed_by: desired.template_hash(desired.ParsedFleet("gen", "rl", "uid-gen", 1, spec(placed_by)))
        for placed_by in ("Operator", "Kueue", None)
    }
    assert hashes["Operator"] != hashes["Kueue"], "the pods' pins and annotations change: the fleet rolls"
    assert hashes[None] == hashes["Operator"], "a fleet using Kueue before placedBy existed is not rolled"


def spec(placed_by: str | None) -> v1alpha1.MegatronGenerationSpec:
    raw = manifest(tensor=16, placed_by=placed_by or "")["spec"]
    if placed_by is None:
        del raw["placement"]["gang"]["placedBy"]
    return v1alpha1.MegatronGenerationSpec.model_validate(raw)


def test_needs_clique_matches_what_the_planner_requires() -> None:
    assert planner.needs_clique(planner.Parallelism(tensor=16), 8)
    assert not planner.needs_clique(planner.Parallelism(tensor=8), 8)


def test_a_shard_kueue_places_in_one_clique_gets_its_compute_domain_before_its_pods() -> None:
    cluster = Cluster(manifest(tensor=16), node("n0", "c0"))
    created: list[str] = []
    cluster.api.observers.append(
        lambda verb, kind, namespace, name, obj: created.append(kind) if verb == "create" else None
    )
    cluster.reconcile()
    made = [obj for (kind, _, _), obj in sorted(cluster.api.objects.items()) if kind == compute_domain.KIND]
    assert [domain["spec"]["numNodes"] for domain in made] == [2, 2], "a node per pod of a 16-GPU shard"
    assert created.index("Pod") > created.index(compute_domain.KIND) and created.count(compute_domain.KIND) == 2
    for pod in cluster.pods():
        assert pod["spec"]["resourceClaims"][0]["name"] == compute_domain.CLAIM_NAME


ADMITTED_NOT_PINNED = {
    "admission": {
        "podSetAssignments": [
            {
                "name": "shard",
                "count": 3,
                "topologyAssignment": {
                    "levels": ["kubernetes.io/hostname"],
                    "slices": [
                        {
                            "domainCount": 2,
                            "valuesPerLevel": [{"individual": {"prefix": "n", "roots": ["0", "1"]}}],
                            "podCounts": {"individual": [1, 1]},
                        },
                        {"domainCount": 1, "valuesPerLevel": [{"universal": "n2"}], "podCounts": {"universal": 1}},
                    ],
                },
            }
        ]
    }
}


def group_pod(name: str, gates: list[str], node_selector: dict[str, str] | None = None) -> Object:
    return {
        "metadata": {"name": name, "namespace": "rl", "labels": {kueue.GROUP_LABEL: "gen-0-abc"}},
        "spec": {
            "schedulingGates": [{"name": gate} for gate in gates],
            **({"nodeSelector": node_selector} if node_selector else {}),
            "containers": [{"resources": {"requests": {GPU: "8"}}}],
        },
    }


def test_topology_assignments_read_in_kueues_compressed_form() -> None:
    assert kueue.assigned_pods({"status": ADMITTED_NOT_PINNED}) == {"n0": 1, "n1": 1, "n2": 1}
    assert kueue.assigned_pods(None) == {}
    clique_only = {"admission": {"podSetAssignments": [{"topologyAssignment": {"levels": [CLIQUE], "slices": []}}]}}
    assert kueue.assigned_pods({"status": clique_only}) == {}, "no node named: nothing to count"


def test_gpus_kueue_assigned_before_it_pinned_the_pods_count_on_the_assigned_nodes_once() -> None:
    # Admitted (admission gate gone), one pod already pinned to n0, two still behind the topology gate.
    raw = [
        group_pod("gen-0-0", [], {"kubernetes.io/hostname": "n0"}),
        group_pod("gen-0-1", [kueue.TOPOLOGY_GATE]),
        group_pod("gen-0-2", [kueue.TOPOLOGY_GATE]),
    ]
    live = [slim for slim in (cache.slim_pod(pod) for pod in raw) if slim is not None]
    assert inventory.awaiting_groups(live) == [("rl", "gen-0-abc")]
    assigned = inventory.assigned_gpus(live, {("rl", "gen-0-abc"): {"status": ADMITTED_NOT_PINNED}}, GPU)
    assert assigned == {"n1": 8, "n2": 8}, "n0's pod counts itself"
    found = inventory.nodes([node(f"n{i}") for i in range(4)], live, resource=GPU, tolerations=[], assigned=assigned)
    assert {info.name: info.free_gpus for info in found} == {"n0": 0, "n1": 0, "n2": 0, "n3": 8}
    # Still waiting for quota (both gates on): no node is Kueue's yet.
    waiting = cache.slim_pod(group_pod("gen-1-0", [kueue.ADMISSION_GATE, kueue.TOPOLOGY_GATE]))
    assert waiting is not None and inventory.awaiting_groups([waiting]) == []


def test_an_operator_placed_fleet_plans_around_a_group_kueue_admitted_but_has_not_pinned() -> None:
    other = manifest(tensor=8, placed_by="Operator")
    other["metadata"] = {**other["metadata"], "name": "other", "uid": "uid-other"}
    other["spec"]["replicas"] = 1
    workload = {"kind": "Workload", "metadata": {"name": "gen-0-abc", "namespace": "rl"}, "status": ADMITTED_NOT_PINNED}
    gated = [{"kind": "Pod", **group_pod(f"gen-0-{i}", [kueue.TOPOLOGY_GATE])} for i in range(3)]
    cluster = Cluster(other, *(node(f"n{i}") for i in range(4)), workload, *gated)
    cluster.reconcile("other")
    (pod,) = cluster.pods("other")
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n3"], "n0-n2 are Kueue's"
