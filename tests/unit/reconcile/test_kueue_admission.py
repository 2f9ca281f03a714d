"""Kueue's admission of whole shards (megafleet.reconcile.admission, megafleet.kueue) against an
in-memory API: the test plays Kueue's part (its gate, its Workload's condition, its stop of a group)."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, kueue, reconcile, settings
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.reconcile import admission, context

GPU = "nvidia.com/gpu"
QUEUE = "team-a"
SHORT = "couldn't assign flavors to pod set frontend: insufficient unused quota for nvidia.com/gpu in flavor h200"


class Agents(agent_fakes.Agents):
    """Every agent serves version 1; a drain succeeds at once."""

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def suspend(self, pod_ip: str, token: str, *, mode: str, timeout_seconds: float) -> None:
        pass

    async def close(self) -> None:
        pass


def kueue_fleet(replicas: int, pipeline: int = 1) -> dict[str, Any]:
    spec = {
        "model": {"source": "/models/m"},
        "parallelism": {"tensor": 8, "pipeline": pipeline},
        "resources": {"gpusPerNode": 8},
        "replicas": replicas,
        "placement": {"gang": {"scheduler": "Kueue", "queue": QUEUE}},
    }
    metadata = {"name": "gen", "namespace": "rl", "uid": "uid-gen", "generation": 1}
    return {"apiVersion": "megafleet.dev/v1alpha1", "kind": "MegatronGeneration", "metadata": metadata, "spec": spec}


class Fleet:
    """One fleet on four 8-GPU nodes, reconciled on demand, its Events kept."""

    def __init__(self, replicas: int, pipeline: int = 1) -> None:
        nodes = [
            {
                "kind": "Node",
                "metadata": {"name": f"n{i}", "labels": {}},
                "spec": {},
                "status": {"allocatable": {GPU: "8"}},
            }
            for i in range(4)
        ]
        self.api = kube_fakes.Api(kueue_fleet(replicas, pipeline), *nodes)
        self.runtime = context.Runtime.of(self.api, Agents(), settings.OperatorSettings())
        self.events: list[tuple[str, str]] = []

    def reconcile(self) -> dict[str, Any]:
        async def once() -> dict[str, Any]:
            body = await self.api.get("MegatronGeneration", "gen", "rl") or {}
            await reconcile.reconcile(
                self.runtime, body, notify=lambda _, reason, text: self.events.append((reason, text))
            )
            return await self.api.get("MegatronGeneration", "gen", "rl") or {}

        return asyncio.run(once())

    def pods(self, shard: int) -> list[Object]:
        return [
            obj
            for (kind, _, _), obj in sorted(self.api.objects.items())
            if kind == "Pod" and obj["metadata"]["labels"]["megafleet.dev/shard"] == str(shard)
        ]

    def run(self, shard: int) -> None:
        for index, pod in enumerate(self.pods(shard)):
            pod["spec"]["nodeName"] = f"n{shard * 2 + index}"
            pod["status"] = {"phase": "Running", "podIP": f"127.0.1.{shard * 10 + index}"}

    def gate(self, shard: int, message: str) -> None:
        """Kueue's webhook gated the shard's pods; its Workload has no quota reserved."""
        group = ""
        for pod in self.pods(shard):
            pod["spec"]["schedulingGates"] = [{"name": kueue.ADMISSION_GATE}]
            group = pod["metadata"]["labels"][kueue.GROUP_LABEL]
        condition = {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
        workload = {
            "kind": "Workload",
            "metadata": {"name": group, "namespace": "rl"},
            "status": {"conditions": [condition]},
        }
        self.api.objects[("Workload", "rl", group)] = workload

    def hold(self, shard: int) -> None:
        """Kueue's webhook put its finalizer on the shard's pods (as it does when they are created)."""
        for pod in self.pods(shard):
            pod["metadata"]["finalizers"] = [kueue.MANAGED_FINALIZER]

    def workload_deleted(self, group: str) -> bool:
        return any(key == ("Workload", "rl", group) for key, _ in self.api.memory.deleted)

    def evict(self, shard: int, *, delete: int) -> None:
        """Kueue stopped the shard's group: each pod marked, the first ``delete`` of them terminating."""
        for index, pod in enumerate(self.pods(shard)):
            stop = {"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvicted", "message": "Preempted"}
            pod["status"] = {**pod.get("status", {}), "conditions": [stop]}
            if index < delete:
                pod["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"

    def condition(self, body: Object) -> Object:
        return next(c for c in body["status"]["conditions"] if c["type"] == "Admitted")


def test_each_shard_is_one_pod_group_and_a_waiting_shard_is_named_with_the_queue_and_kueues_reason() -> None:
    fleet = Fleet(replicas=2, pipeline=2)
    fleet.reconcile()
    for shard in (0, 1):
        members = fleet.pods(shard)
        assert len(members) == 2
        labels = [pod["metadata"]["labels"] for pod in members]
        annotations = [pod["metadata"]["annotations"] for pod in members]
        assert {label[kueue.QUEUE_LABEL] for label in labels} == {QUEUE}
        assert len({label[kueue.GROUP_LABEL] for label in labels}) == 1, "one group per shard"
        assert [a[kueue.GROUP_TOTAL_ANNOTATION] for a in annotations] == ["2", "2"]
        assert [a[kueue.ROLE_ANNOTATION] for a in annotations] == [kueue.ROLE_FRONTEND, kueue.ROLE_RANKS]
        assert all(a[kueue.SERVING_ANNOTATION] == "true" for a in annotations)
    groups = {fleet.pods(shard)[0]["metadata"]["labels"][kueue.GROUP_LABEL] for shard in (0, 1)}
    assert len(groups) == 2

    fleet.run(0)
    fleet.gate(1, SHORT)
    body = fleet.reconcile()

    admitted = fleet.condition(body)
    assert (admitted["status"], admitted["reason"]) == ("False", "WaitingForQuota")
    assert f"shards 1 wait in LocalQueue {QUEUE}" in admitted["message"] and SHORT in admitted["message"]

    for pod in fleet.pods(1):  # Kueue admitted the group: every pod ungated at once
        pod["spec"].pop("schedulingGates")
    fleet.run(1)
    admitted = fleet.condition(fleet.reconcile())
    assert (admitted["status"], admitted["reason"]) == ("True", "AllShardsAdmitted")


def test_a_preempted_shard_is_removed_whole_reported_once_and_placed_again_as_a_new_group_without_a_restart() -> None:
    fleet = Fleet(replicas=2, pipeline=2)
    fleet.reconcile()
    fleet.run(0)
    fleet.run(1)
    fleet.reconcile()
    before = fleet.pods(0)[0]["metadata"]["labels"][kueue.GROUP_LABEL]

    fleet.hold(0)
    fleet.evict(0, delete=1)  # Kueue has deleted one pod of the group so far
    body = fleet.reconcile()

    assert [reason for reason, _ in fleet.events].count("ShardPreempted") == 1
    message = next(text for reason, text in fleet.events if reason == "ShardPreempted")
    assert "shard 0 was stopped by Kueue (WorkloadEvicted: Preempted)" in message and QUEUE in message
    remaining = [pod for pod in fleet.pods(0) if not pod["metadata"].get("deletionTimestamp")]
    assert remaining == [], "the operator deletes what Kueue has not: the shard goes whole"
    assert "ShardRestarting" not in [reason for reason, _ in fleet.events]
    assert fleet.pods(0), "Kueue's finalizer holds the deleted pod"

    fleet.reconcile()  # every pod of the group going: its Workload deleted, Kueue lets the group go
    assert fleet.workload_deleted(before)
    for pod in fleet.pods(0):  # Kueue's finalizer released, the pods gone
        del fleet.api.objects[("Pod", "rl", pod["metadata"]["name"])]
    body = fleet.reconcile()

    again = fleet.pods(0)
    assert len(again) == 2 and again[0]["metadata"]["labels"][kueue.GROUP_LABEL] != before
    assert [entry.get("restarts", 0) for entry in body["status"]["shards"]] == [0, 0]
    assert [reason for reason, _ in fleet.events].count("ShardPreempted") == 1


def test_a_shard_scaled_in_has_its_group_ended_so_its_quota_returns() -> None:
    fleet = Fleet(replicas=2, pipeline=2)
    fleet.reconcile()
    fleet.run(0)
    fleet.run(1)
    fleet.hold(1)
    fleet.reconcile()
    group = fleet.pods(1)[0]["metadata"]["labels"][kueue.GROUP_LABEL]
    fleet.api.objects[("MegatronGeneration", "rl", "gen")]["spec"]["replicas"] = 1
    for pod in fleet.pods(1):  # what the scale-in's deletion leaves: the pods held by Kueue's finalizer
        pod["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"
    fleet.reconcile()
    assert fleet.workload_deleted(group)
    assert not any(fleet.workload_deleted(pod["metadata"]["labels"][kueue.GROUP_LABEL]) for pod in fleet.pods(0))


def test_a_fleet_that_left_kueue_still_ends_the_groups_of_its_old_pods() -> None:
    fleet = Fleet(replicas=1, pipeline=2)
    fleet.reconcile()
    fleet.run(0)
    fleet.hold(0)
    group = fleet.pods(0)[0]["metadata"]["labels"][kueue.GROUP_LABEL]
    fleet.api.objects[("MegatronGeneration", "rl", "gen")]["spec"]["placement"] = {}
    for pod in fleet.pods(0):  # the roll deleted the old shard; Kueue's finalizer holds its pods
        pod["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"
    fleet.reconcile()
    assert fleet.workload_deleted(group)


def test_a_group_is_retired_once_every_pod_goes_and_kueue_still_holds_one() -> None:
    def pod(group: str, *, deleting: bool, held: bool = True) -> Object:
        metadata: Object = {"name": "p", "labels": {kueue.GROUP_LABEL: group}}
        if deleting:
            metadata["deletionTimestamp"] = "2026-12-06T12:00:00Z"
        if held:
            metadata["finalizers"] = [kueue.MANAGED_FINALIZER]
        return {"metadata": metadata}

    going = [pod("a", deleting=True), pod("a", deleting=True, held=False)]
    partly = [pod("b", deleting=True), pod("b", deleting=False)]
    released = [pod("c", deleting=True, held=False)]
    assert kueue.retired(going + partly + released + [{"metadata": {"name": "plain"}}]) == ["a"]


def test_the_pods_of_a_deleted_fleet_have_their_group_ended_when_they_were_the_fleets() -> None:
    owner = {"kind": "MegatronGeneration", "name": "gen", "uid": "uid-gen", "controller": True}
    labels = {"megafleet.dev/fleet": "gen", kueue.GROUP_LABEL: "gen-0-abc123"}
    metadata = {
        "name": "gen-s0-p0",
        "namespace": "rl",
        "labels": labels,
        "deletionTimestamp": "2026-12-06T12:00:00Z",
        "finalizers": [kueue.MANAGED_FINALIZER],
    }
    api = kube_fakes.Api()
    asyncio.run(admission.release_orphan(api, {"metadata": {**metadata, "ownerReferences": [owner]}}))
    assert [key for key, _ in api.memory.deleted] == [("Workload", "rl", "gen-0-abc123")]
    foreign = {**owner, "controller": False}
    asyncio.run(admission.release_orphan(api, {"metadata": {**metadata, "ownerReferences": [foreign]}}))
    assert len(api.memory.deleted) == 1, "a pod the fleet did not control is left alone"


def test_a_fleet_without_a_gang_scheduler_has_no_kueue_labels_nor_admitted_condition() -> None:
    fleet = Fleet(replicas=1)
    fleet.api.objects[("MegatronGeneration", "rl", "gen")]["spec"]["placement"] = {}
    body = fleet.reconcile()
    assert not any(key.startswith("kueue.x-k8s.io/") for key in fleet.pods(0)[0]["metadata"]["labels"])
    assert all(c["type"] != "Admitted" for c in body["status"]["conditions"])


def test_group_names_fit_a_label_value_and_differ_per_incarnation() -> None:
    long = "f" * 63
    name = kueue.group_name(long, 1234)
    assert len(name) <= kueue.GROUP_NAME_CHARACTERS and name.endswith(name[-6:]) and "-1234-" in name
    assert kueue.group_name("gen", 0, "abc123") == "gen-0-abc123"
    assert kueue.group_name("gen", 0) != kueue.group_name("gen", 0)


def test_waiting_reason_says_kueues_words_or_that_there_is_no_workload_yet() -> None:
    assert kueue.waiting_reason(None) == "Kueue has not made the group's Workload yet"
    workload = {"status": {"conditions": [{"type": "QuotaReserved", "status": "False", "message": SHORT}]}}
    assert kueue.waiting_reason(workload) == SHORT


@pytest.mark.parametrize("scheduler", ["KAI", "Volcano"])
def test_kai_and_volcano_are_refused_with_a_message_that_says_why(scheduler: str) -> None:
    with pytest.raises(pydantic.ValidationError, match="KAI and Volcano are not supported"):
        v1alpha1.GangSpec.model_validate({"scheduler": scheduler, "queue": "q"})


def test_kueue_needs_a_queue() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"queue .* is required with scheduler Kueue"):
        v1alpha1.GangSpec.model_validate({"scheduler": "Kueue"})
    assert v1alpha1.GangSpec.model_validate({"scheduler": "Kueue", "queue": "q"}).queue == "q"
